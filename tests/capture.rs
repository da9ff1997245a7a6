//! The `capture` tap against host computations:
//! - captured lhs and rhs equal the tensors fed to the graph, bit for bit; the captured matmul
//!   output equals the host product bit for bit (integer-valued data, so every f32 partial sum
//!   is exact and the order of summation cannot matter), read back by numpy (`numpy.load`);
//! - the caller's outputs are bit-identical with the capture on;
//! - `every=N` captures steps 0, N, 2N, ...; a weight is written once per compile;
//! - the byte budget is respected: capture stops at the first tensor that does not fit, the
//!   sketches go on for every run, and the capture manifest lists what was skipped;
//! - the rewritten graph is pinned (insta).

mod common;
use common::*;
use opscope::capture::{read_manifest, read_tensor, CaptureManifest};
use opscope::{MemorySink, Pipeline};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

const B: usize = 2;
const S: usize = 4;
const K: usize = 8;
const N: usize = 4;

/// x[B,S,K] @ w[K,N] -> relu: the matmul output is an intermediate, not a caller output.
fn graph() -> Graph {
    let mut g = Graph::new("cap");
    let x = g.input("x", Shape::new(&[B, S, K], DType::F32));
    let w = g.param("w", Shape::new(&[K, N], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[B, S, N], DType::F32));
    g.node_mut(y).name = Some("/fc/MatMul".into());
    let r = g.activation(rlx_ir::op::Activation::Relu, y, Shape::new(&[B, S, N], DType::F32));
    g.set_outputs(vec![r]);
    g
}

/// Integer values in [-3, 3]: products and sums of K of them are exact in f32.
fn ints(n: usize, seed: u64) -> Vec<f32> {
    randn(n, seed).iter().map(|v| (v * 1.5).round().clamp(-3.0, 3.0)).collect()
}

/// Compile `g` once inside a scope capturing into `dir`, run it on each input of `xs`; returns
/// the caller's outputs per run and the sink.
fn record(pipeline: &str, g: &Graph, w: &[f32], xs: &[Vec<f32>], dir: &std::path::Path) -> (Vec<Vec<Vec<f32>>>, MemorySink) {
    let p = Pipeline::parse(pipeline).expect("pipeline parses");
    let sink = MemorySink::default();
    let (outs, res) = opscope::Scope::new(&p, Box::new(sink.clone())).capture_dir(dir).run(|| {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        c.set_param("w", w);
        xs.iter().map(|x| c.run(&[("x", x)])).collect::<Vec<_>>()
    });
    res.expect("recording ok");
    (outs, sink)
}

fn plain(g: &Graph, w: &[f32], xs: &[Vec<f32>]) -> Vec<Vec<Vec<f32>>> {
    let mut c = Session::new(Device::Cpu).compile(g.clone());
    c.set_param("w", w);
    xs.iter().map(|x| c.run(&[("x", x)])).collect()
}

fn entry<'a>(m: &'a CaptureManifest, role: &str, run: u64) -> &'a opscope::capture::Captured {
    m.captured.iter().find(|c| c.role == role && c.run == run).unwrap_or_else(|| panic!("{role} of run {run} captured: {m:#?}"))
}

fn host_matmul(x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; B * S * N];
    for r in 0..B * S {
        for n in 0..N {
            let acc: f64 = (0..K).map(|k| x[r * K + k] as f64 * w[k * N + n] as f64).sum();
            y[r * N + n] = acc as f32;
        }
    }
    y
}

