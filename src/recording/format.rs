//! The recording format: columns, rows, the manifest sidecar and file lifecycle
//! (`<path>.partial` until finished, then an atomic rename).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::manifest::Manifest;

/// One row of a recording. The key is `run_id, compile, step, pass_idx, site, role, stat, idx`
/// (unique: a test checks it); repeated strings are shared (`Arc<str>`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Recording run id (one per recorder).
    pub run_id: Arc<str>,
    /// Compile within the recording (`Manifest::compile`: 1, 2, ... in the order the recording
    /// first saw each compile; not the process-wide tag written into the sketches): one graph
    /// compiled twice gives two compiles, each with its own steps.
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
    /// FLOPs of one execution of the site, empty if unknown: a multiply-add counts 2 (a
    /// matmul `[M, K] @ [K, N]` is `2 M K N`, `analysis::cost`).
    pub flops: Option<u64>,
}

/// The rows of one statistic of one tensor at one use, in columnar form: the key columns
/// (everything but `idx` and `value`) are the same for every row, and element `i` of `values`
/// is the row with `idx = i`. A NaN element means "undefined for this data" and is not a row
/// (so a block of `n` values holds `n` minus its NaN count rows).
///
/// The recorder hands blocks to [`super::Sink::write_block`]: a columnar sink (the Parquet
/// dataset) appends them without building a [`Row`] per value; the others expand them
/// ([`Block::rows`]).
#[derive(Debug, Clone, Copy)]
pub struct Block<'a> {
    /// Recording run id.
    pub run_id: &'a Arc<str>,
    /// Compile within the recording.
    pub compile: u32,
    /// Run index of the compiled graph.
    pub step: u64,
    /// Graph name.
    pub graph: &'a Arc<str>,
    /// Pass that recorded the rows.
    pub pass: &'a Arc<str>,
    /// Position of that pass in the pipeline.
    pub pass_idx: u32,
    /// Site name.
    pub site: &'a Arc<str>,
    /// Op at the site.
    pub op: &'a Arc<str>,
    /// Role of the tensor at the site.
    pub role: &'a Arc<str>,
    /// Statistic.
    pub stat: &'a Arc<str>,
    /// Elements in the tensor, if its shape is known.
    pub numel: Option<u64>,
    /// Shape of the tensor.
    pub shape: &'a Arc<str>,
    /// FLOPs of one execution of the site, if known.
    pub flops: Option<u64>,
    /// Element `i` is the value of the row with `idx = i`; NaN elements are not rows.
    pub values: &'a [f32],
}

impl Block<'_> {
    /// The rows the block stands for, in `idx` order, NaN elements left out.
    pub fn rows(&self) -> impl Iterator<Item = Row> + '_ {
        self.values.iter().enumerate().filter(|(_, x)| !x.is_nan()).map(|(i, &value)| Row {
            run_id: self.run_id.clone(),
            compile: self.compile,
            step: self.step,
            graph: self.graph.clone(),
            pass: self.pass.clone(),
            pass_idx: self.pass_idx,
            site: self.site.clone(),
            op: self.op.clone(),
            role: self.role.clone(),
            stat: self.stat.clone(),
            idx: i as u64,
            value,
            numel: self.numel,
            shape: self.shape.clone(),
            flops: self.flops,
        })
    }

    /// The number of rows ([`Block::rows`]): values that are not NaN.
    pub fn row_count(&self) -> usize {
        self.values.iter().filter(|x| !x.is_nan()).count()
    }
}

/// The type of a recording column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    /// Text (dictionary-encoded in Parquet).
    Text,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// 32-bit float.
    F32,
}

/// One column of a recording: name, type, whether it may be empty, and what it holds.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    /// Column name (CSV header, Arrow field).
    pub name: &'static str,
    /// Type.
    pub ty: ColumnType,
    /// Empty (CSV) / null (Parquet) allowed.
    pub nullable: bool,
    /// What it holds.
    pub doc: &'static str,
}

const fn col(name: &'static str, ty: ColumnType, nullable: bool, doc: &'static str) -> Column {
    Column { name, ty, nullable, doc }
}

