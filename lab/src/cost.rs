//! `opscope cost`: where a model's work goes on the deployed (fused) graph. Per op kind and per
//! site: FLOPs, bytes moved, arithmetic intensity and roofline class against a ridge point
//! measured in this process ([`probe_machine`]); the hot GEMM shapes RLX runs after fusion
//! (its merged Q/K/V projection is one GEMM); RLX's own time estimate beside it. The counting
//! conventions are `opscope::analysis::cost`'s.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{CompileOptions, Device, Session};
use serde::Serialize;

use opscope::analysis::cost::{Bound, Bytes, GraphCost, KindCost, Machine, NodeCost, ShapeBin};

/// How a probe was run and what it measured.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// What one probe op is (`neg over [67108864] f32`, `matmul [1024,1024]x[1024,1024] f32`).
    pub op: String,
    /// Work of one probe op: bytes moved (copy probe) or FLOPs (GEMM probe).
    pub work: u64,
    /// Its timing ([`time_per_op`]); `None` for a machine given rather than measured.
    pub timing: Option<OpTiming>,
    /// Work per second at the measured per-op time (bytes/s or FLOP/s).
    pub rate: f64,
}

/// The machine the roofline uses, measured through RLX on the CPU in this process.
#[derive(Debug, Clone, Serialize)]
pub struct MachineProbe {
    /// Peak and bandwidth.
    pub machine: Machine,
    /// Ridge point, FLOP/byte.
    pub ridge: f64,
    /// The fastest of the streaming probes: its rate is the memory bandwidth.
    pub copy: Probe,
    /// Every streaming probe ([`STREAM_KERNELS`]).
    pub streams: Vec<Probe>,
    /// The GEMM probe (peak FLOP/s).
    pub gemm: Probe,
    /// Square size `n` of the GEMM probe (0 for a given machine).
    pub gemm_n: usize,
    /// Bandwidth by working set, smallest first, ending with the DRAM point of `copy` (empty for a
    /// given machine): the cache-aware roofs ([`MachineProbe::roof_at`]).
    pub curve: Vec<CurvePoint>,
}

/// One point of the bandwidth-by-working-set curve: the fastest of [`CURVE_KERNELS`] on tensors
/// sized so that one op moves `working_set` bytes.
#[derive(Debug, Clone, Serialize)]
pub struct CurvePoint {
    /// Bytes one probe op reads and writes (its inputs and its output), which is also the data it
    /// keeps live: the level of the memory hierarchy it fits in.
    pub working_set: u64,
    /// Bytes/s of the fastest kernel at this size.
    pub bandwidth: f64,
    /// That kernel's probe.
    pub probe: Probe,
    /// Kernels of [`CURVE_KERNELS`] whose differential time at this size stayed non-positive
    /// (each with its error): left out of the best-of. Measured on this project's AMD EPYC
    /// machine: in about one process of five, one kernel's 1-op chain ran slower than its 5-op
    /// chain over all 4000 runs at one size between 192 KiB and 768 KiB (`add` over 768 KiB:
    /// 124 us against 92 us), while the other kernels timed positive there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unmeasured: Vec<String>,
}

/// Options of [`probe_machine`].
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Bytes of the copy probe's input tensor (the output is as large). Make the pair larger than
    /// the last-level cache to measure DRAM bandwidth.
    pub copy_bytes: usize,
    /// Square GEMM size `n` of the GEMM probe (`[n,n] x [n,n]`).
    pub gemm_n: usize,
    /// Repetitions of each probe (the best run of each chain length is used; [`time_per_op`]).
    pub reps: usize,
    /// Working sets (bytes moved by one op) of the bandwidth curve, ascending; empty for none.
    pub curve: Vec<u64>,
}

/// The working sets of the default bandwidth curve: 48 KiB to 192 MiB in steps of 2x to 4x
/// (`3 * 2^k` KiB, so the `add` kernel's three tensors are powers of two), placed on both sides of
/// this machine class's cache sizes (L1d 48 KiB, L2 2 MiB per core, L3 300 MiB shared). The DRAM
/// point is the copy probe's.
pub const CURVE_WORKING_SETS: [u64; 9] = [48 << 10, 192 << 10, 768 << 10, 3 << 19, 3 << 20, 6 << 20, 12 << 20, 48 << 20, 192 << 20];

/// The kernels of the bandwidth curve: RLX's binary streaming kernels, measured here 1.3x to 2x
/// faster than its unary ones on the same bytes at every size (the roof is the fastest kernel's).
pub const CURVE_KERNELS: [&str; 3] = ["mul_scalar", "add_self", "add"];

