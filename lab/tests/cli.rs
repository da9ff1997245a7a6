//! The `opscope` binary as a user runs it: `opscope passes`, `opscope record` with bad input.

use std::os::unix::process::ExitStatusExt;
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
        ["attn (tap)", "capture (tap)", "fakequant (actuation)", "lowrank (actuation)", "matmul (tap)", "online (setting)", "residual (tap)", "route (tap)", "sample (setting)", "skip (actuation)", "smoothquant (actuation)", "sparseattn (actuation)", "staticquant (actuation)"],
        "{text}"
    );
    for opt in ["sites", "roles", "stats", "hist_bins", "hist_range", "elemsig", "topk", "bits", "scope", "weights", "rounding", "range", "clip", "blocks", "mask", "alpha", "table", "window", "sinks", "every", "rank", "force", "energy", "budget"] {
        assert!(text.contains(&format!("    {opt} ")), "option {opt} listed: {text}");
    }
}

/// `opscope passes | head -1`: the reader closes the pipe; the listing ends quietly (exit 0, no
/// panic), as `mine` and `sites` do (Rust ignores SIGPIPE, so a `println!` there panics).
#[test]
fn a_closed_stdout_pipe_ends_the_output_quietly() {
    for _ in 0..3 {
        let mut child = opscope().arg("passes").stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        // Closed before the child writes (its start takes milliseconds): the first write fails.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !err.contains("panicked"), "{:?}: {err}", out.status);
    }
}

/// Misplaced inputs name the fix: an ONNX file given as --gguf, and a recording named without
/// the `.partial` an interrupted record left.
#[test]
fn an_onnx_file_as_gguf_and_a_missing_recording_name_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let onnx = dir.path().join("m.onnx");
    // An ONNX protobuf begins with field 1 (ir_version), byte 0x08.
    std::fs::write(&onnx, [0x08, 0x07, 0x12, 0x04]).unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one entry\n").unwrap();
    let out = opscope().args(["record", "--gguf"]).arg(&onnx).arg("--text").arg(&text).arg("--out").arg(dir.path().join("r.csv")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not a GGUF file") && err.contains("pass it as --onnx"), "{err}");
    let rec = dir.path().join("ci.csv");
    std::fs::write(dir.path().join("ci.csv.partial"), b"").unwrap();
    let out = opscope().arg("mine").arg(&rec).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("ci.csv.partial holds an interrupted one"), "{err}");
    // A CSV recording renamed .parquet; a report into a directory that does not exist.
    let csv = dir.path().join("r.parquet");
    std::fs::write(&csv, format!("{}\n", opscope::recording::header().join(","))).unwrap();
    let out = opscope().arg("mine").arg(&csv).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("a CSV recording") && err.contains("name it .csv"), "{err}");
    let html = dir.path().join("nodir").join("r.html");
    let out = opscope().arg("report").arg(&csv).arg("-o").arg(&html).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("its directory") && err.contains("does not exist") && !err.contains("recording"), "{err}");
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

