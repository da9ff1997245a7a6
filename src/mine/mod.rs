//! The miner: from a recording to per-site verdicts with evidence, each rule's threshold and
//! its source, and an estimated payoff weighted by the site's share of the recorded FLOPs, or of
//! the measured time when time shares are given ([`mine_with`]).
//!
//! Metrics are computed per run (step) from the sketches and summarized by their median over
//! runs ([`median`]: for an even count the upper of the two middle values, a value some run
//! had; `opscope diff` reports numpy's median, the mean of the two); across-run verdicts need at least [`MIN_STEPS`] runs. Conventions: `P = sumsq / count`
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
pub mod probe;
mod series;
mod tensor;
mod time;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Serialize, Serializer};

pub use calibrate::{
    calibrate, calibrate_all, quant_params, CalibrationError, CalibrationNote, CalibrationMethod, CalibrationOptions, CalibrationTable, QuantParams, RangeAveraging,
    TensorCalibration,
};
pub use hist::{histograms_by_run, merged_histogram, merged_histograms, MergedHistogram, RunHistograms};
pub use series::{
    fingerprints, load, load_compact, load_sampled, no_data, repeat_rate, sidecar_note, row_layout, run_priority, series_from_rows, weighted_vector, ChanSummary, RepeatRate, RowSummary, Series,
    SeriesKey, StepStats,
};
pub use time::{PayoffBasis, TimeShares, TimeSharesError, SUM_TOLERANCE};
pub use tensor::{int8_estimate, kinds, outlier_channels, payoff_fraction, sqnr8_per_token, Int8Estimate, LOW_RANK_CV, LOW_RANK_NULL_MARGIN, OUTLIER_CHANNEL_RATIO};

/// Runs needed before across-run verdicts (stationary, drifting, scale drift, exact repeat) are
/// made. opscope's floor: the trends are least-squares lines over the runs, whose slope's t
/// statistic has n - 2 degrees of freedom, so 3 runs would leave it one and 4 leave two; more
/// runs give firmer verdicts. `tests/mine_nulls.rs` mines nulls of 4 runs each (Laplace,
/// Student-t 5, a bimodal mix, ReLU at half density) and checks they draw no trend verdict.
pub const MIN_STEPS: usize = 4;

/// Runs per series and tensor shape that `opscope mine` reads by default ([`load_sampled`]):
/// a series with more is mined from a uniform sample of this many, so mining memory is bounded
/// whatever the run count (about 1 KB per series per kept run). 1000 is TensorBoard's default
/// for scalars (`DEFAULT_TENSOR_SIZE_GUIDANCE`, reservoir-sampled per tag; `--samples_per_plugin`
/// overrides it): a recording of up to 1000 runs per shape is mined from every run.
pub const DEFAULT_MAX_RUNS: usize = 1000;


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
///
/// 1e-3 is opscope's line: a correct mask leaves padding keys about 1e-39 of the mass in RLX
/// (exp of a -1e9 or `finfo.min` bias: subnormal or zero), so any mass a model's output would
/// feel is a masking fault (RLX 0.2.19 soft-capping after
/// the mask gives tenths; `tests/attn_reference.rs`).
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
    /// What each verdict kind of the rule reads: the statistics and the runs it needs, and
    /// which series it applies to. [`cannot_run`] reports the kinds whose needs a recording does
    /// not meet. Default: none declared.
    fn needs(&self) -> &'static [Need] {
        &[]
    }
}

/// What one verdict kind needs from a series to be decided at all.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    /// The verdict kind.
    pub kind: Kind,
    /// Statistics that must be recorded in at least one run (all of them).
    pub stats: &'static [crate::sketch::Stat],
    /// Runs needed (1 for a per-run rule, [`MIN_STEPS`] for the across-run rules).
    pub runs: usize,
}

/// A verdict kind that could not be decided on some series: what was missing.
#[derive(Debug, Clone, Serialize)]
pub struct CannotRun {
    /// The verdict kind.
    pub kind: Kind,
    /// Statistics the recording lacks (names), empty when only runs are missing.
    pub missing: Vec<&'static str>,
    /// Runs needed, when the series have fewer (0 when runs are not the problem).
    pub runs_needed: usize,
    /// Number of (site, role, pass) series the kind could not be decided on.
    pub series: usize,
}

