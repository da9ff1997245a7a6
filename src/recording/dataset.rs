//! Parquet dataset recordings: a directory of complete Parquet files in hive-style partitions,
//! one partition per recording, the layout Spark, pyarrow, DuckDB and DataFusion read as one
//! table:
//!
//! ```text
//! run.parquet/                                 (the dataset; any directory)
//!   recording=run-1764500000-4242-1/           (one recorder: a scope, or a process)
//!     part-00000.parquet                       (closed: footer written, fsynced, renamed)
//!     part-00001.parquet
//!     _part-00002.parquet.partial              (the open part; readers skip it)
//!     _graphs-000001.json                      (manifests of compiles 1.., written once)
//!     _index-00000.json                        (earlier checksums and manifest files, once)
//!     _manifest.json                           (the sidecar: parts, checksums, manifest files;
//!                                               rewritten at every part close)
//!   recording=run-1764500007-4250-1/           (another process, another host)
//!     ...
//! ```
//!
//! A part is closed after [`PartLimits::runs`] runs or once it holds [`PartLimits::bytes`]
//! bytes, so a process killed by `kill -9` (or a power cut) loses the open part only. Names
//! beginning with `_` or `.` are the ones Spark, pyarrow's `dataset()` and Hive skip, and
//! `*.parquet` globs do not match `.partial`.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::manifest::Manifest;

use super::checksum::Checksum;
use super::format::{check_dataset_path, write_atomic, Block, IndexBlock, Row, Sidecar, SidecarFile, FORMAT};
use super::rowgroup::{ParquetFile, RowGroup};
use super::read::RowRef;
use super::sink::Sink;
use super::RecordingError;

/// Environment variable: runs per part (a whole number >= 1; default [`PartLimits::DEFAULT`]).
pub const ENV_PART_RUNS: &str = "RLX_OPSCOPE_PART_RUNS";
/// Environment variable: bytes after which a part is closed (a whole number >= 1; default
/// [`PartLimits::DEFAULT`]).
pub const ENV_PART_BYTES: &str = "RLX_OPSCOPE_PART_BYTES";
/// The sidecar of one partition (`recording=<id>/_manifest.json`).
pub const PARTITION_SIDECAR: &str = "_manifest.json";

/// When a part is closed: after `runs` runs, or at the end of the run that brings it to `bytes`
/// bytes (encoded, as the Parquet writer counts them), whichever comes first. A killed process
/// loses at most the open part, so these bound the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartLimits {
    /// Runs per part (>= 1).
    pub runs: u64,
    /// Bytes per part (>= 1).
    pub bytes: u64,
}

impl PartLimits {
    /// 32 runs or 64 MiB. 64 MiB sits in the range Parquet readers favour per file (Spark reads
    /// files in 128 MB splits, `spark.sql.files.maxPartitionBytes`; DuckDB and pyarrow read a
    /// file per thread); 32 runs bounds what a crash loses on a fast model (MiniLM-L3 writes
    /// about 1 MB per run of 8 sentences with the full `matmul` set).
    pub const DEFAULT: PartLimits = PartLimits { runs: 32, bytes: 64 << 20 };

    /// The defaults, overridden by `RLX_OPSCOPE_PART_RUNS` and `RLX_OPSCOPE_PART_BYTES`.
    ///
    /// Errors: a variable that is set but not a whole number >= 1 (the error names it).
    pub fn from_env() -> Result<PartLimits, Error> {
        let read = |name: &str, default: u64| -> Result<u64, Error> {
            match std::env::var(name) {
                Err(_) => Ok(default),
                Ok(v) => match v.trim().parse::<u64>() {
                    Ok(n) if n >= 1 => Ok(n),
                    _ => Err(Error::Env {
                        var: name.to_string(),
                        value: v,
                        why: format!("a Parquet part's limit is a whole number >= 1 (default {default}); unset it for the default"),
                    }),
                },
            }
        };
        Ok(PartLimits {
            runs: read(ENV_PART_RUNS, Self::DEFAULT.runs)?,
            bytes: read(ENV_PART_BYTES, Self::DEFAULT.bytes)?,
        })
    }
}

impl Default for PartLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The part a run goes to while it is open.
struct OpenPart {
    writer: ParquetFile,
    tmp: PathBuf,
    runs: u64,
}

