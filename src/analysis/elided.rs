//! Tensors RLX's CPU backend never writes (thunk-level fusions decided after opscope's rewrite).

use std::collections::HashMap;

use rlx_ir::{Graph, NodeId, Op};

use super::{family, static_dims};

/// Tensors of `g` that RLX 0.2.19's CPU backend never writes, because a thunk-level fusion reads
/// around them (measured: a sketch reading one sees stale memory). RLX decides these fusions
/// after opscope's rewrite and does not count a custom op as a reader, so they are predicted
/// here from the graph, mirroring `rlx-cpu` `thunk/compile_dispatch.rs`:
/// - `Narrow` -> `Attention` / `Rope`: a last-axis slice whose only reader is an attention (all
///   three of Q, K, V sliced) or a rope is read in place from its parent;
/// - `FusedAttnBlock`: at batch x seq <= `RLX_FUSE_ATTN_THRESHOLD` (default 64), a QKV projection
///   sliced three ways into an attention whose output feeds one projection is one kernel: the
///   QKV output, the slices and the attention output never exist.
pub fn backend_elided(g: &Graph) -> HashMap<u32, String> {
    let mut out: HashMap<u32, String> = HashMap::new();
    let users = |id: NodeId| g.users(id);
    // The node and the reshape views above it (a Reshape shares its input's buffer).
    let strip = |mut id: NodeId| -> (NodeId, Vec<NodeId>) {
        let mut views = Vec::new();
        while matches!(g.node(id).op, Op::Reshape { .. }) {
            views.push(id);
            id = g.node(id).inputs[0];
        }
        (id, views)
    };
    let last_axis_narrow = |id: NodeId| matches!(g.node(id).op, Op::Narrow { axis, .. } if axis + 1 == g.node(id).shape.rank());
    let single_reader = |id: NodeId, views: &[NodeId]| {
        // The narrow feeds only the view chain, and the chain's top only its one reader.
        let chain: Vec<NodeId> = std::iter::once(id).chain(views.iter().rev().copied()).collect();
        chain.iter().all(|&n| users(n).len() == 1)
    };
    let strided = "RLX 0.2.19's CPU backend reads this slice in place from its parent (Narrow -> Attention/Rope \
                   fusion) and never writes it: a sketch would read stale memory";
    // Read as rlx-cpu reads it (`rlx_ir::env::var`, registry overrides included).
    let threshold: usize = rlx_ir::env::var("RLX_FUSE_ATTN_THRESHOLD").and_then(|v| v.parse().ok()).unwrap_or(64);
    for n in g.nodes() {
        match &n.op {
            Op::Rope { .. } => {
                let (src, views) = strip(n.inputs[0]);
                if last_axis_narrow(src) && single_reader(src, &views) {
                    for v in std::iter::once(src).chain(views) {
                        out.insert(v.0, strided.into());
                    }
                }
            }
            Op::Attention { num_heads, .. } => {
                if n.inputs.len() < 3 {
                    continue;
                }
                // Q and K may pass through a Rope (its output is written).
                let through_rope = |id: NodeId| match g.node(strip(id).0).op {
                    Op::Rope { .. } => g.node(strip(id).0).inputs[0],
                    _ => id,
                };
                let parts: Vec<(NodeId, Vec<NodeId>)> =
                    [through_rope(n.inputs[0]), through_rope(n.inputs[1]), n.inputs[2]].into_iter().map(strip).collect();
                if !parts.iter().all(|(p, _)| last_axis_narrow(*p)) {
                    continue;
                }
                if parts.iter().all(|(p, v)| single_reader(*p, v)) {
                    for (p, v) in &parts {
                        for x in std::iter::once(*p).chain(v.iter().copied()) {
                            out.insert(x.0, strided.into());
                        }
                    }
                }
                // FusedAttnBlock: batch x seq from Q as the CPU kernel reads it.
                let q = static_dims(&g.node(n.inputs[0]).shape).unwrap_or_default();
                let (b, s) = match q.as_slice() {
                    [b, d1, d2, _] => (*b, if *d1 == *num_heads { *d2 } else { *d1 }),
                    [b, s, _] => (*b, *s),
                    [s, _] => (1, *s),
                    _ => continue,
                };
                let parent = g.node(parts[0].0).inputs[0];
                let same_parent = parts.iter().all(|(p, _)| g.node(*p).inputs[0] == parent);
                let qkv_matmul = matches!(
                    g.node(parent).op,
                    Op::MatMul | Op::FusedMatMulBiasAct { activation: None, .. }
                );
                let out_users: Vec<NodeId> = {
                    let mut u = users(n.id);
                    while u.len() == 1 && matches!(g.node(u[0]).op, Op::Reshape { .. }) {
                        u = users(u[0]);
                    }
                    u
                };
                let out_proj = out_users.len() == 1 && family(&g.node(out_users[0]).op) == "matmul";
                if b * s <= threshold && same_parent && qkv_matmul && out_proj {
                    let block = format!(
                        "RLX 0.2.19's CPU backend fuses the QKV projection, its slices, this attention and the output \
                         projection into one kernel at batch x seq = {} <= {threshold} (RLX_FUSE_ATTN_THRESHOLD): this \
                         tensor is never written, a sketch would read stale memory (RLX_FUSE_ATTN_THRESHOLD=0 makes it \
                         observable, in a different program)",
                        b * s
                    );
                    let mut ids = vec![parent, n.id];
                    for (p, v) in &parts {
                        ids.push(*p);
                        ids.extend(v.iter().copied());
                    }
                    let mut u = users(n.id);
                    while u.len() == 1 && matches!(g.node(u[0]).op, Op::Reshape { .. }) {
                        ids.push(u[0]);
                        u = users(u[0]);
                    }
                    for id in ids {
                        out.insert(id.0, block.clone());
                    }
                }
            }
            _ => {}
        }
    }
    out
}
