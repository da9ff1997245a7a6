//! Calibration: per tensor, the range `[lowest, highest]` a static int8 quantizer clips to, and
//! its scale and zero point, from a recording, by the three methods of ONNX Runtime's
//! `onnxruntime.quantization.calibrate` (read in ORT 1.32's `calibrate.py`; TensorRT's
//! calibrators use the same ideas):
//!
//! - **min-max** (`MinMaxCalibrater`): `lowest` = the smallest `min` over runs, `highest` = the
//!   largest `max`; symmetric: `[-absmax, absmax]`. With [`RangeAveraging`] the runs' ranges
//!   are averaged instead (each run is one batch): their mean (`MinMaxCalibrater(moving_average=
//!   True)` as `quantize_static` runs it: one `collect_data` pass, `np.nanmean` over the batches'
//!   `ReduceMin` / `ReduceMax`), or their exponential moving average in run order, `m = m + c (x
//!   - m)` from the first run's value (PyTorch's `MovingAverageMinMaxObserver`, `c` its
//!   `averaging_constant`, 0.01 by default; ORT's `merge_range` does the same across
//!   `collect_data` calls of one batch each). Symmetric: `[-a, a]` with `a` the larger of the
//!   averaged `|lowest|` and `|highest|`, as ORT.
//! - **percentile** (`HistogramCollector.compute_percentile`): on the value histogram merged over
//!   runs ([`merged_histogram`]), `cdf = cumsum(hist / total)`; `lowest = edges[i]` for the first
//!   bin `i` with `cdf[i] >= (100 - p) / 200` and `highest = edges[j]` for the first `j` with
//!   `cdf[j] >= 1 - (100 - p) / 200` (ORT takes the bin's *lower* edge on both sides). Symmetric:
//!   on the histogram of `|x|` (the signed one folded at 0), `±edges[j]` for `cdf[j] >= p / 100`.
//! - **entropy** (`HistogramCollector.get_entropy_threshold`, ORT's `CalibrationMethod.Entropy`;
//!   TensorRT's entropy calibration, Migacz, "8-bit Inference with TensorRT", GTC 2017): on the
//!   histogram made symmetric about 0 (`n` bins, zero bin `n / 2`), for each `i` from `Q / 2` to
//!   `n / 2` the candidate `[edges[n/2 - i], edges[min(n/2 + i + 1, n)]]`: `p` is the slice with
//!   the counts outside added to its end bins, `q` the slice merged into `Q` quantized bins
//!   (`Q` = [`CalibrationOptions::quantized_bins`], 128) and expanded back: each quantized
//!   bin's count divided by the number of non-zero bins of `p` in its group, truncated to an
//!   integer (ORT's int64 arrays), and given to every bin of the group (ORT's behaviour;
//!   TensorRT's description gives it to the non-zero bins only); both smoothed (zeros become
//!   `1e-4`, the mass taken from the non-zeros; MXNet's `_smooth_distribution`);
//!   the candidate with the smallest KL(p || q) wins (first on a tie). ORT computes the KL in
//!   float32 and this module in f64, so where two candidates' KL agree within float32 rounding
//!   the two can pick neighbouring bins.
//!
//! All three clip to the data: a threshold beyond the recorded `min` / `max` is replaced by it,
//! as ORT does. A constant tensor gets `[c, c]` by every method.
//!
//! **Scale and zero point** are ORT's `quant_utils.compute_scale_zp` (the affine scheme
//! `r = scale * (q - zero_point)` of Jacob et al., CVPR 2018): the range is widened to hold 0
//! (`rmin = min(lowest, 0)`, `rmax = max(highest, 0)`), then
//! - symmetric, int8 `[-127, 127]`: `absmax = max(|rmin|, |rmax|)`, `scale = absmax / 127`,
//!   `zero_point = 0`;
//! - asymmetric, uint8 `[0, 255]`: `scale = (rmax - rmin) / 255`,
//!   `zero_point = round_half_even(0 - rmin / scale)`;
//!
//! in f64, the scale stored as f32; a scale below f32's smallest normal (an all-zero tensor)
//! becomes 1 with zero point 0. TensorRT's calibration cache stores the symmetric int8 scale
//! `amax / 127` of the same range ([`TensorCalibration::trt_scale`]).
//!
//! **What the histogram must be.** Percentile and entropy need `hist` recorded with `min` and
//! `max` (`matmul{stats=[min,max,hist],..}`), and a histogram that holds every value: with a
//! fixed `hist_range=LO:HI` no value may fall outside (`hist_outside` must be 0), and runs then
//! merge exactly. With the default per-run absmax range runs are re-binned onto a common range
//! (approximate; [`TensorCalibration::notes`] says so, as it says when the data cover too few
//! bins). Entropy (and symmetric percentile) need a bin edge at 0 (a range `-A:A` with an even
//! bin count, or any range whose grid passes through 0, which is then padded with empty bins to
//! be symmetric). Entropy also needs at least `2 x Q` = 256 bins after that, opscope's
//! requirement: the candidates run from `Q / 2` bins each side of 0 to the whole histogram, so
//! with `2Q` bins the narrowest is half the range (with fewer than `Q` ORT's search is empty,
//! and at ORT's own default of `Q` bins only the whole range is left). TensorRT's entropy
//! calibration uses 2048 bins (Migacz 2017), the count to record with (`hist_bins=2048`).
//!
//! **Tensor names.** A recording keys tensors by (site, role); sites are ONNX node names, and
//! neither the recording nor its manifest holds the ONNX *tensor* names ORT and TensorRT key
//! their tables by. [`TensorCalibration::name`] is `site/role` (`/pass<k>` appended where two
//! passes tap the same site and role); rename the keys to tensor names to use the tables on the
//! original model.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::{json, Value};

use super::hist::merged_histogram;
use super::series::{Series, SeriesKey, StepStats};
use crate::sketch::{tensor, Stat};

