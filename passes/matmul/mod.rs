//! `matmul`: tap every matmul site (MatMul of any rank, DequantMatMul, fused matmuls) and
//! sketch its operands and output.

use rlx_ir::{NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Range, Stats, Word, Words};
use crate::rewrite::Rewrite;
use crate::sketch::{static_dims, HistRange, SketchSpec, TAP_STATS};

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over site names (ONNX node names without the leading '/', else matmul.K)");
const ROLES: Opt<Words> = Opt::words(
    "roles",
    &["lhs", "rhs", "out"],
    "[lhs,rhs,out]",
    "which tensors to sketch: lhs (activation), rhs (weight or 2nd operand), out",
);
const STATS: Opt<Stats> = Opt::stats(
    "stats",
    TAP_STATS,
    "[all]",
    "statistics to compute (count is always recorded; hist adds hist_lo/hist_hi/hist_outside; all = every one but the opt-in hash)",
);
const HIST_BINS: Opt<u64> = Opt::uint("hist_bins", 1, 65536, "32", "value-histogram bins");
const HIST_RANGE: Opt<Range> = Opt::range(
    "hist_range",
    "absmax",
    "histogram range: absmax = [-max|x|, max|x|] per tensor and run, or a fixed LO:HI",
);
const ELEMSIG: Opt<u64> = Opt::uint(
    "elemsig",
    1,
    65536,
    "16",
    "elements sampled at evenly spaced flat indices (exact-repeat detection)",
);

const PADDING: Opt<Word> = Opt::word(
    "padding",
    &["exclude", "include"],
    "exclude",
    "exclude: rows of an activation at padding positions (graph input attention_mask, one value per row) add to no statistic; include: every row counts",
);

const LOWER: Opt<bool> = Opt::bool(
    "lower",
    "false",
    "compute sketches with RLX primitive ops (the lowering a device without a native sketch kernel uses) even on the CPU; statistics it cannot compute are listed in the manifest",
);

const OPTIONS: &[OptionSpec] =
    &[SITES.spec, ROLES.spec, STATS.spec, HIST_BINS.spec, HIST_RANGE.spec, ELEMSIG.spec, PADDING.spec, LOWER.spec];

/// The `matmul` tap pass.
pub struct MatmulTap;

/// One logical matmul inside a horizontally merged one: RLX's fusion turns
/// `x@Wq, x@Wk, x@Wv` into `narrow_i(x @ concat(Wq, Wk, Wv))`.
struct Part {
    /// The weight parameter node (an input of the concat).
    weight: NodeId,
    /// Its name.
    param: String,
    /// The narrow node holding this part's output.
    out: NodeId,
}

/// The parts of a merged matmul `id`, if its rhs is a last-axis concat of parameters and its
/// users are last-axis narrows that cover exactly the concat's segments.
fn merged_parts(rw: &Rewrite, id: NodeId, rhs: NodeId) -> Option<Vec<Part>> {
    let g = rw.graph();
    let cat = g.node(rhs);
    let Op::Concat { axis } = cat.op else { return None };
    if axis + 1 != cat.shape.rank() || cat.inputs.len() < 2 {
        return None;
    }
    let out_axis = g.node(id).shape.rank().checked_sub(1)?;
    let mut parts = Vec::new();
    let mut start = 0usize;
    let users = rw.users(id); // O(nodes): only reached for a matmul whose rhs is a concat
    for &w in &cat.inputs {
        let wn = g.node(w);
        let Op::Param { name } = &wn.op else { return None };
        let len = static_dims(&wn.shape)?.get(axis).copied()?;
        let narrow = users.iter().copied().find(|&u| {
            matches!(g.node(u).op, Op::Narrow { axis: a, start: s, len: l } if a == out_axis && s == start && l == len)
        })?;
        parts.push(Part { weight: w, param: name.clone(), out: narrow });
        start += len;
    }
    // Every user must be one of the parts' narrows: otherwise the merged output is used whole.
    if users.iter().all(|u| parts.iter().any(|p| p.out == *u)) {
        Some(parts)
    } else {
        None
    }
}

