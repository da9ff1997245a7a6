//! What the report shows of one series, summarised over every run of the recording (never the
//! last run alone). These are the numbers behind the site table and the plots; the report also
//! embeds them as JSON (`<script type="application/json" id="opscope-data">`) for tools and tests.

use std::collections::BTreeMap;

use serde::Serialize;

use opscope::mine::{histograms_by_run, median, outlier_channels, weighted_vector, Series, SeriesKey, StepStats, OUTLIER_CHANNEL_RATIO};
use opscope::sketch::{tensor, Stat};

/// Vector probe statistics the report draws, with their plot and caption: `(stat, caption,
/// x axis, kind)`. Per-head attention statistics are averaged over every non-padding query of
/// the recording (runs weighted by their `queries`, as the attention rules weight them); the
/// others are plain means over the runs that recorded them.
pub const PROBE_VECTORS: [(&str, &str, &str, ProbeKind); 8] = [
    ("peak", "peak probability (mean over queries of the largest probability)", "head", ProbeKind::Bars),
    ("entropy_norm", "normalized entropy (entropy / ln allowed keys)", "head", ProbeKind::Bars),
    ("topk_mass", "top-k mass (mass on the k most probable keys)", "head", ProbeKind::Bars),
    ("sink_first", "mass on the first key ([CLS]; the StreamingLLM sink position)", "head", ProbeKind::Bars),
    ("sink_last", "mass on the last non-padding key ([SEP])", "head", ProbeKind::Bars),
    ("recv_max", "largest mass one key receives (H2O heavy hitter)", "head", ProbeKind::Bars),
    ("load", "assignments per expert, mean per run", "expert", ProbeKind::Bars),
    ("cos_row", "cos(x, x + f(x)) per row, mean over runs", "row", ProbeKind::Rows),
];

/// How a probe vector is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    /// One bar per head / expert, zero baseline.
    Bars,
    /// A line over rows, with gaps where a row was never recorded.
    Rows,
}

/// The value histogram merged over runs, and each run's on its range.
pub type HistData = opscope::mine::RunHistograms;

/// A vector statistic as plotted: max-pooled to at most [`crate::report::MAX_POINTS`] points
/// ([`crate::report::pool`]: point `i` is the largest finite value of elements
/// `i*step .. (i+1)*step`, NaN (null in JSON) where none is finite). Values are f32, as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct Pooled {
    /// Elements before pooling (`C` channels, `R` rows).
    pub len: usize,
    /// Elements per point (1: not pooled).
    pub step: usize,
    /// The plotted values.
    pub values: Vec<f32>,
}

impl Pooled {
    fn new(v: &[f64]) -> Pooled {
        let (points, step) = crate::report::pool(v);
        Pooled { len: v.len(), step, values: points.iter().map(|p| p.1 as f32).collect() }
    }
}

/// Per-channel max|x| over runs, as plotted.
#[derive(Debug, Clone, Serialize)]
pub struct ChannelData {
    /// Per channel, the largest value over runs.
    pub max: Pooled,
    /// Per channel, the mean over the runs that recorded it.
    pub mean: Pooled,
    /// The outlier line: [`opscope::mine::OUTLIER_CHANNEL_RATIO`] x the median channel of `max`.
    pub outlier_line: Option<f64>,
}