/// ORT's smoothing constant for zero bins (`quant_utils.smooth_distribution`, `eps=0.0001`,
/// from MXNet's `_smooth_distribution`).
const SMOOTH_EPS: f64 = 1e-4;

/// A calibration method.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CalibrationMethod {
    /// Smallest `min` and largest `max` over runs (ORT `CalibrationMethod.MinMax`).
    MinMax,
    /// The central `p` percent of the merged histogram, `p` in `[0, 100]` (ORT
    /// `CalibrationMethod.Percentile`; ORT's default `p` is 99.999).
    Percentile(f64),
    /// The KL-divergence threshold search over the merged histogram (ORT
    /// `CalibrationMethod.Entropy`, TensorRT's entropy calibration).
    Entropy,
}

impl CalibrationMethod {
    /// Name as the CLI spells it (`minmax`, `percentile`, `entropy`).
    pub fn name(&self) -> &'static str {
        match self {
            CalibrationMethod::MinMax => "minmax",
            CalibrationMethod::Percentile(_) => "percentile",
            CalibrationMethod::Entropy => "entropy",
        }
    }

    /// ORT's enum member (`MinMax`, `Percentile`, `Entropy`).
    pub fn ort_name(&self) -> &'static str {
        match self {
            CalibrationMethod::MinMax => "MinMax",
            CalibrationMethod::Percentile(_) => "Percentile",
            CalibrationMethod::Entropy => "Entropy",
        }
    }
}

impl fmt::Display for CalibrationMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalibrationMethod::Percentile(p) => write!(f, "percentile {p}"),
            m => f.write_str(m.name()),
        }
    }
}

/// How min-max combines the ranges of the runs (each run one batch of calibration data).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RangeAveraging {
    /// The smallest `min` and the largest `max` of any run (ORT's `MinMaxCalibrater` default,
    /// PyTorch's `MinMaxObserver`).
    Extremes,
    /// The mean over runs of each run's `min` and of each run's `max`: ORT's
    /// `MinMaxCalibrater(moving_average=True)` as `quantize_static` runs it (one `collect_data`
    /// pass over the data reader; `np.nanmean` over the batches). One outlier batch then moves
    /// the range by `1 / runs` of its excess instead of setting it.
    Mean,
    /// Exponential moving average in run order (compile, then step): the first run's `min` /
    /// `max`, then `m = m + c (x - m)` for each later run, `c` in `(0, 1]`. PyTorch's
    /// `MovingAverageMinMaxObserver(averaging_constant=c)` (default 0.01), and ORT's moving
    /// average across `collect_data` calls of one batch each. Weighs late runs most: with `c =
    /// 0.01` the first run keeps `0.99^(runs - 1)` of its weight.
    Ema(f64),
}

impl RangeAveraging {
    /// The CLI's spelling: `extremes`, `mean`, `ema`.
    pub fn name(&self) -> &'static str {
        match self {
            RangeAveraging::Extremes => "extremes",
            RangeAveraging::Mean => "mean",
            RangeAveraging::Ema(_) => "ema",
        }
    }
}

/// How to calibrate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CalibrationOptions {
    /// The method.
    pub method: CalibrationMethod,
    /// Min-max only: how the runs' ranges combine ([`RangeAveraging::Extremes`] by default).
    pub averaging: RangeAveraging,
    /// Symmetric: min-max gives `[-absmax, absmax]`, percentile works on `|x|`, and the scale is
    /// int8 `[-127, 127]` with zero point 0; otherwise uint8 `[0, 255]` with a zero point.
    pub symmetric: bool,
    /// Quantized bins of the entropy search (`Q`; ORT's `num_quantized_bins`, TensorRT's 128).
    pub quantized_bins: usize,
}

impl CalibrationOptions {
    /// `method`, asymmetric, 128 quantized bins.
    pub fn new(method: CalibrationMethod) -> CalibrationOptions {
        CalibrationOptions {
            method,
            averaging: RangeAveraging::Extremes,
            symmetric: false,
            quantized_bins: 128,
        }
    }

    /// Check the options alone, before any series is read.
    ///
    /// Errors: [`CalibrationError::Options`] for fewer than 2 quantized bins, a percentile
    /// outside [0, 100], an averaging constant outside `(0, 1]`, or averaging with a method other
    /// than min-max.
    pub fn validate(&self) -> Result<(), CalibrationError> {
        if let RangeAveraging::Ema(c) = self.averaging {
            if !(c > 0.0 && c <= 1.0) {
                return Err(CalibrationError::Options(format!(
                    "the averaging constant must be in (0, 1] (got {c}; PyTorch's MovingAverageMinMaxObserver uses 0.01)"
                )));
            }
        }
        if self.averaging != RangeAveraging::Extremes && self.method != CalibrationMethod::MinMax {
            return Err(CalibrationError::Options(format!(
                "averaging the runs' ranges ({}) applies to min-max only (ORT's moving_average is a MinMaxCalibrater option), not to {}",
                self.averaging.name(),
                self.method
            )));
        }
        if self.quantized_bins < 2 {
            return Err(CalibrationError::Options(format!("quantized bins must be at least 2 (got {})", self.quantized_bins)));
        }
        if let CalibrationMethod::Percentile(p) = self.method {
            if !(0.0..=100.0).contains(&p) {
                return Err(CalibrationError::Options(format!("percentile must be in [0, 100] (got {p})")));
            }
        }
        Ok(())
    }
}

/// The integer grid a range is mapped to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantParams {
    /// Smallest code (-127 for symmetric int8, 0 for uint8).
    pub qmin: i32,
    /// Largest code (127, or 255).
    pub qmax: i32,
    /// Real value of one code step (units of the tensor), stored as f32 as ORT stores it.
    pub scale: f32,
    /// The code of the real value 0.
    pub zero_point: i32,
}

