//! insta snapshots of rewritten graphs (`rlx_ir::text::print`) and their manifests, one per
//! pass per fixture; every rewritten graph also passes RLX's verifier.

mod common;

use opscope::{Manifest, Pipeline};
use rlx_ir::quant::QuantScheme;
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Dim, Graph, Shape};

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

fn fixture_2d() -> Graph {
    let mut g = Graph::new("mm2d");
    let x = g.input("x", f32s(&[4, 8]));
    let w = g.param("w", f32s(&[8, 3]));
    let y = g.matmul(x, w, f32s(&[4, 3]));
    g.set_outputs(vec![y]);
    g
}

fn fixture_3d() -> Graph {
    let mut g = Graph::new("mm3d");
    let a = g.input("a", f32s(&[2, 4, 8]));
    let b = g.input("b", f32s(&[2, 8, 3]));
    let y = g.matmul(a, b, f32s(&[2, 4, 3]));
    g.set_outputs(vec![y]);
    g
}

fn fixture_dequant() -> Graph {
    let mut g = Graph::new("dequant");
    let x = g.input("x", f32s(&[4, 8]));
    let wq = g.param("w_q", Shape::new(&[8, 3], DType::I8));
    let scale = g.param("scale", f32s(&[1, 3]));
    let zp = g.param("zp", f32s(&[1, 3]));
    let y = g.dequant_matmul(x, wq, scale, zp, QuantScheme::Int8Block { block_size: 8 }, f32s(&[4, 3]));
    g.set_outputs(vec![y]);
    g
}

fn fixture_no_matmul() -> Graph {
    let mut g = Graph::new("relu_only");
    let x = g.input("x", f32s(&[4, 8]));
    let y = g.activation(Activation::Relu, x, f32s(&[4, 8]));
    g.set_outputs(vec![y]);
    g
}

fn fixture_symbolic() -> Graph {
    let mut g = Graph::new("symbolic");
    let x = g.input("x", Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(8)], DType::F32));
    let w = g.param("w", f32s(&[8, 3]));
    let y = g.matmul(x, w, Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(3)], DType::F32));
    g.set_outputs(vec![y]);
    g
}

fn fixture_named_mlp() -> Graph {
    // Two named matmuls sharing an input (like Q and K projections): one lhs sketch, two uses.
    let mut g = Graph::new("shared_lhs");
    let x = g.input("x", f32s(&[4, 8]));
    let wq = g.param("wq", f32s(&[8, 8]));
    let wk = g.param("wk", f32s(&[8, 8]));
    let q = g.matmul(x, wq, f32s(&[4, 8]));
    g.node_mut(q).name = Some("/layer.0/attention/query/MatMul".into());
    let k = g.matmul(x, wk, f32s(&[4, 8]));
    g.node_mut(k).name = Some("/layer.0/attention/key/MatMul".into());
    let s = g.binary(BinaryOp::Add, q, k, f32s(&[4, 8]));
    g.set_outputs(vec![s]);
    g
}


fn snap(name: &str, pipeline: &str, g: Graph) {
    let p = Pipeline::parse(pipeline).unwrap();
    let (out, m) = p.apply(&g).unwrap();
    check_and_snap(name, &g, out, m);
}

/// Tap the deployed program: fuse as `Session::compile` would, then apply with names
/// recovered from the source graph.
fn snap_deployed(name: &str, pipeline: &str, g: Graph) {
    let p = Pipeline::parse(pipeline).unwrap();
    let fused = opscope::activate::fuse(&g, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::new());
    let (out, m) = p.apply_tagged(&fused, Some(&g), 0).unwrap();
    check_and_snap(name, &fused, out, m);
}

fn check_and_snap(name: &str, g: &Graph, out: Graph, m: Manifest) {
    // The caller's outputs come first, unchanged.
    common::assert_caller_outputs_first(g, &out);
    common::snapshot(name, &out, &m);
}

#[test]
fn matmul_2d() {
    snap("matmul__2d", "matmul", fixture_2d());
}

#[test]
fn matmul_batched_3d() {
    snap("matmul__batched_3d", "matmul", fixture_3d());
}

#[test]
fn matmul_dequant() {
    snap("matmul__dequant", "matmul", fixture_dequant());
}

#[test]
fn matmul_no_matmul_graph() {
    let g = fixture_no_matmul();
    let (out, m) = Pipeline::parse("matmul").unwrap().apply(&g).unwrap();
    assert_eq!(rlx_ir::fingerprint(&out), rlx_ir::fingerprint(&g), "graph untouched");
    assert!(m.sites.is_empty() && m.outputs.is_empty());
    snap("matmul__no_matmul", "matmul", g);
}

