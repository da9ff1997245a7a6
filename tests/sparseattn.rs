//! The `sparseattn` actuation (top-k attention, Gupta et al. 2021; sliding window with attention
//! sinks, StreamingLLM, Xiao et al. 2023) against host implementations:
//! - the unfused BERT form (`MatMul -> Add(mask bias) -> Softmax -> MatMul`) with padding
//!   (bias -10000 and `finfo.min`) and a causal bias: the output is **bit-identical** to the same
//!   graph with the host's keep mask fed in (`where(keep, s, f32::MIN)`, keep computed in f64 on
//!   the host), so the pass selects exactly the host's keys; and it equals a plain f64 masked
//!   softmax attention (kept and allowed keys only) to 1e-5;
//! - the fused form (`Op::Attention`, key mask and causal, rank 3 `[B,S,H*D]`): equal to the f64
//!   host to 1e-5 (the fused op is lowered with rlx-fusion's `LowerAttention` first);
//! - masked keys never come back: with `topk` or a window larger than a padded sequence's valid
//!   keys but smaller than `S` the rewrite is in the graph and the output is bit-identical to
//!   the untouched model (dropped padding keys had probability 0 before, and have now);
//! - `topk >= S` and `window >= S` leave the graph unchanged (skipped with the reason), outputs
//!   bit-identical;
//! - option errors name the fix; the rewritten graphs are pinned (insta) and pass the verifier.

mod common;
use common::*;
use opscope::Pipeline;
use rlx_ir::infer::GraphExt;
use rlx_ir::op::{BinaryOp, CmpOp, MaskKind};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

const B: usize = 2;
const H: usize = 2;
const S: usize = 16;
const D: usize = 8;
/// Valid tokens of sequence 1 (sequence 0 has no padding).
const VALID: usize = 10;

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// Which bias the unfused fixture adds to its scores.
#[derive(Clone, Copy, Debug)]
enum Bias {
    /// Padding keys of sequence 1 get -10000 (BERT's `(1 - mask) * -10000`).
    Pad,
    /// Padding keys get `finfo(float32).min` (recent Hugging Face exports).
    PadFinfo,
    /// Padding plus causal (-10000 for `j > i`).
    PadCausal,
}

/// The additive bias `[B, 1, S, S]`.
fn bias(kind: Bias) -> Vec<f32> {
    let mut out = vec![0f32; B * S * S];
    for b in 0..B {
        for i in 0..S {
            for j in 0..S {
                let pad = b == 1 && j >= VALID;
                let v = match kind {
                    Bias::Pad if pad => -10000.0,
                    Bias::PadFinfo if pad => f32::MIN,
                    Bias::PadCausal if pad || j > i => -10000.0,
                    _ => 0.0,
                };
                out[(b * S + i) * S + j] = v;
            }
        }
    }
    out
}

/// `softmax(q @ kt + bias) @ v` with q, v `[B,H,S,D]`, kt `[B,H,D,S]`, bias `[B,1,S,S]`. With
/// `keep_input`, the scores go through `where(keep > 0.5, s, f32::MIN)` first (the host's mask).
fn unfused(keep_input: bool) -> Graph {
    let mut g = Graph::new("bert_attn");
    let q = g.input("q", f32s(&[B, H, S, D]));
    let kt = g.input("kt", f32s(&[B, H, D, S]));
    let v = g.input("v", f32s(&[B, H, S, D]));
    let bias = g.input("bias", f32s(&[B, 1, S, S]));
    let sc = g.matmul(q, kt, f32s(&[B, H, S, S]));
    let mut s = g.binary(BinaryOp::Add, sc, bias, f32s(&[B, H, S, S]));
    if keep_input {
        let keep = g.input("keep", f32s(&[B, H, S, S]));
        let half = g.full(&[1, 1, 1, 1], 0.5, DType::F32);
        let cond = g.add_node(Op::Compare(CmpOp::Gt), vec![keep, half], Shape::new(&[B, H, S, S], DType::Bool));
        let low = g.full(&[1, 1, 1, 1], f32::MIN, DType::F32);
        s = g.add_node(Op::Where, vec![cond, s, low], f32s(&[B, H, S, S]));
    }
    let p = g.add_node(Op::Softmax { axis: -1 }, vec![s], f32s(&[B, H, S, S]));
    let o = g.matmul(p, v, f32s(&[B, H, S, D]));
    g.set_outputs(vec![o]);
    g
}

struct Data {
    q: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    bias: Vec<f32>,
}

