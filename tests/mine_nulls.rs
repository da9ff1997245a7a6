//! Held-out nulls: distributions the miner's thresholds were not tuned on (the sweep and the
//! rules' comments use Gaussian nulls), recorded through a real tapped matmul (the activation
//! `x[M,K]` of `x @ w`), several seeds and shapes, 4 runs of fresh i.i.d. data each. Each null has
//! no structure a kernel could exploit beyond what its distribution itself implies, so the
//! verdicts each may produce are listed here with the reason, and any other verdict fails.
//!
//! The generators are `rand_distr`'s (Student-t, normal, exponential); each null's defining
//! property (kurtosis, density) is checked on the host in f64 before it is recorded, so a wrong
//! generator cannot pass as a null.

mod common;

use std::collections::BTreeSet;

use common::matmul_2d;
use opscope::mine::{mine, series_from_rows, Verdict};
use opscope::{MemorySink, Pipeline};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp1, Normal, StandardNormal, StudentT};
use rlx_runtime::{Device, Session};

/// Shapes `[M, K]` of the recorded activation (tokens x channels).
const SHAPES: &[(usize, usize)] = &[(64, 128), (128, 64), (32, 256)];
const SEEDS: &[u64] = &[11, 12, 13];
const RUNS: usize = 4;

#[derive(Debug, Clone, Copy)]
enum Null {
    /// N(0, 1). Kurtosis 3.
    Gaussian,
    /// Laplace(0, 1): the difference of two i.i.d. Exp(1) variables. Kurtosis 6.
    Laplace,
    /// Student-t with 5 degrees of freedom. Kurtosis 9.
    StudentT5,
    /// 0.5 N(-2, 1) + 0.5 N(2, 1): two overlapping modes (the density dips between them but
    /// never empties). Kurtosis (16 + 24 + 3) / 5^2 = 1.72.
    Bimodal,
    /// max(0, z), z ~ N(0, 1): ReLU outputs, half of them exactly 0.
    Relu,
}

fn sample(null: Null, n: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
    let t5 = StudentT::new(5.0).expect("5 dof");
    let (lo, hi) = (Normal::new(-2.0, 1.0).expect("sd 1"), Normal::new(2.0, 1.0).expect("sd 1"));
    (0..n)
        .map(|_| {
            let v: f64 = match null {
                Null::Laplace => {
                    let (a, b): (f64, f64) = (Exp1.sample(rng), Exp1.sample(rng));
                    a - b
                }
                Null::Gaussian => StandardNormal.sample(rng),
                Null::StudentT5 => t5.sample(rng),
                Null::Bimodal => {
                    if rng.gen::<bool>() {
                        hi.sample(rng)
                    } else {
                        lo.sample(rng)
                    }
                }
                Null::Relu => {
                    let z: f64 = StandardNormal.sample(rng);
                    z.max(0.0)
                }
            };
            v as f32
        })
        .collect()
}

/// Kurtosis E[(x-mu)^4] / E[(x-mu)^2]^2 and density (non-zero fraction), in f64 on the host.
fn host_moments(x: &[f32]) -> (f64, f64) {
    let n = x.len() as f64;
    let mu = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let m2 = x.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / n;
    let m4 = x.iter().map(|&v| (v as f64 - mu).powi(4)).sum::<f64>() / n;
    (m4 / (m2 * m2), x.iter().filter(|&&v| v != 0.0).count() as f64 / n)
}

/// Record `RUNS` runs of fresh samples of `null` as the activation of a tapped `[M,K] @ [K,16]`
/// matmul (every tensor statistic, default histogram) and mine the recording.
fn record(null: Null, (m, k): (usize, usize), seed: u64) -> Vec<Verdict> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let xs: Vec<Vec<f32>> = (0..RUNS).map(|_| sample(null, m * k, &mut rng)).collect();
    let all: Vec<f32> = xs.concat();
    let (kurt, density) = host_moments(&all);
    let (want_kurt, want_density) = match null {
        Null::Gaussian => (3.0, 1.0),
        Null::Laplace => (6.0, 1.0),
        Null::StudentT5 => (9.0, 1.0),
        Null::Bimodal => (1.72, 1.0),
        // ReLU(z), z ~ N(0, 1): E[x] = mu = 1/sqrt(2 pi), E[x^2] = 1/2, E[x^3] = 2/sqrt(2 pi),
        // E[x^4] = 3/2; centred: var = 1/2 - mu^2 = 0.34085, m4 = 3/2 - 4 mu E[x^3] + 6 mu^2 E[x^2]
        // - 3 mu^4 = 0.62823, kurtosis 5.407; density 1/2.
        Null::Relu => (5.407, 0.5),
    };
    // Sample kurtosis of 32k-values: within 15% for the lighter tails. Student-t 5's sample
    // kurtosis has an infinite-variance estimator (its eighth moment diverges), so it is only
    // checked to be clearly heavier than a Gaussian's 3, and its variance, 5 / (5 - 2), within
    // 10% (its fourth moment is finite).
    if let Null::StudentT5 = null {
        assert!(kurt > 4.0, "{null:?}: host kurtosis {kurt}");
        let n = all.len() as f64;
        let mean = all.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = all.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!((var / (5.0 / 3.0) - 1.0).abs() < 0.1, "{null:?}: host variance {var}");
    } else {
        assert!((kurt / want_kurt - 1.0).abs() < 0.15, "{null:?}: host kurtosis {kurt} vs {want_kurt}");
    }
    assert!((density - want_density).abs() < 0.02, "{null:?}: host density {density}");

    let w: Vec<f32> = common::randn(k * 16, seed + 100);
    let sink = MemorySink::default();
    let p = Pipeline::parse("matmul{roles=[lhs]}").expect("pipeline parses");
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(m, k, 16));
        c.set_param("w", &w);
        for x in &xs {
            c.run(&[("x", x)]);
        }
    })
    .expect("recording ok");
    let series = series_from_rows(&sink.rows());
    assert_eq!(series.len(), 1, "one lhs series");
    assert_eq!(series.values().next().map(|s| s.runs.len()), Some(RUNS));
    mine(&series)
}

