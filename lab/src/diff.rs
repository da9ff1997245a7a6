//! `opscope diff A B`: two recordings of the same model (fp32 vs fake-quantized, `--seq 32` vs
//! `64`, before vs after a fine-tune) compared site by site, the sites that moved most first.
//!
//! **Alignment.** Series are matched by `(site, role, pass_idx)`; then, among those left, by
//! `(site, role)` where each recording has it under one pass only (a tap that moved to another
//! position in the pipeline, as `matmul` vs `fakequant,matmul`). Only when no full name matches,
//! the same two steps run on the site names without each recording's common prefix
//! ([`crate::summary::common_prefix`] of its distinct site names, none for a single name), for
//! recordings whose sites differ only by it; the output says so. Series left over are listed
//! as only in A or only in B, never dropped.
//!
//! **Measures** (per matched series; definitions in the docs of each field):
//! - every scalar statistic of [`SCALARS`]: the median over runs in A and in B, the relative
//!   change of the median, and the two-sample Kolmogorov–Smirnov statistic of the per-run
//!   values ([`ks_statistic`]);
//! - the value histogram: both series' histograms merged over all runs on one common range
//!   ([`opscope::mine::merged_histograms`]), compared by the Jensen–Shannon divergence
//!   ([`js_divergence_bits`]) and the 1-Wasserstein distance normalized by the pooled standard
//!   deviation ([`wasserstein1`]);
//! - per-channel max|x| (`chan_maxabs`): the per-channel means over runs, compared by the
//!   relative L2 change, Spearman's rank correlation, and the rank moves of the largest channels.
//!
//! **Ranking.** By one score, [`SCORE`]: the Jensen–Shannon divergence of the value histograms.
//! A series without a histogram in A or B has no score and comes after those that have one.
//!
//! A measure that cannot be computed (the statistic was not recorded on one side, the median in
//! A is 0 for a relative change, a channel count differs) is `None` (`null` in JSON, `-` in the
//! table) and the reason is in the series' `notes`; nothing is replaced by 0.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::hash::Hash;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use opscope::mine::{merged_histograms, Series, SeriesKey, StepStats};
use opscope::sketch::tensor;

use crate::summary::common_prefix;

/// The ranking score: its name in the output and its definition.
pub const SCORE: (&str, &str) = (
    "js",
    "Jensen-Shannon divergence (bits, 0..1; Lin 1991) between the value histograms of A and B, \
     each merged over all runs, on one common range",
);

/// Channels at the top of the per-channel max|x| ranking (in A or in B) whose rank moves are
/// listed: the outlier channels per-channel scales and LLM.int8-style outlier handling
/// (Dettmers et al. 2022) depend on.
pub const TOP_CHANNELS: usize = 5;

/// A per-run scalar derived from one run's sketch: name, definition, and how to compute it.
pub struct Scalar {
    /// Name in the output.
    pub name: &'static str,
    /// Definition (units).
    pub doc: &'static str,
    /// The value for one run; `None` when the statistics it needs were not recorded in that run
    /// or it is undefined there (no finite element).
    pub get: fn(&StepStats) -> Option<f64>,
}

fn count(r: &StepStats) -> Option<f64> {
    r.scalar(tensor::COUNT).filter(|&c| c > 0.0)
}

/// The scalar statistics compared, in output order.
pub const SCALARS: &[Scalar] = &[
    Scalar { name: "mean", doc: "mean of the finite values (units of x)", get: |r| r.scalar(tensor::MEAN) },
    Scalar { name: "rms", doc: "sqrt(sumsq / count) (units of x)", get: |r| Some((r.scalar(tensor::SUMSQ)? / count(r)?).sqrt()) },
    Scalar {
        name: "absmax",
        doc: "max(|min|, |max|) (units of x)",
        get: |r| Some(r.scalar(tensor::MIN)?.abs().max(r.scalar(tensor::MAX)?.abs())),
    },
    Scalar { name: "kurtosis", doc: "E[(x-mu)^4] / E[(x-mu)^2]^2 (3 for a Gaussian)", get: |r| r.scalar(tensor::KURTOSIS) },
    Scalar { name: "density", doc: "nnz / count (fraction of non-zero finite values)", get: |r| Some(r.scalar(tensor::NNZ)? / count(r)?) },
    Scalar { name: "chan_outlier", doc: "max / mean of the per-channel max|x|", get: |r| r.scalar(tensor::CHAN_OUTLIER) },
    Scalar { name: "nan_count", doc: "NaN elements", get: |r| r.scalar(tensor::NAN_COUNT) },
    Scalar { name: "posinf_count", doc: "+Inf elements", get: |r| r.scalar(tensor::POSINF_COUNT) },
    Scalar { name: "neginf_count", doc: "-Inf elements", get: |r| r.scalar(tensor::NEGINF_COUNT) },
];