fn data(kind: Bias, seed: u64) -> Data {
    let n = B * H * S * D;
    // q scaled up so that rows are peaked (top-k then matters) and gaps between scores are wide.
    Data { q: randn(n, seed).iter().map(|x| 1.5 * x).collect(), kt: randn(n, seed + 1), v: randn(n, seed + 2), bias: bias(kind) }
}

/// Host scores `[B,H,S,S]` in f64 (bias included) and which keys the bias allows.
fn host_scores(d: &Data) -> (Vec<f64>, Vec<bool>) {
    let mut s = vec![0.0; B * H * S * S];
    let mut allowed = vec![false; s.len()];
    for b in 0..B {
        for h in 0..H {
            for i in 0..S {
                for j in 0..S {
                    let dot: f64 = (0..D).map(|x| d.q[((b * H + h) * S + i) * D + x] as f64 * d.kt[((b * H + h) * D + x) * S + j] as f64).sum();
                    let bias = d.bias[(b * S + i) * S + j] as f64;
                    let at = ((b * H + h) * S + i) * S + j;
                    s[at] = dot + bias;
                    allowed[at] = bias > -1000.0;
                }
            }
        }
    }
    (s, allowed)
}

/// Which keys the pass keeps, on the host: per row, the top `k` scores (ties at the k-th kept),
/// or the window `|i - j| < w` (Sq = Sk here) plus `sinks` first keys. Also asserts that the
/// k-th allowed score is separated from the next by more than f32 scores can move (1e-3), so
/// that the host's selection in f64 is the one RLX makes in f32.
#[derive(Clone, Copy, Debug)]
enum Keep {
    TopK(usize),
    Window(usize, usize),
}

fn host_keep(s: &[f64], allowed: &[bool], keep: Keep) -> Vec<bool> {
    host_keep_with(s, allowed, keep, true)
}

fn host_keep_with(s: &[f64], allowed: &[bool], keep: Keep, check_margin: bool) -> Vec<bool> {
    let mut out = vec![false; s.len()];
    for (r, row) in s.chunks(S).enumerate() {
        let i = r % S;
        match keep {
            Keep::TopK(k) => {
                let mut sorted = row.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let kth = sorted[k - 1];
                let allowed_row = &allowed[r * S..(r + 1) * S];
                let n_allowed = allowed_row.iter().filter(|a| **a).count();
                if check_margin && k < n_allowed {
                    assert!(sorted[k - 1] - sorted[k] > 1e-3, "row {r}: k-th and next score {} {} too close for this fixture", sorted[k - 1], sorted[k]);
                }
                for j in 0..S {
                    out[r * S + j] = row[j] >= kth;
                }
            }
            Keep::Window(w, sinks) => {
                for j in 0..S {
                    out[r * S + j] = j < sinks || i.abs_diff(j) < w;
                }
            }
        }
    }
    out
}

/// Host masked softmax attention in f64: softmax over the kept *and* allowed keys, then `@ v`.
/// A padding query whose kept keys are all padding (a window far from the valid tokens) has no
/// defined output (RLX spreads it over the kept padding keys, whose f32 scores near -10000 carry
/// 1e-3 rounding): NaN here, and [`max_diff`] leaves it out; the bit-exact check covers it.
fn host_output(d: &Data, s: &[f64], allowed: &[bool], keep: &[bool]) -> Vec<f64> {
    let mut o = vec![f64::NAN; B * H * S * D];
    for r in 0..B * H * S {
        let bh = r / S;
        let idx: Vec<usize> = (0..S).filter(|&j| allowed[r * S + j] && keep[r * S + j]).collect();
        if idx.is_empty() {
            assert!(r / (S * H) == 1 && r % S >= VALID, "row {r}: only a padding query may keep no valid key");
            continue;
        }
        let mx = idx.iter().map(|&j| s[r * S + j]).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = idx.iter().map(|&j| (s[r * S + j] - mx).exp()).sum();
        for x in 0..D {
            o[r * D + x] = idx.iter().map(|&j| (s[r * S + j] - mx).exp() / z * d.v[(bh * S + j) * D + x] as f64).sum();
        }
    }
    o
}

fn inputs(d: &Data) -> Vec<(&str, &[f32])> {
    vec![("q", &d.q), ("kt", &d.kt), ("v", &d.v), ("bias", &d.bias)]
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(_, y)| !y.is_nan()).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

fn pipeline(keep: Keep) -> String {
    match keep {
        Keep::TopK(k) => format!("sparseattn{{topk={k}}}"),
        Keep::Window(w, s) => format!("sparseattn{{window={w},sinks={s}}}"),
    }
}

