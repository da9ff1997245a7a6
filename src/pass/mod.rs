//! The pass trait, typed pass options, and the `inventory` registry of passes.
//!
//! A pass is a short type implementing [`Pass`] in its own file under `passes/`, registered at
//! the bottom of that file with `inventory::submit! { PassRegistration(&MyPass) }`. Nothing
//! outside `passes/` names a concrete pass: the pipeline finds passes by name here.

mod options;

use std::fmt;

pub use options::{
    split_list, Globs, Opt, OptionKind, SitePatterns, OptionSpec, OptionType, OptionValue, Options, Range, RawValue, Stats, Text, Word, Words,
};

use crate::error::Error;
use crate::rewrite::Rewrite;

/// What a pass does to the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PassKind {
    /// Observes: appends sketch outputs, leaves the caller's outputs bit-identical.
    Tap,
    /// Changes the model on purpose (fake-quant, layer skip) to measure a decision.
    Actuation,
}

impl fmt::Display for PassKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PassKind::Tap => "tap",
            PassKind::Actuation => "actuation",
        })
    }
}

/// An opscope pass: a name, a kind, typed options, and a rewrite of an RLX graph.
pub trait Pass: Sync {
    /// Registered name, used in pipelines (`matmul`).
    fn name(&self) -> &'static str;
    /// Tap or actuation.
    fn kind(&self) -> PassKind;
    /// One line of documentation.
    fn doc(&self) -> &'static str;
    /// Declared options.
    fn options(&self) -> &'static [OptionSpec];
    /// Rewrite the graph held by `rw`, appending taps through [`Rewrite::tap`] (tap passes)
    /// or rewriting nodes (actuation passes).
    ///
    /// Errors: only for internal inconsistencies; a site that cannot be handled is recorded
    /// with [`Rewrite::skip`] and the pass goes on.
    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error>;
}

/// An entry in the pass registry (`inventory::submit! { PassRegistration(&MyPass) }`).
pub struct PassRegistration(pub &'static dyn Pass);

inventory::collect!(PassRegistration);

/// Every registered pass, sorted by name.
pub fn registered() -> Vec<&'static dyn Pass> {
    let mut v: Vec<&'static dyn Pass> = inventory::iter::<PassRegistration>
        .into_iter()
        .map(|r| r.0)
        .collect();
    v.sort_by_key(|p| p.name());
    v
}

/// Look a pass up by name.
pub fn lookup(name: &str) -> Option<&'static dyn Pass> {
    registered().into_iter().find(|p| p.name() == name)
}
