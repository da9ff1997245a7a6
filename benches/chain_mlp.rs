//! Tap cost on a chain MLP, as a user runs it: x[64,256] -> (matmul [256,256] -> relu) x L,
//! recorded to a real Parquet file, tapped and untapped runs interleaved in one process.
//!
//! Data: He-scaled Gaussian weights (std sqrt(2/256), variance-preserving through ReLU) and a
//! N(0,1) input multiplied by a data scale. The chain is positively homogeneous (no bias), so
//! every activation carries the same scale: 1 (normal data), 1e-10 (x^4 below f32's normal
//! range), 1e-21 (x^2 below it) and 1e25 (x^2 above f32's range). Before timing, the bench
//! asserts that the output has no subnormal value and that its RMS over the input's is within
//! [1e-2, 1e2]: the untapped run itself computes on normal numbers.
//!
//! Printed per L and scale: untapped run time (median), the tapped/untapped ratio of medians for
//! the full `matmul` sketch set, for `matmul{stats=[max]}` and for the full set lowered into RLX
//! ops (`matmul{lower=true}`, what a device without the native kernel runs), and the extra
//! microseconds per site per run. Runs are interleaved pairs (untapped, tapped) after a warm-up of each;
//! beside the full set's and `stats=[max]`'s ratio, the 25th-75th percentiles of the per-pair
//! ratios (tapped run / the untapped run just before it): how far one cell's figure can move.
//! Then peak memory (RSS high-water mark and peak heap) of one child process per variant, and the
//! sustained cost: back-to-back tapped runs in one child process against untapped ones, time
//! per run until the recording is closed (no untapped run in between for the writer thread to
//! catch up in).
//! Compile cost has its own bench, `benches/compile.rs`.
//!
//! `cargo bench --bench chain_mlp --features parquet` runs it; `-- --quick` uses fewer layers and runs.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

mod common;

use opscope::Pipeline;
use peak_alloc::PeakAlloc;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rlx_runtime::{Device, Session};

#[global_allocator]
static PEAK: PeakAlloc = PeakAlloc;

const M: usize = 64;
const D: usize = 256;
const SCALES: [f32; 4] = [1.0, 1e-10, 1e-21, 1e25];

fn weights(layers: usize) -> Vec<Vec<f32>> {
    (0..layers).map(|l| common::weight(D, l)).collect()
}

fn input(scale: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let n = Normal::new(0.0f32, 1.0).unwrap();
    (0..M * D).map(|_| n.sample(&mut rng) * scale).collect()
}

fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / v.len() as f64).sqrt()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn compile(layers: usize, w: &[Vec<f32>], name: &str) -> rlx_runtime::CompiledGraph {
    let mut g = common::chain(M, D, layers);
    g.name = name.to_string();
    let mut c = Session::new(Device::Cpu).compile(g);
    for (l, wl) in w.iter().enumerate() {
        c.set_param(&format!("w{l}"), wl);
    }
    c
}

/// One timing cell: medians of the untapped and tapped runs, and the per-pair ratios.
struct Cell {
    untapped: Duration,
    tapped: Duration,
    /// Tapped run / the untapped run just before it, one per pair.
    ratios: Vec<f64>,
}

impl Cell {
    /// Tapped/untapped ratio of the medians.
    fn ratio(&self) -> f64 {
        self.tapped.as_secs_f64() / self.untapped.as_secs_f64()
    }

    /// Extra microseconds per site per run (medians).
    fn per_site(&self, layers: usize) -> f64 {
        (self.tapped.as_secs_f64() - self.untapped.as_secs_f64()) * 1e6 / layers as f64
    }

    /// The 25th-75th percentiles of the per-pair ratios, as text.
    fn spread(&self) -> String {
        format!("{:.2}-{:.2}", common::quantile(&self.ratios, 0.25), common::quantile(&self.ratios, 0.75))
    }
}

/// Time one cell: `pairs` interleaved pairs (untapped, tapped) after a warm-up run of each.
fn cell(layers: usize, w: &[Vec<f32>], x: &[f32], pipeline: &Pipeline, pairs: usize, out: &Path, tag: &str) -> Cell {
    let mut plain = compile(layers, w, &format!("plain_{tag}"));
    let y = plain.run(&[("x", x)]);
    let y = &y[0];
    let sub = y.iter().filter(|v| v.is_subnormal()).count();
    let ratio = rms(y) / rms(x);
    assert!(sub == 0 && (1e-2..1e2).contains(&ratio), "L={layers} {tag}: {sub} subnormal outputs, output/input RMS {ratio}: the data is not normal");
    let sink = opscope::recording::open(out).expect("parquet sink");
    let r = opscope::scope(pipeline, sink, || {
        let mut tapped = compile(layers, w, &format!("tapped_{tag}"));
        std::hint::black_box(tapped.run(&[("x", x)]));
        std::hint::black_box(plain.run(&[("x", x)]));
        let mut a = Vec::with_capacity(pairs);
        let mut b = Vec::with_capacity(pairs);
        for _ in 0..pairs {
            let t = Instant::now();
            std::hint::black_box(plain.run(&[("x", x)]));
            a.push(t.elapsed());
            let t = Instant::now();
            std::hint::black_box(tapped.run(&[("x", x)]));
            b.push(t.elapsed());
        }
        let ratios = a.iter().zip(&b).map(|(a, b)| b.as_secs_f64() / a.as_secs_f64()).collect();
        Cell { untapped: median(a), tapped: median(b), ratios }
    });
    r.expect("recording")
}