/// Without a model, `record` and `measure` name both kinds they take (an ONNX encoder or a GGUF
/// decoder), not `--onnx` alone; and refuse both at once.
#[test]
fn a_missing_model_names_onnx_and_gguf() {
    for cmd in ["record", "measure"] {
        let out = opscope().args([cmd, "--tokenizer", "t.json", "--text", "x.txt"]).output().unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && err.contains("--onnx <ONNX>|--gguf <GGUF>"), "{cmd}: {err}");
        let out = opscope().args([cmd, "--onnx", "m.onnx", "--gguf", "m.gguf", "--text", "x.txt"]).output().unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && err.contains("cannot be used with"), "{cmd}: {err}");
    }
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
    for name in ["attn", "fakequant", "matmul", "residual", "route", "skip", "smoothquant", "staticquant"] {
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

/// `opscope record` with the real text and tokenizer and `extra` arguments.
fn record_with(out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    opscope()
        .arg("record")
        .args(a.cli_args())
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn an_output_that_is_an_input_or_not_ours_is_refused() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let before = std::fs::metadata(&a.text).unwrap().len();
    for input in [&a.text, &a.tokenizer] {
        let out = record_with(input, &["--limit", "2"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("this command writes") || err.contains("is also an input"), "{err}");
    }
    assert_eq!(std::fs::metadata(&a.text).unwrap().len(), before, "the corpus is untouched");
    let dir = tempfile::tempdir().unwrap();
    // A name the tool does not write.
    let out = record_with(&dir.path().join("p.txt"), &["--limit", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains(".csv, .csv.gz or .parquet"));
    // An existing file that is not a recording: refused, then written with --force.
    let other = dir.path().join("notes.csv");
    std::fs::write(&other, "my,own,table\n1,2,3\n").unwrap();
    let out = record_with(&other, &["--limit", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not an opscope recording"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "my,own,table\n1,2,3\n");
    let out = record_with(&other, &["--limit", "2", "--force"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Recording again over our own recording is refused (a written recording is never lost),
    // and leaves it as it was; --force replaces it. A report over the recording is refused.
    let kept = std::fs::read(&other).unwrap();
    let out = record_with(&other, &["--limit", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("already holds an opscope recording") && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), kept, "the refused record left the earlier recording alone");
    assert!(record_with(&other, &["--limit", "2", "--force"]).status.success());
    let rep = opscope().arg("report").arg(&other).arg("-o").arg(&other).output().unwrap();
    assert!(!rep.status.success() && String::from_utf8_lossy(&rep.stderr).contains(".html"));
    let html = dir.path().join("r.html");
    std::fs::write(&html, "<html>someone else's page</html>").unwrap();
    let rep = opscope().arg("report").arg(&other).arg("-o").arg(&html).output().unwrap();
    assert!(String::from_utf8_lossy(&rep.stderr).contains("is not an opscope report"));
    let rep = opscope().arg("report").arg(&other).arg("-o").arg(&html).arg("--force").output().unwrap();
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stderr));
    let rep = opscope().arg("report").arg(&other).arg("-o").arg(&html).output().unwrap();
    assert!(rep.status.success(), "our own report is replaced: {}", String::from_utf8_lossy(&rep.stderr));
}

/// `record` of the whole text, a sentence a run (long enough to be signalled mid-way), started
/// from `cmd` (the binary, or a shell that execs it), stderr piped. The child starts with
/// SIGINT, SIGTERM and SIGHUP at their default dispositions, whatever the test process
/// inherited: `record` keeps a signal its caller ignored ignored (as `nohup` asks), and a test
/// run in the background of a non-interactive shell (`.ci/run &`: SIGINT ignored) or under
/// `nohup` (SIGHUP ignored) would otherwise see the record run to its end, unsignalled.
fn spawn_long_record(mut cmd: Command, a: &opscope_lab::model::MiniLmAssets, out: &std::path::Path) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    // SAFETY: `signal` is async-signal-safe, as `pre_exec` requires between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd.args(a.cli_args())
        .args(["--batch", "1", "--seq", "16", "--out"])
        .arg(out)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Wait until `bytes()` reaches `at_least` (a recording's progress on disk).
fn wait_for_bytes(bytes: impl Fn() -> u64, at_least: u64) {
    let start = std::time::Instant::now();
    while bytes() < at_least {
        assert!(start.elapsed().as_secs() < 120, "no progress");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn ctrl_c_during_record_leaves_a_readable_partial_recording() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rec.csv.gz");
    let partial = dir.path().join("rec.csv.gz.partial");
    let mut cmd = opscope();
    cmd.arg("record");
    let child = spawn_long_record(cmd, &a, &out);
    // Wait until some runs are on disk, then interrupt as a terminal's Ctrl-C does.
    wait_for_bytes(|| std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0), 50_000);
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    // Ended by the signal that stopped it (a shell's `$?` reads 130), not by an exit status.
    assert_eq!(res.status.signal(), Some(libc::SIGINT), "{err}");
    assert!(err.contains("SIGINT received"), "{err}");
    assert!(err.contains("interrupted after") && err.contains("rec.csv.gz.partial"), "{err}");
    assert!(!out.exists(), "never renamed into place");
    assert!(!dir.path().join("rec.csv.gz.writing").exists(), "the interrupted recorder released its claim on the path");
    let mined = opscope().arg("mine").arg(&partial).output().unwrap();
    assert!(mined.status.success(), "{}", String::from_utf8_lossy(&mined.stderr));
    let series = opscope::mine::load(&partial).unwrap();
    assert!(series.values().any(|s| s.runs.len() >= 2), "the runs before the interrupt are there");
    // A second record to the same --out would replace the interrupted rows: refused, naming them.
    let before = std::fs::read(&partial).unwrap();
    let again = opscope().arg("record").args(a.cli_args()).args(["--limit", "2", "--out"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("rec.csv.gz.partial is there: an interrupted recording"), "{err}");
    assert_eq!(std::fs::read(&partial).unwrap(), before, "the interrupted recording is left as it was");
}

/// A signal after the handler is installed but before the first batch ran (while the graph
/// compiles) leaves nothing behind: no empty partition or header-only `.partial` standing in
/// the way of the next recording to that path.
#[test]
fn a_signal_before_the_first_run_leaves_nothing_in_the_way() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    for name in ["z.parquet", "z.csv"] {
        let out = dir.path().join(name);
        let child = opscope()
            .arg("record")
            .args(a.cli_args())
            .args(["--limit", "16", "--out"])
            .arg(&out)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // The handler thread is named: signal as soon as it runs (the compile of MiniLM, about
        // 0.2 s, comes before the first batch).
        let installed = || {
            std::fs::read_dir(format!("/proc/{}/task", child.id()))
                .map(|d| d.flatten().any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "opscope-signals")))
                .unwrap_or(false)
        };
        let start = std::time::Instant::now();
        while !installed() {
            assert!(start.elapsed().as_secs() < 120, "no signal handler thread");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
        let res = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.signal(), Some(libc::SIGTERM), "{err}");
        assert!(err.contains("interrupted before any run was recorded: nothing is left"), "{name}: {err}");
        assert!(!out.exists() && !dir.path().join(format!("{name}.partial")).exists(), "{name}: {err}");
        let again = opscope().arg("record").args(a.cli_args()).args(["--limit", "8", "--out"]).arg(&out).output().unwrap();
        assert!(again.status.success(), "{name}: {}", String::from_utf8_lossy(&again.stderr));
    }
}

/// `sweep` stops on SIGTERM as `record` does: before the next site, its CSV recording closed as
/// a readable `.partial`, no ground truth written for the sites it did not record, and the
/// process ends by the signal.
#[test]
fn sigterm_during_sweep_keeps_a_readable_partial_and_writes_no_truth() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep.csv");
    let partial = dir.path().join("sweep.csv.partial");
    // 36 sites a seed: 100 seeds write about 700 MB of CSV in seconds, so a signal sent after
    // the first megabyte lands mid-sweep.
    let child = opscope()
        .args(["sweep", "--seeds", "100", "--out"])
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_bytes(|| std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0), 1_000_000);
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.signal(), Some(libc::SIGTERM), "{err}");
    assert!(err.contains("SIGTERM received") && err.contains("no ground truth was written"), "{err}");
    assert!(!out.exists() && !dir.path().join("sweep.csv.truth.json").exists(), "{err}");
    let series = opscope::mine::load(&partial).unwrap();
    // The sweep's sites in the order it runs them: the first structure's at least are whole.
    let first = opscope_lab::sweep::site_name(opscope_lab::sweep::Planted::ALL[0], opscope_lab::sweep::SHAPES[0], 0);
    let runs = series.iter().find(|(k, _)| k.0.ends_with(&first) && k.1 == "lhs").map(|(_, s)| s.runs.len());
    assert_eq!(runs, Some(opscope_lab::sweep::Planted::ALL[0].steps()), "{err}");
}

/// SIGTERM (what `timeout`, `docker stop`, systemd and Slurm send) stops a Parquet recording
/// as Ctrl-C does: the runs of the open part are closed into a readable part, not lost with it.
#[test]
fn sigterm_during_record_closes_the_open_part() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rec.parquet");
    let mut cmd = opscope();
    cmd.arg("record");
    let child = spawn_long_record(cmd, &a, &out);
    // Wait until the open part (runs not yet closed: 32 a part) has some runs.
    let open = |out: &std::path::Path| -> u64 {
        let Ok(parts) = std::fs::read_dir(out) else { return 0 };
        parts
            .flatten()
            .filter_map(|p| std::fs::read_dir(p.path()).ok())
            .flatten()
            .flatten()
            .filter(|f| f.file_name().to_string_lossy().ends_with(".parquet.partial"))
            .map(|f| f.metadata().map(|m| m.len()).unwrap_or(0))
            .sum()
    };
    wait_for_bytes(|| open(&out), 20_000);
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.signal(), Some(libc::SIGTERM), "{err}");
    assert!(err.contains("SIGTERM received") && err.contains("interrupted after"), "{err}");
    let series = opscope::mine::load(&out).unwrap();
    assert!(series.values().any(|s| s.runs.len() >= 2), "the open part's runs were closed into a readable part");

    // Started with SIGHUP ignored (as `nohup` starts it), a hang-up leaves the recording running.
    let out = dir.path().join("nohup.parquet");
    let mut cmd = Command::new("bash");
    cmd.args(["-c", "trap '' HUP; exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_opscope"), "record"]);
    let mut child = spawn_long_record(cmd, &a, &out);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(Command::new("kill").args(["-HUP", &child.id().to_string()]).status().unwrap().success());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(child.try_wait().unwrap().is_none(), "SIGHUP ignored by the caller stopped the recording");
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));

    // A hang-up the process was not told to ignore stops it as SIGTERM does, and it ends by
    // SIGHUP (a shell's `$?` reads 129).
    let out = dir.path().join("hup.parquet");
    let mut cmd = opscope();
    cmd.arg("record");
    let child = spawn_long_record(cmd, &a, &out);
    wait_for_bytes(|| open(&out), 1);
    assert!(Command::new("kill").args(["-HUP", &child.id().to_string()]).status().unwrap().success());
    let res = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.signal(), Some(libc::SIGHUP), "{err}");
    assert!(err.contains("SIGHUP received") && err.contains("interrupted after"), "{err}");
}

