//! `sparseattn`: sparse attention by masking, as an actuation. At every attention site, the keys
//! a query does not keep have their score replaced by `f32::MIN` (`torch.finfo(float32).min`)
//! before the softmax, so the kept keys' probabilities renormalize among themselves:
//!
//! - `topk=K`: each query keeps its `K` highest-scoring keys (top-k attention, Gupta et al.
//!   2021, "Memory-efficient Transformers via Top-k Attention"). The k-th score of a row is
//!   RLX's `Sort` (descending, last axis) narrowed at `K - 1`; a key is kept when its score is
//!   `>=` that value. **Ties at the k-th score are all kept**: a row keeps more than `K` keys
//!   exactly when several keys share the k-th score (a NaN score compares false and is dropped).
//!   `topk >= Sk` keeps every key: the site is left unchanged (listed as skipped).
//! - `window=W,sinks=N`: query `i` keeps key `j` when `|i' - j| < W`, `i' = i + Sk - Sq` its
//!   absolute position (RLX's convention for a causal decode step), or when `j < N` (the
//!   attention sinks of StreamingLLM, Xiao et al. 2023, "Efficient Streaming Language Models
//!   with Attention Sinks": the first positions every query keeps). In a causal attention the
//!   causal mask already drops `j > i'`, so the window is StreamingLLM's `W` most recent keys,
//!   the query's own included; in a bidirectional encoder (BERT) it is a band of `W - 1` keys on
//!   each side (Longformer's sliding window, Beltagy et al. 2020, of width `2W - 1`). A window
//!   covering every key (`W >= Sk`) leaves the site unchanged (listed as skipped).
//!
//! **Existing masks stay intact.** The rewrite replaces, it does not add: a kept key keeps its
//! score, padding or causal bias included, and a dropped one gets `f32::MIN` (Hugging Face's
//! `masked_fill(~keep, finfo.min)`; adding `finfo.min` to a `finfo.min` padding bias would
//! overflow to -inf and turn an all-masked row into NaN). A key masked before (bias -10000 or
//! `finfo.min`, or RLX's -1e9) therefore stays masked: for a valid query the kept set holds a
//! valid key (its top score, or the query's own position), so masked keys get `exp(-1e4)`,
//! which is 0 in f32, exactly as before. Only a padding query whose kept keys are all padding
//! spreads its (ignored) mass over them.
//!
//! Sites, as the `attn` tap finds them:
//! - a `Softmax` over the last axis of scores from a matmul that feed a matmul with V (the
//!   unfused `MatMul -> Softmax -> MatMul` an ONNX BERT arrives as and RLX's CPU fusion keeps:
//!   MiniLM's deployed form). `where(keep, s, f32::MIN)` goes between the scores (bias added)
//!   and the softmax; the window's keep mask is a constant `[1.., Sq, Sk]` expanded to the
//!   scores' shape (RLX 0.2.19's CPU `Where` does not broadcast its condition). A broadcast
//!   `min(s, c)` (`c` = f32::MAX kept, f32::MIN dropped) is the same for finite scores but was
//!   not faster on MiniLM (notes/sparseattn.md).
//! - a fused `Op::Attention`: it is first lowered with rlx-fusion's `LowerAttention` (primitive
//!   ops with a real `Softmax`, mirroring the CPU kernel's layouts, GQA, scale, masks and
//!   soft-cap; 1e-5 of the kernel per rlx-fusion's own test), then masked before its softmax.
//!   The fused kernel is then gone: expect the lowered attention's cost.
//!
//! Cost: masking in a dense kernel saves no FLOPs; `topk` adds a sort of every score row.

use rlx_ir::infer::GraphExt;
use rlx_ir::op::CmpOp;
use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use crate::error::Error;
use crate::manifest::Role;
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::{family, Rewrite};
use crate::sketch::static_dims;

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over attention site names (as the attn tap names them)");
const TOPK: Opt<u64> = Opt::uint("topk", 0, 1 << 20, "0", "keys kept per query, the k highest scores, ties at the k-th kept (Gupta et al. 2021); 0 = off");
const WINDOW: Opt<u64> =
    Opt::uint("window", 0, 1 << 20, "0", "keep keys j with |i - j| < window of query i (sliding window; with a causal mask the window most recent keys); 0 = off");
