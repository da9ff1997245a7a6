//! What happens to a recording when things go wrong: a wrong name, an interrupt, a crash, and
//! a scope that records nothing. Nothing written is lost, and nothing silent.

mod common;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use opscope::{CsvSink, MemorySink, Pipeline, Scope, Sink};
use rlx_runtime::{Device, Session};

fn pipeline() -> Pipeline {
    Pipeline::parse("matmul{stats=[max]}").unwrap()
}

/// Compile the 2x... matmul fixture and run it `runs` times.
fn compile_and_run(runs: usize) -> Vec<Vec<f32>> {
    let mut c = Session::new(Device::Cpu).compile(matmul_2d(4, 6, 3));
    c.set_param("w", &randn(18, 1));
    (0..runs).map(|_| c.run(&[("x", &randn(24, 2))]).remove(0)).collect()
}

#[test]
fn a_csv_sink_refuses_a_name_it_does_not_write() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["x.parquet", "p.txt", "p.json"] {
        let err = CsvSink::create(dir.path().join(name)).err().unwrap_or_else(|| panic!("{name} accepted")).to_string();
        assert!(err.contains(".csv or .csv.gz"), "{name}: {err}");
        let err = opscope::open_sink(dir.path().join(name)).err();
        assert_eq!(err.is_none(), name.ends_with(".parquet") && cfg!(feature = "parquet"), "{name}: {err:?}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), usize::from(cfg!(feature = "parquet")), "nothing else created");
}

/// `open_sink` makes the environment mode's checks of the path (a helper's finds: it wrote over
/// a user's CSV, removed a crashed recording's `.partial`, and let a second process truncate the
/// first's): a file that is not a recording, a `.partial` and a directory of foreign files are
/// refused, each left as it was; an earlier recording is replaced, once the new one is complete.
#[test]
fn open_sink_never_writes_over_what_is_not_a_finished_recording() {
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("precious.csv");
    std::fs::write(&mine, "my,precious\n1,2\n").unwrap();
    let err = opscope::open_sink(&mine).err().expect("a user's file refused").to_string();
    assert!(err.contains("is not an opscope recording") && err.contains("pick another path"), "{err}");
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "my,precious\n1,2\n");

    let rec = dir.path().join("rec.csv");
    let partial = dir.path().join("rec.csv.partial");
    std::fs::write(&partial, "site,role\nrows of a crashed run\n").unwrap();
    let err = opscope::open_sink(&rec).err().expect("a .partial refused").to_string();
    assert!(err.contains("rec.csv.partial is there") && err.contains("opscope mine"), "{err}");
    assert_eq!(std::fs::read_to_string(&partial).unwrap(), "site,role\nrows of a crashed run\n");
    std::fs::remove_file(&partial).unwrap();

    // A finished recording is replaced by the next one at the path.
    opscope::scope(&pipeline(), opscope::open_sink(&rec).unwrap(), || compile_and_run(1)).unwrap();
    let first = std::fs::read(&rec).unwrap();
    opscope::scope(&pipeline(), opscope::open_sink(&rec).unwrap(), || compile_and_run(2)).unwrap();
    assert_ne!(std::fs::read(&rec).unwrap(), first, "replaced by the second recording");

    let foreign = dir.path().join("table.parquet");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("part-0.parquet"), b"PAR1").unwrap();
    let err = opscope::open_sink(&foreign).err().expect("a foreign directory refused").to_string();
    assert!(err.contains("other files than recording=<id> partitions (part-0.parquet)"), "{err}");
    assert_eq!(std::fs::read_dir(&foreign).unwrap().count(), 1, "nothing added");
}

static STOP: AtomicBool = AtomicBool::new(false);