/// Wall time the curve spends per kernel and size, seconds: sets the repetitions of small sizes
/// (whose per-op time is microseconds) between `reps` and 1000.
const CURVE_SECONDS: f64 = 0.15;

impl Default for ProbeOptions {
    /// 256 MiB copies (input + output 512 MiB, above this machine class's 300 MiB L3), 1024^3
    /// GEMMs, 7 repetitions, the curve at [`CURVE_WORKING_SETS`].
    fn default() -> ProbeOptions {
        ProbeOptions { copy_bytes: 256 << 20, gemm_n: 1024, reps: 7, curve: CURVE_WORKING_SETS.to_vec() }
    }
}

/// Shortest and longest chain of probe ops timed: per-op time is `(t(LONG) - t(SHORT)) / (LONG - SHORT)`.
pub const SHORT: usize = 1;
/// See [`SHORT`].
pub const LONG: usize = 5;

/// Compile `graph` for timing: without fusion so that each probe op is its own kernel; its one
/// input is named `x`. Runs it once (warm-up: the arena's pages are touched, caches filled).
fn compile_for_timing(graph: Graph, params: &[(&str, &[f32])], input: &[f32]) -> Result<rlx_runtime::CompiledGraph> {
    let session = Session::new(Device::Cpu);
    let mut opts = CompileOptions::default();
    opts.fusion_opts.skip_fusion = true;
    let mut c = session.compile_with(graph, &opts);
    for (name, data) in params {
        c.set_param(name, data);
    }
    if c.run(&[("x", input)]).is_empty() {
        bail!("probe graph returned no output");
    }
    Ok(c)
}

/// Seconds of one run.
fn time_run(c: &mut rlx_runtime::CompiledGraph, input: &[f32]) -> f64 {
    let t = Instant::now();
    let out = c.run(&[("x", input)]);
    let dt = t.elapsed().as_secs_f64();
    std::hint::black_box(out);
    dt
}

/// The time of one op of a chain, measured differentially.
#[derive(Debug, Clone, Serialize)]
pub struct OpTiming {
    /// Seconds of each run of the chain of [`SHORT`] ops.
    pub short: Vec<f64>,
    /// Seconds of each run of the chain of [`LONG`] ops.
    pub long: Vec<f64>,
    /// Seconds per op: `(min(long) - min(short)) / (LONG - SHORT)`.
    pub per_op: f64,
}

/// Rounds of `reps` alternations [`time_per_op`] runs at most while the difference of the best
/// runs is not positive. The best-of-N minimum only falls as runs are added, towards each chain's
/// undisturbed time, and the longer chain's undisturbed time is the larger, so a difference that
/// other work on the machine made negative asks for more runs, not a failure. (Small probes, such
/// as the tests' 16 MiB ones, run beside other tests on two cores; before the rounds, `report
/// --onnx` with them failed once in a test run that shared the cores with a cargo build.)
pub const MAX_ROUNDS: usize = 4;

/// Time one op through RLX on the CPU: `chain(L)` builds a graph of `L` copies of the op in a
/// chain (one input `x`, parameters `params`); both chains are compiled once (fusion off) and
/// run once to warm up, then runs of [`SHORT`] and [`LONG`] ops alternate `reps` times, and the
/// per-op time is the difference of the best (shortest) runs over the op count difference.
/// Best-of as STREAM reports it (McCalpin): the fastest run is the one least disturbed by other
/// work on the machine; the difference cancels what every run pays once (copying the input in
/// and the output out, dispatch). A difference that is not positive takes another round of
/// `reps` alternations, up to [`MAX_ROUNDS`] rounds ([`best_difference`]).
///
/// Errors: a compile or run fails, or the per-op time is still not positive after
/// [`MAX_ROUNDS`] rounds (too noisy: larger probe sizes).
pub fn time_per_op(reps: usize, chain: impl Fn(usize) -> Graph, params: &[(&str, &[f32])], input: &[f32]) -> Result<OpTiming> {
    let mut cs = compile_for_timing(chain(SHORT), params, input)?;
    let mut cl = compile_for_timing(chain(LONG), params, input)?;
    best_difference(reps, || (time_run(&mut cs, input), time_run(&mut cl, input)))
}

