//! `opscope record` end to end against the same loop untapped, as a user runs it: import
//! MiniLM-L3, tokenize the text, compile, run every batch, and (tapped) record to a Parquet
//! dataset on disk until its last part is closed.
//!
//! Setup: the first 256 fortunes (32 batches of 8 x 64 tokens; as many as `scripts/record-minilm.sh` records in a quarter of its text), on the CPU. Each round runs the
//! untapped loop (`opscope_lab::model::Job::run_untapped`) and each pipeline once
//! (`Job::run` inside a recording scope, the loop `opscope record` runs, into a fresh
//! dataset directory), the order reversed every other round; timed from `Job::new` (import and
//! tokenize) to the end of the run (the sink finished). Printed per pipeline: the median over
//! rounds of tapped / untapped within the round, with the min..max, and the bytes per recorded
//! value on disk. Then peak memory: one child process per variant runs the same job once and
//! reports its RSS high-water mark (`VmHWM`) and its peak heap (a counting global allocator),
//! tapped over untapped.
//!
//! Goal (issue 13): `matmul` <= 1.15x, and peak memory <= 1.1x. `cargo bench -p opscope-lab
//! --bench record_e2e` (needs scripts/fetch-assets.sh's assets; `-- --quick` for 3 rounds,
//! `-- --memory` for the memory table alone).

use std::path::Path;
use std::time::Instant;

mod common;

use common::dir_bytes;
use opscope::Pipeline;
use opscope_lab::model::{split_entries, Job, MiniLmAssets};

#[global_allocator]
static PEAK: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

const BATCH: usize = 8;
const SEQ: usize = 64;

fn entries(a: &MiniLmAssets) -> Vec<String> {
    split_entries(&std::fs::read_to_string(&a.text).unwrap()).into_iter().take(256).collect()
}

/// Child process: run the job once, untapped (`pipeline` empty) or recording `pipeline` to
/// `out`; print "rss_kb heap_bytes".
fn child(a: &MiniLmAssets, pipeline: &str, out: &Path) {
    let job = Job::new(&a.onnx, &a.tokenizer, entries(a), BATCH, SEQ).unwrap();
    if pipeline.is_empty() {
        job.run_untapped(|_, outs| {
            std::hint::black_box(outs);
            Ok(())
        })
        .unwrap();
    } else {
        let sink = opscope::recording::open(out).unwrap();
        job.run(&Pipeline::parse(pipeline).unwrap(), opscope::activate::Stage::Deployed, sink, |_, outs| {
            std::hint::black_box(outs);
            Ok(())
        })
        .unwrap();
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).unwrap_or("0");
    println!("{hwm} {}", PEAK.peak_usage());
}

/// (RSS high-water mark in MB, peak heap in MB) of one child process.
fn memory(pipeline: &str, out: &Path) -> (f64, f64) {
    let o = std::process::Command::new(std::env::current_exe().unwrap()).args(["--child", pipeline]).arg(out).output().unwrap();
    assert!(o.status.success(), "child failed: {}", String::from_utf8_lossy(&o.stderr));
    let v: Vec<f64> = String::from_utf8_lossy(&o.stdout).split_whitespace().filter_map(|t| t.parse().ok()).collect();
    (v[0] / 1024.0, v[1] / (1024.0 * 1024.0))
}

