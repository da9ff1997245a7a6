//! `opscope::mine::load_sampled`: mining in memory bounded by a number of runs per series.
//! Checked against the unsampled load of the same recording (`load_compact`, itself checked
//! against the full load in `lab/tests/dataset.rs`): which runs are kept (the `k` of least
//! priority, the same for every series), that a kept run holds the same statistics, that what is
//! documented exact is equal bit for bit, and that a recording within the bound mines the same.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::{matmul_2d, randn};
use opscope::mine::{load_compact, load_sampled, run_priority, Series, SeriesKey};
use opscope::sketch::tensor;
use opscope::Pipeline;
use rlx_runtime::{Device, Session};

/// Record `matmul` over compiles of x[m,16] @ w, `(m, runs)` each (the same site in each, with
/// another shape), inputs scaled differently per run and 3 of every 4 values zero (a sparse
/// activation: the miner has a verdict to compare, `sparse_gemm`, on data that holds one).
fn record(path: &Path, compiles: &[(usize, usize)]) {
    let p = Pipeline::parse("matmul").unwrap();
    let w = randn(16 * 16, 7);
    opscope::scope(&p, opscope::recording::open(path).unwrap(), || {
        for (j, &(m, n)) in compiles.iter().enumerate() {
            let seed = 100 + 1000 * j as u64;
            let mut c = Session::new(Device::Cpu).compile(matmul_2d(m, 16, 16));
            c.set_param("w", &w);
            for i in 0..n {
                let scale = 0.5 + (i % 7) as f32;
                let x: Vec<f32> = randn(m * 16, seed + i as u64).iter().enumerate().map(|(k, v)| if k % 4 == 0 { v * scale } else { 0.0 }).collect();
                std::hint::black_box(c.run(&[("x", &x)]));
            }
        }
    })
    .unwrap();
}

fn keys(s: &Series) -> Vec<(u32, u64)> {
    s.runs.iter().map(|r| (r.compile, r.step)).collect()
}

#[test]
fn a_sampled_load_keeps_the_least_priority_runs_and_exact_aggregates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.csv");
    // One run of x[4,16], 10 of x[8,16], then 60 of x[4,16] again (three compiles, two shapes).
    // The series' shape is its first run's, [4,16]; the sample below leaves that run out, and
    // with it every run of compile 1.
    let compiles = [(4, 1), (8, 10), (4, 60)];
    record(&path, &compiles);
    let full = load_compact(&path).unwrap();
    let k = 8;
    let sampled = load_sampled(&path, k).unwrap();
    assert_eq!(full.keys().collect::<Vec<_>>(), sampled.keys().collect::<Vec<_>>(), "the same series");
    let lhs: SeriesKey = ("matmul.0".into(), "lhs".into(), 0);
    assert_eq!(full[&lhs].runs.len(), compiles.iter().map(|c| c.1).sum::<usize>(), "three compiles' runs of the activation");
    assert_eq!(full[&lhs].shape, "[4,16]");
    assert!(sampled[&lhs].runs.iter().all(|r| r.compile != 1), "the test's premise: no run of the first compile is kept");
    let mut kept_sets = BTreeSet::new();
    for (key, f) in &full {
        let s = &sampled[key];
        assert_eq!(s.runs_seen(), f.runs.len(), "{key:?}: runs seen");
        // Per tensor shape, the k runs of least priority, computed here from the unsampled
        // load's runs (a stratum of at most k runs keeps them all).
        let dims: Vec<usize> = f.shape.trim_matches(|c| c == '[' || c == ']').split(',').map(|d| d.parse().unwrap()).collect();
        let mut strata: std::collections::BTreeMap<Vec<usize>, Vec<(u32, u64)>> = Default::default();
        for r in &f.runs {
            strata.entry(r.dims(&dims).to_vec()).or_default().push((r.compile, r.step));
        }
        let mut want: Vec<(u32, u64)> = Vec::new();
        for (_, mut runs) in strata.clone() {
            runs.sort_by_key(|&(c, st)| run_priority(c, st));
            want.extend(runs.into_iter().take(k));
        }
        want.sort();
        assert_eq!(keys(s), want, "{key:?}: the kept runs, in (compile, step) order");
        assert_eq!(s.is_sampled(), strata.values().any(|v| v.len() > k), "{key:?}");
        if s.is_sampled() {
            kept_sets.insert(keys(s));
        }
        // A kept run holds the statistics it holds unsampled.
        for r in &s.runs {
            let g = f.runs.iter().find(|x| (x.compile, x.step) == (r.compile, r.step)).unwrap();
            for st in [tensor::MIN, tensor::MAX, tensor::MEAN, tensor::SUMSQ, tensor::KURTOSIS, tensor::NNZ] {
                assert_eq!(r.scalar(st).map(f64::to_bits), g.scalar(st).map(f64::to_bits), "{key:?} run {:?} {st:?}", (r.compile, r.step));
            }
            assert_eq!(r.vector(tensor::HIST), g.vector(tensor::HIST), "{key:?}");
            assert_eq!(r.chan_summary(), g.chan_summary(), "{key:?}");
            assert_eq!(r.row_summary().map(|x| x.hash), g.row_summary().map(|x| x.hash), "{key:?}");
        }
        // Exact over every run, sampled or not.
        let min = f.runs.iter().filter_map(|r| r.scalar(tensor::MIN)).reduce(f64::min);
        let max = f.runs.iter().filter_map(|r| r.scalar(tensor::MAX)).reduce(f64::max);
        assert_eq!(s.range(), (min, max), "{key:?}: smallest min, largest max");
        assert_eq!(s.chan_maxabs_mean(), f.chan_maxabs_mean(), "{key:?}");
        assert_eq!(s.chan_maxabs_max(), f.chan_maxabs_max(), "{key:?}");
        assert_eq!(s.mean_row_energy(), f.mean_row_energy(), "{key:?}");
        assert_eq!((&s.shape, s.flops), (&f.shape, f.flops), "{key:?}: the first run's shape");
        assert_eq!(s.flops_over_runs().to_bits(), f.flops_over_runs().to_bits(), "{key:?}: FLOPs over every run");
        for c in 1..=3 {
            assert_eq!(s.ran_in(c), f.ran_in(c), "{key:?}: ran in compile {c}");
        }
    }
    assert!(sampled[&lhs].ran_in(1), "compile 1 ran, though none of its runs is kept");
    let flops_kept: f64 = sampled[&lhs].runs.iter().map(|r| r.flops(sampled[&lhs].flops).unwrap() as f64).sum();
    assert_ne!(flops_kept, sampled[&lhs].flops_over_runs(), "the kept runs' FLOPs are not every run's");
    // The activation and the output keep the same runs (bottom-k over one priority).
    assert_eq!(kept_sets.len(), 1, "{kept_sets:?}");
    // The weight, recorded once, keeps its run.
    let rhs = &sampled[&("matmul.0".to_string(), "rhs".to_string(), 0)];
    assert!(!rhs.runs.is_empty() && !rhs.is_sampled());
    // The sampled rows are the ones the verdicts read.
    assert!(opscope::mine::mine(&sampled).iter().all(|v| v.site == "matmul.0"));
}