#[test]
fn a_batch_too_large_for_memory_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.csv");
    // A 1 GB budget (RLX's own override): 64 sentences at --seq 64 plan about 2.8 GB.
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let run = |budget: &str| {
        opscope()
            .env("RLX_SOFT_MEMORY_BUDGET_BYTES", budget)
            .arg("record")
            .args(a.cli_args())
            .args(["--batch", "64", "--limit", "64", "--out"])
            .arg(&out)
            .output()
            .unwrap()
    };
    let refused = run("1000000000");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("the largest --batch that fits is"), "{err}");
    let fits: usize = err.rsplit(' ').next().unwrap().trim().parse().unwrap();
    assert!((10..25).contains(&fits), "about 1 GB / 47 MB per sentence: {fits}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing written");
    assert!(run("8000000000").status.success(), "64 sentences fit in 8 GB");
}

#[test]
fn names_as_printed_select_sites_and_a_typo_lists_the_closest() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.csv");
    // The short name `record` and `sites` print selects the site (its full ONNX name is longer).
    let run = record_with(&out, &["--limit", "8", "--pipeline", "matmul{sites=[layer.0/attention/self/query/MatMul],roles=[lhs],stats=[max]}"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let mut reader = csv::Reader::from_path(&out).unwrap();
    let rows: Vec<opscope::Row> = reader.deserialize().collect::<Result<_, _>>().unwrap();
    let sites: std::collections::BTreeSet<String> = rows.iter().map(|r| r.site.to_string()).collect();
    assert_eq!(sites.into_iter().collect::<Vec<_>>(), vec!["model/model.0/auto_model/encoder/layer.0/attention/self/query/MatMul".to_string()]);
    let typo = record_with(&dir.path().join("t.csv"), &["--limit", "8", "--pipeline", "matmul{sites=[layer.0/atention/self/query/*]}"]);
    let err = String::from_utf8_lossy(&typo.stderr);
    assert!(!typo.status.success() && err.contains("closest sites: layer.0/attention/self/query/MatMul"), "{err}");
    // `opscope sites` lists the 24 matmul sites of MiniLM-L3 with the short name first.
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap();
    let listed = opscope().arg("sites").arg("--onnx").arg(&a.onnx).output().unwrap();
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.lines().next().unwrap().starts_with("layer.0/attention/self/query/MatMul\t"), "{text}");
    assert!(text.contains("24 site(s) of 'matmul'"), "{text}");
}

