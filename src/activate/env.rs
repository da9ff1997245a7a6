//! The environment mode: `RLX_OPSCOPE=<pipeline>` in any program that links opscope taps every
//! compile, on every device RLX was built with, and strips the tap outputs from every run.
//!
//! At load time opscope wraps the backend of every device registered in RLX's backend registry
//! (the CPU, and Metal, CUDA, wgpu, ... when `rlx-runtime` was built with their features): each
//! wrapper forwards to the backend it replaced. The variables are read at the first compile,
//! through `rlx_ir::env` (so RLX's code-side overrides, `rlx_ir::env::set` and
//! `rlx_ir::env::scoped`, work as they do for RLX's own `RLX_*` settings), and the decision then
//! holds for the process. While `RLX_OPSCOPE` is unset or empty at that compile, every compile
//! goes straight to the wrapped backend with the caller's module untouched and the executable is
//! the backend's own (no wrapper at run time).
//!
//! On a device without opscope's native sketch kernel (every device but the CPU) the tensor
//! sketches are lowered into RLX primitive ops ([`crate::sketch::lower`]) and what cannot be
//! lowered is listed in the manifest's `skipped`, per compile.
//!
//! Derived params (the `lowrank` factors, [`crate::params`]): a program that links opscope
//! binds weights with plain `set_param`, so every executable whose graph declares derived params
//! is wrapped, in this mode and under a scope alike (and even while `RLX_OPSCOPE` is unset, when
//! a scope rewrote the graph): the wrapper's `set_param` / `set_param_typed` (F32) computes the
//! derived params of the param it sets, and every run refuses, with the unbound params and the
//! fix on stderr and exit code 2, while one is unbound (RLX alone would read zeros and warn).
//! RLX's own unbound-param warning still names them at the first run: RLX does not see params
//! set below its `CompiledGraph`.
//!
//! A backend registered after load (an external crate's `register()` called from `main`) for a
//! device RLX had not registered is wrapped by calling [`init`] again after it. One registered
//! for a device already wrapped replaces the wrapper, and that device is then not tapped (RLX
//! 0.2.19's registry cannot say which factory is current): register it before the first
//! compile and before opscope loads, or use a scope.

use std::sync::{Arc, OnceLock};

use crate::error::Error;
use crate::pipeline::Pipeline;
use crate::record::{new_run_id, Recorder};

use super::Stage;

/// Environment variable holding the pipeline text.
pub const ENV_PIPELINE: &str = "RLX_OPSCOPE";
/// Environment variable holding the recording path (default `opscope-recording.csv`).
pub const ENV_OUT: &str = "RLX_OPSCOPE_OUT";
/// Environment variable selecting the observed program: `deployed` (default) or `source`.
pub const ENV_STAGE: &str = "RLX_OPSCOPE_STAGE";

/// Every environment variable opscope reads; another `RLX_OPSCOPE*` name is warned about at the
/// first compile.
/// (The dataset sink's two, `recording::ENV_PART_RUNS` and `ENV_PART_BYTES`, by name: that
/// module exists with the `parquet` feature only; a unit test checks the names.)
const KNOWN_VARS: [&str; 6] = [ENV_PIPELINE, ENV_OUT, ENV_STAGE, super::ir::ENV_IR, "RLX_OPSCOPE_PART_RUNS", "RLX_OPSCOPE_PART_BYTES"];

#[cfg(all(test, feature = "parquet"))]
#[test]
fn the_known_variables_name_the_dataset_sinks_own() {
    assert!(KNOWN_VARS.contains(&crate::recording::ENV_PART_RUNS) && KNOWN_VARS.contains(&crate::recording::ENV_PART_BYTES));
}

pub(super) struct EnvState {
    pub(super) pipeline: Pipeline,
    pub(super) recorder: Arc<Recorder>,
    pub(super) stage: Stage,
}

/// The three variables as read at the first compile.
struct EnvVars {
    pipeline: String,
    out: Option<String>,
    stage: Option<String>,
}

