//! Output paths the CLI refuses to write: one that is also an input, and an existing file that
//! is not what the command writes (a recording of ours, an opscope report), unless `--force`.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Result};

/// What a command writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// A recording: `.csv`, `.csv.gz`, or a Parquet dataset directory (`.parquet` or a path
    /// ending in `/`; the sink refuses other names). An existing dataset that holds recordings is
    /// refused: adding to it is [`Output::RecordingAppend`].
    Recording,
    /// A recording added as a new partition to a Parquet dataset that may already hold others
    /// (they are mined together).
    RecordingAppend,
    /// An HTML report: `.html`.
    Report,
    /// JSON: `.json`.
    Json,
    /// A TensorRT calibration cache: `.cache` (text, first line `TRT-<version>-<calibrator>`).
    TrtCache,
}

/// The names a command writing `kind` takes.
fn out_ext(kind: Output) -> &'static str {
    match kind {
        Output::Recording | Output::RecordingAppend => ".csv, .csv.gz or .parquet (a dataset directory)",
        Output::Report => ".html",
        Output::Json => ".json",
        Output::TrtCache => ".cache",
    }
}

/// True if `a` and `b` name the same file (both exist and are the same inode, or equal paths).
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The first bytes of a file (decompressed when it is gzip).
fn head(path: &Path) -> Vec<u8> {
    let Ok(mut f) = std::fs::File::open(path) else { return Vec::new() };
    let mut raw = vec![0u8; 4096];
    let n = f.read(&mut raw).unwrap_or(0);
    raw.truncate(n);
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = vec![0u8; 4096];
        let n = flate2::read::GzDecoder::new(&raw[..]).read(&mut out).unwrap_or(0);
        out.truncate(n);
        return out;
    }
    raw
}

/// True if the existing file at `path` is what `kind` writes: a recording (our CSV header, or a
/// Parquet file beside our manifest sidecar), an opscope report, JSON, or a TensorRT cache.
fn is_ours(path: &Path, kind: Output) -> bool {
    let h = head(path);
    match kind {
        Output::Recording | Output::RecordingAppend => opscope::recording::holds_recording(path),
        Output::Report => String::from_utf8_lossy(&h).contains(r#"<meta name="generator" content="opscope">"#),
        Output::Json => h.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b == b'{'),
        Output::TrtCache => h.starts_with(b"TRT-"),
    }
}

/// Why `out` belongs to a recording and no command may write it (`None` when it does not): a
/// recording's manifest sidecar (`<recording>.manifest.json`, a partition's `_manifest.json`),
/// a sweep's ground truth (`<recording>.truth.json`), a GGUF recording's model description
/// (`<recording>.model.json`), any file inside a capture directory (`<recording>.capture`
/// holding its `manifest.json`), or any file inside a Parquet dataset directory (a path
/// component ending in `.parquet` that is a directory, or a `recording=<id>` partition). A recording written into its own dataset is the sink's business, not this check's.
fn part_of_a_recording(out: &Path, kind: Output) -> Option<String> {
    let name = out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    if kind != Output::Recording && kind != Output::RecordingAppend {
        if name == opscope::recording::PARTITION_SIDECAR || name.ends_with(".manifest.json") {
            return Some("this is a recording's manifest sidecar".into());
        }
        if name.ends_with(".truth.json") {
            return Some("this is a sweep's ground truth (opscope sweep writes it beside its recording)".into());
        }
        if name.ends_with(".model.json") {
            return Some("this is a GGUF recording's model description (record --gguf writes it beside its recording)".into());
        }
    }
    let parent = out.parent()?;
    for dir in parent.ancestors().filter(|d| !d.as_os_str().is_empty()) {
        let n = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if n.ends_with(".capture") && dir.join("manifest.json").is_file() {
            return Some(format!("it is inside the capture directory {} (a capture pass's tensors and their manifest)", dir.display()));
        }
        if n.starts_with("recording=") || (n.ends_with(".parquet") && dir.is_dir()) {
            return Some(format!("it is inside the Parquet dataset {}", if n.starts_with("recording=") { dir.parent().unwrap_or(dir).display() } else { dir.display() }));
        }
    }
    None
}