/// The shift of one scalar statistic between A and B.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalarShift {
    /// Statistic ([`SCALARS`]).
    pub stat: String,
    /// Runs of A where the statistic has a value.
    pub runs_a: usize,
    /// Runs of B where the statistic has a value.
    pub runs_b: usize,
    /// Median over those runs of A (the mean of the two middle values for an even count, as
    /// `numpy.median`).
    pub median_a: Option<f64>,
    /// Median over those runs of B.
    pub median_b: Option<f64>,
    /// `median_b - median_a`.
    pub change: Option<f64>,
    /// `(median_b - median_a) / |median_a|`; 0 when both are 0, `None` when only A's is 0.
    pub rel_change: Option<f64>,
    /// Two-sample Kolmogorov–Smirnov statistic of the per-run values ([`ks_statistic`]).
    pub ks: Option<f64>,
}

/// The shift of the value histogram between A and B.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistShift {
    /// Bins of the common range (the most any run of A or B has).
    pub bins: usize,
    /// Common range: lower edge (the smallest `hist_lo` of any run).
    pub lo: f64,
    /// Common range: upper edge (the largest `hist_hi` of any run).
    pub hi: f64,
    /// True when every run of A and B had this range and bin count (fixed `hist_range`): the
    /// merged counts are exact. Otherwise runs were re-binned by overlap (values spread
    /// uniformly within a bin), and two equal distributions with different ranges can show a
    /// small divergence.
    pub exact: bool,
    /// Finite values of A outside a fixed range, summed over runs (not in the histogram).
    pub outside_a: f64,
    /// Same for B.
    pub outside_b: f64,
    /// Jensen–Shannon divergence in bits ([`js_divergence_bits`]).
    pub js: f64,
    /// 1-Wasserstein distance between the binned distributions, units of x ([`wasserstein1`]).
    pub w1: f64,
    /// `w1` divided by the pooled standard deviation `sqrt((var_A + var_B) / 2)` of the two
    /// binned distributions (no unit); `None` when both are a single bin (variance 0).
    pub w1_norm: Option<f64>,
}

/// One channel of `chan_maxabs` among the largest whose rank changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankMove {
    /// Channel (last-axis index).
    pub channel: usize,
    /// Rank in A, 1 = largest mean max|x| (ties share their average rank).
    pub rank_a: f64,
    /// Rank in B.
    pub rank_b: f64,
}

/// The shift of per-channel max|x| (`chan_maxabs`) between A and B, on the per-channel means
/// over runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelShift {
    /// Channels.
    pub channels: usize,
    /// `||m_B - m_A||_2 / ||m_A||_2` over the per-channel means; `None` when `m_A` is all 0.
    pub rel_l2: Option<f64>,
    /// Spearman's rank correlation of `m_A` and `m_B` (Pearson correlation of the average ranks;
    /// Spearman 1904); `None` when either is constant over channels.
    pub spearman: Option<f64>,
    /// Channels in the top [`TOP_CHANNELS`] of A or of B whose rank differs, by best rank.
    pub moved: Vec<RankMove>,
}

/// One series present in both recordings, compared.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiteDiff {
    /// Position in the ranking, 1 = moved most; `None` without a score.
    pub rank: Option<usize>,
    /// Site name without A's common prefix (what the table prints).
    pub site: String,
    /// Full site name in A.
    pub site_a: String,
    /// Full site name in B.
    pub site_b: String,
    /// Role (`lhs`, `rhs`, `out`, ...).
    pub role: String,
    /// Pass index in A's pipeline.
    pub pass_a: u32,
    /// Pass index in B's pipeline.
    pub pass_b: u32,
    /// Op at the site in A.
    pub op: String,
    /// Tensor shape in A.
    pub shape_a: String,
    /// Tensor shape in B.
    pub shape_b: String,
    /// Runs (executions) of the series in A.
    pub runs_a: usize,
    /// Runs of the series in B.
    pub runs_b: usize,
    /// The ranking score ([`SCORE`]): `hist.js`.
    pub score: Option<f64>,
    /// Value histogram shift; `None` when A or B has no histogram (see `notes`).
    pub hist: Option<HistShift>,
    /// Scalar statistics recorded in A or B, in [`SCALARS`] order.
    pub scalars: Vec<ScalarShift>,
    /// Per-channel max|x| shift; `None` when either side lacks it or the channel counts differ.
    pub channels: Option<ChannelShift>,
    /// Why a measure is missing.
    pub notes: Vec<String>,
}

