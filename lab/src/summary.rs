//! A per-site summary of a recording, kept as rows arrive (a [`Sink`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

use opscope::Error;
use opscope::manifest::Manifest;
use opscope::recording::{Row, Sink};

/// Aggregates of one (site, role, pass) over all runs. A field is `None` when the statistics it
/// needs were not recorded (not selected, or undefined for the data): the table then shows `-`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SiteSummary {
    /// Graph order of the site's first appearance.
    pub order: usize,
    /// Tensor shape.
    pub shape: String,
    /// Smallest recorded `min` over all runs.
    pub min: Option<f64>,
    /// Largest recorded `max` over all runs.
    pub max: Option<f64>,
    /// Finite elements over all runs.
    pub count: f64,
    /// Non-zero finite elements over all runs.
    pub nnz: Option<f64>,
    /// The per-run kurtosis values, keyed by the run's sampling priority
    /// ([`opscope::mine::run_priority`]): the table shows their median, as `opscope mine` and
    /// the report do. Every run's up to [`opscope::mine::DEFAULT_MAX_RUNS`], past that the runs
    /// of least priority, the same uniform sample `opscope mine` reads by default, so the
    /// summary's memory is bounded whatever the run count.
    pub kurtosis: BTreeMap<u64, f64>,
    /// Largest per-run chan_outlier.
    pub chan_outlier: Option<f64>,
    /// NaN + Inf elements over all runs, if any of the three counts was recorded.
    pub nonfinite: Option<f64>,
}

impl SiteSummary {
    /// max |x| over all runs: needs both `min` and `max`.
    pub fn absmax(&self) -> Option<f64> {
        Some(self.min?.abs().max(self.max?.abs()))
    }
    /// nnz / count.
    pub fn density(&self) -> Option<f64> {
        (self.count > 0.0).then_some(self.nnz? / self.count)
    }
    /// Median of the per-run kurtosis values ([`opscope::mine::median`]: of an even count the
    /// upper middle value, one some run had); over the sample past
    /// [`opscope::mine::DEFAULT_MAX_RUNS`] runs.
    pub fn kurtosis_median(&self) -> Option<f64> {
        opscope::mine::median(self.kurtosis.values().copied().collect())
    }
}

/// A sink that keeps per-(site, role) aggregates. Clones share storage.
#[derive(Clone, Default)]
pub struct SummarySink {
    sites: Arc<Mutex<BTreeMap<(String, String, u32), SiteSummary>>>,
}

impl SummarySink {
    /// The aggregates, keyed (site, role, pass index), in graph order.
    pub fn sites(&self) -> Vec<((String, String, u32), SiteSummary)> {
        let mut v: Vec<_> = self.sites.lock().map(|m| m.clone().into_iter().collect()).unwrap_or_default();
        v.sort_by_key(|(_, s)| s.order);
        v
    }

    /// A text table: site, role, shape, absmax, density, kurtosis, chan_outlier, non-finite.
    /// Site names lose the prefix they all share (printed above the table).
    pub fn table(&self) -> String {
        let sites = self.sites();
        let names: Vec<&str> = sites.iter().map(|((s, _, _), _)| s.as_str()).collect();
        let several = sites.iter().any(|((_, _, p), _)| *p > 0);
        let prefix = common_prefix(&names);
        let width = names.iter().map(|s| s.len() - prefix.len() + 9).max().unwrap_or(4).max(4);
        let mut out = String::new();
        let tensor_role = |r: &str| matches!(r, "lhs" | "rhs" | "out");
        if !prefix.is_empty() {
            let _ = writeln!(out, "sites under {prefix}");
        }
        if sites.iter().any(|((_, r, _), _)| tensor_role(r)) {
            let _ = writeln!(
                out,
                "{:<width$}  {:<4}  {:<16}  {:>10}  {:>8}  {:>9}  {:>12}  {:>10}",
                "site", "role", "shape", "absmax", "density", "kurtosis", "chan_outlier", "non-finite"
            );
        }
        let show = |x: Option<f64>, prec: usize| x.map_or("-".to_string(), |x| format!("{x:.prec$}"));
        let probes: Vec<String> = sites
            .iter()
            .filter(|((_, r, _), _)| !tensor_role(r))
            .map(|((site, role, _), s)| format!("  {}  {role}  {}", &site[prefix.len()..], s.shape))
            .collect();
        for ((site, role, pass), s) in sites.iter().filter(|((_, r, _), _)| tensor_role(r)) {
            let name = &site[prefix.len()..];
            let name = if several { format!("{name} [pass {pass}]") } else { name.to_string() };
            let _ = writeln!(
                out,
                "{:<width$}  {:<4}  {:<16}  {:>10}  {:>8}  {:>9}  {:>12}  {:>10}",
                name,
                role,
                s.shape,
                show(s.absmax(), 4),
                show(s.density(), 4),
                show(s.kurtosis_median(), 2),
                show(s.chan_outlier, 2),
                show(s.nonfinite, 0)
            );
        }
        if sites.iter().any(|((_, r, _), _)| tensor_role(r)) {
            let _ = writeln!(
                out,
                "(over all runs: absmax and chan_outlier the largest, density nnz/count, kurtosis the median of the runs', as in `opscope mine`, non-finite the count)"
            );
        }
        if !probes.is_empty() {
            let _ = writeln!(out, "probe sites (attn / route / residual statistics; `opscope measure` summarizes them):");
            for p in probes {
                let _ = writeln!(out, "{p}");
            }
        }
        out
    }
}

/// The longest common prefix of `names` ending at a `/` (what the tables strip from site names).
pub fn common_prefix<'a>(names: &[&'a str]) -> &'a str {
    let Some(first) = names.first() else { return "" };
    let mut end = first.len();
    for n in &names[1..] {
        // Byte length of the common prefix, counted in whole characters.
        let common: usize = first.chars().zip(n.chars()).take_while(|(a, b)| a == b).map(|(a, _)| a.len_utf8()).sum();
        end = end.min(common);
    }
    match first[..end].rfind('/') {
        Some(i) => &first[..=i],
        None => "",
    }
}

impl Sink for SummarySink {
    fn manifest(&mut self, _m: &std::sync::Arc<Manifest>) -> Result<(), Error> {
        Ok(())
    }

    fn write(&mut self, rows: &[Row]) -> Result<(), Error> {
        let mut map = self.sites.lock().map_err(|_| Error::Internal("poisoned".into()))?;
        for r in rows {
            let next = map.len();
            let key = (r.site.to_string(), r.role.to_string(), r.pass_idx);
            let s = map.entry(key).or_insert_with(|| SiteSummary {
                order: next,
                shape: r.shape.to_string(),
                ..Default::default()
            });
            let v = r.value as f64;
            match &*r.stat {
                "count" => s.count += v,
                "nnz" => *s.nnz.get_or_insert(0.0) += v,
                "min" => s.min = Some(s.min.map_or(v, |m| m.min(v))),
                "max" => s.max = Some(s.max.map_or(v, |m| m.max(v))),
                "kurtosis" => {
                    // Bottom-k sampling: the runs of least priority, as `opscope mine` keeps.
                    s.kurtosis.insert(opscope::mine::run_priority(r.compile, r.step), v);
                    if s.kurtosis.len() > opscope::mine::DEFAULT_MAX_RUNS {
                        s.kurtosis.pop_last();
                    }
                }
                "chan_outlier" => s.chan_outlier = Some(s.chan_outlier.map_or(v, |m| m.max(v))),
                "nan_count" | "posinf_count" | "neginf_count" => *s.nonfinite.get_or_insert(0.0) += v,
                _ => {}
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

