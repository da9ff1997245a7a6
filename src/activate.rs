//! Activation: a scope around unchanged code (built on `rlx_runtime::taps`), the environment
//! (`RLX_OPSCOPE`, through a wrapper of the CPU backend installed at load time), or direct
//! (`Pipeline::apply`).

use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use rlx_ir::{DType, Graph, Op};
use rlx_runtime::taps::{self, GraphTap};

use crate::error::Error;
use crate::manifest::Manifest;
use crate::pipeline::Pipeline;
use crate::record::{new_run_id, Recorder};
use crate::sink::Sink;
use crate::sketch::{is_sketch_op, KEEP_OP};

/// True if a graph already carries opscope sketches (never tap twice).
fn already_tapped(g: &Graph) -> bool {
    g.nodes()
        .iter()
        .any(|n| matches!(&n.op, Op::Custom { name, .. } if is_sketch_op(name) || name == KEEP_OP))
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

/// Apply `pipeline` to a graph about to be compiled; on success register the manifest.
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
    match stage {
        Stage::Deployed => {
            let fused = fuse(graph, rlx_runtime::Device::Cpu, options);
            pipeline.apply_tagged(&fused, Some(graph), tag)
        }
        Stage::Source => pipeline.apply_tagged(graph, None, tag),
    }
}

/// Returns the graph to compile and the manifest of its appended outputs; the graph unchanged
/// when the pipeline neither appended nor actuated anything, or failed (the failure goes to the
/// recorder).
fn tap_graph(
    pipeline: &Pipeline,
    recorder: &Recorder,
    graph: Graph,
    stage: Stage,
    options: &rlx_runtime::CompileOptions,
) -> (Graph, Option<Arc<Manifest>>) {
    if already_tapped(&graph) {
        return (graph, None);
    }
    let tag = recorder.next_tag();
    match rewrite(pipeline, &graph, stage, options, tag) {
        Ok((tapped, manifest)) => {
            let appended = manifest.outputs.iter().any(|o| o.output_index.is_some());
            let actuated = !manifest.actuations.is_empty();
            let m = recorder.register(manifest);
            if appended {
                (tapped, Some(m))
            } else if actuated {
                // An actuation changed the program and nothing was appended: compile the
                // changed graph, with no extra outputs to record.
                (tapped, None)
            } else {
                // Nothing appended (no site, or only zero-size tensors): compile the caller's
                // graph untouched; zero-size entries have no outputs to wait for.
                (graph, None)
            }
        }
        Err(e) => {
            recorder.fail(e);
            (graph, None)
        }
    }
}

struct ScopeTap {
    pipeline: Pipeline,
    recorder: Arc<Recorder>,
    stage: Stage,
}

impl GraphTap for ScopeTap {
    fn on_compile(&self, graph: Graph) -> (Graph, usize) {
        // A tap is not told the caller's CompileOptions: fuse with the session defaults
        // (`CompileOptions::new()`, `RLX_*` overrides applied), which is what
        // `Session::compile` and `compile_with(CompileOptions::default())` use.
        let options = rlx_runtime::CompileOptions::new();
        let (g, m) = tap_graph(&self.pipeline, &self.recorder, graph, self.stage, &options);
        let n = m.map_or(0, |m| m.outputs.iter().filter(|o| o.output_index.is_some()).count());
        (g, n)
    }

    fn on_outputs(&self, extra: Vec<(Vec<u8>, DType)>) {
        let outs: Vec<Vec<f32>> = extra.iter().map(|(b, d)| taps::to_f32(b, *d)).collect();
        self.recorder.record_tagged(outs);
    }
}

/// Run `f` with every graph it compiles through `Session::compile` / `compile_with` tapped by
/// `pipeline`, recording to `sink`. The caller's outputs are unchanged (same count,
/// bit-identical values); tap outputs are stripped by RLX and recorded.
///
/// Runs of a tapped graph are recorded only while inside the scope (RLX reports extras to the
/// tap current at run time). Scopes are per thread.
///
/// Errors: the first recording error (pipeline failure on a graph, I/O error of the sink,
/// outputs not matching a manifest). `f`'s value is returned only when recording succeeded;
/// use [`scope_with_result`] to get both.
pub fn scope<T>(pipeline: &Pipeline, sink: Box<dyn Sink>, f: impl FnOnce() -> T) -> Result<T, Error> {
    let (value, res) = scope_with_result(pipeline, sink, f);
    res.map(|_| value)
}

