//! The chain MLP both benchmarks run: x[m,d] -> (matmul [d,d] -> relu) x layers.

use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, Shape};

/// The graph, with params `w0..w{layers-1}` and input `x`.
pub fn chain(m: usize, d: usize, layers: usize) -> Graph {
    let mut g = Graph::new(format!("chain{layers}"));
    let sh = Shape::new(&[m, d], DType::F32);
    let mut h = g.input("x", sh.clone());
    for l in 0..layers {
        let w = g.param(format!("w{l}"), Shape::new(&[d, d], DType::F32));
        let y = g.matmul(h, w, sh.clone());
        h = g.activation(Activation::Relu, y, sh.clone());
    }
    g.set_outputs(vec![h]);
    g
}

/// A fixed, reproducible weight for layer `l`.
pub fn weight(d: usize, l: usize) -> Vec<f32> {
    (0..d * d).map(|i| (((i * 31 + l * 17) % 97) as f32 - 48.0) / (48.0 * 16.0)).collect()
}
