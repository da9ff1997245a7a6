//! The scope mode: a `rlx_runtime::taps::GraphTap` around unchanged code.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rlx_ir::{DType, Graph};
use rlx_runtime::taps::{self, GraphTap};

use crate::error::Error;
use crate::pipeline::Pipeline;
use crate::record::{new_run_id, Recorder};
use crate::recording::Sink;

use super::{mark_fused, tap_graph, Stage};

struct ScopeTap {
    pipeline: Pipeline,
    recorder: Arc<Recorder>,
    stage: Stage,
    device: rlx_runtime::Device,
}

impl GraphTap for ScopeTap {
    fn on_compile(&self, graph: Graph) -> (Graph, usize) {
        // A tap is not told the caller's CompileOptions: fuse with the session defaults
        // (`CompileOptions::new()`, `RLX_*` overrides applied), which is what
        // `Session::compile` and `compile_with(CompileOptions::default())` use.
        let options = rlx_runtime::CompileOptions::new();
        let t = tap_graph(&self.pipeline, &self.recorder, graph, self.stage, self.device, &options);
        // The backend wrapper compiles a graph fused here without fusing it again, if the
        // compile's own options fuse as these do.
        mark_fused(&t.graph, t.fused, self.device, &options);
        (t.graph, t.manifest.map_or(0, |m| m.appended()))
    }

    fn on_outputs(&self, extra: Vec<(Vec<u8>, DType)>) {
        // Only the tags are read unless the run is recorded (an unsampled run converts nothing).
        let firsts: Vec<Option<f32>> = extra.iter().map(|(b, d)| crate::record::first_value(b, *d)).collect();
        // The bytes go to the writer as they are (`RunOutput`): no copy on the run's thread.
        self.recorder.record_tagged_with(&firsts, move || extra);
    }
}

/// A recording scope around unchanged code: every graph compiled through `Session::compile` /
/// `compile_with` inside [`Scope::run`] is tapped by the pipeline and recorded to the sink. The
/// caller's outputs are unchanged (same count, bit-identical values); tap outputs are stripped
/// by RLX and recorded. The one entry point of the scope mode ([`scope`] is its shorthand).
///
/// Runs of a tapped graph are recorded only while inside the scope (RLX reports extras to the
/// tap current at run time). Scopes are per thread.
pub struct Scope<'a> {
    pipeline: &'a Pipeline,
    sink: Box<dyn Sink>,
    stage: Stage,
    device: rlx_runtime::Device,
    interrupt: Option<&'static AtomicBool>,
    capture_dir: Option<std::path::PathBuf>,
}

/// What a scope recorded, and what looked wrong.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Graphs compiled (and tapped) inside the scope.
    pub compiles: usize,
    /// Runs of tapped graphs inside the scope (each took a step number).
    pub runs: u64,
    /// Of those, the runs whose rows were written: fewer than `runs` when a `sample` setting
    /// left runs out.
    pub recorded: u64,
    /// The recording id (the rows' `run_id`; in a Parquet dataset, the partition
    /// `recording=<id>` this scope wrote).
    pub run_id: String,
    /// The interrupt flag was set: the recording was closed as partial (left at `.partial`).
    pub interrupted: bool,
    /// Why the recording may not hold what the caller expects (also printed on stderr): no
    /// graph compiled inside the scope (a graph compiled before it, or on another thread, or
    /// inside a nested scope, is not tapped by this one), tapped graphs never run inside it, or
    /// a `sample` setting that left every run out.
    pub warnings: Vec<String>,
}

impl<'a> Scope<'a> {
    /// A scope recording `pipeline` to `sink`, observing the deployed program.
    pub fn new(pipeline: &'a Pipeline, sink: Box<dyn Sink>) -> Scope<'a> {
        Scope { pipeline, sink, stage: Stage::Deployed, device: rlx_runtime::Device::Cpu, interrupt: None, capture_dir: None }
    }

    /// The device the code inside the scope compiles for (default the CPU). RLX 0.2.19's
    /// `GraphTap::on_compile` is not told the session's device, so a scope around code that
    /// compiles for another device must say which: the deployed program is then fused as that
    /// device fuses it, and sketches are lowered into RLX primitive ops where it has no native
    /// sketch kernel. A scope left on the CPU around a GPU compile appends CPU-only sketch ops,
    /// which that backend cannot run. The environment mode needs no such call: it wraps each
    /// device's backend and knows the device.
    pub fn device(mut self, device: rlx_runtime::Device) -> Scope<'a> {
        self.device = device;
        self
    }

