//! Parquet dataset recordings survive and scale: a `kill -9` mid-recording and a file-size limit
//! (`ulimit -f`) leave every closed part readable with the rows its footer declares; a part
//! without its footer says why; two processes writing into one dataset are mined together, and
//! DuckDB (an independent reader, through `read_parquet(.., hive_partitioning=true)`) computes
//! the same per-series aggregates as `opscope mine --json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn opscope() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

fn assets() -> (PathBuf, PathBuf, PathBuf) {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    (a.onnx, a.tokenizer, a.text)
}

/// The fortunes of the cached text, in order (entries are separated by lines holding `%`).
fn fortunes() -> Vec<String> {
    let (_, _, text) = assets();
    let all = std::fs::read_to_string(text).unwrap();
    all.split("\n%\n").filter(|e| !e.trim().is_empty()).map(str::to_string).collect()
}

/// `opscope record` on MiniLM, `--out out`, the text file given.
fn record(out: &Path, text: &Path, batch: u32, limit: u64) -> Command {
    let (onnx, tok, _) = assets();
    let mut c = opscope();
    c.arg("record").arg("--onnx").arg(onnx).arg("--tokenizer").arg(tok).arg("--text").arg(text);
    c.args(["--batch", &batch.to_string(), "--seq", "32", "--limit", &limit.to_string(), "--append", "--out"]).arg(out);
    c
}

/// Closed parts (`part-*.parquet`) under `root`, by path.
fn closed_parts(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                stack.push(p);
            } else if name.starts_with("part-") && name.ends_with(".parquet") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Rows a part's footer declares (the parquet crate's metadata, not opscope's reader).
fn footer_rows(part: &Path) -> i64 {
    use parquet::file::reader::FileReader;
    let r = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(part).unwrap())
        .unwrap_or_else(|e| panic!("{} is not a closed Parquet file: {e}", part.display()));
    r.metadata().file_metadata().num_rows()
}

/// Rows opscope reads from a part, and the distinct (compile, step) runs in it.
fn read_part(part: &Path) -> (i64, Vec<(u32, u64)>) {
    let mut n = 0i64;
    let mut runs = Vec::new();
    opscope::recording::read_rows(part, |r| {
        n += 1;
        if !runs.contains(&(r.compile, r.step)) {
            runs.push((r.compile, r.step));
        }
    })
    .unwrap_or_else(|e| panic!("{}: {e}", part.display()));
    (n, runs)
}

