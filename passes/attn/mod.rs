//! `attn`: tap every attention site, the Softmax over attention scores of an unfused attention
//! (`MatMul -> Softmax -> MatMul`, as an ONNX BERT arrives) and every fused `Op::Attention`,
//! and record per-head concentration (peak probability, entropy, top-k mass) and received mass
//! (attention sinks, heavy-hitter keys) with padding excluded.

pub mod lower;
pub mod probe;
pub mod rules;

use rlx_ir::op::{BinaryOp, MaskKind};
use rlx_ir::{Graph, NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Stats};
use crate::rewrite::{family, Rewrite};
use crate::sketch::{static_dims, SketchSpec};

use probe::{bhqk, stats, AttnProbe, AttnSource, FusedMask};

/// Role of the attention probabilities at an attention site.
pub const PROBS: Role = Role::new("probs");

const SITES: Opt<Globs> = Opt::globs(
    "sites",
    "[*]",
    "glob patterns over site names (the Softmax's or Attention's ONNX node name, else softmax.K / attention.K)",
);
const STATS: Opt<Stats> = Opt::stats(
    "stats",
    stats::ALL,
    "[all]",
    "statistics: per head peak, entropy, entropy_norm, topk_mass, sink_first, sink_last, pad_mass, recv_max; per position peak_pos, recv_pos",
);
const TOPK: Opt<u64> = Opt::uint("topk", 1, 65536, "8", "k of topk_mass: the probability mass a top-k sparse attention would keep per query");

const LOWER: Opt<bool> = Opt::bool(
    "lower",
    "false",
    "compute the probe with RLX primitive ops (the lowering a device without a native sketch kernel uses) even on the CPU",
);

const OPTIONS: &[OptionSpec] = &[SITES.spec, STATS.spec, TOPK.spec, LOWER.spec];

/// The `attn` tap pass.
pub struct AttnTap;

/// Walk back from the softmax input through elementwise and shape ops (both operands of a
/// binary op, a few steps deep): true if a matmul (the scores) is found.
pub(crate) fn from_matmul(g: &Graph, id: NodeId) -> bool {
    fn walk(g: &Graph, id: NodeId, depth: usize) -> bool {
        let n = g.node(id);
        if family(&n.op) == "matmul" {
            return true;
        }
        depth > 0
            && match &n.op {
                Op::Binary(_) => n.inputs.iter().any(|&i| walk(g, i, depth - 1)),
                Op::Activation(_) | Op::Reshape { .. } | Op::Transpose { .. } => walk(g, n.inputs[0], depth - 1),
                _ => false,
            }
    }
    walk(g, id, 6)
}

/// The additive mask of a softmax over scores: the operand of an `Add` feeding the softmax that
/// does not come from the scores matmul, with its dims mapped to `[B, H, Sq, Sk]`.
fn additive_bias(g: &Graph, softmax_in: NodeId, rank: usize) -> Option<(NodeId, [usize; 4])> {
    let n = g.node(softmax_in);
    let Op::Binary(BinaryOp::Add) = n.op else { return None };
    let (a, b) = (n.inputs[0], n.inputs[1]);
    let bias = match (from_matmul(g, a), from_matmul(g, b)) {
        (true, false) => b,
        (false, true) => a,
        _ => return None,
    };
    let d = static_dims(&g.node(bias).shape)?;
    if d.len() > rank || g.node(bias).shape.dtype() != rlx_ir::DType::F32 {
        return None;
    }
    // Right-align to the probabilities' rank, then map like `bhqk`.
    let mut full = vec![1usize; rank - d.len()];
    full.extend(d);
    let dims = match full.as_slice() {
        [b, h, q, k] => [*b, *h, *q, *k],
        [b, q, k] => [*b, 1, *q, *k],
        [q, k] => [1, 1, *q, *k],
        _ => return None,
    };
    Some((bias, dims))
}

