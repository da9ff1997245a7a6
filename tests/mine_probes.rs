//! The miner's verdicts from the attention and residual probes, on fixtures with planted
//! structure and on a Gaussian null: an attention sink on the first key, top-k-sparse attention,
//! and a residual block whose branch barely moves the stream. Each planted structure gets its
//! verdict and nothing else fires.

mod common;

use common::{randn, run_tapped};
use opscope::mine::{mine, series_from_rows, Kind};
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, NodeId, Shape};

const B: usize = 2;
const H: usize = 4;
const S: usize = 32;
const D: usize = 8;

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// scores = s @ I (exact) + bias -> softmax -> @ v: the unfused attention an ONNX BERT has.
fn attention() -> Graph {
    let mut g = Graph::new("attn");
    let s = g.input("s", f32s(&[B, H, S, S]));
    let eye = g.param("eye", f32s(&[S, S]));
    let bias = g.input("bias", f32s(&[B, 1, 1, S]));
    let v = g.input("v", f32s(&[B, H, S, D]));
    let scores = g.matmul(s, eye, f32s(&[B, H, S, S]));
    let masked = g.binary(BinaryOp::Add, scores, bias, f32s(&[B, H, S, S]));
    let p = g.softmax(masked, -1, f32s(&[B, H, S, S]));
    let o = g.matmul(p, v, f32s(&[B, H, S, D]));
    g.set_outputs(vec![o]);
    g
}

fn attention_verdicts(scores: &[f32]) -> Vec<Kind> {
    let eye: Vec<f32> = (0..S * S).map(|i| if i / S == i % S { 1.0 } else { 0.0 }).collect();
    let bias = vec![0f32; B * S];
    let v = randn(B * H * S * D, 7);
    let (_, sink) = run_tapped("attn{topk=4}", &attention(), &[("eye", &eye)], &[("s", scores), ("bias", &bias), ("v", &v)]);
    let mut kinds: Vec<Kind> = mine(&series_from_rows(&sink.rows())).into_iter().map(|v| v.kind).collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

#[test]
fn gaussian_scores_get_no_attention_verdict() {
    let s: Vec<f32> = randn(B * H * S * S, 1).iter().map(|x| x * 0.5).collect();
    assert_eq!(attention_verdicts(&s), vec![]);
}

#[test]
fn a_planted_first_key_sink_is_found() {
    // +4 on key 0: exp(4) / (exp(4) + 31) = 0.64 of every query's mass.
    let s: Vec<f32> = randn(B * H * S * S, 2).iter().enumerate().map(|(i, x)| x * 0.5 + if i % S == 0 { 4.0 } else { 0.0 }).collect();
    assert_eq!(attention_verdicts(&s), vec![opscope::passes::attn::rules::ATTENTION_SINK]);
}

#[test]
fn planted_top_k_sparsity_is_found() {
    // Each query puts +6 on two keys away from the ends: the top 4 hold ~96% of the mass.
    let s: Vec<f32> = randn(B * H * S * S, 3)
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let (q, k) = ((i / S) % S, i % S);
            x * 0.5 + if k == 1 + (q * 7) % (S - 2) || k == 1 + (q * 13 + 5) % (S - 2) { 6.0 } else { 0.0 }
        })
        .collect();
    assert_eq!(attention_verdicts(&s), vec![opscope::passes::attn::rules::SPARSE_ATTENTION]);
}

#[test]
fn a_block_that_barely_moves_the_stream_is_a_skip_candidate() {
    const R: usize = 16;
    const W: usize = 32;
    let mut g = Graph::new("blocks");
    let mut x = g.input("x", f32s(&[R, W]));
    let mut params: Vec<(String, Vec<f32>)> = Vec::new();
    for i in 0..5 {
        let scale = if i == 2 { 0.002 } else { 0.2 };
        let w1 = g.param(&format!("w1.{i}"), f32s(&[W, W]));
        let w2 = g.param(&format!("w2.{i}"), f32s(&[W, W]));
        let a = g.matmul(x, w1, f32s(&[R, W]));
        let r: NodeId = g.activation(Activation::Relu, a, f32s(&[R, W]));
        let f = g.matmul(r, w2, f32s(&[R, W]));
        x = g.binary(BinaryOp::Add, x, f, f32s(&[R, W]));
        params.push((format!("w1.{i}"), randn(W * W, 10 + i as u64).iter().map(|v| v * 0.2).collect()));
        params.push((format!("w2.{i}"), randn(W * W, 20 + i as u64).iter().map(|v| v * scale).collect()));
    }
    g.set_outputs(vec![x]);
    let p: Vec<(&str, &[f32])> = params.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    let xs = randn(R * W, 5);
    let (_, sink) = run_tapped("residual", &g, &p, &[("x", &xs)]);
    let verdicts = mine(&series_from_rows(&sink.rows()));
    let flagged: Vec<&str> = verdicts.iter().filter(|v| v.kind == opscope::passes::residual::rules::LAYER_SKIP_PROBE).map(|v| v.site.as_str()).collect();
    assert_eq!(flagged, vec!["block.2"], "{verdicts:?}");
}
