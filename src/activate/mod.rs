//! Activation: a scope around unchanged code ([`Scope`], built on `rlx_runtime::taps`), the
//! environment (`RLX_OPSCOPE`, read at the first compile by wrappers of every registered
//! device's backend, installed at load time: [`env`]), RLX's IR-pass registry for actuations (`RLX_OPSCOPE_IR`: [`ir`]), or direct
//! ([`Pipeline::apply`]). All of them rewrite through [`rewrite`].

pub mod env;
pub mod ir;
mod scope;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rlx_ir::{Graph, NodeId, Op};

use crate::error::Error;
use crate::manifest::Manifest;
use crate::pipeline::Pipeline;
use crate::record::Recorder;
use crate::sketch::{is_sketch_op, sample::GATE_PREFIX, KEEP_OP};

pub use scope::{scope, Scope, Summary};

/// True if a graph already carries opscope sketches, native or lowered (never tap twice: a
/// scope's tap and the environment mode's wrapper can both see one compile).
pub(crate) fn already_tapped(g: &Graph) -> bool {
    g.nodes().iter().any(|n| {
        matches!(&n.op, Op::Custom { name, .. } if is_sketch_op(name) || name == KEEP_OP)
            || n.name.as_deref().is_some_and(|s| s.starts_with("opscope/") && s.ends_with("/lowered"))
    })
}

/// Which program a tap observes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stage {
    /// The program that runs: the graph after RLX's fusion pipeline for the device (matmul +
    /// bias + activation fused, Q/K/V projections merged, ...). Taps are appended to the fused
    /// graph, so the same kernels run and the caller's outputs are bit-identical. Site names
    /// are recovered from the source graph through the weights each site consumes.
    #[default]
    Deployed,
    /// The graph as the program built it, before fusion. A tap on a matmul output adds a
    /// consumer, which can stop RLX from fusing it (matmul + bias + GELU): outputs may then
    /// differ from the untapped run in the last bits.
    Source,
}

impl std::str::FromStr for Stage {
    type Err = String;
    fn from_str(s: &str) -> Result<Stage, String> {
        match s {
            "deployed" => Ok(Stage::Deployed),
            "source" => Ok(Stage::Source),
            _ => Err(format!("unknown stage '{s}': expected deployed or source")),
        }
    }
}

/// The fused graph `Session::compile` would run for `graph` on `device` with `options`.
/// Compiling it again changes nothing (RLX's fusion is idempotent on its own output).
pub fn fuse(graph: &Graph, device: rlx_runtime::Device, options: &rlx_runtime::CompileOptions) -> Graph {
    rlx_runtime::stages::pipeline_for(device, options)
        .optimize(rlx_ir::MirModule::from_graph(graph.clone()))
        .into_graph()
}

/// Apply `pipeline` to the program `stage` observes of `graph`: the graph fused as a CPU compile
/// with `options` would fuse it (site names recovered from `graph`), or `graph` as given. `tag`
/// is written into every sketch ([`Pipeline::apply_tagged`]). A dry run of this shows what a
/// recording would tap, or fails as the recording would.
///
/// Errors: a pass fails on this graph (a `skip` block that does not exist).
pub fn rewrite(
    pipeline: &Pipeline,
    graph: &Graph,
    stage: Stage,
    options: &rlx_runtime::CompileOptions,
    tag: u32,
) -> Result<(Graph, Manifest), Error> {
    rewrite_on(pipeline, graph, stage, rlx_runtime::Device::Cpu, options, tag)
}

/// [`rewrite`] for a compile on `device`: the deployed program is the graph as RLX's stage
/// pipeline fuses it for that device, and the sketches are lowered into RLX primitive ops where
/// the device has no native sketch kernel ([`Pipeline::apply_on`]).
///
/// Errors: as [`rewrite`].
pub fn rewrite_on(
    pipeline: &Pipeline,
    graph: &Graph,
    stage: Stage,
    device: rlx_runtime::Device,
    options: &rlx_runtime::CompileOptions,
    tag: u32,
) -> Result<(Graph, Manifest), Error> {
    rewrite_counted(pipeline, graph, stage, device, options, tag).map(|(g, m, _)| (g, m))
}

