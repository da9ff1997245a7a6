//! Graph analyses several passes share, each with one home (as rustc keeps shared analyses in
//! `rustc_mir_dataflow`): site naming, residual blocks, tensors the backend elides, shapes,
//! repeated blocks, and the cost of each node ([`cost`]: FLOPs, bytes, GEMM shapes, roofline class).

mod blocks;
pub mod cost;
mod elided;
mod naming;
mod residual;

use rlx_ir::{Dim, Shape};

pub use blocks::{block_fusion, node_label, repeated_blocks, BlockFusion, users_of, wl_colours, Block, BlockOptions, BlocksError};
pub use elided::backend_elided;
pub use naming::{family, op_name, site_names};
pub(crate) use naming::site_names_by_id;
pub use residual::{residual_blocks, ResidualBlock};

/// The batch, query and key lengths of a fused `Op::Attention` from its Q and K dims, and
/// whether it is laid out `[B, H, S, D]`, as RLX 0.2.19's CPU kernel dispatches: rank 4 is
/// `[B, H, S, D]` when Q's dim 1 equals the head count, else `[B, S, H, D]`, and K follows Q's
/// layout (a grouped-query K `[B, kv_heads, S, D]` does not have the head count in dim 1, and
/// read alone, by which of its axes equals the head count, its key count would be wrong); rank
/// 3 is `[B, S, H*D]`, rank 2 `[S, H*D]`. Returns `(batch, sq, sk, bhsd)`; `None` for another
/// rank, or Q and K of different ranks.
pub fn attention_seqs(q: &[usize], k: &[usize], num_heads: usize) -> Option<(usize, usize, usize, bool)> {
    if q.len() != k.len() {
        return None;
    }
    match q.len() {
        4 if q[1] == num_heads => Some((q[0], q[2], k[2], true)),
        4 | 3 => Some((q[0], q[1], k[1], false)),
        2 => Some((1, q[0], k[0], false)),
        _ => None,
    }
}

/// Render a shape as `[2,16,384]` (symbolic dims as `?N`).
pub fn shape_text(shape: &Shape) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(2 + 6 * shape.dims().len());
    out.push('[');
    for (i, d) in shape.dims().iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Writing to a String cannot fail.
        let _ = match d {
            Dim::Static(n) => write!(out, "{n}"),
            Dim::Dynamic(s) => write!(out, "?{s}"),
        };
    }
    out.push(']');
    out
}

/// Static dims of a shape, or `None` if any is symbolic.
pub fn static_dims(shape: &Shape) -> Option<Vec<usize>> {
    shape
        .dims()
        .iter()
        .map(|d| match d {
            Dim::Static(n) => Some(*n),
            Dim::Dynamic(_) => None,
        })
        .collect()
}

