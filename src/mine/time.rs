//! Measured time shares for the miner's payoff: a site's payoff is its share of the measured
//! time times the kernel's payoff fraction when the site has a measured share, its share of the
//! recorded FLOPs otherwise; each verdict says which ([`PayoffBasis`]).
//!
//! The shares come from `opscope time --json` (the lab's `shares` module: every deployed node
//! timed alone, medians over interleaved rounds); this module reads only its `sites[].site` and
//! `sites[].share`, so any JSON holding those works.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What a verdict's payoff is weighted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PayoffBasis {
    /// The site's share of the measured time ([`TimeShares`]).
    Time,
    /// The site's share of the recorded FLOPs (no measured share for this site).
    Flops,
}

impl PayoffBasis {
    /// `time` or `flops`.
    pub fn as_str(self) -> &'static str {
        match self {
            PayoffBasis::Time => "time",
            PayoffBasis::Flops => "flops",
        }
    }
}

/// Why time shares could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TimeSharesError {
    /// The file could not be read.
    #[error("time shares {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        error: std::io::Error,
    },
    /// The JSON does not hold `sites: [{site, share}, ...]`.
    #[error("time shares {path}: not the JSON of `opscope time --json` ({error}); write one with `opscope time ... --json FILE`")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        error: serde_json::Error,
    },
    /// A share is not a number in [0, 1], a site is listed twice, or the shares do not sum to 1.
    #[error("time shares {path}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// Shares may sum to 1 within this (rounding of a JSON float per site).
pub const SUM_TOLERANCE: f64 = 1e-6;

/// Measured time shares by site name (the names recordings use), each in [0, 1], summing to 1
/// over the timed graph.
///
/// A deployed node that merges several source ops (RLX's horizontally merged Q/K/V projection)
/// is one timed site named by its parts joined with `+` (`opscope::analysis::site_names`), while
/// a recording names each part (the matmul pass taps the parts). [`TimeShares::get`] gives a
/// part `1/k` of its merged node's share (`k` parts): the parts of a merged projection are
/// equal-width column blocks of one GEMM in the models opscope records (MiniLM's Q, K and V are
/// each 384 wide), so each does `1/k` of its FLOPs and moves `1/k` of its weight bytes. A merge
/// of unequal parts (grouped-query K/V narrower than Q) would need the parts' widths.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TimeShares {
    /// Site -> share of the measured time.
    pub shares: BTreeMap<String, f64>,
    /// Part of a merged site -> its share (`1/k` of the merged site's).
    pub parts: BTreeMap<String, f64>,
    /// Where they come from (a path), for messages.
    pub source: String,
}

#[derive(Deserialize)]
struct Doc {
    sites: Vec<SiteShare>,
}

#[derive(Deserialize)]
struct SiteShare {
    site: String,
    share: f64,
}

impl TimeShares {
    /// Shares from `(site, share)` pairs; `source` names them in errors.
    ///
    /// Errors ([`TimeSharesError::Invalid`]): no site; a share not finite or outside [0, 1]; a
    /// site listed twice; shares summing to other than 1 (within [`SUM_TOLERANCE`]).
    pub fn from_sites(sites: impl IntoIterator<Item = (String, f64)>, source: &str) -> Result<TimeShares, TimeSharesError> {
        let bad = |why: String| TimeSharesError::Invalid { path: PathBuf::from(source), why };
        let mut shares = BTreeMap::new();
        for (site, share) in sites {
            if !(share.is_finite() && (0.0..=1.0).contains(&share)) {
                return Err(bad(format!("site '{site}' has share {share}, not a fraction in [0, 1]")));
            }
            if shares.insert(site.clone(), share).is_some() {
                return Err(bad(format!("site '{site}' is listed twice")));
            }
        }
        if shares.is_empty() {
            return Err(bad("no site: the file lists no time share".into()));
        }
        let sum: f64 = shares.values().sum();
        if (sum - 1.0).abs() > SUM_TOLERANCE {
            return Err(bad(format!("the shares sum to {sum}, not 1: the file is not one graph's time shares")));
        }
        let mut parts = BTreeMap::new();
        for (site, share) in &shares {
            let names: Vec<&str> = site.split('+').collect();
            if names.len() > 1 {
                for n in &names {
                    parts.insert(n.to_string(), share / names.len() as f64);
                }
            }
        }
        Ok(TimeShares { shares, parts, source: source.to_string() })
    }

    /// Shares from the JSON of `opscope time --json` (its `sites[].site` and `sites[].share`).
    ///
    /// Errors: as [`TimeShares::from_sites`], or [`TimeSharesError::Json`].
    pub fn from_json(text: &str, source: &str) -> Result<TimeShares, TimeSharesError> {
        let doc: Doc = serde_json::from_str(text).map_err(|error| TimeSharesError::Json { path: PathBuf::from(source), error })?;
        TimeShares::from_sites(doc.sites.into_iter().map(|s| (s.site, s.share)), source)
    }

    /// Read `path` ([`TimeShares::from_json`]).
    ///
    /// Errors: [`TimeSharesError::Io`] when `path` cannot be read, else as
    /// [`TimeShares::from_json`].
    pub fn load(path: &Path) -> Result<TimeShares, TimeSharesError> {
        let text = std::fs::read_to_string(path).map_err(|error| TimeSharesError::Io { path: path.to_path_buf(), error })?;
        TimeShares::from_json(&text, &path.display().to_string())
    }

    /// Share of `site`, if measured: its own, else its part of a merged site (see the type).
    pub fn get(&self, site: &str) -> Option<f64> {
        self.shares.get(site).or_else(|| self.parts.get(site)).copied()
    }
}
