//! A lowering of the tensor sketch ([`super::SKETCH_OP`]) into RLX primitive ops (reshape,
//! abs, compares, `Where`, casts, `Reduce` sum/max/min, narrow, concat), for a device that has
//! no native sketch kernel.
//!
//! The lowered subgraph yields the same `[len]` F32 vector as the kernel, laid out by
//! [`SketchSpec::layout`] (tag at 0), so the recorder, sinks and miner are unchanged. A
//! statistic the primitives cannot compute as the kernel defines it is filled with NaN, which
//! the recorder drops (it is *not computed*, never 0), and [`lower`] returns it with the reason
//! so the pass lists it in the manifest's `skipped`.
//!
//! # Accuracy (f32 graph arithmetic against the kernel's f64 sums)
//!
//! Every sum is taken in two levels, over the last axis then over rows (blocked summation:
//! error about `(C + R) * 2^-24` relative for non-negative terms, Higham 2nd ed. section 4.2),
//! on values scaled by the tensor's max|x| (by the row's for `pos_sumsq`), so squares and
//! fourth powers neither overflow nor underflow in f32 and are scaled back once. Counts are sums
//! of 0/1 values, exact below 2^24 elements. Measured against the kernel on the tests' fixtures:
//! within 1e-5 relative (`tests/lowering.rs`). `mean` is relative to mean|x| where it cancels,
//! as the kernel documents its own. The histogram of a fixed range compares each value with the
//! smallest f32 at or above each numpy edge (computed on the host in f64 at rewrite time), so its
//! counts equal the kernel's exactly.
//!
//! # Not lowered
//!
//! - `hist` (and `hist_outside`) with the `absmax` range: the edges depend on a run-time max|x|
//!   and numpy's f64 edges cannot be formed exactly in f32 graph arithmetic; RLX's `Histogram`
//!   op takes a compile-time range and truncates `(x - lo) * bins / width` in f32 without
//!   numpy's edge correction (rlx-cpu 0.2.19 `exec_histogram`), so counts at edges could differ.
//! - `hist` with more than [`MAX_LOWERED_BINS`] bins: one compare and sum per edge over the
//!   whole tensor.
//! - Any statistic of a tensor with a symbolic dim (the subgraph is built for static shapes).
//!
//! # Probes
//!
//! A probe sketch (attention, routing, residual) is lowered by its own probe
//! ([`super::TypedProbe::lower`], next to the probe in its pass) and laid out here by
//! [`lower_probe`]; the core knows no concrete probe. Each probe documents its own accuracy
//! and the statistics it does not lower.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{CmpOp, ReduceOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use super::{tensor, HistRange, SketchSpec, Stat};

/// Largest fixed-range histogram the lowering builds (one compare and one sum over the tensor
/// per edge: 257 full passes at this bound).
pub const MAX_LOWERED_BINS: usize = 256;

/// The lowered sketch's output node (`[spec.len()]` F32) and the statistics it leaves
/// undefined (NaN, dropped by the recorder) with the reason.
pub struct Lowered {
    /// Output node, `[len]` F32, the kernel's layout.
    pub node: NodeId,
    /// Statistics filled with NaN: not computed on the lowered path, and why.
    pub not_computed: Vec<(Stat, String)>,
}

/// True when RLX has a native kernel for the sketch op on `device`: opscope registers a CPU
/// kernel only (`rlx_cpu::op_registry`), and RLX 0.2.19 has no per-device kernel query for
/// other backends' custom ops, so every non-CPU device lowers.
pub fn native_kernel(device: rlx_runtime::Device) -> bool {
    device == rlx_runtime::Device::Cpu && rlx_cpu::op_registry::lookup_cpu_kernel(super::SKETCH_OP).is_some()
}

/// Why a tensor sketch cannot be lowered at all (every statistic then not computed).
/// A probe sketch is lowered by its probe ([`super::TypedProbe::lower`]); one whose probe has
/// none gives the probe's reason.
pub fn unlowerable(spec: &SketchSpec, shape: &Shape) -> Option<String> {
    if let super::Probe::Pass { name, params } = &spec.probe {
        let Some(k) = super::probe::lookup(name) else {
            return Some(format!("no linked pass registers the probe '{name}'"));
        };
        return k.lowering(params.get()).err();
    }
    if super::static_dims(shape).is_none() {
        return Some(format!("symbolic shape {}: the lowered sketch needs static dims", super::shape_text(shape)));
    }
    None
}

