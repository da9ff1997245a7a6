//! `capture`: write the whole operand and output tensors of chosen matmul sites, on sampled
//! runs and within a byte budget, as numpy `.npy` files beside the recording (see
//! [`crate::capture`] for the directory layout and the budget rule). What sketches cannot
//! see (N:M structure, the spectrum, the quantization error of the real GEMM) is then measured
//! on the host by `opscope probe --capture DIR`.
//!
//! Each captured tensor becomes one extra graph output (after every sketch output), so RLX
//! copies it out on every run; the recorder drops it on runs the pass does not sample. Each
//! also gets a count-only sketch, so every tapped run still carries its compile tag.

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Text, Words};
use crate::rewrite::Rewrite;

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over matmul site names (as the matmul tap names them)");
const ROLES: Opt<Words> = Opt::words("roles", &["lhs", "rhs", "out"], "[lhs,rhs,out]", "which tensors to capture: lhs (activation), rhs (weight or 2nd operand), out");
const EVERY: Opt<u64> = Opt::uint("every", 1, 1 << 40, "1", "capture runs whose step is a multiple of N (weights: once per compile)");
const BUDGET: Opt<Text> = Opt::text(
    "budget",
    "64MiB",
    "byte budget of tensor data for the whole recording (B, KiB, MiB, GiB); when the next tensor does not fit, capture stops and sketches go on",
);

const OPTIONS: &[OptionSpec] = &[SITES.spec, ROLES.spec, EVERY.spec, BUDGET.spec];

/// The `capture` tap pass.
pub struct Capture;

impl Pass for Capture {
    fn name(&self) -> &'static str {
        "capture"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "write whole lhs/rhs/out tensors of matmul sites as .npy (sampled runs, byte budget) for host probes"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let roles = super::matmul::selected_roles(opts, &ROLES);
        let every = opts.get(&EVERY)?;
        let budget = crate::capture::parse_bytes(&opts.get(&BUDGET)?).map_err(|why| Error::Graph(format!("capture{{budget=..}}: {why}")))?;
        for (site_name, id, lhs, rhs, out) in super::matmul::logical_sites(rw) {
            if !patterns.matches(&site_name) {
                continue;
            }
            let site = rw.add_site_named(id, site_name, None);
            for role in &roles {
                let tensor = if *role == Role::LHS {
                    Some(lhs)
                } else if *role == Role::RHS {
                    rhs
                } else {
                    Some(out)
                };
                match tensor {
                    Some(t) => {
                        rw.capture(&site, role.clone(), t, every, budget);
                    }
                    None => rw.skip(&site, Some(role.clone()), None, "the op has no such operand".into()),
                }
            }
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&Capture) }
