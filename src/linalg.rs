//! Dense linear algebra on the host: the singular value decomposition (exact and randomized) and
//! the spectrum summaries that actuations (`lowrank`) and tensor probes read from it.
//!
//! Matrices cross this module's boundary as row-major `f32` slices `a [rows, cols]` (as RLX binds
//! weights) and are computed on in `f64` with `nalgebra` (its SVD is Golub-Kahan
//! bidiagonalization with implicit-shift QR, the method of LAPACK's `dgesvd`). Results are
//! row-major `f64`.
//!
//! - [`svd`]: the exact thin SVD `A = U diag(sigma) V^T`.
//! - [`randomized_svd`]: a rank-`k` SVD from a Gaussian sketch (Halko, Martinsson & Tropp 2011,
//!   "Finding structure with randomness", SIAM Review 53(2); Alg. 4.4 + Alg. 5.1), with
//!   [`randomized_svd_error_bound`], the published bound on its expected error.
//! - [`effective_rank_entropy`] (Roy & Vetterli 2007) and [`rank_for_energy`].

use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};

/// What went wrong in a decomposition, with the fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum LinalgError {
    /// The slice length does not match `rows * cols`.
    #[error("{len} values for a [{rows}, {cols}] matrix: pass rows * cols = {} row-major values", rows * cols)]
    Shape {
        /// Values passed.
        len: usize,
        /// Rows claimed.
        rows: usize,
        /// Columns claimed.
        cols: usize,
    },
    /// A NaN or infinity in the input (the SVD of such a matrix is undefined).
    #[error("value {value} at flat index {index} is not finite: the SVD needs finite values (check the weight that was bound)")]
    NonFinite {
        /// Flat row-major index.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A requested rank outside `1..=min(rows, cols)`, or other bad argument.
    #[error("{0}")]
    Argument(String),
    /// The implicit-shift QR iteration did not converge within its iteration budget.
    #[error("SVD of a [{rows}, {cols}] matrix did not converge within {iters} QR iterations")]
    NoConvergence {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// The iteration budget.
        iters: usize,
    },
}

/// A thin singular value decomposition `A ~ U diag(sigma) Vt` of a `[rows, cols]` matrix,
/// row-major `f64`, with `m` components (`m = min(rows, cols)` for [`svd`], the requested rank
/// for [`randomized_svd`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Svd {
    /// Left singular vectors `[rows, m]`, orthonormal columns.
    pub u: Vec<f64>,
    /// Singular values `[m]`, non-increasing, non-negative.
    pub sigma: Vec<f64>,
    /// Right singular vectors, transposed: `[m, cols]`, orthonormal rows.
    pub vt: Vec<f64>,
    /// Rows of `A`.
    pub rows: usize,
    /// Columns of `A`.
    pub cols: usize,
}

impl Svd {
    /// Number of components `m`.
    pub fn rank(&self) -> usize {
        self.sigma.len()
    }

    /// The rank-`r` product `U_r diag(sigma_r) Vt_r`, row-major `[rows, cols]` (`r` clipped to
    /// [`Svd::rank`]).
    pub fn reconstruct(&self, r: usize) -> Vec<f64> {
        let (m, r) = (self.rank(), r.min(self.rank()));
        let mut out = vec![0f64; self.rows * self.cols];
        for i in 0..self.rows {
            let row = &mut out[i * self.cols..(i + 1) * self.cols];
            for t in 0..r {
                let c = self.u[i * m + t] * self.sigma[t];
                for (o, v) in row.iter_mut().zip(&self.vt[t * self.cols..(t + 1) * self.cols]) {
                    *o += c * v;
                }
            }
        }
        out
    }
}

/// Row-major `f32` to an `f64` nalgebra matrix, checking length and finiteness.
fn matrix(a: &[f32], rows: usize, cols: usize) -> Result<DMatrix<f64>, LinalgError> {
    if a.len() != rows * cols || rows == 0 || cols == 0 {
        return Err(LinalgError::Shape { len: a.len(), rows, cols });
    }
    if let Some(index) = a.iter().position(|x| !x.is_finite()) {
        return Err(LinalgError::NonFinite { index, value: a[index] });
    }
    Ok(DMatrix::from_fn(rows, cols, |i, j| a[i * cols + j] as f64))
}