/// A Parquet recording as a dataset directory (see the module docs): rows of each run are one
/// row group of the open part; a part is closed (footer, fsync, rename from
/// `_part-NNNNN.parquet.partial` to `part-NNNNN.parquet`, directory fsync) when it reaches its
/// [`PartLimits`], and the partition's `_manifest.json` is rewritten then, after the manifests
/// of the compiles first seen since the last close are written to a file of their own
/// ([`SidecarFile`]; each manifest is written once). Several recorders (processes, hosts) may
/// write into one dataset: each writes its own `recording=<id>` partition.
pub struct DatasetSink {
    root: PathBuf,
    limits: PartLimits,
    id: Option<String>,
    next_part: usize,
    open: Option<OpenPart>,
    /// The open run's rows (one row group, encoded as they come: see `rowgroup`).
    pending: RowGroup,
    manifests: Vec<std::sync::Arc<Manifest>>,
    done: bool,
    /// Row groups of the open run were written already ([`GROUP_ROWS`]): the run still ends
    /// (counts towards the part's limits) at the next flush, even with no rows pending.
    run_open: bool,
    /// This sink created its partition directory (see `partition`).
    partition_made: bool,
    /// The length and CRC-32 of each part closed since the last index file, by file name, for
    /// the sidecar ([`Sidecar::parts`]).
    sums: std::collections::BTreeMap<String, Checksum>,
    /// The manifest files written since the last index file ([`Sidecar::graph_files`]).
    graph_files: Vec<SidecarFile>,
    /// Manifests written to files so far (the first `graphs_on_disk` of `manifests`).
    graphs_on_disk: usize,
    /// The index files written ([`Sidecar::index_files`]).
    index_files: Vec<SidecarFile>,
    /// The entries of the last index file, still listed in `_manifest.json` too until the next
    /// one: a copy of the dataset taken while the recording runs may hold a `_manifest.json`
    /// newer than its directory listing, naming an index file the copy lacks.
    last_block: IndexBlock,
    /// `sums` and `graph_files` move to an index file at this many entries together.
    per_index_file: usize,
}

/// How many entries (part checksums and manifest files together) a partition's `_manifest.json`
/// lists before they move to an index file (`_index-NNNNN.json`, [`Sidecar::index_files`]), so
/// that the sidecar rewritten at every part's close stays bounded however many parts a long
/// recording closes (a million runs at 32 a part are 31 250 parts, whose checksums alone were
/// 2.8 MB rewritten every 32 runs). It lists the last index file's entries too, so at most
/// twice this many: about 120 KB (118 KB measured at 1023 entries). The index files are listed
/// in `_manifest.json`, one line each (61 at a million runs).
pub const ENTRIES_PER_INDEX_FILE: usize = 512;

/// A run's rows are written as a row group every this many rows (and at the run's end), so the
/// encoded pages the writer holds stay bounded whatever a run holds: 128 Ki rows, about 0.45 MB
/// at the 3.4 bytes a row of MiniLM's sketches. Before, a run was one row group: at L = 256 on
/// the chain MLP (460 000 rows a run) its pages were 1.65 MB of the tapped run's peak heap.
/// Readers see the same rows in the same order (a run is no longer always one row group).
pub const GROUP_ROWS: usize = 1 << 17;

impl DatasetSink {
    /// A dataset recording under `root` (created if missing; its parent must exist). Nothing
    /// else is created until the first part: the partition is named after the recording id
    /// ([`Sink::recording_id`], else the first row's `run_id`).
    ///
    /// Errors: `root` is a file, or its directory does not exist, or it cannot be created.
    pub fn create(root: impl AsRef<Path>, limits: PartLimits) -> Result<DatasetSink, Error> {
        let root = root.as_ref().to_path_buf();
        check_dataset_path(&root)?;
        std::fs::create_dir_all(&root).map_err(|e| Error::Io { path: root.clone(), error: e })?;
        Ok(DatasetSink {
            root,
            limits: PartLimits { runs: limits.runs.max(1), bytes: limits.bytes.max(1) },
            id: None,
            next_part: 0,
            open: None,
            pending: RowGroup::new().map_err(|e| Error::Internal(format!("parquet schema: {e}")))?,
            manifests: Vec::new(),
            done: false,
            run_open: false,
            partition_made: false,
            sums: Default::default(),
            graph_files: Vec::new(),
            graphs_on_disk: 0,
            index_files: Vec::new(),
            last_block: IndexBlock::default(),
            per_index_file: ENTRIES_PER_INDEX_FILE,
        })
    }

    /// The same sink with `n` (>= 1) entries in `_manifest.json` before they move to an index
    /// file (default [`ENTRIES_PER_INDEX_FILE`]; a test's small number exercises the files).
    pub fn entries_per_index_file(mut self, n: usize) -> DatasetSink {
        self.per_index_file = n.max(1);
        self
    }

