//! The tensor sketch lowered into RLX primitive ops (`matmul{lower=true}`, what a device without
//! a native sketch kernel runs) gives the native CPU kernel's statistics: 1e-5 relative,
//! histogram counts and counts exactly equal, the same values absent; the statistics it does
//! not compute are exactly the ones the manifest lists; the caller's outputs stay bit-identical.
//! The native kernel itself is checked against independent host code in `sketch_reference.rs`;
//! here the lowered path is also checked against that host reference directly.

mod common;
use std::collections::{BTreeMap, BTreeSet};

use common::*;
use opscope::{Pipeline, Row};
use rlx_ir::{DType, Graph, Shape};

/// (site, role, stat) -> values by idx, over step 0.
type Stats = BTreeMap<(String, String, String), BTreeMap<u64, f64>>;

fn collect(rows: &[Row]) -> Stats {
    let mut m = Stats::new();
    for r in rows.iter().filter(|r| r.step == 0) {
        m.entry((r.site.to_string(), r.role.to_string(), r.stat.to_string())).or_default().insert(r.idx, r.value as f64);
    }
    m
}


/// Statistics the lowering leaves out for `pipeline` (must equal what the manifest lists).
fn absent_by_design(absmax_hist: bool) -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    if absmax_hist {
        s.insert("hist".into());
        s.insert("hist_outside".into());
    }
    s
}

/// Compare a lowered recording with a native one: every (site, role, stat, idx) the native
/// recorded is in the lowered one within `tol` relative (exactly for counts and histograms),
/// except the statistics in `absent`, which the lowered recording must not hold at all.
fn assert_same(native: &Stats, lowered: &Stats, absent: &BTreeSet<String>, tol: f64) {
    let exact = ["count", "nnz", "nan_count", "posinf_count", "neginf_count", "hist", "hist_outside", "elemsig", "min", "max", "chan_maxabs", "row_absmax", "hist_lo", "hist_hi"];
    let mut compared = 0;
    for ((site, role, stat), vals) in native {
        let got = lowered.get(&(site.clone(), role.clone(), stat.clone()));
        if absent.contains(stat) {
            assert!(got.is_none(), "{site}/{role} {stat}: the lowering should not record it, got {got:?}");
            continue;
        }
        let got = got.unwrap_or_else(|| panic!("{site}/{role} {stat}: recorded natively, missing when lowered"));
        assert_eq!(got.keys().collect::<Vec<_>>(), vals.keys().collect::<Vec<_>>(), "{site}/{role} {stat}: indices");
        // mean: relative to mean|x| where it cancels, as the kernel documents its own accuracy.
        let scale = if stat == "mean" {
            let l1 = native[&(site.clone(), role.clone(), "l1".to_string())][&0];
            let n = native[&(site.clone(), role.clone(), "count".to_string())][&0];
            l1 / n
        } else {
            0.0
        };
        for (i, w) in vals {
            let g = got[i];
            if exact.contains(&stat.as_str()) {
                assert_eq!(g, *w, "{site}/{role} {stat}[{i}]: lowered {g}, native {w}");
            } else {
                assert!((g - w).abs() <= tol * w.abs().max(scale), "{site}/{role} {stat}[{i}]: lowered {g}, native {w}");
            }
            compared += 1;
        }
    }
    for key in lowered.keys() {
        assert!(native.contains_key(key), "{key:?}: recorded only when lowered");
    }
    assert!(compared > 0, "nothing compared");
}

fn param_refs(p: &[(String, Vec<f32>)]) -> Vec<(&str, &[f32])> {
    p.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect()
}

fn check_chain(opts: &str, absmax_hist: bool) {
    let (g, params) = chain_mlp(32, 64, 4);
    let x = randn(32 * 64, 7);
    let p = param_refs(&params);
    let plain = run_plain(&g, &p, &[("x", &x)]);
    let (native_out, native) = run_tapped(&format!("matmul{{{opts}}}"), &g, &p, &[("x", &x)]);
    let (low_out, lowered) = run_tapped(&format!("matmul{{{opts},lower=true}}"), &g, &p, &[("x", &x)]);
    assert_eq!(bits(&native_out), bits(&plain));
    assert_eq!(bits(&low_out), bits(&plain), "caller outputs bit-identical with the lowered tap");
    let (n, l) = (collect(&native.rows()), collect(&lowered.rows()));
    assert_eq!(n.keys().map(|k| (&k.0, &k.1)).collect::<BTreeSet<_>>().len(), 12, "4 sites x 3 roles");
    assert_same(&n, &l, &absent_by_design(absmax_hist), 1e-5);
}