#[test]
fn mine_text_names_sites_short_lists_a_shared_input_once_and_the_rules_that_could_not_run() {
    let dir = tempfile::tempdir().unwrap();
    // Layer 0's Q, K and V projections read one tensor: with every statistic, its verdicts are
    // printed once for the three sites, named without the common prefix, with a rule number.
    let full = dir.path().join("full.csv");
    let run = record_with(&full, &["--limit", "16", "--pipeline", "matmul{sites=[layer.0/attention/self/*],roles=[lhs]}"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let out = opscope().arg("mine").arg(&full).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("common prefix 'model/model.0/auto_model/encoder/layer.0/attention/self/'"), "{text}");
    let merged: Vec<&str> = text.lines().filter(|l| l.contains("{key,query,value}/MatMul")).collect();
    assert!(!merged.is_empty(), "{text}");
    assert!(!text.lines().any(|l| l.contains(" query/MatMul ")), "the shared input is listed once: {text}");
    // Each line's rule number resolves in the legend, with its source.
    let first = merged[0];
    let n = &first[first.find('[').unwrap()..=first.find(']').unwrap()];
    let legend = text.lines().find(|l| l.trim_start().starts_with(n)).unwrap_or_else(|| panic!("{n} not in legend: {text}"));
    assert!(legend.contains("Source: "), "{legend}");
    // Counts print as integers.
    assert!(!text.contains("runs=2.000"), "{text}");

    // Only min and max recorded: the outlier and quantization rules could not run, and the
    // output says which statistics they need instead of "nothing justifies a specialized kernel".
    let thin = dir.path().join("thin.csv");
    let run = record_with(&thin, &["--limit", "16", "--pipeline", "matmul{sites=[layer.0/output/dense/MatMul],roles=[lhs],stats=[min,max]}"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let text = String::from_utf8_lossy(&opscope().arg("mine").arg(&thin).output().unwrap().stdout).to_string();
    assert!(!text.contains("nothing in these sketches justifies"), "{text}");
    assert!(text.contains("rules that could not run:"), "{text}");
    assert!(text.contains("channel_outliers: needs chan_outlier, chan_maxabs at 1 site/role(s)"), "{text}");
    assert!(text.contains("per_token_int8: needs sumsq, row_absmax"), "{text}");
    assert!(!text.contains("note: low rank"), "the low-rank note only where a probe verdict is: {text}");
}

#[test]
fn a_percentile_out_of_range_is_one_error_before_the_recording_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let out = opscope()
        .args(["calibrate", "never-read.csv", "--method", "percentile", "--percentile", "150", "--out"])
        .arg(dir.path().join("t.json"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim(), "opscope: --percentile: percentile must be in [0, 100] (got 150)");
    assert!(!dir.path().join("t.json").exists());
}

/// `measure` flags that apply to `--gguf` only are refused on an ONNX model, before anything is
/// loaded (they used to be accepted and ignored: the full measurement ran), and a missing GGUF
/// says how to fetch it.
#[test]
fn measure_refuses_gguf_only_flags_on_onnx_and_names_a_missing_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one two\n%\nthree four\n").unwrap();
    for flag in ["--no-skip", "--no-w8a8"] {
        let out = opscope().args(["measure", "--onnx", "missing.onnx", "--tokenizer", "missing.json", "--text"]).arg(&text).arg(flag).output().unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && err.contains("apply to --gguf only"), "{flag}: {err}");
    }
    let out = opscope().args(["measure", "--gguf", "missing.gguf", "--text"]).arg(&text).arg("--no-skip").output().unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!out.status.success() && err.contains("fetch-assets.sh") && !err.contains("panicked"), "{err}");
    // The ONNX-only commands say so to a --gguf (they asked for a --tokenizer that --gguf
    // conflicts with).
    for cmd in [&["ab", "--a", "matmul", "--b", ""][..], &["time"][..]] {
        let out = opscope().args(cmd).args(["--gguf", "missing.gguf", "--text"]).arg(&text).output().unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && err.contains("--gguf works with `record`, `measure`, `cost`, `sites` and `blocks` only"), "{cmd:?}: {err}");
    }
}

