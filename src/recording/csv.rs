//! CSV recordings (the `csv` crate), gzip-compressed when the path ends in `.gz`: the writer
//! and the streaming reader.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::manifest::Manifest;

use super::checksum::{Checksum, Summing};
use super::format::{check_path, column_index, header, partial_path, sidecar_json, write_sidecar_ending, Row};
use super::read::RowRef;
use super::sink::Sink;
use super::RecordingError;

/// The file a CSV recording goes to: plain, or gzip when the path ends in `.gz`.
/// The file's bytes are summed as they are written ([`Summing`]) for the sidecar's checksum.
enum Out {
    Plain(std::io::BufWriter<Summing<File>>),
    Gz(flate2::write::GzEncoder<std::io::BufWriter<Summing<File>>>),
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
    /// Write any trailer, flush, and return the file with the checksum of every byte in it.
    fn into_file(self) -> std::io::Result<(File, Checksum)> {
        let buffered = match self {
            Out::Plain(w) => w,
            Out::Gz(w) => w.finish()?,
        };
        Ok(buffered.into_inner().map_err(|e| e.into_error())?.into_parts())
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
    manifests: Vec<std::sync::Arc<Manifest>>,
    /// Nothing written since the last successful flush (the recorder flushes after each run),
    /// so the file ends on a whole run: recorded in the sidecar of an abandoned recording.
    ends_on_run: bool,
    /// What was at `<path>` when the recording began ([`FileStamp`]), if anything:
    /// a file the caller chose to replace. A different file there at `finish` appeared while
    /// recording and is not replaced.
    there_at_start: Option<FileStamp>,
    /// The closed file's length and CRC-32, for its sidecar ([`super::Sidecar::checksum`]).
    checksum: Option<Checksum>,
}

/// What identifies the file at a path: device, inode, length and modification time.
type FileStamp = (u64, u64, u64, Option<std::time::SystemTime>);

/// The [`FileStamp`] of the regular file at `path`, if one is there (device and inode 0 where
/// the platform has none).
fn file_stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    Some((dev, ino, m.len(), m.modified().ok()))
}

impl CsvSink {
    /// Create the recording.
    ///
    /// Errors: the name does not end in `.csv` or `.csv.gz`, or `<path>.partial` cannot be created
    /// (missing directory, permissions): fix the path or create the directory.
    pub fn create(path: impl AsRef<Path>) -> Result<CsvSink, Error> {
        let path = path.as_ref().to_path_buf();
        check_path(&path)?;
        let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        if !(name.ends_with(".csv") || name.ends_with(".csv.gz")) {
            return Err(Error::BadPath {
                path,
                why: "a CSV recording is named .csv or .csv.gz (opscope::open_sink picks the format from the name: .parquet for Parquet)".into(),
            });
        }
        let tmp = partial_path(&path);
        // A sidecar an earlier, abandoned recording left beside `<path>.partial` describes that
        // recording, not this one (its `ends_on_run` would make a reader trust this file's last
        // run): remove it before this recording's rows replace the file.
        let stale = super::format::sidecar_path(&tmp);
        match std::fs::remove_file(&stale) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::Io { path: stale, error: e }),
            _ => {}
        }
        let file = File::create(&tmp).map_err(|source| Error::Io {
            path: tmp.clone(),
            error: source,
        })?;
        let buffered = std::io::BufWriter::with_capacity(1 << 20, Summing::new(file));
        let out = if path.extension().is_some_and(|e| e == "gz") {
            Out::Gz(flate2::write::GzEncoder::new(buffered, flate2::Compression::fast()))
        } else {
            Out::Plain(buffered)
        };
        // The header is written up front, so a recording with no rows is still a valid table.
        let mut writer = csv::WriterBuilder::new().has_headers(false).from_writer(out);
        writer.write_record(header()).map_err(|e| Error::Csv {
            path: tmp.clone(),
            error: e,
        })?;
        Ok(CsvSink {
            there_at_start: file_stamp(&path),
            path,
            writer: Some(writer),
            manifests: Vec::new(),
            ends_on_run: true,
            checksum: None,
        })
    }

    fn csv_err(&self, source: csv::Error) -> Error {
        let path = partial_path(&self.path);
        if let csv::ErrorKind::Io(e) = source.kind() {
            // A failed write (disk full, `ulimit -f`): say the cause, and what is kept.
            let e = e.to_string();
            return Error::Write {
                why: format!(
                    "{e}{}; the runs flushed before it stay readable in {} (read it by that name; its last run may be cut and \
                     is left out)",
                    super::format::space_hint(&e),
                    path.display()
                ),
                path,
            };
        }
        Error::Csv { path, error: source }
    }
}

