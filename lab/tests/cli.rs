//! The `opscope` binary as a user runs it: `opscope passes`, `opscope record` with bad input.

use std::process::Command;

fn opscope() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

#[test]
fn passes_lists_every_pass_with_kind_and_options() {
    let out = opscope().arg("passes").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let heads: Vec<String> = text.lines().filter(|l| !l.starts_with(' ')).map(|l| l.split("  ").take(2).collect::<Vec<_>>().join(" ")).collect();
    assert_eq!(
        heads,
        ["attn (tap)", "fakequant (actuation)", "matmul (tap)", "residual (tap)", "route (tap)", "skip (actuation)"],
        "{text}"
    );
    for opt in ["sites", "roles", "stats", "hist_bins", "hist_range", "elemsig", "topk", "bits", "scope", "weights", "rounding", "range", "clip", "blocks", "mask"] {
        assert!(text.contains(&format!("    {opt} ")), "option {opt} listed: {text}");
    }
}

#[test]
fn record_refuses_a_pipeline_without_a_tap() {
    let out = opscope()
        .args(["record", "--onnx", "m.onnx", "--tokenizer", "t.json", "--text", "x.txt", "--out", "r.csv"])
        .args(["--pipeline", "skip{blocks=[2]}"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("has no tap") && err.contains("skip{blocks=[2]},residual"), "{err}");
}

#[test]
fn record_with_bogus_pipeline_fails_listing_the_passes() {
    let out = opscope()
        .args(["record", "--onnx", "m.onnx", "--tokenizer", "t.json", "--text", "x.txt", "--out", "r.csv"])
        .args(["--pipeline", "bogus"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("unknown pass 'bogus'") && err.contains("known passes (closest first): "), "{err}");
    for name in ["attn", "fakequant", "matmul", "residual", "route", "skip"] {
        assert!(err.contains(name), "{name} listed: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_failed_record_leaves_an_earlier_recording_alone() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("r.csv");
    std::fs::write(&rec, "earlier recording").unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one\n%\ntwo\n").unwrap();
    let out = opscope()
        .args(["record", "--onnx", "missing.onnx", "--tokenizer", "missing.json", "--text"])
        .arg(&text)
        .arg("--out")
        .arg(&rec)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(std::fs::read_to_string(&rec).unwrap(), "earlier recording");
    assert!(!dir.path().join("r.csv.partial").exists() && !dir.path().join("r.csv.manifest.json").exists());
}

#[test]
fn record_with_missing_model_says_how_to_fetch_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one\n%\ntwo\n").unwrap();
    let out = opscope()
        .args(["record", "--onnx", "missing.onnx", "--tokenizer", "missing.json", "--text"])
        .arg(&text)
        .args(["--out"])
        .arg(dir.path().join("r.csv"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("missing.json"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
