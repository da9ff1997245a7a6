//! The tensor rules: verdicts from the tensor sketches of one series.

use std::collections::BTreeMap;

use crate::sketch::tensor;

use super::{median, Kind, Need, RowSummary, Rule, Series, SeriesKey, StepStats, Verdict, MIN_STEPS};
use crate::sketch::Stat;

/// The verdict kinds of the tensor rules.
pub mod kinds {
    use super::Kind;

    /// Few non-zeros: a sparse GEMM pays.
    pub const SPARSE_GEMM: Kind = Kind { name: "sparse_gemm", doc: "density <= 0.3 (Gale et al., Sparse GPU Kernels for Deep Learning, SC 2020: sparse kernels beat dense from ~70% sparsity)" };
    /// Half the values are zero: consistent with 2:4 structured sparsity, which sketches cannot
    /// confirm.
    pub const TWO_FOUR_PROBE: Kind = Kind { name: "two_four_probe", doc: "0.45 <= density <= 0.55: consistent with 2:4 structured sparsity (Mishra et al. 2021, NVIDIA Ampere), which sketches cannot confirm; a probe counting non-zeros per group of 4 along K would (`opscope probe`). The band of +-0.05 around one half is opscope's: a 2:4 tensor is exactly 0.5 dense only when no kept value is itself 0, and a ReLU output's density scatters about 0.5" };
    /// A few channels carry outliers.
    pub const CHANNEL_OUTLIERS: Kind = Kind { name: "channel_outliers", doc: "chan_outlier (the largest channel max|x| over the mean channel's) >= 4 and 0 < fraction of channels above 8x the median channel max|x| <= 4%: per-channel scaling or mixed precision (Dettmers et al., LLM.int8(), 2022; Xiao et al., SmoothQuant, 2023). 4 and 4% are opscope's lines: a few channels, not a broad spread; `opscope sweep --check` holds them between planted x30 channel outliers and Gaussian nulls over 48 seeds and 3 shapes" };
    /// Outliers scattered over elements.
    pub const SCATTERED_OUTLIERS: Kind = Kind { name: "scattered_outliers", doc: "kurtosis >= 20 (Gaussian 3) without channel structure, in a tensor of density > 0.6: sparse outliers + low-bit dense (Dettmers et al., SpQR, 2023). Zeros alone raise kurtosis (Gaussian non-zeros at density d give 3/d: 30 at 10%), so sparser tensors are left to the sparsity rules; 20 and 0.6 are opscope's lines, held by `opscope sweep --check` between planted x30 scattered outliers, 90% sparse and 2:4 tensors and Gaussian nulls" };
    /// Per-channel int8 pays over per-tensor.
    pub const PER_CHANNEL_INT8: Kind = Kind { name: "per_channel_int8", doc: "per-channel int8 SQNR >= 8 dB above per-tensor (noise model Δ²/12, Widrow & Kollár, Quantization Noise, 2008; 8 dB is opscope's line: a Gaussian null gains 2-4 dB)" };
    /// Per-token (row-wise, dynamic) int8 pays over per-tensor: the deployable W8A8 activation
    /// scheme.
    pub const PER_TOKEN_INT8: Kind = Kind { name: "per_token_int8", doc: "an activation's per-token int8 SQNR >= 8 dB above per-tensor (noise model Δ²/12 per row, Widrow & Kollár 2008; per-token dynamic scales as in LLM.int8()'s vector-wise quantization, Dettmers et al. 2022, and ZeroQuant, Yao et al. 2022); the scale factors out of the GEMM's K sum, so a W8A8 kernel can apply it" };
    /// Per-tensor int4 is enough.
    pub const INT4: Kind = Kind { name: "int4", doc: "per-tensor int4 SQNR >= 22 dB in every run and kurtosis <= 2.4 (Δ²/12 model; the ideal for a uniform distribution is 22.9 dB, a Gaussian gives 14.6-20 dB). 22 dB and 2.4 are opscope's lines: within 1 dB of the uniform ideal, with tails lighter than a Gaussian's (uniform 1.8, Gaussian 3), so a Gaussian never passes" };
    /// Values on few levels: a LUT / codebook kernel.
    pub const LUT: Kind = Kind { name: "lut", doc: ">= 2 empty bins between the 10% and 90% quantile bins of a histogram of >= 8 bins, in a tensor of density > 0.6 (a sparse tensor's zeros are one level that says nothing of the rest): values on few levels, a LUT / codebook kernel (Han et al., Deep Compression, 2016); 2 bins is opscope's line, held by `opscope sweep --check` between a planted 0.5 grid and Gaussian and uniform nulls" };
    /// Adjacent rows are close: delta compute.
    pub const DELTA_COMPUTE: Kind = Kind { name: "delta_compute", doc: "adjacent-row difference energy <= 0.25 x the pairs' energy (1.0 for independent rows of zero mean): delta compute (Neil et al., Delta Networks, ICML 2017). 0.25 is opscope's line: the rows' differences then carry at most a quarter of their energy, so a delta kernel that skips small differences has most of its work to skip; `opscope sweep --check` holds it between planted coherent rows and Gaussian nulls, with its drifting sequences close above it (upper median 0.308)" };
    /// Calibrate once.
    pub const STATIONARY: Kind = Kind { name: "stationary", doc: "per-run rms varies <= 5% and the mean does not trend: calibrate once (static quantization, as PyTorch observers and ONNX Runtime calibrators do). 5% is opscope's line: a scale fixed from one run is then at most 5% too coarse for another (about 0.4 dB of int8 SQNR, 20 log10 1.05) or clips its top 5% of range" };
    /// The range moves: static scales clip or waste range.
    pub const SCALE_DRIFT: Kind = Kind { name: "scale_drift", doc: "the absmax trend (slope t >= 3) changes by >= 1.5x over the recorded runs: a static (calibrated once) scale would clip or waste range; use dynamic or recalibrated scales (static vs dynamic quantization, ONNX Runtime and TensorRT calibration). 1.5x (3.5 dB of int8 SQNR, 20 log10 1.5) and t >= 3 are opscope's lines: the maximum of a heavy-tailed tensor jumps from run to run, and Student-t 5 nulls drew 0.59x and 3.4x trends before the t line (`tests/mine_nulls.rs`)" };
    /// Scales must be dynamic.
    pub const DRIFTING: Kind = Kind { name: "drifting", doc: "the mean moves by >= 0.5 rms over the runs (least-squares trend): scales must be dynamic (dynamic vs static quantization, PyTorch quantization docs). 0.5 rms is opscope's line: a shift that moves the bulk of the distribution by half its spread, beyond what a range calibrated on the early runs covers" };
    /// Identical in every run: memoize.
    pub const EXACT_REPEAT: Kind = Kind { name: "exact_repeat", doc: "elemsig and sumsq identical in every run: memoize" };
    /// Low rank suspected.
    pub const LOW_RANK_PROBE: Kind = Kind { name: "low_rank_probe", doc: "row-energy CV >= max(0.35, 2 sqrt((kurtosis - 1) / C)), in a tensor of density > 0.6 with kurtosis < 20 and neither channel outliers nor delta-compute rows (each of which spreads row energies by itself): low rank is suspected but not observable from sketches; a randomized range finder (Halko, Martinsson, Tropp 2011) would confirm it (`opscope probe`). A row of C i.i.d. zero-mean values of kurtosis k has energy CV sqrt((k - 1) / C) (a Gaussian's chi-squared: sqrt(2/C), 0.35 at C = 16, 0.09 at C = 256); the line is twice that null, with the run's kurtosis and row length, and never under 0.35 (opscope's lines: 0.35 alone read half of the Gaussian nulls at C = 16 and Student-t 5 nulls at C = 64 as low rank, `tests/mine_nulls.rs`). `opscope sweep --check` holds it between planted rank-4 tensors and Gaussian nulls at C = 64, 128 and 256" };
    /// Subnormal values: density counts them, and a CPU may compute slowly on them.
    pub const SUBNORMALS: Kind = Kind { name: "subnormals", doc: "a run's min or max is subnormal (0 < |x| < 2^-126, f32's smallest normal): the tensor holds values that `nnz` counts as non-zeros where a flush-to-zero kernel (FTZ/DAZ on x86, GPU fast math) reads 0, so its density is an upper bound of what such a kernel sees; a CPU kernel without FTZ/DAZ takes microcode assists on them (IEEE 754-2008 subnormals; Intel 64 and IA-32 Architectures Optimization Reference Manual)" };
    pub use super::super::HEALTH;
}

