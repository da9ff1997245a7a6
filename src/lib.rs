//! opscope: named passes for RLX graphs that record what flows through a model's op sites.
//!
//! A [`Pipeline`] of registered passes (`matmul{hist_bins=16}`) rewrites an RLX graph. Tap
//! passes (`matmul`, `attn`, `route`, `residual`) append small sketch outputs at op sites, which
//! RLX strips before the caller sees its outputs and a [`Sink`] records; actuation passes
//! (`fakequant`, `skip`) change the model on purpose to measure a decision. Three ways to turn
//! it on:
//! - [`scope`]: around unchanged code;
//! - the environment: `RLX_OPSCOPE=<pipeline> RLX_OPSCOPE_OUT=<path>` in any program that links
//!   opscope (`use opscope as _;`);
//! - direct: [`Pipeline::apply`] for code that manages compiles itself.
//!
//! ```
//! use opscope::{MemorySink, Pipeline};
//! use rlx_ir::{DType, Graph, Shape};
//! use rlx_runtime::{Device, Session};
//!
//! // Unchanged RLX code: y = x @ w.
//! let mut g = Graph::new("demo");
//! let x = g.input("x", Shape::new(&[2, 3], DType::F32));
//! let w = g.param("w", Shape::new(&[3, 2], DType::F32));
//! let y = g.matmul(x, w, Shape::new(&[2, 2], DType::F32));
//! g.set_outputs(vec![y]);
//!
//! let pipeline = Pipeline::parse("matmul{stats=[max,nnz]}")?;
//! let sink = MemorySink::default();
//! let outputs = opscope::scope(&pipeline, Box::new(sink.clone()), || {
//!     let mut c = Session::new(Device::Cpu).compile(g.clone());
//!     c.set_param("w", &[1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
//!     c.run(&[("x", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])])
//! })?;
//! assert_eq!(outputs, vec![vec![1.0, 2.0, 4.0, 5.0]]); // the caller's outputs, as always
//! let max_out = sink.rows().into_iter().find(|r| &*r.role == "out" && &*r.stat == "max").unwrap();
//! assert_eq!((&*max_out.site, max_out.value), ("matmul.0", 5.0));
//! # Ok::<(), opscope::Error>(())
//! ```

#![warn(missing_docs)]

pub mod activate;
pub mod analysis;
mod bytes;
pub mod capture;
pub mod error;
pub mod linalg;
pub mod manifest;
pub mod memo;
pub mod mine;
pub mod online;
pub mod params;
pub mod pass;
pub mod pipeline;
pub mod record;
pub mod recording;
pub mod rewrite;
pub mod sketch;

#[path = "../passes/mod.rs"]
pub mod passes;

pub use activate::{scope, Scope, Stage};
pub use error::Error;
pub use manifest::{Manifest, Role};
pub use pass::{Pass, PassKind, PassRegistration};
pub use pipeline::Pipeline;
pub use recording::{CsvSink, MemorySink, Row, Sink};

/// The recording sink a path's name asks for: `.csv`, `.csv.gz`, or `.parquet` (cargo feature
/// `parquet`), after the environment mode's checks of the path
/// ([`recording::open_checked`]): it never overwrites a file that is not an opscope recording
/// or an interrupted recording's `<path>.partial`, and replaces an earlier recording only once
/// the new one is complete. The way to open a file recording: [`CsvSink::create`] writes CSV
/// only and checks nothing of what is at the path.
///
/// Errors: another name, `.parquet` without the feature, an unusable path, or one of the checks
/// (each names the fix).
pub use recording::open_checked as open_sink;
pub use sketch::{SketchSpec, Stat};

/// `inventory`, re-exported so that a crate defining its own pass registers it with the same
/// version opscope collects (`opscope::inventory::submit! { PassRegistration(&MyTap) }`).
pub use inventory;

/// At load time: link every pass file (see [`passes::link`]) and wrap the backend of every
/// registered device for the environment mode (it reads `RLX_OPSCOPE` at the first compile; see
/// [`activate::env`]).
#[ctor::ctor]
fn opscope_load() {
    passes::link();
    activate::env::init();
    activate::ir::init();
}

/// At exit: finish the environment mode's recording (nothing when it is off). A recording
/// that failed (disk full) ends the process with exit status 1, so a CI job sees it: the
/// program's own status is gone by now, and `exit` may not be called again from an exit
/// handler, hence `_exit` (Rust's stdout was flushed before exit handlers run).
#[ctor::dtor]
fn opscope_exit() {
    if let Err(e) = activate::env::finish() {
        eprintln!("opscope: recording failed: {e}");
        // SAFETY: `_exit` ends the process at once; nothing runs after it.
        unsafe { libc::_exit(1) };
    }
}