/// Rows pyarrow reads from each file (it decodes every row group).
fn pyarrow_rows(parts: &[PathBuf]) -> Vec<i64> {
    let code = "import sys, pyarrow.parquet as pq\nfor p in sys.argv[1:]: print(pq.read_table(p).num_rows)";
    let out = Command::new("python3").args(["-c", code]).args(parts).output().expect("python3 runs");
    assert!(out.status.success(), "pyarrow (pip install -r scripts/requirements-test.txt): {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect()
}

/// MiniLM's weights: the rhs of every matmul but the two attention products (`self/MatMul`,
/// `self/MatMul_1`, whose operands are activations).
fn is_weight(site: &str, role: &str) -> bool {
    role == "rhs" && !site.contains("/self/MatMul")
}

fn mine_json(dataset: &Path) -> Value {
    let out = opscope().args(["mine", "--json"]).arg(dataset).output().unwrap();
    assert!(out.status.success(), "mine: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn kill_9_mid_recording_leaves_every_closed_part_readable() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rec.parquet");
    let (_, _, text) = assets();
    // One run (2 sentences) per part, 200 runs: far longer than the wait below.
    let mut child = record(&out, &text, 2, 400)
        .env("RLX_OPSCOPE_PART_RUNS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while closed_parts(&out).len() < 3 {
        assert!(child.try_wait().unwrap().is_none(), "the recording ended before it was killed");
        assert!(start.elapsed() < Duration::from_secs(240), "no 3 closed parts after 240 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL: no handler, no flush, no footer
    let status = child.wait().unwrap();
    assert!(!status.success(), "{status:?}");

    let parts = closed_parts(&out);
    assert!(parts.len() >= 3 && parts.len() < 200, "{}", parts.len());
    let by_pyarrow = pyarrow_rows(&parts);
    let mut steps = Vec::new();
    for (part, py) in parts.iter().zip(&by_pyarrow) {
        let declared = footer_rows(part);
        let (read, runs) = read_part(part);
        assert!(declared > 0 && read == declared && *py == declared, "{}: footer {declared}, opscope {read}, pyarrow {py}", part.display());
        assert_eq!(runs.len(), 1, "{}: one whole run per part: {runs:?}", part.display());
        steps.push(runs[0]);
    }
    // The parts hold runs 0, 1, 2, ... of compile 1, none lost or torn before the open one.
    let want: Vec<(u32, u64)> = (0..parts.len() as u64).map(|s| (1, s)).collect();
    assert_eq!(steps, want);
    // Part 0 also holds the weights' sketches (written once, only in the first run).
    let weights = |p: &Path| {
        let mut n = 0;
        opscope::recording::read_rows(p, |r| n += usize::from(is_weight(r.site, r.role))).unwrap();
        n
    };
    assert!(weights(&parts[0]) > 0 && parts[1..].iter().all(|p| weights(p) == 0));

    // The dataset mines as a whole: every activation series has one run per closed part.
    let doc = mine_json(&out);
    let series = doc["series"].as_array().unwrap();
    let outs: Vec<u64> = series.iter().filter(|s| s["role"] == "out").map(|s| s["runs"].as_u64().unwrap()).collect();
    assert!(!outs.is_empty() && outs.iter().all(|&r| r == parts.len() as u64), "{outs:?} vs {} parts", parts.len());
    assert_eq!(doc["no_data"], serde_json::json!([]), "the sidecar lists the compile of every closed part");
}

#[test]
fn a_part_without_its_footer_says_the_process_was_killed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep.parquet");
    let st = opscope().args(["sweep", "--seeds", "1", "--out"]).arg(&out).env("RLX_OPSCOPE_PART_RUNS", "4").stdout(Stdio::null()).status().unwrap();
    assert!(st.success());
    let parts = closed_parts(&out);
    assert!(parts.len() >= 3, "{}", parts.len());
    let whole = opscope::mine::load(&out).unwrap();
    // What a killed writer leaves: the part's bytes up to some row group, no footer.
    let bytes = std::fs::read(&parts[1]).unwrap();
    let torn = dir.path().join("torn.parquet");
    std::fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
    let err = opscope::mine::load(&torn).err().expect("a torn part is an error").to_string();
    assert!(err.contains("no Parquet footer") && err.contains("killed") && err.contains("torn.parquet"), "{err}");
    let cli = opscope().arg("mine").arg(&torn).output().unwrap();
    let stderr = String::from_utf8_lossy(&cli.stderr);
    assert!(!cli.status.success() && stderr.contains("no Parquet footer") && !stderr.contains("panicked"), "{stderr}");

    // In the dataset, a torn open part is skipped with a note; the closed parts are all read.
    let partition = parts[0].parent().unwrap();
    std::fs::write(partition.join("_part-00099.parquet.partial"), &bytes[..bytes.len() / 2]).unwrap();
    let again = opscope::mine::load(&out).unwrap();
    assert_eq!(again.len(), whole.len());
    let runs = |m: &BTreeMap<_, opscope::mine::Series>| m.values().map(|s| s.runs.len()).sum::<usize>();
    assert_eq!(runs(&again), runs(&whole));
    let cli = opscope().arg("mine").arg(&out).output().unwrap();
    let stderr = String::from_utf8_lossy(&cli.stderr);
    assert!(cli.status.success() && stderr.contains("skipped 1 open part(s)"), "{stderr}");

    // A closed part cut after it was closed (an interrupted copy): an error naming the part and
    // the fix (move it out), not the killed-writer advice to read the directory being read.
    // Its length no longer matches the checksum its sidecar recorded.
    std::fs::write(&parts[1], &bytes[..bytes.len() / 2]).unwrap();
    let err = opscope::mine::load(&out).err().expect("a damaged closed part is an error").to_string();
    let cut = format!("holds {} bytes, and held {}", bytes.len() / 2, bytes.len());
    assert!(err.contains(&cut) && err.contains("move it out of the dataset") && err.contains(&*parts[1].to_string_lossy()), "{err}");
    // Without its checksum (a dataset written before them), the missing footer says the same.
    let side = partition.join("_manifest.json");
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    doc.as_object_mut().unwrap().remove("parts");
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    let err = opscope::mine::load(&out).err().expect("a damaged closed part is an error").to_string();
    assert!(err.contains("closed part") && err.contains("Move it out") && err.contains(&*parts[1].to_string_lossy()), "{err}");
}

#[test]
fn a_file_size_limit_is_a_clear_error_and_keeps_the_closed_parts() {
    let dir = tempfile::tempdir().unwrap();
    let (full, limited) = (dir.path().join("full.parquet"), dir.path().join("limited.parquet"));
    let sweep = |out: &Path, ulimit: Option<u32>| {
        let bin = env!("CARGO_BIN_EXE_opscope");
        let limit = ulimit.map(|n| format!("ulimit -f {n}; ")).unwrap_or_default();
        let script = format!("{limit}exec \"$0\" sweep --seeds 1 --out \"$1\"");
        Command::new("bash").args(["-c", &script, bin]).arg(out).env("RLX_OPSCOPE_PART_RUNS", "1").output().unwrap()
    };
    let ok = sweep(&full, None);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // 10 KiB per file: every part (5-8.2 KB) and every file of manifests (3 KB: one compile,
    // each sweep run is its own) fits; `_manifest.json`, which lists every part and manifest
    // file (about 200 bytes each), outgrows it after about 50 of the sweep's 66 parts.
    let out = sweep(&limited, Some(10));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the write failure is an error: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("File too large") && stderr.contains("ulimit -f") && stderr.contains("are intact and readable"),
        "names the cause and what survives: {stderr}"
    );
    let (a, b) = (closed_parts(&full), closed_parts(&limited));
    assert!(b.len() >= 2 && b.len() < a.len(), "{} closed parts of {}", b.len(), a.len());
    // Every closed part is whole: the rows of the unlimited recording's part of the same index.
    let values = |p: &Path| {
        let mut v = Vec::new();
        opscope::recording::read_rows(p, |r| v.push((r.site.to_string(), r.role.to_string(), r.stat.to_string(), r.idx, r.value.to_bits())))
            .unwrap();
        v
    };
    for (pa, pb) in a.iter().zip(&b) {
        assert_eq!(footer_rows(pb), footer_rows(pa), "{}", pb.display());
        assert_eq!(values(pb), values(pa), "{}", pb.display());
    }
    // And the truncated dataset mines.
    let series = opscope::mine::load(&limited).unwrap();
    assert!(!series.is_empty());
    // A CSV recording past the limit: the same cause named, and its flushed runs readable at
    // .partial.
    let csv = dir.path().join("limited.csv");
    let out = sweep(&csv, Some(1024));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("File too large") && stderr.contains("ulimit -f") && stderr.contains("limited.csv.partial"), "{stderr}");
    assert!(!opscope::mine::load(&dir.path().join("limited.csv.partial")).unwrap().is_empty());
}