/// One series summarised over every run.
#[derive(Debug, Clone, Serialize)]
pub struct SeriesData {
    /// HTML anchor of the series' section (`#s3-layer.0-query-matmul-lhs`).
    pub anchor: String,
    /// Site name (full).
    pub site: String,
    /// Role.
    pub role: String,
    /// Pass index.
    pub pass_idx: u32,
    /// Op at the site.
    pub op: String,
    /// Tensor shape of the first compile.
    pub shape: String,
    /// Runs (executions) the series was recorded in.
    pub runs: usize,
    /// Runs whose rows are not those of `shape` (`opscope::mine::row_layout`; a decoder's decode
    /// steps beside its prefill): left out of `pos_sumsq_mean`.
    pub runs_other_rows: usize,
    /// max |x| over all runs: max over runs of max(|min|, |max|).
    pub absmax: Option<f64>,
    /// sqrt(sum over runs of sumsq / sum over runs of count): the rms of every finite element
    /// recorded (runs that left `sumsq` out are left out).
    pub rms: Option<f64>,
    /// Median over runs of the per-run kurtosis (as the miner summarises it; the pooled kurtosis
    /// needs third moments, which sketches do not record).
    pub kurtosis: Option<f64>,
    /// Outlier channels of the per-channel max|x| over all runs ([`outlier_channels`]: above
    /// [`opscope::mine::OUTLIER_CHANNEL_RATIO`] x the median channel).
    pub outlier_channels: Option<Vec<usize>>,
    /// Channels (`C`).
    pub channels: Option<usize>,
    /// NaN + Inf elements over all runs, if any of the three counts was recorded.
    pub nonfinite: Option<f64>,
    /// The value histogram merged over runs.
    pub hist: Option<HistData>,
    /// Per-channel max|x| over runs.
    pub chan_maxabs: Option<ChannelData>,
    /// Per-row energy (sum x² per row, `R` values): mean over the runs whose rows are those of
    /// `shape` (`opscope::mine::row_layout`: up to the batch) that recorded the row, NaN (null in
    /// JSON) where no run did (padding rows); as plotted. Other runs (a decoder's decode steps)
    /// are left out.
    pub pos_sumsq_mean: Option<Pooled>,
    /// Probe vectors ([`PROBE_VECTORS`]) averaged over the recording, by statistic name.
    pub probes: BTreeMap<String, Vec<f64>>,
    /// True for a tensor series (it records `count`) with several runs that each recorded the same
    /// absmax, rms, histogram and per-channel max|x| (a weight, recorded once per compile): the
    /// per-run views are left out.
    pub runs_identical: bool,
    /// Per run: max |x| (null where not recorded).
    pub run_absmax: Vec<f64>,
    /// Per run: rms (null where not recorded).
    pub run_rms: Vec<f64>,
}

fn run_absmax(r: &StepStats) -> Option<f64> {
    Some(r.scalar(tensor::MIN)?.abs().max(r.scalar(tensor::MAX)?.abs()))
}

fn run_rms(r: &StepStats) -> Option<f64> {
    let c = r.scalar(tensor::COUNT)?;
    (c > 0.0).then_some((r.scalar(tensor::SUMSQ)? / c).sqrt())
}

/// Rows of a shape `[d0,...,dn]`: the product of every dimension but the last (0 if the shape
/// does not parse).
fn rows_of(shape: &str) -> usize {
    let dims: Option<Vec<usize>> = shape.trim_matches(|c| c == '[' || c == ']').split(',').map(|d| d.trim().parse().ok()).collect();
    match dims {
        Some(d) if d.len() >= 2 => d[..d.len() - 1].iter().product(),
        _ => 0,
    }
}

/// Lower-case letters, digits, '.', '-' and '_' of `s`; anything else becomes '-'.
fn slug(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c.to_ascii_lowercase() } else { '-' }).collect()
}

