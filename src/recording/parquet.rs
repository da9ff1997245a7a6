//! Parquet recordings (`arrow` + `parquet` crates, cargo feature `parquet`): the same tidy
//! table as the CSV sink, one row group per run, strings dictionary-encoded, Snappy-compressed.
//! Columnar and typed, so a miner reads values without parsing text. The reader also takes
//! Parquet files that pandas or polars wrote back (plain or dictionary strings, any codec the
//! `parquet` crate reads).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Float32Builder, StringDictionaryBuilder, UInt32Builder, UInt64Builder};
use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

use crate::error::Error;
use crate::manifest::Manifest;

use super::format::{check_path, partial_path as partial, write_sidecar, ColumnType, Row, COLUMNS};
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
    pending: Vec<Row>,
    manifests: Vec<Manifest>,
}

impl ParquetSink {
    /// Create the recording. Errors as [`super::CsvSink::create`].
    pub fn create(path: impl AsRef<Path>) -> Result<ParquetSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let tmp = partial(&path);
        let file = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let writer = ArrowWriter::try_new(file, schema(), Some(props))
            .map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet writer: {e}") })?;
        Ok(ParquetSink {
            path,
            writer: Some(writer),
            pending: Vec::new(),
            manifests: Vec::new(),
        })
    }

    /// The rows as one Arrow batch of [`schema`].
    pub(super) fn batch(rows: &[Row]) -> Result<RecordBatch, Error> {
        let mut strings: Vec<StringDictionaryBuilder<Int32Type>> = (0..8).map(|_| StringDictionaryBuilder::new()).collect();
        let (mut compile, mut pass_idx) = (UInt32Builder::new(), UInt32Builder::new());
        let (mut step, mut idx, mut numel, mut flops) = (UInt64Builder::new(), UInt64Builder::new(), UInt64Builder::new(), UInt64Builder::new());
        let mut value = Float32Builder::new();
        for r in rows {
            for (b, s) in strings.iter_mut().zip([&r.run_id, &r.graph, &r.pass, &r.site, &r.op, &r.role, &r.stat, &r.shape]) {
                b.append_value(&**s);
            }
            compile.append_value(r.compile);
            step.append_value(r.step);
            pass_idx.append_value(r.pass_idx);
            idx.append_value(r.idx);
            value.append_value(r.value);
            numel.append_option(r.numel);
            flops.append_option(r.flops);
        }
        let mut s: Vec<ArrayRef> = strings.iter_mut().map(|b| Arc::new(b.finish()) as ArrayRef).collect();
        let col = |i: usize, s: &mut Vec<ArrayRef>| std::mem::replace(&mut s[i], Arc::new(UInt32Builder::new().finish()));
        let columns: Vec<ArrayRef> = vec![
            col(0, &mut s),
            Arc::new(compile.finish()),
            Arc::new(step.finish()),
            col(1, &mut s),
            col(2, &mut s),
            Arc::new(pass_idx.finish()),
            col(3, &mut s),
            col(4, &mut s),
            col(5, &mut s),
            col(6, &mut s),
            Arc::new(idx.finish()),
            Arc::new(value.finish()),
            Arc::new(numel.finish()),
            col(7, &mut s),
            Arc::new(flops.finish()),
        ];
        RecordBatch::try_new(schema(), columns).map_err(|e| Error::Internal(format!("arrow batch: {e}")))
    }
}

impl Sink for ParquetSink {
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        self.pending.extend_from_slice(rows);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Error> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = Self::batch(&self.pending)?;
        self.pending.clear();
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

/// A Parquet file starts and ends with the magic `PAR1`; the footer (schema, row groups) is
/// written last, when the file is closed. A file that starts with it and does not end with it
/// was being written when its process stopped: say so, rather than a decoder's message.
fn check_footer(path: &Path, file: &File) -> Result<(), Error> {
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
            reason: format!(
                "no Parquet footer ({len} bytes, not ending in PAR1): the file was not closed, probably the process was \
                 killed while writing it; its rows cannot be read. In a dataset directory the earlier parts \
                 (part-*.parquet) are intact: read the directory"
            ),
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
/// Errors: the file cannot be opened or is not Parquet, a recording column is missing, holds
/// another kind of value, or holds a null or unrepresentable value where the format has none.
pub(super) fn read(path: &Path, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float32Type, UInt32Type, UInt64Type};
    use arrow_array::Array;
    let bad = |reason: String| RecordingError { path: path.to_path_buf(), line: None, reason };
    let file = File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    check_footer(path, &file)?;
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
