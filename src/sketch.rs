//! Sketches: the small summaries a tap computes on a tensor, and the native RLX op that computes
//! them in one call.
//!
//! A tap appends one [`SKETCH_OP`] node per tapped tensor. The node's attributes carry a
//! [`SketchSpec`] (which [`Stat`]s, histogram and signature parameters, the tensor's row/channel
//! geometry); its output is one flat `[len]` F32 vector whose layout [`SketchSpec::layout`] gives.
//! The CPU kernel reads the tensor twice (moments, extremes, counts, per-channel and per-row
//! vectors in the first pass; centred moments and the histogram in the second), summing within a
//! row in 8 f32 lanes and across rows in f64, so the cost does not grow with the number of
//! statistics. A tensor of 2^24 elements or more has inexact f32 counts (relative error < 6e-8).
//!
//! Non-finite values (NaN, +Inf, -Inf) are counted in `nan_count`, `posinf_count`,
//! `neginf_count` and excluded from every other statistic. A statistic that is undefined for the
//! data (the mean of no finite values, the kurtosis of a constant) is written as NaN by the
//! kernel and dropped by [`crate::record`] before it reaches a sink: a recording never carries
//! a made-up number.

use std::sync::{Arc, Once};

use rlx_cpu::op_registry::{CpuKernel, CpuTensorMut, CpuTensorRef};
use rlx_ir::op_registry::OpExtension;
use rlx_ir::{DType, Dim, Shape};
use serde::{Deserialize, Serialize};

/// Name of the custom RLX op that computes a sketch (`Op::Custom { name: SKETCH_OP, .. }`).
pub const SKETCH_OP: &str = "opscope.sketch";

/// Name of the custom op `keep(sketch, anchor) -> sketch`: a copy of its first input that also
/// reads a run-time tensor. A sketch of a weight is param-invariant; routing it through `keep`
/// lets RLX's `cache_param_invariant` hoist the sketch into the run-once prepare graph while the
/// value still reaches the main graph's outputs (RLX 0.2.19 returns a hoisted value that is
/// itself a graph output unfilled: measured, all zeros).
pub const KEEP_OP: &str = "opscope.keep";

/// The sketch op with two inputs (attention probabilities and their mask, a router's scores
/// and chosen experts, a residual stream and its branch): same attributes, a
/// [`crate::probes::Probe`] says how the inputs are read.
pub const SKETCH2_OP: &str = "opscope.sketch2";

/// The sketch op with three inputs (fused attention's Q, K and mask).
pub const SKETCH3_OP: &str = "opscope.sketch3";

/// True for the name of any opscope sketch op (one, two or three inputs).
pub fn is_sketch_op(name: &str) -> bool {
    name == SKETCH_OP || name == SKETCH2_OP || name == SKETCH3_OP
}