/// The columns of a recording, in [`Row`]'s field order: the one list the CSV header, the
/// Arrow schema and both readers are built from.
pub const COLUMNS: [Column; 15] = [
    col("run_id", ColumnType::Text, false, "recording id, one per recorder (a scope, or the process in the environment mode): run-<unix seconds>-<pid>-<n>-<8 random hex digits>"),
    col("compile", ColumnType::U32, false, "the tapped compile within the recording, 1, 2, ... (a graph compiled twice is two compiles); group by (compile, step), never by step alone"),
    col("step", ColumnType::U64, false, "execution of that compiled graph, 0-based"),
    col("graph", ColumnType::Text, false, "graph name"),
    col("pass", ColumnType::Text, false, "pass that recorded the row"),
    col("pass_idx", ColumnType::U32, false, "position of that pass in the pipeline, 0-based"),
    col("site", ColumnType::Text, false, "site name"),
    col("op", ColumnType::Text, false, "op at the site as RLX prints it"),
    col("role", ColumnType::Text, false, "role of the tensor at the site (lhs, rhs, out, probs, ...)"),
    col("stat", ColumnType::Text, false, "statistic"),
    col("idx", ColumnType::U64, false, "element index within a vector statistic (0 for a scalar)"),
    col("value", ColumnType::F32, false, "the value"),
    col("numel", ColumnType::U64, true, "elements of the tensor; empty if its shape is symbolic"),
    col("shape", ColumnType::Text, false, "shape of the tensor ([2,16,384])"),
    col("flops", ColumnType::U64, true, "FLOPs of one execution of the site; empty if unknown"),
];

/// Index of the column named `name` in [`COLUMNS`].
pub fn column_index(name: &str) -> Option<usize> {
    COLUMNS.iter().position(|c| c.name == name)
}

/// Column names, the CSV header.
pub fn header() -> [&'static str; 15] {
    COLUMNS.map(|c| c.name)
}

/// Recording format version written in the sidecar: 2 since a dataset partition's manifests
/// and earlier part checksums are in files `_manifest.json` lists ([`Sidecar::graph_files`],
/// [`Sidecar::index_files`]); 1 before. A reader refuses a sidecar of a later version (its
/// fields would be read as absent) and reads every earlier one.
pub const FORMAT: u32 = 2;

/// The manifest sidecar written next to a recording (`<recording>.manifest.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sidecar {
    /// Recording format version.
    pub format: u32,
    /// One manifest per tapped compile (shared with the recorder that wrote them: a sink keeps
    /// the recorder's manifests, not copies).
    pub graphs: Vec<std::sync::Arc<Manifest>>,
    /// Written true only beside a `.partial` CSV recording its sink closed right after a run's
    /// rows were flushed (an interrupt, or an error between runs): its last run is whole, and a
    /// reader keeps it. Absent (false) otherwise: a reader of a `.partial` CSV recording leaves
    /// its last run out, which a crash may have cut.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ends_on_run: bool,
    /// In a dataset partition's `_manifest.json`: how many parts were closed when it was
    /// written (it is rewritten as each part closes, and last after the last one), so a reader
    /// finds a part that was deleted or lost since (`part-NNNNN.parquet` numbered from 0).
    /// Absent in a CSV recording's sidecar and in datasets written before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_parts: Option<usize>,
    /// Beside a CSV or single Parquet recording (finished, or a `.partial` its sink closed): the
    /// file's length and CRC-32 when it was closed, verified before its rows are read
    /// ([`super::checksum`]). Absent in recordings written before it was added, and beside a
    /// `.partial` left by a crash (no sidecar then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<super::checksum::Checksum>,
    /// In a dataset partition's `_manifest.json`: each closed part's checksum, by file name
    /// (`part-00000.parquet`), verified before the part is read; those of earlier parts are in
    /// the files [`Sidecar::index_files`] lists (filled in here when a dataset is read). Absent
    /// in datasets written before it was added.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub parts: std::collections::BTreeMap<String, super::checksum::Checksum>,
    /// In a dataset partition's `_manifest.json`: the recording id the partition holds (its
    /// directory is `recording=<id>`), so a copy of the partition under another name is found
    /// (two partitions of one recording would count its runs twice). Absent before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recording: Option<String>,
    /// In a dataset partition's `_manifest.json`: the files that hold its manifests, in compile
    /// order, after those in its [`Sidecar::index_files`] (`graphs` is then empty in the file,
    /// and filled from them when a dataset is read, [`super::partitions`]). Each is written once, with the compiles first seen since the one
    /// before it, so a recording that compiles thousands of graphs writes each manifest once
    /// rather than all of them at every part's close (quadratic in the compiles). Absent in
    /// datasets written before it was added (their manifests are inline in `graphs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub graph_files: Vec<SidecarFile>,
    /// In a dataset partition's `_manifest.json`: the index files (`_index-NNNNN.json`, NNNNN
    /// = 0, 1, ...), each an [`IndexBlock`] of the earlier entries of `parts` and
    /// `graph_files`, written once when the two lists reached `recording::ENTRIES_PER_INDEX_FILE`
    /// (512) entries together (and restarted empty): `_manifest.json`, rewritten at every part's
    /// close, stays bounded however long the recording runs (it lists the last index file's entries
    /// too, for a copy taken while the recording ran). Merged into `parts` and
    /// `graph_files` when a dataset is read. Absent before it was added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub index_files: Vec<SidecarFile>,
}

