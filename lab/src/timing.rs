//! Measured time with error bars: two programs timed INTERLEAVED, their ratio with a bootstrap
//! confidence interval (what `opscope ab` prints and the benches can use).
//!
//! The method, criterion-style (criterion.rs, `analysis/mod.rs` and `stats/`):
//! 1. **Warm-up**: A and B run alternately for [`AbOptions::warmup`] (at least
//!    [`MIN_WARMUP_PAIRS`] pairs), so lazy initialisation, page faults and caches settle; the
//!    median warm-up pair time estimates the cost of one pair.
//! 2. **Sample count from a time budget**: `pairs = budget / pair time`, clamped to
//!    `[min_pairs, max_pairs]`.
//! 3. **Interleaving**: pair `i` runs A then B when `i` is even and B then A when odd (ABBA
//!    order), so drift of the machine (frequency, other load) and any first-of-pair effect hit
//!    both programs alike; the pair is the unit of resampling.
//! 4. **Outliers**: Tukey's fences as criterion classifies them (`stats::univariate::outliers::
//!    tukey`): with quartiles Q1, Q3 (linear interpolation, numpy's default) and IQR = Q3 - Q1, a
//!    time beyond Q1 - 3 IQR or Q3 + 3 IQR is a *severe* outlier, beyond 1.5 IQR a *mild* one.
//!    Criterion only reports them; here a pair is DROPPED when either of its two times is a severe
//!    outlier of its own program's times (a preemption or a page-cache miss, not the program), and
//!    mild outliers are counted and kept.
//! 5. **Estimate**: the ratio of medians `median(A) / median(B)` over the kept pairs (medians,
//!    as a time distribution is skewed to the right).
//! 6. **Interval**: the percentile bootstrap (Efron & Tibshirani 1993, ch. 13) over PAIRED samples:
//!    [`AbOptions::resamples`] times, draw `n` pair indices with replacement, take the ratio of the
//!    two medians of the drawn pairs; the interval is the `(1-c)/2` and `(1+c)/2` quantiles of those
//!    ratios for confidence `c` (criterion's default: 95%, 100 000 resamples). The generator is
//!    ChaCha8 seeded with [`AbOptions::seed`], so the same samples give the same interval.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::model::{Encoded, OnnxEncoder};

/// Fewest warm-up pairs, whatever [`AbOptions::warmup`] is: the first run of a compiled RLX
/// program pays its lazy set-up, the second is the first representative one.
pub const MIN_WARMUP_PAIRS: usize = 2;

/// Fewest pairs a comparison accepts (after dropping outliers): below this the bootstrap
/// distribution of a median takes only a handful of values and its quantiles mean little.
pub const MIN_PAIRS: usize = 10;

/// Tukey's inner fence factor (mild outliers; Tukey 1977, as criterion uses).
pub const TUKEY_MILD: f64 = 1.5;
/// Tukey's outer fence factor (severe outliers; Tukey 1977, as criterion uses).
pub const TUKEY_SEVERE: f64 = 3.0;

/// How to time a comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AbOptions {
    /// Time spent alternating A and B before measuring.
    pub warmup: Duration,
    /// Time the measured pairs should take together; sets the sample count.
    pub budget: Duration,
    /// Fewest measured pairs, however long a pair takes (>= [`MIN_PAIRS`]).
    pub min_pairs: usize,
    /// Most measured pairs, however short a pair is.
    pub max_pairs: usize,
    /// Bootstrap resamples `B` (>= 100).
    pub resamples: usize,
    /// Confidence level of the interval, in (0, 1).
    pub confidence: f64,
    /// Seed of the bootstrap's ChaCha8 generator.
    pub seed: u64,
}

impl Default for AbOptions {
    /// 1 s warm-up, 5 s budget, 10..=10 000 pairs, 10 000 resamples, 95% confidence, seed 0.
    fn default() -> AbOptions {
        AbOptions {
            warmup: Duration::from_secs(1),
            budget: Duration::from_secs(5),
            min_pairs: MIN_PAIRS,
            max_pairs: 10_000,
            resamples: 10_000,
            confidence: 0.95,
            seed: 0,
        }
    }
}