/// Like [`scope`], returning `f`'s value and the recording result separately.
pub fn scope_with_result<T>(
    pipeline: &Pipeline,
    sink: Box<dyn Sink>,
    f: impl FnOnce() -> T,
) -> (T, Result<(), Error>) {
    scope_at(pipeline, Stage::Deployed, sink, f)
}

/// Like [`scope_with_result`], observing the program at `stage`.
pub fn scope_at<T>(
    pipeline: &Pipeline,
    stage: Stage,
    sink: Box<dyn Sink>,
    f: impl FnOnce() -> T,
) -> (T, Result<(), Error>) {
    crate::sketch::register();
    let recorder = Arc::new(Recorder::new(sink, new_run_id()));
    let tap = Rc::new(ScopeTap {
        pipeline: pipeline.clone(),
        recorder: recorder.clone(),
        stage,
    });
    let value = taps::with_tap(tap, f);
    (value, recorder.finish())
}

// ---------------------------------------------------------------------------------------------
// Environment activation.

/// Environment variable holding the pipeline text.
pub const ENV_PIPELINE: &str = "RLX_OPSCOPE";
/// Environment variable holding the recording path (default `opscope-recording.csv`).
pub const ENV_OUT: &str = "RLX_OPSCOPE_OUT";
/// Environment variable selecting the observed program: `deployed` (default) or `source`.
pub const ENV_STAGE: &str = "RLX_OPSCOPE_STAGE";

struct EnvState {
    pipeline: Pipeline,
    recorder: Arc<Recorder>,
    stage: Stage,
}

static ENV: OnceLock<Result<EnvState, String>> = OnceLock::new();

/// The pipeline text of `RLX_OPSCOPE`, `None` when unset or empty (opscope is then inert).
fn env_text() -> Option<String> {
    std::env::var(ENV_PIPELINE).ok().filter(|t| !t.trim().is_empty())
}

/// Parse `RLX_OPSCOPE` once, at the first compile (not at load time: the pass registry is
/// filled by load-time constructors too, in no guaranteed order).
fn env_state() -> Option<&'static Result<EnvState, String>> {
    let text = env_text()?;
    Some(ENV.get_or_init(|| {
        let pipeline = Pipeline::parse(&text).map_err(|e| format!("{ENV_PIPELINE}: {e}"))?;
        let stage = match std::env::var(ENV_STAGE) {
            Ok(s) => s.parse::<Stage>().map_err(|e| format!("{ENV_STAGE}: {e}"))?,
            Err(_) => Stage::Deployed,
        };
        let out = std::env::var(ENV_OUT).unwrap_or_else(|_| "opscope-recording.csv".into());
        let sink = crate::sink::create(&out).map_err(|e| format!("{ENV_OUT}: {e}"))?;
        Ok(EnvState {
            pipeline,
            recorder: Arc::new(Recorder::new(sink, new_run_id())),
            stage,
        })
    }))
}

/// Activate from the environment: if `RLX_OPSCOPE` is set, install the tapping CPU backend.
/// Runs at load time in any program that links opscope (`use opscope as _;`); calling it again
/// is harmless. Returns whether opscope is active.
pub fn init_from_env() -> bool {
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(|| {
        if env_text().is_none() {
            return false;
        }
        crate::sketch::register();
        rlx_runtime::register_backend(rlx_runtime::Device::Cpu, || Box::new(env_backend::TappingCpu));
        true
    })
}

/// Finish the environment recording (rename it into place, write the sidecar). Runs at exit;
/// calling it earlier ends the recording.
pub fn finish_env() -> Result<(), Error> {
    match ENV.get() {
        Some(Ok(st)) => st.recorder.finish(),
        _ => Ok(()),
    }
}

#[ctor::ctor]
fn opscope_load() {
    init_from_env();
}

#[ctor::dtor]
fn opscope_exit() {
    if let Err(e) = finish_env() {
        eprintln!("opscope: recording failed: {e}");
    }
}

mod env_backend {
    //! A CPU backend that taps every MIR compile and strips the tap outputs from every run.
    //! Every `ExecutableGraph` method is forwarded, so the wrapper is transparent.

