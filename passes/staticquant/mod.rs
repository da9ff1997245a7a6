//! `staticquant`: static (calibrated) W8A8 / W4A8 quantization of every matmul, from a
//! calibration table: the actuation that answers "what does `quantize_static` cost this model?"
//! as `fakequant` answers it for `quantize_dynamic`.
//!
//! **Why a pass of its own, not `fakequant{table=..}`.** ONNX Runtime and TensorRT keep the two
//! apart: ORT has `quantize_dynamic` (activation scale from each run) and `quantize_static`
//! (activation scale fixed by a calibration table), TensorRT has dynamic ranges and calibration
//! caches. `fakequant`'s `scope` and `clip` (how a run's absmax becomes a scale) mean nothing when
//! the scale comes from a table, and the table's asymmetric uint8 zero point means nothing to
//! `fakequant`. So `staticquant` takes the table and the weight format only.
//!
//! **Activations: ONNX QuantizeLinear + DequantizeLinear (QDQ) with the table's constants.**
//! For the matmul's activation input `x` (its lhs) with scale `s` and zero point `zp` from the
//! table entry `site/lhs` (what `opscope calibrate` writes: ORT's `compute_scale_zp` of the
//! calibrated range; asymmetric uint8 or, with `--symmetric`, int8 with `zp = 0`):
//!
//! ```text
//! q = clamp(round(x / s) + zp, qlo, qhi)     round half to even (ONNX QuantizeLinear)
//! y = (q - zp) * s                           (ONNX DequantizeLinear)
//! ```
//!
//! `[qlo, qhi]` is the code type's whole range, `[0, 255]` for uint8 and `[-128, 127]` for int8:
//! QuantizeLinear saturates to the type, and the calibration's narrower symmetric grid
//! `[-127, 127]` only sets the scale (ORT 1.32 `quant_utils.compute_scale_zp`). `s` and `zp` are
//! graph constants: no reduction runs over the activation, unlike `fakequant`. A value beyond the
//! calibrated range saturates at `qlo` or `qhi`. Every step is one f32 RLX op (Div, Round, Add,
//! Clamp, Sub, Mul): codes are whole numbers below 2^24, so the add and subtract of `zp` are
//! exact, and `(q - zp) * s` is the integer GEMM's `s * (q - zp)` rounded once, as ORT's
//! DequantizeLinear computes it.
//!
//! **Weights** (`weights`): symmetric per output channel, as ORT's `quantize_static(...,
//! per_channel=True)` quantizes a MatMul weight (axis 1 of `W[K, N]`) and as TensorRT does:
//! `s_w[n] = max_k |W[k, n]| / Q`, `q = clamp(round(W / s_w), -Q, Q)`, `Q = 127` (int8) or `7`
//! (int4), computed in the graph from the weight (`fakequant`'s weight quantizer; a weight is
//! fixed, so its scale is static; under `cache_param_invariant` RLX computes it once). `float`
//! keeps the weight in f32 (A8 only). A static W8A8 matmul then equals an integer GEMM with i32
//! accumulation, `y[m, n] = s_x * s_w[n] * sum_k (q_x[m, k] - zp) q_w[k, n]`, up to the f32
//! rounding of RLX's float GEMM (`tests/staticquant.rs`).
//!
//! **Not lowered to `DequantMatMul`.** RLX 0.2.19's `Int8Block`/`Int4Block` weight formats would
//! hold a per-column int8 weight (one block of K per column), but packing needs the weight's
//! values, and a pass sees the graph only: on MiniLM the weights are `Op::Param`s set after the
//! compile. RLX also has no int8-activation GEMM, so the activation stays fake-quantized either
//! way.
//!
//! **Sites.** The matmul sites with a weight rhs (reachable from parameters only), as the
//! `matmul` tap names them; the table's entries must come from a recording of the same model at
//! the same stage (the deployed program by default). RLX's merged Q/K/V projection is one matmul
//! over one `x`: the table's `query`, `key` and `value` entries of that `x` (equal: the same
//! tensor) give its quantizer. `bmm=true` also quantizes attention's activation x activation
//! matmuls, both operands (`site/lhs` and `site/rhs`), as ORT's QDQ quantizer does for every
//! MatMul unless excluded. A site the table lacks is an error naming it (restrict with `sites`).
//! `DequantMatMul`: the activation is quantized, the packed weight kept. Skipped with a reason:
//! a non-f32 operand, symbolic dims, rank < 2.

