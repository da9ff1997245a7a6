//! A program that compiles many graphs: `n` iterations of compile-and-run-once of the chain MLP
//! x[64,256] -> (matmul [256,256] -> relu) x 8, untapped and inside one recording scope writing
//! to a CSV file and to a Parquet dataset on disk (default part limits: 32 runs a part), for
//! n = 250, 500, 1000, 2000. Each compile is one manifest in the recording, so what the sink
//! does per compile (the manifests it writes, at each part's close for a dataset) shows here and
//! nowhere else: a sink that rewrote every manifest so far at each part's close spent time
//! quadratic in the compiles.
//!
//! Printed per n: the wall time of each variant (one loop each, the variants' order rotated per
//! n, after one warm-up loop of each), tapped over untapped, milliseconds per compile; then the
//! least-squares exponent of each variant's time in n (1.0 = linear in the compiles).
//!
//! Then a long recording: one compile of the chain run 8192 times into a Parquet dataset with
//! one run a part (`PartLimits { runs: 1, .. }`: 8192 parts, the part count of 262 144 runs at
//! the default 32 runs a part), printing the milliseconds per run of each block of 1024 runs. A
//! sink whose sidecar listed every part's checksum rewrote it whole at each close, so its runs
//! slowed down as the recording grew; the last block over the first says whether they still do.
//!
//! `cargo bench --bench recompile --features parquet`; `-- --quick` stops at n = 1000 and
//! records 4096 runs.

use std::time::Instant;

mod common;

use opscope::recording::{CsvSink, DatasetSink, PartLimits};
use opscope::Pipeline;
use rlx_runtime::{Device, Session};

const M: usize = 64;
const D: usize = 256;
const LAYERS: usize = 8;

/// `n` compile-and-run-once iterations of the chain (one output value kept so that no run is
/// optimised away).
fn compile_loop(n: usize, weights: &[Vec<f32>], x: &[f32]) -> f32 {
    let mut acc = 0.0;
    for _ in 0..n {
        let mut c = Session::new(Device::Cpu).compile(common::chain(M, D, LAYERS));
        for (l, w) in weights.iter().enumerate() {
            c.set_param(&format!("w{l}"), w);
        }
        acc += c.run(&[("x", x)])[0][0];
    }
    acc
}

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    Untapped,
    Csv,
    Parquet,
}

const VARIANTS: [(Variant, &str); 3] = [(Variant::Untapped, "untapped"), (Variant::Csv, "CSV"), (Variant::Parquet, "Parquet dataset")];

/// The wall time in seconds of one loop of `n` in `variant`, its recording written under `dir`
/// and removed after (the time includes the sink's finish: its last part and sidecar).
fn time(variant: Variant, n: usize, weights: &[Vec<f32>], x: &[f32], dir: &std::path::Path) -> f64 {
    let p = Pipeline::parse("matmul").expect("pipeline");
    let t = Instant::now();
    let out = match variant {
        Variant::Untapped => compile_loop(n, weights, x),
        Variant::Csv => {
            let sink = CsvSink::create(dir.join("r.csv")).expect("csv sink");
            opscope::scope(&p, Box::new(sink), || compile_loop(n, weights, x)).expect("scope")
        }
        Variant::Parquet => {
            let sink = DatasetSink::create(dir.join("r.parquet"), PartLimits::DEFAULT).expect("dataset sink");
            opscope::scope(&p, Box::new(sink), || compile_loop(n, weights, x)).expect("scope")
        }
    };
    let took = t.elapsed().as_secs_f64();
    assert!(out.is_finite(), "the chain's output is finite");
    for f in ["r.csv", "r.csv.manifest.json", "r.parquet"] {
        let path = dir.join(f);
        if path.is_dir() {
            std::fs::remove_dir_all(&path).expect("remove the dataset");
        } else if path.exists() {
            std::fs::remove_file(&path).expect("remove the recording");
        }
    }
    took
}