/// One index file of a dataset partition (`_index-NNNNN.json`, [`Sidecar::index_files`]): the
/// entries `_manifest.json` listed before they moved here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexBlock {
    /// Part checksums by file name, as [`Sidecar::parts`].
    #[serde(default)]
    pub parts: std::collections::BTreeMap<String, super::checksum::Checksum>,
    /// Files of manifests, in compile order, as [`Sidecar::graph_files`].
    #[serde(default)]
    pub graph_files: Vec<SidecarFile>,
}

/// A file a dataset partition's `_manifest.json` lists, written once (synced, renamed into
/// place) before the part that needs it is renamed into place: `_graphs-NNNNNN.json` (a JSON
/// array of [`Manifest`]s; NNNNNN the first compile it holds, numbered from 1) or
/// `_index-NNNNN.json` (an [`IndexBlock`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SidecarFile {
    /// The file's name in the partition directory.
    pub file: String,
    /// How many manifests it holds, or entries (part checksums and manifest files together).
    pub entries: usize,
    /// Its length and CRC-32, verified when it is read.
    pub checksum: super::checksum::Checksum,
}

/// A sidecar of format `format` at `side` is one this version reads.
///
/// Errors: a later format than [`FORMAT`] (its new fields would be read as absent, and the
/// recording misread).
pub(super) fn check_format(side: &Path, format: u32) -> Result<(), Error> {
    if format > FORMAT {
        return Err(super::RecordingError {
            path: side.to_path_buf(),
            line: None,
            reason: format!("written by a later opscope (recording format {format}; this one reads formats up to {FORMAT}): read it with that version or a later one"),
        }
        .into());
    }
    Ok(())
}

/// The checksums of a sidecar alone (the rest of its JSON is skipped unparsed): what a reader
/// verifies a file against.
#[derive(Debug, Default, Deserialize)]
pub(super) struct Sums {
    #[serde(default)]
    pub checksum: Option<super::checksum::Checksum>,
    /// A dataset partition's part checksums (read by the Parquet reader only).
    #[serde(default)]
    #[cfg_attr(not(feature = "parquet"), allow(dead_code))]
    pub parts: std::collections::BTreeMap<String, super::checksum::Checksum>,
    /// A dataset partition's index files ([`Sidecar::index_files`]), for its earlier parts'
    /// checksums.
    #[serde(default)]
    #[cfg_attr(not(feature = "parquet"), allow(dead_code))]
    pub index_files: Vec<SidecarFile>,
}

