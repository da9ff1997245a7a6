//! `fakequant`: symmetric, dynamic fake-quantization of every matmul site's activation input
//! (and optionally its weight), to simulate W8A8 / int4 inference and measure the decision.
//!
//! For a tensor `x` and a scope (the slices that share one scale), in f32:
//!
//! ```text
//! Q  = 2^(bits-1) - 1                        (127 for int8, 7 for int4)
//! s  = (clip * absmax) / Q                   absmax = max |x| over the slice (clip = 1: absmax / Q)
//! s' = s where s > 0 else 1                  an all-zero slice gives 0, never NaN
//! q  = clamp(round(x / s'), lo, hi)          lo = -Q (narrow) or -Q-1 (full), hi = Q
//! y  = q * s'
//! ```
//!
//! Every step is one RLX graph op (Abs, Reduce Max with `keep_dim`, Binary Mul/Div with
//! broadcasting, Compare + Where, Round or Floor/Sign, Clamp), so a host implementation doing
//! the same f32 operations in the same order reproduces it bit for bit (`tests/fakequant.rs`).
//! Scales are dynamic (computed from the current run's tensor), as in ONNX Runtime's dynamic
//! quantization and LLM.int8's per-token scales (Dettmers et al. 2022).
//!
//! Scopes (`scope` option, for the activation):
//! - `token`: one scale per row, absmax over the last axis (per-token; deployable: the scale
//!   factors out of an integer GEMM as a row scale of the output).
//! - `channel`: one scale per feature, absmax over every axis except the last. The last axis of
//!   the lhs is the GEMM's reduction axis K, so a per-channel activation scale varies inside
//!   each dot product and cannot be factored out of an integer GEMM: this is an accuracy upper
//!   bound, not a deployable int8 kernel. (SmoothQuant, Xiao et al. 2023, makes it deployable by
//!   migrating the per-channel factor into the weights.)
//! - `tensor`: one scale for the whole tensor.
//!
//! With `weights=true`, an rhs that is a weight (reachable only from parameters through
//! reshapes, transposes and concats) is also quantized, per output channel: one scale per
//! column n of `W[K,N]`, absmax over K (the axis before last). Per-token activations times
//! per-column weights is W8A8 as an integer GEMM computes it:
//! `y[m,n] = s_x[m] * s_w[n] * sum_k q_x[m,k] * q_w[k,n]`.
//!
//! Rounding (`rounding`): `even` is round-half-to-even, RLX's `Activation::Round` (the CPU kernel
//! calls `f32::round_ties_even`), as in ONNX QuantizeLinear, TensorRT, numpy `rint` and
//! `torch.round`. `away` is round-half-away-from-zero, C `roundf` / Rust `f32::round`, built as
//! `sign(r) * (floor(|r|) + (frac >= 0.5 ? 1 : 0))` with `frac = |r| - floor(|r|)` (exact in
//! f32). The shorter `sign(r) * floor(|r| + 0.5)` is not used: for `r = 0.49999997` the f32 sum
//! `|r| + 0.5` rounds up to 1.0, so it would give 1 where `roundf` gives 0.
//!
//! Range (`range`): `narrow` clamps codes to `[-Q, Q]` (symmetric, zero-centred: the int8
//! weight range of TensorRT and of the TFLite/LiteRT quantization spec, TensorFlow's
//! `narrow_range=True`, and LLM.int8's `round(127 * x / absmax)`); `full` to `[-Q-1, Q]`, the
//! whole two's-complement range (ONNX QuantizeLinear saturation: int8 `[-128, 127]`, int4
//! `[-8, 7]`).
//!
//! `bits`, `rounding`, `range` and `clip` apply to the weight as to the activation.
//!
//! Only the matmul's own operand is rewired: other users of `x` still see the f32 tensor.
//! Forms: `MatMul` (any rank), `FusedMatMulBiasAct`, `FusedMatMulResidual` (lhs = input 0,
//! rhs = input 1), and `DequantMatMul`, whose activation is fake-quantized while its weight
//! stays in its packed format (so on a Q4_1 model `fakequant` measures W4A8 with the file's own
//! 4-bit weights; `weights=true` notes that the weight is kept). A horizontally merged Q/K/V
//! matmul is one site. Skipped, with a reason:
//! a non-f32 operand, a symbolic shape (RLX
//! 0.2.19's CPU binary kernel broadcasts `[M,1]` against `[M,K]` correctly only with static
//! dims), an operand of rank < 2.

