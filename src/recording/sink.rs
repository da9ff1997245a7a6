//! The sink trait and the in-memory and fan-out sinks.

use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::manifest::Manifest;

use super::format::{Block, Row};

/// A destination for recorded rows.
///
/// The recorder calls `write_block` once per statistic of each recorded tensor use of a run
/// (a block may hold no row: every value NaN), then `flush` once; `finish` once at the end.
/// `write_block`'s default expands the block and calls `write`, so a sink that implements only
/// `write` gets every row (in slices that do not line up with outputs). Errors are returned, never swallowed: the
/// recorder keeps the first and reports it when the scope ends.
///
/// Errors, for every method: what the destination refused, naming the file: [`Error::Io`] for
/// a write, flush, sync or rename that failed (a full disk, a file-size limit), [`Error::Csv`]
/// or [`Error::Write`] for an encoder that failed. The recorder keeps the first error and calls the
/// sink no more (later runs are drained unwritten), neither `finish` nor `abandon`: the sink is
/// dropped, so an implementation leaves what it wrote under its partial name, never renamed
/// into place.
pub trait Sink: Send {
    /// The id of the recording the rows belong to (the `run_id` column), told once before any
    /// other call by the recorder. A Parquet dataset names its partition after it
    /// (`recording=<id>/`). The default ignores it.
    fn recording_id(&mut self, _id: &str) -> Result<(), Error> {
        Ok(())
    }
    /// A tapped graph was compiled; its manifest describes the rows that will follow.
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error>;
    /// Rows of (part of) one run.
    fn write(&mut self, rows: &[Row]) -> Result<(), Error>;
    /// The rows of one statistic of one tensor, in columnar form (the recorder's path; one
    /// call per statistic of each recorded tensor use). The default expands the block into
    /// [`Row`]s and calls [`Sink::write`]; a columnar sink appends the values directly.
    fn write_block(&mut self, block: &Block<'_>) -> Result<(), Error> {
        let rows: Vec<Row> = block.rows().collect();
        self.write(&rows)
    }
    /// A run's rows are all written: make them durable enough to survive a crash of the
    /// process (the CSV sink flushes its buffers to the OS).
    fn flush(&mut self) -> Result<(), Error> {
        Ok(())
    }
    /// All runs are done: make the recording complete and durable.
    fn finish(&mut self) -> Result<(), Error>;
    /// The recording stopped early (an interrupt): make what was written readable and durable
    /// (close the compressed stream or the Parquet footer, write the sidecar) but leave it under
    /// its partial name, so it never looks complete. The default does nothing.
    fn abandon(&mut self) -> Result<(), Error> {
        Ok(())
    }
    /// Where whole tensors captured by a `capture` pass are written (a directory beside the
    /// recording, `<path>.capture`); `None` (the default) when the sink has no path.
    fn capture_dir(&self) -> Option<std::path::PathBuf> {
        None
    }
}

/// An in-memory sink (tests, and programs that mine right away). Clones share storage.
#[derive(Clone, Default)]
pub struct MemorySink {
    /// Rows written so far.
    pub rows: Arc<Mutex<Vec<Row>>>,
    /// Manifests seen so far.
    pub manifests: Arc<Mutex<Vec<Manifest>>>,
}

impl MemorySink {
    /// A copy of the rows.
    pub fn rows(&self) -> Vec<Row> {
        self.rows.lock().map(|r| r.clone()).unwrap_or_default()
    }
    /// A copy of the manifests.
    pub fn manifests(&self) -> Vec<Manifest> {
        self.manifests.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

impl Sink for MemorySink {
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        self.manifests
            .lock()
            .map_err(|_| Error::Internal("poisoned".into()))?
            .push(Manifest::clone(manifest));
        Ok(())
    }
    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        self.rows
            .lock()
            .map_err(|_| Error::Internal("poisoned".into()))?
            .extend_from_slice(rows);
        Ok(())
    }
    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

/// Writes to every inner sink.
pub struct Tee(pub Vec<Box<dyn Sink>>);

impl Sink for Tee {
    fn recording_id(&mut self, id: &str) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.recording_id(id))
    }
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.manifest(manifest))
    }
    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.write(rows))
    }
    fn write_block(&mut self, block: &Block<'_>) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.write_block(block))
    }
    fn flush(&mut self) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.flush())
    }
    fn finish(&mut self) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.finish())
    }
    fn abandon(&mut self) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.abandon())
    }
    fn capture_dir(&self) -> Option<std::path::PathBuf> {
        self.0.iter().find_map(|s| s.capture_dir())
    }
}

/// `<path>.capture`: the capture directory beside a recording at `path`.
pub fn capture_dir_of(path: &std::path::Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".capture");
    std::path::PathBuf::from(p)
}
