//! Residual blocks `x + f(x)`: the numbering the `residual` tap and the `skip` actuation share.

use rlx_ir::{Graph, NodeId, Op};

use super::family;

/// A residual connection `x + f(x)` found in a graph.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualBlock {
    /// Block index in execution (node) order, shared by the `residual` tap and the `skip`
    /// actuation: `block.{index}`.
    pub index: usize,
    /// The node computing the sum: `Binary(Add)`, or a `FusedResidualLN` / `FusedResidualRmsNorm`
    /// (RLX's CPU fusion of `Add` + norm) that normalizes it.
    pub node: NodeId,
    /// The residual stream `x`.
    pub stream: NodeId,
    /// The branch `f(x)`.
    pub branch: NodeId,
    /// Which input of `node` (0 or 1) is the stream.
    pub stream_input: usize,
}

/// Every residual connection of `g`, in node order: an `Add` (or a fused residual norm, whose
/// inputs 0 and 1 are summed) of two same-shape F32 tensors where one (`x`) is an ancestor of
/// the other (`f(x)`) through a path holding at least one matmul or attention op. Bias adds
/// (broadcast) and sums of independent tensors (token + position embeddings) are not blocks.
pub fn residual_blocks(g: &Graph) -> Vec<ResidualBlock> {
    let mut out = Vec::new();
    for n in g.nodes() {
        let pair = match &n.op {
            Op::Binary(rlx_ir::op::BinaryOp::Add) => true,
            Op::FusedResidualLN { .. } | Op::FusedResidualRmsNorm { .. } => true,
            _ => false,
        };
        if !pair || n.inputs.len() < 2 {
            continue;
        }
        let (a, b) = (n.inputs[0], n.inputs[1]);
        let (sa, sb) = (&g.node(a).shape, &g.node(b).shape);
        if sa != sb || sa.dtype() != rlx_ir::DType::F32 {
            continue;
        }
        let found = if through_matmul(g, b, a) {
            Some((a, b, 0))
        } else if through_matmul(g, a, b) {
            Some((b, a, 1))
        } else {
            None
        };
        if let Some((stream, branch, stream_input)) = found {
            out.push(ResidualBlock { index: out.len(), node: n.id, stream, branch, stream_input });
        }
    }
    out
}

/// True if `ancestor` is reached walking back from `from` along a path that passes through a
/// matmul-family or attention node (nodes before `ancestor` are not visited).
fn through_matmul(g: &Graph, from: NodeId, ancestor: NodeId) -> bool {
    if from.0 <= ancestor.0 {
        return false;
    }
    // state: 1 = reaches ancestor without a matmul yet, 2 = with one; search (node, seen_mm).
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![(from, false)];
    while let Some((id, mm)) = stack.pop() {
        if !seen.insert((id, mm)) {
            continue;
        }
        let node = g.node(id);
        let mm = mm || family(&node.op) == "matmul" || matches!(node.op, Op::Attention { .. });
        for &i in &node.inputs {
            if i == ancestor {
                if mm {
                    return true;
                }
            } else if i.0 > ancestor.0 {
                stack.push((i, mm));
            }
        }
    }
    false
}