impl QuantParams {
    /// `int8` or `uint8`.
    pub fn dtype(&self) -> &'static str {
        if self.qmin < 0 {
            "int8"
        } else {
            "uint8"
        }
    }
}

/// Scale and zero point of `[lo, hi]`: ORT's `compute_scale_zp` for int8 `[-127, 127]`
/// (symmetric) or uint8 `[0, 255]` (asymmetric); formulas in the module docs.
pub fn quant_params(lo: f32, hi: f32, symmetric: bool) -> QuantParams {
    let (qmin, qmax) = if symmetric { (-127, 127) } else { (0, 255) };
    let (mut rmin, mut rmax) = (lo.min(0.0), hi.max(0.0));
    if symmetric {
        let a = rmin.abs().max(rmax.abs());
        (rmin, rmax) = (-a, a);
    }
    let scale = (rmax as f64 - rmin as f64) / (qmax - qmin) as f64;
    if scale < f32::MIN_POSITIVE as f64 {
        return QuantParams { qmin, qmax, scale: 1.0, zero_point: 0 };
    }
    let zero_point = if symmetric {
        ((qmin + qmax) as f64 / 2.0).round_ties_even() as i32
    } else {
        (qmin as f64 - rmin as f64 / scale).round_ties_even() as i32
    };
    QuantParams { qmin, qmax, scale: scale as f32, zero_point }
}

/// A histogram over `[lo, hi]` in equal bins: the one a method read (for symmetric percentile,
/// the histogram of `|x|` over `[0, hi]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    /// Lower edge of the first bin.
    pub lo: f64,
    /// Upper edge of the last bin.
    pub hi: f64,
    /// Counts per bin (whole numbers unless runs were re-binned).
    pub counts: Vec<f64>,
}

impl Histogram {
    /// The `counts.len() + 1` edges as `numpy.linspace(lo, hi, n + 1)` gives them in f64
    /// (`i * ((hi - lo) / n) + lo`, the last exactly `hi`), the edges the sketch kernel bins by.
    pub fn edges(&self) -> Vec<f64> {
        let n = self.counts.len();
        let step = (self.hi - self.lo) / n as f64;
        (0..=n).map(|i| if i == n { self.hi } else { i as f64 * step + self.lo }).collect()
    }
}

/// One tensor's calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorCalibration {
    /// Table key: `site/role` (see the module docs on tensor names).
    pub name: String,
    /// Site (ONNX node name, or `{op}.{k}`).
    pub site: String,
    /// Role at the site (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Pipeline position of the pass that recorded it.
    pub pass_idx: u32,
    /// The method that gave the range.
    pub method: CalibrationMethod,
    /// Lower end of the calibrated range (units of the tensor; ORT's `lowest`).
    pub lowest: f32,
    /// Upper end (ORT's `highest`).
    pub highest: f32,
    /// Smallest finite value recorded over all runs.
    pub data_min: f32,
    /// Largest finite value recorded over all runs.
    pub data_max: f32,
    /// Scale and zero point of `[lowest, highest]` (int8 symmetric or uint8 asymmetric, as the
    /// options asked).
    pub quant: QuantParams,
    /// The histogram the method read (percentile and entropy), as ORT's table stores it.
    pub histogram: Option<Histogram>,
    /// Runs that carried the statistics used.
    pub runs: usize,
    /// What a user should know about this number.
    pub notes: Vec<CalibrationNote>,
}

/// Something to know about a calibrated range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CalibrationNote {
    /// Runs had different histogram ranges (the default per-run absmax range) and were merged
    /// by re-binning: the histogram, and so the range, is approximate.
    Rebinned,
    /// Non-finite values (NaN, ±Inf) were recorded and left out, as the sketch does.
    NonFinite(f64),
    /// The data span only `span` bins of width `width` from 0 to their absmax (fewer than
    /// [`COARSE_BINS`]): the range moves in steps of more than 1/32 of it.
    Coarse {
        /// Bins from 0 to the data's absmax.
        span: usize,
        /// Bin width (units of the tensor).
        width: f64,
    },
    /// Entropy: the data lie within the narrowest candidate (`Q / 2` bins each side of 0), so
    /// the search returns the data's range, min-max.
    EntropyIsMinMax {
        /// Bins from 0 to the data's absmax.
        span: usize,
        /// Bin width.
        width: f64,
        /// `Q / 2`.
        half: usize,
    },
}

/// Fewer bins than this between 0 and a tensor's absmax make its histogram coarse
/// ([`CalibrationNote::Coarse`]): a threshold step is then more than 1/32 (3%) of the range.
/// opscope's choice (a 3% step in the clip range is about the step of a 5-bit grid), not a
/// published threshold.
pub const COARSE_BINS: usize = 32;

impl CalibrationNote {
    /// A few words for a table column.
    pub fn short(&self) -> String {
        match self {
            CalibrationNote::Rebinned => "re-binned".into(),
            CalibrationNote::NonFinite(n) => format!("{n} non-finite"),
            CalibrationNote::Coarse { span, .. } => format!("coarse: {span} bins"),
            CalibrationNote::EntropyIsMinMax { span, .. } => format!("= min-max: {span} bins"),
        }
    }

    /// What it means and the fix, without the tensor's numbers.
    pub fn explain(&self) -> &'static str {
        match self {
            CalibrationNote::Rebinned => "runs had different histogram ranges (the per-run absmax default) and were merged by re-binning: approximate; record with a fixed hist_range=-A:A",
            CalibrationNote::NonFinite(_) => "NaN or Inf values were recorded and left out of the range",
            CalibrationNote::Coarse { .. } => "the data cover fewer than 32 histogram bins from 0 to their absmax: the range moves in steps of more than 3%; record with a narrower hist_range",
            CalibrationNote::EntropyIsMinMax { .. } => "the data lie within the entropy search's narrowest candidate (half the quantized bins, 64 by default, each side of 0), so it returns min-max; record with a narrower hist_range",
        }
    }
}

