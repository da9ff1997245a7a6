//! The environment mode as a user runs it: `examples/mlp` (plain RLX code plus
//! `use opscope as _;`) activated by `RLX_OPSCOPE`.

mod common;
use common::example;

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
    // Said on stderr, not left to an empty table (a new user's report).
    let err = String::from_utf8_lossy(&q.stderr);
    assert!(err.contains("RLX_OPSCOPE='fakequant{bits=2}' has no tap pass") && err.contains("q.csv holds no rows"), "{err}");
}

/// `RLX_OPSCOPE_OUT` naming a file that is not a recording stops the program at its first
/// compile and leaves the file as it was; an earlier recording is replaced, said on stderr
/// (plain and gzip CSV).
#[test]
fn env_activation_never_overwrites_a_file_that_is_not_a_recording() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["notes.csv", "notes.csv.gz"] {
        let path = dir.path().join(name);
        std::fs::write(&path, b"my notes\n").unwrap();
        let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &path).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("exists and is not an opscope recording: refusing to overwrite it"), "{err}");
        assert!(out.stdout.is_empty(), "stopped before any output");
        assert_eq!(std::fs::read(&path).unwrap(), b"my notes\n", "{name} left as it was");
    }
    // An interrupted recording's `.partial` at the path is not replaced either; an empty file
    // (a `mktemp`) is, without a note.
    let path = dir.path().join("cut.csv");
    std::fs::write(dir.path().join("cut.csv.partial"), b"rows of an interrupted recording\n").unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cut.csv.partial is there: an interrupted recording"), "{err}");
    assert_eq!(std::fs::read(dir.path().join("cut.csv.partial")).unwrap(), b"rows of an interrupted recording\n");
    // One that holds no row (killed before its first run reached the disk) says so, and that
    // removing it loses nothing.
    std::fs::write(dir.path().join("cut.csv.partial"), b"").unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("holds no row") && err.contains("nothing is lost"), "{err}");
    let path = dir.path().join("empty.csv");
    std::fs::write(&path, b"").unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &path).output().unwrap();
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("opscope"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(opscope::recording::holds_recording(&path));
    for name in ["rec.csv", "rec.csv.gz"] {
        let path = dir.path().join(name);
        let run = || example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &path).output().unwrap();
        let first = run();
        assert!(first.status.success() && !String::from_utf8_lossy(&first.stderr).contains("earlier recording"));
        let again = run();
        assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
        let err = String::from_utf8_lossy(&again.stderr);
        assert!(err.contains("holds an earlier recording; this one replaces it when it is complete"), "{err}");
        assert!(opscope::recording::holds_recording(&path), "{name}");
    }
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
    assert!(!String::from_utf8_lossy(&out.stderr).contains("opscope"), "silent when off");
    // RLX_OPSCOPE_OUT alone (RLX_OPSCOPE forgotten or blank): nothing recorded, said once.
    for pipeline in [None, Some(" ")] {
        let mut cmd = example("mlp");
        cmd.current_dir(dir.path()).env("RLX_OPSCOPE_OUT", dir.path().join("r.csv"));
        if let Some(p) = pipeline {
            cmd.env("RLX_OPSCOPE", p);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.matches("RLX_OPSCOPE_OUT is set but RLX_OPSCOPE is empty or unset").count(), 1, "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file written");
    }
}

/// A misspelt variable is said (a helper's `RLX_OPSCOPE_OUTT=x.csv` wrote
/// `./opscope-recording.csv` in silence), with the name it was closest to; a `.gz` name that is
/// not `.csv.gz` is refused rather than written as gzip CSV.
#[test]
fn a_misspelt_variable_and_a_gz_name_that_is_not_csv_are_said() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("mlp").current_dir(dir.path()).env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUTT", "x.csv").output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("RLX_OPSCOPE_OUTT is not an opscope variable (did you mean RLX_OPSCOPE_OUT?)"), "{err}");
    assert!(!dir.path().join("x.csv").exists());
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", dir.path().join("out.json.gz")).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown recording format: name the file .csv, .csv.gz or .parquet"), "{err}");
    assert!(!dir.path().join("out.json.gz").exists() && !dir.path().join("out.json.gz.partial").exists());
    // A directory of another tool's Parquet files is not a dataset to add a recording to.
    let foreign = dir.path().join("table.parquet");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("part-0.parquet"), b"PAR1").unwrap();
    let out = example("mlp").env("RLX_OPSCOPE", "matmul").env("RLX_OPSCOPE_OUT", &foreign).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("other files than recording=<id> partitions (part-0.parquet)"), "{err}");
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 1, "nothing added");
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
    // A sample setting that leaves out every run the program makes.
    let out = example("mlp").env("RLX_OPSCOPE", "sample{every=1000000},matmul").env("RLX_OPSCOPE_OUT", dir.path().join("s.csv")).output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("recorded none of them") && err.contains("lower N"), "{err}");
}