/// Fraction of a site's cost a kernel of this kind could remove: opscope's ranking weights, not
/// measurements (`opscope measure` and `ab` time a rewrite on the model). Sparse GEMM
/// `1 - density` (the multiplies by zero skipped); int8 GEMM 0.5 of a f32 GEMM, also with
/// channel or scattered outliers handled apart (LLM.int8()'s mixed-precision decomposition,
/// SmoothQuant's migration): conservative against int8's 4x peak rate over f32 on VNNI or DP4A,
/// as the quantize and dequantize steps and the outliers' f32 part remain; int4 0.75 (an eighth of
/// f32's weight bytes: a memory-bound GEMV saves most of its time, less the dequantization); memoization 1.0 (the op is skipped);
/// delta compute and LUT 0.5; a stationary site 0.1 (static scales replace a dynamic absmax
/// pass over the tensor, small beside the GEMM); 0 for the others (warnings and probes).
pub fn payoff_fraction(kind: Kind, density: f64) -> f64 {
    match kind {
        kinds::SPARSE_GEMM => 1.0 - density,
        kinds::PER_CHANNEL_INT8 | kinds::PER_TOKEN_INT8 | kinds::CHANNEL_OUTLIERS | kinds::SCATTERED_OUTLIERS => 0.5,
        kinds::INT4 => 0.75,
        kinds::EXACT_REPEAT => 1.0,
        kinds::DELTA_COMPUTE | kinds::LUT => 0.5,
        kinds::STATIONARY => 0.1,
        _ => 0.0,
    }
}

/// The low-rank probe's fixed row-energy CV line (opscope's; see [`kinds::LOW_RANK_PROBE`]).
pub const LOW_RANK_CV: f64 = 0.35;

/// The low-rank probe's margin over the i.i.d. null CV `sqrt((kurtosis - 1) / C)`: the line is
/// at least this many times it (see [`kinds::LOW_RANK_PROBE`]).
pub const LOW_RANK_NULL_MARGIN: f64 = 2.0;

/// A channel is an outlier channel when its max|x| exceeds this many times the median
/// channel's max|x|. Outlier features in the sense of Dettmers et al., LLM.int8() (2022) and
/// Xiao et al., SmoothQuant (2023): a few channels with a much larger range than the rest. The
/// ratio 8 is opscope's line: the maxima of Gaussian channels (a half-normal spread) reach about
/// 5x the median channel, so 8x is clear of that null. (LLM.int8()'s own threshold, |x| >= 6,
/// is an absolute magnitude for its models' hidden states, not a ratio.)
pub const OUTLIER_CHANNEL_RATIO: f64 = 8.0;

