//! opscope beside its peer, the published `rlx-opscope` 0.2.19, on the same graphs in one process.
//!
//! The graph is the chain MLP of `benches/chain_mlp.rs`: x[64,256] -> (matmul [256,256] -> relu)
//! x L, He-scaled weights, N(0,1) input (the bench asserts the untapped output has no subnormal
//! value). Per L, four programs compiled from the same graph and weights run in interleaved
//! rounds (one run of each per round, the order rotating each round, after a warm-up run of each):
//!
//! - untapped;
//! - opscope `matmul` (its full sketch set), scope mode, recorded to a Parquet dataset on disk;
//! - `rlx-opscope` 0.2.19 `inject_matmul_stats` with its default `StatConfig` (its full set:
//!   min, max, mean, l1, sumsq, nnz, a 32-bin normalized histogram, per-channel max|x|, per-row
//!   energy, adjacent-row energy), each run recorded with its own tidy-CSV `Recorder` to a file
//!   on disk (what that crate ships as its sink).
//!
//! Printed: median run time of each and the ratio of medians to untapped; then per L each tool's
//! compile time (its rewrite included) over the untapped one, medians of interleaved rounds
//! (`benches/compile.rs` has the finer compile table). (`matmul{stats=[max]}` is in `benches/chain_mlp.rs`; a
//! scope records the runs made inside it, so one scope holds the interleaved rounds here.) Both
//! tools tap the lhs, rhs and out of every matmul.
//!
//! Every depth runs at four input scales, 1, 1e-10, 1e-21 and 1e25 (the weights keep the input's
//! scale through the depth): at 1e-10 fourth powers, and at 1e-21 squares, of the activations
//! fall below f32's normal range, at 1e25 squares overflow it; a tool computing its statistics
//! in f32 elementwise ops slows down on denormals there, or saturates.
//! `rlx-opscope` is a dev-dependency for this bench only; the library never uses it.
//!
//! `cargo bench --features parquet --bench peer` runs it; `-- --quick` uses fewer layers and rounds.

use std::path::Path;
use std::time::{Duration, Instant};

mod common;

use opscope::Pipeline;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rlx_runtime::{CompiledGraph, Device, Session};

const M: usize = 64;
const D: usize = 256;