impl fmt::Display for CalibrationNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalibrationNote::Rebinned => f.write_str("runs merged by re-binning (approximate)"),
            CalibrationNote::NonFinite(n) => write!(f, "{n} non-finite value(s) left out"),
            CalibrationNote::Coarse { span, width } => write!(f, "the data span {span} bins of width {width} from 0: the range moves in steps of {width}"),
            CalibrationNote::EntropyIsMinMax { span, width, half } => {
                write!(f, "the data span {span} bins of width {width} each side of 0, within the narrowest entropy candidate ({half} bins): min-max")
            }
        }
    }
}

impl TensorCalibration {
    /// `max(|lowest|, |highest|)`: TensorRT's dynamic range.
    pub fn amax(&self) -> f32 {
        self.lowest.abs().max(self.highest.abs())
    }

    /// The symmetric int8 scale `amax / 127` TensorRT's calibration cache stores (1 for an
    /// all-zero tensor, as ORT).
    pub fn trt_scale(&self) -> f32 {
        quant_params(self.lowest, self.highest, true).scale
    }
}

/// Why a tensor cannot be calibrated; each names the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    /// The series carries no tensor statistic at all (a probe's series: attention, routing).
    #[error("no tensor statistics (min, max, hist) recorded: not a tensor sketch")]
    NotATensor,
    /// `min` / `max` are missing.
    #[error("no min/max recorded: record with matmul{{stats=[min,max,hist],..}}")]
    NoMinMax,
    /// No run has a finite value.
    #[error("no finite value in {runs} run(s) (min/max NaN or empty tensor): nothing to calibrate")]
    NoFiniteValues {
        /// Runs seen.
        runs: usize,
    },
    /// No histogram for a histogram method.
    #[error(
        "no histogram recorded ({method} reads the value histogram): record with \
         matmul{{stats=[min,max,hist],hist_bins=2048,hist_range=-A:A}} (a fixed range wide enough for the data; \
         with the default per-run range runs merge approximately)"
    )]
    NoHistogram {
        /// The method asked for.
        method: &'static str,
    },
    /// The histogram holds no count.
    #[error("the merged histogram is empty")]
    EmptyHistogram,
    /// Values fell outside a fixed histogram range.
    #[error(
        "{outside} value(s) fell outside hist_range {lo}:{hi} (data {min}..{max}): the histogram \
         does not hold them; record with a hist_range covering the data, e.g. hist_range=-{a}:{a}"
    )]
    Outside {
        /// Values outside, summed over runs.
        outside: f64,
        /// Histogram range.
        lo: f64,
        /// Histogram range.
        hi: f64,
        /// Data minimum.
        min: f32,
        /// Data maximum.
        max: f32,
        /// A suggested bound (absmax rounded up).
        a: f64,
    },
    /// The histogram has no bin edge at 0.
    #[error(
        "the histogram over {lo}:{hi} in {bins} bins has no bin edge at 0, which the {what} \
         is centred on: record with hist_range=-A:A and an even hist_bins"
    )]
    NotCentred {
        /// Histogram range.
        lo: f64,
        /// Histogram range.
        hi: f64,
        /// Bins.
        bins: usize,
        /// What needs it.
        what: &'static str,
    },
    /// Too few bins for the entropy search.
    #[error(
        "entropy needs at least 2 x {quantized} = {need} histogram bins symmetric about 0 (here {bins}): \
         its candidate ranges run from {half} bins each side of 0 to the whole histogram, so with fewer \
         bins there is little or nothing to choose from; record with hist_bins=2048 (TensorRT's histogram \
         size; ORT's entropy calibrator at its own default of 128 bins returns the whole range)"
    )]
    TooFewBins {
        /// Bins the symmetric histogram has.
        bins: usize,
        /// Quantized bins `Q`.
        quantized: usize,
        /// `2 Q`.
        need: usize,
        /// `Q / 2`.
        half: usize,
    },
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// The computed range is not finite.
    #[error("the calibrated range {lo}..{hi} is not finite")]
    NotFinite {
        /// Lower end.
        lo: f32,
        /// Upper end.
        hi: f32,
    },
}

/// Sum of a scalar statistic over runs.
fn sum_of(runs: &[StepStats], stat: Stat) -> f64 {
    runs.iter().filter_map(|r| r.scalar(stat)).sum()
}

/// The histogram made symmetric about 0: `[-H w, H w]` in `2H` bins of the same width `w`, the
/// recorded bins in place and empty bins added on the short side. Errors if 0 is not a bin edge.
fn centred(h: &Histogram, what: &'static str) -> Result<Histogram, CalibrationError> {
    let n = h.counts.len();
    let w = (h.hi - h.lo) / n as f64;
    let not_centred = CalibrationError::NotCentred { lo: h.lo, hi: h.hi, bins: n, what };
    if !(w > 0.0) {
        return Err(not_centred);
    }
    let left = -h.lo / w; // bins between lo and 0 (negative when lo > 0)
    let l = left.round();
    if (left - l).abs() > 1e-6 * l.abs().max(1.0) {
        return Err(not_centred);
    }
    let (l, r) = (l as i64, n as i64 - l as i64);
    if l == r {
        return Ok(h.clone());
    }
    let half = l.max(r);
    let mut counts = vec![0.0; 2 * half as usize];
    let offset = (half - l) as usize;
    counts[offset..offset + n].copy_from_slice(&h.counts);
    Ok(Histogram { lo: -(half as f64) * w, hi: half as f64 * w, counts })
}

/// The histogram of `|x|` over `[0, H w]` from a centred one (`2H` bins): bin `k` holds the
/// signed bins `H + k` and `H - 1 - k`. (A negative value exactly on an edge lands one bin lower
/// than numpy would bin its absolute value.)
fn folded(h: &Histogram) -> Histogram {
    let half = h.counts.len() / 2;
    let counts = (0..half).map(|k| h.counts[half + k] + h.counts[half - 1 - k]).collect();
    Histogram { lo: 0.0, hi: h.hi, counts }
}