/// One statistic of a sketch. The string form (`as_str`) is the `stat` column of a recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stat {
    /// Number of finite elements (1 value). Always present: every other statistic is over it.
    Count,
    /// Smallest finite value (1 value).
    Min,
    /// Largest finite value (1 value).
    Max,
    /// Mean of the finite values (1 value).
    Mean,
    /// Sum of |x| over finite values (1 value).
    L1,
    /// Sum of x^2 over finite values (1 value).
    Sumsq,
    /// Number of finite non-zero values (1 value); density = nnz / count.
    Nnz,
    /// Kurtosis E[(x-mu)^4] / E[(x-mu)^2]^2 over finite values (1 value; 3 for a Gaussian).
    Kurtosis,
    /// Value histogram (`hist_bins` values, counts). Range given by `hist_lo` / `hist_hi`.
    Hist,
    /// Lower edge of the histogram range (1 value).
    HistLo,
    /// Upper edge of the histogram range (1 value).
    HistHi,
    /// Finite values outside a fixed histogram range (1 value; always 0 for the absmax range).
    HistOutside,
    /// `elemsig_k` elements at evenly spaced flat indices `floor(j * numel / k)` (raw values).
    Elemsig,
    /// max |x| per last-axis channel (`C` values).
    ChanMaxabs,
    /// max(chan_maxabs) / mean(chan_maxabs) (1 value).
    ChanOutlier,
    /// Sum of x^2 per row, all leading axes flattened (`R = numel / C` values).
    PosSumsq,
    /// Sum over adjacent row pairs of ||x_r - x_{r-1}||^2 (1 value). Rows are adjacent along the
    /// second-to-last axis; pairs never cross a leading (batch/head) index.
    AdjSumsq,
    /// Number of NaN elements (1 value).
    NanCount,
    /// Number of +Inf elements (1 value).
    PosinfCount,
    /// Number of -Inf elements (1 value).
    NeginfCount,
    // ---- attention probes (`attn` tap; see `crate::probes`) ----
    /// Non-padding queries `(batch, query)` the attention statistics average over (1 value).
    Queries,
    /// Mean non-padding keys per sequence (1 value).
    Keys,
    /// Per head: mean over non-padding queries of the largest probability (`H` values).
    Peak,
    /// Per head: mean over non-padding queries of the entropy `-sum p ln p`, in nats (`H`).
    Entropy,
    /// Per head: mean over non-padding queries of entropy / ln(allowed keys), in [0, 1] (`H`).
    EntropyNorm,
    /// The `k` of `topk_mass` (1 value).
    Topk,
    /// Per head: mean over non-padding queries of the mass on the `topk` most probable keys (`H`).
    TopkMass,
    /// Per head: mean probability non-padding queries give the first non-padding key (`H`).
    SinkFirst,
    /// Per head: mean probability non-padding queries give the last non-padding key (`H`).
    SinkLast,
    /// Per head: mean probability mass non-padding queries give padding keys (`H`; 0 when the
    /// mask works).
    PadMass,
    /// Per head: mean over sequences of the largest received mass of one non-padding key, the
    /// received mass being the mean probability over the sequence's non-padding queries (`H`).
    RecvMax,
    /// Per (head, query position): mean over sequences of the peak probability (`H x Sq`,
    /// row-major; undefined positions, padding in every sequence, are not recorded).
    PeakPos,
    /// Per (head, key position): mean over sequences of the key's received mass (`H x Sk`).
    RecvPos,
    // ---- routing probes (`route` tap) ----
    /// Routed tokens (rows) in this run (1 value).
    Tokens,
    /// Per expert: number of (token, choice) assignments (`E` values; 0 for a dead expert).
    Load,
    /// Per expert: sum of the gate probabilities of the assignments it received (`E`).
    GateMass,
    /// Per expert: sum over tokens of its gate probability, chosen or not (`E`; the
    /// "importance" of Shazeer et al. 2017).
    Importance,
    /// Mean over tokens of the gate probability mass on the chosen experts (1 value).
    KeptMass,
    /// Expert ids that are not an integer in [0, E) (1 value; must be 0).
    BadIds,
    // ---- residual probes (`residual` tap) ----
    /// Rows (tokens) of the residual stream in this run, padding rows excluded (1 value).
    Rows,
    /// ||f(x)||_F / ||x||_F over the whole tensor (1 value).
    Ratio,
    /// Mean over rows of cos(x_r, x_r + f(x)_r) (1 value; 1 - this is ShortGPT's block influence).
    Cos,
    /// Per row: cos(x_r, x_r + f(x)_r) (`R` values; padding rows and zero vectors are NaN and
    /// not recorded).
    CosRow,
}

impl Stat {
    /// Every statistic, in layout order.
    pub const ALL: [Stat; 43] = [
        Stat::Count,
        Stat::Min,
        Stat::Max,
        Stat::Mean,
        Stat::L1,
        Stat::Sumsq,
        Stat::Nnz,
        Stat::Kurtosis,
        Stat::Hist,
        Stat::HistLo,
        Stat::HistHi,
        Stat::HistOutside,
        Stat::Elemsig,
        Stat::ChanMaxabs,
        Stat::ChanOutlier,
        Stat::PosSumsq,
        Stat::AdjSumsq,
        Stat::NanCount,
        Stat::PosinfCount,
        Stat::NeginfCount,
        Stat::Queries,
        Stat::Keys,
        Stat::Peak,
        Stat::Entropy,
        Stat::EntropyNorm,
        Stat::Topk,
        Stat::TopkMass,
        Stat::SinkFirst,
        Stat::SinkLast,
        Stat::PadMass,
        Stat::RecvMax,
        Stat::PeakPos,
        Stat::RecvPos,
        Stat::Tokens,
        Stat::Load,
        Stat::GateMass,
        Stat::Importance,
        Stat::KeptMass,
        Stat::BadIds,
        Stat::Rows,
        Stat::Ratio,
        Stat::Cos,
        Stat::CosRow,
    ];

