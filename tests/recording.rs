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
        assert!(rows.iter().all(|r| &*r.site == "matmul.0" && r.flops == Some(2 * 4 * 6 * 3)));
        // x[4,6] @ w[6,3] -> [4,3]: each role's own shape and element count on every row.
        for r in &rows {
            let want = match &*r.role {
                "lhs" => ("[4,6]", 24),
                "rhs" => ("[6,3]", 18),
                "out" => ("[4,3]", 12),
                other => panic!("{name}: role {other}"),
            };
            assert_eq!((&*r.shape, r.numel), (want.0, Some(want.1)), "{name}: {} {}", r.role, r.stat);
        }
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

/// A FIFO at the path is refused, not replaced by the recording's rename (its reader would
/// wait forever on the unlinked pipe); it is left in place.
#[test]
fn a_fifo_at_the_path_is_refused_and_left_in_place() {
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.csv");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let msg = CsvSink::create(&fifo).err().expect("refused").to_string();
    assert!(msg.contains("not a regular file") && msg.contains("FIFO"), "{msg}");
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(!dir.path().join("pipe.csv.partial").exists(), "nothing written beside it");
}

struct FailingSink;

impl Sink for FailingSink {
    fn manifest(&mut self, _: &std::sync::Arc<Manifest>) -> Result<(), Error> {
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
    // An empty file says so, not that a column is missing.
    let empty = dir.path().join("empty.csv");
    std::fs::write(&empty, b"").unwrap();
    let e = opscope::mine::load(&empty).err().expect("error").to_string();
    assert!(e.contains("the file is empty (0 bytes)"), "{e}");
    // Recording to it: a Parquet recording is a directory, never written over the file.
    let e = opscope::recording::open(&q).err().expect("refused").to_string();
    assert!(e.contains("a Parquet recording is a dataset directory") && e.contains("move the file away"), "{e}");
    assert_eq!(std::fs::read(&q).unwrap(), b"not parquet");
}

/// A recording renamed to the wrong format (a `.csv.gz` copied to `.csv`, a plain CSV to
/// `.csv.gz`, a Parquet file to `.csv`) is refused with the format found and the name to give
/// it; given that name, the same bytes load.
#[test]
fn a_recording_named_as_another_format_is_refused_with_the_name_to_give_it() {
    let dir = tempfile::tempdir().unwrap();
    let (gz, plain) = (dir.path().join("rec.csv.gz"), dir.path().join("rec.csv"));
    run_into(Box::new(CsvSink::create(&gz).unwrap())).unwrap();
    run_into(Box::new(CsvSink::create(&plain).unwrap())).unwrap();
    let mut cases = vec![(gz.clone(), "gz_as.csv", "gzip-compressed", "name it .csv.gz", "gz_renamed.csv.gz")];
    cases.push((plain.clone(), "plain_as.csv.gz", "not gzip-compressed", "name it .csv", "plain_renamed.csv"));
    #[cfg(feature = "parquet")]
    {
        let ds = dir.path().join("ds.parquet");
        run_into(opscope::recording::open(&ds).unwrap()).unwrap();
        let part = opscope::recording::partitions(&ds).unwrap().remove(0).parts.remove(0);
        cases.push((part, "part_as.csv", "a Parquet file", "name it .parquet", "part_renamed.parquet"));
    }
    for (src, wrong, found, fix, right) in cases {
        let at = dir.path().join(wrong);
        std::fs::copy(&src, &at).unwrap();
        let e = opscope::mine::load(&at).err().unwrap_or_else(|| panic!("{wrong} loaded")).to_string();
        assert!(e.contains(found) && e.contains(fix) && e.contains(wrong), "{wrong}: {e}");
        let renamed = dir.path().join(right);
        std::fs::rename(&at, &renamed).unwrap();
        let series = opscope::mine::load(&renamed).unwrap_or_else(|e| panic!("{right}: {e}"));
        assert!(!series.is_empty(), "{right}");
    }
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
    // A damaged sidecar is an error naming both fixes; without one, a note says what is unknown.
    let side = opscope::recording::sidecar_path(&path);
    std::fs::write(&side, b"{\"format\": 1, \"gra").unwrap();
    let err = opscope::mine::no_data(&path, &series).unwrap_err().to_string();
    assert!(err.contains("manifest sidecar is damaged") && err.contains("restore it") && err.contains("move it away"), "{err}");
    std::fs::remove_file(&side).unwrap();
    assert_eq!(opscope::mine::no_data(&path, &series).unwrap(), Vec::<String>::new());
    let note = opscope::mine::sidecar_note(&path).unwrap().expect("a note");
    assert!(note.starts_with("no manifest sidecar") && note.contains("r.csv.manifest.json"), "{note}");
}

/// Every row of a Parquet file, or of every `*.parquet` file under a dataset directory (by
/// path), read with the parquet and arrow crates directly (not opscope's reader), by column
/// name, text cast to UTF-8.
#[cfg(feature = "parquet")]
fn parquet_rows_independently(path: &std::path::Path) -> Vec<Row> {
    if path.is_dir() {
        let mut files = Vec::new();
        let mut stack = vec![path.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|e| e == "parquet") {
                    files.push(p);
                }
            }
        }
        files.sort();
        assert!(!files.is_empty(), "no parquet file under {}", path.display());
        return files.iter().flat_map(|f| parquet_rows_independently(f)).collect();
    }
    parquet_rows_selected(path, None)
}