/// The first index with `cdf[i] >= v` (`numpy.searchsorted(cdf, v)`), `cdf.len()` if none.
fn searchsorted(cdf: &[f64], v: f64) -> usize {
    cdf.partition_point(|&c| c < v)
}

/// `cumsum(hist / total)` as numpy forms it (each term divided, then summed in order).
fn cdf(counts: &[f64]) -> Result<Vec<f64>, CalibrationError> {
    let total: f64 = counts.iter().sum();
    if !(total > 0.0) {
        return Err(CalibrationError::EmptyHistogram);
    }
    let mut acc = 0.0;
    Ok(counts.iter().map(|&c| {
        acc += c / total;
        acc
    })
    .collect())
}

/// ORT's `compute_percentile` before the clip to the data: the edges at the percentile cut(s).
fn percentile_range(h: &Histogram, p: f64, symmetric: bool) -> Result<(f64, f64), CalibrationError> {
    let cdf = cdf(&h.counts)?;
    let e = h.edges();
    if symmetric {
        let t = e[searchsorted(&cdf, p / 100.0)];
        return Ok((-t, t));
    }
    let cut = (100.0 - p) / 200.0;
    Ok((e[searchsorted(&cdf, cut)], e[searchsorted(&cdf, 1.0 - cut)]))
}

/// ORT's `smooth_distribution`: zeros become `eps`, non-zeros lose `eps * zeros / nonzeros`;
/// `None` when all are zero.
fn smooth(p: &[f64]) -> Option<Vec<f64>> {
    let zeros = p.iter().filter(|&&x| x == 0.0).count();
    let nonzeros = p.len() - zeros;
    if nonzeros == 0 {
        return None;
    }
    let eps1 = SMOOTH_EPS * zeros as f64 / nonzeros as f64;
    Some(p.iter().map(|&x| if x == 0.0 { SMOOTH_EPS } else { x - eps1 }).collect())
}

/// KL(p || q) of the normalized distributions in nats, as ORT's `entropy` (scipy's `rel_entr`
/// rules: a term with `p = 0` is 0, one with `p < 0` or `q <= 0` is infinite).
fn kl(p: &[f64], q: &[f64]) -> f64 {
    let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let (a, b) = (a / sp, b / sq);
            if a > 0.0 && b > 0.0 {
                a * (a / b).ln()
            } else if a == 0.0 && b >= 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        })
        .sum()
}

/// The KL of one entropy candidate: the slice `[start, end)` of `counts`, `qbins` quantized bins.
fn candidate_kl(counts: &[f64], start: usize, end: usize, qbins: usize) -> f64 {
    let sliced = &counts[start..end];
    let mut p = sliced.to_vec();
    let last = p.len() - 1;
    p[0] += counts[..start].iter().sum::<f64>();
    p[last] += counts[end..].iter().sum::<f64>();
    let merged = sliced.len() / qbins;
    // Quantized bins, truncated to integers as ORT's int64 arrays hold them.
    let mut quantized: Vec<f64> = (0..qbins).map(|k| sliced[k * merged..(k + 1) * merged].iter().sum::<f64>().trunc()).collect();
    quantized[qbins - 1] = (quantized[qbins - 1] + sliced[qbins * merged..].iter().sum::<f64>()).trunc();
    let mut q = vec![0.0; p.len()];
    for (k, &qb) in quantized.iter().enumerate() {
        let group = k * merged..(k + 1) * merged;
        let norm = p[group.clone()].iter().filter(|&&x| x != 0.0).count();
        if norm != 0 {
            q[group].fill((qb / norm as f64).trunc());
        }
    }
    match (smooth(&p), smooth(&q)) {
        (Some(p), Some(q)) => kl(&p, &q),
        _ => f64::INFINITY,
    }
}

/// ORT's `get_entropy_threshold` before the clip to the data, on a centred histogram.
fn entropy_range(h: &Histogram, qbins: usize) -> Result<(f64, f64), CalibrationError> {
    let n = h.counts.len();
    if n < 2 * qbins {
        return Err(CalibrationError::TooFewBins { bins: n, quantized: qbins, need: 2 * qbins, half: qbins / 2 });
    }
    let (zero, half_q) = (n / 2, qbins / 2);
    let e = h.edges();
    let mut best = (f64::INFINITY, (e[zero - half_q], e[(zero + half_q + 1).min(n)]));
    let mut first = true;
    for i in half_q..=zero {
        let (start, end) = (zero - i, (zero + i + 1).min(n));
        let d = candidate_kl(&h.counts, start, end, qbins);
        // numpy's argmin: the first smallest (an all-infinite curve picks the first candidate).
        if first || d < best.0 {
            best = (d, (e[start], e[end]));
            first = false;
        }
    }
    Ok(best.1)
}

