//! A value histogram merged over every run of a series, on one common range: what the report
//! plots, calibration reads (percentile, entropy) and `diff` compares.
//!
//! Runs recorded with a fixed range (`hist_range=LO:HI`) and the same bin count merge exactly,
//! by summing counts. Runs recorded with the default per-run absmax range have different edges;
//! each run's counts are then re-binned onto the common range `[min lo, max hi]` assuming the
//! values of a source bin are spread uniformly within it (the approximation ONNX Runtime's
//! `HistogramCollector` also makes when a later batch widens the range), and
//! [`MergedHistogram::exact`] is false.

use super::series::Series;
use crate::sketch::tensor;

/// A histogram over `[lo, hi]` with equal-width bins, merged over runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MergedHistogram {
    /// Lower edge of the first bin.
    pub lo: f64,
    /// Upper edge of the last bin.
    pub hi: f64,
    /// Element counts per bin (`bins` values; fractional when re-binned).
    pub counts: Vec<f64>,
    /// Finite elements outside a fixed range, summed over runs (`hist_outside`).
    pub outside: f64,
    /// Runs that carried a histogram.
    pub runs: usize,
    /// True when every run had the same range and bin count (counts are exact sums).
    pub exact: bool,
}

impl MergedHistogram {
    /// Bin edges, `counts.len() + 1` values (`np.linspace(lo, hi, bins + 1)`).
    pub fn edges(&self) -> Vec<f64> {
        let n = self.counts.len();
        (0..=n).map(|i| self.lo + (self.hi - self.lo) * i as f64 / n as f64).collect()
    }

    /// Total count in the bins.
    pub fn total(&self) -> f64 {
        self.counts.iter().sum()
    }
}

/// One run's histogram: range and counts.
fn run_hist(r: &super::StepStats) -> Option<(f64, f64, &[f32])> {
    let h = r.vector(tensor::HIST)?;
    let lo = r.scalar(tensor::HIST_LO)?;
    let hi = r.scalar(tensor::HIST_HI)?;
    (lo.is_finite() && hi.is_finite() && hi >= lo && !h.is_empty()).then_some((lo, hi, h))
}

/// Add `counts` over `[lo, hi]` to `out` (bins of equal width over `[out_lo, out_hi]`), spreading
/// each source bin's count over the destination bins it overlaps in proportion to the overlap.
/// A zero-width source range (a constant tensor) puts its count in the bin holding `lo`.
fn rebin(counts: &[f32], lo: f64, hi: f64, out_lo: f64, out_hi: f64, out: &mut [f64]) {
    let n = out.len();
    let ow = (out_hi - out_lo) / n as f64;
    let bin_of = |x: f64| -> usize {
        if ow <= 0.0 {
            return 0;
        }
        (((x - out_lo) / ow).floor().max(0.0) as usize).min(n - 1)
    };
    let w = (hi - lo) / counts.len() as f64;
    for (i, &c) in counts.iter().enumerate() {
        let c = c as f64;
        if c == 0.0 || !c.is_finite() {
            continue;
        }
        let (a, b) = (lo + w * i as f64, lo + w * (i + 1) as f64);
        if w <= 0.0 || ow <= 0.0 {
            out[bin_of(a)] += c;
            continue;
        }
        let (first, last) = (bin_of(a), bin_of(b - w * 1e-9));
        for j in first..=last {
            let (ja, jb) = (out_lo + ow * j as f64, out_lo + ow * (j + 1) as f64);
            let overlap = (b.min(jb) - a.max(ja)).max(0.0);
            out[j] += c * overlap / w;
        }
    }
}

/// The value histogram of `s` merged over its runs, with `bins` bins (default: the most bins
/// any run has). `None` when no run carries a histogram (record with `stats=[..,hist]`).
pub fn merged_histogram(s: &Series, bins: Option<usize>) -> Option<MergedHistogram> {
    histograms_by_run(s, bins).map(|h| h.merged)
}