impl AbOptions {
    /// Errors: a count or level out of range, named with its bounds.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.min_pairs >= MIN_PAIRS, "min_pairs {} is below {MIN_PAIRS}: a median of fewer pairs has no usable bootstrap", self.min_pairs);
        ensure!(self.max_pairs >= self.min_pairs, "max_pairs {} is below min_pairs {}", self.max_pairs, self.min_pairs);
        ensure!(self.resamples >= 100, "resamples {} is below 100: the interval's end points would be single resamples", self.resamples);
        ensure!(
            self.confidence > 0.0 && self.confidence < 1.0,
            "confidence {} is not in (0, 1) (e.g. 0.95 for a 95% interval)",
            self.confidence
        );
        Ok(())
    }
}

/// Outliers of one program's times by Tukey's fences (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Outliers {
    /// Below Q1 - 3 IQR.
    pub low_severe: usize,
    /// Between Q1 - 3 IQR and Q1 - 1.5 IQR.
    pub low_mild: usize,
    /// Between Q3 + 1.5 IQR and Q3 + 3 IQR.
    pub high_mild: usize,
    /// Above Q3 + 3 IQR.
    pub high_severe: usize,
}

/// What one A/B comparison measured. Times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AbReport {
    /// Pairs measured (after warm-up).
    pub pairs: usize,
    /// Pairs kept (neither time a severe outlier).
    pub kept: usize,
    /// Warm-up pairs run.
    pub warmup_pairs: usize,
    /// Median time of A over the kept pairs, s.
    pub median_a: f64,
    /// Median time of B over the kept pairs, s.
    pub median_b: f64,
    /// `median_a / median_b`.
    pub ratio: f64,
    /// Lower end of the bootstrap interval of `ratio`.
    pub ci_low: f64,
    /// Upper end of the bootstrap interval of `ratio`.
    pub ci_high: f64,
    /// Confidence level of the interval.
    pub confidence: f64,
    /// Bootstrap resamples.
    pub resamples: usize,
    /// Seed of the bootstrap generator.
    pub seed: u64,
    /// A's outliers (all measured pairs).
    pub outliers_a: Outliers,
    /// B's outliers (all measured pairs).
    pub outliers_b: Outliers,
    /// The method, in words (for JSON readers).
    pub method: &'static str,
    /// Every measured time of A, s, pair by pair in run order (warm-up excluded, outliers
    /// included): what the medians, fences and bootstrap above are computed from.
    pub times_a: Vec<f64>,
    /// Every measured time of B, s, paired with `times_a`.
    pub times_b: Vec<f64>,
}

/// [`AbReport::method`].
pub const METHOD: &str = "interleaved ABBA pairs after warm-up; pairs with a time beyond Tukey's outer fences \
(Q1 - 3 IQR, Q3 + 3 IQR, criterion's severe outliers) dropped; ratio of medians A/B; percentile bootstrap over \
paired samples, ChaCha8 seeded";

impl AbReport {
    /// True if the interval excludes 1 (A and B differ at this confidence).
    pub fn differs(&self) -> bool {
        self.ci_low > 1.0 || self.ci_high < 1.0
    }

    /// One line: `A/B = 1.234x [1.200, 1.270] (95%, 812 of 820 pairs)`, the medians in ms.
    pub fn line(&self) -> String {
        format!(
            "A/B = {:.4}x [{:.4}, {:.4}] ({:.0}% percentile bootstrap, {} resamples; {} of {} pairs kept); median A {:.4} ms, B {:.4} ms",
            self.ratio,
            self.ci_low,
            self.ci_high,
            self.confidence * 100.0,
            self.resamples,
            self.kept,
            self.pairs,
            self.median_a * 1e3,
            self.median_b * 1e3
        )
    }
}

/// The `q`-quantile of ascending `sorted` by linear interpolation between closest ranks
/// (numpy's default `linear` method; criterion's `percentiles().at`). `q` in [0, 1]. `NaN` if empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let h = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// The median of `x` (mean of the two middle values for an even count), using `scratch`.
fn median_in(x: impl Iterator<Item = f64>, scratch: &mut Vec<f64>) -> f64 {
    scratch.clear();
    scratch.extend(x);
    let n = scratch.len();
    let (_, &mut hi, _) = scratch.select_nth_unstable_by(n / 2, f64::total_cmp);
    if n % 2 == 1 {
        return hi;
    }
    let lo = scratch[..n / 2].iter().copied().fold(f64::NEG_INFINITY, f64::max);
    0.5 * (lo + hi)
}