/// The differential time of [`time_per_op`] from `pair`, which runs the [`SHORT`] chain then the
/// [`LONG`] one and returns their seconds: rounds of `reps` (at least 1) pairs until
/// `(min(long) - min(short)) / (LONG - SHORT)` is positive, at most [`MAX_ROUNDS`] rounds. The
/// returned timing holds every run of every round.
///
/// Errors: not positive after [`MAX_ROUNDS`] rounds, naming the runs made and the fix.
pub fn best_difference(reps: usize, mut pair: impl FnMut() -> (f64, f64)) -> Result<OpTiming> {
    let (mut short, mut long) = (Vec::new(), Vec::new());
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let mut per_op = f64::NAN;
    for _ in 0..MAX_ROUNDS {
        for _ in 0..reps.max(1) {
            let (s, l) = pair();
            short.push(s);
            long.push(l);
        }
        per_op = (min(&long) - min(&short)) / (LONG - SHORT) as f64;
        if per_op > 0.0 {
            return Ok(OpTiming { short, long, per_op });
        }
    }
    bail!(
        "the differential timing gave a non-positive time per op ({per_op:.3e} s; fastest {SHORT}-op chain {:.3e} s, {LONG}-op \
         chain {:.3e} s) after {} runs of each chain: the machine is too noisy for probes this small; rerun on a quieter \
         machine, or raise the probe sizes (--probe-mib / --probe-gemm)",
        min(&short),
        min(&long),
        short.len()
    )
}

/// The streaming kernels of the bandwidth probe: elementwise ops with one read and one write per
/// element (8 bytes per f32 element), and STREAM's "add" (two reads, one write: 12 bytes).
pub const STREAM_KERNELS: [&str; 5] = ["neg", "relu", "mul_scalar", "add_self", "add"];

/// Bytes one element of streaming kernel `kind` moves (f32).
fn stream_bytes_per_element(kind: &str) -> u64 {
    if kind == "add" {
        12
    } else {
        8
    }
}

/// A chain of `l` ops of streaming kernel `kind` ([`STREAM_KERNELS`]) over `len` f32 values: one
/// input `x`; `mul_scalar` multiplies by a `[1]` parameter `one`, `add_self` is `x + x` (one read:
/// both operands are the same tensor), `add` is `x + p` with a parameter `p` of `len` values.
///
/// Errors: an unknown kind.
pub fn stream_chain(kind: &str, len: usize, l: usize) -> Result<Graph> {
    let s = Shape::new(&[len], DType::F32);
    let mut g = Graph::new(format!("opscope_stream_probe_{kind}_{l}"));
    let mut cur = g.input("x", s.clone());
    let one = (kind == "mul_scalar").then(|| g.param("one", Shape::new(&[1], DType::F32)));
    let p = (kind == "add").then(|| g.param("p", s.clone()));
    for _ in 0..l {
        cur = match (kind, one.or(p)) {
            ("add", Some(p)) => g.binary(BinaryOp::Add, cur, p, s.clone()),
            ("neg", _) => g.activation(Activation::Neg, cur, s.clone()),
            ("relu", _) => g.activation(Activation::Relu, cur, s.clone()),
            ("mul_scalar", Some(p)) => g.binary(BinaryOp::Mul, cur, p, s.clone()),
            ("add_self", _) => g.binary(BinaryOp::Add, cur, cur, s.clone()),
            _ => bail!("unknown streaming kernel '{kind}'; known: {}", STREAM_KERNELS.join(", ")),
        };
    }
    g.set_outputs(vec![cur]);
    Ok(g)
}

