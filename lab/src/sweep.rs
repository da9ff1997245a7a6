//! Synthetic ground truth: seeded tensors with one planted structure each, driven through real
//! tapped RLX matmul graphs, so that a miner's verdicts can be checked against what was planted.
//!
//! Every planted tensor is the activation (`lhs`) of its own matmul site
//! `sweep/{structure}/{shape}/s{seed}`; the weight (`rhs`) is an unstructured Gaussian, a null
//! sample at every site. Base values are N(0, 1); sizes and scales below are the planted
//! structures of the issue (90% zeros, rank 4, x30 outliers on a few channels or on 1% of
//! elements, a 0.5 grid, a random walk along the token axis).

use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal, Uniform};
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use opscope::Error;
use opscope::mine::{Kind, Verdict};
use opscope::pipeline::Pipeline;
use opscope::recording::Sink;

/// Runs of a sequence structure (stationary, drifting, repeat); single-tensor structures run once.
pub const SEQUENCE_STEPS: usize = 8;

/// Output width `N` of every sweep matmul.
pub const SWEEP_N: usize = 32;

/// Shapes of the planted activations: 2-D with many rows, 2-D with few rows, batched rank 3.
/// The last dim is a multiple of 4 (2:4 groups run along it).
/// Every shape holds >= 4k elements: below that, 1% scattered outliers can land in so few channels
/// that sketches cannot tell them from channel outliers.
pub const SHAPES: [&[usize]; 3] = [&[64, 256], &[32, 128], &[4, 16, 64]];

/// One planted structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Planted {
    /// N(0, 1): the null; no verdict should fire.
    Gaussian,
    /// U(-sqrt 3, sqrt 3): unit variance, flat histogram, kurtosis 1.8.
    Uniform,
    /// Unstructured sparsity: each element is 0 with probability 0.9.
    Sparse,
    /// 2:4 structured sparsity: in every group of 4 consecutive last-axis elements, 2 are 0.
    TwoFour,
    /// Rank 4: rows (leading axes flattened) are combinations of 4 random vectors.
    LowRank,
    /// Per-channel outliers: max(1, C/64) random feature columns scaled x30 (LLM.int8's
    /// systematic outlier features).
    ChannelOutliers,
    /// Scattered outliers: 1% of the elements, at random, scaled x30.
    ScatteredOutliers,
    /// Values on a 0.5 grid (N(0,1) rounded to the nearest multiple of 0.5).
    Quantized,
    /// Coherent rows: a random walk along the token (second-to-last) axis, steps N(0, 0.05^2),
    /// starting from N(0, 1) in every leading block.
    CoherentRows,
    /// A sequence of fresh N(0, 1) draws: the distribution does not move.
    Stationary,
    /// A sequence whose mean moves by +0.5 per step.
    Drifting,
    /// A sequence repeating one N(0, 1) tensor exactly.
    Repeat,
}

impl Planted {
    /// Every structure, in sweep order.
    pub const ALL: [Planted; 12] = [
        Planted::Gaussian,
        Planted::Uniform,
        Planted::Sparse,
        Planted::TwoFour,
        Planted::LowRank,
        Planted::ChannelOutliers,
        Planted::ScatteredOutliers,
        Planted::Quantized,
        Planted::CoherentRows,
        Planted::Stationary,
        Planted::Drifting,
        Planted::Repeat,
    ];