/// `RLX_OPSCOPE` and its companions through `rlx_ir::env::var` (process environment plus RLX's
/// code-side overrides), read once, at the first call (the first compile); `None` when
/// `RLX_OPSCOPE` is unset or empty (opscope is then inert).
fn vars() -> Option<&'static EnvVars> {
    static VARS: OnceLock<Option<EnvVars>> = OnceLock::new();
    VARS.get_or_init(|| {
        // A misspelt companion (`RLX_OPSCOPE_OUTT`) would be a silent default: said once.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("RLX_OPSCOPE") && !KNOWN_VARS.contains(&name.as_ref()) {
                let near = crate::error::closest(&name, KNOWN_VARS.iter().copied());
                let hint = near.first().map(|n| format!(" (did you mean {n}?)")).unwrap_or_default();
                eprintln!("opscope: warning: {name} is not an opscope variable{hint}; known: {}", KNOWN_VARS.join(", "));
            }
        }
        let Some(pipeline) = rlx_ir::env::var(ENV_PIPELINE).filter(|t| !t.trim().is_empty()) else {
            // Companions without the pipeline: said once, so a misspelt or forgotten
            // RLX_OPSCOPE is not a silent no-op.
            if let Some(other) = [ENV_OUT, ENV_STAGE].into_iter().find(|v| rlx_ir::env::var(v).is_some()) {
                eprintln!("opscope: note: {other} is set but {ENV_PIPELINE} is empty or unset: the environment mode is off ({other} is not used)");
            }
            return None;
        };
        Some(EnvVars {
            pipeline,
            out: rlx_ir::env::var(ENV_OUT),
            stage: rlx_ir::env::var(ENV_STAGE),
        })
    })
    .as_ref()
}

static ENV: OnceLock<Result<EnvState, String>> = OnceLock::new();

/// The parsed pipeline, sink and stage, built once at the first compile.
pub(super) fn env_state() -> Option<&'static Result<EnvState, String>> {
    let v = vars()?;
    Some(ENV.get_or_init(|| {
        let pipeline = Pipeline::parse(&v.pipeline).map_err(|e| format!("{ENV_PIPELINE}: {e}"))?;
        let stage = match &v.stage {
            Some(s) => s.parse::<Stage>().map_err(|e| format!("{ENV_STAGE}: {e}"))?,
            None => Stage::Deployed,
        };
        let out = v.out.clone().unwrap_or_else(|| "opscope-recording.csv".into());
        // `open_sink`'s checks: never over a file that is not a recording, a `.partial` or a
        // directory of foreign files; an earlier recording is replaced once this one is
        // complete, and said so.
        let sink = crate::recording::open_checked(&out).map_err(|e| format!("{ENV_OUT}: {e}"))?;
        Ok(EnvState {
            pipeline,
            recorder: Arc::new(Recorder::new(sink, new_run_id())),
            stage,
        })
    }))
}

/// Wrap the backend of every device registered in RLX's backend registry that is not wrapped
/// yet (each wrapper forwards to the backend it replaced and decides at the first compile
/// whether to tap; see the module docs). Runs at load time in any program that links opscope
/// (`use opscope as _;`); call it again after registering a backend for a new device so that
/// it is tapped too. A device already wrapped is left as it is (see the module docs for a
/// backend that replaces a wrapped one).
pub fn init() {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    for device in rlx_runtime::registered_devices() {
        if backend::SLOTS.iter().any(|s| s.get().is_some_and(|(d, _)| *d == device)) {
            continue;
        }
        let Some(free) = backend::SLOTS.iter().position(|s| s.get().is_none()) else {
            eprintln!("opscope: warning: more than {} devices registered; {device:?} is not tapped", backend::SLOTS.len());
            return;
        };
        let Some(inner) = rlx_runtime::backend_for(device) else { continue };
        if backend::SLOTS[free].set((device, inner)).is_ok() {
            rlx_runtime::register_backend(device, backend::FACTORIES[free]);
        }
    }
}

/// The devices [`init`] wrapped (a wrapper replaced since by another registration is still
/// listed: see the module docs).
pub fn tapped_devices() -> Vec<rlx_runtime::Device> {
    backend::SLOTS.iter().filter_map(|s| s.get().map(|(d, _)| *d)).collect()
}

