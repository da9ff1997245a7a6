//! The `lowrank` actuation against numpy (`numpy.linalg.svd`, f64, run by python3):
//! - `opscope::linalg::svd`'s singular values equal numpy's to 1e-4 relative; `||W - U V||_F^2` equals the tail
//!   energy `sum_{i>r} sigma_i^2`; the compiled graph's output equals `x @ W_r` to f32 precision
//!   and its error `||x W - x W_r||_F` equals numpy's;
//! - a planted rank-r weight (sigma_{r+1}/sigma_1 < 1e-6) is reconstructed exactly;
//! - a graph whose factors were never bound is refused by `opscope::params::check`;
//! - a rank with no FLOP saving is skipped with the reason; the rewrite is pinned (insta).

mod common;
use common::*;
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

const M: usize = 20;
const K: usize = 48;
const N: usize = 32;

fn graph(transposed: bool) -> Graph {
    let mut g = Graph::new("lr");
    let x = g.input("x", Shape::new(&[M, K], DType::F32));
    let w = if transposed {
        // A weight stored [N, K] (ONNX Gemm transB): reached through a transpose.
        let p = g.param("w", Shape::new(&[N, K], DType::F32));
        g.add_node(rlx_ir::Op::Transpose { perm: vec![1, 0] }, vec![p], Shape::new(&[K, N], DType::F32))
    } else {
        g.param("w", Shape::new(&[K, N], DType::F32))
    };
    let y = g.matmul(x, w, Shape::new(&[M, N], DType::F32));
    g.set_outputs(vec![y]);
    g
}

/// numpy's SVD of w [K, N] and the rank-r quantities, as JSON.
fn numpy(w: &[f32], x: &[f32], r: usize) -> serde_json::Value {
    let script = r#"
import json, sys, numpy as np
d = json.load(sys.stdin)
K, N, M, r = d["K"], d["N"], d["M"], d["r"]
W = np.array(d["w"], dtype=np.float32).astype(np.float64).reshape(K, N)
X = np.array(d["x"], dtype=np.float32).astype(np.float64).reshape(M, K)
U, s, Vt = np.linalg.svd(W, full_matrices=False)
Wr = (U[:, :r] * s[:r]) @ Vt[:r]
print(json.dumps({"sigma": s.tolist(), "tail": float((s[r:] ** 2).sum()),
                  "yr": (X @ Wr).ravel().tolist(), "out_err": float(np.linalg.norm(X @ W - X @ Wr))}))
"#;
    let input = serde_json::json!({"K": K, "N": N, "M": M, "r": r, "w": w, "x": x});
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with numpy (scripts/requirements-test.txt)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "numpy reference failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f64s(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Rewrite with `pipeline`, compile, bind `w` through `opscope::params::bind`, run `x`.
fn run_lowrank(pipeline: &str, g: &Graph, w: &[f32], x: &[f32]) -> Vec<f32> {
    let (out, m) = opscope::Pipeline::parse(pipeline).unwrap().apply(g).unwrap();
    assert_eq!(m.actuations.len(), 1, "{pipeline}: one site rewritten");
    let mut c = Session::new(Device::Cpu).compile(out);
    opscope::params::bind(&mut c, "w", w).unwrap();
    opscope::params::check(&c).expect("every factor bound");
    c.run(&[("x", x)]).remove(0)
}

fn frob2(a: &[f64]) -> f64 {
    a.iter().map(|v| v * v).sum()
}

#[test]
fn error_equals_the_tail_energy_of_numpys_svd() {
    let r = 8;
    let w = randn(K * N, 7);
    let x = randn(M * K, 8);
    let np = numpy(&w, &x, r);
    // Singular values: opscope::linalg (nalgebra) against numpy.
    let sigma = opscope::linalg::svd(&w, K, N).unwrap().sigma;
    let np_sigma = f64s(&np["sigma"]);
    for (a, b) in sigma.iter().zip(&np_sigma) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1e-12), "sigma {a} vs numpy {b}");
    }
    // ||W - U V||_F^2 from the f32 factors the pass binds, against numpy's tail energy.
    let (u, v) = opscope::passes::lowrank::factors(&w, K, N, r).unwrap();
    let mut diff = vec![0f64; K * N];
    for i in 0..K {
        for j in 0..N {
            let uv: f64 = (0..r).map(|t| u[i * r + t] as f64 * v[t * N + j] as f64).sum();
            diff[i * N + j] = w[i * N + j] as f64 - uv;
        }
    }
    let tail = np["tail"].as_f64().unwrap();
    assert!((frob2(&diff) - tail).abs() <= 1e-4 * tail, "||W - UV||^2 {} vs tail energy {tail}", frob2(&diff));
    // The compiled graph computes x @ W_r, for W stored [K, N] and stored [N, K] behind a transpose.
    let yr = f64s(&np["yr"]);
    let scale = yr.iter().fold(0f64, |a, v| a.max(v.abs()));
    let wt: Vec<f32> = (0..N * K).map(|i| w[(i % K) * N + i / K]).collect();
    for (g, wbound) in [(graph(false), &w), (graph(true), &wt)] {
        let y = run_lowrank(&format!("lowrank{{rank={r}}}"), &g, wbound, &x);
        for (a, b) in y.iter().zip(&yr) {
            assert!((*a as f64 - b).abs() <= 1e-5 * scale, "x W_r: graph {a} vs numpy {b}");
        }
        // Output error ||x W - x W_r|| equals numpy's.
        let full = run_plain(&g, &[("w", wbound)], &[("x", &x)]).remove(0);
        let err: Vec<f64> = full.iter().zip(&y).map(|(a, b)| (*a - *b) as f64).collect();
        let want = np["out_err"].as_f64().unwrap();
        assert!((frob2(&err).sqrt() - want).abs() <= 1e-3 * want, "output error {} vs numpy {want}", frob2(&err).sqrt());
    }
}