#[test]
fn captured_tensors_equal_the_host_tensors_bit_for_bit_and_numpy_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let cap = dir.path().join("rec.capture");
    let w = ints(K * N, 2);
    let xs: Vec<Vec<f32>> = (0..3).map(|i| ints(B * S * K, 10 + i)).collect();
    let (outs, sink) = record("capture", &graph(), &w, &xs, &cap);
    // The caller's outputs are bit-identical with the capture on.
    assert_eq!(outs.iter().map(|o| bits(o)).collect::<Vec<_>>(), plain(&graph(), &w, &xs).iter().map(|o| bits(o)).collect::<Vec<_>>());
    let m = read_manifest(&cap).unwrap();
    assert_eq!(m.format, "npy");
    // lhs and out on each of the 3 runs, the weight once.
    assert_eq!(m.captured.len(), 3 + 3 + 1, "{m:#?}");
    assert_eq!(m.captured.iter().filter(|c| c.role == "rhs").count(), 1);
    assert!(m.skipped.is_empty());
    let rhs = entry(&m, "rhs", 0);
    assert!(rhs.invariant);
    assert_eq!(rhs.shape, vec![K, N]);
    assert_eq!(bits(&[read_tensor(&cap, rhs).unwrap()]), bits(&[w.clone()]));
    for (r, x) in xs.iter().enumerate() {
        let lhs = entry(&m, "lhs", r as u64);
        assert_eq!((lhs.site.as_str(), lhs.shape.clone(), lhs.bytes, lhs.dtype.as_str()), ("fc/MatMul", vec![B, S, K], (B * S * K * 4) as u64, "f32"));
        assert_eq!(bits(&[read_tensor(&cap, lhs).unwrap()]), bits(&[x.clone()]), "run {r} lhs");
        let out = read_tensor(&cap, entry(&m, "out", r as u64)).unwrap();
        assert_eq!(bits(&[out.clone()]), bits(&[host_matmul(x, &w)]), "run {r} out");
        // The caller's relu output is the relu of the captured product.
        assert_eq!(bits(&[out.iter().map(|v| v.max(0.0)).collect()]), bits(&outs[r]));
    }
    // Count sketches are recorded for every run.
    let rows = sink.rows();
    assert_eq!(rows.iter().filter(|r| r.stat.as_ref() == "count" && r.role.as_ref() == "lhs").count(), 3);

    // numpy reads every file listed, with the listed shape, and its float64 product of the
    // captured operands equals the captured output exactly; it prints each lhs's bytes.
    let code = r#"
import json, sys, numpy as np
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
t = {(c["role"], c["run"]): np.load(d + "/" + c["file"]) for c in m["captured"]}
for c in m["captured"]:
    a = t[(c["role"], c["run"])]
    assert a.dtype == np.float32 and list(a.shape) == c["shape"], (a.dtype, a.shape, c)
w = t[("rhs", 0)].astype(np.float64)
for r in range(3):
    y = (t[("lhs", r)].astype(np.float64) @ w).astype(np.float32)
    assert np.array_equal(y.view(np.uint32), t[("out", r)].view(np.uint32)), r
    print(t[("lhs", r)].tobytes().hex())
"#;
    let out = std::process::Command::new("python3").args(["-c", code]).arg(&cap).output().expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect();
    let expect: Vec<String> = xs.iter().map(|x| x.iter().flat_map(|v| v.to_le_bytes()).map(|b| format!("{b:02x}")).collect()).collect();
    assert_eq!(printed, expect);
}

#[test]
fn every_n_samples_runs_and_the_budget_stops_capture_but_not_sketches() {
    let dir = tempfile::tempdir().unwrap();
    let w = randn(K * N, 3);
    let xs: Vec<Vec<f32>> = (0..7).map(|i| randn(B * S * K, 20 + i)).collect();
    // every=2: runs 0, 2, 4, 6 sampled; lhs only (B*S*K*4 = 256 bytes each).
    let cap = dir.path().join("a.capture");
    let (outs, _) = record("capture{roles=[lhs],every=2}", &graph(), &w, &xs, &cap);
    assert_eq!(outs.iter().map(|o| bits(o)).collect::<Vec<_>>(), plain(&graph(), &w, &xs).iter().map(|o| bits(o)).collect::<Vec<_>>());
    let m = read_manifest(&cap).unwrap();
    assert_eq!(m.captured.iter().map(|c| c.run).collect::<Vec<_>>(), vec![0, 2, 4, 6]);
    for c in &m.captured {
        assert_eq!(bits(&[read_tensor(&cap, c).unwrap()]), bits(&[xs[c.run as usize].clone()]));
    }

    // Budget 700 bytes: lhs (256) + out (128) per run fits 1 run (384); run 1's lhs brings it
    // to 640, its out (768) does not fit: capture stops there for good.
    let cap = dir.path().join("b.capture");
    let (outs, sink) = record("capture{roles=[lhs,out],budget=700B}", &graph(), &w, &xs, &cap);
    assert_eq!(outs.iter().map(|o| bits(o)).collect::<Vec<_>>(), plain(&graph(), &w, &xs).iter().map(|o| bits(o)).collect::<Vec<_>>());
    let m = read_manifest(&cap).unwrap();
    let got: Vec<(String, u64)> = m.captured.iter().map(|c| (c.role.clone(), c.run)).collect();
    assert_eq!(got, vec![("lhs".into(), 0), ("out".into(), 0), ("lhs".into(), 1)]);
    let used: u64 = m.captured.iter().map(|c| c.bytes).sum();
    assert_eq!(used, 640);
    assert_eq!(m.budgets.len(), 1);
    assert_eq!((m.budgets[0].budget, m.budgets[0].used, m.budgets[0].exhausted), (700, 640, true));
    // Skipped: run 1's out, then lhs and out of runs 2..6.
    assert_eq!(m.skipped.len(), 1 + 2 * 5, "{m:#?}");
    assert_eq!((m.skipped[0].role.as_str(), m.skipped[0].run, m.skipped[0].bytes), ("out", 1, 128));
    assert!(m.skipped.iter().all(|s| s.reason.contains("budget 700")));
    // Sketches go on: a count row for every run.
    let steps: Vec<u64> = sink.rows().iter().filter(|r| r.stat.as_ref() == "count" && r.role.as_ref() == "lhs").map(|r| r.step).collect();
    assert_eq!(steps, (0..7).collect::<Vec<_>>());
    // Files on disk: exactly the captured ones, no partial file left.
    let mut files: Vec<String> = walk(&cap);
    files.sort();
    let mut listed: Vec<String> = m.captured.iter().map(|c| c.file.clone()).chain(["manifest.json".into()]).collect();
    listed.sort();
    assert_eq!(files, listed);
}

