//! `matmul`: tap every matmul site (MatMul of any rank, DequantMatMul, fused matmuls) and
//! sketch its operands and output.

use rlx_ir::{NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{OptionSpec, OptionType, OptionValue, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::Rewrite;
use crate::sketch::{static_dims, HistRange, SketchSpec, Stat};

/// Words accepted by the `stats` option: every selectable statistic, plus `all`.
const STAT_WORDS: &[&str] = &[
    "all", "min", "max", "mean", "l1", "sumsq", "nnz", "kurtosis", "hist", "elemsig", "chan_maxabs",
    "chan_outlier", "pos_sumsq", "adj_sumsq", "nan_count", "posinf_count", "neginf_count",
];

const OPTIONS: &[OptionSpec] = &[
    OptionSpec {
        name: "sites",
        ty: OptionType::Globs,
        default: "[*]",
        doc: "glob patterns over site names (ONNX node names without the leading '/', else matmul.K)",
    },
    OptionSpec {
        name: "roles",
        ty: OptionType::ListOf(&["lhs", "rhs", "out"]),
        default: "[lhs,rhs,out]",
        doc: "which tensors to sketch: lhs (activation), rhs (weight or 2nd operand), out",
    },
    OptionSpec {
        name: "stats",
        ty: OptionType::ListOf(STAT_WORDS),
        default: "[all]",
        doc: "statistics to compute (count is always recorded; hist adds hist_lo/hist_hi/hist_outside)",
    },
    OptionSpec {
        name: "hist_bins",
        ty: OptionType::UInt { min: 1, max: 65536 },
        default: "32",
        doc: "value-histogram bins",
    },
    OptionSpec {
        name: "hist_range",
        ty: OptionType::Range,
        default: "absmax",
        doc: "histogram range: absmax = [-max|x|, max|x|] per tensor and run, or a fixed LO:HI",
    },
    OptionSpec {
        name: "elemsig",
        ty: OptionType::UInt { min: 1, max: 65536 },
        default: "16",
        doc: "elements sampled at evenly spaced flat indices (exact-repeat detection)",
    },
];

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
        let patterns = opts.globs("sites")?;
        let roles: Vec<Role> = opts
            .list("roles")?
            .iter()
            .filter_map(|r| match r.as_str() {
                "lhs" => Some(Role::Lhs),
                "rhs" => Some(Role::Rhs),
                "out" => Some(Role::Out),
                _ => None,
            })
            .collect();
        let stats = opts.stats("stats", &Stat::SELECTABLE)?;
        let hist_range = match opts.value("hist_range")? {
            OptionValue::Range(lo, hi) => HistRange::Fixed { lo: *lo, hi: *hi },
            _ => HistRange::Absmax,
        };
        let hist_bins = opts.uint("hist_bins")? as usize;
        let elemsig = opts.uint("elemsig")? as usize;

        rw.note_removed(|op| crate::rewrite::family(op) == "matmul");
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
        for (site_name, id, lhs, rhs, out) in sites {
            if !patterns.iter().any(|p| p.matches(&site_name)) {
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
            for &role in &roles {
                let tensor = match role {
                    Role::Lhs => Some(lhs),
                    Role::Rhs => rhs,
                    Role::Out => Some(out),
                    _ => None,
                };
                let Some(tensor) = tensor else {
                    rw.skip(&site, Some(role), None, "the op has no such operand".into());
                    continue;
                };
                let shape = rw.graph().node(tensor).shape.clone();
                match SketchSpec::for_shape(&shape, &stats, hist_bins, hist_range, elemsig) {
                    Ok(plan) => {
                        for (stat, why) in plan.dropped {
                            rw.skip(&site, Some(role), Some(tensor), format!("{} not computed: {why}", stat.as_str()));
                        }
                        rw.tap(&site, role, tensor, plan.spec);
                    }
                    Err(why) => rw.skip(&site, Some(role), Some(tensor), why.to_string()),
                }
            }
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&MatmulTap) }

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_words_are_all_plus_every_selectable_stat() {
        let names: Vec<&str> = Stat::SELECTABLE.iter().map(|s| s.as_str()).collect();
        assert_eq!(STAT_WORDS[0], "all");
        assert_eq!(&STAT_WORDS[1..], names.as_slice());
    }
}
