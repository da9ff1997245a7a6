//! The probes lowered into RLX primitive ops (`residual{lower=true}`, `route{lower=true}`,
//! `attn{lower=true}`: what a device without a native sketch kernel runs) give the native CPU
//! kernel's statistics: 1e-5 relative; counts, order statistics (median, top entries) and maxima
//! exactly equal; the same values absent (NaN slots); the manifest lists exactly the statistics
//! a lowering does not compute (none, for these fixtures); the caller's outputs stay
//! bit-identical. The native probes themselves are checked
//! against independent host code in `residual_skip.rs`, `route.rs` and `attn_reference.rs`.
//! Built with `--features gpu`, every fixture also runs on RLX's wgpu backend and is compared
//! with the CPU kernel (see `on_gpu`).

mod common;
use std::collections::{BTreeMap, BTreeSet};

use common::*;
use opscope::{Manifest, Row};
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

/// (site, role, stat) -> values by idx, over step 0.
type Stats = BTreeMap<(String, String, String), BTreeMap<u64, f64>>;

fn collect(rows: &[Row]) -> Stats {
    let mut m = Stats::new();
    for r in rows.iter().filter(|r| r.step == 0) {
        m.entry((r.site.to_string(), r.role.to_string(), r.stat.to_string())).or_default().insert(r.idx, r.value as f64);
    }
    m
}

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// Statistics compared exactly (counts, positions, maxima of the same f32 values).
const EXACT: &[&str] = &["rows", "out_chan_absmax", "out_median_abs", "out_top", "tokens", "load", "bad_ids", "queries", "keys", "topk"];

/// Every (site, role, stat, idx) recorded natively is recorded lowered within `tol` relative
/// (exactly for [`EXACT`]), except the statistics in `absent`, which the lowered recording must
/// not hold; nothing is recorded only when lowered. Returns the number of values compared.
fn assert_same(native: &Stats, lowered: &Stats, absent: &BTreeSet<&str>, tol: f64) -> usize {
    let mut compared = 0;
    for ((site, role, stat), vals) in native {
        let got = lowered.get(&(site.clone(), role.clone(), stat.clone()));
        if absent.contains(stat.as_str()) {
            assert!(got.is_none(), "{site}/{role} {stat}: the lowering should not record it, got {got:?}");
            continue;
        }
        let got = got.unwrap_or_else(|| panic!("{site}/{role} {stat}: recorded natively, missing when lowered"));
        assert_eq!(got.keys().collect::<Vec<_>>(), vals.keys().collect::<Vec<_>>(), "{site}/{role} {stat}: indices");
        for (i, w) in vals {
            let g = got[i];
            if EXACT.contains(&stat.as_str()) {
                assert_eq!(g, *w, "{site}/{role} {stat}[{i}]: lowered {g}, native {w}");
            } else {
                assert!((g - w).abs() <= tol * w.abs(), "{site}/{role} {stat}[{i}]: lowered {g}, native {w}");
            }
            compared += 1;
        }
    }
    for key in lowered.keys() {
        assert!(native.contains_key(key), "{key:?}: recorded only when lowered");
    }
    assert!(compared > 0, "nothing compared");
    compared
}

/// The statistics the manifest lists as not computed by the lowered sketch, per (site, role).
fn listed_not_lowered(m: &[Manifest]) -> BTreeSet<(String, String, String)> {
    m.iter()
        .flat_map(|m| m.skipped.iter())
        .filter(|k| k.reason.contains("not computed by the lowered sketch"))
        .map(|k| (k.site.clone(), k.role.as_ref().map(|r| r.as_str().to_string()).unwrap_or_default(), k.reason.split(' ').next().unwrap().to_string()))
        .collect()
}