/// `opscope compare`: MiniLM recorded with the native sketch kernel and with the sketches
/// lowered into RLX ops (what a GPU runs) agrees on every statistic (exit 0, one `ok` line per
/// check); against a recording whose histograms use another range it fails on exactly the
/// histogram checks (exit 1), and a statistic on one side only is a failing check.
#[test]
fn compare_passes_lowered_against_native_and_fails_where_they_differ() {
    let dir = tempfile::tempdir().unwrap();
    let rec = |name: &str, pipeline: &str| {
        let p = dir.path().join(name);
        let out = record_with(&p, &["--limit", "8", "--pipeline", pipeline]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        p
    };
    let native = rec("n.parquet", "matmul{hist_range=-8:8,sites=[*layer.0*]}");
    let lowered = rec("l.parquet", "matmul{hist_range=-8:8,sites=[*layer.0*],lower=true}");
    let other = rec("o.parquet", "matmul{hist_range=-4:4,sites=[*layer.0*]}");
    let cmp = |b: &std::path::Path| opscope().arg("compare").arg(&native).arg(b).output().unwrap();

    let out = cmp(&lowered);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    let checks: Vec<&str> = text.lines().filter(|l| l.starts_with("ok ") || l.starts_with("FAIL")).collect();
    assert!(checks.len() > 100 && checks.iter().all(|l| l.starts_with("ok ")), "{text}");
    assert!(text.ends_with(&format!("{} checks, 0 failed, 0 not computed on one side (skip)\n", checks.len())), "{text}");

    let out = cmp(&other);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{text}");
    let failed: Vec<&str> = text.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(!failed.is_empty(), "{text}");
    // Only the histogram and its range/outside counts depend on the range.
    for l in &failed {
        assert!(l.contains("] hist"), "{l}");
    }

    // The absmax-range histogram has no lowering: the lowered recording's manifest lists it,
    // so those checks are `skip` with the reason, and the comparison passes.
    let native_absmax = rec("na.parquet", "matmul{sites=[*layer.0*]}");
    let lowered_absmax = rec("la.parquet", "matmul{sites=[*layer.0*],lower=true}");
    let out = opscope().arg("compare").arg(&native_absmax).arg(&lowered_absmax).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{text}");
    let skips: Vec<&str> = text.lines().filter(|l| l.starts_with("skip")).collect();
    assert!(!skips.is_empty(), "{text}");
    for l in &skips {
        assert!((l.contains("] hist:") || l.contains("] hist_outside:")) && l.contains("not computed in B: hist"), "{l}");
    }
    assert!(text.lines().filter(|l| l.starts_with("ok ")).count() > 100, "{text}");

    let out = opscope().arg("compare").arg(&native).arg(&lowered).arg("--rtol=-1").output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--rtol -1"));
}

#[test]
fn record_with_online_writes_the_state_beside_the_recording() {
    // 16 entries in batches of 8: two runs, two distinct inputs per activation site.
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.parquet");
    let out = record_with(&rec, &["--limit", "16", "--batch", "8", "--seq", "32", "--pipeline", "online,matmul{stats=[min,max],roles=[lhs]}"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let path = opscope::online::state_path(&rec);
    assert!(String::from_utf8_lossy(&out.stdout).contains(path.to_str().unwrap()), "the path is printed");
    let state = opscope::online::OnlineState::read(&path).unwrap();
    assert!(!dir.path().read_dir().unwrap().flatten().any(|e| e.file_name().to_string_lossy().ends_with(".partial")), "no temp file left");
    // Per activation site: two tensors, two distinct; the sketch's absmax is at least the
    // recorded one (the recorded min/max leave padding rows out, the online state does not).
    let series = opscope::mine::load(&rec).unwrap();
    let mut checked = 0;
    for ((site, role, _), s) in &series {
        let Some(st) = state.sites.get(&format!("{site}/{role}")) else { continue };
        assert_eq!(st.tensors, 2, "{site}");
        assert!((st.distinct() - 2.0).abs() < 0.5, "{site}: {}", st.distinct());
        let recorded = s.runs.iter().flat_map(|r| [r.scalar(opscope::sketch::tensor::MIN), r.scalar(opscope::sketch::tensor::MAX)]).flatten().fold(0f64, |m, v| m.max(v.abs()));
        let q = st.quantiles().unwrap();
        assert!(q.absmax >= recorded && q.p50 <= q.p99 && q.p99 <= q.p999 && q.p999 <= q.absmax, "{site}: {q:?} vs recorded absmax {recorded}");
        checked += 1;
    }
    assert!(checked >= 12, "every activation site has a state: {checked} of {:?}", state.sites.keys());
}

/// A GGUF file passed as --onnx says to pass it as --gguf; a recording with a header and no
/// rows is an error for `mine` (nothing to mine), not "no verdict".
#[test]
fn a_gguf_as_onnx_and_an_empty_recording_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.bin");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00 not a real model").unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one\n").unwrap();
    let tokenizer = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}")).tokenizer;
    let o = opscope().args(["record", "--onnx"]).arg(&gguf).args(["--tokenizer"]).arg(&tokenizer).arg("--text").arg(&text).arg("--out").arg(dir.path().join("r.csv")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("a GGUF file, not ONNX") && err.contains("--gguf"), "{err}");
    // Text that is not UTF-8: the line and byte of the first bad byte.
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"one\ntw\xf6\n").unwrap();
    let o = opscope().args(["record", "--onnx"]).arg(&gguf).args(["--tokenizer"]).arg(&tokenizer).arg("--text").arg(&latin1).arg("--out").arg(dir.path().join("r2.csv")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("byte 6 (line 2) is not valid UTF-8"), "{err}");
    let empty = dir.path().join("empty.csv");
    std::fs::write(&empty, opscope::recording::header().join(",") + "\n").unwrap();
    let o = opscope().arg("mine").arg(&empty).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("nothing to mine") && !err.contains("panicked"), "{err}");
}