/// Build the lowered sketch of `x` (static shape, F32) with an optional row mask (`R` values,
/// or `B x S` for a per-head `[B, H, S, D]` tensor; a row whose mask is 0 adds to nothing).
/// Under `cache_param_invariant` a weight's lowered sketch is hoisted and records the kernel's
/// values under `run`, as the native op does (tested).
///
/// Requires [`unlowerable`] to be `None`. The mask is an F32 node of static shape.
///
/// Panics (a bug in the caller, which `Rewrite::tap_inputs` rules out) when `x` or the mask has
/// a symbolic dim, or a mask of neither `R` nor `B x S` values is given for `x` of rank < 4.
pub fn lower(g: &mut Graph, x: NodeId, mask: Option<NodeId>, spec: &SketchSpec) -> Lowered {
    let dims = super::static_dims(g.shape(x)).expect("lower: static dims (checked by unlowerable)");
    let c = dims.last().copied().unwrap_or(1).max(1);
    let n: usize = dims.iter().product();
    let r = n / c;
    let mut b = B { g, r, c };
    let xr = b.g.reshape_(x, vec![r as i64, c as i64]);

    // keep: [R,1] F32, 1 for a row that counts.
    let keep = mask.map(|m| {
        let mdims = super::static_dims(b.g.shape(m)).expect("static mask");
        let mn: usize = mdims.iter().product();
        let mf = if mn == r {
            b.g.reshape_(m, vec![r as i64, 1])
        } else {
            // Per-head [B, H, S, D] with a [B, S] mask: broadcast over heads.
            let (bb, h, s) = (dims[0], dims[1], dims[2]);
            let m4 = b.g.reshape_(m, vec![bb as i64, 1, s as i64, 1]);
            let ones = b.g.full(&[1, h, 1, 1], 1.0, DType::F32);
            let m4 = b.g.mul(m4, ones);
            b.g.reshape_(m4, vec![r as i64, 1])
        };
        let zero = b.k(0.0);
        let ne = b.cmp(CmpOp::Ne, mf, zero);
        b.g.cast(ne, DType::F32)
    });
    let absx = b.g.abs(xr);
    let inf = b.k(f32::INFINITY);
    let finite_b = b.cmp(CmpOp::Lt, absx, inf);
    let mut validf = b.g.cast(finite_b, DType::F32);
    if let Some(k) = keep {
        validf = b.g.mul(validf, k);
    }
    let half = b.k(0.5);
    let valid = b.cmp(CmpOp::Gt, validf, half);
    let zero = b.k(0.0);
    let xz = b.where_(valid, xr, zero);
    let az = b.g.abs(xz);

    let count = b.total(validf, ReduceOp::Sum);
    let pinf = b.k(f32::INFINITY);
    let ninf = b.k(f32::NEG_INFINITY);
    let for_min = b.where_(valid, xr, pinf);
    let for_max = b.where_(valid, xr, ninf);
    let min0 = b.total(for_min, ReduceOp::Min);
    let max0 = b.total(for_max, ReduceOp::Max);
    let zero1 = b.k1(0.0);
    let nan1 = b.k1(f32::NAN);
    let defined = b.cmp(CmpOp::Gt, count, zero1);
    // `+ 0` writes a zero extreme as +0 (-0 + 0 = +0), as the native kernel does.
    let min0 = b.g.add(min0, zero1);
    let max0 = b.g.add(max0, zero1);
    let min = b.where_(defined, min0, nan1);
    let max = b.where_(defined, max0, nan1);
    // s = max|x| over valid values (0 when none); safe = s, or 1 where s is 0.
    let s = b.total(az, ReduceOp::Max);
    let s_pos = b.cmp(CmpOp::Gt, s, zero1);
    let one1 = b.k1(1.0);
    let safe = b.where_(s_pos, s, one1);
    let xs = b.g.div(xz, safe); // [R,C] in [-1, 1]

    let tag_out = data_path_tag(b.g, xr, spec.tag);
    let mut pieces = vec![tag_out];
    let mut not_computed = Vec::new();
    let layout = spec.layout().expect("tensor layout");
    for slot in &layout {
        let len = slot.len;
        let piece = match slot.stat {
            tensor::COUNT => count,
            tensor::MIN => min,
            tensor::MAX => max,
            tensor::MEAN => {
                let sum = b.total(xs, ReduceOp::Sum);
                let m = b.g.div(sum, count);
                let m = b.g.mul(m, safe);
                // Clamped to [min, max] as the kernel's mean; NaN (0/0) for no finite value.
                let m = b.bin(rlx_ir::op::BinaryOp::Max, m, min);
                b.bin(rlx_ir::op::BinaryOp::Min, m, max)
            }
            tensor::L1 => {
                let l1 = b.total(az, ReduceOp::Sum);
                b.finite_or_nan(l1)
            }
            tensor::SUMSQ => {
                let sq = b.g.mul(xs, xs);
                let t = b.total(sq, ReduceOp::Sum);
                let t = b.g.mul(t, safe);
                let t = b.g.mul(t, safe);
                b.f32_sum_or_nan(t, s)
            }
            tensor::NNZ => {
                let nz = b.cmp(CmpOp::Ne, xz, zero);
                let nzf = b.g.cast(nz, DType::F32);
                b.total(nzf, ReduceOp::Sum)
            }
            tensor::KURTOSIS => {
                let sum = b.total(xs, ReduceOp::Sum);
                let mean_s = b.g.div(sum, count);
                let d = b.g.sub(xs, mean_s);
                let d = b.where_(valid, d, zero);
                let d2 = b.g.mul(d, d);
                let d4 = b.g.mul(d2, d2);
                let m2 = b.total(d2, ReduceOp::Sum);
                let m4 = b.total(d4, ReduceOp::Sum);
                let var = b.g.div(m2, count);
                let v2 = b.g.mul(var, var);
                let m4n = b.g.div(m4, count);
                let k = b.g.div(m4n, v2);
                // Undefined for a constant: every scaled value is exactly 1 (v / v), the mean
                // of n ones (n < 2^24) exactly 1, so m2 = 0 and k = 0/0 = NaN; likewise for no
                // finite value. Kurtosis is >= 1: anything below is f32 trouble, not recorded.
                let k = b.finite_or_nan(k);
                let ge1 = b.k1(0.999);
                let ok = b.cmp(CmpOp::Gt, k, ge1);
                b.where_(ok, k, nan1)
            }
            tensor::HIST_LO | tensor::HIST_HI => {
                let v = match spec.hist_range {
                    HistRange::Fixed { lo, hi } => b.k1(if slot.stat == tensor::HIST_LO { lo } else { hi }),
                    HistRange::Absmax => {
                        let m = b.where_(s_pos, s, one1);
                        if slot.stat == tensor::HIST_LO {
                            b.g.neg(m)
                        } else {
                            m
                        }
                    }
                };
                b.where_(defined, v, nan1)
            }
            tensor::HIST | tensor::HIST_OUTSIDE => match spec.hist_range {
                HistRange::Absmax => {
                    not_computed.push((
                        slot.stat,
                        "not lowered for the absmax range: numpy's f64 edges of a run-time range cannot be formed exactly in f32 graph ops, and RLX's Histogram op takes a compile-time range (use hist_range=LO:HI, or the native CPU kernel)".to_string(),
                    ));
                    b.nan(len)
                }
                HistRange::Fixed { .. } if spec.hist_bins > MAX_LOWERED_BINS => {
                    not_computed.push((slot.stat, format!("not lowered above {MAX_LOWERED_BINS} bins (one pass over the tensor per edge)")));
                    b.nan(len)
                }
                HistRange::Fixed { lo, hi } => {
                    let (bins, outside) = b.fixed_hist(xr, validf, count, lo, hi, spec.hist_bins);
                    if slot.stat == tensor::HIST {
                        bins
                    } else {
                        outside
                    }
                }
            },
            tensor::ELEMSIG => {
                let flat = b.g.reshape_(x, vec![n as i64]);
                let keep_flat = keep.map(|k| b.g.reshape_(k, vec![r as i64]));
                let mut vals = Vec::new();
                for j in 0..len {
                    let at = j * n / len.max(1);
                    let v = b.g.narrow_(flat, 0, at, 1);
                    let v = match keep_flat {
                        Some(kf) => {
                            let kr = b.g.narrow_(kf, 0, at / c, 1);
                            let half1 = b.k1(0.5);
                            let kept = b.cmp(CmpOp::Gt, kr, half1);
                            b.where_(kept, v, nan1)
                        }
                        None => v,
                    };
                    vals.push(v);
                }
                b.cat(vals)
            }
            tensor::CHAN_MAXABS => {
                // No counted value (every row padding or non-finite): NaN, as the kernel writes.
                let ch = b.chan_maxabs(az);
                let any = b.cmp(CmpOp::Gt, count, zero1);
                let (z, n1) = (b.k1(0.0), b.k1(f32::NAN));
                let add = b.where_(any, z, n1);
                b.g.add(ch, add)
            }
            tensor::CHAN_OUTLIER => {
                let ch = b.chan_maxabs(az); // [C]
                let peak = b.reduce(ch, ReduceOp::Max, 0);
                let sum = b.reduce(ch, ReduceOp::Sum, 0);
                let cc = b.k1(c as f32);
                let mean_c = b.g.div(sum, cc);
                let pos = b.cmp(CmpOp::Gt, mean_c, zero1);
                let o = b.g.div(peak, mean_c);
                b.where_(pos, o, nan1)
            }
            tensor::POS_SUMSQ => {
                // Per row, scaled by the row's max|x| (rm): sum((x/rm)^2) * rm * rm.
                let rm = b.g.reduce(az, ReduceOp::Max, vec![1], true, Shape::new(&[r, 1], DType::F32));
                let rpos = b.cmp(CmpOp::Gt, rm, zero);
                let one = b.k(1.0);
                let rsafe = b.where_(rpos, rm, one);
                let xq = b.g.div(xz, rsafe);
                let sq = b.g.mul(xq, xq);
                let p = b.g.reduce(sq, ReduceOp::Sum, vec![1], true, Shape::new(&[r, 1], DType::F32));
                let p = b.g.mul(p, rsafe);
                let p = b.g.mul(p, rsafe);
                let p = b.f32_sum_or_nan(p, rm);
                let p = match keep {
                    Some(k) => {
                        let kept = b.cmp(CmpOp::Gt, k, half);
                        let nan = b.k(f32::NAN);
                        b.where_(kept, p, nan)
                    }
                    None => p,
                };
                b.g.reshape_(p, vec![r as i64])
            }
            tensor::ROW_ABSMAX => {
                let rm = b.g.reduce(az, ReduceOp::Max, vec![1], true, Shape::new(&[r, 1], DType::F32));
                let rm = match keep {
                    Some(k) => {
                        let kept = b.cmp(CmpOp::Gt, k, half);
                        let nan = b.k(f32::NAN);
                        b.where_(kept, rm, nan)
                    }
                    None => rm,
                };
                b.g.reshape_(rm, vec![r as i64])
            }
            tensor::NAN_COUNT | tensor::POSINF_COUNT | tensor::NEGINF_COUNT => {
                let hit = match slot.stat {
                    tensor::NAN_COUNT => b.cmp(CmpOp::Ne, xr, xr),
                    tensor::POSINF_COUNT => b.cmp(CmpOp::Eq, xr, pinf),
                    _ => b.cmp(CmpOp::Eq, xr, ninf),
                };
                let mut f = b.g.cast(hit, DType::F32);
                if let Some(k) = keep {
                    f = b.g.mul(f, k);
                }
                b.total(f, ReduceOp::Sum)
            }
            tensor::ADJ_SUMSQ => {
                // Rows as [L, block, C] (block = the second-to-last dim): pairs (row - 1, row)
                // inside a block, both elements finite and both rows kept; on values / max|x|.
                let block = if dims.len() >= 2 { dims[dims.len() - 2].max(1) } else { 1 };
                if block < 2 || r % block != 0 {
                    b.k1(0.0)
                } else {
                    let l = (r / block) as i64;
                    let (bl, cc) = (block as i64, c as i64);
                    let x3 = b.g.reshape_(xs, vec![l, bl, cc]);
                    let v3 = b.g.reshape_(validf, vec![l, bl, cc]);
                    let cur = b.g.narrow_(x3, 1, 1, block - 1);
                    let prev = b.g.narrow_(x3, 1, 0, block - 1);
                    let vc = b.g.narrow_(v3, 1, 1, block - 1);
                    let vp = b.g.narrow_(v3, 1, 0, block - 1);
                    let both = b.g.mul(vc, vp);
                    let d = b.g.sub(cur, prev);
                    let sq = b.g.mul(d, d);
                    let sq = b.g.mul(sq, both); // xs is 0 where not valid; both masks the pair
                    let pairs = (r / block * (block - 1)) as i64;
                    let sq = b.g.reshape_(sq, vec![pairs, cc]);
                    let saved = b.r;
                    b.r = pairs as usize;
                    let t = b.total(sq, ReduceOp::Sum);
                    b.r = saved;
                    let scaled = t;
                    let t = b.g.mul(t, safe);
                    let t = b.g.mul(t, safe);
                    // An exact zero (identical rows) is recorded; a non-zero sum f32 cannot hold
                    // is not.
                    let t = b.f32_sum_or_nan(t, scaled);
                    b.where_(s_pos, t, zero1)
                }
            }
            other => {
                not_computed.push((other, "no lowering into RLX primitive ops yet".to_string()));
                b.nan(len)
            }
        };
        pieces.push(piece);
    }
    let out = b.cat(pieces);
    Lowered { node: out, not_computed }
}

