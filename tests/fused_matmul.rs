//! The `matmul` tap on fused matmul sites of the deployed program, checked by value.
//!
//! - `FusedMatMulBiasAct` (RLX's CPU fusion of `x @ w + b -> gelu`): the site's `lhs` is `x`,
//!   `rhs` is `w`, and `out` is the fused kernel's output `gelu(x @ w + b)` (README, "Which
//!   program is observed"), not the matmul's `x @ w`. Every recorded statistic of the three
//!   equals the host reference (`common::reference`); the fused output itself is checked against
//!   numpy (`x @ w + b`, then GELU with Python's `math.erf`), so `out`'s scalar statistics are
//!   also checked against statistics of the numpy values.
//! - `FusedMatMulResidual` (`x @ w + r`): RLX 0.2.19 has no CPU kernel for it and no backend
//!   enables the fusion (rlx-compile `fusion_pipeline.rs`: "no backend runs that fusion"), so it
//!   cannot be run here; the test pins what the tap would record (lhs = `x`, rhs = `w`, out = the
//!   fused node, the residual not sketched) on a hand-built deployed graph.

mod common;

use std::io::Write;

use common::*;
use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, Op, Shape};

/// numpy: `act(x[M,K] @ w[K,N] + add)` in f64, `add` broadcast from `[N]` (a bias) or `[M,N]`
/// (a residual); `act` is "gelu" (exact erf GELU, `x/2 (1 + erf(x/sqrt 2))`) or "none".
fn numpy_fused(x: &[f32], w: &[f32], add: &[f32], m: usize, k: usize, n: usize, act: &str) -> Vec<f64> {
    let input = serde_json::json!({"x": x, "w": w, "add": add, "m": m, "k": k, "n": n, "act": act});
    let code = r#"
import json, math, sys
import numpy as np
a = json.load(sys.stdin)
x = np.asarray(a["x"], dtype=np.float64).reshape(a["m"], a["k"])
w = np.asarray(a["w"], dtype=np.float64).reshape(a["k"], a["n"])
add = np.asarray(a["add"], dtype=np.float64)
z = x @ w + (add.reshape(a["m"], a["n"]) if add.size == a["m"] * a["n"] else add)
if a["act"] == "gelu":
    z = np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))(z)
print(json.dumps(z.reshape(-1).tolist()))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", code])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is required for this test (with numpy: pip install -r scripts/requirements-test.txt)");
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 with numpy is required for this test (pip install -r scripts/requirements-test.txt): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let z: Vec<f64> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(z.len(), m * n, "numpy output length");
    z
}