/// Measure the roofline's two roofs through RLX on the CPU, in this process:
/// - memory bandwidth from streaming probes: chains of streaming kernels ([`STREAM_KERNELS`])
///   over `copy_bytes` of f32 (STREAM's "copy"/"scale" traffic, one read and one write per
///   element, and its "add"; McCalpin, STREAM benchmark); the bandwidth is the fastest kernel's, as the Empirical Roofline Toolkit
///   (Lo et al., Berkeley Lab, 2014) takes the best of its kernels: RLX's unary kernels are
///   measured here several times slower than its binary ones on the same bytes, and a roof is
///   what the memory system allows, not what one kernel reaches;
/// - peak FLOP/s from a chain of `[n,n] x [n,n]` f32 GEMMs (`2n^3` FLOPs each) against weights
///   scaled by `1/sqrt(n)` (activations stay O(1), far from subnormals).
///
/// Each probe's per-op time is differential ([`time_per_op`]).
///
/// Errors: those of [`time_per_op`], or sizes of 0.
pub fn probe_machine(o: &ProbeOptions) -> Result<MachineProbe> {
    if o.copy_bytes < 4 || o.gemm_n == 0 {
        bail!("probe sizes must be positive (copy {} bytes, GEMM n {})", o.copy_bytes, o.gemm_n);
    }
    let len = o.copy_bytes / 4;
    let x: Vec<f32> = (0..len).map(|i| (i % 251) as f32 * 0.01 + 1.0).collect();
    let one = [1.0f32];
    let mut streams = Vec::new();
    for kind in STREAM_KERNELS {
        stream_chain(kind, len, 1)?;
        let copy_work = stream_bytes_per_element(kind) * len as u64;
        let params: Vec<(&str, &[f32])> = match kind {
            "mul_scalar" => vec![("one", &one)],
            "add" => vec![("p", &x)],
            _ => vec![],
        };
        let t = time_per_op(o.reps, |l| stream_chain(kind, len, l).expect("checked above"), &params, &x)
            .with_context(|| format!("the streaming probe {kind} over [{len}] f32"))?;
        let rate = copy_work as f64 / t.per_op;
        streams.push(Probe { op: format!("{kind} over [{len}] f32"), work: copy_work, timing: Some(t), rate });
    }
    let copy = streams.iter().max_by(|a, b| a.rate.total_cmp(&b.rate)).cloned().expect("four kernels");

    let n = o.gemm_n;
    let xg: Vec<f32> = (0..n * n).map(|i| ((i * 7919 % 1009) as f32 / 1009.0) - 0.5).collect();
    // A fixed sign pattern scaled by 1/sqrt(n): activations stay O(1) along the chain.
    let w: Vec<f32> = (0..n * n).map(|i| if (i.wrapping_mul(2654435761) >> 7) & 1 == 0 { 1.0 } else { -1.0 } / (n as f32).sqrt()).collect();
    let gemm_graph = |l: usize| {
        let s = Shape::new(&[n, n], DType::F32);
        let mut g = Graph::new(format!("opscope_gemm_probe_{l}"));
        let mut cur = g.input("x", s.clone());
        let p = g.param("w", s.clone());
        for _ in 0..l {
            cur = g.matmul(cur, p, s.clone());
        }
        g.set_outputs(vec![cur]);
        g
    };
    let gemm = time_per_op(o.reps, gemm_graph, &[("w", &w)], &xg).with_context(|| format!("the GEMM probe [{n},{n}]"))?;
    let gemm_work = 2 * (n as u64).pow(3);

    // The curve ends at the copy probe's working set (its DRAM point).
    let sizes: Vec<u64> = o.curve.iter().copied().filter(|&w| w < copy.work).collect();
    let mut curve = bandwidth_curve(&sizes, o.reps)?;
    curve.push(CurvePoint { working_set: copy.work, bandwidth: copy.rate, probe: copy.clone(), unmeasured: Vec::new() });

    let machine = Machine { peak_flops: gemm_work as f64 / gemm.per_op, bandwidth: copy.rate };
    Ok(MachineProbe {
        machine,
        ridge: machine.ridge(),
        copy,
        streams,
        gemm: Probe { op: format!("matmul [{n},{n}]x[{n},{n}] f32"), work: gemm_work, timing: Some(gemm), rate: machine.peak_flops },
        gemm_n: n,
        curve,
    })
}