/// Each run's value histogram on the common range of [`merged_histogram`], and their sum.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunHistograms {
    /// The merged histogram (the sum of [`RunHistograms::runs`]); serialized as its fields.
    #[serde(flatten)]
    pub merged: MergedHistogram,
    /// Per run that carried a histogram: its index in [`Series::runs`] and its counts on the
    /// merged range and bins (re-binned as the merged histogram is when not
    /// [`MergedHistogram::exact`]). Not serialized.
    #[serde(skip)]
    pub runs: Vec<(usize, Vec<f64>)>,
}

/// One run's histogram: (index in [`Series::runs`], lo, hi, counts, `hist_outside`).
type RunHist<'a> = (usize, f64, f64, &'a [f32], f64);

/// The runs of `s` that carry a histogram.
fn run_hists(s: &Series) -> Vec<RunHist<'_>> {
    s.runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| run_hist(r).map(|(lo, hi, h)| (i, lo, hi, h, r.scalar(tensor::HIST_OUTSIDE).unwrap_or(0.0))))
        .collect()
}

/// The common range of `runs` (`[min lo, max hi]`), its bin count (`bins`, default the most bins
/// any run has) and whether every run already has exactly that range and bin count.
fn common_range(runs: &[RunHist<'_>], bins: Option<usize>) -> (f64, f64, usize, bool) {
    let n = bins.unwrap_or_else(|| runs.iter().map(|r| r.3.len()).max().unwrap_or(1)).max(1);
    let lo = runs.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
    let hi = runs.iter().map(|r| r.2).fold(f64::NEG_INFINITY, f64::max);
    let exact = runs.iter().all(|r| r.1 == lo && r.2 == hi && r.3.len() == n);
    (lo, hi, n, exact)
}

/// `runs` on the range `[lo, hi]` with `n` bins: summed as they are when `exact`, else each
/// re-binned by overlap.
fn on_range(runs: &[RunHist<'_>], (lo, hi, n, exact): (f64, f64, usize, bool)) -> RunHistograms {
    let mut counts = vec![0.0; n];
    let mut per_run = Vec::with_capacity(runs.len());
    for &(i, rlo, rhi, h, _) in runs {
        let mut c = vec![0.0; n];
        if exact {
            for (o, &x) in c.iter_mut().zip(h) {
                *o += x as f64;
            }
        } else {
            rebin(h, rlo, rhi, lo, hi, &mut c);
        }
        for (o, x) in counts.iter_mut().zip(&c) {
            *o += x;
        }
        per_run.push((i, c));
    }
    RunHistograms {
        merged: MergedHistogram {
            lo,
            hi,
            counts,
            outside: runs.iter().map(|r| r.4).sum(),
            runs: runs.len(),
            exact,
        },
        runs: per_run,
    }
}

/// Every run's value histogram on one common range (what a histogram-over-runs view draws),
/// with `bins` bins (default: the most bins any run has); their sum is [`merged_histogram`].
/// `None` when no run carries a histogram.
pub fn histograms_by_run(s: &Series, bins: Option<usize>) -> Option<RunHistograms> {
    let runs = run_hists(s);
    if runs.is_empty() {
        return None;
    }
    Some(on_range(&runs, common_range(&runs, bins)))
}

/// The value histograms of several series, each merged over its runs, all on one common range:
/// `[min lo, max hi]` over every run of every series, with `bins` bins (default: the most bins
/// any run has), so that they can be compared bin by bin (`opscope diff`). Each run is re-binned
/// once, directly onto the common range, by the overlap rule of [`merged_histogram`]; when
/// every run of every series already has that range and bin count the counts are exact sums and
/// each result's [`MergedHistogram::exact`] is true. `None` when any series has no histogram.
pub fn merged_histograms(series: &[&Series], bins: Option<usize>) -> Option<Vec<MergedHistogram>> {
    let per: Vec<Vec<RunHist<'_>>> = series.iter().map(|s| run_hists(s)).collect();
    if per.iter().any(|runs| runs.is_empty()) {
        return None;
    }
    let all: Vec<RunHist<'_>> = per.iter().flatten().copied().collect();
    let range = common_range(&all, bins);
    Some(per.iter().map(|runs| on_range(runs, range).merged).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebin_keeps_mass_and_place() {
        // One count in [0.5, 1.0) of a 2-bin [0, 1] histogram, onto 4 bins over [-1, 1]:
        // it lands in the last bin, [0.5, 1].
        let mut out = vec![0.0; 4];
        rebin(&[0.0, 3.0], 0.0, 1.0, -1.0, 1.0, &mut out);
        assert_eq!(out, vec![0.0, 0.0, 0.0, 3.0]);
        // A source bin straddling two destination bins splits in proportion: [0, 1) onto
        // bins of width 0.4 over [-0.2, 1.4): overlaps 0.2, 0.4, 0.4.
        let mut out = vec![0.0; 4];
        rebin(&[10.0], 0.0, 1.0, -0.2, 1.4, &mut out);
        let want = [2.0, 4.0, 4.0, 0.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-9, "{out:?}");
        }
        // A constant tensor (zero-width range) keeps its count.
        let mut out = vec![0.0; 2];
        rebin(&[5.0], 0.25, 0.25, 0.0, 1.0, &mut out);
        assert_eq!(out, vec![5.0, 0.0]);
    }

    /// Rows of one run's histogram: `hist` over `[lo, hi]`.
    fn hist_rows(step: u64, lo: f32, hi: f32, counts: &[f32]) -> Vec<crate::recording::Row> {
        use std::sync::Arc;
        let row = |stat: &str, idx: u64, value: f32| crate::recording::Row {
            run_id: Arc::from("r"),
            compile: 1,
            step,
            graph: Arc::from("g"),
            pass: Arc::from("matmul"),
            pass_idx: 0,
            site: Arc::from("s"),
            op: Arc::from("matmul"),
            role: Arc::from("out"),
            stat: Arc::from(stat),
            idx,
            value,
            numel: None,
            shape: Arc::from("[4]"),
            flops: None,
        };
        let mut v = vec![row("count", 0, counts.iter().sum()), row("hist_lo", 0, lo), row("hist_hi", 0, hi)];
        v.extend(counts.iter().enumerate().map(|(i, &c)| row("hist", i as u64, c)));
        v
    }

    #[test]
    fn runs_on_the_common_range_sum_to_the_merged_histogram() {
        // Run 0 over [0, 1], run 1 over [-1, 1]: both onto [-1, 1] with 2 bins. Run 0's bins
        // [0, .5) and [.5, 1] both fall in [0, 1]; run 1 keeps its bins.
        let mut rows = hist_rows(0, 0.0, 1.0, &[3.0, 1.0]);
        rows.extend(hist_rows(1, -1.0, 1.0, &[2.0, 5.0]));
        let series = crate::mine::series_from_rows(&rows);
        let s = series.values().next().unwrap();
        let h = histograms_by_run(s, None).unwrap();
        assert!(!h.merged.exact);
        assert_eq!((h.merged.lo, h.merged.hi), (-1.0, 1.0));
        assert_eq!(h.runs, vec![(0, vec![0.0, 4.0]), (1, vec![2.0, 5.0])]);
        assert_eq!(h.merged.counts, vec![2.0, 9.0]);
        assert_eq!(merged_histogram(s, None).unwrap(), h.merged);
        // The same range in every run: exact sums.
        let mut rows = hist_rows(0, -1.0, 1.0, &[3.0, 1.0]);
        rows.extend(hist_rows(1, -1.0, 1.0, &[2.0, 5.0]));
        let series = crate::mine::series_from_rows(&rows);
        let h = histograms_by_run(series.values().next().unwrap(), None).unwrap();
        assert!(h.merged.exact);
        assert_eq!(h.merged.counts, vec![5.0, 6.0]);
    }
}