#[test]
fn an_interrupted_recording_is_closed_readable_and_left_partial() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rec.csv.gz");
    let sink = opscope::open_sink(&path).unwrap();
    let (_, res) = Scope::new(&pipeline(), sink).interrupt_flag(&STOP).run(|| {
        let outs = compile_and_run(3);
        STOP.store(true, Ordering::SeqCst); // as a Ctrl-C handler would
        outs
    });
    let summary = res.unwrap();
    assert!(summary.interrupted && summary.runs == 3, "{summary:?}");
    let partial = dir.path().join("rec.csv.gz.partial");
    assert!(!path.exists(), "an interrupted recording never takes the final name");
    assert!(partial.is_file() && dir.path().join("rec.csv.gz.partial.manifest.json").is_file());
    // A closed gzip stream: the miner reads every run.
    let series = opscope::mine::load(&partial).unwrap();
    let runs: Vec<usize> = series.values().map(|s| s.runs.len()).collect();
    assert!(runs.contains(&3), "{runs:?}");

    // A later recording to the same path that crashes: the interrupted one's sidecar (which
    // says its file ended on a whole run) is gone, so the new file's last run is left out.
    let side = dir.path().join("rec.csv.gz.partial.manifest.json");
    assert!(std::fs::read_to_string(&side).unwrap().contains("\"ends_on_run\": true"));
    {
        let mut sink = CsvSink::create(&path).unwrap();
        assert!(!side.exists(), "the stale sidecar is removed when the new recording starts");
        let memory = MemorySink::default();
        opscope::scope(&pipeline(), Box::new(memory.clone()), || compile_and_run(2)).unwrap();
        sink.write(&memory.rows()).unwrap();
        sink.flush().unwrap();
    } // crash
    let series = opscope::mine::load(&partial).unwrap();
    assert!(series.values().all(|s| s.runs.iter().all(|r| r.step == 0)), "the crashed recording's last run is left out");
}

#[test]
fn a_crashed_gzip_recording_is_read_up_to_its_last_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("crash.csv.gz");
    let memory = MemorySink::default();
    {
        // The sink is dropped without finishing (a crash): the gzip stream has no trailer.
        let mut sink = CsvSink::create(&path).unwrap();
        opscope::scope(&pipeline(), Box::new(memory.clone()), || compile_and_run(2)).unwrap();
        let rows = memory.rows();
        for r in rows.chunks(3) {
            sink.write(r).unwrap();
            sink.flush().unwrap();
        }
    }
    let partial = dir.path().join("crash.csv.gz.partial");
    let text = {
        use std::io::Read;
        let mut out = String::new();
        let _ = flate2::read::GzDecoder::new(std::fs::File::open(&partial).unwrap()).read_to_string(&mut out);
        out
    };
    assert!(!text.is_empty(), "rows flushed before the crash are in the file");
    let read = opscope::mine::load(&partial).expect("a truncated .partial is readable");
    // Nothing marks the last run whole (no sidecar: the process died), so it is left out.
    let rows = memory.rows();
    let last = rows.last().map(|r| (r.compile, r.step)).unwrap();
    assert_eq!(last, (1, 1));
    let want = opscope::mine::series_from_rows(&rows.iter().filter(|r| (r.compile, r.step) != last).cloned().collect::<Vec<_>>());
    assert_eq!(read.len(), want.len());
    for (k, s) in &want {
        assert_eq!(read[k].runs.len(), s.runs.len(), "{k:?}");
        assert!(read[k].runs.iter().all(|r| r.step == 0), "{k:?}");
    }
}

