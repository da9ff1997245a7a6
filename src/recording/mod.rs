//! The recording format, both ways: one column list ([`COLUMNS`]) for the CSV header and the
//! Arrow schema, the sinks that write recordings, the readers that stream them back, and the
//! manifest sidecar.
//!
//! A recording is a tidy long table, one row per sketch element, keyed by
//! `run_id, compile, step, pass_idx, site, role, stat, idx`. Rows go to `<path>.partial` while
//! recording and are renamed into place, with `<path>.manifest.json`, when the recording is
//! finished.

mod csv;
mod format;
#[cfg(feature = "parquet")]
mod parquet;
mod read;
mod sink;

use std::path::Path;

pub use self::csv::CsvSink;
#[cfg(feature = "parquet")]
pub use self::parquet::{schema, ParquetSink};
pub use crate::error::RecordingError;
pub use format::{
    check_path, column_index, header, partial_path, sidecar_path, write_atomic, write_sidecar, Column, ColumnType, Row,
    Sidecar, COLUMNS, FORMAT,
};
pub use read::{read_rows, RowRef};
pub use sink::{MemorySink, Sink, Tee};

use crate::error::Error;

/// Open the recording sink a path's extension asks for: `.parquet` Parquet (cargo feature
/// `parquet`), `.csv` CSV, `.csv.gz` / `.gz` gzip CSV.
///
/// Errors: another extension (the error lists the ones written), `.parquet` without the
/// `parquet` feature, or the path cannot be written ([`CsvSink::create`]).
pub fn open(path: impl AsRef<Path>) -> Result<Box<dyn Sink>, Error> {
    let path = path.as_ref();
    check_path(path)?;
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    if name.ends_with(".parquet") {
        #[cfg(feature = "parquet")]
        return Ok(Box::new(ParquetSink::create(path)?));
        #[cfg(not(feature = "parquet"))]
        return Err(no_parquet(path));
    }
    if name.ends_with(".csv") || name.ends_with(".gz") {
        return Ok(Box::new(CsvSink::create(path)?));
    }
    Err(Error::BadPath {
        path: path.to_path_buf(),
        why: "unknown recording format: name the file .csv, .csv.gz or .parquet".into(),
    })
}

/// Read the manifest sidecar of the recording at `recording`, if there is one.
///
/// Errors: the sidecar exists but cannot be read or parsed.
pub fn read_sidecar(recording: &Path) -> Result<Option<Sidecar>, Error> {
    let side = sidecar_path(recording);
    if !side.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&side).map_err(|e| Error::Io { path: side.clone(), error: e })?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| RecordingError { path: side, line: Some(e.line() as u64), reason: format!("manifest sidecar: {e}") }.into())
}

#[cfg(not(feature = "parquet"))]
fn no_parquet(path: &Path) -> Error {
    Error::BadPath {
        path: path.to_path_buf(),
        why: "Parquet recordings need opscope's cargo feature `parquet` (features = [\"parquet\"]); or name the file .csv / .csv.gz".into(),
    }
}