/// [`parquet_rows_independently`] of one file, reading its page index (required: the offset
/// index of every column, as readers that skip pages need it) and, given `select` =
/// `(skip, take)`, only those rows through a row selection (pages located by that index).
#[cfg(feature = "parquet")]
fn parquet_rows_selected(path: &std::path::Path, select: Option<(usize, usize)>) -> Vec<Row> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
    use arrow_array::Array;
    use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection, RowSelector};
    use std::sync::Arc;
    use parquet::file::metadata::PageIndexPolicy;
    let file = std::fs::File::open(path).unwrap();
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Required);
    let mut builder = ParquetRecordBatchReaderBuilder::try_new_with_options(file, options).unwrap();
    if let Some((skip, take)) = select {
        builder = builder.with_row_selection(RowSelection::from(vec![RowSelector::skip(skip), RowSelector::select(take)]));
    }
    let reader = builder.build().unwrap();
    let mut rows = Vec::new();
    for batch in reader {
        let b = batch.unwrap();
        let text = |n: &str| arrow_cast::cast(b.column_by_name(n).unwrap(), &arrow_schema::DataType::Utf8).unwrap();
        let cols: Vec<_> = ["run_id", "graph", "pass", "site", "op", "role", "stat", "shape"].iter().map(|n| text(n)).collect();
        let s = |c: usize, i: usize| -> Arc<str> { Arc::from(cols[c].as_string::<i32>().value(i)) };
        let u32c = |n: &str| b.column_by_name(n).unwrap().as_primitive::<UInt32Type>().clone();
        let u64c = |n: &str| b.column_by_name(n).unwrap().as_primitive::<UInt64Type>().clone();
        let (compile, pass_idx) = (u32c("compile"), u32c("pass_idx"));
        let (step, idx, numel, flops) = (u64c("step"), u64c("idx"), u64c("numel"), u64c("flops"));
        let value = b.column_by_name("value").unwrap().as_primitive::<Float32Type>().clone();
        for i in 0..b.num_rows() {
            rows.push(Row {
                run_id: s(0, i),
                compile: compile.value(i),
                step: step.value(i),
                graph: s(1, i),
                pass: s(2, i),
                pass_idx: pass_idx.value(i),
                site: s(3, i),
                op: s(4, i),
                role: s(5, i),
                stat: s(6, i),
                idx: idx.value(i),
                value: value.value(i),
                numel: numel.is_valid(i).then(|| numel.value(i)),
                shape: s(7, i),
                flops: flops.is_valid(i).then(|| flops.value(i)),
            });
        }
    }
    rows
}

/// The fields `read_rows` gives, of every row of `path`.
#[cfg(feature = "parquet")]
fn read_back(path: &std::path::Path) -> Vec<(String, String, u32, String, String, Option<u64>, u32, u64, String, u64, f32)> {
    let mut v = Vec::new();
    opscope::recording::read_rows(path, |r| {
        v.push((r.site.into(), r.role.into(), r.pass_idx, r.op.into(), r.shape.into(), r.flops, r.compile, r.step, r.stat.into(), r.idx, r.value))
    })
    .unwrap();
    v
}

#[test]
#[cfg(feature = "parquet")]
fn csv_parquet_and_memory_hold_every_column_of_every_row_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (csv, gz, pq) = (dir.path().join("r.csv"), dir.path().join("r.csv.gz"), dir.path().join("r.parquet"));
    let memory = opscope::MemorySink::default();
    let sinks: Vec<Box<dyn Sink>> = vec![
        opscope::recording::open(&csv).unwrap(),
        opscope::recording::open(&gz).unwrap(),
        opscope::recording::open(&pq).unwrap(),
        Box::new(memory.clone()),
    ];
    run_into(Box::new(opscope::recording::Tee(sinks))).unwrap();
    let want = memory.rows();
    assert!(want.len() > 30 && want.iter().any(|r| r.idx > 0), "{}", want.len());
    let from_csv: Vec<Row> = csv::Reader::from_path(&csv).unwrap().deserialize().collect::<Result<_, _>>().unwrap();
    let gz_reader = flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap());
    let from_gz: Vec<Row> = csv::Reader::from_reader(gz_reader).deserialize().collect::<Result<_, _>>().unwrap();
    assert_eq!(from_csv, want, "CSV, every column");
    assert_eq!(from_gz, want, "CSV.gz, every column");
    assert_eq!(parquet_rows_independently(&pq), want, "Parquet read by the arrow crates, every column");
    // opscope's own reader agrees with all of them.
    let fields = |rows: &[Row]| -> Vec<_> {
        rows.iter()
            .map(|r| (r.site.to_string(), r.role.to_string(), r.pass_idx, r.op.to_string(), r.shape.to_string(), r.flops, r.compile, r.step, r.stat.to_string(), r.idx, r.value))
            .collect()
    };
    for p in [&csv, &gz, &pq] {
        assert_eq!(read_back(p), fields(&want), "{}", p.display());
    }
}

#[test]
#[cfg(feature = "parquet")]
fn parquet_written_back_by_pandas_and_polars_is_read_and_mined() {
    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("r.parquet");
    let memory = opscope::MemorySink::default();
    run_into(Box::new(opscope::recording::Tee(vec![opscope::recording::open(&pq).unwrap(), Box::new(memory.clone())]))).unwrap();
    let (by_pandas, by_polars) = (dir.path().join("pandas.parquet"), dir.path().join("polars.parquet"));
    // What a user does: load, filter, save (pandas: pyarrow strings, Snappy; polars: view
    // strings, Zstd).
    let script = r#"
import sys, pandas as pd, polars as pl
src, a, b = sys.argv[1:4]
df = pd.read_parquet(src)  # a dataset directory (pyarrow adds the hive column `recording`)
df[df["role"] != "out"].to_parquet(a, index=False)
pl.read_parquet(src + "/**/*.parquet").filter(pl.col("role") != "out").write_parquet(b)
"#;
    let st = std::process::Command::new("python3").args(["-c", script]).arg(&pq).arg(&by_pandas).arg(&by_polars).status().expect("python3 runs");
    assert!(st.success(), "pandas/polars (pip install -r scripts/requirements-test.txt)");
    let codec = |p: &std::path::Path| {
        use parquet::file::reader::FileReader;
        let r = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(p).unwrap()).unwrap();
        r.metadata().row_group(0).column(0).compression().to_string()
    };
    assert!(codec(&by_pandas).starts_with("SNAPPY"), "{}", codec(&by_pandas));
    assert!(codec(&by_polars).starts_with("ZSTD"), "{}", codec(&by_polars));
    let kept: Vec<Row> = memory.rows().into_iter().filter(|r| &*r.role != "out").collect();
    let want = opscope::mine::series_from_rows(&kept);
    for p in [&by_pandas, &by_polars] {
        let fields: Vec<_> = read_back(p);
        assert_eq!(fields.len(), kept.len(), "{}", p.display());
        assert_eq!(fields.iter().map(|f| f.10).collect::<Vec<_>>(), kept.iter().map(|r| r.value).collect::<Vec<_>>());
        let got = opscope::mine::load(p).unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{}", p.display());
        for (k, s) in &got {
            let w = &want[k];
            assert_eq!((s.runs.len(), &s.shape, s.flops), (w.runs.len(), &w.shape, w.flops));
            for (a, b) in s.runs.iter().zip(&w.runs) {
                assert_eq!(a.vector(opscope::sketch::tensor::HIST), b.vector(opscope::sketch::tensor::HIST));
                assert_eq!(a.scalar(opscope::sketch::tensor::MAX), b.scalar(opscope::sketch::tensor::MAX));
            }
        }
    }
}