#[test]
fn two_processes_write_one_dataset_and_duckdb_agrees_with_mine() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shared.parquet");
    // Two disjoint texts: 16 and 24 fortunes (2 and 3 batches of 8).
    let all = fortunes();
    let entries: Vec<&str> = all.iter().map(String::as_str).collect();
    assert!(entries.len() >= 40);
    let (ta, tb) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
    std::fs::write(&ta, entries[..16].join("\n%\n")).unwrap();
    std::fs::write(&tb, entries[16..40].join("\n%\n")).unwrap();
    let mut a = record(&out, &ta, 8, 16).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut b = record(&out, &tb, 8, 24).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    for c in [&mut a, &mut b] {
        let st = c.wait().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(c.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(st.success(), "{err}");
    }
    let partitions = opscope::recording::partitions(&out).unwrap();
    assert_eq!(partitions.len(), 2, "{partitions:?}");

    let doc = mine_json(&out);
    assert_eq!(doc["no_data"], serde_json::json!([]));
    let mined: BTreeMap<(String, String, u64), (u64, f64, f64)> = doc["series"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let key = (s["site"].as_str().unwrap().to_string(), s["role"].as_str().unwrap().to_string(), s["pass_idx"].as_u64().unwrap());
            (key, (s["runs"].as_u64().unwrap(), s["min"].as_f64().unwrap(), s["max"].as_f64().unwrap()))
        })
        .collect();
    // Activations ran 2 + 3 times; each weight was sketched once per process.
    for ((site, role, _), (runs, _, _)) in &mined {
        let want = if is_weight(site, role) { 2 } else { 5 };
        assert_eq!(*runs, want, "{site}/{role}");
    }

    // The README's SQL, run by DuckDB over the same directory.
    let sql = r#"
