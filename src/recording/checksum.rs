//! Whole-file checksums of recordings: computed while a file is written, kept in its manifest
//! sidecar, verified before its rows are read.
//!
//! Parquet page headers have a CRC field, but the `parquet` crate (60) does not write it, and
//! plain CSV has none; so a byte damaged on disk or in a copy (not in a footer or a header the
//! reader parses) was read as another value, without a word. Every file a recorder closes now
//! has its length and CRC-32 in its sidecar ([`super::Sidecar::checksum`] for a CSV or single
//! Parquet file, [`super::Sidecar::parts`] for each closed part of a dataset partition), and a
//! file that no longer matches is refused with its name. CRC-32 is the checksum of gzip and of
//! Parquet's own page headers (`crc32fast`: 11-12 GB/s on this 2-core Xeon, about 1% of the
//! time of a recorder's writer thread, which writes about 140 MB/s at 40 M values/s).

use std::fs::File;
use std::io::{Seek, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::Error;

use super::RecordingError;

/// A file's length and CRC-32 (IEEE, as gzip and Parquet compute it) when it was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksum {
    /// Length in bytes.
    pub bytes: u64,
    /// CRC-32 of the whole file.
    pub crc32: u32,
}

impl Checksum {
    /// The checksum of `bytes` held in memory (a file about to be written, or read whole).
    pub fn of(bytes: &[u8]) -> Checksum {
        Checksum { bytes: bytes.len() as u64, crc32: crc32fast::hash(bytes) }
    }
}

/// A writer that passes bytes to `inner` and sums what it accepted ([`Summing::checksum`]).
pub(super) struct Summing<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl<W: Write> Summing<W> {
    pub(super) fn new(inner: W) -> Summing<W> {
        Summing { inner, hasher: crc32fast::Hasher::new(), bytes: 0 }
    }

    /// The checksum of every byte written so far.
    pub(super) fn checksum(&self) -> Checksum {
        Checksum { bytes: self.bytes, crc32: self.hasher.clone().finalize() }
    }

    /// The inner writer and the checksum of what went to it.
    pub(super) fn into_parts(self) -> (W, Checksum) {
        let sum = self.checksum();
        (self.inner, sum)
    }
}

impl<W: Write> Write for Summing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The checksum of the file at `path` as it is now.
///
/// Errors: the file cannot be read.
pub fn checksum_of(path: &Path) -> Result<Checksum, Error> {
    let file = File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    sum_open(&file, path)
}

/// The checksum of the open `file` (named `path` in errors), read from its start; the file is
/// left at its start for the reader that follows.
fn sum_open(file: &File, path: &Path) -> Result<Checksum, Error> {
    let io = |e| Error::Io { path: path.to_path_buf(), error: e };
    let mut file = file;
    file.rewind().map_err(io)?;
    // The writer's own summing, fed by a copy into nothing: one code path for both checksums.
    let mut sum = Summing::new(std::io::sink());
    std::io::copy(&mut file, &mut sum).map_err(io)?;
    file.rewind().map_err(io)?;
    Ok(sum.checksum())
}

/// Check the file at `path` against the checksum `sidecar` (the sidecar file) recorded for it
/// when it was closed; `fix` says what the reader can do about a mismatch (it follows the
/// problem in the error).
///
/// Errors: the file cannot be read; its length or CRC-32 differs (the error names the file,
/// both values, and `fix`).
pub fn verify(path: &Path, want: &Checksum, sidecar: &Path, fix: &str) -> Result<(), Error> {
    let file = File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    verify_open(&file, path, want, sidecar, fix)
}

/// [`verify`] through an open handle: the length and the bytes checked are those of the file
/// `file` opened (the same inode the caller then reads its rows from, even if another file is
/// renamed over `path` meanwhile). `file` is left at its start.
///
/// Errors: as [`verify`].
pub(super) fn verify_open(file: &File, path: &Path, want: &Checksum, sidecar: &Path, fix: &str) -> Result<(), Error> {
    let len = file.metadata().map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?.len();
    let what = if len != want.bytes {
        format!(
            "it holds {len} bytes, and held {} when it was closed ({}): it was cut, written to, recompressed or \
             replaced since",
            want.bytes,
            sidecar.display()
        )
    } else {
        let now = sum_open(file, path)?;
        if now.crc32 == want.crc32 {
            return Ok(());
        }
        format!(
            "its bytes changed since it was closed (CRC-32 {:08x} now, {:08x} recorded in {}): a disk, a transfer or a \
             program damaged it, so its values cannot be trusted",
            now.crc32,
            want.crc32,
            sidecar.display()
        )
    };
    Err(RecordingError { path: path.to_path_buf(), line: None, reason: format!("{what}; {fix}") }.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_the_standard_one() {
        // The check value of CRC-32/ISO-HDLC (gzip, zlib, Parquet): 0xCBF43926 for "123456789".
        let mut w = Summing::new(Vec::new());
        w.write_all(b"1234").unwrap();
        w.write_all(b"56789").unwrap();
        assert_eq!(w.checksum(), Checksum { bytes: 9, crc32: 0xCBF4_3926 });
    }

    #[test]
    fn summing_matches_a_checksum_of_the_file_and_verify_names_a_flipped_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        let mut w = Summing::new(std::fs::File::create(&path).unwrap());
        let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        w.write_all(&body[..1000]).unwrap();
        w.write_all(&body[1000..]).unwrap();
        let (_, sum) = w.into_parts();
        // The reference: crc32 of the bytes at once (zlib's CRC-32 of the same bytes).
        assert_eq!(sum, Checksum { bytes: body.len() as u64, crc32: crc32fast::hash(&body) });
        assert_eq!(checksum_of(&path).unwrap(), sum);
        let side = dir.path().join("f.bin.manifest.json");
        verify(&path, &sum, &side, "restore it").unwrap();
        let mut damaged = body.clone();
        damaged[123_456] ^= 0x10;
        std::fs::write(&path, &damaged).unwrap();
        let e = verify(&path, &sum, &side, "restore it").unwrap_err().to_string();
        assert!(e.contains("f.bin") && e.contains("changed since it was closed") && e.contains(&format!("{:08x}", sum.crc32)), "{e}");
        std::fs::write(&path, &body[..200_000]).unwrap();
        let e = verify(&path, &sum, &side, "restore it").unwrap_err().to_string();
        assert!(e.contains("holds 200000 bytes, and held 300000"), "{e}");
    }
}
