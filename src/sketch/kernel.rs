//! The tensor sketch kernel: every tensor statistic of [`super::tensor`] in two reads of the
//! data.
//!
//! # Accuracy
//!
//! Every sum (`mean`, `l1`, `sumsq`, the centred moments of `kurtosis`, `pos_sumsq`,
//! `adj_sumsq`) is accumulated in f64: within a row in 16 f64 lanes, across rows in f64. Each
//! term is formed in f64 from the f32 input (`x^2` of an f32 is exact in f64; `x - mean` and its
//! fourth power are rounded once each), and f64's exponent range holds the fourth power of any
//! difference of two finite f32 values (at most about 2e155), so nothing underflows or
//! overflows at any scale of the data. The rounding error of a sum of n non-negative terms is at
//! most about `n/16 * 2^-53` relative (Higham, *Accuracy and Stability of Numerical Algorithms*,
//! 2nd ed., section 4.2, for recursive summation per lane): 1.2e-10 at n = 2^24. The recorded
//! value is then rounded once to f32 (6e-8 relative). So `l1`, `sumsq`, `pos_sumsq`,
//! `adj_sumsq` and `kurtosis` are accurate to well below 1e-6 relative for any scale of the
//! data, and the kurtosis is scale-invariant.
//!
//! The mean is `x0 + sum(x - x0) / n` with `x0` the first finite value, so near-constant data
//! (a large value plus tiny noise) is centred on its noise rather than its magnitude; its error
//! is below 1e-6 relative, or below 1e-6 of mean|x| when cancellation leaves it near 0.
//! `kurtosis` is centred on that mean in a second read (two-pass, not a one-pass formula).
//!
//! A sum whose value f32 cannot hold to that accuracy (magnitude above `f32::MAX`, about
//! 3.4e38, or non-zero below `f32::MIN_POSITIVE`, about 1.2e-38, where f32 loses precision) is
//! written as NaN and left out by the recorder, like an undefined statistic: `sumsq` of values
//! near 1e20 or near 1e-20 is not recorded rather than recorded as infinity, zero or a denormal.
//! An exact zero is recorded. The mean always lies between `min` and `max` and is recorded as
//! the nearest f32.
//!
//! # Histogram
//!
//! Bin assignment equals `numpy.histogram(x.astype(np.float64), bins, range=(lo, hi))`: edges
//! are `np.linspace(lo, hi, bins + 1)` in f64 (`i * ((hi - lo) / bins) + lo`, the last edge
//! exactly `hi`); a value on an interior edge goes to the upper bin, the last bin includes `hi`.
//! numpy truncates `(x - lo) / (hi - lo) * bins` and corrects the estimate by one comparison
//! against each neighbouring edge; the kernel lowers its estimate by half a bin and compares
//! against the upper edge only (see `Binner::bin`; where the range allows, in f32 against the
//! smallest f32 at or above each edge, `Binner32`), which gives the same bin for up to 2^26
//! bins (a spec with more than 2^24 gets an undefined, NaN, histogram; the pipeline option
//! allows 65536). A unit test checks both against the edges' definition. numpy on a float32 array instead rounds the edges to f32 and can differ for a
//! value that is the nearest f32 to an edge.

use super::{tensor, HistRange, SketchSpec};

/// Compute a tensor sketch of `data` (row-major, of run-time shape `dims`) on the host.
///
/// Geometry comes from `dims`, as in [`compute_into`] (channels `C` = last dim, rows
/// `R = data.len() / C`); `spec.rows` and `spec.chans` only size the vector statistics, and a
/// vector statistic whose size disagrees with the data is NaN (not recorded). For a tensor spec
/// returns exactly `spec.len()` values (a tensor spec's length is always known) laid out as
/// [`SketchSpec::layout`]. Counts are f32 (exact below 2^24 elements). Accuracy: see the module
/// documentation. This is the CPU kernel's body; it is public so other backends can stage
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
    /// Sum of (x - pivot).
    shifted: f64,
    l1: f64,
    sumsq: f64,
    min: f32,
    max: f32,
    adj: f64,
}

/// Lanes of the row loops: 16 independent accumulator chains hide the add latency (f64: four
/// AVX2 registers per accumulator; measured fastest of 4, 8, 16, 32).
const LANES: usize = 16;

/// Extremes and non-zero count of one row of finite values, in f32 lanes: returns (nnz, min,
/// max). Kept out of line and apart from the f64 sums: a loop mixing f32 and f64 lanes is not
/// vectorized cleanly by LLVM (measured 2-4x slower). The plain comparisons (rather than
/// `f32::min`, which must skip NaN) compile to bare `minps`/`maxps`; the row holds no NaN.
fn row_extremes(row: &[f32]) -> (u32, f32, f32) {
    let (z, lo, hi, _) = extremes_dispatch::<false>(row);
    (z, lo, hi)
}

/// [`row_extremes`] plus the number of values that are not finite (NaN or an infinity), for a
/// row not known to be finite: the pass of a sketch that needs no sum (`stats=[max]`,
/// `[min,max,nnz]`, ...), where the f64 sums would otherwise be computed only to learn that the
/// row is finite. When the count is not 0 the extremes are not used (NaN is skipped by the
/// comparisons).
fn row_extremes_finite(row: &[f32]) -> (u32, f32, f32, usize) {
    extremes_dispatch::<true>(row)
}

/// [`extremes`] with AVX-512F where the CPU has it ([`avx512::extremes`]: 64 lanes; the same
/// counts and extreme values, a zero extreme possibly of the other sign, which no caller of
/// this path keeps), else compiled for AVX2 (eight f32 lanes per instruction instead of
/// SSE2's four; the same comparisons and counts, so the same bits).
fn extremes_dispatch<const COUNT: bool>(row: &[f32]) -> (u32, f32, f32, usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { avx512::extremes::<COUNT>(row) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { extremes_avx2::<COUNT>(row) };
    }
    extremes_portable::<COUNT>(row)
}

/// [`extremes`] for the build's baseline target, out of line (a loop mixing f32 and f64
/// lanes is not vectorized cleanly by LLVM: measured 2-4x slower).
#[inline(never)]
fn extremes_portable<const COUNT: bool>(row: &[f32]) -> (u32, f32, f32, usize) {
    extremes::<COUNT>(row)
}

/// [`extremes`] with AVX2 enabled. Safety: the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
unsafe fn extremes_avx2<const COUNT: bool>(row: &[f32]) -> (u32, f32, f32, usize) {
    extremes::<COUNT>(row)
}

/// The loop of [`row_extremes`] and [`row_extremes_finite`]; the non-finite count only when
/// `COUNT` (0 otherwise). Inlined into its callers, so each is vectorized for its own target
/// features.
#[inline(always)]
fn extremes<const COUNT: bool>(row: &[f32]) -> (u32, f32, f32, usize) {
    let mut z = [0u32; LANES];
    let mut fin = [0u32; LANES];
    let mut lo = [f32::INFINITY; LANES];
    let mut hi = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let x = c[l];
            z[l] += (x != 0.0) as u32;
            if COUNT {
                fin[l] += (x.abs() < f32::INFINITY) as u32;
            }
            lo[l] = if x < lo[l] { x } else { lo[l] };
            hi[l] = if x > hi[l] { x } else { hi[l] };
        }
    }
    for (l, &x) in rem.iter().enumerate() {
        z[l] += (x != 0.0) as u32;
        if COUNT {
            fin[l] += (x.abs() < f32::INFINITY) as u32;
        }
        lo[l] = lo[l].min(x);
        hi[l] = hi[l].max(x);
    }
    let non_finite = if COUNT { row.len() - fin.iter().map(|&f| f as usize).sum::<usize>() } else { 0 };
    (
        z.iter().sum(),
        lo.iter().copied().fold(f32::INFINITY, f32::min),
        hi.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        non_finite,
    )
}

/// Sums over one row in f64 lanes: returns (sum of `x - pivot`, sum |x|, sum x^2). Finite
/// exactly when every value of the row is (no finite f32's square overflows f64).
fn row_sums(row: &[f32], pivot: f64) -> (f64, f64, f64) {
    let mut s = [0f64; LANES];
    let mut a = [0f64; LANES];
    let mut q = [0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let xd = c[l] as f64;
            s[l] += xd - pivot;
            a[l] += xd.abs();
            q[l] += xd * xd;
        }
    }
    for (l, &x) in rem.iter().enumerate() {
        let xd = x as f64;
        s[l] += xd - pivot;
        a[l] += xd.abs();
        q[l] += xd * xd;
    }
    (s.iter().sum(), a.iter().sum(), q.iter().sum())
}

/// Sum of (x - mean)^2 and (x - mean)^4 over one row, in f64 lanes. Finite exactly when every
/// value of the row is.
fn row_centred(row: &[f32], mean: f64) -> (f64, f64) {
    let mut r2 = [0f64; LANES];
    let mut r4 = [0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let d = c[l] as f64 - mean;
            let d2 = d * d;
            r2[l] += d2;
            r4[l] += d2 * d2;
        }
    }
    for (l, &x) in rem.iter().enumerate() {
        let d = x as f64 - mean;
        let d2 = d * d;
        r2[l] += d2;
        r4[l] += d2 * d2;
    }
    (r2.iter().sum(), r4.iter().sum())
}

/// Sum of (x - p)^2 over the element pairs of two rows, in f64 lanes. Finite exactly when every
/// value of both rows is.
fn pair_sumsq(prev: &[f32], row: &[f32]) -> f64 {
    let mut d = [0f64; LANES];
    let pc = prev.chunks_exact(LANES);
    let rc = row.chunks_exact(LANES);
    let (prem, rrem) = (pc.remainder(), rc.remainder());
    for (p, x) in pc.zip(rc) {
        for l in 0..LANES {
            let e = x[l] as f64 - p[l] as f64;
            d[l] += e * e;
        }
    }
    for (l, (p, x)) in prem.iter().zip(rrem).enumerate() {
        let e = *x as f64 - *p as f64;
        d[l] += e * e;
    }
    d.iter().sum()
}