/// [`rewrite_on`], with the node count of the fused graph the pipeline was applied to (`None`
/// for [`Stage::Source`]).
fn rewrite_counted(
    pipeline: &Pipeline,
    graph: &Graph,
    stage: Stage,
    device: rlx_runtime::Device,
    options: &rlx_runtime::CompileOptions,
    tag: u32,
) -> Result<(Graph, Manifest, Option<usize>), Error> {
    match stage {
        Stage::Deployed => {
            let fused = fuse(graph, device, options);
            let nodes = fused.len();
            pipeline.apply_on(&fused, Some(graph), tag, device).map(|(g, m)| (g, m, Some(nodes)))
        }
        Stage::Source => pipeline.apply_on(graph, None, tag, device).map(|(g, m)| (g, m, None)),
    }
}

/// True for an op a tap appends natively: a sketch, `keep` or a sampling gate. RLX's fusion and
/// legalization copy these custom ops unchanged (none declares a decomposition).
fn is_native_tap_op(op: &Op) -> bool {
    matches!(op, Op::Custom { name, .. } if is_sketch_op(name) || name == KEEP_OP || name.starts_with(GATE_PREFIX))
}

/// What [`tap_graph`] hands to the compile.
pub(crate) struct Tapped {
    /// The graph to compile.
    pub graph: Graph,
    /// The manifest of its appended outputs; `None` when nothing was appended.
    pub manifest: Option<Arc<Manifest>>,
    /// `graph` is RLX's fused program for the compile's device and options with only native
    /// tap ops added (no actuation, no lowered sketch, no helper node): the backend can plan it
    /// as it is ([`for_backend`]) instead of running the fusion pipeline over it a second time.
    pub fused: bool,
}

/// The graph to compile and the manifest of its appended outputs; the graph unchanged when the
/// pipeline neither appended nor actuated anything, or failed (the failure goes to the
/// recorder).
pub(crate) fn tap_graph(
    pipeline: &Pipeline,
    recorder: &Recorder,
    graph: Graph,
    stage: Stage,
    device: rlx_runtime::Device,
    options: &rlx_runtime::CompileOptions,
) -> Tapped {
    let untouched = |graph| Tapped { graph, manifest: None, fused: false };
    if already_tapped(&graph) {
        return untouched(graph);
    }
    let tag = recorder.next_tag();
    match rewrite_counted(pipeline, &graph, stage, device, options, tag) {
        Ok((tapped, manifest, fused_nodes)) => {
            let appended = manifest.outputs.iter().any(|o| o.output_index.is_some());
            let actuated = !manifest.actuations.is_empty();
            let m = recorder.register(manifest);
            if appended {
                // Only native tap ops added to the fused graph: every other node is one of it.
                let fused = !actuated
                    && fused_nodes.is_some_and(|n| tapped.nodes().iter().filter(|x| !is_native_tap_op(&x.op)).count() == n);
                Tapped { graph: tapped, manifest: Some(m), fused }
            } else if actuated {
                // An actuation changed the program and nothing was appended: compile the
                // changed graph, with no extra outputs to record.
                untouched(tapped)
            } else {
                // Nothing appended (no site, or only zero-size tensors): compile the caller's
                // graph untouched; zero-size entries have no outputs to wait for.
                untouched(graph)
            }
        }
        Err(e) => {
            recorder.fail(e);
            untouched(graph)
        }
    }
}

/// Compiles whose tapped graph reached the backend planned ([`for_backend`]), fused once, since the
/// process started.
static PLANNED: AtomicU64 = AtomicU64::new(0);

/// How many tapped compiles reached the backend fused once: the tap fuses the caller's graph to
/// find the program that runs, appends its sketches, and the backend plans that graph without
/// running RLX's fusion pipeline over it again. A compile that does not qualify (a
/// [`Stage::Source`] tap, an actuation, a lowered sketch or a helper node such as the
/// attention mask's cast, a symbolic dim, a scope compiling with options that fuse otherwise
/// than `CompileOptions::new()`, options asking for RLX's fusion diagnostics, a backend other
/// than opscope's CPU wrapper) is fused a second time, as RLX compiles any graph. Counted since the process started, for tests and the
/// compile benchmark.
pub fn compiles_fused_once() -> u64 {
    PLANNED.load(Ordering::Relaxed)
}

/// True if a compile with `options` asks for the diagnostics RLX's fusion pipeline gives (the
/// fusion contract of `assert_fusion_clean`, which panics on a missed fusion; the before and
/// after report of `fusion_report`; `lint_numerics`): such a compile is fused again, so that
/// they run on it as on the untapped compile.
fn wants_fusion_diagnostics(options: &rlx_runtime::CompileOptions) -> bool {
    options.assert_fusion_clean || options.fusion_report || options.lint_numerics
}