#[test]
fn a_planted_rank_r_weight_is_reconstructed_exactly() {
    let r = 6;
    let (a, b) = (randn(K * r, 11), randn(r * N, 12));
    let w: Vec<f32> = (0..K * N).map(|i| (0..r).map(|t| a[(i / N) * r + t] * b[t * N + i % N]).sum()).collect();
    let x = randn(M * K, 13);
    let np = numpy(&w, &x, r);
    let s = f64s(&np["sigma"]);
    assert!(s[r] / s[0] < 1e-6, "planted rank {r}: sigma_(r+1)/sigma_1 = {}", s[r] / s[0]);
    let y = run_lowrank(&format!("lowrank{{rank={r}}}"), &graph(false), &w, &x);
    let full = run_plain(&graph(false), &[("w", &w)], &[("x", &x)]).remove(0);
    let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (p, q) in y.iter().zip(&full) {
        assert!((p - q).abs() <= 1e-5 * scale, "planted: {p} vs {q}");
    }
}

#[test]
fn unbound_factors_are_refused() {
    let (out, _) = opscope::Pipeline::parse("lowrank{rank=4}").unwrap().apply(&graph(false)).unwrap();
    let c = Session::new(Device::Cpu).compile(out); // w never set
    let e = opscope::params::check(&c).unwrap_err().to_string();
    assert!(e.contains("w/lowrank/r4/U") && e.contains("opscope::params::bind"), "{e}");
}

#[test]
fn no_saving_is_skipped_and_the_rewrite_is_pinned() {
    // K N / (K + N) = 19.2 for [48, 32].
    let (_, m) = opscope::Pipeline::parse("lowrank{rank=20}").unwrap().apply(&graph(false)).unwrap();
    assert!(m.actuations.is_empty());
    assert!(m.skipped.iter().any(|s| s.reason.contains("no FLOP saving")), "{:?}", m.skipped);
    let (out, m) = opscope::Pipeline::parse("lowrank{rank=8}").unwrap().apply(&graph(true)).unwrap();
    snapshot("lowrank__transposed_r8", &out, &m);
}
