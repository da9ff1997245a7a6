//! RLX's code-side settings turn opscope on: `rlx_ir::env::scoped("RLX_OPSCOPE", ..)` before the
//! first compile, with nothing in the process environment.
//!
//! `env_override OUT` sets `RLX_OPSCOPE=matmul` and `RLX_OPSCOPE_OUT=OUT` in code, compiles
//! `gelu(x @ w + b)` and runs it twice, printing each output as `step s: [v, ...]`.
//! `env_override OUT --late` sets them only after the first compile: nothing is recorded (the
//! decision is taken at the first compile). `--device NAME` compiles for that RLX device
//! (e.g. `gpu`, with RLX's wgpu backend built in) instead of the CPU.

use opscope as _;

use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let out = args.get(1).expect("usage: env_override OUT [--late] [--device NAME]").clone();
    let late = args.iter().any(|a| a == "--late");
    let device: Device = match args.iter().position(|a| a == "--device") {
        Some(i) => args.get(i + 1).expect("--device NAME").parse().expect("an RLX device name"),
        None => Device::Cpu,
    };
    let set = || (rlx_ir::env::scoped("RLX_OPSCOPE", "matmul"), rlx_ir::env::scoped("RLX_OPSCOPE_OUT", out.clone()));
    let early = (!late).then(set);

    let (m, k, n) = (3usize, 8usize, 4usize);
    let mut g = Graph::new("env_override");
    let x = g.input("x", Shape::new(&[m, k], DType::F32));
    let w = g.param("w", Shape::new(&[k, n], DType::F32));
    let b = g.param("b", Shape::new(&[n], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[m, n], DType::F32));
    let z = g.binary(BinaryOp::Add, y, b, Shape::new(&[m, n], DType::F32));
    let a = g.activation(Activation::Gelu, z, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![a]);
    let mut c = Session::new(device).compile(g);
    let _late = late.then(set);
    c.set_param("w", &(0..k * n).map(|i| ((i * 5 % 13) as f32 - 6.0) / 8.0).collect::<Vec<_>>());
    c.set_param("b", &(0..n).map(|i| i as f32 / 4.0 - 0.5).collect::<Vec<_>>());
    for step in 0..2 {
        let xv: Vec<f32> = (0..m * k).map(|i| ((i + 3 * step) % 7) as f32 / 3.0 - 1.0).collect();
        let outs = c.run(&[("x", &xv)]);
        println!("step {step}: {:?}", outs[0]);
    }
    drop(early);
}