/// Finish the environment recording (rename it into place, write the sidecar; with `online`
/// in the pipeline, the online state to `<recording>.online.json`). Runs at exit; calling it
/// earlier ends the recording. Warnings (nothing recorded, an idle tap or actuation) go to
/// stderr. `Ok` without doing anything when the environment mode is off or never started (a
/// bad `RLX_OPSCOPE` stops the program at its first compile, exit status 2, with the parse
/// error).
///
/// Errors: the recorder's first error (a write that failed, a run it refused: [`Error::Io`],
/// [`Error::Write`], [`Error::Mismatch`], ...), then [`Error::Write`] when the online state
/// cannot be written.
pub fn finish() -> Result<(), Error> {
    match ENV.get() {
        Some(Ok(st)) => {
            let crate::record::RecordCounts { compiles, appending, runs, recorded } = st.recorder.counts();
            st.recorder.finish()?;
            if crate::online::enabled(&st.pipeline) {
                // The online state beside the recording, written then renamed.
                let out = vars().and_then(|v| v.out.clone()).unwrap_or_else(|| "opscope-recording.csv".into());
                let path = crate::online::state_path(std::path::Path::new(&out));
                crate::online::take().write(&path).map_err(|why| Error::Write { path: path.clone(), why })?;
            }
            if !st.pipeline.has_tap() {
                let out = vars().and_then(|v| v.out.clone()).unwrap_or_else(|| "opscope-recording.csv".into());
                eprintln!(
                    "opscope: note: {ENV_PIPELINE}='{}' has no tap pass: nothing was recorded ({out} holds no rows; its \
                     manifest lists the actuations, if any); add a tap (e.g. {ENV_PIPELINE}='{},matmul') to record",
                    st.pipeline, st.pipeline
                );
            } else if appending == 0 || runs == 0 {
                eprintln!(
                    "opscope: warning: {ENV_PIPELINE}='{}' recorded no rows: {compiles} graph(s) compiled, {appending} with a site, {runs} tapped run(s)",
                    st.pipeline
                );
            } else if recorded == 0 {
                eprintln!("opscope: warning: {}", super::scope::sampled_out(&st.pipeline, runs));
            }
            for w in st.pipeline.idle_warnings(&st.recorder.manifests()) {
                eprintln!("opscope: warning: {w}");
            }
            Ok(())
        }
        _ => Ok(()),
    }
}


mod backend {
    //! A backend that forwards to the one it replaced, taps every MIR compile and strips the
    //! tap outputs from every run. Every `Backend` and `ExecutableGraph` method is forwarded,
    //! so the wrapper is transparent.

    use std::sync::{Arc, OnceLock};

    use rlx_runtime::backend::{Backend, ExecutableGraph};
    use rlx_runtime::{CompileOptions, Device};

    use std::collections::HashSet;

    use std::cell::Cell;

    use super::env_state;
    use crate::activate::{for_backend, take_fused, tap_graph};
    use crate::sketch::{self, epoch};
    use crate::params::{self, Derivation};
    use crate::manifest::Manifest;
    use crate::record::Recorder;

    /// The replaced backends, one per wrapped device. RLX's registry takes a plain `fn()`
    /// factory, so each slot has its own factory ([`FACTORIES`]); RLX 0.2.19 has 24 devices.
    pub(super) static SLOTS: [OnceLock<(Device, Box<dyn Backend>)>; 32] = [const { OnceLock::new() }; 32];

    fn factory<const SLOT: usize>() -> Box<dyn Backend> {
        Box::new(Tapping { slot: SLOT })
    }

    /// `factory::<i>` for every slot `i`.
    pub(super) static FACTORIES: [rlx_runtime::BackendFactory; 32] = [
        factory::<0>, factory::<1>, factory::<2>, factory::<3>, factory::<4>, factory::<5>, factory::<6>, factory::<7>,
        factory::<8>, factory::<9>, factory::<10>, factory::<11>, factory::<12>, factory::<13>, factory::<14>, factory::<15>,
        factory::<16>, factory::<17>, factory::<18>, factory::<19>, factory::<20>, factory::<21>, factory::<22>, factory::<23>,
        factory::<24>, factory::<25>, factory::<26>, factory::<27>, factory::<28>, factory::<29>, factory::<30>, factory::<31>,
    ];

    /// The wrapper of slot `slot` (its device and the backend it forwards to).
    pub(super) struct Tapping {
        slot: usize,
    }