    /// The name used in pipeline options and in the `stat` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Stat::Count => "count",
            Stat::Min => "min",
            Stat::Max => "max",
            Stat::Mean => "mean",
            Stat::L1 => "l1",
            Stat::Sumsq => "sumsq",
            Stat::Nnz => "nnz",
            Stat::Kurtosis => "kurtosis",
            Stat::Hist => "hist",
            Stat::HistLo => "hist_lo",
            Stat::HistHi => "hist_hi",
            Stat::HistOutside => "hist_outside",
            Stat::Elemsig => "elemsig",
            Stat::ChanMaxabs => "chan_maxabs",
            Stat::ChanOutlier => "chan_outlier",
            Stat::PosSumsq => "pos_sumsq",
            Stat::AdjSumsq => "adj_sumsq",
            Stat::NanCount => "nan_count",
            Stat::PosinfCount => "posinf_count",
            Stat::NeginfCount => "neginf_count",
            Stat::Queries => "queries",
            Stat::Keys => "keys",
            Stat::Peak => "peak",
            Stat::Entropy => "entropy",
            Stat::EntropyNorm => "entropy_norm",
            Stat::Topk => "topk",
            Stat::TopkMass => "topk_mass",
            Stat::SinkFirst => "sink_first",
            Stat::SinkLast => "sink_last",
            Stat::PadMass => "pad_mass",
            Stat::RecvMax => "recv_max",
            Stat::PeakPos => "peak_pos",
            Stat::RecvPos => "recv_pos",
            Stat::Tokens => "tokens",
            Stat::Load => "load",
            Stat::GateMass => "gate_mass",
            Stat::Importance => "importance",
            Stat::KeptMass => "kept_mass",
            Stat::BadIds => "bad_ids",
            Stat::Rows => "rows",
            Stat::Ratio => "ratio",
            Stat::Cos => "cos",
            Stat::CosRow => "cos_row",
        }
    }

    /// Parse a statistic name (the inverse of [`Stat::as_str`]).
    pub fn parse(s: &str) -> Option<Stat> {
        Stat::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Statistics a user selects by name; `hist` brings `hist_lo`, `hist_hi`, `hist_outside`
    /// along, and `count` is always included.
    pub const SELECTABLE: [Stat; 16] = [
        Stat::Min,
        Stat::Max,
        Stat::Mean,
        Stat::L1,
        Stat::Sumsq,
        Stat::Nnz,
        Stat::Kurtosis,
        Stat::Hist,
        Stat::Elemsig,
        Stat::ChanMaxabs,
        Stat::ChanOutlier,
        Stat::PosSumsq,
        Stat::AdjSumsq,
        Stat::NanCount,
        Stat::PosinfCount,
        Stat::NeginfCount,
    ];

    /// True if the statistic is a vector (its rows carry `idx`), false for one value.
    /// For probe statistics the answer is per probe: everything but the counts is a vector.
    pub fn is_vector(self) -> bool {
        !matches!(
            self,
            Stat::Count
                | Stat::Min
                | Stat::Max
                | Stat::Mean
                | Stat::L1
                | Stat::Sumsq
                | Stat::Nnz
                | Stat::Kurtosis
                | Stat::HistLo
                | Stat::HistHi
                | Stat::HistOutside
                | Stat::ChanOutlier
                | Stat::AdjSumsq
                | Stat::NanCount
                | Stat::PosinfCount
                | Stat::NeginfCount
                | Stat::Queries
                | Stat::Keys
                | Stat::Topk
                | Stat::Tokens
                | Stat::KeptMass
                | Stat::BadIds
                | Stat::Rows
                | Stat::Ratio
                | Stat::Cos
        )
    }

    /// True if a NaN in this slot means "undefined for this data" (dropped from recordings).
    /// Every statistic: a sampled `elemsig` element that is itself NaN is left out too
    /// (`nan_count` counts it), so that a recording never carries a NaN.
    pub fn nan_means_undefined(self) -> bool {
        true
    }
}

/// Range of the value histogram.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum HistRange {
    /// [-max|x|, +max|x|] of the finite values of this tensor on this run (scale-normalized,
    /// as PyTorch's `HistogramObserver` and ONNX Runtime's entropy/percentile calibrators do).
    /// An all-zero tensor uses [-1, 1].
    Absmax,
    /// A fixed `[lo, hi]` range (`hi` falls in the last bin, as in `numpy.histogram`); finite
    /// values outside it are counted in `hist_outside`.
    Fixed {
        /// Lower edge (the first bin starts here).
        lo: f32,
        /// Upper edge (included in the last bin).
        hi: f32,
    },
}

/// What to compute on one tensor, and the geometry needed to lay the result out.
///
/// Serialized (JSON) into the custom op's attribute bytes, so the op is self-describing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SketchSpec {
    /// Selected statistics, sorted in [`Stat::ALL`] order, `count` included.
    pub stats: Vec<Stat>,
    /// Number of histogram bins (>= 1).
    pub hist_bins: usize,
    /// Histogram range.
    pub hist_range: HistRange,
    /// Number of sampled elements for `elemsig` (>= 1).
    pub elemsig_k: usize,
    /// Last-axis length `C` (1 for a scalar; 0 if symbolic, with the per-channel statistics
    /// dropped). Sets the length of `chan_maxabs`.
    pub chans: usize,
    /// Rows `R = numel / C` (0 if symbolic, with `pos_sumsq` dropped). Sets the length of
    /// `pos_sumsq`.
    pub rows: usize,
    /// Compile tag, written as output value 0 so a recorder can tell which compiled graph a
    /// run's outputs came from. Statistics start at offset 1.
    pub tag: u32,
    /// The tensor is a weight (param-invariant): the kernel memoizes its sketch by the exact
    /// content (a 128-bit XXH3 of the bytes, about 20x cheaper than sketching), so an unchanged
    /// weight is not re-sketched on every call, and a changed one is.
    #[serde(default)]
    pub memo: bool,
    /// What the op reads: one tensor (the default), or the inputs of an attention, routing or
    /// residual probe (see [`crate::probes::Probe`]).
    #[serde(default)]
    pub probe: crate::probes::Probe,
}

