//! Parquet recordings (`arrow` + `parquet` crates, cargo feature `parquet`): the same tidy
//! table as the CSV sink, one row group per run, strings dictionary-encoded, Snappy-compressed.
//! Columnar and typed, so a miner reads values without parsing text. The reader also takes
//! Parquet files that pandas or polars wrote back (plain or dictionary strings, any codec the
//! `parquet` crate reads).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::UInt64Builder;
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::error::Error;
use crate::manifest::Manifest;

use super::format::{check_path, partial_path as partial, write_sidecar, Block, ColumnType, Row, COLUMNS};
use super::read::RowRef;
use super::sink::Sink;
use super::RecordingError;

fn dict() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

/// The Arrow schema of a recording, built from [`COLUMNS`].
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(
        COLUMNS
            .iter()
            .map(|c| {
                let t = match c.ty {
                    ColumnType::Text => dict(),
                    ColumnType::U32 => DataType::UInt32,
                    ColumnType::U64 => DataType::UInt64,
                    ColumnType::F32 => DataType::Float32,
                };
                Field::new(c.name, t, c.nullable)
            })
            .collect::<Vec<_>>(),
    ))
}

/// A Parquet recording plus the JSON manifest sidecar, with the CSV sink's lifecycle: rows go
/// to `<path>.partial` (one row group per run, written at each flush), `finish` closes the
/// file, syncs and renames it; a sink dropped unfinished leaves `.partial`.
pub struct ParquetSink {
    path: PathBuf,
    writer: Option<ArrowWriter<File>>,
    pending: Columns,
    manifests: Vec<Manifest>,
}

impl ParquetSink {
    /// Create the recording. Errors as [`super::CsvSink::create`].
    pub fn create(path: impl AsRef<Path>) -> Result<ParquetSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let tmp = partial(&path);
        let file = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        let writer = ArrowWriter::try_new(file, schema(), Some(writer_properties()))
            .map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet writer: {e}") })?;
        Ok(ParquetSink {
            path,
            writer: Some(writer),
            pending: Columns::default(),
            manifests: Vec::new(),
        })
    }
}

/// A text column being built: dictionary keys per row, the distinct strings in key order.
/// Strings are interned by pointer first (the recorder shares one `Arc<str>` per name), then by
/// value, so a block costs one lookup per text column, not one per row.
#[derive(Default)]
struct TextColumn {
    keys: Vec<i32>,
    strings: Vec<Arc<str>>,
    by_value: std::collections::HashMap<Arc<str>, i32>,
    /// The last string interned and its key: consecutive blocks of one tensor share most names.
    last: Option<(Arc<str>, i32)>,
}

impl TextColumn {
    fn key(&mut self, s: &Arc<str>) -> i32 {
        if let Some((l, k)) = &self.last {
            if Arc::ptr_eq(l, s) || **l == **s {
                return *k;
            }
        }
        let k = match self.by_value.get(s) {
            Some(&k) => k,
            None => {
                let k = self.strings.len() as i32;
                self.strings.push(s.clone());
                self.by_value.insert(s.clone(), k);
                k
            }
        };
        self.last = Some((s.clone(), k));
        k
    }

    fn push(&mut self, s: &Arc<str>, n: usize) {
        let k = self.key(s);
        self.keys.extend(std::iter::repeat_n(k, n));
    }

    fn take(&mut self) -> ArrayRef {
        let keys = arrow_array::Int32Array::from(std::mem::take(&mut self.keys));
        let values = arrow_array::StringArray::from_iter_values(self.strings.iter().map(|s| &**s));
        self.strings.clear();
        self.by_value.clear();
        self.last = None;
        Arc::new(arrow_array::DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).expect("keys index the strings pushed"))
    }
}