#[test]
fn unfused_bert_form_equals_the_host_mask_bit_for_bit_and_the_f64_reference() {
    let cases = [
        (Bias::Pad, Keep::TopK(4)),
        (Bias::Pad, Keep::TopK(1)),
        (Bias::PadFinfo, Keep::TopK(6)),
        (Bias::PadCausal, Keep::TopK(3)),
        (Bias::Pad, Keep::Window(3, 1)),
        (Bias::PadFinfo, Keep::Window(2, 2)),
        (Bias::PadCausal, Keep::Window(4, 1)),
        (Bias::Pad, Keep::Window(5, 0)),
    ];
    for (seed, (kind, keep)) in cases.into_iter().enumerate() {
        let d = data(kind, 40 + 3 * seed as u64);
        let (s, allowed) = host_scores(&d);
        let kept = host_keep(&s, &allowed, keep);
        let (out, sink) = run_tapped(&pipeline(keep), &unfused(false), &[], &inputs(&d));
        let acts = &sink.manifests()[0].actuations;
        assert_eq!(acts.len(), 1, "{kind:?} {keep:?}: {acts:?}");
        // Bit for bit against the same program with the host's keep mask as an input.
        let keep_f: Vec<f32> = kept.iter().map(|k| if *k { 1.0 } else { 0.0 }).collect();
        let mut ins = inputs(&d);
        ins.push(("keep", &keep_f));
        let want = run_plain(&unfused(true), &[], &ins);
        assert_eq!(bits(&out), bits(&want), "{kind:?} {keep:?}: not the host's keep mask");
        // Against plain f64 masked softmax attention.
        let host = host_output(&d, &s, &allowed, &kept);
        let diff = max_diff(&out[0], &host);
        assert!(diff < 1e-5, "{kind:?} {keep:?}: max |RLX - host f64| = {diff:e}");
        // And it is a change: the dense model differs.
        let dense = run_plain(&unfused(false), &[], &inputs(&d));
        assert_ne!(bits(&out), bits(&dense), "{kind:?} {keep:?}: nothing was dropped");
    }
}

#[test]
fn masked_keys_never_come_back_and_covering_settings_change_nothing() {
    for kind in [Bias::Pad, Bias::PadFinfo] {
        let d = data(kind, 7);
        let dense = run_plain(&unfused(false), &[], &inputs(&d));
        // Sequence 0 has S valid keys, so these must be no-ops only in sequence 1: compare it.
        let half = B * H * S * D / 2;
        for keep in [Keep::TopK(VALID), Keep::TopK(S - 1), Keep::Window(VALID, 0)] {
            let (out, sink) = run_tapped(&pipeline(keep), &unfused(false), &[], &inputs(&d));
            assert_eq!(sink.manifests()[0].actuations.len(), 1, "{kind:?} {keep:?}: rewrite applied");
            // Sequence 1 (10 valid keys): every valid key is kept (top-10 of a row whose
            // padding scores are ~-10000; a window of 10 spans all of 0..10 from any valid
            // query), and dropped padding keys had probability exactly 0 before: bit-identical.
            // Padding queries of sequence 1 (rows 10..16) under the window keep keys 1.. of
            // their own band only, so only valid queries are compared there.
            for h in 0..H {
                for i in 0..VALID {
                    let at = half + (h * S + i) * D;
                    let (a, b) = (&out[0][at..at + D], &dense[0][at..at + D]);
                    assert_eq!(bits(&[a.to_vec()]), bits(&[b.to_vec()]), "{kind:?} {keep:?}: head {h} query {i} changed");
                }
            }
        }
        // Covering every key: the pass leaves the graph alone and says so; all outputs identical.
        for keep in [Keep::TopK(S), Keep::TopK(S + 5), Keep::Window(S, 0), Keep::Window(1, S)] {
            let (out, sink) = run_tapped(&pipeline(keep), &unfused(false), &[], &inputs(&d));
            let m = &sink.manifests()[0];
            assert!(m.actuations.is_empty(), "{keep:?}: {:?}", m.actuations);
            assert!(m.skipped.iter().any(|s| s.reason.contains("keeps all 16 keys")), "{keep:?}: {:?}", m.skipped);
            assert_eq!(bits(&out), bits(&dense), "{kind:?} {keep:?}");
        }
    }
}

