//! `opscope probe --capture DIR`: host probes on the tensors a `capture` pass wrote, measuring
//! what sketches cannot see.
//!
//! Per captured tensor:
//! - **2:4 (N:M) structure**: the exact count of groups of 4 consecutive values along the
//!   reduction axis that hold >= 2 zeros (`== 0.0`, either sign). The axis is K: the last axis
//!   of an activation `lhs` `[.., K]` (and of an `out`, the next op's activation), the
//!   second-to-last of a weight `rhs` `[.., K, N]` (each column's K values). A K that is not a
//!   multiple of 4 gives no count (said why).
//! - **cardinality**: the number of distinct f32 bit patterns (so `0.0` and `-0.0` count
//!   twice, as do NaN payloads): exact up to 2^24 values, a HyperLogLog++ estimate above.
//! - **spectrum**: singular values of the tensor as a matrix `[numel / last, last]` (a weight
//!   `[K, N]` as is; an activation `[.., K]` with one row per token), with `opscope::linalg`
//!   (nalgebra, f64): exact when `min(rows, cols) <= 1024`, else a rank-64 randomized SVD
//!   (Halko, Martinsson & Tropp 2011; oversampling 10, 2 power steps) whose effective
//!   rank covers the 64 values kept; the effective rank `exp(H(sigma / sum sigma))`
//!   (Roy & Vetterli 2007) and the 99%-energy rank (smallest r keeping 99% of the tensor's
//!   sum of squares; none when a randomized top 64 holds less).
//!
//! Per matmul site and run whose `lhs` and `rhs` are both captured (a weight is captured once
//! per compile and pairs with every run of it), `Y = X W` is computed in f64 and compared with:
//! - **quantized GEMM** `Q(X) Q(W)`, int8 (q_max 127) and int4 (q_max 7), symmetric absmax
//!   scales `s = max|v| / q_max`, `Q(v) = s * clamp(round_half_even(v / s), -q_max, q_max)`
//!   (`0` when `max|v| = 0`), weights per tensor or per output column `n`, activations per
//!   tensor or per token (each row of X): the measured SQNR
//!   `10 log10(sum Y^2 / sum (Y - Yq)^2)` in dB, with the real activations;
//! - **2:4-pruned GEMM** `X P(W)`, `P` keeping the 2 largest |w| of each group of 4 along K
//!   (ties: the earlier index), with its SQNR. Shapes: `X [.., M, K]`, `W [K, N]` or batched
//!   `[B.., K, N]` with the same batch as X.
//!
//! `Y` is the product of the captured operands, not the captured `out` (a fused site's `out`
//! includes its bias and activation).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use anyhow::{bail, Context, Result};
use opscope::capture::{read_manifest, read_tensor, Captured};
use serde::Serialize;

/// Structure of one captured tensor.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TensorProbe {
    /// Site name.
    pub site: String,
    /// Role (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Compile number and step of the run (a weight: the first run of its compile).
    pub compile: u32,
    /// Step.
    pub run: u64,
    /// Dims.
    pub shape: Vec<usize>,
    /// 2:4 counts along the reduction axis, or why there are none.
    pub two_four: Result<TwoFour, String>,
    /// Number of distinct f32 bit patterns: exact up to [`DISTINCT_EXACT_MAX`] values, else a
    /// HyperLogLog++ estimate (see [`distinct_bits`]).
    pub distinct: u64,
    /// `distinct` is exact (false: a HyperLogLog++ estimate).
    pub distinct_exact: bool,
    /// Number of elements.
    pub numel: u64,
    /// Singular-value spectrum, or why there is none (a non-finite value).
    pub spectrum: Result<Spectrum, String>,
}