use std::collections::HashMap;

use rlx_ir::infer::GraphExt;
use rlx_ir::op::{Activation, CmpOp, ReduceOp};
use rlx_ir::{shape, DType, Graph, NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Word};
use crate::rewrite::Rewrite;
use crate::sketch::static_dims;

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over site names (as the matmul tap names them)");
const BITS: Opt<u64> = Opt::uint("bits", 2, 8, "8", "code width: Q = 2^(bits-1) - 1 (127 for int8, 7 for int4)");
const SCOPE: Opt<Word> = Opt::word(
    "scope",
    &["token", "channel", "tensor"],
    "token",
    "activation scale per row (token), per feature (channel; an upper bound, not an int8 GEMM), or per tensor",
);
const WEIGHTS: Opt<bool> = Opt::bool(
    "weights",
    "false",
    "also fake-quantize a parameter-derived rhs, per output column (absmax over K): W8A8",
);
const ROUNDING: Opt<Word> = Opt::word(
    "rounding",
    &["even", "away"],
    "even",
    "ties: half-to-even (ONNX, TensorRT, numpy rint) or half-away-from-zero (C roundf)",
);
const RANGE: Opt<Word> = Opt::word(
    "range",
    &["narrow", "full"],
    "narrow",
    "codes in [-Q, Q] (narrow, symmetric) or [-Q-1, Q] (full two's complement)",
);
const BMM: Opt<bool> = Opt::bool(
    "bmm",
    "false",
    "also quantize matmuls whose rhs is an activation (attention's Q@K^T and P@V, lhs only); W8A8 keeps them in float by default, as LLM.int8 does",
);
const CLIP: Opt<f32> = Opt::float("clip", 0.01, 1.0, "1", "scale = clip * absmax / Q; values beyond the clipped range saturate");

const PADDING: Opt<Word> = Opt::word(
    "padding",
    &["include", "exclude"],
    "include",
    "per-tensor and per-channel activation scales over every row (include: what a run-time quantizer of the padded batch sees) or over the rows the graph input attention_mask marks as tokens (exclude: the same scale whatever the batch's padding); per-token scales are per row either way",
);

const OPTIONS: &[OptionSpec] = &[SITES.spec, BITS.spec, SCOPE.spec, WEIGHTS.spec, ROUNDING.spec, RANGE.spec, BMM.spec, CLIP.spec, PADDING.spec];

/// The `fakequant` actuation pass.
pub struct FakeQuant;

/// A resolved quantizer: `q = clamp(round(x / s'), lo, hi)`, `s = clip * absmax / qmax`.
/// (Also `staticquant`'s per-column weight quantizer.)
#[derive(Clone, Copy)]
pub(super) struct Quantizer {
    pub(super) qmax: f32,
    pub(super) lo: f32,
    pub(super) clip: f32,
    pub(super) away: bool,
}

/// True if `id` is a weight: reachable only from parameters through reshapes, transposes and
/// concats, or a weight `smoothquant` migrated (`diag(s) W`, quantized as the weight a
/// deployment would fold its static scales into). Constants do not count: RLX 0.2.19's constant folder (`rlx-compile` `const_fold.rs`)
/// evaluates `Round` as `f32::round` (half away from zero), unlike its kernels, so a quantizer
/// over a constant-only tensor could be folded with other tie-breaking.
fn is_weight(g: &Graph, id: NodeId) -> bool {
    super::smoothquant::is_param_weight(g, id) || super::smoothquant::is_migrated_weight(g, id)
}

/// Why `id` cannot be fake-quantized, if it cannot.
fn unsupported(g: &Graph, id: NodeId) -> Option<String> {
    let s = g.shape(id);
    if s.dtype() != DType::F32 {
        Some(format!("operand is {:?}, not f32", s.dtype()))
    } else if static_dims(s).is_none() {
        Some("symbolic dims: RLX's CPU broadcast of a per-row scale needs static shapes".into())
    } else if s.rank() < 2 {
        Some(format!("operand has rank {}, a matmul operand needs 2 or more", s.rank()))
    } else {
        None
    }
}

/// Append the fake-quantizer of `x` with one scale per slice over `axes` and return its output.
pub(super) fn fake_quant(g: &mut Graph, x: NodeId, axes: Vec<usize>, qz: Quantizer) -> NodeId {
    fake_quant_rows(g, x, axes, qz, None)
}