impl SiteDiff {
    /// The shift of scalar statistic `name`, if recorded on either side.
    pub fn scalar(&self, name: &str) -> Option<&ScalarShift> {
        self.scalars.iter().find(|s| s.stat == name)
    }

    /// The largest Kolmogorov–Smirnov statistic over the scalar statistics, with the first
    /// statistic (in [`SCALARS`] order) that reaches it.
    pub fn ks_max(&self) -> Option<(f64, &str)> {
        self.scalars.iter().filter_map(|s| Some((s.ks?, s.stat.as_str()))).fold(None, |best, x| match best {
            Some(b) if b.0 >= x.0 => Some(b),
            _ => Some(x),
        })
    }
}

/// Two recordings compared.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Diff {
    /// Name of the ranking score.
    pub score: String,
    /// Its definition.
    pub score_doc: String,
    /// True when no full site name is in both recordings and series were matched by the names
    /// without each recording's common prefix.
    pub short_names: bool,
    /// Common prefix of A's site names (stripped in `site`).
    pub prefix_a: String,
    /// Common prefix of B's site names.
    pub prefix_b: String,
    /// Series in both, ranked by `score` (highest first), then those without a score by name.
    pub sites: Vec<SiteDiff>,
    /// Series only in A: `site/role` (full names), with ` [pass N]`.
    pub only_a: Vec<String>,
    /// Series only in B.
    pub only_b: Vec<String>,
}

/// The two-sample Kolmogorov–Smirnov statistic `D = sup_x |F_a(x) - F_b(x)|` of the empirical
/// distribution functions `F(x) = #{v <= x} / n` (Kolmogorov 1933, Smirnov 1948; the
/// `statistic` of `scipy.stats.ks_2samp`). 0 for identical samples, 1 for samples that do not
/// overlap. Non-finite values are left out; `None` when a sample is then empty.
pub fn ks_statistic(a: &[f64], b: &[f64]) -> Option<f64> {
    let sorted = |v: &[f64]| {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (a, b) = (sorted(a), sorted(b));
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0, 0, 0.0f64);
    // Step through the pooled values; at each distinct x both CDFs include every value <= x.
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / na - j as f64 / nb).abs());
    }
    Some(d)
}

/// The Jensen–Shannon divergence in bits between two histograms over the same bins (counts,
/// normalized here): `JS = KL(p || m) / 2 + KL(q || m) / 2`, `m = (p + q) / 2`, log base 2, so
/// `0 <= JS <= 1` (Lin, *Divergence measures based on the Shannon entropy*, IEEE Trans. Inf.
/// Theory 1991; the square of `scipy.spatial.distance.jensenshannon(p, q, base=2)`).
/// Exactly 0 for proportional histograms. `None` when a histogram is empty.
pub fn js_divergence_bits(p: &[f64], q: &[f64]) -> Option<f64> {
    let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
    if !(sp > 0.0 && sq > 0.0) || p.len() != q.len() {
        return None;
    }
    let mut js = 0.0;
    for (&a, &b) in p.iter().zip(q) {
        let (a, b) = (a / sp, b / sq);
        let m = 0.5 * (a + b);
        if a > 0.0 {
            js += 0.5 * a * (a / m).log2();
        }
        if b > 0.0 {
            js += 0.5 * b * (b / m).log2();
        }
    }
    // Rounding can leave -1e-17 for equal inputs' neighbours; the divergence is >= 0.
    Some(js.max(0.0))
}

