//! The `residual` tap and the `skip` actuation on small residual stacks: block influence
//! statistics match a host computation from the same tensors, only `x + f(x)` with a matmul
//! in `f` counts as a block, and `skip` makes `x + f(x)` exactly `x` (bit-identical to a graph
//! built without the block), removes the branch, keeps the outputs' count and order, and
//! numbers blocks as `residual` does, before and after fusion.

mod common;

use common::{bits, randn, run_plain, run_tapped, stats_of};
use opscope::Pipeline;
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

const R: usize = 6;
const D: usize = 8;

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// `h = x + W2 relu(W1 x)`.
fn branch(g: &mut Graph, x: NodeId, i: usize) -> NodeId {
    let w1 = g.param(&format!("w1.{i}"), f32s(&[D, D]));
    let w2 = g.param(&format!("w2.{i}"), f32s(&[D, D]));
    let a = g.matmul(x, w1, f32s(&[R, D]));
    let r = g.activation(Activation::Relu, a, f32s(&[R, D]));
    g.matmul(r, w2, f32s(&[R, D]))
}

/// Two residual blocks, plus a bias add and a sum of independent inputs (neither is a block).
/// `upto` = number of blocks kept (for the reference graphs of `skip`); `ln` puts a LayerNorm
/// after each sum (post-LN, as BERT; RLX's CPU fusion then makes them FusedResidualLN).
fn stack(blocks: &[bool], ln: bool) -> Graph {
    let mut g = Graph::new("stack");
    let x0 = g.input("x", f32s(&[R, D]));
    let p = g.input("p", f32s(&[R, D]));
    let b = g.param("bias", f32s(&[1, D]));
    let e = g.binary(BinaryOp::Add, x0, p, f32s(&[R, D])); // embeddings: not a block
    let mut x = g.binary(BinaryOp::Add, e, b, f32s(&[R, D])); // bias add: not a block
    let gamma = g.param("gamma", f32s(&[D]));
    let beta = g.param("beta", f32s(&[D]));
    for (i, &keep) in blocks.iter().enumerate() {
        let f = branch(&mut g, x, i);
        let sum = if keep { g.binary(BinaryOp::Add, x, f, f32s(&[R, D])) } else { x };
        x = if ln { g.layer_norm(sum, gamma, beta, -1, 1e-5, f32s(&[R, D])) } else { sum };
    }
    g.set_outputs(vec![x, e]);
    rlx_ir::retarget::prune(&g)
}

struct Data {
    params: Vec<(String, Vec<f32>)>,
    x: Vec<f32>,
    p: Vec<f32>,
}

fn data() -> Data {
    let mut params = vec![("bias".to_string(), randn(D, 9)), ("gamma".into(), randn(D, 10)), ("beta".into(), randn(D, 11))];
    for i in 0..2 {
        params.push((format!("w1.{i}"), randn(D * D, 20 + i as u64).iter().map(|v| v * 0.3).collect()));
        params.push((format!("w2.{i}"), randn(D * D, 30 + i as u64).iter().map(|v| v * 0.3).collect()));
    }
    Data { params, x: randn(R * D, 1), p: randn(R * D, 2) }
}

fn params(d: &Data) -> Vec<(&str, &[f32])> {
    d.params.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect()
}

/// Host: y = x @ w for row-major x[R,D], w[D,D].
fn mm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; R * D];
    for r in 0..R {
        for c in 0..D {
            y[r * D + c] = (0..D).map(|k| x[r * D + k] * w[k * D + c]).sum();
        }
    }
    y
}

