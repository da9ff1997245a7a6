//! Cost of the full `matmul` sketch set on a chain MLP, measured side by side in one run:
//! x[64,256] -> (matmul [256,256] -> relu) x L for L = 16, 64, 128.
//!
//! Prints, per L: untapped and tapped compile time, run time (median of N runs), their ratios,
//! and the peak heap in use during compile + runs (a counting allocator), with its ratio.
//! `cargo bench` runs it; `cargo bench -- --quick` uses fewer runs.

use std::time::{Duration, Instant};

mod common;

use opscope::{Error, Manifest, Pipeline, Row, Sink};
use peak_alloc::PeakAlloc;
use rlx_ir::Graph;
use rlx_runtime::{Device, Session};

#[global_allocator]
static PEAK: PeakAlloc = PeakAlloc;

const M: usize = 64;
const D: usize = 256;

/// Counts rows and drops them: the bench measures tapping and recording, not row storage.
struct CountingSink(usize);

impl Sink for CountingSink {
    fn manifest(&mut self, _: &Manifest) -> Result<(), Error> {
        Ok(())
    }
    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        self.0 += rows.len();
        Ok(())
    }
    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

struct Measured {
    compile: Duration,
    run: Duration,
    peak_mb: f32,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Compile and run `g` `runs` times; `tap` wraps the whole thing in an opscope scope.
/// A fresh graph name per measurement.
fn measure(g: &Graph, weights: &[Vec<f32>], x: &[f32], runs: usize, tap: Option<&Pipeline>) -> Measured {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut g = g.clone();
    g.name = format!("{}_{}", g.name, NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let body = || {
        let t = Instant::now();
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        let compile = t.elapsed();
        for (l, w) in weights.iter().enumerate() {
            c.set_param(&format!("w{l}"), w);
        }
        c.run(&[("x", x)]); // warm-up
        let times: Vec<Duration> = (0..runs)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(c.run(&[("x", x)]));
                t.elapsed()
            })
            .collect();
        (compile, median(times))
    };
    PEAK.reset_peak_usage();
    let base = PEAK.current_usage();
    let (compile, run) = match tap {
        None => body(),
        Some(p) => opscope::scope(p, Box::new(CountingSink(0)), body).expect("recording"),
    };
    let peak_mb = (PEAK.peak_usage().saturating_sub(base)) as f32 / (1024.0 * 1024.0);
    Measured { compile, run, peak_mb }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let pipeline = Pipeline::parse(&std::env::var("BENCH_PIPELINE").unwrap_or("matmul".into())).unwrap();
    println!("chain MLP x[{M},{D}] -> (matmul [{D},{D}] -> relu) x L; pipeline '{pipeline}' (every sketch, lhs+rhs+out)");
    println!(
        "{:>4} {:>5} | {:>10} {:>10} {:>6} | {:>10} {:>10} {:>6} | {:>8} {:>8} {:>6}",
        "L", "sites", "compile", "tapped", "ratio", "run", "tapped", "ratio", "peak MB", "tapped", "ratio"
    );
    for layers in [16usize, 64, 128] {
        let g = common::chain(M, D, layers);
        let weights: Vec<Vec<f32>> = (0..layers).map(|l| common::weight(D, l)).collect();
        let x: Vec<f32> = (0..M * D).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
        let runs = if quick { 5 } else { (2000 / layers).max(15) };
        // Interleave to share machine noise: untapped, tapped, untapped, tapped.
        let a1 = measure(&g, &weights, &x, runs, None);
        let b1 = measure(&g, &weights, &x, runs, Some(&pipeline));
        let a2 = measure(&g, &weights, &x, runs, None);
        let b2 = measure(&g, &weights, &x, runs, Some(&pipeline));
        // Compile time from the first compile of each graph only: RLX may serve a repeated
        // structure from a compile cache. Run time: the better of two medians.
        let a = Measured { compile: a1.compile, run: a1.run.min(a2.run), peak_mb: a1.peak_mb.max(a2.peak_mb) };
        let b = Measured { compile: b1.compile, run: b1.run.min(b2.run), peak_mb: b1.peak_mb.max(b2.peak_mb) };
        let ms = |d: Duration| format!("{:.2}ms", d.as_secs_f64() * 1e3);
        println!(
            "{:>4} {:>5} | {:>10} {:>10} {:>5.2}x | {:>10} {:>10} {:>5.2}x | {:>8.1} {:>8.1} {:>5.2}x",
            layers,
            layers,
            ms(a.compile),
            ms(b.compile),
            b.compile.as_secs_f64() / a.compile.as_secs_f64(),
            ms(a.run),
            ms(b.run),
            b.run.as_secs_f64() / a.run.as_secs_f64(),
            a.peak_mb,
            b.peak_mb,
            b.peak_mb / a.peak_mb
        );
    }
}