const SINKS: Opt<u64> = Opt::uint("sinks", 0, 1 << 20, "0", "with window: the first positions every query keeps (StreamingLLM attention sinks, Xiao et al. 2023)");

const OPTIONS: &[OptionSpec] = &[SITES.spec, TOPK.spec, WINDOW.spec, SINKS.spec];

/// Name prefix of the nodes this pass adds (`PREFIX<site>/keep`, `PREFIX<site>/scores`).
pub const PREFIX: &str = "opscope/sparseattn/";

/// The score a dropped key gets: `f32::MIN` (`torch.finfo(torch.float32).min`), replaced, not
/// added, so that it never overflows to -inf.
pub const DROPPED: f32 = f32::MIN;

/// The `sparseattn` actuation pass.
pub struct SparseAttn;

/// Which keys each query keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Keep {
    /// The `k` highest scores of each row (ties at the k-th score kept).
    TopK(usize),
    /// Keys within `window` of the query's absolute position, plus the first `sinks` keys.
    Window {
        /// Keys `j` with `|i' - j| < window` of the query's absolute position `i'` are kept.
        window: usize,
        /// The first `sinks` keys are kept by every query.
        sinks: usize,
    },
}

impl Keep {
    fn from_options(opts: &Options) -> Result<Keep, Error> {
        let (k, w, s) = (opts.get(&TOPK)? as usize, opts.get(&WINDOW)? as usize, opts.get(&SINKS)? as usize);
        match (k, w) {
            (0, 0) => Err(Error::Graph("sparseattn: set topk=K (top-k attention) or window=W[,sinks=N] (sliding window with sinks)".into())),
            (k, 0) if s == 0 => Ok(Keep::TopK(k)),
            (_, 0) => Err(Error::Graph("sparseattn: sinks is an option of window=W; with topk=K drop sinks".into())),
            (0, w) => Ok(Keep::Window { window: w, sinks: s }),
            _ => Err(Error::Graph("sparseattn: topk and window are alternatives; set one of them".into())),
        }
    }

    /// Keeps every key of a `[.., Sq, sk]` score tensor (the rewrite would change nothing): the
    /// farthest key is `sk - 1` positions from any query.
    fn keeps_all(self, sk: usize) -> bool {
        match self {
            Keep::TopK(k) => k >= sk,
            Keep::Window { window, sinks } => window >= sk || sinks >= sk,
        }
    }

    /// Whether the window keeps key `j` for query `i` of `sq` queries over `sk` keys.
    pub fn window_keeps(window: usize, sinks: usize, sq: usize, sk: usize, i: usize, j: usize) -> bool {
        let abs_q = sk.saturating_sub(sq) + i;
        j < sinks || abs_q.abs_diff(j) < window
    }

    fn describe(self) -> String {
        match self {
            Keep::TopK(k) => format!("top-{k} keys per query kept (ties at the k-th score kept), the others' scores set to f32::MIN before the softmax"),
            Keep::Window { window, sinks } => {
                format!("window {window} (|i - j| < {window}) plus {sinks} sink key(s) kept, the others' scores set to f32::MIN before the softmax")
            }
        }
    }
}

/// True if `id` is a `Softmax` over attention scores: last axis, rank >= 2, fed (through
/// elementwise ops) by a matmul and read by a matmul (with V), as the `attn` tap finds it.
fn is_score_softmax(rw: &Rewrite, id: NodeId) -> bool {
    let node = rw.graph().node(id);
    let Op::Softmax { axis } = node.op else { return false };
    let rank = node.shape.rank() as i32;
    rank >= 2
        && (axis == -1 || axis == rank - 1)
        && crate::passes::attn::from_matmul(rw.graph(), node.inputs[0])
        && rw.users(id).iter().any(|u| family(&rw.graph().node(*u).op) == "matmul")
}