fn row_major(m: &DMatrix<f64>) -> Vec<f64> {
    let (r, c) = m.shape();
    (0..r * c).map(|x| m[(x / c, x % c)]).collect()
}

/// Exact thin SVD of an `f64` matrix, sorted.
fn svd_f64(a: DMatrix<f64>) -> Result<Svd, LinalgError> {
    let (rows, cols) = a.shape();
    // Each singular value takes a few implicit-shift sweeps; 100 per value is far beyond what
    // converging matrices need and bounds the time of one that does not.
    let iters = 100 * rows.min(cols).max(1);
    let s = a.try_svd(true, true, f64::EPSILON, iters).ok_or(LinalgError::NoConvergence { rows, cols, iters })?;
    let (Some(u), Some(vt)) = (s.u.as_ref(), s.v_t.as_ref()) else {
        return Err(LinalgError::Argument("nalgebra returned no singular vectors".into()));
    };
    Ok(Svd { u: row_major(u), sigma: s.singular_values.iter().copied().collect(), vt: row_major(vt), rows, cols })
}

/// The exact thin SVD of row-major `a [rows, cols]`, in `f64` (nalgebra): `U [rows, m]`,
/// `sigma [m]` non-increasing, `Vt [m, cols]`, `m = min(rows, cols)`. Cost `O(rows cols m)`.
///
/// Errors: a length that is not `rows * cols`, a zero dimension, a non-finite value, or no
/// convergence (all [`LinalgError`]).
pub fn svd(a: &[f32], rows: usize, cols: usize) -> Result<Svd, LinalgError> {
    svd_f64(matrix(a, rows, cols)?)
}

/// Orthonormal basis (thin Q of a Householder QR) of the columns of `y`.
fn orth(y: DMatrix<f64>) -> DMatrix<f64> {
    y.qr().q()
}

/// A rank-`rank` SVD of row-major `a [rows, cols]` from a Gaussian sketch, per Halko, Martinsson
/// & Tropp 2011 (HMT): Alg. 4.4 (randomized subspace iteration) finds an orthonormal `Q
/// [rows, l]`, `l = rank + oversample` (clipped to `min(rows, cols)`), with `Y = A Omega`,
/// `Omega [cols, l]` standard Gaussian, and `power_iters = q` steps `Q <- orth(A orth(A^T Q))`
/// (re-orthonormalized by QR between every product, so rounding does not collapse the basis onto
/// the top singular vector); Alg. 5.1 (direct SVD) then takes the exact SVD of `B = Q^T A
/// [l, cols]`, `U = Q U_B`, truncated to `rank` components. HMT's defaults: `oversample = 10`
/// (Sec. 4.2: p = 5 or 10 suffices for Gaussian test matrices), `q = 1` or `2` when the spectrum
/// decays slowly (Sec. 4.5). `seed` makes `Omega` reproducible (ChaCha8).
///
/// Its expected spectral error `E ||A - U diag(sigma) Vt||_2` is bounded by
/// [`randomized_svd_error_bound`] of the exact spectrum.
///
/// Errors: as [`svd`]; `rank` outside `1..=min(rows, cols)`.
pub fn randomized_svd(a: &[f32], rows: usize, cols: usize, rank: usize, oversample: usize, power_iters: usize, seed: u64) -> Result<Svd, LinalgError> {
    let a = matrix(a, rows, cols)?;
    let m = rows.min(cols);
    if rank == 0 || rank > m {
        return Err(LinalgError::Argument(format!("rank {rank} of a [{rows}, {cols}] matrix: pick 1..={m}")));
    }
    let l = (rank + oversample).min(m);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let omega = DMatrix::<f64>::from_fn(cols, l, |_, _| rng.sample(rand_distr::StandardNormal));
    let mut q = orth(&a * omega);
    for _ in 0..power_iters {
        let w = orth(a.tr_mul(&q));
        q = orth(&a * w);
    }
    let b = q.tr_mul(&a);
    let s = svd_f64(b)?;
    let ub = DMatrix::from_row_slice(l, s.rank(), &s.u);
    let u = q * ub;
    let (u, sigma, vt) = (row_major(&u.columns(0, rank).into_owned()), s.sigma[..rank].to_vec(), s.vt[..rank * cols].to_vec());
    Ok(Svd { u, sigma, vt, rows, cols })
}

