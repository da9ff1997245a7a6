//! The residual probe lowered into RLX primitive ops (reshape, abs, compares, `Where`, casts,
//! `Reduce` sum/max, sqrt), for a device without a native sketch kernel or `residual{lower=true}`.
//!
//! # Accuracy (f32 graph arithmetic against the kernel's f64 sums)
//!
//! Sums of squares and dot products are taken on values scaled by a max|.| (the tensor's for
//! `ratio`, the row's for `cos_row`) so nothing overflows or underflows in f32, over the last
//! axis then over rows (two-level summation, as the tensor sketch's lowering: error about
//! `(D + R) * 2^-24` relative for the non-negative sums, Higham 2nd ed. section 4.2). A cosine
//! near 0 is a difference of such sums and is accurate to about `D * 2^-24` absolute, not
//! relative: residual blocks have cos(x, x + f(x)) well away from 0 (measured on the tests'
//! fixtures and MiniLM: within 1e-5 relative). `rows` and `out_chan_absmax` are exact (a count,
//! and a max of the same f32 values `x + f(x)` the kernel forms).
//!
//! # Not lowered
//!
//! - `out_median_abs`: the median of the kept elements needs a full sort of `R * D` values and
//!   a selection at a run-time position (the kept count depends on the padding mask); RLX's
//!   `Sort` is not paired here with a run-time-indexed gather checked against the kernel.
//! - `out_top`: the kernel keeps the first of equal |values| in row-major order; RLX's `TopK`
//!   tie order is not specified to match, so row and channel could differ on ties.
//!
//! A non-finite element makes the kernel's f64 sums non-finite; the lowering's scaled sums are
//! NaN there (the recorder drops NaN): inputs with Inf/NaN in the stream are outside this
//! lowering's agreement.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{Graph, NodeId};

use super::probe::{stats, ResidualProbe};
use crate::sketch::lower::prim::{as_f32, cmp, finite_or_nan, k, reduce_keep, total, where_};
use crate::sketch::probe::LoweredStat;
use crate::sketch::Stat;

/// Why `out_median_abs` is not lowered.
pub const MEDIAN_NOT_LOWERED: &str =
    "not lowered: the median of the kept elements needs a sort of every element and a pick at a run-time position (the kept count); not built from RLX's Sort";
/// Why `out_top` is not lowered.
pub const TOP_NOT_LOWERED: &str =
    "not lowered: the kernel keeps the first of equal |values| in row-major order, and RLX's TopK tie order is not specified to match (row, channel could differ)";