/// The 1-Wasserstein (earth mover's) distance between two histograms over the same equal-width
/// bins of width `w`, each bin's mass at its centre: `W1 = sum_i |P_i - Q_i| * w` over the
/// cumulative normalized counts `P`, `Q` (Vaserstein 1969; `scipy.stats.wasserstein_distance`
/// of the bin centres weighted by the counts), and the pooled standard deviation
/// `sqrt((var_p + var_q) / 2)` of the two binned distributions. `None` when a histogram is empty.
pub fn wasserstein1(p: &[f64], q: &[f64], lo: f64, hi: f64) -> Option<(f64, f64)> {
    let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
    if !(sp > 0.0 && sq > 0.0) || p.len() != q.len() || p.is_empty() {
        return None;
    }
    let n = p.len();
    let w = (hi - lo) / n as f64;
    let (mut cp, mut cq, mut w1) = (0.0, 0.0, 0.0);
    for i in 0..n - 1 {
        cp += p[i] / sp;
        cq += q[i] / sq;
        w1 += (cp - cq).abs() * w;
    }
    let var = |h: &[f64], s: f64| {
        let centre = |i: usize| lo + w * (i as f64 + 0.5);
        let mean: f64 = h.iter().enumerate().map(|(i, c)| c / s * centre(i)).sum();
        h.iter().enumerate().map(|(i, c)| c / s * (centre(i) - mean).powi(2)).sum::<f64>()
    };
    Some((w1, (0.5 * (var(p, sp) + var(q, sq))).sqrt()))
}

/// The median of `v` (`numpy.median`: the mean of the two middle values for an even count).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some(0.5 * (v[n / 2 - 1] + v[n / 2])),
    }
}

/// Average ranks, 1 = largest (ties share the mean of the ranks they span).
fn ranks_desc(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let avg = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = avg;
        }
        i = j + 1;
    }
    r
}

/// Pearson correlation; `None` when either side is constant.
fn pearson(a: &[f64], b: &[f64]) -> Option<f64> {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let (mut sab, mut saa, mut sbb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        sab += (x - ma) * (y - mb);
        saa += (x - ma).powi(2);
        sbb += (y - mb).powi(2);
    }
    (saa > 0.0 && sbb > 0.0).then(|| sab / (saa * sbb).sqrt())
}

fn scalar_shifts(a: &Series, b: &Series, notes: &mut Vec<String>) -> Vec<ScalarShift> {
    let mut out = Vec::new();
    for s in SCALARS {
        let va: Vec<f64> = a.runs.iter().filter_map(s.get).filter(|x| x.is_finite()).collect();
        let vb: Vec<f64> = b.runs.iter().filter_map(s.get).filter(|x| x.is_finite()).collect();
        if va.is_empty() && vb.is_empty() {
            continue;
        }
        for (v, side) in [(&va, "A"), (&vb, "B")] {
            if v.is_empty() {
                notes.push(format!("{}: not recorded in {side} (or undefined in every run)", s.name));
            }
        }
        let (ma, mb) = (median(&va), median(&vb));
        let rel_change = match (ma, mb) {
            (Some(x), Some(y)) if x == y => Some(0.0),
            (Some(x), Some(y)) if x != 0.0 => Some((y - x) / x.abs()),
            (Some(_), Some(_)) => {
                notes.push(format!("{}: no relative change (the median in A is 0)", s.name));
                None
            }
            _ => None,
        };
        out.push(ScalarShift {
            stat: s.name.to_string(),
            runs_a: va.len(),
            runs_b: vb.len(),
            median_a: ma,
            median_b: mb,
            change: mb.zip(ma).map(|(y, x)| y - x),
            rel_change,
            ks: ks_statistic(&va, &vb),
        });
    }
    out
}