    /// The partition directory, `root/recording=<id>`, created on first use.
    fn partition(&mut self) -> Result<PathBuf, Error> {
        let id = self.id.get_or_insert_with(super::format::new_run_id).clone();
        // An id is a directory name: keep it to characters every file system and URL takes.
        let safe: String = id.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
        let dir = self.root.join(format!("recording={safe}"));
        if !self.partition_made {
            // Created here, exclusively: a partition of the same id already in the dataset is
            // another recording's, whose parts this one's would replace.
            std::fs::create_dir(&dir).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Error::BadPath {
                    path: dir.clone(),
                    why: format!(
                        "the dataset already holds a partition of recording id '{id}': another recording's, whose \
                         parts this one would replace; give this recording another id (or record into another dataset)"
                    ),
                },
                _ => Error::Io { path: dir.clone(), error: e },
            })?;
            self.partition_made = true;
        }
        Ok(dir)
    }

    fn write_err(&self, path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
        let closed = self.next_part;
        // An I/O error that names `path` already (`write_atomic`'s) is given by its cause alone.
        let e = e.to_string();
        let e = e.strip_prefix(&format!("recording {}: ", path.display())).map(str::to_string).unwrap_or(e);
        let hint = super::format::space_hint(&e);
        Error::Write {
            path: path.to_path_buf(),
            why: format!(
                "{what}: {e}{hint}; the {closed} part(s) closed before it in {} are intact and readable",
                path.parent().unwrap_or(&self.root).display()
            ),
        }
    }

    /// Write the pending rows as one row group of the open part (opened if needed).
    fn write_group(&mut self) -> Result<(), Error> {
        if self.open.is_none() {
            self.open = Some(self.open_part()?);
        }
        let part = self.open.as_mut().expect("opened above");
        let res = part.writer.write_group(&mut self.pending);
        let tmp = part.tmp.clone();
        res.map_err(|e| self.write_err(&tmp, "writing a run", e))
    }

    /// End the run: its rows (those not yet written by [`GROUP_ROWS`]) are a row group of the
    /// open part; close the part when it reaches its limits. A part is closed only here, so a
    /// closed part holds whole runs.
    fn write_run(&mut self) -> Result<(), Error> {
        if self.pending.rows() == 0 && !self.run_open {
            return Ok(());
        }
        if self.pending.rows() > 0 {
            self.write_group()?;
        }
        self.run_open = false;
        let part = self.open.as_mut().expect("a run's rows opened the part");
        part.runs += 1;
        let full = part.runs >= self.limits.runs || part.writer.bytes_written() as u64 >= self.limits.bytes;
        if full {
            self.close_part()?;
        }
        Ok(())
    }

    /// A run's rows so far reached [`GROUP_ROWS`]: write them as a row group now, so the
    /// writer's encoded pages stay bounded whatever a run holds.
    fn spill(&mut self) -> Result<(), Error> {
        if self.pending.rows() >= GROUP_ROWS {
            self.write_group()?;
            self.run_open = true;
        }
        Ok(())
    }

    fn open_part(&mut self) -> Result<OpenPart, Error> {
        let dir = self.partition()?;
        let tmp = dir.join(format!("_part-{:05}.parquet.partial", self.next_part));
        let file = File::create(&tmp).map_err(|e| Error::Io { path: tmp.clone(), error: e })?;
        let writer = ParquetFile::create(file).map_err(|e| Error::Write { path: tmp.clone(), why: format!("parquet writer: {e}") })?;
        Ok(OpenPart { writer, tmp, runs: 0 })
    }

    /// Footer and fsync; the sidecar if it changed (first, so that it lists the compiles of
    /// every closed part whenever the process stops); rename into place; fsync the directory.
    fn close_part(&mut self) -> Result<(), Error> {
        let Some(part) = self.open.take() else { return Ok(()) };
        let (file, sum) = part.writer.finish().map_err(|e| self.write_err(&part.tmp, "closing the part (footer)", e))?;
        file.sync_all().map_err(|e| self.write_err(&part.tmp, "syncing the part", e))?;
        let name = format!("part-{:05}.parquet", self.next_part);
        self.sums.insert(name.clone(), sum);
        // Before the rename: a part is never readable without the manifests of its compiles
        // and its checksum. Its count of closed parts is the parts before this one (written
        // again after it at the end, or at the next part's close).
        self.write_sidecar()?;
        let dir = part.tmp.parent().map(Path::to_path_buf).unwrap_or_default();
        let path = dir.join(name);
        std::fs::rename(&part.tmp, &path).map_err(|e| Error::Io { path: path.clone(), error: e })?;
        // The rename is durable once the directory is (POSIX: fsync the directory).
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        self.next_part += 1;
        Ok(())
    }

    /// Write the partition's `_manifest.json` (at each part's close and at the end), after the
    /// manifests first seen since the last one in a file of their own ([`SidecarFile`]), and
    /// the entries listed so far in an index file when they reached `per_index_file`: each
    /// manifest is written once, and `_manifest.json` (the newer entries and the last index
    /// file's) stays bounded.
    fn write_sidecar(&mut self) -> Result<(), Error> {
        let dir = self.partition()?;
        if self.manifests.len() > self.graphs_on_disk {
            // Named by the first compile it holds (written again, whole, under the same name
            // if this write fails and the next part's close tries again).
            let name = format!("_graphs-{:06}.json", self.graphs_on_disk + 1);
            let path = dir.join(&name);
            let new = &self.manifests[self.graphs_on_disk..];
            let json = serde_json::to_vec(new).map_err(|e| Error::Internal(format!("manifest JSON: {e}")))?;
            write_atomic(&path, &json).map_err(|e| self.write_err(&path, "writing the manifests", e))?;
            self.graph_files.push(SidecarFile { file: name, entries: new.len(), checksum: Checksum::of(&json) });
            self.graphs_on_disk = self.manifests.len();
        }
        let entries = self.sums.len() + self.graph_files.len();
        if entries >= self.per_index_file {
            let name = format!("_index-{:05}.json", self.index_files.len());
            let path = dir.join(&name);
            let block = IndexBlock { parts: std::mem::take(&mut self.sums), graph_files: std::mem::take(&mut self.graph_files) };
            let json = serde_json::to_vec(&block).map_err(|e| Error::Internal(format!("index JSON: {e}")))?;
            if let Err(e) = write_atomic(&path, &json) {
                // Kept listed in `_manifest.json` for the next close to try again.
                (self.sums, self.graph_files) = (block.parts, block.graph_files);
                return Err(self.write_err(&path, "writing an index file", e));
            }
            self.index_files.push(SidecarFile { file: name, entries, checksum: Checksum::of(&json) });
            self.last_block = block;
        }
        // The last index file's entries, then the newer ones.
        let mut parts = self.last_block.parts.clone();
        parts.extend(self.sums.iter().map(|(k, v)| (k.clone(), *v)));
        let graph_files: Vec<SidecarFile> = self.last_block.graph_files.iter().chain(&self.graph_files).cloned().collect();
        let path = dir.join(PARTITION_SIDECAR);
        let json = serde_json::to_vec_pretty(&Sidecar {
            format: FORMAT,
            graphs: Vec::new(),
            ends_on_run: false,
            closed_parts: Some(self.next_part),
            checksum: None,
            parts,
            recording: self.id.clone(),
            graph_files,
            index_files: self.index_files.clone(),
        })
            .map_err(|e| Error::Internal(format!("manifest JSON: {e}")))?;
        write_atomic(&path, &json).map_err(|e| self.write_err(&path, "writing the manifest sidecar", e))?;
        Ok(())
    }

    /// Close everything: the pending run, the open part (an empty part when the recording
    /// holds no row, so that it still reads as a table of zero rows), the sidecar.
    fn close(&mut self) -> Result<(), Error> {
        if self.done {
            return Ok(());
        }
        self.write_run()?;
        if self.next_part == 0 && self.open.is_none() {
            self.open = Some(self.open_part()?);
        }
        self.close_part()?;
        self.write_sidecar()?;
        self.done = true;
        Ok(())
    }
}