impl Sink for CsvSink {
    fn capture_dir(&self) -> Option<std::path::PathBuf> {
        Some(super::sink::capture_dir_of(&self.path))
    }
    fn manifest(&mut self, manifest: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        self.manifests.push(manifest.clone());
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let Some(w) = self.writer.as_mut() else {
            return Err(Error::Internal("write after finish".into()));
        };
        self.ends_on_run = false;
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
        self.ends_on_run = res.is_ok();
        res.map_err(|e| self.csv_err(e))
    }

    fn finish(&mut self) -> Result<(), Error> {
        if self.close()? {
            let tmp = partial_path(&self.path);
            // A file that appeared at the path (or changed) while this recording was written,
            // and is not a recording (or empty), is not replaced: the rows stay at
            // `<path>.partial`. A file there from the start is the caller's to replace.
            let now = file_stamp(&self.path);
            if now.is_some_and(|(_, _, len, _)| len > 0) && now != self.there_at_start && !super::format::holds_recording(&self.path) {
                // Closed whole: the reader takes every row (none is a cut run).
                write_sidecar_ending(&tmp, std::mem::take(&mut self.manifests), true, self.checksum)?;
                return Err(Error::BadPath {
                    path: self.path.clone(),
                    why: format!(
                        "a file that is not an opscope recording appeared here while recording: it is left as it is, and \
                         the recording is complete at {}",
                        tmp.display()
                    ),
                });
            }
            // The manifest is written in full (beside, synced) before anything is renamed: a
            // write that fails (disk full, `ulimit -f`) leaves the recording at `<path>.partial`
            // and an earlier recording at `<path>` with its own manifest, both untouched. Then
            // the earlier manifest is removed, so no moment pairs the new rows with it (a crash
            // between the renames leaves the rows without a manifest, which `mine` notes).
            let side = super::format::sidecar_path(&self.path);
            let side_tmp = partial_path(&side);
            let manifests = std::mem::take(&mut self.manifests);
            if let Err(e) = super::format::write_synced(&side_tmp, &sidecar_json(manifests.clone(), false, self.checksum)?) {
                let _ = std::fs::remove_file(&side_tmp);
                // Its own sidecar marks the `.partial` whole; if that write fails too (the same
                // full disk), a reader leaves its last run out, as after a crash.
                let marked = write_sidecar_ending(&tmp, manifests, true, self.checksum).is_ok();
                return Err(Error::Write {
                    path: side,
                    why: format!(
                        "writing the manifest sidecar: {e}{}; the recording is at {} (read it by that name{}), and anything \
                         at {} is left as it was",
                        super::format::space_hint(&e.to_string()),
                        tmp.display(),
                        if marked { "; it is complete" } else { "; its last run is left out when read, as after a crash" },
                        self.path.display()
                    ),
                });
            }
            // A rename that fails here leaves the files where the error says.
            let (path, tmp, side_tmp, side) = (&self.path, &tmp, &side_tmp, &side);
            let stuck = |what: String| {
                move |error: std::io::Error| Error::Write {
                    path: path.clone(),
                    why: format!(
                        "{what}: {error}; the new recording is complete at {} with its manifest at {} (rename them to \
                         {} and {} to finish it by hand)",
                        tmp.display(),
                        side_tmp.display(),
                        path.display(),
                        side.display()
                    ),
                }
            };
            match std::fs::remove_file(side) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(stuck(format!("removing the earlier manifest {}", side.display()))(e)),
                _ => {}
            }
            std::fs::rename(tmp, path).map_err(stuck("renaming the recording into place".into()))?;
            std::fs::rename(side_tmp, side).map_err(stuck("renaming its manifest into place".into()))?;
        }
        Ok(())
    }

    fn abandon(&mut self) -> Result<(), Error> {
        if self.close()? {
            write_sidecar_ending(&partial_path(&self.path), std::mem::take(&mut self.manifests), self.ends_on_run, self.checksum)?;
        }
        Ok(())
    }
}