/// Upper bound on the expected spectral-norm error `E ||A - A_k||_2` of [`randomized_svd`] with
/// rank `k`, oversampling `p` and `q` power iterations, from the exact singular values `sigma`
/// of `A` (non-increasing, all `min(rows, cols)` of them):
///
/// ```text
/// sigma_{k+1} + [ (1 + sqrt(k/(p-1))) sigma_{k+1}^{2q+1}
///                 + (e sqrt(k+p) / p) (sum_{j>k} sigma_j^{2(2q+1)})^{1/2} ]^{1/(2q+1)}
/// ```
///
/// The bracket is HMT 2011 Corollary 10.10 (the power scheme; for `q = 0` it is Theorem 10.6's
/// spectral bound) on `E ||(I - Q Q^T) A||`, the error of the rank-`l` projection; truncating
/// `Q Q^T A` to rank `k` adds at most `sigma_{k+1}` (HMT Theorem 9.3). Where `k + p >=
/// min(rows, cols)` the sketch spans the whole range and the bound is `sigma_{k+1}` (Eckart-Young).
/// It is a bound on the mean over draws of `Omega`, not on every draw.
///
/// Errors: `p < 2` (the bound needs `p >= 2`), `k` outside `1..=sigma.len()`.
pub fn randomized_svd_error_bound(sigma: &[f64], k: usize, p: usize, q: usize) -> Result<f64, LinalgError> {
    if k == 0 || k > sigma.len() {
        return Err(LinalgError::Argument(format!("rank {k} with {} singular values: pick 1..={}", sigma.len(), sigma.len())));
    }
    let next = sigma.get(k).copied().unwrap_or(0.0);
    if k + p >= sigma.len() {
        return Ok(next);
    }
    if p < 2 {
        return Err(LinalgError::Argument(format!("oversample {p}: HMT's bound needs p >= 2 (HMT 2011 uses p = 5 or 10)")));
    }
    let e = (2 * q + 1) as f64;
    let (kf, pf) = (k as f64, p as f64);
    let tail: f64 = sigma[k..].iter().map(|s| s.powf(2.0 * e)).sum::<f64>().sqrt();
    let inner = (1.0 + (kf / (pf - 1.0)).sqrt()) * next.powf(e) + std::f64::consts::E * (kf + pf).sqrt() / pf * tail;
    Ok(next + inner.powf(1.0 / e))
}

/// Effective rank of Roy & Vetterli 2007 ("The effective rank: a measure of effective
/// dimensionality", EUSIPCO): `exp(H(p))` with `p_i = sigma_i / sum_j sigma_j` and the Shannon
/// entropy `H(p) = -sum_i p_i ln p_i` in nats (`0 ln 0 = 0`). Between 1 (one non-zero singular
/// value) and the number of non-zero values (all equal). `0` for an all-zero `sigma`.
pub fn effective_rank_entropy(sigma: &[f64]) -> f64 {
    let total: f64 = sigma.iter().map(|s| s.abs()).sum();
    if total == 0.0 {
        return 0.0;
    }
    let h: f64 = sigma.iter().map(|s| s.abs() / total).filter(|p| *p > 0.0).map(|p| -p * p.ln()).sum();
    h.exp()
}

/// The smallest rank `r` whose truncation keeps at least `fraction` of the energy (squared
/// Frobenius norm): `sum_{i<=r} sigma_i^2 >= fraction * sum_i sigma_i^2` (by Eckart-Young the
/// relative error of the best rank-`r` approximation is then `||A - A_r||_F^2 / ||A||_F^2 <=
/// 1 - fraction`). `sigma` non-increasing. `0` for an all-zero `sigma`.
///
/// Errors: `fraction` outside `(0, 1]`.
pub fn rank_for_energy(sigma: &[f64], fraction: f64) -> Result<usize, LinalgError> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(LinalgError::Argument(format!("energy fraction {fraction}: pick a value in (0, 1], e.g. 0.99")));
    }
    let total: f64 = sigma.iter().map(|s| s * s).sum();
    if total == 0.0 {
        return Ok(0);
    }
    let mut acc = 0.0;
    for (i, s) in sigma.iter().enumerate() {
        acc += s * s;
        // Relative slack for rounding in the running sum (fraction = 1 must reach len).
        if acc >= fraction * total * (1.0 - 1e-12) {
            return Ok(i + 1);
        }
    }
    Ok(sigma.len())
}