/// Rows being gathered for one Arrow batch of [`schema`], column by column. A [`Block`] is
/// appended with one dictionary lookup per text column and a fill of its keys; only `idx` and
/// `value` are written per row.
#[derive(Default)]
pub(super) struct Columns {
    /// run_id, graph, pass, site, op, role, stat, shape (the text columns in [`COLUMNS`] order).
    text: [TextColumn; 8],
    compile: Vec<u32>,
    step: Vec<u64>,
    pass_idx: Vec<u32>,
    idx: Vec<u64>,
    value: Vec<f32>,
    numel: UInt64Builder,
    flops: UInt64Builder,
}

impl Columns {
    /// Rows gathered so far.
    pub(super) fn len(&self) -> usize {
        self.value.len()
    }

    /// No row gathered.
    pub(super) fn is_empty(&self) -> bool {
        self.value.is_empty()
    }

    fn push_keys(&mut self, b: &Block<'_>, n: usize) {
        for (c, s) in self.text.iter_mut().zip([b.run_id, b.graph, b.pass, b.site, b.op, b.role, b.stat, b.shape]) {
            c.push(s, n);
        }
        self.compile.extend(std::iter::repeat_n(b.compile, n));
        self.step.extend(std::iter::repeat_n(b.step, n));
        self.pass_idx.extend(std::iter::repeat_n(b.pass_idx, n));
        for (col, v) in [(&mut self.numel, b.numel), (&mut self.flops, b.flops)] {
            match v {
                Some(v) => col.append_value_n(v, n),
                None => col.append_nulls(n),
            }
        }
    }

    /// Append the rows of `b` (its non-NaN values).
    pub(super) fn push_block(&mut self, b: &Block<'_>) {
        let start = self.value.len();
        for (i, &x) in b.values.iter().enumerate() {
            if !x.is_nan() {
                self.idx.push(i as u64);
                self.value.push(x);
            }
        }
        let n = self.value.len() - start;
        if n > 0 {
            self.push_keys(b, n);
        }
    }

    /// Append one row.
    pub(super) fn push_row(&mut self, r: &Row) {
        let b = Block {
            run_id: &r.run_id,
            compile: r.compile,
            step: r.step,
            graph: &r.graph,
            pass: &r.pass,
            pass_idx: r.pass_idx,
            site: &r.site,
            op: &r.op,
            role: &r.role,
            stat: &r.stat,
            numel: r.numel,
            shape: &r.shape,
            flops: r.flops,
            values: &[],
        };
        self.idx.push(r.idx);
        self.value.push(r.value);
        self.push_keys(&b, 1);
    }

    /// The gathered rows as one batch; the columns are left empty.
    pub(super) fn take_batch(&mut self) -> Result<RecordBatch, Error> {
        let mut text = self.text.iter_mut().map(TextColumn::take);
        let mut t = || text.next().expect("eight text columns");
        let u32s = |v: &mut Vec<u32>| Arc::new(arrow_array::UInt32Array::from(std::mem::take(v))) as ArrayRef;
        let u64s = |v: &mut Vec<u64>| Arc::new(arrow_array::UInt64Array::from(std::mem::take(v))) as ArrayRef;
        // In COLUMNS order.
        let columns: Vec<ArrayRef> = vec![
            t(),
            u32s(&mut self.compile),
            u64s(&mut self.step),
            t(),
            t(),
            u32s(&mut self.pass_idx),
            t(),
            t(),
            t(),
            t(),
            u64s(&mut self.idx),
            Arc::new(arrow_array::Float32Array::from(std::mem::take(&mut self.value))),
            Arc::new(self.numel.finish()),
            t(),
            Arc::new(self.flops.finish()),
        ];
        RecordBatch::try_new(schema(), columns).map_err(|e| Error::Internal(format!("arrow batch: {e}")))
    }
}

/// Rows per data page (best effort: checked after each write batch of 1024 rows); see
/// [`writer_properties`].
const PAGE_ROWS: usize = 4096;

