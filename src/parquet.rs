//! Parquet recordings (`arrow` + `parquet` crates): the same tidy table as the CSV sink, one
//! row group per run, strings dictionary-encoded, Snappy-compressed. Columnar and typed, so a
//! miner reads values without parsing text.

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
use crate::sink::{check_path, partial_path as partial, write_sidecar, Row, HEADER};

fn dict() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

/// The Arrow schema of a recording, columns in [`HEADER`] order.
pub fn schema() -> SchemaRef {
    let f = |name: &str, t: DataType, nullable: bool| Field::new(name, t, nullable);
    Arc::new(Schema::new(vec![
        f(HEADER[0], dict(), false),
        f(HEADER[1], DataType::UInt32, false),
        f(HEADER[2], DataType::UInt64, false),
        f(HEADER[3], dict(), false),
        f(HEADER[4], dict(), false),
        f(HEADER[5], DataType::UInt32, false),
        f(HEADER[6], dict(), false),
        f(HEADER[7], dict(), false),
        f(HEADER[8], dict(), false),
        f(HEADER[9], dict(), false),
        f(HEADER[10], DataType::UInt64, false),
        f(HEADER[11], DataType::Float32, false),
        f(HEADER[12], DataType::UInt64, true),
        f(HEADER[13], dict(), false),
        f(HEADER[14], DataType::UInt64, true),
    ]))
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
    /// Create the recording. Errors as [`crate::CsvSink::create`].
    pub fn create(path: impl AsRef<Path>) -> Result<ParquetSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let tmp = partial(&path);
        let file = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let writer = ArrowWriter::try_new(file, schema(), Some(props))
            .map_err(|e| Error::Internal(format!("parquet writer: {e}")))?;
        Ok(ParquetSink {
            path,
            writer: Some(writer),
            pending: Vec::new(),
            manifests: Vec::new(),
        })
    }

    fn batch(rows: &[Row]) -> Result<RecordBatch, Error> {
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

impl crate::sink::Sink for ParquetSink {
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
        w.write(&batch).map_err(|e| Error::BadPath { path: path.clone(), why: format!("parquet write: {e}") })?;
        // One row group per run keeps the writer's memory bounded by one run.
        w.flush().map_err(|e| Error::BadPath { path, why: format!("parquet flush: {e}") })
    }

    fn finish(&mut self) -> Result<(), Error> {
        self.flush()?;
        let Some(w) = self.writer.take() else { return Ok(()) };
        let tmp = partial(&self.path);
        let file = w.into_inner().map_err(|e| Error::BadPath { path: tmp.clone(), why: format!("parquet close: {e}") })?;
        file.sync_all().map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        std::fs::rename(&tmp, &self.path).map_err(|e| Error::Io { path: self.path.clone(), error: e })?;
        write_sidecar(&self.path, std::mem::take(&mut self.manifests))
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