#[test]
fn chain_mlp_lowered_equals_native_absmax_range() {
    check_chain("hist_bins=16,elemsig=7", true);
}

#[test]
fn chain_mlp_lowered_equals_native_fixed_range_histogram() {
    check_chain("hist_bins=32,hist_range=-2:3,elemsig=5", false);
}

/// Zeros, negatives, NaN, +-Inf (counted, excluded from every other statistic), a constant
/// weight (kurtosis undefined), against the native kernel and the independent host reference.
#[test]
fn edge_values_lowered_equal_native_and_host() {
    let (m, k, n) = (8, 16, 4);
    let mut x = randn(m * k, 11);
    x[0] = 0.0;
    x[5] = f32::NAN;
    x[17] = f32::INFINITY;
    x[40] = f32::NEG_INFINITY;
    x[41] = -0.0;
    for v in &mut x[64..80] {
        *v = 0.0; // a row of zeros
    }
    x[100] = f32::NAN;
    let w = vec![0.25f32; k * n];
    let g = matmul_2d(m, k, n);
    let opts = "roles=[lhs,rhs],hist_bins=8,hist_range=-2:2,elemsig=6";
    let (_, native) = run_tapped(&format!("matmul{{{opts}}}"), &g, &[("w", &w)], &[("x", &x)]);
    let (_, lowered) = run_tapped(&format!("matmul{{{opts},lower=true}}"), &g, &[("w", &w)], &[("x", &x)]);
    let (nm, lm) = (collect(&native.rows()), collect(&lowered.rows()));
    assert_same(&nm, &lm, &absent_by_design(false), 1e-5);
    // Against the host reference directly (independent f64 loops in tests/common).
    let s = stats_of(&lowered.rows(), "matmul.0", "lhs", 0);
    let r = reference(&x, &[m, k], 8, 6);
    assert_eq!(s["count"], vec![r.count]);
    assert_eq!(s["nan_count"], vec![2.0]);
    assert_eq!((s["posinf_count"][0], s["neginf_count"][0]), (1.0, 1.0));
    assert_eq!(s["nnz"], vec![r.nnz]);
    assert!(close(s["sumsq"][0], r.sumsq, 1e-5) && close(s["l1"][0], r.l1, 1e-5));
    assert!(close(s["kurtosis"][0], r.kurtosis.unwrap(), 1e-5), "{} vs {:?}", s["kurtosis"][0], r.kurtosis);
    let finite: Vec<f64> = x.iter().filter(|v| v.is_finite()).map(|&v| v as f64).collect();
    let (hist, outside) = numpy_histogram(&finite, -2.0, 2.0, 8);
    assert_eq!(s["hist"], hist, "fixed-range histogram equals numpy's bins");
    assert_eq!(s["hist_outside"], vec![outside]);
    for (a, b) in s["row_absmax"].iter().zip(&r.row_absmax) {
        assert_eq!(a, b);
    }
    // The constant weight: kurtosis undefined (absent), mean exactly the constant.
    let ws = stats_of(&lowered.rows(), "matmul.0", "rhs", 0);
    assert!(!ws.contains_key("kurtosis"), "kurtosis of a constant is not recorded");
    assert_eq!(ws["mean"], vec![0.25]);
}