/// A recording opened for reading and checked, through the handle its rows are then read from,
/// against the checksum its sidecar holds ([`open_checked`]).
pub(super) struct Opened {
    /// The file, at its start: the inode that was checked, whatever is renamed over its path
    /// after.
    pub file: std::fs::File,
    /// With `rows_first_when_cut`, the error for a file whose length differs from its
    /// checksum's, for the caller to give after reading the rows (which say where a cut is);
    /// `None` otherwise.
    pub cut: Option<Error>,
}

/// Open the file at `recording` and verify it through that handle against the checksum in its
/// sidecar, when the sidecar has one (see [`super::checksum::verify`], `fix` as there), so the
/// bytes checked are the bytes then read. A sidecar that is missing or does not parse is left
/// to the reader of the manifests, which says what it is. With `rows_first_when_cut`, a file
/// whose length differs is returned with its error in [`Opened::cut`] instead.
///
/// Errors: the file cannot be opened or read; it no longer matches its checksum.
pub(super) fn open_checked(recording: &Path, fix: &str, rows_first_when_cut: bool) -> Result<Opened, Error> {
    let recording = &through_link(recording, sidecar_path);
    let open = || std::fs::File::open(recording).map_err(|e| Error::Io { path: recording.clone(), error: e });
    let mut tried = None;
    for attempt in 1.. {
        let file = open()?;
        let Some((want, side)) = sidecar_checksum(recording) else { return Ok(Opened { file, cut: None }) };
        match super::checksum::verify_open(&file, recording, &want, &side, fix) {
            Ok(()) => return Ok(Opened { file, cut: None }),
            // A recording replaced while it was being checked (another process's `--force`
            // renamed a new file and then its sidecar into place) is opened and checked again
            // against the sidecar it has now; the same checksum failing twice, or a third
            // failure, is damage.
            Err(e) if tried == Some(want) || attempt == 3 => {
                let len = file.metadata().map_err(|e| Error::Io { path: recording.clone(), error: e })?.len();
                if rows_first_when_cut && len != want.bytes {
                    return Ok(Opened { file, cut: Some(e) });
                }
                return Err(e);
            }
            Err(_) => tried = Some(want),
        }
    }
    unreachable!("the loop returns by its third attempt")
}

/// The checksum the sidecar of `recording` holds for it, with the sidecar's path; `None` when
/// there is no sidecar, it does not parse (its reader says so), or it holds no checksum. A
/// symbolic link without a sidecar of its own is checked against its target's.
pub(super) fn sidecar_checksum(recording: &Path) -> Option<(super::checksum::Checksum, PathBuf)> {
    let recording = &through_link(recording, sidecar_path);
    let side = sidecar_path(recording);
    let bytes = std::fs::read(&side).ok()?;
    let sums = serde_json::from_slice::<Sums>(&bytes).ok()?;
    Some((sums.checksum?, side))
}

/// `path`, or, when it is a symbolic link with no sidecar beside it (`sidecar` names where that
/// is) but its target has one, the target: the recording's checksum is beside the file it was
/// written as.
pub(super) fn through_link(path: &Path, sidecar: impl Fn(&Path) -> PathBuf) -> PathBuf {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if link && !sidecar(path).exists() {
        if let Ok(target) = std::fs::canonicalize(path) {
            if sidecar(&target).exists() {
                return target;
            }
        }
    }
    path.to_path_buf()
}

/// Path of the manifest sidecar of a recording.
pub fn sidecar_path(recording: &Path) -> PathBuf {
    let mut s = recording.as_os_str().to_owned();
    s.push(".manifest.json");
    PathBuf::from(s)
}

/// Where a recording is written until it is finished: `<path>.partial`.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// True if `path` names a Parquet dataset: a name ending in `.parquet` that is not an existing
/// file (a single-file recording of an earlier opscope), a path ending in `/`, or an existing
/// directory that holds `recording=<id>` partitions (any other existing directory is refused
/// as an output, so that a recording never lands in a directory by mistake).
pub fn is_dataset_path(path: &Path) -> bool {
    let s = path.as_os_str().to_string_lossy();
    let holds_recordings = path.is_dir()
        && std::fs::read_dir(path).is_ok_and(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().starts_with("recording=")));
    holds_recordings || s.ends_with('/') || (s.ends_with(".parquet") && !path.is_file())
}