/// The median of `x` (`NaN` if empty).
pub fn median(x: &[f64]) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    median_in(x.iter().copied(), &mut Vec::with_capacity(x.len()))
}

/// Tukey's fences of `x` at factor `k`: `(Q1 - k IQR, Q3 + k IQR)`, quartiles by [`quantile`].
pub fn tukey_fences(x: &[f64], k: f64) -> (f64, f64) {
    let mut s = x.to_vec();
    s.sort_by(f64::total_cmp);
    let (q1, q3) = (quantile(&s, 0.25), quantile(&s, 0.75));
    let iqr = q3 - q1;
    (q1 - k * iqr, q3 + k * iqr)
}

/// Classify `x` by Tukey's fences; also returns, per value, whether it is a severe outlier.
pub fn outliers(x: &[f64]) -> (Outliers, Vec<bool>) {
    let (mild_lo, mild_hi) = tukey_fences(x, TUKEY_MILD);
    let (sev_lo, sev_hi) = tukey_fences(x, TUKEY_SEVERE);
    let mut o = Outliers::default();
    let severe = x
        .iter()
        .map(|&v| {
            if v < sev_lo {
                o.low_severe += 1;
                true
            } else if v > sev_hi {
                o.high_severe += 1;
                true
            } else {
                if v < mild_lo {
                    o.low_mild += 1;
                } else if v > mild_hi {
                    o.high_mild += 1;
                }
                false
            }
        })
        .collect();
    (o, severe)
}