/// Calibrate one series (all its runs). `key` names it.
///
/// Errors: see [`CalibrationError`]; each names the fix.
pub fn calibrate(key: &SeriesKey, s: &Series, o: &CalibrationOptions) -> Result<TensorCalibration, CalibrationError> {
    o.validate()?;
    let has = |st: Stat| s.runs.iter().any(|r| r.has(st));
    if !has(tensor::MIN) && !has(tensor::MAX) && !has(tensor::HIST) {
        return Err(CalibrationError::NotATensor);
    }
    if !has(tensor::MIN) || !has(tensor::MAX) {
        return Err(CalibrationError::NoMinMax);
    }
    let with_range: Vec<&StepStats> = s.runs.iter().filter(|r| r.scalar(tensor::MIN).is_some() && r.scalar(tensor::MAX).is_some()).collect();
    if with_range.is_empty() {
        return Err(CalibrationError::NoFiniteValues { runs: s.runs.len() });
    }
    let data_min = with_range.iter().filter_map(|r| r.scalar(tensor::MIN)).fold(f64::INFINITY, f64::min) as f32;
    let data_max = with_range.iter().filter_map(|r| r.scalar(tensor::MAX)).fold(f64::NEG_INFINITY, f64::max) as f32;
    let mut notes = Vec::new();
    let nonfinite = sum_of(&s.runs, tensor::NAN_COUNT) + sum_of(&s.runs, tensor::POSINF_COUNT) + sum_of(&s.runs, tensor::NEGINF_COUNT);
    if nonfinite > 0.0 {
        notes.push(CalibrationNote::NonFinite(nonfinite));
    }
    let clip = |(lo, hi): (f64, f64)| -> (f32, f32) { ((lo as f32).max(data_min), (hi as f32).min(data_max)) };

    let mut runs = with_range.len();
    let mut histogram = None;
    let (lowest, highest) = match o.method {
        CalibrationMethod::MinMax => {
            let (lo, hi) = match o.averaging {
                RangeAveraging::Extremes => (data_min, data_max),
                RangeAveraging::Mean => {
                    let n = with_range.len() as f64;
                    let lo: f64 = with_range.iter().filter_map(|r| r.scalar(tensor::MIN)).sum();
                    let hi: f64 = with_range.iter().filter_map(|r| r.scalar(tensor::MAX)).sum();
                    ((lo / n) as f32, (hi / n) as f32)
                }
                RangeAveraging::Ema(c) => {
                    let ema = |stat: Stat| {
                        let mut v = with_range.iter().filter_map(|r| r.scalar(stat));
                        let first = v.next().unwrap_or(f64::NAN);
                        v.fold(first, |m, x| m + c * (x - m)) as f32
                    };
                    (ema(tensor::MIN), ema(tensor::MAX))
                }
            };
            if o.symmetric {
                let a = lo.abs().max(hi.abs());
                (-a, a)
            } else {
                (lo, hi)
            }
        }
        CalibrationMethod::Percentile(_) | CalibrationMethod::Entropy => {
            let Some(m) = merged_histogram(s, None) else {
                return Err(CalibrationError::NoHistogram { method: o.method.name() });
            };
            runs = m.runs;
            if m.outside > 0.0 {
                let a = (data_min.abs().max(data_max.abs()) as f64).ceil();
                return Err(CalibrationError::Outside { outside: m.outside, lo: m.lo, hi: m.hi, min: data_min, max: data_max, a });
            }
            if !m.exact {
                notes.push(CalibrationNote::Rebinned);
            }
            let h = Histogram { lo: m.lo, hi: m.hi, counts: m.counts };
            if data_min == data_max {
                histogram = Some(h);
                (data_min, data_max)
            } else {
                let (range, used) = match o.method {
                    CalibrationMethod::Percentile(p) if o.symmetric => {
                        let f = folded(&centred(&h, "histogram of |x| (symmetric percentile)")?);
                        (percentile_range(&f, p, true)?, f)
                    }
                    CalibrationMethod::Percentile(p) => (percentile_range(&h, p, false)?, h),
                    _ => {
                        let c = centred(&h, "entropy search")?;
                        (entropy_range(&c, o.quantized_bins)?, c)
                    }
                };
                // Resolution: bins from 0 to the data's absmax.
                let width = (used.hi - used.lo) / used.counts.len() as f64;
                let span = (data_min.abs().max(data_max.abs()) as f64 / width).ceil() as usize;
                let half = o.quantized_bins / 2;
                if o.method == CalibrationMethod::Entropy && span <= half {
                    notes.push(CalibrationNote::EntropyIsMinMax { span, width, half });
                } else if span < COARSE_BINS {
                    notes.push(CalibrationNote::Coarse { span, width });
                }
                histogram = Some(used);
                clip(range)
            }
        }
    };
    if !lowest.is_finite() || !highest.is_finite() {
        return Err(CalibrationError::NotFinite { lo: lowest, hi: highest });
    }
    Ok(TensorCalibration {
        name: format!("{}/{}", key.0, key.1),
        site: key.0.clone(),
        role: key.1.clone(),
        pass_idx: key.2,
        method: o.method,
        lowest,
        highest,
        data_min,
        data_max,
        quant: quant_params(lowest, highest, o.symmetric),
        histogram,
        runs,
        notes,
    })
}

/// Every series of a recording calibrated.
#[derive(Debug, Clone, Default)]
pub struct CalibrationTable {
    /// Tensors calibrated, in series order (site, role, pass).
    pub tensors: Vec<TensorCalibration>,
    /// Tensors that could not be calibrated, by name, with the reason.
    pub failed: Vec<(String, CalibrationError)>,
    /// Series without tensor statistics (probe passes), left out.
    pub not_tensors: usize,
}

/// Calibrate every series of a recording that carries tensor statistics. Names are `site/role`,
/// with `/pass<k>` appended where two passes recorded tensor statistics of the same site and
/// role (a pass that recorded none there, such as a `capture` beside the `matmul` tap, does not
/// count).
pub fn calibrate_all(series: &BTreeMap<SeriesKey, Series>, o: &CalibrationOptions) -> CalibrationTable {
    let results: Vec<(&SeriesKey, Result<TensorCalibration, CalibrationError>)> = series.iter().map(|(k, s)| (k, calibrate(k, s, o))).collect();
    let mut seen: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (k, r) in &results {
        if !matches!(r, Err(CalibrationError::NotATensor)) {
            *seen.entry((&k.0, &k.1)).or_default() += 1;
        }
    }
    let mut t = CalibrationTable::default();
    for (k, r) in results {
        let name = match seen.get(&(k.0.as_str(), k.1.as_str())) {
            Some(1) | None => format!("{}/{}", k.0, k.1),
            Some(_) => format!("{}/{}/pass{}", k.0, k.1, k.2),
        };
        match r {
            Ok(c) => t.tensors.push(TensorCalibration { name, ..c }),
            Err(CalibrationError::NotATensor) => t.not_tensors += 1,
            Err(e) => t.failed.push((name, e)),
        }
    }
    t
}

