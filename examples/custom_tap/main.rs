//! A tap defined outside opscope: [`token_absmax`] (its own file) declares a pass, its statistic
//! and its probe kernel, and registers all three with `inventory`. Nothing in opscope's `src/`
//! or `passes/` knows it; `RLX_OPSCOPE=token_absmax` records it like any built-in pass:
//!
//! ```sh
//! RLX_OPSCOPE=token_absmax RLX_OPSCOPE_OUT=/tmp/absmax.csv cargo run --release --example custom_tap
//! ```
//!
//! The rest of this file is plain RLX code: a two-layer MLP that prints its outputs (the same
//! with and without the variable).

mod token_absmax;

use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

/// The input of step `step`: row `r`, column `c` holds `(((r * 7 + c * 3 + step) % 11) - 5) * (r + 1) / 4`
/// (rows of different scale; the test recomputes it).
pub fn input(rows: usize, width: usize, step: usize) -> Vec<f32> {
    (0..rows * width)
        .map(|i| {
            let (r, c) = (i / width, i % width);
            (((r * 7 + c * 3 + step) % 11) as f32 - 5.0) * (r + 1) as f32 / 4.0
        })
        .collect()
}

fn main() {
    let (rows, width) = (6usize, 8usize);
    let shape = Shape::new(&[rows, width], DType::F32);
    let mut g = Graph::new("two_layers");
    let x = g.input("x", shape.clone());
    let w1 = g.param("fc1.weight", Shape::new(&[width, width], DType::F32));
    let w2 = g.param("fc2.weight", Shape::new(&[width, width], DType::F32));
    let h = g.matmul(x, w1, shape.clone());
    let h = g.activation(Activation::Relu, h, shape.clone());
    let y = g.matmul(h, w2, shape.clone());
    g.set_outputs(vec![y]);

    let mut c = Session::new(Device::Cpu).compile(g);
    // A fixed weight pattern: w[k, n] = ((k * 8 + n) * 5 % 7) / 7 - 0.4.
    let w: Vec<f32> = (0..width * width).map(|i| ((i * 5) % 7) as f32 / 7.0 - 0.4).collect();
    c.set_param("fc1.weight", &w);
    c.set_param("fc2.weight", &w);
    for step in 0..2 {
        let out = c.run(&[("x", &input(rows, width, step))]);
        println!("step {step}: {:?}", out[0]);
    }
}
