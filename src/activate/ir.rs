//! The RLX IR-pass route for actuations: `RLX_OPSCOPE_IR=<pipeline>` in any program that links
//! opscope registers, at load time, one pass with `rlx_fusion::pass::register_ir_pass`. RLX runs
//! it after its fusion passes and before legalization on every backend that compiles through
//! its stage pipeline (CPU, CUDA, ROCm, MLX, wgpu), so the actuation acts on a program compiled
//! by unmodified RLX code, with no scope and no wrapper.
//!
//! Only actuation passes (`fakequant`, `skip`) are accepted: a registered IR pass's extra
//! outputs are not stripped, so taps go through `RLX_OPSCOPE` (see [`super::env`]). The
//! variable is read at load (RLX's registry is global and append-only; registering the pass
//! unconditionally would stamp provenance on every compile of every program); the pipeline is
//! parsed at the first compile. A bad pipeline, or one holding a tap, stops the program at its
//! first compile with the error (exit status 2).
//!
//! With RLX patched to take a pass list in `CompileOptions` (`upstream/rlx-compile-options-ir-passes.patch`,
//! see the README) and opscope's feature `rlx-ir-pass-list`, the same pass is also registered as
//! the opt-in pass `opscope`: `CompileOptions::new().with_ir_passes(["opscope:fakequant{bits=8}"])`
//! runs the actuation in that compile only, with no environment variable.
//!
//! A graph this pass already rewrote is left alone: RLX stamps the nodes a registered pass
//! leaves without provenance with the pass's name, and the pass skips a graph holding such a
//! node (opscope's own fusion of a program, for a tap, runs the registered passes too).

use std::sync::{Arc, OnceLock};

use rlx_ir::Graph;

use crate::pipeline::Pipeline;

/// Environment variable holding the actuation pipeline for the IR-pass route.
pub const ENV_IR: &str = "RLX_OPSCOPE_IR";

/// Name of the registered pass (and of the provenance RLX stamps on its nodes).
pub const IR_PASS_NAME: &str = "opscope.actuation";

struct ActuationPass {
    text: String,
    parsed: OnceLock<Result<Pipeline, String>>,
}

impl ActuationPass {
    fn pipeline(&self) -> &Pipeline {
        let parsed = self.parsed.get_or_init(|| {
            let p = Pipeline::parse(&self.text).map_err(|e| format!("{ENV_IR}: {e}"))?;
            if p.has_tap() {
                return Err(format!(
                    "{ENV_IR}='{}' holds a tap: an RLX IR pass cannot strip the outputs a tap appends; use RLX_OPSCOPE for taps and keep {ENV_IR} for actuations (fakequant, skip)",
                    self.text
                ));
            }
            Ok(p)
        });
        match parsed {
            Ok(p) => p,
            Err(msg) => {
                eprintln!("{msg}");
                std::process::exit(2);
            }
        }
    }
}

impl rlx_fusion::pass::Pass for ActuationPass {
    fn name(&self) -> &str {
        IR_PASS_NAME
    }

    fn run(&self, graph: Graph) -> Graph {
        let pipeline = self.pipeline();
        let done = graph.nodes().iter().any(|n| n.origin.as_ref().and_then(|o| o.pass.as_deref()) == Some(IR_PASS_NAME));
        if done {
            return graph;
        }
        match pipeline.apply(&graph) {
            Ok((g, _)) => g,
            Err(e) => {
                eprintln!("{ENV_IR}: {e}");
                std::process::exit(2);
            }
        }
    }
}

/// The opt-in pass `opscope:<pipeline>` of a compile's pass list (patched RLX; see the module
/// docs): the actuation pipeline, parsed when the list is resolved.
///
/// Errors: the text does not parse, or holds a tap (whose outputs nothing would strip).
#[cfg(feature = "rlx-ir-pass-list")]
fn listed(args: &str) -> Result<Arc<dyn rlx_fusion::pass::Pass + Send + Sync>, String> {
    let p = Pipeline::parse(args).map_err(|e| e.to_string())?;
    if p.has_tap() {
        return Err(format!(
            "'{args}' holds a tap: a pass in the compile's pass list cannot strip the outputs a tap appends; use RLX_OPSCOPE or opscope::scope for taps"
        ));
    }
    let parsed = OnceLock::new();
    let _ = parsed.set(Ok(p));
    Ok(Arc::new(ActuationPass { text: args.to_string(), parsed }))
}

/// At load time: register the actuation pass when `RLX_OPSCOPE_IR` is set and not empty (and,
/// with the feature `rlx-ir-pass-list`, the opt-in pass `opscope` for compiles whose
/// `CompileOptions::ir_passes` name it). Calling it again is harmless.
pub fn init() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        #[cfg(feature = "rlx-ir-pass-list")]
        rlx_fusion::pass::register_named_ir_pass("opscope", listed);
        if let Some(text) = rlx_ir::env::var(ENV_IR).filter(|t| !t.trim().is_empty()) {
            rlx_fusion::pass::register_ir_pass(Arc::new(ActuationPass { text, parsed: OnceLock::new() }));
        }
    });
}