    /// Name used in site names and the ground-truth sidecar.
    pub fn name(self) -> &'static str {
        match self {
            Planted::Gaussian => "gaussian",
            Planted::Uniform => "uniform",
            Planted::Sparse => "sparse",
            Planted::TwoFour => "two_four",
            Planted::LowRank => "low_rank",
            Planted::ChannelOutliers => "channel_outliers",
            Planted::ScatteredOutliers => "scattered_outliers",
            Planted::Quantized => "quantized",
            Planted::CoherentRows => "coherent_rows",
            Planted::Stationary => "stationary",
            Planted::Drifting => "drifting",
            Planted::Repeat => "repeat",
        }
    }

    /// Runs of the site: [`SEQUENCE_STEPS`] for sequence structures, else 1.
    pub fn steps(self) -> usize {
        match self {
            Planted::Stationary | Planted::Drifting | Planted::Repeat => SEQUENCE_STEPS,
            _ => 1,
        }
    }

    /// The tensor of `dims` (row-major) at `step`. `rng` is the site's own generator: a
    /// sequence draws from it step after step, except `Repeat`, which regenerates from `seed`.
    pub fn generate(self, dims: &[usize], seed: u64, step: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        let n: usize = dims.iter().product();
        let c = *dims.last().unwrap_or(&1);
        let rows = n.checked_div(c).unwrap_or(0);
        let normal = Normal::new(0.0f32, 1.0).expect("unit normal");
        let gauss = |rng: &mut rand::rngs::StdRng, k: usize| -> Vec<f32> { (0..k).map(|_| normal.sample(rng)).collect() };
        match self {
            Planted::Gaussian | Planted::Stationary => gauss(rng, n),
            Planted::Uniform => {
                let u = Uniform::new_inclusive(-3f32.sqrt(), 3f32.sqrt());
                (0..n).map(|_| u.sample(rng)).collect()
            }
            Planted::Sparse => gauss(rng, n)
                .into_iter()
                .map(|v| if rng.gen_bool(0.9) { 0.0 } else { v })
                .collect(),
            Planted::TwoFour => {
                let mut x = gauss(rng, n);
                for group in x.chunks_mut(4) {
                    for i in sample(rng, group.len(), group.len() / 2) {
                        group[i] = 0.0;
                    }
                }
                x
            }
            Planted::LowRank => {
                let r = 4;
                let a = gauss(rng, rows * r);
                let b = gauss(rng, r * c);
                let mut x = vec![0f32; n];
                for i in 0..rows {
                    for j in 0..c {
                        x[i * c + j] = (0..r).map(|k| a[i * r + k] * b[k * c + j]).sum::<f32>() / (r as f32).sqrt();
                    }
                }
                x
            }
            Planted::ChannelOutliers => {
                let mut x = gauss(rng, n);
                let chosen = sample(rng, c, (c / 64).max(1)).into_vec();
                for row in x.chunks_mut(c) {
                    for &j in &chosen {
                        row[j] *= 30.0;
                    }
                }
                x
            }
            Planted::ScatteredOutliers => {
                let mut x = gauss(rng, n);
                for i in sample(rng, n, (n / 100).max(1)) {
                    x[i] *= 30.0;
                }
                x
            }
            Planted::Quantized => gauss(rng, n).into_iter().map(|v| (v / 0.5).round() * 0.5).collect(),
            Planted::CoherentRows => {
                let block = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
                let step_dist = Normal::new(0.0f32, 0.05).expect("normal");
                let mut x = gauss(rng, n);
                for r in 0..rows {
                    if r % block != 0 {
                        for j in 0..c {
                            x[r * c + j] = x[(r - 1) * c + j] + step_dist.sample(rng);
                        }
                    }
                }
                x
            }
            Planted::Drifting => gauss(rng, n).into_iter().map(|v| v + 0.5 * step as f32).collect(),
            Planted::Repeat => {
                let mut again = rand::rngs::StdRng::seed_from_u64(seed);
                gauss(&mut again, n)
            }
        }
    }
}

/// One planted site of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TruthSite {
    /// Site name in the recording.
    pub site: String,
    /// Role holding the planted tensor (`lhs`).
    pub role: String,
    /// What was planted.
    pub planted: Planted,
    /// Shape of the planted tensor.
    pub shape: Vec<usize>,
    /// Runs recorded.
    pub steps: usize,
    /// Seed of the site's generator.
    pub seed: u64,
}

/// The ground-truth sidecar of a sweep (`<recording>.truth.json`). The `rhs` of every site is
/// an unstructured N(0, 1/K) weight: a Gaussian null.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Truth {
    /// Format version.
    pub format: u32,
    /// Canonical pipeline text the sweep recorded with.
    pub pipeline: String,
    /// Every planted site.
    pub sites: Vec<TruthSite>,
}

/// Site name of one sweep site.
pub fn site_name(planted: Planted, dims: &[usize], seed: u64) -> String {
    let shape: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("sweep/{}/{}/s{seed}", planted.name(), shape.join("x"))
}

