//! A per-site summary of a recording, kept as rows arrive (a [`Sink`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::manifest::Manifest;
use crate::sink::{Row, Sink};

/// Aggregates of one (site, role) over all runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SiteSummary {
    /// Graph order of the site's first appearance.
    pub order: usize,
    /// Tensor shape.
    pub shape: String,
    /// max |x| over all runs (finite values).
    pub absmax: f64,
    /// Finite elements over all runs.
    pub count: f64,
    /// Non-zero finite elements over all runs.
    pub nnz: f64,
    /// Sum of per-run kurtosis values and their number (the table shows the mean).
    pub kurtosis_sum: f64,
    /// Number of runs with a kurtosis.
    pub kurtosis_n: f64,
    /// Largest per-run chan_outlier.
    pub chan_outlier: f64,
    /// NaN + Inf elements over all runs.
    pub nonfinite: f64,
    /// Runs recorded.
    pub runs: u64,
}

/// A sink that keeps per-(site, role) aggregates. Clones share storage.
#[derive(Clone, Default)]
pub struct SummarySink {
    sites: Arc<Mutex<BTreeMap<(String, String), SiteSummary>>>,
}

impl SummarySink {
    /// The aggregates, in graph order.
    pub fn sites(&self) -> Vec<((String, String), SiteSummary)> {
        let mut v: Vec<_> = self.sites.lock().map(|m| m.clone().into_iter().collect()).unwrap_or_default();
        v.sort_by_key(|(k, s)| (s.order, k.1.clone()));
        v
    }

    /// A text table: site, role, shape, absmax, density, kurtosis, chan_outlier, non-finite.
    pub fn table(&self) -> String {
        let sites = self.sites();
        let width = sites.iter().map(|((s, _), _)| s.len()).max().unwrap_or(4).max(4);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<width$}  {:<4}  {:<16}  {:>10}  {:>8}  {:>9}  {:>12}  {:>10}",
            "site", "role", "shape", "absmax", "density", "kurtosis", "chan_outlier", "non-finite"
        );
        for ((site, role), s) in sites {
            let density = if s.count > 0.0 { s.nnz / s.count } else { f64::NAN };
            let kurt = if s.kurtosis_n > 0.0 { s.kurtosis_sum / s.kurtosis_n } else { f64::NAN };
            let show = |x: f64, prec: usize| if x.is_nan() { "-".to_string() } else { format!("{x:.prec$}") };
            let _ = writeln!(
                out,
                "{:<width$}  {:<4}  {:<16}  {:>10}  {:>8}  {:>9}  {:>12}  {:>10}",
                site,
                role,
                s.shape,
                show(if s.count > 0.0 { s.absmax } else { f64::NAN }, 4),
                show(density, 4),
                show(kurt, 2),
                show(if s.chan_outlier > 0.0 { s.chan_outlier } else { f64::NAN }, 2),
                s.nonfinite
            );
        }
        out
    }
}

impl Sink for SummarySink {
    fn manifest(&mut self, _m: &Manifest) -> Result<(), Error> {
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let mut map = self.sites.lock().map_err(|_| Error::Internal("poisoned".into()))?;
        let mut seen_run: std::collections::HashSet<(String, String)> = Default::default();
        for r in rows {
            let next = map.len();
            let key = (r.site.to_string(), r.role.to_string());
            let s = map.entry(key.clone()).or_insert_with(|| SiteSummary {
                order: next,
                shape: r.shape.to_string(),
                ..Default::default()
            });
            if seen_run.insert(key) {
                s.runs += 1;
            }
            match &*r.stat {
                "count" => s.count += r.value,
                "nnz" => s.nnz += r.value,
                "min" | "max" => s.absmax = s.absmax.max(r.value.abs()),
                "kurtosis" => {
                    s.kurtosis_sum += r.value;
                    s.kurtosis_n += 1.0;
                }
                "chan_outlier" => s.chan_outlier = s.chan_outlier.max(r.value),
                "nan_count" | "posinf_count" | "neginf_count" => s.nonfinite += r.value,
                _ => {}
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}