/// Check that a Parquet dataset can be written at `root`: not a file, and its parent exists.
///
/// Errors: `root` is a file (a single-file recording of an earlier opscope), or its directory
/// does not exist.
pub fn check_dataset_path(root: &Path) -> Result<(), Error> {
    let bad = |why: &str| Err(Error::BadPath { path: root.to_path_buf(), why: why.into() });
    if root.is_file() {
        return bad(
            "is a file (a single-file recording?): a Parquet recording is a dataset directory of parts; \
             move the file away or pick another path",
        );
    }
    match root.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => bad("its directory does not exist; create it first"),
        _ => Ok(()),
    }
}

/// Check that a recording can be written at `path` (a file, or for a Parquet dataset
/// ([`is_dataset_path`]) a directory; its directory exists), without creating anything: for
/// failing before a long job rather than after it.
///
/// Errors: [`Error::BadPath`] naming the problem and the fix: a CSV path that is a directory or
/// not a regular file (a FIFO, socket or device), a directory that does not exist; for a
/// dataset path, what [`check_dataset_path`] refuses (a file at the path, a missing parent
/// directory).
pub fn check_path(path: &Path) -> Result<(), Error> {
    if is_dataset_path(path) {
        return check_dataset_path(path);
    }
    let bad = |why: &str| {
        Err(Error::BadPath {
            path: path.to_path_buf(),
            why: why.into(),
        })
    };
    if path.is_dir() {
        return bad("is a directory; give a file path such as <dir>/recording.csv.gz");
    }
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        // A recording is written beside its path and renamed over it, which would replace a
        // FIFO (its reader then waits forever on the unlinked pipe), a socket or a device.
        return bad("is not a regular file (a FIFO, socket or device): a recording is renamed into place over it; give a regular file path");
    }
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => {
            bad("its directory does not exist; create it first")
        }
        _ => Ok(()),
    }
}

/// True if the file at `path` holds an opscope recording: a CSV table whose first line is the
/// recording [`header`] (read through gzip when the file is gzip), or a Parquet file beside its
/// manifest sidecar ([`sidecar_path`]). False for anything else, and for a file that cannot be
/// read.
pub fn holds_recording(path: &Path) -> bool {
    use std::io::Read;
    let Ok(mut f) = std::fs::File::open(path) else { return false };
    let mut raw = vec![0u8; 4096];
    let n = f.read(&mut raw).unwrap_or(0);
    raw.truncate(n);
    if raw.starts_with(b"PAR1") {
        return sidecar_path(path).exists();
    }
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = vec![0u8; 4096];
        let n = flate2::read::GzDecoder::new(&raw[..]).read(&mut out).unwrap_or(0);
        out.truncate(n);
        raw = out;
    }
    raw.starts_with(header().join(",").as_bytes())
}

/// Whether a new recording may be written at `path` over what is there: `Ok(false)` when no
/// file is there (or an empty one: nothing to lose), `Ok(true)` when the file holds an opscope
/// recording (the new one replaces it once complete: a CSV recording is written to
/// `<path>.partial` and renamed into place), and an error naming the fix for any other file,
/// which a recording never overwrites, and for a `<path>.partial` already there (an interrupted
/// recording, or one another process is writing), which the new recording's rows would
/// replace. A directory is left to the sinks ([`check_path`]: a Parquet dataset adds its
/// partition beside the others).
///
/// Errors: [`Error::BadPath`] for an existing file that is not an opscope recording, or an
/// existing `<path>.partial`.
pub fn check_replaceable(path: &Path) -> Result<bool, Error> {
    let partial = partial_path(path);
    if partial.exists() && !is_dataset_path(path) {
        return Err(Error::BadPath { path: path.to_path_buf(), why: partial_in_the_way(&partial) });
    }
    if !path.is_file() || std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Ok(false);
    }
    if holds_recording(path) {
        return Ok(true);
    }
    Err(Error::BadPath {
        path: path.to_path_buf(),
        why: "exists and is not an opscope recording: refusing to overwrite it; pick another path, or remove the file".into(),
    })
}