/// Percentile-bootstrap interval of `median(a) / median(b)` over PAIRED samples (`a[i]`, `b[i]`
/// drawn together): `resamples` draws of `n` pair indices with replacement from ChaCha8 seeded
/// with `seed`; returns the `(1-confidence)/2` and `(1+confidence)/2` quantiles of the resampled
/// ratios.
///
/// Errors: `a` and `b` differ in length or hold fewer than 2 values, a value is not finite and
/// positive, or `confidence` is not in (0, 1).
pub fn bootstrap_ratio_of_medians(a: &[f64], b: &[f64], resamples: usize, confidence: f64, seed: u64) -> Result<(f64, f64)> {
    ensure!(a.len() == b.len(), "paired samples differ in length: {} times of A, {} of B", a.len(), b.len());
    ensure!(a.len() >= 2, "{} pair(s): the bootstrap needs at least 2", a.len());
    ensure!(confidence > 0.0 && confidence < 1.0, "confidence {confidence} is not in (0, 1)");
    ensure!(resamples >= 1, "no resamples");
    if let Some(v) = a.iter().chain(b).find(|v| !(v.is_finite() && **v > 0.0)) {
        bail!("a time of {v} s: times must be finite and positive");
    }
    let n = a.len();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut idx, mut sa, mut sb) = (vec![0usize; n], Vec::with_capacity(n), Vec::with_capacity(n));
    let mut ratios: Vec<f64> = (0..resamples)
        .map(|_| {
            for i in idx.iter_mut() {
                *i = rng.gen_range(0..n);
            }
            median_in(idx.iter().map(|&i| a[i]), &mut sa) / median_in(idx.iter().map(|&i| b[i]), &mut sb)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    let alpha = 1.0 - confidence;
    Ok((quantile(&ratios, alpha / 2.0), quantile(&ratios, 1.0 - alpha / 2.0)))
}

/// Pairs left after dropping those where either time is a severe outlier (as [`analyze`] does).
fn kept_pairs(a: &[f64], b: &[f64]) -> usize {
    let (_, sev_a) = outliers(a);
    let (_, sev_b) = outliers(b);
    (0..a.len()).filter(|&i| !sev_a[i] && !sev_b[i]).count()
}

/// Analyse measured pairs (`a[i]`, `b[i]` in seconds): drop severe outliers, ratio of medians,
/// bootstrap interval (see the module doc). `warmup_pairs` is only reported.
///
/// Errors: as [`bootstrap_ratio_of_medians`]; invalid options; fewer than [`MIN_PAIRS`] pairs left.
pub fn analyze(a: &[f64], b: &[f64], opts: &AbOptions, warmup_pairs: usize) -> Result<AbReport> {
    opts.validate()?;
    ensure!(a.len() == b.len(), "paired samples differ in length: {} times of A, {} of B", a.len(), b.len());
    let (outliers_a, sev_a) = outliers(a);
    let (outliers_b, sev_b) = outliers(b);
    let (ka, kb): (Vec<f64>, Vec<f64>) =
        (0..a.len()).filter(|&i| !sev_a[i] && !sev_b[i]).map(|i| (a[i], b[i])).unzip();
    ensure!(
        ka.len() >= MIN_PAIRS,
        "only {} of {} pairs are left after dropping severe outliers; at least {MIN_PAIRS} are needed: raise the time budget",
        ka.len(),
        a.len()
    );
    let (ci_low, ci_high) = bootstrap_ratio_of_medians(&ka, &kb, opts.resamples, opts.confidence, opts.seed)?;
    let (median_a, median_b) = (median(&ka), median(&kb));
    Ok(AbReport {
        pairs: a.len(),
        kept: ka.len(),
        warmup_pairs,
        median_a,
        median_b,
        ratio: median_a / median_b,
        ci_low,
        ci_high,
        confidence: opts.confidence,
        resamples: opts.resamples,
        seed: opts.seed,
        outliers_a,
        outliers_b,
        method: METHOD,
        times_a: a.to_vec(),
        times_b: b.to_vec(),
    })
}

/// Time two self-timing programs interleaved and compare them: each call runs its program once
/// and returns the time that run took (for programs timed inside a worker thread, so that the
/// hand-off is not counted). See the module doc for the method.
///
/// Errors: the first error of a program; invalid options; too few pairs (see [`analyze`]).
pub fn ab_timed(
    mut a: impl FnMut() -> Result<Duration>,
    mut b: impl FnMut() -> Result<Duration>,
    opts: &AbOptions,
) -> Result<AbReport> {
    opts.validate()?;
    let start = Instant::now();
    let mut warm = Vec::new();
    while warm.len() < MIN_WARMUP_PAIRS || start.elapsed() < opts.warmup {
        let (ta, tb) = if warm.len() % 2 == 0 { (a()?, b()?) } else { let tb = b()?; (a()?, tb) };
        warm.push((ta + tb).as_secs_f64());
    }
    let pair = median(&warm).max(1e-9);
    let pairs = ((opts.budget.as_secs_f64() / pair) as usize).clamp(opts.min_pairs, opts.max_pairs);
    let (mut ta, mut tb) = (Vec::with_capacity(pairs), Vec::with_capacity(pairs));
    let mut i = 0;
    // The budget's pairs, then more (up to `max_pairs`) while fewer than MIN_PAIRS survive the
    // severe-outlier cut: a busy machine's spikes must cost time, not the measurement.
    while i < pairs || (i < opts.max_pairs && kept_pairs(&ta, &tb) < MIN_PAIRS) {
        let (x, y) = if i % 2 == 0 { (a()?, b()?) } else { let y = b()?; (a()?, y) };
        ta.push(x.as_secs_f64());
        tb.push(y.as_secs_f64());
        i += 1;
    }
    analyze(&ta, &tb, opts, warm.len())
}

/// [`ab_timed`] for programs timed here: each call of `a` or `b` is one run, timed with
/// [`Instant`] around the call.
///
/// Errors: as [`ab_timed`].
pub fn ab(mut a: impl FnMut() -> Result<()>, mut b: impl FnMut() -> Result<()>, opts: &AbOptions) -> Result<AbReport> {
    let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<Duration> {
        let t = Instant::now();
        f()?;
        Ok(t.elapsed())
    };
    ab_timed(|| timed(&mut a), || timed(&mut b), opts)
}

/// A sink that keeps nothing: [`ab_pipelines`] times the taps (sketch kernels, read-back and the
/// recorder's decoding into blocks) without the cost of a file, which depends on the disk and
/// not on the program.
struct Discard;

impl opscope::Sink for Discard {
    fn manifest(&mut self, _: &std::sync::Arc<opscope::Manifest>) -> Result<(), opscope::Error> {
        Ok(())
    }
    fn write(&mut self, rows: &[opscope::Row]) -> Result<(), opscope::Error> {
        std::hint::black_box(rows);
        Ok(())
    }
    /// Blocks are dropped as they come (the default would build a `Row` per value, which no
    /// real sink of the recorder's path does).
    fn write_block(&mut self, block: &opscope::recording::Block<'_>) -> Result<(), opscope::Error> {
        std::hint::black_box(block);
        Ok(())
    }
    fn finish(&mut self) -> Result<(), opscope::Error> {
        Ok(())
    }
}

/// One program of [`ab_pipelines`]: the model compiled inside a recording scope of `pipeline`
/// (`None`: untapped, no scope), on its own worker thread (scopes are per thread, and RLX reports a
/// run's tap outputs to the scope current at run time). Each message `i` runs batch `i` once and
/// answers the time of that run alone, measured on the worker (the hand-off is not counted).
fn worker(
    model: &OnnxEncoder,
    batches: &[Encoded],
    pipeline: Option<&opscope::Pipeline>,
    stage: opscope::activate::Stage,
    go: std::sync::mpsc::Receiver<usize>,
    done: std::sync::mpsc::SyncSender<Result<Duration>>,
) -> Result<()> {
    let serve = || {
        let session = rlx_runtime::Session::new(rlx_runtime::Device::Cpu);
        let mut compiled = match model.compile(&session) {
            Ok(c) => c,
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        };
        while let Ok(i) = go.recv() {
            let t = Instant::now();
            let r = model.run(&mut compiled, &batches[i % batches.len()]).map(|outs| {
                let e = t.elapsed();
                std::hint::black_box(outs);
                e
            });
            if done.send(r).is_err() {
                break;
            }
        }
    };
    match pipeline {
        None => serve(),
        Some(p) => {
            let (_, recorded) = opscope::Scope::new(p, Box::new(Discard)).stage(stage).run(serve);
            recorded.map_err(|e| anyhow::anyhow!("recording '{p}': {e}"))?;
        }
    }
    Ok(())
}

/// Time the same model under two pipelines (`None`: untapped), interleaved (see the module doc):
/// sample `i` of A and of B both run batch `i mod batches.len()`, so a pair shares its input. A
/// tapped program's rows go to a sink that discards them: the time is that of the deployed program
/// with its sketch kernels and row building, not of writing a file.
///
/// Errors: no batches; a run fails; the recording of a tapped program fails; as [`ab_timed`].
pub fn ab_pipelines(
    model: &OnnxEncoder,
    batches: &[Encoded],
    a: Option<&opscope::Pipeline>,
    b: Option<&opscope::Pipeline>,
    stage: opscope::activate::Stage,
    opts: &AbOptions,
) -> Result<AbReport> {
    ensure!(!batches.is_empty(), "no batch to run: give the comparison at least one batch of input");
    opts.validate()?;
    std::thread::scope(|s| {
        let (go_a, rx_a) = std::sync::mpsc::sync_channel::<usize>(0);
        let (go_b, rx_b) = std::sync::mpsc::sync_channel::<usize>(0);
        let (tx_ta, done_a) = std::sync::mpsc::sync_channel(0);
        let (tx_tb, done_b) = std::sync::mpsc::sync_channel(0);
        let wa = s.spawn(move || worker(model, batches, a, stage, rx_a, tx_ta));
        let wb = s.spawn(move || worker(model, batches, b, stage, rx_b, tx_tb));
        let call = |go: &std::sync::mpsc::SyncSender<usize>, done: &std::sync::mpsc::Receiver<Result<Duration>>, i: &mut usize, side: &str| -> Result<Duration> {
            let lost = || anyhow::anyhow!("program {side} stopped (its worker ended)");
            go.send(*i).map_err(|_| lost())?;
            *i += 1;
            done.recv().map_err(|_| lost())?
        };
        let (mut ia, mut ib) = (0usize, 0usize);
        let report = ab_timed(|| call(&go_a, &done_a, &mut ia, "A"), || call(&go_b, &done_b, &mut ib, "B"), opts);
        drop((go_a, go_b, done_a, done_b));
        let join = |w: std::thread::ScopedJoinHandle<'_, Result<()>>, side: &str| -> Result<()> {
            w.join().map_err(|_| anyhow::anyhow!("program {side} panicked"))?.map_err(|e| e.context(format!("program {side}")))
        };
        let (ja, jb) = (join(wa, "A"), join(wb, "B"));
        // A worker's own error explains a lost hand-off better than the hand-off does.
        ja?;
        jb?;
        report
    })
}