/// Build the lowering of a probe sketch reading `inputs` (the sketch op's inputs) with its
/// probe's [`super::TypedProbe::lower`], laid out as the kernel's output (tag at 0, then each
/// statistic's slot; a statistic the probe cannot lower is NaN and returned with the reason).
///
/// Requires [`unlowerable`] to be `None` (a registered probe with a lowering).
///
/// Errors: the probe's parameters do not decode, or a lowered statistic's node does not hold
/// its slot's length (a bug in the probe's lowering, reported rather than recorded shifted).
pub fn lower_probe(g: &mut Graph, inputs: &[NodeId], spec: &SketchSpec) -> Result<Lowered, String> {
    let super::Probe::Pass { name, params } = &spec.probe else {
        return Err("lower_probe: a tensor sketch (use lower)".into());
    };
    let k = super::probe::lookup(name).ok_or_else(|| format!("no linked pass registers the probe '{name}'"))?;
    let layout = spec.layout()?;
    for &x in inputs {
        if super::static_dims(g.shape(x)).is_none() {
            return Err(format!("symbolic shape {}: the lowered probe needs static dims", super::shape_text(g.shape(x))));
        }
    }
    // A lowering builds on the geometry the pass read from the graph; should it not fit the
    // inputs (a shape the pass did not foresee), the graph helpers panic. That must not end the
    // caller's compile: the probe is then skipped with the reason, and the nodes it had added,
    // which no output reads, are dead code RLX removes.
    let mut scratch = g.clone();
    let lowered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let pieces = k.lower(params.get(), &mut scratch, inputs, &spec.stats);
        (scratch, pieces)
    }));
    let pieces = match lowered {
        Ok((built, pieces)) => {
            *g = built;
            pieces?
        }
        Err(panic) => {
            let what = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("a panic");
            return Err(format!("probe {name}: the lowering does not fit these inputs ({what})"));
        }
    };
    if pieces.len() != layout.len() {
        return Err(format!("probe {name}: lowering gave {} statistics for {}", pieces.len(), layout.len()));
    }
    let mut out = vec![match inputs.first() {
        Some(&x) => data_path_tag(g, x, spec.tag),
        None => g.full(&[1], spec.tag as f32, DType::F32),
    }];
    let mut not_computed = Vec::new();
    for (slot, piece) in layout.iter().zip(pieces) {
        match piece {
            Ok(node) => {
                let n = super::static_dims(g.shape(node)).map(|d| d.iter().product::<usize>());
                if n != Some(slot.len) {
                    return Err(format!("probe {name}: lowered {} holds {n:?} values, the layout {}", slot.stat.as_str(), slot.len));
                }
                out.push(g.reshape_(node, vec![slot.len as i64]));
            }
            Err(why) => {
                not_computed.push((slot.stat, why));
                out.push(g.full(&[slot.len], f32::NAN, DType::F32));
            }
        }
    }
    let node = if out.len() == 1 { out[0] } else { g.concat_(out, 0) };
    Ok(Lowered { node, not_computed })
}