impl Sink for DatasetSink {
    fn capture_dir(&self) -> Option<std::path::PathBuf> {
        Some(super::sink::capture_dir_of(&self.root))
    }
    fn recording_id(&mut self, id: &str) -> Result<(), Error> {
        if self.id.is_none() {
            self.id = Some(id.to_string());
        }
        Ok(())
    }
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }
    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let Some(first) = rows.first() else { return Ok(()) };
        self.id.get_or_insert_with(|| first.run_id.to_string());
        let res = rows.iter().try_for_each(|r| self.pending.push_row(r));
        res.map_err(|e| Error::Internal(format!("encoding a run: {e}")))?;
        self.spill()
    }
    fn write_block(&mut self, block: &Block<'_>) -> Result<(), Error> {
        self.id.get_or_insert_with(|| block.run_id.to_string());
        self.pending.push_block(block).map_err(|e| Error::Internal(format!("encoding a run: {e}")))?;
        self.spill()
    }
    fn flush(&mut self) -> Result<(), Error> {
        self.write_run()
    }
    fn finish(&mut self) -> Result<(), Error> {
        self.close()
    }
    /// Interrupted: every run written is closed into parts, as at `finish` (parts are never
    /// partial; the partition holds the runs that were recorded).
    fn abandon(&mut self) -> Result<(), Error> {
        self.close()
    }
}

impl Drop for DatasetSink {
    fn drop(&mut self) {
        if let Some(p) = &self.open {
            eprintln!(
                "opscope: recording not finished: {} closed part(s) are readable; the open part {} has no footer",
                self.next_part,
                p.tmp.display()
            );
        }
    }
}

/// One partition of a dataset: a directory holding closed parts.
#[derive(Debug)]
pub struct Partition {
    /// The directory (`root/recording=<id>`, or `root` itself when the parts lie there).
    pub dir: PathBuf,
    /// Closed parts (`*.parquet`), by name.
    pub parts: Vec<PathBuf>,
    /// Open parts (`*.partial`: being written, or left by a killed process), skipped.
    pub open: Vec<PathBuf>,
    /// The partition's `_manifest.json`, if present, with the entries of its index files and
    /// the manifests of its manifest files read in.
    pub sidecar: Option<Sidecar>,
    /// For each part whose checksum an index file lists: that file's name (the others are in
    /// `_manifest.json`).
    pub checksums_in: std::collections::BTreeMap<String, String>,
    /// The first manifest file `_manifest.json` lists that is missing, if one is (a copy taken
    /// while the recording was written holds a `_manifest.json` newer than its other files):
    /// the manifests from it on are not read. An error only if the rows need them ([`read`]).
    pub missing_graphs: Option<String>,
}