/// The outlier channels of per-channel max|x| values `chan_maxabs` (`C` values, the
/// `chan_maxabs` statistic): indices, ascending, of the finite values above
/// [`OUTLIER_CHANNEL_RATIO`] times the median finite value (the upper median for an even count).
/// Empty when no value is finite. The `channel_outliers` rule reads the fraction of channels this
/// returns per run.
pub fn outlier_channels(chan_maxabs: &[f32]) -> Vec<usize> {
    let mut sorted: Vec<f64> = chan_maxabs.iter().filter(|x| x.is_finite()).map(|&x| x as f64).collect();
    if sorted.is_empty() {
        return Vec::new();
    }
    sorted.sort_by(|a, b| a.total_cmp(b));
    let line = OUTLIER_CHANNEL_RATIO * sorted[sorted.len() / 2];
    chan_maxabs.iter().enumerate().filter(|(_, &x)| x.is_finite() && x as f64 > line).map(|(i, _)| i).collect()
}

fn db(x: f64) -> f64 {
    10.0 * x.log10()
}

/// Per-run metrics of one tensor.
#[derive(Debug, Clone, Default)]
struct Metrics {
    density: Option<f64>,
    kurtosis: Option<f64>,
    chan_outlier: Option<f64>,
    /// Fraction of channels whose max|x| exceeds 8x the median channel's.
    elevated: Option<f64>,
    sqnr8_tensor: Option<f64>,
    sqnr8_channel: Option<f64>,
    /// Per-token (per-row) int8 SQNR, from `row_absmax`.
    sqnr8_token: Option<f64>,
    sqnr4_tensor: Option<f64>,
    /// Empty histogram bins between the bins holding the 10% and 90% quantiles.
    central_holes: Option<f64>,
    /// adj_sumsq / sum over adjacent pairs of (pos_sumsq[r] + pos_sumsq[r-1]).
    adj_ratio: Option<f64>,
    /// Coefficient of variation of the per-row energies.
    row_cv: Option<f64>,
    /// The row-energy CV of i.i.d. rows with this run's kurtosis: sqrt((kurtosis - 1) / C).
    row_cv_null: Option<f64>,
    mean: Option<f64>,
    rms: Option<f64>,
}

fn metrics(run: &StepStats, shape: &[usize]) -> Metrics {
    let count = run.scalar(tensor::COUNT).unwrap_or(0.0);
    let mut m = Metrics::default();
    if count <= 0.0 {
        return m;
    }
    m.density = run.scalar(tensor::NNZ).map(|n| n / count);
    m.kurtosis = run.scalar(tensor::KURTOSIS);
    m.chan_outlier = run.scalar(tensor::CHAN_OUTLIER);
    m.mean = run.scalar(tensor::MEAN);
    let p = run.scalar(tensor::SUMSQ).map(|s| s / count);
    m.rms = p.map(f64::sqrt);
    let absmax = match (run.scalar(tensor::MIN), run.scalar(tensor::MAX)) {
        (Some(lo), Some(hi)) => Some(lo.abs().max(hi.abs())),
        _ => None,
    };
    if let (Some(p), Some(a)) = (p, absmax) {
        if a > 0.0 && p > 0.0 {
            m.sqnr8_tensor = Some(db(12.0 * p * 127.0 * 127.0 / (a * a)));
            m.sqnr4_tensor = Some(db(12.0 * p * 49.0 / (a * a)));
        }
    }
    let chans = match run.vector(tensor::CHAN_MAXABS) {
        Some(ch) => chan_metrics(ch).map(|(e, n)| (Some(e), n)),
        None => run.chan_summary().map(|c| (c.elevated, c.noise)),
    };
    if let Some((elevated, noise)) = chans {
        m.elevated = elevated;
        if let (Some(p), Some(noise)) = (p, noise) {
            m.sqnr8_channel = Some(db(p / noise));
        }
    }
    let rows = match run.row_summary() {
        Some(r) => *r,
        None => row_metrics(run, shape),
    };
    (m.sqnr8_token, m.adj_ratio, m.row_cv) = (rows.sqnr8_token, rows.adj_ratio, rows.row_cv);
    // `row_len` is positive wherever `row_cv` is defined; a NaN kurtosis gives a null of 0
    // (`max(0.0)` drops the NaN), so the line stays 0.35, and an infinite one fails the probe's
    // `kurtosis < 20` anyway.
    m.row_cv_null = match (m.kurtosis, rows.row_len) {
        (Some(k), Some(c)) => Some(((k - 1.0).max(0.0) / c).sqrt()),
        _ => None,
    };
    if let Some(h) = run.vector(tensor::HIST).filter(|h| h.len() >= 8) {
        // The bins holding the central 80% of the values: a continuous distribution fills
        // them, values on a few levels leave gaps between them.
        let total: f64 = h.iter().map(|&x| x as f64).sum();
        let mut acc = 0.0;
        let (mut a, mut b) = (None, 0);
        for (i, &x) in h.iter().enumerate() {
            acc += x as f64;
            if a.is_none() && acc >= 0.1 * total {
                a = Some(i);
            }
            if acc <= 0.9 * total {
                b = i;
            }
        }
        let a = a.unwrap_or(0);
        m.central_holes = Some(if b > a { h[a..=b].iter().filter(|&&x| x == 0.0).count() as f64 } else { 0.0 });
    }
    m
}

