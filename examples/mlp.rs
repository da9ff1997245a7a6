//! Plain RLX code: build, compile and run a small MLP, print its outputs.
//!
//! The one opscope line is `use opscope as _;`. With `RLX_OPSCOPE=matmul` (and
//! `RLX_OPSCOPE_OUT=path.csv`) every graph this program compiles is recorded; without it
//! nothing changes. The printed outputs are the same either way.

use opscope as _; // links opscope; RLX_OPSCOPE in the environment turns it on

use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

fn main() {
    let (batch, width, layers) = (4usize, 16usize, 3usize);
    let shape = Shape::new(&[batch, width], DType::F32);
    let mut g = Graph::new("mlp");
    let x = g.input("x", shape.clone());
    let mut h = x;
    for l in 0..layers {
        let w = g.param(format!("w{l}"), Shape::new(&[width, width], DType::F32));
        let b = g.param(format!("b{l}"), Shape::new(&[width], DType::F32));
        let m = g.matmul(h, w, shape.clone());
        let a = g.binary(BinaryOp::Add, m, b, shape.clone());
        h = g.activation(Activation::Gelu, a, shape.clone());
    }
    g.set_outputs(vec![h]);

    let mut compiled = Session::new(Device::Cpu).compile(g);
    for l in 0..layers {
        // A fixed, reproducible weight pattern.
        let w: Vec<f32> = (0..width * width)
            .map(|i| (((i * 7 + l * 13) % 17) as f32 - 8.0) / 16.0)
            .collect();
        let b: Vec<f32> = (0..width).map(|i| (i as f32 - 7.5) / 32.0).collect();
        compiled.set_param(&format!("w{l}"), &w);
        compiled.set_param(&format!("b{l}"), &b);
    }
    for step in 0..3 {
        let x: Vec<f32> = (0..batch * width)
            .map(|i| ((i + step * 5) % 11) as f32 / 5.0 - 1.0)
            .collect();
        let outs = compiled.run(&[("x", &x)]);
        println!("step {step}: {} output(s)", outs.len());
        for (i, o) in outs.iter().enumerate() {
            println!("  out[{i}] = {o:?}");
        }
    }
}
