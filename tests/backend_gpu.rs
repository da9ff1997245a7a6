//! A second RLX backend: the wgpu backend (`Device::Gpu`), on this machine Mesa's lavapipe
//! (software Vulkan, Debian `mesa-vulkan-drivers`). The sketches run lowered into RLX primitive
//! ops (opscope's native kernel is the CPU's) and must give the CPU kernel's statistics: counts
//! and fixed-range histograms equal, everything else within 1e-5 relative (`mean` relative to
//! mean|x|, where it cancels). The caller's outputs on the GPU are bit-identical tapped and
//! untapped; the environment mode taps a GPU compile as it taps a CPU one.
//!
//! Built only with `--features gpu` (it adds wgpu to the build; CI does not build it):
//! `cargo test --release --features gpu --test backend_gpu` (README, "Every backend").
#![cfg(feature = "gpu")]

mod common;
use std::collections::BTreeMap;

use common::*;
use opscope::{MemorySink, Pipeline, Row, Scope};
use rlx_ir::Graph;
use rlx_runtime::{Device, Session};

/// (site, role, stat) -> (step, idx) -> value.
type Stats = BTreeMap<(String, String, String), BTreeMap<(u64, u64), f64>>;

fn collect(rows: &[Row]) -> Stats {
    let mut m = Stats::new();
    for r in rows {
        m.entry((r.site.to_string(), r.role.to_string(), r.stat.to_string())).or_default().insert((r.step, r.idx), r.value as f64);
    }
    m
}


/// Compile `g` on `device` inside a scope recording `pipeline` (when given); run it on `steps`
/// inputs. Returns the caller's outputs per step and the rows.
/// `n`: the input's element count.
fn run_on(device: Device, pipeline: Option<&str>, g: &Graph, params: &[(String, Vec<f32>)], n: usize, steps: usize) -> (Vec<Vec<Vec<f32>>>, Vec<Row>) {
    let body = || {
        let mut c = Session::new(device).compile(g.clone());
        for (n, d) in params {
            c.set_param(n, d);
        }
        (0..steps).map(|s| c.run(&[("x", &randn(n, 7 + s as u64))])).collect::<Vec<_>>()
    };
    match pipeline {
        None => (body(), Vec::new()),
        Some(text) => {
            let p = Pipeline::parse(text).unwrap();
            let sink = MemorySink::default();
            let (outs, res) = Scope::new(&p, Box::new(sink.clone())).device(device).run(body);
            res.expect("recording ok");
            (outs, sink.rows())
        }
    }
}

fn assert_same(cpu: &Stats, gpu: &Stats) -> usize {
    let exact = ["count", "nnz", "nan_count", "posinf_count", "neginf_count", "hist", "hist_outside", "hist_lo", "hist_hi", "elemsig", "min", "max", "chan_maxabs", "row_absmax"];
    let mut compared = 0;
    assert_eq!(cpu.keys().collect::<Vec<_>>(), gpu.keys().collect::<Vec<_>>(), "the same series on both devices");
    for (key, vals) in cpu {
        let got = &gpu[key];
        assert_eq!(got.keys().collect::<Vec<_>>(), vals.keys().collect::<Vec<_>>(), "{key:?}: indices");
        for (i, want) in vals {
            let g = got[i];
            let scale = if key.2 == "mean" {
                let (site, role) = (key.0.clone(), key.1.clone());
                cpu[&(site.clone(), role.clone(), "l1".into())][&(i.0, 0)] / cpu[&(site, role, "count".into())][&(i.0, 0)]
            } else {
                0.0
            };
            if exact.contains(&key.2.as_str()) {
                assert_eq!(g, *want, "{key:?}[{i:?}]: gpu {g}, cpu {want}");
            } else {
                assert!((g - want).abs() <= 1e-5 * want.abs().max(scale), "{key:?}[{i:?}]: gpu {g}, cpu {want}");
            }
            compared += 1;
        }
    }
    compared
}

#[test]
fn wgpu_lowered_sketches_equal_the_cpu_kernel_on_the_chain_mlp() {
    assert!(rlx_runtime::is_available(Device::Gpu), "no wgpu adapter: install a Vulkan driver (Debian: mesa-vulkan-drivers)");
    let (g, params) = chain_mlp(32, 64, 4);
    let pipeline = "matmul{hist_bins=32,hist_range=-4:4,elemsig=7}";
    let (plain_gpu, _) = run_on(Device::Gpu, None, &g, &params, 32 * 64, 3);
    let (tapped_gpu, gpu_rows) = run_on(Device::Gpu, Some(pipeline), &g, &params, 32 * 64, 3);
    let (_, cpu_rows) = run_on(Device::Cpu, Some(pipeline), &g, &params, 32 * 64, 3);
    assert_eq!(
        tapped_gpu.iter().map(|o| bits(o)).collect::<Vec<_>>(),
        plain_gpu.iter().map(|o| bits(o)).collect::<Vec<_>>(),
        "caller outputs on the GPU bit-identical tapped and untapped"
    );
    let (cpu, gpu) = (collect(&cpu_rows), collect(&gpu_rows));
    assert_eq!(cpu.keys().map(|k| (&k.0, &k.1)).collect::<std::collections::BTreeSet<_>>().len(), 12, "4 sites x 3 roles");
    let n = assert_same(&cpu, &gpu);
    assert!(n > 1000, "compared {n} values");
}

