//! Parquet recordings (`arrow` + `parquet` crates, cargo feature `parquet`): the same tidy
//! table as the CSV sink, one row group per run (split every [`GROUP_ROWS`] rows), strings dictionary-encoded (by
//! [`super::rowgroup`]), values Snappy-compressed.
//! Columnar and typed, so a miner reads values without parsing text. The reader also takes
//! Parquet files that pandas or polars wrote back (plain or dictionary strings, any codec the
//! `parquet` crate reads).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::ArrayRef;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::basic::{Compression, Encoding};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::error::Error;
use crate::manifest::Manifest;

use super::dataset::GROUP_ROWS;
use super::format::{check_path, partial_path as partial, write_sidecar_ending, Block, ColumnType, Row, COLUMNS};
use super::rowgroup::{ParquetFile, RowGroup};
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
/// to `<path>.partial` (one row group per run, written at each flush, and every [`GROUP_ROWS`]
/// rows of a larger run, so the encoded pages held stay bounded), `finish` closes the
/// file, syncs and renames it; a sink dropped unfinished leaves `.partial`.
pub struct ParquetSink {
    path: PathBuf,
    writer: Option<ParquetFile>,
    pending: RowGroup,
    manifests: Vec<std::sync::Arc<Manifest>>,
    /// The closed file's length and CRC-32, for its sidecar ([`super::Sidecar::checksum`]).
    checksum: Option<super::checksum::Checksum>,
}

impl ParquetSink {
    /// Create the recording. Errors as [`super::CsvSink::create`].
    pub fn create(path: impl AsRef<Path>) -> Result<ParquetSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let tmp = partial(&path);
        let file = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        let writer = ParquetFile::create(file).map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet writer: {e}") })?;
        Ok(ParquetSink {
            path,
            writer: Some(writer),
            pending: RowGroup::new().map_err(|e| Error::Internal(format!("parquet schema: {e}")))?,
            manifests: Vec::new(),
            checksum: None,
        })
    }
}

/// Rows in a data page of `idx` and `value`: the crate closes a page at the first write batch
/// (of at most its default 1024 rows) that brings it to this many, so a page holds `PAGE_ROWS`
/// to `PAGE_ROWS + 1023` rows, a row group's last one fewer. The crate encodes and compresses a
/// page at a time, and its buffers grow to a page: the byte-stream-split buffer and its flushed
/// copy, and Snappy's output. At its default 20 000 rows they were 0.45 MB of the 1.23 MB of
/// extra peak heap of the chain MLP tapped at L = 16 (`heaptrack`, `benches/chain_mlp.rs`, one
/// child process per variant); at 4096 rows the extra is 0.95 MB (heap 1.27x -> 1.21x
/// tapped/untapped), for 3.50 bytes a row on MiniLM's sketches instead of 3.40 and no change in
/// rows a second beyond the noise (`lab/benches/recorder.rs`, the two settings alternated in
/// one sitting, 2026-12-04; `lab/COST.md`). 1024 rows saved 0.07 MB more for 3.73 bytes a row
/// and a third fewer rows a second.
pub const PAGE_ROWS: usize = 4096;

/// The writer settings of every Parquet recording (measured on MiniLM's real `matmul`
/// sketches by `lab/benches/recorder.rs`; the README's recorder table). The thirteen key
/// columns are encoded by [`super::rowgroup`] (dictionary pages and run-length keys, one lookup
/// per block); these settings are what the crate's own column writers apply to `idx` and
/// `value`, and the Parquet schema the properties describe for all fifteen:
///
/// - Snappy pages for `idx` and `value` (the Parquet and Spark default; Zstd level 1 saved
///   another 11% of the bytes at 15% less throughput). The key columns' pages are stored
///   uncompressed: a block's keys are one run of a few bytes.
/// - Text columns dictionary-encoded (a run's names repeat over all its values), without
///   min/max statistics: computing them (two string comparisons per row and column) took 40% of
///   the crate's writer time when it encoded them. A row group is one run of one compile, so
///   `run_id`, `graph` (and `pass` in a one-pass pipeline) are constant in it and their ranges
///   could skip row groups in a filter such as `WHERE graph = 'x'`; filter on `compile`
///   (statistics kept; the sidecar maps compiles to graphs) or on the `recording` partition
///   instead. Results are the same either way; only such a scan reads more.
/// - `value`: BYTE_STREAM_SPLIT without a dictionary (float bytes split into four streams, so
///   Snappy finds the repeated exponents; a dictionary of distinct floats only costs a hash per
///   value): 6.76 -> 4.73 bytes per row.
/// - `idx`: DELTA_BINARY_PACKED without a dictionary (runs of 0, 1, 2, ... cost almost no
///   bits): 4.73 -> 3.40 bytes per row with the integer key columns (then encoded the same way;
///   as run-length dictionary keys now, 3.38).
/// - Data pages of about [`PAGE_ROWS`] rows (the crate's default is 20 000 rows or 1 MiB).
///
/// Both encodings are in the Parquet format since 2.8 and read by pyarrow, DuckDB, polars,
/// DataFusion and Spark 3.3+ (a test reads every recording column back through DuckDB and
/// pyarrow).
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
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let res = rows.iter().try_for_each(|r| self.pending.push_row(r));
        res.map_err(|e| Error::Internal(format!("encoding a run: {e}")))?;
        self.spill()
    }

    fn write_block(&mut self, block: &Block<'_>) -> Result<(), Error> {
        self.pending.push_block(block).map_err(|e| Error::Internal(format!("encoding a run: {e}")))?;
        self.spill()
    }

    fn flush(&mut self) -> Result<(), Error> {
        if self.pending.rows() == 0 {
            return Ok(());
        }
        let w = self.writer.as_mut().ok_or_else(|| Error::Internal("write after finish".into()))?;
        // One row group per run, or per GROUP_ROWS rows of it (`spill`).
        w.write_group(&mut self.pending).map_err(|e| Error::Write { path: partial(&self.path), why: format!("parquet write: {e}") })
    }

    /// As [`super::CsvSink`]'s finish: the sidecar is written in full (beside, synced) before
    /// anything is renamed, and the earlier recording's sidecar removed before the file is
    /// renamed over it, so no moment pairs the new file with the earlier sidecar (whose checksum
    /// would call it damaged).
    fn finish(&mut self) -> Result<(), Error> {
        if self.close()? {
            let tmp = partial(&self.path);
            let side = super::format::sidecar_path(&self.path);
            let side_tmp = partial(&side);
            let json = super::format::sidecar_json(std::mem::take(&mut self.manifests), false, self.checksum)?;
            super::format::write_synced(&side_tmp, &json).map_err(|e| Error::Write {
                path: side.clone(),
                why: format!("writing the manifest sidecar: {e}; the recording is complete at {}", tmp.display()),
            })?;
            match std::fs::remove_file(&side) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::Io { path: side, error: e }),
                _ => {}
            }
            std::fs::rename(&tmp, &self.path).map_err(|e| Error::Io { path: self.path.clone(), error: e })?;
            std::fs::rename(&side_tmp, &side).map_err(|e| Error::Io { path: side.clone(), error: e })?;
        }
        Ok(())
    }

    fn abandon(&mut self) -> Result<(), Error> {
        if self.close()? {
            write_sidecar_ending(&partial(&self.path), std::mem::take(&mut self.manifests), false, self.checksum)?;
        }
        Ok(())
    }
}