/// Bandwidth by working set: at each size in `sizes` (bytes one op moves, ascending), the fastest
/// of [`CURVE_KERNELS`] timed as [`time_per_op`] does, with at least `reps` repetitions and more
/// for small sizes (about [`CURVE_SECONDS`] per kernel and size, at most 1000). The shape of the
/// Empirical Roofline Toolkit's bandwidth sweep (Lo et al., Berkeley Lab, 2014): the plateaus of
/// this curve are the cache levels' roofs of a hierarchical roofline (Yang et al., "Hierarchical
/// Roofline Analysis", 2020).
///
/// A kernel whose time stays non-positive at a size is left out of that size's best-of and
/// named in [`CurvePoint::unmeasured`].
///
/// Errors: sizes not ascending or below 48 bytes; no kernel timed at a size (every kernel's
/// [`time_per_op`] error named).
pub fn bandwidth_curve(sizes: &[u64], reps: usize) -> Result<Vec<CurvePoint>> {
    if let Some(w) = sizes.windows(2).find(|w| w[0] >= w[1]) {
        bail!("the bandwidth curve's working sets must be ascending: {} then {}", w[0], w[1]);
    }
    if let Some(s) = sizes.iter().find(|&&s| s < 48) {
        bail!("a bandwidth-curve working set of {s} bytes is below 48 (four f32 values per tensor)");
    }
    let mut curve = Vec::with_capacity(sizes.len());
    for &ws in sizes {
        let mut best: Option<Probe> = None;
        let mut unmeasured = Vec::new();
        for kind in CURVE_KERNELS {
            let per = stream_bytes_per_element(kind);
            let len = (ws / per) as usize;
            let x: Vec<f32> = (0..len).map(|i| (i % 251) as f32 * 0.01 + 1.0).collect();
            let one = [1.0f32];
            let params: Vec<(&str, &[f32])> = match kind {
                "mul_scalar" => vec![("one", &one)],
                "add" => vec![("p", &x)],
                _ => vec![],
            };
            // Six ops per repetition (SHORT + LONG) at an assumed 50 GB/s plus 50 us of dispatch.
            let per_rep = (SHORT + LONG) as f64 * (per * len as u64) as f64 / 50e9 + 50e-6;
            let r = ((CURVE_SECONDS / per_rep) as usize).clamp(reps.max(1), 1000);
            let t = match time_per_op(r, |l| stream_chain(kind, len, l).expect("a kernel of CURVE_KERNELS"), &params, &x) {
                Ok(t) => t,
                // The point is the best of the kernels that timed; it fails only if none did.
                Err(e) => {
                    unmeasured.push(format!("{kind} over [{len}] f32: {e:#}"));
                    continue;
                }
            };
            let work = per * len as u64;
            let p = Probe { op: format!("{kind} over [{len}] f32"), work, rate: work as f64 / t.per_op, timing: Some(t) };
            if best.as_ref().is_none_or(|b| p.rate > b.rate) {
                best = Some(p);
            }
        }
        let Some(probe) = best else {
            bail!("the bandwidth curve at {ws} bytes an op: no kernel timed ({})", unmeasured.join("; "));
        };
        curve.push(CurvePoint { working_set: ws, bandwidth: probe.rate, probe, unmeasured });
    }
    Ok(curve)
}

/// One row of the per-kind or per-site table: a cost with its roofline placement.
#[derive(Debug, Clone, Serialize)]
pub struct Placed<T> {
    /// The cost.
    #[serde(flatten)]
    pub cost: T,
    /// FLOP/byte, `None` when FLOPs are unknown or nothing moves.
    pub intensity: Option<f64>,
    /// Roofline class against the measured ridge point, `None` with the intensity.
    pub bound: Option<Bound>,
    /// Lower bound on the time of one execution at the measured roofs, seconds
    /// (`max(flops/peak, bytes/bandwidth)`).
    pub min_seconds: f64,
    /// Sites only (`None` for op kinds, whose bytes are a sum over nodes, not a working set): the
    /// bandwidth roof at the site's working set ([`MachineProbe::roof_at`] of its bytes), bytes/s.
    pub working_set_bandwidth: Option<f64>,
    /// Sites only: roofline class against the ridge at that roof (`peak / working_set_bandwidth`),
    /// the hierarchical roofline's class; `None` with the intensity.
    pub working_set_bound: Option<Bound>,
}

/// Place a cost on the roofline of `m`; `site`: also on the roof at its working set.
fn place<T>(cost: T, flops: Option<u64>, bytes: &Bytes, m: &MachineProbe, site: bool) -> Placed<T> {
    let b = bytes.total();
    let intensity = flops.filter(|_| b > 0).map(|f| f as f64 / b as f64);
    let mm = m.machine;
    let ws = site.then(|| m.roof_at(b));
    let ws_machine = ws.map(|bandwidth| Machine { peak_flops: mm.peak_flops, bandwidth });
    Placed {
        cost,
        intensity,
        bound: intensity.map(|i| mm.bound(i)),
        min_seconds: mm.min_time(flops.unwrap_or(0), b),
        working_set_bandwidth: ws,
        working_set_bound: ws_machine.zip(intensity).map(|(w, i)| w.bound(i)),
    }
}

/// Totals of one forward pass.
#[derive(Debug, Clone, Serialize)]
pub struct Totals {
    /// FLOPs of the nodes whose FLOPs are known.
    pub flops: u64,
    /// FLOPs of every GEMM (matmuls and attention products).
    pub gemm_flops: u64,
    /// Bytes moved.
    pub bytes: Bytes,
    /// Op kinds whose FLOPs this tool does not model (their FLOPs are not in `flops`).
    pub unmodelled: Vec<String>,
}