/// A finished `.csv.gz` recording cut afterwards (an interrupted copy) is an error naming the
/// cut and the fix, never a silent read of part of it; renamed `.partial`, it is read up to its
/// last run.
#[test]
fn a_finished_gzip_recording_cut_afterwards_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("done.csv.gz");
    opscope::scope(&pipeline(), opscope::open_sink(&path).unwrap(), || compile_and_run(3)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let err = opscope::mine::load(&path).err().expect("a cut finished recording is an error").to_string();
    assert!(err.contains("mid-stream") && err.contains("cut or damaged since") && err.contains(".partial"), "{err}");
    let partial = dir.path().join("done.csv.gz.partial");
    std::fs::rename(&path, &partial).unwrap();
    assert!(opscope::mine::load(&partial).is_ok());
    // A plain CSV recording cut mid-row (a copy that stopped early): the error says the last
    // row is cut short, not only that two rows have different field counts.
    let path = dir.path().join("done.csv");
    opscope::scope(&pipeline(), opscope::open_sink(&path).unwrap(), || compile_and_run(3)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let mid_row = bytes[..bytes.len() / 2].iter().rposition(|&b| b == b',').unwrap();
    std::fs::write(&path, &bytes[..mid_row]).unwrap();
    let err = opscope::mine::load(&path).err().expect("a cut finished recording is an error").to_string();
    assert!(err.contains("is cut short") && err.contains("of its 15 fields") && err.contains("cut or damaged since"), "{err}");
    // A short row in the middle of a file is malformed, not a cut.
    let mut spliced = bytes[..mid_row].to_vec();
    spliced.push(b'\n');
    spliced.extend_from_slice(&bytes[bytes.len() / 2..]);
    std::fs::write(&path, &spliced).unwrap();
    let err = opscope::mine::load(&path).err().expect("malformed").to_string();
    assert!(!err.contains("cut short") && err.contains("fields"), "{err}");
}

/// A plain CSV recording cut by a crash at every byte of its last two runs: read, it holds
/// exactly the runs before the one the cut fell in (or before the last one, when the cut falls
/// on a row boundary), never part of a run and never an error.
#[test]
fn a_cut_csv_recording_never_counts_part_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let memory = MemorySink::default();
    opscope::scope(&Pipeline::parse("matmul").unwrap(), Box::new(memory.clone()), || compile_and_run(3)).unwrap();
    let rows = memory.rows();
    let path = dir.path().join("cut.csv");
    {
        let mut sink = CsvSink::create(&path).unwrap();
        for step in 0..3 {
            sink.write(&rows.iter().filter(|r| r.step == step).cloned().collect::<Vec<_>>()).unwrap();
            sink.flush().unwrap();
        }
    } // dropped unfinished: a crash
    let full = std::fs::read(dir.path().join("cut.csv.partial")).unwrap();
    let text = String::from_utf8(full.clone()).unwrap();
    // Byte offset where the rows of each step start (the step column is the third).
    let starts: Vec<usize> = (1..3u64)
        .map(|s| {
            let mut at = 0;
            for l in text.split_inclusive('\n') {
                if l.split(',').nth(2) == Some(&s.to_string()) {
                    return at;
                }
                at += l.len();
            }
            panic!("no step {s}")
        })
        .collect();
    let runs_of = |steps: &[u64]| -> Vec<(String, usize)> {
        let kept: Vec<_> = rows.iter().filter(|r| steps.contains(&r.step)).cloned().collect();
        opscope::mine::series_from_rows(&kept).into_iter().map(|(k, s)| (k.0 + "/" + &k.1, s.runs.len())).collect()
    };
    let cut = dir.path().join("c.csv.partial");
    for end in (starts[0] + 1..full.len()).step_by(7).chain([full.len()]) {
        std::fs::write(&cut, &full[..end]).unwrap();
        let got: Vec<(String, usize)> = opscope::mine::load(&cut)
            .unwrap_or_else(|e| panic!("cut at {end}: {e}"))
            .into_iter()
            .map(|(k, s)| (k.0 + "/" + &k.1, s.runs.len()))
            .collect();
        // The cut falls in step `s` (3: after the last row): the runs before it are read,
        // whole, except that the last of them may be left out too (a cut row that does not
        // parse does not say which run it began, and nothing marks the last run whole).
        let s = if end <= starts[1] { 1 } else if end < full.len() { 2 } else { 3 };
        let whole: Vec<u64> = (0..s).collect();
        let (all, but_last) = (runs_of(&whole), runs_of(&whole[..s as usize - 1]));
        assert!(got == all || got == but_last, "cut at byte {end} of {}: {got:?}", full.len());
        // Well inside step 2 (rows of it parsed), exactly steps 0 and 1.
        if s == 2 && end > starts[1] + 1000 {
            assert_eq!(got, all, "cut at byte {end}");
        }
    }
}

#[test]
fn a_scope_that_records_nothing_says_why() {
    let sink = || Box::new(MemorySink::default());
    let warn = |res: Result<opscope::activate::Summary, opscope::Error>| res.unwrap().warnings.join(" | ");
    // Compiled before the scope, run inside it.
    let mut c = Session::new(Device::Cpu).compile(matmul_2d(4, 6, 3));
    c.set_param("w", &randn(18, 1));
    let (_, res) = Scope::new(&pipeline(), sink()).run(|| c.run(&[("x", &randn(24, 2))]));
    assert!(warn(res).contains("no graph was compiled inside it"));
    // Compiled inside, run after.
    let (mut c, res) = Scope::new(&pipeline(), sink()).run(|| {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(4, 6, 3));
        c.set_param("w", &randn(18, 1));
        c
    });
    assert!(warn(res).contains("never ran inside it"));
    c.run(&[("x", &randn(24, 2))]);
    // Compiled and run on another thread.
    let (_, res) = Scope::new(&pipeline(), sink()).run(|| std::thread::spawn(|| compile_and_run(1)).join().unwrap());
    assert!(warn(res).contains("on another thread"));
    // The outer of two nested scopes: the inner one takes the compile.
    let inner = MemorySink::default();
    let (_, res) = Scope::new(&pipeline(), sink()).run(|| opscope::scope(&pipeline(), Box::new(inner.clone()), || compile_and_run(1)).unwrap());
    assert!(warn(res).contains("nested scope"));
    assert!(!inner.rows().is_empty(), "the inner scope recorded");
    // A pipeline that matches nothing.
    let (_, res) = Scope::new(&Pipeline::parse("attn").unwrap(), sink()).run(|| compile_and_run(1));
    assert!(warn(res).contains("found no site"));
    // A sample setting that leaves out every run: the runs counted, none recorded.
    let p = Pipeline::parse("sample{every=1000000},matmul").unwrap();
    let (_, res) = Scope::new(&p, sink()).run(|| compile_and_run(3));
    let summary = res.unwrap();
    assert_eq!((summary.runs, summary.recorded), (3, 0));
    assert!(summary.warnings.join(" | ").contains("recorded none of them"), "{:?}", summary.warnings);
    // And a scope that did record has no warning.
    let (_, res) = Scope::new(&pipeline(), sink()).run(|| compile_and_run(1));
    assert_eq!(res.unwrap().warnings, Vec::<String>::new());
}

