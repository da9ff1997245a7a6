//! The `matmul` tap leaves activation rows at padding positions out of every statistic when the
//! program has an `attention_mask` input with one value per row; weights are never masked.

mod common;
use common::*;
use rlx_ir::{DType, Graph, Shape};

const B: usize = 2;
const S: usize = 5;
const K: usize = 8;
const N: usize = 3;

/// x[B,S,K] @ w[K,N], with an attention_mask[B,S] input the model also returns (a model uses
/// its mask; RLX drops an unused input).
fn masked_matmul() -> Graph {
    let mut g = Graph::new("masked");
    let x = g.input("x", Shape::new(&[B, S, K], DType::F32));
    let mask = g.input("attention_mask", Shape::new(&[B, S], DType::F32));
    let w = g.param("w", Shape::new(&[K, N], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[B, S, N], DType::F32));
    g.set_outputs(vec![y, mask]);
    g
}

#[test]
fn padding_rows_add_to_no_statistic_of_an_activation() {
    // A hole in the first sequence and left padding in the second: real rows follow padding
    // rows, so a pair joining them would show in adj_sumsq.
    let mask: Vec<f32> = vec![1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0];
    // Padding rows hold a value no real row has: any leak shows in min/max/sums.
    let mut x = randn(B * S * K, 7);
    for (r, &m) in mask.iter().enumerate() {
        if m == 0.0 {
            x[r * K..(r + 1) * K].fill(1e6);
        }
    }
    let w = randn(K * N, 8);
    let (_, sink) = run_tapped(
        "matmul{roles=[lhs,rhs],hist_bins=8,elemsig=10}",
        &masked_matmul(),
        &[("w", &w)],
        &[("x", &x), ("attention_mask", &mask)],
    );
    let rows = sink.rows();
    let kept: Vec<usize> = (0..B * S).filter(|&r| mask[r] != 0.0).collect();
    let compact: Vec<f32> = kept.iter().flat_map(|&r| x[r * K..(r + 1) * K].to_vec()).collect();
    let mut want = reference(&compact, &[kept.len(), K], 8, 10);
    // Row-indexed statistics keep the rows' own indices; pairs never join a padding row or cross
    // a sequence.
    want.pos_sumsq = Vec::new();
    want.row_absmax = Vec::new();
    want.elemsig = Vec::new();
    want.adj_sumsq = (1..B * S)
        .filter(|&r| r % S != 0 && mask[r] != 0.0 && mask[r - 1] != 0.0)
        .map(|r| (0..K).map(|j| (x[r * K + j] as f64 - x[(r - 1) * K + j] as f64).powi(2)).sum::<f64>())
        .sum();
    let lhs: Vec<&opscope::Row> = rows.iter().filter(|r| &*r.role == "lhs").collect();
    let pos: Vec<(u64, f64)> = lhs.iter().filter(|r| &*r.stat == "pos_sumsq").map(|r| (r.idx, r.value as f64)).collect();
    let want_pos: Vec<(u64, f64)> =
        kept.iter().map(|&r| (r as u64, x[r * K..(r + 1) * K].iter().map(|&v| (v as f64).powi(2)).sum())).collect();
    assert_eq!(pos.len(), want_pos.len(), "pos_sumsq only at real rows: {pos:?}");
    for ((gi, gv), (wi, wv)) in pos.iter().zip(&want_pos) {
        assert!(gi == wi && close(*gv, *wv, 1e-5), "pos_sumsq[{gi}] {gv} vs [{wi}] {wv}");
    }
    let absmax: Vec<(u64, f64)> = lhs.iter().filter(|r| &*r.stat == "row_absmax").map(|r| (r.idx, r.value as f64)).collect();
    let want_absmax: Vec<(u64, f64)> =
        kept.iter().map(|&r| (r as u64, x[r * K..(r + 1) * K].iter().map(|&v| (v as f64).abs()).fold(0.0, f64::max))).collect();
    assert_eq!(absmax, want_absmax, "row_absmax (per-token absmax) only at real rows, exact");
    // Sampled elements at flat indices floor(j * numel / 10) that fall in padding rows are left out.
    let sig: Vec<(u64, f64)> = lhs.iter().filter(|r| &*r.stat == "elemsig").map(|r| (r.idx, r.value as f64)).collect();
    let want_sig: Vec<(u64, f64)> = (0..10)
        .map(|j| (j as u64, j * B * S * K / 10))
        .filter(|&(_, at)| mask[at / K] != 0.0)
        .map(|(j, at)| (j, x[at] as f64))
        .collect();
    assert_eq!(sig, want_sig);
    let without: Vec<opscope::Row> = lhs.iter().filter(|r| !matches!(&*r.stat, "pos_sumsq" | "row_absmax" | "elemsig")).map(|r| (*r).clone()).collect();
    assert_matches_reference(&without, "matmul.0", "lhs", &want, 1e-5);
    // The weight is not masked (its rows are not tokens).
    let wref = reference(&w, &[K, N], 8, 10);
    let rhs: Vec<opscope::Row> = rows.iter().filter(|r| &*r.role == "rhs").cloned().collect();
    assert_matches_reference(&rhs, "matmul.0", "rhs", &wref, 1e-5);
    assert!(sink.manifests()[0].padding.as_deref().is_some_and(|p| p.contains("attention_mask")));

    // padding=include counts every row: the 1e6 rows show.
    let (_, sink) = run_tapped(
        "matmul{roles=[lhs],stats=[max],padding=include}",
        &masked_matmul(),
        &[("w", &w)],
        &[("x", &x), ("attention_mask", &mask)],
    );
    let max = sink.rows().iter().find(|r| &*r.stat == "max").unwrap().value;
    assert_eq!(max, 1e6);
}