/// RLX's own estimate for the same graph, for comparison (`rlx_runtime::cost::estimate_graph_cost`
/// with `CpuCostModel`: per-arch constants, not measured; it counts one of attention's two GEMMs).
#[derive(Debug, Clone, Serialize)]
pub struct RlxEstimate {
    /// Estimated forward time, seconds.
    pub seconds: f64,
    /// RLX's memory bandwidth constant, bytes/s.
    pub bandwidth: f64,
    /// RLX's sgemm rate at the GEMM probe's shape, FLOP/s.
    pub gemm_flops_per_s: f64,
    /// Where RLX's numbers come from (`measured`, `arch-default`, `uncalibrated`).
    pub calibration: String,
}

/// The cost report of one graph: what `opscope cost` prints and writes as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct CostReport {
    /// Graph name.
    pub graph: String,
    /// Forward passes the corpus runs (with the graph's batch shape; a last partial batch counts as one).
    pub forwards: usize,
    /// The measured roofs.
    pub machine: MachineProbe,
    /// Per forward pass.
    pub totals: Totals,
    /// Lower bound on one forward pass's time at the measured roofs, seconds (sum over nodes).
    pub min_seconds: f64,
    /// Per op kind, by FLOPs.
    pub by_kind: Vec<Placed<KindCost>>,
    /// The `top` sites by their time lower bound.
    pub top_sites: Vec<Placed<NodeCost>>,
    /// Every costed site (node of the deployed graph), in graph order: what `opscope report`
    /// draws on its roofline and joins with a recording's sites.
    pub sites: Vec<Placed<NodeCost>>,
    /// GEMM shapes, by FLOPs.
    pub gemm_shapes: Vec<ShapeBin>,
    /// RLX's own estimate, when asked for.
    pub rlx_estimate: Option<RlxEstimate>,
}

impl CostReport {
    /// Place `cost` on the roofline of `machine`, keeping the `top` sites by time lower bound.
    pub fn new(cost: &GraphCost, machine: MachineProbe, forwards: usize, top: usize) -> CostReport {
        let m = &machine;
        let mut unmodelled: Vec<String> = cost.nodes.iter().filter(|n| n.flops.is_none()).map(|n| n.op.clone()).collect();
        unmodelled.sort();
        unmodelled.dedup();
        let by_kind: Vec<_> = cost
            .by_kind()
            .into_iter()
            .map(|k| {
                let f = (!k.flops_unknown).then_some(k.flops);
                let b = k.bytes;
                place(k, f, &b, m, false)
            })
            .collect();
        let all: Vec<_> = cost.nodes.iter().map(|n| place(n.clone(), n.flops, &n.bytes, m, true)).collect();
        let min_seconds = all.iter().map(|s| s.min_seconds).sum();
        let mut sites = all.clone();
        sites.sort_by(|a, b| b.min_seconds.total_cmp(&a.min_seconds).then(a.cost.node.cmp(&b.cost.node)));
        sites.truncate(top);
        CostReport {
            graph: cost.graph.clone(),
            forwards,
            machine,
            totals: Totals { flops: cost.flops(), gemm_flops: cost.gemm_flops(), bytes: cost.bytes(), unmodelled },
            min_seconds,
            by_kind,
            top_sites: sites,
            sites: all,
            gemm_shapes: cost.gemm_histogram(),
            rlx_estimate: None,
        }
    }

    /// Add RLX's own estimate of `graph` (the costed graph).
    pub fn with_rlx_estimate(mut self, graph: &Graph) -> CostReport {
        let model = rlx_runtime::cost::CpuCostModel::new();
        use rlx_runtime::cost::BackendCostModel;
        let n = self.machine.gemm_n.max(1024);
        self.rlx_estimate = Some(RlxEstimate {
            seconds: rlx_runtime::cost::estimate_graph_cost(graph, &model) * 1e-9,
            bandwidth: model.memory_bw() * 1e9,
            gemm_flops_per_s: model.sgemm_gflops(n, n, n) * 1e9,
            calibration: model.calibration().as_str().to_string(),
        });
        self
    }