import sys, json, duckdb
rows = duckdb.sql(f"""
  SELECT site, role, pass_idx,
         count(DISTINCT (recording, compile, step)) AS runs,
         min(value) FILTER (WHERE stat = 'min')     AS min,
         max(value) FILTER (WHERE stat = 'max')     AS max
  FROM read_parquet('{sys.argv[1]}/**/*.parquet', hive_partitioning = true)
  GROUP BY site, role, pass_idx
""").fetchall()
print(json.dumps([[s, r, p, n, float(lo), float(hi)] for s, r, p, n, lo, hi in rows]))
"#;
    let py = Command::new("python3").args(["-c", sql]).arg(&out).output().expect("python3 runs");
    assert!(py.status.success(), "duckdb (pip install -r scripts/requirements-test.txt): {}", String::from_utf8_lossy(&py.stderr));
    let rows: Vec<(String, String, u64, u64, f64, f64)> = serde_json::from_slice(&py.stdout).unwrap();
    let by_sql: BTreeMap<(String, String, u64), (u64, f64, f64)> = rows.into_iter().map(|(s, r, p, n, lo, hi)| ((s, r, p), (n, lo, hi))).collect();
    assert_eq!(by_sql.len(), mined.len());
    assert!(mined.len() >= 36, "{}", mined.len());
    assert_eq!(by_sql, mined, "DuckDB and opscope mine --json, per (site, role, pass)");

    // The README's check of the parts' checksums for readers that do not verify them (DuckDB,
    // Spark): Python's zlib, not opscope's code.
    let check = readme_checksum_script();
    let run_check = |ok: bool| {
        let py = Command::new("python3").args(["-c", check.as_str()]).arg(&out).output().expect("python3 runs");
        assert_eq!(py.status.success(), ok, "{}", String::from_utf8_lossy(&py.stderr));
        String::from_utf8_lossy(&py.stdout).trim().to_string()
    };
    assert_eq!(run_check(true), "2 partition(s): every part matches its checksum");
    // A part copied into another partition is not listed there; then damaged in place.
    let stray = partitions[0].dir.join("part-00099.parquet");
    std::fs::copy(&partitions[1].parts[0], &stray).unwrap();
    assert_eq!(run_check(false), format!("{}: not listed (copied in?)", stray.display()));
    let mine = opscope().args(["mine", "--json"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&mine.stderr);
    assert!(!mine.status.success() && err.contains("not a part this recording wrote") && err.contains("part-00099.parquet"), "{err}");
    std::fs::remove_file(&stray).unwrap();
    let part = &partitions[1].parts[0];
    let mut bytes = std::fs::read(part).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(part, &bytes).unwrap();
    assert_eq!(run_check(false), format!("{}: damaged", part.display()));
    let mine = opscope().args(["mine", "--json"]).arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&mine.stderr);
    assert!(!mine.status.success() && err.contains("changed since it was closed") && err.contains(&*part.to_string_lossy()), "{err}");
    // Restored, and a file of manifests damaged instead: the script names it.
    bytes[mid] ^= 0x20;
    std::fs::write(part, &bytes).unwrap();
    assert_eq!(run_check(true), "2 partition(s): every part matches its checksum");
    let graphs = partitions[0].dir.join("_graphs-000001.json");
    let mut text = std::fs::read(&graphs).unwrap();
    text.push(b' ');
    std::fs::write(&graphs, &text).unwrap();
    assert_eq!(run_check(false), format!("{}: missing or damaged", graphs.display()));
    text.pop();
    std::fs::write(&graphs, &text).unwrap();
    // What a writer killed between `_manifest.json` and its part's rename leaves: the sidecar
    // lists the part (numbered at its `closed_parts`), which is still `_part-N.parquet.partial`.
    // Not missing for the script, as for opscope.
    let dir1 = &partitions[1].dir;
    let last = partitions[1].parts.last().unwrap();
    let name = last.file_name().unwrap().to_string_lossy().to_string();
    let n: usize = name[5..10].parse().unwrap();
    std::fs::rename(last, dir1.join(format!("_{name}.partial"))).unwrap();
    let side = dir1.join("_manifest.json");
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    doc["closed_parts"] = n.into();
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    assert_eq!(run_check(true), "2 partition(s): every part matches its checksum");
    let mine = opscope().args(["mine", "--json"]).arg(&out).output().unwrap();
    assert!(mine.status.success() && String::from_utf8_lossy(&mine.stderr).contains("skipped 1 open part(s)"), "{}", String::from_utf8_lossy(&mine.stderr));
}

#[test]
fn parts_close_at_the_byte_limit_and_a_bad_limit_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = |out: &Path, runs: &str, bytes: &str| {
        opscope().args(["sweep", "--seeds", "1", "--out"]).arg(out).env("RLX_OPSCOPE_PART_RUNS", runs).env("RLX_OPSCOPE_PART_BYTES", bytes).output().unwrap()
    };
    let (one, by_bytes) = (dir.path().join("one.parquet"), dir.path().join("bytes.parquet"));
    assert!(sweep(&one, "100000", "1000000000").status.success());
    assert!(sweep(&by_bytes, "100000", "40000").status.success());
    assert_eq!(closed_parts(&one).len(), 1, "neither limit reached: one part");
    let parts = closed_parts(&by_bytes);
    assert!(parts.len() >= 3, "{}", parts.len());
    // Closed at the end of the run (row group) that brought its data to 40000 bytes: with its
    // last row group a part holds at least that much, without it less. (The footer, with
    // statistics per row group and column, comes on top.)
    for p in &parts[..parts.len() - 1] {
        use parquet::file::reader::FileReader;
        let r = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(p).unwrap()).unwrap();
        let groups: Vec<i64> = r.metadata().row_groups().iter().map(|g| g.compressed_size()).collect();
        let all = 4 + groups.iter().sum::<i64>(); // + the leading magic PAR1
        let before_last = all - groups[groups.len() - 1];
        assert!(before_last < 40_000 && all >= 40_000, "{}: {groups:?}", p.display());
    }
    let total = |ps: &[PathBuf]| ps.iter().map(|p| footer_rows(p)).sum::<i64>();
    assert_eq!(total(&parts), total(&closed_parts(&one)), "the same rows, split");

    for (runs, bytes, var) in [("0", "100", "RLX_OPSCOPE_PART_RUNS"), ("2", "lots", "RLX_OPSCOPE_PART_BYTES")] {
        let out = sweep(&dir.path().join(format!("bad{runs}.parquet")), runs, bytes);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(&format!("{var}=")) && err.contains("whole number >= 1") && !err.contains("panicked"), "{err}");
    }
}