/// Where one statistic sits in a sketch's output vector.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    /// The statistic.
    pub stat: Stat,
    /// Offset of its first value in the output vector.
    pub offset: usize,
    /// Number of values.
    pub len: usize,
}

/// Why a tensor cannot be sketched (recorded in the manifest, never a panic).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unsketchable {
    /// The tensor's element type is not F32.
    #[error("dtype {0:?} is not F32 (sketches read f32 values)")]
    NotF32(DType),
}

/// A sketch spec, and the statistics that had to be dropped for this shape with the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// What will be computed.
    pub spec: SketchSpec,
    /// Selected statistics that cannot be computed on this shape, and why.
    pub dropped: Vec<(Stat, String)>,
}

/// Render a shape as `[2,16,384]` (symbolic dims as `?N`).
pub fn shape_text(shape: &Shape) -> String {
    let dims: Vec<String> = shape
        .dims()
        .iter()
        .map(|d| match d {
            Dim::Static(n) => n.to_string(),
            Dim::Dynamic(s) => format!("?{s}"),
        })
        .collect();
    format!("[{}]", dims.join(","))
}

/// Static dims of a shape, or `None` if any is symbolic.
pub fn static_dims(shape: &Shape) -> Option<Vec<usize>> {
    shape
        .dims()
        .iter()
        .map(|d| match d {
            Dim::Static(n) => Some(*n),
            Dim::Dynamic(_) => None,
        })
        .collect()
}

impl SketchSpec {
    /// Build the spec for a tensor of `shape`.
    ///
    /// A symbolic dim only drops the statistics whose output length depends on it: `pos_sumsq`
    /// (one value per row) when a leading dim is symbolic, `chan_maxabs` and `chan_outlier` when
    /// the last dim is. Everything else has a fixed length and is computed from the shape the
    /// kernel receives at run time.
    ///
    /// Errors: [`Unsketchable::NotF32`] for a non-f32 tensor.
    pub fn for_shape(
        shape: &Shape,
        stats: &[Stat],
        hist_bins: usize,
        hist_range: HistRange,
        elemsig_k: usize,
    ) -> Result<Planned, Unsketchable> {
        if shape.dtype() != DType::F32 {
            return Err(Unsketchable::NotF32(shape.dtype()));
        }
        let dims = shape.dims();
        let last_static = match dims.last() {
            Some(Dim::Static(n)) => Some(*n),
            Some(Dim::Dynamic(_)) => None,
            None => Some(1),
        };
        // Rows = product of the leading dims (all static needed; the last dim may be symbolic).
        let rows_static = match dims.split_last() {
            None => Some(1),
            Some((_, lead)) => lead
                .iter()
                .map(|d| match d {
                    Dim::Static(n) => Some(*n),
                    Dim::Dynamic(_) => None,
                })
                .product::<Option<usize>>(),
        };
        let mut set: Vec<Stat> = stats.to_vec();
        set.push(Stat::Count);
        if set.contains(&Stat::Hist) {
            set.extend([Stat::HistLo, Stat::HistHi, Stat::HistOutside]);
        }
        set.sort();
        set.dedup();
        let mut dropped = Vec::new();
        let text = shape_text(shape);
        set.retain(|&s| {
            let why = match s {
                Stat::PosSumsq if rows_static.is_none() => "a leading dim is symbolic: one value per row has no static length",
                Stat::ChanMaxabs | Stat::ChanOutlier if last_static.is_none() => "the last (channel) dim is symbolic",
                _ => return true,
            };
            dropped.push((s, format!("{why} (shape {text})")));
            false
        });
        let spec = SketchSpec {
            stats: set,
            hist_bins: hist_bins.max(1),
            hist_range,
            elemsig_k: elemsig_k.max(1),
            chans: last_static.unwrap_or(0),
            rows: rows_static.unwrap_or(0),
            tag: 0,
            memo: false,
            probe: crate::probes::Probe::Tensor,
        };
        Ok(Planned { spec, dropped })
    }

    /// Number of values statistic `s` occupies.
    pub fn stat_len(&self, s: Stat) -> usize {
        if let Some(n) = self.probe.stat_len(s) {
            return n;
        }
        match s {
            Stat::Hist => self.hist_bins,
            Stat::Elemsig => self.elemsig_k,
            Stat::ChanMaxabs => self.chans,
            Stat::PosSumsq => self.rows,
            _ => 1,
        }
    }

    /// The output layout: one [`Slot`] per selected statistic, in order, after the tag at 0.
    pub fn layout(&self) -> Vec<Slot> {
        let mut offset = 1;
        self.stats
            .iter()
            .map(|&stat| {
                let len = self.stat_len(stat);
                let slot = Slot { stat, offset, len };
                offset += len;
                slot
            })
            .collect()
    }

    /// Total output length in f32 values (the tag plus every slot).
    pub fn len(&self) -> usize {
        1 + self.stats.iter().map(|&s| self.stat_len(s)).sum::<usize>()
    }