/// x[B,S,K] @ w with an attention_mask[B,S]: padding rows add to no statistic on the lowered
/// path either.
#[test]
fn padding_mask_lowered_equals_native() {
    let (b, s, k, n) = (2, 5, 8, 3);
    let mut g = Graph::new("masked");
    let x = g.input("x", Shape::new(&[b, s, k], DType::F32));
    let mask = g.input("attention_mask", Shape::new(&[b, s], DType::F32));
    let w = g.param("w", Shape::new(&[k, n], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[b, s, n], DType::F32));
    g.set_outputs(vec![y, mask]);
    let m: Vec<f32> = vec![1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0];
    let mut xv = randn(b * s * k, 7);
    for (r, &mv) in m.iter().enumerate() {
        if mv == 0.0 {
            xv[r * k..(r + 1) * k].fill(1e6); // any leak shows
        }
    }
    let wv = randn(k * n, 8);
    let opts = "hist_bins=8,hist_range=-4:4,elemsig=10";
    let run = |p: &str| run_tapped(p, &g, &[("w", &wv)], &[("x", &xv), ("attention_mask", &m)]);
    let (_, native) = run(&format!("matmul{{{opts}}}"));
    let (_, lowered) = run(&format!("matmul{{{opts},lower=true}}"));
    let (nm, lm) = (collect(&native.rows()), collect(&lowered.rows()));
    assert_same(&nm, &lm, &absent_by_design(false), 1e-5);
    let max = lm[&("matmul.0".to_string(), "lhs".to_string(), "max".to_string())][&0];
    assert!(max < 1e5, "a padding row leaked into max: {max}");
}

/// The manifest lists, per site and role, each statistic the lowering does not compute, with
/// the reason.
#[test]
fn manifest_lists_what_is_not_lowered() {
    let g = matmul_2d(4, 8, 3);
    let p = Pipeline::parse("matmul{lower=true}").unwrap();
    let (_, m) = p.apply(&g).unwrap();
    let listed: BTreeSet<(String, String)> = m
        .skipped
        .iter()
        .filter(|k| k.reason.contains("not computed by the lowered sketch"))
        .map(|k| (k.role.as_ref().unwrap().as_str().to_string(), k.reason.split(' ').next().unwrap().to_string()))
        .collect();
    let mut want = BTreeSet::new();
    for role in ["lhs", "rhs", "out"] {
        for stat in absent_by_design(true) {
            want.insert((role.to_string(), stat));
        }
    }
    assert_eq!(listed, want);
    // No custom op left: the lowered graph runs on primitive ops only.
    assert!(!out_has_custom(&p, &g));
    // The native default keeps the kernel.
    let (out, m2) = Pipeline::parse("matmul").unwrap().apply(&g).unwrap();
    assert!(out.nodes().iter().any(|n| matches!(&n.op, rlx_ir::Op::Custom { .. })));
    assert!(m2.skipped.is_empty());
}

fn out_has_custom(p: &Pipeline, g: &Graph) -> bool {
    let (out, _) = p.apply(g).unwrap();
    out.nodes().iter().any(|n| matches!(&n.op, rlx_ir::Op::Custom { .. }))
}

/// A device without a native kernel lowers with no option: `apply_on` a non-CPU device.
#[test]
fn non_cpu_device_lowers_automatically() {
    let g = matmul_2d(4, 8, 3);
    let p = Pipeline::parse("matmul{stats=[min,max]}").unwrap();
    let (out, _) = p.apply_on(&g, None, 0, rlx_runtime::Device::Metal).unwrap();
    assert!(!out.nodes().iter().any(|n| matches!(&n.op, rlx_ir::Op::Custom { .. })), "lowered on Metal");
    let (out, _) = p.apply_on(&g, None, 0, rlx_runtime::Device::Cpu).unwrap();
    assert!(out.nodes().iter().any(|n| matches!(&n.op, rlx_ir::Op::Custom { .. })), "native on the CPU");
}

#[test]
fn snapshot_lowered_min_max_sumsq() {
    let g = matmul_2d(4, 8, 3);
    let p = Pipeline::parse("matmul{roles=[lhs],stats=[min,max,sumsq],lower=true}").unwrap();
    let (out, m) = p.apply(&g).unwrap();
    snapshot("lowering__min_max_sumsq", &out, &m);
}

