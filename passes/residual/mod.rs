//! `residual`: tap every residual connection `x + f(x)` and record block influence: the
//! branch-to-stream norm ratio and the cosine between the block's input and output.

pub mod probe;
pub mod rules;

use rlx_ir::{DType, NodeId, Op, Shape};

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

const OPTIONS: &[OptionSpec] = &[BLOCKS.spec, MASK.spec, STATS.spec];

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
        let bypassed: Vec<String> =
            rw.actuations().iter().filter(|a| a.site.starts_with("block.")).map(|a| a.site.clone()).collect();
        for site in bypassed {
            rw.skip(&site, Some(BLOCK), None, "bypassed by an earlier skip: not observed".into());
        }
        for b in rw.residual_blocks() {
            let name = format!("block.{}", b.index);
            if !patterns.iter().any(|p| p.matches(&name)) {
                continue;
            }
            let site = rw.add_site_named(b.node, name, None);
            let shape = rw.graph().node(b.stream).shape.clone();
            match static_dims(&shape) {
                Some(d) if !d.is_empty() => {
                    let width = *d.last().unwrap_or(&1);
                    let rows = d.iter().product::<usize>() / width.max(1);
                    let mask = if opts.get(&MASK)? == "auto" { row_mask(rw, rows) } else { None };
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

/// The graph input `attention_mask` as an F32 row mask, if it holds exactly `rows` values (one
/// per token of the residual stream). The cast node is shared by every block.
fn row_mask(rw: &mut Rewrite, rows: usize) -> Option<NodeId> {
    let g = rw.graph();
    let input = g.nodes().iter().find(|n| matches!(&n.op, Op::Input { name } if name == "attention_mask"))?;
    let dims = static_dims(&input.shape)?;
    if dims.iter().product::<usize>() != rows {
        return None;
    }
    if input.shape.dtype() == DType::F32 {
        return Some(input.id);
    }
    let id = input.id;
    let shape = Shape::new(&dims, DType::F32);
    let cast = g
        .nodes()
        .iter()
        .find(|n| n.inputs == [id] && n.op == (Op::Cast { to: DType::F32 }) && n.name.as_deref() == Some("opscope/attention_mask/f32"))
        .map(|n| n.id);
    Some(cast.unwrap_or_else(|| {
        let g = rw.graph_append();
        let c = g.add_node(Op::Cast { to: DType::F32 }, vec![id], shape);
        g.node_mut(c).name = Some("opscope/attention_mask/f32".into());
        c
    }))
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {
    std::hint::black_box([probe::link as fn(), rules::link]);
}

inventory::submit! { PassRegistration(&ResidualTap) }
