//! The miner: from a recording to per-site verdicts with evidence, each rule's threshold and
//! its source, and an estimated payoff weighted by the site's share of the recorded FLOPs.
//!
//! Metrics are computed per run (step) from the sketches and summarized by their median over
//! runs; across-run verdicts need at least [`MIN_STEPS`] runs. Conventions: `P = sumsq / count`
//! (mean square), `absmax = max(|min|, |max|)`, SQNR estimates use the uniform quantizer noise
//! model `Δ²/12` (Widrow & Kollár, *Quantization Noise*, 2008) with symmetric scales
//! `Δ = absmax / (2^(b-1) - 1)` (127 for int8, 7 for int4).

//!
//! Calibration ([`mod@calibrate`]) turns the same series into quantization ranges, scales and zero
//! points (min-max, percentile, entropy), and writes them as ONNX Runtime and TensorRT read them.
//!
//! Rules are registered with `inventory::submit! { RuleRegistration(&MyRule) }`: the tensor
//! rules below live here, each probe pass keeps its rules next to its kernel (`passes/attn`,
//! `passes/route`, `passes/residual`). A rule reads the series it knows and pushes verdicts.

pub mod calibrate;
mod hist;
mod series;
mod tensor;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Serialize, Serializer};

pub use calibrate::{
    calibrate, calibrate_all, quant_params, CalibrationError, CalibrationNote, CalibrationMethod, CalibrationOptions, CalibrationTable, QuantParams,
    TensorCalibration,
};
pub use hist::{merged_histogram, MergedHistogram};
pub use series::{load, no_data, series_from_rows, weighted_vector, Series, SeriesKey, StepStats};
pub use tensor::{kinds, payoff_fraction};

/// Runs needed before across-run verdicts (stationary, drifting, exact repeat) are made.
pub const MIN_STEPS: usize = 4;


/// What sketches cannot see, said once per report.
pub const NOT_OBSERVABLE: &str = "low rank is not observable from these sketches (a LowRankProbe verdict is a suspicion from row energies); \
a randomized range finder (Halko, Martinsson, Tropp 2011) on sampled activations would confirm it. \
2:4 structure likewise needs a per-group-of-4 non-zero count.";

/// A kind of verdict: its name (the `kind` of `opscope mine --json`) and what it means, with
/// the rule's threshold and source. Declared as a `const` by the rule that makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kind {
    /// Name (`sparse_gemm`).
    pub name: &'static str,
    /// What the verdict means, the threshold and its source.
    pub doc: &'static str,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl Serialize for Kind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name)
    }
}

/// The health verdict: NaN or Inf values, or attention mass leaking to padding keys
/// (pad_mass > 1e-3). Shared by the tensor rules and the attention probe's rules.
pub const HEALTH: Kind = Kind {
    name: "health",
    doc: "NaN or Inf values, or attention mass leaking to padding keys (pad_mass > 1e-3)",
};

/// A mining rule: reads the series it knows and pushes verdicts.
pub trait Rule: Sync {
    /// Name, for listings.
    fn name(&self) -> &'static str;
    /// Push the verdicts `series` supports (payoff may be left 0; see [`Verdict::payoff`]).
    fn mine(&self, series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>);
}

/// An entry in the rule registry.
pub struct RuleRegistration(pub &'static dyn Rule);

inventory::collect!(RuleRegistration);

/// Every registered rule, sorted by name.
pub fn rules() -> Vec<&'static dyn Rule> {
    let mut v: Vec<&'static dyn Rule> = std::iter::once(tensor::RULES)
        .chain(inventory::iter::<RuleRegistration>.into_iter().map(|r| r.0))
        .collect();
    v.sort_by_key(|r| r.name());
    v
}

/// One verdict at one site.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Site name.
    pub site: String,
    /// Role of the tensor.
    pub role: String,
    /// Pass index.
    pub pass_idx: u32,
    /// What the data justifies.
    pub kind: Kind,
    /// The numbers the rule read.
    pub evidence: Vec<(String, f64)>,
    /// The rule, with its threshold.
    pub rule: &'static str,
    /// Where the threshold comes from.
    pub source: &'static str,
    /// Share of the recorded FLOPs at this site (0..1) times the fraction of the site's cost
    /// the kernel could remove (an estimate, stated per kind in [`payoff_fraction`]).
    pub payoff: f64,
}

impl Verdict {
    /// A verdict on the series `key` with payoff 0.
    pub fn new(key: &SeriesKey, kind: Kind, evidence: Vec<(&str, f64)>, rule: &'static str, source: &'static str) -> Verdict {
        Verdict {
            site: key.0.clone(),
            role: key.1.clone(),
            pass_idx: key.2,
            kind,
            evidence: evidence.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            rule,
            source,
            payoff: 0.0,
        }
    }
}

/// Mine every series with every registered rule: the verdicts, sorted by payoff (highest
/// first), then site.
pub fn mine(series: &BTreeMap<SeriesKey, Series>) -> Vec<Verdict> {
    let mut out = Vec::new();
    for r in rules() {
        r.mine(series, &mut out);
    }
    out.sort_by(|a, b| b.payoff.total_cmp(&a.payoff).then(a.site.cmp(&b.site)));
    out
}

/// The median of the finite values, `None` if there are none.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}
