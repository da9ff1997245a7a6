//! Recordings: complete, renamed into place, readable back with the csv crate; errors are
//! returned, never swallowed.

mod common;
use common::*;
use opscope::{CsvSink, Error, Manifest, Pipeline, Row, Sink};

fn run_into(sink: Box<dyn Sink>) -> Result<Vec<Vec<f32>>, Error> {
    let g = matmul_2d(4, 6, 3);
    let w = randn(18, 1);
    let x = randn(24, 2);
    let p = Pipeline::parse("matmul{stats=[min,max,hist],hist_bins=4}").unwrap();
    opscope::scope(&p, sink, || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &w);
        (0..2).map(|_| c.run(&[("x", &x)]).remove(0)).collect()
    })
}

#[test]
fn csv_recording_round_trips_and_is_renamed_into_place() {
    for name in ["rec.csv", "rec.csv.gz"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        run_into(Box::new(CsvSink::create(&path).unwrap())).unwrap();
        assert!(path.is_file(), "{name}");
        assert!(!dir.path().join(format!("{name}.partial")).exists());
        let file = std::fs::File::open(&path).unwrap();
        let reader: Box<dyn std::io::Read> = if name.ends_with(".gz") {
            Box::new(flate2::read::GzDecoder::new(file))
        } else {
            Box::new(file)
        };
        let rows: Vec<Row> = csv::Reader::from_reader(reader).deserialize().collect::<Result<_, _>>().unwrap();
        // lhs and out on 2 runs, rhs once: count, min, max, hist x4, hist_lo, hist_hi, hist_outside
        assert_eq!(rows.len(), (2 * 2 + 1) * 10, "{name}");
        assert!(rows.iter().all(|r| &*r.site == "matmul.0" && r.numel.is_some() && r.flops == Some(2 * 4 * 6 * 3)));
        let side: opscope::recording::Sidecar =
            serde_json::from_slice(&std::fs::read(opscope::recording::sidecar_path(&path)).unwrap()).unwrap();
        assert_eq!(side.graphs[0].pipeline, "matmul{stats=[min,max,hist],hist_bins=4}");
    }
}

#[test]
fn a_missing_directory_is_a_clear_error() {
    let err = CsvSink::create("/nonexistent-dir/rec.csv").err().expect("error");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent-dir/rec.csv") && msg.contains("its directory does not exist"), "{msg}");
}

struct FailingSink;

impl Sink for FailingSink {
    fn manifest(&mut self, _: &Manifest) -> Result<(), Error> {
        Ok(())
    }
    fn write(&mut self, _: &[Row]) -> Result<(), Error> {
        Err(Error::Io {
            path: "disk".into(),
            error: std::io::Error::other("disk full"),
        })
    }
    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

#[test]
fn a_sink_error_is_returned_by_the_scope() {
    let err = run_into(Box::new(FailingSink)).expect_err("the write error surfaces");
    assert!(err.to_string().contains("disk full"), "{err}");
}

#[test]
fn the_callers_value_survives_a_recording_error() {
    let g = matmul_2d(2, 2, 2);
    let p = Pipeline::parse("matmul").unwrap();
    let (value, res) = opscope::Scope::new(&p, Box::new(FailingSink)).run(|| {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &[1.0, 0.0, 0.0, 1.0]);
        c.run(&[("x", &[1.0, 2.0, 3.0, 4.0])])
    });
    assert_eq!(value, vec![vec![1.0, 2.0, 3.0, 4.0]]);
    assert!(res.is_err());
}