/// The partitions of the dataset at `root`, by path: every directory under it (names beginning
/// with `_` or `.` skipped, as Spark and pyarrow do) holding `*.parquet` files.
///
/// Errors: a directory cannot be listed, a sidecar cannot be parsed.
pub fn partitions(root: &Path) -> Result<Vec<Partition>, Error> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let io = |e| Error::Io { path: dir.clone(), error: e };
        let mut p = Partition { dir: dir.clone(), parts: Vec::new(), open: Vec::new(), sidecar: None, checksums_in: Default::default(), missing_graphs: None };
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            if name.ends_with(".partial") && name.contains(".parquet") {
                p.open.push(path);
            } else if name.starts_with('_') || name.starts_with('.') {
                continue;
            } else if path.is_dir() {
                stack.push(path);
            } else if name.ends_with(".parquet") {
                p.parts.push(path);
            }
        }
        let side = dir.join(PARTITION_SIDECAR);
        if side.is_file() {
            let bytes = std::fs::read(&side).map_err(|e| Error::Io { path: side.clone(), error: e })?;
            let mut sidecar: Sidecar = serde_json::from_slice(&bytes).map_err(|e| RecordingError {
                path: side.clone(),
                line: Some(e.line() as u64),
                reason: super::damaged_sidecar(&e),
            })?;
            super::format::check_format(&side, sidecar.format)?;
            (p.checksums_in, p.missing_graphs) = read_sidecar_files(&dir, &mut sidecar)?;
            p.sidecar = Some(sidecar);
        }
        if !p.parts.is_empty() || !p.open.is_empty() || p.sidecar.is_some() {
            p.parts.sort();
            p.open.sort();
            out.push(p);
        }
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(out)
}

/// The entries of a file `_manifest.json` lists ([`SidecarFile`]) in the partition `dir`,
/// checked against its length and CRC-32 and its entry count; `what` names them in errors
/// ("manifests", "entries").
///
/// Errors: the file is missing or not a regular file, unreadable, damaged (checksum), not of
/// the expected JSON form, or holds another count than listed (each named, with the fix).
fn read_listed<T: serde::de::DeserializeOwned>(dir: &Path, f: &SidecarFile, what: &str, len: impl Fn(&T) -> usize) -> Result<T, Error> {
    let path = dir.join(&f.file);
    let bad = |reason: String| -> Error { RecordingError { path: path.clone(), line: None, reason }.into() };
    if !path.is_file() {
        return Err(bad(format!(
            "the partition's {PARTITION_SIDECAR} lists this file of {} {what}, which {}: restore it from a copy (a \
             copy taken while the recording was written may lack it: copy the dataset again once it has finished)",
            f.entries,
            if path.exists() { "is not a regular file" } else { "is missing" }
        )));
    }
    let bytes = std::fs::read(&path).map_err(|e| bad(format!("the partition's {PARTITION_SIDECAR} lists this file of {} {what}, which cannot be read ({e})", f.entries)))?;
    let sum = Checksum::of(&bytes);
    if sum != f.checksum {
        return Err(bad(format!(
            "damaged: {} bytes with CRC-32 {:08x}, where the partition's {PARTITION_SIDECAR} lists {} bytes with CRC-32 \
             {:08x}; restore it from a copy",
            sum.bytes, sum.crc32, f.checksum.bytes, f.checksum.crc32
        )));
    }
    let v: T = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a file of {what} ({e}), although its checksum matches: written by another version?")))?;
    if len(&v) != f.entries {
        return Err(bad(format!("holds {} {what} where the partition's {PARTITION_SIDECAR} lists {}", len(&v), f.entries)));
    }
    Ok(v)
}