/// Values on and next to numpy's f64 bin edges (-0.6 is not an f32: the f32 nearest it lies
/// below the edge and belongs to the lower bin), the range ends, and values outside: the lowered
/// fixed-range histogram bins them as numpy does.
#[test]
fn fixed_range_histogram_at_bin_edges_is_numpys() {
    let (m, k, n) = (4, 16, 2);
    let mut x = randn(m * k, 21);
    let edgy = [-0.6f32, (-0.6f32).next_up(), 0.2, (0.2f32).next_down(), -0.2, 1.0, -1.0, 0.0, 1.5, -3.0, 0.4, 0.6, (0.6f32).next_down()];
    x[..edgy.len()].copy_from_slice(&edgy);
    let w = randn(k * n, 22);
    let g = matmul_2d(m, k, n);
    let opts = "roles=[lhs],stats=[hist],hist_bins=10,hist_range=-1:1";
    let (_, native) = run_tapped(&format!("matmul{{{opts}}}"), &g, &[("w", &w)], &[("x", &x)]);
    let (_, lowered) = run_tapped(&format!("matmul{{{opts},lower=true}}"), &g, &[("w", &w)], &[("x", &x)]);
    let finite: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (hist, outside) = numpy_histogram(&finite, -1.0, 1.0, 10);
    let s = stats_of(&lowered.rows(), "matmul.0", "lhs", 0);
    assert_eq!(s["hist"], hist);
    assert_eq!(s["hist_outside"], vec![outside]);
    assert_same(&collect(&native.rows()), &collect(&lowered.rows()), &absent_by_design(false), 1e-5);
}

/// Under `cache_param_invariant` RLX hoists weight-only work into a run-once prepare graph
/// whose graph outputs come back unfilled: the lowered sketch of a weight reads a run-time
/// tensor so that it stays in the main graph, and records the native kernel's values.
#[test]
fn lowered_weight_sketch_survives_param_hoisting() {
    use rlx_runtime::{Device, Session};
    let g = matmul_2d(3, 5, 4);
    let w = randn(20, 1);
    let x = randn(15, 2);
    let record = |pipeline: &str| {
        let p = Pipeline::parse(pipeline).unwrap();
        let sink = opscope::MemorySink::default();
        let outs = opscope::scope(&p, Box::new(sink.clone()), || {
            let opts = rlx_runtime::CompileOptions::default().with_cache_param_invariant(true);
            let mut c = Session::new(Device::Cpu).compile_with(g.clone(), &opts);
            c.set_param("w", &w);
            (0..2).map(|_| c.run(&[("x", &x)])).collect::<Vec<_>>()
        })
        .unwrap();
        let rows = sink.rows();
        // A weight is recorded once, also when its sketch holds not-computed (NaN) slots.
        assert!(rows.iter().filter(|r| &*r.role == "rhs").all(|r| r.step == 0), "{pipeline}: weight recorded at step 0 only");
        assert!(rows.iter().any(|r| &*r.role == "lhs" && r.step == 1));
        (outs, collect(&rows))
    };
    let (n_out, native) = record("matmul{hist_bins=8,hist_range=-3:3}");
    let (l_out, lowered) = record("matmul{hist_bins=8,hist_range=-3:3,lower=true}");
    assert_eq!(n_out.iter().map(|o| bits(o)).collect::<Vec<_>>(), l_out.iter().map(|o| bits(o)).collect::<Vec<_>>());
    assert!(lowered.contains_key(&("matmul.0".into(), "rhs".into(), "sumsq".into())));
    assert_same(&native, &lowered, &absent_by_design(false), 1e-5);
}

/// `lower=true` on a tensor the lowering cannot take (a symbolic dim) records nothing for it and
/// says why, rather than computing it with the native kernel the caller asked not to use.
#[test]
fn forced_lowering_that_cannot_lower_is_skipped_not_silently_native() {
    use rlx_ir::{DType, Dim, Graph, Shape};
    let mut g = Graph::new("sym");
    let x = g.input("x", Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(8)], DType::F32));
    let w = g.param("w", Shape::new(&[8, 4], DType::F32));
    let y = g.matmul(x, w, Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(4)], DType::F32));
    g.set_outputs(vec![y]);
    let (_, m) = opscope::Pipeline::parse("matmul{roles=[lhs,rhs],lower=true}").unwrap().apply(&g).unwrap();
    let lhs: Vec<_> = m.skipped.iter().filter(|s| s.role == Some(opscope::Role::LHS)).collect();
    assert!(lhs.iter().any(|s| s.reason.contains("lower=true asked") && s.reason.contains("symbolic")), "{:?}", m.skipped);
    // The static weight is lowered and recorded; no native sketch op is in the graph for the lhs.
    assert_eq!(m.outputs.len(), 1, "{:?}", m.outputs);
    // Without lower=true the native kernel takes the symbolic lhs.
    let (_, m) = opscope::Pipeline::parse("matmul{roles=[lhs,rhs]}").unwrap().apply(&g).unwrap();
    assert_eq!(m.outputs.len(), 2, "{:?}", m.outputs);
}