#[test]
fn block_influence_matches_the_host() {
    let d = data();
    let (outs, sink) = run_tapped("residual", &stack(&[true, true], false), &params(&d), &[("x", &d.x), ("p", &d.p)]);
    let rows = sink.rows();
    let get = |n: &str| d.params.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap();
    let mut x: Vec<f32> = d.x.iter().zip(&d.p).zip(get("bias").iter().cycle()).map(|((a, b), c)| a + b + c).collect();
    for i in 0..2 {
        let h: Vec<f32> = mm(&x, &get(&format!("w1.{i}"))).iter().map(|v| v.max(0.0)).collect();
        let f = mm(&h, &get(&format!("w2.{i}")));
        let s = stats_of(&rows, &format!("block.{i}"), "block", 0);
        let (mut xx, mut ff, mut cos) = (0f64, 0f64, Vec::new());
        for r in 0..R {
            let (xr, fr) = (&x[r * D..(r + 1) * D], &f[r * D..(r + 1) * D]);
            let y: Vec<f64> = xr.iter().zip(fr).map(|(a, b)| *a as f64 + *b as f64).collect();
            let dot: f64 = xr.iter().zip(&y).map(|(a, b)| *a as f64 * b).sum();
            let nx: f64 = xr.iter().map(|a| (*a as f64).powi(2)).sum();
            let ny: f64 = y.iter().map(|b| b * b).sum();
            xx += nx;
            ff += fr.iter().map(|b| (*b as f64).powi(2)).sum::<f64>();
            cos.push(dot / (nx.sqrt() * ny.sqrt()));
        }
        assert_eq!(s["rows"], vec![R as f64]);
        assert!((s["ratio"][0] - (ff / xx).sqrt()).abs() < 1e-5, "block.{i} ratio {} vs {}", s["ratio"][0], (ff / xx).sqrt());
        let mean = cos.iter().sum::<f64>() / R as f64;
        assert!((s["cos"][0] - mean).abs() < 1e-5, "block.{i} cos");
        assert_eq!(s["cos_row"].len(), cos.len(), "block.{i} cos_row length");
        for (a, b) in s["cos_row"].iter().zip(&cos) {
            assert!((a - b).abs() < 1e-5);
        }
        x = x.iter().zip(&f).map(|(a, b)| a + b).collect();
    }
    let sites: Vec<String> = rows.iter().map(|r| r.site.to_string()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    assert_eq!(sites, vec!["block.0", "block.1"], "bias and embedding adds are not blocks");
    let plain = run_plain(&stack(&[true, true], false), &params(&d), &[("x", &d.x), ("p", &d.p)]);
    assert_eq!(bits(&outs), bits(&plain));
}

/// Massive-activation statistics of each block's output `h = x + f(x)` equal the host's: the
/// median |h| (numpy's definition, the mean of the two middle values of an even count), the
/// four largest |h| with their row and channel, and per-channel max |h|. The input carries a
/// planted entry at row 3, channel 5 (a massive activation the stream carries on): at 2000 it is
/// > 1000x the median |h| (about 0.8) and the miner says so for both blocks; at 500 it is > 100
/// but not 1000x the median, and it does not.
#[test]
fn massive_activation_statistics_match_the_host() {
    for (planted, verdicts_expected) in [(2000.0, 2), (500.0, 0)] {
        massive_case(planted, verdicts_expected);
    }
}

fn massive_case(planted: f32, verdicts_expected: usize) {
    let mut d = data();
    d.x[3 * D + 5] = planted;
    d.x[1 * D + 2] = -150.0;
    let (_, sink) = run_tapped("residual", &stack(&[true, true], false), &params(&d), &[("x", &d.x), ("p", &d.p)]);
    let rows = sink.rows();
    let get = |n: &str| d.params.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).unwrap();
    let mut x: Vec<f32> = d.x.iter().zip(&d.p).zip(get("bias").iter().cycle()).map(|((a, b), c)| a + b + c).collect();
    for i in 0..2 {
        let h: Vec<f32> = mm(&x, &get(&format!("w1.{i}"))).iter().map(|v| v.max(0.0)).collect();
        let f = mm(&h, &get(&format!("w2.{i}")));
        let y: Vec<f32> = x.iter().zip(&f).map(|(a, b)| a + b).collect();
        let s = stats_of(&rows, &format!("block.{i}"), "block", 0);
        let mut abs: Vec<f64> = y.iter().map(|v| v.abs() as f64).collect();
        abs.sort_by(f64::total_cmp);
        let median = (abs[R * D / 2 - 1] + abs[R * D / 2]) / 2.0;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
        assert!(close(s["out_median_abs"][0], median), "block.{i} median {} vs {median}", s["out_median_abs"][0]);
        let mut order: Vec<usize> = (0..R * D).collect();
        order.sort_by(|&a, &b| y[b].abs().total_cmp(&y[a].abs()));
        let top = &s["out_top"];
        assert_eq!(top.len(), 12, "block.{i}: 4 triples");
        for (t, &e) in order[..4].iter().enumerate() {
            assert!(close(top[3 * t], y[e] as f64), "block.{i} top {t}: {} vs {}", top[3 * t], y[e]);
            assert_eq!((top[3 * t + 1], top[3 * t + 2]), ((e / D) as f64, (e % D) as f64), "block.{i} top {t} position");
        }
        assert_eq!((top[0], top[1], top[2]).1, 3.0, "the planted entry leads");
        for c in 0..D {
            let want = (0..R).map(|r| y[r * D + c].abs() as f64).fold(0.0, f64::max);
            assert!(close(s["out_chan_absmax"][c], want), "block.{i} channel {c}");
        }
        x = y;
    }
    let verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&rows));
    let massive: Vec<_> = verdicts.iter().filter(|v| v.kind.name == "massive_activation").collect();
    assert_eq!(massive.len(), verdicts_expected, "planted {planted}: {verdicts:?}");
}

