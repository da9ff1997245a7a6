//! The repeated-block finder on the real model: MiniLM-L3's deployed program holds its encoder
//! layer exactly as many times as the ONNX file has layers (read by Python's `onnx`, not by RLX),
//! in disjoint occurrences, occurrence i holding layer i's matmuls; `opscope blocks --json` gives it.
//! Needs the assets of `scripts/fetch-assets.sh` and the `onnx` package.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::process::Command;

use opscope::analysis::{repeated_blocks, site_names, BlockOptions};
use opscope_lab::model::{MiniLmAssets, OnnxEncoder};

/// Per encoder layer index, its ONNX MatMul node count, read with the `onnx` package.
fn onnx_layers(onnx: &std::path::Path) -> BTreeMap<usize, usize> {
    let code = r#"
import json, re, sys, onnx
m = onnx.load(sys.argv[1], load_external_data=False)
per = {}
for n in m.graph.node:
    k = re.search(r"/layer\.(\d+)/", n.name)
    if k and n.op_type == "MatMul":
        per[int(k.group(1))] = per.get(int(k.group(1)), 0) + 1
print(json.dumps(per))
"#;
    let out = Command::new("python3").args(["-c", code]).arg(onnx).output().expect("python3 runs");
    assert!(out.status.success(), "onnx reference failed (pip install -r scripts/requirements-test.txt): {}", String::from_utf8_lossy(&out.stderr));
    let m: BTreeMap<String, usize> = serde_json::from_slice(&out.stdout).unwrap();
    m.into_iter().map(|(k, v)| (k.parse().unwrap(), v)).collect()
}

#[test]
fn minilm_deployed_graph_holds_its_encoder_layer_once_per_layer() {
    let a = MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let layers = onnx_layers(&a.onnx);
    // paraphrase-MiniLM-L3-v2: Q, K, V, scores, context, out-proj, FFN1, FFN2 per layer.
    assert_eq!(layers, BTreeMap::from([(0, 8), (1, 8), (2, 8)]));
    let enc = OnnxEncoder::load(&a.onnx, 1, 16).unwrap();
    let fused = opscope::activate::fuse(&enc.graph, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::default());
    let blocks = repeated_blocks(&fused, &BlockOptions::default()).unwrap();
    let top = &blocks[0];
    assert_eq!(top.occurrences.len(), layers.len(), "{:?}", blocks.iter().map(|b| (b.ops, b.occurrences.len())).collect::<Vec<_>>());
    let all: Vec<u32> = top.occurrences.iter().flatten().copied().collect();
    assert_eq!(all.len(), all.iter().collect::<HashSet<_>>().len(), "occurrences overlap");
    // Occurrence i holds layer i's matmuls and no other layer's: RLX merges Q, K and V into one
    // GEMM, so 8 ONNX MatMuls are 6 matmul ops; one softmax per layer.
    let (names, _) = site_names(&fused, Some(&enc.graph));
    let mut seen = BTreeSet::new();
    for occ in &top.occurrences {
        let mm: Vec<&String> = occ.iter().filter(|v| opscope::analysis::op_name(&fused.nodes()[**v as usize].op) == "matmul").map(|v| &names[v]).collect();
        assert_eq!(mm.len(), layers[&0] - 2, "{mm:?}");
        let which: BTreeSet<usize> = layers.keys().copied().filter(|i| mm.iter().any(|n| n.contains(&format!("/layer.{i}/")))).collect();
        assert_eq!(which.len(), 1, "one occurrence spans layers {which:?}: {mm:?}");
        seen.extend(which);
    }
    assert_eq!(seen, layers.keys().copied().collect::<BTreeSet<_>>());
    assert_eq!(top.op_counts.get("softmax"), Some(&1), "{:?}", top.op_counts);
}

#[test]
fn blocks_cli_prints_json() {
    let a = MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(env!("CARGO_BIN_EXE_opscope"))
        .args(["blocks", "--batch", "1", "--seq", "16", "--json", "--onnx"])
        .arg(&a.onnx)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let top = &doc["blocks"][0];
    assert_eq!(top["occurrences"].as_array().unwrap().len(), 3, "{top}");
    assert_eq!(doc["stage"], "deployed");
    let sites = doc["first_sites"][0].as_array().unwrap();
    assert_eq!(sites.len(), 3);
    // RLX fuses the two residual adds + LayerNorms of a layer; the rest of its ops are unfused.
    let f = &doc["rlx_fusion"][0];
    assert_eq!(f["fused"], serde_json::json!({"fused_residual_ln": 2}), "{f}");
    let ops = top["ops"].as_u64().unwrap();
    assert_eq!(f["unfused_ops"].as_u64().unwrap(), ops - 2, "{f}");
    assert!(f["missed"].is_array());
    let bad = Command::new(env!("CARGO_BIN_EXE_opscope")).args(["blocks", "--onnx", "missing.onnx"]).output().unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("missing.onnx: no such ONNX file") && !err.contains("panicked"), "{err}");
}