/// An actuation asked for one part of RLX's merged Q/K/V GEMM (a single op in the deployed
/// program) stops with the reason, instead of rewriting the key and value projections too;
/// selecting all three parts works. On MiniLM, whose deployed program merges them.
#[test]
fn an_actuation_on_part_of_a_merged_op_is_refused() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let run = |pipeline: &str, out: &str| {
        opscope()
            .args(["record", "--onnx"])
            .arg(&a.onnx)
            .arg("--tokenizer")
            .arg(&a.tokenizer)
            .arg("--text")
            .arg(&a.text)
            .args(["--limit", "2", "--batch", "2", "--seq", "16", "--pipeline", pipeline, "--out"])
            .arg(dir.path().join(out))
            .output()
            .unwrap()
    };
    for pass in ["fakequant{weights=true,sites=[*layer.0/attention/self/query*]}", "smoothquant{sites=[*layer.0/attention/self/key*]}"] {
        let o = run(&format!("{pass},matmul{{stats=[max]}}"), "part.csv");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("merged them into one op") && err.contains("value/MatMul"), "{pass}: {err}");
        assert!(!dir.path().join("part.csv").exists(), "{pass}: a refused pipeline writes no recording");
    }
    let o = run("fakequant{weights=true,sites=[*layer.0/attention/self/*]},matmul{stats=[max]}", "all.csv");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The merged site as `opscope plan` prints it (short part names joined by '+', any order)
    // selects it whole, and so it is rewritten: the manifest lists the actuation.
    let merged = "layer.0/attention/self/key/MatMul+layer.0/attention/self/query/MatMul+layer.0/attention/self/value/MatMul";
    let o = run(&format!("fakequant{{weights=true,sites=[{merged},*layer.1/attention/self/query*]}},matmul{{stats=[max]}}"), "merged.csv");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("layer.1/attention/self/query/MatMul but not"), "layer 1's part alone is still refused: {err}");
    let o = run(&format!("fakequant{{weights=true,sites=[{merged}]}},matmul{{stats=[max]}}"), "merged.csv");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let side = std::fs::read_to_string(dir.path().join("merged.csv.manifest.json")).unwrap();
    assert!(side.contains("fake-quant lhs int8") && side.contains("layer.0/attention/self/query/MatMul+"), "no actuation of the merged site");
}

