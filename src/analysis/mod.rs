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