/// Append `where(keep, s, f32::MIN)` for scores `s` (static F32 `[.., sq, sk]`); returns it.
fn mask_scores(g: &mut Graph, site: &str, s: NodeId, dims: &[usize], keep: Keep) -> NodeId {
    let r = dims.len();
    let (sq, sk) = (dims[r - 2], dims[r - 1]);
    let full = Shape::new(dims, DType::F32);
    let ones = vec![1usize; r];
    let cond = match keep {
        Keep::TopK(k) => {
            // The k-th largest score of each row, broadcast along the row; keep s >= it.
            let sorted = g.add_node(Op::Sort { axis: r - 1, descending: true }, vec![s], full.clone());
            let kth = g.narrow_(sorted, r - 1, k - 1, 1);
            let kth = g.add_node(Op::Expand { target_shape: dims.iter().map(|&d| d as i64).collect() }, vec![kth], full.clone());
            g.add_node(Op::Compare(CmpOp::Ge), vec![s, kth], full.clone().with_dtype(DType::Bool))
        }
        Keep::Window { window, sinks } => {
            // A constant 0/1 [1.., sq, sk] pattern, expanded to the scores' shape (RLX 0.2.19's
            // CPU `Where` does not broadcast its condition).
            let mut pat_dims = ones.clone();
            pat_dims[r - 2] = sq;
            pat_dims[r - 1] = sk;
            let data: Vec<u8> = (0..sq)
                .flat_map(|i| (0..sk).map(move |j| if Keep::window_keeps(window, sinks, sq, sk, i, j) { 1f32 } else { 0f32 }))
                .flat_map(f32::to_le_bytes)
                .collect();
            let pat = g.add_node(Op::Constant { data }, vec![], Shape::new(&pat_dims, DType::F32));
            let pat = g.add_node(Op::Expand { target_shape: dims.iter().map(|&d| d as i64).collect() }, vec![pat], full.clone());
            let half = g.full(&ones, 0.5, DType::F32);
            g.add_node(Op::Compare(CmpOp::Gt), vec![pat, half], full.clone().with_dtype(DType::Bool))
        }
    };
    g.node_mut(cond).name = Some(format!("{PREFIX}{site}/keep"));
    let low = g.full(&ones, DROPPED, DType::F32);
    let out = g.add_node(Op::Where, vec![cond, s, low], full);
    g.node_mut(out).name = Some(format!("{PREFIX}{site}/scores"));
    out
}