/// numpy's JSON form of a value as ORT's `CalibrationCacheEncoder` writes an array.
fn np_array(data: Value, dtype: &str) -> Value {
    json!({"data": data, "dtype": dtype, "CLS": "numpy.array"})
}

/// The calibration table as ONNX Runtime writes it (`write_calibration_table`'s
/// `calibration.json`, `save_tensors_data`): `{"CLS": "TensorsData", "data": {name: {"lowest",
/// "highest"[, "hist", "bins"], "CLS": "TensorData"}}, "calibration_method": {"CLS":
/// "CalibrationMethod", "value": "CalibrationMethod.<M>"}, "smooth_quant": false}`, loadable with
/// `onnxruntime.quantization.calibrate.load_tensors_data` and usable as `quantize_static`'s
/// `calibration_cache_path` (with the same `calibrate_method`). Min-max ranges are plain floats,
/// histogram ranges float32 arrays with the histogram (`hist`) and its edges (`bins`), as ORT
/// writes each. ORT ignores the extra top-level `"opscope"` object: the options, and per tensor
/// site, role, scale, zero point and runs.
pub fn ort_json(tensors: &[TensorCalibration], o: &CalibrationOptions) -> Value {
    let mut data = serde_json::Map::new();
    let mut ours = serde_json::Map::new();
    for t in tensors {
        let mut d = serde_json::Map::new();
        match &t.histogram {
            None => {
                d.insert("lowest".into(), json!(t.lowest));
                d.insert("highest".into(), json!(t.highest));
            }
            Some(h) => {
                d.insert("lowest".into(), np_array(json!(t.lowest), "float32"));
                d.insert("highest".into(), np_array(json!(t.highest), "float32"));
                let whole = h.counts.iter().all(|c| c.fract() == 0.0 && c.abs() < 9e15);
                let hist = if whole {
                    np_array(json!(h.counts.iter().map(|&c| c as i64).collect::<Vec<_>>()), "int64")
                } else {
                    np_array(json!(h.counts), "float64")
                };
                d.insert("hist".into(), hist);
                let edges: Vec<f32> = h.edges().into_iter().map(|e| e as f32).collect();
                d.insert("bins".into(), np_array(json!(edges), "float32"));
            }
        }
        d.insert("CLS".into(), json!("TensorData"));
        data.insert(t.name.clone(), Value::Object(d));
        ours.insert(
            t.name.clone(),
            json!({
                "site": t.site, "role": t.role, "pass_idx": t.pass_idx,
                "scale": t.quant.scale, "zero_point": t.quant.zero_point, "dtype": t.quant.dtype(),
                "trt_scale": t.trt_scale(), "data_min": t.data_min, "data_max": t.data_max,
                "runs": t.runs, "notes": t.notes.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            }),
        );
    }
    let percentile = match o.method {
        CalibrationMethod::Percentile(p) => json!(p),
        _ => Value::Null,
    };
    let constant = match o.averaging {
        RangeAveraging::Ema(c) => json!(c),
        _ => Value::Null,
    };
    json!({
        "CLS": "TensorsData",
        "data": data,
        "calibration_method": {"CLS": "CalibrationMethod", "value": format!("CalibrationMethod.{}", o.method.ort_name())},
        "smooth_quant": false,
        "opscope": {
            "method": o.method.name(), "percentile": percentile, "symmetric": o.symmetric,
            "average": o.averaging.name(), "averaging_constant": constant,
            "quantized_bins": o.quantized_bins,
            "tensor_names": "site/role: the recording does not hold ONNX tensor names",
            "tensors": ours,
        },
    })
}