/// Merge the index files `index_files` of the partition `dir` ([`Sidecar::index_files`]) before
/// `parts` and `graph_files` (the entries `_manifest.json` lists itself, which repeat the last
/// index file's); returns, for each part whose checksum an index file lists, that file's name.
/// The last index file may be missing (a copy taken while the recording ran may lack the index
/// file written during the copy): `_manifest.json` lists its entries too.
///
/// Errors: an index file out of sequence (`_index-00000.json`, `_index-00001.json`, ...), an
/// index file other than the last missing, or as [`read_listed`].
fn merge_index(
    dir: &Path,
    index_files: &[SidecarFile],
    parts: &mut std::collections::BTreeMap<String, Checksum>,
    graph_files: &mut Vec<SidecarFile>,
) -> Result<std::collections::BTreeMap<String, String>, Error> {
    let (mut all_parts, mut all_files, mut checksums_in) = (std::collections::BTreeMap::new(), Vec::new(), std::collections::BTreeMap::new());
    for (k, f) in index_files.iter().enumerate() {
        let want = format!("_index-{k:05}.json");
        if f.file != want {
            return Err(RecordingError {
                path: dir.join(PARTITION_SIDECAR),
                line: None,
                reason: format!("lists index file {k} as '{}' where the recording wrote '{want}': edited by hand? restore it from a copy", f.file),
            }
            .into());
        }
        if k + 1 == index_files.len() && !dir.join(&f.file).exists() {
            continue;
        }
        let block: IndexBlock = read_listed(dir, f, "entries", |b: &IndexBlock| b.parts.len() + b.graph_files.len())?;
        checksums_in.extend(block.parts.keys().map(|n| (n.clone(), f.file.clone())));
        all_parts.extend(block.parts);
        all_files.extend(block.graph_files);
    }
    // The sidecar's own entries: the last index file's again (checked equal), then newer ones.
    for (name, sum) in std::mem::take(parts) {
        match all_parts.insert(name.clone(), sum) {
            Some(before) if before != sum => {
                return Err(RecordingError {
                    path: dir.join(PARTITION_SIDECAR),
                    line: None,
                    reason: format!("lists {name} with another checksum than its index file {}: edited by hand? restore it from a copy", checksums_in[&name]),
                }
                .into())
            }
            _ => {}
        }
    }
    for f in std::mem::take(graph_files) {
        if !all_files.iter().any(|g: &SidecarFile| g == &f) {
            all_files.push(f);
        }
    }
    (*parts, *graph_files) = (all_parts, all_files);
    Ok(checksums_in)
}

/// Fill `sidecar.parts` and `sidecar.graph_files` from its index files and `sidecar.graphs` from
/// its manifest files (in compile order, after any inline ones); returns where each part's
/// checksum is listed ([`Partition::checksums_in`]) and the first missing manifest file
/// ([`Partition::missing_graphs`]), from which on no manifest is read.
///
/// Errors: a manifest file out of sequence (each is named by the first compile it holds, so a
/// file listed twice, out of order or under another name is found), or as [`merge_index`] and
/// [`read_listed`] (a missing manifest file is not an error here).
fn read_sidecar_files(dir: &Path, sidecar: &mut Sidecar) -> Result<(std::collections::BTreeMap<String, String>, Option<String>), Error> {
    let checksums_in = merge_index(dir, &sidecar.index_files, &mut sidecar.parts, &mut sidecar.graph_files)?;
    for f in &sidecar.graph_files {
        let want = format!("_graphs-{:06}.json", sidecar.graphs.len() + 1);
        if f.file != want {
            return Err(RecordingError {
                path: dir.join(PARTITION_SIDECAR),
                line: None,
                reason: format!(
                    "lists the manifest file '{}' where the recording's next one is '{want}' (compile {} on): a file listed \
                     twice, out of order or renamed; restore the sidecar from a copy",
                    f.file,
                    sidecar.graphs.len() + 1
                ),
            }
            .into());
        }
        if !dir.join(&f.file).exists() {
            return Ok((checksums_in, Some(f.file.clone())));
        }
        let graphs: Vec<std::sync::Arc<Manifest>> = read_listed(dir, f, "manifests", Vec::len)?;
        sidecar.graphs.extend(graphs);
    }
    Ok((checksums_in, None))
}

/// Compiles are numbered 1, 2, ... within each recording. Read as one table, a dataset numbers
/// them across recordings: partition `k`'s compiles are shifted by the compiles of the
/// partitions before it (its sidecar's manifest count; the largest compile in its rows when it
/// has no sidecar). [`read`] and [`read_sidecar`] shift alike, so `no_data` lines up.
fn compiles_of(p: &Partition, seen_max: u32) -> u32 {
    p.sidecar.as_ref().map(|s| s.graphs.len() as u32).unwrap_or(seen_max)
}