/// Singular values of a tensor seen as a `[rows, cols]` matrix.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Spectrum {
    /// `[rows, cols]`: rows = numel / last dim, cols = last dim.
    pub matrix: [usize; 2],
    /// `exact` (every singular value) or `randomized` (the top 64).
    pub method: &'static str,
    /// The singular values computed, non-increasing.
    pub sigma: Vec<f64>,
    /// Effective rank `exp(H(p))`, `p_i = sigma_i / sum sigma` (Roy & Vetterli 2007), over the
    /// singular values computed (randomized: the top k only, a lower bound).
    pub effective_rank: f64,
    /// Smallest r with `sum_{i<=r} sigma_i^2 >= 0.99 ||A||_F^2` (the squared Frobenius norm of
    /// the data, so a randomized top-k is measured against the whole energy); `None` (JSON
    /// `null`) when the singular values computed hold less than that (randomized: rank > k).
    pub energy_rank_99: Option<usize>,
}

/// Largest `min(rows, cols)` given an exact SVD; above it a rank-[`RANDOMIZED_RANK`]
/// randomized SVD is used (cost `O(rows cols l)` instead of `O(rows cols min)`).
pub const EXACT_SVD_MAX: usize = 1024;
/// Rank of the randomized SVD for large tensors.
pub const RANDOMIZED_RANK: usize = 64;

/// The spectrum of `data` (dims `dims`) as a `[numel / last, last]` matrix.
///
/// Errors: a non-finite value or an empty tensor ([`opscope::linalg::LinalgError`]).
pub fn spectrum(data: &[f32], dims: &[usize]) -> Result<Spectrum, String> {
    let cols = dims.last().copied().unwrap_or(1).max(1);
    let rows = data.len() / cols;
    let svd = if rows.min(cols) <= EXACT_SVD_MAX {
        opscope::linalg::svd(data, rows, cols)
    } else {
        opscope::linalg::randomized_svd(data, rows, cols, RANDOMIZED_RANK, 10, 2, 0)
    }
    .map_err(|e| e.to_string())?;
    let method = if rows.min(cols) <= EXACT_SVD_MAX { "exact" } else { "randomized" };
    // An exact SVD holds all the energy; a randomized top-k is measured against the data's.
    let energy_rank_99 = if method == "exact" {
        Some(opscope::linalg::rank_for_energy(&svd.sigma, 0.99).map_err(|e| e.to_string())?)
    } else {
        let total: f64 = data.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let computed: f64 = svd.sigma.iter().map(|s| s * s).sum();
        if computed >= 0.99 * total && computed > 0.0 {
            Some(opscope::linalg::rank_for_energy(&svd.sigma, 0.99 * total / computed).map_err(|e| e.to_string())?)
        } else {
            None
        }
    };
    Ok(Spectrum {
        matrix: [rows, cols],
        method,
        effective_rank: opscope::linalg::effective_rank_entropy(&svd.sigma),
        energy_rank_99,
        sigma: svd.sigma,
    })
}

/// Group-of-4 counts along the reduction axis.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct TwoFour {
    /// Groups of 4 consecutive values along K.
    pub groups: u64,
    /// Groups with >= 2 zeros.
    pub satisfying: u64,
    /// `satisfying / groups`: 1.0 is 2:4 sparse as stored.
    pub fraction: f64,
    /// Groups with >= 2 values that are zero or subnormal (`|x| < f32::MIN_POSITIVE`): what a
    /// kernel that flushes subnormals to zero (FTZ/DAZ, GPUs' default) computes with. RLX's
    /// softmax leaves about 1e-39 on masked keys where onnxruntime gives exact zeros, so on
    /// attention probabilities this is the count a sparse kernel would see.
    pub satisfying_ftz: u64,
}

/// The measured SQNR of one quantization scheme of a GEMM.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SchemeSqnr {
    /// Bits: 8 or 4.
    pub bits: u32,
    /// Weight scale granularity: `tensor` or `channel` (per output column).
    pub weights: &'static str,
    /// Activation scale granularity: `tensor` or `token` (per row of X).
    pub activations: &'static str,
    /// SQNR in dB; `None` when the quantized product is exact (infinite SQNR).
    pub sqnr_db: Option<f64>,
}