/// The `[1]` F32 tag slot of a lowered sketch, computed through the data path: the tag when
/// every row of `x` (leading dims flattened, `C` = last dim) counts `C` elements in the
/// sketch's own compare, cast and two-level sum, else NaN, which the recorder refuses
/// ("carries tag NaN, which no compile has"). It catches a backend that hands those reductions
/// zeros or another buffer (RLX 0.2.19's wgpu backend reads an operand outside its arena
/// stripe as zeros, and says so on stderr). It cannot tell an operand `x` that reads as zeros
/// from a tensor of zeros, and a statistic's own chain can still fail alone: a guard, not a
/// proof. Each row's drift `count - C` is exact (C < 2^24) and 0 when all is well, and NaN is
/// not a tag, so no drift can be mistaken for another compile's tag. |x| is never -1 and
/// NaN != -1, so every element counts on a backend that keeps IEEE NaN semantics; one that
/// does not (fast math) can refuse a run holding NaN, never record a wrong one. A symbolic
/// shape, or a last dim of 2^24 or more, gets the constant tag.
pub fn data_path_tag(g: &mut Graph, x: NodeId, tag: u32) -> NodeId {
    let tag1 = g.full(&[1], tag as f32, DType::F32);
    let Some(dims) = super::static_dims(g.shape(x)) else {
        return tag1;
    };
    let n: usize = dims.iter().product();
    let c = dims.last().copied().unwrap_or(1).max(1);
    if n == 0 || c >= 1 << 24 {
        return tag1;
    }
    let r = n / c;
    let xf = if g.shape(x).dtype() == DType::F32 { x } else { g.cast(x, DType::F32) };
    let x2 = g.reshape_(xf, vec![r as i64, c as i64]);
    let a = g.abs(x2);
    let neg1 = g.full(&[1], -1.0, DType::F32);
    let s = rlx_ir::shape::compare_shape(g.shape(a), g.shape(neg1)).expect("compare shape");
    let seen = g.add_node(Op::Compare(CmpOp::Ne), vec![a, neg1], s);
    let seen = g.cast(seen, DType::F32);
    let rows = g.reduce(seen, ReduceOp::Sum, vec![1], false, Shape::new(&[r], DType::F32));
    let cc = g.full(&[1], -(c as f32), DType::F32);
    let drift = g.add(rows, cc);
    let drift = g.abs(drift);
    let drift = g.reduce(drift, ReduceOp::Sum, vec![0], true, Shape::new(&[1], DType::F32));
    let zero = g.full(&[1], 0.0, DType::F32);
    let s = rlx_ir::shape::compare_shape(g.shape(drift), g.shape(zero)).expect("compare shape");
    let ok = g.add_node(Op::Compare(CmpOp::Eq), vec![drift, zero], s);
    let nan = g.full(&[1], f32::NAN, DType::F32);
    prim::where_(g, ok, tag1, nan)
}

