//! Activation: a scope around unchanged code ([`Scope`], built on `rlx_runtime::taps`), the
//! environment (`RLX_OPSCOPE`, read at the first compile by wrappers of every registered
//! device's backend, installed at load time: [`env`]), RLX's IR-pass registry for actuations (`RLX_OPSCOPE_IR`: [`ir`]), or direct
//! ([`Pipeline::apply`]). All of them rewrite through [`rewrite`].

pub mod env;
pub mod ir;
mod once;
mod scope;

use std::sync::Arc;

use rlx_ir::{Graph, Op};

use crate::error::Error;
use crate::manifest::Manifest;
use crate::pipeline::Pipeline;
use crate::record::Recorder;
use crate::sketch::{is_sketch_op, sample::GATE_PREFIX};

pub use once::compiles_fused_once;
pub(crate) use once::{for_backend, forget_fused, mark_fused, take_fused};
pub use scope::{scope, Scope, Summary};

/// True if a graph already carries opscope sketches, native or lowered (never tap twice: a
/// scope's tap and the environment mode's wrapper can both see one compile).
fn already_tapped(g: &Graph) -> bool {
    g.nodes().iter().any(|n| {
        matches!(&n.op, Op::Custom { name, .. } if is_sketch_op(name))
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
            pipeline.apply_owned(fused, Some(graph), tag, device).map(|(g, m, _)| (g, m, Some(nodes)))
        }
        Stage::Source => pipeline.apply_on(graph, None, tag, device).map(|(g, m)| (g, m, None)),
    }
}

/// True for a node a tap appends for the native kernel: a sketch or a sampling gate
/// (custom ops RLX's fusion and legalization copy unchanged: none declares a decomposition), or
/// one of the taps' two helpers, standard ops the CPU backend runs as they are: the attention
/// mask's F32 cast (`Rewrite::row_mask`) and the matmul tap's `[B, S, C]` view of a flattened
/// activation. `tests/fused_once.rs` checks that a graph with both records the same rows fused
/// once as fused twice.
fn is_native_tap_node(n: &rlx_ir::Node) -> bool {
    let name = n.name.as_deref().unwrap_or("");
    match &n.op {
        Op::Custom { name, .. } => is_sketch_op(name) || name.starts_with(GATE_PREFIX),
        Op::Cast { to: rlx_ir::DType::F32 } => name == crate::rewrite::MASK_CAST,
        Op::Reshape { .. } => name.starts_with(crate::rewrite::SEQ_VIEW),
        _ => false,
    }
}

/// What [`tap_graph`] hands to the compile.
pub(crate) struct Tapped {
    /// The graph to compile.
    pub graph: Graph,
    /// The manifest of its appended outputs; `None` when nothing was appended.
    pub manifest: Option<Arc<Manifest>>,
    /// `graph` is RLX's fused program for the compile's device and options with only the nodes
    /// of native taps added (no actuation, no lowered sketch): the backend can plan it
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
                    && fused_nodes.is_some_and(|n| tapped.nodes().iter().filter(|x| !is_native_tap_node(x)).count() == n);
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