/// One block of the property test below: indices into the string pool for the eight text
/// columns, the integer keys, and the values (NaN elements are not rows).
#[cfg(feature = "parquet")]
type BlockCase = ([usize; 8], (u32, u64, u32), (Option<u64>, Option<u64>), Vec<f32>, bool);

#[cfg(feature = "parquet")]
mod parquet_round_trip {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn block_case() -> impl Strategy<Value = BlockCase> {
        let value = prop_oneof![
            4 => any::<f32>(),
            1 => Just(f32::NAN),
            1 => prop::sample::select(vec![0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE / 4.0, f32::MAX]),
        ];
        (
            prop::array::uniform8(0usize..64),
            (any::<u32>(), any::<u64>(), any::<u32>()),
            (prop::option::of(any::<u64>()), prop::option::of(any::<u64>())),
            prop::collection::vec(value, 0..40),
            any::<bool>(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The Parquet sink's own key-column encoder (dictionary pages and run-length keys,
        /// `recording::rowgroup`) against the `parquet` crate's decoder: any strings (empty,
        /// any Unicode; up to 64 distinct a column), any integers (the u32 and u64 extremes,
        /// empty numel and flops in any pattern), any f32 bits, through the block path and the
        /// row path mixed in a run, over several runs: every column of every row reads back
        /// as written, in order, and so does a row selection in the middle read through the
        /// page index (which the file must have).
        #[test]
        fn every_column_of_every_row_reads_back_as_written(
            pool in prop::collection::vec(".{0,12}", 64),
            runs in prop::collection::vec(prop::collection::vec(block_case(), 0..30), 1..4),
        ) {
            let pool: Vec<Arc<str>> = pool.iter().map(|s| Arc::from(s.as_str())).collect();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("r.parquet");
            // The single-file sink (a `.parquet` path given to `recording::open` is a dataset
            // directory of such files, written by the same row-group writer).
            let mut sink = opscope::recording::ParquetSink::create(&path).unwrap();
            let mut want = Vec::new();
            for (step, blocks) in runs.iter().enumerate() {
                for (t, (compile, step_key, pass_idx), (numel, flops), values, by_rows) in blocks {
                    let b = opscope::recording::Block {
                        run_id: &pool[t[0]],
                        compile: *compile,
                        step: step_key.wrapping_add(step as u64),
                        graph: &pool[t[1]],
                        pass: &pool[t[2]],
                        pass_idx: *pass_idx,
                        site: &pool[t[3]],
                        op: &pool[t[4]],
                        role: &pool[t[5]],
                        stat: &pool[t[6]],
                        numel: *numel,
                        shape: &pool[t[7]],
                        flops: *flops,
                        values,
                    };
                    let rows: Vec<Row> = b.rows().collect();
                    if *by_rows { sink.write(&rows).unwrap() } else { sink.write_block(&b).unwrap() }
                    want.extend(rows);
                }
                sink.flush().unwrap();
            }
            sink.finish().unwrap();
            let (skip, take) = (want.len() / 3, want.len() / 3);
            for (got, want) in [(parquet_rows_independently(&path), &want[..]), (parquet_rows_selected(&path, Some((skip, take))), &want[skip..skip + take])] {
                prop_assert_eq!(got.len(), want.len());
                for (g, w) in got.iter().zip(want) {
                    // f32 compared by bits (the values include -0.0 and subnormals).
                    prop_assert_eq!(g.value.to_bits(), w.value.to_bits());
                    let mut g = g.clone();
                    g.value = w.value;
                    prop_assert_eq!(&g, w);
                }
            }
        }
    }
}

/// The single-file Parquet sink and a dataset's part write a run larger than `GROUP_ROWS` rows
/// as several row groups (so the pages it holds stay bounded), and every row still reads back, in order, through
/// the parquet crate directly: a run of 150 000 rows (blocks of 10 000 values, by the block and
/// the row path) then a run of 3 rows make three row groups: 140 000 rows (the block that
/// reached `GROUP_ROWS`), the run's last 10 000, and the small run's 3.
#[cfg(feature = "parquet")]
#[test]
fn a_large_run_is_split_into_row_groups_and_reads_back_whole() {
    use std::sync::Arc;
    // A row group is written once a run's rows reach GROUP_ROWS (at a block's end).
    assert!(opscope::recording::GROUP_ROWS > 130_000 && opscope::recording::GROUP_ROWS <= 140_000);
    // The single-file sink, then a dataset's part (its own spill, the same bound).
    for dataset in [false, true] {
    let dir = tempfile::tempdir().unwrap();
    let (mut sink, path): (Box<dyn Sink>, _) = if dataset {
        let root = dir.path().join("big.parquet");
        let sink = opscope::recording::DatasetSink::create(&root, opscope::recording::PartLimits { runs: 100, bytes: u64::MAX }).unwrap();
        (Box::new(sink), root.join("recording=r").join("part-00000.parquet"))
    } else {
        let path = dir.path().join("big.parquet");
        (Box::new(opscope::recording::ParquetSink::create(&path).unwrap()), path)
    };
    let s = |x: &str| Arc::<str>::from(x);
    let (run_id, graph, pass, site, op, role, stat, shape) = (s("r"), s("g"), s("matmul"), s("matmul.0"), s("MatMul"), s("out"), s("elemsig"), s("[10000]"));
    let mut want = Vec::new();
    for (step, blocks, len) in [(0u64, 15usize, 10_000usize), (1, 1, 3)] {
        for k in 0..blocks {
            let values: Vec<f32> = (0..len).map(|i| (step * 1_000_000 + (k * len + i) as u64) as f32 * 0.5).collect();
            let b = opscope::recording::Block {
                run_id: &run_id,
                compile: 1,
                step,
                graph: &graph,
                pass: &pass,
                pass_idx: 0,
                site: &site,
                op: &op,
                role: &role,
                stat: &stat,
                numel: Some(len as u64),
                shape: &shape,
                flops: None,
                values: &values,
            };
            let rows: Vec<Row> = b.rows().collect();
            if k % 2 == 0 { sink.write_block(&b).unwrap() } else { sink.write(&rows).unwrap() }
            want.extend(rows);
        }
        sink.flush().unwrap();
    }
    sink.finish().unwrap();
    let meta = parquet::file::reader::FileReader::metadata(&parquet::file::serialized_reader::SerializedFileReader::new(std::fs::File::open(&path).unwrap()).unwrap())
        .row_groups()
        .iter()
        .map(|g| g.num_rows())
        .collect::<Vec<_>>();
    assert_eq!(meta, vec![140_000, 10_000, 3], "two row groups for the large run, one for the small (dataset: {dataset})");
    // `idx` and `value` are written in data pages of PAGE_ROWS rows plus less than one write
    // batch of the crate (1024 rows), a row group's last page fewer (the bound on the writer's
    // page buffers), read from the file's offset index.
    let options = parquet::file::serialized_reader::ReadOptionsBuilder::new().with_page_index().build();
    let reader = parquet::file::serialized_reader::SerializedFileReader::new_with_options(std::fs::File::open(&path).unwrap(), options).unwrap();
    let md = parquet::file::reader::FileReader::metadata(&reader);
    let schema = md.file_metadata().schema_descr();
    let (page, batch) = (opscope::recording::PAGE_ROWS as i64, parquet::file::properties::DEFAULT_WRITE_BATCH_SIZE as i64);
    for (g, group) in md.row_groups().iter().enumerate() {
        for name in ["idx", "value"] {
            let c = (0..schema.num_columns()).find(|&c| schema.column(c).name() == name).unwrap();
            let index = md.page_index_for_row_group(g);
            let locations = index.page_locations(c).expect("an offset index");
            let firsts: Vec<i64> = locations.iter().map(|p| p.first_row_index).chain([group.num_rows()]).collect();
            let sizes: Vec<i64> = firsts.windows(2).map(|w| w[1] - w[0]).collect();
            let (last, full) = sizes.split_last().unwrap();
            assert!(full.iter().all(|n| (page..page + batch).contains(n)), "row group {g}, `{name}`: pages {sizes:?}");
            assert!(*last > 0 && *last < page + batch, "row group {g}, `{name}`: pages {sizes:?}");
        }
    }
    assert!(md.row_group(0).num_rows() > 30 * opscope::recording::PAGE_ROWS as i64, "the large group spans many pages");
    let got = parquet_rows_independently(&path);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "every row reads back as written, in order");
    }
}

/// A file holding the rows of two recordings (two CSV recordings concatenated; two recorders'
/// rows written into one Parquet file) is refused by name, with both run_ids and the fix: mined
/// as one file, the second recording's runs, keyed by the same (compile, step), replaced the
/// first's without a word (found by a helper: `mine` of the two gave the second's numbers alone).
#[test]
fn a_file_holding_two_recordings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.csv"), dir.path().join("b.csv"));
    run_into(Box::new(CsvSink::create(&a).unwrap())).unwrap();
    run_into(Box::new(CsvSink::create(&b).unwrap())).unwrap();
    let rows = |p: &std::path::Path| {
        let mut n = 0usize;
        opscope::recording::read_rows(p, |_| n += 1).map(|()| n)
    };
    let (na, nb) = (rows(&a).unwrap(), rows(&b).unwrap());
    assert_eq!(na, nb);
    let (ta, tb) = (std::fs::read_to_string(&a).unwrap(), std::fs::read_to_string(&b).unwrap());
    let both = dir.path().join("both.csv");
    std::fs::write(&both, format!("{ta}{}", tb.split_once('\n').unwrap().1)).unwrap();
    let run_id = |t: &str| t.lines().nth(1).unwrap().split(',').next().unwrap().to_string();
    let (ra, rb) = (run_id(&ta), run_id(&tb));
    assert_ne!(ra, rb);
    let err = rows(&both).unwrap_err().to_string();
    assert!(err.contains("more than one recording") && err.contains(&ra) && err.contains(&rb) && err.contains("--append"), "{err}");
    let err = opscope::mine::load_compact(&both).unwrap_err().to_string();
    assert!(err.contains("more than one recording"), "{err}");

