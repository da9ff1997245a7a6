//! Compile cost of the tap on the chain MLP x[64,256] -> (matmul [256,256] -> relu) x L: the
//! time of `Session::compile` inside a recording scope (the tap pass rewrites the graph, RLX
//! compiles the extra nodes) over the same compile without a scope.
//!
//! Compiles are interleaved in triples after two warm-up triples, the order rotated every
//! triple, so all three see the same machine state: untapped; tapped, as a scope compiles it
//! (the tap's fused graph planned without a second fusion, `activate::compiles_fused_once`);
//! and tapped with a compile option the tap did not fuse with
//! (`disable_conv_bias_act_fusion`, which this graph has no convolution for), so that RLX fuses
//! the tapped graph again, as every tapped compile did before the fused graph was planned.
//! Printed per L and pipeline: median untapped compile, the ratio of medians with the 25th-75th
//! percentile range of the per-triple ratios, the fused-twice ratio, and extra microseconds per
//! matmul site; then the least-squares exponent of the tapped compile time in L (1.0 = linear
//! in sites).
//!
//! `cargo bench --bench compile --features parquet` runs it; `-- --quick` uses fewer triples;
//! `-- --pipeline=TEXT` (repeatable) measures that pipeline instead of the two default ones.

use std::time::{Duration, Instant};

mod common;

use common::quantile;
use opscope::Pipeline;
use rlx_runtime::{CompileOptions, Device, Session};

const M: usize = 64;
const D: usize = 256;

/// Time one compile of the chain; with `run`, run the result once afterwards (untimed): a
/// tapped graph compiled in a scope and never run there draws the scope's warning.
fn compile_once(layers: usize, run: Option<&[Vec<f32>]>) -> Duration {
    compile_with(layers, run, &CompileOptions::new())
}

/// [`compile_once`] with `options` (`Session::compile` is `compile_with(CompileOptions::new())`).
fn compile_with(layers: usize, run: Option<&[Vec<f32>]>, options: &CompileOptions) -> Duration {
    let g = common::chain(M, D, layers);
    let t = Instant::now();
    let mut c = Session::new(Device::Cpu).compile_with(g, options);
    let took = t.elapsed();
    if let Some(w) = run {
        for (l, wl) in w.iter().enumerate() {
            c.set_param(&format!("w{l}"), wl);
        }
        std::hint::black_box(c.run(&[("x", &vec![1.0f32; M * D][..])]));
    }
    took
}

