//! `lowrank` where the caller's code knows nothing of opscope: the environment mode
//! (`RLX_OPSCOPE=lowrank{..}` around `examples/lowrank_env`, plain `set_param`) and a scope
//! around plain `set_param` code. opscope's executable wrapper computes the factors when `w` is
//! set, so the output equals numpy's `x @ U_r diag(sigma_r) Vt_r`; with `w` never set the program
//! is refused (exit 2, the unbound factor named with the fix) instead of reading zeros.

mod common;
use common::{example, randn};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

/// numpy: `x [m, k] @ W_r`, `W_r` the rank-r truncated SVD of `w [k, n]` (f64).
fn numpy_xwr(w: &[f32], x: &[f32], k: usize, n: usize, r: usize) -> Vec<f64> {
    let script = r#"
import json, sys, numpy as np
d = json.load(sys.stdin)
k, n, r = d["k"], d["n"], d["r"]
W = np.array(d["w"], dtype=np.float32).astype(np.float64).reshape(k, n)
X = np.array(d["x"], dtype=np.float32).astype(np.float64).reshape(-1, k)
U, s, Vt = np.linalg.svd(W, full_matrices=False)
print(json.dumps((X @ ((U[:, :r] * s[:r]) @ Vt[:r])).ravel().tolist()))
"#;
    let input = serde_json::json!({"w": w, "x": x, "k": k, "n": n, "r": r});
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with numpy (scripts/requirements-test.txt)");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((*a as f64 - b).abs() <= 1e-5 * scale, "{what}: y[{i}] = {a}, numpy x W_r = {b}");
    }
}

#[test]
fn env_mode_binds_the_factors_in_set_param() {
    let dir = tempfile::tempdir().unwrap();
    let plain = example("lowrank_env").output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let out = example("lowrank_env").env("RLX_OPSCOPE", "lowrank{rank=4}").env("RLX_OPSCOPE_OUT", dir.path().join("x.csv")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (w, x, y) = (f32s(&v["w"]), f32s(&v["x"]), f32s(&v["y"]));
    assert_close(&y, &numpy_xwr(&w, &x, 48, 32, 4), "env mode, rank 4");
    // The rewrite reached the program (the full product differs from the rank-4 one).
    let p: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert_close(&f32s(&p["y"]), &numpy_xwr(&w, &x, 48, 32, 32), "plain program, full rank");
    assert_ne!(p["y"], v["y"]);
}

#[test]
fn env_mode_refuses_to_run_with_unbound_factors() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("lowrank_env").arg("unbound").env("RLX_OPSCOPE", "lowrank{rank=4}").env("RLX_OPSCOPE_OUT", dir.path().join("x.csv")).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "refused; stderr {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("opscope: refusing to run: derived params w/lowrank/r4/U, w/lowrank/r4/V were never set"), "{err}");
    assert!(err.contains("set their source params w with set_param"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty(), "no output computed");
}

#[test]
fn scope_mode_binds_the_factors_in_set_param() {
    let (m, k, n, r) = (5, 48, 32, 6);
    let mut g = Graph::new("scoped");
    let xi = g.input("x", Shape::new(&[m, k], DType::F32));
    let wi = g.param("w", Shape::new(&[k, n], DType::F32));
    let y = g.matmul(xi, wi, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![y]);
    let (w, x) = (randn(k * n, 41), randn(m * k, 42));
    let p: opscope::Pipeline = format!("lowrank{{rank={r}}}").parse().unwrap();
    let y = opscope::scope(&p, Box::new(opscope::MemorySink::default()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        c.set_param("w", &w); // plain RLX: no opscope::params::bind
        opscope::params::check(&c).expect("the wrapper bound the factors");
        c.run(&[("x", &x)]).remove(0)
    })
    .unwrap();
    assert_close(&y, &numpy_xwr(&w, &x, k, n, r), "scope mode, rank 6");
}
