//! `opscope::linalg` against numpy (`numpy.linalg.svd` / `numpy.linalg.norm`, f64, run by python3
//! on the same f32 matrices, passed as raw little-endian files):
//! - exact SVD: singular values to 1e-4 relative on random and MiniLM-shaped ([384, 1536],
//!   [1536, 384]) matrices, `U diag(sigma) Vt = A` and orthonormal factors;
//! - planted rank-r matrices: `sigma_{r+1} / sigma_1 < 1e-6` (ours and numpy's);
//! - randomized SVD (HMT 2011): numpy's spectral error `||A - U diag(sigma) Vt||_2` is at least
//!   `sigma_{k+1}` (Eckart-Young) and its mean over seeds is within the HMT bound computed from
//!   numpy's exact sigma, with and without power iterations;
//! - effective rank (Roy & Vetterli) and the 99% energy rank equal numpy's, from numpy's sigma;
//! - bad input is an error naming the problem.

mod common;
use common::randn;
use opscope::linalg::{self, LinalgError};

/// numpy's side: reads `d["files"]` (name -> (path, dtype)) and returns JSON.
const SCRIPT: &str = r#"
import json, sys, numpy as np
d = json.load(sys.stdin)
arr = {k: np.fromfile(p, dtype=t).astype(np.float64) for k, (p, t) in d["files"].items()}
rows, cols = d["rows"], d["cols"]
A = arr["a"].reshape(rows, cols)
s = np.linalg.svd(A, compute_uv=False)
out = {"sigma": s.tolist()}
p = s / s.sum()
p = p[p > 0]
out["erank"] = float(np.exp(-(p * np.log(p)).sum()))
e = np.cumsum(s ** 2) / (s ** 2).sum()
out["energy99"] = int(np.searchsorted(e, 0.99) + 1)
if "u" in arr:
    k = d["k"]
    U = arr["u"].reshape(rows, k); S = arr["s"]; Vt = arr["vt"].reshape(k, cols)
    out["err2"] = float(np.linalg.norm(A - (U * S) @ Vt, 2))
print(json.dumps(out))
"#;

fn write<T: Copy>(dir: &std::path::Path, name: &str, v: &[T], to_bytes: impl Fn(T) -> Vec<u8>) -> String {
    let p = dir.join(name);
    std::fs::write(&p, v.iter().flat_map(|x| to_bytes(*x)).collect::<Vec<u8>>()).unwrap();
    p.to_string_lossy().into_owned()
}

/// numpy's view of `a [rows, cols]` and, with `approx`, of the rank-k factors we computed.
fn numpy(a: &[f32], rows: usize, cols: usize, approx: Option<&linalg::Svd>) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let mut files = serde_json::Map::new();
    files.insert("a".into(), serde_json::json!([write(dir.path(), "a", a, |x| x.to_le_bytes().to_vec()), "<f4"]));
    let mut k = 0;
    if let Some(s) = approx {
        k = s.rank();
        for (name, v) in [("u", &s.u), ("s", &s.sigma), ("vt", &s.vt)] {
            files.insert(name.into(), serde_json::json!([write(dir.path(), name, v, |x| x.to_le_bytes().to_vec()), "<f8"]));
        }
    }
    let input = serde_json::json!({"files": files, "rows": rows, "cols": cols, "k": k});
    let mut child = std::process::Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
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

fn assert_sigma_close(ours: &[f64], np: &[f64], what: &str) {
    assert_eq!(ours.len(), np.len(), "{what}: number of singular values");
    for (i, (a, b)) in ours.iter().zip(np).enumerate() {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1e-9 * np[0]), "{what}: sigma_{i} {a} vs numpy {b}");
    }
}

/// `B [rows, r] @ C [r, cols]`, Gaussian factors: a matrix of rank r.
fn planted(rows: usize, cols: usize, r: usize, seed: u64) -> Vec<f32> {
    let (b, c) = (randn(rows * r, seed), randn(r * cols, seed + 1));
    (0..rows * cols).map(|i| (0..r).map(|t| b[(i / cols) * r + t] * c[t * cols + i % cols]).sum()).collect()
}