#[test]
fn a_per_head_activation_masks_each_heads_padding_positions() {
    // q[B,H,S,K] @ kt[B,H,K,S] (attention scores): the lhs and out rows are (batch, head,
    // position); the mask [B,S] is shared by the heads. The rhs (K^T) has no token rows.
    const H: usize = 2;
    let mut g = Graph::new("heads");
    let q = g.input("q", Shape::new(&[B, H, S, K], DType::F32));
    let kt = g.input("kt", Shape::new(&[B, H, K, S], DType::F32));
    let mask_in = g.input("attention_mask", Shape::new(&[B, S], DType::F32));
    let y = g.matmul(q, kt, Shape::new(&[B, H, S, S], DType::F32));
    g.set_outputs(vec![y, mask_in]);
    // Left padding in the first sequence, a hole in the second: a real row follows a padding
    // row, so a pair that joined them would show in adj_sumsq.
    let mask: Vec<f32> = vec![0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0];
    let mut qv = randn(B * H * S * K, 3);
    let kv = randn(B * H * K * S, 4);
    let kept = |r: usize| mask[(r / (H * S)) * S + r % S] != 0.0;
    for r in 0..B * H * S {
        if !kept(r) {
            qv[r * K..(r + 1) * K].fill(1e6);
        }
    }
    // Every statistic (the default set, a histogram and sampled elements).
    let (_, sink) = run_tapped("matmul{hist_bins=8,elemsig=10}", &g, &[], &[("q", &qv), ("kt", &kv), ("attention_mask", &mask)]);
    let rows = sink.rows();
    let real_rows: Vec<usize> = (0..B * H * S).filter(|&r| kept(r)).collect();
    let compact: Vec<f32> = real_rows.iter().flat_map(|&r| qv[r * K..(r + 1) * K].to_vec()).collect();
    let mut want = reference(&compact, &[real_rows.len(), K], 8, 10);
    // Row-indexed statistics keep the rows' own indices (checked below); pairs never join a
    // padding row or cross a (batch, head) block of S positions.
    want.pos_sumsq = Vec::new();
    want.row_absmax = Vec::new();
    want.elemsig = Vec::new();
    want.adj_sumsq = (1..B * H * S)
        .filter(|&r| r % S != 0 && kept(r) && kept(r - 1))
        .map(|r| (0..K).map(|j| (qv[r * K + j] as f64 - qv[(r - 1) * K + j] as f64).powi(2)).sum::<f64>())
        .sum();
    let lhs: Vec<&opscope::Row> = rows.iter().filter(|r| &*r.role == "lhs").collect();
    let by = |stat: &str| -> Vec<(u64, f64)> { lhs.iter().filter(|r| &*r.stat == stat).map(|r| (r.idx, r.value as f64)).collect() };
    let want_pos: Vec<(u64, f64)> =
        real_rows.iter().map(|&r| (r as u64, qv[r * K..(r + 1) * K].iter().map(|&v| (v as f64).powi(2)).sum())).collect();
    let pos = by("pos_sumsq");
    assert_eq!(pos.iter().map(|p| p.0).collect::<Vec<_>>(), want_pos.iter().map(|p| p.0).collect::<Vec<_>>(), "pos_sumsq only at real rows");
    for ((i, g), (_, w)) in pos.iter().zip(&want_pos) {
        assert!(close_rel(*g, *w, 1e-6), "pos_sumsq[{i}] {g} vs {w}");
    }
    let want_absmax: Vec<(u64, f64)> =
        real_rows.iter().map(|&r| (r as u64, qv[r * K..(r + 1) * K].iter().map(|&v| (v as f64).abs()).fold(0.0, f64::max))).collect();
    assert_eq!(by("row_absmax"), want_absmax, "row_absmax only at real rows, exact");
    let want_sig: Vec<(u64, f64)> = (0..10)
        .map(|j| (j as u64, j * B * H * S * K / 10))
        .filter(|&(_, at)| kept(at / K))
        .map(|(j, at)| (j, qv[at] as f64))
        .collect();
    assert_eq!(by("elemsig"), want_sig, "sampled elements in padding rows are left out");
    let without: Vec<opscope::Row> =
        lhs.iter().filter(|r| !matches!(&*r.stat, "pos_sumsq" | "row_absmax" | "elemsig")).map(|r| (*r).clone()).collect();
    assert_matches_reference(&without, "matmul.0", "lhs", &want, 1e-6);
    let rhs = stats_of(&rows, "matmul.0", "rhs", 0);
    assert_eq!(rhs["count"], vec![(B * H * K * S) as f64], "K^T is not masked");
}

