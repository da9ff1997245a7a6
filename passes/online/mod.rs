//! `online`: every native tensor sketch of the pipeline also feeds the process-wide online state
//! of its `site/role` (DDSketch of |x| at 1% relative accuracy, HyperLogLog++ of the tensors'
//! content hashes; see [`crate::online`]), on the runs it computes: with `sample{every=N}`,
//! the sampled ones.

use crate::error::Error;
use crate::pass::{OptionSpec, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::Rewrite;

/// The `online` setting.
pub struct Online;

impl Pass for Online {
    fn name(&self) -> &'static str {
        "online"
    }
    fn kind(&self) -> PassKind {
        PassKind::Setting
    }
    fn doc(&self) -> &'static str {
        "feed mergeable per-site state from every native tensor sketch: DDSketch of |x| (alpha 1%: p50/p99/p99.9, absmax/p99.9 headroom) and HyperLogLog++ of distinct tensors (opscope::online)"
    }
    fn options(&self) -> &'static [OptionSpec] {
        &[]
    }

    fn run(&self, _opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        rw.set_online();
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
pub(super) fn link() {}

inventory::submit! { PassRegistration(&Online) }