/// `|x|` on the rows `mask` marks as tokens (an F32 mask with one value per row of `x`, its
/// leading axes flattened; a row counts where it is >= 0.5), 0 on the others: what a max over
/// rows of it reads is the tokens' (also `smoothquant`'s). A `Where`, not a product: a padding
/// row holding an Inf would make 0 * Inf = NaN. `x` has static dims.
pub(super) fn abs_of_token_rows(g: &mut Graph, x: NodeId, mask: NodeId) -> NodeId {
    let xs = g.shape(x).clone();
    let abs = g.abs(x);
    let dims = static_dims(&xs).expect("static dims (checked by the caller)");
    let mut row_dims: Vec<i64> = dims[..dims.len() - 1].iter().map(|&d| d as i64).collect();
    row_dims.push(1);
    let m = g.reshape_(mask, row_dims);
    let m = g.add_node(Op::Expand { target_shape: dims.iter().map(|&d| d as i64).collect() }, vec![m], xs.clone());
    let half = g.full(&dims, 0.5, DType::F32);
    let token = g.add_node(Op::Compare(CmpOp::Ge), vec![m, half], xs.clone().with_dtype(DType::Bool));
    let zero = g.full(&dims, 0.0, DType::F32);
    g.add_node(Op::Where, vec![token, abs, zero], xs)
}

/// The graph's row mask for `x` (one value per row of `x`, its leading axes flattened; see
/// [`Rewrite::row_mask`]), or why `padding=exclude` cannot take its scales over token rows.
pub(super) fn token_rows(rw: &mut Rewrite, x: NodeId) -> Result<NodeId, String> {
    let dims = static_dims(rw.graph().shape(x)).ok_or("symbolic dims")?;
    let n: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    rw.row_mask(n).ok_or_else(|| {
        format!("padding=exclude needs a graph input attention_mask with one value per row of lhs ({n} rows): none here; use padding=include")
    })
}

/// [`fake_quant`] whose scales read only the rows `rows` marks as tokens (an F32 mask with one
/// value per row of `x`, `x`'s leading axes flattened; a row counts where it is >= 0.5): every
/// row is quantized, the padding rows with the tokens' scales.
fn fake_quant_rows(g: &mut Graph, x: NodeId, axes: Vec<usize>, qz: Quantizer, rows: Option<NodeId>) -> NodeId {
    let xs = g.shape(x).clone();
    let ones = vec![1usize; xs.rank()];
    let c = |g: &mut Graph, v: f32| g.full(&ones, v, DType::F32);
    let abs = match rows {
        Some(mask) => abs_of_token_rows(g, x, mask),
        None => g.abs(x),
    };
    let rs = shape::reduce_shape(&xs, &axes, true).expect("reduce shape of a static tensor");
    let mut s = g.reduce(abs, ReduceOp::Max, axes, true, rs.clone());
    if qz.clip != 1.0 {
        let k = c(g, qz.clip);
        s = g.mul(k, s);
    }
    let (q, zero, one) = (c(g, qz.qmax), c(g, 0.0), c(g, 1.0));
    s = g.div(s, q);
    let pos = g.add_node(Op::Compare(CmpOp::Gt), vec![s, zero], rs.clone().with_dtype(DType::Bool));
    let s = g.add_node(Op::Where, vec![pos, s, one], rs);
    let r = g.div(x, s);
    let code = if qz.away {
        let a = g.abs(r);
        let f = g.activation(Activation::Floor, a, xs.clone());
        let frac = g.sub(a, f);
        let half = c(g, 0.5);
        let up = g.add_node(Op::Compare(CmpOp::Ge), vec![frac, half], xs.clone().with_dtype(DType::Bool));
        let inc = g.add_node(Op::Where, vec![up, one, zero], xs.clone());
        let mag = g.add(f, inc);
        let sign = g.activation(Activation::Sign, r, xs.clone());
        g.mul(sign, mag)
    } else {
        g.activation(Activation::Round, r, xs.clone())
    };
    let code = g.clamp_(code, qz.lo, qz.qmax);
    g.mul(code, s)
}