    /// True if the output is empty (never: `count` is always present).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn has(&self, s: Stat) -> bool {
        self.stats.contains(&s)
    }

    /// Encode as the custom op's attribute bytes.
    pub fn to_attrs(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("SketchSpec serializes")
    }

    /// Decode from attribute bytes.
    pub fn from_attrs(attrs: &[u8]) -> Result<SketchSpec, String> {
        serde_json::from_slice(attrs).map_err(|e| format!("{SKETCH_OP}: bad attributes: {e}"))
    }
}

/// Compute a sketch of `data` (row-major, geometry from `spec`) on the host.
///
/// Returns exactly `spec.len()` values laid out as [`SketchSpec::layout`]. Counts are f32 (exact
/// below 2^24 elements). This is the CPU kernel's body; it is public so other backends can stage
/// through the host, not as a test reference (tests use independent code).
pub fn compute(data: &[f32], dims: &[usize], spec: &SketchSpec) -> Vec<f32> {
    let mut out = vec![0f32; spec.len()];
    compute_into(data, dims, spec, &mut out);
    out
}

#[derive(Default, Clone, Copy)]
struct Acc {
    count: u64,
    nnz: u64,
    nan: u64,
    posinf: u64,
    neginf: u64,
    sum: f64,
    l1: f64,
    sumsq: f64,
    min: f32,
    max: f32,
    adj: f64,
}

const LANES: usize = 8;

/// Sums over one row of finite values, vectorizable: returns (sum, l1, sumsq, nnz, min, max).
#[inline]
fn row_clean(row: &[f32]) -> (f32, f32, f32, u32, f32, f32) {
    let mut s = [0f32; LANES];
    let mut a = [0f32; LANES];
    let mut q = [0f32; LANES];
    let mut z = [0u32; LANES];
    let mut lo = [f32::INFINITY; LANES];
    let mut hi = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let x = c[l];
            s[l] += x;
            a[l] += x.abs();
            q[l] += x * x;
            z[l] += (x != 0.0) as u32;
            lo[l] = lo[l].min(x);
            hi[l] = hi[l].max(x);
        }
    }
    for (l, &x) in rem.iter().enumerate() {
        s[l] += x;
        a[l] += x.abs();
        q[l] += x * x;
        z[l] += (x != 0.0) as u32;
        lo[l] = lo[l].min(x);
        hi[l] = hi[l].max(x);
    }
    (
        s.iter().sum(),
        a.iter().sum(),
        q.iter().sum(),
        z.iter().sum(),
        lo.iter().copied().fold(f32::INFINITY, f32::min),
        hi.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    )
}