/// The writer settings of every Parquet recording (measured on MiniLM's real `matmul`
/// sketches by `lab/benches/recorder.rs`; the README's recorder table):
///
/// - Snappy pages (the Parquet and Spark default; Zstd level 1 saved another 11% of the bytes
///   at 15% less throughput).
/// - Text columns dictionary-encoded (a run's names repeat over all its values), without
///   min/max statistics: computing them (two string comparisons per row and column) took 40% of
///   the writer's time. A row group is one run of one compile, so `run_id`, `graph` (and `pass`
///   in a one-pass pipeline) are constant in it and their ranges could skip row groups in a
///   filter such as `WHERE graph = 'x'`; filter on `compile` (statistics kept; the sidecar maps
///   compiles to graphs) or on the `recording` partition instead. Results are the same either
///   way; only such a scan reads more.
/// - `value`: BYTE_STREAM_SPLIT without a dictionary (float bytes split into four streams, so
///   Snappy finds the repeated exponents; a dictionary of distinct floats only costs a hash per
///   value): 6.76 -> 4.73 bytes per row.
/// - `idx`, `step`, `compile`, `pass_idx`: DELTA_BINARY_PACKED without a dictionary (runs of
///   0, 1, 2, ... and constants cost almost no bits): 4.73 -> 3.40 bytes per row, and 2.5 -> 4.3
///   M rows/s with the rest.
/// - At most about 4096 rows per data page ([`PAGE_ROWS`]; the crate's default is 20 000): a
///   text column's dictionary indices wait as 8-byte integers until their page is encoded, so
///   a page's rows cost 8 x 8 bytes of heap. Measured on the chain MLP at L=16 (10 runs): the
///   tapped process's peak heap 9.98 -> 7.69 MB, 7.26 MB with the dataset sink encoding every
///   4096 rows (untapped 4.54 MB); on MiniLM 3.40 -> 3.61 bytes per row (more page headers
///   and dictionary-index runs).
///
/// Both encodings are in the Parquet format since 2.8 and read by pyarrow, DuckDB, polars,
/// DataFusion and Spark 3.3+ (a test reads every recording column back through DuckDB).
pub(super) fn writer_properties() -> WriterProperties {
    let text = COLUMNS.iter().filter(|c| c.ty == ColumnType::Text).map(|c| c.name);
    let b = WriterProperties::builder().set_compression(Compression::SNAPPY).set_data_page_row_count_limit(PAGE_ROWS);
    let b = text.fold(b, |b, c| b.set_column_statistics_enabled(ColumnPath::from(c), EnabledStatistics::None));
    let b = b.set_column_dictionary_enabled("value".into(), false).set_column_encoding("value".into(), Encoding::BYTE_STREAM_SPLIT);
    ["idx", "step", "compile", "pass_idx"]
        .into_iter()
        .fold(b, |b, c| b.set_column_dictionary_enabled(c.into(), false).set_column_encoding(c.into(), Encoding::DELTA_BINARY_PACKED))
        .build()
}

impl Sink for ParquetSink {
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        rows.iter().for_each(|r| self.pending.push_row(r));
        Ok(())
    }

    fn write_block(&mut self, block: &Block<'_>) -> Result<(), Error> {
        self.pending.push_block(block);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Error> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = self.pending.take_batch()?;
        let w = self.writer.as_mut().ok_or_else(|| Error::Internal("write after finish".into()))?;
        let path = partial(&self.path);
        w.write(&batch).map_err(|e| Error::Write { path: path.clone(), why: format!("parquet write: {e}") })?;
        // One row group per run keeps the writer's memory bounded by one run.
        w.flush().map_err(|e| Error::Write { path, why: format!("parquet flush: {e}") })
    }

    fn finish(&mut self) -> Result<(), Error> {
        if self.close()? {
            let tmp = partial(&self.path);
            std::fs::rename(&tmp, &self.path).map_err(|e| Error::Io { path: self.path.clone(), error: e })?;
            write_sidecar(&self.path, std::mem::take(&mut self.manifests))?;
        }
        Ok(())
    }

    fn abandon(&mut self) -> Result<(), Error> {
        if self.close()? {
            write_sidecar(&partial(&self.path), std::mem::take(&mut self.manifests))?;
        }
        Ok(())
    }
}

