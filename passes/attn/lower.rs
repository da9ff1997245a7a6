//! The attention probe lowered into RLX primitive ops (compares, casts, `Where`, `Reduce`
//! sum/max, log, `Sort`, a 0/1 matmul for "first/last key"), for a device without a native
//! sketch kernel or `attn{lower=true}`: the [`AttnSource::Probs`] source (probabilities in the
//! graph, with or without an additive bias and a padding row mask).
//!
//! The mask is built as the kernel's `allowed(b, h, q, k)`: row mask `>= 0.5` and bias
//! `> MASKED_BIAS`; a key is padding when no (head, query) may see it, a query when `Sq == Sk`
//! and its key is padding. The first/last non-padding key is found with a strictly-triangular
//! 0/1 matmul (how many non-padding keys precede/follow: exact small integers).
//!
//! # Accuracy (f32 graph arithmetic against the kernel's f64 sums)
//!
//! Every statistic is a mean of f32 values the kernel also reads (row maxima, probabilities,
//! `p ln p` with f32 `ln`, the `topk` largest of a row from RLX's `Sort`, whose sum does not
//! depend on tie order), summed in f32 over at most `Sk` then `B * Sq` terms of one sign: error
//! about `(Sk + B * Sq) * 2^-24` relative (Higham 2nd ed. section 4.2). Counts (`queries`,
//! `keys`, `topk`) are exact.
//!
//! # Not lowered
//!
//! - The whole [`AttnSource::Fused`] source: its probabilities are rebuilt exactly as RLX's CPU
//!   attention kernel computes them (f32 dot products in its order, its own softmax kernel
//!   `neon_softmax`); a graph `MatMul` + `Softmax` rounds differently, so peaks and positions
//!   could differ in the last bits and arg-dependent statistics beyond 1e-5. Listed per site.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use super::probe::{stats, AttnProbe, AttnSource, MASKED_BIAS};
use crate::sketch::lower::prim::{as_f32, cmp, k, values, where_};
use crate::sketch::probe::LoweredStat;
use crate::sketch::Stat;

/// Why the fused source is not lowered.
pub const FUSED_NOT_LOWERED: &str = "the attention probe's Fused source (probabilities rebuilt from Q and K as RLX's CPU attention kernel computes them, its own softmax kernel) has no exact lowering: graph MatMul + Softmax round differently";

/// `Ok` for [`AttnSource::Probs`], the reason for [`AttnSource::Fused`].
pub fn lowering(p: &AttnProbe) -> Result<(), String> {
    match p.source {
        AttnSource::Probs { .. } => Ok(()),
        AttnSource::Fused { .. } => Err(FUSED_NOT_LOWERED.into()),
    }
}

/// Reduce `x` over `axes` (one at a time, keeping rank).
fn red(g: &mut Graph, x: NodeId, op: ReduceOp, axes: &[usize]) -> NodeId {
    let mut x = x;
    for &a in axes {
        let mut dims = crate::sketch::static_dims(g.shape(x)).expect("static dims");
        dims[a] = 1;
        x = g.reduce(x, op, vec![a], true, Shape::new(&dims, DType::F32));
    }
    x
}

/// `a / n` where `n > 0`, else NaN (the kernel's "no sample: not recorded").
fn mean_or_nan(g: &mut Graph, a: NodeId, n: NodeId) -> NodeId {
    let zero = k(g, &[1, 1, 1, 1], 0.0);
    let nan = k(g, &[1, 1, 1, 1], f32::NAN);
    let pos = cmp(g, CmpOp::Gt, n, zero);
    let one = k(g, &[1, 1, 1, 1], 1.0);
    let safe = where_(g, pos, n, one);
    let m = g.div(a, safe);
    where_(g, pos, m, nan)
}