/// The kernel body: fill `out` (length `spec.len()`) from `data` of run-time shape `dims`.
///
/// Geometry comes from `dims`: channels `C` = last dim, rows `R = numel / C`, and adjacent-row
/// pairs for `adj_sumsq` run along the second-to-last dim, never across a leading index.
pub fn compute_into(data: &[f32], dims: &[usize], spec: &SketchSpec, out: &mut [f32]) {
    let chans = dims.last().copied().unwrap_or(1);
    let c = chans.max(1);
    let rows = if chans == 0 { 0 } else { data.len() / c };
    let block = if dims.len() >= 2 { dims[dims.len() - 2].max(1) } else { 1 };
    let want_chan = spec.has(Stat::ChanMaxabs) || spec.has(Stat::ChanOutlier);
    let want_pos = spec.has(Stat::PosSumsq);
    let want_adj = spec.has(Stat::AdjSumsq);
    let mut chan = if want_chan { vec![0f32; c] } else { Vec::new() };
    let mut pos = if want_pos { vec![0f32; rows] } else { Vec::new() };
    let mut acc = Acc {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        ..Acc::default()
    };

    // Pass 1: counts, raw sums, extremes, per-channel max|x|, per-row energy, adjacent-row
    // difference energy. A row whose sums are finite holds only finite values and takes the
    // vectorized path; any other row is re-read element by element.
    for r in 0..rows {
        let row = &data[r * c..(r + 1) * c];
        let (s, a, q, z, lo, hi) = row_clean(row);
        let clean = s.is_finite() && q.is_finite();
        let row_sumsq;
        if clean {
            acc.count += c as u64;
            acc.sum += s as f64;
            acc.l1 += a as f64;
            acc.sumsq += q as f64;
            acc.nnz += z as u64;
            acc.min = acc.min.min(lo);
            acc.max = acc.max.max(hi);
            row_sumsq = q;
            if want_chan {
                for (m, &x) in chan.iter_mut().zip(row) {
                    *m = m.max(x.abs());
                }
            }
        } else {
            let mut rq = 0f64;
            for (j, &x) in row.iter().enumerate() {
                if x.is_nan() {
                    acc.nan += 1;
                } else if x == f32::INFINITY {
                    acc.posinf += 1;
                } else if x == f32::NEG_INFINITY {
                    acc.neginf += 1;
                } else {
                    let xd = x as f64;
                    acc.count += 1;
                    acc.sum += xd;
                    acc.l1 += xd.abs();
                    acc.sumsq += xd * xd;
                    rq += xd * xd;
                    acc.nnz += (x != 0.0) as u64;
                    acc.min = acc.min.min(x);
                    acc.max = acc.max.max(x);
                    if want_chan {
                        chan[j] = chan[j].max(x.abs());
                    }
                }
            }
            row_sumsq = rq as f32;
        }
        if want_pos {
            pos[r] = row_sumsq;
        }
        if want_adj && r % block != 0 {
            let prev = &data[(r - 1) * c..r * c];
            let mut d = [0f32; LANES];
            let mut tail = 0f32;
            let pc = prev.chunks_exact(LANES);
            let rc = row.chunks_exact(LANES);
            let (prem, rrem) = (pc.remainder(), rc.remainder());
            for (p, x) in pc.zip(rc) {
                for l in 0..LANES {
                    let e = x[l] - p[l];
                    d[l] += e * e;
                }
            }
            for (p, x) in prem.iter().zip(rrem) {
                tail += (x - p) * (x - p);
            }
            let total = d.iter().sum::<f32>() + tail;
            if total.is_finite() {
                acc.adj += total as f64;
            } else {
                // Some element of either row is non-finite: sum the pairs where both are finite.
                for (p, x) in prev.iter().zip(row) {
                    if p.is_finite() && x.is_finite() {
                        let e = (*x as f64) - (*p as f64);
                        if e.is_finite() {
                            acc.adj += e * e;
                        }
                    }
                }
            }
        }
    }

    let n = acc.count as f64;
    // A constant tensor: the exact mean is its value (f32 row sums drift by a few ulps, which
    // would turn the undefined kurtosis of a constant into a made-up 1.0).
    let constant = acc.count > 0 && acc.min == acc.max;
    let mean = if constant {
        acc.min as f64
    } else if acc.count > 0 {
        acc.sum / n
    } else {
        f64::NAN
    };

    // Pass 2 (only when asked): centred moments for the kurtosis and the histogram.
    let want_kurt = spec.has(Stat::Kurtosis);
    let want_hist = spec.has(Stat::Hist);
    let (lo, hi) = match spec.hist_range {
        HistRange::Fixed { lo, hi } => (lo, hi),
        HistRange::Absmax => {
            let m = if acc.count > 0 {
                acc.min.abs().max(acc.max.abs())
            } else {
                0.0
            };
            if m > 0.0 {
                (-m, m)
            } else {
                (-1.0, 1.0)
            }
        }
    };
    let bins = spec.hist_bins;
    let mut hist = if want_hist { vec![0u64; bins] } else { Vec::new() };
    // Four interleaved counter sets of the fast histogram path.
    let mut lanes = if want_hist { vec![0u64; 4 * bins] } else { Vec::new() };
    let mut outside = 0u64;
    let (mut m2, mut m4) = (0f64, 0f64);
    if (want_kurt || want_hist) && acc.count > 0 {
        let meanf = mean as f32;
        let width = (hi as f64) - (lo as f64);
        let inv = if width > 0.0 { bins as f64 / width } else { 0.0 };
        for row in data.chunks(c) {
            if want_kurt {
                let mut r2 = [0f32; LANES];
                let mut r4 = [0f32; LANES];
                let mut extra2 = 0f64;
                let mut extra4 = 0f64;
                let ch = row.chunks_exact(LANES);
                let rem = ch.remainder();
                let mut dirty = false;
                for x in ch {
                    for l in 0..LANES {
                        let d = x[l] - meanf;
                        let d2 = d * d;
                        r2[l] += d2;
                        r4[l] += d2 * d2;
                    }
                }
                for &x in rem {
                    let d = (x - meanf) as f64;
                    extra2 += d * d;
                    extra4 += d * d * d * d;
                }
                let s2: f32 = r2.iter().sum();
                let s4: f32 = r4.iter().sum();
                if s2.is_finite() && s4.is_finite() && extra2.is_finite() && extra4.is_finite() {
                    m2 += s2 as f64 + extra2;
                    m4 += s4 as f64 + extra4;
                } else {
                    dirty = true;
                }
                if dirty {
                    for &x in row {
                        if x.is_finite() {
                            let d = x as f64 - mean;
                            m2 += d * d;
                            m4 += d * d * d * d;
                        }
                    }
                }
            }
            if want_hist {
                let absmax_range = matches!(spec.hist_range, HistRange::Absmax);
                let (lo32, inv32, last) = (lo, inv as f32, (bins - 1) as f32);
                if absmax_range && row.iter().all(|x| x.is_finite()) {
                    // Every finite value lies in [-max|x|, max|x|]: no range test, f32 math.
                    // Bin edges in f32 can differ from exact ones by one ulp of the scaled value.
                    // Four interleaved counter sets break the store-to-load chain of repeated
                    // bins; bin indices are computed four at a time.
                    // SAFETY (to_int_unchecked): the value is finite and clamped to [0, bins-1].
                    let bin = |x: f32| unsafe { ((x - lo32) * inv32).clamp(0.0, last).to_int_unchecked::<u32>() } as usize;
                    let ch = row.chunks_exact(4);
                    let rem = ch.remainder();
                    for q in ch {
                        let b: [usize; 4] = std::array::from_fn(|l| bin(q[l]));
                        for l in 0..4 {
                            lanes[l * bins + b[l]] += 1;
                        }
                    }
                    for &x in rem {
                        lanes[bin(x)] += 1;
                    }
                } else {
                    for &x in row {
                        if !x.is_finite() {
                            continue;
                        }
                        if (x as f64) < lo as f64 || (x as f64) > hi as f64 {
                            outside += 1;
                            continue;
                        }
                        let t = (x as f64 - lo as f64) * inv;
                        hist[(t as usize).min(bins - 1)] += 1;
                    }
                }
            }
        }
    }

    let elem_n = data.len();
    out[0] = spec.tag as f32;
    for slot in spec.layout() {
        let dst = &mut out[slot.offset..slot.offset + slot.len];
        let undefined = acc.count == 0;
        let v = |x: f64| if undefined { f32::NAN } else { x as f32 };
        match slot.stat {
            Stat::Count => dst[0] = acc.count as f32,
            Stat::Min => dst[0] = v(acc.min as f64),
            Stat::Max => dst[0] = v(acc.max as f64),
            Stat::Mean => dst[0] = v(mean),
            Stat::L1 => dst[0] = acc.l1 as f32,
            Stat::Sumsq => dst[0] = acc.sumsq as f32,
            Stat::Nnz => dst[0] = acc.nnz as f32,
            Stat::Kurtosis => {
                dst[0] = if acc.count > 0 && m2 > 0.0 && !constant {
                    let var = m2 / n;
                    ((m4 / n) / (var * var)) as f32
                } else {
                    f32::NAN
                }
            }
            Stat::Hist => {
                for (i, (d, &h)) in dst.iter_mut().zip(&hist).enumerate() {
                    let fast: u64 = (0..4).map(|l| lanes[l * bins + i]).sum();
                    *d = (h + fast) as f32;
                }
            }
            Stat::HistLo => dst[0] = v(lo as f64),
            Stat::HistHi => dst[0] = v(hi as f64),
            Stat::HistOutside => dst[0] = outside as f32,
            Stat::Elemsig => {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = if elem_n == 0 {
                        f32::NAN
                    } else {
                        data[j * elem_n / slot.len]
                    };
                }
            }
            Stat::ChanMaxabs => {
                if rows == 0 || chan.len() != slot.len {
                    dst.fill(f32::NAN);
                } else {
                    dst.copy_from_slice(&chan);
                }
            }
            Stat::ChanOutlier => {
                let peak = chan.iter().copied().fold(0f32, f32::max) as f64;
                let mean_c = chan.iter().map(|&x| x as f64).sum::<f64>() / chan.len().max(1) as f64;
                dst[0] = if rows > 0 && mean_c > 0.0 {
                    (peak / mean_c) as f32
                } else {
                    f32::NAN
                };
            }
            Stat::PosSumsq => {
                if pos.len() == slot.len {
                    dst.copy_from_slice(&pos);
                } else {
                    dst.fill(f32::NAN);
                }
            }
            Stat::AdjSumsq => dst[0] = acc.adj as f32,
            Stat::NanCount => dst[0] = acc.nan as f32,
            Stat::PosinfCount => dst[0] = acc.posinf as f32,
            Stat::NeginfCount => dst[0] = acc.neginf as f32,
            // Probe statistics never reach the tensor kernel (`SketchSpec::for_shape` never
            // selects them); a foreign spec gets NaN, which is never recorded.
            _ => dst.fill(f32::NAN),
        }
    }
}