/// Run `pipeline` natively and with `,lower=true` (or `{lower=true}`), check outputs are
/// bit-identical to an untapped run, the lowered statistics equal the native ones except
/// `absent`, and that the manifest lists exactly `absent` at every tapped (site, role).
fn check(pass: &str, opts: &str, g: &Graph, params: &[(&str, &[f32])], inputs: &[(&str, &[f32])], absent: &[&str]) -> (Stats, Stats) {
    let native_p = if opts.is_empty() { pass.to_string() } else { format!("{pass}{{{opts}}}") };
    let lowered_p = if opts.is_empty() { format!("{pass}{{lower=true}}") } else { format!("{pass}{{{opts},lower=true}}") };
    let plain = run_plain(g, params, inputs);
    let (n_out, native) = run_tapped(&native_p, g, params, inputs);
    let (l_out, lowered) = run_tapped(&lowered_p, g, params, inputs);
    assert_eq!(bits(&n_out), bits(&plain));
    assert_eq!(bits(&l_out), bits(&plain), "caller outputs bit-identical with the lowered probe");
    let (n, l) = (collect(&native.rows()), collect(&lowered.rows()));
    let absent: BTreeSet<&str> = absent.iter().copied().collect();
    assert_same(&n, &l, &absent, 1e-5);
    // The manifest lists exactly the absent statistics, at every tapped (site, role).
    let taps: BTreeSet<(String, String)> = n.keys().map(|k| (k.0.clone(), k.1.clone())).collect();
    let want: BTreeSet<(String, String, String)> =
        taps.iter().flat_map(|(s, r)| absent.iter().map(move |a| (s.clone(), r.clone(), a.to_string()))).collect();
    assert_eq!(listed_not_lowered(&lowered.manifests()), want, "the manifest lists what is not lowered");
    assert!(listed_not_lowered(&native.manifests()).is_empty());
    // No probe was left unlowered.
    assert!(lowered.manifests().iter().all(|m| m.skipped.iter().all(|s| !s.reason.contains("no lowering"))), "{:?}", lowered.manifests());
    #[cfg(feature = "gpu")]
    on_gpu(&native_p, g, params, inputs, &n);
    (n, l)
}

/// With `--features gpu`: the same pipeline on RLX's wgpu backend (lowered automatically)
/// gives the CPU kernel's statistics: counts equal, everything else within 1e-5 relative to the
/// largest |value| of its statistic (the two backends' GEMM and softmax differ in the last
/// bits); the caller's outputs on the GPU are bit-identical tapped and untapped.
#[cfg(feature = "gpu")]
fn on_gpu(pipeline: &str, g: &Graph, params: &[(&str, &[f32])], inputs: &[(&str, &[f32])], cpu: &Stats) {
    use rlx_runtime::{Device, Session};
    let run = || {
        let mut c = Session::new(Device::Gpu).compile(g.clone());
        for (name, v) in params {
            c.set_param(name, v);
        }
        c.run(inputs)
    };
    let plain = run();
    let p = opscope::Pipeline::parse(pipeline).unwrap();
    let sink = opscope::MemorySink::default();
    let (outs, res) = opscope::Scope::new(&p, Box::new(sink.clone())).device(Device::Gpu).run(run);
    res.expect("GPU recording");
    assert_eq!(bits(&outs), bits(&plain), "GPU caller outputs bit-identical tapped and untapped");
    let gpu = collect(&sink.rows());
    let counts = ["rows", "tokens", "load", "bad_ids", "queries", "keys", "topk"];
    assert_eq!(cpu.keys().collect::<Vec<_>>(), gpu.keys().collect::<Vec<_>>(), "the same statistics on the GPU");
    for (key, vals) in cpu {
        let scale = vals.values().map(|v| v.abs()).fold(0.0, f64::max);
        for (i, want) in vals {
            let got = gpu[key][i];
            if counts.contains(&key.2.as_str()) {
                assert_eq!(got, *want, "{key:?}[{i}]: gpu {got}, cpu {want}");
            } else {
                assert!((got - want).abs() <= 1e-5 * scale.max(1e-30), "{key:?}[{i}]: gpu {got}, cpu {want}");
            }
        }
    }
}

// ---------------------------------------------------------------- residual

const RB: usize = 2; // batch
const RS: usize = 5; // sequence
const RD: usize = 16; // width