fn hist_shift(a: &Series, b: &Series, notes: &mut Vec<String>) -> Option<HistShift> {
    let Some(h) = merged_histograms(&[a, b], None) else {
        for (s, side) in [(a, "A"), (b, "B")] {
            if !s.runs.iter().any(|r| r.vector(tensor::HIST).is_some()) {
                notes.push(format!("hist: not recorded in {side} (record with stats=[..,hist]): no score"));
            }
        }
        return None;
    };
    let (ha, hb) = (&h[0], &h[1]);
    let (Some(js), Some((w1, sigma))) = (js_divergence_bits(&ha.counts, &hb.counts), wasserstein1(&ha.counts, &hb.counts, ha.lo, ha.hi))
    else {
        notes.push(format!(
            "hist: no value in the histogram range [{}, {}] in {}: no score",
            ha.lo,
            ha.hi,
            if ha.total() > 0.0 { "B" } else { "A" }
        ));
        return None;
    };
    // Binned differently (bin counts, or one fixed range against another or against per-run
    // absmax ranges): js and w1 then measure the binning as well as the data.
    let binning = |s: &Series| -> (usize, Option<(f64, f64)>) {
        let bins = s.runs.iter().filter_map(|r| r.vector(tensor::HIST).map(|h| h.len())).max().unwrap_or(0);
        let ranges: Vec<(f64, f64)> = s.runs.iter().filter_map(|r| Some((r.scalar(tensor::HIST_LO)?, r.scalar(tensor::HIST_HI)?))).collect();
        let fixed = ranges.first().copied().filter(|f| ranges.iter().all(|r| r == f));
        (bins, fixed)
    };
    let (ba, bb) = (binning(a), binning(b));
    if ba.0 != bb.0 || ba.1 != bb.1 {
        let say = |(bins, fixed): (usize, Option<(f64, f64)>)| match fixed {
            Some((lo, hi)) => format!("{bins} bins over [{lo}, {hi}]"),
            None => format!("{bins} bins over each run's range"),
        };
        notes.push(format!(
            "hist: A and B were binned differently (A {}, B {}): js and w1 measure the re-binning as well as the data; \
             record both with the same hist_bins and hist_range to compare histograms",
            say(ba),
            say(bb)
        ));
    }
    for (m, s, side) in [(ha, a, "A"), (hb, b, "B")] {
        if m.outside > 0.0 {
            // The side's own fixed range (the one its values fell outside of when recorded), not
            // the range both were merged onto.
            let lo = s.runs.iter().filter_map(|r| r.scalar(tensor::HIST_LO)).fold(f64::INFINITY, f64::min);
            let hi = s.runs.iter().filter_map(|r| r.scalar(tensor::HIST_HI)).fold(f64::NEG_INFINITY, f64::max);
            notes.push(format!(
                "hist: {} values of {side} ({:.2}%) lie outside its fixed range [{lo}, {hi}] and are not compared",
                m.outside,
                100.0 * m.outside / (m.outside + m.total()),
            ));
        }
    }
    Some(HistShift {
        bins: ha.counts.len(),
        lo: ha.lo,
        hi: ha.hi,
        exact: ha.exact,
        outside_a: ha.outside,
        outside_b: hb.outside,
        js,
        w1,
        w1_norm: (sigma > 0.0).then(|| w1 / sigma),
    })
}

fn channel_shift(a: &Series, b: &Series, notes: &mut Vec<String>) -> Option<ChannelShift> {
    match (a.has_chan_maxabs(), b.has_chan_maxabs()) {
        (false, false) => return None,
        (true, true) => {}
        (ha, _) => {
            notes.push(format!("chan_maxabs: not recorded in {}", if ha { "B" } else { "A" }));
            return None;
        }
    }
    let (ma, mb) = (a.chan_maxabs_mean().unwrap_or_default(), b.chan_maxabs_mean().unwrap_or_default());
    if ma.len() != mb.len() {
        notes.push(format!("chan_maxabs: channel counts differ (A {}, B {}): not compared", ma.len(), mb.len()));
        return None;
    }
    if let Some(c) = ma.iter().chain(&mb).position(|x| !x.is_finite()) {
        notes.push(format!("chan_maxabs: channel {} has no value in some run: not compared", c % ma.len()));
        return None;
    }
    let na = ma.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nd = ma.iter().zip(&mb).map(|(x, y)| (y - x).powi(2)).sum::<f64>().sqrt();
    let rel_l2 = if nd == 0.0 {
        Some(0.0)
    } else if na > 0.0 {
        Some(nd / na)
    } else {
        notes.push("chan_maxabs: no relative L2 change (every channel of A is 0)".into());
        None
    };
    let (ra, rb) = (ranks_desc(&ma), ranks_desc(&mb));
    let spearman = pearson(&ra, &rb);
    if spearman.is_none() {
        notes.push("chan_maxabs: no Spearman correlation (constant over channels in A or B)".into());
    }
    let top = TOP_CHANNELS as f64;
    let mut moved: Vec<RankMove> = (0..ma.len())
        .filter(|&c| (ra[c] <= top || rb[c] <= top) && ra[c] != rb[c])
        .map(|c| RankMove { channel: c, rank_a: ra[c], rank_b: rb[c] })
        .collect();
    moved.sort_by(|x, y| x.rank_a.min(x.rank_b).total_cmp(&y.rank_a.min(y.rank_b)).then(x.channel.cmp(&y.channel)));
    Some(ChannelShift { channels: ma.len(), rel_l2, spearman, moved })
}

/// Compare one series of A with one of B: histogram, scalar and channel shifts, and the notes.
fn compare(a: &Series, b: &Series) -> (Option<HistShift>, Vec<ScalarShift>, Option<ChannelShift>, Vec<String>) {
    let mut notes = Vec::new();
    let hist = hist_shift(a, b, &mut notes);
    let scalars = scalar_shifts(a, b, &mut notes);
    let channels = channel_shift(a, b, &mut notes);
    (hist, scalars, channels, notes)
}