/// Errors measured on one GEMM (site, run).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GemmProbe {
    /// Site name.
    pub site: String,
    /// Compile number.
    pub compile: u32,
    /// Step.
    pub run: u64,
    /// `[batch, M, K, N]`, batch = product of X's leading dims.
    pub mkn: [usize; 4],
    /// Quantized GEMM SQNRs: int8 then int4, each (w, a) in (tensor, tensor), (tensor, token),
    /// (channel, tensor), (channel, token).
    pub quant: Vec<SchemeSqnr>,
    /// SQNR (dB) of the GEMM with the weight pruned to 2:4 along K; `None` when exact (W is
    /// 2:4 already), or K is not a multiple of 4 (see `pruned_note`).
    pub pruned_2_4_sqnr_db: Option<f64>,
    /// Why there is no pruned SQNR, if there is none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pruned_note: Option<String>,
}

/// Everything `opscope probe` measured on a capture directory.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ProbeReport {
    /// One entry per captured tensor.
    pub tensors: Vec<TensorProbe>,
    /// One entry per (matmul site, run) with both operands captured.
    pub gemms: Vec<GemmProbe>,
}

/// Group-of-4 counts of `data` (C order, `dims`) along `axis`.
///
/// Errors: the axis length is not a multiple of 4, or `axis` is out of range.
pub fn two_four(data: &[f32], dims: &[usize], axis: usize) -> Result<TwoFour, String> {
    let Some(&k) = dims.get(axis) else { return Err(format!("axis {axis} out of range for {dims:?}")) };
    if k % 4 != 0 || k == 0 {
        return Err(format!("reduction axis has {k} values, not a multiple of 4"));
    }
    let inner: usize = dims[axis + 1..].iter().product();
    let outer: usize = dims[..axis].iter().product();
    let (mut groups, mut sat, mut sat_ftz) = (0u64, 0u64, 0u64);
    for o in 0..outer {
        let base = o * k * inner;
        for g in (0..k).step_by(4) {
            for i in 0..inner {
                let at = |j: usize| data[base + (g + j) * inner + i];
                let zeros = (0..4).filter(|&j| at(j) == 0.0).count();
                let flushed = (0..4).filter(|&j| at(j).abs() < f32::MIN_POSITIVE).count();
                groups += 1;
                sat += (zeros >= 2) as u64;
                sat_ftz += (flushed >= 2) as u64;
            }
        }
    }
    Ok(TwoFour { groups, satisfying: sat, fraction: sat as f64 / groups as f64, satisfying_ftz: sat_ftz })
}

/// Largest tensor whose distinct values are counted exactly: a hash set of up to 2^24 `u32`
/// takes about 100 MB; above it the count is a HyperLogLog++ estimate in 16 KiB.
pub const DISTINCT_EXACT_MAX: usize = 1 << 24;

/// Number of distinct f32 bit patterns in `data` (`0.0` and `-0.0` apart) and whether it is
/// exact: an exact hash set up to [`DISTINCT_EXACT_MAX`] values, else HyperLogLog++ (Heule,
/// Nunkesser and Hall, EDBT 2013; crate `hyperloglogplus`, precision
/// [`opscope::online::HLL_PRECISION`], standard error 1.04 / sqrt(2^14) = 0.81%).
pub fn distinct_bits(data: &[f32]) -> (u64, bool) {
    if data.len() <= DISTINCT_EXACT_MAX {
        return (data.iter().map(|v| v.to_bits()).collect::<HashSet<u32>>().len() as u64, true);
    }
    use hyperloglogplus::{HyperLogLog, HyperLogLogPlus};
    let mut hll: HyperLogLogPlus<u32, opscope::online::Xxh3Builder> =
        HyperLogLogPlus::new(opscope::online::HLL_PRECISION, opscope::online::Xxh3Builder).expect("precision 14 is in 4..=18");
    for v in data {
        hll.insert(&v.to_bits());
    }
    (hll.count().round() as u64, false)
}

