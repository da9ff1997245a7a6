//! `sample`: record one run in N, chosen by consistent hashing of the run's input contents.
//!
//! `sample{every=16},matmul` gates every sketch of the pipeline by one gate node that hashes the
//! graph's inputs (XXH3-64 over names, dtypes and bytes: [`crate::sketch::sample::input_hash`])
//! and opens on `hash % 16 == 0`. On a run that is not sampled the native sketch kernels read
//! the closed gate and return at once, and the recorder writes no row (the run still counts as
//! a step). A repeated input is always sampled or always not. See [`crate::sketch::sample`].

use crate::error::Error;
use crate::pass::{Opt, OptionSpec, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::Rewrite;

const EVERY: Opt<u64> = Opt::uint(
    "every",
    1,
    1 << 30,
    "16",
    "record one run in N: the runs whose inputs' XXH3-64 is 0 mod N (1 records every run)",
);

const OPTIONS: &[OptionSpec] = &[EVERY.spec];

/// The `sample` setting.
pub struct Sample;

impl Pass for Sample {
    fn name(&self) -> &'static str {
        "sample"
    }
    fn kind(&self) -> PassKind {
        PassKind::Setting
    }
    fn doc(&self) -> &'static str {
        "record one run in N (every=N), chosen by XXH3-64 of the run's inputs (a repeated input is always sampled or never); native CPU sketches only"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        rw.set_sampling(opts.get(&EVERY)?)
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
pub(super) fn link() {}

inventory::submit! { PassRegistration(&Sample) }