/// Pair the keys of `a` and `b` left in `la` / `lb` whose `key` is unique on both sides.
fn match_unique<K: Eq + Hash + Clone>(
    la: &mut Vec<SeriesKey>,
    lb: &mut Vec<SeriesKey>,
    key_a: impl Fn(&SeriesKey) -> K,
    key_b: impl Fn(&SeriesKey) -> K,
    pairs: &mut Vec<(SeriesKey, SeriesKey)>,
) {
    let mut ca: HashMap<K, Vec<usize>> = HashMap::new();
    for (i, k) in la.iter().enumerate() {
        ca.entry(key_a(k)).or_default().push(i);
    }
    let mut cb: HashMap<K, Vec<usize>> = HashMap::new();
    for (i, k) in lb.iter().enumerate() {
        cb.entry(key_b(k)).or_default().push(i);
    }
    let mut used_a = vec![false; la.len()];
    let mut used_b = vec![false; lb.len()];
    for (k, ia) in &ca {
        if let (1, Some(ib)) = (ia.len(), cb.get(k).filter(|v| v.len() == 1)) {
            pairs.push((la[ia[0]].clone(), lb[ib[0]].clone()));
            used_a[ia[0]] = true;
            used_b[ib[0]] = true;
        }
    }
    let mut i = 0;
    la.retain(|_| (!used_a[i], i += 1).0);
    let mut j = 0;
    lb.retain(|_| (!used_b[j], j += 1).0);
}

fn key_text(k: &SeriesKey) -> String {
    format!("{}/{} [pass {}]", k.0, k.1, k.2)
}

/// Compare two recordings' series ([`opscope::mine::load`]) site by site (see the module docs).
///
/// Errors: a recording holds no series; no series is in both (the message names the first few
/// of each and, for the first of A, the closest names in B).
pub fn diff(a: &BTreeMap<SeriesKey, Series>, b: &BTreeMap<SeriesKey, Series>) -> Result<Diff> {
    for (m, side) in [(a, "A"), (b, "B")] {
        if m.is_empty() {
            bail!("recording {side} holds no statistics (a header-only recording, or only statistics no linked pass declares): nothing to compare");
        }
    }
    let names = |m: &BTreeMap<SeriesKey, Series>| {
        let mut v: Vec<String> = m.keys().map(|k| k.0.clone()).collect();
        v.dedup();
        v
    };
    let (names_a, names_b) = (names(a), names(b));
    // A single name's "common prefix" would be all but its last component: no prefix then.
    let prefix = |n: &[String]| if n.len() < 2 { String::new() } else { common_prefix(&n.iter().map(String::as_str).collect::<Vec<_>>()).to_string() };
    let (prefix_a, prefix_b) = (prefix(&names_a), prefix(&names_b));
    let short = |p: &str, k: &SeriesKey| k.0.strip_prefix(p).unwrap_or(&k.0).to_string();
    let mut la: Vec<SeriesKey> = a.keys().cloned().collect();
    let mut lb: Vec<SeriesKey> = b.keys().cloned().collect();
    let mut pairs = Vec::new();
    match_unique(&mut la, &mut lb, |k| k.clone(), |k| k.clone(), &mut pairs);
    match_unique(&mut la, &mut lb, |k| (k.0.clone(), k.1.clone()), |k| (k.0.clone(), k.1.clone()), &mut pairs);
    let short_names = pairs.is_empty() && prefix_a != prefix_b;
    if short_names {
        match_unique(&mut la, &mut lb, |k| (short(&prefix_a, k), k.1.clone(), k.2), |k| (short(&prefix_b, k), k.1.clone(), k.2), &mut pairs);
        match_unique(&mut la, &mut lb, |k| (short(&prefix_a, k), k.1.clone()), |k| (short(&prefix_b, k), k.1.clone()), &mut pairs);
    }
    if pairs.is_empty() {
        let show = |keys: &[SeriesKey], p: &str| {
            let v: Vec<String> = keys.iter().take(5).map(|k| format!("{}/{}", short(p, k), k.1)).collect();
            format!("{}{}", v.join(", "), if keys.len() > 5 { ", ..." } else { "" })
        };
        let first = &la[0];
        let near = opscope::error::closest(&short(&prefix_a, first), names_b.iter().map(|n| n.strip_prefix(prefix_b.as_str()).unwrap_or(n)));
        let mut near: Vec<&str> = near;
        near.dedup();
        bail!(
            "no site/role is in both recordings (matched by full name, and by name without each recording's common prefix):\n  \
             A ({} site/roles under '{prefix_a}'): {}\n  B ({} site/roles under '{prefix_b}'): {}\n  \
             closest in B to A's '{}': {}",
            a.len(),
            show(&la, &prefix_a),
            b.len(),
            show(&lb, &prefix_b),
            short(&prefix_a, first),
            near.into_iter().take(3).collect::<Vec<_>>().join(", ")
        );
    }
    let mut sites: Vec<SiteDiff> = pairs
        .into_iter()
        .map(|(ka, kb)| {
            let (sa, sb) = (&a[&ka], &b[&kb]);
            let (hist, scalars, channels, notes) = compare(sa, sb);
            SiteDiff {
                rank: None,
                site: short(&prefix_a, &ka),
                site_a: ka.0.clone(),
                site_b: kb.0.clone(),
                role: ka.1.clone(),
                pass_a: ka.2,
                pass_b: kb.2,
                op: sa.op.clone(),
                shape_a: sa.shape.clone(),
                shape_b: sb.shape.clone(),
                runs_a: sa.runs.len(),
                runs_b: sb.runs.len(),
                score: hist.as_ref().map(|h| h.js),
                hist,
                scalars,
                channels,
                notes,
            }
        })
        .collect();
    sites.sort_by(|x, y| match (x.score, y.score) {
        (Some(p), Some(q)) => q.total_cmp(&p),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => std::cmp::Ordering::Equal,
    }
    .then_with(|| (&x.site, &x.role, x.pass_a).cmp(&(&y.site, &y.role, y.pass_a))));
    for (i, s) in sites.iter_mut().enumerate() {
        s.rank = s.score.map(|_| i + 1);
    }
    Ok(Diff {
        score: SCORE.0.to_string(),
        score_doc: SCORE.1.to_string(),
        short_names: short_names && !sites.is_empty(),
        prefix_a,
        prefix_b,
        sites,
        only_a: la.iter().map(key_text).collect(),
        only_b: lb.iter().map(key_text).collect(),
    })
}