/// Times of several programs measured in one sitting by [`many_timed`]: `times[p][r]` is
/// program `p`'s time in round `r`, in seconds. Program 0 is the baseline the others are compared with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ManyTimes {
    /// Per program, one time per measured round, s.
    pub times: Vec<Vec<f64>>,
    /// Warm-up rounds run (each runs every program once).
    pub warmup_rounds: usize,
}

impl ManyTimes {
    /// Program `p` (>= 1) against the baseline (program 0), paired by round, as [`analyze`]
    /// compares A = `p` with B = baseline.
    ///
    /// Errors: `p` is 0 or out of range; as [`analyze`].
    pub fn against_baseline(&self, p: usize, opts: &AbOptions) -> Result<AbReport> {
        ensure!(p >= 1 && p < self.times.len(), "program {p} is not one of the 1..{} compared with the baseline", self.times.len());
        analyze(&self.times[p], &self.times[0], opts, self.warmup_rounds)
    }

    /// Program `p`'s extra time over the baseline: the median over rounds of the PAIRED
    /// difference `t_p[r] - t_0[r]`, in microseconds (negative when `p` ran faster). The median of
    /// paired differences is the location estimate of the sign test (Lehmann, *Nonparametrics*,
    /// 1975, ch. 3); pairing by round cancels drift common to a round.
    ///
    /// Errors: `p` is 0 or out of range, or no round was measured.
    pub fn median_extra_us(&self, p: usize) -> Result<f64> {
        ensure!(p >= 1 && p < self.times.len(), "program {p} is not one of the 1..{} compared with the baseline", self.times.len());
        ensure!(!self.times[0].is_empty(), "no round was measured");
        let d: Vec<f64> = self.times[p].iter().zip(&self.times[0]).map(|(a, b)| (a - b) * 1e6).collect();
        Ok(median(&d))
    }
}