/// Build the statistics `want` of `p` (a [`AttnSource::Probs`] probe) from `inputs` =
/// `[probs]` (+ bias) (+ `[B * Sk]` row mask), each laid out as [`AttnProbe::execute`] writes it.
pub fn lower(p: &AttnProbe, g: &mut Graph, inputs: &[NodeId], want: &[Stat]) -> Vec<LoweredStat> {
    let AttnSource::Probs { bias, rows } = p.source else {
        return want.iter().map(|_| Err(FUSED_NOT_LOWERED.to_string())).collect();
    };
    let (b, h, sq, sk) = (p.batch, p.heads, p.sq, p.sk);
    let topk = p.topk.clamp(1, sk.max(1));
    let full = [b, h, sq, sk];
    let zero = k(g, &[1, 1, 1, 1], 0.0);
    let one = k(g, &[1, 1, 1, 1], 1.0);
    let half = k(g, &[1, 1, 1, 1], 0.5);
    let pr = g.reshape_(inputs[0], full.iter().map(|&d| d as i64).collect());

    // allowed: [B, H, Sq, Sk] 1.0 / 0.0.
    let mut allowed = k(g, &full, 1.0);
    if let Some(d) = bias {
        let bv = g.reshape_(inputs[1], d.iter().map(|&x| x as i64).collect());
        let lim = k(g, &[1, 1, 1, 1], MASKED_BIAS);
        let ok = cmp(g, CmpOp::Gt, bv, lim);
        let okf = as_f32(g, ok);
        allowed = g.mul(allowed, okf);
    }
    if rows {
        let m = g.reshape_(*inputs.last().expect("row mask"), vec![b as i64, 1, 1, sk as i64]);
        let ok = cmp(g, CmpOp::Ge, m, half);
        let okf = as_f32(g, ok);
        allowed = g.mul(allowed, okf);
    }
    // keyok [B,1,1,Sk]: some (h, q) may see the key.
    let seen = red(g, allowed, ReduceOp::Max, &[1, 2]);
    let keyok_b = cmp(g, CmpOp::Gt, seen, half);
    let keyok = as_f32(g, keyok_b);
    // validq [B,1,Sq,1].
    let validq = if sq == sk { g.reshape_(keyok, vec![b as i64, 1, sq as i64, 1]) } else { k(g, &[b, 1, sq, 1], 1.0) };
    let validq_full = {
        let ones = k(g, &full, 1.0);
        g.mul(validq, ones)
    };
    let validq_b = cmp(g, CmpOp::Gt, validq_full, half);
    let nq = red(g, validq, ReduceOp::Sum, &[2]); // [B,1,1,1]
    let queries = red(g, nq, ReduceOp::Sum, &[0]); // [1,1,1,1]
    // Probabilities of valid queries (0 elsewhere), so sums over q skip padding queries.
    let pv = where_(g, validq_b, pr, zero);
    let n_allowed = red(g, allowed, ReduceOp::Sum, &[3]); // [B,H,Sq,1]
    let rowmax = red(g, pr, ReduceOp::Max, &[3]); // [B,H,Sq,1]
    let vb = validq_b_row(g, validq, b, h, sq);
    let rowmax_v = where_(g, vb, rowmax, zero);

    // Sum over (b, q) of a [B,H,Sq,1] per-query value, divided by `queries`: [H].
    let per_q = |g: &mut Graph, v: NodeId| {
        let s = red(g, v, ReduceOp::Sum, &[2, 0]);
        let m = mean_or_nan(g, s, queries);
        g.reshape_(m, vec![h as i64])
    };
    // Sum over (b, q) of v, divided by the sum of the weights n: [H].
    let per_w = |g: &mut Graph, v: NodeId, n: NodeId| {
        let s = red(g, v, ReduceOp::Sum, &[2, 0]);
        let c = red(g, n, ReduceOp::Sum, &[2, 0]);
        let m = mean_or_nan(g, s, c);
        g.reshape_(m, vec![h as i64])
    };
    // First / last non-padding key, [B,1,1,Sk] one-hot, via counts of non-padding keys before
    // (after) each key: keyok [B, Sk] @ strictly upper (lower) triangular ones.
    let edge_key = |g: &mut Graph, first: bool| {
        let tri: Vec<f32> = (0..sk * sk).map(|i| {
            let (j, kk) = (i / sk, i % sk);
            if (first && j < kk) || (!first && j > kk) { 1.0 } else { 0.0 }
        }).collect();
        let tri = values(g, &[sk, sk], &tri);
        let ko = g.reshape_(keyok, vec![b as i64, sk as i64]);
        let before = g.matmul(ko, tri, Shape::new(&[b, sk], DType::F32));
        let before = g.reshape_(before, vec![b as i64, 1, 1, sk as i64]);
        let none = cmp(g, CmpOp::Eq, before, zero);
        let nonef = as_f32(g, none);
        g.mul(nonef, keyok)
    };
    // Sink weight: the query is valid, the key is the edge key, not the query's own position,
    // and allowed. [B,H,Sq,Sk].
    let sink = |g: &mut Graph, first: bool| {
        let edge = edge_key(g, first);
        let not_own: Vec<f32> = (0..sq * sk).map(|i| if i % sk == sk - sq + i / sk { 0.0 } else { 1.0 }).collect();
        let not_own = values(g, &[1, 1, sq, sk], &not_own);
        let w = g.mul(allowed, edge);
        let w = g.mul(w, not_own);
        let w = g.mul(w, validq);
        let pw = g.mul(pr, w);
        let wb = cmp_pos(g, w, half);
        let pw = where_(g, wb, pw, zero);
        let mass = red(g, pw, ReduceOp::Sum, &[3]); // [B,H,Sq,1]
        let n = red(g, w, ReduceOp::Sum, &[3]);
        (mass, n)
    };
    // Received mass per (b, h, k) from valid queries over nq: [B,H,1,Sk].
    let recv = |g: &mut Graph| {
        let r = red(g, pv, ReduceOp::Sum, &[2]);
        let nqs = mean_or_nan(g, r, nq);
        nqs
    };

    want.iter()
        .map(|&s| -> LoweredStat {
            Ok(match s {
                stats::QUERIES => g.reshape_(queries, vec![1]),
                stats::KEYS => {
                    let n = red(g, keyok, ReduceOp::Sum, &[3, 0]);
                    let bb = k(g, &[1, 1, 1, 1], b as f32);
                    let m = g.div(n, bb);
                    g.reshape_(m, vec![1])
                }
                stats::TOPK => k(g, &[1], topk as f32),
                stats::PEAK => per_q(g, rowmax_v),
                stats::ENTROPY | stats::ENTROPY_NORM => {
                    let pos = cmp(g, CmpOp::Gt, pr, zero);
                    let safe = where_(g, pos, pr, one);
                    let ln = g.log(safe);
                    let xl = g.mul(pr, ln);
                    let xl = where_(g, pos, xl, zero);
                    let e = red(g, xl, ReduceOp::Sum, &[3]);
                    let e = g.neg(e); // [B,H,Sq,1]
                    let vb = validq_b_row(g, validq, b, h, sq);
                    let e = where_(g, vb, e, zero);
                    if s == stats::ENTROPY {
                        per_q(g, e)
                    } else {
                        let two = k(g, &[1, 1, 1, 1], 1.5);
                        let ok = cmp(g, CmpOp::Gt, n_allowed, two);
                        let okf = as_f32(g, ok);
                        let w = g.mul(okf, validq);
                        let wb = cmp_pos(g, w, half);
                        let two = k(g, &[1, 1, 1, 1], 2.0);
                        let na = where_(g, ok, n_allowed, two);
                        let lnn = g.log(na);
                        let en = g.div(e, lnn);
                        let en = where_(g, wb, en, zero);
                        per_w(g, en, w)
                    }
                }
                stats::TOPK_MASS => {
                    let sorted = g.add_node(Op::Sort { axis: 3, descending: true }, vec![pr], Shape::new(&full, DType::F32));
                    let top = g.narrow_(sorted, 3, 0, topk);
                    let m = red(g, top, ReduceOp::Sum, &[3]);
                    let kk = k(g, &[1, 1, 1, 1], topk as f32 + 0.5);
                    let ok = cmp(g, CmpOp::Gt, n_allowed, kk);
                    let okf = as_f32(g, ok);
                    let w = g.mul(okf, validq);
                    let wb = cmp_pos(g, w, half);
                    let m = where_(g, wb, m, zero);
                    per_w(g, m, w)
                }
                stats::SINK_FIRST | stats::SINK_LAST | stats::SINK_FIRST_LIFT | stats::SINK_LAST_LIFT => {
                    let first = matches!(s, stats::SINK_FIRST | stats::SINK_FIRST_LIFT);
                    let (mass, n) = sink(g, first);
                    let v = if matches!(s, stats::SINK_FIRST_LIFT | stats::SINK_LAST_LIFT) { g.mul(mass, n_allowed) } else { mass };
                    per_w(g, v, n)
                }
                stats::PAD_MASS => {
                    let padk = g.sub(one, keyok);
                    let m = g.mul(pv, padk);
                    let padb = cmp_pos(g, padk, half);
                    let m = where_(g, padb, m, zero);
                    let m = red(g, m, ReduceOp::Sum, &[3]);
                    per_q(g, m)
                }
                stats::RECV_MAX => {
                    let r = recv(g); // [B,H,1,Sk], NaN where nq = 0
                    let kb = cmp_pos(g, keyok, half);
                    let ninf = k(g, &[1, 1, 1, 1], f32::NEG_INFINITY);
                    let r = where_(g, kb, r, ninf);
                    let best = red(g, r, ReduceOp::Max, &[3]); // [B,H,1,1]
                    // Counted where finite (nq > 0 and some non-padding key).
                    let a = g.abs(best);
                    let inf = k(g, &[1, 1, 1, 1], f32::INFINITY);
                    let fin = cmp(g, CmpOp::Lt, a, inf);
                    let finf = as_f32(g, fin);
                    let bz = where_(g, fin, best, zero);
                    let s = red(g, bz, ReduceOp::Sum, &[0]);
                    let c = red(g, finf, ReduceOp::Sum, &[0]);
                    let m = mean_or_nan(g, s, c);
                    g.reshape_(m, vec![h as i64])
                }
                stats::RECV_POS => {
                    let r = recv(g); // [B,H,1,Sk]
                    let nqp = cmp(g, CmpOp::Gt, nq, zero);
                    let nqf = as_f32(g, nqp);
                    let w = g.mul(keyok, nqf); // [B,1,1,Sk]
                    let ones = k(g, &[1, h, 1, 1], 1.0);
                    let w = g.mul(w, ones); // [B,H,1,Sk]
                    let wb = cmp_pos(g, w, half);
                    let rz = where_(g, wb, r, zero);
                    let s = red(g, rz, ReduceOp::Sum, &[0]);
                    let c = red(g, w, ReduceOp::Sum, &[0]);
                    let m = mean_or_nan(g, s, c);
                    g.reshape_(m, vec![(h * sk) as i64])
                }
                stats::PEAK_POS => {
                    let ones = k(g, &[1, h, 1, 1], 1.0);
                    let w = g.mul(validq, ones); // [B,H,Sq,1]
                    let s = red(g, rowmax_v, ReduceOp::Sum, &[0]);
                    let c = red(g, w, ReduceOp::Sum, &[0]);
                    let m = mean_or_nan(g, s, c);
                    g.reshape_(m, vec![(h * sq) as i64])
                }
                other => return Err(format!("{}: no lowering", other.as_str())),
            })
        })
        .collect()
}

/// `x > half` as Bool.
fn cmp_pos(g: &mut Graph, x: NodeId, half: NodeId) -> NodeId {
    cmp(g, CmpOp::Gt, x, half)
}

/// The valid-query mask as Bool `[B, H, Sq, 1]`.
fn validq_b_row(g: &mut Graph, validq: NodeId, b: usize, h: usize, sq: usize) -> NodeId {
    let ones = k(g, &[b, h, sq, 1], 1.0);
    let v = g.mul(validq, ones);
    let half = k(g, &[1, 1, 1, 1], 0.5);
    cmp(g, CmpOp::Gt, v, half)
}