/// The verdict kinds that could not be decided on some of `series` (the rules' [`Rule::needs`]
/// against what was recorded), by kind name: a recording made with `stats=[min,max]` cannot show
/// channel outliers, and says so instead of reading "no verdict". Only series holding tensor
/// sketches (`count`) are checked against the tensor rules' needs; a series recorded once per
/// compile (a memoized weight) is not counted as short of runs when other series have enough.
pub fn cannot_run(series: &BTreeMap<SeriesKey, Series>) -> Vec<CannotRun> {
    let mut out: BTreeMap<(&'static str, Vec<&'static str>, usize), (Kind, usize)> = BTreeMap::new();
    let tensors: Vec<&Series> = series.values().filter(|s| s.runs.iter().any(|r| r.has(crate::sketch::tensor::COUNT))).collect();
    let most_runs = tensors.iter().map(|s| s.runs.len()).max().unwrap_or(0);
    // A tensor recorded once per compile while others ran many times is a constant (a weight,
    // memoized): across-run rules do not apply to it.
    let constant = |s: &Series| s.runs.windows(2).all(|w| w[0].compile != w[1].compile);
    for r in rules() {
        for need in r.needs() {
            for s in &tensors {
                let missing: Vec<&'static str> =
                    need.stats.iter().filter(|st| !s.runs.iter().any(|r| r.has(**st))).map(|st| st.as_str()).collect();
                let short = s.runs.len() < need.runs && !(need.runs > 1 && most_runs >= need.runs && constant(s));
                let runs_needed = if short { need.runs } else { 0 };
                if missing.is_empty() && runs_needed == 0 {
                    continue;
                }
                out.entry((need.kind.name, missing, runs_needed)).or_insert((need.kind, 0)).1 += 1;
            }
        }
    }
    out.into_iter()
        .map(|((_, missing, runs_needed), (kind, n))| CannotRun { kind, missing, runs_needed, series: n })
        .collect()
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
    /// Share of the site's cost (0..1; see [`Verdict::basis`]) times the fraction of the site's
    /// cost the kernel could remove (an estimate, stated per kind in [`payoff_fraction`]).
    pub payoff: f64,
    /// What the site's share in [`Verdict::payoff`] is: `None` (not serialized) when the verdicts
    /// were mined without time shares ([`mine`]): the share of the FLOPs its pass recorded (per
    /// pass, so a second tap such as `capture` does not dilute it);
    /// `Some(Time)` the share of the measured time, `Some(Flops)` the FLOP share of a site the
    /// time shares do not list ([`mine_with`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub basis: Option<PayoffBasis>,
    /// The fraction of the site's cost the kernel could remove ([`payoff_fraction`], which
    /// states each kind's weight; 0 for warnings and probes): `payoff = share x fraction`. Not
    /// serialized.
    #[serde(skip)]
    pub fraction: f64,
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
            basis: None,
            fraction: 0.0,
        }
    }
}

/// Mine every series with every registered rule: the verdicts, sorted by payoff (highest
/// first), then site.
pub fn mine(series: &BTreeMap<SeriesKey, Series>) -> Vec<Verdict> {
    mine_with(series, None)
}

/// [`mine`], the payoff weighted by measured time shares when `time` is given: a verdict on a
/// site `time` lists gets `payoff = time share x fraction` and basis [`PayoffBasis::Time`]; a
/// verdict on a site it does not list keeps its FLOP-share payoff with basis
/// [`PayoffBasis::Flops`] (never 0 for want of a time; [`untimed_sites`] lists those sites).
/// With `time` `None` the verdicts are [`mine`]'s, basis `None`. Sorted by payoff, then site.
pub fn mine_with(series: &BTreeMap<SeriesKey, Series>, time: Option<&TimeShares>) -> Vec<Verdict> {
    let mut out = Vec::new();
    for r in rules() {
        r.mine(series, &mut out);
    }
    if let Some(t) = time {
        for v in &mut out {
            match t.get(&v.site) {
                Some(share) => {
                    v.payoff = share * v.fraction;
                    v.basis = Some(PayoffBasis::Time);
                }
                None => v.basis = Some(PayoffBasis::Flops),
            }
        }
    }
    out.sort_by(|a, b| b.payoff.total_cmp(&a.payoff).then(a.site.cmp(&b.site)));
    out
}

/// Sites of `series` holding tensor sketches that `time` does not list (their payoffs fall back
/// to FLOP shares in [`mine_with`]), sorted.
pub fn untimed_sites(series: &BTreeMap<SeriesKey, Series>, time: &TimeShares) -> Vec<String> {
    let mut v: Vec<String> = series
        .iter()
        .filter(|(_, s)| s.runs.iter().any(|r| r.has(crate::sketch::tensor::COUNT)))
        .map(|(k, _)| k.0.clone())
        .filter(|site| time.get(site).is_none())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The median of the finite values, `None` if there are none: for an even count the upper of
/// the two middle values (`v[n/2]` of the sorted values), so a verdict's evidence is a value
/// some run had (numpy's median would average the two).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}