/// Depth of the `--profile` runs: `--layers=N`, default 64.
fn profile_layers() -> usize {
    std::env::args().find_map(|a| a.strip_prefix("--layers=").and_then(|v| v.parse().ok())).unwrap_or(64)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    if let Some(mode) = std::env::args().find_map(|a| a.strip_prefix("--profile=").map(str::to_string)) {
        // 200 compiles of one kind at L=64 (`--layers=N` for another depth), for a profiler (`perf record`): `--profile=plain`
        // (untapped), `--profile=tapped` (in a scope: the tap pass and RLX's compile of the
        // tapped graph) or `--profile=rewrite` (the tap pass alone, `opscope::activate::rewrite`).
        let p = Pipeline::parse("matmul").expect("pipeline");
        for _ in 0..200 {
            match mode.as_str() {
                "plain" => drop(compile_once(profile_layers(), None)),
                "tapped" => drop(opscope::scope(&p, Box::new(common::DropSink), || compile_once(profile_layers(), None)).expect("scope")),
                "rewrite" => {
                    let g = common::chain(M, D, profile_layers());
                    let r = opscope::activate::rewrite(&p, &g, opscope::activate::Stage::Deployed, &rlx_runtime::CompileOptions::default(), 1);
                    drop(std::hint::black_box(r));
                }
                other => panic!("--profile={other}: expected plain, tapped or rewrite"),
            }
        }
        return;
    }
    let triples = if quick { 5 } else { 15 };
    let layers: &[usize] = if quick { &[16, 64] } else { &[16, 64, 128, 256] };
    // `--pipeline=TEXT` (repeatable) measures other pipelines instead, e.g. `matmul{roles=[lhs,out]}`
    // (no weight sketches) to price the weight sketches' share of the compile.
    let given: Vec<(String, String)> =
        std::env::args().filter_map(|a| a.strip_prefix("--pipeline=").map(|p| (p.to_string(), p.to_string()))).collect();
    let pipelines: Vec<(String, String)> = if given.is_empty() {
        vec![("matmul".into(), "matmul (full set)".into()), ("matmul{stats=[max]}".into(), "matmul{stats=[max]}".into())]
    } else {
        given
    };
    // Options that fuse this graph as `CompileOptions::new()` does (it has no convolution) but
    // that the scope's tap did not fuse with: the backend wrapper declines to plan the tap's
    // fused graph, and RLX fuses it a second time.
    let mut twice = CompileOptions::new();
    twice.disable_conv_bias_act_fusion = true;
    println!("compile tapped/untapped, chain MLP x[{M},{D}], {triples} interleaved triples after 2 warm-up triples");
    println!("| L | pipeline | untapped (median) | tapped (median) | tapped, fused twice (median) | tap pass alone (median) | ratio of medians | per-triple ratio: median, 25-75% | fused twice: ratio of medians | extra us per matmul site |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (text, label) in &pipelines {
        let p = Pipeline::parse(text).unwrap_or_else(|e| panic!("--pipeline={text}: {e}"));
        let mut fit = Vec::new();
        for &l in layers {
            let w: Vec<Vec<f32>> = (0..l).map(|i| common::weight(D, i)).collect();
            let (mut a, mut b, mut c, mut r, mut rw) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for i in 0..triples + 2 {
                let once_before = opscope::activate::compiles_fused_once();
                let mut t = [Duration::ZERO; 3];
                for k in 0..3 {
                    let which = (i + k) % 3;
                    t[which] = match which {
                        0 => compile_once(l, None),
                        1 => opscope::scope(&p, Box::new(common::DropSink), || compile_once(l, Some(&w))).expect("scope"),
                        _ => opscope::scope(&p, Box::new(common::DropSink), || compile_with(l, Some(&w), &twice)).expect("scope"),
                    };
                }
                assert_eq!(opscope::activate::compiles_fused_once() - once_before, 1, "one tapped compile of the triple is fused once");
                // The tap pass alone (RLX's fusion of the caller's graph, then the rewrite), on
                // the same graph: the part of the extra compile time that is opscope's.
                let g = common::chain(M, D, l);
                let t0 = Instant::now();
                let rewritten = opscope::activate::rewrite(&p, &g, opscope::activate::Stage::Deployed, &CompileOptions::default(), 1);
                let z = t0.elapsed();
                drop(std::hint::black_box(rewritten));
                if i >= 2 {
                    rw.push(z.as_secs_f64());
                    a.push(t[0].as_secs_f64());
                    b.push(t[1].as_secs_f64());
                    c.push(t[2].as_secs_f64());
                    r.push(t[1].as_secs_f64() / t[0].as_secs_f64());
                }
            }
            let (ma, mb, mc, mr) = (quantile(&a, 0.5), quantile(&b, 0.5), quantile(&c, 0.5), quantile(&rw, 0.5));
            fit.push(((l as f64).ln(), [ma.ln(), mb.ln(), (mb - ma).max(1e-9).ln(), mr.ln()]));
            println!(
                "| {l} | {label} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2}x | {:.2}x, {:.2}-{:.2}x | {:.2}x | {:.0} |",
                ma * 1e3,
                mb * 1e3,
                mc * 1e3,
                mr * 1e3,
                mb / ma,
                quantile(&r, 0.5),
                quantile(&r, 0.25),
                quantile(&r, 0.75),
                mc / ma,
                (mb - ma) * 1e6 / l as f64
            );
        }
        if fit.len() >= 2 {
            // Least-squares exponent of each time in L (1.0 = linear in sites).
            let slope = |k: usize| {
                let n = fit.len() as f64;
                let (sx, sy) = (fit.iter().map(|p| p.0).sum::<f64>(), fit.iter().map(|p| p.1[k]).sum::<f64>());
                let sxy = fit.iter().map(|p| p.0 * p.1[k]).sum::<f64>();
                let sxx = fit.iter().map(|p| p.0 * p.0).sum::<f64>();
                (n * sxy - sx * sy) / (n * sxx - sx * sx)
            };
            println!(
                "{label}: time ~ L^k over L = {}..{}: untapped k = {:.2}, tapped {:.2}, tapped - untapped {:.2}, the tap pass {:.2}",
                layers[0],
                layers[layers.len() - 1],
                slope(0),
                slope(1),
                slope(2),
                slope(3)
            );
        }
    }
}