/// Why a new recording does not start over the `.partial` at `partial`, and what to do: read it,
/// move or remove it, or pick another path; when it holds no row (empty, or the CSV header
/// only: a recording stopped before its first run reached the disk, or one another process has
/// just begun), that there is nothing to read and it may be removed if no other process is
/// recording there.
pub fn partial_in_the_way(partial: &Path) -> String {
    // Only a file no longer than the header line is read (a `.partial` may hold gigabytes).
    let line = header().join(",") + "\n";
    let small = std::fs::metadata(partial).is_ok_and(|m| m.len() <= line.len() as u64);
    let text = if small { std::fs::read(partial).unwrap_or_default() } else { b"-".to_vec() };
    let header_only = text.is_empty() || text == line.as_bytes();
    if header_only {
        format!(
            "{} is there and holds no row: a recording stopped before its first run reached the disk, or one another \
             process has just begun; if no other process records there, remove it (nothing is lost), or pick another path",
            partial.display()
        )
    } else {
        format!(
            "{} is there: an interrupted recording, or one another process is writing; this recording would replace it: \
             read it (`opscope mine {}`), move or remove it, or pick another path",
            partial.display(),
            partial.display()
        )
    }
}

/// Write `bytes` to `path` atomically (temporary name `<path>.partial`, fsync, rename): a reader
/// sees the old file or the whole new one.
///
/// Errors: [`Error::Io`] naming `path` when the temporary file cannot be written (a full disk,
/// a file-size limit) or renamed; the `.partial` file is then left beside it, `path` unchanged.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let tmp = partial_path(path);
    write_synced(&tmp, bytes).map_err(|source| Error::Io { path: path.to_path_buf(), error: source })?;
    std::fs::rename(&tmp, path).map_err(|source| Error::Io { path: path.to_path_buf(), error: source })
}

/// Create `path` holding `bytes`, written and synced to disk.
pub(super) fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// What an I/O error's text says of its cause, for a message: the file-size limit or a full
/// disk; empty otherwise.
pub(super) fn space_hint(error: &str) -> &'static str {
    if error.contains("File too large") || error.contains("os error 27") {
        " (the file-size limit, `ulimit -f`, was reached)"
    } else if error.contains("No space left") || error.contains("os error 28") {
        " (the disk is full)"
    } else {
        ""
    }
}


/// Write the manifest sidecar of the recording at `recording` (atomically).
///
/// Errors: the sidecar cannot be written.
pub fn write_sidecar(recording: &Path, graphs: Vec<std::sync::Arc<Manifest>>) -> Result<(), Error> {
    write_sidecar_ending(recording, graphs, false, None)
}

/// [`write_sidecar`] with [`Sidecar::ends_on_run`] and the file's [`Sidecar::checksum`].
pub(super) fn write_sidecar_ending(
    recording: &Path,
    graphs: Vec<std::sync::Arc<Manifest>>,
    ends_on_run: bool,
    checksum: Option<super::checksum::Checksum>,
) -> Result<(), Error> {
    write_atomic(&sidecar_path(recording), &sidecar_json(graphs, ends_on_run, checksum)?)
}

/// The JSON text of a manifest sidecar.
pub(super) fn sidecar_json(
    graphs: Vec<std::sync::Arc<Manifest>>,
    ends_on_run: bool,
    checksum: Option<super::checksum::Checksum>,
) -> Result<Vec<u8>, Error> {
    serde_json::to_vec_pretty(&Sidecar { format: FORMAT, graphs, ends_on_run, closed_parts: None, checksum, parts: Default::default(), recording: None, graph_files: Vec::new(), index_files: Vec::new() })
        .map_err(|e| Error::Internal(format!("manifest JSON: {e}")))
}