/// Time several self-timing programs in ONE sitting, interleaved: each round runs every program
/// once, in index order on even rounds and in reverse order on odd rounds (ABBA generalised to n
/// programs, so every program's mean position in a round is the same and drift and
/// first-of-round effects hit all alike). Warm-up rounds run for [`AbOptions::warmup`] (at least
/// [`MIN_WARMUP_PAIRS`]); the median warm-up round time sets the round count from
/// [`AbOptions::budget`], clamped to `[min_pairs, max_pairs]`, and rounds continue (up to
/// `max_pairs`) while some program keeps fewer than [`MIN_PAIRS`] pairs with program 0 after
/// the severe-outlier cut. With two programs this is exactly [`ab_timed`]'s schedule.
///
/// Errors: fewer than 2 programs; invalid options; the first error of a program.
pub fn many_timed(progs: &mut [&mut dyn FnMut() -> Result<Duration>], opts: &AbOptions) -> Result<ManyTimes> {
    opts.validate()?;
    let n = progs.len();
    ensure!(n >= 2, "{n} program(s): a comparison needs a baseline and at least one other");
    let mut round = |r: usize, out: &mut Vec<f64>| -> Result<()> {
        out.clear();
        out.resize(n, 0.0);
        for k in 0..n {
            let p = if r % 2 == 0 { k } else { n - 1 - k };
            out[p] = progs[p]()?.as_secs_f64();
        }
        Ok(())
    };
    let start = Instant::now();
    let mut warm = Vec::new();
    let mut row = Vec::with_capacity(n);
    while warm.len() < MIN_WARMUP_PAIRS || start.elapsed() < opts.warmup {
        round(warm.len(), &mut row)?;
        warm.push(row.iter().sum::<f64>());
    }
    let per_round = median(&warm).max(1e-9);
    let rounds = ((opts.budget.as_secs_f64() / per_round) as usize).clamp(opts.min_pairs, opts.max_pairs);
    let mut times = vec![Vec::with_capacity(rounds); n];
    let mut r = 0;
    let short = |times: &Vec<Vec<f64>>| (1..n).any(|p| kept_pairs(&times[p], &times[0]) < MIN_PAIRS);
    while r < rounds || (r < opts.max_pairs && short(&times)) {
        round(r, &mut row)?;
        for (t, &x) in times.iter_mut().zip(&row) {
            t.push(x);
        }
        r += 1;
    }
    Ok(ManyTimes { times, warmup_rounds: warm.len() })
}