// ---- examples/run_paths: every run path, the stage, the default path, .csv.gz, fakequant ----

/// The patterns of examples/run_paths.rs, and the graph's values computed on the host in f64.
/// Every value is a small multiple of a power of two (x in quarters, fc1 in eighths, fc2 in
/// quarters), so RLX's f32 results are exact and the comparisons below can be tight.
mod host {
    pub const B: usize = 4;
    pub const K: usize = 8;
    pub const H: usize = 8;
    pub const N: usize = 6;
    pub const STEPS: usize = 2;
    pub fn x(step: usize) -> Vec<f64> {
        (0..B * K).map(|i| ((i * 7 + step * 3) % 17) as f64 / 4.0 - 2.0).collect()
    }
    pub fn w1() -> Vec<f64> {
        (0..K * H).map(|i| ((i * 5 % 13) as f64 - 6.0) / 8.0).collect()
    }
    pub fn b1() -> Vec<f64> {
        (0..H).map(|i| (i as f64 - 3.5) / 4.0).collect()
    }
    pub fn w2() -> Vec<f64> {
        (0..H * N).map(|i| ((i * 3 % 11) as f64 - 5.0) / 4.0).collect()
    }
    pub fn b2() -> Vec<f64> {
        (0..N).map(|i| i as f64 / 8.0 - 0.25).collect()
    }
    /// `a [m, k] @ b [k, n]`, row-major.
    pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        assert_eq!((a.len(), b.len()), (m * k, k * n));
        let mut o = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                o[r * n + c] = (0..k).map(|j| a[r * k + j] * b[j * n + c]).sum();
            }
        }
        o
    }
    pub fn add_bias(a: &[f64], b: &[f64]) -> Vec<f64> {
        a.iter().enumerate().map(|(i, v)| v + b[i % b.len()]).collect()
    }
    pub fn relu(a: &[f64]) -> Vec<f64> {
        a.iter().map(|v| v.max(0.0)).collect()
    }
    /// The tensors of one step: (fc1 lhs, fc1 matmul, fc1 matmul + bias, fc2 lhs, fc2 matmul, y).
    pub struct Step {
        pub x: Vec<f64>,
        pub mm1: Vec<f64>,
        pub pre1: Vec<f64>,
        pub h: Vec<f64>,
        pub mm2: Vec<f64>,
        pub y: Vec<f64>,
    }
    pub fn step(s: usize) -> Step {
        let x = x(s);
        let mm1 = matmul(&x, &w1(), B, K, H);
        let pre1 = add_bias(&mm1, &b1());
        let h = relu(&pre1);
        let mm2 = matmul(&h, &w2(), B, H, N);
        let y = add_bias(&mm2, &b2());
        Step { x, mm1, pre1, h, mm2, y }
    }
}

/// The printed outputs of examples/run_paths: `step s: [v, ...]`, one line per step.
fn printed_outputs(stdout: &[u8]) -> Vec<Vec<f64>> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| {
            let list = l.split_once(": ").expect("`step s: [..]`").1.trim_matches(|c| c == '[' || c == ']');
            list.split(", ").map(|v| v.parse::<f32>().expect("an f32") as f64).collect()
        })
        .collect()
}