    /// When `flag` is set by the time `f` returns (a Ctrl-C handler sets it and `f` stops
    /// early), close the recording as partial ([`Sink::abandon`]: readable, left at
    /// `<path>.partial`) instead of finishing it.
    pub fn interrupt_flag(mut self, flag: &'static AtomicBool) -> Scope<'a> {
        self.interrupt = Some(flag);
        self
    }

    /// Write tensors captured by a `capture` pass into `dir` (default: `<path>.capture` beside
    /// a file recording; a [`crate::MemorySink`] has no default and needs this).
    pub fn capture_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Scope<'a> {
        self.capture_dir = Some(dir.into());
        self
    }

    /// Observe the program at `stage` instead.
    pub fn stage(mut self, stage: Stage) -> Scope<'a> {
        self.stage = stage;
        self
    }

    /// Run `f` inside the scope. Returns `f`'s value and the recording result: the first
    /// recording error (pipeline failure on a graph, I/O error of the sink, outputs not
    /// matching a manifest), else what was recorded once the sink is finished. Its warnings
    /// are printed on stderr too.
    pub fn run<T>(self, f: impl FnOnce() -> T) -> (T, Result<Summary, Error>) {
        let recorder = Arc::new(Recorder::new(self.sink, new_run_id()));
        if let Some(dir) = self.capture_dir.clone() {
            recorder.set_capture_dir(dir);
        }
        let tap = Rc::new(ScopeTap {
            pipeline: self.pipeline.clone(),
            recorder: recorder.clone(),
            stage: self.stage,
            device: self.device,
        });
        // Whatever way `f` ends, a graph the tap marked fused that no compile took is forgotten.
        struct Forget;
        impl Drop for Forget {
            fn drop(&mut self) {
                super::forget_fused();
            }
        }
        let forget = Forget;
        let value = taps::with_tap(tap, f);
        drop(forget);
        let crate::record::RecordCounts { compiles, appending, runs, recorded } = recorder.counts();
        let interrupted = self.interrupt.is_some_and(|f| f.load(Ordering::SeqCst));
        let res = if interrupted { recorder.abandon() } else { recorder.finish() };
        let mut warnings = Vec::new();
        if compiles == 0 {
            warnings.push(format!(
                "the scope recorded nothing: no graph was compiled inside it with Session::compile/compile_with on this \
                 thread (a graph compiled before the scope, on another thread, or inside a nested scope is not tapped \
                 by this one; pipeline '{}')",
                self.pipeline
            ));
        } else if appending == 0 && self.pipeline.has_tap() {
            warnings.push(format!(
                "the pipeline '{}' found no site in the {compiles} graph(s) compiled in the scope: nothing to record",
                self.pipeline
            ));
        } else if appending > 0 && runs == 0 && res.is_ok() && !interrupted {
            warnings.push(format!(
                "{appending} tapped graph(s) compiled in the scope never ran inside it: runs after the scope ends are \
                 not recorded (pipeline '{}')",
                self.pipeline
            ));
        } else if appending > 0 && recorded == 0 && res.is_ok() && !interrupted {
            warnings.push(sampled_out(&self.pipeline, runs));
        }
        warnings.extend(self.pipeline.idle_warnings(&recorder.manifests()));
        for w in &warnings {
            eprintln!("opscope: warning: {w}");
        }
        (value, res.map(|_| Summary { compiles, runs, recorded, run_id: recorder.run_id().to_string(), interrupted, warnings }))
    }
}

/// Shorthand for `Scope::new(pipeline, sink).run(f)` that returns `f`'s value only when
/// recording succeeded.
///
/// Errors: as [`Scope::run`].
pub fn scope<T>(pipeline: &Pipeline, sink: Box<dyn Sink>, f: impl FnOnce() -> T) -> Result<T, Error> {
    let (value, res) = Scope::new(pipeline, sink).run(f);
    res.map(|_| value)
}


/// The warning for a recording whose tapped graphs ran but whose `sample` setting left every
/// run out, so it holds no row (a `sample{every=N}` with N beyond the run count).
pub(super) fn sampled_out(pipeline: &Pipeline, runs: u64) -> String {
    format!(
        "the pipeline '{pipeline}' tapped {runs} run(s) and its `sample` setting recorded none of them, so the recording \
         holds no row: `sample{{every=N}}` records about one run in N, chosen by input content; run more inputs or \
         lower N"
    )
}