/// `x[B,S,D]` with an `attention_mask[B,S]`; three blocks `x + W2 relu(W1 x)`, the last one
/// post-LN (RLX's CPU fusion makes it a FusedResidualLN).
fn residual_stack() -> Graph {
    let mut g = Graph::new("res");
    let mut x = g.input("x", f32s(&[RB, RS, RD]));
    let mask = g.input("attention_mask", f32s(&[RB, RS]));
    let gamma = g.param("gamma", f32s(&[RD]));
    let beta = g.param("beta", f32s(&[RD]));
    for i in 0..3 {
        let w1 = g.param(&format!("w1.{i}"), f32s(&[RD, RD]));
        let w2 = g.param(&format!("w2.{i}"), f32s(&[RD, RD]));
        let a = g.matmul(x, w1, f32s(&[RB, RS, RD]));
        let r = g.activation(Activation::Relu, a, f32s(&[RB, RS, RD]));
        let f = g.matmul(r, w2, f32s(&[RB, RS, RD]));
        x = g.binary(BinaryOp::Add, x, f, f32s(&[RB, RS, RD]));
        if i == 2 {
            x = g.layer_norm(x, gamma, beta, -1, 1e-5, f32s(&[RB, RS, RD]));
        }
    }
    g.set_outputs(vec![x, mask]);
    g
}

fn residual_data(mask: &[f32]) -> (Vec<(String, Vec<f32>)>, Vec<f32>) {
    let mut params = vec![("gamma".to_string(), randn(RD, 10)), ("beta".into(), randn(RD, 11))];
    for i in 0..3 {
        params.push((format!("w1.{i}"), randn(RD * RD, 20 + i as u64).iter().map(|v| v * 0.3).collect()));
        params.push((format!("w2.{i}"), randn(RD * RD, 30 + i as u64).iter().map(|v| v * 0.3).collect()));
    }
    let mut x = randn(RB * RS * RD, 1);
    // Any leak of a padding row shows: huge values in the first, zeros (which would move the
    // median and the minimum) in the others.
    let mut first = true;
    for (r, &m) in mask.iter().enumerate() {
        if m == 0.0 {
            x[r * RD..(r + 1) * RD].fill(if first { 1e6 } else { 0.0 });
            first = false;
        }
    }
    x[3 * RD + 7] = 300.0; // a massive activation carried by the stream
    (params, x)
}

const RESIDUAL_NOT_LOWERED: &[&str] = &[];

fn check_residual(mask: &[f32], opts: &str) -> (Stats, Stats) {
    let g = residual_stack();
    let (params, x) = residual_data(mask);
    let p: Vec<(&str, &[f32])> = params.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    check("residual", opts, &g, &p, &[("x", &x), ("attention_mask", mask)], RESIDUAL_NOT_LOWERED)
}

#[test]
fn residual_lowered_equals_native_with_padding() {
    let mask = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0];
    let (n, l) = check_residual(&mask, "");
    let key = |s: &str| ("block.0".to_string(), "block".to_string(), s.to_string());
    assert_eq!(l[&key("rows")][&0], 6.0, "padding rows excluded");
    assert_eq!(l[&key("cos_row")].len(), 6, "cos_row of padding rows not recorded");
    for k in ["ratio", "cos", "cos_row", "out_chan_absmax", "out_median_abs", "out_top"] {
        assert!(n.contains_key(&key(k)), "{k} compared");
    }
    let sites: BTreeSet<&str> = l.keys().map(|k| k.0.as_str()).collect();
    assert_eq!(sites.len(), 3, "three blocks: {sites:?}");
}

#[test]
fn residual_lowered_equals_native_without_mask() {
    let mask = [1.0; RB * RS];
    let (_, l) = check_residual(&mask, "mask=none");
    assert_eq!(l[&("block.1".to_string(), "block".to_string(), "rows".to_string())][&0], 10.0);
}

// ---------------------------------------------------------------- route

const T: usize = 24; // tokens
const E: usize = 4; // experts

/// `x[T,D] -> logits = x @ Wr + br -> (softmax) -> TopK(k=2)` (router); the first choice
/// dispatches x through GroupedMatMul over W[E,D,N]. `softmax` false: TopK over the logits (the
/// probe then takes them as logits).
fn moe(softmax: bool) -> Graph {
    let (d, n) = (8, 6);
    let mut g = Graph::new("moe");
    let x = g.input("x", f32s(&[T, d]));
    let wr = g.param("router.w", f32s(&[d, E]));
    let br = g.param("router.b", f32s(&[1, E]));
    let xw = g.matmul(x, wr, f32s(&[T, E]));
    let logits = g.binary(BinaryOp::Add, xw, br, f32s(&[T, E]));
    let scores = if softmax { g.softmax(logits, -1, f32s(&[T, E])) } else { logits };
    let top = g.add_node(Op::TopK { k: 2 }, vec![scores], f32s(&[T, 2]));
    let first = g.add_node(Op::Narrow { axis: 1, start: 0, len: 1 }, vec![top], f32s(&[T, 1]));
    let idx = g.reshape(first, vec![T as i64], f32s(&[T]));
    let w = g.param("experts.w", f32s(&[E, d, n]));
    let y = g.add_node(Op::GroupedMatMul, vec![x, w, idx], f32s(&[T, n]));
    g.set_outputs(vec![y, scores]);
    g
}