/// Primitive-op helpers for probes' lowerings (shapes inferred by broadcasting).
pub mod prim {
    use rlx_ir::infer::GraphExt;
    use rlx_ir::op::{BinaryOp, CmpOp, ReduceOp};
    use rlx_ir::{DType, Graph, NodeId, Op, Shape};

    /// A constant of shape `dims` (use `[1]` or `[1, 1]` to broadcast).
    pub fn k(g: &mut Graph, dims: &[usize], v: f32) -> NodeId {
        g.full(dims, v, DType::F32)
    }
    /// A constant F32 tensor of shape `dims` holding `vals` (row-major; `vals.len()` must be
    /// the element count).
    pub fn values(g: &mut Graph, dims: &[usize], vals: &[f32]) -> NodeId {
        assert_eq!(dims.iter().product::<usize>(), vals.len(), "values: shape and data disagree");
        let data = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        g.add_node(Op::Constant { data }, vec![], Shape::new(dims, DType::F32))
    }
    /// `a op b` as a Bool tensor (broadcast).
    pub fn cmp(g: &mut Graph, op: CmpOp, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::compare_shape(g.shape(a), g.shape(b)).expect("compare shape");
        g.add_node(Op::Compare(op), vec![a, b], s)
    }
    /// `a` where `cond`, else `b` (broadcast, F32). RLX 0.2.19's CPU `Where` does not
    /// broadcast its condition (measured: a `[R, 1]` condition against `[R, D]` values gave
    /// wrong rows), so a condition smaller than the result is first expanded to its shape.
    pub fn where_(g: &mut Graph, cond: NodeId, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::binary_shape(g.shape(a), g.shape(b)).expect("where shape");
        let s = rlx_ir::shape::binary_shape(&s, &g.shape(cond).clone().with_dtype(DType::F32)).expect("where shape");
        let cond = if g.shape(cond).dims() != s.dims() {
            let c = g.cast(cond, DType::F32);
            let ones = g.full(&super::super::static_dims(&s).expect("static dims"), 1.0, DType::F32);
            let c = g.mul(c, ones);
            let zero = g.full(&[1], 0.0, DType::F32);
            cmp(g, CmpOp::Ne, c, zero)
        } else {
            cond
        };
        g.add_node(Op::Where, vec![cond, a, b], s)
    }
    /// `a op b` (broadcast).
    pub fn bin(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::binary_shape(g.shape(a), g.shape(b)).expect("binary shape");
        g.binary(op, a, b, s)
    }
    /// `op` over `axis` of `x`, keeping the axis (length 1).
    pub fn reduce_keep(g: &mut Graph, x: NodeId, op: ReduceOp, axis: usize) -> NodeId {
        let mut dims = super::super::static_dims(g.shape(x)).expect("static dims");
        dims[axis] = 1;
        g.reduce(x, op, vec![axis], true, Shape::new(&dims, DType::F32))
    }
    /// `op` over every element of `x`, as `[1]`: over the last axis first, then the rest (the
    /// two-level summation of [`super::lower`]'s accuracy notes).
    pub fn total(g: &mut Graph, x: NodeId, op: ReduceOp) -> NodeId {
        let dims = super::super::static_dims(g.shape(x)).expect("static dims");
        let c = dims.last().copied().unwrap_or(1).max(1);
        let r = dims.iter().product::<usize>() / c;
        let x2 = g.reshape_(x, vec![r as i64, c as i64]);
        let rows = g.reduce(x2, op, vec![1], false, Shape::new(&[r], DType::F32));
        g.reduce(rows, op, vec![0], true, Shape::new(&[1], DType::F32))
    }
    /// 1.0 where `cond`, else 0.0 (F32).
    pub fn as_f32(g: &mut Graph, cond: NodeId) -> NodeId {
        g.cast(cond, DType::F32)
    }
    /// `v` where it is finite, else NaN.
    pub fn finite_or_nan(g: &mut Graph, v: NodeId) -> NodeId {
        let a = g.abs(v);
        let inf = k(g, &[1], f32::INFINITY);
        let ok = cmp(g, CmpOp::Lt, a, inf);
        let nan = k(g, &[1], f32::NAN);
        where_(g, ok, v, nan)
    }
}