/// Append the window's `where(keep, s, f32::MIN)` for the lowered scores `s` (`dims` =
/// `[B, H, Sq, Sk]`) of a fused attention whose key mask `mask` (`[B, Sk]`, a key valid where
/// `>= 0.5`, as RLX's kernel reads it) marks which cache slots hold tokens, with fewer queries
/// than keys (a decode step): the window counts valid keys, not slots. A sequence shorter than
/// the cache has its own tokens in the slots of its positions and unused (masked) slots after
/// them, and its current token in the last slot; counted in slots, the `W` most recent keys of
/// such a query would be unused slots, and the window would keep only the query's own key and
/// the sinks. Query `i` is the `(n - Sq + i)`-th of the `n` valid keys of its sequence (the
/// queries are the last `Sq` valid keys); it keeps the valid keys whose index is within
/// `window` of its own, and the first `sinks` valid keys. Returns the masked scores.
fn mask_window_by_valid_keys(g: &mut Graph, site: &str, s: NodeId, dims: &[usize], mask: NodeId, window: usize, sinks: usize) -> NodeId {
    use rlx_ir::op::ReduceOp;
    let (b, sq, sk) = (dims[0], dims[2], dims[3]);
    let full = Shape::new(dims, DType::F32);
    let expand = |g: &mut Graph, x: NodeId| g.add_node(Op::Expand { target_shape: dims.iter().map(|&d| d as i64).collect() }, vec![x], full.clone());
    let m = g.reshape_(mask, vec![b as i64, sk as i64]);
    let m = if g.shape(m).dtype() == DType::F32 { m } else { g.cast(m, DType::F32) };
    let half = g.full(&[b, sk], 0.5, DType::F32);
    let below = g.lt(m, half);
    let below = g.cast(below, DType::F32);
    let one = g.full(&[b, sk], 1.0, DType::F32);
    let valid = g.sub(one, below);
    // Inclusive count of valid keys up to each slot, and the sequence's total.
    let upto = g.add_node(Op::Cumsum { axis: 1, exclusive: false }, vec![valid], Shape::new(&[b, sk], DType::F32));
    let total = g.add_node(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keep_dim: true }, vec![valid], Shape::new(&[b, 1], DType::F32));
    let upto = g.reshape_(upto, vec![b as i64, 1, 1, sk as i64]);
    let upto = expand(g, upto);
    let total = g.reshape_(total, vec![b as i64, 1, 1, 1]);
    let total = expand(g, total);
    // Query i's index among the valid keys less key j's: (n - Sq + i) - (upto_j - 1).
    let data: Vec<u8> = (0..sq).flat_map(|i| (i as f32 - sq as f32 + 1.0).to_le_bytes()).collect();
    let offset = g.add_node(Op::Constant { data }, vec![], Shape::new(&[1, 1, sq, 1], DType::F32));
    let offset = expand(g, offset);
    let gap = g.sub(total, upto);
    let gap = g.add(gap, offset);
    let gap2 = g.mul(gap, gap);
    let w2 = g.full(dims, (window * window) as f32, DType::F32);
    let near = g.lt(gap2, w2);
    let near = g.cast(near, DType::F32);
    let first = g.full(dims, sinks as f32 + 0.5, DType::F32);
    let sink = g.lt(upto, first);
    let sink = g.cast(sink, DType::F32);
    let either = g.add(near, sink);
    let half = g.full(dims, 0.5, DType::F32);
    let cond = g.add_node(Op::Compare(CmpOp::Gt), vec![either, half], full.clone().with_dtype(DType::Bool));
    g.node_mut(cond).name = Some(format!("{PREFIX}{site}/keep"));
    let low = g.full(&[1, 1, 1, 1], DROPPED, DType::F32);
    let low = expand(g, low);
    let out = g.add_node(Op::Where, vec![cond, s, low], full);
    g.node_mut(out).name = Some(format!("{PREFIX}{site}/scores"));
    out
}

/// Static F32 `[.., sq, sk]` dims of the scores `s`, or why not.
fn score_dims(g: &Graph, s: NodeId) -> Result<Vec<usize>, String> {
    let shape = g.shape(s);
    if shape.dtype() != DType::F32 {
        return Err(format!("scores are {:?}, not f32", shape.dtype()));
    }
    let d = static_dims(shape).ok_or("scores have a symbolic dim: the keep mask needs static shapes")?;
    if d.len() < 2 {
        return Err(format!("scores of rank {} (need [.., Sq, Sk])", d.len()));
    }
    Ok(d)
}

/// Repeat the heads of a grouped-query K or V `x` (`[B, kv, S, D]`) to `[B, heads, S, D]`, query
/// head `h` reading KV head `h / (heads / kv)` as RLX's CPU kernel does; `None` when `x` is not
/// such a tensor (it already has `heads` heads, or `kv` does not divide `heads`).
fn repeat_kv_heads(g: &mut Graph, x: NodeId, heads: usize) -> Option<NodeId> {
    let d = static_dims(g.shape(x))?;
    let (b, kv, s, dh) = (d[0], d[1], d[2], d[3]);
    if kv == heads || kv == 0 || heads % kv != 0 {
        return None;
    }
    let group = heads / kv;
    let x = g.reshape_(x, vec![b as i64, kv as i64, 1, s as i64, dh as i64]);
    let target = [b, kv, group, s, dh];
    let x = g.add_node(Op::Expand { target_shape: target.iter().map(|&t| t as i64).collect() }, vec![x], Shape::new(&target, DType::F32));
    Some(g.reshape_(x, vec![b as i64, heads as i64, s as i64, dh as i64]))
}

