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

#[test]
fn a_tap_defined_outside_opscope_records_through_the_environment() {
    // examples/custom_tap/token_absmax.rs defines and registers the pass, its statistic and its
    // probe kernel; neither src/ nor passes/ knows it.
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("absmax.csv");
    let plain = example("custom_tap").output().unwrap();
    let tapped = example("custom_tap").env("RLX_OPSCOPE", "token_absmax").env("RLX_OPSCOPE_OUT", &rec).output().unwrap();
    assert!(tapped.status.success(), "{}", String::from_utf8_lossy(&tapped.stderr));
    assert_eq!(plain.stdout, tapped.stdout, "the caller's outputs are unchanged");

    // Host reference: the example's input and weight patterns, the first layer in f64.
    let (rows, width) = (6usize, 8usize);
    let x = |step: usize, r: usize, c: usize| (((r * 7 + c * 3 + step) % 11) as f64 - 5.0) * (r + 1) as f64 / 4.0;
    let w = |k: usize, n: usize| (((k * width + n) * 5) % 7) as f64 / 7.0 - 0.4;
    let mut want: Vec<(u64, &str, u64, f64)> = Vec::new();
    for step in 0..2 {
        for r in 0..rows {
            let lhs0 = (0..width).map(|c| x(step, r, c).abs()).fold(0.0, f64::max);
            let h = |n: usize| (0..width).map(|k| x(step, r, k) * w(k, n)).sum::<f64>().max(0.0);
            let lhs1 = (0..width).map(h).fold(0.0, f64::max);
            // The unnamed matmuls are named after their weights `fc1.weight`, `fc2.weight`.
            want.push((step as u64, "fc1", r as u64, lhs0));
            want.push((step as u64, "fc2", r as u64, lhs1));
        }
    }
    let mut reader = csv::Reader::from_path(&rec).unwrap();
    let rows_read: Vec<opscope::Row> = reader.deserialize().collect::<Result<_, _>>().unwrap();
    assert_eq!(rows_read.len(), want.len(), "one row per (step, site, token)");
    for (step, site, idx, v) in want {
        let got = rows_read
            .iter()
            .find(|r| r.step == step && &*r.site == site && r.idx == idx)
            .unwrap_or_else(|| panic!("no row for step {step} {site} token {idx}"));
        assert_eq!((&*got.pass, &*got.role, &*got.stat), ("token_absmax", "lhs", "token_absmax"));
        assert!((got.value as f64 - v).abs() <= 1e-5 * v.max(1.0), "step {step} {site} token {idx}: {} vs {v}", got.value);
    }
}

#[test]
fn env_activation_that_records_nothing_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "attn").env("RLX_OPSCOPE_OUT", dir.path().join("a.csv")).output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("recorded no rows") && err.contains("attn"), "{err}");
}