impl ParquetSink {
    /// Write the pending rows and the footer, sync `<path>.partial`. False if already closed.
    fn close(&mut self) -> Result<bool, Error> {
        self.flush()?;
        let Some(w) = self.writer.take() else { return Ok(false) };
        let tmp = partial(&self.path);
        let file = w.into_inner().map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet close: {e}") })?;
        file.sync_all().map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        Ok(true)
    }
}

impl Drop for ParquetSink {
    /// Dropped unfinished: leave `<path>.partial` (without a footer it is not a valid Parquet
    /// file; the CSV sink keeps partial rows readable) and say so.
    fn drop(&mut self) {
        if self.writer.is_some() {
            eprintln!("opscope: recording not finished; partial data is in {}", partial(&self.path).display());
        }
    }
}

/// Where a Parquet file being read comes from, for what its missing footer means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    /// A file named by the user (a single-file recording, or a part read alone).
    File,
    /// A closed part of a dataset: complete when its writer renamed it into place.
    ClosedPart,
}

/// A Parquet file starts and ends with the magic `PAR1`; the footer (schema, row groups) is
/// written last, when the file is closed. A file that starts with it and does not end with it
/// was being written when its process stopped, or (a closed part of a dataset) was cut since:
/// say so, rather than a decoder's message.
fn check_footer(path: &Path, file: &File, origin: Origin) -> Result<(), Error> {
    use std::io::{Read, Seek, SeekFrom};
    let io = |e| Error::Io { path: path.to_path_buf(), error: e };
    let len = file.metadata().map_err(io)?.len();
    let mut f = file;
    let mut head = [0u8; 4];
    if len < 4 || f.read_exact(&mut head).is_err() || &head != b"PAR1" {
        return Ok(()); // not Parquet at all: the decoder's own error names it
    }
    let mut tail = [0u8; 4];
    let ends = len >= 12 && f.seek(SeekFrom::End(-4)).is_ok() && f.read_exact(&mut tail).is_ok() && &tail == b"PAR1";
    f.seek(SeekFrom::Start(0)).map_err(io)?;
    if !ends {
        return Err(RecordingError {
            path: path.to_path_buf(),
            line: None,
            reason: match origin {
                Origin::File => format!(
                    "no Parquet footer ({len} bytes, not ending in PAR1): the file was not closed, probably the process was \
                     killed while writing it; its rows cannot be read. In a dataset directory the earlier parts \
                     (part-*.parquet) are intact: read the directory"
                ),
                // A closed part was complete when its writer renamed it: damaged since (a cut
                // copy, a failing disk). Nothing of it is read; the fix is the user's choice.
                Origin::ClosedPart => format!(
                    "this closed part of the dataset has no Parquet footer ({len} bytes, not ending in PAR1): it was \
                     complete when its writer closed it, so it was cut or damaged since (a copy interrupted, a failing \
                     disk); its rows cannot be read. Move it out of the dataset (or restore it) to read the other parts"
                ),
            },
        }
        .into());
    }
    Ok(())
}

/// A text column: per row, its string (our dictionary encoding, or any other string type cast
/// to plain UTF-8).
enum Text {
    Dict(Vec<i32>, arrow_array::StringArray),
    Plain(arrow_array::StringArray),
}

impl Text {
    fn get(&self, i: usize) -> &str {
        match self {
            Text::Dict(k, v) => v.value(k[i] as usize),
            Text::Plain(v) => v.value(i),
        }
    }
}