/// Rows of a `.csv` or `.csv.gz` recording, decoded with the csv crate (and flate2 for `.gz`),
/// not with opscope's reader.
fn read_csv_rows(path: &std::path::Path) -> Vec<opscope::Row> {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let input: Box<dyn std::io::Read> = if path.to_string_lossy().ends_with(".gz") {
        Box::new(flate2::read::GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    csv::Reader::from_reader(input).deserialize().collect::<Result<_, _>>().unwrap()
}

/// The value of one scalar statistic, exactly one row expected.
fn scalar(rows: &[opscope::Row], step: u64, site: &str, role: &str, stat: &str) -> f64 {
    let hits: Vec<&opscope::Row> =
        rows.iter().filter(|r| r.step == step && &*r.site == site && &*r.role == role && &*r.stat == stat).collect();
    assert_eq!(hits.len(), 1, "step {step} {site}/{role} {stat}: {} rows", hits.len());
    hits[0].value as f64
}

/// Checks min, max, sumsq and count of `tensor` against the recording.
fn assert_sketch(rows: &[opscope::Row], step: u64, site: &str, role: &str, tensor: &[f64]) {
    let min = tensor.iter().copied().fold(f64::INFINITY, f64::min);
    let max = tensor.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sumsq: f64 = tensor.iter().map(|v| v * v).sum();
    for (stat, want, tol) in [
        ("count", tensor.len() as f64, 0.0),
        ("min", min, 0.0),
        ("max", max, 0.0),
        // Written as f32: one rounding of the f64 sum.
        ("sumsq", sumsq, 1e-6 * sumsq.max(1.0)),
    ] {
        let got = scalar(rows, step, site, role, stat);
        assert!((got - want).abs() <= tol, "step {step} {site}/{role} {stat}: recorded {got}, host {want}");
    }
}

const RUN_PATHS: [&str; 5] = ["run", "run_typed", "run_raw", "run_slots", "run_pipelined"];
const SKETCH: &str = "matmul{stats=[min,max,sumsq]}"; // `count` is always recorded

#[test]
fn every_run_path_records_the_deployed_program_and_returns_the_callers_outputs() {
    for path in RUN_PATHS {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join("rec.csv");
        let plain = example("run_paths").arg(path).output().unwrap();
        assert!(plain.status.success(), "{path}: {}", String::from_utf8_lossy(&plain.stderr));
        let tapped = example("run_paths").arg(path).env("RLX_OPSCOPE", SKETCH).env("RLX_OPSCOPE_OUT", &rec).output().unwrap();
        assert!(tapped.status.success(), "{path}: {}", String::from_utf8_lossy(&tapped.stderr));
        assert_eq!(plain.stdout, tapped.stdout, "{path}: the caller's outputs are unchanged");

        // The caller sees exactly its own output (no tap output left over), equal to the host's.
        let outs = printed_outputs(&tapped.stdout);
        assert_eq!(outs.len(), host::STEPS, "{path}: one line per step");
        for (s, y) in outs.iter().enumerate() {
            assert_eq!(y, &host::step(s).y, "{path}: step {s} output");
        }

        let rows = read_csv_rows(&rec);
        let steps: std::collections::BTreeSet<u64> = rows.iter().map(|r| r.step).collect();
        assert_eq!(steps.into_iter().collect::<Vec<_>>(), vec![0, 1], "{path}: every run recorded, once");
        for s in 0..host::STEPS {
            let t = host::step(s);
            let st = s as u64;
            // Deployed: matmul + bias is one fused kernel, whose output is the site's `out`.
            assert_sketch(&rows, st, "fc1", "lhs", &t.x);
            assert_sketch(&rows, st, "fc1", "out", &t.pre1);
            assert_sketch(&rows, st, "fc2", "lhs", &t.h);
            assert_sketch(&rows, st, "fc2", "out", &t.y);
        }
        // The weights are sketched once (hoisted into the prepare graph).
        assert_sketch(&rows, 0, "fc1", "rhs", &host::w1());
        assert_sketch(&rows, 0, "fc2", "rhs", &host::w2());
        for r in &rows {
            assert_eq!(&*r.op, "fused_mm_bias", "{path}: deployed op at {}", r.site);
        }
        assert_eq!(rows.len(), 2 * (2 * 2 * 4 + 4), "{path}: 2 sites x (2 steps x lhs,out + rhs once) x 4 stats");
    }
}

/// A weight written between two runs (`fc1.weight` doubled before step 1, examples/run_paths
/// `set_param`): the caller's outputs are unchanged by the tap, step 1's weight sketch is the
/// doubled weight's and its output the doubled product's (host values), and the weight not
/// written is not recorded again. (On one RLX worker the weight sketch is reused between param
/// writes without reading the weight: `opscope::sketch::epoch`.)
#[test]
fn a_weight_written_between_runs_is_recorded_anew() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv");
    let plain = example("run_paths").arg("set_param").output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let tapped = example("run_paths").arg("set_param").env("RLX_OPSCOPE", SKETCH).env("RLX_OPSCOPE_OUT", &rec).output().unwrap();
    assert!(tapped.status.success(), "{}", String::from_utf8_lossy(&tapped.stderr));
    assert_eq!(plain.stdout, tapped.stdout, "the caller's outputs are unchanged");
    let rows = read_csv_rows(&rec);
    let w1x2: Vec<f64> = host::w1().iter().map(|v| v * 2.0).collect();
    assert_sketch(&rows, 0, "fc1", "rhs", &host::w1());
    assert_sketch(&rows, 1, "fc1", "rhs", &w1x2);
    assert_sketch(&rows, 0, "fc2", "rhs", &host::w2());
    assert!(!rows.iter().any(|r| r.step == 1 && &*r.site == "fc2" && &*r.role == "rhs"), "fc2's weight was not written");
    let pre1 = host::add_bias(&host::matmul(&host::x(1), &w1x2, host::B, host::K, host::H), &host::b1());
    assert_sketch(&rows, 1, "fc1", "out", &pre1);
    let y = printed_outputs(&tapped.stdout);
    assert_ne!(y[0], host::step(1).y, "step 1 differs from an unwritten weight's");
}

#[test]
fn stage_source_records_the_graph_as_built() {
    // RLX_OPSCOPE_STAGE=source taps before fusion: each site is the plain MatMul and its `out`
    // is x @ W without the bias (README, "Which program is observed").
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("src.csv");
    let out = example("run_paths")
        .arg("run")
        .env("RLX_OPSCOPE", SKETCH)
        .env("RLX_OPSCOPE_STAGE", "source")
        .env("RLX_OPSCOPE_OUT", &rec)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows = read_csv_rows(&rec);
    for s in 0..host::STEPS {
        let t = host::step(s);
        let st = s as u64;
        assert_sketch(&rows, st, "fc1", "lhs", &t.x);
        assert_sketch(&rows, st, "fc1", "out", &t.mm1);
        assert_sketch(&rows, st, "fc2", "lhs", &t.h);
        assert_sketch(&rows, st, "fc2", "out", &t.mm2);
    }
    assert!(rows.iter().all(|r| &*r.op == "matmul"), "source ops: {:?}", rows.iter().map(|r| &*r.op).collect::<std::collections::BTreeSet<_>>());
    // Exact data: the outputs are the same as untapped here, and equal to the host's.
    for (s, y) in printed_outputs(&out.stdout).iter().enumerate() {
        assert_eq!(y, &host::step(s).y, "step {s} output");
    }

    // A bad stage stops the program at its first compile.
    let bad = example("run_paths").env("RLX_OPSCOPE", SKETCH).env("RLX_OPSCOPE_STAGE", "fused").env("RLX_OPSCOPE_OUT", dir.path().join("b.csv")).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("RLX_OPSCOPE_STAGE: unknown stage 'fused'"), "{err}");
}

