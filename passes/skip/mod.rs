//! `skip`: bypass chosen residual blocks (layer skip), so that `x + f(x)` becomes `x` and the
//! branch `f` is dead and removed. Measures what skipping a block costs, against the block
//! influence the `residual` tap records.

use rlx_ir::op::BinaryOp;
use rlx_ir::Op;

use crate::error::Error;
use crate::pass::{Opt, OptionSpec, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::Rewrite;

const BLOCKS: Opt<Vec<u64>> = Opt::uint_list(
    "blocks",
    1 << 20,
    "[]",
    "blocks to bypass, by the index K of the residual tap's block.K (execution order)",
);

const OPTIONS: &[OptionSpec] = &[BLOCKS.spec];

/// The `skip` actuation pass.
pub struct Skip;

impl Pass for Skip {
    fn name(&self) -> &'static str {
        "skip"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "bypass residual blocks: x + f(x) -> x (a fused residual norm keeps its norm: LN(x + f(x)) -> LN(x)); f is removed"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let wanted = opts.get(&BLOCKS)?;
        let blocks = rw.residual_blocks();
        if let Some(&bad) = wanted.iter().find(|&&k| !blocks.iter().any(|b| b.index as u64 == k)) {
            return Err(Error::Graph(format!(
                "skip: block {bad} does not exist (or is already bypassed): the graph '{}' has residual blocks [{}]; \
                 run the residual tap to list them",
                rw.graph().name,
                blocks.iter().map(|b| b.index.to_string()).collect::<Vec<_>>().join(",")
            )));
        }
        // Last block first: bypassing block k rewires block k+1's stream, so a later block is
        // rewired before the earlier one it reads is.
        for b in blocks.into_iter().rev().filter(|b| wanted.contains(&(b.index as u64))) {
            let site = format!("block.{}", b.index);
            let node = rw.graph().node(b.node).clone();
            let action = match node.op {
                Op::Binary(BinaryOp::Add) => {
                    // Every user of the sum (and any output it is) reads the stream instead.
                    let g = rw.graph_mut();
                    for u in g.users(b.node) {
                        let inputs = g.node(u).inputs.iter().map(|&i| if i == b.node { b.stream } else { i }).collect();
                        g.set_inputs(u, inputs);
                    }
                    for o in g.outputs.iter_mut() {
                        if *o == b.node {
                            *o = b.stream;
                        }
                    }
                    "bypass: x + f(x) -> x"
                }
                Op::FusedResidualLN { has_bias: false, eps } | Op::FusedResidualRmsNorm { has_bias: false, eps } => {
                    let ln = matches!(node.op, Op::FusedResidualLN { .. });
                    let g = rw.graph_mut();
                    let n = g.node_mut(b.node);
                    n.op = if ln { Op::LayerNorm { axis: -1, eps } } else { Op::RmsNorm { axis: -1, eps } };
                    let mut inputs = vec![b.stream];
                    inputs.extend_from_slice(&node.inputs[2..]);
                    n.inputs = inputs;
                    if ln {
                        "bypass: LayerNorm(x + f(x)) -> LayerNorm(x)"
                    } else {
                        "bypass: RmsNorm(x + f(x)) -> RmsNorm(x)"
                    }
                }
                _ => {
                    rw.skip(&site, None, Some(b.node), "a fused residual norm with a bias add is not bypassed".into());
                    continue;
                }
            };
            rw.actuate(&site, b.node, action.into());
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&Skip) }
