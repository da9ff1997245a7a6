//! Errors. Every error names the problem and, where there is one, the fix.

use std::path::PathBuf;

/// An opscope error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pipeline text does not parse or names an unknown pass, option or value.
    #[error("{0}")]
    Pipeline(#[from] crate::pipeline::ParseError),
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
    /// The recording path cannot be used.
    #[error("recording {path}: {why}")]
    BadPath {
        /// The path given.
        path: PathBuf,
        /// What is wrong with it, and the fix.
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
    /// A bug in opscope.
    #[error("opscope internal error: {0}")]
    Internal(String),
}

/// `candidates` sorted closest-first to `word` (Jaro-Winkler similarity, ties by name).
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<(f64, &str)> = candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(word, c), c))
        .collect();
    v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    v.into_iter().map(|(_, c)| c).collect()
}
