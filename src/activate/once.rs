//! Fusing a tapped compile once. A deployed-stage tap fuses the caller's graph with RLX's
//! pipeline to find the program that runs and appends its sketches there; RLX would then run its
//! fusion pipeline over the tapped graph a second time (a third of a tapped compile's extra time
//! on the chain MLP at L=64, by `perf`). When the tapped graph is RLX's fused program with only
//! the nodes of native taps added ([`super::Tapped::fused`]), opscope's backend wrapper hands RLX
//! the graph planned instead ([`for_backend`]). The environment mode knows this in the wrapper
//! itself; a scope's tap runs in RLX's compile tap, before the wrapper, and leaves a per-thread
//! mark ([`mark_fused`]) that the wrapper takes at the next compile ([`take_fused`]).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use rlx_ir::{Graph, NodeId};

/// Compiles whose tapped graph reached the backend planned ([`for_backend`]), fused once, since
/// the process started.
static PLANNED: AtomicU64 = AtomicU64::new(0);

/// How many tapped compiles reached the backend fused once: the tap fuses the caller's graph to
/// find the program that runs, appends its sketches, and the backend plans that graph without
/// running RLX's fusion pipeline over it again. A compile that does not qualify (a
/// [`super::Stage::Source`] tap, an actuation, a lowered sketch, a symbolic dim, a scope
/// compiling with options that fuse otherwise than `CompileOptions::new()`, options asking for
/// RLX's fusion diagnostics, a backend other than opscope's CPU wrapper) is fused a second
/// time, as RLX compiles any graph. Counted since the process started, for tests and the
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

/// The module to hand a backend for `graph`: when [`super::tap_graph`] marked it `fused` and the
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

/// A graph a scope's tap returned fused ([`super::Tapped::fused`]), as the backend wrapper will see it
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