    #[cfg(feature = "parquet")]
    {
        let (ma, mb) = (opscope::MemorySink::default(), opscope::MemorySink::default());
        run_into(Box::new(ma.clone())).unwrap();
        run_into(Box::new(mb.clone())).unwrap();
        let path = dir.path().join("both.parquet");
        let mut sink = opscope::recording::ParquetSink::create(&path).unwrap();
        sink.write(&ma.rows()).unwrap();
        sink.flush().unwrap();
        sink.write(&mb.rows()).unwrap();
        sink.finish().unwrap();
        let err = rows(&path).unwrap_err().to_string();
        assert!(err.contains("more than one recording"), "{err}");
        let one = dir.path().join("one.parquet");
        let mut sink = opscope::recording::ParquetSink::create(&one).unwrap();
        sink.write(&ma.rows()).unwrap();
        sink.finish().unwrap();
        assert_eq!(rows(&one).unwrap(), ma.rows().len());
    }
}

/// Two recordings that reach one dataset with the same recording id (two processes of one PID
/// in one second, before ids had random bits) never share a partition: the second is refused
/// at its first part, naming the clash, and the first keeps every row. Fresh ids differ.
#[cfg(feature = "parquet")]
#[test]
fn a_second_recording_with_the_same_id_never_replaces_the_first_in_a_dataset() {
    use opscope::recording::{DatasetSink, PartLimits};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("d.parquet");
    let sink = || {
        let mut s = DatasetSink::create(&root, PartLimits { runs: 1, bytes: 1 << 30 }).unwrap();
        s.recording_id("run-1-1-1").unwrap();
        Box::new(s)
    };
    run_into(sink()).unwrap();
    let mut before = 0;
    opscope::recording::read_rows(&root, |_| before += 1).unwrap();
    assert!(before > 0);
    let err = run_into(sink()).unwrap_err().to_string();
    assert!(err.contains("already holds a partition of recording id 'run-1-1-1'"), "{err}");
    let mut after = 0;
    opscope::recording::read_rows(&root, |_| after += 1).unwrap();
    assert_eq!(after, before, "the first recording's rows are all there");
    assert_eq!(opscope::recording::partitions(&root).unwrap().len(), 1);
    // Fresh ids end in 32 random bits (8 hex digits), not only a per-process counter: two
    // processes with one PID in one second differ there (equal with probability 2^-32).
    let suffix = |id: String| id.rsplit('-').next().unwrap().to_string();
    let (a, b) = (suffix(opscope::recording::new_run_id()), suffix(opscope::recording::new_run_id()));
    assert!(a.len() == 8 && a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
    assert_ne!(a, b);
}

/// Every row `read_rows` gives of `path`, or its error.
fn read_all(path: &std::path::Path) -> Result<Vec<(String, u64, String, u64, u32)>, Error> {
    let mut v = Vec::new();
    opscope::recording::read_rows(path, |r| v.push((r.site.into(), r.step, r.stat.into(), r.idx, r.value.to_bits())))?;
    Ok(v)
}

/// A byte changed in a closed CSV recording (a disk, a transfer) is an error naming the file
/// and its checksum, never another value read in silence; so is a cut between two rows, which
/// no row shows. Without the checksum (a recording from before it) both read "fine".
#[test]
fn a_csv_recording_damaged_after_it_was_closed_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.csv");
    run_into(opscope::recording::open(&path).unwrap()).unwrap();
    let side = opscope::recording::sidecar_path(&path);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // The sidecar's checksum is the file's (crc32 from flate2's own crc module: another code path).
    let mut crc = flate2::Crc::new();
    crc.update(&bytes);
    assert_eq!(doc["checksum"]["bytes"], bytes.len() as u64);
    assert_eq!(doc["checksum"]["crc32"], crc.sum() as u64);
    let good = read_all(&path).unwrap();
    // A digit of a value (the twelfth field) changed: the same length, another number.
    let text = String::from_utf8(bytes.clone()).unwrap();
    let mut line_start = 0;
    let at = text
        .split_inclusive('\n')
        .find_map(|line| {
            let start = line_start;
            line_start += line.len();
            if start == 0 {
                return None; // the header
            }
            let field = line.match_indices(',').nth(10).map(|(i, _)| i + 1)?;
            let end = field + line[field..].find(',')?;
            line[field..end].bytes().position(|b| (b'1'..=b'8').contains(&b)).map(|i| start + field + i)
        })
        .unwrap();
    let mut damaged = bytes.clone();
    damaged[at] += 1;
    std::fs::write(&path, &damaged).unwrap();
    let err = read_all(&path).unwrap_err().to_string();
    assert!(err.contains("r.csv") && err.contains("changed since it was closed") && err.contains(&format!("{:08x}", crc.sum())), "{err}");
    // A cut at a row boundary: whole rows, fewer of them.
    let cut = bytes[..bytes.len() - 1].iter().rposition(|&b| b == b'\n').unwrap() + 1;
    std::fs::write(&path, &bytes[..cut]).unwrap();
    let err = read_all(&path).unwrap_err().to_string();
    assert!(err.contains(&format!("holds {cut} bytes, and held {}", bytes.len())), "{err}");
    // What a reader without the checksum gets: a wrong value, or a run short of rows.
    let mut old = doc.clone();
    old.as_object_mut().unwrap().remove("checksum");
    std::fs::write(&side, serde_json::to_vec(&old).unwrap()).unwrap();
    assert_eq!(read_all(&path).unwrap().len(), good.len() - 1, "the cut is silent without the checksum");
    std::fs::write(&path, &damaged).unwrap();
    let silent = read_all(&path).unwrap();
    assert_eq!(silent.len(), good.len());
    assert_ne!(silent, good, "the changed digit is read as another value without the checksum");
    // Restored, it reads as before.
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(read_all(&path).unwrap(), good);
    // Through a symbolic link elsewhere (no sidecar beside the link), the target's checksum
    // still applies.
    let elsewhere = tempfile::tempdir().unwrap();
    let link = elsewhere.path().join("link.csv");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert_eq!(read_all(&link).unwrap(), good);
    std::fs::write(&path, &damaged).unwrap();
    let err = read_all(&link).unwrap_err().to_string();
    assert!(err.contains("changed since it was closed"), "through a link: {err}");
}