/// Builder state: the graph and the `[R, C]` geometry.
struct B<'a> {
    g: &'a mut Graph,
    r: usize,
    c: usize,
}

impl B<'_> {
    /// A `[1, 1]` constant (broadcasts against `[R, C]` and `[R, 1]`).
    fn k(&mut self, v: f32) -> NodeId {
        self.g.full(&[1, 1], v, DType::F32)
    }
    /// A `[1]` constant.
    fn k1(&mut self, v: f32) -> NodeId {
        self.g.full(&[1], v, DType::F32)
    }
    fn nan(&mut self, len: usize) -> NodeId {
        self.g.full(&[len], f32::NAN, DType::F32)
    }
    fn cmp(&mut self, op: CmpOp, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::compare_shape(self.g.shape(a), self.g.shape(b)).expect("compare shape");
        self.g.add_node(Op::Compare(op), vec![a, b], s)
    }
    fn where_(&mut self, cond: NodeId, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::binary_shape(self.g.shape(a), self.g.shape(b)).expect("where shape");
        let s = rlx_ir::shape::binary_shape(&s, &self.g.shape(cond).clone().with_dtype(DType::F32)).expect("where shape");
        self.g.add_node(Op::Where, vec![cond, a, b], s)
    }
    fn bin(&mut self, op: rlx_ir::op::BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        let s = rlx_ir::shape::binary_shape(self.g.shape(a), self.g.shape(b)).expect("binary shape");
        self.g.binary(op, a, b, s)
    }
    /// Reduce a 1-D tensor to `[1]`.
    fn reduce(&mut self, x: NodeId, op: ReduceOp, axis: usize) -> NodeId {
        self.g.reduce(x, op, vec![axis], true, Shape::new(&[1], DType::F32))
    }
    /// Reduce `[R, C]` to `[1]`: over the last axis, then over rows.
    fn total(&mut self, x: NodeId, op: ReduceOp) -> NodeId {
        let rows = self.g.reduce(x, op, vec![1], false, Shape::new(&[self.r], DType::F32));
        self.reduce(rows, op, 0)
    }
    /// max |x| per channel: `[R, C]` (already |x|, 0 where not counted) to `[C]`.
    fn chan_maxabs(&mut self, az: NodeId) -> NodeId {
        self.g.reduce(az, ReduceOp::Max, vec![0], false, Shape::new(&[self.c], DType::F32))
    }
    fn cat(&mut self, pieces: Vec<NodeId>) -> NodeId {
        if pieces.len() == 1 {
            return pieces[0];
        }
        self.g.concat_(pieces, 0)
    }
    /// `v` where finite, else NaN (the kernel's `f32_or_nan` for a value above f32's range).
    fn finite_or_nan(&mut self, v: NodeId) -> NodeId {
        let a = self.g.abs(v);
        let inf = self.g.full(&[1], f32::INFINITY, DType::F32);
        let ok = self.cmp(CmpOp::Lt, a, inf);
        let nan = self.g.full(&[1], f32::NAN, DType::F32);
        self.where_(ok, v, nan)
    }
    /// A sum of squares `t` as the kernel records it: itself when finite and at least
    /// `f32::MIN_POSITIVE`; an exact 0 when `zero_if` is 0 (the scale it was multiplied by, or
    /// the sum before scaling); NaN otherwise (f32 cannot hold it to 6e-8 relative).
    fn f32_sum_or_nan(&mut self, t: NodeId, zero_if: NodeId) -> NodeId {
        let scale = zero_if;
        let t = self.finite_or_nan(t);
        let minp = self.g.full(&[1], f32::MIN_POSITIVE, DType::F32);
        let normal = self.cmp(CmpOp::Ge, t, minp);
        let zero = self.g.full(&[1], 0.0, DType::F32);
        let none = self.cmp(CmpOp::Eq, scale, zero);
        let nan = self.g.full(&[1], f32::NAN, DType::F32);
        let t2 = self.where_(normal, t, nan);
        self.where_(none, zero, t2)
    }
    /// numpy's histogram over a fixed `[lo, hi]`: `#(x >= E_i)` for the smallest f32 `E_i` at
    /// or above each f64 edge `np.linspace(lo, hi, bins + 1)[i]`, differenced; the last bin
    /// ends at `#(x > hi)`. Returns (`[bins]` counts, `[1]` finite values outside).
    fn fixed_hist(&mut self, xr: NodeId, validf: NodeId, count: NodeId, lo: f32, hi: f32, bins: usize) -> (NodeId, NodeId) {
        let (lo64, hi64) = (lo as f64, hi as f64);
        let step = (hi64 - lo64) / bins as f64;
        let ceil32 = |e: f64| {
            let f = e as f32;
            if (f as f64) < e {
                f.next_up()
            } else {
                f
            }
        };
        // at_least[i] = #(valid x >= E_i), i in 0..bins; above = #(valid x > hi).
        let mut at_least = Vec::with_capacity(bins + 1);
        for i in 0..bins {
            let e = ceil32(if i == 0 { lo64 } else { i as f64 * step + lo64 });
            let ek = self.k(e);
            let ge = self.cmp(CmpOp::Ge, xr, ek);
            let f = self.g.cast(ge, DType::F32);
            let f = self.g.mul(f, validf);
            at_least.push(self.total(f, ReduceOp::Sum));
        }
        let hk = self.k(hi);
        let gt = self.cmp(CmpOp::Gt, xr, hk);
        let f = self.g.cast(gt, DType::F32);
        let f = self.g.mul(f, validf);
        at_least.push(self.total(f, ReduceOp::Sum));
        let stacked = self.cat(at_least.clone()); // [bins + 1]
        let upper = self.g.narrow_(stacked, 0, 0, bins);
        let lower = self.g.narrow_(stacked, 0, 1, bins);
        let counts = self.g.sub(upper, lower);
        // outside = count - (#(x >= lo) - #(x > hi))
        let inside = self.g.sub(at_least[0], at_least[bins]);
        let outside = self.g.sub(count, inside);
        (counts, outside)
    }
}