/// A recording id, unique per recorder: `run-<unix seconds>-<pid>-<n>-<8 hex digits>`, `n`
/// counting the recorders of the process (two scopes of one process get two ids) and the hex
/// digits random (two processes with one PID in one second get two ids).
pub fn new_run_id() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(1);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // 32 random bits: two processes of one PID started in the same second (PID 1 in two
    // containers, jobs of a cluster array) still get different ids, so their partitions of a
    // shared dataset never coincide.
    format!("run-{secs}-{}-{}-{:08x}", std::process::id(), N.fetch_add(1, Ordering::Relaxed), rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::super::checksum::Checksum;
    use super::*;

    /// The rows are read from the file that was checked: a recording renamed over the path after
    /// its check (another process's `--force`) never reaches a reader through a checked handle.
    #[test]
    fn a_checked_handle_reads_the_bytes_that_were_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.csv");
        let old = b"the bytes that were checked".to_vec();
        let sum = |b: &[u8]| Some(Checksum::of(b));
        std::fs::write(&path, &old).unwrap();
        std::fs::write(sidecar_path(&path), sidecar_json(vec![], true, sum(&old)).unwrap()).unwrap();
        let mut opened = open_checked(&path, "restore it", false).unwrap();
        assert!(opened.cut.is_none());
        let new = dir.path().join("new");
        std::fs::write(&new, b"a recording never checked").unwrap();
        std::fs::rename(&new, &path).unwrap();
        let mut read = Vec::new();
        opened.file.read_to_end(&mut read).unwrap();
        assert_eq!(read, old);

        // Through the handle, a changed byte is refused, and a cut file is refused or, when the
        // caller reads its rows first, handed back with its error.
        std::fs::write(&path, b"the bytes that were checkeD").unwrap();
        let e = open_checked(&path, "restore it", false).err().expect("a changed byte").to_string();
        assert!(e.contains("its bytes changed since it was closed"), "{e}");
        std::fs::write(&path, b"the bytes").unwrap();
        let e = open_checked(&path, "restore it", false).err().expect("a cut file").to_string();
        assert!(e.contains("it holds 9 bytes, and held 27"), "{e}");
        let cut = open_checked(&path, "restore it", true).expect("the rows first").cut.expect("its error").to_string();
        assert_eq!(cut, e);
    }

    /// A recording replaced while it was being checked (another process's `--force` renamed the new
    /// file into place, then its sidecar): checked first against the old sidecar, it fails; the
    /// check is made again against the sidecar as it is now, which matches, and the file is
    /// accepted (and read through the checked handle). Deterministic: the sidecar is first a FIFO
    /// that gives the old sidecar, and the new sidecar is renamed over it before the FIFO's writer
    /// closes, so the first read ends after the rename and the second read finds the new one.
    #[test]
    fn a_recording_replaced_during_its_check_is_checked_again_against_its_new_sidecar() {
        use std::io::Write;
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.csv");
        let (old, new) = (b"the recording before --force".to_vec(), b"the recording after  --force".to_vec());
        assert_eq!(old.len(), new.len());
        let sum = |b: &[u8]| Some(Checksum::of(b));
        std::fs::write(&path, &new).unwrap();
        let side = sidecar_path(&path);
        let staged = dir.path().join("new.manifest.json");
        std::fs::write(&staged, sidecar_json(vec![], true, sum(&new)).unwrap()).unwrap();
        let fifo = std::ffi::CString::new(side.as_os_str().as_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
        let old_sidecar = sidecar_json(vec![], true, sum(&old)).unwrap();
        let writer = std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().write(true).open(&side).unwrap(); // waits for the first read
            f.write_all(&old_sidecar).unwrap();
            std::fs::rename(&staged, &side).unwrap();
            drop(f); // the first read ends here, the new sidecar already in place
        });
        let opened = open_checked(&path, "restore it", false);
        writer.join().unwrap();
        let mut opened = opened.expect("checked again against the new sidecar");
        assert!(opened.cut.is_none());
        let mut read = Vec::new();
        opened.file.read_to_end(&mut read).unwrap();
        assert_eq!(read, new);
        // The same old sidecar twice is damage: refused (the check the retry must not weaken).
        std::fs::write(sidecar_path(&path), sidecar_json(vec![], true, sum(&old)).unwrap()).unwrap();
        let e = open_checked(&path, "restore it", false).err().expect("a changed byte").to_string();
        assert!(e.contains("its bytes changed since it was closed"), "{e}");
    }
}