/// `x` with 4 significant digits, `-` for `None`.
fn num(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(x) if x == 0.0 => "0".into(),
        Some(x) if x.abs() >= 1e4 || x.abs() < 1e-3 => format!("{x:.3e}"),
        Some(x) => format!("{x:.4}"),
    }
}

/// A relative change as a signed percentage, `-` for `None`.
fn pct(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(x) if x == 0.0 => "0%".into(),
        Some(x) => format!("{:+.1}%", 100.0 * x),
    }
}

impl Diff {
    /// The text report: header, the ranked table (first `top` series, all if 0), the per
    /// statistic detail of the first `detail` of them, the series only in A or only in B.
    pub fn text(&self, a: &str, b: &str, top: usize, detail: usize) -> String {
        let mut out = String::new();
        let moved = self.sites.iter().filter(|s| s.score.is_some_and(|x| x > 0.0)).count();
        let _ = writeln!(out, "A: {a}\nB: {b}");
        if !self.prefix_a.is_empty() || !self.prefix_b.is_empty() {
            let _ = writeln!(
                out,
                "sites under {}{}",
                self.prefix_a,
                if self.prefix_a == self.prefix_b { String::new() } else { format!(" (B: {})", self.prefix_b) }
            );
        }
        if self.short_names {
            let _ = writeln!(
                out,
                "no full site name is in both recordings: series matched by their names under '{}' in A and '{}' in B",
                self.prefix_a, self.prefix_b
            );
        }
        let repassed = self.sites.iter().filter(|s| s.pass_a != s.pass_b).count();
        let _ = writeln!(
            out,
            "{} site/roles in both ({} with a histogram shift > 0{}), {} only in A, {} only in B",
            self.sites.len(),
            moved,
            if repassed > 0 { format!("; {repassed} matched across pass indices") } else { String::new() },
            self.only_a.len(),
            self.only_b.len()
        );
        let _ = writeln!(out, "ranked by {}: {}", self.score, self.score_doc);
        let _ = writeln!(
            out,
            "w1/sd: 1-Wasserstein distance of the histograms / pooled std; d: relative change of the median over runs; \
             ks: largest Kolmogorov-Smirnov D of a statistic's per-run values; chan: relative L2 change of mean per-channel max|x|; - = not available (see --json notes)\n"
        );
        let shown: Vec<&SiteDiff> = if top == 0 { self.sites.iter().collect() } else { self.sites.iter().take(top).collect() };
        let width = shown.iter().map(|s| s.site.len()).max().unwrap_or(4).max(4);
        let _ = writeln!(
            out,
            "{:>4}  {:<width$}  {:<5}  {:>9}  {:>9}  {:>10}  {:>10}  {:>8}  {:>8}  {:>8}  {:>18}  {:>9}",
            "rank", "site", "role", "js(bits)", "w1/sd", "rms A", "rms B", "d rms", "d absmax", "d kurt", "ks (stat)", "chan"
        );
        for s in &shown {
            let med = |n: &str, side: char| s.scalar(n).and_then(|x| if side == 'a' { x.median_a } else { x.median_b });
            let rel = |n: &str| s.scalar(n).and_then(|x| x.rel_change);
            let ks = match s.ks_max() {
                None => "-".into(),
                Some((d, _)) if d == 0.0 => "0".into(),
                Some((d, st)) => format!("{d:.2} ({st})"),
            };
            let _ = writeln!(
                out,
                "{:>4}  {:<width$}  {:<5}  {:>9}  {:>9}  {:>10}  {:>10}  {:>8}  {:>8}  {:>8}  {:>18}  {:>9}",
                s.rank.map_or("-".into(), |r| r.to_string()),
                s.site,
                s.role,
                num(s.score),
                num(s.hist.as_ref().and_then(|h| h.w1_norm)),
                num(med("rms", 'a')),
                num(med("rms", 'b')),
                pct(rel("rms")),
                pct(rel("absmax")),
                pct(rel("kurtosis")),
                ks,
                pct(s.channels.as_ref().and_then(|c| c.rel_l2)),
            );
        }
        if shown.len() < self.sites.len() {
            let _ = writeln!(out, "({} more site/roles; --top 0 prints all)", self.sites.len() - shown.len());
        }
        for s in shown.iter().take(detail) {
            let _ = writeln!(
                out,
                "\n{} {} ({}; A {} {} runs, B {} {} runs{})",
                s.site,
                s.role,
                s.op,
                s.shape_a,
                s.runs_a,
                s.shape_b,
                s.runs_b,
                if s.pass_a != s.pass_b { format!("; pass {} in A, {} in B", s.pass_a, s.pass_b) } else { String::new() }
            );
            let _ = writeln!(out, "  {:<13} {:>9}  {:>11}  {:>11}  {:>9}  {:>5}", "stat", "runs A/B", "median A", "median B", "change", "ks");
            for x in &s.scalars {
                let _ = writeln!(
                    out,
                    "  {:<13} {:>9}  {:>11}  {:>11}  {:>9}  {:>5}",
                    x.stat,
                    format!("{}/{}", x.runs_a, x.runs_b),
                    num(x.median_a),
                    num(x.median_b),
                    pct(x.rel_change),
                    x.ks.map_or("-".into(), |d| format!("{d:.2}"))
                );
            }
            if let Some(h) = &s.hist {
                let _ = writeln!(
                    out,
                    "  hist          {} bins on [{}, {}]{}: js {} bits, w1 {} = {} pooled sd",
                    h.bins,
                    num(Some(h.lo)),
                    num(Some(h.hi)),
                    if h.exact { "" } else { " (runs re-binned)" },
                    num(Some(h.js)),
                    num(Some(h.w1)),
                    num(h.w1_norm)
                );
            }
            if let Some(c) = &s.channels {
                let moves: Vec<String> = c.moved.iter().map(|m| format!("{} ({} -> {})", m.channel, m.rank_a, m.rank_b)).collect();
                let _ = writeln!(
                    out,
                    "  chan_maxabs   {} channels: rel L2 {}, Spearman {}; top-{} channels whose rank moved: {}",
                    c.channels,
                    num(c.rel_l2),
                    num(c.spearman),
                    TOP_CHANNELS,
                    if moves.is_empty() { "none".to_string() } else { moves.join(", ") }
                );
            }
            for n in &s.notes {
                let _ = writeln!(out, "  note: {n}");
            }
        }
        for (list, side) in [(&self.only_a, "A"), (&self.only_b, "B")] {
            if !list.is_empty() {
                let _ = writeln!(out, "\nonly in {side} ({}):", list.len());
                for k in list {
                    let p = if side == "A" { &self.prefix_a } else { &self.prefix_b };
                    let _ = writeln!(out, "  {}", k.strip_prefix(p.as_str()).unwrap_or(k));
                }
            }
        }
        out
    }
}