#[test]
fn ties_at_the_kth_score_are_all_kept() {
    // q = 0, so the scores are the bias exactly: per row 0, 0, -1, -1, -2, -2, ... (pairs tied).
    let n = B * H * S * D;
    let bias: Vec<f32> = (0..B * S * S).map(|i| -(((i % S) / 2) as f32)).collect();
    let d = Data { q: vec![0.0; n], kt: randn(n, 91), v: randn(n, 92), bias };
    let (s, allowed) = host_scores(&d);
    for k in [1usize, 3, 5] {
        let kept = host_keep_with(&s, &allowed, Keep::TopK(k), false);
        // k odd: the k-th score is shared with key k (0-based), so k + 1 keys are kept.
        assert!(kept.chunks(S).all(|row| row.iter().filter(|x| **x).count() == k + 1), "host keeps k + 1");
        let (out, _) = run_tapped(&pipeline(Keep::TopK(k)), &unfused(false), &[], &inputs(&d));
        let host = host_output(&d, &s, &allowed, &kept);
        assert!(max_diff(&out[0], &host) < 1e-5, "k {k}: ties not all kept ({:e})", max_diff(&out[0], &host));
        // Exactly k keys (smaller index first, TopK's rule) would be another output.
        let exact: Vec<bool> = (0..s.len()).map(|i| i % S < k).collect();
        let other = host_output(&d, &s, &allowed, &exact);
        assert!(max_diff(&out[0], &other) > 1e-3, "k {k}: indistinguishable from keeping exactly k");
    }
}

// ───────────────────────────── fused Op::Attention ─────────────────────────────

/// Fused attention over `[B, S, H*D]` with a key mask (sequence 1 padded from `VALID`) or a
/// causal mask.
fn fused(causal: bool) -> Graph {
    let mut g = Graph::new(if causal { "fused_causal" } else { "fused_keys" });
    let dims = [B, S, H * D];
    let (q, k, v) = (g.input("q", f32s(&dims)), g.input("k", f32s(&dims)), g.input("v", f32s(&dims)));
    let o = if causal {
        g.attention_kind_opts(q, k, v, H, D, MaskKind::Causal, f32s(&dims), None, None)
    } else {
        let m = g.input("mask", f32s(&[B, S]));
        g.attention_opts(q, k, v, m, H, D, f32s(&dims), None, None)
    };
    g.set_outputs(vec![o]);
    g
}

/// Host fused attention in f64 (RLX's CPU semantics: scale `D^-0.5`, key mask `< 0.5` and causal
/// `j > i` excluded), keeping per row the top `k` scores or the window.
fn host_fused(q: &[f32], k: &[f32], v: &[f32], mask: Option<&[f32]>, keep: Keep) -> Vec<f64> {
    let at = |b: usize, s: usize, h: usize, x: usize| ((b * S + s) * H + h) * D + x;
    let scale = (D as f64).powf(-0.5);
    let mut o = vec![0.0; B * S * H * D];
    for b in 0..B {
        for h in 0..H {
            for i in 0..S {
                let allowed: Vec<bool> = (0..S).map(|j| mask.map_or(j <= i, |m| m[b * S + j] >= 0.5)).collect();
                // RLX's lowered attention gives a masked key -1e9 before the keep test.
                let s: Vec<f64> = (0..S)
                    .map(|j| if allowed[j] { (0..D).map(|x| q[at(b, i, h, x)] as f64 * k[at(b, j, h, x)] as f64).sum::<f64>() * scale } else { -1e9 })
                    .collect();
                let kept: Vec<bool> = match keep {
                    Keep::TopK(kk) => {
                        let mut sorted = s.clone();
                        sorted.sort_by(|a, b| b.total_cmp(a));
                        if kk < allowed.iter().filter(|a| **a).count() {
                            assert!(sorted[kk - 1] - sorted[kk] > 1e-3, "fixture tie at b {b} h {h} q {i}");
                        }
                        s.iter().map(|x| *x >= sorted[kk - 1]).collect()
                    }
                    Keep::Window(w, sinks) => (0..S).map(|j| j < sinks || i.abs_diff(j) < w).collect(),
                };
                let idx: Vec<usize> = (0..S).filter(|&j| allowed[j] && kept[j]).collect();
                let mx = idx.iter().map(|&j| s[j]).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = idx.iter().map(|&j| (s[j] - mx).exp()).sum();
                for x in 0..D {
                    o[at(b, i, h, x)] = idx.iter().map(|&j| (s[j] - mx).exp() / z * v[at(b, j, h, x)] as f64).sum();
                }
            }
        }
    }
    o
}