/// A Parquet dataset of `run_into`'s two runs, one part a run: the temporary directory (kept
/// alive by the caller), the dataset root and its one partition directory.
#[cfg(feature = "parquet")]
fn one_run_parts() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("d.parquet");
    let sink = opscope::recording::DatasetSink::create(&root, opscope::recording::PartLimits { runs: 1, bytes: u64::MAX }).unwrap();
    run_into(Box::new(sink)).unwrap();
    let part_dir = std::fs::read_dir(&root).unwrap().next().unwrap().unwrap().path();
    (dir, root, part_dir)
}

/// Without a checksum to catch it first (a sidecar that lists none), a damaged part reaches the
/// `parquet` decoder, which panics on some damaged pages: every single-bit change of every byte
/// of a part reads as rows or as an error naming the file, never as a panic out of the reader.
#[test]
#[cfg(feature = "parquet")]
fn every_flipped_bit_of_an_unchecked_parquet_part_is_rows_or_an_error_never_a_panic() {
    let (_dir, _root, part_dir) = one_run_parts();
    let (part, side) = (part_dir.join("part-00000.parquet"), part_dir.join("_manifest.json"));
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    doc.as_object_mut().unwrap().remove("parts");
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    let bytes = std::fs::read(&part).unwrap();
    let (mut errors, mut decoder) = (0, 0);
    let mut panicked = Vec::new();
    for at in 0..bytes.len() {
        for bit in [0x01u8, 0x80] {
            let mut d = bytes.clone();
            d[at] ^= bit;
            std::fs::write(&part, &d).unwrap();
            match std::panic::catch_unwind(|| read_all(&part)) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let e = e.to_string();
                    assert!(e.contains("part-00000.parquet"), "byte {at} ^ {bit:#x}: the error names the file: {e}");
                    errors += 1;
                    decoder += e.contains("decoder failed") as usize;
                }
                Err(_) => panicked.push((at, bit)),
            }
        }
    }
    assert!(panicked.is_empty(), "{} of {} flips panicked out of the reader: {:?}", panicked.len(), 2 * bytes.len(), &panicked[..panicked.len().min(10)]);
    assert!(errors > 0, "some flip is an error");
    eprintln!("{} bytes: {errors} flips read as errors, {decoder} of them the decoder's panic caught", bytes.len());
}

