//! The miner's int8 SQNR estimates (noise model Δ²/12 from the sketches) against the SQNR
//! measured on the same MiniLM tensors, per site: `opscope record` with the full `matmul` set
//! and a `capture` of layer 0's activations in one run, then `opscope probe --recording`.
//! An independent Python reference (pyarrow reads the recording, numpy the `.npy` captures)
//! recomputes both sides: the estimate from the recorded `min`, `max`, `sumsq`, `count`,
//! `chan_maxabs` and `row_absmax` (the formulas written out again, not the miner's code), and
//! the measurement with `fakequant`'s quantizer in f32 on the rows the sketch recorded
//! (padding rows, NaN in `row_absmax`, left out). The recorded per-row absmax must also equal
//! the captured tensor's, row for row: the two views are of one tensor.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const REFERENCE: &str = r#"
import json, sys, numpy as np, pyarrow.parquet as pq, pyarrow.dataset as ds
cap, rec = sys.argv[1], sys.argv[2]
man = json.load(open(cap + "/manifest.json"))
t = ds.dataset(rec, format="parquet", partitioning="hive").to_table().to_pandas()
out = []
for c in man["captured"]:
    if c["role"] != "lhs":
        continue
    r = t[(t.site == c["site"]) & (t.role == c["role"]) & (t.compile == c["compile"]) & (t.step == c["run"])]
    def vec(stat):
        v = r[r.stat == stat].sort_values("idx")
        return v.value.to_numpy(np.float64), v.idx.to_numpy()
    def scalar(stat):
        v, _ = vec(stat)
        return float(v[0])
    x = np.load(cap + "/" + c["file"]).astype(np.float32)
    cols = x.shape[-1]
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    ra, ridx = vec("row_absmax")            # NaN rows are not written: a missing idx is padding
    kept = np.zeros(rows, bool); kept[ridx] = True
    row_absmax = np.zeros(rows); row_absmax[ridx] = ra
    host_rows = np.abs(x2[kept]).max(axis=1).astype(np.float64)
    rows_equal = bool(np.array_equal(host_rows, row_absmax[kept]))
    count, sumsq = scalar("count"), scalar("sumsq")
    p = sumsq / count
    a = max(abs(scalar("min")), abs(scalar("max")))
    ch, _ = vec("chan_maxabs")
    pred = {
        "tensor": 10 * np.log10(12 * p * 127**2 / a**2),
        "channel": 10 * np.log10(p / np.mean((ch / 127) ** 2 / 12)),
        "token": 10 * np.log10(p / np.mean((ra / 127) ** 2 / 12)),
    }
    xk = x2[kept]
    def fq(groups_amax, idx):
        s = (groups_amax / np.float32(127)).astype(np.float32)[idx]
        q = np.where(s == 0, np.float32(0), np.clip(np.round(xk / np.where(s == 0, 1, s)), -127, 127).astype(np.float32) * s)
        e = (xk.astype(np.float64) - q.astype(np.float64)) ** 2
        return 10 * np.log10((xk.astype(np.float64) ** 2).sum() / e.sum())
    ones = np.zeros(xk.shape, int)
    meas = {
        "tensor": fq(np.array([np.abs(xk).max()], np.float32), ones),
        "channel": fq(np.abs(xk).max(axis=0), np.broadcast_to(np.arange(cols), xk.shape)),
        "token": fq(np.abs(xk).max(axis=1), np.broadcast_to(np.arange(xk.shape[0])[:, None], xk.shape)),
    }
    out.append({"site": c["site"], "run": c["run"], "kept": int(kept.sum()), "rows": rows, "rows_equal": rows_equal,
                "count_ok": bool(count == kept.sum() * cols), "pred": pred, "meas": meas})
print(json.dumps(out))
"#;

fn opscope(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_opscope")).args(args).output().expect("opscope runs")
}

#[test]
fn miner_estimates_against_measured_sqnr_on_minilm_match_an_independent_reference() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.parquet");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = opscope(&[
        "record",
        "--onnx",
        &s(&a.onnx),
        "--tokenizer",
        &s(&a.tokenizer),
        "--text",
        &s(&a.text),
        "--limit",
        "16",
        "--batch",
        "8",
        "--seq",
        "32",
        "--pipeline",
        "matmul,capture{sites=[*layer.0/*],roles=[lhs],budget=64MiB}",
        "--out",
        &s(&rec),
    ]);
    assert!(out.status.success(), "record: {}", String::from_utf8_lossy(&out.stderr));
    let cap = dir.path().join("rec.parquet.capture");
    let out = opscope(&["probe", "--json", "--capture", &s(&cap), "--recording", &s(&rec)]);
    assert!(out.status.success(), "probe: {}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("probe JSON");
    let checks = doc["noise_check"].as_array().expect("noise_check");

    let py = Command::new("python3").args(["-c", REFERENCE]).arg(&cap).arg(&rec).output().expect("python3 runs");
    assert!(py.status.success(), "reference: {}", String::from_utf8_lossy(&py.stderr));
    let reference: Vec<Value> = serde_json::from_slice(&py.stdout).expect("reference JSON");
    assert!(reference.len() >= 8, "layer 0's activations over two runs: {}", reference.len());
    let mut padded = 0;
    for r in &reference {
        let (site, run) = (r["site"].as_str().unwrap(), r["run"].as_u64().unwrap());
        assert!(r["rows_equal"].as_bool().unwrap(), "{site} run {run}: recorded row_absmax differs from the captured tensor's");
        assert!(r["count_ok"].as_bool().unwrap(), "{site} run {run}: the sketch's count is not kept rows x channels");
        padded += (r["kept"].as_u64() < r["rows"].as_u64()) as usize;
        for scale in ["tensor", "channel", "token"] {
            let c = checks
                .iter()
                .find(|c| c["site"] == site && c["role"] == "lhs" && c["run"].as_u64() == Some(run) && c["scale"] == scale)
                .unwrap_or_else(|| panic!("no noise check for {site} run {run} {scale}"));
            assert_eq!(c["rows_kept"], r["kept"], "{site} run {run}: rows measured");
            let (p, m) = (c["predicted_db"].as_f64().unwrap(), c["measured_db"].as_f64().unwrap());
            let (rp, rm) = (r["pred"][scale].as_f64().unwrap(), r["meas"][scale].as_f64().unwrap());
            assert!((p - rp).abs() < 1e-3, "{site} run {run} {scale}: predicted {p} vs reference {rp}");
            assert!((m - rm).abs() < 1e-3, "{site} run {run} {scale}: measured {m} vs reference {rm}");
            assert!((c["gap_db"].as_f64().unwrap() - (m - p)).abs() < 1e-9);
        }
    }
    assert!(padded > 0, "the batches hold padding rows, so the row mask is exercised");
    // The report's text form names every scale.
    let text = opscope(&["probe", "--capture", &s(&cap), "--recording", &s(&rec)]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("noise model") && text.contains("channel") && text.contains("token"), "{text}");
}