#[test]
fn within_the_bound_a_sampled_load_mines_as_the_unsampled_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.csv");
    record(&path, &[(8, 20), (4, 6)]);
    let full = load_compact(&path).unwrap();
    // 20 runs of the activation's largest shape: a sample of 20 per shape holds every run.
    let sampled = load_sampled(&path, 20).unwrap();
    assert!(sampled.values().all(|s| !s.is_sampled()));
    let json = |s: &std::collections::BTreeMap<SeriesKey, Series>| serde_json::to_string(&opscope::mine::mine(s)).unwrap();
    assert_eq!(json(&sampled), json(&full));
    let verdicts = opscope::mine::mine(&full);
    assert!(verdicts.iter().any(|v| v.kind.name == "sparse_gemm" && v.role == "lhs"), "the comparison sees verdicts: {verdicts:?}");
    // One run fewer than that shape holds: sampled, the other shape's 6 runs all kept.
    let sampled = load_sampled(&path, 19).unwrap();
    let lhs = &sampled[&("matmul.0".to_string(), "lhs".to_string(), 0)];
    assert_eq!((lhs.runs.len(), lhs.runs_seen()), (25, 26));
}

#[test]
fn a_recording_out_of_run_order_is_read_whole_and_too_small_a_sample_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = Pipeline::parse("matmul").unwrap();
    let memory = opscope::MemorySink::default();
    opscope::scope(&p, Box::new(memory.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(8, 16, 16));
        c.set_param("w", &randn(256, 7));
        for i in 0..12 {
            std::hint::black_box(c.run(&[("x", &randn(128, 100 + i))]));
        }
    })
    .unwrap();
    let rows = memory.rows();
    let mut runs: Vec<Vec<opscope::Row>> = rows.chunk_by(|a, b| (a.compile, a.step) == (b.compile, b.step)).map(<[_]>::to_vec).collect();
    assert_eq!(runs.len(), 12);
    let write = |name: &str, runs: &[Vec<opscope::Row>]| {
        let path = dir.path().join(name);
        let mut sink = opscope::recording::open(&path).unwrap();
        for r in runs {
            sink.write(r).unwrap();
        }
        sink.finish().unwrap();
        path
    };
    let lhs: SeriesKey = ("matmul.0".into(), "lhs".into(), 0);
    let in_order = write("in_order.csv", &runs);
    assert_eq!(load_sampled(&in_order, 4).unwrap()[&lhs].runs.len(), 4, "sampled");
    // The same rows, runs in reverse step order (each run's rows still together).
    runs.reverse();
    let reversed = write("reversed.csv", &runs);
    let whole = load_sampled(&reversed, 4).unwrap();
    assert_eq!(whole[&lhs].runs.len(), 12, "read again without sampling");
    assert!(!whole[&lhs].is_sampled());
    let json = |s: &std::collections::BTreeMap<SeriesKey, Series>| serde_json::to_string(&opscope::mine::mine(s)).unwrap();
    assert_eq!(json(&whole), json(&opscope::mine::load(&in_order).unwrap()), "the verdicts of the whole recording");
    // A NaN in one run only, the run a sample of 4 leaves out: the health verdict stays.
    runs.reverse();
    let last = (0..12u64).max_by_key(|&st| run_priority(1, st)).unwrap();
    for r in runs[last as usize].iter_mut().filter(|r| &*r.role == "lhs" && &*r.stat == "nan_count") {
        r.value = 3.0;
    }
    let nan = write("nan.csv", &runs);
    let sampled = load_sampled(&nan, 4).unwrap();
    assert!(sampled[&lhs].runs.iter().all(|r| r.step != last), "the test's premise: the NaN run is left out");
    let health = |s: &std::collections::BTreeMap<SeriesKey, Series>| {
        opscope::mine::mine(s).into_iter().filter(|v| v.kind.name == "health").map(|v| (v.role, v.evidence)).collect::<Vec<_>>()
    };
    let ev = |n: &str, v: f64| (n.to_string(), v);
    assert_eq!(health(&sampled), vec![("lhs".to_string(), vec![ev("nonfinite", 3.0), ev("runs_nonfinite", 1.0), ev("first_in_runs", 1.0)])]);
    assert_eq!(health(&sampled), health(&load_compact(&nan).unwrap()));
    // A subnormal `min` in the same left-out run (2^-149, f32's smallest subnormal, through the
    // CSV text and back): the subnormals verdict stays too, counted over every run.
    let tiny = f32::from_bits(1);
    for r in runs[last as usize].iter_mut().filter(|r| &*r.role == "lhs" && &*r.stat == "min") {
        r.value = tiny;
    }
    // A larger subnormal in the first run: the evidence is the smallest in magnitude, whichever
    // run is read first.
    for r in runs[0].iter_mut().filter(|r| &*r.role == "lhs" && &*r.stat == "min") {
        r.value = 1e-39;
    }
    let sub = write("subnormal.csv", &runs);
    let sampled = load_sampled(&sub, 4).unwrap();
    assert!(sampled[&lhs].runs.iter().all(|r| r.step != last), "the test's premise: the subnormal run is left out");
    let subnormals = |s: &std::collections::BTreeMap<SeriesKey, Series>| {
        opscope::mine::mine(s)
            .into_iter()
            .filter(|v| v.kind.name == "subnormals")
            .map(|v| (v.role, v.evidence.into_iter().filter(|(k, _)| k != "density").collect::<Vec<_>>()))
            .collect::<Vec<_>>()
    };
    let want = vec![(
        "lhs".to_string(),
        vec![("subnormal_extreme".to_string(), tiny as f64), ("runs_with_subnormal".to_string(), 2.0), ("runs".to_string(), 12.0)],
    )];
    assert_eq!(subnormals(&sampled), want);
    assert_eq!(subnormals(&load_compact(&sub).unwrap()), want);
    runs.reverse();
    let sub_reversed = write("subnormal_reversed.csv", &runs);
    assert_eq!(subnormals(&load_sampled(&sub_reversed, 4).unwrap()), want, "the same value in the other order");
    assert_eq!(subnormals(&opscope::mine::load(&sub_reversed).unwrap()), want);
    runs.reverse();
    // A crafted row far beyond the tensor (2^40 values) is refused, not allocated.
    runs[0][0].idx = 1 << 40;
    runs[0][0].stat = "chan_maxabs".into();
    let crafted = write("crafted.csv", &runs);
    for err in [load_compact(&crafted).unwrap_err(), load_sampled(&crafted, 4).unwrap_err(), opscope::mine::load(&crafted).unwrap_err()] {
        let err = err.to_string();
        assert!(err.contains("idx 1099511627776") && err.contains("chan_maxabs") && err.contains("crafted.csv"), "{err}");
    }
    let err = load_sampled(&in_order, 3).unwrap_err().to_string();
    assert!(err.contains("too small") && err.contains("4 runs"), "{err}");
}