/// The same for a closed part of a Parquet dataset, whose pages carry no CRC (the `parquet`
/// crate does not write one): a flipped byte that the decoder reads as other values is an
/// error naming the part, read in the dataset or alone; moved out of the dataset, the other
/// parts are read and it is named as missing.
#[test]
#[cfg(feature = "parquet")]
fn a_parquet_part_damaged_after_it_was_closed_is_an_error() {
    let (dir, root, part_dir) = one_run_parts();
    let (part, side) = (part_dir.join("part-00000.parquet"), part_dir.join("_manifest.json"));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    let bytes = std::fs::read(&part).unwrap();
    let mut crc = flate2::Crc::new();
    crc.update(&bytes);
    assert_eq!(doc["parts"]["part-00000.parquet"]["crc32"], crc.sum() as u64, "{doc}");
    assert_eq!(doc["parts"]["part-00001.parquet"]["bytes"], std::fs::metadata(part_dir.join("part-00001.parquet")).unwrap().len());
    let good = read_all(&root).unwrap();
    // Find a byte whose flip the decoder reads in silence as other rows (the failure the
    // checksum exists for): it must exist, or the checksum guards nothing.
    let mut unchecked = doc.clone();
    unchecked.as_object_mut().unwrap().remove("parts");
    let silent = (4..bytes.len() - 8).find_map(|at| {
        let mut d = bytes.clone();
        d[at] ^= 0x01;
        std::fs::write(&part, &d).unwrap();
        std::fs::write(&side, serde_json::to_vec(&unchecked).unwrap()).unwrap();
        let quiet = read_all(&root).is_ok_and(|rows| rows.len() == good.len() && rows != good);
        std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
        quiet.then_some(d)
    });
    let damaged = silent.expect("some flipped byte reads as other values without the checksum");
    std::fs::write(&part, &damaged).unwrap();
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("part-00000.parquet") && err.contains("changed since it was closed") && err.contains("move it out of the dataset"), "{err}");
    let err = read_all(&part).unwrap_err().to_string();
    assert!(err.contains("changed since it was closed"), "read alone: {err}");
    // Read through a symbolic link, the part is checked against its partition's sidecar.
    let link = dir.path().join("link.parquet");
    std::os::unix::fs::symlink(&part, &link).unwrap();
    let err = read_all(&link).unwrap_err().to_string();
    assert!(err.contains("changed since it was closed"), "through a link: {err}");
    // Moved out of the dataset: the other part is read.
    std::fs::rename(&part, dir.path().join("aside.bin")).unwrap();
    let rest = read_all(&root).unwrap();
    assert!(!rest.is_empty() && rest.len() < good.len());
    // Restored, and the partition copied into the dataset (a backup left beside it): its runs
    // would be counted twice, so it is refused, naming both.
    std::fs::write(&part, &bytes).unwrap();
    assert_eq!(read_all(&root).unwrap(), good);
    let copy = root.join("recording=copy");
    std::fs::create_dir(&copy).unwrap();
    for f in std::fs::read_dir(&part_dir).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("copied into the dataset twice") && err.contains("recording=copy"), "{err}");
}

/// A recording the checksum cannot guard (its `checksum` removed, as the error for a file
/// changed on purpose suggests; a CSV written back by pandas) is still refused by the miner when
/// one of its rows appears twice with another value (the later row used to win in silence: a
/// density of 1.0 read as 0.002), or names an `idx` its tensor cannot have; the clean file mines.
#[test]
fn a_duplicated_row_or_an_impossible_idx_is_refused_by_the_miner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.csv");
    run_into(opscope::recording::open(&path).unwrap()).unwrap();
    let side = opscope::recording::sidecar_path(&path);
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
    doc.as_object_mut().unwrap().remove("checksum");
    std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(opscope::mine::load(&path).is_ok());
    let header: Vec<&str> = text.lines().next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (stat, value, idx) = (col("stat"), col("value"), col("idx"));
    let row = text.lines().skip(1).find(|l| l.split(',').nth(stat) == Some("max")).unwrap();
    let with = |f: usize, v: &str| -> String {
        let mut cells: Vec<&str> = row.split(',').collect();
        cells[f] = v;
        cells.join(",")
    };
    for (extra, want) in [(with(value, "12345"), "has two rows for stat 'max' idx 0"), (with(idx, "9999999"), "has idx 9999999 for stat 'max'")] {
        std::fs::write(&path, format!("{text}{extra}\n")).unwrap();
        let err = opscope::mine::load(&path).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
}

