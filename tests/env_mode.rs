//! The environment mode as a user runs it: `examples/mlp` (plain RLX code plus
//! `use opscope as _;`) activated by `RLX_OPSCOPE`.

use std::path::PathBuf;
use std::process::Command;

/// `cargo test` builds the examples in `<target>/<profile>/examples`, beside the `deps` folder
/// this test runs from.
fn example(name: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let path: PathBuf = exe.parent().unwrap().parent().unwrap().join("examples").join(name);
    assert!(path.is_file(), "{} not built (cargo test builds the examples)", path.display());
    let mut c = Command::new(path);
    c.env_remove("RLX_OPSCOPE").env_remove("RLX_OPSCOPE_OUT").env_remove("RLX_OPSCOPE_STAGE");
    c
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
    let sidecar = opscope::recording::sidecar_path(&rec);
    let side: opscope::recording::Sidecar = serde_json::from_slice(&std::fs::read(sidecar).unwrap()).unwrap();
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