#[test]
fn record_into_a_dataset_holding_recordings_needs_append() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("held.parquet");
    assert!(opscope().args(["sweep", "--seeds", "1", "--out"]).arg(&out).stdout(Stdio::null()).status().unwrap().success());
    let before = closed_parts(&out);
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one\n%\ntwo\n").unwrap();
    let run = |extra: &[&str]| {
        opscope()
            .args(["record", "--onnx", "missing.onnx", "--tokenizer", "missing.json", "--text"])
            .arg(&text)
            .args(extra)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap()
    };
    for extra in [&[][..], &["--force"][..]] {
        let o = run(extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("already holds 1 recording(s)") && err.contains("--append"), "{extra:?}: {err}");
    }
    // With --append the output check passes and the next error is the missing tokenizer.
    let err = String::from_utf8_lossy(&run(&["--append"]).stderr).to_string();
    assert!(!err.contains("already holds") && err.contains("missing.json: no such tokenizer file"), "{err}");
    assert_eq!(closed_parts(&out), before, "a refused or failed start leaves the dataset alone");
}

#[test]
fn append_to_a_csv_recording_is_refused_and_leaves_it_alone() {
    // A CSV recording is one file: "appending" would replace it.
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "one\n%\ntwo\n").unwrap();
    for name in ["kept.csv", "kept.csv.gz"] {
        let out = dir.path().join(name);
        std::fs::write(&out, b"earlier recording").unwrap();
        let o = opscope()
            .args(["record", "--onnx", "missing.onnx", "--tokenizer", "missing.json", "--text"])
            .arg(&text)
            .args(["--append", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("--append adds a partition to a Parquet dataset"), "{name}: {err}");
        assert_eq!(std::fs::read(&out).unwrap(), b"earlier recording", "{name}");
    }
}

/// One row as every reader sees it: the text and integer columns, `value` as its f32 bits.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize)]
struct Cells(String, u32, u64, String, String, u32, String, String, String, String, u64, u32, Option<u64>, String, Option<u64>);

fn cells(r: &opscope::recording::Row) -> Cells {
    Cells(
        r.run_id.to_string(),
        r.compile,
        r.step,
        r.graph.to_string(),
        r.pass.to_string(),
        r.pass_idx,
        r.site.to_string(),
        r.op.to_string(),
        r.role.to_string(),
        r.stat.to_string(),
        r.idx,
        r.value.to_bits(),
        r.numel,
        r.shape.to_string(),
        r.flops,
    )
}

/// Every column of every row of a dataset as DuckDB reads it, sorted.
fn duckdb_cells(dataset: &Path) -> Vec<Cells> {
    let code = r#"
import sys, json, struct, duckdb
rows = duckdb.sql(f"""
  SELECT run_id, compile, step, graph, pass, pass_idx, site, op, role, stat, idx, value, numel, shape, flops
  FROM read_parquet('{sys.argv[1]}/**/*.parquet')
""").fetchall()
bits = lambda v: struct.unpack('<I', struct.pack('<f', v))[0]
print(json.dumps([list(r[:11]) + [bits(r[11])] + list(r[12:]) for r in rows]))
"#;
    python_cells(code, dataset, "duckdb")
}

/// The rows `code` (Python, given `dataset` as its argument) prints as JSON, sorted; `package`
/// names what it imports, for the message when it fails.
fn python_cells(code: &str, dataset: &Path, package: &str) -> Vec<Cells> {
    let py = Command::new("python3").args(["-c", code]).arg(dataset).output().expect("python3 runs");
    assert!(py.status.success(), "{package} (pip install -r scripts/requirements-test.txt): {}", String::from_utf8_lossy(&py.stderr));
    let mut rows: Vec<Cells> = serde_json::from_slice(&py.stdout).unwrap();
    rows.sort();
    rows
}

/// Every column of every row of a dataset as pyarrow reads it (a third Parquet decoder), sorted.
fn pyarrow_cells(dataset: &Path) -> Vec<Cells> {
    let code = r#"
import sys, json, struct, glob
import pyarrow.parquet as pq
bits = lambda v: struct.unpack('<I', struct.pack('<f', v))[0]
out = []
for f in sorted(glob.glob(f"{sys.argv[1]}/**/*.parquet", recursive=True)):
    t = pq.read_table(f).to_pylist()
    for r in t:
        r["value"] = bits(r["value"])
        out.append([r[c] for c in ["run_id", "compile", "step", "graph", "pass", "pass_idx", "site", "op", "role", "stat", "idx", "value", "numel", "shape", "flops"]])
print(json.dumps(out))
"#;
    python_cells(code, dataset, "pyarrow")
}