fn main() {
    let a = match MiniLmAssets::from_cache() {
        Ok(a) => a,
        Err(e) => {
            println!("MiniLM skipped: {e}");
            return;
        }
    };
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|x| x == "--child") {
        child(&a, &args[i + 1], Path::new(&args[i + 2]));
        return;
    }
    let quick = args.iter().any(|x| x == "--quick");
    let rounds = if quick { 3 } else { 5 };
    let (batch, seq) = (BATCH, SEQ);
    let entries = entries(&a);
    let pipelines = ["matmul", "matmul{stats=[max]}", "sample{every=16},matmul"];
    let dir = tempfile::tempdir().unwrap();
    if args.iter().any(|x| x == "--memory") {
        // The memory table alone.
        memory_table(&pipelines, dir.path());
        return;
    }
    let untapped = || {
        let t = Instant::now();
        let job = Job::new(&a.onnx, &a.tokenizer, entries.clone(), batch, seq).unwrap();
        job.run_untapped(|_, outs| {
            std::hint::black_box(outs);
            Ok(())
        })
        .unwrap();
        t.elapsed().as_secs_f64()
    };
    let tapped = |p: &str, out: &Path| {
        let t = Instant::now();
        let job = Job::new(&a.onnx, &a.tokenizer, entries.clone(), batch, seq).unwrap();
        let sink = opscope::recording::open(out).unwrap();
        job.run(&Pipeline::parse(p).unwrap(), opscope::activate::Stage::Deployed, sink, |_, outs| {
            std::hint::black_box(outs);
            Ok(())
        })
        .unwrap();
        t.elapsed().as_secs_f64()
    };
    // Warm-up: one of each.
    untapped();
    tapped(pipelines[0], &dir.path().join("warm.parquet"));
    println!("MiniLM-L3, {} entries in batches of {batch} x {seq} tokens, import + tokenize + compile + run (+ record to Parquet), {rounds} rounds", entries.len());
    println!("{:<28} {:>8} {:>16} {:>12} {:>10}", "pipeline", "ratio", "rounds min..max", "untapped s", "B/value");
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); pipelines.len()];
    let mut base = Vec::new();
    let mut bytes = vec![(0u64, 0u64); pipelines.len()];
    for r in 0..rounds {
        let mut order: Vec<usize> = (0..pipelines.len()).collect();
        if r % 2 == 1 {
            order.reverse();
        }
        // Untapped first in even rounds, last in odd ones.
        let first = (r % 2 == 0).then(|| untapped());
        let mut times = vec![0.0; pipelines.len()];
        for &i in &order {
            let out = dir.path().join(format!("r{r}-{i}.parquet"));
            times[i] = tapped(pipelines[i], &out);
            let mut n = 0u64;
            opscope::recording::read_rows(&out, |_| n += 1).unwrap();
            bytes[i] = (dir_bytes(&out), n);
            let _ = std::fs::remove_dir_all(&out);
        }
        let u = first.unwrap_or_else(|| untapped());
        base.push(u);
        for (i, t) in times.iter().enumerate() {
            ratios[i].push(t / u);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let b = median(&mut base.clone());
    for (i, p) in pipelines.iter().enumerate() {
        let (lo, hi) = (ratios[i].iter().copied().fold(f64::INFINITY, f64::min), ratios[i].iter().copied().fold(0.0, f64::max));
        let m = median(&mut ratios[i]);
        let (by, n) = bytes[i];
        println!("{p:<28} {m:>7.3}x {:>16} {b:>12.2} {:>10.2}", format!("{lo:.3}..{hi:.3}"), by as f64 / n.max(1) as f64);
    }
    memory_table(&pipelines, dir.path());
}

/// Peak memory of each pipeline over the untapped job, one child process each.
fn memory_table(pipelines: &[&str], dir: &Path) {
    println!("\npeak memory, one child process per variant (the same job once):");
    println!("{:<28} {:>8} {:>8} {:>9} {:>8}", "pipeline", "RSS MB", "ratio", "heap MB", "ratio");
    let (ru, hu) = memory("", &dir.join("mem-untapped.parquet"));
    println!("{:<28} {ru:>8.1} {:>8} {hu:>9.1} {:>8}", "untapped", "", "");
    for (i, p) in pipelines.iter().enumerate() {
        let (r, h) = memory(p, &dir.join(format!("mem-{i}.parquet")));
        println!("{p:<28} {r:>8.1} {:>7.3}x {h:>9.1} {:>7.3}x", r / ru, h / hu);
    }
}
