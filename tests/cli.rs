//! The binaries as a user runs them: `opscope passes`, `opscope record` with a bad pipeline,
//! and `examples/mlp` activated from the environment.

use std::path::PathBuf;
use std::process::Command;

fn opscope() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

/// `cargo test` builds the examples next to the binaries' `deps` folder.
fn example(name: &str) -> Command {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_opscope"));
    let path = bin.parent().unwrap().join("examples").join(name);
    assert!(path.is_file(), "{} not built", path.display());
    let mut c = Command::new(path);
    c.env_remove("RLX_OPSCOPE").env_remove("RLX_OPSCOPE_OUT").env_remove("RLX_OPSCOPE_STAGE");
    c
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
fn env_activation_runs_an_actuation_on_unchanged_code() {
    // fakequant alone in the environment: the program computes with 2-bit activations (its
    // printed outputs change) and nothing is recorded.
    let dir = tempfile::tempdir().unwrap();
    let plain = example("mlp").output().unwrap();
    let q = example("mlp").env("RLX_OPSCOPE", "fakequant{bits=2}").env("RLX_OPSCOPE_OUT", dir.path().join("q.csv")).output().unwrap();
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert_ne!(plain.stdout, q.stdout, "the actuation reached the program");
    let lines = |o: &[u8]| String::from_utf8_lossy(o).lines().count();
    assert_eq!(lines(&plain.stdout), lines(&q.stdout), "outputs keep their count");
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

#[test]
fn env_activation_records_and_leaves_stdout_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("mlp.csv");
    let plain = example("mlp").output().unwrap();
    assert!(plain.status.success());
    let tapped = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &rec).output().unwrap();
    assert!(tapped.status.success(), "{}", String::from_utf8_lossy(&tapped.stderr));
    assert_eq!(plain.stdout, tapped.stdout, "stdout is byte-identical with RLX_OPSCOPE");
    assert!(!plain.stdout.is_empty());

    let mut r = csv::Reader::from_path(&rec).unwrap();
    let rows: Vec<opscope::Row> = r.deserialize().collect::<Result<_, _>>().unwrap();
    // 3 fused matmul sites: lhs and out on each of 3 runs, the weight (rhs) once.
    let counts = rows.iter().filter(|r| &*r.stat == "count").count();
    assert_eq!(counts, 3 * (2 * 3 + 1), "count rows");
    assert_eq!(rows.iter().map(|r| r.step).max(), Some(2));
    let sidecar = opscope::sink::sidecar_path(&rec);
    let side: opscope::sink::Sidecar = serde_json::from_slice(&std::fs::read(sidecar).unwrap()).unwrap();
    assert_eq!(side.graphs.len(), 1);
    assert_eq!(side.graphs[0].pipeline, "matmul");
    assert!(!dir.path().join("mlp.csv.partial").exists(), "renamed into place");
}

#[test]
fn env_activation_with_bad_pipeline_stops_at_first_compile() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("mlp")
        .env("RLX_OPSCOPE", "matmul{hist_bin=4}")
        .env("RLX_OPSCOPE_OUT", dir.path().join("x.csv"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("RLX_OPSCOPE: bad opscope pipeline: unknown option 'hist_bin' of pass 'matmul'"), "{err}");
    assert!(err.contains("hist_bins"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty(), "stopped before any output");
}

#[test]
fn env_activation_with_a_directory_as_output_stops_at_first_compile() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("RLX_OPSCOPE_OUT: recording") && err.contains("is a directory"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left behind");
}

#[test]
fn without_the_variable_nothing_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("mlp").current_dir(dir.path()).output().unwrap();
    assert!(out.status.success());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file written");
}