    impl Tapping {
        fn device(&self) -> Device {
            SLOTS[self.slot].get().expect("a wrapper is registered only after its slot is set").0
        }

        fn inner(&self) -> &dyn Backend {
            SLOTS[self.slot].get().expect("a wrapper is registered only after its slot is set").1.as_ref()
        }

        /// Wrap `exec` when it has tap outputs to strip, derived params to bind, or weight
        /// sketches (`weights`: their memo follows the param epoch, [`crate::sketch::epoch`]);
        /// else the backend's own executable.
        fn wrap(
            exec: Box<dyn ExecutableGraph>,
            tapped: Option<(Arc<Manifest>, Arc<Recorder>)>,
            derived: Vec<(String, Arc<Derivation>)>,
            weights: bool,
        ) -> Box<dyn ExecutableGraph> {
            if tapped.is_none() && derived.is_empty() && !weights {
                return exec;
            }
            Box::new(Tapped {
                extra: tapped.as_ref().map_or(0, |(m, _)| m.appended()),
                inner: exec,
                tap: tapped,
                derived: Derived { params: derived, bound: HashSet::new(), fault: None },
                slots: Vec::new(),
                epoch: Cell::new(epoch::next()),
            })
        }

        fn tap(
            &self,
            graph: rlx_ir::Graph,
            device: Device,
            options: &CompileOptions,
        ) -> (rlx_ir::Graph, Option<(Arc<Manifest>, Arc<Recorder>)>, bool) {
            match env_state() {
                Some(Ok(st)) => {
                    // The backend is given the caller's options and device: fuse exactly as
                    // the compile will, and lower the sketches where the device has no kernel.
                    let t = tap_graph(&st.pipeline, &st.recorder, graph, st.stage, device, options);
                    (t.graph, t.manifest.map(|m| (m, st.recorder.clone())), t.fused)
                }
                Some(Err(msg)) => {
                    // A bad RLX_OPSCOPE stops the program at its first compile, with the
                    // parse error and no panic trace.
                    eprintln!("{msg}");
                    std::process::exit(2);
                }
                None => (graph, None, false),
            }
        }
    }

    impl Backend for Tapping {
        fn compile(&self, graph: rlx_ir::Graph, options: &CompileOptions) -> Box<dyn ExecutableGraph> {
            let derived = params::derived_in(&graph);
            let weights = sketch::has_weight_sketch(&graph);
            Self::wrap(self.inner().compile(graph, options), None, derived, weights)
        }

        fn compile_lir(&self, lir: rlx_ir::LirModule, options: &CompileOptions) -> Box<dyn ExecutableGraph> {
            self.inner().compile_lir(lir, options)
        }

        fn compile_hir(
            &self,
            hir: rlx_ir::HirModule,
            device: Device,
            options: &CompileOptions,
        ) -> Result<Box<dyn ExecutableGraph>, rlx_ir::hir::LowerError> {
            self.inner().compile_hir(hir, device, options)
        }

        fn compile_module(
            &self,
            module: rlx_ir::GraphModule,
            device: Device,
            options: &CompileOptions,
        ) -> Result<Box<dyn ExecutableGraph>, rlx_ir::hir::LowerError> {
            // A graph a scope's tap fused and tapped in this compile: planned as it is, not
            // fused again (`crate::activate::for_backend`).
            let scope_fused = module.as_graph().is_some_and(|g| take_fused(g, device, options));
            // Off: the wrapped backend's own compile of the caller's module, and its executable
            // (wrapped only to bind derived params a scope's rewrite declared).
            if env_state().is_none() {
                let derived = module.as_graph().map(params::derived_in).unwrap_or_default();
                let weights = module.as_graph().is_some_and(sketch::has_weight_sketch);
                let module = if scope_fused { for_backend(module.into_graph()?, true, device, options) } else { module };
                return Ok(Self::wrap(self.inner().compile_module(module, device, options)?, None, derived, weights));
            }
            let Some(graph) = module.as_graph().cloned() else {
                return self.inner().compile_module(module, device, options);
            };
            debug_assert_eq!(device, self.device());
            let (graph, tapped, fused) = self.tap(graph, device, options);
            let derived = params::derived_in(&graph);
            let weights = sketch::has_weight_sketch(&graph);
            let exec = self.inner().compile_module(for_backend(graph, fused || scope_fused, device, options), device, options)?;
            Ok(Self::wrap(exec, tapped, derived, weights))
        }

