//! Miner rules for the residual probe: the layer-skip probe (ShortGPT's block influence) and
//! massive activations in the residual stream (Sun et al. 2024).

use std::collections::BTreeMap;

use crate::mine::{median, Kind, Rule, RuleRegistration, Series, SeriesKey, Verdict};

use super::probe::stats;
use super::BLOCK;

/// A residual block's influence 1 - cos(x, x + f(x)) is <= half the median block's, among at
/// least 3 recorded blocks.
///
/// ShortGPT ranks blocks by this influence and removes the lowest; it sets no line. "Half the
/// median" and "3 blocks" are opscope's: a block well below its peers, among enough peers for a
/// median to mean something. A probe, not a verdict: the `skip` actuation measures what
/// removing the block does to the model's outputs.
pub const LAYER_SKIP_PROBE: Kind = Kind {
    name: "layer_skip_probe",
    doc: "a residual block's influence 1 - cos(x, x + f(x)) is <= half the median block's: a layer skip candidate (Men et al., ShortGPT, 2024, removes the lowest-influence layers). A probe: confirm with the skip actuation (on MiniLM-L3 the ranks did not agree, see README)",
};

/// A residual block's output holds an entry with |h| > 100 and > 1000x the median |h|.
pub const MASSIVE_ACTIVATION: Kind = Kind {
    name: "massive_activation",
    doc: "a residual block's output holds an entry with |h| > 100 and > 1000x the median |h| (Sun et al., Massive Activations in Large Language Models, 2024, define them so): a few fixed channels at a few tokens (often the first) act as biases; per-tensor int8 of the stream or of the next norm's input loses every other value to them, and removing them breaks the model. Keep those channels out of the quantized range (LLM.int8's mixed precision) or scale them away (SmoothQuant)",
};

/// [`MASSIVE_ACTIVATION`]'s magnitude line (Sun et al. 2024).
pub const MASSIVE_ABS: f64 = 100.0;
/// [`MASSIVE_ACTIVATION`]'s ratio to the median |h| (Sun et al. 2024: "roughly 1,000 times").
pub const MASSIVE_RATIO: f64 = 1000.0;

/// The largest `out_top` entry over the runs of `s` and its run's median |h|:
/// `(value, row, channel, median)`.
fn largest(s: &Series) -> Option<(f64, f64, f64, f64)> {
    let mut best: Option<(f64, f64, f64, f64)> = None;
    for r in &s.runs {
        let (Some(top), Some(med)) = (r.vector(stats::OUT_TOP), r.scalar(stats::OUT_MEDIAN_ABS)) else { continue };
        if let [v, row, ch, ..] = top[..] {
            let (v, row, ch) = (v as f64, row as f64, ch as f64);
            if v.is_finite() && best.is_none_or(|b| v.abs() > b.0.abs()) {
                best = Some((v, row, ch, med));
            }
        }
    }
    best
}

struct ResidualRules;

impl Rule for ResidualRules {
    fn name(&self) -> &'static str {
        "residual"
    }

    fn mine(&self, series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
        let mut blocks: Vec<(&SeriesKey, f64)> = Vec::new();
        for (key, s) in series.iter().filter(|(k, _)| k.1 == BLOCK.as_str()) {
            // Mean over runs weighted by each run's (non-padding) rows.
            let (mut sum, mut w) = (0.0, 0.0);
            for r in &s.runs {
                if let (Some(c), Some(n)) = (r.scalar(stats::COS), r.scalar(stats::ROWS)) {
                    sum += n * c;
                    w += n;
                }
            }
            if w > 0.0 {
                blocks.push((key, 1.0 - sum / w));
            }
        }
        for (key, s) in series.iter().filter(|(k, _)| k.1 == BLOCK.as_str()) {
            let Some((v, row, ch, med)) = largest(s) else { continue };
            if v.abs() > MASSIVE_ABS && v.abs() > MASSIVE_RATIO * med {
                // Channels holding a massive entry in any run.
                let channels = s
                    .runs
                    .iter()
                    .filter_map(|r| r.vector(stats::OUT_CHAN_ABSMAX))
                    .fold(std::collections::BTreeSet::new(), |mut set, c| {
                        set.extend(c.iter().enumerate().filter(|(_, m)| **m as f64 > MASSIVE_ABS).map(|(j, _)| j));
                        set
                    });
                out.push(Verdict::new(
                    key,
                    MASSIVE_ACTIVATION,
                    vec![
                        ("value", v),
                        ("row", row),
                        ("channel", ch),
                        ("median_abs", med),
                        ("ratio_to_median", v.abs() / med),
                        ("channels_above_100", channels.len() as f64),
                    ],
                    "|h| > 100 and > 1000x the median |h| of the block's output",
                    "Sun et al., Massive Activations in Large Language Models (2024)",
                ));
            }
        }
        if blocks.len() < 3 {
            return;
        }
        let med = median(blocks.iter().map(|b| b.1).collect()).unwrap_or(0.0);
        for (key, bi) in &blocks {
            if *bi <= 0.5 * med {
                out.push(Verdict::new(
                    key,
                    LAYER_SKIP_PROBE,
                    vec![("block_influence", *bi), ("median_block_influence", med)],
                    "1 - cos(x, x + f(x)) <= half the median block's; confirm with the skip actuation",
                    "Men et al., ShortGPT (2024): remove the lowest block-influence layers",
                ));
            }
        }
    }
}

inventory::submit! { RuleRegistration(&ResidualRules) }

/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