    /// The report as text: machine, totals, per-kind table, top sites, GEMM shapes.
    pub fn text(&self) -> String {
        let m = &self.machine;
        let bound = |b: Option<Bound>| match b {
            Some(Bound::Compute) => "compute",
            Some(Bound::Memory) => "memory",
            None => "-",
        };
        let ai = |i: Option<f64>| i.map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
        let mut s = format!(
            "graph {} ({} forward pass(es) over the corpus)\nmachine (measured here through RLX): copy bandwidth {:.2} GB/s ({}), GEMM peak {:.2} GFLOP/s ({}), ridge point {:.2} FLOP/byte\n",
            self.graph,
            self.forwards,
            m.machine.bandwidth / 1e9,
            m.copy.op,
            m.machine.peak_flops / 1e9,
            m.gemm.op,
            m.ridge
        );
        if !m.streams.is_empty() {
            let rates: Vec<String> = m.streams.iter().map(|p| format!("{} {:.2}", p.op.split(' ').next().unwrap_or(""), p.rate / 1e9)).collect();
            s.push_str(&format!("streaming kernels (GB/s; the fastest is the bandwidth roof): {}\n", rates.join(", ")));
        }
        if !m.curve.is_empty() {
            let pts: Vec<String> = m.curve.iter().map(|p| format!("{} {:.1}", human_bytes(p.working_set), p.bandwidth / 1e9)).collect();
            s.push_str(&format!("bandwidth by working set (GB/s; a site's roof is the point at or below its bytes): {}\n", pts.join(", ")));
            for p in m.curve.iter().filter(|p| !p.unmeasured.is_empty()) {
                s.push_str(&format!(
                    "  note: at {} the best of the kernels that timed; left out: {}\n",
                    human_bytes(p.working_set),
                    p.unmeasured.join("; ")
                ));
            }
        }
        let t = &self.totals;
        s.push_str(&format!(
            "per forward: {:.3} GFLOP ({:.3} GFLOP in GEMMs), {:.2} MB moved (weights {:.2}, activations {:.2}, inputs {:.3}, outputs {:.3}), roofline time bound {:.3} ms\n",
            t.flops as f64 / 1e9,
            t.gemm_flops as f64 / 1e9,
            t.bytes.total() as f64 / 1e6,
            t.bytes.weights as f64 / 1e6,
            t.bytes.activations as f64 / 1e6,
            t.bytes.inputs as f64 / 1e6,
            t.bytes.outputs as f64 / 1e6,
            self.min_seconds * 1e3
        ));
        if !t.unmodelled.is_empty() {
            s.push_str(&format!("FLOPs not modelled (not counted): {}\n", t.unmodelled.join(", ")));
        }
        if let Some(r) = &self.rlx_estimate {
            s.push_str(&format!(
                "RLX's own estimate ({}): {:.3} ms per forward (its constants: {:.1} GB/s, {:.1} GFLOP/s at the probe GEMM)\n",
                r.calibration,
                r.seconds * 1e3,
                r.bandwidth / 1e9,
                r.gemm_flops_per_s / 1e9
            ));
        }
        s.push_str("\n| op kind | nodes | GFLOP | MB moved | FLOP/byte | bound | time bound ms |\n|---|---|---|---|---|---|---|\n");
        for k in &self.by_kind {
            s.push_str(&format!(
                "| {} | {} | {:.4}{} | {:.3} | {} | {} | {:.4} |\n",
                k.cost.op,
                k.cost.count,
                k.cost.flops as f64 / 1e9,
                if k.cost.flops_unknown { "+?" } else { "" },
                k.cost.bytes.total() as f64 / 1e6,
                ai(k.intensity),
                bound(k.bound),
                k.min_seconds * 1e3
            ));
        }
        s.push_str("\n| site | op | shape | GFLOP | MB moved | FLOP/byte | bound (DRAM) | roof at its bytes GB/s | bound there | time bound ms |\n|---|---|---|---|---|---|---|---|---|---|\n");
        for p in &self.top_sites {
            let c = &p.cost;
            s.push_str(&format!(
                "| {} | {} | {:?} | {} | {:.3} | {} | {} | {} | {} | {:.4} |\n",
                c.site,
                c.op,
                c.shape,
                c.flops.map(|f| format!("{:.4}", f as f64 / 1e9)).unwrap_or_else(|| "?".into()),
                c.bytes.total() as f64 / 1e6,
                ai(p.intensity),
                bound(p.bound),
                p.working_set_bandwidth.map(|b| format!("{:.1}", b / 1e9)).unwrap_or_else(|| "-".into()),
                bound(p.working_set_bound),
                p.min_seconds * 1e3
            ));
        }
        s.push_str("\n| GEMM M x K x N | batch | dtype | operand | count | GFLOP | share |\n|---|---|---|---|---|---|---|\n");
        for b in &self.gemm_shapes {
            let g = &b.shape;
            s.push_str(&format!(
                "| {} x {} x {} | {} | {} | {} | {} | {:.4} | {:.1}% |\n",
                g.m,
                g.k,
                g.n,
                g.batch,
                g.dtype,
                if g.weight { "weight" } else { "activation" },
                b.count,
                b.flops as f64 / 1e9,
                100.0 * b.share
            ));
        }
        s
    }
}