fn run_graph(g: &Graph, d: &Data) -> Vec<Vec<f32>> {
    run_plain(g, &params(d), &[("x", &d.x), ("p", &d.p)])
}

#[test]
fn skip_equals_a_graph_without_the_block_and_removes_the_branch() {
    let d = data();
    for (blocks, keep) in [("[1]", [true, false]), ("[0]", [false, true]), ("[0,1]", [false, false])] {
        let (g, m) = Pipeline::parse(&format!("skip{{blocks={blocks}}}")).unwrap().apply(&stack(&[true, true], false)).unwrap();
        assert!(rlx_ir::verify::verify_all(&g).is_empty());
        assert_eq!(g.outputs.len(), 2, "outputs keep their count");
        let matmuls = g.nodes().iter().filter(|n| matches!(n.op, Op::MatMul)).count();
        let kept = keep.iter().filter(|k| **k).count();
        assert_eq!(matmuls, 2 * kept, "skip{{blocks={blocks}}}: the bypassed branch's matmuls are removed");
        assert_eq!(m.actuations.len(), 2 - kept);
        let want = run_graph(&stack(&keep, false), &d);
        assert_eq!(bits(&run_graph(&g, &d)), bits(&want), "skip{{blocks={blocks}}} differs from the graph without the block");
    }
}

#[test]
fn skip_after_fusion_keeps_the_norm() {
    // Deployed: Add + LayerNorm fuse into FusedResidualLN; skip turns it into LayerNorm(x).
    let d = data();
    let src = stack(&[true, true], true);
    let fused = opscope::activate::fuse(&src, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::new());
    assert!(fused.nodes().iter().any(|n| matches!(n.op, Op::FusedResidualLN { .. })), "the fixture fuses");
    let (g, m) = Pipeline::parse("skip{blocks=[1]},residual").unwrap().apply_tagged(&fused, Some(&src), 0).unwrap();
    assert!(rlx_ir::verify::verify_all(&g).is_empty());
    let want = run_graph(&stack(&[true, false], true), &d);
    let got = run_graph(&g, &d);
    assert_eq!(got[0].len(), want[0].len(), "output length");
    for (a, b) in got[0].iter().zip(&want[0]) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    // The residual tap after skip still calls the surviving block block.0.
    let sites: Vec<&str> = m.sites.iter().map(|s| s.site.as_str()).collect();
    assert_eq!(sites, vec!["block.0"]);
    common::snapshot("skip__deployed_post_ln", &g, &m);
}

#[test]
fn snapshots_of_residual_and_skip() {
    for (name, pipeline) in [("residual__stack", "residual"), ("skip__stack_block1", "skip{blocks=[1]}")] {
        let (g, m) = Pipeline::parse(pipeline).unwrap().apply(&stack(&[true, true], false)).unwrap();
        common::snapshot(name, &g, &m);
    }
}

#[test]
fn skip_of_a_missing_block_says_which_exist() {
    let err = Pipeline::parse("skip{blocks=[7]}").unwrap().apply(&stack(&[true, true], false)).unwrap_err().to_string();
    assert!(err.contains("block 7 does not exist") && err.contains("[0,1]"), "{err}");
    let err = Pipeline::parse("skip{blocks=[1,1]}").unwrap_err().to_string();
    assert!(err.contains("listed twice"), "{err}");
}