/// Shape inference for [`SKETCH_OP`] and the multi-input probe ops.
struct SketchOp {
    name: &'static str,
    inputs: usize,
}

impl OpExtension for SketchOp {
    fn name(&self) -> &str {
        self.name
    }
    fn num_inputs(&self) -> usize {
        self.inputs
    }
    fn infer_shape(&self, _inputs: &[&Shape], attrs: &[u8]) -> Shape {
        // Attributes are written by `SketchSpec::to_attrs` only; a foreign blob gets a 1-value
        // output and the kernel reports the decode error at run time.
        let len = SketchSpec::from_attrs(attrs).map(|s| s.len()).unwrap_or(1);
        Shape::new(&[len], DType::F32)
    }
}

/// CPU kernel for [`SKETCH_OP`] and the multi-input probe ops ([`SKETCH2_OP`], [`SKETCH3_OP`]).
struct SketchKernel {
    name: &'static str,
}

impl CpuKernel for SketchKernel {
    fn name(&self) -> &str {
        self.name
    }
    fn execute(
        &self,
        inputs: &[CpuTensorRef<'_>],
        output: CpuTensorMut<'_>,
        attrs: &[u8],
    ) -> Result<(), String> {
        let spec = SketchSpec::from_attrs(attrs)?;
        if spec.probe != crate::probes::Probe::Tensor {
            let out = output.expect_f32_mut("opscope probe output")?;
            if out.len() != spec.len() {
                return Err(format!("{}: output holds {} values, spec needs {}", self.name, out.len(), spec.len()));
            }
            return crate::probes::execute(&spec, inputs, out);
        }
        let x = inputs
            .first()
            .ok_or_else(|| format!("{SKETCH_OP}: no input"))?
            .expect_f32("opscope.sketch input")?;
        let out = output.expect_f32_mut("opscope.sketch output")?;
        if out.len() != spec.len() {
            return Err(format!(
                "{SKETCH_OP}: output holds {} values, spec needs {}",
                out.len(),
                spec.len()
            ));
        }
        let dims = static_dims(inputs[0].shape()).ok_or_else(|| {
            format!("{SKETCH_OP}: input shape {} is not bound at run time", shape_text(inputs[0].shape()))
        })?;
        if dims.iter().product::<usize>() != x.len() {
            return Err(format!("{SKETCH_OP}: shape {dims:?} does not match {} values", x.len()));
        }
        if spec.memo {
            memo_compute(x, &dims, &spec, out);
        } else {
            compute_into(x, &dims, &spec, out);
        }
        Ok(())
    }
}

/// Sketches of weights already seen, keyed by (content hash, dims, spec without tag).
type MemoKey = (u128, Vec<usize>, Vec<u8>);

/// Bounded: cleared when it holds this many sketches (a model has a few hundred weights).
const MEMO_CAPACITY: usize = 4096;

fn memo_compute(x: &[f32], dims: &[usize], spec: &SketchSpec, out: &mut [f32]) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static MEMO: Mutex<Option<HashMap<MemoKey, Vec<f32>>>> = Mutex::new(None);
    let bytes: &[u8] = unsafe {
        // SAFETY: f32 has no padding or invalid bit patterns; the slice covers exactly the
        // same memory as `x`, read-only, for the duration of the borrow.
        std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x))
    };
    let untagged = SketchSpec { tag: 0, ..spec.clone() };
    let key: MemoKey = (xxhash_rust::xxh3::xxh3_128(bytes), dims.to_vec(), untagged.to_attrs());
    let hit = MEMO.lock().ok().and_then(|g| g.as_ref().and_then(|m| m.get(&key).cloned()));
    if let Some(v) = hit {
        out.copy_from_slice(&v);
        out[0] = spec.tag as f32;
        return;
    }
    // Computed outside the lock: other kernels sketching other weights are not held up.
    compute_into(x, dims, spec, out);
    if let Ok(mut guard) = MEMO.lock() {
        let map = guard.get_or_insert_with(HashMap::new);
        if map.len() >= MEMO_CAPACITY {
            map.clear();
        }
        map.insert(key, out.to_vec());
    }
}

