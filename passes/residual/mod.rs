//! `residual`: tap every residual connection `x + f(x)` and record block influence: the
//! branch-to-stream norm ratio and the cosine between the block's input and output.

pub mod lower;
pub mod probe;
pub mod rules;



use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Stats, Word};
use crate::rewrite::Rewrite;
use crate::sketch::{static_dims, SketchSpec};

use probe::{stats, ResidualProbe};

/// Role of a residual block: the stream `x` and the branch `f(x)` of `x + f(x)`.
pub const BLOCK: Role = Role::new("block");

const BLOCKS: Opt<Globs> = Opt::globs(
    "blocks",
    "[*]",
    "glob patterns over block names block.K (K = execution order, the numbering skip{blocks=..} uses)",
);
const MASK: Opt<Word> = Opt::word(
    "mask",
    &["auto", "none"],
    "auto",
    "auto: rows where the graph input attention_mask (the Hugging Face ONNX export name) is 0 are padding, excluded; none: every row counts",
);
const STATS: Opt<Stats> = Opt::stats(
    "stats",
    stats::ALL,
    "[all]",
    "ratio = ||f(x)||/||x||, cos = mean over rows of cos(x, x+f(x)) (1 - cos is ShortGPT's block influence), cos_row = per row",
);

const LOWER: Opt<bool> = Opt::bool(
    "lower",
    "false",
    "compute the probe with RLX primitive ops (the lowering a device without a native sketch kernel uses) even on the CPU",
);

const OPTIONS: &[OptionSpec] = &[BLOCKS.spec, MASK.spec, STATS.spec, LOWER.spec];

/// The `residual` tap pass.
pub struct ResidualTap;

impl Pass for ResidualTap {
    fn name(&self) -> &'static str {
        "residual"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "block influence at every residual x + f(x): ||f(x)||/||x|| and cos(x, x + f(x)), blocks named block.K in execution order"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&BLOCKS)?;
        let stats = opts.stats(&STATS)?;
        rw.force_lowering(opts.get(&LOWER)?);
        let bypassed: Vec<String> =
            rw.actuations().iter().filter(|a| a.site.starts_with("block.")).map(|a| a.site.clone()).collect();
        for site in bypassed {
            rw.skip(&site, Some(BLOCK), None, "bypassed by an earlier skip: not observed".into());
        }
        for b in rw.residual_blocks() {
            let name = format!("block.{}", b.index);
            if !patterns.matches(&name) {
                continue;
            }
            let site = rw.add_site_named(b.node, name, None);
            let shape = rw.graph().node(b.stream).shape.clone();
            match static_dims(&shape) {
                Some(d) if !d.is_empty() => {
                    let width = *d.last().unwrap_or(&1);
                    let rows = d.iter().product::<usize>() / width.max(1);
                    let mask = if opts.get(&MASK)? == "auto" { rw.row_mask(rows) } else { None };
                    let probe = ResidualProbe { rows, width, masked: mask.is_some() };
                    let mut inputs = vec![b.stream, b.branch];
                    inputs.extend(mask);
                    rw.tap_inputs(&site, BLOCK, &inputs, SketchSpec::for_probe(&probe, &stats));
                }
                _ => rw.skip(&site, Some(BLOCK), Some(b.stream), "the residual stream's shape is symbolic or scalar".into()),
            }
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {
    std::hint::black_box([probe::link as fn(), rules::link]);
}

inventory::submit! { PassRegistration(&ResidualTap) }