#[test]
fn exact_svd_matches_numpy_on_random_and_minilm_shapes() {
    for (rows, cols, seed) in [(48, 32, 1), (32, 48, 2), (384, 1536, 3), (1536, 384, 4)] {
        let a = randn(rows * cols, seed);
        let s = linalg::svd(&a, rows, cols).unwrap();
        let np = numpy(&a, rows, cols, None);
        let what = format!("[{rows}, {cols}]");
        assert_sigma_close(&s.sigma, &f64s(&np["sigma"]), &what);
        // U diag(sigma) Vt reproduces A.
        let back = s.reconstruct(s.rank());
        let norm: f64 = a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        let err: f64 = a.iter().zip(&back).map(|(x, y)| (*x as f64 - y).powi(2)).sum::<f64>().sqrt();
        assert!(err <= 1e-10 * norm, "{what}: ||A - U S Vt||_F / ||A||_F = {}", err / norm);
        // Orthonormal columns of U and rows of Vt (Gram matrices = I).
        let m = s.rank();
        for (name, mat, len, stride, step) in [("U", &s.u, rows, m, 1usize), ("Vt", &s.vt, cols, 1, cols)] {
            for i in (0..m).step_by(7) {
                for j in (i..m).step_by(5) {
                    let dot: f64 = (0..len).map(|t| mat[t * stride + i * step] * mat[t * stride + j * step]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-10, "{what}: {name} Gram ({i}, {j}) = {dot}");
                }
            }
        }
    }
}

#[test]
fn planted_rank_r_matrices_have_a_gap_of_1e6() {
    for (rows, cols, r, seed) in [(48, 32, 6, 11), (384, 1536, 16, 12)] {
        let a = planted(rows, cols, r, seed);
        let s = linalg::svd(&a, rows, cols).unwrap().sigma;
        let np = f64s(&numpy(&a, rows, cols, None)["sigma"]);
        assert!(np[r] / np[0] < 1e-6, "numpy: planted rank {r}: sigma_(r+1)/sigma_1 = {}", np[r] / np[0]);
        assert!(s[r] / s[0] < 1e-6, "ours: planted rank {r}: sigma_(r+1)/sigma_1 = {}", s[r] / s[0]);
        assert_sigma_close(&s[..r], &np[..r], &format!("planted [{rows}, {cols}] rank {r}"));
        assert!(linalg::rank_for_energy(&s, 0.99).unwrap() <= r);
    }
}

/// A [200, 300] matrix with a decaying spectrum (Gaussian `X [200, 40] diag(0.85^j) Y [40, 300]`
/// plus Gaussian noise of 1e-3), and a plain Gaussian one (flat spectrum, the hard case).
fn test_matrices() -> Vec<(&'static str, Vec<f32>)> {
    let (rows, cols, r) = (200, 300, 40);
    let (x, y, noise) = (randn(rows * r, 21), randn(r * cols, 22), randn(rows * cols, 23));
    let decaying = (0..rows * cols)
        .map(|i| (0..r).map(|t| x[(i / cols) * r + t] * 0.85f32.powi(t as i32) * y[t * cols + i % cols]).sum::<f32>() + 1e-3 * noise[i])
        .collect();
    vec![("decaying", decaying), ("gaussian", randn(rows * cols, 24))]
}

#[test]
fn randomized_svd_error_is_within_the_hmt_bound() {
    let (rows, cols, k, p) = (200, 300, 10, 10);
    for (name, a) in test_matrices() {
        let sigma = f64s(&numpy(&a, rows, cols, None)["sigma"]);
        for q in [0, 1, 2] {
            let bound = linalg::randomized_svd_error_bound(&sigma, k, p, q).unwrap();
            let errs: Vec<f64> = (0..5u64)
                .map(|seed| {
                    let s = linalg::randomized_svd(&a, rows, cols, k, p, q, seed).unwrap();
                    assert_eq!((s.u.len(), s.sigma.len(), s.vt.len()), (rows * k, k, k * cols));
                    numpy(&a, rows, cols, Some(&s))["err2"].as_f64().unwrap()
                })
                .collect();
            let mean = errs.iter().sum::<f64>() / errs.len() as f64;
            eprintln!("{name} q={q}: sigma_k+1 {:.4} errors {errs:.4?} mean {mean:.4} bound {bound:.4}", sigma[k]);
            for e in &errs {
                assert!(*e >= sigma[k] * (1.0 - 1e-9), "{name} q={q}: error {e} below sigma_(k+1) {} (Eckart-Young)", sigma[k]);
            }
            assert!(mean <= bound, "{name} q={q}: mean error {mean} over 5 seeds above the HMT bound {bound}");
        }
        // With two power iterations on the decaying spectrum the result is near-optimal.
        if name == "decaying" {
            let s = linalg::randomized_svd(&a, rows, cols, k, p, 2, 7).unwrap();
            let e = numpy(&a, rows, cols, Some(&s))["err2"].as_f64().unwrap();
            assert!(e <= 1.01 * sigma[k], "decaying q=2: error {e} vs optimal {}", sigma[k]);
            assert_sigma_close(&s.sigma, &sigma[..k], "randomized q=2 top-k sigma");
        }
    }
}