impl ParquetSink {
    /// A run's rows so far reached [`GROUP_ROWS`]: write them as a row group now (as the
    /// dataset sink does), so the pages held in memory stay bounded whatever a run holds.
    fn spill(&mut self) -> Result<(), Error> {
        if self.pending.rows() >= GROUP_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    /// Write the pending rows and the footer, sync `<path>.partial`. False if already closed.
    fn close(&mut self) -> Result<bool, Error> {
        self.flush()?;
        let Some(w) = self.writer.take() else { return Ok(false) };
        let tmp = partial(&self.path);
        let (file, checksum) = w.finish().map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet close: {e}") })?;
        file.sync_all().map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        self.checksum = Some(checksum);
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
    let file = match origin {
        // A single-file recording's checksum is in its own sidecar; a dataset's part read alone
        // has its in the partition's. Before the footer: a file cut since it was closed says
        // so, not that its writer was killed. The rows are read through the handle checked.
        Origin::File => {
            let opened = super::format::open_checked(
                path,
                "restore it from a copy (a file changed on purpose: remove `checksum` from its sidecar)",
                false,
            )?;
            super::dataset::verify_part(&opened.file, path)?;
            opened.file
        }
        // A dataset's reader verifies its parts itself ([`read_open`]).
        Origin::ClosedPart => File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?,
    };
    read_open(path, file, origin, f)
}

/// [`read`] from `file`, opened at `path` (which names it in errors), unchecked: the caller has
/// verified the handle against its checksum, if it has one.
///
/// Errors: as [`read`].
pub(super) fn read_open(path: &Path, file: File, origin: Origin, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
    use arrow_array::Array;
    let bad = |reason: String| RecordingError { path: path.to_path_buf(), line: None, reason };
    check_footer(path, &file, origin)?;
    // The `parquet` crate panics on some damaged data (a flipped byte in a page) instead of
    // returning an error; a file without a checksum to catch the damage first reaches it. The
    // decoder's calls are caught and reported as the damage they are; `f` is not inside them.
    let decoder_failed = || {
        bad("the Parquet decoder failed on this file's data (it panicked): the file is damaged, a changed or cut byte its \
             sidecar has no checksum to find; restore it from a copy, or move it out of the recording to read the rest"
            .to_string())
    };
    let mut reader = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).and_then(|b| b.with_batch_size(1 << 16).build())
    }))
    .map_err(|_| decoder_failed())?
    .map_err(|e| bad(format!("not a readable Parquet recording: {e}")))?;
    let mut first_run: Option<String> = None;
    while let Some(batch) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reader.next())).map_err(|_| decoder_failed())? {
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
                    let (keys, values) = (d.keys().values().to_vec(), d.values().as_string::<i32>().clone());
                    // `Text::get` indexes the values by key: a damaged file's key out of range is
                    // an error here, not a panic there.
                    if let Some(k) = keys.iter().find(|&&k| k < 0 || k as usize >= values.len()) {
                        return Err(bad(format!(
                            "column '{name}' has a dictionary key {k} outside its {} values: the file is damaged; restore it from a copy",
                            values.len()
                        )));
                    }
                    return Ok(Text::Dict(keys, values));
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
        let run_id = text("run_id")?;
        for i in 0..batch.num_rows() {
            let run = run_id.get(i);
            match &first_run {
                Some(r) if r != run => return Err(super::read::two_recordings(path, r, run)),
                Some(_) => {}
                None => first_run = Some(run.to_string()),
            }
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
