//! Issue 15 on the real model, against a full capture of the same runs:
//! - the `online` state's DDSketch quantiles (alpha = 1%) of every MiniLM site and role are
//!   within alpha (relative) of the exact quantiles of the captured tensors (a plain host sort);
//! - the singular values `opscope probe` gives for captured MiniLM weights and activations equal
//!   `numpy.linalg.svd` of the same `.npy` files to 1e-4 relative (plus 1e-10 of sigma_1).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use opscope::capture::{read_manifest, read_tensor};
use serde_json::Value;

fn record(out: &Path, pipeline: &str, limit: &str) -> String {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let o = Command::new(env!("CARGO_BIN_EXE_opscope"))
        .arg("record")
        .args(a.cli_args())
        .args(["--limit", limit, "--batch", "8", "--seq", "32", "--pipeline", pipeline, "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "record: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// The exact q-quantile of `v` as DDSketch ranks it: the value at rank floor(q (n - 1)).
fn exact_quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[(q * (sorted.len() - 1) as f64).floor() as usize]
}

#[test]
fn online_quantiles_of_every_minilm_site_are_within_alpha_of_a_full_capture() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.parquet");
    // Two runs of 8 x 32 tokens; every matmul tensor captured on both (weights once).
    let said = record(&rec, "online,capture{budget=512MiB}", "16");
    let state = opscope::online::OnlineState::read(&opscope::online::state_path(&rec)).unwrap();
    let cap = dir.path().join("rec.parquet.capture");
    let m = read_manifest(&cap).unwrap();
    assert!(m.skipped.is_empty(), "the budget holds every tensor: {:?}", m.skipped.len());
    // `record` says where the tensors went and how many (its table has counts only for them).
    assert!(said.contains(&format!("captured {} tensor(s) in {}", m.captured.len(), cap.display())), "{said}");
    let runs = m.captured.iter().map(|c| c.run).max().unwrap() + 1;
    assert_eq!(runs, 2);
    // What each site/role's state saw: every run's tensor (a weight, captured once per compile,
    // feeds the state on every run).
    let mut seen: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for c in &m.captured {
        let v = read_tensor(&cap, c).unwrap();
        let times = if c.invariant { runs as usize } else { 1 };
        let e = seen.entry(format!("{}/{}", c.site, c.role)).or_default();
        for _ in 0..times {
            e.extend(v.iter().filter(|x| x.is_finite()).map(|x| x.abs() as f64));
        }
    }
    assert!(seen.len() >= 60, "every site and role of MiniLM-L3: {}", seen.len());
    // A tensor read by several sites (the merged Q/K/V projection's input) feeds the state once,
    // under its first site's key.
    assert!(state.sites.len() >= 50, "states: {}", state.sites.len());
    const ALPHA: f64 = 0.01;
    for (key, s) in &state.sites {
        let mut values = seen.get(key).unwrap_or_else(|| panic!("online state {key} was not captured")).clone();
        assert_eq!(s.magnitudes.count(), values.len(), "{key}: values the state saw");
        values.sort_by(f64::total_cmp);
        for q in [0.5, 0.9, 0.99, 0.999] {
            let est = s.magnitudes.quantile(q).unwrap().unwrap();
            let exact = exact_quantile(&values, q);
            // Magnitudes at or below 1e-9 are the sketch's zero bucket (reported as 0).
            assert!((est - exact).abs() <= ALPHA * exact * (1.0 + 1e-9) + 1e-9, "{key} q={q}: sketch {est}, exact {exact}");
        }
        let (absmax, exact) = (s.quantiles().unwrap().absmax, *values.last().unwrap());
        assert_eq!(absmax, exact, "{key}: absmax is exact ({absmax} vs {exact})");
    }
}

const NUMPY_SVD: &str = r#"
import json, sys, numpy as np
cap = sys.argv[1]
man = json.load(open(cap + "/manifest.json"))
out = {}
for c in man["captured"]:
    x = np.load(cap + "/" + c["file"]).astype(np.float64)
    a = x.reshape(-1, x.shape[-1])
    out[c["file"]] = np.linalg.svd(a, compute_uv=False).tolist()
print(json.dumps(out))
"#;

#[test]
fn probe_singular_values_of_captured_minilm_tensors_equal_numpy() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.parquet");
    record(&rec, "capture{sites=[*layer.0/attention/self/query*,*layer.0/intermediate*],roles=[lhs,rhs]}", "8");
    let cap = dir.path().join("rec.parquet.capture");
    // A second capture appended into the dataset is refused before the model runs: the
    // dataset gains no partition (nor an open part) and the capture is left as it was.
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let capture_manifest = std::fs::read(cap.join("manifest.json")).unwrap();
    let again = Command::new(env!("CARGO_BIN_EXE_opscope"))
        .arg("record")
        .args(a.cli_args())
        .args(["--limit", "8", "--pipeline", "capture{roles=[lhs]}", "--append", "--out"])
        .arg(&rec)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("already holds a capture"), "{err}");
    assert_eq!(opscope::recording::partitions(&rec).unwrap().len(), 1, "no partition added: {err}");
    assert!(opscope::recording::partitions(&rec).unwrap()[0].open.is_empty());
    assert_eq!(std::fs::read(cap.join("manifest.json")).unwrap(), capture_manifest);
    let o = Command::new(env!("CARGO_BIN_EXE_opscope")).args(["probe", "--json", "--capture"]).arg(&cap).output().unwrap();
    assert!(o.status.success(), "probe: {}", String::from_utf8_lossy(&o.stderr));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let py = Command::new("python3").args(["-c", NUMPY_SVD]).arg(&cap).output().expect("python3 runs");
    assert!(py.status.success(), "numpy: {}", String::from_utf8_lossy(&py.stderr));
    let reference: BTreeMap<String, Vec<f64>> = serde_json::from_slice(&py.stdout).unwrap();
    let m = read_manifest(&cap).unwrap();
    let tensors = doc["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), m.captured.len());
    let mut weights = 0;
    for (t, c) in tensors.iter().zip(&m.captured) {
        assert_eq!(t["site"].as_str(), Some(c.site.as_str()));
        let sp = &t["spectrum"]["Ok"];
        assert_eq!(sp["method"], "exact", "{}: MiniLM's tensors get the exact SVD", c.site);
        let ours: Vec<f64> = sp["sigma"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        let theirs = &reference[&c.file];
        assert_eq!(ours.len(), theirs.len(), "{} {}", c.site, c.role);
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            // Relative, plus 1e-10 of sigma_1 for singular values at f64 rounding level (rows that
            // repeat, such as padding, make the trailing ones ~1e-16 sigma_1 in both).
            assert!((a - b).abs() <= 1e-4 * b.abs() + 1e-10 * theirs[0], "{} {} sigma_{i}: {a} vs numpy {b}", c.site, c.role);
        }
        weights += c.invariant as usize;
    }
    assert!(weights >= 2 && m.captured.len() > weights, "weights and activations: {weights} of {}", m.captured.len());
}