/// The per-run numbers the tensor rules read from one run's `chan_maxabs` (`None` when it is
/// empty): the fraction of outlier channels ([`outlier_channels`]) and the per-channel int8
/// noise power, the mean over channels of `(c / 127)^2 / 12` (summed in ascending order of `c`;
/// `None` when it is 0). Used on the vector itself and by a compact load's [`ChanSummary`]
/// (`crate::mine::ChanSummary`), so both give the same bits.
pub(crate) fn chan_metrics(ch: &[f32]) -> Option<(f64, Option<f64>)> {
    if ch.is_empty() {
        return None;
    }
    let mut sorted: Vec<f64> = ch.iter().map(|&x| x as f64).collect();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let elevated = outlier_channels(ch).len() as f64 / sorted.len() as f64;
    let noise: f64 = sorted.iter().map(|c| (c / 127.0).powi(2) / 12.0).sum::<f64>() / sorted.len() as f64;
    Some((elevated, (noise > 0.0).then_some(noise)))
}

/// The per-run numbers the tensor rules read from the per-row vectors (`row_absmax`,
/// `pos_sumsq`) of one run of a tensor of dims `shape`: per-token int8 SQNR
/// ([`sqnr8_per_token`]), the adjacent-row ratio and the row-energy coefficient of variation.
/// The hash is left 0 (see [`RowSummary`]). All `None` for a run with no counted value, and for
/// a run holding a NaN or an Inf: the sketch sums a row's finite values only, so a row of
/// nothing but NaN/Inf reads as a row of energy 0 (a false "identical neighbour" or "low rank"),
/// and a partly non-finite row as a smaller one; the health verdict names such runs.
pub(crate) fn row_metrics(run: &StepStats, shape: &[usize]) -> RowSummary {
    let mut out = RowSummary::default();
    let count = run.scalar(tensor::COUNT).unwrap_or(0.0);
    if count <= 0.0 {
        return out;
    }
    let nonfinite: f64 = [tensor::NAN_COUNT, tensor::POSINF_COUNT, tensor::NEGINF_COUNT].iter().filter_map(|&s| run.scalar(s)).sum();
    if nonfinite > 0.0 {
        return out;
    }
    let p = run.scalar(tensor::SUMSQ).map(|s| s / count);
    if let (Some(p), Some(rows)) = (p, run.vector(tensor::ROW_ABSMAX)) {
        out.sqnr8_token = sqnr8_per_token(p, rows);
    }
    if let Some(pos) = run.vector(tensor::POS_SUMSQ).filter(|p| p.len() >= 2) {
        let block = if shape.len() >= 2 { shape[shape.len() - 2].max(1) } else { 1 };
        // A NaN entry is a row the recording left out (a padding row: the sketch wrote no value
        // for it, the loader fills the gap with NaN). The kernel's `adj_sumsq` takes a pair only
        // when both of its rows are kept, so the denominator takes the same pairs, and the row
        // CV is over the recorded rows.
        let kept = |r: usize| !pos[r].is_nan();
        let pairs: f64 = (1..pos.len()).filter(|&r| r % block != 0 && kept(r) && kept(r - 1)).map(|r| (pos[r] + pos[r - 1]) as f64).sum();
        if let (Some(adj), true) = (run.scalar(tensor::ADJ_SUMSQ), pairs > 0.0) {
            out.adj_ratio = Some(adj / pairs);
        }
        let rows: Vec<f64> = pos.iter().filter(|x| !x.is_nan()).map(|&x| x as f64).collect();
        let n = rows.len() as f64;
        let mean = rows.iter().sum::<f64>() / n;
        if rows.len() >= 2 && mean > 0.0 {
            let var = rows.iter().map(|&x| (x - mean).powi(2)).sum::<f64>() / n;
            out.row_cv = Some(var.sqrt() / mean);
            out.row_len = Some(count / n);
        }
    }
    out
}

/// The miner's int8 SQNR estimates (dB) for one recorded run of a tensor, from its sketches
/// alone: the numbers its quantization rules compare. Each assumes uniform quantizer noise
/// `Δ²/12` per element, independent of the signal (Widrow & Kollár 2008), with a symmetric
/// absmax scale `Δ = absmax / 127`:
/// - `tensor`: one scale, `absmax = max(|min|, |max|)`; needs `min`, `max`, `sumsq`, `count`;
/// - `channel`: one scale per last-axis channel, from `chan_maxabs`;
/// - `token`: one scale per row (all axes but the last), from `row_absmax`
///   ([`sqnr8_per_token`]).
///
/// `None` where a statistic is missing or the tensor is all zero. Padding rows are left out
/// as the sketch left them out. `opscope probe --recording` compares these with the SQNR
/// measured on captured tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Int8Estimate {
    /// One scale for the tensor.
    pub tensor: Option<f64>,
    /// One scale per channel (last axis).
    pub channel: Option<f64>,
    /// One scale per row (per token).
    pub token: Option<f64>,
}

/// [`Int8Estimate`] of one run (`shape`: the tensor's dims).
pub fn int8_estimate(run: &StepStats, shape: &[usize]) -> Int8Estimate {
    let m = metrics(run, shape);
    Int8Estimate { tensor: m.sqnr8_tensor, channel: m.sqnr8_channel, token: m.sqnr8_token }
}

/// Estimated per-token int8 SQNR (dB) of a tensor with mean square `p` over its recorded rows
/// and per-row absmax `rows` (`row_absmax`; NaN entries are rows not recorded, e.g. padding).
///
/// Each row `r` of `C` elements gets its own symmetric scale `Δ_r = absmax_r / 127` and uniform
/// quantization noise `Δ_r² / 12` per element (Widrow & Kollár 2008); every row has `C`
/// elements, so the noise power is the mean over rows of `Δ_r² / 12`, and
/// `SQNR = 10 log10(p / noise)`. `None` when no row is recorded or every row is zero.
pub fn sqnr8_per_token(p: f64, rows: &[f32]) -> Option<f64> {
    let a: Vec<f64> = rows.iter().filter(|x| x.is_finite()).map(|&x| x as f64).collect();
    if a.is_empty() || p <= 0.0 {
        return None;
    }
    let noise = a.iter().map(|x| (x / 127.0).powi(2) / 12.0).sum::<f64>() / a.len() as f64;
    (noise > 0.0).then(|| db(p / noise))
}