/// `48 KiB`, `1.5 MiB`: a byte count in binary units, for the curve's line.
fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

impl MachineProbe {
    /// A machine given by its roofs, without probing (for tests and what-if reports).
    pub fn given(machine: Machine) -> MachineProbe {
        let p = |op: &str, rate: f64| Probe { op: op.into(), work: 0, timing: None, rate };
        MachineProbe {
            machine,
            ridge: machine.ridge(),
            copy: p("given", machine.bandwidth),
            streams: vec![],
            gemm: p("given", machine.peak_flops),
            gemm_n: 0,
            curve: vec![],
        }
    }

    /// The bandwidth roof of an op that moves `bytes` (its working set), bytes/s: the curve's
    /// bandwidth at the largest probed working set not above `bytes` (an op cannot stream faster
    /// than one with a smaller working set: its data sits in the same or a slower level); the
    /// smallest point's for an op below every probed size (L1-resident; such ops are
    /// dispatch-bound in RLX); the DRAM bandwidth without a curve.
    pub fn roof_at(&self, bytes: u64) -> f64 {
        match self.curve.iter().take_while(|p| p.working_set <= bytes).last().or(self.curve.first()) {
            Some(p) => p.bandwidth,
            None => self.machine.bandwidth,
        }
    }
}

/// Cost of `graph` as deployed on the CPU (fused with `CompileOptions::default()`, as the lab
/// compiles models), sites named from `graph`, symbolic dims bound from `inputs`.
///
/// Errors: those of `opscope::analysis::cost::graph_cost` (empty graph, unbound dim) and of
/// binding the inputs.
pub fn deployed_cost(graph: &Graph, inputs: &[(&str, &[usize])]) -> Result<(Graph, GraphCost)> {
    let bindings = opscope::analysis::cost::Bindings::from_inputs(graph, inputs)?;
    // The source graph first: an empty graph or an unbound dim is reported before fusion sees it.
    opscope::analysis::cost::graph_cost(graph, None, &bindings)?;
    let fused = opscope::activate::fuse(graph, Device::Cpu, &CompileOptions::default());
    let cost = opscope::analysis::cost::graph_cost(&fused, Some(graph), &bindings).context("costing the deployed graph")?;
    Ok((fused, cost))
}

/// The cost report of an ONNX model imported for `[batch, seq]` (as `opscope record` imports
/// it), on the roofs measured by [`probe_machine`] with `probe`; `forwards` forward passes,
/// the `top` sites listed in `top_sites`, RLX's own estimate beside it. Token ids do not change
/// the cost, so no tokenizer or text is read.
///
/// Errors: the model does not import, or those of [`deployed_cost`] and [`probe_machine`].
pub fn model_cost(onnx: &std::path::Path, batch: usize, seq: usize, probe: &ProbeOptions, forwards: usize, top: usize) -> Result<CostReport> {
    let enc = crate::model::OnnxEncoder::load(onnx, batch, seq)?;
    let shape = [batch, seq];
    graph_cost(&enc.graph, &text_input_dims(&enc.graph, &shape), probe, forwards, top)
}

/// The bindings of a text model's symbolic `[batch, seq]` inputs to `shape`, for
/// [`deployed_cost`] and `opscope::analysis::cost::Bindings`. Only symbolic rank-2 inputs are
/// bound: the importer fixes `[batch, seq]`, and a model's `[1, seq]` position ids stay as declared.
pub fn text_input_dims<'a>(graph: &'a Graph, shape: &'a [usize; 2]) -> Vec<(&'a str, &'a [usize])> {
    graph
        .nodes()
        .iter()
        .filter_map(|n| match &n.op {
            rlx_ir::Op::Input { name } if n.shape.rank() == 2 && n.shape.dims().iter().any(|d| !d.is_static()) => Some((name.as_str(), &shape[..])),
            _ => None,
        })
        .collect()
}

/// [`model_cost`] for a graph already built (e.g. the SmolLM2 prefill graph), `inputs` binding
/// its symbolic input dims as [`deployed_cost`] does.
///
/// Errors: as [`deployed_cost`] and [`probe_machine`].
pub fn graph_cost(graph: &Graph, inputs: &[(&str, &[usize])], probe: &ProbeOptions, forwards: usize, top: usize) -> Result<CostReport> {
    let (fused, graph_cost) = deployed_cost(graph, inputs)?;
    let machine = probe_machine(probe)?;
    Ok(CostReport::new(&graph_cost, machine, forwards, top).with_rlx_estimate(&fused))
}
