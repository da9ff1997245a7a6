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
        Output::Recording | Output::RecordingAppend => {
            let header = opscope::recording::header().join(",");
            h.starts_with(header.as_bytes())
                || (h.starts_with(b"PAR1") && opscope::recording::sidecar_path(path).exists())
        }
        Output::Report => String::from_utf8_lossy(&h).contains(r#"<meta name="generator" content="opscope">"#),
        Output::Json => h.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b == b'{'),
        Output::TrtCache => h.starts_with(b"TRT-"),
    }
}

/// Check that `out` may be written: its name fits `kind`, it is none of `inputs`, and an
/// existing file there is what `kind` writes — unless `force`.
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
        let want = match kind {
            Output::Recording | Output::RecordingAppend => ".csv, .csv.gz or .parquet (a dataset directory)",
            Output::Report => ".html",
            Output::Json => ".json",
            Output::TrtCache => ".cache",
        };
        bail!("{}: this command writes {want}; name the output file so", out.display());
    }
    if kind == Output::RecordingAppend && !opscope::recording::is_dataset_path(out) {
        bail!(
            "{}: --append adds a partition to a Parquet dataset (a .parquet directory); a CSV recording is one file, \
             which writing would replace: record to a .parquet path, or drop --append to replace this file",
            out.display()
        );
    }
    opscope::recording::check_path(out)?;
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
    if let Some(input) = inputs.iter().find(|i| same_file(out, i)) {
        bail!("{} is also an input ({}): writing it would destroy it; pick another output path (or --force)", out.display(), input.display());
    }
    if out.is_file() && !is_ours(out, kind) {
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
