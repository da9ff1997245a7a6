//! Sketches: the small summaries a tap computes on a tensor, and the native RLX op that computes
//! them in one call.
//!
//! A tap appends one [`SKETCH_OP`] node per tapped tensor. The node's attributes carry a
//! [`SketchSpec`] (which [`Stat`]s, histogram and signature parameters, the tensor's row/channel
//! geometry); its output is one flat `[len]` F32 vector whose layout [`SketchSpec::layout`] gives.
//! The CPU kernel reads the tensor twice (moments, extremes, counts, per-channel and per-row
//! vectors in the first pass; centred moments and the histogram in the second), summing in f64
//! (16 lanes within a row, then across rows), so the cost does not grow with the number of
//! statistics. Every moment is within 1e-6 relative of an f64 reference at any scale and length,
//! and the histogram bins are `numpy.histogram`'s (the kernel module documents both). A tensor of
//! 2^24 elements or more has inexact f32 counts (relative error < 6e-8).
//!
//! Non-finite values (NaN, +Inf, -Inf) are counted in `nan_count`, `posinf_count`,
//! `neginf_count` and excluded from every other statistic. A statistic that is undefined for the
//! data (the mean of no finite values, the kurtosis of a constant) is written as NaN by the
//! kernel and dropped by the recorder before it reaches a sink: a recording never carries
//! a made-up number. So is a sum that f32 cannot hold to 6e-8 relative (`sumsq` above
//! `f32::MAX`, or non-zero below `f32::MIN_POSITIVE`).

pub mod epoch;
mod kernel;
pub mod lower;
mod ops;
pub mod probe;
pub mod sample;
mod stat;

use rlx_ir::{DType, Dim, Shape};

pub use crate::analysis::{shape_text, static_dims};
use serde::{Deserialize, Serialize};

pub use kernel::{compute, compute_into, compute_masked};
pub use ops::{has_weight_sketch, register_kernels, weight_memo_counts, WeightMemoCounts};
pub(crate) use ops::seed_spec;
pub use probe::{Probe, ProbeKernel, ProbeRegistration, Typed, TypedProbe};
pub use stat::{tables, tensor, Stat, StatDef, StatLen, StatTable, OPT_IN, SELECTABLE, TAP_STATS};

/// Name of the custom RLX op that computes a sketch (`Op::Custom { name: SKETCH_OP, .. }`).
pub const SKETCH_OP: &str = "opscope.sketch";

/// The sketch op with two inputs (attention probabilities and their mask, a router's scores
/// and chosen experts, a residual stream and its branch): same attributes, a registered
/// [`Probe`] says how the inputs are read.
pub const SKETCH2_OP: &str = "opscope.sketch2";

/// The sketch op with three inputs (fused attention's Q, K and mask).
pub const SKETCH3_OP: &str = "opscope.sketch3";

/// True for the name of any opscope sketch op (one, two or three inputs), gated or not
/// ([`sample`]).
pub fn is_sketch_op(name: &str) -> bool {
    let base = name.strip_suffix(sample::GATED_SUFFIX).unwrap_or(name);
    base == SKETCH_OP || base == SKETCH2_OP || base == SKETCH3_OP
}

/// Values of the `hash` statistic: XXH3-64 as four 16-bit limbs (each exact in f32).
pub const HASH_LIMBS: usize = 4;

/// The 64-bit hash the four recorded `hash` limbs hold (limb 0 least significant). `None`
/// unless there are exactly [`HASH_LIMBS`] values, each an integer in 0..65536.
pub fn hash_from_limbs(limbs: &[f32]) -> Option<u64> {
    if limbs.len() != HASH_LIMBS || limbs.iter().any(|&x| !(0.0..65536.0).contains(&x) || x.fract() != 0.0) {
        return None;
    }
    Some(limbs.iter().rev().fold(0u64, |h, &x| (h << 16) | x as u64))
}

/// Range of the value histogram.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum HistRange {
    /// [-max|x|, +max|x|] of the finite values of this tensor on this run (scale-normalized,
    /// as PyTorch's `HistogramObserver` and ONNX Runtime's entropy/percentile calibrators do).
    /// An all-zero tensor uses [-1, 1].
    Absmax,
    /// A fixed `[lo, hi]` range (bins as `numpy.histogram` assigns them: edges
    /// `np.linspace(lo, hi, bins + 1)` in f64, `hi` in the last bin); finite values outside it
    /// are counted in `hist_outside`.
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
    /// Selected statistics, in layout order (their table's order; `count` included for a tensor).
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
    /// Rows `R = numel / C` (0 if symbolic, with `pos_sumsq` and `row_absmax` dropped). Sets the
    /// length of `pos_sumsq` and `row_absmax`.
    pub rows: usize,
    /// Compile tag, written as output value 0 so a recorder can tell which compiled graph a
    /// run's outputs came from (an f32: exact below 2^24; 0 means untagged, which a recorder
    /// refuses; see `Recorder::next_tag`). Statistics start at offset 1.
    pub tag: u32,
    /// The tensor is a weight (param-invariant): the kernel memoizes its sketch by the exact
    /// content (a 128-bit XXH3 of the bytes, about 20x cheaper than sketching), so an unchanged
    /// weight is not re-sketched on every call, and a changed one is; between two param writes
    /// of its executable it does not read the weight at all ([`epoch`]).
    #[serde(default)]
    pub memo: bool,
    /// For a weight sketch ([`SketchSpec::memo`]): 1 + the id of the sketched node in the
    /// tapped graph (0, not serialized, otherwise). It makes the attribute bytes of every
    /// weight sketch of a compile unique, so the kernel can tell two sketches of same-shaped
    /// weights apart when it reuses a sketch between param writes ([`epoch`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub node: u32,
    /// What the op reads: one tensor (the default), or the inputs of a registered probe
    /// (attention, routing, residual: see [`Probe`]).
    #[serde(default)]
    pub probe: Probe,
    /// `site/role` of the online state this tensor also feeds on the runs the kernel computes
    /// (the `online` setting; see [`crate::online`]); `None` for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub online: Option<String>,
}