/// Operand node ids `(lhs, rhs)` if `op` is a matmul site. (The packed weight of a
/// DequantMatMul is not f32: its rhs is reported as skipped by the sketch planner.)
fn matmul_operands(op: &Op, inputs: &[NodeId]) -> Option<(NodeId, Option<NodeId>)> {
    match op {
        Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual | Op::DequantMatMul { .. } => {
            Some((*inputs.first()?, inputs.get(1).copied()))
        }
        _ => None,
    }
}

/// The roles a `roles=[..]` option selects, in the order lhs, rhs, out.
pub(crate) fn selected_roles(opts: &Options, key: &Opt<Words>) -> Vec<Role> {
    [Role::LHS, Role::RHS, Role::OUT].into_iter().filter(|r| opts.get(key).is_ok_and(|v| v.iter().any(|w| w == r.as_str()))).collect()
}

/// Every logical matmul site of the graph as `(site name, node, lhs, rhs, out)`: one per
/// matmul node, and one per part of a horizontally merged Q/K/V matmul (named after the source
/// graph's site of its weight). Shared with the `capture` pass, so both name sites alike.
pub(crate) fn logical_sites(rw: &Rewrite) -> Vec<(String, NodeId, NodeId, Option<NodeId>, NodeId)> {
    let nodes: Vec<NodeId> = rw.original_nodes().collect();
    // (site name, node, lhs, rhs, out) of every logical site.
    let mut sites: Vec<(String, NodeId, NodeId, Option<NodeId>, NodeId)> = Vec::new();
    for id in nodes {
        let node = rw.graph().node(id);
        let Some((lhs, rhs)) = matmul_operands(&node.op, &node.inputs) else {
            continue;
        };
        let parts = match (&node.op, rhs) {
            (Op::MatMul, Some(r)) => merged_parts(rw, id, r),
            _ => None,
        };
        match parts {
            Some(parts) => {
                let whole = rw.site_name(id);
                for (i, p) in parts.into_iter().enumerate() {
                    let name = rw
                        .source_name_for_param("matmul", &p.param)
                        .unwrap_or_else(|| format!("{whole}[{i}]"));
                    sites.push((name, id, lhs, Some(p.weight), p.out));
                }
            }
            None => sites.push((rw.site_name(id), id, lhs, rhs, id)),
        }
    }
    sites
}

impl Pass for MatmulTap {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "sketch lhs, rhs and out of every MatMul, DequantMatMul and fused matmul"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let roles = selected_roles(opts, &ROLES);
        let stats = opts.stats(&STATS)?;
        let hist_range = match opts.get(&HIST_RANGE)? {
            Some((lo, hi)) => HistRange::Fixed { lo, hi },
            None => HistRange::Absmax,
        };
        let hist_bins = opts.get(&HIST_BINS)? as usize;
        let elemsig = opts.get(&ELEMSIG)? as usize;
        let exclude_padding = opts.get(&PADDING)? == "exclude";
        rw.force_lowering(opts.get(&LOWER)?);