/// The module to hand a backend for `graph`: when [`tap_graph`] marked it `fused` and the
/// compile does not ask for fusion diagnostics, the graph with the buffer plan RLX's compile
/// pipeline for `device` and `options` gives it after fusion (`CompilePipeline::plan_lir`, what
/// `compile_module` does after `optimize`), so that the backend compiles it without fusing again
/// (RLX's `compile_module` takes an LIR module as planned; `RLX_FUSION_REPORT=1` prints RLX's
/// scan of the graph, as its own compile would); else the graph, for RLX to fuse.
pub(crate) fn for_backend(graph: Graph, fused: bool, device: rlx_runtime::Device, options: &rlx_runtime::CompileOptions) -> rlx_ir::GraphModule {
    if !fused || wants_fusion_diagnostics(options) {
        return rlx_ir::GraphModule::from_graph(graph);
    }
    let lir = rlx_runtime::stages::pipeline_for(device, options).plan_lir(rlx_ir::MirModule::from_graph(graph));
    if rlx_ir::env::flag("RLX_FUSION_REPORT") {
        rlx_runtime::stages::maybe_log_fusion(&rlx_fusion::FusionReport::scan(lir.as_graph()));
    }
    PLANNED.fetch_add(1, Ordering::Relaxed);
    rlx_ir::GraphModule::from_lir(lir)
}

/// The settings of `options` that RLX's fusion pipeline reads (`rlx_runtime::stages::pipeline_for`
/// and the pipeline's `optimize`), as text: two options with the same key fuse a graph alike.
fn fusion_key(options: &rlx_runtime::CompileOptions) -> String {
    format!(
        "{:?}",
        (
            options.fusion_target,
            options.fusion_opts,
            options.supported_ops,
            options.kernel_dispatch,
            options.disable_conv_bias_act_fusion,
            options.no_io_peaks_output,
        )
    )
}

/// A graph a scope's tap returned fused ([`Tapped::fused`]), as the backend wrapper will see it
/// in the same `Session::compile` on the same thread.
struct FusedMark {
    device: rlx_runtime::Device,
    name: String,
    nodes: usize,
    outputs: Vec<NodeId>,
    /// [`fusion_key`] of the options the tap fused with.
    fusion: String,
}

thread_local! {
    /// The last graph this thread's scope tap returned fused (RLX's tap scopes are per thread,
    /// and `Session::compile` compiles the graph the tap returns on the calling thread).
    static FUSED: RefCell<Option<FusedMark>> = const { RefCell::new(None) };
}

/// Called by a scope's tap for each graph it returns: remember it when it is `fused` (fused
/// with `options` for `device`), else forget any earlier one. A graph with a symbolic dim is
/// not remembered: `Session::compile` defers its compile to the first run, where RLX binds the
/// dims and compiles the bound graph, which it must fuse (RLX's fusion decides some fusions by
/// shape, such as the attention block's `RLX_FUSE_ATTN_THRESHOLD`).
pub(crate) fn mark_fused(graph: &Graph, fused: bool, device: rlx_runtime::Device, options: &rlx_runtime::CompileOptions) {
    let mark = (fused && !rlx_ir::dynamic::has_dynamic_dims(graph)).then(|| FusedMark {
        device,
        name: graph.name.clone(),
        nodes: graph.len(),
        outputs: graph.outputs.clone(),
        fusion: fusion_key(options),
    });
    FUSED.with(|f| *f.borrow_mut() = mark);
}

/// Forget this thread's mark: called when a scope ends (normally or by a panic), so that a
/// graph whose compile never reached the wrapper (it panicked, and the panic was caught) is not
/// planned by a compile after the scope.
pub(crate) fn forget_fused() {
    FUSED.with(|f| f.borrow_mut().take());
}

/// Called by the backend wrapper at each compile: true if `graph` is the one this thread's scope
/// tap last marked (same device, name, node count and outputs) and the compile's `options` fuse
/// as the tap fused it. The mark is taken either way: it stands for one compile.
pub(crate) fn take_fused(graph: &Graph, device: rlx_runtime::Device, options: &rlx_runtime::CompileOptions) -> bool {
    FUSED.with(|f| f.borrow_mut().take()).is_some_and(|m| {
        m.device == device && m.name == graph.name && m.nodes == graph.len() && m.outputs == graph.outputs && m.fusion == fusion_key(options)
    })
}