#[test]
fn fused_attention_is_lowered_then_masked_and_equals_the_f64_host() {
    let n = B * S * H * D;
    let mask: Vec<f32> = (0..B * S).map(|i| if i / S == 1 && i % S >= VALID { 0.0 } else { 1.0 }).collect();
    for (seed, (causal, keep)) in [(false, Keep::TopK(4)), (true, Keep::TopK(3)), (false, Keep::Window(3, 1)), (true, Keep::Window(4, 2))].into_iter().enumerate() {
        let s = 70 + 3 * seed as u64;
        let (q, k, v): (Vec<f32>, _, _) = (randn(n, s).iter().map(|x| 2.0 * x).collect(), randn(n, s + 1), randn(n, s + 2));
        let mut ins: Vec<(&str, &[f32])> = vec![("q", &q), ("k", &k), ("v", &v)];
        if !causal {
            ins.push(("mask", &mask));
        }
        let g = fused(causal);
        let (out, sink) = run_tapped(&pipeline(keep), &g, &[], &ins);
        let acts = &sink.manifests()[0].actuations;
        assert!(acts.len() == 1 && acts[0].action.contains("LowerAttention"), "{acts:?}");
        let host = host_fused(&q, &k, &v, (!causal).then_some(&mask[..]), keep);
        let diff = max_diff(&out[0], &host);
        assert!(diff < 1e-5, "causal {causal} {keep:?}: max |RLX - host f64| = {diff:e}");
        let dense = run_plain(&g, &[], &ins);
        assert_ne!(bits(&out), bits(&dense), "causal {causal} {keep:?}: nothing was dropped");
        // Covering every key: the fused op stays, bit-identical.
        let (same, sink) = run_tapped("sparseattn{topk=16}", &g, &[], &ins);
        assert!(sink.manifests()[0].actuations.is_empty());
        assert_eq!(bits(&same), bits(&dense), "causal {causal}: topk=S changed the fused attention");
    }
}