/// The columnar path (`Sink::write_block`, what the recorder uses) and the row path
/// (`Sink::write`) of the Parquet dataset sink write the same table, and that table is the rows
/// `Block::rows` defines: every column of every row read back by DuckDB (an independent
/// Parquet reader; it decodes the DELTA_BINARY_PACKED and BYTE_STREAM_SPLIT columns the sink
/// writes) and pyarrow, and by opscope's reader. Blocks with NaN elements (not rows), empty and
/// all-NaN blocks, unknown numel/flops (a run where both are empty in every row), extreme and
/// subnormal floats, several runs and parts, dictionaries of 1 to 66 000 strings (keys of 0 to
/// 17 bits in opscope's own key-column encoder).
#[test]
fn the_columnar_sink_writes_every_row_of_its_blocks_and_duckdb_reads_them_back() {
    use opscope::recording::{Block, DatasetSink, PartLimits, Sink};
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let s = |x: &str| Arc::<str>::from(x);
    let (run_id, graph, other_graph) = (s("run-7-1-1"), s("chain"), s("other"));
    let passes = [s("matmul"), s("attn")];
    // Three sites in most runs; in run 3 a dictionary of 300 site names (9-bit keys) and in run
    // 5 one of 66 000 (17-bit keys: three bytes a run-length value).
    let mut sites = vec![s("l0/MatMul"), s("l1/MatMul"), s("layer.2/attention/self/MatMul_1")];
    sites.extend((0..66_000).map(|k| s(&format!("block.{k}/MatMul"))));
    let (op, role, shape) = (s("MatMul"), s("lhs"), s("[64,256]"));
    let stats = [s("min"), s("max"), s("hist"), s("chan_maxabs")];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE / 8.0, -0.0, 1e38, f32::NAN];
    let mut runs: Vec<Vec<(usize, usize, usize, usize, Vec<f32>, Option<u64>, Option<u64>)>> = Vec::new();
    for run in 0..8 {
        let mut blocks = Vec::new();
        let count = match run {
            3 => 300,
            5 => 66_000,
            // Run 7: 140 000 rows, more than a row group holds (`GROUP_ROWS`): two row groups.
            7 => 200,
            _ => rng.gen_range(1..40),
        };
        for b in 0..count {
            let n = match run {
                5 => 1,
                7 => 700,
                _ => [0usize, 1, 3, 64, 700][rng.gen_range(0..5)],
            };
            let values: Vec<f32> = (0..n)
                .map(|_| if rng.gen_bool(0.1) { specials[rng.gen_range(0..specials.len())] } else { rng.gen_range(-3.0f32..3.0) * 10f32.powi(rng.gen_range(-30..30)) })
                .collect();
            // Run 6: numel and flops empty in every row (a column chunk of nulls only).
            let numel = (run != 6 && rng.gen_bool(0.8)).then(|| rng.gen_range(1..1u64 << 40));
            let flops = (run != 6 && rng.gen_bool(0.5)).then(|| rng.gen_range(0..u64::MAX));
            let site = if run == 3 || run == 5 { 3 + b } else { rng.gen_range(0..3) };
            blocks.push((rng.gen_range(0..2), site, rng.gen_range(0..4), rng.gen_range(0..2), values, numel, flops));
        }
        runs.push(blocks);
    }
    let write = |out: &Path, columnar: bool| -> Vec<Cells> {
        let mut sink = DatasetSink::create(out, PartLimits { runs: 3, bytes: 1 << 30 }).unwrap();
        sink.recording_id(&run_id).unwrap();
        for (compile, g) in [(1, "chain"), (2, "other")] {
            let m: opscope::manifest::Manifest = serde_json::from_value(serde_json::json!({
                "graph": g, "pipeline": "matmul", "tag": compile, "compile": compile, "user_outputs": 1,
                "sites": [], "outputs": [], "skipped": []
            }))
            .unwrap();
            sink.manifest(&std::sync::Arc::new(m.clone())).unwrap();
        }
        let mut expected = Vec::new();
        for (step, blocks) in runs.iter().enumerate() {
            for (p, si, st, g, values, numel, flops) in blocks {
                let b = Block {
                    run_id: &run_id,
                    compile: 1 + *g as u32,
                    step: step as u64,
                    graph: if *g == 0 { &graph } else { &other_graph },
                    pass: &passes[*p],
                    pass_idx: *p as u32,
                    site: &sites[*si],
                    op: &op,
                    role: &role,
                    stat: &stats[*st],
                    numel: *numel,
                    shape: &shape,
                    flops: *flops,
                    values,
                };
                let rows: Vec<_> = b.rows().collect();
                assert_eq!(rows.len(), b.row_count());
                expected.extend(rows.iter().map(cells));
                if columnar { sink.write_block(&b).unwrap() } else { sink.write(&rows).unwrap() }
            }
            sink.flush().unwrap();
        }
        sink.finish().unwrap();
        expected.sort();
        expected
    };
    let (by_blocks, by_rows) = (dir.path().join("blocks.parquet"), dir.path().join("rows.parquet"));
    let expected = write(&by_blocks, true);
    assert_eq!(write(&by_rows, false), expected);
    assert!(expected.len() > 70_000, "{}", expected.len());
    assert!(expected.iter().any(|c| c.11 == f32::INFINITY.to_bits()) && expected.iter().any(|c| c.12.is_none()) && expected.iter().any(|c| c.14.is_none()));
    for out in [&by_blocks, &by_rows] {
        assert_eq!(closed_parts(out).len(), 3, "8 runs at 3 runs per part (a run of two row groups is one run)");
        let groups: usize = closed_parts(out)
            .iter()
            .map(|p| parquet::file::reader::FileReader::metadata(&parquet::file::serialized_reader::SerializedFileReader::new(std::fs::File::open(p).unwrap()).unwrap()).num_row_groups())
            .sum();
        assert!(opscope::recording::GROUP_ROWS < 140_000);
        assert_eq!(groups, 9, "one row group a run, and two for the run of 140 000 rows");
        assert_eq!(duckdb_cells(out), expected, "{}", out.display());
        assert_eq!(pyarrow_cells(out), expected, "{}", out.display());
        // opscope's own reader: the key columns and values it decodes, in any order.
        let mut ours = Vec::new();
        opscope::recording::read_rows(out, |r| ours.push(format!("{} {} {} {} {} {} {} {:?} {}", r.compile, r.step, r.pass_idx, r.site, r.role, r.stat, r.idx, r.flops, r.value.to_bits())))
            .unwrap();
        let mut want: Vec<String> = expected.iter().map(|c| format!("{} {} {} {} {} {} {} {:?} {}", c.1, c.2, c.5, c.6, c.8, c.9, c.10, c.14, c.11)).collect();
        ours.sort();
        want.sort();
        assert_eq!(ours, want);
    }
}