    use std::sync::Arc;

    use rlx_runtime::backend::cpu_backend::CpuBackend;
    use rlx_runtime::backend::{Backend, ExecutableGraph};
    use rlx_runtime::CompileOptions;

    use super::{env_state, tap_graph};
    use crate::manifest::Manifest;
    use crate::record::Recorder;

    pub(super) struct TappingCpu;

    impl TappingCpu {
        fn wrap(
            exec: Box<dyn ExecutableGraph>,
            tapped: Option<(Arc<Manifest>, Arc<Recorder>)>,
        ) -> Box<dyn ExecutableGraph> {
            match tapped {
                None => exec,
                Some((manifest, recorder)) => Box::new(Tapped {
                    extra: manifest.outputs.iter().filter(|o| o.output_index.is_some()).count(),
                    inner: exec,
                    manifest,
                    recorder,
                    slots: Vec::new(),
                }),
            }
        }

        fn tap(
            &self,
            graph: rlx_ir::Graph,
            options: &CompileOptions,
        ) -> (rlx_ir::Graph, Option<(Arc<Manifest>, Arc<Recorder>)>) {
            match env_state() {
                Some(Ok(st)) => {
                    // The backend is given the caller's options: fuse exactly as the compile will.
                    let (g, m) = tap_graph(&st.pipeline, &st.recorder, graph, st.stage, options);
                    (g, m.map(|m| (m, st.recorder.clone())))
                }
                Some(Err(msg)) => {
                    // A bad RLX_OPSCOPE stops the program at its first compile, with the
                    // parse error and no panic trace.
                    eprintln!("{msg}");
                    std::process::exit(2);
                }
                None => (graph, None),
            }
        }
    }

    impl Backend for TappingCpu {
        fn compile(&self, graph: rlx_ir::Graph, options: &CompileOptions) -> Box<dyn ExecutableGraph> {
            CpuBackend.compile(graph, options)
        }

        fn compile_module(
            &self,
            module: rlx_ir::GraphModule,
            device: rlx_runtime::Device,
            options: &CompileOptions,
        ) -> Result<Box<dyn ExecutableGraph>, rlx_ir::hir::LowerError> {
            let Some(graph) = module.as_graph().cloned() else {
                return CpuBackend.compile_module(module, device, options);
            };
            let (graph, tapped) = self.tap(graph, options);
            let exec = CpuBackend.compile_module(rlx_ir::GraphModule::from_graph(graph), device, options)?;
            Ok(Self::wrap(exec, tapped))
        }