/// The f64 row loops: the portable versions above, or on x86-64 with AVX2 the same loops
/// written with AVX2 intrinsics (LLVM's vectorizer interleaves the portable versions' lanes
/// badly: measured 3-4x slower than the intrinsics). Both do the same operations per lane in the
/// same order and reduce the 16 lanes in the same order, so they give the same bits (a unit test
/// checks this).
#[derive(Clone, Copy)]
struct RowFns {
    sums: fn(&[f32], f64) -> (f64, f64, f64),
    centred: fn(&[f32], f64) -> (f64, f64),
    pairs: fn(&[f32], &[f32]) -> f64,
    /// Pass 1 of a row in one read ([`avx512::row_pass`]), where the CPU has AVX-512F; else
    /// [`RowFns::row_pass`] composes `sums`, the extremes, the per-channel max and `pairs`.
    fused: Option<FusedRow>,
}

/// Signature of a fused pass-1 row loop: (row, pivot, the previous row for `adj_sumsq`, the
/// per-channel max|x| to update).
type FusedRow = fn(&[f32], f64, Option<&[f32]>, Option<&mut [f32]>) -> RowPass;

/// What pass 1 takes from one row.
#[derive(Clone, Copy, Debug)]
struct RowPass {
    /// (sum of `x - pivot`, sum |x|, sum x^2) in 16 f64 lanes ([`row_sums`]): finite exactly
    /// when every value of the row is.
    sums: (f64, f64, f64),
    /// (non-zero count, min, max) of the row ([`row_extremes`]); read only when `sums` are
    /// finite.
    extremes: (u32, f32, f32),
    /// Sum of (x - p)^2 over the pairs with the previous row ([`pair_sumsq`]); NaN when no
    /// previous row was given.
    pair: f64,
}

impl RowFns {
    fn portable() -> RowFns {
        RowFns {
            sums: row_sums,
            centred: row_centred,
            pairs: pair_sumsq,
            fused: None,
        }
    }

    /// The AVX2 loops (what a CPU with AVX2 and without AVX-512F runs), or `None` without AVX2.
    #[cfg(target_arch = "x86_64")]
    fn avx2() -> Option<RowFns> {
        std::arch::is_x86_feature_detected!("avx2").then_some(RowFns {
            // SAFETY (all three): the CPU supports AVX2, checked just above.
            sums: |r, p| unsafe { avx2::row_sums(r, p) },
            centred: |r, m| unsafe { avx2::row_centred(r, m) },
            pairs: |p, r| unsafe { avx2::pair_sumsq(p, r) },
            fused: None,
        })
    }