/// Planted: expert 0 favoured (+2 logit), expert 3 dead (-30: never chosen, probabilities
/// about 1e-13, still normal f32).
fn check_moe(softmax: bool) -> (Stats, Stats) {
    let (x, wr, br, w) = (randn(T * 8, 1), randn(8 * E, 2), vec![2.0, 0.0, 0.0, -30.0], randn(E * 8 * 6, 3));
    let params: [(&str, &[f32]); 3] = [("router.w", &wr), ("router.b", &br), ("experts.w", &w)];
    check("route", "", &moe(softmax), &params, &[("x", &x)], &[])
}

#[test]
fn route_lowered_equals_native_over_probabilities() {
    let (n, _) = check_moe(true);
    let stats: BTreeSet<&str> = n.keys().map(|k| k.2.as_str()).collect();
    assert_eq!(stats, ["bad_ids", "gate_mass", "importance", "kept_mass", "load", "tokens"].into_iter().collect());
    let load = &n[&("topk.0".to_string(), "router".to_string(), "load".to_string())];
    assert_eq!(load[&3], 0.0, "the dead expert");
    // The dispatch (no scores) is compared too.
    assert!(n.keys().any(|k| k.1 == "dispatch"));
}

#[test]
fn route_lowered_equals_native_over_logits() {
    check_moe(false);
}

/// 64 tokens of which the last 48 are padding (all routed to expert 7 with a large logit): the
/// lowered probe leaves them out as the kernel does.
#[test]
fn route_lowered_equals_native_with_padding() {
    const TOK: usize = 64;
    const EXP: usize = 8;
    let mut g = Graph::new("padded_router");
    let logits = g.input("logits", f32s(&[TOK, EXP]));
    let mask = g.input("attention_mask", f32s(&[TOK]));
    let top = g.add_node(Op::TopK { k: 2 }, vec![logits], f32s(&[TOK, 2]));
    g.set_outputs(vec![top, mask]);
    let mut l = randn(TOK * EXP, 5);
    for t in 16..TOK {
        l[t * EXP + 7] = 50.0;
    }
    let m: Vec<f32> = (0..TOK).map(|t| if t < 16 { 1.0 } else { 0.0 }).collect();
    let (n, _) = check("route", "", &g, &[], &[("logits", &l), ("attention_mask", &m)], &[]);
    assert_eq!(n[&("topk.0".to_string(), "router".to_string(), "tokens".to_string())][&0], 16.0);
}

// ---------------------------------------------------------------- attention

const AB: usize = 2;
const AH: usize = 3;
const AS: usize = 6;
const AD: usize = 4;

fn scalar(g: &mut Graph, v: f32) -> NodeId {
    g.add_node(Op::Constant { data: v.to_le_bytes().to_vec() }, vec![], f32s(&[1]))
}