/// The lowered sketch returns its compile tag through the data path (tag + elements its
/// reductions saw - n): on the CPU it is the tag exactly; a backend that hands back zeros (RLX
/// 0.2.19's wgpu backend reads an operand outside its arena stripe as zeros) gets a clear
/// error and not one row recorded.
/// `pipeline` applied to a [4, 8] x [8, 3] matmul under compile tag `tag`, compiled and run
/// once on the CPU: the run's extra outputs (the caller's one output removed) and the manifest.
fn tapped_run_2d(pipeline: &str, tag: u32) -> (Vec<Vec<f32>>, opscope::Manifest) {
    let (m, k, n) = (4, 8, 3);
    let (tapped, manifest) = Pipeline::parse(pipeline).unwrap().apply_tagged(&matmul_2d(m, k, n), None, tag).unwrap();
    let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(tapped);
    c.set_param("w", &randn(k * n, 2));
    let extra = c.run(&[("x", &randn(m * k, 1))])[1..].to_vec();
    (extra, manifest)
}

#[test]
fn a_sketch_that_comes_back_as_zeros_is_refused_not_recorded() {
    let (extra, manifest) = tapped_run_2d("matmul{lower=true}", 7);
    assert_eq!(extra.len(), 3, "lhs, rhs, out");
    assert!(extra.iter().all(|v| v[0] == 7.0), "the data-path tag is the tag when every element is seen");

    let sink = opscope::MemorySink::default();
    let rec = opscope::record::Recorder::new(Box::new(sink.clone()), "run".into());
    rec.register(manifest.clone());
    rec.record_tagged(extra.clone());
    rec.record_tagged(extra.iter().map(|v| vec![0.0; v.len()]).collect());
    let err = rec.finish().expect_err("zeros refused").to_string();
    assert!(err.contains("carry tag 0") && err.contains("not the sketch"), "{err}");
    // One element short in one sketch: tag 6, a compile this recording never had.
    let sink2 = opscope::MemorySink::default();
    let rec = opscope::record::Recorder::new(Box::new(sink2.clone()), "run".into());
    let reg = rec.register(manifest);
    let mut short = extra.clone();
    short[1][0] = 6.0;
    rec.record(&reg, short);
    let err = rec.finish().expect_err("a wrong tag refused").to_string();
    assert!(err.contains("has tag 6, manifest 7"), "{err}");
    assert!(sink2.rows().is_empty(), "nothing of that run recorded");
}

