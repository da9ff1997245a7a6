//! opscope: named tap and actuation passes for RLX graphs.
//!
//! A [`Pipeline`] of registered passes (`matmul{hist_bins=16}`) rewrites an RLX graph: tap
//! passes append small sketch outputs at op sites (MatMul, ...), which RLX strips before the
//! caller sees its outputs and a [`Sink`] records. Three ways to turn it on:
//! - [`scope`]: around unchanged code;
//! - the environment: `RLX_OPSCOPE=<pipeline> RLX_OPSCOPE_OUT=<path>` in any program that links
//!   opscope (`use opscope as _;`);
//! - direct: [`Pipeline::apply`] for code that manages compiles itself.

#![warn(missing_docs)]

pub mod activate;
pub mod error;
pub mod manifest;
pub mod model;
pub mod pass;
pub mod pipeline;
pub mod record;
pub mod rewrite;
pub mod sink;
pub mod sketch;
pub mod summary;

#[path = "../passes/mod.rs"]
pub mod passes;

pub use activate::{finish_env, init_from_env, scope, scope_with_result};
pub use error::Error;
pub use manifest::{Manifest, Role};
pub use pass::{Pass, PassKind, PassRegistration};
pub use pipeline::Pipeline;
pub use sink::{CsvSink, MemorySink, Row, Sink};
pub use sketch::{SketchSpec, Stat};