/// The unfused attention of an ONNX BERT: `softmax((Q @ K^T) * scale + bias) @ V`, Q, K, V
/// `[B, H, S, D]`. `bias`: `Some(neg)` adds `(1 - mask) * neg` from the input `mask[B, S]`;
/// `None` adds nothing and takes `attention_mask[B, S]` as an output (the probe then reads the
/// padding row mask); `causal` adds a constant `[1, 1, S, S]` causal bias of `finfo.min`.
fn bert(bias: Option<f32>, causal: bool) -> Graph {
    let (b, h, s, d) = (AB, AH, AS, AD);
    let mut g = Graph::new("bert_unfused");
    let q = g.input("q", f32s(&[b, h, s, d]));
    let k = g.input("k", f32s(&[b, h, s, d]));
    let v = g.input("v", f32s(&[b, h, s, d]));
    let kt = g.add_node(Op::Transpose { perm: vec![0, 1, 3, 2] }, vec![k], f32s(&[b, h, d, s]));
    let scores = g.matmul(q, kt, f32s(&[b, h, s, s]));
    let c = scalar(&mut g, (d as f32).powf(-0.5));
    let mut z = g.binary(BinaryOp::Mul, scores, c, f32s(&[b, h, s, s]));
    let mut outs = Vec::new();
    if causal {
        let tri: Vec<u8> = (0..s * s).flat_map(|i| if i % s > i / s { f32::MIN } else { 0.0 }.to_le_bytes()).collect();
        let cb = g.add_node(Op::Constant { data: tri }, vec![], f32s(&[1, 1, s, s]));
        z = g.binary(BinaryOp::Add, z, cb, f32s(&[b, h, s, s]));
    }
    match bias {
        Some(neg) => {
            let mask = g.input("mask", f32s(&[b, s]));
            let m4 = g.reshape(mask, vec![b as i64, 1, 1, s as i64], f32s(&[b, 1, 1, s]));
            let one = scalar(&mut g, 1.0);
            let inv = g.binary(BinaryOp::Sub, one, m4, f32s(&[b, 1, 1, s]));
            let negc = scalar(&mut g, neg);
            let bias = g.binary(BinaryOp::Mul, inv, negc, f32s(&[b, 1, 1, s]));
            z = g.binary(BinaryOp::Add, z, bias, f32s(&[b, h, s, s]));
        }
        None => {
            let am = g.input("attention_mask", f32s(&[b, s]));
            outs.push(am);
        }
    }
    let p = g.softmax(z, -1, f32s(&[b, h, s, s]));
    let ctx = g.matmul(p, v, f32s(&[b, h, s, d]));
    outs.insert(0, ctx);
    g.set_outputs(outs);
    g
}

/// Batch 0 whole, batch 1 with its last `pad` tokens padding.
fn attn_check(bias: Option<f32>, causal: bool, opts: &str, pad: usize) -> (Stats, Stats) {
    let n = AB * AH * AS * AD;
    let q: Vec<f32> = randn(n, 100).iter().map(|x| 1.5 * x).collect();
    let (k, v) = (randn(n, 101), randn(n, 102));
    let mask: Vec<f32> = (0..AB * AS).map(|i| if i >= AS && i % AS >= AS - pad { 0.0 } else { 1.0 }).collect();
    let g = bert(bias, causal);
    let name = if bias.is_some() { "mask" } else { "attention_mask" };
    check("attn", opts, &g, &[], &[("q", &q), ("k", &k), ("v", &v), (name, &mask)], &[])
}

/// Every attention statistic is compared (a fixture where none is undefined).
fn assert_all_attn_stats(n: &Stats) {
    let got: BTreeSet<&str> = n.keys().map(|k| k.2.as_str()).collect();
    for s in ["queries", "keys", "peak", "entropy", "entropy_norm", "topk", "topk_mass", "sink_first", "sink_last", "pad_mass", "recv_max", "peak_pos", "recv_pos", "sink_first_lift", "sink_last_lift"] {
        assert!(got.contains(s), "{s} recorded natively (and so compared): {got:?}");
    }
}

#[test]
fn attn_lowered_equals_native_with_mask_bias() {
    let (n, _) = attn_check(Some(-10000.0), false, "topk=2", 2);
    assert_all_attn_stats(&n);
    assert_eq!(n[&("softmax.0".to_string(), "probs".to_string(), "queries".to_string())][&0], 10.0, "6 + 4 real queries");
}

#[test]
fn attn_lowered_equals_native_with_finfo_min_bias_and_default_topk() {
    // Batch 1 holds one real token: its query sees one key (no entropy_norm, no topk_mass).
    let (_, l) = attn_check(Some(f32::MIN), false, "", AS - 1);
    assert_eq!(l[&("softmax.0".to_string(), "probs".to_string(), "queries".to_string())][&0], 7.0);
}

/// No bias: the padding comes from the graph input attention_mask (pad_mass is then non-zero).
#[test]
fn attn_lowered_equals_native_with_padding_rows() {
    let (n, _) = attn_check(None, false, "topk=3", 2);
    let pad = &n[&("softmax.0".to_string(), "probs".to_string(), "pad_mass".to_string())];
    assert!(pad.values().all(|v| *v > 1e-3), "padding keys get mass without a mask: {pad:?}");
}

/// A causal bias under the padding bias (the probe reads the outer, padding bias: the kernel
/// and the lowering then agree on which keys are allowed): sinks and lifts of causal rows.
#[test]
fn attn_lowered_equals_native_causal() {
    attn_check(Some(-10000.0), true, "topk=2", 2);
}