/// The model under several pipelines (`None`: untapped) in ONE sitting: one worker thread and
/// one compile per program (as [`ab_pipelines`]), scheduled by [`many_timed`]; round `r` runs
/// batch `r mod batches.len()` on every program. `programs[0]` is the baseline.
///
/// Errors: no batches; fewer than 2 programs; a run or a recording fails (the program named by
/// its index); as [`many_timed`].
pub fn many_pipelines(
    model: &OnnxEncoder,
    batches: &[Encoded],
    programs: &[Option<&opscope::Pipeline>],
    stage: opscope::activate::Stage,
    opts: &AbOptions,
) -> Result<ManyTimes> {
    ensure!(!batches.is_empty(), "no batch to run: give the comparison at least one batch of input");
    ensure!(programs.len() >= 2, "{} program(s): a comparison needs a baseline and at least one other", programs.len());
    opts.validate()?;
    // A dry run of every rewrite first: a pass error (a missing calibration table, a block that
    // does not exist) would otherwise surface only when its scope closes, after the timing.
    let options = rlx_runtime::CompileOptions::default();
    for (k, p) in programs.iter().enumerate() {
        if let Some(p) = p {
            opscope::activate::rewrite(p, &model.graph, stage, &options, 0).map_err(|e| anyhow::anyhow!("program {k}: '{p}': {e}"))?;
        }
    }
    std::thread::scope(|s| {
        let mut gos = Vec::new();
        let mut dones = Vec::new();
        let mut workers = Vec::new();
        for &p in programs {
            let (go, rx) = std::sync::mpsc::sync_channel::<usize>(0);
            let (tx, done) = std::sync::mpsc::sync_channel(0);
            workers.push(s.spawn(move || worker(model, batches, p, stage, rx, tx)));
            gos.push(go);
            dones.push(done);
        }
        let mut calls: Vec<Box<dyn FnMut() -> Result<Duration> + '_>> = gos
            .iter()
            .zip(&dones)
            .enumerate()
            .map(|(k, (go, done))| {
                let mut i = 0usize;
                Box::new(move || -> Result<Duration> {
                    let lost = || anyhow::anyhow!("program {k} stopped (its worker ended)");
                    go.send(i).map_err(|_| lost())?;
                    i += 1;
                    done.recv().map_err(|_| lost())?
                }) as Box<dyn FnMut() -> Result<Duration>>
            })
            .collect();
        let mut refs: Vec<&mut dyn FnMut() -> Result<Duration>> = calls.iter_mut().map(|c| c.as_mut() as &mut dyn FnMut() -> Result<Duration>).collect();
        let report = many_timed(&mut refs, opts);
        drop(refs);
        drop(calls);
        drop((gos, dones));
        // A worker's own error explains a lost hand-off better than the hand-off does.
        for (k, w) in workers.into_iter().enumerate() {
            w.join().map_err(|_| anyhow::anyhow!("program {k} panicked"))?.map_err(|e| e.context(format!("program {k}")))?;
        }
        report
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_distr::{Distribution, LogNormal};

    #[test]
    fn quantile_interpolates_like_numpy() {
        // numpy.quantile([1, 2, 4, 8], [0, .25, .5, .9, 1]) = [1, 1.75, 3, 6.8, 8]
        let s = [1.0, 2.0, 4.0, 8.0];
        for (q, want) in [(0.0, 1.0), (0.25, 1.75), (0.5, 3.0), (0.9, 6.8), (1.0, 8.0)] {
            assert!((quantile(&s, q) - want).abs() < 1e-12, "q={q}: {} vs {want}", quantile(&s, q));
        }
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn tukey_fences_classify_and_drop_severe_pairs() {
        // 1..=20 (Q1 = 5.75, Q3 = 15.25, IQR = 9.5): mild above 29.5, severe above 43.75.
        let mut a: Vec<f64> = (1..=20).map(f64::from).collect();
        a[0] = 35.0; // mild: kept
        a[1] = 50.0; // severe: its pair dropped
        let (o, sev) = outliers(&a);
        assert_eq!((o.high_mild, o.high_severe, o.low_mild, o.low_severe), (1, 1, 0, 0));
        assert_eq!(sev.iter().filter(|&&s| s).count(), 1);
        let b: Vec<f64> = (1..=20).map(f64::from).collect();
        let r = analyze(&a, &b, &AbOptions { resamples: 200, ..AbOptions::default() }, 0).unwrap();
        assert_eq!((r.pairs, r.kept), (20, 19));
        // Every measured pair is in the report (outliers included), so a reader can recompute:
        // dropping pair 1 (50 against 2) leaves A = {35, 3..20}, B = {1, 3..20}; medians of 19.
        assert_eq!((r.times_a.clone(), r.times_b.clone()), (a.clone(), b.clone()));
        assert_eq!((r.median_a, r.median_b), (12.0, 11.0));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["times_a"].as_array().map(Vec::len), Some(20));
    }

    /// Coverage of the percentile bootstrap against a known truth: A's times are B's (lognormal,
    /// a right-skewed time-like law) scaled by 1.5 with independent noise, so the true ratio of
    /// medians is exactly 1.5. Over 300 seeded experiments the 90% interval must hold 1.5 in
    /// 86%..97% of them (binomial sd 1.7 points at n = 300; measured 92.3%, an 80% interval
    /// gives 84%), and its median width must be within 10% of the asymptotic one (measured 1%
    /// off; an 80% interval is 23% narrower).
    #[test]
    fn bootstrap_covers_a_known_ratio() {
        let law = LogNormal::new(0.0, 0.25).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (trials, n) = (300, 60);
        let mut hits = 0;
        let mut widths = Vec::new();
        for t in 0..trials {
            let a: Vec<f64> = (0..n).map(|_| 1.5 * law.sample(&mut rng)).collect();
            let b: Vec<f64> = (0..n).map(|_| law.sample(&mut rng)).collect();
            let (lo, hi) = bootstrap_ratio_of_medians(&a, &b, 1000, 0.90, t).unwrap();
            hits += (lo <= 1.5 && 1.5 <= hi) as usize;
            widths.push(hi - lo);
        }
        let cover = hits as f64 / trials as f64;
        assert!((0.86..=0.97).contains(&cover), "90% interval covered 1.5 in {cover:.3} of {trials}");
        // Width against the asymptotic standard error of a log-median ratio: var(log median) =
        // 1 / (4 n f(0)^2) per side with f(0) = 1/(sigma sqrt(2 pi)) for log-times ~ N(0, sigma^2);
        // the 90% interval of the ratio spans about 2 * 1.645 * 1.5 * sqrt(2 var).
        let sigma: f64 = 0.25;
        let var = 2.0 * std::f64::consts::PI * sigma * sigma / (4.0 * n as f64);
        let want = 2.0 * 1.645 * 1.5 * (2.0 * var).sqrt();
        let got = median(&widths);
        assert!((got / want - 1.0).abs() < 0.10, "median width {got:.4}, asymptotic {want:.4}");
    }

    #[test]
    fn bootstrap_is_reproducible_and_checks_its_input() {
        let a: Vec<f64> = (1..=30).map(|i| i as f64).collect();
        let b: Vec<f64> = (1..=30).map(|i| 2.0 * i as f64).collect();
        let x = bootstrap_ratio_of_medians(&a, &b, 500, 0.95, 3).unwrap();
        assert_eq!(x, bootstrap_ratio_of_medians(&a, &b, 500, 0.95, 3).unwrap());
        // Exactly paired: every resample has ratio 0.5.
        assert_eq!(x, (0.5, 0.5));
        assert!(bootstrap_ratio_of_medians(&a, &b[1..], 500, 0.95, 3).unwrap_err().to_string().contains("differ in length"));
        let mut z = a.clone();
        z[3] = f64::NAN;
        assert!(bootstrap_ratio_of_medians(&z, &b, 500, 0.95, 3).unwrap_err().to_string().contains("finite and positive"));
        assert!(AbOptions { confidence: 95.0, ..AbOptions::default() }.validate().is_err());
    }
}
