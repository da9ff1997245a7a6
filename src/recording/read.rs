//! Reading recordings back: rows streamed with borrowed fields, whatever the file format.

use std::path::Path;

use crate::error::Error;
use super::RecordingError;

/// One row of a recording as read, fields borrowed from the reader (no allocation per row).
/// The key columns and the value; `run_id`, `graph`, `pass` and `numel` are not needed to mine
/// and are not decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowRef<'a> {
    /// Site name.
    pub site: &'a str,
    /// Role.
    pub role: &'a str,
    /// Pass position in the pipeline.
    pub pass_idx: u32,
    /// Op at the site.
    pub op: &'a str,
    /// Tensor shape text.
    pub shape: &'a str,
    /// FLOPs of one execution.
    pub flops: Option<u64>,
    /// Compile tag.
    pub compile: u32,
    /// Execution of the compiled graph.
    pub step: u64,
    /// Statistic name.
    pub stat: &'a str,
    /// Element index.
    pub idx: u64,
    /// Value.
    pub value: f32,
}

/// Stream every row of the recording at `path` (CSV, `.csv.gz` or `.parquet`, or the
/// `<name>.partial` of one; or a Parquet dataset directory: every closed part of every
/// `recording=<id>` partition, partitions by path, with compiles numbered across recordings) to
/// `f`, in file order. A partial CSV recording whose stream ends
/// mid-way (a crash) is read up to its last complete row, with a warning on stderr.
///
/// Errors: the file cannot be read, is not a recording, or holds a malformed row
/// ([`crate::error::RecordingError`] names the file, the line where there is one, and the
/// problem; a Parquet file without its footer, left by a killed process, says so); a Parquet
/// file or directory in a build without the `parquet` feature.
pub fn read_rows(path: &Path, mut f: impl FnMut(RowRef<'_>)) -> Result<(), Error> {
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        let partial = super::partial_path(path);
        return Err(Error::BadPath {
            path: path.to_path_buf(),
            why: if partial.exists() {
                format!("no such recording; {} holds an interrupted one: read it by that name", partial.display())
            } else {
                "no such file or directory".into()
            },
        });
    }
    if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
        return Err(RecordingError {
            path: path.to_path_buf(),
            line: None,
            reason: "the file is empty (0 bytes), and a recording holds at least its header: it was cut to nothing, or \
                     another program created it; record again"
                .into(),
        }
        .into());
    }
    if path.is_dir() {
        #[cfg(feature = "parquet")]
        return super::dataset::read(path, &mut f);
        #[cfg(not(feature = "parquet"))]
        return Err(super::no_parquet(path));
    }
    // A partial recording (`rec.csv.gz.partial`, interrupted or crashed) has the format of the
    // name it would have had.
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let base = name.strip_suffix(".partial").unwrap_or(&name);
    if base.ends_with(".parquet") {
        // A CSV recording renamed: say so rather than "corrupt footer".
        let mut magic = [0u8; 4];
        let read = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
        if read.is_ok() && &magic != b"PAR1" && super::holds_recording(path) {
            return Err(Error::BadPath {
                path: path.to_path_buf(),
                why: "a CSV recording (it begins with the recording's CSV header), not Parquet: name it .csv (or .csv.gz if it is gzip)".into(),
            });
        }
        #[cfg(feature = "parquet")]
        return super::parquet::read(path, super::parquet::Origin::File, &mut f);
        #[cfg(not(feature = "parquet"))]
        return Err(super::no_parquet(path));
    }
    super::csv::read(path, base.ends_with(".gz"), name.ends_with(".partial"), &mut f)
}

/// The error for a file that holds the rows of two recordings (`run_id`s `a` and `b`), such as
/// two CSV recordings concatenated or two recorders' rows written into one Parquet file: runs are
/// keyed by (compile, step) within a recording, so mined as one, one recording's runs would
/// silently replace the other's.
pub(super) fn two_recordings(path: &Path, a: &str, b: &str) -> Error {
    RecordingError {
        path: path.to_path_buf(),
        line: None,
        reason: format!(
            "holds the rows of more than one recording (run_id '{a}' and '{b}'): mined as one file, their runs would collide on \
             (compile, step) and one would replace the other; mine each recording's file alone, or record with --append into \
             a Parquet dataset (one partition per recording, mined together)"
        ),
    }
    .into()
}
