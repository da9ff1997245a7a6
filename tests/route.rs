//! The `route` tap on a small MoE fixture with a planted skew and a dead expert: per-expert
//! load, gate mass, importance and kept mass match a host computation of the same routing
//! (softmax in f64, top-k with ties to the smaller index, as RLX's TopK), the dead expert is
//! recorded as load 0, and the model's outputs are bit-identical to an untapped run.

mod common;

use common::{bits, randn, run_plain, run_tapped, stats_of};
use rlx_ir::{DType, Graph, Op, Shape};

const T: usize = 24; // tokens
const D: usize = 8; // hidden
const E: usize = 4; // experts
const N: usize = 6; // expert output width

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// x[T,D] -> logits = x @ Wr + br -> softmax -> TopK(k=2) (router); the first choice of each
/// token dispatches x through GroupedMatMul over W[E,D,N].
fn moe() -> Graph {
    let mut g = Graph::new("moe");
    let x = g.input("x", f32s(&[T, D]));
    let wr = g.param("router.w", f32s(&[D, E]));
    let br = g.param("router.b", f32s(&[1, E]));
    let xw = g.matmul(x, wr, f32s(&[T, E]));
    let logits = g.binary(rlx_ir::op::BinaryOp::Add, xw, br, f32s(&[T, E]));
    let probs = g.softmax(logits, -1, f32s(&[T, E]));
    let top = g.add_node(Op::TopK { k: 2 }, vec![probs], f32s(&[T, 2]));
    g.node_mut(top).name = Some("moe/router/TopK".into());
    let first = g.add_node(Op::Narrow { axis: 1, start: 0, len: 1 }, vec![top], f32s(&[T, 1]));
    let idx = g.reshape(first, vec![T as i64], f32s(&[T]));
    let w = g.param("experts.w", f32s(&[E, D, N]));
    let y = g.add_node(Op::GroupedMatMul, vec![x, w, idx], f32s(&[T, N]));
    g.node_mut(y).name = Some("moe/experts/GroupedMatMul".into());
    g.set_outputs(vec![y, probs]);
    g
}

struct Weights {
    x: Vec<f32>,
    wr: Vec<f32>,
    br: Vec<f32>,
    w: Vec<f32>,
}

/// Planted: expert 0 is favoured (+4 logit), expert 3 is dead (-1e4 logit: never in the top 2).
fn weights() -> Weights {
    Weights { x: randn(T * D, 1), wr: randn(D * E, 2), br: vec![4.0, 0.0, 0.0, -1e4], w: randn(E * D * N, 3) }
}

/// Host routing: probabilities (f64 softmax of the f32 logits) and the top-2 experts per token.
fn host_routing(wt: &Weights) -> (Vec<Vec<f64>>, Vec<[usize; 2]>) {
    let mut probs = Vec::new();
    let mut top = Vec::new();
    for t in 0..T {
        let logits: Vec<f32> = (0..E)
            .map(|e| (0..D).map(|d| wt.x[t * D + d] * wt.wr[d * E + e]).sum::<f32>() + wt.br[e])
            .collect();
        let mx = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
        let z: f64 = logits.iter().map(|&l| (l as f64 - mx).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|&l| (l as f64 - mx).exp() / z).collect();
        let mut order: Vec<usize> = (0..E).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        top.push([order[0], order[1]]);
        probs.push(p);
    }
    (probs, top)
}

fn run(pipeline: &str) -> (Vec<Vec<f32>>, Vec<opscope::Row>) {
    let wt = weights();
    let params: [(&str, &[f32]); 3] = [("router.w", &wt.wr), ("router.b", &wt.br), ("experts.w", &wt.w)];
    let (outs, sink) = run_tapped(pipeline, &moe(), &params, &[("x", &wt.x)]);
    (outs, sink.rows())
}