#[test]
fn default_output_is_opscope_recording_csv_in_the_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = example("run_paths").current_dir(dir.path()).env("RLX_OPSCOPE", SKETCH).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let names: std::collections::BTreeSet<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let want: std::collections::BTreeSet<String> =
        ["opscope-recording.csv", "opscope-recording.csv.manifest.json"].iter().map(|s| s.to_string()).collect();
    assert_eq!(names, want);
    let rows = read_csv_rows(&dir.path().join("opscope-recording.csv"));
    assert_sketch(&rows, 1, "fc2", "out", &host::step(1).y);
}

#[test]
fn csv_gz_output_is_gzip_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv.gz");
    let out = example("run_paths").arg("run_slots").env("RLX_OPSCOPE", SKETCH).env("RLX_OPSCOPE_OUT", &rec).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&rec).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzip magic (RFC 1952)");
    let rows = read_csv_rows(&rec);
    assert_eq!(rows.len(), 2 * (2 * 2 * 4 + 4));
    for s in 0..host::STEPS {
        let t = host::step(s);
        assert_sketch(&rows, s as u64, "fc1", "out", &t.pre1);
        assert_sketch(&rows, s as u64, "fc2", "lhs", &t.h);
    }
    // opscope's own reader agrees row for row.
    let mut n = 0;
    opscope::recording::read_rows(&rec, |r| {
        let w = &rows[n];
        assert_eq!((r.site, r.role, r.stat, r.step, r.value), (&*w.site, &*w.role, &*w.stat, w.step, w.value));
        n += 1;
    })
    .unwrap();
    assert_eq!(n, rows.len());
}

