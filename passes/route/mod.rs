//! `route`: tap MoE routing, every TopK router (over `[tokens, experts]` scores) and every
//! `GroupedMatMul` expert dispatch, and record per-expert load (dead and hot experts, the
//! evidence for expert pruning and capacity planning) and gate mass.

pub mod lower;
pub mod probe;
pub mod rules;

use rlx_ir::{Graph, NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Stats, Word};
use crate::rewrite::Rewrite;
use crate::sketch::{static_dims, SketchSpec};

use probe::{stats, RouteProbe, RouteScores};

/// Role of a MoE router's choice of experts (the tap at a TopK).
pub const ROUTER: Role = Role::new("router");
/// Role of an expert dispatch (the tap at a GroupedMatMul).
pub const DISPATCH: Role = Role::new("dispatch");

const SITES: Opt<Globs> = Opt::globs(
    "sites",
    "[*]",
    "glob patterns over site names (the TopK's or GroupedMatMul's node name, else topk.K / grouped_matmul.K)",
);
const STATS: Opt<Stats> = Opt::stats(
    "stats",
    stats::ALL,
    "[all]",
    "load = assignments per expert, gate_mass = gate probability they carry, importance = gate probability per expert over all tokens, kept_mass = mean chosen mass per token",
);

const MASK: Opt<Word> = Opt::word(
    "mask",
    &["auto", "none"],
    "auto",
    "auto: tokens where the graph input attention_mask (one value per routed token) is 0 are padding, excluded; none: every token counts",
);

const LOWER: Opt<bool> = Opt::bool(
    "lower",
    "false",
    "compute the probe with RLX primitive ops (the lowering a device without a native sketch kernel uses) even on the CPU",
);

const OPTIONS: &[OptionSpec] = &[SITES.spec, STATS.spec, MASK.spec, LOWER.spec];

/// The `route` tap pass.
pub struct RouteTap;

/// How to read router scores `id`, looking through reshapes: a last-axis softmax output or a
/// sigmoid output (DeepSeek-V3-style routers) already holds gate values; anything else is taken
/// as logits (softmax over experts).
fn score_kind(g: &Graph, mut id: NodeId) -> RouteScores {
    loop {
        let n = g.node(id);
        match &n.op {
            Op::Softmax { axis } if *axis == -1 || *axis + 1 == n.shape.rank() as i32 => return RouteScores::Probs,
            Op::Activation(rlx_ir::op::Activation::Sigmoid) => return RouteScores::Probs,
            Op::Reshape { .. } => id = n.inputs[0],
            _ => return RouteScores::Logits,
        }
    }
}

impl Pass for RouteTap {
    fn name(&self) -> &'static str {
        "route"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "MoE routing: per-expert load, gate mass and importance at every TopK router and GroupedMatMul dispatch"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let stats = opts.stats(&STATS)?;
        let use_mask = opts.get(&MASK)? == "auto";
        rw.force_lowering(opts.get(&LOWER)?);
        rw.note_removed(|op| matches!(op, Op::TopK { .. } | Op::GroupedMatMul));
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id).clone();
            let role = match node.op {
                Op::TopK { .. } => ROUTER,
                Op::GroupedMatMul => DISPATCH,
                _ => continue,
            };
            let name = rw.site_name(id);
            if !patterns.matches(&name) {
                continue;
            }
            let site = rw.add_site(id, None);
            let g = rw.graph();
            let planned: Result<(RouteProbe, Vec<NodeId>), String> = match node.op {
                Op::TopK { k } => {
                    let scores = node.inputs[0];
                    match static_dims(&g.node(scores).shape) {
                        Some(d) if d.len() >= 2 && g.node(scores).shape.dtype() == rlx_ir::DType::F32 => {
                            let experts = d[d.len() - 1];
                            let tokens = d.iter().product::<usize>() / experts.max(1);
                            let kind = score_kind(g, scores);
                            Ok((RouteProbe { experts, tokens, k, scores: kind, masked: false }, vec![id, scores]))
                        }
                        _ => Err("router scores need a static F32 shape [.., experts]".to_string()),
                    }
                }
                _ => {
                    // GroupedMatMul: [input, weight [E, K, N], expert_idx [M]].
                    let (w, ids) = (node.inputs[1], node.inputs[2]);
                    match (static_dims(&g.node(w).shape), static_dims(&g.node(ids).shape)) {
                        (Some(wd), Some(idd)) if wd.len() == 3 => Ok((
                            RouteProbe {
                                experts: wd[0],
                                tokens: idd.iter().product(),
                                k: 1,
                                scores: RouteScores::None,
                                masked: false,
                            },
                            vec![ids],
                        )),
                        _ => Err("GroupedMatMul needs static shapes: weight [E, K, N] and expert_idx [M]".to_string()),
                    }
                }
            };
            let planned = planned.map(|(mut probe, mut inputs)| {
                if let Some(m) = use_mask.then(|| rw.row_mask(probe.tokens)).flatten() {
                    probe.masked = true;
                    inputs.push(m);
                }
                (probe, inputs)
            });
            match planned {
                Ok((probe, inputs)) => rw.tap_inputs(&site, role.clone(), &inputs, SketchSpec::for_probe(&probe, &stats)),
                Err(why) => rw.skip(&site, Some(role), Some(id), why),
            }
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {
    std::hint::black_box([probe::link as fn(), rules::link]);
}

inventory::submit! { PassRegistration(&RouteTap) }
