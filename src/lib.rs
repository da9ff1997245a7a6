//! opscope: named passes for RLX graphs that record what flows through a model's op sites.
//!
//! A [`Pipeline`] of registered passes (`matmul{hist_bins=16}`) rewrites an RLX graph. Tap
//! passes (today: `matmul`) append small sketch outputs at op sites, which RLX strips before the
//! caller sees its outputs and a [`Sink`] records; the pass trait also has an actuation kind,
//! for passes that change the model on purpose (none is registered yet). Three ways to turn it
//! on:
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