/// Grouped-query attention in the `[B, H, S, D]` layout (Llama's, SmolLM2's: K and V carry fewer
/// heads than Q), causal, as a prefill (`Sq = Sk`) and as a decode step (one query at the last
/// position): the pass counts `Sk` keys (not the KV head count in K's dim 1), lowers the
/// attention with its KV heads repeated (rlx-fusion 0.2.19's `LowerAttention` panics on this
/// layout), and equals an f64 host in which query head `h` reads KV head `h / (H / KV)`.
#[test]
fn grouped_query_attention_counts_its_keys_and_equals_the_f64_host() {
    const HQ: usize = 6;
    const KV: usize = 2;
    const SK: usize = 12;
    let host = |q: &[f32], k: &[f32], v: &[f32], sq: usize, keep: Option<Keep>| -> Vec<f64> {
        let scale = (D as f64).powf(-0.5);
        let mut o = vec![0.0; B * HQ * sq * D];
        for b in 0..B {
            for h in 0..HQ {
                let kvh = h / (HQ / KV);
                for i in 0..sq {
                    let abs = SK - sq + i;
                    let s: Vec<f64> = (0..SK)
                        .map(|j| {
                            if j > abs {
                                return -1e9;
                            }
                            (0..D).map(|x| q[((b * HQ + h) * sq + i) * D + x] as f64 * k[((b * KV + kvh) * SK + j) * D + x] as f64).sum::<f64>() * scale
                        })
                        .collect();
                    let kept: Vec<bool> = match keep {
                        None => vec![true; SK],
                        Some(Keep::TopK(kk)) => {
                            let mut sorted = s.clone();
                            sorted.sort_by(|a, b| b.total_cmp(a));
                            if kk <= abs {
                                assert!(sorted[kk - 1] - sorted[kk] > 1e-3, "fixture tie at b {b} h {h} q {i}");
                            }
                            s.iter().map(|x| *x >= sorted[kk - 1]).collect()
                        }
                        Some(Keep::Window(w, sinks)) => (0..SK).map(|j| j < sinks || abs.abs_diff(j) < w).collect(),
                    };
                    let idx: Vec<usize> = (0..SK).filter(|&j| j <= abs && kept[j]).collect();
                    let mx = idx.iter().map(|&j| s[j]).fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = idx.iter().map(|&j| (s[j] - mx).exp()).sum();
                    for x in 0..D {
                        o[((b * HQ + h) * sq + i) * D + x] = idx.iter().map(|&j| (s[j] - mx).exp() / z * v[((b * KV + kvh) * SK + j) * D + x] as f64).sum();
                    }
                }
            }
        }
        o
    };
    for (sq, seed) in [(SK, 90u64), (1, 95)] {
        let mut g = Graph::new(if sq == SK { "gqa_prefill" } else { "gqa_decode" });
        let q = g.input("q", f32s(&[B, HQ, sq, D]));
        let (k, v) = (g.input("k", f32s(&[B, KV, SK, D])), g.input("v", f32s(&[B, KV, SK, D])));
        let o = g.attention_kind_opts(q, k, v, HQ, D, MaskKind::Causal, f32s(&[B, HQ, sq, D]), None, None);
        g.set_outputs(vec![o]);
        let qv: Vec<f32> = randn(B * HQ * sq * D, seed).iter().map(|x| 2.0 * x).collect();
        let (kv, vv) = (randn(B * KV * SK * D, seed + 1), randn(B * KV * SK * D, seed + 2));
        let ins: Vec<(&str, &[f32])> = vec![("q", &qv), ("k", &kv), ("v", &vv)];
        // The reference's reading of RLX's grouped-query kernel, checked on the dense model.
        let dense = run_plain(&g, &[], &ins);
        let diff = max_diff(&dense[0], &host(&qv, &kv, &vv, sq, None));
        assert!(diff < 1e-5, "Sq {sq}: dense RLX against the host: {diff:e}");
        for keep in [Keep::TopK(3), Keep::Window(4, 1), Keep::Window(3, 0)] {
            let (out, sink) = run_tapped(&pipeline(keep), &g, &[], &ins);
            let m = &sink.manifests()[0];
            assert!(m.actuations.len() == 1 && m.actuations[0].action.contains("LowerAttention"), "Sq {sq} {keep:?}: {:?} {:?}", m.actuations, m.skipped);
            let diff = max_diff(&out[0], &host(&qv, &kv, &vv, sq, Some(keep)));
            assert!(diff < 1e-5, "Sq {sq} {keep:?}: max |RLX - host f64| = {diff:e}");
            assert_ne!(bits(&out), bits(&dense), "Sq {sq} {keep:?}: nothing was dropped");
        }
        // Covering all 12 keys (not the 2 KV heads) leaves the site unchanged, and the scope
        // says so: an actuation that changed nothing measured the unchanged model.
        let p = Pipeline::parse("sparseattn{topk=12}").unwrap();
        let sink = opscope::MemorySink::default();
        let (same, summary) = opscope::Scope::new(&p, Box::new(sink.clone())).run(|| run_plain(&g, &[], &ins));
        let m = &sink.manifests()[0];
        assert!(m.actuations.is_empty() && m.skipped.iter().any(|s| s.reason.contains("keeps all 12 keys") && s.pass_idx == Some(0)), "{:?}", m.skipped);
        assert_eq!(bits(&same), bits(&dense));
        let warnings = summary.expect("recording").warnings;
        assert!(
            warnings.iter().any(|w| w.contains("'sparseattn{topk=12}' (pass 0) changed nothing") && w.contains("keeps all 12 keys")),
            "{warnings:?}"
        );
        // One that changed a site draws no such warning, nor one asked to change no site.
        for p in ["sparseattn{topk=3}", "sparseattn{sites=[],topk=3}"] {
            let (_, summary) = opscope::Scope::new(&Pipeline::parse(p).unwrap(), Box::new(opscope::MemorySink::default())).run(|| run_plain(&g, &[], &ins));
            assert!(!summary.expect("recording").warnings.iter().any(|w| w.contains("changed nothing")), "{p}");
        }
    }
}

