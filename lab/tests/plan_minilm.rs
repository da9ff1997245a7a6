//! `opscope plan` and `opscope measure --plan` on the real model (paraphrase-MiniLM-L3-v2, 8
//! fortunes): the four weight sites of layer 0 (merged Q/K/V, attention output, FFN1, FFN2) with
//! options int8 and int4 fake-quant (per token, per output channel), at 20% of their fp32 bytes.
//!
//! - the bytes of every cell follow the documented formula on MiniLM's known weight shapes;
//! - the plan fits the budget and its prediction is the optimum of its own table, found here by
//!   exhaustive search over the 3^4 combinations;
//! - the joint error `measure --plan` reports is a real measurement: it equals an independent
//!   `measure --also PIPELINE` run of the plan's pipeline, and onnxruntime's embeddings of an
//!   ONNX model fake-quantized by `scripts/plan_reference.py` (onnx + numpy, no opscope);
//! - the joint error is printed beside the sum of the per-site errors.
//!
//! Needs the assets of `scripts/fetch-assets.sh` and the Python packages of
//! `scripts/requirements-test.txt`.

use std::path::{Path, PathBuf};
use std::process::Command;

use opscope_lab::model::{split_entries, TextEncoder};
use opscope_lab::plan::Plan;

const LIMIT: usize = 8;
const INT8: &str = "int8=fakequant{sites=[{site}],scope=token,weights=true}";
const INT4: &str = "int4=fakequant{sites=[{site}],bits=4,scope=token,weights=true}";

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_opscope")).args(args).output().expect("opscope runs");
    assert!(out.status.success(), "opscope {args:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn minilm_plan_fits_is_optimal_and_its_joint_error_is_measured() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let (onnx, tok, text) = (a.onnx.to_str().unwrap(), a.tokenizer.to_str().unwrap(), a.text.to_str().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let plan_path = dir.path().join("plan.json");
    let limit = LIMIT.to_string();
    let corpus = ["--onnx", onnx, "--tokenizer", tok, "--text", text, "--limit", &limit];
    let mut args = vec!["plan"];
    args.extend(corpus);
    args.extend(["--sites", "layer.0/*", "--option", INT8, "--option", INT4, "--budget-ratio", "0.2", "--out", plan_path.to_str().unwrap()]);
    let stdout = run(&args);
    eprintln!("{stdout}");
    let plan = Plan::load(&plan_path).unwrap();

    // Sites and bytes: MiniLM-L3 has hidden 384 and FFN 1536; fp32 4 B, int8 1 B, int4 0.5 B per
    // weight, plus one f32 scale per output column.
    let dims: Vec<(u64, u64)> = plan.sites.iter().map(|s| (s.weight.k, s.weight.n)).collect();
    assert_eq!(dims, vec![(384, 3 * 384), (384, 384), (384, 1536), (1536, 384)], "layer 0: merged QKV, out-proj, FFN1, FFN2");
    assert!(plan.sites[0].weight.site.contains("query/MatMul+") && plan.sites[0].weight.site.contains("value/MatMul"));
    for s in &plan.sites {
        let (k, n) = (s.weight.k, s.weight.n);
        let bytes: Vec<(&str, u64)> = s.cells.iter().map(|c| (c.option.as_str(), c.bytes)).collect();
        assert_eq!(bytes, vec![("fp32", 4 * k * n), ("int8", k * n + 4 * n), ("int4", k * n / 2 + 4 * n)], "{}", s.weight.site);
        assert_eq!(s.cells[0].nsr, 0.0);
        assert!(s.cells[1].nsr > 0.0 && s.cells[2].nsr > s.cells[1].nsr, "int4 loses more than int8 at {}: {:?}", s.weight.site, s.cells);
    }
    let fp32: u64 = dims.iter().map(|(k, n)| 4 * k * n).sum();
    assert_eq!(plan.fp32_bytes, fp32);
    assert_eq!(plan.budget_bytes, (0.2 * fp32 as f64).floor() as u64);

    // The plan fits and is the optimum of its table (exhaustive search over 3^4 plans).
    assert!(plan.plan_bytes <= plan.budget_bytes, "{} > {}", plan.plan_bytes, plan.budget_bytes);
    let mut best = (f64::INFINITY, Vec::new());
    for code in 0..81usize {
        let picks: Vec<usize> = (0..4).map(|i| code / 3usize.pow(i) % 3).collect();
        let bytes: u64 = picks.iter().zip(&plan.sites).map(|(&p, s)| s.cells[p].bytes).sum();
        let err: f64 = picks.iter().zip(&plan.sites).map(|(&p, s)| s.cells[p].nsr).sum();
        if bytes <= plan.budget_bytes && err < best.0 {
            best = (err, picks);
        }
    }
    assert!((plan.predicted_nsr - best.0).abs() <= 1e-12 * best.0, "plan {} vs exhaustive {}", plan.predicted_nsr, best.0);
    let chosen: Vec<&str> = plan.sites.iter().map(|s| s.chosen.as_str()).collect();
    let sum: f64 = plan.sites.iter().map(|s| s.cells.iter().find(|c| c.option == s.chosen).unwrap().nsr).sum();
    assert!((sum - plan.predicted_nsr).abs() <= 1e-12 * sum);
    assert!(chosen.contains(&"int4"), "at 20% of fp32 some site must go to int4: {chosen:?}");

    // The joint error, measured.
    let m_path = dir.path().join("applied.json");
    let mut args = vec!["measure"];
    args.extend(corpus);
    args.extend(["--plan", plan_path.to_str().unwrap(), "--time-budget-ms", "0", "--json", m_path.to_str().unwrap()]);
    eprintln!("{}", run(&args));
    let applied = json(&m_path)["applied"].clone();
    let joint = applied["joint_nsr"].as_f64().unwrap();
    assert_eq!(applied["pipeline"].as_str().unwrap(), plan.pipeline);

    // ... equals an independent `measure --also` of the same pipeline (its SQNR in dB).
    let also_path = dir.path().join("also.json");
    let mut args = vec!["measure"];
    args.extend(corpus);
    args.extend(["--also", plan.pipeline.as_str(), "--json", also_path.to_str().unwrap()]);
    run(&args);
    let also = json(&also_path)["also"][0].clone();
    let also_nsr = 10f64.powf(-also["sqnr_db"].as_f64().unwrap() / 10.0);
    assert!((joint - also_nsr).abs() <= 1e-9 * also_nsr, "measure --plan {joint} vs measure --also {also_nsr}");
    assert_eq!(applied["cos_mean"], also["cos_mean"]);

    // ... and agrees with onnxruntime on the model fake-quantized by the reference script.
    let texts: Vec<String> = split_entries(&std::fs::read_to_string(text).unwrap()).into_iter().take(LIMIT).collect();
    let enc = TextEncoder::load(Path::new(tok), 64).unwrap().encode(&texts).unwrap();
    let rows = |v: &[i64]| -> Vec<Vec<i64>> { v.chunks(64).map(|c| c.to_vec()).collect() };
    let mut sites = serde_json::Map::new();
    for s in plan.sites.iter().filter(|s| s.chosen != "fp32") {
        let bits = if s.chosen == "int4" { 4 } else { 8 };
        for part in s.weight.site.split('+') {
            sites.insert(format!("/{part}"), bits.into());
        }
    }
    let n_sites = sites.len();
    let req = dir.path().join("req.json");
    let res = dir.path().join("ref.json");
    let body = serde_json::json!({ "batches": [{ "ids": rows(&enc.ids), "mask": rows(&enc.mask) }], "sites": sites });
    std::fs::write(&req, serde_json::to_vec(&body).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/plan_reference.py");
    let st = Command::new("python3").arg(&script).args(["--onnx", onnx, "--input", req.to_str().unwrap(), "--out", res.to_str().unwrap()]).status().expect("python3 runs");
    assert!(st.success(), "{} failed: pip install -r scripts/requirements-test.txt", script.display());
    let r = json(&res);
    assert_eq!(r["quantized"].as_u64().unwrap() as usize, n_sites, "every chosen MatMul found in the ONNX model");
    let ort = r["nsr"].as_f64().unwrap();
    eprintln!(
        "MiniLM layer 0, budget {} of {} B: {chosen:?} ({} B); NSR predicted (sum of per-site) {:.4e}, measured jointly {joint:.4e} (ratio {:.3}), onnxruntime reference {ort:.4e}",
        plan.budget_bytes,
        plan.fp32_bytes,
        plan.plan_bytes,
        plan.predicted_nsr,
        joint / plan.predicted_nsr
    );
    assert!((joint - ort).abs() <= 0.02 * ort, "opscope joint NSR {joint} vs onnxruntime {ort}");
}
