//! `opscope memo` on MiniLM: the guard's hits equal the hits a recording of the same replay
//! predicts (LRU simulation over run fingerprints), at a capacity holding the pool (1 - P/T) and
//! below it, with every guarded output bit-identical to an unguarded run.

fn memo(capacity: u32) -> serde_json::Value {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("memo.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_opscope"))
        .args(["memo", "--batch", "2", "--seq", "16", "--pool", "4", "--runs", "20", "--seed", "3"])
        .args(["--capacity", &capacity.to_string()])
        .args(a.cli_args())
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    print!("{}", String::from_utf8_lossy(&out.stdout));
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[test]
fn memo_guard_hits_equal_the_recorded_prediction_on_minilm() {
    let v = memo(4);
    assert_eq!(v["recorded_distinct"], 4, "{v}");
    assert_eq!(v["predicted_hits"], 16, "1 - P/T of 20 runs over 4 batches: {v}");
    assert_eq!(v["measured"]["hits"], 16, "{v}");
    assert_eq!(v["measured"]["collisions"], 0, "{v}");
    assert_eq!(v["bit_identical"], true, "{v}");
    let v = memo(2);
    assert!(v["predicted_hits"].as_u64().unwrap() < 16, "{v}");
    assert_eq!(v["measured"]["hits"], v["predicted_hits"], "{v}");
    assert!(v["measured"]["evictions"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["bit_identical"], true, "{v}");
}

#[test]
fn a_replay_shorter_than_its_pool_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_opscope"))
        .args(["memo", "--pool", "8", "--runs", "4", "--onnx", "m", "--tokenizer", "t", "--text", "x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--runs"), "{}", String::from_utf8_lossy(&out.stderr));
}