#[test]
fn compiles_are_numbered_from_1_in_each_recording_and_run_ids_differ() {
    let record = || {
        let sink = MemorySink::default();
        opscope::scope(&pipeline(), Box::new(sink.clone()), || {
            compile_and_run(2);
            compile_and_run(1);
        })
        .unwrap();
        sink.rows()
    };
    let (a, b) = (record(), record());
    for rows in [&a, &b] {
        let compiles: std::collections::BTreeSet<u32> = rows.iter().map(|r| r.compile).collect();
        assert_eq!(compiles.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        let steps: Vec<u64> = rows.iter().filter(|r| r.compile == 2 && r.role.as_ref() == "out" && r.stat.as_ref() == "count").map(|r| r.step).collect();
        assert_eq!(steps, vec![0], "the second compile ran once");
    }
    assert_ne!(a[0].run_id, b[0].run_id, "each scope is its own recording");
}

/// A file that is not a recording, written at the path while a CSV recording runs, is not
/// replaced when the recording finishes: the error names it, and the complete recording stays
/// at `<path>.partial` (with its manifest sidecar), readable.
#[test]
fn a_foreign_file_appearing_at_the_path_is_not_replaced_at_finish() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("late.csv");
    let memory = MemorySink::default();
    opscope::scope(&pipeline(), Box::new(memory.clone()), || compile_and_run(2)).unwrap();
    let mut sink = CsvSink::create(&path).unwrap();
    sink.write(&memory.rows()).unwrap();
    std::fs::write(&path, b"my notes\n").unwrap();
    let err = sink.finish().unwrap_err().to_string();
    assert!(err.contains("not an opscope recording appeared here") && err.contains("late.csv.partial"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"my notes\n", "left as it was");
    let partial = dir.path().join("late.csv.partial");
    // An empty file appearing there is replaced (nothing to lose).
    let path = dir.path().join("empty.csv");
    let mut sink = CsvSink::create(&path).unwrap();
    sink.write(&memory.rows()).unwrap();
    std::fs::write(&path, b"").unwrap();
    sink.finish().unwrap();
    assert!(opscope::recording::holds_recording(&path));
    // The .partial holds every row the recording wrote, like the one that finished normally.
    let rows = |p: &std::path::Path| {
        let mut n = 0;
        opscope::recording::read_rows(p, |_| n += 1).unwrap();
        n
    };
    assert_eq!(rows(&partial), memory.rows().len(), "the complete recording is at .partial");
    assert_eq!(rows(&path), memory.rows().len());
}

/// A CSV recording whose manifest cannot be written at finish (here its temporary file's name
/// is taken by a directory; a full disk or `ulimit -f` fail the same write) is not renamed into
/// place: the earlier recording and its manifest stay as they were, paired, and the new rows
/// are complete at `<path>.partial`, which the error names.
#[test]
fn a_manifest_that_cannot_be_written_leaves_the_earlier_recording_paired_with_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.csv");
    opscope::scope(&Pipeline::parse("matmul{stats=[max]}").unwrap(), opscope::open_sink(&path).unwrap(), || compile_and_run(1)).unwrap();
    let (rows, manifest) = (std::fs::read(&path).unwrap(), std::fs::read(dir.path().join("r.csv.manifest.json")).unwrap());
    std::fs::create_dir(dir.path().join("r.csv.manifest.json.partial")).unwrap();
    let err = opscope::scope(&Pipeline::parse("matmul{stats=[min]}").unwrap(), opscope::open_sink(&path).unwrap(), || compile_and_run(2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("writing the manifest sidecar") && err.contains("it is complete") && err.contains("r.csv.partial"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), rows, "the earlier rows");
    assert_eq!(std::fs::read(dir.path().join("r.csv.manifest.json")).unwrap(), manifest, "with their own manifest");
    let mut n = 0;
    opscope::recording::read_rows(&dir.path().join("r.csv.partial"), |r| n += usize::from(r.stat == "min")).unwrap();
    assert!(n > 0, "the new recording's rows, every run of them, at .partial");
}

/// A panic inside the scope closes the recording as an interrupted one: every run that ran is
/// readable, in a CSV `.partial` (its last run too: the sidecar says the file ends on a whole
/// run) and in a Parquet dataset's closed part. Until 2026-12-07 the Parquet part was left
/// without a footer (every run lost) and the CSV reader dropped the last run (a helper's find).
#[test]
fn a_panic_in_the_scope_keeps_every_run_that_ran() {
    let dir = tempfile::tempdir().unwrap();
    let names: &[&str] = if cfg!(feature = "parquet") { &["p.csv", "p.parquet"] } else { &["p.csv"] };
    for name in names {
        let path = dir.path().join(name);
        let sink = opscope::open_sink(&path).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            opscope::scope(&pipeline(), sink, || {
                compile_and_run(3);
                panic!("the user's code fails after 3 runs");
            })
        }));
        assert!(r.is_err(), "{name}: the panic goes on to the caller");
        let read = if name.ends_with(".csv") {
            assert!(!path.exists(), "a panicked recording never looks complete");
            dir.path().join(format!("{name}.partial"))
        } else {
            path.clone()
        };
        let series = opscope::mine::load(&read).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (k, s) in &series {
            if k.1 != "rhs" {
                let steps: Vec<u64> = s.runs.iter().map(|r| r.step).collect();
                assert_eq!(steps, vec![0, 1, 2], "{name} {k:?}: every run that ran");
            }
        }
        assert!(!series.is_empty(), "{name}");
    }
}