/// Symmetric absmax fake-quantization of `v` (f64) with `q_max` levels each side, one scale
/// per group given by `group(i)` (`groups` of them).
fn quantize(v: &[f64], q_max: f64, groups: usize, group: impl Fn(usize) -> usize) -> Vec<f64> {
    let mut amax = vec![0f64; groups];
    for (i, x) in v.iter().enumerate() {
        let g = group(i);
        amax[g] = amax[g].max(x.abs());
    }
    let scale: Vec<f64> = amax.iter().map(|a| a / q_max).collect();
    v.iter()
        .enumerate()
        .map(|(i, x)| {
            let s = scale[group(i)];
            if s == 0.0 {
                0.0
            } else {
                (x / s).round_ties_even().clamp(-q_max, q_max) * s
            }
        })
        .collect()
}

/// `Y[b] = X[b] W[b or 0]`, f64; X `[batch, M, K]`, W `[wb, K, N]` (wb = 1 or batch).
fn gemm(x: &[f64], w: &[f64], [batch, m, k, n]: [usize; 4], wb: usize) -> Vec<f64> {
    let mut y = vec![0f64; batch * m * n];
    for b in 0..batch {
        let wo = if wb == 1 { 0 } else { b * k * n };
        for r in 0..m {
            let xr = &x[(b * m + r) * k..(b * m + r + 1) * k];
            let yr = &mut y[(b * m + r) * n..(b * m + r + 1) * n];
            for (kk, xv) in xr.iter().enumerate() {
                let wr = &w[wo + kk * n..wo + (kk + 1) * n];
                for (yv, wv) in yr.iter_mut().zip(wr) {
                    *yv += xv * wv;
                }
            }
        }
    }
    y
}

/// SQNR in dB of `approx` against `exact`; `None` when they are equal.
pub fn sqnr_db(exact: &[f64], approx: &[f64]) -> Option<f64> {
    let sig: f64 = exact.iter().map(|y| y * y).sum();
    let err: f64 = exact.iter().zip(approx).map(|(a, b)| (a - b) * (a - b)).sum();
    (err > 0.0).then(|| 10.0 * (sig / err).log10())
}

/// W `[wb, K, N]` with the 2 largest |w| of each group of 4 along K kept, the others zeroed.
pub fn prune_2_4(w: &[f64], wb: usize, k: usize, n: usize) -> Vec<f64> {
    let mut p = w.to_vec();
    for b in 0..wb {
        for g in (0..k).step_by(4) {
            for c in 0..n {
                let idx: Vec<usize> = (0..4).map(|j| b * k * n + (g + j) * n + c).collect();
                let mut order: Vec<usize> = (0..4).collect();
                order.sort_by(|&a, &bb| w[idx[bb]].abs().total_cmp(&w[idx[a]].abs())); // stable: ties keep the earlier
                for &j in &order[2..] {
                    p[idx[j]] = 0.0;
                }
            }
        }
    }
    p
}

