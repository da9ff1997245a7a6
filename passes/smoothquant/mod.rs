//! `smoothquant`: SmoothQuant's per-channel migration of activation range into the weight
//! (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
//! Language Models", ICML 2023), as an actuation: run it before `fakequant` to measure what the
//! migration buys a W8A8 scheme.
//!
//! For a matmul `y = x W` with `x [.., K]` and a weight `W [K, N]`, per input channel `j`:
//!
//! ```text
//! a_j = max |x[.., j]|      over every row of the current run (the lhs's per-channel absmax;
//!                          `padding=exclude`: over the rows `attention_mask` marks as tokens)
//! w_j = max |W[j, :]|       the weight row's absmax
//! s_j = a_j^alpha / w_j^(1 - alpha)       (a_j or w_j of 0 counts as 1: s stays finite, > 0)
//! x'  = x / s      W' = diag(s) W         so x' W' = x W up to f32 rounding
//! ```
//!
//! `alpha` is the migration strength (the paper's 0.5 default; 0.75-0.85 for models with larger
//! outliers). At `alpha = 0.5` each channel's range is split evenly: `max|x'_j| = max|W'_j| =
//! sqrt(a_j w_j)`. Every step is one RLX graph op (Abs, Reduce Max, Compare + Where, Pow, Div,
//! Mul, Reshape), so the product `x' W'` runs on RLX's own matmul.
//!
//! The activation scales are **dynamic**: computed from the run being measured, so the result is
//! SmoothQuant with the calibration set equal to the evaluation batch, an upper bound on a
//! static calibration (the paper calibrates on 512 Pile sentences). The weight `W'` is then
//! a per-run tensor; `fakequant{weights=true}` quantizes it as the weight (per output column),
//! which is what a deployment with the static scales folded into its int8 weights computes.
//!
//! Forms: `MatMul` (lhs any rank), `FusedMatMulBiasAct`, `FusedMatMulResidual` with a weight rhs
//! of rank 2 (reachable only from parameters through reshapes, transposes and concats). RLX's
//! merged Q/K/V projection is one site: one `s` over the concatenated weight, as the paper shares
//! it between the three projections of one input. Skipped, with a reason: `DequantMatMul` (its
//! packed weight cannot be rescaled in the graph), an activation rhs (attention's BMMs), a non-f32
//! operand, symbolic dims, a weight of rank other than 2.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{BinaryOp, CmpOp, ReduceOp};
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Word};
use crate::rewrite::Rewrite;
use crate::sketch::static_dims;

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over site names (as the matmul tap names them)");
const ALPHA: Opt<f32> =
    Opt::float("alpha", 0.0, 1.0, "0.5", "migration strength: s = absmax(x)^alpha / absmax(W row)^(1-alpha) (Xiao et al. 2023: 0.5)");

const PADDING: Opt<Word> = Opt::word(
    "padding",
    &["include", "exclude"],
    "include",
    "activation absmax a_j over every row (include: the padded batch as a run-time migration sees it) or over the rows the graph input attention_mask marks as tokens (exclude)",
);

const OPTIONS: &[OptionSpec] = &[SITES.spec, ALPHA.spec, PADDING.spec];

/// Name prefix of the nodes this pass adds; the migrated weight is `PREFIX<site>/weight`, which
/// `fakequant` treats as the site's weight.
pub const PREFIX: &str = "opscope/smoothquant/";

/// The `smoothquant` actuation pass.
pub struct SmoothQuant;

/// True if `id` is a parameter reached through reshapes, transposes and concats only (also
/// `fakequant`'s test of a weight).
pub(crate) fn is_param_weight(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    match n.op {
        Op::Param { .. } => true,
        Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } => n.inputs.iter().all(|&i| is_param_weight(g, i)),
        _ => false,
    }
}

/// True if `id` is a weight this pass migrated (`fakequant` quantizes it as the weight).
pub fn is_migrated_weight(g: &Graph, id: NodeId) -> bool {
    g.node(id).name.as_deref().is_some_and(|n| n.starts_with(PREFIX) && n.ends_with("/weight"))
}

/// Why the operands `(x, w)` cannot be smoothed, if they cannot.
fn unsupported(g: &Graph, x: NodeId, w: NodeId) -> Option<(Role, NodeId, String)> {
    for (role, id) in [(Role::LHS, x), (Role::RHS, w)] {
        let s = g.shape(id);
        if s.dtype() != DType::F32 {
            return Some((role, id, format!("operand is {:?}, not f32", s.dtype())));
        }
        if static_dims(s).is_none() {
            return Some((role, id, "symbolic dims: the per-channel scale's broadcast needs static shapes".into()));
        }
    }
    let (xr, wr) = (g.shape(x).rank(), g.shape(w).rank());
    if wr != 2 {
        return Some((Role::RHS, w, format!("weight has rank {wr}: smoothquant migrates into a [K, N] weight")));
    }
    if xr < 1 {
        return Some((Role::LHS, x, "lhs has rank 0".into()));
    }
    None
}

