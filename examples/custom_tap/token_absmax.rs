//! `token_absmax`: a tap pass defined outside opscope. For every matmul it records the
//! activation's per-token absmax, `max_j |x[r, j]|` for each row `r` of the lhs flattened to
//! `[rows, width]`: the scale a per-token int8 quantizer would use (LLM.int8's vector-wise
//! quantization, Dettmers et al. 2022). Three registrations, all in this file:
//! - the statistic ([`stats::TOKEN_ABSMAX`]) with `opscope::stats!` and a `StatTable`;
//! - the probe kernel ([`TokenAbsmax`], a `TypedProbe`) with a `ProbeRegistration`: the sketch
//!   op dispatches to it by its name and RLX runs it as the sketch op's CPU kernel;
//! - the pass ([`TokenAbsmaxTap`]) with a `PassRegistration`.

use opscope::error::Error;
use opscope::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration};
use opscope::rewrite::{family, Rewrite};
use opscope::sketch::probe::{input, need};
use opscope::sketch::{static_dims, ProbeRegistration, SketchSpec, Stat, StatTable, Typed, TypedProbe};
use opscope::Role;
use rlx_cpu::op_registry::CpuTensorRef;
use rlx_ir::{NodeId, Op};
use serde::{Deserialize, Serialize};

opscope::stats! {
    /// The statistic of this tap.
    pub mod stats {
        /// Per row (token): max |x| over the row's finite values (`rows` values).
        TOKEN_ABSMAX = "token_absmax", Vector;
    }
}

/// The probe's parameters: the lhs viewed as `[rows, width]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenAbsmax {
    /// Rows (tokens): every leading dim flattened.
    pub rows: usize,
    /// Width (the reduction axis K).
    pub width: usize,
}

impl TypedProbe for TokenAbsmax {
    const NAME: &'static str = "TokenAbsmax";

    fn stats(&self) -> &'static [Stat] {
        stats::ALL
    }

    fn stat_len(&self, _: Stat) -> usize {
        self.rows
    }

    fn execute(&self, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String> {
        let x = input(inputs, 0, "matmul lhs")?;
        need(x.len(), self.rows * self.width, "matmul lhs")?;
        let absmax = x
            .chunks(self.width.max(1))
            .map(|row| row.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        Ok(vec![(stats::TOKEN_ABSMAX, absmax)])
    }
}

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over matmul site names");
const OPTIONS: &[OptionSpec] = &[SITES.spec];

/// The `token_absmax` tap pass.
pub struct TokenAbsmaxTap;

impl Pass for TokenAbsmaxTap {
    fn name(&self) -> &'static str {
        "token_absmax"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "per-token absmax of every matmul's activation (the per-token int8 scale)"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id).clone();
            if family(&node.op) != "matmul" || matches!(node.op, Op::DequantMatMul { .. }) {
                continue;
            }
            let name = rw.site_name(id);
            if !patterns.matches(&name) {
                continue;
            }
            let site = rw.add_site(id, None);
            let lhs = node.inputs[0];
            match static_dims(&rw.graph().node(lhs).shape) {
                Some(d) if !d.is_empty() => {
                    let width = d[d.len() - 1];
                    let probe = TokenAbsmax { rows: d.iter().product::<usize>() / width.max(1), width };
                    rw.tap(&site, Role::LHS, lhs, SketchSpec::for_probe(&probe, stats::ALL));
                }
                _ => rw.skip(&site, Some(Role::LHS), Some(lhs), "the lhs shape is symbolic".into()),
            }
        }
        Ok(())
    }
}

inventory::submit! { StatTable(stats::ALL) }
inventory::submit! { ProbeRegistration(&Typed::<TokenAbsmax>::NEW) }
inventory::submit! { PassRegistration(&TokenAbsmaxTap) }