/// A fused `Op::Attention`: the probe rebuilds probabilities from Q and K; lowered, by a graph
/// MatMul and Softmax under the same mask, it records the kernel's statistics.
fn fused_check(bhsd: bool, kv: usize, kind: &str, softcap: Option<f32>) -> Stats {
    use rlx_ir::op::MaskKind;
    let (b, h, s, d) = (2, 4, 6, 4);
    let (qd, kd): (Vec<usize>, Vec<usize>) = if bhsd { (vec![b, h, s, d], vec![b, kv, s, d]) } else { (vec![b, s, h * d], vec![b, s, kv * d]) };
    let mut g = Graph::new("fused");
    let q = g.input("q", f32s(&qd));
    let k = g.input("k", f32s(&kd));
    let v = g.input("v", f32s(&kd));
    let out = f32s(&qd);
    let qv: Vec<f32> = randn(qd.iter().product(), 41).iter().map(|x| 1.5 * x).collect();
    let (kv_, vv) = (randn(kd.iter().product(), 42), randn(kd.iter().product(), 43));
    let keys: Vec<f32> = (0..b * s).map(|i| if i >= s && i % s >= s - 2 { 0.0 } else { 1.0 }).collect();
    let mut bias = randn(b * h * s * s, 44);
    for (i, x) in bias.iter_mut().enumerate() {
        if i % s == s - 1 && i % 3 == 0 {
            *x = -10000.0;
        }
    }
    let mut inputs: Vec<(&str, &[f32])> = vec![("q", &qv), ("k", &kv_), ("v", &vv)];
    let o = match kind {
        "keys" => {
            let m = g.input("mask", f32s(&[b, s]));
            inputs.push(("mask", &keys));
            g.attention_opts(q, k, v, m, h, d, out, None, softcap)
        }
        "bias" => {
            let m = g.input("mask", f32s(&[b, h, s, s]));
            inputs.push(("mask", &bias));
            g.attention_bias_opts(q, k, v, m, h, d, out, Some(0.4), softcap)
        }
        "causal" => g.attention_kind_opts(q, k, v, h, d, MaskKind::Causal, out, None, softcap),
        _ => g.attention_kind_opts(q, k, v, h, d, MaskKind::SlidingWindow(2), out, None, softcap),
    };
    g.set_outputs(vec![o]);
    let (n, _) = check("attn", "topk=2", &g, &[], &inputs, &[]);
    assert!(n.keys().any(|k| k.2 == "entropy"), "{kind}: recorded");
    n
}

#[test]
fn fused_attention_lowered_equals_native() {
    fused_check(false, 4, "keys", None);
    fused_check(true, 2, "causal", Some(3.0)); // grouped-query, soft-capped ([B,H,S,D] path)
    fused_check(true, 4, "bias", None);
    fused_check(false, 4, "window", None);
    fused_check(false, 2, "keys", Some(3.0)); // soft-cap ignored by RLX off the [B,H,S,D] path
}

/// One block `x + W2 relu(W1 x)` over `x[3, 5]` (15 elements: an odd count, the median is the
/// middle value) with W2 = 0, so `x + f(x)` is exactly `x`, planted with ties of |value|: the
/// lowered `out_top` keeps the kernel's first-in-row-major-order entry of equal |values|.
#[test]
fn residual_median_odd_count_and_top_ties_lowered_equal_native() {
    let (r, d) = (3, 5);
    let mut g = Graph::new("res_small");
    let x = g.input("x", f32s(&[r, d]));
    let w1 = g.param("w1", f32s(&[d, d]));
    let w2 = g.param("w2", f32s(&[d, d]));
    let a = g.matmul(x, w1, f32s(&[r, d]));
    let h = g.activation(Activation::Relu, a, f32s(&[r, d]));
    let f = g.matmul(h, w2, f32s(&[r, d]));
    let y = g.binary(BinaryOp::Add, x, f, f32s(&[r, d]));
    g.set_outputs(vec![y]);
    let mut xv = randn(r * d, 3);
    // |9| at (0, 4), (1, 1) with sign -, (2, 0); |7| at (0, 2) and (2, 3).
    xv[4] = 9.0;
    xv[6] = -9.0;
    xv[10] = 9.0;
    xv[2] = -7.0;
    xv[13] = 7.0;
    let (w1v, w2v) = (randn(d * d, 4), vec![0.0f32; d * d]);
    let (n, l) = check("residual", "", &g, &[("w1", &w1v), ("w2", &w2v)], &[("x", &xv)], &[]);
    let top = &l[&("block.0".to_string(), "block".to_string(), "out_top".to_string())];
    let got: Vec<f64> = top.values().copied().collect();
    assert_eq!(got, vec![9.0, 0.0, 4.0, -9.0, 1.0, 1.0, 9.0, 2.0, 0.0, -7.0, 0.0, 2.0], "ties: first in row-major order");
    let mut abs: Vec<f64> = xv.iter().map(|v| v.abs() as f64).collect();
    abs.sort_by(f64::total_cmp);
    assert_eq!(n[&("block.0".to_string(), "block".to_string(), "out_median_abs".to_string())][&0], abs[7]);
}