/// What the lowered sketch cannot compute exactly (the absmax-range histogram) is listed in
/// the manifest with the reason and never recorded on the GPU.
#[test]
fn what_the_gpu_cannot_compute_is_listed_not_recorded() {
    let (g, params) = chain_mlp(8, 16, 1);
    let p = Pipeline::parse("matmul{hist_bins=8}").unwrap();
    let (_, manifest) = p.apply_on(&g, None, 1, Device::Gpu).unwrap();
    let skipped: Vec<String> = manifest.skipped.iter().map(|s| s.reason.clone()).collect();
    assert!(skipped.iter().any(|r| r.starts_with("hist not computed by the lowered sketch")), "{skipped:?}");
    let (_, rows) = run_on(Device::Gpu, Some("matmul{hist_bins=8}"), &g, &params, 8 * 16, 1);
    assert!(!rows.is_empty());
    assert!(rows.iter().all(|r| &*r.stat != "hist" && &*r.stat != "hist_outside"), "the absmax-range histogram is not recorded");
}


fn csv_rows(path: &std::path::Path) -> Vec<Row> {
    csv::Reader::from_path(path).unwrap().deserialize().collect::<Result<_, _>>().unwrap()
}

/// Printed outputs `step s: [v, ...]` (f32 `Debug`, which round-trips exactly).
fn printed(stdout: &str) -> Vec<Vec<f64>> {
    stdout
        .lines()
        .map(|l| l.split_once(": ").unwrap().1.trim_matches(|c| c == '[' || c == ']').split(", ").map(|v| v.parse::<f32>().unwrap() as f64).collect())
        .collect()
}

/// The environment mode on the GPU: `examples/env_override --device gpu` (RLX code that names
/// no opscope item) records its one site, and the recorded statistics of the site's output (the
/// fused matmul + bias + GELU, which the program prints) equal host statistics of what it
/// printed: count, min and max exactly, sum of squares and l1 within 1e-6 relative. The CPU run
/// of the same program agrees within 1e-5 relative (the two backends' GELU differ in the last
/// bits, so their outputs do too).
#[test]
fn the_environment_mode_taps_a_gpu_compile() {
    let dir = tempfile::tempdir().unwrap();
    let mut by_device = Vec::new();
    for device in ["cpu", "gpu"] {
        let rec = dir.path().join(format!("{device}.csv"));
        let out = example("env_override").arg(&rec).args(["--device", device]).output().unwrap();
        assert!(out.status.success(), "{device}: {}", String::from_utf8_lossy(&out.stderr));
        let ys = printed(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(ys.len(), 2, "two steps printed");
        let rows = csv_rows(&rec);
        let sites: std::collections::BTreeSet<&str> = rows.iter().map(|r| &*r.site).collect();
        assert_eq!(sites.len(), 1, "{device}: one matmul site: {sites:?}");
        for (step, y) in ys.iter().enumerate() {
            let get = |stat: &str| {
                let hits: Vec<&Row> = rows.iter().filter(|r| r.step == step as u64 && &*r.role == "out" && &*r.stat == stat).collect();
                assert_eq!(hits.len(), 1, "{device} step {step} {stat}");
                hits[0].value as f64
            };
            let sumsq: f64 = y.iter().map(|v| v * v).sum();
            let l1: f64 = y.iter().map(|v| v.abs()).sum();
            assert_eq!(get("count"), y.len() as f64, "{device}");
            assert_eq!(get("min"), y.iter().copied().fold(f64::INFINITY, f64::min), "{device}");
            assert_eq!(get("max"), y.iter().copied().fold(f64::NEG_INFINITY, f64::max), "{device}");
            assert!((get("sumsq") - sumsq).abs() <= 1e-6 * sumsq, "{device} sumsq {} host {sumsq}", get("sumsq"));
            assert!((get("l1") - l1).abs() <= 1e-6 * l1, "{device} l1 {} host {l1}", get("l1"));
        }
        // The absmax-range histogram has no lowering: compare what both record.
        by_device.push(collect(&rows.into_iter().filter(|r| !r.stat.starts_with("hist")).collect::<Vec<_>>()));
    }
    let (cpu, gpu) = (&by_device[0], &by_device[1]);
    assert_eq!(cpu.keys().collect::<Vec<_>>(), gpu.keys().collect::<Vec<_>>());
    for (key, vals) in cpu {
        for (i, want) in vals {
            let got = gpu[key][i];
            assert!((got - want).abs() <= 1e-5 * want.abs().max(1e-3), "{key:?}[{i:?}]: gpu {got}, cpu {want}");
        }
    }
}
