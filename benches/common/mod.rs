//! What the benches share: the chain MLP x[m,d] -> (matmul [d,d] -> relu) x layers, its
//! weights, a sink that drops rows, and the quantile their tables print.

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

/// A reproducible He-scaled weight for layer `l`: N(0, 2/d) (He et al., 2015), which keeps the
/// activations' scale through a ReLU layer, so a deep chain computes on normal numbers.
pub fn weight(d: usize, l: usize) -> Vec<f32> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + l as u64);
    let he = Normal::new(0.0f32, (2.0 / d as f32).sqrt()).expect("normal");
    (0..d * d).map(|_| he.sample(&mut rng)).collect()
}

/// A sink that drops rows: for measuring what does not depend on the sink (compile time, the
/// tap's own memory). Not every bench uses it.
#[allow(dead_code)]
pub struct DropSink;

impl opscope::Sink for DropSink {
    fn manifest(&mut self, _: &std::sync::Arc<opscope::Manifest>) -> Result<(), opscope::Error> {
        Ok(())
    }
    fn write(&mut self, _: &[opscope::Row]) -> Result<(), opscope::Error> {
        Ok(())
    }
    fn write_block(&mut self, _: &opscope::recording::Block<'_>) -> Result<(), opscope::Error> {
        Ok(())
    }
    fn finish(&mut self) -> Result<(), opscope::Error> {
        Ok(())
    }
}

/// The `q`-quantile of `v` (0 <= q <= 1), linear between the two nearest order statistics (the
/// default of numpy's `quantile`); `NaN` when `v` is empty.
#[allow(dead_code)]
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}