#[test]
fn router_load_gate_mass_and_importance_match_the_host() {
    let wt = weights();
    let (probs, top) = host_routing(&wt);
    let (_, rows) = run("route");
    let s = stats_of(&rows, "moe/router/TopK", "router", 0);
    let mut load = vec![0.0; E];
    let mut gate = vec![0.0; E];
    let mut importance = vec![0.0; E];
    let mut kept = 0.0;
    for t in 0..T {
        for &e in &top[t] {
            load[e] += 1.0;
            gate[e] += probs[t][e];
            kept += probs[t][e];
        }
        for e in 0..E {
            importance[e] += probs[t][e];
        }
    }
    assert_eq!(s["tokens"], vec![T as f64]);
    assert_eq!(s["load"], load, "load per expert");
    assert_eq!(s["load"][3], 0.0, "the dead expert is recorded with load 0");
    assert_eq!(s["load"].iter().sum::<f64>(), (2 * T) as f64, "every token makes 2 assignments");
    for e in 0..E {
        // The kernel reads the RLX softmax (f32) as the probabilities; the host's are f64.
        assert!((s["gate_mass"][e] - gate[e]).abs() < 1e-5, "gate_mass[{e}] {} vs {}", s["gate_mass"][e], gate[e]);
        assert!((s["importance"][e] - importance[e]).abs() < 1e-5, "importance[{e}]");
    }
    assert!((s["kept_mass"][0] - kept / T as f64).abs() < 1e-6);
    assert_eq!(s["bad_ids"], vec![0.0]);
}

#[test]
fn dispatch_load_counts_first_choices_and_outputs_are_bit_identical() {
    let wt = weights();
    let (_, top) = host_routing(&wt);
    let (outs, rows) = run("route");
    let s = stats_of(&rows, "moe/experts/GroupedMatMul", "dispatch", 0);
    let mut load = vec![0.0; E];
    for t in &top {
        load[t[0]] += 1.0;
    }
    assert_eq!(s["load"], load);
    assert_eq!(s["load"][3], 0.0);
    assert!(s["load"][0] > s["load"][1] && s["load"][0] > s["load"][2], "the planted skew shows: {:?}", s["load"]);
    assert!(!s.contains_key("gate_mass"), "a dispatch site has no scores");
    let params: [(&str, &[f32]); 3] = [("router.w", &wt.wr), ("router.b", &wt.br), ("experts.w", &wt.w)];
    let plain = run_plain(&moe(), &params, &[("x", &wt.x)]);
    assert_eq!(bits(&outs), bits(&plain), "tapped outputs differ from untapped");
}

#[test]
fn router_over_logits_uses_their_softmax() {
    // TopK straight on logits: the probe takes the softmax itself.
    let mut g = Graph::new("logit_router");
    let x = g.input("x", f32s(&[3, E]));
    let top = g.add_node(Op::TopK { k: 1 }, vec![x], f32s(&[3, 1]));
    g.set_outputs(vec![top]);
    let logits = [0.0f32, 1.0, 2.0, 3.0, 5.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
    let (_, sink) = run_tapped("route", &g, &[], &[("x", &logits)]);
    let s = stats_of(&sink.rows(), "topk.0", "router", 0);
    // Ties go to the smaller index (RLX TopK, like torch.topk): token 2 picks expert 0.
    assert_eq!(s["load"], vec![2.0, 0.0, 0.0, 1.0]);
    let sm = |row: &[f32], e: usize| {
        let z: f64 = row.iter().map(|&l| (l as f64).exp()).sum();
        (row[e] as f64).exp() / z
    };
    let kept = (sm(&logits[0..4], 3) + sm(&logits[4..8], 0) + sm(&logits[8..12], 0)) / 3.0;
    assert!((s["kept_mass"][0] - kept).abs() < 1e-6, "{} vs {kept}", s["kept_mass"][0]);
}

/// Router probabilities reshaped before the TopK (`[T, E]` -> `[1, T, E]`): the probe looks
/// through the reshape to the softmax and reads gate values, not logits (a second softmax over
/// probabilities would flatten them towards 1/E).
#[test]
fn router_probabilities_seen_through_a_reshape() {
    let mut g = Graph::new("reshaped_router");
    let x = g.input("x", f32s(&[3, E]));
    let p = g.softmax(x, -1, f32s(&[3, E]));
    let r = g.reshape(p, vec![1, 3, E as i64], f32s(&[1, 3, E]));
    let top = g.add_node(Op::TopK { k: 1 }, vec![r], f32s(&[1, 3, 1]));
    g.set_outputs(vec![top]);
    let logits = [0.0f32, 1.0, 2.0, 3.0, 5.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 4.0];
    let (_, sink) = run_tapped("route", &g, &[], &[("x", &logits)]);
    let s = stats_of(&sink.rows(), "topk.0", "router", 0);
    assert_eq!(s["load"], vec![1.0, 0.0, 0.0, 2.0]);
    let sm = |row: &[f32], e: usize| {
        let z: f64 = row.iter().map(|&l| (l as f64).exp()).sum();
        (row[e] as f64).exp() / z
    };
    let kept = (sm(&logits[0..4], 3) + sm(&logits[4..8], 0) + sm(&logits[8..12], 3)) / 3.0;
    assert!((s["kept_mass"][0] - kept).abs() < 1e-6, "{} vs {kept}", s["kept_mass"][0]);
}

#[test]
fn moe_snapshot() {
    let (g, m) = opscope::Pipeline::parse("route").unwrap().apply(&moe()).unwrap();
    common::snapshot("route__moe", &g, &m);
}

#[test]
fn miner_flags_the_dead_expert_and_the_hot_one() {
    let (_, rows) = run("route");
    let verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&rows));
    let find = |site: &str, kind: opscope::mine::Kind| verdicts.iter().find(|v| v.site == site && v.kind == kind);
    // The router made 48 assignments (12 per expert if uniform): enough evidence.
    let v = find("moe/router/TopK", opscope::passes::route::rules::DEAD_EXPERT).unwrap_or_else(|| panic!("no DeadExpert in {verdicts:?}"));
    assert!(v.evidence.iter().any(|(k, x)| k == "dead_experts" && *x == 1.0), "{:?}", v.evidence);
    // The dispatch made 24 (6 per expert if uniform): below the rule's 10, no verdict yet.
    assert!(find("moe/experts/GroupedMatMul", opscope::passes::route::rules::DEAD_EXPERT).is_none());
    // Dispatch (top-1) load is skewed to the favoured expert 0: >= 2x the mean of 6.
    let hot = find("moe/experts/GroupedMatMul", opscope::passes::route::rules::EXPERT_IMBALANCE).expect("imbalance verdict");
    assert!(hot.evidence.iter().any(|(k, x)| k == "expert" && *x == 0.0), "{:?}", hot.evidence);
}