/// Measure one GEMM: X `x_dims` `[.., M, K]`, W `w_dims` `[K, N]` or `[B.., K, N]`.
///
/// Errors: shapes that do not make a matmul (K differs, or W's batch is neither 1 nor X's).
pub fn probe_gemm(x: &[f32], x_dims: &[usize], w: &[f32], w_dims: &[usize]) -> Result<([usize; 4], Vec<SchemeSqnr>, Result<Option<f64>, String>)> {
    if x_dims.len() < 2 || w_dims.len() < 2 {
        bail!("matmul operands need rank >= 2: {x_dims:?} x {w_dims:?}");
    }
    let (m, k) = (x_dims[x_dims.len() - 2], x_dims[x_dims.len() - 1]);
    let (k2, n) = (w_dims[w_dims.len() - 2], w_dims[w_dims.len() - 1]);
    if k != k2 {
        bail!("K differs: lhs {x_dims:?}, rhs {w_dims:?}");
    }
    let wb: usize = w_dims[..w_dims.len() - 2].iter().product();
    let (batch, m) = if wb == 1 { (1, x.len() / k) } else { (x.len() / (m * k), m) };
    if wb != 1 && wb != batch {
        bail!("rhs batch {wb} is neither 1 nor the lhs batch {batch}: {x_dims:?} x {w_dims:?}");
    }
    let mkn = [batch, m, k, n];
    let xf: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let wf: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    let y = gemm(&xf, &wf, mkn, wb);
    let mut quant = Vec::new();
    for bits in [8u32, 4] {
        let q_max = ((1u32 << (bits - 1)) - 1) as f64;
        for (wg, ag) in [("tensor", "tensor"), ("tensor", "token"), ("channel", "tensor"), ("channel", "token")] {
            let qw = if wg == "tensor" { quantize(&wf, q_max, 1, |_| 0) } else { quantize(&wf, q_max, n, |i| i % n) };
            let qx = if ag == "tensor" { quantize(&xf, q_max, 1, |_| 0) } else { quantize(&xf, q_max, batch * m, |i| i / k) };
            let yq = gemm(&qx, &qw, mkn, wb);
            quant.push(SchemeSqnr { bits, weights: wg, activations: ag, sqnr_db: sqnr_db(&y, &yq) });
        }
    }
    let pruned = if k % 4 == 0 {
        let p = prune_2_4(&wf, wb, k, n);
        Ok(sqnr_db(&y, &gemm(&xf, &p, mkn, wb)))
    } else {
        Err(format!("K = {k} is not a multiple of 4"))
    };
    Ok((mkn, quant, pruned))
}

/// The reduction axis of a tensor of `role` with `rank` dims: K is the last axis of an
/// activation (`lhs`, and `out` as the next op's input), the second-to-last of `rhs`.
fn reduction_axis(role: &str, rank: usize) -> usize {
    if role == "rhs" && rank >= 2 {
        rank - 2
    } else {
        rank.saturating_sub(1)
    }
}

/// Probe every tensor of the capture directory `dir`.
///
/// Errors: `dir` is not a capture directory, a listed file is missing or malformed, or a
/// site's captured operands do not make a matmul.
pub fn probe_dir(dir: &Path) -> Result<ProbeReport> {
    let m = read_manifest(dir)?;
    let mut report = ProbeReport::default();
    let mut cache: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    let load = |c: &Captured, cache: &mut BTreeMap<String, Vec<f32>>| -> Result<Vec<f32>> {
        if let Some(v) = cache.get(&c.file) {
            return Ok(v.clone());
        }
        let v = read_tensor(dir, c).with_context(|| format!("{}/{} run {}", c.site, c.role, c.run))?;
        Ok(v)
    };
    for c in &m.captured {
        let v = load(c, &mut cache)?;
        let axis = reduction_axis(&c.role, c.shape.len());
        let distinct = distinct_bits(&v);
        report.tensors.push(TensorProbe {
            site: c.site.clone(),
            role: c.role.clone(),
            compile: c.compile,
            run: c.run,
            shape: c.shape.clone(),
            two_four: two_four(&v, &c.shape, axis),
            distinct: distinct.0,
            distinct_exact: distinct.1,
            numel: v.len() as u64,
            spectrum: spectrum(&v, &c.shape),
        });
        if c.role == "rhs" && c.invariant {
            cache.insert(c.file.clone(), v);
        }
    }
    // GEMMs: each captured lhs with the rhs of the same site and run, or the compile's weight.
    for x in m.captured.iter().filter(|c| c.role == "lhs") {
        let w = m
            .captured
            .iter()
            .find(|c| c.role == "rhs" && c.site == x.site && c.compile == x.compile && (c.run == x.run || c.invariant));
        let Some(w) = w else { continue };
        let xv = load(x, &mut cache)?;
        let wv = load(w, &mut cache)?;
        let (mkn, quant, pruned) = probe_gemm(&xv, &x.shape, &wv, &w.shape).with_context(|| format!("site {}", x.site))?;
        let (pruned_2_4_sqnr_db, pruned_note) = match pruned {
            Ok(db) => (db, None),
            Err(why) => (None, Some(why)),
        };
        report.gemms.push(GemmProbe { site: x.site.clone(), compile: x.compile, run: x.run, mkn, quant, pruned_2_4_sqnr_db, pruned_note });
    }
    Ok(report)
}

