//! The routing probe lowered into RLX primitive ops (compares against a constant expert index
//! row, casts, `Where`, `Reduce` sum/max, exp), for a device without a native sketch kernel or
//! `route{lower=true}`.
//!
//! An assignment is a one-hot `(id == e)` over the experts `e = 0..E` (an f32 compare: true
//! exactly when the f32-encoded id is the integer `e`, so a non-integer, out-of-range or NaN id
//! matches no expert, as the kernel's validity test); `load` is its sum over kept tokens and
//! choices and `bad_ids` is `kept tokens * k - sum(load)`: both exact counts (below 2^24).
//!
//! # Accuracy (f32 graph arithmetic against the kernel's f64 sums)
//!
//! `importance`, `gate_mass` and `kept_mass` are sums over tokens of gate probabilities in
//! [0, 1] (non-negative terms: error about `T * 2^-24` relative, Higham 2nd ed. section 4.2;
//! within 1e-5 relative up to about 160 tokens in the worst case, far more in practice). With
//! `Logits` the probabilities are a softmax in f32 (max subtracted first, as the kernel), each
//! within a few ulps of the kernel's f64 softmax. A probability below f32's normal range
//! (`< 1.2e-38`, an expert the router all but excludes) is subnormal in both and loses relative
//! precision; it adds nothing measurable to a sum that holds a larger one.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{Graph, NodeId};

use super::probe::{stats, RouteProbe, RouteScores};
use crate::sketch::lower::prim::{as_f32, cmp, k, reduce_keep, total, values, where_};
use crate::sketch::probe::LoweredStat;
use crate::sketch::Stat;

/// Build the statistics `want` of `p` from `inputs` = `[ids]` (+ `[T, E]` scores unless
/// `p.scores` is `None`) (+ the `[T]` token mask when `p.masked`), each laid out as
/// [`RouteProbe::execute`] writes it.
pub fn lower(p: &RouteProbe, g: &mut Graph, inputs: &[NodeId], want: &[Stat]) -> Vec<LoweredStat> {
    let (t, e, kk) = (p.tokens, p.experts, p.k);
    let zero = k(g, &[1, 1], 0.0);
    let ids = g.reshape_(inputs[0], vec![t as i64, kk as i64, 1]);
    let experts: Vec<f32> = (0..e).map(|i| i as f32).collect();
    let iota = values(g, &[1, 1, e], &experts);
    let hit = cmp(g, CmpOp::Eq, ids, iota); // [T, k, E]
    let hit = as_f32(g, hit);
    // keep: [T, 1] 1.0 / 0.0.
    let keepf = match (p.masked, inputs.last()) {
        (true, Some(&m)) => {
            let m = g.reshape_(m, vec![t as i64, 1]);
            let ne = cmp(g, CmpOp::Ne, m, zero);
            as_f32(g, ne)
        }
        _ => k(g, &[t, 1], 1.0),
    };
    let keep = {
        let half = k(g, &[1, 1], 0.5);
        cmp(g, CmpOp::Gt, keepf, half)
    };
    // Assignments per (token, expert), kept tokens only: [T, E].
    let per_tok = g.reduce(hit, ReduceOp::Sum, vec![1], false, rlx_ir::Shape::new(&[t, e], rlx_ir::DType::F32));
    let per_tok = g.mul(per_tok, keepf);
    let tokens = total(g, keepf, ReduceOp::Sum);
    // Gate probabilities of kept tokens, [T, E] (0 for padding).
    let probs = match p.scores {
        RouteScores::None => None,
        RouteScores::Probs => Some(inputs[1]),
        RouteScores::Logits => {
            let s = g.reshape_(inputs[1], vec![t as i64, e as i64]);
            let mx = reduce_keep(g, s, ReduceOp::Max, 1);
            let d = g.sub(s, mx);
            let ex = g.exp(d);
            let z = reduce_keep(g, ex, ReduceOp::Sum, 1);
            Some(g.div(ex, z))
        }
    }
    .map(|s| {
        let s = g.reshape_(s, vec![t as i64, e as i64]);
        where_(g, keep, s, zero)
    });
    let over_tokens = |g: &mut Graph, x: NodeId| {
        let r = reduce_keep(g, x, ReduceOp::Sum, 0);
        g.reshape_(r, vec![e as i64])
    };
    want.iter()
        .map(|&s| match (s, probs) {
            (stats::TOKENS, _) => Ok(tokens),
            (stats::LOAD, _) => Ok(over_tokens(g, per_tok)),
            (stats::BAD_IDS, _) => {
                let load = total(g, per_tok, ReduceOp::Sum);
                let kc = k(g, &[1], kk as f32);
                let all = g.mul(tokens, kc);
                Ok(g.sub(all, load))
            }
            (stats::IMPORTANCE, Some(pr)) => Ok(over_tokens(g, pr)),
            (stats::GATE_MASS, Some(pr)) => {
                let m = g.mul(per_tok, pr);
                Ok(over_tokens(g, m))
            }
            (stats::KEPT_MASS, Some(pr)) => {
                let m = g.mul(per_tok, pr);
                let sum = total(g, m, ReduceOp::Sum);
                Ok(g.div(sum, tokens)) // 0/0 = NaN with no kept token, as the kernel
            }
            (other, _) => Err(format!("{}: no lowering (the probe has no scores)", other.as_str())),
        })
        .collect()
}