/// Lower the fused attention `id` with rlx-fusion's `LowerAttention` into `g` (appended; its
/// inputs are the attention's own) and point every user and output of `id` at the result.
/// Returns the lowered `Softmax` node.
///
/// A grouped-query attention in the `[B, H, S, D]` layout has its K and V heads repeated to `H`
/// first: rlx-fusion 0.2.19's `LowerAttention` reads the layout of K alone, takes a
/// `[B, kv_heads, S, D]` K for `[B, S, H, D]` with `kv_heads` keys, and panics in shape
/// inference (measured on SmolLM2-135M: 9 query heads, 3 KV heads).
fn lower_attention(g: &mut Graph, id: NodeId) -> Result<NodeId, String> {
    use rlx_fusion::pass::Pass as _;
    let node = g.node(id).clone();
    let Op::Attention { num_heads, .. } = node.op else { return Err("not a fused attention".into()) };
    let mut inputs = node.inputs.clone();
    let qd = static_dims(g.shape(inputs[0])).ok_or("attention input 0 has a symbolic dim: LowerAttention needs static shapes")?;
    if qd.len() == 4 && qd[1] == num_heads && inputs.len() >= 3 {
        // Checked for K and V both before either is rewritten.
        let mut grouped = Vec::new();
        for i in [1, 2] {
            let d = static_dims(g.shape(inputs[i])).ok_or_else(|| format!("attention input {i} has a symbolic dim: LowerAttention needs static shapes"))?;
            if d.len() != 4 || d[1] == num_heads {
                continue;
            }
            if g.shape(inputs[i]).dtype() != DType::F32 {
                return Err(format!("grouped-query attention input {i} is {:?}, not f32", g.shape(inputs[i]).dtype()));
            }
            if d[1] == 0 || num_heads % d[1] != 0 {
                return Err(format!("attention input {i} {d:?} has {} heads, which do not divide the {num_heads} query heads", d[1]));
            }
            grouped.push(i);
        }
        for i in grouped {
            inputs[i] = repeat_kv_heads(g, inputs[i], num_heads).ok_or("a grouped-query K or V could not be repeated")?;
        }
    }
    let mut mini = Graph::new("sparseattn_lower");
    let mut outer = Vec::new();
    for (i, &inp) in inputs.iter().enumerate() {
        let shape = g.shape(inp).clone();
        if static_dims(&shape).is_none() {
            return Err(format!("attention input {i} has a symbolic dim: LowerAttention needs static shapes"));
        }
        outer.push((mini.input(&format!("in{i}"), shape), inp));
    }
    let att = mini.add_node(node.op.clone(), outer.iter().map(|p| p.0).collect(), node.shape.clone());
    mini.set_outputs(vec![att]);
    let lowered = rlx_fusion::lower_attention::LowerAttention.run(mini);
    let mut map = std::collections::HashMap::new();
    let mut softmax = None;
    for n in lowered.nodes() {
        let new = match &n.op {
            Op::Input { name, .. } => {
                let i: usize = name.trim_start_matches("in").parse().map_err(|_| format!("unexpected input {name} after LowerAttention"))?;
                outer[i].1
            }
            op => {
                let inputs = n.inputs.iter().map(|i| map[i]).collect();
                let new = g.add_node(op.clone(), inputs, n.shape.clone());
                if matches!(op, Op::Softmax { .. }) {
                    softmax = Some(new);
                }
                new
            }
        };
        map.insert(n.id, new);
    }
    let (softmax, out) = (softmax.ok_or("LowerAttention produced no Softmax")?, map[&lowered.outputs[0]]);
    for u in g.users(id) {
        let inputs = g.node(u).inputs.iter().map(|&i| if i == id { out } else { i }).collect();
        g.set_inputs(u, inputs);
    }
    for o in g.outputs.iter_mut() {
        if *o == id {
            *o = out;
        }
    }
    Ok(softmax)
}