/// Check that `out` may be written: its name fits `kind`, it is none of `inputs`, and an
/// existing file there is what `kind` writes but not a recording (a new recording never
/// replaces an earlier one) — unless `force`; and never a part of a recording (its sidecar, its
/// truth file, a file inside its dataset directory), even with `force`.
///
/// Errors: name each problem and the fix (another path, or `--force`).
pub fn check(out: &Path, inputs: &[&Path], kind: Output, force: bool) -> Result<()> {
    let name = out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let fits = match kind {
        Output::Recording | Output::RecordingAppend => {
            [".csv", ".csv.gz", ".gz", ".parquet"].iter().any(|e| name.ends_with(e)) || opscope::recording::is_dataset_path(out)
        }
        Output::Report => name.ends_with(".html"),
        Output::Json => name.ends_with(".json"),
        Output::TrtCache => name.ends_with(".cache"),
    };
    if !fits {
        bail!("{}: this command writes {}; name the output file so", out.display(), out_ext(kind));
    }
    if kind == Output::RecordingAppend && !opscope::recording::is_dataset_path(out) {
        bail!(
            "{}: --append adds a partition to a Parquet dataset (a .parquet directory); a CSV recording is one file, \
             which writing would replace: record to a .parquet path, or drop --append and pass --force to replace this file",
            out.display()
        );
    }
    if matches!(kind, Output::Recording | Output::RecordingAppend) {
        opscope::recording::check_path(out)?;
    } else if out.is_dir() {
        bail!("{} is a directory: give a file path ending in {}", out.display(), out_ext(kind));
    } else if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty() && !d.is_dir()) {
        bail!("{}: its directory {} does not exist; create it first", out.display(), dir.display());
    }
    if let Some(why) = part_of_a_recording(out, kind) {
        bail!("{}: {why}; writing there would make the recording unreadable: pick another path (--force does not allow it)", out.display());
    }
    if out.is_dir() {
        // A dataset directory: recordings already in it would be mined with this one.
        let held = opscope::recording::partitions(out)?.len();
        if held > 0 && kind == Output::Recording {
            bail!(
                "{} is a Parquet dataset that already holds {held} recording(s): pass --append to add this one beside \
                 them (they are mined together), or pick another path (--force does not delete recordings)",
                out.display()
            );
        }
        let foreign = std::fs::read_dir(out)?
            .filter_map(|e| e.ok())
            .any(|e| !e.file_name().to_string_lossy().starts_with("recording=") && !e.file_name().to_string_lossy().starts_with('.'));
        if foreign && !force {
            bail!("{} is a directory holding other files than recording=<id> partitions: pick another path (or --force)", out.display());
        }
        return Ok(());
    }
    if force {
        return Ok(());
    }
    let partial = opscope::recording::partial_path(out);
    if matches!(kind, Output::Recording | Output::RecordingAppend) && partial.is_file() {
        bail!("{}; or pass --force to replace it", opscope::recording::partial_in_the_way(&partial));
    }
    if let Some(input) = inputs.iter().find(|i| same_file(out, i)) {
        bail!("{} is also an input ({}): writing it would destroy it; pick another output path (or --force)", out.display(), input.display());
    }
    if !out.is_file() {
        return Ok(());
    }
    let ours = is_ours(out, kind);
    if ours && kind == Output::Recording {
        // A written recording is never lost to a second `record` with the same --out: a
        // Parquet dataset that holds one is refused above, and a CSV recording is too.
        bail!(
            "{} already holds an opscope recording: refusing to replace it; pick another path, or pass --force to \
             replace it (a Parquet dataset, a .parquet path, takes --append to add a recording beside earlier ones)",
            out.display()
        );
    }
    if !ours {
        bail!(
            "{} exists and is not {}: refusing to overwrite it; pick another path (or --force)",
            out.display(),
            match kind {
                Output::Recording | Output::RecordingAppend => "an opscope recording",
                Output::Report => "an opscope report",
                Output::Json => "a JSON file",
                Output::TrtCache => "a TensorRT calibration cache",
            }
        );
    }
    Ok(())
}

/// The lock file a new recording holds on its output path while it is written: `<dataset>/.opscope-writing`
/// for a Parquet dataset (hidden: readers and the partition listing skip dot files), `<file>.writing`
/// beside a CSV recording.
pub fn claim_path(out: &Path) -> std::path::PathBuf {
    if opscope::recording::is_dataset_path(out) {
        out.join(".opscope-writing")
    } else {
        let mut s = out.as_os_str().to_owned();
        s.push(".writing");
        std::path::PathBuf::from(s)
    }
}

/// A process's claim on a recording path for a new recording (see [`claim`]): an exclusive
/// `flock` on the lock file, held while the claim lives. Dropping it removes the lock file (while
/// still locked) and a dataset directory the claim created if it is still empty (a recording that
/// failed before its first part leaves nothing behind).
#[derive(Debug)]
pub struct Claim {
    lock: std::path::PathBuf,
    /// The open lock file: closing it releases the `flock`.
    file: Option<std::fs::File>,
    made_root: Option<std::path::PathBuf>,
}

/// The lock files of the claims this process holds, for [`release_claims`].
/// Each with the dataset directory the claim created, if it did.
static HELD: std::sync::Mutex<Vec<(std::path::PathBuf, Option<std::path::PathBuf>)>> = std::sync::Mutex::new(Vec::new());

