//! Sinks: where recorded numbers go. A recording is a tidy long table, one row per sketch
//! element, keyed by `run_id, compile, step, pass_idx, site, role, stat, idx`.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::manifest::Manifest;

/// One row of a recording. The key is `run_id, compile, step, pass_idx, site, role, stat, idx`
/// (unique: a test checks it); repeated strings are shared (`Arc<str>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Recording run id (one per recorder).
    pub run_id: Arc<str>,
    /// Compile within the recording (the tag of its manifest): one graph compiled twice gives
    /// two compiles, each with its own steps.
    pub compile: u32,
    /// Run index of this compiled graph (0-based).
    pub step: u64,
    /// Graph name.
    pub graph: Arc<str>,
    /// Pass that recorded the row.
    pub pass: Arc<str>,
    /// Position of that pass in the pipeline (0-based).
    pub pass_idx: u32,
    /// Site name.
    pub site: Arc<str>,
    /// Op at the site.
    pub op: Arc<str>,
    /// Role of the tensor at the site (`lhs`, `rhs`, `out`).
    pub role: Arc<str>,
    /// Statistic (`min`, `hist`, ...; see [`crate::sketch::Stat`]).
    pub stat: Arc<str>,
    /// Element index within a vector statistic (0 for scalars).
    pub idx: u64,
    /// The value (the kernel computes in f32 and f64 and writes f32).
    pub value: f32,
    /// Elements in the tensor, empty if its shape is symbolic.
    pub numel: Option<u64>,
    /// Shape of the tensor (`[2,16,384]`).
    pub shape: Arc<str>,
    /// FLOPs of one execution of the site, empty if unknown.
    pub flops: Option<u64>,
}

/// A destination for recorded rows.
///
/// `write` is called one or more times per run of a tapped graph (once per appended output),
/// then `flush` once; `finish` once at the end. Errors are returned, never swallowed: the
/// recorder keeps the first and reports it when the scope ends.
pub trait Sink: Send {
    /// A tapped graph was compiled; its manifest describes the rows that will follow.
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error>;
    /// Rows of (part of) one run.
    fn write(&mut self, rows: &[Row]) -> Result<(), Error>;
    /// A run's rows are all written: make them durable enough to survive a crash of the
    /// process (the CSV sink flushes its buffers to the OS).
    fn flush(&mut self) -> Result<(), Error> {
        Ok(())
    }
    /// All runs are done: make the recording complete and durable.
    fn finish(&mut self) -> Result<(), Error>;
}

/// Column names of a CSV recording, in [`Row`]'s field order.
pub const HEADER: [&str; 15] = [
    "run_id", "compile", "step", "graph", "pass", "pass_idx", "site", "op", "role", "stat", "idx", "value", "numel",
    "shape", "flops",
];

/// The manifest sidecar written next to a recording (`<recording>.manifest.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sidecar {
    /// Recording format version.
    pub format: u32,
    /// One manifest per tapped compile.
    pub graphs: Vec<Manifest>,
}

/// Path of the manifest sidecar of a recording.
pub fn sidecar_path(recording: &Path) -> PathBuf {
    let mut s = recording.as_os_str().to_owned();
    s.push(".manifest.json");
    PathBuf::from(s)
}

/// Where a recording is written until it is finished: `<path>.partial`.
pub(crate) fn partial_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Open the recording sink its path asks for: Parquet for `.parquet`, CSV otherwise (gzip for
/// `.gz`). Errors as [`CsvSink::create`].
pub fn create(path: impl AsRef<Path>) -> Result<Box<dyn Sink>, Error> {
    let path = path.as_ref();
    if path.extension().is_some_and(|e| e == "parquet") {
        Ok(Box::new(crate::parquet::ParquetSink::create(path)?))
    } else {
        Ok(Box::new(CsvSink::create(path)?))
    }
}

/// Check that a recording can be written at `path` (not a directory; its directory exists),
/// without creating anything: for failing before a long job rather than after it.
pub fn check_path(path: &Path) -> Result<(), Error> {
    let bad = |why: &str| {
        Err(Error::BadPath {
            path: path.to_path_buf(),
            why: why.into(),
        })
    };
    if path.is_dir() {
        return bad("is a directory; give a file path such as <dir>/recording.csv.gz");
    }
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => {
            bad("its directory does not exist; create it first")
        }
        _ => Ok(()),
    }
}

/// Write `bytes` to `path` atomically (temporary name, fsync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        error: source,
    };
    let tmp = partial_path(path);
    let mut f = File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// The file a CSV recording goes to: plain, or gzip when the path ends in `.gz`.
enum Out {
    Plain(std::io::BufWriter<File>),
    Gz(flate2::write::GzEncoder<std::io::BufWriter<File>>),
}