impl Pass for SparseAttn {
    fn name(&self) -> &'static str {
        "sparseattn"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "sparse attention by masking: keep each query's top-k keys (topk=K) or a window plus sink keys (window=W,sinks=N); dropped scores set to f32::MIN before the softmax, existing masks kept"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let keep = Keep::from_options(opts)?;
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let fused = matches!(rw.graph().node(id).op, Op::Attention { .. });
            if !(fused || is_score_softmax(rw, id)) {
                continue;
            }
            let site = rw.site_name(id);
            if !patterns.matches(&site) {
                continue;
            }
            // Scores [.., Sq, Sk]: the softmax's input, or (fused) the attention's probabilities.
            let dims = if fused {
                let n = rw.graph().node(id);
                let (q, k) = (static_dims(rw.graph().shape(n.inputs[0])), static_dims(rw.graph().shape(n.inputs[1])));
                match (q, k, &n.op) {
                    // Q's layout is K's, as RLX's CPU kernel dispatches: a grouped-query K
                    // `[B, kv_heads, S, D]` read alone gave `kv_heads` keys.
                    (Some(q), Some(k), Op::Attention { num_heads, .. }) => crate::analysis::attention_seqs(&q, &k, *num_heads)
                        .map(|(_, sq, sk, _)| vec![sq, sk])
                        .ok_or_else(|| format!("attention of rank {} (K rank {}) is not supported", q.len(), k.len())),
                    _ => Err("attention Q or K has a symbolic dim".to_string()),
                }
            } else {
                score_dims(rw.graph(), rw.graph().node(id).inputs[0])
            };
            let dims = match dims {
                Ok(d) => d,
                Err(why) => {
                    rw.skip(&site, Some(Role::new("scores")), Some(id), why);
                    continue;
                }
            };
            let sk = dims[dims.len() - 1];
            if keep.keeps_all(sk) {
                rw.skip(&site, Some(Role::new("scores")), Some(id), format!("{keep:?} keeps all {sk} keys: left unchanged"));
                continue;
            }
            // A fused decode step with a key mask: the window counts valid keys (see
            // `mask_window_by_valid_keys`).
            let key_mask = match &rw.graph().node(id).op {
                Op::Attention { mask_kind: rlx_ir::op::MaskKind::Custom, .. } if dims[0] < dims[1] => rw.graph().node(id).inputs.get(3).copied(),
                _ => None,
            };
            let g = rw.graph_mut();
            let softmax = if fused {
                match lower_attention(g, id) {
                    Ok(s) => s,
                    Err(why) => {
                        rw.skip(&site, Some(Role::new("scores")), Some(id), why);
                        continue;
                    }
                }
            } else {
                id
            };
            let s = g.node(softmax).inputs[0];
            let dims = match score_dims(g, s) {
                Ok(d) => d,
                Err(why) => {
                    rw.skip(&site, Some(Role::new("scores")), Some(id), why);
                    continue;
                }
            };
            let (masked, counted) = match (keep, key_mask) {
                // The kernel's key mask is `[B, Sk]`; one of another size is left to the slots.
                (Keep::Window { window, sinks }, Some(mask))
                    if dims.len() == 4 && static_dims(g.shape(mask)).is_some_and(|m| m.iter().product::<usize>() == dims[0] * dims[3]) =>
                {
                    (mask_window_by_valid_keys(g, &site, s, &dims, mask, window, sinks), "; the window counts the key mask's valid keys (a decode step)")
                }
                _ => (mask_scores(g, &site, s, &dims, keep), ""),
            };
            g.set_inputs(softmax, vec![masked]);
            let how = if fused { "fused attention lowered (rlx-fusion LowerAttention); " } else { "" };
            rw.actuate(&site, softmax, format!("{how}{}{counted}", keep.describe()));
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's object code, and with it the
/// registration below, is linked into every program that uses opscope.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&SparseAttn) }