/// Stream the rows of a Parquet recording to `f`.
///
/// Files written back by pandas or polars are read too: any string type (dictionary with any
/// key type, large or view strings) is cast to UTF-8, any integer or float type to the column's
/// type (`arrow_cast::cast` in its safe mode: a value that does not fit is an error, not a wrap),
/// and Snappy and Zstd compression are decoded (pandas and polars defaults).
///
/// Errors: the file cannot be opened or is not Parquet or has no footer (the message says what
/// that means for its `origin`), a recording column is missing, holds
/// another kind of value, or holds a null or unrepresentable value where the format has none.
pub(super) fn read(path: &Path, origin: Origin, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
    use arrow_array::Array;
    let bad = |reason: String| RecordingError { path: path.to_path_buf(), line: None, reason };
    let file = File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    check_footer(path, &file, origin)?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.with_batch_size(1 << 16).build())
        .map_err(|e| bad(format!("not a readable Parquet recording: {e}")))?;
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("reading: {e}")))?;
        let column = |name: &str| batch.column_by_name(name).ok_or_else(|| bad(format!("no '{name}' column: not an opscope recording")));
        // `c` cast to `to`; nulls only where `nullable` (a failed safe cast is a null too).
        let cast = |name: &str, to: DataType, nullable: bool| -> Result<ArrayRef, RecordingError> {
            let c = column(name)?;
            let numeric = |t: &DataType| t.is_integer() || t.is_floating();
            let text = |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
            let ok = match (c.data_type(), &to) {
                (DataType::Dictionary(_, v), DataType::Utf8) => text(v),
                (t, DataType::Utf8) => text(t),
                (t, _) => numeric(t),
            };
            if !ok {
                return Err(bad(format!("column '{name}' holds {}, not the recording's {to}", c.data_type())));
            }
            let nulls_before = c.null_count();
            let out = if *c.data_type() == to { c.clone() } else { arrow_cast::cast(c, &to).map_err(|e| bad(format!("column '{name}': {e}")))? };
            if !nullable && out.null_count() > 0 || out.null_count() > nulls_before {
                return Err(bad(format!(
                    "column '{name}' has {} empty or out-of-range value(s) for {to}: was the file edited? Write integers and text back unchanged",
                    out.null_count()
                )));
            }
            Ok(out)
        };
        let text = |name: &str| -> Result<Text, RecordingError> {
            let c = column(name)?;
            if let DataType::Dictionary(k, v) = c.data_type() {
                if **k == DataType::Int32 && **v == DataType::Utf8 && c.null_count() == 0 {
                    let d = c.as_dictionary::<Int32Type>();
                    return Ok(Text::Dict(d.keys().values().to_vec(), d.values().as_string::<i32>().clone()));
                }
            }
            Ok(Text::Plain(cast(name, DataType::Utf8, false)?.as_string::<i32>().clone()))
        };
        let (site, role, op, shape, stat) = (text("site")?, text("role")?, text("op")?, text("shape")?, text("stat")?);
        let pass = cast("pass_idx", DataType::UInt32, false)?;
        let compile = cast("compile", DataType::UInt32, false)?;
        let step = cast("step", DataType::UInt64, false)?;
        let idx = cast("idx", DataType::UInt64, false)?;
        let value = cast("value", DataType::Float32, false)?;
        let flops = cast("flops", DataType::UInt64, true)?;
        let (pass, compile) = (pass.as_primitive::<UInt32Type>(), compile.as_primitive::<UInt32Type>());
        let (step, idx, flops) = (step.as_primitive::<UInt64Type>(), idx.as_primitive::<UInt64Type>(), flops.as_primitive::<UInt64Type>());
        let value = value.as_primitive::<Float32Type>();
        for i in 0..batch.num_rows() {
            f(RowRef {
                site: site.get(i),
                role: role.get(i),
                pass_idx: pass.value(i),
                op: op.get(i),
                shape: shape.get(i),
                flops: flops.is_valid(i).then(|| flops.value(i)),
                compile: compile.value(i),
                step: step.value(i),
                stat: stat.get(i),
                idx: idx.value(i),
                value: value.value(i),
            });
        }
    }
    Ok(())
}