/// Stream every row of the closed parts of every partition under `root` (partitions by path,
/// parts by name), compiles numbered across recordings (see [`compiles_of`]). Open parts are
/// skipped with a note on stderr.
///
/// Errors: no partition under `root` ("not a dataset"); a part cannot be read (its path named);
/// a partition's rows name a compile its sidecar does not list.
pub(super) fn read(root: &Path, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    let parts = partitions(root)?;
    if parts.iter().all(|p| p.parts.is_empty()) {
        let open: usize = parts.iter().map(|p| p.open.len()).sum();
        return Err(RecordingError {
            path: root.to_path_buf(),
            line: None,
            reason: if open > 0 {
                format!("no closed Parquet part in this dataset, only {open} open part(s) (*.partial): the recording is still being written, or its process was killed before closing a part")
            } else {
                "a directory without Parquet parts: not an opscope dataset (a recording directory holds recording=<id>/part-NNNNN.parquet)".into()
            },
        }
        .into());
    }
    check_parts_belong(&parts)?;
    for p in &parts {
        if let Some(missing) = missing_parts(p) {
            eprintln!(
                "opscope: warning: {} lacks {missing}: deleted or lost since it was written, or closed after a copy of \
                 the dataset was taken; its runs are not in what is read (restore the part to read them)",
                p.dir.display()
            );
        }
    }
    let open: Vec<&PathBuf> = parts.iter().flat_map(|p| &p.open).collect();
    if !open.is_empty() {
        eprintln!(
            "opscope: note: skipped {} open part(s) ({}...): still being written, or left by a killed process; the closed parts are read",
            open.len(),
            open[0].display()
        );
    }
    let mut offset = 0u32;
    for p in &parts {
        let mut max = 0u32;
        for part in &p.parts {
            // The rows are read through the handle that was checked.
            let file = std::fs::File::open(part).map_err(|e| Error::Io { path: part.clone(), error: e })?;
            verify_in(&file, part, p.sidecar.as_ref().map(|s| &s.parts), &p.checksums_in)?;
            super::parquet::read_open(part, file, super::parquet::Origin::ClosedPart, &mut |mut r: RowRef<'_>| {
                max = max.max(r.compile);
                r.compile += offset;
                f(r)
            })?;
        }
        let n = compiles_of(p, max);
        if max > n {
            return Err(RecordingError {
                path: p.dir.join(PARTITION_SIDECAR),
                line: None,
                reason: match &p.missing_graphs {
                    Some(file) => format!(
                        "the rows name compile {max} but only {n} manifest(s) could be read: the manifest file {file} it \
                         lists is missing (a copy taken while the recording was written? copy it again once the recording \
                         has finished, or restore the file)"
                    ),
                    None => format!("the rows name compile {max} but the sidecar lists {n} manifest(s): was the sidecar replaced? Delete it to number compiles from the rows"),
                },
            }
            .into());
        }
        if let Some(file) = &p.missing_graphs {
            eprintln!(
                "opscope: note: {} lists the manifest file {file}, which is missing (a copy taken while the recording was \
                 written?); the parts present need only the {n} manifest(s) before it",
                p.dir.join(PARTITION_SIDECAR).display()
            );
        }
        offset += n;
    }
    Ok(())
}

/// What a reader can do about a part that no longer matches its checksum.
const PART_FIX: &str = "restore it from a copy, or move it out of the dataset to read the other parts (its runs are \
                        then named as missing); a part rewritten on purpose cannot be checked: delete the partition's \
                        _manifest.json to read its parts unchecked (compiles then numbered from the rows, without \
                        their manifests)";

/// Verify the closed part `file` (opened at `part`) against its entry in `parts` (its
/// partition's [`Sidecar::parts`], index files merged in); a part without an entry (a dataset
/// written before checksums, a sidecar lost) is not checked. The handle is left at its start.
/// The error names the file that lists the checksum: `checksums_in`'s entry for the part
/// ([`Partition::checksums_in`]), else `_manifest.json`.
///
/// Errors: the part no longer matches ([`super::checksum::verify`]).
fn verify_in(
    file: &std::fs::File,
    part: &Path,
    parts: Option<&std::collections::BTreeMap<String, Checksum>>,
    checksums_in: &std::collections::BTreeMap<String, String>,
) -> Result<(), Error> {
    let name = part.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let Some(want) = parts.and_then(|s| s.get(&name)) else { return Ok(()) };
    let source = checksums_in.get(&name).map_or(PARTITION_SIDECAR, String::as_str);
    super::checksum::verify_open(file, part, want, &part.with_file_name(source), PART_FIX)
}

/// The checksums a partition's sidecar lists ([`Sidecar::parts`]), if it lists any.
fn listed(p: &Partition) -> Option<&std::collections::BTreeMap<String, Checksum>> {
    p.sidecar.as_ref().map(|s| &s.parts).filter(|s| !s.is_empty())
}

/// Every closed part of a partition whose sidecar lists its parts is one of them, and no two
/// partitions hold one recording (their sidecars name the same [`Sidecar::recording`]): a part
/// copied or renamed in (another recording's, or a copy of one of its own) would be mined as
/// this recording's runs, and a copied partition would count every run twice; neither shows in
/// the rows (their compile and step numbers look like any others). Partitions written before
/// checksums are not checked.
///
/// Errors: a part its partition's sidecar does not list; two partitions of one recording.
fn check_parts_belong(parts: &[Partition]) -> Result<(), Error> {
    for p in parts {
        let Some(sums) = listed(p) else { continue };
        for part in &p.parts {
            let name = part.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            if !sums.contains_key(&name) {
                return Err(RecordingError {
                    path: part.clone(),
                    line: None,
                    reason: format!(
                        "not a part this recording wrote: the partition's {PARTITION_SIDECAR} lists {} part(s) ({}) and \
                         not this one, so it was copied or renamed in, and its rows would be mined as this recording's \
                         runs; move it out of the dataset (or give it back the name the sidecar lists)",
                        sums.len(),
                        sums.keys().take(3).cloned().collect::<Vec<_>>().join(", ") + if sums.len() > 3 { ", ..." } else { "" }
                    ),
                }
                .into());
            }
        }
    }
    let mut seen: std::collections::BTreeMap<&str, &Path> = std::collections::BTreeMap::new();
    for p in parts {
        let Some(id) = p.sidecar.as_ref().and_then(|s| s.recording.as_deref()) else { continue };
        if let Some(first) = seen.insert(id, &p.dir) {
            return Err(RecordingError {
                path: p.dir.clone(),
                line: None,
                reason: format!(
                    "holds recording {id}, as {} does: one recording copied into the dataset twice, whose runs would be \
                     counted twice; move one of the two out of the dataset",
                    first.display()
                ),
            }
            .into());
        }
    }
    Ok(())
}

