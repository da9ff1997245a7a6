//! Helpers shared by the lab's benches.

use std::path::Path;

/// Bytes of every file under `p` (a recording file, or a Parquet dataset directory with its
/// parts and sidecars); 0 for a path that cannot be read.
pub fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    };
    rd.flatten().map(|e| if e.path().is_dir() { dir_bytes(&e.path()) } else { e.metadata().map(|m| m.len()).unwrap_or(0) }).sum()
}