/// A decode step over a KV cache with a key mask (the GGUF job's layout): each sequence's
/// tokens in the slots of their positions, unused slots masked after them, the current token in
/// the last slot. The window counts valid keys: a sequence shorter than the cache keeps its own
/// `W` most recent tokens (counted in slots, it would keep unused slots and lose them), plus its
/// first `sinks` tokens; against an f64 host.
#[test]
fn a_decode_window_counts_the_key_masks_valid_keys() {
    const HQ: usize = 4;
    const KV: usize = 2;
    const SK: usize = 12;
    // Sequence 0: 10 tokens cached (slots 0..9), slot 10 unused; sequence 1: 6 cached, 6..10
    // unused. Slot 11: the current token.
    let lens = [10usize, 6];
    let mask: Vec<f32> = lens.iter().flat_map(|&n| (0..SK).map(move |j| if j < n || j == SK - 1 { 1.0 } else { 0.0 })).collect();
    let mut g = Graph::new("decode_key_mask");
    let q = g.input("q", f32s(&[B, HQ, 1, D]));
    let (k, v) = (g.input("k", f32s(&[B, KV, SK, D])), g.input("v", f32s(&[B, KV, SK, D])));
    let m = g.input("mask", f32s(&[B, SK]));
    let o = g.attention_opts(q, k, v, m, HQ, D, f32s(&[B, HQ, 1, D]), None, None);
    g.set_outputs(vec![o]);
    let qv: Vec<f32> = randn(B * HQ * D, 120).iter().map(|x| 2.0 * x).collect();
    let (kv, vv) = (randn(B * KV * SK * D, 121), randn(B * KV * SK * D, 122));
    let ins: Vec<(&str, &[f32])> = vec![("q", &qv), ("k", &kv), ("v", &vv), ("mask", &mask)];
    let host = |window: usize, sinks: usize| -> Vec<f64> {
        let scale = (D as f64).powf(-0.5);
        let mut o = vec![0.0; B * HQ * D];
        for b in 0..B {
            let valid: Vec<usize> = (0..SK).filter(|&j| mask[b * SK + j] >= 0.5).collect();
            let n = valid.len();
            // The query is the last valid key (index n - 1).
            let kept: Vec<usize> = valid.iter().enumerate().filter(|&(idx, _)| n - 1 - idx < window || idx < sinks).map(|(_, &j)| j).collect();
            for h in 0..HQ {
                let kvh = h / (HQ / KV);
                let s: Vec<f64> = kept
                    .iter()
                    .map(|&j| (0..D).map(|x| qv[(b * HQ + h) * D + x] as f64 * kv[((b * KV + kvh) * SK + j) * D + x] as f64).sum::<f64>() * scale)
                    .collect();
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                for x in 0..D {
                    o[(b * HQ + h) * D + x] = kept.iter().zip(&s).map(|(&j, sc)| (sc - mx).exp() / z * vv[((b * KV + kvh) * SK + j) * D + x] as f64).sum();
                }
            }
        }
        o
    };
    let dense = run_plain(&g, &[], &ins);
    let diff = max_diff(&dense[0], &host(SK, 0));
    assert!(diff < 1e-5, "dense RLX against the host: {diff:e}");
    for (window, sinks) in [(3, 1), (4, 0), (2, 2)] {
        let (out, sink) = run_tapped(&format!("sparseattn{{window={window},sinks={sinks}}}"), &g, &[], &ins);
        let acts = &sink.manifests()[0].actuations;
        assert!(acts.len() == 1 && acts[0].action.contains("counts the key mask's valid keys"), "{acts:?}");
        let diff = max_diff(&out[0], &host(window, sinks));
        assert!(diff < 1e-5, "window {window} sinks {sinks}: max |RLX - host f64| = {diff:e}");
    }
}

#[test]
fn option_errors_name_the_fix() {
    for (p, want) in [
        ("sparseattn", "set topk=K"),
        ("sparseattn{topk=4,window=8}", "alternatives"),
        ("sparseattn{topk=4,sinks=1}", "sinks is an option of window"),
    ] {
        let err = Pipeline::parse(p).unwrap().apply(&unfused(false)).err().unwrap_or_else(|| panic!("{p}: accepted"));
        assert!(err.to_string().contains(want), "{p}: {err}");
    }
}

#[test]
fn rewritten_graphs_are_pinned() {
    let small = || {
        let mut g = Graph::new("bert_attn_small");
        let q = g.input("q", f32s(&[1, 1, 4, 2]));
        let kt = g.input("kt", f32s(&[1, 1, 2, 4]));
        let v = g.input("v", f32s(&[1, 1, 4, 2]));
        let bias = g.input("bias", f32s(&[1, 1, 4, 4]));
        let sc = g.matmul(q, kt, f32s(&[1, 1, 4, 4]));
        let s = g.binary(BinaryOp::Add, sc, bias, f32s(&[1, 1, 4, 4]));
        let p: NodeId = g.add_node(Op::Softmax { axis: -1 }, vec![s], f32s(&[1, 1, 4, 4]));
        let o = g.matmul(p, v, f32s(&[1, 1, 4, 2]));
        g.set_outputs(vec![o]);
        g
    };
    for (name, p, g) in [
        ("sparseattn__softmax_topk2", "sparseattn{topk=2}", small()),
        ("sparseattn__softmax_window2_sinks1", "sparseattn{window=2,sinks=1}", small()),
        ("sparseattn__fused_causal_topk4", "sparseattn{topk=4}", fused(true)),
    ] {
        let (out, m) = Pipeline::parse(p).unwrap().apply(&g).unwrap();
        if !name.contains("fused") {
            assert_caller_outputs_first(&g, &out); // the fused output becomes the lowered reshape
        }
        snapshot(name, &out, &m);
    }
}