impl CsvSink {
    /// Write the gzip trailer, flush and sync `<path>.partial`, keeping its checksum. False if
    /// already closed.
    fn close(&mut self) -> Result<bool, Error> {
        let Some(w) = self.writer.take() else {
            return Ok(false);
        };
        let tmp = partial_path(&self.path);
        let io = |source| Error::Io {
            path: tmp.clone(),
            error: source,
        };
        let out = w.into_inner().map_err(|e| io(e.into_error()))?;
        let (file, checksum) = out.into_file().map_err(io)?;
        file.sync_all().map_err(io)?;
        self.checksum = Some(checksum);
        Ok(true)
    }
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


/// Stream the rows of a CSV recording (gzip when the path ends in `.gz`) to `f`.
///
/// A `.partial` recording whose sidecar says it ends on a whole run ([`super::Sidecar::ends_on_run`]:
/// interrupted between runs) is read whole. Any other `.partial` recording (its process
/// crashed, was killed, or hit a write error) is read up to the start of its last run: the rows of the last (compile, step) in the file are left out,
/// with a warning naming them, because the cut may have fallen inside that run (the sink
/// flushes after every run, but a run larger than its 1 MiB buffer is written in pieces) and a
/// run counted with part of its rows gives wrong per-run numbers. A finished run lost this way
/// is the price of never counting half a run. The file is read twice (once to find the cut).
///
/// A recording whose sidecar holds its checksum ([`super::Sidecar::checksum`]) is verified
/// too, so a damaged byte is an error rather than another value: before any row when its
/// length is as recorded; after the rows when it is not (a cut shows in the rows first, and
/// that error says where; a cut between two rows shows only in the length).
///
/// Errors: the file cannot be opened, lacks a recording column, no longer matches its
/// checksum, or holds a malformed row (the error names the line); in a `.partial` recording a
/// malformed row is where the cut is.
pub(super) fn read(path: &Path, gz: bool, partial: bool, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    check_format(path, gz)?;
    let fix = if partial {
        "restore it from a copy, or move its sidecar (<name>.partial.manifest.json) away to read it unchecked up to its \
         last run"
    } else {
        "restore it from a copy, or rename it to <name>.partial to read it unchecked up to its last run (a file changed \
         on purpose: remove `checksum` from its sidecar)"
    };
    // The rows are read through the handle that was checked.
    let opened = super::format::open_checked(path, fix, true)?;
    read_unverified(path, &opened.file, gz, partial, f)?;
    opened.cut.map_or(Ok(()), Err)
}

/// [`read`] without the checksum, from `file` (opened at `path`, which names it in errors).
fn read_unverified(path: &Path, file: &File, gz: bool, partial: bool, f: &mut dyn FnMut(RowRef<'_>)) -> Result<(), Error> {
    let whole = || super::read_sidecar(path).ok().flatten().is_some_and(|s| s.ends_on_run);
    if !partial || whole() {
        // A file that should be whole and whose stream ends early was cut after it was written.
        return match read_records(path, file, gz, None, f)? {
            None => Ok(()),
            Some(why) => Err(RecordingError {
                path: path.to_path_buf(),
                line: None,
                reason: format!(
                    "{why}: {}",
                    if partial {
                        "its sidecar says it ends on a whole run, so it was cut since; delete the sidecar \
                         (<name>.partial.manifest.json) to read it up to its last run"
                    } else {
                        "a finished recording is closed whole, so it was cut or damaged since; restore it, or rename it to \
                         <name>.partial to read it up to its last run"
                    }
                ),
            }
            .into()),
        };
    }
    // Pass 1: where the last run starts, and where the stream stops.
    let mut key = None;
    let (mut rows, mut last_start) = (0u64, 0u64);
    let stop = read_records(path, file, gz, None, &mut |r| {
        if key != Some((r.compile, r.step)) {
            key = Some((r.compile, r.step));
            last_start = rows;
        }
        rows += 1;
    });
    let cut = match stop {
        Ok(None) => None,
        Ok(Some(why)) => Some(why),
        Err(Error::Recording(RecordingError { line, reason, .. })) => Some(format!("it is cut at line {}: {reason}", line.unwrap_or(0))),
        Err(e) => return Err(e),
    };
    if let Some((compile, step)) = key {
        eprintln!(
            "opscope: warning: {} did not finish ({}): its last run (compile {compile}, step {step}, {} rows read) may be \
             cut off and is left out; {last_start} rows of the earlier runs are read",
            path.display(),
            cut.as_deref().unwrap_or("it ends on a complete row, but nothing marks its last run complete"),
            rows - last_start,
        );
    }
    // Pass 2: the rows before the last run.
    read_records(path, file, gz, Some(last_start), f).map(|_| ())
}

/// Refuse a file whose first bytes say it is not what its name says: gzip's magic (`1f 8b`,
/// RFC 1952) in a file named as plain CSV, a file named `.gz` without it, or Parquet's (`PAR1`)
/// in a file named as CSV. Read as named, the first two fail on their header with a message
/// that does not say why, and the name is what to fix.
///
/// Errors: the file cannot be opened, or its format and its name disagree (the error names the
/// format found and the name to give it).
fn check_format(path: &Path, gz: bool) -> Result<(), Error> {
    let mut head = [0u8; 4];
    let mut file = File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    let n = file.read(&mut head).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    let head = &head[..n];
    let is_gzip = head.starts_with(&[0x1f, 0x8b]);
    let found = if head.starts_with(b"PAR1") {
        Some("a Parquet file (it begins with PAR1): name it .parquet")
    } else if is_gzip && !gz {
        Some("gzip-compressed (it begins with gzip's magic bytes 1f 8b): name it .csv.gz")
    } else if gz && !is_gzip && n > 0 {
        Some("not gzip-compressed (it lacks gzip's magic bytes 1f 8b): name it .csv")
    } else {
        None
    };
    match found {
        Some(what) => Err(RecordingError { path: path.to_path_buf(), line: None, reason: format!("named as a CSV recording but {what}") }.into()),
        None => Ok(()),
    }
}

/// Read the data rows of a CSV recording (at most `limit` of them) to `f`. Returns why the
/// stream stopped early when it ends mid-way (an I/O error of a cut gzip stream, or a row cut
/// short by a crash), `None` when it was read to its end or to `limit`. A malformed row is an
/// error either way. Reads `file` from its start (`path` names it in errors).
fn read_records(path: &Path, mut file: &File, gz: bool, limit: Option<u64>, f: &mut dyn FnMut(RowRef<'_>)) -> Result<Option<String>, Error> {
    file.rewind().map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    let reader: Box<dyn Read + '_> = if gz {
        Box::new(flate2::read::GzDecoder::new(std::io::BufReader::with_capacity(1 << 20, file)))
    } else {
        Box::new(std::io::BufReader::with_capacity(1 << 20, file))
    };
    let mut csv = csv::Reader::from_reader(reader);
    let malformed = |line: Option<u64>, reason: String| RecordingError { path: path.to_path_buf(), line, reason };
    let header_row = csv.byte_headers().map_err(|e| malformed(Some(1), format!("header: {e}")))?.clone();
    // Position of every recording column in this file (files written by other tools may
    // reorder or add columns).
    let mut at = [0usize; 15];
    for (i, c) in super::COLUMNS.iter().enumerate() {
        at[i] = header_row
            .iter()
            .position(|h| h == c.name.as_bytes())
            .ok_or_else(|| malformed(Some(1), format!("no '{}' column: not an opscope recording", c.name)))?;
    }
    let ix = |name: &str| at[column_index(name).expect("a recording column")];
    let (site, role, pass, op, shape) = (ix("site"), ix("role"), ix("pass_idx"), ix("op"), ix("shape"));
    let (flops, compile, step, stat, idx, value) = (ix("flops"), ix("compile"), ix("step"), ix("stat"), ix("idx"), ix("value"));
    let run_id = ix("run_id");
    let mut first_run: Option<Vec<u8>> = None;
    let mut rec = csv::ByteRecord::new();
    let mut line = 1u64;
    loop {
        if limit.is_some_and(|n| line - 1 >= n) {
            return Ok(None);
        }
        match csv.read_byte_record(&mut rec) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            // A cut compressed stream ends with an I/O error.
            Err(e) if matches!(e.kind(), csv::ErrorKind::Io(_)) && limit.is_none() => return Ok(Some(format!("it ends mid-stream after line {line}: {e}"))),
            // A short row that is the file's last is where the file was cut (a crash, or a
            // copy or truncation after it was written), not a malformed row.
            Err(e) if limit.is_none() && matches!(e.kind(), csv::ErrorKind::UnequalLengths { .. }) => {
                let fields = match e.kind() {
                    csv::ErrorKind::UnequalLengths { len, .. } => *len,
                    _ => 0,
                };
                if matches!(csv.read_byte_record(&mut rec), Ok(false)) {
                    return Ok(Some(format!(
                        "its last row (line {}) is cut short, {fields} of its {} fields",
                        line + 1,
                        header_row.len()
                    )));
                }
                return Err(malformed(Some(line + 1), e.to_string()).into());
            }
            Err(e) => return Err(malformed(Some(line + 1), e.to_string()).into()),
        }
        line += 1;
        let bad = |what: &str| malformed(Some(line), format!("bad {what}"));
        let text = |i: usize| std::str::from_utf8(&rec[i]).map_err(|_| bad("UTF-8"));
        let num = |i: usize, what: &str| text(i)?.parse::<u64>().map_err(|_| bad(what));
        match &first_run {
            Some(r) if r.as_slice() != &rec[run_id] => {
                return Err(super::read::two_recordings(path, &String::from_utf8_lossy(r), &String::from_utf8_lossy(&rec[run_id])));
            }
            Some(_) => {}
            None => first_run = Some(rec[run_id].to_vec()),
        }
        let fl = text(flops)?;
        f(RowRef {
            site: text(site)?,
            role: text(role)?,
            pass_idx: num(pass, "pass_idx")? as u32,
            op: text(op)?,
            shape: text(shape)?,
            flops: if fl.is_empty() { None } else { Some(fl.parse().map_err(|_| bad("flops"))?) },
            compile: num(compile, "compile")? as u32,
            step: num(step, "step")?,
            stat: text(stat)?,
            idx: num(idx, "idx")?,
            value: text(value)?.parse::<f32>().map_err(|_| bad("value"))?,
        });
    }
}