#[test]
fn hmt_bound_by_hand() {
    // sigma = (4, 2, 1, 1, ...) with 20 values, k = 1, p = 2, q = 0:
    // 2 + (1 + sqrt(1/1)) 2 + e sqrt(3)/2 sqrt(4 + 18) = 6 + e sqrt(3) sqrt(22) / 2.
    let mut sigma = vec![4.0, 2.0];
    sigma.extend(std::iter::repeat(1.0).take(18));
    let want = 6.0 + std::f64::consts::E * 3f64.sqrt() * 22f64.sqrt() / 2.0;
    assert!((linalg::randomized_svd_error_bound(&sigma, 1, 2, 0).unwrap() - want).abs() < 1e-12);
    // q = 1: 2 + [(1 + 1) 8 + e sqrt(3)/2 sqrt(64 + 18)]^(1/3).
    let want = 2.0 + (16.0 + std::f64::consts::E * 3f64.sqrt() / 2.0 * 82f64.sqrt()).powf(1.0 / 3.0);
    assert!((linalg::randomized_svd_error_bound(&sigma, 1, 2, 1).unwrap() - want).abs() < 1e-12);
    // The sketch spans everything: Eckart-Young's sigma_(k+1).
    assert_eq!(linalg::randomized_svd_error_bound(&sigma, 15, 10, 0).unwrap(), 1.0);
    assert!(linalg::randomized_svd_error_bound(&sigma, 1, 1, 0).unwrap_err().to_string().contains("p >= 2"));
}

#[test]
fn effective_ranks_equal_numpys() {
    let cases = [("gaussian [384, 1536]", 384, 1536, randn(384 * 1536, 31)), ("planted r=6 [48, 32]", 48, 32, planted(48, 32, 6, 32))];
    for (name, rows, cols, a) in cases {
        let np = numpy(&a, rows, cols, None);
        let np_sigma = f64s(&np["sigma"]);
        let ours = linalg::svd(&a, rows, cols).unwrap().sigma;
        let want = np["erank"].as_f64().unwrap();
        for (label, s) in [("numpy's sigma", &np_sigma), ("our sigma", &ours)] {
            let got = linalg::effective_rank_entropy(s);
            assert!((got - want).abs() <= 1e-6 * want, "{name}, {label}: effective rank {got} vs numpy {want}");
        }
        assert_eq!(linalg::rank_for_energy(&np_sigma, 0.99).unwrap() as u64, np["energy99"].as_u64().unwrap(), "{name}: 99% energy rank");
        assert_eq!(linalg::rank_for_energy(&ours, 0.99).unwrap() as u64, np["energy99"].as_u64().unwrap(), "{name}: 99% energy rank (our sigma)");
    }
    // Limits: n equal values give n, one non-zero value gives 1.
    assert!((linalg::effective_rank_entropy(&[3.0; 17]) - 17.0).abs() < 1e-12);
    assert_eq!(linalg::effective_rank_entropy(&[5.0, 0.0, 0.0]), 1.0);
    assert_eq!(linalg::rank_for_energy(&[3.0, 4.0], 1.0).unwrap(), 2);
    assert_eq!(linalg::rank_for_energy(&[4.0, 3.0], 0.64).unwrap(), 1);
    assert_eq!(linalg::rank_for_energy(&[4.0, 3.0], 0.65).unwrap(), 2);
}

#[test]
fn bad_input_is_an_error_naming_the_problem() {
    let e = linalg::svd(&[1.0; 5], 2, 3).unwrap_err();
    assert_eq!(e, LinalgError::Shape { len: 5, rows: 2, cols: 3 });
    assert!(e.to_string().contains("rows * cols = 6"), "{e}");
    let e = linalg::svd(&[1.0, f32::NAN, 0.0, 2.0], 2, 2).unwrap_err();
    assert!(e.to_string().contains("flat index 1 is not finite"), "{e}");
    let e = linalg::randomized_svd(&[1.0; 6], 2, 3, 3, 10, 0, 0).unwrap_err();
    assert!(e.to_string().contains("pick 1..=2"), "{e}");
    assert!(linalg::rank_for_energy(&[1.0], 1.5).unwrap_err().to_string().contains("(0, 1]"));
}
