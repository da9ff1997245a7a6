//! The routing probe: a MoE router's chosen experts (and its scores): per-expert load, gate
//! mass and importance.

use crate::sketch::probe::{input, need};
use crate::sketch::{Stat, TypedProbe};
use rlx_cpu::op_registry::CpuTensorRef;
use serde::{Deserialize, Serialize};

crate::stats! {
    /// Statistics of the routing probe, in layout order (`E` = experts).
    pub mod stats {
        /// Routed tokens (rows) in this run (1 value).
        TOKENS = "tokens", One;
        /// Per expert: number of (token, choice) assignments (`E` values; 0 for a dead expert).
        LOAD = "load", Vector;
        /// Per expert: sum of the gate probabilities of the assignments it received (`E`).
        GATE_MASS = "gate_mass", Vector;
        /// Per expert: sum over tokens of its gate probability, chosen or not (`E`; the
        /// "importance" of Shazeer et al. 2017).
        IMPORTANCE = "importance", Vector;
        /// Mean over tokens of the gate probability mass on the chosen experts (1 value).
        KEPT_MASS = "kept_mass", One;
        /// Expert ids that are not an integer in [0, E) (1 value; must be 0).
        BAD_IDS = "bad_ids", One;
    }
}

inventory::submit! { crate::sketch::StatTable(stats::ALL) }
inventory::submit! { crate::sketch::ProbeRegistration(&crate::sketch::Typed::<RouteProbe>::NEW) }

/// Router geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteProbe {
    /// Number of experts `E`.
    pub experts: usize,
    /// Tokens `T` (rows).
    pub tokens: usize,
    /// Experts chosen per token `k`.
    pub k: usize,
    /// What input 1 holds, if anything.
    pub scores: RouteScores,
    /// The last input is a `[T]` token mask (1 = token, 0 = padding): padding tokens are left
    /// out of every statistic.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub masked: bool,
}

/// The router scores a route probe reads next to the chosen expert ids (input 0, `[T, k]` or
/// `[T]`, f32-encoded ids as RLX's `TopK` and `GroupedMatMul` use).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum RouteScores {
    /// No scores: load only.
    None,
    /// Input 1 is `[T, E]` gate values used as they are: the router's softmax output, or its
    /// sigmoid output (per-expert gates that need not sum to 1).
    Probs,
    /// Input 1 is `[T, E]` logits; gate probabilities are their softmax (computed in f64).
    Logits,
}



impl TypedProbe for RouteProbe {
    const NAME: &'static str = "Route";

    fn stats(&self) -> &'static [Stat] {
        if self.scores == RouteScores::None {
            &[stats::TOKENS, stats::LOAD, stats::BAD_IDS]
        } else {
            stats::ALL
        }
    }

    fn stat_len(&self, s: Stat) -> usize {
        match s {
            stats::LOAD | stats::GATE_MASS | stats::IMPORTANCE => self.experts,
            _ => 1,
        }
    }

    fn execute(&self, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String> {
        let ids = input(inputs, 0, "expert ids")?;
        need(ids.len(), self.tokens * self.k, "expert ids")?;
        let scores = match self.scores {
            RouteScores::None => None,
            _ => {
                let s = input(inputs, 1, "router scores")?;
                need(s.len(), self.tokens * self.experts, "router scores")?;
                Some(s)
            }
        };
        let mask = if self.masked {
            let m = input(inputs, inputs.len() - 1, "token mask")?;
            need(m.len(), self.tokens, "token mask")?;
            Some(m)
        } else {
            None
        };
        Ok(route_stats(self, ids, scores, mask))
    }

    fn lowering(&self) -> Result<(), String> {
        Ok(())
    }

    fn lower(&self, g: &mut rlx_ir::Graph, inputs: &[rlx_ir::NodeId], stats: &[Stat]) -> Vec<crate::sketch::probe::LoweredStat> {
        super::lower::lower(self, g, inputs, stats)
    }
}

/// Routing statistics over the tokens `mask` keeps (every token without one). An id is valid
/// when it is an integer in `[0, E)`; invalid ids are counted in [`stats::BAD_IDS`] and
/// assigned to no expert.
fn route_stats(r: &RouteProbe, ids: &[f32], scores: Option<&[f32]>, mask: Option<&[f32]>) -> Vec<(Stat, Vec<f32>)> {
    let e = r.experts;
    let mut load = vec![0f64; e];
    let mut gate = vec![0f64; e];
    let mut importance = vec![0f64; e];
    let mut kept = 0f64;
    let mut bad = 0f64;
    let mut probs = vec![0f64; e];
    let mut tokens = 0usize;
    for t in 0..r.tokens {
        if mask.is_some_and(|m| m[t] == 0.0) {
            continue;
        }
        tokens += 1;
        if let Some(s) = scores {
            let row = &s[t * e..(t + 1) * e];
            match r.scores {
                RouteScores::Logits => {
                    let mx = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                    let z: f64 = row.iter().map(|&x| (x as f64 - mx).exp()).sum();
                    for (p, &x) in probs.iter_mut().zip(row) {
                        *p = (x as f64 - mx).exp() / z;
                    }
                }
                _ => probs.iter_mut().zip(row).for_each(|(p, &x)| *p = x as f64),
            }
            for (i, p) in importance.iter_mut().zip(&probs) {
                *i += p;
            }
        }
        for &id in &ids[t * r.k..(t + 1) * r.k] {
            if id.fract() != 0.0 || !(0.0..e as f32).contains(&id) {
                bad += 1.0;
                continue;
            }
            let x = id as usize;
            load[x] += 1.0;
            if scores.is_some() {
                gate[x] += probs[x];
                kept += probs[x];
            }
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    let kept = if tokens > 0 { (kept / tokens as f64) as f32 } else { f32::NAN };
    vec![
        (stats::TOKENS, vec![tokens as f32]),
        (stats::LOAD, f(load)),
        (stats::GATE_MASS, f(gate)),
        (stats::IMPORTANCE, f(importance)),
        (stats::KEPT_MASS, vec![kept]),
        (stats::BAD_IDS, vec![bad as f32]),
    ]
}


/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
