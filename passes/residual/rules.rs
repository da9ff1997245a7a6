//! Miner rules for the residual probe: the layer-skip probe (ShortGPT's block influence).

use std::collections::BTreeMap;

use crate::mine::{median, Kind, Rule, RuleRegistration, Series, SeriesKey, Verdict};

use super::probe::stats;
use super::BLOCK;

/// A residual block's influence 1 - cos(x, x + f(x)) is <= half the median block's.
pub const LAYER_SKIP_PROBE: Kind = Kind {
    name: "layer_skip_probe",
    doc: "a residual block's influence 1 - cos(x, x + f(x)) is <= half the median block's: a layer skip candidate (Men et al., ShortGPT, 2024, removes the lowest-influence layers). A probe: confirm with the skip actuation (on MiniLM-L3 the ranks did not agree, see README)",
};

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
