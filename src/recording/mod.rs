//! The recording format, both ways: one column list ([`COLUMNS`]) for the CSV header and the
//! Arrow schema, the sinks that write recordings, the readers that stream them back, and the
//! manifest sidecar.
//!
//! A recording is a tidy long table, one row per sketch element, keyed by
//! `run_id, compile, step, pass_idx, site, role, stat, idx`. A CSV recording's rows go to
//! `<path>.partial` while recording and are renamed into place, with `<path>.manifest.json`, when
//! the recording is finished. A Parquet recording is a dataset directory of closed parts,
//! `DIR/recording=<run_id>/part-NNNNN.parquet`, with a `_manifest.json` per partition
//! ([`DatasetSink`]): a killed process loses the open part only.

mod checksum;
mod csv;
#[cfg(feature = "parquet")]
mod dataset;
mod format;
#[cfg(feature = "parquet")]
mod parquet;
mod read;
#[cfg(feature = "parquet")]
mod rowgroup;
mod sink;

use std::path::Path;

pub use self::checksum::{checksum_of, verify, Checksum};
pub use self::csv::CsvSink;
#[cfg(feature = "parquet")]
pub use self::dataset::{partitions, DatasetSink, PartLimits, Partition, ENTRIES_PER_INDEX_FILE, ENV_PART_BYTES, ENV_PART_RUNS, PARTITION_SIDECAR, GROUP_ROWS};
#[cfg(feature = "parquet")]
pub use self::parquet::{schema, ParquetSink, PAGE_ROWS};
pub use crate::error::RecordingError;
pub use format::{
    check_dataset_path, check_path, check_replaceable, holds_recording, partial_in_the_way, Block, column_index, header, is_dataset_path, new_run_id, partial_path, sidecar_path, write_atomic, write_sidecar, Column, ColumnType, Row,
    IndexBlock, Sidecar, SidecarFile, COLUMNS, FORMAT,
};
pub use read::{read_rows, RowRef};
pub use sink::{capture_dir_of, MemorySink, Sink, Tee};

use crate::error::Error;

/// Open the recording sink a path asks for: a Parquet dataset directory ([`DatasetSink`], cargo
/// feature `parquet`) for a name ending in `.parquet`, a path ending in `/` or an existing
/// dataset ([`is_dataset_path`]); `.csv` CSV, `.csv.gz` / `.gz` gzip CSV ([`CsvSink`]). A dataset closes a part every
/// [`PartLimits`] (`RLX_OPSCOPE_PART_RUNS`, `RLX_OPSCOPE_PART_BYTES`; defaults 32 runs, 64 MiB)
/// and adds its partition beside any already in the directory.
///
/// Errors: another extension (the error lists the ones written), a Parquet path without the
/// `parquet` feature, a bad `RLX_OPSCOPE_PART_*` value, or the path cannot be written
/// ([`CsvSink::create`], [`DatasetSink::create`]).
pub fn open(path: impl AsRef<Path>) -> Result<Box<dyn Sink>, Error> {
    let path = path.as_ref();
    check_path(path)?;
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    if is_dataset_path(path) {
        #[cfg(feature = "parquet")]
        return Ok(Box::new(DatasetSink::create(path, PartLimits::from_env()?)?));
        #[cfg(not(feature = "parquet"))]
        return Err(no_parquet(path));
    }
    if name.ends_with(".csv") || name.ends_with(".csv.gz") {
        return Ok(Box::new(CsvSink::create(path)?));
    }
    if name.ends_with(".parquet") {
        // `is_dataset_path` declines a `.parquet` name that is a regular file.
        return Err(Error::BadPath {
            path: path.to_path_buf(),
            why: "a file is there, and a Parquet recording is a dataset directory of that name (never written over a \
                  file): move the file away or pick another name"
                .into(),
        });
    }
    Err(Error::BadPath {
        path: path.to_path_buf(),
        why: "unknown recording format: name the file .csv, .csv.gz or .parquet".into(),
    })
}

/// [`open`] after the checks the environment mode makes of `RLX_OPSCOPE_OUT`
/// ([`check_replaceable`]): never over a file that is not an opscope recording, never over a
/// `<path>.partial` (an interrupted recording, or one another process is writing), never into a
/// directory holding files other than `recording=<id>` partitions; an earlier recording at the
/// path is replaced once the new one is complete, and stderr says so (a Parquet dataset gets the
/// new recording beside the earlier ones). This is `opscope::open_sink`.
///
/// Errors: those of [`check_replaceable`] and [`open`], each naming the fix;
/// [`Error::BadPath`] for a directory with foreign files.
pub fn open_checked(path: impl AsRef<Path>) -> Result<Box<dyn Sink>, Error> {
    let path = path.as_ref();
    if path.is_dir() {
        let foreign = std::fs::read_dir(path)
            .map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().to_string())
            .find(|n| !n.starts_with("recording=") && !n.starts_with('.'));
        if let Some(f) = foreign {
            return Err(Error::BadPath {
                path: path.to_path_buf(),
                why: format!(
                    "a directory holding other files than recording=<id> partitions ({f}): a recording added there would \
                     make it unreadable as a dataset; pick another path"
                ),
            });
        }
    }
    if check_replaceable(path)? {
        eprintln!("opscope: note: {} holds an earlier recording; this one replaces it when it is complete", path.display());
    }
    open(path)
}

/// Read the manifest sidecar of the recording at `recording`, if there is one.
///
/// Errors: the sidecar exists but cannot be read or parsed.
///
/// A dataset directory's sidecars (`recording=<id>/_manifest.json`) are merged into one, with
/// compiles numbered across recordings as [`read_rows`] numbers them.
pub fn read_sidecar(recording: &Path) -> Result<Option<Sidecar>, Error> {
    #[cfg(feature = "parquet")]
    if recording.is_dir() {
        return dataset::read_sidecar(recording);
    }
    let side = sidecar_path(recording);
    if !side.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&side).map_err(|e| Error::Io { path: side.clone(), error: e })?;
    let sidecar: Sidecar = serde_json::from_slice(&bytes).map_err(|e| RecordingError { path: side.clone(), line: Some(e.line() as u64), reason: damaged_sidecar(&e) })?;
    format::check_format(&side, sidecar.format)?;
    Ok(Some(sidecar))
}

/// The error reason for a manifest sidecar that does not parse: what it holds and the two
/// fixes (restore it, or mine the rows without it).
pub(crate) fn damaged_sidecar(e: &serde_json::Error) -> String {
    format!(
        "the manifest sidecar is damaged ({e}); it lists the graphs, sites and skipped sites of the recording, and the \
         rows do not need it: restore it from a copy, or move it away to mine the rows alone (the sites it would list \
         as skipped or never run then go unlisted)"
    )
}

#[cfg(not(feature = "parquet"))]
fn no_parquet(path: &Path) -> Error {
    Error::BadPath {
        path: path.to_path_buf(),
        why: "Parquet recordings need opscope's cargo feature `parquet` (features = [\"parquet\"]); or name the file .csv / .csv.gz".into(),
    }
}