/// `where(v > 0, v, 1)`.
fn positive_or_one(g: &mut Graph, v: NodeId, ones: &[usize]) -> NodeId {
    let shape = g.shape(v).clone();
    let (zero, one) = (g.full(ones, 0.0, DType::F32), g.full(ones, 1.0, DType::F32));
    let pos = g.add_node(Op::Compare(CmpOp::Gt), vec![v, zero], shape.clone().with_dtype(DType::Bool));
    g.add_node(Op::Where, vec![pos, v, one], shape)
}

/// Append the migration of `x [.., K] @ w [K, N]`, `a_j` over the token rows of `rows` when
/// given (see `fakequant::abs_of_token_rows`); returns `(x', W')`.
fn migrate(g: &mut Graph, site: &str, x: NodeId, w: NodeId, alpha: f32, rows: Option<NodeId>) -> (NodeId, NodeId) {
    let xs = g.shape(x).clone();
    let rank = xs.rank();
    let k = *static_dims(&xs).expect("checked static").last().expect("rank >= 1");
    let xones = vec![1usize; rank];
    let row = {
        let mut d = xones.clone();
        d[rank - 1] = k;
        d
    };
    let sx = Shape::new(&row, DType::F32);
    let sw = Shape::new(&[k, 1], DType::F32);
    // a [1.., K]: absmax over every axis but the last.
    let ax = match rows {
        Some(mask) => super::fakequant::abs_of_token_rows(g, x, mask),
        None => g.abs(x),
    };
    let a = g.reduce(ax, ReduceOp::Max, (0..rank - 1).collect(), true, sx.clone());
    let a = positive_or_one(g, a, &xones);
    // w [K, 1]: absmax over N, as a [1.., K] row.
    let aw = g.abs(w);
    let wmax = g.reduce(aw, ReduceOp::Max, vec![1], true, sw.clone());
    let wmax = g.add_node(Op::Reshape { new_shape: row.iter().map(|&d| d as i64).collect() }, vec![wmax], sx.clone());
    let wmax = positive_or_one(g, wmax, &xones);
    let (pa, pw) = (g.full(&xones, alpha, DType::F32), g.full(&xones, 1.0 - alpha, DType::F32));
    let num = g.binary(BinaryOp::Pow, a, pa, sx.clone());
    let den = g.binary(BinaryOp::Pow, wmax, pw, sx.clone());
    let s = g.div(num, den);
    g.node_mut(s).name = Some(format!("{PREFIX}{site}/scale"));
    let xm = g.div(x, s);
    g.node_mut(xm).name = Some(format!("{PREFIX}{site}/activation"));
    let scol = g.add_node(Op::Reshape { new_shape: vec![k as i64, 1] }, vec![s], sw);
    let wm = g.mul(w, scol);
    g.node_mut(wm).name = Some(format!("{PREFIX}{site}/weight"));
    (xm, wm)
}

impl Pass for SmoothQuant {
    fn name(&self) -> &'static str {
        "smoothquant"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "SmoothQuant migration before every matmul: x' = x / s, W' = diag(s) W, s_j = absmax(x_j)^alpha / absmax(W_j)^(1-alpha) (dynamic scales)"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let alpha = opts.get(&ALPHA)?;
        let exclude_padding = opts.get(&PADDING)? == "exclude";
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id);
            let dequant = matches!(node.op, Op::DequantMatMul { .. });
            if !(dequant || matches!(node.op, Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual)) {
                continue;
            }
            let site = rw.site_name(id);
            if !patterns.selects_op("smoothquant", &site.split('+').collect::<Vec<_>>())? {
                continue;
            }
            let (x, w) = (node.inputs[0], node.inputs[1]);
            if dequant {
                rw.skip(&site, Some(Role::RHS), Some(w), "DequantMatMul: its packed weight cannot be rescaled in the graph".into());
                continue;
            }
            if !is_param_weight(rw.graph(), w) {
                rw.skip(&site, Some(Role::RHS), Some(w), "rhs is an activation (an attention BMM): nothing to migrate into".into());
                continue;
            }
            if let Some((role, t, why)) = unsupported(rw.graph(), x, w) {
                rw.skip(&site, Some(role), Some(t), why);
                continue;
            }
            let rows = if exclude_padding {
                match super::fakequant::token_rows(rw, x) {
                    Ok(m) => Some(m),
                    Err(why) => {
                        rw.skip(&site, Some(Role::LHS), Some(x), why);
                        continue;
                    }
                }
            } else {
                None
            };
            let g = rw.graph_mut();
            let (xm, wm) = migrate(g, &site, x, w, alpha, rows);
            let mut inputs = g.node(id).inputs.clone();
            inputs[0] = xm;
            inputs[1] = wm;
            g.set_inputs(id, inputs);
            let over = if rows.is_some() { " over token rows" } else { "" };
            rw.actuate(&site, id, format!("smoothquant alpha {alpha}: x / s, diag(s) W, dynamic per-channel scales{over}"));
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&SmoothQuant) }
