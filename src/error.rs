//! Errors. Every error names the problem and, where there is one, the fix.

use std::fmt;
use std::path::PathBuf;

/// An opscope error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline text does not parse or names an unknown pass, option or value.
    #[error("{0}")]
    Pipeline(#[from] ParseError),
    /// Writing or finishing a recording failed. (The cause is part of the message, not a
    /// separate `source`, so that error chains print it once.)
    #[error("recording {path}: {error}")]
    Io {
        /// The file being written.
        path: PathBuf,
        /// The underlying I/O error.
        error: std::io::Error,
    },
    /// CSV encoding failed.
    #[error("recording {path}: {error}")]
    Csv {
        /// The file being written.
        path: PathBuf,
        /// The underlying CSV error.
        error: csv::Error,
    },
    /// A recording (or its manifest sidecar) that is read back is malformed or is not a
    /// recording.
    #[error(transparent)]
    Recording(#[from] RecordingError),
    /// Writing a recording's encoded data failed (a Parquet encoder error).
    #[error("recording {path}: {why}")]
    Write {
        /// The file being written.
        path: PathBuf,
        /// What failed.
        why: String,
    },
    /// An environment variable holds a value opscope cannot use.
    #[error("{var}={value:?}: {why}")]
    Env {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong with it, and the fix.
        why: String,
    },
    /// The recording path cannot be used.
    #[error("recording {path}: {why}")]
    BadPath {
        /// The path given.
        path: PathBuf,
        /// What is wrong with it, and the fix.
        why: String,
    },
    /// A capture directory (`<recording>.capture`, the `capture` pass's tensors and their
    /// manifest) or one of its files cannot be used.
    #[error("capture {path}: {why}")]
    Capture {
        /// The directory or file.
        path: PathBuf,
        /// What is wrong with it, and the fix.
        why: String,
    },
    /// A derived parameter (`opscope::params`) cannot be computed or was never bound.
    #[error("{why}")]
    Params {
        /// What is wrong, and the fix.
        why: String,
    },
    /// The outputs a tapped graph returned do not match what its manifest says it appended.
    #[error("tap outputs of graph '{graph}' do not match its manifest: {detail}")]
    Mismatch {
        /// Graph name.
        graph: String,
        /// What differed.
        detail: String,
    },
    /// A pass's options do not fit the graph it was applied to (a `skip` block that does not
    /// exist).
    #[error("{0}")]
    Graph(String),
    /// A calibration table a pass reads (`staticquant{table=..}`) is missing, is not a table,
    /// or lacks a tensor the graph needs.
    #[error("calibration table {path}: {why}")]
    Table {
        /// The table file.
        path: PathBuf,
        /// What is wrong, and the fix.
        why: String,
    },
    /// A bug in opscope.
    #[error("opscope internal error: {0}")]
    Internal(String),
}

/// `candidates` sorted closest-first to `word` (Jaro-Winkler similarity, ties by name).
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<(f64, &str)> = candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(&word.to_lowercase(), &c.to_lowercase()), c))
        .collect();
    v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    v.into_iter().map(|(_, c)| c).collect()
}

/// A pipeline text error: what, where (byte offset into the text), and what is known.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ParseError {
    /// The whole pipeline text.
    pub text: String,
    /// Byte offset of the problem.
    pub offset: usize,
    /// What is wrong.
    pub message: String,
    /// What would be accepted there, closest first (may be empty).
    pub known: Vec<String>,
    /// What the `known` list names (`passes`, `options of matmul`).
    pub known_what: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "bad opscope pipeline: {} (at column {})", self.message, self.offset + 1)?;
        writeln!(f, "  {}", self.text)?;
        write!(f, "  {}^", " ".repeat(self.text[..self.offset.min(self.text.len())].chars().count()))?;
        if !self.known.is_empty() {
            write!(f, "\n  known {} (closest first): {}", self.known_what, self.known.join(", "))?;
        }
        Ok(())
    }
}


/// A recording read back is malformed: which file, which line (CSV; the sidecar's JSON line),
/// and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}{}: {reason}", path.display(), line.map(|l| format!(" line {l}")).unwrap_or_default())]
pub struct RecordingError {
    /// The file.
    pub path: PathBuf,
    /// The line, where the format has lines.
    pub line: Option<u64>,
    /// What is wrong.
    pub reason: String,
}