/// Summarise `s` over all its runs. `rank` is its place in execution order, `short` its name
/// without the common prefix (both only name the anchor).
pub fn summarize(key: &SeriesKey, s: &Series, rank: usize, short: &str) -> SeriesData {
    let (site, role, pass_idx) = key;
    let vectors_of = |stat: Stat| s.runs.iter().filter_map(move |r| r.vector(stat));
    let absmax = s.runs.iter().filter_map(run_absmax).reduce(f64::max);
    let (sumsq, count) = s
        .runs
        .iter()
        .filter_map(|r| Some((r.scalar(tensor::SUMSQ)?, r.scalar(tensor::COUNT)?)))
        .fold((0.0, 0.0), |a, (q, c)| (a.0 + q, a.1 + c));
    // Per channel over runs: the largest value and the mean; outliers from the largest.
    let chan_max: Option<Vec<f64>> = s.chan_maxabs_max();
    let outliers = chan_max.as_ref().map(|m| outlier_channels(&m.iter().map(|&x| x as f32).collect::<Vec<f32>>()));
    let chan_maxabs = chan_max.as_ref().map(|m| {
        let mut finite: Vec<f64> = m.iter().copied().filter(|x| x.is_finite()).collect();
        finite.sort_by(|a, b| a.total_cmp(b));
        ChannelData {
            max: Pooled::new(m),
            mean: Pooled::new(&s.chan_maxabs_mean().unwrap_or_default()),
            outlier_line: finite.get(finite.len() / 2).map(|m| m * OUTLIER_CHANNEL_RATIO),
        }
    });
    let nonfinite = s
        .runs
        .iter()
        .flat_map(|r| [tensor::NAN_COUNT, tensor::POSINF_COUNT, tensor::NEGINF_COUNT].map(|k| r.scalar(k)))
        .flatten()
        .reduce(|a, b| a + b);
    let hist = histograms_by_run(s, None);
    let queries = Stat::parse("queries");
    let mut probes = BTreeMap::new();
    for (name, ..) in PROBE_VECTORS {
        let Some(stat) = Stat::parse(name) else { continue };
        if vectors_of(stat).next().is_none() {
            continue;
        }
        let weighted = queries.is_some_and(|q| s.runs.iter().any(|r| r.has(q)));
        let v = weighted_vector(s, stat, |r| if weighted { queries.and_then(|q| r.scalar(q)).unwrap_or(0.0) } else { 1.0 });
        probes.insert(name.to_string(), v);
    }
    let run_absmax: Vec<f64> = s.runs.iter().map(|r| run_absmax(r).unwrap_or(f64::NAN)).collect();
    let run_rms: Vec<f64> = s.runs.iter().map(|r| run_rms(r).unwrap_or(f64::NAN)).collect();
    let same = |v: &[f64]| v.windows(2).all(|w| w[0] == w[1] || (w[0].is_nan() && w[1].is_nan()));
    // Non-finite counts too: runs of all NaN and of all Inf have no absmax, rms or histogram.
    let run_nonfinite: Vec<[f64; 3]> = s
        .runs
        .iter()
        .map(|r| [tensor::NAN_COUNT, tensor::POSINF_COUNT, tensor::NEGINF_COUNT].map(|st| r.scalar(st).unwrap_or(0.0)))
        .collect();
    let runs_identical = s.runs.len() >= 2
        && s.runs.iter().any(|r| r.has(tensor::COUNT))
        && run_nonfinite.windows(2).all(|w| w[0] == w[1])
        && same(&run_absmax)
        && same(&run_rms)
        && hist.as_ref().is_none_or(|h| h.runs.windows(2).all(|w| w[0].1 == w[1].1))
        // The channel maxima by their bits (a full load) or by the hash of their bits (a
        // compact one): NaN equals NaN and -0 differs from +0 either way.
        && s.runs.windows(2).all(|w| {
            let bits = |r: &StepStats| r.vector(tensor::CHAN_MAXABS).map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
            bits(&w[0]) == bits(&w[1]) && w[0].chan_summary().map(|c| c.hash) == w[1].chan_summary().map(|c| c.hash)
        });
    SeriesData {
        anchor: format!("s{rank}-{}-{}", slug(short), slug(role)),
        site: site.clone(),
        role: role.clone(),
        pass_idx: *pass_idx,
        op: s.op.clone(),
        shape: s.shape.clone(),
        runs: s.runs.len(),
        runs_other_rows: s.runs_of_other_rows(),
        absmax,
        rms: (count > 0.0).then(|| (sumsq / count).sqrt()),
        kurtosis: median(s.runs.iter().filter_map(|r| r.scalar(tensor::KURTOSIS)).collect()),
        channels: chan_max.as_ref().map(|c| c.len()),
        outlier_channels: outliers,
        nonfinite,
        hist,
        chan_maxabs,
        pos_sumsq_mean: s.mean_row_energy().map(|mut v| {
            // Trailing rows that no run recorded (padding at the end) are gaps too: the vector
            // spans the rows of the shape.
            v.resize(v.len().max(rows_of(&s.shape)), f64::NAN);
            Pooled::new(&v)
        }),
        probes,
        runs_identical,
        run_absmax,
        run_rms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `runs_identical` is the same after a full and a compact load: the channel maxima compare
    /// by bits either way (a gap, NaN, equals itself; -0 differs from +0), found by a review on
    /// a hand-made recording with a gap in `chan_maxabs`.
    #[test]
    fn identical_runs_are_the_same_on_both_loads() {
        let dir = tempfile::tempdir().unwrap();
        let row = |step: u64, stat: &str, idx: u64, value: f32| opscope::Row {
            run_id: "r".into(),
            compile: 1,
            step,
            graph: "g".into(),
            pass: "matmul".into(),
            pass_idx: 0,
            site: "s".into(),
            op: "matmul".into(),
            role: "out".into(),
            stat: stat.into(),
            idx,
            value,
            numel: Some(6),
            shape: "[2,3]".into(),
            flops: None,
        };
        // (channel 0, channel 2) of chan_maxabs in each run; channel 1 is never recorded.
        for (name, runs, want) in [
            ("gap", [(1.0f32, 3.0f32), (1.0, 3.0)], true),
            ("-0 and +0", [(-0.0, 3.0), (0.0, 3.0)], false),
        ] {
            let path = dir.path().join(format!("{}.csv", name.replace(' ', "_")));
            let mut sink = opscope::recording::open(&path).unwrap();
            for (step, (c0, c2)) in runs.iter().enumerate() {
                let step = step as u64;
                let rows = [
                    row(step, "count", 0, 6.0),
                    row(step, "min", 0, -3.0),
                    row(step, "max", 0, 3.0),
                    row(step, "sumsq", 0, 20.0),
                    row(step, "chan_maxabs", 0, *c0),
                    row(step, "chan_maxabs", 2, *c2),
                ];
                sink.write(&rows).unwrap();
            }
            sink.finish().unwrap();
            let key: SeriesKey = ("s".into(), "out".into(), 0);
            let full = opscope::mine::load(&path).unwrap();
            let compact = opscope::mine::load_compact(&path).unwrap();
            let a = summarize(&key, &full[&key], 0, "s").runs_identical;
            let b = summarize(&key, &compact[&key], 0, "s").runs_identical;
            assert_eq!((a, b), (want, want), "{name}: full {a}, compact {b}");
        }
        // Runs of nothing but NaN and of nothing but +Inf record no absmax, rms or histogram:
        // their non-finite counts tell them apart (a helper saw them reported identical).
        for (name, counts, want) in [("NaN then Inf", [("nan_count", 6.0), ("posinf_count", 6.0)], false), ("NaN twice", [("nan_count", 6.0), ("nan_count", 6.0)], true)] {
            let path = dir.path().join(format!("{}.csv", name.replace(' ', "_")));
            let mut sink = opscope::recording::open(&path).unwrap();
            for (step, (stat, n)) in counts.iter().enumerate() {
                sink.write(&[row(step as u64, "count", 0, 0.0), row(step as u64, stat, 0, *n)]).unwrap();
            }
            sink.finish().unwrap();
            let key: SeriesKey = ("s".into(), "out".into(), 0);
            let full = opscope::mine::load(&path).unwrap();
            assert_eq!(summarize(&key, &full[&key], 0, "s").runs_identical, want, "{name}");
        }
    }
}