/// Least-squares slope of ln(t) on ln(n).
fn exponent(ns: &[usize], ts: &[f64]) -> f64 {
    let xs: Vec<f64> = ns.iter().map(|&n| (n as f64).ln()).collect();
    let ys: Vec<f64> = ts.iter().map(|t| t.ln()).collect();
    let (mx, my) = (xs.iter().sum::<f64>() / xs.len() as f64, ys.iter().sum::<f64>() / ys.len() as f64);
    let cov: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let var: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    cov / var
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let ns: &[usize] = if quick { &[250, 500, 1000] } else { &[250, 500, 1000, 2000] };
    let weights: Vec<Vec<f32>> = (0..LAYERS).map(|l| common::weight(D, l)).collect();
    let x: Vec<f32> = (0..M * D).map(|i| ((i % 97) as f32 / 97.0) - 0.5).collect();
    let dir = tempfile::tempdir().expect("temp dir");
    for &(v, _) in &VARIANTS {
        time(v, 50, &weights, &x, dir.path());
    }
    println!("n compiles, each run once (chain L = {LAYERS}, full `matmul` set; 32 runs a Parquet part)");
    println!("| n | untapped | CSV | Parquet dataset | CSV / untapped | Parquet / untapped | ms a compile: untapped / CSV / Parquet |");
    println!("|---|---|---|---|---|---|---|");
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for (k, &n) in ns.iter().enumerate() {
        let mut t = [0.0f64; 3];
        for j in 0..VARIANTS.len() {
            let i = (j + k) % VARIANTS.len();
            t[i] = time(VARIANTS[i].0, n, &weights, &x, dir.path());
        }
        for (i, ti) in t.iter().enumerate() {
            times[i].push(*ti);
        }
        let ms = |s: f64| s * 1e3 / n as f64;
        println!(
            "| {n} | {:.2} s | {:.2} s | {:.2} s | {:.2}x | {:.2}x | {:.2} / {:.2} / {:.2} |",
            t[0],
            t[1],
            t[2],
            t[1] / t[0],
            t[2] / t[0],
            ms(t[0]),
            ms(t[1]),
            ms(t[2])
        );
    }
    for (i, (_, name)) in VARIANTS.iter().enumerate() {
        println!("{name}: time ~ n^{:.2}", exponent(ns, &times[i]));
    }
    long_recording(if quick { 4096 } else { 8192 }, &weights, &x, dir.path());
}

/// One compile run `runs` times into a dataset of one run a part; ms per run of each block of
/// 1024 runs, and the sidecar's size at the end.
fn long_recording(runs: usize, weights: &[Vec<f32>], x: &[f32], dir: &std::path::Path) {
    const BLOCK: usize = 1024;
    let p = Pipeline::parse("matmul").expect("pipeline");
    let root = dir.join("long.parquet");
    let sink = DatasetSink::create(&root, PartLimits { runs: 1, bytes: u64::MAX }).expect("dataset sink");
    let mut blocks = Vec::new();
    opscope::scope(&p, Box::new(sink), || {
        let mut c = Session::new(Device::Cpu).compile(common::chain(M, D, LAYERS));
        for (l, w) in weights.iter().enumerate() {
            c.set_param(&format!("w{l}"), w);
        }
        let mut t = Instant::now();
        for r in 1..=runs {
            std::hint::black_box(c.run(&[("x", x)]));
            if r % BLOCK == 0 {
                blocks.push(t.elapsed().as_secs_f64() * 1e3 / BLOCK as f64);
                t = Instant::now();
            }
        }
    })
    .expect("scope");
    let sidecar = std::fs::read_dir(&root)
        .expect("the dataset")
        .flatten()
        .map(|e| e.path().join(opscope::recording::PARTITION_SIDECAR))
        .find(|p| p.is_file())
        .and_then(|p| std::fs::metadata(p).ok())
        .map_or(0, |m| m.len());
    println!();
    println!("one compile, {runs} runs, one run a Parquet part: ms a run per block of {BLOCK} runs");
    println!("{}", blocks.iter().map(|b| format!("{b:.2}")).collect::<Vec<_>>().join(" / "));
    println!("last block / first: {:.2}x; _manifest.json at the end: {sidecar} bytes", blocks[blocks.len() - 1] / blocks[0]);
    std::fs::remove_dir_all(&root).expect("remove the dataset");
}