/// The report's 2:4 counts as the miner's evidence ([`opscope::mine::probe::upgrade_two_four`]),
/// with each weight's pruned-GEMM SQNR (worst run).
pub fn two_four_evidence(r: &ProbeReport) -> Vec<opscope::mine::probe::TwoFourEvidence> {
    r.tensors
        .iter()
        .filter_map(|t| {
            let tf = t.two_four.as_ref().ok()?;
            let pruned = if t.role == "rhs" {
                r.gemms.iter().filter(|g| g.site == t.site).filter_map(|g| g.pruned_2_4_sqnr_db).reduce(f64::min)
            } else {
                None
            };
            Some(opscope::mine::probe::TwoFourEvidence {
                site: t.site.clone(),
                role: t.role.clone(),
                groups: tf.groups,
                satisfying: tf.satisfying,
                pruned_sqnr_db: pruned,
            })
        })
        .collect()
}

/// The report's spectra as the miner's low-rank evidence
/// ([`opscope::mine::probe::upgrade_low_rank`]), one entry per tensor and run.
pub fn low_rank_evidence(r: &ProbeReport) -> Vec<opscope::mine::probe::LowRankEvidence> {
    r.tensors
        .iter()
        .filter_map(|t| {
            let sp = t.spectrum.as_ref().ok()?;
            Some(opscope::mine::probe::LowRankEvidence {
                site: t.site.clone(),
                role: t.role.clone(),
                rows: sp.matrix[0],
                cols: sp.matrix[1],
                energy_rank_99: sp.energy_rank_99,
            })
        })
        .collect()
}

/// `verdicts` with every probe verdict the report has evidence for upgraded (2:4 counts and
/// spectra; see [`opscope::mine::probe`]).
pub fn upgrade(verdicts: Vec<opscope::mine::Verdict>, r: &ProbeReport) -> Vec<opscope::mine::Verdict> {
    let verdicts = opscope::mine::probe::upgrade_two_four(verdicts, &two_four_evidence(r));
    opscope::mine::probe::upgrade_low_rank(verdicts, &low_rank_evidence(r))
}

fn db(x: Option<f64>) -> String {
    x.map_or("exact".into(), |v| format!("{v:.2}"))
}

/// The report as text: one line per tensor, then one block per GEMM.
pub fn render(r: &ProbeReport) -> String {
    let mut s = String::new();
    s.push_str("tensor                                   role  run  shape            2:4 groups (>=2 zeros / all)  distinct  eff.rank  99%-energy rank / min(rows,cols)\n");
    for t in &r.tensors {
        let tf = match &t.two_four {
            Ok(tf) if tf.satisfying_ftz != tf.satisfying => {
                format!("{}/{} = {:.4} ({} with subnormals as 0)", tf.satisfying, tf.groups, tf.fraction, tf.satisfying_ftz)
            }
            Ok(tf) => format!("{}/{} = {:.4}", tf.satisfying, tf.groups, tf.fraction),
            Err(why) => format!("- ({why})"),
        };
        let sp = match &t.spectrum {
            Ok(sp) => format!(
                "{:.1}  {}/{}{}",
                sp.effective_rank,
                sp.energy_rank_99.map_or(format!(">{}", sp.sigma.len()), |r| r.to_string()),
                sp.matrix[0].min(sp.matrix[1]),
                if sp.method == "exact" { "" } else { " (top 64, randomized)" }
            ),
            Err(why) => format!("- ({why})"),
        };
        s.push_str(&format!(
            "{:<40} {:<5} {:>4} {:<16} {:<29} {}/{}  {}\n",
            t.site,
            t.role,
            format!("{}:{}", t.compile, t.run),
            format!("{:?}", t.shape).replace(' ', ""),
            tf,
            if t.distinct_exact { t.distinct.to_string() } else { format!("~{}", t.distinct) },
            t.numel,
            sp
        ));
    }
    if !r.gemms.is_empty() {
        s.push_str("\nGEMM output SQNR (dB) of Q(X)Q(W) vs XW, symmetric absmax, round half to even; w=weights, a=activations\n");
    }
    for g in &r.gemms {
        let q: Vec<String> = g.quant.iter().map(|q| format!("int{} w:{} a:{} {}", q.bits, q.weights, q.activations, db(q.sqnr_db))).collect();
        s.push_str(&format!("{} run {}:{} [b,M,K,N]={:?}\n  {}\n", g.site, g.compile, g.run, g.mkn, q.join("\n  ")));
        match &g.pruned_note {
            Some(why) => s.push_str(&format!("  2:4-pruned W: - ({why})\n")),
            None => s.push_str(&format!("  2:4-pruned W (2 largest |w| of 4 along K): {}\n", db(g.pruned_2_4_sqnr_db))),
        }
    }
    s
}