/// Child process: compile one variant and run it `runs` times, print "rss_kb heap_bytes".
/// `mode`: `plain` (untapped), `tapped` (full `matmul` set, Parquet sink), `dropped` (full set,
/// rows dropped); a `-max` suffix (`tapped-max`, `dropped-max`) taps `matmul{stats=[max]}`
/// instead (for a profiler: `perf record .. --child 64 dropped-max 300 out.parquet`). Prints the
/// back-to-back run times (mean, median, p90, max, ms) and the time per run until the
/// recording is closed on stderr.
fn child(layers: usize, mode: &str, runs: usize, out: &Path) {
    let (mode, pipeline) = match mode.strip_suffix("-max") {
        Some(m) => (m, "matmul{stats=[max]}"),
        None => (mode, "matmul"),
    };
    let pipeline = Pipeline::parse(pipeline).unwrap();
    let (tapped, null_sink) = (mode != "plain", mode == "dropped");
    let w = weights(layers);
    let x = input(1.0);
    let base = PEAK.current_usage();
    let run_peak = std::cell::Cell::new(0usize);
    let loop_start = std::cell::Cell::new(None::<Instant>);
    let times = std::cell::RefCell::new(Vec::<f64>::new());
    let first_peak = std::cell::Cell::new(0usize);
    let body = || {
        let mut c = compile(layers, &w, "mem");
        std::hint::black_box(c.run(&[("x", &x)]));
        // The steady state: peak heap over the later runs, compile's transients excluded.
        first_peak.set(PEAK.peak_usage());
        PEAK.reset_peak_usage();
        let start = PEAK.current_usage();
        let mut ts = Vec::new();
        loop_start.set(Some(Instant::now()));
        for _ in 1..runs {
            let t = Instant::now();
            std::hint::black_box(c.run(&[("x", &x)]));
            ts.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.replace(ts);
        run_peak.set(PEAK.peak_usage().saturating_sub(start));
    };
    if null_sink {
        opscope::scope(&pipeline, Box::new(common::DropSink), body).expect("recording");
    } else if tapped {
        let sink = opscope::recording::open(out).expect("parquet sink");
        opscope::scope(&pipeline, sink, body).expect("recording");
    } else {
        body();
    }
    // Back-to-back run times (no untapped run in between to let the writer catch up): the
    // sustained cost a loop of tapped runs pays, and the loop's time until the recording is
    // closed (the writer's backlog drained, the last part written) per run, on stderr.
    let drained = loop_start.get().map(|t| t.elapsed().as_secs_f64() * 1e3);
    let mut ts = times.into_inner();
    let mut per_run = f64::NAN;
    if let (false, Some(drained)) = (ts.is_empty(), drained) {
        let mean = ts.iter().sum::<f64>() / ts.len() as f64;
        ts.sort_by(f64::total_cmp);
        let q = |f: f64| ts[((ts.len() - 1) as f64 * f) as usize];
        per_run = drained / ts.len() as f64;
        eprintln!("{} back-to-back runs, ms: mean {mean:.2} median {:.2} p90 {:.2} max {:.2}; until closed {per_run:.2} a run", ts.len(), q(0.5), q(0.9), q(1.0));
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).unwrap_or("0");
    let peak = first_peak.get().max(PEAK.peak_usage());
    println!("{hwm} {} {} {per_run}", peak.saturating_sub(base), run_peak.get());
}

/// One child process (see [`child`]): (RSS high-water mark MB, peak heap MB, ms per run from
/// the second run until the recording is closed).
fn run_child(layers: usize, tapped: bool, runs: usize, dir: &Path) -> (f64, f64, f64) {
    let exe = std::env::current_exe().expect("bench executable");
    let out = dir.join(format!("mem{layers}_{tapped}.parquet"));
    let o = Command::new(exe)
        .args(["--child", &layers.to_string(), if tapped { "tapped" } else { "plain" }, &runs.to_string()])
        .arg(&out)
        .output()
        .expect("spawn child");
    assert!(o.status.success(), "child failed: {}", String::from_utf8_lossy(&o.stderr));
    let s = String::from_utf8_lossy(&o.stdout);
    let v: Vec<f64> = s.split_whitespace().filter_map(|t| t.parse().ok()).collect();
    (v[0] / 1024.0, v[1] / (1024.0 * 1024.0), v[3])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(args[i + 1].parse().unwrap(), &args[i + 2], args[i + 3].parse().unwrap(), Path::new(&args[i + 4]));
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let depths: &[usize] = if quick { &[16, 64] } else { &[16, 64, 128, 256] };
    let dir = tempfile::tempdir().expect("temp dir");
    let full = Pipeline::parse("matmul").unwrap();
    let max = Pipeline::parse("matmul{stats=[max]}").unwrap();
    let lowered = Pipeline::parse("matmul{lower=true}").unwrap();
    println!("chain MLP x[{M},{D}] -> (matmul [{D},{D}] -> relu) x L, He-scaled weights, N(0,1) input x scale;");
    println!("recorded to Parquet; ratio = tapped/untapped median of interleaved runs (25-75% = quartiles of the per-pair ratios);");
    println!("us/site = extra time per site per run");
    println!(
        "{:>4} {:>7} | {:>10} | {:>7} {:>9} {:>8} | {:>11} {:>9} {:>8} | {:>8} {:>8}",
        "L", "scale", "untapped", "matmul", "25-75%", "us/site", "stats=[max]", "25-75%", "us/site", "lowered", "us/site"
    );
    for &layers in depths {
        let w = weights(layers);
        let pairs = if quick { 5 } else { (1200 / layers).clamp(9, 41) };
        for scale in SCALES {
            let x = input(scale);
            let tag = format!("{layers}_{scale:e}");
            let full_cell = cell(layers, &w, &x, &full, pairs, &dir.path().join(format!("full_{tag}.parquet")), &format!("full_{tag}"));
            let max_cell = cell(layers, &w, &x, &max, pairs, &dir.path().join(format!("max_{tag}.parquet")), &format!("max_{tag}"));
            let low_cell = cell(layers, &w, &x, &lowered, pairs, &dir.path().join(format!("low_{tag}.parquet")), &format!("low_{tag}"));
            println!(
                "{:>4} {:>7} | {:>8.2}ms | {:>6.2}x {:>9} {:>8.1} | {:>10.2}x {:>9} {:>8.1} | {:>7.2}x {:>8.1}",
                layers,
                format!("{scale:e}"),
                full_cell.untapped.as_secs_f64() * 1e3,
                full_cell.ratio(),
                full_cell.spread(),
                full_cell.per_site(layers),
                max_cell.ratio(),
                max_cell.spread(),
                max_cell.per_site(layers),
                low_cell.ratio(),
                low_cell.per_site(layers)
            );
        }
    }
    // Compile cost: `benches/compile.rs` (interleaved repeated compiles; a single first
    // compile of a few milliseconds, as this bench once printed, scattered by 2x between runs).
    println!("\npeak memory, one child process per variant (full `matmul` set, Parquet sink, 10 runs):");
    println!("{:>4} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6}", "L", "RSS MB", "tapped", "ratio", "heap MB", "tapped", "ratio");
    for &layers in depths {
        let (ra, ha, _) = run_child(layers, false, 10, dir.path());
        let (rb, hb, _) = run_child(layers, true, 10, dir.path());
        println!("{:>4} | {:>9.1} {:>9.1} {:>5.2}x | {:>9.1} {:>9.1} {:>5.2}x", layers, ra, rb, rb / ra, ha, hb, hb / ha);
    }
    // The table above times single runs interleaved with untapped ones: the writer thread
    // drains a tapped run's rows while the next untapped run computes. A loop of tapped runs
    // has no such gap; this is its cost, until the recording is closed.
    println!("\nsustained: back-to-back runs of one variant per child process (scale 1, full `matmul` set, Parquet),");
    println!("time per run from the second run until the recording is closed; children alternate untapped, tapped, twice");
    println!("{:>4} {:>5} | {:>12} {:>12} | {:>13}", "L", "runs", "untapped ms", "tapped ms", "ratio (each)");
    for &layers in depths {
        let runs = if quick { 40 } else { (4800 / layers).max(60) };
        let mut pairs = Vec::new();
        for _ in 0..2 {
            let a = run_child(layers, false, runs, dir.path()).2;
            let b = run_child(layers, true, runs, dir.path()).2;
            pairs.push((a, b));
        }
        let each: Vec<String> = pairs.iter().map(|(a, b)| format!("{:.2}x", b / a)).collect();
        let (a, b) = (pairs.iter().map(|p| p.0).sum::<f64>() / 2.0, pairs.iter().map(|p| p.1).sum::<f64>() / 2.0);
        println!("{:>4} {:>5} | {:>12.2} {:>12.2} | {:>13}", layers, runs, a, b, each.join(" "));
    }
}