#[test]
fn matmul_symbolic_dims_are_skipped_with_reason() {
    snap("matmul__symbolic", "matmul", fixture_symbolic());
}

#[test]
fn matmul_shared_lhs_is_sketched_once() {
    snap("matmul__shared_lhs", "matmul", fixture_named_mlp());
}

/// Two passes asking for the same statistics with histogram ranges that differ only in the
/// sign of a zero bound (`0:1` and `-0:1`, equal as floats, encoded differently) take two
/// sketches of each tensor, not one shared: the dedupe key is the encoded attributes, and the
/// rewrite's cache of encodings must not hand the second pass the first one's.
#[test]
fn specs_differing_only_in_a_signed_zero_are_not_merged() {
    let p = Pipeline::parse("matmul{stats=[hist],hist_range=0:1},matmul{stats=[hist],hist_range=-0:1}").unwrap();
    let (_, m) = p.apply(&fixture_2d()).unwrap();
    assert_eq!(m.outputs.len(), 6, "two sketches of lhs, rhs and out: {:?}", m.outputs.iter().map(|o| (o.tensor, o.uses.len())).collect::<Vec<_>>());
    assert!(m.outputs.iter().all(|o| o.uses.len() == 1));
    let same = Pipeline::parse("matmul{stats=[hist],hist_range=0:1},matmul{stats=[hist],hist_range=0:1}").unwrap();
    let (_, m) = same.apply(&fixture_2d()).unwrap();
    assert_eq!(m.outputs.len(), 3, "the same spec twice is one sketch a tensor, used twice");
}

#[test]
fn matmul_option_out_only_min_max() {
    snap("matmul__opt_out_min_max", "matmul{roles=[out],stats=[min,max],hist_bins=4}", fixture_2d());
}

#[test]
fn matmul_option_hist_fixed_range() {
    snap("matmul__opt_hist_fixed", "matmul{roles=[lhs],stats=[hist],hist_bins=4,hist_range=-1:1}", fixture_3d());
}

#[test]
fn matmul_option_site_filter() {
    snap("matmul__opt_sites_key", "matmul{sites=[*key*],stats=[nnz]}", fixture_named_mlp());
}


/// Three projections of one input (Q, K, V), merged by RLX into one matmul over a concat of
/// the weights; the tap splits it back into three named logical sites.
fn fixture_qkv() -> Graph {
    let mut g = Graph::new("qkv");
    let x = g.input("x", f32s(&[2, 4, 8]));
    let mut outs = Vec::new();
    for p in ["query", "key", "value"] {
        let w = g.param(format!("{p}.weight"), f32s(&[8, 8]));
        let y = g.matmul(x, w, f32s(&[2, 4, 8]));
        g.node_mut(y).name = Some(format!("/attn/{p}/MatMul"));
        outs.push(y);
    }
    let s = g.binary(BinaryOp::Add, outs[0], outs[1], f32s(&[2, 4, 8]));
    let t = g.binary(BinaryOp::Mul, s, outs[2], f32s(&[2, 4, 8]));
    g.set_outputs(vec![t]);
    g
}

#[test]
fn matmul_deployed_bias_gelu_fused() {
    snap_deployed("matmul__deployed_bias_gelu", "matmul{stats=[max]}", common::fixture_bias_gelu());
}

#[test]
fn matmul_deployed_qkv_merged_split_into_sites() {
    snap_deployed("matmul__deployed_qkv", "matmul{stats=[max]}", fixture_qkv());
}

/// A rank-1 activation `x[8] @ w[8,3] -> [3]`: sketched as one row of 8 channels.
fn fixture_rank1() -> Graph {
    let mut g = Graph::new("rank1");
    let x = g.input("x", f32s(&[8]));
    let w = g.param("w", f32s(&[8, 3]));
    let y = g.matmul(x, w, f32s(&[3]));
    g.set_outputs(vec![y]);
    g
}

#[test]
fn matmul_rank1_operand_is_sketched_not_a_panic() {
    // RLX's verifier rejects a rank-1 matmul; the pass must still not panic on one.
    let p = Pipeline::parse("matmul{stats=[max,chan_maxabs,pos_sumsq,adj_sumsq]}").unwrap();
    let (out, m) = p.apply(&fixture_rank1()).unwrap();
    assert_eq!(out.outputs.len(), 4);
    let lhs = &m.outputs[0];
    assert_eq!((lhs.shape.as_str(), lhs.spec.chans, lhs.spec.rows), ("[8]", 8, 1));
    assert_eq!(m.sites[0].flops, Some(2 * 3 * 8));
}