/// Verify a dataset part read alone (`.../recording=<id>/part-00003.parquet`), opened as `file`,
/// against the checksum in its partition's `_manifest.json`, when there is one (through the
/// handle; left at its start).
///
/// Errors: as [`verify_in`].
pub(super) fn verify_part(file: &std::fs::File, part: &Path) -> Result<(), Error> {
    let part = &super::format::through_link(part, |p| p.with_file_name(PARTITION_SIDECAR));
    let side = part.with_file_name(PARTITION_SIDECAR);
    let Ok(bytes) = std::fs::read(&side) else { return Ok(()) };
    match serde_json::from_slice::<super::format::Sums>(&bytes) {
        Ok(mut sums) => {
            let dir = side.parent().unwrap_or(Path::new("."));
            let checksums_in = merge_index(dir, &sums.index_files, &mut sums.parts, &mut Vec::new())?;
            verify_in(file, part, Some(&sums.parts), &checksums_in)
        }
        Err(_) => Ok(()),
    }
}

/// The closed parts a partition lacks, named (`None` when it lacks none): every
/// `part-NNNNN.parquet` numbered below its sidecar's [`Sidecar::closed_parts`], below the
/// highest closed part present, or below an open part's number (parts are numbered from 0
/// without gaps, and a part is opened only after the one before it closed). An open part left
/// by a killed process is not missing: it was never closed.
pub fn missing_parts(p: &Partition) -> Option<String> {
    let number = |f: &PathBuf, prefix: &str, suffix: &str| -> Option<usize> { f.file_name()?.to_str()?.strip_prefix(prefix)?.strip_suffix(suffix)?.parse().ok() };
    let numbers: std::collections::BTreeSet<usize> = p.parts.iter().filter_map(|f| number(f, "part-", ".parquet")).collect();
    let opened = p.open.iter().filter_map(|f| number(f, "_part-", ".parquet.partial")).max().unwrap_or(0);
    let expected = p.sidecar.as_ref().and_then(|s| s.closed_parts).unwrap_or(0).max(numbers.last().map_or(0, |n| n + 1)).max(opened);
    let missing: Vec<String> = (0..expected).filter(|n| !numbers.contains(n)).map(|n| format!("part-{n:05}.parquet")).collect();
    match missing.len() {
        0 => None,
        1 => Some(missing[0].clone()),
        k if k <= 4 => Some(format!("{k} parts: {}", missing.join(", "))),
        k => Some(format!("{k} parts: {}, ... and {} more", missing[..3].join(", "), k - 3)),
    }
}

/// The sidecars of every partition as one, compiles shifted as [`read`] shifts them. `None` if
/// no partition has one.
///
/// Errors: as [`partitions`]; reading the rows of a partition without a sidecar (for its
/// compile count) when a later partition has one.
pub(super) fn read_sidecar(root: &Path) -> Result<Option<Sidecar>, Error> {
    let parts = partitions(root)?;
    if parts.iter().all(|p| p.sidecar.is_none()) {
        return Ok(None);
    }
    let mut graphs = Vec::new();
    let mut offset = 0u32;
    for p in &parts {
        let n = match &p.sidecar {
            Some(s) => {
                for m in &s.graphs {
                    let mut m = m.clone();
                    // Recordings made before compiles were numbered per recording carry the tag.
                    if m.compile != 0 {
                        std::sync::Arc::make_mut(&mut m).compile += offset;
                    }
                    graphs.push(m);
                }
                s.graphs.len() as u32
            }
            None => {
                let mut max = 0u32;
                for part in &p.parts {
                    super::parquet::read(part, super::parquet::Origin::ClosedPart, &mut |r: RowRef<'_>| max = max.max(r.compile))?;
                }
                max
            }
        };
        offset += n;
    }
    Ok(Some(Sidecar { format: FORMAT, graphs, ends_on_run: false, closed_parts: None, checksum: None, parts: Default::default(), recording: None, graph_files: Vec::new(), index_files: Vec::new() }))
}