/// Build the statistics `want` of `p` from `inputs` = `[x, f(x)]` (+ the `[rows]` mask when
/// `p.masked`), each as [`ResidualProbe::execute`] lays it out.
pub fn lower(p: &ResidualProbe, g: &mut Graph, inputs: &[NodeId], want: &[Stat]) -> Vec<LoweredStat> {
    let (r, d) = (p.rows, p.width);
    let x = g.reshape_(inputs[0], vec![r as i64, d as i64]);
    let f = g.reshape_(inputs[1], vec![r as i64, d as i64]);
    let zero = k(g, &[1, 1], 0.0);
    let one = k(g, &[1, 1], 1.0);
    let nan = k(g, &[1, 1], f32::NAN);
    // keep: [R, 1] Bool; keepf 1.0 / 0.0.
    let keep = match (p.masked, inputs.get(2)) {
        (true, Some(&m)) => {
            let m = g.reshape_(m, vec![r as i64, 1]);
            cmp(g, CmpOp::Ne, m, zero)
        }
        _ => {
            let ones = k(g, &[r, 1], 1.0);
            cmp(g, CmpOp::Ne, ones, zero)
        }
    };
    let keepf = as_f32(g, keep);
    // The block's output as the graph's Add computes it, in f32.
    let y = g.add(x, f);
    let xz = where_(g, keep, x, zero);
    let fz = where_(g, keep, f, zero);
    let yz = where_(g, keep, y, zero);

    // Scale by max|.| (1 where it is 0).
    let safe = |g: &mut Graph, m: NodeId| {
        let pos = cmp(g, CmpOp::Gt, m, zero);
        where_(g, pos, m, one)
    };
    want.iter()
        .map(|&s| match s {
            stats::ROWS => Ok(total(g, keepf, ReduceOp::Sum)),
            stats::RATIO => {
                let ax = g.abs(xz);
                let af = g.abs(fz);
                let sx = total(g, ax, ReduceOp::Max);
                let sf = total(g, af, ReduceOp::Max);
                let (sx1, sf1) = (safe(g, sx), safe(g, sf));
                let xs = g.div(xz, sx1);
                let fs = g.div(fz, sf1);
                let xx = g.mul(xs, xs);
                let ff = g.mul(fs, fs);
                let xx = total(g, xx, ReduceOp::Sum);
                let ff = total(g, ff, ReduceOp::Sum);
                let q = g.div(ff, xx);
                let q = g.sqrt(q);
                let sc = g.div(sf1, sx1);
                let ratio = g.mul(q, sc);
                // NaN when ||x|| is 0 (the kernel's xx > 0 test).
                let some = cmp(g, CmpOp::Gt, sx, zero);
                let ratio = where_(g, some, ratio, nan);
                let ratio = finite_or_nan(g, ratio);
                Ok(g.reshape_(ratio, vec![1]))
            }
            stats::COS | stats::COS_ROW => {
                let c = cos_rows(g, xz, yz, keep, zero, one, nan); // [R, 1], NaN where undefined
                if s == stats::COS_ROW {
                    return Ok(g.reshape_(c, vec![r as i64]));
                }
                let a = g.abs(c);
                let inf = k(g, &[1, 1], f32::INFINITY);
                let fin = cmp(g, CmpOp::Lt, a, inf);
                let cz = where_(g, fin, c, zero);
                let n = as_f32(g, fin);
                let sum = total(g, cz, ReduceOp::Sum);
                let n = total(g, n, ReduceOp::Sum);
                let mean = g.div(sum, n); // 0/0 = NaN with no defined row, as the kernel
                Ok(mean)
            }
            stats::OUT_CHAN_ABSMAX => {
                // max over kept rows of finite |x + f(x)|; NaN for a channel with none.
                let a = g.abs(y);
                let inf = k(g, &[1, 1], f32::INFINITY);
                let fin = cmp(g, CmpOp::Lt, a, inf);
                let finf = as_f32(g, fin);
                let ok = g.mul(finf, keepf);
                let half = k(g, &[1, 1], 0.5);
                let ok = cmp(g, CmpOp::Gt, ok, half);
                let neg = k(g, &[1, 1], -1.0);
                let a = where_(g, ok, a, neg);
                let m = reduce_keep(g, a, ReduceOp::Max, 0); // [1, D]
                let none = cmp(g, CmpOp::Lt, m, zero);
                let m = where_(g, none, nan, m);
                Ok(g.reshape_(m, vec![d as i64]))
            }
            stats::OUT_MEDIAN_ABS => Err(MEDIAN_NOT_LOWERED.to_string()),
            stats::OUT_TOP => Err(TOP_NOT_LOWERED.to_string()),
            other => Err(format!("{}: no lowering", other.as_str())),
        })
        .collect()
}

/// Per row: cos(x_r, y_r) on values scaled by the row's max|x| and max|y| (the cosine is
/// scale-free), `[R, 1]`; NaN for a padding row or a zero vector, as the kernel.
fn cos_rows(g: &mut Graph, xz: NodeId, yz: NodeId, keep: NodeId, zero: NodeId, one: NodeId, nan: NodeId) -> NodeId {
    let ax = g.abs(xz);
    let ay = g.abs(yz);
    let mx = reduce_keep(g, ax, ReduceOp::Max, 1);
    let my = reduce_keep(g, ay, ReduceOp::Max, 1);
    let px = cmp(g, CmpOp::Gt, mx, zero);
    let py = cmp(g, CmpOp::Gt, my, zero);
    let mx1 = where_(g, px, mx, one);
    let my1 = where_(g, py, my, one);
    let xs = g.div(xz, mx1);
    let ys = g.div(yz, my1);
    let xx = g.mul(xs, xs);
    let yy = g.mul(ys, ys);
    let xy = g.mul(xs, ys);
    let rx = reduce_keep(g, xx, ReduceOp::Sum, 1);
    let ry = reduce_keep(g, yy, ReduceOp::Sum, 1);
    let rxy = reduce_keep(g, xy, ReduceOp::Sum, 1);
    let nx = g.sqrt(rx);
    let ny = g.sqrt(ry);
    let den = g.mul(nx, ny);
    let c = g.div(rxy, den);
    let pxf = as_f32(g, px);
    let pyf = as_f32(g, py);
    let kf = as_f32(g, keep);
    let ok = g.mul(pxf, pyf);
    let ok = g.mul(ok, kf);
    let half = k(g, &[1, 1], 0.5);
    let ok = cmp(g, CmpOp::Gt, ok, half);
    let c = where_(g, ok, c, nan);
    finite_or_nan(g, c)
}