        fn supported_ops(&self) -> &'static [rlx_ir::OpKind] {
            self.inner().supported_ops()
        }
    }

    struct Tapped {
        inner: Box<dyn ExecutableGraph>,
        /// Trailing tap outputs to strip (0 without a tap).
        extra: usize,
        tap: Option<(Arc<Manifest>, Arc<Recorder>)>,
        derived: Derived,
        slots: Vec<(usize, usize)>,
        /// The param epoch ([`crate::sketch::epoch`]): replaced at every call that may write a
        /// param ([`Tapped::wrote`]), 0 for good once the executable hands out a way around
        /// this wrapper ([`Tapped::escaped`]).
        epoch: Cell<u64>,
    }

    /// The derived params of one executable and which of them hold values.
    #[derive(Clone)]
    struct Derived {
        /// Each derived param the graph declares, with its derivation.
        params: Vec<(String, Arc<Derivation>)>,
        /// Derived params set (computed from their source, or set directly).
        bound: HashSet<String>,
        /// Why a derivation failed at the last bind of its source (refuses every run).
        fault: Option<String>,
    }

    impl Tapped {
        /// A call that may write params or executable state: a new epoch (unless escaped).
        fn wrote(&self) {
            if self.epoch.get() != 0 {
                self.epoch.set(epoch::next());
            }
        }

        /// A call that hands out a way to write params around this wrapper (a raw pointer into
        /// the arena, the backend's own executable, params shared with another executable):
        /// weight sketches are hashed on every run from now on.
        fn escaped(&self) {
            self.epoch.set(0);
        }

        /// Mark this thread's runs with the executable's epoch (see [`crate::sketch::epoch`]).
        fn run_epoch(&self) -> epoch::RunEpoch {
            epoch::RunEpoch::enter(self.epoch.get())
        }

        /// Record the trailing `extra` outputs and return the caller's. `first` reads value 0
        /// of an output (the compile tag); `to_output` hands a whole one to the recorder (f32
        /// values, or typed bytes it decodes on its writer thread), and runs only when the run
        /// is recorded (an unsampled run converts nothing).
        fn strip<T, O: Into<crate::record::RunOutput>>(&self, mut outs: Vec<T>, first: impl Fn(&T) -> Option<f32>, to_output: impl FnMut(T) -> O) -> Vec<T> {
            if let Some((manifest, recorder)) = &self.tap {
                if outs.len() >= self.extra {
                    let tail = outs.split_off(outs.len() - self.extra);
                    let firsts: Vec<Option<f32>> = tail.iter().map(first).collect();
                    recorder.record_with(manifest, &firsts, move || tail.into_iter().map(to_output).collect());
                }
            }
            outs
        }

        /// After param `name` was set to `data`: compute and set every derived param of this
        /// executable computed from it (or note `name` bound, if it is itself a derived param).
        fn bind_derived(&mut self, name: &str, data: Option<&[f32]>) {
            let d = &mut self.derived;
            if d.params.iter().any(|(t, _)| t == name) {
                d.bound.insert(name.to_string());
            }
            let mut done: Vec<*const Derivation> = Vec::new();
            let sources: Vec<Arc<Derivation>> = d.params.iter().filter(|(_, x)| x.source == name).map(|(_, x)| x.clone()).collect();
            for der in sources {
                if done.contains(&Arc::as_ptr(&der)) {
                    continue;
                }
                done.push(Arc::as_ptr(&der));
                for (t, _) in &der.targets {
                    d.bound.remove(t);
                }
                let Some(data) = data else {
                    d.fault = Some(format!("param '{name}' was set with a non-f32 dtype or a byte range; its derived params need the whole f32 values: set it with set_param (or set_param_typed as F32)"));
                    continue;
                };
                match params::derive(&der, data) {
                    Ok(values) => {
                        for ((t, _), v) in der.targets.iter().zip(values.iter()) {
                            self.inner.set_param(t, v);
                            d.bound.insert(t.clone());
                        }
                        d.fault = None;
                    }
                    Err(e) => d.fault = Some(e.to_string()),
                }
            }
        }

        /// After params were copied or shared from `src`: a derived param `src` holds is bound.
        fn note_copied(&mut self, ok: bool, src: &dyn ExecutableGraph) {
            if ok {
                for (t, _) in &self.derived.params {
                    if src.param_already_set(t) {
                        self.derived.bound.insert(t.clone());
                    }
                }
            }
        }

        /// Refuse to run (stderr, exit code 2) while a derived param is unbound: RLX would read
        /// zeros for it and compute silently wrong outputs.
        fn guard(&self) {
            let d = &self.derived;
            if d.params.is_empty() {
                return;
            }
            let unbound: Vec<&(String, Arc<Derivation>)> = d.params.iter().filter(|(t, _)| !d.bound.contains(t) && !self.inner.param_already_set(t)).collect();
            if let Some(why) = &d.fault {
                eprintln!("opscope: refusing to run: {why}");
                std::process::exit(2);
            }
            if !unbound.is_empty() {
                let names: Vec<&str> = unbound.iter().map(|(t, _)| t.as_str()).collect();
                let mut sources: Vec<&str> = unbound.iter().map(|(_, x)| x.source.as_str()).collect();
                sources.dedup();
                eprintln!(
                    "opscope: refusing to run: derived params {} were never set (RLX would read zeros); fix: set their source params {} with set_param on this compiled graph (opscope computes the derived ones), or bind with opscope::params::bind",
                    names.join(", "),
                    sources.join(", ")
                );
                std::process::exit(2);
            }
        }
    }

    impl ExecutableGraph for Tapped {
        fn capabilities(&self) -> rlx_runtime::ExecutableCapabilities { self.inner.capabilities() }
        fn set_param(&mut self, name: &str, data: &[f32]) {
            self.wrote();
            self.inner.set_param(name, data);
            self.bind_derived(name, Some(data));
        }
        fn set_param_range(&mut self, name: &str, byte_offset: usize, data: &[u8]) -> bool {
            self.wrote();
            let ok = self.inner.set_param_range(name, byte_offset, data);
            // A partial update leaves derived params stale: refuse until the source is set whole.
            if ok && self.derived.params.iter().any(|(_, d)| d.source == name) {
                self.bind_derived(name, None);
            }
            ok
        }
        fn finalize_params(&mut self) { self.wrote(); self.inner.finalize_params() }
        fn clone_box(&self) -> Box<dyn ExecutableGraph> {
            Box::new(Tapped {
                inner: self.inner.clone_box(),
                extra: self.extra,
                tap: self.tap.clone(),
                derived: self.derived.clone(),
                slots: Vec::new(),
                // The clone's params are its own: a fresh epoch (none if this one escaped).
                epoch: Cell::new(if self.epoch.get() != 0 { epoch::next() } else { 0 }),
            })
        }
        fn run(&mut self, inputs: &[(&str, &[f32])]) -> Vec<Vec<f32>> {
            self.guard();
            let _epoch = self.run_epoch();
            let outs = self.inner.run(inputs);
            self.strip(outs, |v| v.first().copied(), |v| v)
        }
        fn run_read_outputs(&mut self, inputs: &[(&str, &[f32])], read_indices: Option<&[usize]>) -> Vec<Vec<f32>> {
            // Run everything so the sketches are recorded, then pick the caller's indices.
            let all = self.run(inputs);
            match read_indices {
                None => all,
                Some(ix) => ix.iter().filter_map(|&i| all.get(i).cloned()).collect(),
            }
        }
        fn optimizer_step_resident(&mut self, trainable: &[(String, Vec<usize>)], step: &mut dyn FnMut(&str, &[usize], &mut [f32], &[f32])) -> bool { self.escaped(); self.inner.optimizer_step_resident(trainable, step) }
        fn run_raw(&mut self, inputs: &[(&str, &[f32])]) -> Vec<(*const f32, usize)> {
            self.guard();
            let _epoch = self.run_epoch();
            let raw = self.inner.run_raw(inputs);
            // SAFETY: the backend's run_raw returns pointers into its arena that stay valid
            // until the next run; the tap outputs are copied right away.
            self.strip(raw, |&(p, n)| (n > 0).then(|| unsafe { *p }), |(p, n)| unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
        }
        fn run_slots(&mut self, inputs: &[&[f32]]) -> &[(usize, usize)] {
            self.guard();
            let _epoch = self.run_epoch();
            let slots = self.inner.run_slots(inputs).to_vec();
            let arena = self.inner.arena_ptr();
            self.slots = if slots.len() >= self.extra && !arena.is_null() {
                // (byte offset, f32 length) pairs into the arena, valid until the next run;
                // an output without a buffer has offset usize::MAX.
                let first = |&(o, l): &(usize, usize)| {
                    // SAFETY: as below, value 0 of an output with a buffer.
                    (o != usize::MAX && l > 0).then(|| unsafe { *arena.add(o).cast::<f32>() })
                };
                self.strip(slots, first, |(o, l)| {
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
        fn arena_ptr(&self) -> *const u8 { self.escaped(); self.inner.arena_ptr() }
        fn set_active_extent(&mut self, extent: Option<(usize, usize)>) { self.inner.set_active_extent(extent) }
        fn release_scratch(&mut self) { self.inner.release_scratch() }
        fn set_rng(&mut self, rng: rlx_ir::RngOptions) { self.inner.set_rng(rng) }
        fn rng(&self) -> rlx_ir::RngOptions { self.inner.rng() }
        fn set_moe_resident_experts(&mut self, mask: &[bool]) { self.wrote(); self.inner.set_moe_resident_experts(mask) }
        fn set_moe_resident_experts_per_layer(&mut self, masks: &[&[bool]]) { self.wrote(); self.inner.set_moe_resident_experts_per_layer(masks) }
        fn enable_moe_topk_capture(&mut self, num_experts: usize) -> bool { self.wrote(); self.inner.enable_moe_topk_capture(num_experts) }
        fn take_moe_topk_capture(&mut self) -> Option<Vec<Vec<u32>>> { self.inner.take_moe_topk_capture() }
        fn take_moe_residency_stats(&mut self) -> Option<rlx_runtime::MoeResidencyStats> { self.inner.take_moe_residency_stats() }
        fn bind_handle(&mut self, name: &str, data: &[f32]) -> bool { self.wrote(); self.inner.bind_handle(name, data) }
        fn read_handle(&self, name: &str) -> Option<Vec<f32>> { self.inner.read_handle(name) }
        fn bind_gpu_handle(&mut self, name: &str, data: &[f32]) -> bool { self.wrote(); self.inner.bind_gpu_handle(name, data) }
        fn has_gpu_handle(&self, name: &str) -> bool { self.inner.has_gpu_handle(name) }
        fn set_gpu_handle_feed(&mut self, handle_name: &str, output_index: usize) -> bool { self.wrote(); self.inner.set_gpu_handle_feed(handle_name, output_index) }
        fn read_gpu_handle(&self, name: &str) -> Option<Vec<f32>> { self.inner.read_gpu_handle(name) }
        fn save_inputs(&mut self, names: &[&str]) -> bool { self.wrote(); self.inner.save_inputs(names) }
        fn restore_inputs(&mut self) -> bool { self.wrote(); self.inner.restore_inputs() }
        fn read_gpu_handle_row(&self, name: &str, row: usize, row_inner: usize) -> Option<Vec<f32>> { self.inner.read_gpu_handle_row(name, row, row_inner) }
        fn register_kv_row_feed(&mut self, handle_name: &str, output_index: usize) -> bool { self.wrote(); self.inner.register_kv_row_feed(handle_name, output_index) }
        fn feed_kv_row(&mut self, src_row: usize, dst_row: usize, row_elems: usize) -> bool { self.wrote(); self.inner.feed_kv_row(src_row, dst_row, row_elems) }
        fn feed_kv_batch_major(&mut self, dst_row: usize, batch: usize, seq_cap: usize, row_elems: usize) -> bool { self.wrote(); self.inner.feed_kv_batch_major(dst_row, batch, seq_cap, row_elems) }
        fn feed_kv_batch_major_src(&mut self, src_row: usize, src_seq_cap: usize, dst_row: usize, batch: usize, dst_seq_cap: usize, row_elems: usize) -> bool { self.wrote(); self.inner.feed_kv_batch_major_src(src_row, src_seq_cap, dst_row, batch, dst_seq_cap, row_elems) }
        fn feed_kv_batch_major_ragged(&mut self, src_row: usize, src_seq_cap: usize, dst_rows: &[usize], dst_seq_cap: usize, row_elems: usize) -> bool { self.wrote(); self.inner.feed_kv_batch_major_ragged(src_row, src_seq_cap, dst_rows, dst_seq_cap, row_elems) }
        fn prepare_resident_gpu_handle(&mut self, name: &str) -> bool { self.wrote(); self.inner.prepare_resident_gpu_handle(name) }
        fn stage_bound_gpu_handles_to_arena(&mut self) { self.wrote(); self.inner.stage_bound_gpu_handles_to_arena() }
        fn seed_resident_kv_prefix_from(&mut self, src: &dyn ExecutableGraph, prefix_tokens: usize, outgoing_upper: usize, kv_dim: usize, n_layers: usize) -> bool { self.wrote(); self.inner.seed_resident_kv_prefix_from(src, prefix_tokens, outgoing_upper, kv_dim, n_layers) }
        fn copy_resident_kv_rows_from(&mut self, src: &dyn ExecutableGraph, from_row: usize, to_row: usize, outgoing_upper: usize, kv_dim: usize, n_layers: usize) -> bool { self.wrote(); self.inner.copy_resident_kv_rows_from(src, from_row, to_row, outgoing_upper, kv_dim, n_layers) }
        fn copy_params_from(&mut self, src: &dyn ExecutableGraph) -> bool {
            self.wrote();
            let ok = self.inner.copy_params_from(src);
            self.note_copied(ok, src);
            ok
        }
        fn share_params_from(&mut self, src: &dyn ExecutableGraph) -> bool {
            // Shared params can be written through the other executable.
            self.escaped();
            let ok = self.inner.share_params_from(src);
            self.note_copied(ok, src);
            ok
        }
        fn param_already_set(&self, name: &str) -> bool { self.derived.bound.contains(name) || self.inner.param_already_set(name) }
        fn executable_as_any(&self) -> Option<&dyn std::any::Any> { self.escaped(); self.inner.executable_as_any() }
        fn executable_as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> { self.escaped(); self.inner.executable_as_any_mut() }
        fn read_output_row(&self, out_idx: usize, row: usize, row_inner: usize) -> Option<Vec<f32>> { self.inner.read_output_row(out_idx, row, row_inner) }
        fn run_feed_gpu_handle(&mut self, inputs: &[(&str, &[f32])], handle_name: &str, output_index: usize) -> Option<Vec<f32>> {
            self.guard();
            let _epoch = self.run_epoch();
            self.inner.run_feed_gpu_handle(inputs, handle_name, output_index)
        }
        fn commit_no_wait(&mut self, inputs: &[(&str, &[f32])]) {
            // Run synchronously so the tap outputs are stripped and recorded (the CPU backend
            // has no asynchronous commit either).
            let _ = self.run(inputs);
        }
        fn sync_pending(&mut self) { self.inner.sync_pending() }
        fn run_pipelined(&mut self, input_sets: &[Vec<(&str, &[f32])>]) -> Vec<Vec<Vec<f32>>> {
            self.guard();
            let _epoch = self.run_epoch();
            let outs = self.inner.run_pipelined(input_sets);
            outs.into_iter().map(|o| self.strip(o, |v| v.first().copied(), |v| v)).collect()
        }
        fn set_param_typed(&mut self, name: &str, data: &[u8], dtype: rlx_ir::DType) {
            self.wrote();
            self.inner.set_param_typed(name, data, dtype);
            if dtype == rlx_ir::DType::F32 && data.len() % 4 == 0 {
                let values: Vec<f32> = data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                self.bind_derived(name, Some(&values));
            } else {
                self.bind_derived(name, None);
            }
        }
        fn run_typed(&mut self, inputs: &[(&str, &[u8], rlx_ir::DType)]) -> Vec<(Vec<u8>, rlx_ir::DType)> {
            self.guard();
            let _epoch = self.run_epoch();
            let outs = self.inner.run_typed(inputs);
            self.strip(outs, |(b, d)| crate::record::first_value(b, *d), |(b, d)| crate::record::RunOutput::Bytes(b, d))
        }
        fn wgpu_host_summary(&self) -> Option<String> { self.inner.wgpu_host_summary() }
    }
}