impl Pass for AttnTap {
    fn name(&self) -> &'static str {
        "attn"
    }
    fn kind(&self) -> PassKind {
        PassKind::Tap
    }
    fn doc(&self) -> &'static str {
        "per-head attention concentration and received mass (sinks) at every score Softmax and fused Attention, padding excluded"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let stats = opts.stats(&STATS)?;
        let topk = opts.get(&TOPK)? as usize;
        rw.force_lowering(opts.get(&LOWER)?);
        rw.note_removed(|op| matches!(op, Op::Softmax { .. } | Op::Attention { .. }));
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id).clone();
            let is_site = match &node.op {
                Op::Softmax { axis } => {
                    let rank = node.shape.rank() as i32;
                    let last = *axis == -1 || *axis == rank - 1;
                    // Scores in, probabilities on to a matmul with V: attention, not a classifier
                    // head or a MoE router.
                    rank >= 2
                        && last
                        && from_matmul(rw.graph(), node.inputs[0])
                        && rw.users(id).iter().any(|u| family(&rw.graph().node(*u).op) == "matmul")
                }
                Op::Attention { .. } => true,
                _ => false,
            };
            if !is_site {
                continue;
            }
            let site_name = rw.site_name(id);
            if !patterns.matches(&site_name) {
                continue;
            }
            let site = rw.add_site(id, None);
            match attn_probe(rw.graph(), id, topk) {
                Ok((mut probe, mut inputs, mut note)) => {
                    // No mask of its own: self-attention takes its padding from the program's
                    // row mask (graph input `attention_mask`, one value per token), as the
                    // matmul tap does; only without one is padding counted as real.
                    if note.is_some() && probe.sq == probe.sk {
                        if let Some(mask) = rw.row_mask(probe.batch * probe.sk) {
                            match &mut probe.source {
                                AttnSource::Probs { rows, .. } | AttnSource::Fused { rows, .. } => *rows = true,
                            }
                            inputs.push(mask);
                            note = None;
                        }
                    }
                    if let Some(note) = note {
                        rw.skip(&site, Some(PROBS), Some(id), note);
                    }
                    let mut stats = stats.clone();
                    if topk >= probe.sk && stats.contains(&stats::TOPK_MASS) {
                        stats.retain(|s| !matches!(*s, stats::TOPK_MASS | stats::TOPK));
                        rw.skip(
                            &site,
                            Some(PROBS),
                            Some(id),
                            format!("topk_mass not computed: topk={topk} >= {} keys keeps every key (mass 1 by definition)", probe.sk),
                        );
                    }
                    if stats.contains(&stats::TOPK_MASS) {
                        stats.push(stats::TOPK); // the k that topk_mass is about travels with it
                    }
                    // A fused attention's probabilities are rebuilt from Q and K: listed with
                    // their own shape `[B, H, Sq, Sk]`, not Q's.
                    let dims = [probe.batch, probe.heads, probe.sq, probe.sk];
                    let spec = SketchSpec::for_probe(&probe, &stats);
                    match probe.source {
                        AttnSource::Fused { .. } => rw.tap_rebuilt(&site, PROBS, &inputs, spec, &dims),
                        AttnSource::Probs { .. } => rw.tap_inputs(&site, PROBS, &inputs, spec),
                    }
                }
                Err(why) => rw.skip(&site, Some(PROBS), Some(id), why),
            }
        }
        Ok(())
    }
}