/// The least-squares line through `ys` (at x = 0, 1, ...), evaluated at the first and the last
/// x.
fn trend(ys: &[f64]) -> (f64, f64) {
    let n = ys.len() as f64;
    let xm = (n - 1.0) / 2.0;
    let ym = ys.iter().sum::<f64>() / n;
    let cov: f64 = ys.iter().enumerate().map(|(i, y)| (i as f64 - xm) * (y - ym)).sum();
    let var: f64 = (0..ys.len()).map(|i| (i as f64 - xm).powi(2)).sum();
    let slope = if var > 0.0 { cov / var } else { 0.0 };
    (ym - slope * xm, ym + slope * xm)
}

/// |t| of the least-squares slope through `ys` (at x = 0, 1, ...): slope / its standard error
/// with the residual variance over `n - 2` degrees of freedom (the ordinary regression t
/// statistic). Infinite for an exact line with a non-zero slope, 0 for fewer than 3 points.
fn slope_t(ys: &[f64]) -> f64 {
    let n = ys.len();
    if n < 3 {
        return 0.0;
    }
    let xm = (n as f64 - 1.0) / 2.0;
    let ym = ys.iter().sum::<f64>() / n as f64;
    let sxx: f64 = (0..n).map(|i| (i as f64 - xm).powi(2)).sum();
    let slope = ys.iter().enumerate().map(|(i, y)| (i as f64 - xm) * (y - ym)).sum::<f64>() / sxx;
    let resid: f64 = ys.iter().enumerate().map(|(i, y)| (y - ym - slope * (i as f64 - xm)).powi(2)).sum();
    let se = (resid / (n - 2) as f64 / sxx).sqrt();
    if se > 0.0 {
        (slope / se).abs()
    } else if slope != 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

pub(crate) fn parse_shape(s: &str) -> Vec<usize> {
    s.trim_matches(|c| c == '[' || c == ']').split(',').filter_map(|d| d.trim().parse().ok()).collect()
}

/// The tensor rules (sparsity, outliers, quantization, LUT, delta compute, low rank, across-run
/// behaviour, health) over every series holding tensor statistics.
struct TensorRules;

impl Rule for TensorRules {
    fn name(&self) -> &'static str {
        "tensor"
    }
    fn mine(&self, series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
        tensor_verdicts(series, out)
    }
    fn needs(&self) -> &'static [Need] {
        NEEDS
    }
}

/// What each tensor rule reads (see [`tensor_verdicts`]).
const NEEDS: &[Need] = {
    use tensor::*;
    const fn need(kind: Kind, stats: &'static [Stat], runs: usize) -> Need {
        Need { kind, stats, runs }
    }
    &[
        need(kinds::HEALTH, &[NAN_COUNT, POSINF_COUNT, NEGINF_COUNT], 1),
        need(kinds::SPARSE_GEMM, &[NNZ], 1),
        need(kinds::SUBNORMALS, &[MIN, MAX], 1),
        need(kinds::CHANNEL_OUTLIERS, &[CHAN_OUTLIER, CHAN_MAXABS], 1),
        need(kinds::SCATTERED_OUTLIERS, &[NNZ, KURTOSIS], 1),
        need(kinds::PER_CHANNEL_INT8, &[MIN, MAX, SUMSQ, CHAN_MAXABS], 1),
        need(kinds::PER_TOKEN_INT8, &[MIN, MAX, SUMSQ, ROW_ABSMAX], 1),
        need(kinds::INT4, &[MIN, MAX, SUMSQ, KURTOSIS], 1),
        need(kinds::LUT, &[NNZ, HIST], 1),
        need(kinds::DELTA_COMPUTE, &[POS_SUMSQ, ADJ_SUMSQ], 1),
        need(kinds::LOW_RANK_PROBE, &[NNZ, KURTOSIS, POS_SUMSQ], 1),
        need(kinds::EXACT_REPEAT, &[ELEMSIG, SUMSQ], MIN_STEPS),
        need(kinds::SCALE_DRIFT, &[MIN, MAX], MIN_STEPS),
        need(kinds::DRIFTING, &[MEAN, SUMSQ], MIN_STEPS),
        need(kinds::STATIONARY, &[MEAN, SUMSQ], MIN_STEPS),
    ]
};

/// The tensor rules (listed by [`super::rules`] directly, not through the registry: the core's
/// own rules need no link-time registration).
pub(super) const RULES: &dyn Rule = &TensorRules;

/// True if a series holds tensor sketches (every tensor sketch records `count`; a probe never
/// does).
fn is_tensor_series(s: &Series) -> bool {
    s.runs.iter().any(|r| r.has(tensor::COUNT))
}