impl Write for Out {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Out::Plain(w) => w.write(buf),
            Out::Gz(w) => w.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Out::Plain(w) => w.flush(),
            Out::Gz(w) => w.flush(),
        }
    }
}

impl Out {
    /// Write any trailer, flush, and return the file.
    fn into_file(self) -> std::io::Result<File> {
        let buffered = match self {
            Out::Plain(w) => w,
            Out::Gz(w) => w.finish()?,
        };
        buffered.into_inner().map_err(|e| e.into_error())
    }
}

/// A CSV recording (via the `csv` crate), gzip-compressed when the path ends in `.gz`
/// (`flate2`, fast level: per-row-element tables compress about 10x), plus a JSON manifest
/// sidecar.
///
/// Rows go to `<path>.partial`, flushed after every run, so a crash leaves every finished run
/// on disk; `finish` syncs and renames it to `<path>` and writes `<path>.manifest.json` the same
/// way. An existing file at `<path>` is replaced only at that rename; a sink dropped without
/// `finish` leaves its rows in `<path>.partial`.
pub struct CsvSink {
    path: PathBuf,
    writer: Option<csv::Writer<Out>>,
    manifests: Vec<Manifest>,
}

impl CsvSink {
    /// Create the recording. Errors if `<path>.partial` cannot be created (missing directory,
    /// permissions): fix the path or create the directory.
    pub fn create(path: impl AsRef<Path>) -> Result<CsvSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let tmp = partial_path(&path);
        let file = File::create(&tmp).map_err(|source| Error::Io {
            path: tmp.clone(),
            error: source,
        })?;
        let buffered = std::io::BufWriter::with_capacity(1 << 20, file);
        let out = if path.extension().is_some_and(|e| e == "gz") {
            Out::Gz(flate2::write::GzEncoder::new(buffered, flate2::Compression::fast()))
        } else {
            Out::Plain(buffered)
        };
        // The header is written up front, so a recording with no rows is still a valid table.
        let mut writer = csv::WriterBuilder::new().has_headers(false).from_writer(out);
        writer.write_record(HEADER).map_err(|e| Error::Csv {
            path: tmp.clone(),
            error: e,
        })?;
        Ok(CsvSink {
            path,
            writer: Some(writer),
            manifests: Vec::new(),
        })
    }

    fn csv_err(&self, source: csv::Error) -> Error {
        Error::Csv {
            path: partial_path(&self.path),
            error: source,
        }
    }
}

impl Sink for CsvSink {
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let Some(w) = self.writer.as_mut() else {
            return Err(Error::Internal("write after finish".into()));
        };
        let mut res = Ok(());
        for r in rows {
            if let Err(e) = w.serialize(r) {
                res = Err(e);
                break;
            }
        }
        res.map_err(|e| self.csv_err(e))
    }

    fn flush(&mut self) -> Result<(), Error> {
        let Some(w) = self.writer.as_mut() else {
            return Ok(());
        };
        let res = w.flush().map_err(csv::Error::from);
        res.map_err(|e| self.csv_err(e))
    }

    fn finish(&mut self) -> Result<(), Error> {
        let Some(w) = self.writer.take() else {
            return Ok(());
        };
        let tmp = partial_path(&self.path);
        let io = |source| Error::Io {
            path: tmp.clone(),
            error: source,
        };
        let out = w.into_inner().map_err(|e| io(e.into_error()))?;
        let file = out.into_file().map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(|source| Error::Io {
            path: self.path.clone(),
            error: source,
        })?;
        write_sidecar(&self.path, std::mem::take(&mut self.manifests))
    }
}

/// Write the manifest sidecar of the recording at `recording` (atomically).
pub(crate) fn write_sidecar(recording: &Path, graphs: Vec<Manifest>) -> Result<(), Error> {
    let json = serde_json::to_vec_pretty(&Sidecar { format: 1, graphs })
        .map_err(|e| Error::Internal(format!("manifest JSON: {e}")))?;
    write_atomic(&sidecar_path(recording), &json)
}

impl Drop for CsvSink {
    /// Dropped unfinished (an error, a panic): flush what was written and leave it at
    /// `<path>.partial`; an earlier recording at `<path>` is not touched.
    fn drop(&mut self) {
        if let Some(mut w) = self.writer.take() {
            let _ = w.flush();
            eprintln!(
                "opscope: recording not finished; the rows written so far are in {}",
                partial_path(&self.path).display()
            );
        }
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
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error> {
        self.manifests
            .lock()
            .map_err(|_| Error::Internal("poisoned".into()))?
            .push(manifest.clone());
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
    fn manifest(&mut self, manifest: &Manifest) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.manifest(manifest))
    }
    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.write(rows))
    }
    fn flush(&mut self) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.flush())
    }
    fn finish(&mut self) -> Result<(), Error> {
        self.0.iter_mut().try_for_each(|s| s.finish())
    }
}
