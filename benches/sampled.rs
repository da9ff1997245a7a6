//! Cost of sampled recording on the chain MLP x[64,256] -> (matmul [256,256] -> relu) x L, as a
//! user runs it: the full `matmul` sketch set recorded to a real Parquet file, every run
//! (`matmul`) and one run in N (`sample{every=N},matmul`).
//!
//! Sampling decides from the input's content, so the bench replays a pool of distinct inputs
//! (N(0,1), one seed each; a single repeated input would be always or never sampled). Each round
//! runs every pool input once through each variant, interleaved per input (untapped, then each
//! tapped variant), and sums the times; a variant's cost is the ratio of its round total to the
//! untapped round total. Printed: the median ratio over rounds with the min..max. The pool is
//! stratified so that exactly 1/N of its inputs are sampled (a small pool's hashes would give
//! another fraction); a third variant (`every=2^30`, no input sampled) is the cost of an
//! unsampled run.
//!
//! The whole measurement repeats at input scales 1, 1e-10 and 1e25 (the weights are
//! variance-preserving, so every layer's activations keep the input's scale): fourth powers of
//! 1e-10 data fall below f32's normal range and squares of 1e25 data above it, where a sketch
//! kernel computing in f32 would slow down on denormals or saturate. The bench asserts that the
//! inputs hold no denormal.
//!
//! `cargo bench --bench sampled --features parquet` (`-- --quick`: fewer layers and rounds,
//! scale 1 only).

use std::time::{Duration, Instant};

mod common;

use opscope::Pipeline;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rlx_runtime::{CompiledGraph, Device, Session};

const M: usize = 64;
const D: usize = 256;

/// `x[M, D]`, N(0, 1) times `scale`.
fn input(seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n = Normal::new(0.0f32, 1.0).unwrap();
    let x: Vec<f32> = (0..M * D).map(|_| n.sample(&mut rng) * scale).collect();
    assert!(x.iter().all(|v| v.is_normal()), "input at scale {scale} holds a denormal or zero");
    x
}

fn compile(layers: usize, w: &[Vec<f32>], name: &str) -> CompiledGraph {
    let mut g = common::chain(M, D, layers);
    g.name = name.to_string();
    let mut c = Session::new(Device::Cpu).compile(g);
    for (l, wl) in w.iter().enumerate() {
        c.set_param(&format!("w{l}"), wl);
    }
    c
}

fn time(c: &mut CompiledGraph, x: &[f32]) -> Duration {
    let t = Instant::now();
    std::hint::black_box(c.run(&[("x", x)]));
    t.elapsed()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (layers, rounds, pool) = if quick { (16, 5, 32) } else { (64, 9, 64) };
    let scales: &[f32] = if quick { &[1.0] } else { &[1.0, 1e-10, 1e25] };
    let w: Vec<Vec<f32>> = (0..layers).map(|l| common::weight(D, l)).collect();
    for &scale in scales {
        measure(layers, rounds, pool, scale, &w);
    }
}

/// One table: the three variants against untapped at input scale `scale`.
fn measure(layers: usize, rounds: usize, pool: usize, scale: f32, w: &[Vec<f32>]) {
    let every = 16u64;
    let is_sampled = |x: &[f32], every: u64| {
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        opscope::sketch::sample::sampled(opscope::sketch::sample::input_hash(&[("x", &bytes, rlx_ir::DType::F32)]), every)
    };
    // A stratified pool: exactly pool/N inputs the gate samples, spread evenly over the pool
    // (the first such seeds from 7000 on), the rest unsampled seeds, so the measured ratio is
    // the cost at exactly 1 in N, not at whatever fraction a small pool's hashes give.
    let want = pool / every as usize;
    let (mut yes, mut no) = (Vec::new(), Vec::new());
    let mut seed = 7000u64;
    while yes.len() < want || no.len() < pool - want {
        let x = input(seed, scale);
        seed += 1;
        match is_sampled(&x, every) {
            true if yes.len() < want => yes.push(x),
            false if no.len() < pool - want => no.push(x),
            _ => {}
        }
    }
    let stride = pool / want.max(1);
    let xs: Vec<Vec<f32>> = (0..pool).map(|i| if i % stride == 0 && !yes.is_empty() { yes.pop().unwrap() } else { no.pop().unwrap() }).collect();
    let sampled = xs.iter().filter(|x| is_sampled(x, every)).count();
    assert_eq!(sampled, want);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut plain = compile(layers, w, "plain");
    let variants = [
        ("matmul".to_string(), "every run"),
        (format!("sample{{every={every}}},matmul"), "sampled"),
        ("sample{every=1073741824},matmul".to_string(), "no input sampled: the cost of an unsampled run"),
    ];
    println!("chain MLP x[{M},{D}] x {layers} layers, input scale {scale:e}, pool of {pool} distinct inputs, {rounds} rounds per variant");
    println!(
        "the gate of sample{{every={every}}} samples {sampled} of the {pool} inputs ({:.3}; expected {:.3})",
        sampled as f64 / pool as f64,
        1.0 / every as f64
    );
    for (i, (text, what)) in variants.iter().enumerate() {
        let pipeline = Pipeline::parse(text).unwrap();
        let sink = opscope::recording::open(&dir.path().join(format!("v{i}-{scale:e}.parquet"))).expect("sink");
        // Plain and tapped runs interleaved per input, inside the variant's scope (a scope is
        // per thread; the untapped graph has no tap outputs, so it records nothing).
        let totals = opscope::scope(&pipeline, sink, || {
            let mut tapped = compile(layers, w, &format!("tapped{i}"));
            for x in xs.iter().take(2) {
                time(&mut plain, x);
                time(&mut tapped, x);
            }
            (0..rounds)
                .map(|_| {
                    let (mut a, mut b) = (Duration::ZERO, Duration::ZERO);
                    for x in &xs {
                        a += time(&mut plain, x);
                        b += time(&mut tapped, x);
                    }
                    (a, b)
                })
                .collect::<Vec<_>>()
        })
        .expect("recording");
        let mut r: Vec<f64> = totals.iter().map(|(a, b)| b.as_secs_f64() / a.as_secs_f64()).collect();
        r.sort_by(|a, b| a.total_cmp(b));
        let mut ms: Vec<f64> = totals.iter().map(|(a, _)| a.as_secs_f64() * 1e3 / pool as f64).collect();
        ms.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{text:<40} {:.3}x (rounds {:.3}..{:.3}; untapped {:.2} ms/run)  {what}",
            r[r.len() / 2],
            r[0],
            r[r.len() - 1],
            ms[ms.len() / 2]
        );
    }
}