    fn detect() -> RowFns {
        #[cfg(target_arch = "x86_64")]
        if let Some(fns) = RowFns::avx2() {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                return fns;
            }
            return RowFns {
                // SAFETY (both): the CPU supports AVX-512F, checked just above; `row_pass`
                // checks the slices' lengths.
                centred: |r, m| unsafe { avx512::row_centred(r, m) },
                fused: Some(|r, p, prev, chan| unsafe { avx512::row_pass(r, p, prev, chan) }),
                ..fns
            };
        }
        RowFns::portable()
    }

    /// Pass 1 of one row: its sums, and when they are finite its extremes, with `chan` (the
    /// per-channel max|x|, one per value of the row) raised to the row's finite |x|; the pair
    /// sum with `prev` when given. A row with a non-finite value leaves `chan` as it was or
    /// raised to its finite |x| (the fused loop), which the element path then computes anyway:
    /// the per-channel maxima are the same either way.
    #[inline(always)]
    fn row_pass(&self, row: &[f32], pivot: f64, prev: Option<&[f32]>, chan: Option<&mut [f32]>) -> RowPass {
        if let Some(f) = self.fused {
            return f(row, pivot, prev, chan);
        }
        let sums = (self.sums)(row, pivot);
        let extremes = if sums.0.is_finite() && sums.2.is_finite() {
            if let Some(chan) = chan {
                chan_absmax(chan, row);
            }
            row_extremes(row)
        } else {
            (0, f32::INFINITY, f32::NEG_INFINITY)
        };
        let pair = prev.map_or(f64::NAN, |p| (self.pairs)(p, row));
        RowPass { sums, extremes, pair }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The kernel's loops with AVX-512. The histogram count of [`super::Binner::count_all`]
    //! for up to 32 bins (the default), without one memory increment per value: a row of 4096
    //! values or more as one-hot words summed by a carry-save positional popcount
    //! ([`count_onehot`]), shorter rows and the rest 64 values per step with one comparison per
    //! bin; safety: the CPU must support AVX-512F, AVX-512BW, AVX2 and POPCNT. Pass 1 of a row
    //! in one read ([`row_pass`]), the kurtosis pass ([`row_centred`]) and the extremes of a
    //! sketch with no sums ([`extremes`]); safety: the CPU must support AVX-512F.

    use super::LANES;
    use std::arch::x86_64::*;

    /// The bin of each of 16 values, as bytes: exactly the operations of
    /// [`super::Binner32::bin`] (IEEE f32 sub, mul, sub; no fused multiply-add; clamp; truncate;
    /// one comparison against the upper edge, looked up in the two registers `t` of 32 upper
    /// edges), then clamped to `top` as [`super::avx2::count_all32`] does (a value outside the
    /// contract miscounts rather than leaves the counters).
    #[inline(always)]
    unsafe fn bins16(b: &Consts, x: __m512) -> __m128i {
        _mm512_cvtepi32_epi8(bins16_i32(b, x))
    }

    /// [`bins16`] as 32-bit lanes.
    #[inline(always)]
    unsafe fn bins16_i32(b: &Consts, x: __m512) -> __m512i {
        let t0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(x, b.lo), b.scale), b.half);
        // t0 is finite (x finite, |x - lo| <= hi - lo < f32::MAX / 2): max/min clamp it as
        // f32::clamp does (a -0.0 becomes +0.0; both truncate to 0).
        let i = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(t0, b.zero), b.last));
        let upper = _mm512_permutex2var_ps(b.t[0], i, b.t[1]);
        let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, upper);
        _mm512_min_epi32(_mm512_mask_add_epi32(i, ge, i, b.one), b.top)
    }

    /// Carry-save adder of three bit vectors: (carry, sum) = (majority, xor), bit by bit.
    #[inline(always)]
    unsafe fn csa(a: __m512i, b: __m512i, c: __m512i) -> (__m512i, __m512i) {
        (_mm512_ternarylogic_epi32::<0xE8>(a, b, c), _mm512_ternarylogic_epi32::<0x96>(a, b, c))
    }

    /// Values per block of [`count_onehot`]: a counter position gains at most `BLOCK / 16`
    /// = 2^16 in a block, which [`LEVELS`] bit-sliced levels hold.
    const BLOCK: usize = 1 << 20;
    /// Bit-sliced counter levels above the four of the carry-save tree (weights 16 to 2^16):
    /// a position's count in a block is at most 2^16, 17 bits.
    const LEVELS: usize = 13;

    /// Count `row` (its length a multiple of 256) into `lanes[0..bins]` by a positional
    /// popcount: each value becomes a 32-bit one-hot word (bit `bin` set; `bins <= 32`),
    /// sixteen to a register, and the words are summed bit position by bit position in
    /// bit-sliced counters with a Harley-Seal carry-save tree (Harley and Seal's population
    /// count as Mula, Kurz and Lemire vectorize it, "Faster Population Counts Using AVX2
    /// Instructions", Computer Journal 2018): 15 carry-save adders per 16 registers, two
    /// `vpternlogd` each, then the sixteens rippled into [`LEVELS`] higher levels. At the end of
    /// each block of [`BLOCK`] values, bin `j`'s count is the sum over levels of the level's
    /// weight times the number of lanes with bit `j` set. The bins are [`bins16_i32`]'s, so
    /// the counts are those of every other path.
    #[target_feature(enable = "avx512f,avx512bw,avx2,popcnt")]
    unsafe fn count_onehot(c: &Consts, row: &[f32], lanes: &mut [u64], bins: usize) {
        debug_assert!(row.len() % 256 == 0 && bins <= 32);
        let one = _mm512_set1_epi32(1);
        let zero = _mm512_setzero_si512();
        for block in row.chunks(BLOCK) {
            let (mut ones, mut twos, mut fours, mut eights) = (zero, zero, zero, zero);
            let mut high = [zero; LEVELS];
            for g in block.chunks_exact(256) {
                let p = g.as_ptr();
                // Shift counts above 31 (not produced for values in the contract) give 0.
                let v = |i: usize| _mm512_sllv_epi32(one, bins16_i32(c, _mm512_loadu_ps(p.add(16 * i))));
                // Four inputs into the ones and twos: (fours carried out, ones, twos).
                let quad = |o: __m512i, t: __m512i, i: usize| {
                    let (twos_a, o) = csa(o, v(i), v(i + 1));
                    let (twos_b, o) = csa(o, v(i + 2), v(i + 3));
                    let (fours, t) = csa(t, twos_a, twos_b);
                    (fours, o, t)
                };
                let (fours_a, o, t) = quad(ones, twos, 0);
                let (fours_b, o, t) = quad(o, t, 4);
                let (eights_a, f) = csa(fours, fours_a, fours_b);
                let (fours_a, o, t) = quad(o, t, 8);
                let (fours_b, o, t) = quad(o, t, 12);
                let (eights_b, f) = csa(f, fours_a, fours_b);
                let (sixteens, e) = csa(eights, eights_a, eights_b);
                (ones, twos, fours, eights) = (o, t, f, e);
                let mut carry = sixteens;
                for h in high.iter_mut() {
                    let next = _mm512_and_si512(*h, carry);
                    *h = _mm512_xor_si512(*h, carry);
                    carry = next;
                }
                debug_assert!(_mm512_test_epi32_mask(carry, carry) == 0, "bit-sliced counter overflow");
            }
            let levels = [(ones, 1u64), (twos, 2), (fours, 4), (eights, 8)]
                .into_iter()
                .chain(high.iter().enumerate().map(|(i, &h)| (h, 16u64 << i)));
            for (v, weight) in levels {
                for (j, l) in lanes[..bins].iter_mut().enumerate() {
                    let lanes_set = _mm512_test_epi32_mask(v, _mm512_set1_epi32(1 << j)).count_ones() as u64;
                    *l += weight * lanes_set;
                }
            }
        }
    }

    /// Pass 1 of one row in one read, 16 values a step: the sums of [`super::row_sums`] and
    /// the pair sum of [`super::pair_sumsq`] in the same 16 f64 lanes (two registers of
    /// eight; lane `l` is element `l` of each 16-value chunk, the remainder goes through lanes
    /// 0.. in order, the lanes are summed 0 to 15), so the same bits; the extremes of
    /// [`super::extremes`] in 16 f32 lanes (`vminps`/`vmaxps` keep the lane's value on a tie
    /// and on NaN, as its comparisons do); and `chan` raised to each finite |x| (a masked
    /// `vmaxps`, so a row with a non-finite value raises it only where the element path
    /// would). The composition ([`super::RowFns::row_pass`]) reads a row two to four times,
    /// four f64 lanes an instruction. Measured with `benches/kernel.rs` (this 2-core Xeon,
    /// 2026-12-06, the old and new binaries alternated three times, best of each): the full
    /// tensor set 0.77-0.91x the composition's time (median 0.83x) over the chain MLP's
    /// `[64, 256]` and MiniLM's `[8, 128, 384]` and `[8, 128, 1536]`, raw and ReLU, at data
    /// scales 1, 1e-10, 1e-21 and 1e25 (1.2 ns a value at `[64, 256]` against 1.4).
    /// Safety: the CPU must support AVX-512F. Panics if `prev` or `chan` is shorter than
    /// `row` (a longer one is read to `row`'s length).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn row_pass(row: &[f32], pivot: f64, prev: Option<&[f32]>, chan: Option<&mut [f32]>) -> super::RowPass {
        // The raw-pointer loop reads `prev` and `chan` up to `row.len()`: a shorter one panics
        // here rather than being read or written past its end.
        let prev = prev.map(|p| &p[..row.len()]);
        let mut chan = chan.map(|c| &mut c[..row.len()]);
        let pv = _mm512_set1_pd(pivot);
        let zd = _mm512_setzero_pd();
        let (mut s, mut a, mut q, mut d) = ([zd; 2], [zd; 2], [zd; 2], [zd; 2]);
        let zero = _mm512_setzero_ps();
        let inf = _mm512_set1_ps(f32::INFINITY);
        let one = _mm512_set1_epi32(1);
        let mut z = _mm512_setzero_si512();
        let mut lo = inf;
        let mut hi = _mm512_set1_ps(f32::NEG_INFINITY);
        let bulk = row.len() / LANES * LANES;
        let r = row.as_ptr();
        let mut i = 0;
        while i < bulk {
            let x = _mm512_loadu_ps(r.add(i));
            // `x != 0.0` (true for NaN, as Rust's `!=`).
            z = _mm512_mask_add_epi32(z, _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(x, zero), z, one);
            lo = _mm512_min_ps(x, lo);
            hi = _mm512_max_ps(x, hi);
            if let Some(c) = chan.as_deref_mut() {
                let ax = _mm512_abs_ps(x);
                let cp = c.as_mut_ptr().add(i);
                let m = _mm512_loadu_ps(cp);
                _mm512_storeu_ps(cp, _mm512_mask_max_ps(m, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ax, inf), m, ax));
            }
            for k in 0..2 {
                let xd = _mm512_cvtps_pd(_mm256_loadu_ps(r.add(i + 8 * k)));
                s[k] = _mm512_add_pd(s[k], _mm512_sub_pd(xd, pv));
                a[k] = _mm512_add_pd(a[k], _mm512_abs_pd(xd));
                q[k] = _mm512_add_pd(q[k], _mm512_mul_pd(xd, xd));
                if let Some(p) = prev {
                    let e = _mm512_sub_pd(xd, _mm512_cvtps_pd(_mm256_loadu_ps(p.as_ptr().add(i + 8 * k))));
                    d[k] = _mm512_add_pd(d[k], _mm512_mul_pd(e, e));
                }
            }
            i += LANES;
        }
        let (mut s, mut a, mut q, mut d) = (lanes(s), lanes(a), lanes(q), lanes(d));
        let mut zl: [u32; LANES] = std::mem::transmute(z);
        let mut lol: [f32; LANES] = std::mem::transmute(lo);
        let mut hil: [f32; LANES] = std::mem::transmute(hi);
        for (l, &x) in row[bulk..].iter().enumerate() {
            let xd = x as f64;
            s[l] += xd - pivot;
            a[l] += xd.abs();
            q[l] += xd * xd;
            if let Some(p) = prev {
                let e = xd - p[bulk + l] as f64;
                d[l] += e * e;
            }
            zl[l] += (x != 0.0) as u32;
            lol[l] = lol[l].min(x);
            hil[l] = hil[l].max(x);
            if let Some(c) = chan.as_deref_mut() {
                if x.abs() < f32::INFINITY {
                    c[bulk + l] = c[bulk + l].max(x.abs());
                }
            }
        }
        super::RowPass {
            sums: (s.iter().sum(), a.iter().sum(), q.iter().sum()),
            extremes: (
                zl.iter().sum(),
                lol.iter().copied().fold(f32::INFINITY, f32::min),
                hil.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            ),
            pair: if prev.is_some() { d.iter().sum() } else { f64::NAN },
        }
    }

    /// [`super::extremes`] 64 values a step in four registers of 16 lanes: the step's four
    /// `vminps`/`vmaxps` chains run in parallel, where 16 lanes (one register, or the AVX2
    /// loop's two) wait on one chain's latency every 16 values. The counts are the same
    /// integers and the extremes the same values; of equal zeros a lane keeps the first it
    /// reads, so a zero extreme may come back with the other sign than the 16-lane loop's
    /// (this path serves only sketches with no sums, whose statistics write a zero extreme as
    /// +0 or read its absolute value). Measured with `benches/kernel.rs` as
    /// [`row_pass`]: `stats=[max]` 0.67-0.91x the AVX2 loop's time (0.09 ns a value at
    /// `[64, 256]` against 0.12; at `[8, 128, 1536]`, 3 MB, the least gain: the read from L2
    /// and beyond bounds it). Safety: the CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn extremes<const COUNT: bool>(row: &[f32]) -> (u32, f32, f32, usize) {
        const STEP: usize = 4 * LANES;
        let zero = _mm512_setzero_ps();
        let inf = _mm512_set1_ps(f32::INFINITY);
        let one = _mm512_set1_epi32(1);
        let (mut z, mut fin) = ([_mm512_setzero_si512(); 4], [_mm512_setzero_si512(); 4]);
        let (mut lo, mut hi) = ([inf; 4], [_mm512_set1_ps(f32::NEG_INFINITY); 4]);
        let bulk = row.len() / STEP * STEP;
        let r = row.as_ptr();
        let mut i = 0;
        while i < bulk {
            for k in 0..4 {
                let x = _mm512_loadu_ps(r.add(i + LANES * k));
                // `x != 0.0` (true for NaN, as Rust's `!=`); `|x| < inf` (false for NaN).
                z[k] = _mm512_mask_add_epi32(z[k], _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(x, zero), z[k], one);
                if COUNT {
                    fin[k] = _mm512_mask_add_epi32(fin[k], _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(x), inf), fin[k], one);
                }
                // The lane's value on a tie and on a NaN `x`, as the comparisons of the
                // portable loop.
                lo[k] = _mm512_min_ps(x, lo[k]);
                hi[k] = _mm512_max_ps(x, hi[k]);
            }
            i += STEP;
        }
        let (mut zs, mut fins) = (0u32, 0usize);
        let (mut l, mut h) = (f32::INFINITY, f32::NEG_INFINITY);
        for k in 0..4 {
            zs += _mm512_reduce_add_epi32(z[k]) as u32;
            fins += _mm512_reduce_add_epi32(fin[k]) as u32 as usize;
            l = l.min(_mm512_reduce_min_ps(lo[k]));
            h = h.max(_mm512_reduce_max_ps(hi[k]));
        }
        for &x in &row[bulk..] {
            zs += (x != 0.0) as u32;
            if COUNT {
                fins += (x.abs() < f32::INFINITY) as usize;
            }
            l = l.min(x);
            h = h.max(x);
        }
        (zs, l, h, if COUNT { row.len() - fins } else { 0 })
    }

    /// [`super::row_centred`] in two registers of eight f64 lanes: the same lanes, operations
    /// and order, so the same bits. Safety: the CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn row_centred(row: &[f32], mean: f64) -> (f64, f64) {
        let m = _mm512_set1_pd(mean);
        let zd = _mm512_setzero_pd();
        let (mut r2, mut r4) = ([zd; 2], [zd; 2]);
        let bulk = row.len() / LANES * LANES;
        let r = row.as_ptr();
        let mut i = 0;
        while i < bulk {
            for k in 0..2 {
                let dv = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(r.add(i + 8 * k))), m);
                let d2 = _mm512_mul_pd(dv, dv);
                r2[k] = _mm512_add_pd(r2[k], d2);
                r4[k] = _mm512_add_pd(r4[k], _mm512_mul_pd(d2, d2));
            }
            i += LANES;
        }
        let (mut r2, mut r4) = (lanes(r2), lanes(r4));
        for (l, &x) in row[bulk..].iter().enumerate() {
            let dv = x as f64 - mean;
            let d2 = dv * dv;
            r2[l] += d2;
            r4[l] += d2 * d2;
        }
        (r2.iter().sum(), r4.iter().sum())
    }

    #[inline(always)]
    unsafe fn lanes(v: [__m512d; 2]) -> [f64; LANES] {
        std::mem::transmute(v)
    }

    struct Consts {
        lo: __m512,
        scale: __m512,
        half: __m512,
        zero: __m512,
        last: __m512,
        one: __m512i,
        top: __m512i,
        t: [__m512; 2],
    }

    /// Count every value of `row` into `lanes` as [`super::avx2::count_all32`] does, for at
    /// most 32 bins. The bins of 64 values are computed 16 at a time ([`bins16`]) and packed
    /// as 64 bytes; then for each bin one byte comparison gives a 64-bit mask whose popcount
    /// is the number of those values in the bin, added to counter set 0. A row's last
    /// `len % 64` values go through the AVX2 loop. The bins are those of the scalar binner,
    /// value for value, and so are the counts (test `count_all_bins_every_value_as_numpy_does`
    /// runs this path, the AVX2 one and the portable one).
    ///
    /// Why: the AVX2 loop stores each chunk's eight bin indices and increments eight counters
    /// in memory; on this machine's Xeon (Sapphire Rapids) `perf annotate` put most of its
    /// time in extracting the indices (`vpextrd`) and the increments. Measured here on 64
    /// ReLU rows of 256 values, 32 bins: 0.55 ns a value against 1.12 ns for the AVX2 loop
    /// (a whole 16 384-value tensor: 0.46 ns, and 0.20 ns by the one-hot count that now takes
    /// rows of 4096 values or more), and on the chain MLP bench (one binary, this path switched off and on by a temporary
    /// switch, two alternations) the full `matmul` set went from 1.23-1.31x to 1.14-1.22x
    /// with untapped runs as fast as before (no frequency drop from the 512-bit integer
    /// ops on this CPU; older Xeons lower their clock for 512-bit code, not measured).
    /// Counting the AVX2 loop's indices in byte lanes (a one-hot byte mask per value, 32
    /// bins to a register) measured no faster than the memory increments and was not kept.
    ///
    /// Safety: as the module's; `b.upper` has at most 33 values (32 bins); every value of
    /// `row` is finite and in `[lo, hi]`; `lanes` holds `HIST_SETS x bins` counters.
    #[target_feature(enable = "avx512f,avx512bw,avx2,popcnt")]
    pub(super) unsafe fn count_all32(b: &super::Binner32, row: &[f32], lanes: &mut [u64]) {
        let bins = b.upper.len() - 1;
        debug_assert!(bins <= 32 && lanes.len() >= super::HIST_SETS * bins);
        let mut padded = [f32::INFINITY; 32];
        padded[..bins].copy_from_slice(&b.upper[1..]);
        let c = Consts {
            lo: _mm512_set1_ps(b.lo),
            scale: _mm512_set1_ps(b.scale),
            half: _mm512_set1_ps(0.5),
            zero: _mm512_setzero_ps(),
            last: _mm512_set1_ps(b.last),
            one: _mm512_set1_epi32(1),
            top: _mm512_set1_epi32(bins as i32 - 1),
            t: [_mm512_loadu_ps(padded.as_ptr()), _mm512_loadu_ps(padded.as_ptr().add(16))],
        };
        // Long rows (a whole tensor, the caller's usual case) take the one-hot count; its
        // per-call cost (reading out the levels, 18 x bins mask tests) is paid back after a
        // few thousand values.
        let row = if row.len() >= 4096 {
            let bulk = row.len() / 256 * 256;
            count_onehot(&c, &row[..bulk], lanes, bins);
            &row[bulk..]
        } else {
            row
        };
        let mut counts = [0u64; 32];
        let chunks = row.chunks_exact(64);
        let rem = chunks.remainder();
        for q in chunks {
            let p = q.as_ptr();
            let v = _mm512_castsi128_si512(bins16(&c, _mm512_loadu_ps(p)));
            let v = _mm512_inserti32x4::<1>(v, bins16(&c, _mm512_loadu_ps(p.add(16))));
            let v = _mm512_inserti32x4::<2>(v, bins16(&c, _mm512_loadu_ps(p.add(32))));
            let v = _mm512_inserti32x4::<3>(v, bins16(&c, _mm512_loadu_ps(p.add(48))));
            let mut k = _mm512_setzero_si512();
            let step = _mm512_set1_epi8(1);
            for n in counts[..bins].iter_mut() {
                *n += _mm512_cmpeq_epi8_mask(v, k).count_ones() as u64;
                k = _mm512_add_epi8(k, step);
            }
        }
        for (l, n) in lanes[..bins].iter_mut().zip(&counts) {
            *l += n;
        }
        super::avx2::count_all32(b, rem, lanes);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! [`super::row_sums`], [`super::row_centred`] and [`super::pair_sumsq`] with AVX2
    //! intrinsics: lane `l` of the 16 is element `l` of each 16-element chunk, as in the
    //! portable versions; the remainder goes through lanes 0.. in order, then the lanes are
    //! summed 0 to 15. Safety (every function): the CPU must support AVX2.

    use super::LANES;
    use std::arch::x86_64::*;

    /// [`super::Binner::count_all`] with the f32 binner, eight values at a time: the bin
    /// estimate `((x - lo) * scale - 0.5)` clamped to `[0, bins - 1]` and truncated, then one
    /// gathered comparison against the upper edge, exactly the operations of
    /// [`super::Binner32::bin`] (IEEE f32 sub, mul, sub; no fused multiply-add), so every value
    /// lands in the same bin. Element `j` of a chunk counts into counter set `j` of `lanes`
    /// ([`super::HIST_SETS`] sets of `bins`); the remainder goes through the scalar
    /// binner into set 0.
    ///
    /// Safety: the CPU must support AVX2; every value of `row` is finite and in `[lo, hi]`;
    /// `lanes` holds at least `HIST_SETS * bins` counters.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn count_all32(b: &super::Binner32, row: &[f32], lanes: &mut [u64]) {
        let bins = b.upper.len() - 1;
        debug_assert!(lanes.len() >= super::HIST_SETS * bins);
        let lo = _mm256_set1_ps(b.lo);
        let scale = _mm256_set1_ps(b.scale);
        let half = _mm256_set1_ps(0.5);
        let zero = _mm256_setzero_ps();
        let last = _mm256_set1_ps(b.last);
        let top = _mm256_set1_epi32(bins as i32 - 1);
        // upper[i + 1] for i in [0, bins - 1]: `upper` has bins + 1 values.
        let edges = b.upper.as_ptr().add(1);
        // Up to 32 bins (the default is 32) the upper edges sit in four registers, looked up
        // with in-register permutes: a gather was the loop's bottleneck (measured: half the
        // kernel's samples on one instruction on this machine's Xeon, where gathers are slow).
        let table = bins <= 32;
        let mut padded = [f32::INFINITY; 32];
        if table {
            padded[..bins].copy_from_slice(&b.upper[1..]);
        }
        let t: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(padded.as_ptr().add(8 * k)));
        let chunks = row.chunks_exact(8);
        let rem = chunks.remainder();
        let mut idx = [0i32; 8];
        for q in chunks {
            let x = _mm256_loadu_ps(q.as_ptr());
            let t0 = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(x, lo), scale), half);
            // t0 is finite (x finite, |x - lo| <= hi - lo < f32::MAX / 2): max/min clamp it
            // as f32::clamp does (a -0.0 becomes +0.0; both truncate to 0).
            let i = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(t0, zero), last));
            let upper = if table {
                // Entry i of the 32: the permutes take i's low three bits, blends on bit 3
                // (moved to the sign bit) and bit 4 pick the register.
                let b3 = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i));
                let b4 = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(i));
                let low = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], i), _mm256_permutevar8x32_ps(t[1], i), b3);
                let high = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[2], i), _mm256_permutevar8x32_ps(t[3], i), b3);
                _mm256_blendv_ps(low, high, b4)
            } else {
                _mm256_i32gather_ps::<4>(edges, i)
            };
            // All ones (-1) where x >= the upper edge: subtracting it adds one.
            let ge = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(x, upper));
            // Clamped again so that a value outside the contract (+inf: `inf >= inf` would
            // add one past the last bin) miscounts instead of writing out of bounds; for
            // finite values in [lo, hi] the index is already at most bins - 1.
            _mm256_storeu_si256(idx.as_mut_ptr().cast(), _mm256_min_epi32(_mm256_sub_epi32(i, ge), top));
            for (j, &k) in idx.iter().enumerate() {
                // 0 <= k <= bins - 1 (clamped above; the truncation of a value >= 0).
                *lanes.get_unchecked_mut(j * bins + k as usize) += 1;
            }
        }
        for &x in rem {
            lanes[b.bin(x)] += 1;
        }
    }

    /// Four f64 values from `p[0..4]` (f32, converted exactly).
    #[inline(always)]
    unsafe fn load4(p: &[f32]) -> __m256d {
        debug_assert!(p.len() >= 4);
        _mm256_cvtps_pd(_mm_loadu_ps(p.as_ptr()))
    }

    #[inline(always)]
    unsafe fn lanes(v: [__m256d; 4]) -> [f64; LANES] {
        std::mem::transmute(v)
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_sums(row: &[f32], pivot: f64) -> (f64, f64, f64) {
        let pv = _mm256_set1_pd(pivot);
        let sign = _mm256_set1_pd(-0.0);
        let zero = _mm256_setzero_pd();
        let (mut s, mut a, mut q) = ([zero; 4], [zero; 4], [zero; 4]);
        let chunks = row.chunks_exact(LANES);
        let rem = chunks.remainder();
        for c in chunks {
            for k in 0..4 {
                let x = load4(&c[4 * k..]);
                s[k] = _mm256_add_pd(s[k], _mm256_sub_pd(x, pv));
                a[k] = _mm256_add_pd(a[k], _mm256_andnot_pd(sign, x));
                q[k] = _mm256_add_pd(q[k], _mm256_mul_pd(x, x));
            }
        }
        let (mut s, mut a, mut q) = (lanes(s), lanes(a), lanes(q));
        for (l, &x) in rem.iter().enumerate() {
            let xd = x as f64;
            s[l] += xd - pivot;
            a[l] += xd.abs();
            q[l] += xd * xd;
        }
        (s.iter().sum(), a.iter().sum(), q.iter().sum())
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_centred(row: &[f32], mean: f64) -> (f64, f64) {
        let m = _mm256_set1_pd(mean);
        let zero = _mm256_setzero_pd();
        let (mut r2, mut r4) = ([zero; 4], [zero; 4]);
        let chunks = row.chunks_exact(LANES);
        let rem = chunks.remainder();
        for c in chunks {
            for k in 0..4 {
                let d = _mm256_sub_pd(load4(&c[4 * k..]), m);
                let d2 = _mm256_mul_pd(d, d);
                r2[k] = _mm256_add_pd(r2[k], d2);
                r4[k] = _mm256_add_pd(r4[k], _mm256_mul_pd(d2, d2));
            }
        }
        let (mut r2, mut r4) = (lanes(r2), lanes(r4));
        for (l, &x) in rem.iter().enumerate() {
            let d = x as f64 - mean;
            let d2 = d * d;
            r2[l] += d2;
            r4[l] += d2 * d2;
        }
        (r2.iter().sum(), r4.iter().sum())
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pair_sumsq(prev: &[f32], row: &[f32]) -> f64 {
        let mut d = [_mm256_setzero_pd(); 4];
        let pc = prev.chunks_exact(LANES);
        let rc = row.chunks_exact(LANES);
        let (prem, rrem) = (pc.remainder(), rc.remainder());
        for (p, x) in pc.zip(rc) {
            for k in 0..4 {
                let e = _mm256_sub_pd(load4(&x[4 * k..]), load4(&p[4 * k..]));
                d[k] = _mm256_add_pd(d[k], _mm256_mul_pd(e, e));
            }
        }
        let mut d = lanes(d);
        for (l, (p, x)) in prem.iter().zip(rrem).enumerate() {
            let e = *x as f64 - *p as f64;
            d[l] += e * e;
        }
        d.iter().sum()
    }
}

/// `x` as f32 when f32 holds it to 6e-8 relative: zero, or a magnitude in
/// [`f32::MIN_POSITIVE`, `f32::MAX`]. Anything else (overflow, a denormal or zero result of a
/// non-zero sum, NaN) is NaN, which the recorder leaves out.
fn f32_or_nan(x: f64) -> f32 {
    let a = x.abs();
    if x == 0.0 || (a >= f32::MIN_POSITIVE as f64 && a <= f32::MAX as f64) {
        x as f32
    } else {
        f32::NAN
    }
}

/// The histogram's bin edges as `numpy.linspace(lo, hi, bins + 1)` computes them in f64:
/// `i * ((hi - lo) / bins) + lo`, the last edge exactly `hi`. `bins + 1` values.
fn numpy_edges(lo: f64, hi: f64, bins: usize) -> Vec<f64> {
    let step = (hi - lo) / bins as f64;
    let mut e: Vec<f64> = (0..=bins).map(|i| i as f64 * step + lo).collect();
    e[bins] = hi;
    e
}

/// The widest vector extension a loop may use (run-time detection still decides).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Isa {
    /// No vector extension (named by the tests only).
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
    Avx2,
    Avx512,
}

/// Counter sets of the histogram loops: consecutive values count into different sets, so
/// repeated bins (the zeros of a ReLU output, the centre of a bell) do not chain every
/// increment on one counter's store-to-load latency. Eight: one per value of an AVX2 chunk
/// (measured faster than four on the chain MLP's ReLU outputs).
const HIST_SETS: usize = 8;

/// Equal-width bins over `[lo, hi]` assigned as `numpy.histogram` assigns them.
struct Binner {
    lo: f64,
    hi: f64,
    /// `bins / (hi - lo)`.
    scale: f64,
    last: f64,
    /// The numpy edges with the top one (`hi`) replaced by +inf, so the last bin includes `hi`.
    /// `bins + 1` values.
    upper: Vec<f64>,
    /// The same in f32 arithmetic, where the range allows it (see [`Binner32`]).
    fast: Option<Binner32>,
}

impl Binner {
    /// Requires `lo < hi`, both finite.
    fn new(lo: f64, hi: f64, bins: usize) -> Binner {
        let mut upper = numpy_edges(lo, hi, bins);
        upper[bins] = f64::INFINITY;
        let scale = bins as f64 / (hi - lo);
        let fast = Binner32::new(lo, hi, scale, &upper);
        Binner {
            lo,
            hi,
            scale,
            last: (bins - 1) as f64,
            upper,
            fast,
        }
    }

    /// The bin of `x` (finite, in `[lo, hi]`): the `i` with `edge[i] <= x < edge[i + 1]`, the
    /// last bin also holding `hi` -- numpy's result.
    ///
    /// numpy truncates `(x - lo) / width * bins` and corrects it by one comparison against each
    /// neighbouring edge. Here the scaled offset is lowered by half a bin before truncation, so
    /// the estimate is the bin or the one below, and one comparison against the upper edge
    /// decides (one lookup instead of two). That holds while the offset's error, in bins, is
    /// below one half: it is a few f64 roundings of values up to `bins` plus the edges' own
    /// rounding, at most about `4 * 2^-53 * bins * max(|lo|, |hi|) / (hi - lo)`, and for f32
    /// `lo < hi` the last ratio is at most 2^24, so any `bins` below 2^26 is safe.
    #[inline(always)]
    fn bin(&self, x: f64) -> usize {
        let t = ((x - self.lo) * self.scale - 0.5).clamp(0.0, self.last);
        // In [0, bins - 1] for a finite x; `as` saturates (NaN gives 0), so a value outside the
        // contract miscounts instead of being undefined behaviour.
        let i = t as u32 as usize;
        // SAFETY: i <= bins - 1 and `upper` has bins + 1 values.
        i + (x >= unsafe { *self.upper.get_unchecked(i + 1) }) as usize
    }

    /// Counter sets [`Binner::count_all`] needs: [`HIST_SETS`] with the f32 binner (the AVX2
    /// loop uses them all), four without (the f64 loop; up to 2^24 bins, so half the memory).
    fn counter_sets(&self) -> usize {
        if self.fast.is_some() {
            HIST_SETS
        } else {
            4
        }
    }

    /// Count every value of `row` (all finite, all in `[lo, hi]`) into `lanes`:
    /// [`HIST_SETS`] interleaved counter sets of `bins` each (the portable loop uses the first
    /// four), bin indices computed four at a time. Out of line so the loop sees `self` and
    /// `lanes` as unaliased (measured: 2x faster than inlined into the kernel).
    ///
    /// With the f32 binner on a CPU with AVX2 the indices are computed eight at a time
    /// ([`avx2::count_all32`]: the same f32 operations, so the same bins; measured 3-4x faster
    /// than four at a time in scalar code).
    ///
    /// Up to 32 bins on a CPU with AVX-512BW, without one memory increment per value
    /// ([`avx512::count_all32`]: one-hot words summed by a positional popcount for rows of
    /// 4096 values or more, else 64 values a step; the same bins, so the same counts).
    #[inline(never)]
    fn count_all(&self, row: &[f32], lanes: &mut [u64]) {
        self.count_all_up_to(row, lanes, Isa::Avx512)
    }

    /// [`Binner::count_all`] using no vector extension above `widest` (the tests compare every
    /// path the machine has).
    #[inline(always)]
    fn count_all_up_to(&self, row: &[f32], lanes: &mut [u64], widest: Isa) {
        let bins = self.upper.len() - 1;
        #[cfg(target_arch = "x86_64")]
        if let Some(fast) = &self.fast {
            if widest >= Isa::Avx512
                && bins <= 32
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("popcnt")
            {
                assert!(lanes.len() >= HIST_SETS * bins, "count_all: {} counters for {HIST_SETS} sets of {bins} bins", lanes.len());
                // SAFETY: the CPU supports AVX-512BW, AVX-512F, AVX2 and POPCNT, checked just
                // above; at most 32 bins; `lanes` as asserted.
                unsafe { avx512::count_all32(fast, row, lanes) };
                return;
            }
            if widest >= Isa::Avx2 && std::arch::is_x86_feature_detected!("avx2") {
                assert!(lanes.len() >= HIST_SETS * bins, "count_all: {} counters for {HIST_SETS} sets of {bins} bins", lanes.len());
                // SAFETY: the CPU supports AVX2 (checked just above) and `lanes` holds
                // HIST_SETS x bins counters (asserted); every index is clamped to a bin.
                unsafe { avx2::count_all32(fast, row, lanes) };
                return;
            }
        }
        let ch = row.chunks_exact(4);
        let rem = ch.remainder();
        if let Some(fast) = &self.fast {
            for q in ch {
                let b: [usize; 4] = std::array::from_fn(|l| fast.bin(q[l]));
                for l in 0..4 {
                    lanes[l * bins + b[l]] += 1;
                }
            }
        } else {
            for q in ch {
                let b: [usize; 4] = std::array::from_fn(|l| self.bin(q[l] as f64));
                for l in 0..4 {
                    lanes[l * bins + b[l]] += 1;
                }
            }
        }
        for &x in rem {
            lanes[self.bin(x as f64)] += 1;
        }
    }

    /// Count the finite values of `row` inside `[lo, hi]` into the first counter set of
    /// `lanes`; returns how many finite values lie outside.
    #[inline(never)]
    fn count_finite(&self, row: &[f32], lanes: &mut [u64]) -> u64 {
        let mut outside = 0;
        for &x in row {
            let xd = x as f64;
            if !x.is_finite() {
                continue;
            }
            if xd < self.lo || xd > self.hi {
                outside += 1;
                continue;
            }
            lanes[self.bin(xd)] += 1;
        }
        outside
    }
}

/// [`Binner::bin`] in f32 arithmetic (about 10% faster, measured): the same bins.
///
/// An f32 value `x` lies below an f64 edge `e` exactly when it lies below the smallest f32 at or
/// above `e`, so comparing against those ("ceil32" edges) in f32 is comparing against the numpy
/// edges. The estimate `(x - lo) * scale - 0.5` in f32 has an error of a few f32 roundings of
/// values up to `bins`, about `4 * 2^-24 * bins` bins, below the half bin the one-comparison
/// scheme needs while `bins <= 2^16`. Used only when that holds and `hi - lo` and `scale` are
/// normal f32 values (so `x - lo` cannot overflow), which excludes only ranges near f32's limits.
struct Binner32 {
    lo: f32,
    scale: f32,
    last: f32,
    /// The smallest f32 at or above each of `Binner::upper` (+inf stays +inf).
    upper: Vec<f32>,
}

impl Binner32 {
    fn new(lo: f64, hi: f64, scale: f64, upper: &[f64]) -> Option<Binner32> {
        let bins = upper.len() - 1;
        let normal = |v: f64| (f32::MIN_POSITIVE as f64..=f32::MAX as f64 / 2.0).contains(&v);
        if bins > 1 << 16 || !normal(hi - lo) || !normal(scale) {
            return None;
        }
        let ceil32 = |e: f64| {
            let f = e as f32;
            if (f as f64) < e {
                f.next_up()
            } else {
                f
            }
        };
        Some(Binner32 {
            lo: lo as f32,
            scale: scale as f32,
            last: (bins - 1) as f32,
            upper: upper.iter().map(|&e| ceil32(e)).collect(),
        })
    }

    /// As [`Binner::bin`]; `x` finite and in `[lo, hi]`.
    #[inline(always)]
    fn bin(&self, x: f32) -> usize {
        let t = ((x - self.lo) * self.scale - 0.5).clamp(0.0, self.last);
        // In [0, bins - 1] for a finite x in range (|x - lo| <= hi - lo < f32::MAX / 2, `scale`
        // finite); `as` saturates (NaN gives 0), so a value outside the contract miscounts
        // instead of being undefined behaviour.
        let i = t as u32 as usize;
        // SAFETY: i <= bins - 1 and `upper` has bins + 1 values.
        i + (x >= unsafe { *self.upper.get_unchecked(i + 1) }) as usize
    }
}

/// Per-channel max|x| of one finite row into `chan` (inlined: vectorized for its caller's
/// target features).
#[inline(always)]
fn chan_absmax(chan: &mut [f32], row: &[f32]) {
    for (m, &x) in chan.iter_mut().zip(row) {
        *m = m.max(x.abs());
    }
}

/// True when `spec` needs the f64 row sums (mean, l1, sumsq, kurtosis, pos_sumsq); without
/// them a row is read once, for its extremes.
fn needs_sums(spec: &SketchSpec) -> bool {
    [tensor::MEAN, tensor::L1, tensor::SUMSQ, tensor::KURTOSIS, tensor::POS_SUMSQ].iter().any(|&t| spec.has(t))
}

/// The kernel body: fill `out` (length `spec.len()`) from `data` of run-time shape `dims`.
///
/// Geometry comes from `dims`: channels `C` = last dim, rows `R = data.len() / C` (a remainder
/// of fewer than `C` values is not read; callers pass `data` of `dims`' product), and
/// adjacent-row pairs for `adj_sumsq` run along the second-to-last dim, never across a leading
/// index. A vector statistic whose length in `spec` disagrees with `R` or `C` is written as NaN
/// (undefined, not recorded). Accuracy and what is written when a value does not fit f32: see
/// the module documentation.
///
/// Panics if `out` is shorter than `spec.len()`.
pub fn compute_into(data: &[f32], dims: &[usize], spec: &SketchSpec, out: &mut [f32]) {
    compute_masked(data, dims, spec, None, out)
}

/// [`compute_into`] over the rows `mask` keeps (`mask[r] != 0`; `R` values, one per row, or for
/// a per-head `[B, H, S, D]` tensor `B x S` values, one per (batch, position)): a
/// padding row adds to no statistic, its `pos_sumsq` is undefined (NaN, not recorded), a pair
/// with a padding row adds nothing to `adj_sumsq`, and a sampled `elemsig` element in a padding
/// row is undefined. Without a mask every row counts.
///
/// Panics if `mask` has another length (the sketch op checks it first).
pub fn compute_masked(data: &[f32], dims: &[usize], spec: &SketchSpec, mask: Option<&[f32]>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { compute_masked_avx2(data, dims, spec, mask, out) };
    }
    compute_masked_body(data, dims, spec, mask, out)
}