/// Remove the lock files of every claim this process holds, and a dataset directory a claim
/// created if it is now empty (as [`Claim`]'s drop does): for an exit that skips destructors
/// (`std::process::exit` after a signal), so no lock file is left beside the recording. (The
/// `flock` itself ends with the process whatever the exit.)
pub fn release_claims() {
    for (lock, made_root) in HELD.lock().map(|mut h| std::mem::take(&mut *h)).unwrap_or_default() {
        let _ = std::fs::remove_file(lock);
        if let Some(root) = made_root {
            let _ = std::fs::remove_dir(root); // only succeeds while it is empty
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Ok(mut h) = HELD.lock() {
            h.retain(|(p, _)| p != &self.lock);
        }
        // Unlink before unlocking: a process that opened this file before the unlink gets the
        // lock only after, finds the path no longer names its file, and starts again.
        let _ = std::fs::remove_file(&self.lock);
        drop(self.file.take());
        if let Some(root) = &self.made_root {
            let _ = std::fs::remove_dir(root); // only succeeds while it is empty
        }
    }
}

/// This machine's name, for the lock file's text (who holds it, named in the refusal).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Claim `out` for a new recording (`kind` [`Output::Recording`], after [`check`] passed): take an
/// exclusive, non-blocking `flock` on its lock file ([`claim_path`]), then check again, under the
/// claim, that a dataset holds no recording yet. Without it, two `record` runs started together
/// into one new dataset both passed [`check`] (neither had written a part yet) and both recorded,
/// to be mined together as one; two into one CSV path wrote the same `.partial` file. The kernel
/// releases a `flock` when its process ends however it ends (`kill -9`, a crash), so a lock file
/// a dead writer left is simply locked again: no pid is trusted. After locking, the path must
/// still name the locked file (a writer that finished unlinks it while holding the lock; a process
/// that had opened the old file retries). [`Output::RecordingAppend`] takes no claim: writers that
/// add partitions beside each other are what a dataset is for.
///
/// Errors: another process holds the lock (the error names the pid and host its lock file gives,
/// and the fixes: wait, `--append`, another path); the dataset gained a recording between
/// [`check`] and the claim; the lock file cannot be created or locked.
pub fn claim(out: &Path, kind: Output) -> Result<Option<Claim>> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::io::AsRawFd;
    if kind != Output::Recording {
        return Ok(None);
    }
    let dataset = opscope::recording::is_dataset_path(out);
    let lock = claim_path(out);
    let mut made_root = None;
    for _ in 0..100 {
        if dataset && !out.exists() {
            match std::fs::create_dir(out) {
                Ok(()) => made_root = Some(out.to_path_buf()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {} // another writer made it
                Err(e) => bail!("{}: cannot create the dataset directory: {e}", out.display()),
            }
        }
        let mut file = match std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock) {
            Ok(f) => f,
            // A failed writer removed the (empty) dataset directory in between: make it again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dataset => continue,
            Err(e) => bail!("{}: cannot create the lock file {}: {e}", out.display(), lock.display()),
        };
        // SAFETY: flock on a file descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                bail!("{}: cannot lock {}: {e}", out.display(), lock.display());
            }
            let mut held = String::new();
            let _ = file.read_to_string(&mut held);
            let field = |k: &str| held.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap_or("").to_string();
            let (pid, host) = (field("pid="), field("host="));
            let who = if pid.is_empty() { "another process".to_string() } else { format!("process {pid} on host '{host}'") };
            bail!(
                "{}: {who} is writing a new recording there now (it holds {}): wait for it to finish, pass --append to \
                 record beside it (Parquet datasets), or pick another path",
                out.display(),
                lock.display()
            );
        }
        // Locked: is the path still this file? (Its holder may have unlinked it after we opened it.)
        let same = match (file.metadata(), std::fs::metadata(&lock)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if !same {
            continue;
        }
        let me = format!("pid={} host={}\n", std::process::id(), host_name());
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(me.as_bytes()))
            .and_then(|_| file.sync_all())
            .map_err(|e| anyhow::anyhow!("{}: {e}", lock.display()))?;
        if let Ok(mut h) = HELD.lock() {
            h.push((lock.clone(), made_root.clone()));
        }
        let claim = Claim { lock, file: Some(file), made_root };
        if dataset {
            let held = opscope::recording::partitions(out)?.len();
            if held > 0 {
                bail!(
                    "{} is a Parquet dataset that already holds {held} recording(s) (written while this one started): pass --append \
                     to add this one beside them (they are mined together), or pick another path",
                    out.display()
                );
            }
        }
        return Ok(Some(claim));
    }
    bail!("{}: could not take the lock {} (it was replaced 100 times while trying): try again", out.display(), lock.display())
}
