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
pub use residual::{residual_blocks, ResidualBlock};

/// Render a shape as `[2,16,384]` (symbolic dims as `?N`).
pub fn shape_text(shape: &Shape) -> String {
    let dims: Vec<String> = shape
        .dims()
        .iter()
        .map(|d| match d {
            Dim::Static(n) => n.to_string(),
            Dim::Dynamic(s) => format!("?{s}"),
        })
        .collect();
    format!("[{}]", dims.join(","))
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