/// [`compute_masked`] with AVX2 enabled: LLVM vectorizes its per-channel and per-element
/// loops eight lanes wide. No floating-point operation is reordered (Rust never reassociates
/// without fast-math), so the results are the baseline build's. Safety: the CPU must support
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn compute_masked_avx2(data: &[f32], dims: &[usize], spec: &SketchSpec, mask: Option<&[f32]>, out: &mut [f32]) {
    compute_masked_body(data, dims, spec, mask, out)
}

#[inline(always)]
fn compute_masked_body(data: &[f32], dims: &[usize], spec: &SketchSpec, mask: Option<&[f32]>, out: &mut [f32]) {
    let fns = RowFns::detect();
    let chans = dims.last().copied().unwrap_or(1);
    let c = chans.max(1);
    let rows = if chans == 0 { 0 } else { data.len() / c };
    let block = if dims.len() >= 2 { dims[dims.len() - 2].max(1) } else { 1 };
    let want_chan = spec.has(tensor::CHAN_MAXABS) || spec.has(tensor::CHAN_OUTLIER);
    let want_pos = spec.has(tensor::POS_SUMSQ);
    let want_rowmax = spec.has(tensor::ROW_ABSMAX);
    let want_adj = spec.has(tensor::ADJ_SUMSQ);
    // The sums feed mean, l1, sumsq, kurtosis (through the mean) and pos_sumsq only; without
    // them a row's pass is its extremes and a finiteness count (`stats=[max]` reads each value
    // once, not twice). The values written are the same either way (a test compares every
    // statistic of every subset against the full set).
    let want_sums = needs_sums(spec);
    let mut chan = if want_chan { vec![0f32; c] } else { Vec::new() };
    let mut pos = if want_pos { vec![0f64; rows] } else { Vec::new() };
    let mut rowmax = if want_rowmax { vec![0f32; rows] } else { Vec::new() };
    let mut acc = Acc {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        ..Acc::default()
    };
    // One mask value per row, or per (batch, position) of a per-head `[B, H, S, D]` tensor
    // (the mask is `[B, S]`, shared by the heads).
    let per_head = dims.len() == 4 && mask.is_some_and(|m| m.len() != rows && m.len() == dims[0] * dims[2]);
    let kept = |r: usize| match mask {
        None => true,
        Some(m) if per_head => m[(r / (dims[1] * dims[2])) * dims[2] + r % dims[2]] != 0.0,
        Some(m) => m[r] != 0.0,
    };
    // The mean is accumulated as sum(x - pivot): near-constant data keeps its noise digits.
    let pivot = (0..rows)
        .filter(|&r| kept(r))
        .find_map(|r| data[r * c..(r + 1) * c].iter().copied().find(|x| x.is_finite()))
        .unwrap_or(0.0) as f64;

    // A sketch with no row sums, no per-row statistic and no mask (`stats=[max]`, `[min,max]`,
    // `[nnz]`, a histogram alone, ...) reads a finite tensor in one call of the extremes loop
    // instead of one per row: on the chain MLP's 256-wide rows the per-row call and its
    // horizontal folds cost as much as the loop itself (measured). A tensor holding any
    // non-finite value takes the per-row pass below (its counts and element path). The values
    // are the per-row pass's: counts are integers, min and max the same set's extremes (a zero
    // extreme is written as +0 on every path, so the order of +0 and -0 does not show).
    let whole = !want_sums && !want_pos && !want_rowmax && !want_adj && mask.is_none() && rows > 0;
    let whole = whole && {
        // Blocks of 2^24 values keep each lane's u32 count exact.
        let (mut z, mut lo, mut hi, mut bad) = (0u64, f32::INFINITY, f32::NEG_INFINITY, 0usize);
        for b in data[..rows * c].chunks(1 << 24) {
            let e = row_extremes_finite(b);
            z += e.0 as u64;
            lo = lo.min(e.1);
            hi = hi.max(e.2);
            bad += e.3;
        }
        if bad == 0 {
            acc.count = (rows * c) as u64;
            acc.nnz = z;
            acc.min = lo;
            acc.max = hi;
            if want_chan {
                data[..rows * c].chunks_exact(c).for_each(|row| chan_absmax(&mut chan, row));
            }
        }
        bad == 0
    };

    // Pass 1: counts, raw sums, extremes, per-channel max|x|, per-row energy, adjacent-row
    // difference energy. A row whose f64 sums are finite holds only finite values (no finite
    // f32's square overflows f64) and takes the vectorized path; any other row is re-read
    // element by element.
    for r in (0..rows).filter(|_| !whole) {
        if !kept(r) {
            if want_pos {
                pos[r] = f64::NAN;
            }
            if want_rowmax {
                rowmax[r] = f32::NAN;
            }
            continue;
        }
        let row = &data[r * c..(r + 1) * c];
        let prev = (want_adj && r % block != 0 && kept(r - 1)).then(|| &data[(r - 1) * c..r * c]);
        let pass = if want_sums {
            fns.row_pass(row, pivot, prev, want_chan.then_some(&mut chan[..]))
        } else {
            let e = row_extremes_finite(row);
            if e.3 == 0 && want_chan {
                chan_absmax(&mut chan, row);
            }
            RowPass {
                // A finite row: sums of 0 stand in (nothing reads them); else the element path.
                sums: if e.3 == 0 { (0.0, 0.0, 0.0) } else { (f64::NAN, f64::NAN, f64::NAN) },
                extremes: (e.0, e.1, e.2),
                pair: prev.map_or(f64::NAN, |p| (fns.pairs)(p, row)),
            }
        };
        let (s, a, q) = pass.sums;
        let row_sumsq;
        if s.is_finite() && q.is_finite() {
            acc.count += c as u64;
            acc.shifted += s;
            acc.l1 += a;
            acc.sumsq += q;
            let (z, lo, hi) = pass.extremes;
            acc.nnz += z as u64;
            acc.min = acc.min.min(lo);
            acc.max = acc.max.max(hi);
            row_sumsq = q;
            if want_rowmax {
                rowmax[r] = lo.abs().max(hi.abs());
            }
        } else {
            let mut rq = 0f64;
            // Over the finite values; 0 for a row of only non-finite ones (as `chan_maxabs`).
            let mut ra = 0f32;
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
                    acc.shifted += xd - pivot;
                    acc.l1 += xd.abs();
                    acc.sumsq += xd * xd;
                    rq += xd * xd;
                    ra = ra.max(x.abs());
                    acc.nnz += (x != 0.0) as u64;
                    acc.min = acc.min.min(x);
                    acc.max = acc.max.max(x);
                    if want_chan {
                        chan[j] = chan[j].max(x.abs());
                    }
                }
            }
            row_sumsq = rq;
            if want_rowmax {
                rowmax[r] = ra;
            }
        }
        if want_pos {
            pos[r] = row_sumsq;
        }
        if let Some(prev) = prev {
            let total = pass.pair;
            if total.is_finite() {
                acc.adj += total;
            } else {
                // Some element of either row is non-finite: sum the pairs where both are finite.
                for (p, x) in prev.iter().zip(row) {
                    if p.is_finite() && x.is_finite() {
                        let e = (*x as f64) - (*p as f64);
                        acc.adj += e * e;
                    }
                }
            }
        }
    }

    let n = acc.count as f64;
    // A constant tensor: the exact mean is its value, and its kurtosis is undefined.
    let constant = acc.count > 0 && acc.min == acc.max;
    let mean = if constant {
        acc.min as f64
    } else if acc.count > 0 {
        pivot + acc.shifted / n
    } else {
        f64::NAN
    };

    // Pass 2 (only when asked): centred moments for the kurtosis and the histogram.
    let want_kurt = spec.has(tensor::KURTOSIS) && !constant;
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
    let bins = spec.hist_bins.max(1);
    let (lo64, hi64) = (lo as f64, hi as f64);
    let width = hi64 - lo64;
    // A fixed range is validated as finite with lo < hi when parsed, and bins as at most 65536;
    // a spec built by hand with an empty range or more than 2^24 bins (see `Binner::bin`) gets
    // an undefined (NaN) histogram rather than a panic or a wrong count.
    let hist_ok = width > 0.0 && width.is_finite() && bins <= 1 << 24;
    let binner = if want_hist && hist_ok { Some(Binner::new(lo64, hi64, bins)) } else { None };
    // Interleaved counter sets break the store-to-load chain of repeated bins.
    let mut lanes = match &binner {
        Some(b) => vec![0u64; b.counter_sets() * bins],
        None => Vec::new(),
    };
    let mut outside = 0u64;
    let (mut m2, mut m4) = (0f64, 0f64);
    if (want_kurt || (want_hist && hist_ok)) && acc.count > 0 {
        let absmax_range = matches!(spec.hist_range, HistRange::Absmax);
        let all_finite = acc.nan + acc.posinf + acc.neginf == 0;
        // Every value of a finite, unmasked tensor is counted in one call (rows end mid-step
        // of the 64-value AVX-512 loop; the counts are the same however the values are split).
        let whole = absmax_range && all_finite && mask.is_none();
        if let (true, Some(binner)) = (whole, &binner) {
            binner.count_all(&data[..rows * c], &mut lanes);
        }
        // Rows are read again only for the kurtosis or a histogram not counted whole above.
        let per_row = if want_kurt || !whole { rows } else { 0 };
        for (r, row) in data[..per_row * c].chunks(c).enumerate() {
            if !kept(r) {
                continue;
            }
            if want_kurt {
                let (s2, s4) = (fns.centred)(row, mean);
                if s4.is_finite() {
                    m2 += s2;
                    m4 += s4;
                } else {
                    for &x in row {
                        if x.is_finite() {
                            let d = x as f64 - mean;
                            let d2 = d * d;
                            m2 += d2;
                            m4 += d2 * d2;
                        }
                    }
                }
            }
            if let (false, Some(binner)) = (whole, &binner) {
                if absmax_range && (all_finite || row.iter().all(|x| x.is_finite())) {
                    // Every finite value lies in [-max|x|, max|x|]: no range test.
                    binner.count_all(row, &mut lanes);
                } else {
                    outside += binner.count_finite(row, &mut lanes);
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
            // `+ 0.0` writes a zero extreme as +0 (-0 + 0 = +0): which zero a fold keeps
            // depends on the order it reads them in.
            tensor::MIN => dst[0] = v(acc.min as f64 + 0.0),
            tensor::MAX => dst[0] = v(acc.max as f64 + 0.0),
            tensor::MEAN => dst[0] = v(mean),
            tensor::L1 => dst[0] = f32_or_nan(acc.l1),
            tensor::SUMSQ => dst[0] = f32_or_nan(acc.sumsq),
            tensor::NNZ => dst[0] = acc.nnz as f32,
            tensor::KURTOSIS => {
                dst[0] = if want_kurt && acc.count > 0 && m2 > 0.0 {
                    let var = m2 / n;
                    f32_or_nan((m4 / n) / (var * var))
                } else {
                    f32::NAN
                }
            }
            tensor::HIST => {
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = if hist_ok {
                        (0..lanes.len() / bins).map(|l| lanes[l * bins + i]).sum::<u64>() as f32
                    } else {
                        f32::NAN
                    };
                }
            }
            tensor::HIST_LO => dst[0] = v(lo as f64),
            tensor::HIST_HI => dst[0] = v(hi as f64),
            tensor::HIST_OUTSIDE => dst[0] = if hist_ok { outside as f32 } else { f32::NAN },
            tensor::ELEMSIG => {
                for (j, d) in dst.iter_mut().enumerate() {
                    let at = j * elem_n / slot.len.max(1);
                    *d = if elem_n == 0 || !kept(at / c) {
                        f32::NAN
                    } else {
                        data[at]
                    };
                }
            }
            tensor::CHAN_MAXABS => {
                if rows == 0 || acc.count == 0 || chan.len() != slot.len {
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
                    for (d, &p) in dst.iter_mut().zip(&pos) {
                        *d = f32_or_nan(p);
                    }
                } else {
                    dst.fill(f32::NAN);
                }
            }
            tensor::ROW_ABSMAX => {
                if rowmax.len() == slot.len {
                    dst.copy_from_slice(&rowmax);
                } else {
                    dst.fill(f32::NAN);
                }
            }
            tensor::ADJ_SUMSQ => dst[0] = f32_or_nan(acc.adj),
            tensor::NAN_COUNT => dst[0] = acc.nan as f32,
            tensor::POSINF_COUNT => dst[0] = acc.posinf as f32,
            tensor::NEGINF_COUNT => dst[0] = acc.neginf as f32,
            tensor::HASH => {
                let bytes = crate::bytes::f32_bytes(data);
                let h = xxhash_rust::xxh3::xxh3_64(bytes);
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = ((h >> (16 * i)) & 0xffff) as f32;
                }
            }
            // Probe statistics never reach the tensor kernel (`SketchSpec::for_shape` never
            // selects them); a foreign spec gets NaN, which is never recorded.
            _ => dst.fill(f32::NAN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 stream from `seed` (reproducible test data without a dependency).
    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Uniform f64 in [0, 1) from [`xorshift`].
    fn uniform(seed: u64) -> impl FnMut() -> f64 {
        let mut next = xorshift(seed);
        move || (next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The extremes pass compiled for AVX2 gives what the baseline build gives: non-zero and
    /// non-finite counts and the min and max (bits), on rows of every length with zeros,
    /// signed zeros, subnormals, infinities and NaN.
    #[test]
    fn extremes_dispatch_equals_the_portable_loop() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let special = [0.0f32, -0.0, 1e-40, -1e-40, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN];
        for len in (0..70).chain([127, 128, 129, 255, 1000]) {
            for trial in 0..20 {
                let row: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = next();
                        if trial % 2 == 1 && r % 7 == 0 { special[(r >> 8) as usize % special.len()] } else { ((r >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32 }
                    })
                    .collect();
                let key = |e: (u32, f32, f32, usize)| (e.0, e.1.to_bits(), e.2.to_bits(), e.3);
                // A zero extreme compared as +0: the AVX-512 loop's 64 lanes may keep the other
                // zero (no caller of that path keeps the sign).
                let plus0 = |e: (u32, f32, f32, usize)| (e.0, (e.1 + 0.0).to_bits(), (e.2 + 0.0).to_bits(), e.3);
                assert_eq!(plus0(extremes_dispatch::<true>(&row)), plus0(extremes_portable::<true>(&row)), "{row:?}");
                assert_eq!(plus0(extremes_dispatch::<false>(&row)), plus0(extremes_portable::<false>(&row)), "{row:?}");
                // The AVX2 loop (what a CPU without AVX-512 runs) to the bit, zero signs too.
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    let (t, f) = unsafe { (extremes_avx2::<true>(&row), extremes_avx2::<false>(&row)) };
                    assert_eq!(key(t), key(extremes_portable::<true>(&row)), "{row:?}");
                    assert_eq!(key(f), key(extremes_portable::<false>(&row)), "{row:?}");
                }
            }
        }
    }

    /// `count_all` puts every value in the bin the f64 binner (numpy's assignment) gives, on
    /// values at, just below and just above every edge, at `lo` and `hi`, and uniform in
    /// between, on every path the CPU has (AVX-512 up to 32 bins, AVX2, portable; a path the
    /// CPU lacks falls back to the next, and the test says so on stderr); rows of every length
    /// mod 8, rows past the 4096 values of the one-hot count and past its 2^20-value block.
    #[test]
    fn count_all_bins_every_value_as_numpy_does() {
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("count_all_bins_every_value_as_numpy_does: no AVX-512BW here, the AVX-512 path is not tested");
        }
        let mut unit = uniform(0x2545_f491_4f6c_dd1d);
        let ranges = [(-1.0f64, 1.0f64), (-3.25e-10, 3.25e-10), (-7e20, 7e20), (0.1, 0.7), (-5.0, -4.999), (-2.5, 9.0)];
        for (lo, hi) in ranges {
            for bins in [1usize, 2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 1000] {
                let b = Binner::new(lo, hi, bins);
                assert!(b.fast.is_some(), "the f32 binner covers [{lo}, {hi}]");
                let mut row: Vec<f32> = Vec::new();
                for &e in &b.upper[..bins] {
                    let f = e as f32;
                    row.extend([f, f.next_down(), f.next_up()]);
                }
                row.extend([lo as f32, hi as f32]);
                row.extend((0..301).map(|_| (lo + (hi - lo) * unit()) as f32));
                // The f32 neighbours of the edges may leave [lo, hi]: keep what count_all's
                // contract admits.
                row.retain(|&x| (x as f64) >= lo && (x as f64) <= hi);
                // Rows longer than a 64-value step and than the 4096 values from which the
                // AVX-512 path counts one-hot words, of several remainder lengths, and rows of
                // a single repeated value (every value in one bin; the longest crosses the
                // one-hot count's block of 2^20 values, after filling its top counter level).
                // Every path counts `r` as the f64 binner bins it.
                let check = |r: &[f32]| {
                    let mut want = vec![0u64; bins];
                    for &x in r {
                        want[b.bin(x as f64)] += 1;
                    }
                    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
                        let mut lanes = vec![0u64; HIST_SETS * bins];
                        b.count_all_up_to(r, &mut lanes, isa);
                        let got: Vec<u64> = (0..bins).map(|k| (0..HIST_SETS).map(|l| lanes[l * bins + k]).sum()).collect();
                        assert_eq!(got, want, "[{lo}, {hi}], {bins} bins, {} values, {isa:?}", r.len());
                    }
                };
                let long = row.repeat(16);
                let same = vec![b.upper[bins / 2] as f32; (1 << 20) + 64 * 5 + 13];
                for r in [&long[..], &long[..long.len() - 63], &long[..4096 + 255], &long[..128 + 17], &same[..333], &same[..]] {
                    let r: Vec<f32> = r.iter().copied().filter(|&x| (x as f64) >= lo && (x as f64) <= hi).collect();
                    check(&r);
                }
                for len in [row.len(), row.len() - 1, row.len() - 3, 7, 8, 9, 0] {
                    check(&row[..len.min(row.len())]);
                }
            }
        }
    }

    /// The AVX2 row loops, and the AVX-512 kurtosis loop where the CPU has it, give the same
    /// bits as the portable ones (the recorded values must not depend on the machine's vector
    /// unit).
    #[test]
    fn avx2_row_loops_equal_portable_bits() {
        let a = RowFns::portable();
        // What this CPU runs (AVX-512 `centred` where it has it) and, with AVX2, the AVX2
        // loops themselves (what a CPU without AVX-512 runs).
        let mut impls = vec![RowFns::detect()];
        #[cfg(target_arch = "x86_64")]
        impls.extend(RowFns::avx2());
        for b in impls {
            let mut bits = xorshift(0x9e37_79b9_7f4a_7c15);
            let mut next = || {
                let state = bits();
                // Spread over many binades, both signs.
                let m = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                m * 10f32.powi((state % 60) as i32 - 30)
            };
            for len in [0usize, 1, 7, 15, 16, 17, 33, 255, 1000] {
                let x: Vec<f32> = (0..len).map(|_| next()).collect();
                let y: Vec<f32> = (0..len).map(|_| next()).collect();
                let bits3 = |t: (f64, f64, f64)| [t.0.to_bits(), t.1.to_bits(), t.2.to_bits()];
                assert_eq!(bits3((a.sums)(&x, 0.25)), bits3((b.sums)(&x, 0.25)), "sums, len {len}");
                let (c, d) = ((a.centred)(&x, -1e-3), (b.centred)(&x, -1e-3));
                assert_eq!((c.0.to_bits(), c.1.to_bits()), (d.0.to_bits(), d.1.to_bits()), "centred, len {len}");
                assert_eq!((a.pairs)(&x, &y).to_bits(), (b.pairs)(&x, &y).to_bits(), "pairs, len {len}");
                // Unit-scale data about a mean of the same scale (above, the wide spread of
                // magnitudes hides the mean: an `x + mean` slip gave the same sums).
                let u: Vec<f32> = (0..len).map(|i| (i * 7919 % 1000) as f32 / 1000.0 - 0.3).collect();
                let (c, d) = ((a.centred)(&u, 0.2), (b.centred)(&u, 0.2));
                assert_eq!((c.0.to_bits(), c.1.to_bits()), (d.0.to_bits(), d.1.to_bits()), "centred unit-scale, len {len}");
                let want: (f64, f64) = u.iter().fold((0.0, 0.0), |t, &v| (t.0 + (v as f64 - 0.2).powi(2), t.1 + (v as f64 - 0.2).powi(4)));
                assert!((c.0 - want.0).abs() <= 1e-12 * want.0.max(1.0) && (c.1 - want.1).abs() <= 1e-12 * want.1.max(1.0), "centred vs host, len {len}");
            }
        }
    }

    /// The fused pass-1 row loop (AVX-512, where the CPU has it) gives the composition's bits:
    /// the sums, the pair sum, and for a finite row the extremes and the per-channel maxima;
    /// for a row with NaN or an infinity, non-finite sums and per-channel maxima that the
    /// element path (the finite |x|) then completes to the same values. Rows of every length
    /// around the 16-value step, with zeros of both signs, subnormals and extreme values.
    #[test]
    fn fused_row_pass_equals_the_composition() {
        let (a, b) = (RowFns::portable(), RowFns::detect());
        #[cfg(target_arch = "x86_64")]
        if b.fused.is_none() {
            eprintln!("fused_row_pass_equals_the_composition: no AVX-512F here, the fused loop is not tested");
        }
        let mut next = xorshift(0x6a09_e667_f3bc_c909);
        let special = [0.0f32, -0.0, 1e-40, -1e-40, f32::MAX, f32::MIN, 3.0e-39, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        for len in [0usize, 1, 5, 15, 16, 17, 31, 32, 33, 64, 255, 256, 257, 1000] {
            for trial in 0..20 {
                let mut gen = |salt: u64| -> Vec<f32> {
                    (0..len)
                        .map(|_| {
                            let r = next() ^ salt;
                            let ordinary = ((r >> 11) as f64 / (1u64 << 53) as f64 * 6.0 - 2.0) as f32 * 10f32.powi((r % 9) as i32 - 4);
                            let zero = if r % 2 == 0 { 0.0 } else { -0.0 };
                            match trial / 4 {
                                // Finite and ordinary.
                                0 => ordinary,
                                // With finite specials (trials 4-7), then with any special.
                                1 | 2 if r % 5 == 0 => special[(r >> 8) as usize % (special.len() - if trial < 8 { 3 } else { 0 })],
                                1 | 2 => ordinary,
                                // A ReLU output with zeros of both signs (ties at a zero
                                // minimum: which zero a lane keeps), then only zeros.
                                3 if r % 3 == 0 => zero,
                                3 => ordinary.max(0.0),
                                _ => zero,
                            }
                        })
                        .collect()
                };
                let (row, prev) = (gen(0), gen(0x5555));
                for with_prev in [false, true] {
                    let p = with_prev.then_some(&prev[..]);
                    let (mut ca, mut cb) = (vec![0.5f32; len], vec![0.5f32; len]);
                    let (x, y) = (a.row_pass(&row, 0.125, p, Some(&mut ca)), b.row_pass(&row, 0.125, p, Some(&mut cb)));
                    let bits3 = |t: (f64, f64, f64)| [t.0.to_bits(), t.1.to_bits(), t.2.to_bits()];
                    let key3 = |e: (u32, f32, f32)| (e.0, e.1.to_bits(), e.2.to_bits());
                    let ctx = format!("len {len}, trial {trial}, prev {with_prev}");
                    // A non-finite sum sends the row (or pair) to the element path whatever it
                    // is (NaN of either sign, an infinity): only finiteness must agree there.
                    let same = |u: f64, v: f64| if u.is_finite() { u.to_bits() == v.to_bits() } else { !v.is_finite() };
                    assert!(same(x.sums.0, y.sums.0) && same(x.sums.1, y.sums.1) && same(x.sums.2, y.sums.2), "sums {:?} vs {:?}, {ctx}", x.sums, y.sums);
                    assert!(same(x.pair, y.pair), "pair {} vs {}, {ctx}", x.pair, y.pair);
                    if !with_prev {
                        assert!(x.pair.is_nan() && y.pair.is_nan(), "no previous row, no pair sum: {ctx}");
                    }
                    let finite = row.iter().all(|v| v.is_finite());
                    assert_eq!(finite, x.sums.0.is_finite() && x.sums.2.is_finite(), "finite sums iff a finite row, {ctx}");
                    assert_eq!(finite, y.sums.0.is_finite() && y.sums.2.is_finite(), "finite sums iff a finite row, {ctx}");
                    if finite {
                        // The 16-lane loop's extremes to the bit (zero signs too), whatever
                        // loop the composition's `row_extremes` dispatches to on this CPU.
                        let key = |e: (u32, f32, f32)| (e.0, e.1.to_bits(), e.2.to_bits());
                        let e = extremes_portable::<false>(&row);
                        assert_eq!(key(y.extremes), key((e.0, e.1, e.2)), "extremes, {ctx}");
                        assert_eq!(ca, cb, "per-channel max, {ctx}");
                    } else {
                        // What the element path then does: raise each channel to the finite |x|.
                        for (ch, &v) in [&mut ca, &mut cb].into_iter().flat_map(|c| c.iter_mut().zip(&row)) {
                            if v.is_finite() {
                                *ch = ch.max(v.abs());
                            }
                        }
                        assert_eq!(ca, cb, "per-channel max after the element path, {ctx}");
                    }
                    if finite {
                        // The composition's parts, called alone.
                        assert_eq!(bits3(x.sums), bits3((a.sums)(&row, 0.125)), "{ctx}");
                    }
                    // Without the per-channel maxima: the same sums, pair and extremes.
                    let w = b.row_pass(&row, 0.125, p, None);
                    assert!(same(w.sums.0, y.sums.0) && same(w.sums.2, y.sums.2) && same(w.pair, y.pair), "{ctx}");
                    if finite {
                        assert_eq!(key3(w.extremes), key3(y.extremes), "{ctx}");
                    }
                }
            }
        }
    }

    /// The f64 and the f32 binning give the bins numpy's edges define, on and beside every edge
    /// and at random, over ranges from 1e-30 to 1e30, symmetric and fixed, for 1 to 65536 bins.
    #[test]
    fn f64_and_f32_bins_are_the_edges_bins() {
        let mut unit = uniform(0x2545_f491_4f6c_dd1d);
        let mut checked = 0;
        for case in 0..3000 {
            let m = ((1.0 + unit()) * 10f64.powi((unit() * 60.0) as i32 - 30)) as f32;
            let (lo, hi) = if case % 2 == 0 {
                (-m, m)
            } else {
                let lo = ((unit() * 2.0 - 1.0) * m as f64) as f32;
                (lo, lo + ((0.001 + unit()) * m as f64) as f32)
            };
            if !(lo < hi) {
                continue;
            }
            let bins = [1usize, 2, 3, 10, 16, 32, 64, 100, 1000, 65536][case % 10];
            let b = Binner::new(lo as f64, hi as f64, bins);
            let fast = b.fast.as_ref().expect("an f32 range of moderate magnitude");
            let step = if bins > 1000 { 97 } else { 1 };
            let mut values: Vec<f32> = numpy_edges(lo as f64, hi as f64, bins)
                .iter()
                .step_by(step)
                .flat_map(|&e| [e as f32, (e as f32).next_down(), (e as f32).next_up()])
                .collect();
            values.extend((0..64).map(|_| (lo as f64 + unit() * (hi as f64 - lo as f64)) as f32));
            let edges = numpy_edges(lo as f64, hi as f64, bins);
            for x in values.into_iter().filter(|&x| x >= lo && x <= hi) {
                // The definition: the last edge at or below x (hi in the last bin).
                let want = (edges.partition_point(|&e| e <= x as f64) - 1).min(bins - 1);
                assert_eq!(b.bin(x as f64), want, "x {x:e} in [{lo:e}, {hi:e}], {bins} bins");
                assert_eq!(fast.bin(x), want, "x {x:e} in [{lo:e}, {hi:e}], {bins} bins");
                checked += 1;
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    /// A range near f32's limits has no f32 binner; `count_all` then bins in f64, and its four
    /// counter lanes add up to each value's own bin.
    #[test]
    fn count_all_without_the_f32_binner_counts_each_value_once() {
        let (lo, hi, bins) = (-3e38f64, 3e38f64, 8usize);
        let b = Binner::new(lo, hi, bins);
        assert!(b.fast.is_none(), "the range is too wide for the f32 binner");
        let row: Vec<f32> = (0..37).map(|i| ((i * 37 % 29) as f32 / 14.0 - 1.0) * 2.9e38).collect();
        let mut lanes = vec![0u64; HIST_SETS * bins];
        b.count_all(&row, &mut lanes);
        let got: Vec<u64> = (0..bins).map(|k| (0..HIST_SETS).map(|l| lanes[l * bins + k]).sum()).collect();
        let mut want = vec![0u64; bins];
        for &x in &row {
            want[b.bin(x as f64)] += 1;
        }
        assert_eq!(got, want);
        assert_eq!(got.iter().sum::<u64>(), row.len() as u64);
    }
}