/// A device without a native sketch kernel lowers the probes with no option: every residual
/// block (and a fused attention) is tapped by primitive ops only and nothing is skipped.
#[test]
fn non_cpu_device_lowers_probes_automatically() {
    let p = opscope::Pipeline::parse("residual").unwrap();
    let (out, m) = p.apply_on(&residual_stack(), None, 0, rlx_runtime::Device::Metal).unwrap();
    assert!(!out.nodes().iter().any(|n| matches!(&n.op, Op::Custom { .. })), "lowered on Metal");
    assert_eq!(m.outputs.len(), 3, "three blocks tapped");
    assert!(m.skipped.is_empty(), "{:?}", m.skipped);
    let (out, _) = p.apply_on(&residual_stack(), None, 0, rlx_runtime::Device::Cpu).unwrap();
    assert!(out.nodes().iter().any(|n| matches!(&n.op, Op::Custom { .. })), "native on the CPU");

    let mut g = Graph::new("fused");
    let f = |d: &[usize]| f32s(d);
    let (q, k, v, mk) = (g.input("q", f(&[1, 4, 8])), g.input("k", f(&[1, 4, 8])), g.input("v", f(&[1, 4, 8])), g.input("mask", f(&[1, 4])));
    let o = g.attention(q, k, v, mk, 2, 4, f(&[1, 4, 8]));
    g.set_outputs(vec![o]);
    let (out, m) = opscope::Pipeline::parse("attn").unwrap().apply_on(&g, None, 0, rlx_runtime::Device::Metal).unwrap();
    assert!(!out.nodes().iter().any(|n| matches!(&n.op, Op::Custom { .. })));
    assert_eq!(m.outputs.len(), 1, "{:?}", m.skipped);
}

/// Cross attention, `Sq != Sk` (3 queries over 5 keys, rank 3 `[B*H, Sq, Sk]`, no mask): every
/// query counts, the query at key `Sk - Sq + q` is "own" for the sinks.
#[test]
fn attn_lowered_equals_native_cross_attention() {
    let (bh, sq, sk, d) = (4, 3, 5, 4);
    let mut g = Graph::new("cross");
    let q = g.input("q", f32s(&[bh, sq, d]));
    let k = g.input("k", f32s(&[bh, sk, d]));
    let v = g.input("v", f32s(&[bh, sk, d]));
    let kt = g.add_node(Op::Transpose { perm: vec![0, 2, 1] }, vec![k], f32s(&[bh, d, sk]));
    let scores = g.matmul(q, kt, f32s(&[bh, sq, sk]));
    let c = scalar(&mut g, 0.5);
    let scaled = g.binary(BinaryOp::Mul, scores, c, f32s(&[bh, sq, sk]));
    let p = g.softmax(scaled, -1, f32s(&[bh, sq, sk]));
    let ctx = g.matmul(p, v, f32s(&[bh, sq, d]));
    g.set_outputs(vec![ctx]);
    let (qv, kv, vv) = (randn(bh * sq * d, 7), randn(bh * sk * d, 8), randn(bh * sk * d, 9));
    let (n, _) = check("attn", "topk=2", &g, &[], &[("q", &qv), ("k", &kv), ("v", &vv)], &[]);
    assert_eq!(n[&("softmax.0".to_string(), "probs".to_string(), "queries".to_string())][&0], (bh * sq) as f64);
    assert!(n.keys().any(|k| k.2 == "sink_last"));
}