/// A site's FLOPs ride on the rows of the pass that counts them (`matmul`), whatever pass
/// comes first: with `capture` first, the matmul rows took the capture pass's entry of the same
/// site (no FLOPs), and every mining payoff of such a recording was 0.
#[test]
fn matmul_rows_carry_the_site_flops_whatever_pass_comes_first() {
    let dir = tempfile::tempdir().unwrap();
    let w = randn(K * N, 4);
    let xs: Vec<Vec<f32>> = (0..2).map(|i| randn(B * S * K, 30 + i)).collect();
    // One execution of x[B,S,K] @ w[K,N]: a multiply and an add per term.
    let flops = (2 * B * S * K * N) as u64;
    for pipeline in ["matmul", "capture,matmul", "matmul,capture"] {
        let (_, sink) = record(pipeline, &graph(), &w, &xs, &dir.path().join(format!("{pipeline}.capture")));
        let rows = sink.rows();
        let matmul: Vec<_> = rows.iter().filter(|r| r.pass.as_ref() == "matmul").collect();
        assert!(!matmul.is_empty(), "{pipeline}: matmul rows recorded");
        let wrong: Vec<_> = matmul.iter().filter(|r| r.flops != Some(flops)).map(|r| (r.role.as_ref(), r.stat.as_ref(), r.flops)).collect();
        assert!(wrong.is_empty(), "{pipeline}: matmul rows without the site's {flops} FLOPs: {:?}", &wrong[..wrong.len().min(5)]);
    }
}

fn walk(d: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            let sub = p.file_name().unwrap().to_string_lossy().to_string();
            out.extend(walk(&p).into_iter().map(|f| format!("{sub}/{f}")));
        } else {
            out.push(p.file_name().unwrap().to_string_lossy().to_string());
        }
    }
    out
}

#[test]
fn a_bad_budget_is_an_error_naming_the_fix() {
    let p = Pipeline::parse("capture{budget=64MB}").expect("text option parses");
    let err = p.apply(&graph()).expect_err("64MB is not a binary size").to_string();
    assert!(err.contains("64MB") && err.contains("MiB"), "{err}");
}

/// A directory that is not a capture (a recording's path given instead of its `.capture`) is
/// named as a capture directory, not as a recording, with the directory to pass.
#[test]
fn a_directory_without_a_capture_manifest_says_which_directory_to_pass() {
    let dir = tempfile::tempdir().unwrap();
    let e = read_manifest(dir.path()).err().expect("no manifest: an error").to_string();
    assert!(e.starts_with("capture ") && e.contains("manifest.json") && e.contains("not a capture directory") && e.contains("<recording>.capture"), "{e}");
    std::fs::write(dir.path().join("manifest.json"), b"{}").unwrap();
    let e = read_manifest(dir.path()).err().expect("not a manifest: an error").to_string();
    assert!(e.starts_with("capture ") && e.contains("not a capture manifest"), "{e}");
}

#[test]
fn snapshot_capture_rewrite() {
    let p = Pipeline::parse("capture{roles=[lhs,rhs],every=4,budget=1KiB}").unwrap();
    let g = graph();
    let (out, m) = p.apply(&g).unwrap();
    assert_caller_outputs_first(&g, &out);
    let mut text = render(&out, &m);
    for c in &m.captures {
        text.push_str(&format!(
            "# capture output {} tensor=%{} {}/{} dims={:?} invariant={} every={} budget={} pass#{}\n",
            c.output_index, c.tensor, c.site, c.role, c.dims, c.invariant, c.every, c.budget, c.pass_idx
        ));
    }
    let errors = rlx_ir::verify::verify_all(&out);
    assert!(errors.is_empty(), "verifier: {errors:?}");
    insta::with_settings!({snapshot_path => "../snapshots", prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!("capture__lhs_rhs", text);
    });
}
