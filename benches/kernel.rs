//! The sketch kernel alone, on the host: nanoseconds per value of `opscope::sketch::compute_into`
//! for the full tensor set (`SELECTABLE`: extremes, f64 sums, kurtosis, a 32-bin absmax
//! histogram, per-channel max|x|, per-row energy, adjacent-row difference energy, 16 sampled
//! elements) and for `stats=[max]`, on the tensor shapes the benches and the real model tap:
//! the chain MLP's `[64, 256]`, MiniLM's hidden `[8, 128, 384]` and FFN `[8, 128, 1536]` (batch 8
//! of 128 tokens).
//!
//! Data: N(0,1) values, raw (an activation before a nonlinearity) and through a ReLU (half of
//! them zero), each times a scale of 1, 1e-10 (x^4 below f32's normal range), 1e-21 (x^2 below
//! it) and 1e25 (x^2 above f32's range). The kernel forms every power in f64, so its cost must
//! not depend on the scale (issue 13: an f32 kernel cost 5-8x on such data). Every input is
//! checked to hold no subnormal value before it is timed.
//!
//! Timing: each cell is the best of five rounds of back-to-back calls on the same tensor (warm
//! in cache, as the tap reads a tensor just written), after a warm-up round; this prints the
//! kernel's own cost, not a model's (`chain_mlp` measures that).
//!
//! `cargo bench --bench kernel`; `-- --quick` for the chain MLP shape only.

use std::time::Instant;

use opscope::sketch::{compute_into, tensor, HistRange, SketchSpec, SELECTABLE};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rlx_ir::{DType, Shape};

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let shapes: &[&[usize]] = if quick { &[&[64, 256]] } else { &[&[64, 256], &[8, 128, 384], &[8, 128, 1536]] };
    println!("sketch kernel on the host, best of 5 rounds of back-to-back calls; ns per value (us per call)");
    println!("{:>16} {:>5} {:>7} | {:>20} | {:>20}", "shape", "relu", "scale", "full set", "stats=[max]");
    for dims in shapes {
        let numel: usize = dims.iter().product();
        let shape = Shape::new(dims, DType::F32);
        let specs = [SELECTABLE.to_vec(), vec![tensor::MAX]].map(|stats| {
            SketchSpec::for_shape(&shape, &stats, 32, HistRange::Absmax, 16).expect("a static shape's spec").spec
        });
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let normal = Normal::new(0.0f32, 1.0).expect("normal");
        let base: Vec<f32> = (0..numel).map(|_| normal.sample(&mut rng)).collect();
        for relu in [false, true] {
            for scale in [1.0f32, 1e-10, 1e-21, 1e25] {
                let data: Vec<f32> = base.iter().map(|&v| if relu { v.max(0.0) } else { v } * scale).collect();
                assert!(data.iter().all(|v| v.is_finite() && (*v == 0.0 || v.is_normal())), "bench data must hold normal numbers");
                let cells = specs.each_ref().map(|spec| {
                    let mut out = vec![0f32; spec.len().expect("a static spec")];
                    // About 20 M values a round, at least 10 calls.
                    let reps = (20_000_000 / numel).max(10);
                    compute_into(&data, dims, spec, &mut out);
                    let mut best = f64::MAX;
                    for _ in 0..5 {
                        let t = Instant::now();
                        for _ in 0..reps {
                            compute_into(std::hint::black_box(&data), dims, spec, &mut out);
                        }
                        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                    }
                    format!("{:.3} ({:.1} us)", best * 1e9 / numel as f64, best * 1e6)
                });
                println!("{:>16} {:>5} {:>7} | {:>20} | {:>20}", format!("{dims:?}"), relu, format!("{scale:e}"), cells[0], cells[1]);
            }
        }
    }
}