#[test]
fn fused_bias_gelu_site_records_operands_and_the_fused_output() {
    let (m, k, n) = (4, 8, 6);
    let g = fixture_bias_gelu();
    let fused = opscope::activate::fuse(&g, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::new());
    assert!(
        fused.nodes().iter().any(|x| matches!(x.op, Op::FusedMatMulBiasAct { activation: Some(Activation::Gelu) })),
        "RLX fuses the fixture into FusedMatMulBiasAct(Gelu): {}",
        rlx_ir::text::print(&fused)
    );
    assert!(!fused.nodes().iter().any(|x| matches!(x.op, Op::MatMul)), "no plain MatMul left");

    let x = randn(m * k, 31);
    let w: Vec<f32> = randn(k * n, 32).iter().map(|v| 0.5 * v).collect();
    let b = randn(n, 33);
    let params: [(&str, &[f32]); 2] = [("w", &w), ("b", &b)];
    let inputs: [(&str, &[f32]); 1] = [("x", &x)];
    let plain = run_plain(&g, &params, &inputs);
    let (tapped, sink) = run_tapped("matmul{hist_bins=16,elemsig=5}", &g, &params, &inputs);
    assert_eq!(bits(&tapped), bits(&plain), "outputs changed by the tap");
    let m0 = sink.manifests().pop().expect("manifest");
    let site = m0.sites.iter().find(|s| s.site == "fc/MatMul").expect("site fc/MatMul");
    assert_eq!(site.op, "fused_mm_bias_Gelu");
    assert_eq!(site.flops, Some(2 * (m * n * k) as u64));

    // The fused kernel computes gelu(x @ w + b): RLX's output is numpy's within 1e-5 (RLX's erf is
    // Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7).
    let host = numpy_fused(&x, &w, &b, m, k, n, "gelu");
    let pre = numpy_fused(&x, &w, &b, m, k, n, "none");
    assert_eq!(plain[0].len(), host.len());
    for (i, (g, h)) in plain[0].iter().zip(&host).enumerate() {
        assert!((*g as f64 - h).abs() <= 1e-5, "out[{i}]: RLX {g}, numpy {h}");
    }

    let rows = sink.rows();
    assert_matches_reference(&rows, "fc/MatMul", "lhs", &reference(&x, &[m, k], 16, 5), 1e-5);
    assert_matches_reference(&rows, "fc/MatMul", "rhs", &reference(&w, &[k, n], 16, 5), 1e-5);
    // Every statistic of `out` is the fused kernel's output's ...
    assert_matches_reference(&rows, "fc/MatMul", "out", &reference(&plain[0], &[m, n], 16, 5), 1e-5);
    // ... and the moments and extremes are numpy's gelu(x @ w + b), not x @ w (+ b).
    let s = stats_of(&rows, "fc/MatMul", "out", 0);
    let host32: Vec<f32> = host.iter().map(|v| *v as f32).collect();
    let want = reference(&host32, &[m, n], 16, 5);
    let pre_ref = reference(&pre.iter().map(|v| *v as f32).collect::<Vec<_>>(), &[m, n], 16, 5);
    for (stat, w) in
        [("min", want.min.unwrap()), ("max", want.max.unwrap()), ("mean", want.mean.unwrap()), ("sumsq", want.sumsq), ("l1", want.l1)]
    {
        let got = s[stat][0];
        assert!(close(got, w, 1e-5), "out {stat}: recorded {got}, numpy gelu(x@w+b) {w}");
    }
    // GELU's minimum is -0.17: a pre-activation below it shows the fixture separates the two.
    assert!(pre_ref.min.unwrap() < -0.5 && want.min.unwrap() > -0.2, "pre {:?}, gelu {:?}", pre_ref.min, want.min);
}

/// `x[4,8] @ w[8,6] + r[4,6]` as RLX's `matmul_residual` fusion writes it: one
/// `FusedMatMulResidual(x, w, r)`.
fn fused_residual_graph() -> Graph {
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    let mut g = Graph::new("mm_residual");
    let x = g.input("x", f(&[4, 8]));
    let r = g.input("r", f(&[4, 6]));
    let w = g.param("w", f(&[8, 6]));
    let y = g.add_node(Op::FusedMatMulResidual, vec![x, w, r], f(&[4, 6]));
    g.set_outputs(vec![y]);
    g
}

/// What the tap records at a `FusedMatMulResidual(x, w, r)` site: lhs = `x`, rhs = `w`, out = the
/// fused node (`x @ w + r`, the kernel's output, as for `FusedMatMulBiasAct`); the residual `r` is
/// an input of the op, not an operand of the matmul, and is not sketched. FLOPs count the matmul:
/// 2 x 4 x 8 x 6. (Not run: RLX 0.2.19 has no CPU kernel for this op.)
#[test]
fn fused_residual_site_taps_operands_and_the_fused_output() {
    let g = fused_residual_graph();
    let (out, m) = opscope::Pipeline::parse("matmul").unwrap().apply(&g).unwrap();
    assert!(rlx_ir::verify::verify_all(&out).is_empty());
    common::assert_caller_outputs_first(&g, &out);
    assert_eq!(m.sites.len(), 1, "{:?}", m.sites);
    assert_eq!(m.sites[0].op, "fused_mm_residual");
    assert_eq!(m.sites[0].flops, Some(2 * 4 * 8 * 6));
    // Manifest ids are ids in the rewritten graph.
    let id = |name: &str| node_named(&out, name).0;
    let fused = out.outputs[0].0;
    let mut tapped: Vec<(String, u32)> =
        m.outputs.iter().flat_map(|o| o.uses.iter().map(move |u| (u.role.as_str().to_string(), o.tensor))).collect();
    tapped.sort();
    assert_eq!(tapped, vec![("lhs".into(), id("x")), ("out".into(), fused), ("rhs".into(), id("w"))]);
    assert!(m.outputs.iter().all(|o| o.tensor != id("r")), "the residual is not sketched");
}

