//! Plain RLX code for the `lowrank` safety test (tests/lowrank_env.rs): `y = x @ w`, `w [48, 32]`
//! bound with `set_param` after compile, printed as JSON `{"w", "x", "y"}` on stdout.
//!
//! With `RLX_OPSCOPE=lowrank{rank=4}` the compiled program reads factors `U`, `V` of `w` that
//! only opscope's wrapper computes (in `set_param`). Argument `unbound`: never set `w` (the
//! wrapper must refuse to run rather than compute with zero factors).

use opscope as _; // links opscope; RLX_OPSCOPE in the environment turns it on

use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

fn main() {
    let (m, k, n) = (8usize, 48usize, 32usize);
    let mut g = Graph::new("lowrank_env");
    let x = g.input("x", Shape::new(&[m, k], DType::F32));
    let w = g.param("w", Shape::new(&[k, n], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![y]);

    let mut compiled = Session::new(Device::Cpu).compile(g);
    // Fixed, reproducible, full-rank values.
    let w: Vec<f32> = (0..k * n).map(|i| ((i as f32 * 0.37 + 0.1).sin() + 0.3 * (i as f32 * 1.71).cos()) / 4.0).collect();
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect();
    if std::env::args().nth(1).as_deref() != Some("unbound") {
        compiled.set_param("w", &w);
    }
    let y = compiled.run(&[("x", &x)]).remove(0);
    println!("{}", serde_json::json!({"w": w, "x": x, "y": y}));
}