/// `opscope mine --max-runs all`, `calibrate` and `diff` load compactly (`opscope::mine::load_compact`: each run's `pos_sumsq` and
/// `row_absmax` reduced to the numbers the rules read, as the run's rows end). On a MiniLM
/// recording with padding rows and repeated batches, the verdicts, the stats no rule could use,
/// the per-run int8 estimates and the exact-repeat fingerprints equal those of the full load.
#[test]
fn a_compact_load_mines_as_the_full_load() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rep.parquet");
    // Three batches of 4 fortunes of different lengths (padding rows), the first batch again
    // at the end (exact repeats of every activation).
    let all = fortunes();
    let entries: Vec<&str> = all.iter().map(String::as_str).collect();
    let mut picked: Vec<&str> = entries[..12].to_vec();
    picked.extend_from_slice(&entries[..4]);
    let t = dir.path().join("t.txt");
    std::fs::write(&t, picked.join("\n%\n")).unwrap();
    let o = record(&out, &t, 4, 16).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let full = opscope::mine::load(&out).unwrap();
    let compact = opscope::mine::load_compact(&out).unwrap();
    assert_eq!(full.keys().collect::<Vec<_>>(), compact.keys().collect::<Vec<_>>());
    let pos = opscope::sketch::tensor::POS_SUMSQ;
    let rowmax = opscope::sketch::tensor::ROW_ABSMAX;
    // The path under test ran: the full load holds per-row vectors with padding (NaN) rows, the
    // compact one holds summaries instead.
    let padded = full.values().flat_map(|s| &s.runs).filter(|r| r.vector(rowmax).is_some_and(|v| v.iter().any(|x| x.is_nan()))).count();
    assert!(padded > 0, "no run with padding rows: the test does not exercise them");
    let chan = opscope::sketch::tensor::CHAN_MAXABS;
    for (k, s) in &compact {
        for r in &s.runs {
            assert!(r.vector(pos).is_none() && r.vector(rowmax).is_none(), "{k:?}: per-row vectors kept");
            if full[k].runs.iter().any(|f| f.vector(pos).is_some()) {
                assert!(r.row_summary().is_some(), "{k:?}: no summary");
            }
            assert!(r.vector(chan).is_none(), "{k:?}: chan_maxabs kept");
            if full[k].runs.iter().any(|f| f.vector(chan).is_some_and(|v| !v.is_empty())) {
                assert!(r.chan_summary().is_some(), "{k:?}: no channel summary");
            }
        }
    }
    assert_eq!(
        serde_json::to_value(opscope::mine::mine(&full)).unwrap(),
        serde_json::to_value(opscope::mine::mine(&compact)).unwrap(),
        "verdicts"
    );
    assert_eq!(
        serde_json::to_value(opscope::mine::cannot_run(&full)).unwrap(),
        serde_json::to_value(opscope::mine::cannot_run(&compact)).unwrap()
    );
    let mut repeats = 0;
    for (k, s) in &full {
        let shape: Vec<usize> = s.shape.trim_matches(|c| c == '[' || c == ']').split(',').filter_map(|d| d.trim().parse().ok()).collect();
        for (a, b) in s.runs.iter().zip(&compact[k].runs) {
            assert_eq!(opscope::mine::int8_estimate(a, &shape), opscope::mine::int8_estimate(b, &shape), "{k:?} run {}", a.step);
        }
        let (fa, fb) = (opscope::mine::fingerprints(s), opscope::mine::fingerprints(&compact[k]));
        assert_eq!(fa, fb, "{k:?}: fingerprints");
        repeats += opscope::mine::repeat_rate(s).map_or(0, |r| r.repeats);
    }
    assert!(repeats > 0, "no exact repeat: the fingerprints were not put to the test");
    // Per-index means and maxima over runs (report, diff): the compact load's running sums and
    // maxima give the full load's values to the last bit (NaN for an index no run filled, such
    // as a row padding in every run), the runs of one file arriving in (compile, step) order.
    let mut compared = [0usize; 3];
    for (k, s) in &full {
        assert_eq!(s.has_chan_maxabs(), compact[k].has_chan_maxabs(), "{k:?}");
        let c = &compact[k];
        let pairs = [
            ("mean row energy", s.mean_row_energy(), c.mean_row_energy()),
            ("chan_maxabs mean", s.chan_maxabs_mean(), c.chan_maxabs_mean()),
            ("chan_maxabs max", s.chan_maxabs_max(), c.chan_maxabs_max()),
        ];
        for (n, (what, a, b)) in pairs.into_iter().enumerate() {
            assert_eq!(a.is_some(), b.is_some(), "{k:?}: {what} on one load only");
            let (Some(a), Some(b)) = (a, b) else { continue };
            compared[n] += 1;
            assert_eq!(a.len(), b.len(), "{k:?} {what}");
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()), "{k:?} {what} [{i}]: {x} vs {y}");
            }
        }
    }
    assert!(compared.iter().all(|&n| n > 0), "series compared (row energy, channel mean, channel max): {compared:?}");

    // The same table re-sorted by another tool (by stat, step, element, site, as a DuckDB
    // `ORDER BY` might leave it: each run's rows of a tensor scattered): the same verdicts.
    let mut rows: Vec<opscope::Row> = Vec::new();
    opscope::recording::read_rows(&out, |r| {
        rows.push(opscope::Row {
            run_id: "r".into(),
            compile: r.compile,
            step: r.step,
            graph: "g".into(),
            pass: "matmul".into(),
            pass_idx: r.pass_idx,
            site: r.site.into(),
            op: r.op.into(),
            role: r.role.into(),
            stat: r.stat.into(),
            idx: r.idx,
            value: r.value,
            numel: None,
            shape: r.shape.into(),
            flops: r.flops,
        })
    })
    .unwrap();
    rows.sort_by(|a, b| (&a.stat, a.step, a.idx, &a.site, &a.role).cmp(&(&b.stat, b.step, b.idx, &b.site, &b.role)));
    let sorted = dir.path().join("sorted.csv");
    let mut sink = opscope::CsvSink::create(&sorted).unwrap();
    opscope::Sink::write(&mut sink, &rows).unwrap();
    opscope::Sink::finish(&mut sink).unwrap();
    assert_eq!(
        serde_json::to_value(opscope::mine::mine(&full)).unwrap(),
        serde_json::to_value(opscope::mine::mine(&opscope::mine::load_compact(&sorted).unwrap())).unwrap(),
        "verdicts of the re-sorted recording"
    );
}