fn compile(g: rlx_ir::Graph, w: &[Vec<f32>]) -> (CompiledGraph, Duration) {
    let t = Instant::now();
    let mut c = Session::new(Device::Cpu).compile(g);
    let took = t.elapsed();
    for (l, wl) in w.iter().enumerate() {
        c.set_param(&format!("w{l}"), wl);
    }
    (c, took)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One program under test: a closure that runs it once (recording included).
type Runner<'a> = Box<dyn FnMut() + 'a>;

/// Median time of each runner over `rounds` interleaved rounds (the order rotates each round).
fn interleaved(runners: &mut [Runner], rounds: usize) -> Vec<Duration> {
    for r in runners.iter_mut() {
        r();
    }
    let n = runners.len();
    let mut times = vec![Vec::with_capacity(rounds); n];
    for round in 0..rounds {
        for k in 0..n {
            let i = (round + k) % n;
            let t = Instant::now();
            runners[i]();
            times[i].push(t.elapsed());
        }
    }
    times.into_iter().map(median).collect()
}

fn row(layers: usize, scale: f32, rounds: usize, dir: &Path) {
    let w: Vec<Vec<f32>> = (0..layers).map(|l| common::weight(D, l)).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let x: Vec<f32> = (0..M * D).map(|_| normal.sample(&mut rng) * scale).collect();
    assert!(x.iter().all(|v| v.is_normal()), "input at scale {scale:e} holds a subnormal or zero");
    let graph = common::chain(M, D, layers);

    let (mut plain, _) = compile(graph.clone(), &w);
    let y = plain.run(&[("x", &x)]);
    assert!(!y[0].iter().any(|v| v.is_subnormal()), "L={layers}, scale {scale:e}: the untapped output has subnormal values");

    // The peer: its rewrite, its compile, its CSV recorder on disk.
    let (peer_graph, specs) = rlx_opscope::inject_matmul_stats(&graph, &rlx_opscope::StatConfig::default());
    let (mut peer, _) = compile(peer_graph, &w);
    let mut peer_rec = rlx_opscope::Recorder::create(dir.join(format!("peer{layers}-{scale:e}.csv")).to_str().unwrap()).expect("peer recorder");
    let mut peer_run = 0u64;

    let full = Pipeline::parse("matmul").unwrap();
    let sink = opscope::recording::open(&dir.join(format!("full{layers}-{scale:e}.parquet"))).expect("parquet sink");
    let t = opscope::scope(&full, sink, || {
        // Compiled inside the scope: tapped. `plain` and `peer` were compiled before it: untapped
        // by opscope (the peer's own sketches are in its graph).
        let (mut tapped, _) = compile(graph.clone(), &w);
        let mut runners: Vec<Runner> = vec![
            Box::new(|| {
                std::hint::black_box(plain.run(&[("x", &x)]));
            }),
            Box::new(|| {
                std::hint::black_box(tapped.run(&[("x", &x)]));
            }),
            Box::new(|| {
                let outs = peer.run(&[("x", &x)]);
                peer_rec.record(peer_run, 0, "cpu", "normal", M, D, D, &specs, &outs).expect("peer record");
                peer_run += 1;
            }),
        ];
        interleaved(&mut runners, rounds)
    })
    .expect("opscope recording");
    peer_rec.flush().expect("peer flush");
    let r = |i: usize| t[i].as_secs_f64() / t[0].as_secs_f64();
    println!(
        "{:>4} | {:>6.0e} | {:>8.2}ms | {:>7.2}x | {:>11.2}x",
        layers,
        scale,
        t[0].as_secs_f64() * 1e3,
        r(1),
        r(2),
    );
}

/// Compile cost of each tool at depth `layers`: median over `rounds` interleaved triples
/// (untapped; opscope's compile in a scope, its tap pass included; rlx-opscope's
/// `inject_matmul_stats` plus its compile), after one warm-up triple. Returns the untapped
/// median (seconds) and the ratios of medians to it (opscope, rlx-opscope).
fn compile_ratios(layers: usize, rounds: usize) -> (f64, f64, f64) {
    let w: Vec<Vec<f32>> = (0..layers).map(|l| common::weight(D, l)).collect();
    let graph = common::chain(M, D, layers);
    let full = Pipeline::parse("matmul").unwrap();
    let x = vec![1.0f32; M * D];
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..=rounds {
        let mut times = [Duration::ZERO; 3];
        for k in 0..3 {
            let i = (round + k) % 3;
            times[i] = match i {
                0 => compile(graph.clone(), &w).1,
                1 => opscope::scope(&full, Box::new(common::DropSink), || {
                    let (mut tapped, took) = compile(graph.clone(), &w);
                    // Run once (untimed): a graph compiled in a scope and never run there draws a warning.
                    std::hint::black_box(tapped.run(&[("x", &x)]));
                    took
                })
                .expect("scope"),
                _ => {
                    let t = Instant::now();
                    let (g, _) = rlx_opscope::inject_matmul_stats(&graph, &rlx_opscope::StatConfig::default());
                    let took = t.elapsed();
                    took + compile(g, &w).1
                }
            };
        }
        if round > 0 {
            a.push(times[0]);
            b.push(times[1]);
            c.push(times[2]);
        }
    }
    let (ma, mb, mc) = (median(a).as_secs_f64(), median(b).as_secs_f64(), median(c).as_secs_f64());
    (ma, mb / ma, mc / ma)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let depths: &[usize] = if quick { &[16] } else { &[16, 64, 128] };
    let dir = tempfile::tempdir().expect("temp dir");
    // RLX's one-time setup (thread pool, kernel tables) is paid here, not by the first timed compile.
    let warm: Vec<Vec<f32>> = (0..2).map(|l| common::weight(D, l)).collect();
    drop(compile(common::chain(M, D, 2), &warm));
    println!("chain MLP x[{M},{D}] -> (matmul [{D},{D}] -> relu) x L, He-scaled weights, N(0,1) input;");
    println!("ratio = median run time / untapped median, interleaved rounds in one process, recordings written to disk;");
    println!(
        "{:>4} | {:>6} | {:>10} | {:>8} | {:>11}",
        "L", "scale", "untapped", "opscope", "rlx-opscope"
    );
    let scales: &[f32] = if quick { &[1.0] } else { &[1.0, 1e-10, 1e-21, 1e25] };
    for &layers in depths {
        for &scale in scales {
            let rounds = if quick { 5 } else { (1200 / layers).clamp(9, 41) };
            row(layers, scale, rounds, dir.path());
        }
    }
    // A multiple of 3: each tool goes first, second and third equally often.
    let rounds = if quick { 3 } else { 9 };
    println!("\ncompile, ratio of medians to untapped over {rounds} interleaved rounds (the order rotating), each tool's rewrite included:");
    println!("{:>4} | {:>10} | {:>8} | {:>11}", "L", "untapped", "opscope", "rlx-opscope");
    for &layers in depths {
        let (untapped, o, p) = compile_ratios(layers, rounds);
        println!("{layers:>4} | {:>8.2}ms | {o:>7.2}x | {p:>10.2}x", untapped * 1e3);
    }
}