/// Shape inference for [`KEEP_OP`]: the first input's shape.
struct KeepOp;

impl OpExtension for KeepOp {
    fn name(&self) -> &str {
        KEEP_OP
    }
    fn num_inputs(&self) -> usize {
        2
    }
    fn infer_shape(&self, inputs: &[&Shape], _attrs: &[u8]) -> Shape {
        inputs[0].clone()
    }
}

/// CPU kernel for [`KEEP_OP`]: copy input 0.
struct KeepKernel;

impl CpuKernel for KeepKernel {
    fn name(&self) -> &str {
        KEEP_OP
    }
    fn execute(&self, inputs: &[CpuTensorRef<'_>], output: CpuTensorMut<'_>, _attrs: &[u8]) -> Result<(), String> {
        let x = inputs
            .first()
            .ok_or_else(|| format!("{KEEP_OP}: no input"))?
            .expect_f32("opscope.keep input")?;
        let out = output.expect_f32_mut("opscope.keep output")?;
        if out.len() != x.len() {
            return Err(format!("{KEEP_OP}: output holds {} values, input {}", out.len(), x.len()));
        }
        out.copy_from_slice(x);
        Ok(())
    }
}

/// Register the sketch op and its CPU kernel (idempotent; called before any tapped compile:
/// RLX panics when it builds an executable holding a custom op with no registered kernel).
pub fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for (name, inputs) in [(SKETCH_OP, 1), (SKETCH2_OP, 2), (SKETCH3_OP, 3)] {
            rlx_ir::op_registry::register_op(Arc::new(SketchOp { name, inputs }));
            rlx_cpu::op_registry::register_cpu_kernel(Arc::new(SketchKernel { name }));
        }
        rlx_ir::op_registry::register_op(Arc::new(KeepOp));
        rlx_cpu::op_registry::register_cpu_kernel(Arc::new(KeepKernel));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_in_declaration_order() {
        // The recorder indexes per-statistic names by `stat as usize`.
        for (i, s) in Stat::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{s:?}");
            assert_eq!(Stat::parse(s.as_str()), Some(*s));
        }
    }
}