/// A fused attention in both rank-4 layouts RLX's kernel dispatches (`[B, H, S, D]` when Q's dim 1
/// is the head count, else `[B, S, H, D]`), multi-head (K and V with all `H` heads), with a key
/// mask: the pass lowers it and masks it (no grouped-query repeat: K already has the heads) and
/// equals the f64 host of the rank-3 test on the same values, permuted for `[B, H, S, D]`.
#[test]
fn rank_4_multi_head_attention_in_both_layouts_is_lowered_and_equals_the_f64_host() {
    let n = B * S * H * D;
    let mask: Vec<f32> = (0..B * S).map(|i| if i / S == 1 && i % S >= VALID { 0.0 } else { 1.0 }).collect();
    // [B, S, H, D] (host_fused's layout) <-> [B, H, S, D].
    let to_bhsd = |x: &[f32]| -> Vec<f32> {
        let mut o = vec![0.0; n];
        for b in 0..B {
            for s in 0..S {
                for h in 0..H {
                    for d in 0..D {
                        o[((b * H + h) * S + s) * D + d] = x[((b * S + s) * H + h) * D + d];
                    }
                }
            }
        }
        o
    };
    for (seed, keep) in [Keep::TopK(4), Keep::Window(3, 1)].into_iter().enumerate() {
        let s = 130 + 3 * seed as u64;
        let (q, k, v): (Vec<f32>, _, _) = (randn(n, s).iter().map(|x| 2.0 * x).collect(), randn(n, s + 1), randn(n, s + 2));
        let host = host_fused(&q, &k, &v, Some(&mask), keep);
        for bhsd in [false, true] {
            let dims = if bhsd { [B, H, S, D] } else { [B, S, H, D] };
            let mut g = Graph::new(if bhsd { "fused_bhsd" } else { "fused_bshd" });
            let (qi, ki, vi) = (g.input("q", f32s(&dims)), g.input("k", f32s(&dims)), g.input("v", f32s(&dims)));
            let m = g.input("mask", f32s(&[B, S]));
            let o = g.attention_opts(qi, ki, vi, m, H, D, f32s(&dims), None, None);
            g.set_outputs(vec![o]);
            let (qx, kx, vx) = if bhsd { (to_bhsd(&q), to_bhsd(&k), to_bhsd(&v)) } else { (q.clone(), k.clone(), v.clone()) };
            let ins: Vec<(&str, &[f32])> = vec![("q", &qx), ("k", &kx), ("v", &vx), ("mask", &mask)];
            let want: Vec<f64> = if bhsd {
                let mut w = vec![0.0; n];
                for b in 0..B {
                    for s in 0..S {
                        for h in 0..H {
                            for d in 0..D {
                                w[((b * H + h) * S + s) * D + d] = host[((b * S + s) * H + h) * D + d];
                            }
                        }
                    }
                }
                w
            } else {
                host.clone()
            };
            let (out, sink) = run_tapped(&pipeline(keep), &g, &[], &ins);
            let m = &sink.manifests()[0];
            assert!(m.actuations.len() == 1 && m.actuations[0].action.contains("LowerAttention"), "bhsd {bhsd} {keep:?}: {:?} {:?}", m.actuations, m.skipped);
            let diff = max_diff(&out[0], &want);
            assert!(diff < 1e-5, "bhsd {bhsd} {keep:?}: max |RLX - host f64| = {diff:e}");
            let dense = run_plain(&g, &[], &ins);
            assert_ne!(bits(&out), bits(&dense), "bhsd {bhsd} {keep:?}: nothing was dropped");
        }
    }
}

/// A grouped-query attention whose KV head count does not divide the query heads (6 query
/// heads, 4 KV heads: no head mapping `h / (H / KV)` covers them) is not lowered: skipped, and
/// the reason names the head counts.
#[test]
fn grouped_query_kv_heads_that_do_not_divide_the_query_heads_are_named() {
    let (hq, kvh, sk) = (6usize, 4usize, 12usize);
    let mut g = Graph::new("gqa_not_dividing");
    let q = g.input("q", f32s(&[1, hq, sk, D]));
    let (k, v) = (g.input("k", f32s(&[1, kvh, sk, D])), g.input("v", f32s(&[1, kvh, sk, D])));
    let o = g.attention_kind_opts(q, k, v, hq, D, MaskKind::Causal, f32s(&[1, hq, sk, D]), None, None);
    g.set_outputs(vec![o]);
    let (_, m) = Pipeline::parse("sparseattn{topk=3}").unwrap().apply(&g).unwrap();
    assert!(m.actuations.is_empty(), "{:?}", m.actuations);
    assert!(
        m.skipped.iter().any(|s| s.reason.contains("has 4 heads, which do not divide the 6 query heads")),
        "{:?}",
        m.skipped
    );
}