fn tensor_verdicts(series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
    // A site's FLOPs over the recording: each run's own (a prefill and a decode compile differ),
    // once per site (roles share them; a weight recorded once has fewer runs than the
    // activations, so the role with the most counts). A payoff is a share of its own pass's
    // total, so a second tap in the pipeline (`capture`, another `matmul` over other sites)
    // neither dilutes nor inflates it.
    let mut site_flops: BTreeMap<(u32, &str), f64> = BTreeMap::new();
    for ((site, _, pass), s) in series {
        let f: f64 = s.flops_over_runs();
        let e = site_flops.entry((*pass, site.as_str())).or_default();
        *e = e.max(f);
    }
    let mut total_flops: BTreeMap<u32, f64> = BTreeMap::new();
    for ((pass, _), f) in &site_flops {
        *total_flops.entry(*pass).or_insert(0.0) += f;
    }
    // Per run (compile, step), the execution order (`Series::order`) of the first tapped tensor
    // holding a NaN or an Inf: where the values arise, in its producer or between it and the
    // tapped tensor before it (TensorFlow Debugger V2's first-op alert, PyTorch's anomaly mode).
    let mut first_bad: BTreeMap<(u32, u64), usize> = BTreeMap::new();
    for s in series.values().filter(|s| is_tensor_series(s)) {
        for run in s.nonfinite_runs() {
            let e = first_bad.entry(run).or_insert(s.order);
            *e = (*e).min(s.order);
        }
    }
    for ((site, role, pass_idx), s) in series {
        if !is_tensor_series(s) {
            continue;
        }
        let shape = parse_shape(&s.shape);
        let ms: Vec<Metrics> = s.runs.iter().map(|r| metrics(r, r.dims(&shape))).collect();
        let med = |f: fn(&Metrics) -> Option<f64>| median(ms.iter().filter_map(f).collect());
        let density = med(|m| m.density);
        let kurt = med(|m| m.kurtosis);
        let chan = med(|m| m.chan_outlier);
        let elevated = med(|m| m.elevated);
        let s8t = med(|m| m.sqnr8_tensor);
        let s8c = med(|m| m.sqnr8_channel);
        let s8k = med(|m| m.sqnr8_token);
        // Rows are tokens for activations and outputs; a weight's (rhs) rows are its input
        // channels, whose per-row scale would sit inside the GEMM's K sum.
        let activation = role != "rhs";
        let holes = med(|m| m.central_holes);
        let adj = med(|m| m.adj_ratio);
        let row_cv = med(|m| m.row_cv);
        // The low-rank line: 0.35, or twice the i.i.d. null of the recorded kurtosis and row
        // length where that is higher (narrow rows, heavy tails).
        let row_cv_line = med(|m| m.row_cv_null).map_or(LOW_RANK_CV, |n| (LOW_RANK_NULL_MARGIN * n).max(LOW_RANK_CV));
        let share = site_flops.get(&(*pass_idx, site.as_str())).copied().unwrap_or(0.0) / total_flops.get(pass_idx).copied().unwrap_or(0.0).max(1.0);
        let mut push = |kind: Kind, evidence: Vec<(&str, Option<f64>)>, rule: &'static str, source: &'static str| {
            out.push(Verdict {
                site: site.clone(),
                role: role.clone(),
                pass_idx: *pass_idx,
                kind,
                evidence: evidence.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_string(), v))).collect(),
                rule,
                source,
                payoff: share * payoff_fraction(kind, density.unwrap_or(1.0)),
                basis: None,
                fraction: payoff_fraction(kind, density.unwrap_or(1.0)),
            });
        };
        // Over every run, also after a sampled load: one run with a NaN is a verdict.
        let nonfinite: f64 = s.nonfinite_over_runs();
        if nonfinite > 0.0 {
            // Over every run, also after a sampled load (`Series::nonfinite_runs`).
            let bad = s.nonfinite_runs();
            let first = bad.iter().filter(|run| first_bad.get(run) == Some(&s.order)).count();
            push(
                kinds::HEALTH,
                vec![("nonfinite", Some(nonfinite)), ("runs_nonfinite", Some(bad.len() as f64)), ("first_in_runs", Some(first as f64))],
                "any NaN or Inf; first_in_runs: the runs in which it is the first tapped tensor in execution order to hold one \
                 (they arise in its producer, or between it and the tapped tensor before it)",
                "health check; the first-tensor alert of TensorFlow Debugger V2 and PyTorch's anomaly mode",
            );
        }
        // Over every run, also after a sampled load (`Series::subnormal_over_runs`).
        let (tiny_runs, tiny_first) = s.subnormal_over_runs();
        if tiny_runs > 0 {
            push(
                kinds::SUBNORMALS,
                vec![("subnormal_extreme", tiny_first), ("runs_with_subnormal", Some(tiny_runs as f64)), ("runs", Some(s.runs_seen() as f64)), ("density", density)],
                "0 < |min| or |max| < 2^-126 (f32's smallest normal, 1.18e-38) in some run; `nnz` counts subnormals as non-zeros, so the density is an upper bound of what a flush-to-zero kernel sees",
                "IEEE 754-2008 subnormal numbers; x86 computes on them through microcode assists unless FTZ/DAZ are set (Intel 64 and IA-32 Architectures Optimization Reference Manual)",
            );
        }
        let d = density.unwrap_or(1.0);
        if d <= 0.3 {
            push(
                kinds::SPARSE_GEMM,
                vec![("density", density)],
                "density <= 0.3 (>= 70% zeros)",
                "Gale et al., Sparse GPU Kernels for Deep Learning (SC 2020): sparse kernels beat dense from ~70% sparsity",
            );
        } else if (0.45..=0.55).contains(&d) {
            push(
                kinds::TWO_FOUR_PROBE,
                vec![("density", density)],
                "0.45 <= density <= 0.55: consistent with 2:4, not provable from sketches; confirm with a probe counting non-zeros per group of 4 along K",
                "Mishra et al., Accelerating Sparse Deep Neural Networks (2021): 2:4 structured sparsity on Ampere",
            );
        }
        let channel = chan.is_some_and(|c| c >= 4.0) && elevated.is_some_and(|e| e > 0.0 && e <= 0.04);
        if channel {
            push(
                kinds::CHANNEL_OUTLIERS,
                vec![("chan_outlier", chan), ("elevated_channels", elevated), ("kurtosis", kurt)],
                "chan_outlier >= 4 with at least one channel and at most 4% of the channels above 8x the median channel max|x| (a half-normal spread of channel maxima reaches ~5x)",
                "Dettmers et al., LLM.int8() (2022): systematic outlier features; Xiao et al., SmoothQuant (2023)",
            );
        }
        if !channel && d > 0.6 && kurt.is_some_and(|k| k >= 20.0) {
            push(
                kinds::SCATTERED_OUTLIERS,
                vec![("kurtosis", kurt), ("elevated_channels", elevated)],
                "kurtosis >= 20 (Gaussian 3) without channel structure",
                "Dettmers et al., SpQR (2023): isolate sparse outliers, quantize the rest",
            );
        }
        if let (Some(t), Some(c)) = (s8t, s8c) {
            if c >= t + 8.0 {
                push(
                    kinds::PER_CHANNEL_INT8,
                    vec![("sqnr_int8_per_tensor_db", s8t), ("sqnr_int8_per_channel_db", s8c), ("sqnr_int8_per_token_db", s8k.filter(|_| activation))],
                    if activation {
                        "per-channel int8 SQNR >= 8 dB above per-tensor (a Gaussian null gains ~2-4 dB). For an activation this is an accuracy bound, not a kernel: a per-channel scale along K does not factor out of the GEMM's sum; deploy per-token, or migrate the channel scales into the weight (SmoothQuant)"
                    } else {
                        "per-channel int8 SQNR >= 8 dB above per-tensor (a Gaussian null gains ~2-4 dB): per-output-channel weight scales, which an int8 GEMM applies after the K sum"
                    },
                    "uniform quantizer noise Δ²/12 (Widrow & Kollár 2008); 8 dB: opscope's line, calibrated on the sweep's Gaussian nulls; Xiao et al., SmoothQuant (2023)",
                );
            }
        }
        if let (Some(t), Some(k), true) = (s8t, s8k, activation) {
            if k >= t + 8.0 {
                push(
                    kinds::PER_TOKEN_INT8,
                    vec![("sqnr_int8_per_tensor_db", s8t), ("sqnr_int8_per_token_db", s8k), ("sqnr_int8_per_channel_db", s8c)],
                    "per-token int8 SQNR >= 8 dB above per-tensor (the same line as per-channel): rows (tokens) differ in scale, a dynamic per-token W8A8 kernel keeps the precision a per-tensor scale loses",
                    "uniform quantizer noise Δ²/12 per row (Widrow & Kollár 2008); Dettmers et al., LLM.int8() (2022) vector-wise quantization; Yao et al., ZeroQuant (2022)",
                );
            }
        }
        // Int4 must hold in every run (the worst run decides), not only typically.
        let s4_worst = ms.iter().map(|m| m.sqnr4_tensor).collect::<Option<Vec<f64>>>().and_then(|v| v.into_iter().reduce(f64::min));
        if s4_worst.is_some_and(|v| v >= 22.0) && kurt.is_some_and(|k| k <= 2.4) {
            push(
                kinds::INT4,
                vec![("sqnr_int4_per_tensor_db_worst_run", s4_worst), ("kurtosis", kurt)],
                "per-tensor int4 SQNR >= 22 dB in every run (the ideal for a uniform is 22.9 dB, a Gaussian gives 14.6-20 dB) and light tails (kurtosis <= 2.4; uniform 1.8, Gaussian 3)",
                "uniform quantizer noise Δ²/12 (Widrow & Kollár 2008)",
            );
        }
        if d > 0.6 && holes.is_some_and(|h| h >= 2.0) {
            push(
                kinds::LUT,
                vec![("central_empty_bins", holes)],
                ">= 2 empty bins between the 10% and 90% quantile bins (each expects >= ~15 values for a continuous distribution of >= 1k values): values on a few levels",
                "Han et al., Deep Compression (2016): shared levels as a codebook",
            );
        }
        let coherent = adj.is_some_and(|a| a <= 0.25);
        if coherent {
            push(
                kinds::DELTA_COMPUTE,
                vec![("adjacent_row_ratio", adj)],
                "sum ||x_r - x_(r-1)||^2 <= 0.25 x sum (||x_r||^2 + ||x_(r-1)||^2) (1.0 for independent rows)",
                "Neil et al., Delta Networks for Optimized Recurrent Network Computation (ICML 2017)",
            );
        }
        if !channel && !coherent && d > 0.6 && kurt.is_some_and(|k| k < 20.0) && row_cv.is_some_and(|c| c >= row_cv_line) {
            push(
                kinds::LOW_RANK_PROBE,
                vec![("row_energy_cv", row_cv), ("row_energy_cv_line", Some(row_cv_line))],
                "row-energy CV >= max(0.35, 2 sqrt((kurtosis - 1) / C)) (i.i.d. rows of C values give sqrt((kurtosis - 1) / C), a Gaussian sqrt(2/C)); rank is not observable from sketches: confirm with a randomized range finder",
                "Halko, Martinsson, Tropp, Finding structure with randomness (2011)",
            );
        }
        // Across runs, only runs of one shape compare: a site in a prefill and a decode compile
        // ([B, S, C] and [B, 1, C]) changes its range with the compile, not with the data. The
        // rules take the shape most runs have (the first run's on a tie).
        let group: Vec<usize> = {
            let mut count: Vec<(&[usize], usize)> = Vec::new();
            for r in &s.runs {
                let d = r.dims(&shape);
                match count.iter_mut().find(|(k, _)| *k == d) {
                    Some(c) => c.1 += 1,
                    None => count.push((d, 1)),
                }
            }
            let best = count.iter().enumerate().max_by_key(|(i, (_, n))| (*n, std::cmp::Reverse(*i))).map(|(_, (d, _))| *d);
            (0..s.runs.len()).filter(|&i| Some(s.runs[i].dims(&shape)) == best).collect()
        };
        let runs: Vec<&StepStats> = group.iter().map(|&i| &s.runs[i]).collect();
        let ms: Vec<&Metrics> = group.iter().map(|&i| &ms[i]).collect();
        let med = |f: fn(&Metrics) -> Option<f64>| median(ms.iter().filter_map(|m| f(m)).collect());
        if runs.len() >= MIN_STEPS {
            let sig: Vec<Option<&[f32]>> = runs.iter().map(|r| r.vector(tensor::ELEMSIG)).collect();
            let sumsq: Vec<Option<f64>> = runs.iter().map(|r| r.scalar(tensor::SUMSQ)).collect();
            // Bitwise: a padding position's sampled element is NaN (not recorded) in every run,
            // and NaN == NaN is false, so a float comparison would never call a padded
            // activation repeated.
            let same = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            // A weight the writer memoizes is recorded at step 0 of each compile only (again
            // only when it changes): an rhs seen at step 0 alone is such a weight, the same in
            // every compile because it is a parameter, not because an input repeats; nothing to
            // memoize (a helper's loop of 300 compiles topped `mine` with its weights at payoff 1).
            let weight = role == "rhs" && runs.iter().all(|r| r.step == 0);
            let repeat = !weight
                && sig.iter().all(|x| matches!((x, sig[0]), (Some(a), Some(b)) if same(a, b)))
                && sumsq.iter().all(|x| x.map(f64::to_bits) == sumsq[0].map(f64::to_bits));
            let means: Vec<f64> = ms.iter().filter_map(|m| m.mean).collect();
            let rms = med(|m| m.rms).unwrap_or(0.0);
            let drift = (means.len() >= MIN_STEPS).then(|| {
                let (start, end) = trend(&means);
                (end - start).abs()
            });
            // The range a static scale must cover: absmax per run, its least-squares trend.
            let absmax: Vec<f64> = runs
                .iter()
                .filter_map(|r| Some(r.scalar(tensor::MIN)?.abs().max(r.scalar(tensor::MAX)?.abs())))
                .collect();
            // The trend must also stand out of the run-to-run scatter (slope t >= 3): the maximum
            // of a heavy-tailed tensor jumps from run to run, and a line through 4 such maxima
            // is noise (Student-t 5 data gave 0.59x and 3.4x "trends", tests/mine_nulls.rs).
            let scale_ratio = (absmax.len() >= MIN_STEPS && slope_t(&absmax) >= 3.0)
                .then(|| trend(&absmax))
                .and_then(|(start, end)| (start > 0.0 && end > 0.0).then(|| end / start));
            if scale_ratio.is_some_and(|r| !(1.0 / 1.5..1.5).contains(&r)) {
                push(
                    kinds::SCALE_DRIFT,
                    vec![("absmax_end_over_start", scale_ratio), ("runs", Some(absmax.len() as f64))],
                    "the absmax trend (least squares over the runs, slope t >= 3) changes by >= 1.5x from the first run to the last",
                    "static quantization (ONNX Runtime, TensorRT calibration) fixes the range once; a 1.5x range change costs 3.5 dB of int8 SQNR (20 log10 1.5) or clips; 1.5x: opscope's line",
                );
            }
            let rms_cv = {
                let v: Vec<f64> = ms.iter().filter_map(|m| m.rms).collect();
                let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
                (mean > 0.0).then(|| (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt() / mean)
            };
            if repeat {
                push(
                    kinds::EXACT_REPEAT,
                    vec![("runs", Some(runs.len() as f64))],
                    "elemsig and sumsq identical in every run",
                    "memoization: an identical input gives an identical output",
                );
            } else if drift.is_some_and(|dv| rms > 0.0 && dv >= 0.5 * rms) {
                push(
                    kinds::DRIFTING,
                    vec![("mean_shift_over_window", drift), ("rms", Some(rms))],
                    "the mean moves by >= 0.5 rms over the recorded runs (least-squares trend)",
                    "dynamic vs static quantization (PyTorch quantization docs): moving ranges need dynamic scales",
                );
            } else if !weight && rms_cv.is_some_and(|c| c <= 0.05) && !scale_ratio.is_some_and(|r| !(1.0 / 1.5..1.5).contains(&r)) {
                push(
                    kinds::STATIONARY,
                    vec![("rms_cv", rms_cv), ("mean_shift_over_window", drift)],
                    "per-run rms varies by <= 5% and the mean does not trend",
                    "static quantization calibration (PyTorch observers, ONNX Runtime calibrators): calibrate once",
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outlier_channels_are_above_eight_times_the_median_channel() {
        // Median 1 (upper median of an even count too): 8.0 is on the line, not above it.
        assert_eq!(outlier_channels(&[1.0, 1.0, 9.0, 1.0, 8.0, 1.0, 0.5]), vec![2]);
        assert_eq!(outlier_channels(&[1.0, 2.0, 17.0, 2.0]), vec![2]);
        // Non-finite values are neither counted in the median nor flagged.
        assert_eq!(outlier_channels(&[f32::NAN, 1.0, 1.0, 100.0]), vec![3]);
        assert!(outlier_channels(&[]).is_empty() && outlier_channels(&[f32::NAN]).is_empty());
    }
}