/// An `attention_mask` of int64, as Hugging Face ONNX exports declare it (MiniLM's), masks the
/// same rows as an f32 one: the tap casts it to f32 for the sketch (the kernel reads an f32 row
/// mask and would reject the raw int64 bytes).
#[test]
fn an_int64_attention_mask_masks_like_an_f32_one() {
    let mut g = Graph::new("masked_i64");
    let x = g.input("x", Shape::new(&[B, S, K], DType::F32));
    let mask_in = g.input("attention_mask", Shape::new(&[B, S], DType::I64));
    let w = g.param("w", Shape::new(&[K, N], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[B, S, N], DType::F32));
    g.set_outputs(vec![y, mask_in]);
    let mask: Vec<i64> = vec![1, 1, 1, 1, 0, 1, 1, 0, 0, 0];
    let mut xv = randn(B * S * K, 11);
    for (r, &m) in mask.iter().enumerate() {
        if m == 0 {
            xv[r * K..(r + 1) * K].fill(-1e6);
        }
    }
    let wv = randn(K * N, 12);
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (xb, mb) = (le(&xv), mask.iter().flat_map(|m| m.to_le_bytes()).collect::<Vec<u8>>());
    let p = opscope::Pipeline::parse("matmul{roles=[lhs],stats=[min,max,sumsq]}").unwrap();
    let sink = opscope::MemorySink::default();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &wv);
        c.run_typed(&[("x", &xb, DType::F32), ("attention_mask", &mb, DType::I64)])
    })
    .unwrap();
    let real: Vec<f64> = (0..B * S).filter(|&r| mask[r] != 0).flat_map(|r| xv[r * K..(r + 1) * K].iter().map(|&v| v as f64)).collect();
    let s = stats_of(&sink.rows(), "matmul.0", "lhs", 0);
    assert_eq!(s["count"], vec![real.len() as f64], "{s:?}");
    assert_eq!(s["min"], vec![real.iter().copied().fold(f64::MAX, f64::min)]);
    assert_eq!(s["max"], vec![real.iter().copied().fold(f64::MIN, f64::max)]);
    assert!(close(s["sumsq"][0], real.iter().map(|v| v * v).sum(), 1e-6));
    assert!(sink.manifests()[0].padding.as_deref().is_some_and(|p| p.contains("I64")), "{:?}", sink.manifests()[0].padding);
}

/// A batch that is all padding has no real row: the activation's per-channel absmax is not
/// recorded (absent, never a row of zeros), and its count is 0; natively and lowered. (Found by
/// a cargo-mutants survivor: it was recorded as a row of zeros while `max` was absent.)
#[test]
fn an_all_padding_batch_records_no_per_channel_absmax() {
    let mask = vec![0.0f32; B * S];
    let x = randn(B * S * K, 13);
    let w = randn(K * N, 14);
    let (_, sink) = run_tapped(
        "matmul{roles=[lhs],stats=[max,chan_maxabs]}",
        &masked_matmul(),
        &[("w", &w)],
        &[("x", &x), ("attention_mask", &mask)],
    );
    let s = stats_of(&sink.rows(), "matmul.0", "lhs", 0);
    assert_eq!(s["count"], vec![0.0], "{s:?}");
    assert!(!s.contains_key("chan_maxabs"), "chan_maxabs recorded for a batch with no real row: {s:?}");
    // The lowered sketch (RLX primitive ops) agrees.
    let (_, sink) = run_tapped(
        "matmul{roles=[lhs],stats=[max,chan_maxabs],lower=true}",
        &masked_matmul(),
        &[("w", &w)],
        &[("x", &x), ("attention_mask", &mask)],
    );
    let s = stats_of(&sink.rows(), "matmul.0", "lhs", 0);
    assert!(!s.contains_key("chan_maxabs") && !s.contains_key("max"), "lowered: {s:?}");
    // The same with real rows records one value per channel.
    let (_, sink) = run_tapped("matmul{roles=[lhs],stats=[max,chan_maxabs]}", &masked_matmul(), &[("w", &w)], &[("x", &x), ("attention_mask", &vec![1.0; B * S])]);
    assert_eq!(stats_of(&sink.rows(), "matmul.0", "lhs", 0)["chan_maxabs"].len(), K);
}