/// Run every structure x shape x seed through its own tapped RLX matmul graph
/// (`x[shape] @ w[K, 32]`, compiled and run with `Session::compile` inside one
/// [`opscope::Scope`]), recording to `sink`; a `capture` pass in `pipeline` writes into
/// `capture_dir` (default: the sink's, `<path>.capture` for a file). Returns the ground truth of
/// the sites recorded and the recording's summary: when `interruptible` and
/// [`crate::model::INTERRUPTED`] is set (a signal handler sets it) the sweep stops before the
/// next site and the recording is closed as partial ([`crate::model::STOPPED_EARLY`];
/// [`opscope::activate::Summary::interrupted`] says which way it was closed).
///
/// Errors: the recording's (see [`opscope::Scope::run`]).
pub fn run(
    pipeline: &Pipeline,
    seeds: &[u64],
    sink: Box<dyn Sink>,
    capture_dir: Option<&std::path::Path>,
    interruptible: bool,
) -> Result<(Truth, opscope::activate::Summary), Error> {
    use rlx_ir::{DType, Graph, Shape};
    use rlx_runtime::{Device, Session};
    let mut sites = Vec::new();
    let mut scope = opscope::Scope::new(pipeline, sink);
    if let Some(dir) = capture_dir {
        scope = scope.capture_dir(dir);
    }
    if interruptible {
        crate::model::STOPPED_EARLY.store(false, std::sync::atomic::Ordering::SeqCst);
        scope = scope.interrupt_flag(&crate::model::STOPPED_EARLY);
    }
    let stop = || interruptible && crate::model::stop_before_next();
    let ((), recorded) = scope.run(|| {
        let session = Session::new(Device::Cpu);
        'sites: for (pi, &planted) in Planted::ALL.iter().enumerate() {
            for (si, dims) in SHAPES.iter().enumerate() {
                for &seed in seeds {
                    if stop() {
                        break 'sites;
                    }
                    let k = *dims.last().expect("shape has dims");
                    let mut out_dims = dims.to_vec();
                    *out_dims.last_mut().expect("dims") = SWEEP_N;
                    let name = site_name(planted, dims, seed);
                    let mut g = Graph::new(format!("sweep_{}_{si}_s{seed}", planted.name()));
                    let x = g.input("x", Shape::new(dims, DType::F32));
                    let w = g.param("w", Shape::new(&[k, SWEEP_N], DType::F32));
                    let y = g.matmul(x, w, Shape::new(&out_dims, DType::F32));
                    g.node_mut(y).name = Some(format!("/{name}"));
                    g.set_outputs(vec![y]);
                    // One generator per site, from (structure, shape, seed).
                    let site_seed = seed.wrapping_mul(1_000_003).wrapping_add((pi * 16 + si) as u64);
                    let mut rng = rand::rngs::StdRng::seed_from_u64(site_seed);
                    let wdist = Normal::new(0.0f32, 1.0 / (k as f32).sqrt()).expect("normal");
                    let wv: Vec<f32> = (0..k * SWEEP_N).map(|_| wdist.sample(&mut rng)).collect();
                    let mut c = session.compile(g);
                    c.set_param("w", &wv);
                    for step in 0..planted.steps() {
                        let xv = planted.generate(dims, site_seed, step, &mut rng);
                        c.run(&[("x", &xv)]);
                    }
                    sites.push(TruthSite {
                        site: name,
                        role: "lhs".into(),
                        planted,
                        shape: dims.to_vec(),
                        steps: planted.steps(),
                        seed: site_seed,
                    });
                }
            }
        }
    });
    let summary = recorded?;
    Ok((Truth { format: 1, pipeline: pipeline.to_string(), sites }, summary))
}

/// Verdicts a planted structure must get at its site, and verdicts it may also get (a
/// consequence of the structure, such as per-channel int8 for channel outliers).
pub fn expected(p: Planted) -> (&'static [Kind], &'static [Kind]) {
    use opscope::mine::kinds::*;
    match p {
        Planted::Gaussian => (&[], &[]),
        Planted::Uniform => (&[INT4], &[]),
        Planted::Sparse => (&[SPARSE_GEMM], &[PER_CHANNEL_INT8]),
        Planted::TwoFour => (&[TWO_FOUR_PROBE], &[PER_CHANNEL_INT8]),
        // Rows of a rank-4 product differ in energy, so per-token scales can pay.
        Planted::LowRank => (&[LOW_RANK_PROBE], &[PER_CHANNEL_INT8, PER_TOKEN_INT8]),
        // Each row's outlier magnitude differs (|30 g| over a few channels), and per-token scales
        // follow it: the estimate gains >= 8 dB in most seeds.
        Planted::ChannelOutliers => (&[CHANNEL_OUTLIERS, PER_CHANNEL_INT8], &[PER_TOKEN_INT8]),
        // Rows without an outlier get a scale of their own.
        Planted::ScatteredOutliers => (&[SCATTERED_OUTLIERS], &[PER_CHANNEL_INT8, PER_TOKEN_INT8]),
        Planted::Quantized => (&[LUT], &[]),
        // Near-constant channels: per-channel scales fit them much better.
        Planted::CoherentRows => (&[DELTA_COMPUTE], &[PER_CHANNEL_INT8]),
        Planted::Stationary => (&[STATIONARY], &[]),
        // A moving mean moves the range a static scale must cover too.
        Planted::Drifting => (&[DRIFTING], &[SCALE_DRIFT]),
        Planted::Repeat => (&[EXACT_REPEAT], &[]),
    }
}