/// The probe and its inputs for attention site `id`, plus a note when padding cannot be told.
fn attn_probe(g: &Graph, id: NodeId, topk: usize) -> Result<(AttnProbe, Vec<NodeId>, Option<String>), String> {
    let node = g.node(id);
    match &node.op {
        Op::Softmax { .. } => {
            let [b, h, q, k] = bhqk(&node.shape).ok_or("attention probabilities need a static rank 2-4 shape")?;
            if node.shape.dtype() != rlx_ir::DType::F32 {
                return Err("attention probabilities are not F32".into());
            }
            let geom = |source| AttnProbe { batch: b, heads: h, sq: q, sk: k, topk, source };
            Ok(match additive_bias(g, node.inputs[0], node.shape.rank()) {
                Some((bias, dims)) => (geom(AttnSource::Probs { bias: Some(dims), rows: false }), vec![id, bias], None),
                None => (
                    geom(AttnSource::Probs { bias: None, rows: false }),
                    vec![id],
                    Some("no additive mask feeds this softmax and the program has no attention_mask input: every query and key counts as non-padding".into()),
                ),
            })
        }
        Op::Attention { num_heads, head_dim, v_head_dim: _, mask_kind, score_scale, attn_logit_softcap } => {
            let (nh, dh) = (*num_heads, *head_dim);
            let qd = static_dims(&g.node(node.inputs[0]).shape).ok_or("Q has a symbolic dim")?;
            let kd = static_dims(&g.node(node.inputs[1]).shape).ok_or("K has a symbolic dim")?;
            if qd.len() != kd.len() {
                return Err(format!("Q rank {} and K rank {} differ", qd.len(), kd.len()));
            }
            // Layout dispatch as RLX 0.2.19's CPU kernel: rank 4 is [B,H,S,D] when dim 1 equals
            // the head count, else [B,S,H,D]; rank 3 is [B,S,H*D]; rank 2 is [S,H*D].
            let (batch, sq, sk, bhsd) =
                crate::analysis::attention_seqs(&qd, &kd, nh).ok_or_else(|| format!("fused attention of rank {} is not supported", qd.len()))?;
            let k_numel: usize = kd.iter().product();
            let kv_heads = (k_numel / (batch.max(1) * sk.max(1) * dh.max(1))).max(1);
            if qd.iter().product::<usize>() != batch * sq * nh * dh {
                return Err(format!("Q {qd:?} does not hold {nh} heads of width {dh}"));
            }
            let mask = match mask_kind {
                MaskKind::None => FusedMask::None,
                MaskKind::Causal => FusedMask::Causal,
                MaskKind::SlidingWindow(w) => FusedMask::Window(*w),
                MaskKind::Custom => FusedMask::Keys,
                MaskKind::Bias => FusedMask::Bias,
            };
            // Q or K sliced from a merged projection is read in place from it, as RLX's kernel
            // does (the slice itself is never written; see `backend_elided`).
            let view = |id: NodeId| -> (NodeId, Option<[usize; 2]>) {
                let mut src = id;
                while matches!(g.node(src).op, Op::Reshape { .. }) {
                    src = g.node(src).inputs[0];
                }
                match g.node(src).op {
                    Op::Narrow { axis, start, .. } if !bhsd && axis + 1 == g.node(src).shape.rank() => {
                        let parent = g.node(src).inputs[0];
                        match static_dims(&g.node(parent).shape).and_then(|d| d.last().copied()) {
                            Some(stride) => (parent, Some([start, stride])),
                            None => (id, None),
                        }
                    }
                    _ => (id, None),
                }
            };
            let ((q_in, q_view), (k_in, k_view)) = (view(node.inputs[0]), view(node.inputs[1]));
            let mut inputs = vec![q_in, k_in];
            if matches!(mask, FusedMask::Keys | FusedMask::Bias) {
                inputs.push(*node.inputs.get(3).ok_or("the attention's mask input is missing")?);
            }
            let probe = AttnProbe {
                batch,
                heads: nh,
                sq,
                sk,
                topk,
                source: AttnSource::Fused {
                    head_dim: dh,
                    kv_heads,
                    bhsd,
                    scale: score_scale.unwrap_or((dh as f32).powf(-0.5)),
                    softcap: attn_logit_softcap.unwrap_or(0.0),
                    mask,
                    q_view,
                    k_view,
                    rows: false,
                },
            };
            // Without a key mask input the probe cannot tell padding: with sequences padded on
            // the right, a causal attention's padding queries (and an unmasked one's padding
            // keys) count as real. Said in the manifest, as for a softmax without a mask.
            let note = matches!(mask, FusedMask::None | FusedMask::Causal | FusedMask::Window(_)).then(|| {
                "no key mask feeds this attention and the program has no attention_mask input: padding queries and keys, if any, count as non-padding".to_string()
            });
            Ok((probe, inputs, note))
        }
        _ => Err("not an attention site".into()),
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {
    std::hint::black_box([probe::link as fn(), rules::link]);
}

inventory::submit! { PassRegistration(&AttnTap) }