/// A closed part deleted or lost after the recording (here one in the middle and the last)
/// is named when the dataset is read: the sidecar counts the parts closed, so the last one is
/// missed too, not only a gap in the numbering; so does a killed recorder's open part (the
/// parts before it were closed). The open part itself is not missing.
#[test]
fn a_part_deleted_since_it_was_written_is_named() {
    let (_, _, text) = assets();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("d.parquet");
    let st = record(&out, &text, 1, 4).env("RLX_OPSCOPE_PART_RUNS", "1").output().unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let parts = closed_parts(&out);
    assert_eq!(parts.len(), 4, "{parts:?}");
    let mine = || {
        let o = opscope().args(["mine", "--json"]).arg(&out).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    assert!(!mine().contains("lacks"), "nothing missing yet");
    std::fs::remove_file(&parts[3]).unwrap();
    let err = mine();
    assert!(err.contains("lacks part-00003.parquet") && err.contains("deleted or lost"), "{err}");
    std::fs::remove_file(&parts[1]).unwrap();
    let err = mine();
    assert!(err.contains("lacks 2 parts: part-00001.parquet, part-00003.parquet"), "{err}");
    // A killed recorder's open part (numbered 4 here) says the parts before it were closed:
    // with no sidecar count to go by, the last closed part deleted is still named.
    let side = parts[0].parent().unwrap().join("_manifest.json");
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    doc.as_object_mut().unwrap().remove("closed_parts");
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    std::fs::copy(&parts[0], parts[0].with_file_name("_part-00004.parquet.partial")).unwrap();
    let err = mine();
    assert!(err.contains("lacks 2 parts: part-00001.parquet, part-00003.parquet") && err.contains("skipped 1 open part"), "{err}");
}

/// The README's Python check of a dataset's checksums (the block after "check it with Python's
/// `zlib`"), de-indented: the test runs the script users copy, not a copy of it.
fn readme_checksum_script() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let start = readme.find("check it with Python's `zlib`").expect("the README's checksum check");
    let body = &readme[start..];
    let open = body.find("```python\n").expect("its python block") + "```python\n".len();
    let close = body[open..].find("  ```").expect("the block's end") + open;
    body[open..close].lines().map(|l| l.strip_prefix("  ").unwrap_or(l)).collect::<Vec<_>>().join("\n")
}
