//! The residual probe: a residual stream `x` and a block's branch `f(x)`: the
//! branch-to-stream norm ratio and the cosine between `x` and `x + f(x)` (block influence).

use crate::sketch::probe::{input, need};
use crate::sketch::{Stat, TypedProbe};
use rlx_cpu::op_registry::CpuTensorRef;
use serde::{Deserialize, Serialize};

crate::stats! {
    /// Statistics of the residual probe, in layout order.
    pub mod stats {
        /// Rows (tokens) of the residual stream in this run, padding rows excluded (1 value).
        ROWS = "rows", One;
        /// ||f(x)||_F / ||x||_F over the whole tensor (1 value).
        RATIO = "ratio", One;
        /// Mean over rows of cos(x_r, x_r + f(x)_r) (1 value; 1 - this is ShortGPT's block influence).
        COS = "cos", One;
        /// Per row: cos(x_r, x_r + f(x)_r) (`R` values; padding rows and zero vectors are NaN and
        /// not recorded).
        COS_ROW = "cos_row", Vector;
        /// Median of |x + f(x)| over the kept rows' elements (1 value, units of x): the
        /// reference a massive activation is measured against (Sun et al. 2024).
        OUT_MEDIAN_ABS = "out_median_abs", One;
        /// The [`TOP`] largest |x + f(x)| over the kept rows, largest first, as triples (signed
        /// value, row, channel) (`3 * TOP` values; rows are flattened leading dims, so a token's
        /// position is `row % seq`; missing entries, with fewer elements than `TOP`, are NaN).
        OUT_TOP = "out_top", Vector;
        /// Per channel: max |x + f(x)| over the kept rows (`D` values).
        OUT_CHAN_ABSMAX = "out_chan_absmax", Vector;
    }
}

inventory::submit! { crate::sketch::StatTable(stats::ALL) }
inventory::submit! { crate::sketch::ProbeRegistration(&crate::sketch::Typed::<ResidualProbe>::NEW) }

/// Entries of [`stats::OUT_TOP`].
pub const TOP: usize = 4;

/// Residual geometry: `x` and `f(x)` are `[rows, width]` after flattening leading dims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResidualProbe {
    /// Rows `R` (tokens).
    pub rows: usize,
    /// Width `D` (hidden size).
    pub width: usize,
    /// Input 2 is a `[rows]` row mask (1 = token, 0 = padding): padding rows are left out of
    /// every statistic.
    #[serde(default)]
    pub masked: bool,
}



impl TypedProbe for ResidualProbe {
    const NAME: &'static str = "Residual";

    fn stats(&self) -> &'static [Stat] {
        stats::ALL
    }

    fn stat_len(&self, s: Stat) -> usize {
        match s {
            stats::COS_ROW => self.rows,
            stats::OUT_TOP => 3 * TOP,
            stats::OUT_CHAN_ABSMAX => self.width,
            _ => 1,
        }
    }

    fn execute(&self, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String> {
        let r = self;
        let x = input(inputs, 0, "residual stream")?;
        let f = input(inputs, 1, "residual branch")?;
        need(x.len(), r.rows * r.width, "residual stream")?;
        need(f.len(), r.rows * r.width, "residual branch")?;
        let mask = if r.masked {
            let m = input(inputs, 2, "residual row mask")?;
            need(m.len(), r.rows, "residual row mask")?;
            Some(m)
        } else {
            None
        };
        Ok(residual_stats(r, x, f, mask))
    }

    fn lowering(&self) -> Result<(), String> {
        Ok(())
    }

    fn lower(&self, g: &mut rlx_ir::Graph, inputs: &[rlx_ir::NodeId], stats: &[Stat]) -> Vec<crate::sketch::probe::LoweredStat> {
        super::lower::lower(self, g, inputs, stats)
    }
}

/// Residual statistics, accumulated in f64, over the rows `mask` keeps (every row without one).
fn residual_stats(r: &ResidualProbe, x: &[f32], f: &[f32], mask: Option<&[f32]>) -> Vec<(Stat, Vec<f32>)> {
    let (mut xx, mut ff) = (0f64, 0f64);
    let mut cos_row = Vec::with_capacity(r.rows);
    let (mut cos_sum, mut cos_n) = (0f64, 0f64);
    let mut kept = 0usize;
    // |x + f(x)| of every kept element (for the median), the running top entries and the
    // per-channel maxima.
    let mut abs: Vec<f32> = Vec::with_capacity(r.rows * r.width);
    let mut top: Vec<(f32, usize, usize)> = Vec::with_capacity(TOP + 1);
    let mut chan = vec![f32::NAN; r.width];
    for i in 0..r.rows {
        if mask.is_some_and(|m| m[i] == 0.0) {
            cos_row.push(f32::NAN);
            continue;
        }
        kept += 1;
        let (xr, fr) = (&x[i * r.width..(i + 1) * r.width], &f[i * r.width..(i + 1) * r.width]);
        let (mut rx, mut ry, mut xy, mut rf) = (0f64, 0f64, 0f64, 0f64);
        for (j, (&a, &b)) in xr.iter().zip(fr).enumerate() {
            // The block's output as the graph's Add computes it, in f32.
            let out = a + b;
            let m = out.abs();
            if m.is_finite() {
                abs.push(m);
                chan[j] = if chan[j].is_nan() { m } else { chan[j].max(m) };
                if top.len() < TOP || m > top[top.len() - 1].0.abs() {
                    let at = top.iter().position(|t| m > t.0.abs()).unwrap_or(top.len());
                    top.insert(at, (out, i, j));
                    top.truncate(TOP);
                }
            }
            let (a, b) = (a as f64, b as f64);
            let y = a + b;
            rx += a * a;
            ry += y * y;
            xy += a * y;
            rf += b * b;
        }
        xx += rx;
        ff += rf;
        let c = if rx > 0.0 && ry > 0.0 { xy / (rx.sqrt() * ry.sqrt()) } else { f64::NAN };
        if c.is_finite() {
            cos_sum += c;
            cos_n += 1.0;
        }
        cos_row.push(c as f32);
    }
    let ratio = if xx > 0.0 { (ff / xx).sqrt() as f32 } else { f32::NAN };
    let cos = if cos_n > 0.0 { (cos_sum / cos_n) as f32 } else { f32::NAN };
    let median = if abs.is_empty() {
        f32::NAN
    } else {
        // As numpy's median: the mean of the two middle values for an even count.
        let n = abs.len();
        let (_, m, upper) = abs.select_nth_unstable_by((n - 1) / 2, f32::total_cmp);
        let m = *m;
        if n % 2 == 0 {
            let next = upper.iter().copied().fold(f32::INFINITY, f32::min);
            ((m as f64 + next as f64) / 2.0) as f32
        } else {
            m
        }
    };
    let mut top_v = vec![f32::NAN; 3 * TOP];
    for (t, (v, i, j)) in top.iter().enumerate() {
        top_v[3 * t..3 * t + 3].copy_from_slice(&[*v, *i as f32, *j as f32]);
    }
    vec![
        (stats::ROWS, vec![kept as f32]),
        (stats::RATIO, vec![ratio]),
        (stats::COS, vec![cos]),
        (stats::COS_ROW, cos_row),
        (stats::OUT_MEDIAN_ABS, vec![median]),
        (stats::OUT_TOP, top_v),
        (stats::OUT_CHAN_ABSMAX, chan),
    ]
}


/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
