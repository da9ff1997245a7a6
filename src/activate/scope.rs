//! The scope mode: a `rlx_runtime::taps::GraphTap` around unchanged code.

use std::rc::Rc;
use std::sync::Arc;

use rlx_ir::{DType, Graph};
use rlx_runtime::taps::{self, GraphTap};

use crate::error::Error;
use crate::pipeline::Pipeline;
use crate::record::{new_run_id, Recorder};
use crate::recording::Sink;

use super::{tap_graph, Stage};

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
}

impl<'a> Scope<'a> {
    /// A scope recording `pipeline` to `sink`, observing the deployed program.
    pub fn new(pipeline: &'a Pipeline, sink: Box<dyn Sink>) -> Scope<'a> {
        Scope { pipeline, sink, stage: Stage::Deployed }
    }

    /// Observe the program at `stage` instead.
    pub fn stage(mut self, stage: Stage) -> Scope<'a> {
        self.stage = stage;
        self
    }

    /// Run `f` inside the scope. Returns `f`'s value and the recording result: the first
    /// recording error (pipeline failure on a graph, I/O error of the sink, outputs not
    /// matching a manifest), else `Ok` once the sink is finished.
    pub fn run<T>(self, f: impl FnOnce() -> T) -> (T, Result<(), Error>) {
        let recorder = Arc::new(Recorder::new(self.sink, new_run_id()));
        let tap = Rc::new(ScopeTap {
            pipeline: self.pipeline.clone(),
            recorder: recorder.clone(),
            stage: self.stage,
        });
        let value = taps::with_tap(tap, f);
        (value, recorder.finish())
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

