//! Every sketch statistic, recorded through a real tapped RLX run, equals a host reference on
//! random tensors and on edge tensors (NaN, +/-Inf, zeros, a constant, K=0, M=1, rank 3).

mod common;
use common::*;

const SITE: &str = "matmul.0";

fn check_2d(m: usize, k: usize, n: usize, x: Vec<f32>, w: Vec<f32>) {
    let g = matmul_2d(m, k, n);
    let (outs, sink) = run_tapped("matmul{hist_bins=16,elemsig=5}", &g, &[("w", &w)], &[("x", &x)]);
    let rows = sink.rows();
    assert_matches_reference(&rows, SITE, "lhs", &reference(&x, &[m, k], 16, 5), 1e-5);
    assert_matches_reference(&rows, SITE, "rhs", &reference(&w, &[k, n], 16, 5), 1e-5);
    assert_matches_reference(&rows, SITE, "out", &reference(&outs[0], &[m, n], 16, 5), 1e-5);
}

#[test]
fn random_2d() {
    check_2d(33, 70, 17, randn(33 * 70, 1), randn(70 * 17, 2));
}

#[test]
fn random_2d_with_offset_mean() {
    // A large mean against a small spread: the centred moments must not cancel.
    let x: Vec<f32> = randn(64 * 40, 3).iter().map(|v| 100.0 + 0.01 * v).collect();
    check_2d(64, 40, 9, x, randn(40 * 9, 4));
}

#[test]
fn m_equals_one() {
    check_2d(1, 31, 5, randn(31, 5), randn(31 * 5, 6));
}

#[test]
fn nan_and_infinities_are_counted_not_absorbed() {
    let mut x = randn(8 * 16, 7);
    x[3] = f32::NAN;
    x[20] = f32::INFINITY;
    x[21] = f32::NEG_INFINITY;
    x[100] = f32::NAN;
    let g = matmul_2d(8, 16, 4);
    let w = randn(16 * 4, 8);
    let (_outs, sink) = run_tapped("matmul{hist_bins=8,elemsig=4}", &g, &[("w", &w)], &[("x", &x)]);
    let rows = sink.rows();
    let r = reference(&x, &[8, 16], 8, 4);
    assert_eq!((r.nan, r.posinf, r.neginf, r.count), (2.0, 1.0, 1.0, 124.0));
    assert_matches_reference(&rows, SITE, "lhs", &r, 1e-5);
}

#[test]
fn all_zeros() {
    let x = vec![0f32; 6 * 10];
    let w = randn(10 * 3, 9);
    let g = matmul_2d(6, 10, 3);
    let (outs, sink) = run_tapped("matmul{hist_bins=4,elemsig=3}", &g, &[("w", &w)], &[("x", &x)]);
    let rows = sink.rows();
    let r = reference(&x, &[6, 10], 4, 3);
    assert_eq!(r.nnz, 0.0);
    assert!(r.kurtosis.is_none() && r.chan_outlier.is_none());
    assert_matches_reference(&rows, SITE, "lhs", &r, 1e-6);
    assert!(outs[0].iter().all(|v| *v == 0.0));
    assert_matches_reference(&rows, SITE, "out", &reference(&outs[0], &[6, 3], 4, 3), 1e-6);
}

#[test]
fn constant_tensor_has_no_kurtosis() {
    // 2.5 sums exactly in f32; 0.1 over 384 channels does not (the mean drifts by ulps).
    for (v, k) in [(2.5f32, 12), (0.1, 384), (1.0 / 3.0, 64)] {
        let x = vec![v; 5 * k];
        let w = randn(k * 2, 10);
        check_2d(5, k, 2, x, w);
    }
}

#[test]
fn k_zero_records_count_zero() {
    let g = matmul_2d(4, 0, 3);
    let (outs, sink) = run_tapped("matmul", &g, &[("w", &[])], &[("x", &[])]);
    let rows = sink.rows();
    for role in ["lhs", "rhs"] {
        let s = stats_of(&rows, SITE, role, 0);
        assert_eq!(s.get("count"), Some(&vec![0.0]), "{role}: {s:?}");
        assert_eq!(s.len(), 1, "{role}: only count is defined for an empty tensor: {s:?}");
    }
    assert_matches_reference(&rows, SITE, "out", &reference(&outs[0], &[4, 3], 32, 16), 1e-6);
}

