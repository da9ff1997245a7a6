//! Miner rules for the routing probe: dead experts and expert imbalance.

use std::collections::BTreeMap;

use crate::mine::{weighted_vector, Kind, Rule, RuleRegistration, Series, SeriesKey, Verdict};

use super::probe::stats;
use super::{DISPATCH, ROUTER};

/// An expert received no token while a uniform router would have sent it >= 10.
///
/// 10 is opscope's line: were the expert as likely as any other, its token count would be
/// about Poisson with mean >= 10, which gives it no token with probability e^-10 (4.5e-5), so
/// an empty expert is not chance; with fewer tokens recorded the rule stays silent.
pub const DEAD_EXPERT: Kind = Kind {
    name: "dead_expert",
    doc: "an expert received no token over the recording while a uniform router would have sent it >= 10: prune it (expert pruning; Lu et al., Not All Experts are Equal, 2024)",
};

/// The busiest expert's load is >= 2x the mean.
pub const EXPERT_IMBALANCE: Kind = Kind {
    name: "expert_imbalance",
    doc: "the busiest expert's load is >= 2x the mean: tokens overflow a capacity factor of 2 (Fedus et al., Switch Transformers, 2021: capacity factors 1.0-2.0)",
};

struct RouteRules;

impl Rule for RouteRules {
    fn name(&self) -> &'static str {
        "route"
    }

    fn mine(&self, series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
        let ours = |k: &SeriesKey| k.1 == ROUTER.as_str() || k.1 == DISPATCH.as_str();
        for (key, s) in series.iter().filter(|(k, _)| ours(k)) {
            let load = weighted_vector(s, stats::LOAD, |_| 1.0);
            let runs = s.runs.iter().filter(|r| r.vector(stats::LOAD).is_some()).count() as f64;
            let total: Vec<f64> = load.iter().map(|l| l * runs).collect();
            let assignments: f64 = total.iter().sum();
            if total.is_empty() || assignments <= 0.0 {
                continue;
            }
            let e = total.len() as f64;
            let mean = assignments / e;
            let dead = total.iter().filter(|&&l| l == 0.0).count() as f64;
            if dead > 0.0 && mean >= 10.0 {
                out.push(Verdict::new(
                    key,
                    DEAD_EXPERT,
                    vec![("dead_experts", dead), ("experts", e), ("assignments", assignments)],
                    "an expert got no token while a uniform router would have sent it >= 10",
                    "Lu et al., Not All Experts are Equal (2024): expert pruning",
                ));
            }
            let max = total.iter().copied().fold(0.0, f64::max);
            if max >= 2.0 * mean {
                let hot = total.iter().position(|&l| l == max).unwrap_or(0) as f64;
                out.push(Verdict::new(
                    key,
                    EXPERT_IMBALANCE,
                    vec![("max_over_mean_load", max / mean), ("expert", hot)],
                    "busiest expert's load >= 2x the mean (overflows capacity factor 2)",
                    "Fedus et al., Switch Transformers (2021): capacity factors 1.0-2.0",
                ));
            }
        }
    }
}

inventory::submit! { RuleRegistration(&RouteRules) }

/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