        fn supported_ops(&self) -> &'static [rlx_ir::OpKind] {
            CpuBackend.supported_ops()
        }
    }

    struct Tapped {
        inner: Box<dyn ExecutableGraph>,
        extra: usize,
        manifest: Arc<Manifest>,
        recorder: Arc<Recorder>,
        slots: Vec<(usize, usize)>,
    }

    impl Tapped {
        /// Record the trailing `extra` outputs and return the caller's.
        fn strip<T>(&self, mut outs: Vec<T>, to_f32: impl Fn(&T) -> Vec<f32>) -> Vec<T> {
            if outs.len() >= self.extra {
                let tail = outs.split_off(outs.len() - self.extra);
                self.recorder.record(&self.manifest, tail.iter().map(to_f32).collect());
            }
            outs
        }
    }

    impl ExecutableGraph for Tapped {
        fn capabilities(&self) -> rlx_runtime::ExecutableCapabilities { self.inner.capabilities() }
        fn set_param(&mut self, name: &str, data: &[f32]) { self.inner.set_param(name, data) }
        fn set_param_range(&mut self, name: &str, byte_offset: usize, data: &[u8]) -> bool { self.inner.set_param_range(name, byte_offset, data) }
        fn finalize_params(&mut self) { self.inner.finalize_params() }
        fn clone_box(&self) -> Box<dyn ExecutableGraph> {
            Box::new(Tapped {
                inner: self.inner.clone_box(),
                extra: self.extra,
                manifest: self.manifest.clone(),
                recorder: self.recorder.clone(),
                slots: Vec::new(),
            })
        }
        fn run(&mut self, inputs: &[(&str, &[f32])]) -> Vec<Vec<f32>> {
            let outs = self.inner.run(inputs);
            self.strip(outs, |v| v.clone())
        }
        fn run_read_outputs(&mut self, inputs: &[(&str, &[f32])], read_indices: Option<&[usize]>) -> Vec<Vec<f32>> {
            // Run everything so the sketches are recorded, then pick the caller's indices.
            let all = self.run(inputs);
            match read_indices {
                None => all,
                Some(ix) => ix.iter().filter_map(|&i| all.get(i).cloned()).collect(),
            }
        }
        fn optimizer_step_resident(&mut self, trainable: &[(String, Vec<usize>)], step: &mut dyn FnMut(&str, &[usize], &mut [f32], &[f32])) -> bool { self.inner.optimizer_step_resident(trainable, step) }
        fn run_raw(&mut self, inputs: &[(&str, &[f32])]) -> Vec<(*const f32, usize)> {
            let raw = self.inner.run_raw(inputs);
            // SAFETY: the backend's run_raw returns pointers into its arena that stay valid
            // until the next run; the tap outputs are copied right away.
            self.strip(raw, |&(p, n)| unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
        }
        fn run_slots(&mut self, inputs: &[&[f32]]) -> &[(usize, usize)] {
            let slots = self.inner.run_slots(inputs).to_vec();
            let arena = self.inner.arena_ptr();
            self.slots = if slots.len() >= self.extra && !arena.is_null() {
                // (byte offset, f32 length) pairs into the arena, valid until the next run;
                // an output without a buffer has offset usize::MAX.
                self.strip(slots, |&(o, l)| {
                    if o == usize::MAX {
                        Vec::new()
                    } else {
                        // SAFETY: `o` is a byte offset of an f32 output inside the arena
                        // (`CpuExecutable::run_slots`), `l` its element count.
                        unsafe { std::slice::from_raw_parts(arena.add(o).cast::<f32>(), l) }.to_vec()
                    }
                })
            } else {
                slots
            };
            &self.slots
        }
        fn arena_ptr(&self) -> *const u8 { self.inner.arena_ptr() }
        fn set_active_extent(&mut self, extent: Option<(usize, usize)>) { self.inner.set_active_extent(extent) }
        fn release_scratch(&mut self) { self.inner.release_scratch() }
        fn set_rng(&mut self, rng: rlx_ir::RngOptions) { self.inner.set_rng(rng) }
        fn rng(&self) -> rlx_ir::RngOptions { self.inner.rng() }
        fn set_moe_resident_experts(&mut self, mask: &[bool]) { self.inner.set_moe_resident_experts(mask) }
        fn set_moe_resident_experts_per_layer(&mut self, masks: &[&[bool]]) { self.inner.set_moe_resident_experts_per_layer(masks) }
        fn enable_moe_topk_capture(&mut self, num_experts: usize) -> bool { self.inner.enable_moe_topk_capture(num_experts) }
        fn take_moe_topk_capture(&mut self) -> Option<Vec<Vec<u32>>> { self.inner.take_moe_topk_capture() }
        fn take_moe_residency_stats(&mut self) -> Option<rlx_runtime::MoeResidencyStats> { self.inner.take_moe_residency_stats() }
        fn bind_handle(&mut self, name: &str, data: &[f32]) -> bool { self.inner.bind_handle(name, data) }
        fn read_handle(&self, name: &str) -> Option<Vec<f32>> { self.inner.read_handle(name) }
        fn bind_gpu_handle(&mut self, name: &str, data: &[f32]) -> bool { self.inner.bind_gpu_handle(name, data) }
        fn has_gpu_handle(&self, name: &str) -> bool { self.inner.has_gpu_handle(name) }
        fn set_gpu_handle_feed(&mut self, handle_name: &str, output_index: usize) -> bool { self.inner.set_gpu_handle_feed(handle_name, output_index) }
        fn read_gpu_handle(&self, name: &str) -> Option<Vec<f32>> { self.inner.read_gpu_handle(name) }
        fn save_inputs(&mut self, names: &[&str]) -> bool { self.inner.save_inputs(names) }
        fn restore_inputs(&mut self) -> bool { self.inner.restore_inputs() }
        fn read_gpu_handle_row(&self, name: &str, row: usize, row_inner: usize) -> Option<Vec<f32>> { self.inner.read_gpu_handle_row(name, row, row_inner) }
        fn register_kv_row_feed(&mut self, handle_name: &str, output_index: usize) -> bool { self.inner.register_kv_row_feed(handle_name, output_index) }
        fn feed_kv_row(&mut self, src_row: usize, dst_row: usize, row_elems: usize) -> bool { self.inner.feed_kv_row(src_row, dst_row, row_elems) }
        fn feed_kv_batch_major(&mut self, dst_row: usize, batch: usize, seq_cap: usize, row_elems: usize) -> bool { self.inner.feed_kv_batch_major(dst_row, batch, seq_cap, row_elems) }
        fn feed_kv_batch_major_src(&mut self, src_row: usize, src_seq_cap: usize, dst_row: usize, batch: usize, dst_seq_cap: usize, row_elems: usize) -> bool { self.inner.feed_kv_batch_major_src(src_row, src_seq_cap, dst_row, batch, dst_seq_cap, row_elems) }
        fn feed_kv_batch_major_ragged(&mut self, src_row: usize, src_seq_cap: usize, dst_rows: &[usize], dst_seq_cap: usize, row_elems: usize) -> bool { self.inner.feed_kv_batch_major_ragged(src_row, src_seq_cap, dst_rows, dst_seq_cap, row_elems) }
        fn prepare_resident_gpu_handle(&mut self, name: &str) -> bool { self.inner.prepare_resident_gpu_handle(name) }
        fn stage_bound_gpu_handles_to_arena(&mut self) { self.inner.stage_bound_gpu_handles_to_arena() }
        fn seed_resident_kv_prefix_from(&mut self, src: &dyn ExecutableGraph, prefix_tokens: usize, outgoing_upper: usize, kv_dim: usize, n_layers: usize) -> bool { self.inner.seed_resident_kv_prefix_from(src, prefix_tokens, outgoing_upper, kv_dim, n_layers) }
        fn copy_resident_kv_rows_from(&mut self, src: &dyn ExecutableGraph, from_row: usize, to_row: usize, outgoing_upper: usize, kv_dim: usize, n_layers: usize) -> bool { self.inner.copy_resident_kv_rows_from(src, from_row, to_row, outgoing_upper, kv_dim, n_layers) }
        fn copy_params_from(&mut self, src: &dyn ExecutableGraph) -> bool { self.inner.copy_params_from(src) }
        fn share_params_from(&mut self, src: &dyn ExecutableGraph) -> bool { self.inner.share_params_from(src) }
        fn param_already_set(&self, name: &str) -> bool { self.inner.param_already_set(name) }
        fn executable_as_any(&self) -> Option<&dyn std::any::Any> { self.inner.executable_as_any() }
        fn executable_as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> { self.inner.executable_as_any_mut() }
        fn read_output_row(&self, out_idx: usize, row: usize, row_inner: usize) -> Option<Vec<f32>> { self.inner.read_output_row(out_idx, row, row_inner) }
        fn run_feed_gpu_handle(&mut self, inputs: &[(&str, &[f32])], handle_name: &str, output_index: usize) -> Option<Vec<f32>> { self.inner.run_feed_gpu_handle(inputs, handle_name, output_index) }
        fn commit_no_wait(&mut self, inputs: &[(&str, &[f32])]) {
            // Run synchronously so the tap outputs are stripped and recorded (the CPU backend
            // has no asynchronous commit either).
            let _ = self.run(inputs);
        }
        fn sync_pending(&mut self) { self.inner.sync_pending() }
        fn run_pipelined(&mut self, input_sets: &[Vec<(&str, &[f32])>]) -> Vec<Vec<Vec<f32>>> {
            let outs = self.inner.run_pipelined(input_sets);
            outs.into_iter().map(|o| self.strip(o, |v| v.clone())).collect()
        }
        fn set_param_typed(&mut self, name: &str, data: &[u8], dtype: rlx_ir::DType) { self.inner.set_param_typed(name, data, dtype) }
        fn run_typed(&mut self, inputs: &[(&str, &[u8], rlx_ir::DType)]) -> Vec<(Vec<u8>, rlx_ir::DType)> {
            let outs = self.inner.run_typed(inputs);
            self.strip(outs, |(b, d)| rlx_runtime::taps::to_f32(b, *d))
        }
        fn wgpu_host_summary(&self) -> Option<String> { self.inner.wgpu_host_summary() }
    }
}