/// A dataset recording writes each compile's manifest once, in files of its own
/// (`_graphs-NNNNNN.json`, NNNNNN the first compile a file holds), each listed in the
/// partition's `_manifest.json` with its count and checksum, and written before the part that
/// needs it is renamed into place. Before, `_manifest.json` held every manifest and was
/// rewritten at each part's close: time quadratic in the compiles (`benches/recompile.rs`).
/// Read back, the manifests are the recorder's, in compile order; a listed file damaged or
/// missing is an error naming it, and an unlisted one is ignored.
#[test]
#[cfg(feature = "parquet")]
fn a_dataset_writes_each_manifest_once_and_reads_them_back_in_compile_order() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("d.parquet");
    let memory = opscope::MemorySink::default();
    let sink = opscope::recording::DatasetSink::create(&root, opscope::recording::PartLimits { runs: 2, bytes: u64::MAX }).unwrap();
    let tee = opscope::recording::Tee(vec![Box::new(memory.clone()), Box::new(sink)]);
    let p = Pipeline::parse("matmul{stats=[max]}").unwrap();
    // Seven compiles of three shapes (so that the manifests differ), run 1, 2 or 3 times: parts
    // of two runs close in the middle of a compile's runs and after several compiles.
    opscope::scope(&p, Box::new(tee), || {
        for i in 0..7usize {
            let (m, k, n) = (2 + i % 3, 3 + i, 2);
            let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(matmul_2d(m, k, n));
            c.set_param("w", &randn(k * n, i as u64));
            for _ in 0..1 + i % 3 {
                c.run(&[("x", &randn(m * k, 7))]);
            }
        }
    })
    .unwrap();
    let part_dir = std::fs::read_dir(&root).unwrap().next().unwrap().unwrap().path();
    let side: serde_json::Value = serde_json::from_slice(&std::fs::read(part_dir.join("_manifest.json")).unwrap()).unwrap();
    assert_eq!(side["graphs"], serde_json::json!([]), "no manifest inline: {side}");
    let files = side["graph_files"].as_array().unwrap();
    assert!(files.len() > 1, "the manifests of later compiles went to later files: {side}");
    let mut on_disk = Vec::new();
    for f in files {
        let name = f["file"].as_str().unwrap();
        assert_eq!(name, format!("_graphs-{:06}.json", on_disk.len() + 1), "named by its first compile");
        let bytes = std::fs::read(part_dir.join(name)).unwrap();
        assert_eq!(f["checksum"]["bytes"], bytes.len() as u64);
        let mut crc = flate2::Crc::new();
        crc.update(&bytes);
        assert_eq!(f["checksum"]["crc32"], crc.sum() as u64);
        let held: Vec<serde_json::Value> = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(f["entries"], held.len() as u64);
        on_disk.extend(held);
    }
    // Each manifest once, in compile order, equal to what the recorder gave the sinks.
    let want: Vec<serde_json::Value> = memory.manifests().iter().map(|m| serde_json::to_value(m).unwrap()).collect();
    assert_eq!(want.len(), 7);
    assert_eq!(on_disk, want);
    let read = opscope::recording::read_sidecar(&root).unwrap().unwrap();
    assert_eq!(read.graphs.iter().map(|m| serde_json::to_value(&**m).unwrap()).collect::<Vec<_>>(), want);
    assert_eq!(read.graphs.iter().map(|m| m.compile).collect::<Vec<_>>(), (1..=7).collect::<Vec<u32>>());
    let rows = read_all(&root).unwrap();
    assert_eq!(rows.len(), memory.rows().len());
    // An unlisted file (a write whose `_manifest.json` never followed) is ignored.
    std::fs::write(part_dir.join("_graphs-000099.json"), b"[]").unwrap();
    assert_eq!(read_all(&root).unwrap(), rows);
    // A listed file damaged, then missing: an error naming it, for the rows and the sidecar.
    let first = part_dir.join(files[0]["file"].as_str().unwrap());
    let good = std::fs::read(&first).unwrap();
    let mut bad = good.clone();
    bad[good.len() / 2] ^= 0x01;
    std::fs::write(&first, &bad).unwrap();
    for err in [read_all(&root).unwrap_err().to_string(), opscope::recording::read_sidecar(&root).unwrap_err().to_string()] {
        assert!(err.contains("_graphs-000001.json") && err.contains("damaged") && err.contains("restore it"), "{err}");
    }
    std::fs::remove_file(&first).unwrap();
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("_graphs-000001.json") && err.contains("is missing") && err.contains("copy it again"), "{err}");
    std::fs::write(&first, &good).unwrap();
    assert_eq!(read_all(&root).unwrap(), rows);
    // Listed twice or out of order (a hand edit): refused, naming the file expected.
    let side_path = part_dir.join("_manifest.json");
    let original = std::fs::read(&side_path).unwrap();
    let mut edited = side.clone();
    let list = edited["graph_files"].as_array_mut().unwrap();
    list.swap(0, 1);
    std::fs::write(&side_path, serde_json::to_vec(&edited).unwrap()).unwrap();
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("where the recording's next one is '_graphs-000001.json'"), "{err}");
    std::fs::write(&side_path, &original).unwrap();
    // What a copy taken while the recording was written holds: a `_manifest.json` listing a
    // manifest file that the copy lacks, with none of the parts that need it. The parts present
    // are read, with a note.
    let last = files.last().unwrap();
    let first_missing: u32 = last["file"].as_str().unwrap()[8..14].parse().unwrap();
    std::fs::remove_file(part_dir.join(last["file"].as_str().unwrap())).unwrap();
    let mut kept = 0;
    for part in std::fs::read_dir(&part_dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "parquet")) {
        let mut max = 0;
        opscope::recording::read_rows(&part, |r| max = max.max(r.compile)).unwrap();
        if max >= first_missing {
            std::fs::remove_file(&part).unwrap();
        } else {
            kept += 1;
        }
    }
    assert!(kept > 0);
    let copy = read_all(&root).unwrap();
    assert!(!copy.is_empty() && copy.len() < rows.len() && copy.iter().all(|r| rows.contains(r)));
}

