//! The attention probe lowered into RLX primitive ops (compares, casts, `Where`, `Reduce`
//! sum/max, log, `Sort`, a 0/1 matmul for "first/last key"; for the fused source also
//! `Transpose`, `MatMul`, `Softmax`, tanh), for a device without a native sketch kernel or
//! `attn{lower=true}`. Both sources:
//!
//! - [`AttnSource::Probs`]: probabilities in the graph, with or without an additive bias and a
//!   padding row mask.
//! - [`AttnSource::Fused`]: probabilities rebuilt from Q and K as the kernel defines them
//!   (`(q . k) * scale` in f32, masked scores set to the runtime's `attn_mask_neg_inf`, bias
//!   added, the soft-cap on the `[B, H, S, D]` path only, softmax), here by a graph `MatMul`
//!   and `Softmax` (grouped-query K heads repeated; an in-place Q/K view of a merged QKV
//!   projection narrowed from its rows).
//!
//! The mask is built as the kernel's `allowed(b, h, q, k)`: row mask `>= 0.5`, bias
//! `> MASKED_BIAS`, and for the fused source the op's mask kind; a key is padding when no
//! (head, query) may see it, a query when `Sq == Sk` and its key is padding. The first/last
//! non-padding key is found with a strictly-triangular 0/1 matmul (how many non-padding keys
//! precede/follow: exact small integers).
//!
//! # Accuracy (f32 graph arithmetic against the kernel's f64 sums)
//!
//! Every statistic is a mean of f32 values the kernel also reads (row maxima, probabilities,
//! `p ln p` with f32 `ln`, the `topk` largest of a row from RLX's `Sort`, whose sum does not
//! depend on tie order), summed in f32 over at most `Sk` then `B * Sq` terms of one sign: error
//! about `(Sk + B * Sq) * 2^-24` relative (Higham 2nd ed. section 4.2). Counts (`queries`,
//! `keys`, `topk`) are exact. For the fused source the rebuilt probabilities differ from the
//! kernel's by the rounding of a different dot-product and softmax order (a few ulps); no
//! statistic depends on an arg-max position, so the means stay within 1e-5 relative (measured
//! on the tests' fixtures: layouts, grouped-query, causal, window, key mask, bias, soft-cap).
//!
//! # Not lowered
//!
//! - A fused attention whose query heads are not a multiple of its K/V heads (the kernel's
//!   `h / (heads / kv_heads)` mapping then has no repeat form).

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use super::probe::{stats, AttnProbe, AttnSource, FusedMask, MASKED_BIAS};
use crate::sketch::lower::prim::{as_f32, cmp, k, values, where_};
use crate::sketch::probe::LoweredStat;
use crate::sketch::Stat;