#[test]
fn rows_are_keyed_uniquely_across_passes_and_compiles() {
    // Two passes sketch the same tensor differently, and one graph is compiled twice.
    let g = matmul_2d(4, 6, 3);
    let w = randn(18, 1);
    let x = randn(24, 2);
    let p = Pipeline::parse("matmul{stats=[hist],hist_bins=4,roles=[out]},matmul{stats=[hist],hist_bins=8,roles=[out]},matmul{stats=[nnz]}").unwrap();
    let sink = opscope::MemorySink::default();
    opscope::scope(&p, Box::new(sink.clone()), || {
        for _ in 0..2 {
            let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
            c.set_param("w", &w);
            c.run(&[("x", &x)]);
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    let rows = sink.rows();
    let mut keys = std::collections::HashSet::new();
    for r in &rows {
        let key = (r.run_id.clone(), r.compile, r.step, r.pass_idx, r.site.clone(), r.role.clone(), r.stat.clone(), r.idx);
        assert!(keys.insert(key), "duplicate key: {r:?}");
    }
    let compiles: std::collections::BTreeSet<u32> = rows.iter().map(|r| r.compile).collect();
    assert_eq!(compiles.len(), 2);
    let first = *compiles.iter().next().unwrap();
    let bins = |pass: u32| rows.iter().filter(|r| r.pass_idx == pass && &*r.stat == "hist" && r.compile == first && r.step == 0).count();
    assert_eq!((bins(0), bins(1)), (4, 8));
}

#[test]
#[cfg(feature = "parquet")]
fn parquet_and_csv_recordings_hold_the_same_values() {
    let dir = tempfile::tempdir().unwrap();
    let (csv, pq) = (dir.path().join("r.csv.gz"), dir.path().join("r.parquet"));
    let memory = opscope::MemorySink::default();
    let tee = opscope::recording::Tee(vec![
        opscope::recording::open(&csv).unwrap(),
        opscope::recording::open(&pq).unwrap(),
        Box::new(memory.clone()),
    ]);
    run_into(Box::new(tee)).unwrap();
    assert!(!dir.path().join("r.parquet.partial").exists());
    let summarize = |m: &std::collections::BTreeMap<opscope::mine::SeriesKey, opscope::mine::Series>| {
        m.iter()
            .map(|(k, s)| {
                let v: Vec<(u32, u64, Vec<Option<f64>>)> = s
                    .runs
                    .iter()
                    .map(|r| (r.compile, r.step, opscope::sketch::tensor::ALL.iter().map(|st| r.scalar(*st)).collect()))
                    .collect();
                (k.clone(), s.shape.clone(), s.flops, v)
            })
            .collect::<Vec<_>>()
    };
    let from_csv = summarize(&opscope::mine::load(&csv).unwrap());
    let from_pq = summarize(&opscope::mine::load(&pq).unwrap());
    let from_mem = summarize(&opscope::mine::series_from_rows(&memory.rows()));
    assert!(!from_mem.is_empty());
    assert_eq!(from_csv, from_mem);
    assert_eq!(from_pq, from_mem);
}

#[test]
fn a_file_that_is_not_a_recording_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.csv");
    std::fs::write(&p, "a,b\n1,2\n").unwrap();
    let e = opscope::mine::load(&p).err().expect("error").to_string();
    assert!(e.contains("not an opscope recording"), "{e}");
    let q = dir.path().join("x.parquet");
    std::fs::write(&q, "not parquet").unwrap();
    let e = opscope::mine::load(&q).err().expect("error").to_string();
    let want = if cfg!(feature = "parquet") { "not a readable Parquet recording" } else { "cargo feature `parquet`" };
    assert!(e.contains(want), "{e}");
}

#[test]
fn the_miner_says_no_data_and_flags_non_finite_values() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.csv");
    let p = Pipeline::parse("matmul").unwrap();
    let g = matmul_2d(2, 3, 2);
    let never = matmul_3d(1, 2, 3, 2);
    opscope::scope(&p, opscope::recording::open(&path).unwrap(), || {
        let s = rlx_runtime::Session::new(rlx_runtime::Device::Cpu);
        let _compiled_never_run = s.compile(never.clone());
        let mut c = s.compile(g.clone());
        c.set_param("w", &[1.0; 6]);
        c.run(&[("x", &[1.0, f32::NAN, 2.0, 3.0, f32::INFINITY, 0.5])]);
    })
    .unwrap();
    let series = opscope::mine::load(&path).unwrap();
    let verdicts = opscope::mine::mine(&series);
    assert!(verdicts.iter().any(|v| v.kind == opscope::mine::HEALTH && v.role == "lhs"), "{verdicts:?}");
    let no_data = opscope::mine::no_data(&path, &series).unwrap();
    assert!(no_data.iter().any(|l| l.ends_with("/lhs: no data")), "{no_data:?}");
}