/// A recording with no row says why: a `sample` stage that skipped every run of the job (the
/// sites were tapped: the manifests list them), not "matched no site"; a pipeline that matches
/// no site is refused before it runs.
#[test]
fn an_empty_recording_says_whether_sampling_or_site_matching_left_it_empty() {
    let dir = tempfile::tempdir().unwrap();
    let sampled = record_with(&dir.path().join("s.parquet"), &["--limit", "8", "--pipeline", "matmul,sample{every=1000}"]);
    let err = String::from_utf8_lossy(&sampled.stderr);
    assert_eq!(sampled.status.code(), Some(1), "{err}");
    assert!(err.contains("tapped 24 site(s) but wrote no run") && err.contains("skipped all 1 run(s)"), "{err}");
    let unmatched = record_with(&dir.path().join("u.parquet"), &["--limit", "8", "--pipeline", "matmul{sites=[no_such_site*]}"]);
    let err = String::from_utf8_lossy(&unmatched.stderr);
    assert!(!unmatched.status.success(), "{err}");
    assert!(err.contains("found no site") && err.contains("closest sites"), "{err}");
}

/// Two `record` runs started together into one new dataset: exactly one records, whichever
/// claims the path first; the other is refused (naming the writer and `--append`) and adds no
/// partition. Before the claim both passed the output check (neither had written a part yet) and
/// both recorded into the dataset, to be mined as one recording. A lock file whose holder is gone
/// is locked again; one a live process holds refuses the path and is left in place.
#[test]
fn two_new_recordings_into_one_path_refuse_the_second() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rec.parquet");
    let spawn = || {
        opscope()
            .arg("record")
            .args(a.cli_args())
            .args(["--limit", "4", "--out"])
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (x, y) = (spawn(), spawn());
    let results = [x.wait_with_output().unwrap(), y.wait_with_output().unwrap()];
    let ok: Vec<bool> = results.iter().map(|r| r.status.success()).collect();
    let errs: Vec<String> = results.iter().map(|r| String::from_utf8_lossy(&r.stderr).to_string()).collect();
    assert_eq!(ok.iter().filter(|&&o| o).count(), 1, "exactly one of two concurrent new recordings records: {errs:?}");
    let refused = &errs[ok.iter().position(|&o| !o).unwrap()];
    assert!(refused.contains("--append") && !refused.contains("panicked"), "{refused}");
    assert_eq!(opscope::recording::partitions(&out).unwrap().len(), 1, "one recording in the dataset");
    let lock = opscope_lab::output::claim_path(&out);
    assert!(!lock.exists(), "the writer removed its lock when it finished");

    // A live writer's lock (held here with flock, as a running `record` holds it) refuses a new
    // path; the holder's lock file is left alone.
    use std::os::unix::io::AsRawFd;
    let fresh = dir.path().join("fresh.parquet");
    std::fs::create_dir(&fresh).unwrap();
    let lock = opscope_lab::output::claim_path(&fresh);
    std::fs::write(&lock, "pid=4242 host=elsewhere\n").unwrap();
    let held = std::fs::File::open(&lock).unwrap();
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let r = record_with(&fresh, &["--limit", "2"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("process 4242 on host 'elsewhere'") && err.contains("--append"), "{err}");
    assert!(lock.exists() && opscope::recording::partitions(&fresh).unwrap().is_empty());

    // The same lock file once its holder is gone (the kernel drops a flock with its process, as
    // after `kill -9`): locked again, recorded, removed.
    drop(held);
    let r = record_with(&fresh, &["--limit", "2"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(!lock.exists());
    assert_eq!(opscope::recording::partitions(&fresh).unwrap().len(), 1);
}

/// `opscope mine --max-runs N`: a series with more runs is mined from N of them and says so
/// (JSON and text), its run count and extremes stay those of every run; a sample too small for
/// the across-run rules is refused before the recording is read.
#[test]
fn mine_max_runs_samples_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv");
    let run = record_with(&rec, &["--limit", "24", "--batch", "2", "--pipeline", "matmul{sites=[layer.0/output/dense/MatMul]}"]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = opscope().arg("mine").arg("--json").args(extra).arg(&rec).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (all, sampled) = (json(&["--max-runs", "all"]), json(&["--max-runs", "5"]));
    assert!(all.get("sampled").is_none());
    assert_eq!(sampled["sampled"]["max_runs"], 5);
    let series = |doc: &serde_json::Value| doc["series"].as_array().unwrap().clone();
    let (a, s) = (series(&all), series(&sampled));
    assert_eq!(a.len(), s.len());
    let mut seen_sampled = 0;
    for (a, s) in a.iter().zip(&s) {
        // Every run's count and extremes, sampled or not.
        for k in ["site", "role", "runs", "min", "max"] {
            assert_eq!(a[k], s[k], "{k}: {a} / {s}");
        }
        assert!(a.get("runs_sampled").is_none());
        if a["runs"] == 12 && a["role"] != "rhs" {
            assert_eq!(s["runs_sampled"], 5, "{s}");
            seen_sampled += 1;
        }
    }
    assert_eq!(seen_sampled, 2, "lhs and out hold 12 runs: {s:?}");
    assert_eq!(sampled["sampled"]["series_sampled"], 2);
    let text = String::from_utf8_lossy(&opscope().args(["mine", "--max-runs", "5"]).arg(&rec).output().unwrap().stdout).to_string();
    assert!(text.contains("2 series hold more than 5 runs of one shape"), "{text}");
    let out = opscope().args(["mine", "--max-runs", "3"]).arg(&rec).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-runs") && err.contains("3"), "{err}");
}

/// `opscope mine` without `--max-runs` reads at most `DEFAULT_MAX_RUNS` (1000) runs per series
/// and shape, so its memory is bounded by default: a series of 1010 runs is mined from 1000 of
/// them and says so, with its run count and extremes over all 1010; `--max-runs all` reads every
/// run. The recording: x[4,16] @ w[16,16] through `opscope::scope`, 1010 runs, inputs scaled per
/// run so that the runs differ.
#[test]
fn mine_samples_past_a_thousand_runs_by_default_and_all_reads_every_run() {
    use rlx_ir::{DType, Graph, Shape};
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv");
    let runs = opscope::mine::DEFAULT_MAX_RUNS + 10;
    let p = opscope::Pipeline::parse("matmul{stats=[min,max,sumsq]}").unwrap();
    opscope::scope(&p, opscope::recording::open(&rec).unwrap(), || {
        let mut g = Graph::new("mm");
        let x = g.input("x", Shape::new(&[4, 16], DType::F32));
        let w = g.param("w", Shape::new(&[16, 16], DType::F32));
        let y = g.matmul(x, w, Shape::new(&[4, 16], DType::F32));
        g.set_outputs(vec![y]);
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g);
        c.set_param("w", &(0..256).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect::<Vec<_>>());
        for r in 0..runs {
            let x: Vec<f32> = (0..64).map(|i| ((i * 13 + r) % 29) as f32 / 29.0 - 0.5).map(|v| v * (1.0 + (r % 5) as f32)).collect();
            std::hint::black_box(c.run(&[("x", &x)]));
        }
    })
    .unwrap();
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = opscope().arg("mine").arg("--json").args(extra).arg(&rec).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (default, all) = (json(&[]), json(&["--max-runs", "all"]));
    assert_eq!(default["sampled"]["max_runs"], 1000, "{}", default["sampled"]);
    assert!(all.get("sampled").is_none());
    let (d, a) = (default["series"].as_array().unwrap(), all["series"].as_array().unwrap());
    assert_eq!(d.len(), a.len());
    let mut sampled = 0;
    for (d, a) in d.iter().zip(a) {
        for k in ["site", "role", "runs", "min", "max"] {
            assert_eq!(d[k], a[k], "{k}: {d} / {a}");
        }
        assert!(a.get("runs_sampled").is_none(), "{a}");
        if a["role"] != "rhs" {
            assert_eq!(a["runs"], runs, "{a}");
            assert_eq!(d["runs_sampled"], 1000, "{d}");
            sampled += 1;
        }
    }
    assert_eq!(sampled, 2, "lhs and out: {d:?}");
    assert_eq!(default["sampled"]["series_sampled"], 2);
    let text = String::from_utf8_lossy(&opscope().arg("mine").arg(&rec).output().unwrap().stdout).to_string();
    assert!(text.contains("2 series hold more than 1000 runs of one shape"), "{text}");
    for bad in ["3", "abc"] {
        let out = opscope().args(["mine", "--max-runs", bad]).arg(&rec).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--max-runs") && err.contains(bad) && err.contains("all"), "{err}");
    }
}

/// `RLX_CACHE_PARAM_INVARIANT=1` (RLX hoisting param-invariant work into a run-once prepare
/// graph) made MiniLM compute on zeros under `run_typed` (every recorded activation of layer 1
/// was 0, the weight sketches came back unfilled and the recorder refused the run): the model
/// jobs compile without hoisting (`model::compile_options`), say so, and record the same rows as
/// without the variable. Fails without that.
#[test]
fn record_with_rlx_hoisting_param_invariant_work_records_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let rows = |hoist: bool| {
        let rec = dir.path().join(format!("h{hoist}.csv"));
        let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = opscope();
        cmd.arg("record").args(a.cli_args()).args(["--limit", "8", "--pipeline", "matmul{sites=[layer.0/*]}", "--out"]).arg(&rec);
        if hoist {
            cmd.env("RLX_CACHE_PARAM_INVARIANT", "1");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "hoist={hoist}: {}", String::from_utf8_lossy(&out.stderr));
        let noted = String::from_utf8_lossy(&out.stderr).contains("RLX_CACHE_PARAM_INVARIANT ignored");
        assert_eq!(noted, hoist, "the note on stderr when the variable is set");
        let mut rows: Vec<(String, String, u64, String, u64, u32)> = csv::Reader::from_path(&rec)
            .unwrap()
            .deserialize::<opscope::Row>()
            .map(|r| r.unwrap())
            .map(|r| (r.site.to_string(), r.role.to_string(), r.step, r.stat.to_string(), r.idx, r.value.to_bits()))
            .collect();
        rows.sort();
        rows
    };
    let (plain, hoisted) = (rows(false), rows(true));
    assert!(plain.iter().any(|r| r.1 == "rhs"), "weights are sketched");
    assert_eq!(plain, hoisted);
}
