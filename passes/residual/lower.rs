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
//! `out_median_abs` sorts |x + f(x)| of the kept finite elements with RLX's `Sort` (the others
//! set to +Inf, so they sort last) and picks positions `floor((n - 1) / 2)` and `floor(n / 2)`
//! (`n` the run-time kept count) with an exact one-hot sum; the mean of the two middle values
//! is formed in f32 as `(a + b) * 0.5`, equal to the kernel's f64 mean rounded to f32 (halving
//! is exact) unless `a + b` overflows f32. `out_top` takes RLX's `TopK` over |x + f(x)| (ties to
//! the smaller flat index, as the op documents: the kernel's row-major first-wins order), and
//! recovers the signed value, row `floor(i / D)` and channel by exact f32 arithmetic on the
//! index. Both are exact, for at most 2^24 elements (f32 indices); above that, and for fewer
//! elements than [`TOP`] entries, they are not lowered.
//!
//! A non-finite element makes the kernel's f64 sums non-finite; the lowering's scaled sums are
//! NaN there (the recorder drops NaN): inputs with Inf/NaN in the stream are outside this
//! lowering's agreement.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{Graph, NodeId};

use super::probe::{stats, ResidualProbe, TOP};
use crate::sketch::lower::prim::{as_f32, cmp, finite_or_nan, k, reduce_keep, total, values, where_};
use rlx_ir::op::Activation;
use rlx_ir::{DType, Op, Shape};
use crate::sketch::probe::LoweredStat;
use crate::sketch::Stat;

/// Most elements whose flat index f32 holds exactly (the median's and top's positions).
const MAX_EXACT_INDEX: usize = 1 << 24;

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
            stats::OUT_MEDIAN_ABS | stats::OUT_TOP if r * d > MAX_EXACT_INDEX => {
                Err(format!("not lowered above {MAX_EXACT_INDEX} elements (flat positions held in f32)"))
            }
            stats::OUT_TOP if r * d < TOP => Err(format!("not lowered for fewer than {TOP} elements (TopK needs k <= the axis)")),
            stats::OUT_MEDIAN_ABS | stats::OUT_TOP => Ok(order_stat(g, s == stats::OUT_MEDIAN_ABS, y, keep, r * d)),
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

/// `out_median_abs` (`median` true, `[1]`) or `out_top` (`[3 * TOP]`) of `y` (`[R, D]`) over
/// the kept finite elements; see the module docs.
fn order_stat(g: &mut Graph, median: bool, y: NodeId, keep: NodeId, n: usize) -> NodeId {
    let d = crate::sketch::static_dims(g.shape(y)).expect("static")[1];
    let a = g.abs(y);
    let inf = k(g, &[1, 1], f32::INFINITY);
    let fin = cmp(g, CmpOp::Lt, a, inf);
    let finf = as_f32(g, fin);
    let keepf = as_f32(g, keep);
    let okf = g.mul(finf, keepf); // [R, D]
    let half = k(g, &[1, 1], 0.5);
    let ok = cmp(g, CmpOp::Gt, okf, half);
    let cnt = total(g, okf, ReduceOp::Sum); // [1]
    let yflat = g.reshape_(y, vec![n as i64]);
    let iota: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let iota = values(g, &[n], &iota);
    let zero1 = k(g, &[1], 0.0);
    let nan1 = k(g, &[1], f32::NAN);
    // The element of `v` ([n]) at the run-time position `at` ([1]), by an exact one-hot sum.
    let pick = |g: &mut Graph, v: NodeId, at: NodeId| {
        let hit = cmp(g, CmpOp::Eq, iota, at);
        let z = where_(g, hit, v, zero1);
        total(g, z, ReduceOp::Sum)
    };
    let floor = |g: &mut Graph, x: NodeId| g.activation(Activation::Floor, x, Shape::new(&[1], DType::F32));
    if median {
        let key = where_(g, ok, a, inf);
        let key = g.reshape_(key, vec![n as i64]);
        let sorted = g.add_node(Op::Sort { axis: 0, descending: false }, vec![key], Shape::new(&[n], DType::F32));
        let one = k(g, &[1], 1.0);
        let halfc = k(g, &[1], 0.5);
        let nm1 = g.sub(cnt, one);
        let lo = g.mul(nm1, halfc);
        let lo = floor(g, lo);
        let hi = g.mul(cnt, halfc);
        let hi = floor(g, hi);
        let a_lo = pick(g, sorted, lo);
        let a_hi = pick(g, sorted, hi);
        let sum = g.add(a_lo, a_hi);
        let m = g.mul(sum, halfc);
        let some = cmp(g, CmpOp::Gt, cnt, zero1);
        return where_(g, some, m, nan1);
    }
    let neg = k(g, &[1, 1], -1.0);
    let key = where_(g, ok, a, neg);
    let key = g.reshape_(key, vec![1, n as i64]);
    let idx = g.add_node(Op::TopK { k: TOP }, vec![key], Shape::new(&[1, TOP], DType::F32));
    let dk = k(g, &[1], d as f32);
    let mut parts = Vec::with_capacity(3 * TOP);
    for t in 0..TOP {
        let it = g.narrow_(idx, 1, t, 1);
        let it = g.reshape_(it, vec![1]);
        let v = pick(g, yflat, it);
        let q = g.div(it, dk);
        let row = floor(g, q);
        // A backend whose f32 division is not correctly rounded (Vulkan allows 2.5 ULP, Metal
        // fast math) can put it/d just below an exact row: correct the row by the remainder,
        // exact in f32 (it < 2^24).
        let rd = g.mul(row, dk);
        let col = g.sub(it, rd);
        let zero1 = k(g, &[1], 0.0);
        let under = cmp(g, CmpOp::Lt, col, zero1);
        let over = cmp(g, CmpOp::Ge, col, dk);
        let one1 = k(g, &[1], 1.0);
        let down = g.sub(row, one1);
        let row = where_(g, under, down, row);
        let up = g.add(row, one1);
        let row = where_(g, over, up, row);
        let rd = g.mul(row, dk);
        let col = g.sub(it, rd);
        // Fewer kept finite elements than t + 1: NaN, as the kernel.
        let tc = k(g, &[1], t as f32 + 0.5);
        let have = cmp(g, CmpOp::Gt, cnt, tc);
        for x in [v, row, col] {
            parts.push(where_(g, have, x, nan1));
        }
    }
    g.concat_(parts, 0)
}