/// A router over 64 tokens of which the last 48 are padding, all routed to expert 7; the 16 real
/// tokens go 2 to each of 8 experts. `attention_mask` (one value per token) marks the padding.
fn padded_router() -> (Graph, Vec<f32>, Vec<f32>) {
    const TOK: usize = 64;
    const EXP: usize = 8;
    let mut g = Graph::new("padded_router");
    let logits = g.input("logits", f32s(&[TOK, EXP]));
    let mask = g.input("attention_mask", f32s(&[TOK]));
    let top = g.add_node(Op::TopK { k: 1 }, vec![logits], f32s(&[TOK, 1]));
    // The mask is an output too (a model uses it; RLX drops an unused input).
    g.set_outputs(vec![top, mask]);
    let mut l = vec![0f32; TOK * EXP];
    for t in 0..TOK {
        let e = if t < 16 { t % EXP } else { 7 };
        l[t * EXP + e] = 5.0;
    }
    let mask: Vec<f32> = (0..TOK).map(|t| if t < 16 { 1.0 } else { 0.0 }).collect();
    (g, l, mask)
}

#[test]
fn padding_tokens_are_left_out_of_routing_statistics() {
    let (g, logits, mask) = padded_router();
    let run = |pipeline: &str| {
        let (_, sink) = run_tapped(pipeline, &g, &[], &[("logits", &logits), ("attention_mask", &mask)]);
        (sink.rows(), sink.manifests())
    };
    let (rows, manifests) = run("route");
    let s = stats_of(&rows, "topk.0", "router", 0);
    assert_eq!(s["tokens"], vec![16.0], "real tokens only");
    assert_eq!(s["load"], vec![2.0; 8], "2 real tokens per expert");
    // Host softmax of the real tokens' logits: each gives its expert e^5 / (e^5 + 7).
    let p = 5f64.exp() / (5f64.exp() + 7.0);
    assert!((s["kept_mass"][0] - p).abs() < 1e-6, "{} vs {p}", s["kept_mass"][0]);
    assert!(manifests[0].padding.as_deref().is_some_and(|m| m.contains("attention_mask")), "the manifest names the mask");
    let verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&rows));
    assert!(verdicts.is_empty(), "padding alone must not make a verdict: {verdicts:?}");

    // Without the mask the padding dominates: the fixture does exercise the exclusion.
    let (rows, _) = run("route{mask=none}");
    let s = stats_of(&rows, "topk.0", "router", 0);
    assert_eq!((s["tokens"][0], s["load"][7]), (64.0, 50.0));
    let verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&rows));
    assert!(verdicts.iter().any(|v| v.kind == opscope::passes::route::rules::EXPERT_IMBALANCE), "{verdicts:?}");
}