/// One tensor's int8 SQNR under one scale granularity: the miner's estimate from the sketches
/// against the SQNR measured on the captured tensor (same rows, same run).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NoiseCheck {
    /// Site name.
    pub site: String,
    /// Role (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Compile and step of the run.
    pub compile: u32,
    /// Step.
    pub run: u64,
    /// `tensor`, `channel` (last axis) or `token` (row).
    pub scale: &'static str,
    /// The miner's estimate ([`opscope::mine::int8_estimate`]), dB.
    pub predicted_db: Option<f64>,
    /// Measured on the captured tensor with `fakequant`'s quantizer, dB.
    pub measured_db: Option<f64>,
    /// `measured - predicted`, dB.
    pub gap_db: Option<f64>,
    /// Fraction of the kept values that quantize to 0 (where `Δ²/12` overstates the noise:
    /// a value below `Δ/2` contributes its own square, not `Δ²/12`).
    pub zero_fraction: f64,
    /// Rows measured (the rows the sketch recorded: padding rows left out) and all rows.
    pub rows_kept: usize,
    /// Rows of the tensor (`numel / last dim`).
    pub rows: usize,
}

/// Int8 fake-quant of `v` as `fakequant{bits=8}` computes it (f32, narrow range, round half to
/// even): `s = absmax / 127`, `q = clamp(round(x / s), -127, 127) * s`, `0` for an all-zero
/// group. Returns (sum x^2, sum (x - q)^2, values quantized to 0) over the elements `keep`
/// selects, with `group(i)` the scale group of element `i` (`groups` of them).
fn fakequant8(v: &[f32], keep: impl Fn(usize) -> bool, groups: usize, group: impl Fn(usize) -> usize) -> (f64, f64, usize) {
    let mut amax = vec![0f32; groups];
    for (i, x) in v.iter().enumerate() {
        if keep(i) {
            let g = group(i);
            amax[g] = amax[g].max(x.abs());
        }
    }
    let (mut sig, mut err, mut zeros) = (0f64, 0f64, 0usize);
    for (i, &x) in v.iter().enumerate() {
        if !keep(i) {
            continue;
        }
        let s = amax[group(i)] / 127.0;
        let q = if s == 0.0 { 0.0 } else { (x / s).round_ties_even().clamp(-127.0, 127.0) * s };
        zeros += (q == 0.0) as usize;
        sig += (x as f64) * (x as f64);
        err += ((x - q) as f64).powi(2);
    }
    (sig, err, zeros)
}