fn is_zero(x: &u32) -> bool {
    *x == 0
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

impl SketchSpec {
    /// Build the spec for a tensor of `shape`.
    ///
    /// A symbolic dim only drops the statistics whose output length depends on it: `pos_sumsq`
    /// and `row_absmax` (one value per row) when a leading dim is symbolic, `chan_maxabs` and `chan_outlier` when
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
        set.push(tensor::COUNT);
        if set.contains(&tensor::HIST) {
            set.extend([tensor::HIST_LO, tensor::HIST_HI, tensor::HIST_OUTSIDE]);
        }
        set.sort();
        set.dedup();
        let mut dropped = Vec::new();
        set.retain(|&s| {
            let why = match s {
                tensor::POS_SUMSQ | tensor::ROW_ABSMAX if rows_static.is_none() => "a leading dim is symbolic: one value per row has no static length",
                tensor::CHAN_MAXABS | tensor::CHAN_OUTLIER if last_static.is_none() => "the last (channel) dim is symbolic",
                _ => return true,
            };
            dropped.push((s, format!("{why} (shape {})", shape_text(shape))));
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
            node: 0,
            probe: Probe::Tensor,
            online: None,
        };
        Ok(Planned { spec, dropped })
    }

    /// A spec for the registered probe `params`, computing `stats` filtered to what the probe
    /// computes, in layout order. Geometry fields of the tensor kernel keep neutral values
    /// (they are part of the attribute bytes, so a probe's attributes stay stable).
    pub fn for_probe<P: TypedProbe>(params: &P, stats: &[Stat]) -> SketchSpec {
        let mut set: Vec<Stat> = stats.iter().copied().filter(|s| params.stats().contains(s)).collect();
        set.sort();
        set.dedup();
        SketchSpec {
            stats: set,
            hist_bins: 1,
            hist_range: HistRange::Absmax,
            elemsig_k: 1,
            chans: 0,
            rows: 0,
            tag: 0,
            memo: false,
            node: 0,
            probe: Probe::Pass {
                name: P::NAME.to_string(),
                params: serde_json::value::to_raw_value(params).expect("probe parameters serialize"),
            },
            online: None,
        }
    }

    /// Values each selected statistic occupies, in order.
    ///
    /// Errors: the spec names a probe no linked pass registers, or its parameters do not
    /// decode.
    pub fn lengths(&self) -> Result<Vec<usize>, String> {
        match &self.probe {
            Probe::Tensor => Ok(self
                .stats
                .iter()
                .map(|&s| match s {
                    tensor::HIST => self.hist_bins,
                    tensor::ELEMSIG => self.elemsig_k,
                    tensor::CHAN_MAXABS => self.chans,
                    tensor::POS_SUMSQ | tensor::ROW_ABSMAX => self.rows,
                    tensor::HASH => HASH_LIMBS,
                    _ => 1,
                })
                .collect()),
            Probe::Pass { name, params } => probe::lookup(name)
                .ok_or_else(|| format!("no linked pass registers the probe '{name}'"))?
                .lengths(params.get(), &self.stats),
        }
    }

    /// The output layout: one [`Slot`] per selected statistic, in order, after the tag at 0.
    ///
    /// Errors: as [`SketchSpec::lengths`].
    pub fn layout(&self) -> Result<Vec<Slot>, String> {
        let mut offset = 1;
        Ok(self
            .stats
            .iter()
            .zip(self.lengths()?)
            .map(|(&stat, len)| {
                let slot = Slot { stat, offset, len };
                offset += len;
                slot
            })
            .collect())
    }

    /// Total output length in f32 values (the tag plus every slot).
    ///
    /// Errors: as [`SketchSpec::lengths`].
    pub fn len(&self) -> Result<usize, String> {
        Ok(1 + self.lengths()?.iter().sum::<usize>())
    }

    pub(crate) fn has(&self, s: Stat) -> bool {
        self.stats.contains(&s)
    }

    /// Encode as the custom op's attribute bytes.
    pub fn to_attrs(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("SketchSpec serializes")
    }

    /// Decode from attribute bytes ([`SketchSpec::to_attrs`]'s JSON).
    ///
    /// Errors: the bytes are not a spec's JSON (the message names the sketch op and serde's
    /// reason).
    pub fn from_attrs(attrs: &[u8]) -> Result<SketchSpec, String> {
        serde_json::from_slice(attrs).map_err(|e| format!("{SKETCH_OP}: bad attributes: {e}"))
    }
}