        rw.note_removed(|op| crate::rewrite::family(op) == "matmul");
        let sites = logical_sites(rw);
        // The plan depends only on the shape (the options are the pass's), and a model's
        // tensors share a few shapes: each is planned once.
        let mut plans: Vec<(rlx_ir::Shape, Result<crate::sketch::Planned, crate::sketch::Unsketchable>)> = Vec::new();
        let mut plan_for = |shape: &rlx_ir::Shape| {
            let i = match plans.iter().position(|(s, _)| s == shape) {
                Some(i) => i,
                None => {
                    plans.push((shape.clone(), SketchSpec::for_shape(shape, &stats, hist_bins, hist_range, elemsig)));
                    plans.len() - 1
                }
            };
            plans[i].1.clone()
        };
        for (site_name, id, lhs, rhs, out) in sites {
            if !patterns.matches(&site_name) {
                continue;
            }
            // FLOPs of one execution: 2 * numel(out) * K, K = lhs's last dim. This is
            // 2 x batch x M x K x N for batched (and broadcast) shapes.
            let out_dims = static_dims(&rw.graph().node(out).shape);
            let k = static_dims(&rw.graph().node(lhs).shape).and_then(|d| d.last().copied());
            let flops = match (out_dims, k) {
                (Some(d), Some(k)) => Some(2 * d.iter().product::<usize>() as u64 * k as u64),
                _ => None,
            };
            let site = rw.add_site_named(id, site_name, flops);
            for role in &roles {
                let role = role.clone();
                let tensor = if role == Role::LHS {
                    Some(lhs)
                } else if role == Role::RHS {
                    rhs
                } else {
                    Some(out)
                };
                let Some(tensor) = tensor else {
                    rw.skip(&site, Some(role), None, "the op has no such operand".into());
                    continue;
                };
                let shape = rw.graph().node(tensor).shape.clone();
                match plan_for(&shape) {
                    Ok(plan) => {
                        for (stat, why) in plan.dropped {
                            rw.skip(&site, Some(role.clone()), Some(tensor), format!("{} not computed: {why}", stat.as_str()));
                        }
                        // An activation with one row per token ([B, S, *]), or per head and token
                        // ([B, H, S, *]: attention's Q, scores, probabilities, context as lhs or
                        // out; an rhs such as K^T [B, H, D, S] has no token rows) leaves its
                        // padding rows out.
                        let rows = plan.spec.rows;
                        let per_head = match static_dims(&shape) {
                            Some(d) if d.len() == 4 && role != Role::RHS => Some(d[0] * d[2]),
                            _ => None,
                        };
                        let mask = if exclude_padding && rows > 0 && rw.is_dynamic(tensor) {
                            rw.row_mask(rows).or_else(|| per_head.and_then(|n| rw.row_mask(n)))
                        } else {
                            None
                        };
                        match mask {
                            Some(m) => {
                                // The view has the tensor's elements and channels, so its plan is
                                // the tensor's (the fallback is never taken).
                                let viewed = sequence_view(rw, tensor, m).and_then(|(view, dims)| {
                                    let plan = SketchSpec::for_shape(&rlx_ir::Shape::new(&dims, shape.dtype()), &stats, hist_bins, hist_range, elemsig);
                                    plan.ok().map(|p| (view, p.spec))
                                });
                                let (t, spec) = viewed.unwrap_or((tensor, plan.spec));
                                rw.tap_inputs(&site, role, &[t, m], spec)
                            }
                            None => rw.tap(&site, role, tensor, plan.spec),
                        }
                    }
                    Err(why) => rw.skip(&site, Some(role), Some(tensor), why.to_string()),
                }
            }
        }
        Ok(())
    }
}

/// A `[B, S, C]` view of a flattened `[B x S, C]` activation whose padding mask is `[B, S]`
/// with `B > 1` (a decoder that folds the batch into its rows, such as opscope-lab's SmolLM2
/// graphs; a decode step's `[B, C]` with a `[B, 1]` mask is B sequences of one token): the
/// sketch then pairs adjacent rows for `adj_sumsq` within a sequence only, never across two
/// (the kernel pairs along the second-to-last axis), and the recording's `shape` gives the
/// miner the same geometry. A Reshape shares its input's buffer; it feeds only the sketch.
/// `None` for any other tensor or mask (an encoder's `[B, S, C]` already has the axis).
fn sequence_view(rw: &mut Rewrite, tensor: NodeId, mask: NodeId) -> Option<(NodeId, [usize; 3])> {
    let d = static_dims(&rw.graph().node(tensor).shape)?;
    let m = static_dims(&rw.graph().node(mask).shape)?;
    if d.len() != 2 || m.len() != 2 || m[0] < 2 || m[0] * m[1] != d[0] {
        return None;
    }
    let dims = [m[0], m[1], d[1]];
    let shape = rlx_ir::Shape::new(&dims, rw.graph().node(tensor).shape.dtype());
    let view = rw.graph_append().reshape(tensor, dims.iter().map(|&x| x as i64).collect(), shape);
    rw.graph_append().node_mut(view).name = Some(format!("{}{}", crate::rewrite::SEQ_VIEW, tensor.0));
    Some((view, dims))
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&MatmulTap) }