impl Pass for FakeQuant {
    fn name(&self) -> &'static str {
        "fakequant"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "fake-quantize every matmul's activation (and optionally weight): y = clamp(round(x/s), lo, hi) * s, s = clip*absmax/Q"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let bits = opts.get(&BITS)?;
        let qmax = ((1u32 << (bits - 1)) - 1) as f32;
        let scope = opts.get(&SCOPE)?;
        let weights = opts.get(&WEIGHTS)?;
        let rounding = opts.get(&ROUNDING)?;
        let full = opts.get(&RANGE)? == "full";
        let clip = opts.get(&CLIP)?;
        let exclude_padding = opts.get(&PADDING)? == "exclude" && scope != "token";
        let qz = Quantizer { qmax, lo: if full { -qmax - 1.0 } else { -qmax }, clip, away: rounding == "away" };
        let ties = if qz.away { "half-away" } else { "half-even" };
        let settings = format!("round {ties}, codes [{},{}], clip {clip}", qz.lo, qmax);

        // One quantizer per (tensor, is-weight): Q, K and V projections of one x share it.
        let bmm = opts.get(&BMM)?;
        let mut made: HashMap<(NodeId, bool), NodeId> = HashMap::new();
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id);
            let dequant = matches!(node.op, Op::DequantMatMul { .. });
            if !(dequant || matches!(node.op, Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual)) {
                continue;
            }
            let (lhs, rhs) = (node.inputs[0], node.inputs.get(1).copied());
            let site = rw.site_name(id);
            if !patterns.selects_op("fakequant", &site.split('+').collect::<Vec<_>>())? {
                continue;
            }
            if !dequant && !bmm && !rhs.is_some_and(|r| is_weight(rw.graph(), r)) {
                // Activation x activation (attention BMMs): W8A8 schemes keep these in float
                // (LLM.int8, Dettmers et al. 2022); `bmm=true` quantizes their lhs.
                rw.skip(&site, None, None, "rhs is an activation (an attention BMM): left in float; bmm=true quantizes it".into());
                continue;
            }
            if let Some(why) = unsupported(rw.graph(), lhs) {
                rw.skip(&site, Some(Role::LHS), Some(lhs), why);
                continue;
            }
            let rank = rw.graph().shape(lhs).rank();
            let axes: Vec<usize> = match scope.as_str() {
                "token" => vec![rank - 1],
                "channel" => (0..rank - 1).collect(),
                _ => (0..rank).collect(),
            };
            // With padding=exclude, the token rows of lhs (its leading axes flattened).
            let rows = if exclude_padding {
                match token_rows(rw, lhs) {
                    Ok(m) => Some(m),
                    Err(why) => {
                        rw.skip(&site, Some(Role::LHS), Some(lhs), format!("{why} or scope=token"));
                        continue;
                    }
                }
            } else {
                None
            };
            let mut inputs = rw.graph().node(id).inputs.clone();
            let mut action = format!("fake-quant lhs int{bits} per-{scope}{}", if rows.is_some() { " (scale over token rows)" } else { "" });
            let rhs_weight = match rhs {
                Some(r) if dequant => {
                    if weights {
                        let why = "DequantMatMul: its weight is already quantized (the packed format is the W of WxA8): kept";
                        rw.skip(&site, Some(Role::RHS), Some(r), why.into());
                    }
                    action.push_str(" (weight kept in its packed format)");
                    None
                }
                Some(r) if weights && is_weight(rw.graph(), r) => match unsupported(rw.graph(), r) {
                    None => Some(r),
                    Some(why) => {
                        rw.skip(&site, Some(Role::RHS), Some(r), why);
                        None
                    }
                },
                Some(r) if weights => {
                    let why = "rhs is not a weight (not reachable from parameters only): left in f32";
                    rw.skip(&site, Some(Role::RHS), Some(r), why.into());
                    None
                }
                _ => None,
            };
            let g = rw.graph_mut();
            inputs[0] = *made.entry((lhs, false)).or_insert_with(|| fake_quant_rows(g, lhs, axes, qz, rows));
            if let Some(r) = rhs_weight {
                let k_axis = g.shape(r).rank() - 2;
                inputs[1] = *made.entry((r, true)).or_insert_with(|| fake_quant(g, r, vec![k_axis], qz));
                action.push_str(" + rhs per-column");
            }
            g.set_inputs(id, inputs);
            rw.actuate(&site, id, format!("{action}; {settings}"));
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&FakeQuant) }