mod table;

use std::collections::HashMap;
use std::path::PathBuf;

use rlx_ir::infer::GraphExt;
use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, NodeId, Op};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration, Text, Word};
use crate::rewrite::Rewrite;
use crate::sketch::static_dims;

pub use table::{Qdq, StaticTable};

const TABLE: Opt<Text> = Opt::text(
    "table",
    "none",
    "calibration table JSON from `opscope calibrate` (required; none = not given)",
);
const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over site names (as the matmul tap names them)");
const WEIGHTS: Opt<Word> = Opt::word(
    "weights",
    &["int8", "int4", "float"],
    "int8",
    "weight format: symmetric per output column int8 (Q=127) or int4 (Q=7), or float (A8 only)",
);
const BMM: Opt<bool> = Opt::bool(
    "bmm",
    "false",
    "also quantize attention's activation x activation matmuls, lhs and rhs, from the table (ORT's QDQ default)",
);

const OPTIONS: &[OptionSpec] = &[TABLE.spec, SITES.spec, WEIGHTS.spec, BMM.spec];

/// The `staticquant` actuation pass.
pub struct StaticQuant;

/// Why `id` cannot be quantized, if it cannot.
fn unsupported(g: &Graph, id: NodeId) -> Option<String> {
    let s = g.shape(id);
    if s.dtype() != DType::F32 {
        Some(format!("operand is {:?}, not f32", s.dtype()))
    } else if static_dims(s).is_none() {
        Some("symbolic dims: the constant scale's broadcast needs static shapes on RLX's CPU".into())
    } else if s.rank() < 2 {
        Some(format!("operand has rank {}, a matmul operand needs 2 or more", s.rank()))
    } else {
        None
    }
}

/// Append `DequantizeLinear(QuantizeLinear(x, s, zp), s, zp)` (module docs) and return it.
fn qdq(g: &mut Graph, x: NodeId, p: Qdq) -> NodeId {
    let xs = g.shape(x).clone();
    let ones = vec![1usize; xs.rank()];
    let s = g.full(&ones, p.scale, DType::F32);
    let zp = g.full(&ones, p.zero_point as f32, DType::F32);
    let r = g.div(x, s);
    let r = g.activation(Activation::Round, r, xs);
    let q = g.add(r, zp);
    let q = g.clamp_(q, p.qlo as f32, p.qhi as f32);
    let q = g.sub(q, zp);
    g.mul(q, s)
}