/// The capture pass `opscope sweep --confirm` appends: the activations of the structures only
/// a host probe can confirm (2:4 and low rank), every run, no budget limit (48 seeds: 288
/// tensors, 12 MiB).
pub const CONFIRM_CAPTURE: &str = "capture{sites=[sweep/two_four/*,sweep/low_rank/*],roles=[lhs],budget=1GiB}";

/// [`expected`] once the probe verdicts were upgraded by a host probe of the
/// [`CONFIRM_CAPTURE`] tensors ([`confirm`]): 2:4 and low rank must be *confirmed*, with the
/// same secondary verdicts.
pub fn expected_confirmed(p: Planted) -> (&'static [Kind], &'static [Kind]) {
    use opscope::mine::kinds::*;
    use opscope::mine::probe::kinds::*;
    match p {
        Planted::TwoFour => (&[TWO_FOUR_CONFIRMED], &[PER_CHANNEL_INT8]),
        Planted::LowRank => (&[LOW_RANK_CONFIRMED], &[PER_CHANNEL_INT8, PER_TOKEN_INT8]),
        other => expected(other),
    }
}

/// Probe the tensors captured in `capture_dir` ([`crate::probe::probe_dir`]) and upgrade the
/// probe verdicts they give evidence for ([`crate::probe::upgrade`]).
///
/// Errors: the capture directory cannot be read (see [`crate::probe::probe_dir`]).
pub fn confirm(verdicts: Vec<opscope::mine::Verdict>, capture_dir: &std::path::Path) -> anyhow::Result<Vec<opscope::mine::Verdict>> {
    let report = crate::probe::probe_dir(capture_dir)?;
    Ok(crate::probe::upgrade(verdicts, &report))
}

/// The result of checking a miner's verdicts against a sweep's ground truth.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Rows: planted structure (and `weight_null` for every site's Gaussian weight); columns:
    /// verdict kind; cells: sites with that verdict.
    pub matrix: BTreeMap<String, BTreeMap<Kind, usize>>,
    /// Sites per row.
    pub sites: BTreeMap<String, usize>,
    /// Every departure from [`expected`]: a missing required verdict or an unexpected one.
    pub errors: Vec<String>,
}

impl Check {
    /// True when every planted structure got its verdicts and nothing else fired.
    pub fn perfect(&self) -> bool {
        self.errors.is_empty()
    }

    /// The confusion matrix as a text table.
    pub fn table(&self) -> String {
        let kinds: Vec<Kind> = self.matrix.values().flat_map(|m| m.keys().copied()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let names: Vec<String> = kinds.iter().map(|k| k.to_string()).collect();
        let mut out = format!("{:<20} {:>5}", "planted \\ verdict", "sites");
        for n in &names {
            out.push_str(&format!(" {:>w$}", n, w = n.len().max(4)));
        }
        out.push('\n');
        for (row, m) in &self.matrix {
            out.push_str(&format!("{:<20} {:>5}", row, self.sites.get(row).copied().unwrap_or(0)));
            for (k, n) in kinds.iter().zip(&names) {
                out.push_str(&format!(" {:>w$}", m.get(k).copied().unwrap_or(0), w = n.len().max(4)));
            }
            out.push('\n');
        }
        out
    }
}

/// What a planted structure must and may get: `(required, allowed)` verdict kinds.
pub type Expectation = fn(Planted) -> (&'static [Kind], &'static [Kind]);

/// Compare `verdicts` with `truth` under `expected` (the CLI's `--check` passes [`expected`];
/// the sweep test passes its own table, written apart from this crate).
pub fn check(truth: &Truth, verdicts: &[Verdict], expected: Expectation) -> Check {
    let mut matrix: BTreeMap<String, BTreeMap<Kind, usize>> = BTreeMap::new();
    let mut sites: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors = Vec::new();
    let mut at = |site: &str, role: &str, row: &str, required: &[Kind], allowed: &[Kind]| {
        let got: Vec<Kind> = verdicts.iter().filter(|v| v.site == site && v.role == role).map(|v| v.kind).collect();
        *sites.entry(row.to_string()).or_default() += 1;
        let cells = matrix.entry(row.to_string()).or_default();
        for k in &got {
            *cells.entry(*k).or_default() += 1;
            if !required.contains(k) && !allowed.contains(k) {
                errors.push(format!("{site}/{role} ({row}): unexpected {k:?}"));
            }
        }
        for k in required {
            if !got.contains(k) {
                errors.push(format!("{site}/{role} ({row}): missing {k:?}"));
            }
        }
    };
    for t in &truth.sites {
        let (required, allowed) = expected(t.planted);
        at(&t.site, &t.role, t.planted.name(), required, allowed);
        at(&t.site, "rhs", "weight_null", &[], &[]);
    }
    Check { matrix, sites, errors }
}