/// Record every seed and shape; assert each recording's verdicts lie in `allowed` and include
/// `required`.
fn check(null: Null, allowed: &[&str], required: &[&str]) {
    check_shapes(null, SHAPES, allowed, required)
}

/// [`check`] over `shapes`.
fn check_shapes(null: Null, shapes: &[(usize, usize)], allowed: &[&str], required: &[&str]) {
    let allowed: BTreeSet<&str> = allowed.iter().copied().collect();
    let mut wrong: Vec<String> = Vec::new();
    for &shape in shapes {
        for &seed in SEEDS {
            let v = record(null, shape, seed);
            let got: BTreeSet<&str> = v.iter().map(|v| v.kind.name).collect();
            let detail = v.iter().map(|v| format!("{} {:?}", v.kind.name, v.evidence)).collect::<Vec<_>>().join("; ");
            let false_verdicts: Vec<&&str> = got.difference(&allowed).collect();
            let missing: Vec<&&str> = required.iter().filter(|r| !got.contains(*r)).collect();
            if !false_verdicts.is_empty() || !missing.is_empty() {
                wrong.push(format!("{shape:?} seed {seed}: false {false_verdicts:?}, missing {missing:?}: {detail}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{null:?}:\n{}", wrong.join("\n"));
}

// `stationary` is allowed on every null and required on the light-tailed ones: each run draws
// fresh i.i.d. values from one distribution, so the per-run rms varies by ~sqrt((kurtosis - 1) /
// (4 n)) <= 1.2% for n >= 8192 (under the 5% line) and a range calibrated once is right. For
// Student-t 5 the rms spread has an infinite-variance estimator, so it is allowed, not required.

#[test]
fn laplace_null() {
    check(Null::Laplace, &["stationary"], &["stationary"]);
}

// Student-t 5 is where the held-out nulls found false verdicts (seeds 11-13, every shape): on
// i.i.d. data with no structure,
// - `scale_drift` fired on 2 of 3 seeds (absmax end/start 0.59 and 3.4): the least-squares trend
//   through 4 per-run maxima of a heavy-tailed sample follows single extreme values. Fixed: the
//   rule now also needs the slope to stand out of the scatter (t >= 3), and no longer fires here;
// - `per_channel_int8` fires on [32,256] (+8.8 to +9.0 dB): 32-value channels have much smaller
//   maxima than the 8192-value tensor, a sample-size effect of the tails the Gaussian-calibrated
//   8 dB line does not cover (left: the gain is real for a per-channel quantizer on this data);
// - `low_rank_probe` fired on [128,64] (row-energy CV 0.40): heavy tails make row energies
//   uneven, and the rule's fixed 0.35 line sat at the Gaussian's null for C = 16 and under
//   Student-t 5's, sqrt((9 - 1) / 64) = 0.35, at C = 64. Fixed: the line is now also twice the
//   i.i.d. null sqrt((kurtosis - 1) / C) of the recorded kurtosis and row length.
// The test pins the one left as tolerated, so no further false verdict goes unnoticed.
#[test]
fn student_t5_null_gets_no_verdict_beyond_the_known_false_positives() {
    check(Null::StudentT5, &["stationary", "per_channel_int8"], &[]);
}

// Narrow rows: a row of C i.i.d. Gaussian values has energy chi-squared with C degrees of
// freedom, whose CV is sqrt(2 / C): 0.35 at C = 16, 0.5 at C = 8. The fixed 0.35 line read
// half of such nulls as low rank (attention probabilities over 16 keys have rows this short).
#[test]
fn gaussian_null_on_narrow_rows_is_not_low_rank() {
    check_shapes(Null::Gaussian, &[(256, 16), (512, 8), (128, 32)], &["stationary"], &["stationary"]);
}

#[test]
fn bimodal_gaussian_mix_null() {
    check(Null::Bimodal, &["stationary"], &["stationary"]);
}

#[test]
fn relu_at_half_density_null() {
    // `two_four_probe` is required: half the values are exactly zero, which is what the probe
    // reports (density in [0.45, 0.55] is consistent with 2:4 and says so without claiming it;
    // confirming needs a per-group-of-4 count). Nothing else: ReLU outputs are not sparse enough
    // for a sparse GEMM (0.5 > 0.3), and their density is 0.5 in every run.
    check(Null::Relu, &["stationary", "two_four_probe"], &["stationary", "two_four_probe"]);
}