/// `Ok`: both sources are lowered.
pub fn lowering(p: &AttnProbe) -> Result<(), String> {
    let _ = p;
    Ok(())
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

/// Build the statistics `want` of `p` from `inputs` (`[probs]` (+ bias), or `[Q, K]` (+ mask)
/// for the fused source; + the `[B * Sk]` row mask), each laid out as [`AttnProbe::execute`]
/// writes it.
pub fn lower(p: &AttnProbe, g: &mut Graph, inputs: &[NodeId], want: &[Stat]) -> Vec<LoweredStat> {
    let (b, h, sq, sk) = (p.batch, p.heads, p.sq, p.sk);
    let full = [b, h, sq, sk];
    let half = k(g, &[1, 1, 1, 1], 0.5);
    let (pr, mut allowed, rows) = match p.source {
        AttnSource::Probs { bias, rows } => {
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
            (pr, allowed, rows)
        }
        AttnSource::Fused { rows, .. } => match rebuild_fused(p, g, inputs) {
            Ok((pr, allowed)) => (pr, allowed, rows),
            Err(why) => return want.iter().map(|_| Err(why.clone())).collect(),
        },
    };
    if rows {
        let m = g.reshape_(*inputs.last().expect("row mask"), vec![b as i64, 1, 1, sk as i64]);
        let ok = cmp(g, CmpOp::Ge, m, half);
        let okf = as_f32(g, ok);
        allowed = g.mul(allowed, okf);
    }
    stats_of(p, g, pr, allowed, want)
}

/// Rebuild a fused attention's probabilities `[B, H, Sq, Sk]` from Q and K as RLX 0.2.19's CPU
/// kernel defines them (see [`AttnSource::Fused`]): `(q . k) * scale` by a graph `MatMul`,
/// masked scores set to the runtime's `attn_mask_neg_inf`, the bias added, the soft-cap on the
/// `[B, H, S, D]` path, then a graph `Softmax`; and the kernel's `allowed` mask (1.0 / 0.0).
///
/// Errors: a geometry the rebuild does not take (reported as not lowered).
fn rebuild_fused(p: &AttnProbe, g: &mut Graph, inputs: &[NodeId]) -> Result<(NodeId, NodeId), String> {
    let AttnSource::Fused { head_dim: dh, kv_heads, bhsd, scale, softcap, mask, q_view, k_view, .. } = p.source else {
        return Err("not fused".into());
    };
    let (b, nh, sq, sk) = (p.batch, p.heads, p.sq, p.sk);
    let nkv = kv_heads.max(1);
    if nh % nkv != 0 {
        return Err(format!("not lowered: {nh} query heads are not a multiple of {nkv} K/V heads"));
    }
    let group = nh / nkv;
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    // [B, heads, S, D] from the op's layout (a row view: narrow the columns first).
    let heads_first = |g: &mut Graph, x: NodeId, view: Option<[usize; 2]>, s: usize, heads: usize| -> NodeId {
        if bhsd {
            return g.reshape_(x, vec![b as i64, heads as i64, s as i64, dh as i64]);
        }
        let x = match view {
            Some([col, stride]) => {
                let rows = g.reshape_(x, vec![(b * s) as i64, stride as i64]);
                g.narrow_(rows, 1, col, heads * dh)
            }
            None => x,
        };
        let x = g.reshape_(x, vec![b as i64, s as i64, heads as i64, dh as i64]);
        g.add_node(Op::Transpose { perm: vec![0, 2, 1, 3] }, vec![x], f(&[b, heads, s, dh]))
    };
    let q = heads_first(g, inputs[0], q_view, sq, nh);
    let mut kk = heads_first(g, inputs[1], k_view, sk, nkv);
    if group > 1 {
        // Query head h reads K head h / group.
        let k5 = g.reshape_(kk, vec![b as i64, nkv as i64, 1, sk as i64, dh as i64]);
        let ones = k(g, &[1, 1, group, 1, 1], 1.0);
        let k5 = g.mul(k5, ones);
        kk = g.reshape_(k5, vec![b as i64, nh as i64, sk as i64, dh as i64]);
    }
    let kt = g.add_node(Op::Transpose { perm: vec![0, 1, 3, 2] }, vec![kk], f(&[b, nh, dh, sk]));
    let dot = g.matmul(q, kt, f(&[b, nh, sq, sk]));
    let sc = k(g, &[1, 1, 1, 1], scale);
    let mut s = g.mul(dot, sc);
    let cfg = rlx_cpu::config::RuntimeConfig::global();
    let (thr, neg) = (cfg.mask_binary_threshold, cfg.attn_mask_neg_inf);
    let full = [b, nh, sq, sk];
    let q_off = sk.saturating_sub(sq);
    let pos_mask = |w: Option<usize>| -> Vec<f32> {
        (0..sq * sk)
            .map(|i| {
                let (qi, ki) = (i / sk, i % sk);
                let a = q_off + qi;
                let ok = ki <= a && w.is_none_or(|w| ki >= a.saturating_sub(w));
                if ok { 1.0 } else { 0.0 }
            })
            .collect()
    };
    let allowed = match mask {
        FusedMask::None | FusedMask::Bias => k(g, &full, 1.0),
        FusedMask::Causal => values(g, &[1, 1, sq, sk], &pos_mask(None)),
        FusedMask::Window(w) => values(g, &[1, 1, sq, sk], &pos_mask(Some(w))),
        FusedMask::Keys => {
            let m = g.reshape_(inputs[2], vec![b as i64, 1, 1, sk as i64]);
            let t = k(g, &[1, 1, 1, 1], thr);
            let ok = cmp(g, CmpOp::Ge, m, t);
            as_f32(g, ok)
        }
    };
    let ones = k(g, &full, 1.0);
    let mut allowed = g.mul(allowed, ones);
    let half = k(g, &[1, 1, 1, 1], 0.5);
    let okb = cmp(g, CmpOp::Gt, allowed, half);
    let negk = k(g, &[1, 1, 1, 1], neg);
    s = where_(g, okb, s, negk);
    if let FusedMask::Bias = mask {
        let bias = g.reshape_(inputs[2], full.iter().map(|&d| d as i64).collect());
        s = g.add(s, bias);
        let lim = k(g, &[1, 1, 1, 1], MASKED_BIAS);
        let ok = cmp(g, CmpOp::Gt, bias, lim);
        let okf = as_f32(g, ok);
        allowed = g.mul(allowed, okf);
    }
    if softcap > 0.0 && bhsd {
        let c = k(g, &[1, 1, 1, 1], softcap);
        let t = g.div(s, c);
        let t = g.tanh(t);
        s = g.mul(t, c);
    }
    let pr = g.softmax(s, -1, f(&full));
    Ok((pr, allowed))
}

/// The attention statistics `want` of probabilities `pr` (`[B, H, Sq, Sk]`) under `allowed`
/// (1.0 / 0.0, the same shape), as the kernel's `attn_stats`.
fn stats_of(p: &AttnProbe, g: &mut Graph, pr: NodeId, allowed: NodeId, want: &[Stat]) -> Vec<LoweredStat> {
    let (b, h, sq, sk) = (p.batch, p.heads, p.sq, p.sk);
    let topk = p.topk.clamp(1, sk.max(1));
    let full = [b, h, sq, sk];
    let zero = k(g, &[1, 1, 1, 1], 0.0);
    let one = k(g, &[1, 1, 1, 1], 1.0);
    let half = k(g, &[1, 1, 1, 1], 0.5);
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
        let not_own: Vec<f32> = (0..sq * sk).map(|i| if Some(i % sk) == (i / sk + sk).checked_sub(sq) { 0.0 } else { 1.0 }).collect();
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