/// The miner's int8 SQNR estimates against the SQNR measured on the captured tensors, per
/// tensor, run and scale granularity (tensor, channel, token), for every captured tensor whose
/// site, role, compile and step are in `recording` (record with the full `matmul` set: the
/// estimates need `min`, `max`, `sumsq`, `chan_maxabs` and `row_absmax`). A weight captured
/// once per compile is compared with the compile's first recorded run. Rows the sketch left out
/// (padding: `row_absmax` is NaN there) are left out of the measurement too.
///
/// Errors: the capture or the recording cannot be read; a recorded `row_absmax` has more values
/// than the captured tensor has rows (not the same tensor).
pub fn noise_check(dir: &Path, recording: &Path) -> Result<Vec<NoiseCheck>> {
    let m = read_manifest(dir)?;
    let series = opscope::mine::load(recording).with_context(|| format!("reading {}", recording.display()))?;
    let mut out = Vec::new();
    for c in &m.captured {
        let Some(s) = series.iter().find(|((site, role, _), _)| *site == c.site && *role == c.role).map(|(_, s)| s) else { continue };
        let run = if c.invariant {
            s.runs.iter().find(|r| r.compile == c.compile)
        } else {
            s.runs.iter().find(|r| r.compile == c.compile && r.step == c.run)
        };
        let Some(run) = run else { continue };
        let v = read_tensor(dir, c).with_context(|| format!("{}/{} run {}", c.site, c.role, c.run))?;
        let cols = c.shape.last().copied().unwrap_or(1).max(1);
        let rows = v.len() / cols;
        let kept: Vec<bool> = match run.vector(opscope::sketch::tensor::ROW_ABSMAX) {
            // A row not recorded (padding) is NaN, and trailing ones are absent: the recording
            // keeps no NaN, so the vector ends at the last recorded row.
            Some(r) if r.len() <= rows => (0..rows).map(|i| r.get(i).is_some_and(|x| x.is_finite())).collect(),
            Some(r) => bail!(
                "{}/{} run {}: the recording has {} row_absmax values, more than the captured tensor's {rows} rows: not the same tensor (record and capture in one run)",
                c.site,
                c.role,
                c.run,
                r.len()
            ),
            None => vec![true; rows],
        };
        let rows_kept = kept.iter().filter(|&&k| k).count();
        let keep = |i: usize| kept[i / cols];
        let est = opscope::mine::int8_estimate(run, &c.shape);
        let measured = [
            ("tensor", est.tensor, fakequant8(&v, keep, 1, |_| 0)),
            ("channel", est.channel, fakequant8(&v, keep, cols, |i| i % cols)),
            ("token", est.token, fakequant8(&v, keep, rows, |i| i / cols)),
        ];
        for (scale, predicted_db, (sig, err, zeros)) in measured {
            let measured_db = (err > 0.0 && sig > 0.0).then(|| 10.0 * (sig / err).log10());
            out.push(NoiseCheck {
                site: c.site.clone(),
                role: c.role.clone(),
                compile: c.compile,
                run: c.run,
                scale,
                predicted_db,
                measured_db,
                gap_db: measured_db.zip(predicted_db).map(|(a, b)| a - b),
                zero_fraction: zeros as f64 / (rows_kept * cols).max(1) as f64,
                rows_kept,
                rows,
            });
        }
    }
    Ok(out)
}

/// The noise checks as text, one line per tensor, run and scale.
pub fn render_noise(checks: &[NoiseCheck]) -> String {
    let mut s = String::from(
        "\nint8 SQNR (dB): the miner's estimate (noise model Δ²/12) vs measured on the captured tensor (fakequant's quantizer)\n\
         tensor                                   role  run    scale    predicted  measured    gap  zeros  rows kept\n",
    );
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    for c in checks {
        s.push_str(&format!(
            "{:<40} {:<5} {:>5}  {:<7} {:>9} {:>9} {:>6} {:>6.3}  {}/{}\n",
            c.site,
            c.role,
            format!("{}:{}", c.compile, c.run),
            c.scale,
            f(c.predicted_db),
            f(c.measured_db),
            f(c.gap_db),
            c.zero_fraction,
            c.rows_kept,
            c.rows
        ));
    }
    s
}