/// Host fake-quantization of a `[rows, cols]` tensor per row (fakequant's `scope=token`,
/// narrow range, ties to even), in f32 op by op as passes/fakequant documents it.
fn fake_quant_rows(x: &[f64], cols: usize, bits: u32) -> Vec<f64> {
    let q = (2f32.powi(bits as i32 - 1)) - 1.0;
    x.chunks(cols)
        .flat_map(|row| {
            let row: Vec<f32> = row.iter().map(|&v| v as f32).collect();
            let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = absmax / q;
            let s = if s > 0.0 { s } else { 1.0 };
            row.into_iter().map(move |v| ((v / s).round_ties_even().clamp(-q, q) * s) as f64).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn fakequant_in_the_environment_computes_the_host_fake_quantized_model() {
    let dir = tempfile::tempdir().unwrap();
    // Through the tapping backend (RLX_OPSCOPE) and through RLX's own IR-pass registry
    // (RLX_OPSCOPE_IR: nothing but RLX compiles the program).
    for (path, var) in [("run", "RLX_OPSCOPE"), ("run_slots", "RLX_OPSCOPE"), ("run", "RLX_OPSCOPE_IR"), ("run_slots", "RLX_OPSCOPE_IR")] {
        let out = example("run_paths")
            .arg(path)
            .env(var, "fakequant{bits=3}")
            .env("RLX_OPSCOPE_OUT", dir.path().join(format!("{path}.csv")))
            .output()
            .unwrap();
        assert!(out.status.success(), "{path}: {}", String::from_utf8_lossy(&out.stderr));
        let outs = printed_outputs(&out.stdout);
        assert_eq!(outs.len(), host::STEPS);
        let mut changed = false;
        for (s, got) in outs.iter().enumerate() {
            // Both matmuls' activations fake-quantized per token to 3 bits (Q = 3); weights kept.
            let xq = fake_quant_rows(&host::x(s), host::K, 3);
            let h = host::relu(&host::add_bias(&host::matmul(&xq, &host::w1(), host::B, host::K, host::H), &host::b1()));
            let hq = fake_quant_rows(&h, host::H, 3);
            let want = host::add_bias(&host::matmul(&hq, &host::w2(), host::B, host::H, host::N), &host::b2());
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                // f32 kernels against f64 sums of the same f32 codes: a few ulps.
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{path}: step {s} y[{i}]: rlx {a}, host {b}");
            }
            changed |= got != &host::step(s).y;
        }
        assert!(changed, "{path} {var}: 3-bit activations change the outputs");
    }
}

// ---- examples/env_override: RLX's code-side settings (rlx_ir::env::scoped) ----

#[test]
fn rlx_env_scoped_in_code_turns_opscope_on_at_the_first_compile() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("scoped.csv");
    // Nothing in the process environment: the example sets the variables in code.
    let out = example("env_override").env_remove("RLX_OPSCOPE").env_remove("RLX_OPSCOPE_OUT").arg(&rec).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = printed_outputs(&out.stdout);
    assert_eq!(printed.len(), 2, "two steps printed");
    let rows = read_csv_rows(&rec);
    let sites: std::collections::BTreeSet<&str> = rows.iter().map(|r| &*r.site).collect();
    assert_eq!(sites.len(), 1, "one matmul site: {sites:?}");
    let site = *sites.iter().next().unwrap();
    // The site's output is the fused matmul+bias+gelu kernel's, which is what the program printed.
    for (step, y) in printed.iter().enumerate() {
        assert_sketch(&rows, step as u64, site, "out", y);
    }

    // Set only after the first compile: the decision was already taken, nothing is recorded.
    let late = dir.path().join("late.csv");
    let out = example("env_override").env_remove("RLX_OPSCOPE").arg(&late).arg("--late").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(printed_outputs(&out.stdout), printed, "same outputs");
    assert!(!late.exists(), "nothing recorded when set after the first compile");
}

#[test]
fn rlx_opscope_ir_refuses_a_tap_and_a_bad_pipeline_at_the_first_compile() {
    for (text, want) in [("matmul", "holds a tap"), ("fakequant{bits=99}", "RLX_OPSCOPE_IR")] {
        let out = example("run_paths").arg("run").env("RLX_OPSCOPE_IR", text).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{text}: {err}");
    }
}

/// In the environment mode, an actuation that changed no site of the program's graphs is said
/// on stderr at exit (examples/mlp has no attention: `sparseattn` finds no site and the program
/// runs unchanged, byte-identical stdout); one that changed the program (`fakequant` on mlp's
/// matmuls) is not.
#[test]
fn env_activation_says_an_actuation_that_changed_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let plain = example("mlp").output().unwrap();
    let idle = example("mlp").env("RLX_OPSCOPE", "sparseattn{topk=3}").env("RLX_OPSCOPE_OUT", dir.path().join("s.csv")).output().unwrap();
    assert!(idle.status.success(), "{}", String::from_utf8_lossy(&idle.stderr));
    assert_eq!(plain.stdout, idle.stdout, "no attention in mlp: the program ran unchanged");
    let err = String::from_utf8_lossy(&idle.stderr);
    assert!(
        err.contains("the actuation 'sparseattn{topk=3}' (pass 0) changed nothing in the 1 graph(s) compiled") && err.contains("it found no site"),
        "{err}"
    );
    let q = example("mlp").env("RLX_OPSCOPE", "fakequant{bits=2}").env("RLX_OPSCOPE_OUT", dir.path().join("q.csv")).output().unwrap();
    assert!(q.status.success());
    assert_ne!(plain.stdout, q.stdout, "fakequant changed the program");
    assert!(!String::from_utf8_lossy(&q.stderr).contains("changed nothing"), "{}", String::from_utf8_lossy(&q.stderr));
}