#[test]
fn rank_3_batched() {
    let (b, m, k, n) = (3, 7, 11, 5);
    let a = randn(b * m * k, 11);
    let bb = randn(b * k * n, 12);
    let g = matmul_3d(b, m, k, n);
    let (outs, sink) = run_tapped("matmul{hist_bins=10,elemsig=7}", &g, &[], &[("a", &a), ("b", &bb)]);
    let rows = sink.rows();
    assert_matches_reference(&rows, SITE, "lhs", &reference(&a, &[b, m, k], 10, 7), 1e-5);
    assert_matches_reference(&rows, SITE, "rhs", &reference(&bb, &[b, k, n], 10, 7), 1e-5);
    assert_matches_reference(&rows, SITE, "out", &reference(&outs[0], &[b, m, n], 10, 7), 1e-5);
    // (adj_sumsq pairs stay inside each batch: the reference pairs rows within a batch only.)
    let flops = rows.iter().find(|r| &*r.site == SITE).and_then(|r| r.flops);
    assert_eq!(flops, Some((2 * b * m * k * n) as u64));
}

#[test]
fn fixed_histogram_range_counts_outside_values() {
    let x: Vec<f32> = (0..40).map(|i| i as f32 / 4.0 - 5.0).collect(); // -5 .. 4.75
    let w = randn(8 * 2, 13);
    let g = matmul_2d(5, 8, 2);
    let (_o, sink) = run_tapped("matmul{roles=[lhs],stats=[hist],hist_bins=4,hist_range=-2:2}", &g, &[("w", &w)], &[("x", &x)]);
    let s = stats_of(&sink.rows(), SITE, "lhs", 0);
    let inside: Vec<f32> = x.iter().copied().filter(|v| (-2.0..=2.0).contains(v)).collect();
    let mut want = vec![0.0; 4];
    for v in &inside {
        let b = (((v + 2.0) / 1.0) as usize).min(3);
        want[b] += 1.0;
    }
    assert_eq!(s["hist"], want);
    assert_eq!(s["hist_outside"], vec![(x.len() - inside.len()) as f64]);
    assert_eq!((s["hist_lo"][0], s["hist_hi"][0]), (-2.0, 2.0));
    assert!(!s.contains_key("min"), "only the selected statistics are recorded");
}

#[test]
fn several_steps_are_numbered() {
    let g = matmul_2d(2, 3, 2);
    let p = opscope::Pipeline::parse("matmul{stats=[max]}").unwrap();
    let sink = opscope::MemorySink::default();
    let w = randn(6, 1);
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &w);
        for s in 0..3 {
            let x = vec![s as f32 + 1.0; 6];
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    let rows = sink.rows();
    for s in 0..3u64 {
        assert_eq!(stats_of(&rows, SITE, "lhs", s)["max"], vec![s as f64 + 1.0]);
    }
}

#[test]
fn a_changed_weight_is_recorded_again() {
    let g = matmul_2d(2, 3, 2);
    let p = opscope::Pipeline::parse("matmul{roles=[rhs],stats=[max]}").unwrap();
    let sink = opscope::MemorySink::default();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        let x = vec![1.0; 6];
        for (step, scale) in [(0, 1.0f32), (1, 1.0), (2, 3.0), (3, 3.0)] {
            let _ = step;
            c.set_param("w", &[0.5 * scale, 1.0 * scale, 0.25, 0.0, 0.0, 0.0]);
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    let rows = sink.rows();
    let max: Vec<(u64, f64)> = rows.iter().filter(|r| &*r.stat == "max").map(|r| (r.step, r.value as f64)).collect();
    assert_eq!(max, vec![(0, 1.0), (2, 3.0)], "recorded when first seen and when it changed");
}

#[test]
fn a_graph_compiled_in_one_scope_and_run_in_another_is_an_error_not_a_mixup() {
    let g = matmul_2d(2, 3, 2);
    let p = opscope::Pipeline::parse("matmul{stats=[max]}").unwrap();
    let mut c = opscope::scope(&p, Box::new(opscope::MemorySink::default()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &[1.0; 6]);
        c
    })
    .unwrap();
    let sink = opscope::MemorySink::default();
    let err = opscope::scope(&p, Box::new(sink.clone()), || c.run(&[("x", &[1.0; 6])])).expect_err("mismatch");
    assert!(err.to_string().contains("compiled outside this recording"), "{err}");
    assert!(sink.rows().is_empty());
}