/// A long recording's part checksums and manifest files move out of `_manifest.json`
/// (rewritten at every part's close) into index files, `ENTRIES_PER_INDEX_FILE` entries at a
/// time, so that the sidecar stays bounded; every part is still verified against its checksum,
/// in the dataset and read alone, and a damaged index file is an error naming it.
#[test]
#[cfg(feature = "parquet")]
fn index_files_keep_the_sidecar_bounded_and_every_part_is_still_verified() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("d.parquet");
    let sink = opscope::recording::DatasetSink::create(&root, opscope::recording::PartLimits { runs: 1, bytes: u64::MAX }).unwrap().entries_per_index_file(3);
    let p = Pipeline::parse("matmul{stats=[max]}").unwrap();
    let (g, w, x) = (matmul_2d(4, 6, 3), randn(18, 1), randn(24, 2));
    opscope::scope(&p, Box::new(sink), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &w);
        for _ in 0..8 {
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    let part_dir = std::fs::read_dir(&root).unwrap().next().unwrap().unwrap().path();
    let side: serde_json::Value = serde_json::from_slice(&std::fs::read(part_dir.join("_manifest.json")).unwrap()).unwrap();
    assert_eq!(side["format"], 2);
    // 8 parts and 1 manifest file, 3 entries an index file: at most 2 left in the sidecar.
    let index = side["index_files"].as_array().unwrap();
    let names: Vec<&str> = index.iter().map(|f| f["file"].as_str().unwrap()).collect();
    assert_eq!(names, ["_index-00000.json", "_index-00001.json", "_index-00002.json"], "{side}");
    let mut listed: std::collections::BTreeMap<String, serde_json::Value> = side["parts"].as_object().cloned().unwrap_or_default().into_iter().collect();
    let mut graph_files: Vec<serde_json::Value> = Vec::new();
    let mut where_listed = std::collections::BTreeMap::new();
    for f in index {
        let bytes = std::fs::read(part_dir.join(f["file"].as_str().unwrap())).unwrap();
        let mut crc = flate2::Crc::new();
        crc.update(&bytes);
        assert_eq!((f["checksum"]["bytes"].as_u64(), f["checksum"]["crc32"].as_u64()), (Some(bytes.len() as u64), Some(crc.sum() as u64)));
        let block: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let parts = block["parts"].as_object().unwrap();
        assert_eq!(f["entries"], (parts.len() + block["graph_files"].as_array().unwrap().len()) as u64);
        for (k, v) in parts {
            where_listed.insert(k.clone(), f["file"].as_str().unwrap().to_string());
            listed.insert(k.clone(), v.clone());
        }
        graph_files.extend(block["graph_files"].as_array().unwrap().iter().cloned());
    }
    graph_files.extend(side["graph_files"].as_array().cloned().unwrap_or_default());
    assert_eq!(graph_files.iter().map(|f| f["file"].as_str().unwrap()).collect::<Vec<_>>(), ["_graphs-000001.json"]);
    for n in 0..8 {
        let name = format!("part-{n:05}.parquet");
        let mut crc = flate2::Crc::new();
        crc.update(&std::fs::read(part_dir.join(&name)).unwrap());
        assert_eq!(listed[&name]["crc32"], crc.sum() as u64, "{name}");
    }
    assert_eq!(listed.len(), 8);
    let good = read_all(&root).unwrap();
    let alone: usize = (0..8).map(|n| read_all(&part_dir.join(format!("part-{n:05}.parquet"))).unwrap().len()).sum();
    assert_eq!(good.len(), alone, "each part verified and read alone, their rows are the dataset's");
    // A part whose checksum is in a file: damaged, it is an error in the dataset and read alone.
    let part = part_dir.join("part-00001.parquet");
    let bytes = std::fs::read(&part).unwrap();
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x01;
    for damaged in [&bytes[..bytes.len() - 1], &flipped[..]] {
        std::fs::write(&part, damaged).unwrap();
        for err in [read_all(&root).unwrap_err().to_string(), read_all(&part).unwrap_err().to_string()] {
            assert!(err.contains("part-00001.parquet") && err.contains("it was closed") && err.contains(&where_listed["part-00001.parquet"]), "{err}");
        }
    }
    std::fs::write(&part, &bytes).unwrap();
    // A part copied in under a name no file or the sidecar lists is refused, as before.
    std::fs::copy(&part, part_dir.join("part-00042.parquet")).unwrap();
    assert!(read_all(&root).unwrap_err().to_string().contains("not a part this recording wrote"));
    std::fs::remove_file(part_dir.join("part-00042.parquet")).unwrap();
    // An index file damaged: an error naming it.
    let sums = part_dir.join("_index-00001.json");
    let text = std::fs::read(&sums).unwrap();
    std::fs::write(&sums, &text[..text.len() - 2]).unwrap();
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("_index-00001.json") && err.contains("damaged"), "{err}");
    std::fs::write(&sums, &text).unwrap();
    assert_eq!(read_all(&root).unwrap(), good);
    // A copy taken while the recording ran may lack the index file written during the copy
    // (its `_manifest.json` was copied after it): the sidecar lists the last index file's
    // entries too, so the copy reads whole. An earlier index file missing is an error.
    let last = part_dir.join("_index-00002.json");
    let kept = std::fs::read(&last).unwrap();
    std::fs::remove_file(&last).unwrap();
    assert_eq!(read_all(&root).unwrap(), good);
    assert_eq!(read_all(&part_dir.join("part-00007.parquet")).unwrap().len() > 0, true, "a part listed in the lost index reads alone");
    std::fs::write(&last, &kept).unwrap();
    let earlier = part_dir.join("_index-00001.json");
    let kept = std::fs::read(&earlier).unwrap();
    std::fs::remove_file(&earlier).unwrap();
    let err = read_all(&root).unwrap_err().to_string();
    assert!(err.contains("_index-00001.json") && err.contains("is missing"), "{err}");
    std::fs::write(&earlier, &kept).unwrap();
    // Directories named `_...` or `.…` are skipped, as Spark and pyarrow skip them: a part kept
    // there (a backup, a job's temporary output) is not read as a second recording's.
    for skipped in ["_backup", ".trash"] {
        let aside = root.join(skipped).join("recording=old");
        std::fs::create_dir_all(&aside).unwrap();
        std::fs::copy(part_dir.join("part-00000.parquet"), aside.join("part-00000.parquet")).unwrap();
    }
    assert_eq!(read_all(&root).unwrap(), good);
}

/// A sidecar of a later recording format than this opscope reads is refused with the reason,
/// CSV and dataset alike, rather than read with its new fields taken as absent.
#[test]
#[cfg(feature = "parquet")]
fn a_sidecar_of_a_later_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("r.csv");
    run_into(opscope::recording::open(&csv).unwrap()).unwrap();
    let root = dir.path().join("d.parquet");
    run_into(Box::new(opscope::recording::DatasetSink::create(&root, opscope::recording::PartLimits::DEFAULT).unwrap())).unwrap();
    let partition = std::fs::read_dir(&root).unwrap().next().unwrap().unwrap().path();
    for (recording, side) in [(csv.clone(), opscope::recording::sidecar_path(&csv)), (root.clone(), partition.join("_manifest.json"))] {
        let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&side).unwrap()).unwrap();
        assert_eq!(doc["format"], opscope::recording::FORMAT);
        doc["format"] = (opscope::recording::FORMAT + 1).into();
        std::fs::write(&side, serde_json::to_vec(&doc).unwrap()).unwrap();
        let err = opscope::recording::read_sidecar(&recording).unwrap_err().to_string();
        assert!(err.contains("written by a later opscope") && err.contains(&format!("format {}", opscope::recording::FORMAT + 1)), "{err}");
    }
}