/// The environment mode in a program whose only compile is inside a scope: the scope's tap takes
/// the compile (its graph reaches the environment's backend wrapper already tapped, and the
/// environment recorder registers no compile). At exit the environment says nothing about its
/// actuation having "changed nothing in the 0 graph(s) compiled". The test runs itself again as
/// a child process with `RLX_OPSCOPE` set (read once per process) and reads the child's stderr.
#[test]
fn env_mode_with_every_compile_in_a_scope_reports_no_idle_actuation() {
    use common::{matmul_2d, randn};
    use opscope::{MemorySink, Pipeline, Scope};
    use rlx_runtime::{Device, Session};
    const CHILD: &str = "OPSCOPE_TEST_ENV_SCOPE_ONLY_CHILD";
    if std::env::var_os(CHILD).is_some() {
        // The child: one compile and run, inside a scope with a tap.
        let p = Pipeline::parse("matmul{stats=[max]}").unwrap();
        let sink = MemorySink::default();
        let (_, res) = Scope::new(&p, Box::new(sink.clone())).run(|| {
            let mut c = Session::new(Device::Cpu).compile(matmul_2d(4, 6, 3));
            c.set_param("w", &randn(18, 1));
            c.run(&[("x", &randn(24, 2))])
        });
        assert_eq!(res.unwrap().compiles, 1, "the scope took the compile");
        assert!(!sink.rows().is_empty(), "the scope recorded");
        opscope::activate::env::finish().unwrap();
        eprintln!("child: finished");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "env_mode_with_every_compile_in_a_scope_reports_no_idle_actuation", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RLX_OPSCOPE", "fakequant{bits=4}")
        .env("RLX_OPSCOPE_OUT", dir.path().join("env.csv"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("child: finished"), "{err}");
    // The environment was on (its pipeline was parsed at the compile: the note on its missing
    // tap says so) ...
    assert!(err.contains("RLX_OPSCOPE='fakequant{bits=4}' has no tap pass"), "{err}");
    // ... and registered no compile of its own: no claim about graphs it never rewrote.
    assert!(!err.contains("changed nothing"), "{err}");
}
