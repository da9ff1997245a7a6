//! The tensor sketch kernel: every tensor statistic of [`super::tensor`] in two reads of the
//! data.

use super::{tensor, HistRange, SketchSpec};

/// Compute a sketch of `data` (row-major, geometry from `spec`) on the host.
///
/// Returns exactly `spec.len()` values (a tensor spec's length is always known) laid out as [`SketchSpec::layout`]. Counts are f32 (exact
/// below 2^24 elements). This is the CPU kernel's body; it is public so other backends can stage
/// through the host, not as a test reference (tests use independent code).
pub fn compute(data: &[f32], dims: &[usize], spec: &SketchSpec) -> Vec<f32> {
    let mut out = vec![0f32; spec.len().unwrap_or(1)];
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
    let want_chan = spec.has(tensor::CHAN_MAXABS) || spec.has(tensor::CHAN_OUTLIER);
    let want_pos = spec.has(tensor::POS_SUMSQ);
    let want_adj = spec.has(tensor::ADJ_SUMSQ);
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
    let want_kurt = spec.has(tensor::KURTOSIS);
    let want_hist = spec.has(tensor::HIST);
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
    for slot in spec.layout().unwrap_or_default() {
        let dst = &mut out[slot.offset..slot.offset + slot.len];
        let undefined = acc.count == 0;
        let v = |x: f64| if undefined { f32::NAN } else { x as f32 };
        match slot.stat {
            tensor::COUNT => dst[0] = acc.count as f32,
            tensor::MIN => dst[0] = v(acc.min as f64),
            tensor::MAX => dst[0] = v(acc.max as f64),
            tensor::MEAN => dst[0] = v(mean),
            tensor::L1 => dst[0] = acc.l1 as f32,
            tensor::SUMSQ => dst[0] = acc.sumsq as f32,
            tensor::NNZ => dst[0] = acc.nnz as f32,
            tensor::KURTOSIS => {
                dst[0] = if acc.count > 0 && m2 > 0.0 && !constant {
                    let var = m2 / n;
                    ((m4 / n) / (var * var)) as f32
                } else {
                    f32::NAN
                }
            }
            tensor::HIST => {
                for (i, (d, &h)) in dst.iter_mut().zip(&hist).enumerate() {
                    let fast: u64 = (0..4).map(|l| lanes[l * bins + i]).sum();
                    *d = (h + fast) as f32;
                }
            }
            tensor::HIST_LO => dst[0] = v(lo as f64),
            tensor::HIST_HI => dst[0] = v(hi as f64),
            tensor::HIST_OUTSIDE => dst[0] = outside as f32,
            tensor::ELEMSIG => {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = if elem_n == 0 {
                        f32::NAN
                    } else {
                        data[j * elem_n / slot.len]
                    };
                }
            }
            tensor::CHAN_MAXABS => {
                if rows == 0 || chan.len() != slot.len {
                    dst.fill(f32::NAN);
                } else {
                    dst.copy_from_slice(&chan);
                }
            }
            tensor::CHAN_OUTLIER => {
                let peak = chan.iter().copied().fold(0f32, f32::max) as f64;
                let mean_c = chan.iter().map(|&x| x as f64).sum::<f64>() / chan.len().max(1) as f64;
                dst[0] = if rows > 0 && mean_c > 0.0 {
                    (peak / mean_c) as f32
                } else {
                    f32::NAN
                };
            }
            tensor::POS_SUMSQ => {
                if pos.len() == slot.len {
                    dst.copy_from_slice(&pos);
                } else {
                    dst.fill(f32::NAN);
                }
            }
            tensor::ADJ_SUMSQ => dst[0] = acc.adj as f32,
            tensor::NAN_COUNT => dst[0] = acc.nan as f32,
            tensor::POSINF_COUNT => dst[0] = acc.posinf as f32,
            tensor::NEGINF_COUNT => dst[0] = acc.neginf as f32,
            // Probe statistics never reach the tensor kernel (`SketchSpec::for_shape` never
            // selects them); a foreign spec gets NaN, which is never recorded.
            _ => dst.fill(f32::NAN),
        }
    }
}