/// The parameter names of a merged matmul's rhs `concat(W_1, .., W_n)` (RLX's horizontal Q/K/V
/// merge), if it is one.
fn merged_params(g: &Graph, rhs: NodeId) -> Option<Vec<String>> {
    let cat = g.node(rhs);
    let Op::Concat { axis } = cat.op else { return None };
    if axis + 1 != cat.shape.rank() || cat.inputs.len() < 2 {
        return None;
    }
    cat.inputs
        .iter()
        .map(|&w| match &g.node(w).op {
            Op::Param { name } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

impl Pass for StaticQuant {
    fn name(&self) -> &'static str {
        "staticquant"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "static QDQ of every matmul's activation with the calibration table's fixed scale and zero point (ORT quantize_static), weights per output column"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let path = opts.get(&TABLE)?;
        if path == "none" {
            return Err(Error::Table {
                path: PathBuf::from("(none)"),
                why: "staticquant needs table=PATH: write one with `opscope calibrate RECORDING --method minmax --out table.json` \
                      from a recording of this model made with matmul{stats=[min,max]}"
                    .into(),
            });
        }
        let table = StaticTable::load(path.as_ref())?;
        let patterns = opts.get(&SITES)?;
        let bmm = opts.get(&BMM)?;
        let wq = match opts.get(&WEIGHTS)?.as_str() {
            "int8" => Some(127.0),
            "int4" => Some(7.0),
            _ => None,
        };

        // One quantizer per tensor: the Q, K and V projections of one x share it.
        let mut made: HashMap<NodeId, NodeId> = HashMap::new();
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id);
            let dequant = matches!(node.op, Op::DequantMatMul { .. });
            if !(dequant || matches!(node.op, Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual)) {
                continue;
            }
            let (lhs, rhs) = (node.inputs[0], node.inputs.get(1).copied());
            let site = rw.site_name(id);
            // The table names a merged Q/K/V projection's parts, as the `matmul` tap does.
            let parts: Vec<String> = match (&node.op, rhs) {
                (Op::MatMul, Some(r)) => merged_params(rw.graph(), r)
                    .map(|ps| ps.iter().filter_map(|p| rw.source_name_for_param("matmul", p)).collect())
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            let names = if parts.is_empty() { vec![site.clone()] } else { parts };
            if !patterns.selects_op("staticquant", &names.iter().map(String::as_str).collect::<Vec<_>>())? {
                continue;
            }
            let weight_rhs = rhs.is_some_and(|r| super::smoothquant::is_param_weight(rw.graph(), r) || super::smoothquant::is_migrated_weight(rw.graph(), r));
            let activation_rhs = !dequant && !weight_rhs;
            if activation_rhs && !bmm {
                rw.skip(&site, None, None, "rhs is an activation (an attention BMM): left in float; bmm=true quantizes it".into());
                continue;
            }
            if let Some(why) = unsupported(rw.graph(), lhs) {
                rw.skip(&site, Some(Role::LHS), Some(lhs), why);
                continue;
            }
            let px = table.lookup_shared(&names, "lhs")?;
            let mut action = format!("static QDQ lhs {} scale {:e} zp {}", px.dtype(), px.scale, px.zero_point);
            let mut inputs = rw.graph().node(id).inputs.clone();
            let mut new_rhs = None;
            match rhs {
                Some(r) if activation_rhs => match unsupported(rw.graph(), r) {
                    None => {
                        let pr = table.lookup(&site, "rhs")?;
                        action.push_str(&format!(" + rhs {} scale {:e} zp {}", pr.dtype(), pr.scale, pr.zero_point));
                        new_rhs = Some((r, Some(pr)));
                    }
                    Some(why) => rw.skip(&site, Some(Role::RHS), Some(r), why),
                },
                Some(_) if dequant => action.push_str(" (weight kept in its packed format)"),
                Some(r) => match (wq, unsupported(rw.graph(), r)) {
                    (Some(_), None) => new_rhs = Some((r, None)),
                    (Some(_), Some(why)) => rw.skip(&site, Some(Role::RHS), Some(r), why),
                    (None, _) => action.push_str(" (weight f32)"),
                },
                None => {}
            }
            let g = rw.graph_mut();
            inputs[0] = *made.entry(lhs).or_insert_with(|| qdq(g, lhs, px));
            match new_rhs {
                Some((r, Some(pr))) => inputs[1] = *made.entry(r).or_insert_with(|| qdq(g, r, pr)),
                Some((r, None)) => {
                    let q = wq.expect("checked above");
                    let k_axis = g.shape(r).rank() - 2;
                    let qz = super::fakequant::Quantizer { qmax: q, lo: -q, clip: 1.0, away: false };
                    inputs[1] = *made.entry(r).or_insert_with(|| super::fakequant::fake_quant(g, r, vec![k_axis], qz));
                    action.push_str(&format!(" + rhs int{} per-column codes [-{q},{q}]", if q == 127.0 { 8 } else { 4 }));
                }
                None => {}
            }
            g.set_inputs(id, inputs);
            rw.actuate(&site, id, format!("{action}; round half-even, table {}", table.method));
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&StaticQuant) }