/// The recorder takes a backend's output bytes as they are (`RunOutput::Bytes`, what a scope's
/// tap and `run_typed` hand it): F32 bytes record the same rows as the same values given as
/// f32 vectors, and bytes of another dtype are refused with the output named, nothing recorded.
#[test]
fn output_bytes_record_as_their_values_and_other_dtypes_are_refused() {
    use opscope::record::{Recorder, RunOutput};
    let (extra, manifest) = tapped_run_2d("matmul", 9);
    let record = |outputs: Vec<RunOutput>| {
        let sink = opscope::MemorySink::default();
        let rec = Recorder::new(Box::new(sink.clone()), "run".into());
        let reg = rec.register(manifest.clone());
        let firsts: Vec<Option<f32>> = extra.iter().map(|v| v.first().copied()).collect();
        rec.record_with(&reg, &firsts, move || outputs);
        (rec.finish(), sink.rows())
    };
    let bytes = |v: &Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ok, want) = record(extra.iter().cloned().map(RunOutput::F32).collect());
    ok.expect("f32 vectors recorded");
    let (ok, got) = record(extra.iter().map(|v| RunOutput::Bytes(bytes(v), DType::F32)).collect());
    ok.expect("f32 bytes recorded");
    assert!(!want.is_empty());
    let key = |r: &Row| (r.site.clone(), r.role.clone(), r.stat.clone(), r.idx, r.value.to_bits());
    assert_eq!(got.iter().map(key).collect::<Vec<_>>(), want.iter().map(key).collect::<Vec<_>>());
    // The second output as I32 bytes (the same bytes): refused, not read as f32.
    let mut outputs: Vec<RunOutput> = extra.iter().map(|v| RunOutput::Bytes(bytes(v), DType::F32)).collect();
    outputs[1] = RunOutput::Bytes(bytes(&extra[1]), DType::I32);
    let (err, rows) = record(outputs);
    let err = err.expect_err("an I32 output refused").to_string();
    assert!(err.contains("output 2") && err.contains("I32"), "{err}");
    assert!(rows.is_empty(), "nothing of that run recorded");
}

/// A zero extreme is recorded as +0 by both paths: an lhs of only -0.0 (min = max = zero) and
/// one whose minimum is a -0.0 among positives give min (and max) bits of +0, lowered and native.
#[test]
fn a_zero_extreme_is_plus_zero_lowered_and_native() {
    let (m, k, n) = (4, 8, 2);
    let g = matmul_2d(m, k, n);
    let w = vec![0.5f32; k * n];
    let all_neg_zero = vec![-0.0f32; m * k];
    let mixed: Vec<f32> = (0..m * k).map(|i| if i % 3 == 0 { -0.0 } else { 1.0 + i as f32 }).collect();
    for (what, x) in [("all -0", &all_neg_zero), ("-0 among positives", &mixed)] {
        for lower in [false, true] {
            let p = format!("matmul{{roles=[lhs],stats=[min,max],lower={lower}}}");
            let (_, rec) = run_tapped(&p, &g, &[("w", &w)], &[("x", x)]);
            let s = stats_of(&rec.rows(), "matmul.0", "lhs", 0);
            assert_eq!(s["min"][0].to_bits(), 0.0f64.to_bits(), "{what}, lower={lower}: min {:?}", s["min"][0]);
            if what == "all -0" {
                assert_eq!(s["max"][0].to_bits(), 0.0f64.to_bits(), "{what}, lower={lower}: max {:?}", s["max"][0]);
            }
        }
    }
}

/// Direct mode: a manifest from `Pipeline::apply` carries tag 0, which a recorder cannot tell
/// from a run the `sample` stage left out (that run's sketches carry the negated tag, and -0.0
/// == 0.0), so every run read as unsampled and `finish` returned Ok over a header-only recording
/// (a helper's find). The recorder now refuses it with the fix; tapped with a tag from
/// `next_tag`, the same run records its rows (the lhs count: 4 x 8 elements).
#[test]
fn a_recorder_refuses_a_manifest_of_tag_0_and_records_a_tagged_one() {
    use opscope::record::Recorder;
    let (extra, manifest) = tapped_run_2d("matmul", 0);
    let sink = opscope::MemorySink::default();
    let rec = Recorder::new(Box::new(sink.clone()), "run".into());
    let reg = rec.register(manifest);
    rec.record(&reg, extra);
    let err = rec.finish().expect_err("tag 0 refused").to_string();
    assert!(err.contains("tag 0") && err.contains("pipeline.apply_tagged(&graph, None, recorder.next_tag())"), "{err}");
    assert!(sink.rows().is_empty());

    let sink = opscope::MemorySink::default();
    let rec = Recorder::new(Box::new(sink.clone()), "run".into());
    let (extra, manifest) = tapped_run_2d("matmul", rec.next_tag());
    let reg = rec.register(manifest);
    rec.record(&reg, extra);
    rec.finish().expect("a tagged manifest records");
    let rows = sink.rows();
    let count = rows.iter().find(|r| &*r.role == "lhs" && &*r.stat == "count").expect("the lhs count row");
    assert_eq!(count.value, (4 * 8) as f32);
}