/// A pass that did nothing is said in `Summary::warnings` (a helper's find: a tap whose
/// `sites=[..]` matched nothing was silent in scope and environment mode while another tap
/// recorded): the idle tap and the idle actuation each get a warning naming them; the same
/// pipeline with patterns that match draws none.
#[test]
fn a_tap_or_actuation_that_found_no_site_is_a_warning() {
    let run = |p: &str| {
        let (_, summary) = Scope::new(&Pipeline::parse(p).unwrap(), Box::new(opscope::MemorySink::default())).run(|| compile_and_run(1));
        summary.unwrap().warnings
    };
    let w = run("fakequant{sites=[nomatch*]},matmul{stats=[max]},matmul{sites=[nomatch*]}");
    assert_eq!(w.len(), 2, "{w:#?}");
    assert!(w.iter().any(|w| w.contains("the tap 'matmul{sites=[nomatch*]}' (pass 2) found no site in the 1 graph(s)")), "{w:#?}");
    assert!(w.iter().any(|w| w.contains("the actuation 'fakequant{sites=[nomatch*]}' (pass 0) changed nothing")), "{w:#?}");
    assert_eq!(run("fakequant{sites=[matmul*]},matmul{stats=[max]},matmul{sites=[matmul.0]}"), Vec::<String>::new());
}

/// A scope inside which nothing was compiled says that, and only that: an actuation it holds
/// did not run on any graph, so it is not also reported as having "changed nothing in the 0
/// graph(s) compiled" (the idle-actuation warning is for compiles that happened).
#[test]
fn a_scope_with_no_compile_does_not_call_its_actuations_idle() {
    let mut c = Session::new(Device::Cpu).compile(matmul_2d(4, 6, 3));
    c.set_param("w", &randn(18, 1));
    for p in ["fakequant{bits=4}", "fakequant{bits=4},matmul{stats=[max]}"] {
        let (_, res) = Scope::new(&Pipeline::parse(p).unwrap(), Box::new(MemorySink::default())).run(|| c.run(&[("x", &randn(24, 2))]));
        let w = res.unwrap().warnings;
        assert_eq!(w.len(), 1, "{p}: {w:#?}");
        assert!(w[0].contains("no graph was compiled inside it"), "{p}: {w:#?}");
    }
}