/// The table as a TensorRT calibration cache: the header `TRT-<trt_version>-EntropyCalibration2`
/// (the calibrator class TensorRT reads the file with, `IInt8EntropyCalibrator2`, whatever method
/// computed the ranges; `trt_version` as TensorRT writes it, 8601 for 8.6.1), then one line
/// `<name>: <scale>` per tensor, the scale [`TensorCalibration::trt_scale`] (`amax / 127`) as the
/// 8 hex digits of its f32 bits, most significant first (NVIDIA's sampleINT8 "Calibration file";
/// `struct.unpack('>f', bytes.fromhex(h))` reads it back).
///
/// Errors: a name holding a line break (it would break the line format).
pub fn trt_cache(tensors: &[TensorCalibration], trt_version: u32) -> Result<String, CalibrationError> {
    let mut out = format!("TRT-{trt_version}-EntropyCalibration2\n");
    for t in tensors {
        if t.name.contains(['\n', '\r']) {
            return Err(CalibrationError::Options(format!("tensor name {:?} holds a line break: not expressible in a TensorRT cache", t.name)));
        }
        out.push_str(&format!("{}: {:08x}\n", t.name, t.trt_scale().to_bits()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mutation survivors (the lab's onnxruntime comparison does not reach these): the bin-count
    /// line is 2, a zero-width histogram is refused, `amax` is the larger magnitude.
    #[test]
    fn options_line_zero_width_histogram_and_amax() {
        let mut o = CalibrationOptions::new(CalibrationMethod::Entropy);
        o.quantized_bins = 2;
        assert!(o.validate().is_ok());
        o.quantized_bins = 1;
        assert!(matches!(o.validate(), Err(CalibrationError::Options(_))));
        let flat = Histogram { lo: 1.5, hi: 1.5, counts: vec![4.0, 0.0] };
        assert!(matches!(centred(&flat, "test"), Err(CalibrationError::NotCentred { .. })));
        let t = TensorCalibration {
            name: "x".into(),
            site: "s".into(),
            role: "lhs".into(),
            pass_idx: 0,
            method: CalibrationMethod::MinMax,
            lowest: -3.0,
            highest: 2.0,
            data_min: -3.0,
            data_max: 2.0,
            quant: quant_params(-3.0, 2.0, true),
            histogram: None,
            runs: 1,
            notes: vec![],
        };
        assert_eq!(t.amax(), 3.0);
        assert_eq!(TensorCalibration { lowest: -1.0, highest: 4.0, ..t }.amax(), 4.0);
    }

    #[test]
    fn a_pass_suffix_only_where_two_passes_recorded_tensor_statistics() {
        use std::sync::Arc;
        let row = |site: &str, pass_idx: u32, stat: &str, value: f32| crate::recording::Row {
            run_id: Arc::from("r"),
            compile: 1,
            step: 0,
            graph: Arc::from("g"),
            pass: Arc::from(if pass_idx == 0 { "matmul" } else { "capture" }),
            pass_idx,
            site: Arc::from(site),
            op: Arc::from("matmul"),
            role: Arc::from("lhs"),
            stat: Arc::from(stat),
            idx: 0,
            value,
            numel: None,
            shape: Arc::from("[4]"),
            flops: None,
        };
        let rows = vec![
            // `a`: min and max from pass 0; pass 1 (a capture) counts only.
            row("a", 0, "count", 4.0),
            row("a", 0, "min", -1.0),
            row("a", 0, "max", 2.0),
            row("a", 1, "count", 4.0),
            // `b`: min and max from two passes.
            row("b", 0, "count", 4.0),
            row("b", 0, "min", -1.0),
            row("b", 0, "max", 2.0),
            row("b", 1, "count", 4.0),
            row("b", 1, "min", -3.0),
            row("b", 1, "max", 3.0),
        ];
        let t = calibrate_all(&crate::mine::series_from_rows(&rows), &CalibrationOptions::new(CalibrationMethod::MinMax));
        let names: Vec<(&str, f32)> = t.tensors.iter().map(|c| (c.name.as_str(), c.lowest)).collect();
        assert_eq!(names, vec![("a/lhs", -1.0), ("b/lhs/pass0", -1.0), ("b/lhs/pass1", -3.0)]);
        assert_eq!(t.not_tensors, 1);
    }

    #[test]
    fn scale_and_zero_point_follow_ort() {
        // uint8: [-1, 3] -> scale 4/255, zp round(255/4) = round(63.75) = 64.
        let q = quant_params(-1.0, 3.0, false);
        assert_eq!((q.qmin, q.qmax, q.scale, q.zero_point), (0, 255, (4.0f64 / 255.0) as f32, 64));
        // The range is widened to hold 0: [2, 3] -> [0, 3], zp 0.
        assert_eq!(quant_params(2.0, 3.0, false).zero_point, 0);
        // int8 symmetric: absmax / 127, zp 0.
        let q = quant_params(-1.0, 3.0, true);
        assert_eq!((q.qmin, q.qmax, q.scale, q.zero_point), (-127, 127, (3.0f64 / 127.0) as f32, 0));
        // An all-zero tensor: scale 1, zp 0.
        assert_eq!(quant_params(0.0, 0.0, false), QuantParams { qmin: 0, qmax: 255, scale: 1.0, zero_point: 0 });
        // Half to even: [-0.5*s, 254.5*s] with s = 1 gives zp round(0.5) = 0.
        assert_eq!(quant_params(-0.5, 254.5, false).zero_point, 0);
    }

    #[test]
    fn centring_pads_the_short_side_and_refuses_an_off_grid_zero() {
        // [0, 4] in 4 bins: 0 is an edge; 4 empty bins are added below it.
        let h = Histogram { lo: 0.0, hi: 4.0, counts: vec![1.0, 2.0, 3.0, 4.0] };
        let c = centred(&h, "t").unwrap();
        assert_eq!((c.lo, c.hi), (-4.0, 4.0));
        assert_eq!(c.counts, vec![0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]);
        // [-1, 3] in 4 bins: one bin below 0, three above -> [-3, 3] in 6 bins.
        let h = Histogram { lo: -1.0, hi: 3.0, counts: vec![1.0, 2.0, 3.0, 4.0] };
        let c = centred(&h, "t").unwrap();
        assert_eq!((c.lo, c.hi, c.counts.clone()), (-3.0, 3.0, vec![0.0, 0.0, 1.0, 2.0, 3.0, 4.0]));
        // |x| bins [0,1], [1,2], [2,3]: 2 + 1, 3 + 0, 4 + 0.
        assert_eq!(folded(&c).counts, vec![3.0, 3.0, 4.0]);
        // [-1, 1] in 3 bins: 0 is inside the middle bin.
        let h = Histogram { lo: -1.0, hi: 1.0, counts: vec![1.0, 1.0, 1.0] };
        assert!(matches!(centred(&h, "t"), Err(CalibrationError::NotCentred { .. })));
    }

    #[test]
    fn percentile_takes_the_lower_edge_of_the_bin_where_the_cdf_crosses() {
        // 8 bins over [0, 8], one count each: cdf 1/8, 2/8, ..., 1 (exact). p = 75 cuts 1/8 a
        // side: cdf >= 1/8 first at bin 0 (edge 0), cdf >= 7/8 first at bin 6 (edge 6).
        let h = Histogram { lo: 0.0, hi: 8.0, counts: vec![1.0; 8] };
        assert_eq!(percentile_range(&h, 75.0, false).unwrap(), (0.0, 6.0));
        // p = 100: the last bin's lower edge, 7, not 8 (ORT's edges[idx]).
        assert_eq!(percentile_range(&h, 100.0, false).unwrap(), (0.0, 7.0));
        // Symmetric, on |x|: cdf >= 0.75 first at bin 5 -> [-5, 5].
        assert_eq!(percentile_range(&h, 75.0, true).unwrap(), (-5.0, 5.0));
    }
}
