//! Miner rules for the attention probe: sparse (top-k) attention, attention sinks, and the
//! padding-leak health check.

use std::collections::BTreeMap;

use crate::mine::{weighted_vector, Kind, Rule, RuleRegistration, Series, SeriesKey, StepStats, Verdict, HEALTH};

use super::probe::stats;
use super::PROBS;

/// Top-k attention keeps >= 90% of the probability mass with k <= keys/4, averaged over heads.
///
/// Both lines are opscope's. Dropping mass `m` and renormalizing moves a query's output
/// `sum_j p_j v_j` by at most `2 m max_j |v_j|`, so 90% kept bounds the change by a fifth of
/// the largest value row; the `sparseattn` actuation measures the real change on the model.
/// `k <= keys/4` asks for at least a 4x cut of the softmax and `P @ V` work, enough to pay for
/// a sparse kernel's gather.
pub const SPARSE_ATTENTION: Kind = Kind {
    name: "sparse_attention",
    doc: "top-k attention keeps >= 90% of the probability mass with k <= keys/4, averaged over heads: sparse / top-k attention (Gupta et al., Memory-efficient Transformers via Top-k Attention, 2021); 90% is opscope's line",
};

/// A head gives one key (the first, or the last non-padding one) >= 5x the uniform share and
/// >= 0.2 of its mass. The uniform share is per query (1 / the keys its mask allows), from the
/// probe's `sink_first_lift` / `sink_last_lift`.
///
/// Both lines are opscope's, and both are needed: the mass line alone would call every key of a
/// sequence of 5 or fewer a sink (its uniform share is >= 0.2), the lift line alone a key with
/// 5/1000 of the mass of a 1000-key sequence. 0.2 is a share whose eviction (StreamingLLM's
/// failure case) visibly changes the head's output.
pub const ATTENTION_SINK: Kind = Kind {
    name: "attention_sink",
    doc: "a head gives one key (the first, or the last non-padding one) >= 5x the uniform share and >= 0.2 of its mass: an attention sink that KV eviction and windowed attention must keep (Xiao et al., StreamingLLM, 2024; Clark et al. 2019 on BERT's [CLS]/[SEP]); 5x and 0.2 are opscope's lines",
};

/// The sink rule's mass line: a head gives the key at least this share of its probability.
pub const SINK_MASS: f64 = 0.2;
/// The sink rule's lift line: at least this many times the uniform share (per query, 1 / the
/// keys it may attend to).
pub const SINK_LIFT: f64 = 5.0;

struct AttnRules;

impl Rule for AttnRules {
    fn name(&self) -> &'static str {
        "attn"
    }

    fn mine(&self, series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
        for (key, s) in series.iter().filter(|(k, _)| k.1 == PROBS.as_str()) {
            let q = |r: &StepStats| r.scalar(stats::QUERIES).unwrap_or(0.0);
            // Mean non-padding keys per sequence, over runs (weighted by queries).
            let (kw, kn) = s.runs.iter().fold((0.0, 0.0), |(a, n), r| match r.scalar(stats::KEYS) {
                Some(k) => (a + q(r) * k, n + q(r)),
                None => (a, n),
            });
            let valid_keys = if kn > 0.0 { (kw / kn).max(1.0) } else { continue };
            let topk = s.runs.iter().find_map(|r| r.scalar(stats::TOPK));
            let mass = weighted_vector(s, stats::TOPK_MASS, q);
            if let (Some(k), false) = (topk, mass.is_empty()) {
                let mean = mass.iter().sum::<f64>() / mass.len() as f64;
                let worst = mass.iter().copied().fold(f64::INFINITY, f64::min);
                if mean >= 0.9 && k * 4.0 <= valid_keys {
                    out.push(Verdict::new(
                        key,
                        SPARSE_ATTENTION,
                        vec![("topk", k), ("topk_mass_mean", mean), ("topk_mass_worst_head", worst), ("keys_per_sequence", valid_keys)],
                        "top-k keeps >= 90% of the attention mass (mean over heads) with k <= keys/4",
                        "Gupta et al., Memory-efficient Transformers via Top-k Attention (2021); 90%: opscope's line",
                    ));
                }
            }
            // The uniform share a head's sink mass is set against: per query, 1 / (keys it may
            // attend to), recorded as the lift (sink mass x allowed keys). Recordings made before
            // the lift existed fall back to 1 / (keys per sequence), which is right only for a
            // bidirectional mask (under a causal one it takes uniform attention over a short
            // prefix for a sink).
            for (stat, lift_stat, evidence) in
                [(stats::SINK_FIRST, stats::SINK_FIRST_LIFT, "sink_first_max"), (stats::SINK_LAST, stats::SINK_LAST_LIFT, "sink_last_max")]
            {
                let v = weighted_vector(s, stat, q);
                let lift = weighted_vector(s, lift_stat, q);
                let lift_of = |h: usize| -> f64 {
                    if lift.len() == v.len() {
                        lift[h]
                    } else {
                        v[h] * valid_keys
                    }
                };
                let sink = |h: usize| v[h] >= SINK_MASS && lift_of(h) >= SINK_LIFT;
                let heads: Vec<usize> = (0..v.len()).filter(|&h| sink(h)).collect();
                let Some(&h) = heads.iter().max_by(|&&a, &&b| v[a].total_cmp(&v[b])) else { continue };
                out.push(Verdict::new(
                    key,
                    ATTENTION_SINK,
                    vec![
                        (evidence, v[h]),
                        ("head", h as f64),
                        ("sink_heads", heads.len() as f64),
                        ("lift", lift_of(h)),
                        ("uniform_share", v[h] / lift_of(h)),
                        ("lift_recorded", if lift.len() == v.len() { 1.0 } else { 0.0 }),
                    ],
                    "a head gives one key (first, or last non-padding) >= 0.2 of its mass and >= 5x the uniform share of the queries that see it",
                    "Xiao et al., StreamingLLM (2024); Clark et al., What Does BERT Look At? (2019); 0.2 and 5x: opscope's lines",
                ));
            }
            let pad = weighted_vector(s, stats::PAD_MASS, q);
            let pad_max = pad.iter().copied().fold(0.0, f64::max);
            if pad_max > 1e-3 {
                out.push(Verdict::new(
                    key,
                    HEALTH,
                    vec![("pad_mass_max_head", pad_max)],
                    "attention mass on padding keys > 1e-3: the mask leaks",
                    "health check",
                ));
            }
        }
    }
}

inventory::submit! { RuleRegistration(&AttnRules) }

/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
