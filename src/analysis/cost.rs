//! Cost of a graph per node: FLOPs, bytes moved by tensor class, arithmetic intensity, the GEMM
//! shapes it runs, and the roofline class of each node against a machine (Williams, Waterman and
//! Patterson, "Roofline: an insightful visual performance model for multicore architectures",
//! CACM 2009). Run it on the deployed (fused) graph (`crate::activate::fuse`) to cost what RLX
//! actually runs: its merged Q/K/V projection is one GEMM there.
//!
//! Conventions (stated once, used everywhere):
//! - A GEMM `[M,K] x [K,N]` is `2*M*K*N` FLOPs (one multiply and one add per term), times its
//!   batch. A matmul whose right operand is rank 2 flattens the left operand's leading dims into
//!   `M` (what a BLAS call on the row-major buffer does); a matmul of two batched operands has
//!   `batch` = the product of the output's leading dims.
//! - `Op::Attention` is its two GEMMs, `QK^T` (`2*B*H*Sq*Sk*D`) and `PV` (`2*B*H*Sq*Sk*Dv`),
//!   plus a softmax over the `[B,H,Sq,Sk]` scores.
//! - Elementwise work counts FLOPs per output element: 1 for a binary, compare, select, clamp or
//!   activation; 2 for `Fma`; a softmax 5 per element (max, subtract, exp, sum, divide), a
//!   layer norm 8 (mean, subtract, square, sum, rsqrt, multiply, scale, shift), an RMS norm 5,
//!   a fused residual + layer norm 9, batch-norm inference 2; reductions and histograms 1 per
//!   input element. These are this module's conventions (transcendental functions count as one
//!   FLOP, as in the roofline literature's "operations"); a GEMM dominates a transformer's count.
//! - Data movement (reshape, transpose, narrow, concat, gather, cast, ...) is 0 FLOPs; ops this
//!   module does not model (convolutions, scans, ...) have unknown FLOPs (`None`) and are listed
//!   as such, never counted as 0.
//! - Bytes moved = every distinct input read once plus the output written once, at the tensor's dtype
//!   width (`DType::size_bytes`: f16 2, int8 1). A gather, narrow or slice reads only the part
//!   it outputs. A reshape or stop-gradient is a view (0 bytes). A `DequantMatMul`'s packed
//!   weight counts at the width its `QuantScheme` stores (GGUF blocks at block bytes per block
//!   elements; other schemes at `bits_per_element_x10 / 10` bits per element) plus its scale and
//!   zero-point tensors. Bytes are split by tensor class ([`TensorClass`]).

use std::collections::BTreeMap;

use rlx_ir::{DType, Dim, Graph, NodeId, Op};
use serde::Serialize;

/// Why a graph cannot be costed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CostError {
    /// The graph has no node that computes anything.
    #[error("graph '{graph}' has no compute nodes to cost (only inputs, parameters and constants, or nothing); pass the model's graph")]
    Empty {
        /// Graph name.
        graph: String,
    },
    /// A node's shape has a symbolic dim that no binding gives a size.
    #[error("unbound dim ?{symbol} in node %{node} ({op}): bind it from a run's input shapes (Bindings::from_inputs) or import the model with static shapes")]
    UnboundDim {
        /// Node id.
        node: u32,
        /// Op name.
        op: String,
        /// The symbol index (`Dim::Dynamic`).
        symbol: u32,
    },
    /// A run's input does not fit the graph's input (rank, a static dim, or two sizes for one symbol).
    #[error("input '{input}': {why}")]
    BadBinding {
        /// Input name.
        input: String,
        /// What does not fit.
        why: String,
    },
}

/// Sizes of a graph's symbolic dims (`Dim::Dynamic(symbol)`), taken from a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bindings(BTreeMap<u32, usize>);

impl Bindings {
    /// No bindings (enough for a graph with static shapes).
    pub fn none() -> Bindings {
        Bindings::default()
    }

    /// Bind each symbolic dim of the graph's `Input` nodes from the shapes a run feeds them,
    /// `(input name, dims)`. Inputs not listed stay unbound.
    ///
    /// Errors ([`CostError::BadBinding`]): an input name the graph does not have, a rank or a
    /// static dim that differs, or one symbol given two sizes.
    pub fn from_inputs(graph: &Graph, inputs: &[(&str, &[usize])]) -> Result<Bindings, CostError> {
        let mut b = BTreeMap::new();
        for (name, dims) in inputs {
            let bad = |why: String| CostError::BadBinding { input: name.to_string(), why };
            let node = graph
                .nodes()
                .iter()
                .find(|n| matches!(&n.op, Op::Input { name: x } if x == name))
                .ok_or_else(|| bad("the graph has no input of this name".into()))?;
            let want = node.shape.dims();
            if want.len() != dims.len() {
                return Err(bad(format!("rank {} given, the graph declares rank {}", dims.len(), want.len())));
            }
            for (i, (d, &v)) in want.iter().zip(dims.iter()).enumerate() {
                match *d {
                    Dim::Static(s) if s != v => return Err(bad(format!("dim {i} is {v}, the graph declares {s}"))),
                    Dim::Static(_) => {}
                    Dim::Dynamic(sym) => {
                        if let Some(&old) = b.get(&sym) {
                            if old != v {
                                return Err(bad(format!("symbol ?{sym} is {v} here and {old} in an earlier input")));
                            }
                        }
                        b.insert(sym, v);
                    }
                }
            }
        }
        Ok(Bindings(b))
    }

    /// Bind `symbol` to `size`.
    pub fn bind(mut self, symbol: u32, size: usize) -> Bindings {
        self.0.insert(symbol, size);
        self
    }
}

/// What a tensor is, for counting bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    /// A parameter or constant, or computed from parameters and constants only (the weight
    /// `Concat` of a merged Q/K/V projection).
    Weight,
    /// A graph input.
    Input,
    /// A graph output.
    Output,
    /// Any other intermediate tensor.
    Activation,
}

/// Bytes moved, by tensor class (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Bytes {
    /// Weights read (and weight-derived tensors written).
    pub weights: u64,
    /// Graph inputs read.
    pub inputs: u64,
    /// Graph outputs written.
    pub outputs: u64,
    /// Intermediate activations read and written.
    pub activations: u64,
}

impl Bytes {
    /// All bytes moved.
    pub fn total(&self) -> u64 {
        self.weights + self.inputs + self.outputs + self.activations
    }

    fn add(&mut self, class: TensorClass, n: u64) {
        match class {
            TensorClass::Weight => self.weights += n,
            TensorClass::Input => self.inputs += n,
            TensorClass::Output => self.outputs += n,
            TensorClass::Activation => self.activations += n,
        }
    }

    fn merge(&mut self, o: &Bytes) {
        self.weights += o.weights;
        self.inputs += o.inputs;
        self.outputs += o.outputs;
        self.activations += o.activations;
    }
}

/// One GEMM a node runs: `batch` independent `[M,K] x [K,N]` products.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct GemmShape {
    /// Rows of the left operand and of the output.
    pub m: u64,
    /// Reduction length.
    pub k: u64,
    /// Columns of the right operand and of the output.
    pub n: u64,
    /// Independent products (1 for a weight GEMM on a flattened activation).
    pub batch: u64,
    /// Dtype of the right operand (`f32`, `f16`, ...), or the `QuantScheme` of a
    /// `DequantMatMul`'s packed weight (`GgufQ4_1`).
    pub dtype: String,
    /// True if the right operand is a weight ([`TensorClass::Weight`]); false for
    /// activation x activation products (attention's `QK^T` and `PV`).
    pub weight: bool,
}

impl GemmShape {
    /// `2*M*K*N*batch` FLOPs.
    pub fn flops(&self) -> u64 {
        2 * self.m * self.k * self.n * self.batch
    }
}

/// Cost of one node of the graph.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeCost {
    /// Node id in the costed graph.
    pub node: u32,
    /// Site name (`crate::analysis::site_names`: the source op name when the source graph is given).
    pub site: String,
    /// Op kind as RLX prints it (`matmul`, `softmax`, `fused_residual_ln`).
    pub op: String,
    /// Output shape, symbols bound.
    pub shape: Vec<usize>,
    /// FLOPs of one execution; `None` for an op kind this module does not model.
    pub flops: Option<u64>,
    /// Bytes moved by one execution.
    pub bytes: Bytes,
    /// The GEMMs the node runs (empty for non-GEMM ops).
    pub gemms: Vec<GemmShape>,
}

impl NodeCost {
    /// Arithmetic intensity, FLOPs per byte moved; `None` when FLOPs are unknown or no byte moves.
    pub fn intensity(&self) -> Option<f64> {
        let b = self.bytes.total();
        self.flops.filter(|_| b > 0).map(|f| f as f64 / b as f64)
    }
}

/// Cost of every compute node of a graph, in graph order (inputs, parameters, constants and
/// views that move nothing are left out).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GraphCost {
    /// Graph name.
    pub graph: String,
    /// Per node.
    pub nodes: Vec<NodeCost>,
}

/// Totals of one op kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindCost {
    /// Op kind.
    pub op: String,
    /// Nodes of this kind.
    pub count: usize,
    /// FLOPs (of the nodes whose FLOPs are known).
    pub flops: u64,
    /// True if some node of this kind has unknown FLOPs.
    pub flops_unknown: bool,
    /// Bytes moved.
    pub bytes: Bytes,
}

/// One bin of the GEMM-shape histogram.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShapeBin {
    /// The shape.
    pub shape: GemmShape,
    /// How many times one execution of the graph runs it.
    pub count: usize,
    /// FLOPs of all of them.
    pub flops: u64,
    /// Share of the graph's GEMM FLOPs (0..1).
    pub share: f64,
}

impl GraphCost {
    /// Total FLOPs of the nodes whose FLOPs are known.
    pub fn flops(&self) -> u64 {
        self.nodes.iter().filter_map(|n| n.flops).sum()
    }

    /// Total bytes moved.
    pub fn bytes(&self) -> Bytes {
        let mut b = Bytes::default();
        for n in &self.nodes {
            b.merge(&n.bytes);
        }
        b
    }

    /// FLOPs of every GEMM the graph runs (matmuls, their fused forms and attention's two products).
    pub fn gemm_flops(&self) -> u64 {
        self.nodes.iter().flat_map(|n| &n.gemms).map(|g| g.flops()).sum()
    }

    /// Totals per op kind, by FLOPs then bytes, largest first.
    pub fn by_kind(&self) -> Vec<KindCost> {
        let mut m: BTreeMap<&str, KindCost> = BTreeMap::new();
        for n in &self.nodes {
            let k = m.entry(n.op.as_str()).or_insert_with(|| KindCost {
                op: n.op.clone(),
                count: 0,
                flops: 0,
                flops_unknown: false,
                bytes: Bytes::default(),
            });
            k.count += 1;
            k.flops += n.flops.unwrap_or(0);
            k.flops_unknown |= n.flops.is_none();
            k.bytes.merge(&n.bytes);
        }
        let mut v: Vec<KindCost> = m.into_values().collect();
        v.sort_by(|a, b| b.flops.cmp(&a.flops).then(b.bytes.total().cmp(&a.bytes.total())).then(a.op.cmp(&b.op)));
        v
    }

    /// The GEMM-shape histogram: each distinct (M, K, N, batch, dtype, weight) with its count and
    /// FLOP share, by FLOPs, largest first.
    pub fn gemm_histogram(&self) -> Vec<ShapeBin> {
        let mut m: BTreeMap<&GemmShape, usize> = BTreeMap::new();
        for g in self.nodes.iter().flat_map(|n| &n.gemms) {
            *m.entry(g).or_default() += 1;
        }
        let total = self.gemm_flops().max(1) as f64;
        let mut v: Vec<ShapeBin> = m
            .into_iter()
            .map(|(s, count)| {
                let flops = s.flops() * count as u64;
                ShapeBin { shape: s.clone(), count, flops, share: flops as f64 / total }
            })
            .collect();
        v.sort_by(|a, b| b.flops.cmp(&a.flops).then(a.shape.cmp(&b.shape)));
        v
    }
}

/// Cost every compute node of `graph` (normally the deployed, fused graph), naming sites from
/// `source` (the graph before fusion) when given, symbolic dims sized by `bindings`.
///
/// Errors: [`CostError::Empty`] when the graph has no compute node; [`CostError::UnboundDim`]
/// naming the first node whose shape (or an input's shape) has a symbol `bindings` does not size.
pub fn graph_cost(graph: &Graph, source: Option<&Graph>, bindings: &Bindings) -> Result<GraphCost, CostError> {
    let nodes = graph.nodes();
    if !nodes.iter().any(|n| !matches!(n.op, Op::Input { .. } | Op::Param { .. } | Op::Constant { .. })) {
        return Err(CostError::Empty { graph: graph.name.clone() });
    }
    // Bound shapes of every node, in graph order.
    let mut dims: Vec<Vec<usize>> = Vec::with_capacity(nodes.len());
    for n in nodes {
        let d = n
            .shape
            .dims()
            .iter()
            .map(|d| match *d {
                Dim::Static(s) => Ok(s),
                Dim::Dynamic(sym) => bindings.0.get(&sym).copied().ok_or(CostError::UnboundDim {
                    node: n.id.0,
                    op: super::op_name(&n.op),
                    symbol: sym,
                }),
            })
            .collect::<Result<Vec<usize>, CostError>>()?;
        dims.push(d);
    }
    let outputs: std::collections::HashSet<u32> = graph.outputs.iter().map(|o| o.0).collect();
    // Weight-derived: a parameter or constant, or computed from those only.
    let mut weight = vec![false; nodes.len()];
    for n in nodes {
        weight[n.id.0 as usize] = match n.op {
            Op::Param { .. } | Op::Constant { .. } => true,
            Op::Input { .. } => false,
            _ => !n.inputs.is_empty() && n.inputs.iter().all(|i| weight[i.0 as usize]),
        };
    }
    let class = |id: NodeId| -> TensorClass {
        let i = id.0 as usize;
        if matches!(nodes[i].op, Op::Input { .. }) {
            TensorClass::Input
        } else if outputs.contains(&id.0) {
            TensorClass::Output
        } else if weight[i] {
            TensorClass::Weight
        } else {
            TensorClass::Activation
        }
    };
    let numel = |id: NodeId| -> u64 { dims[id.0 as usize].iter().product::<usize>() as u64 };
    let size = |id: NodeId| -> u64 { numel(id) * nodes[id.0 as usize].shape.dtype().size_bytes() as u64 };
    let (names, _) = super::site_names(graph, source);

    let mut out = Vec::new();
    for n in nodes {
        if matches!(n.op, Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } | Op::Reshape { .. } | Op::StopGradient) {
            continue;
        }
        let o = dims[n.id.0 as usize].iter().product::<usize>() as u64;
        let mut bytes = Bytes::default();
        // Reads.
        match &n.op {
            Op::Gather { .. } | Op::Narrow { .. } | Op::Slice { .. } | Op::GatherNd { .. } | Op::GatherElements { .. } => {
                bytes.add(class(n.inputs[0]), o * nodes[n.inputs[0].0 as usize].shape.dtype().size_bytes() as u64);
                for &i in &n.inputs[1..] {
                    bytes.add(class(i), size(i));
                }
            }
            Op::DequantMatMul { scheme } => {
                let x = &dims[n.inputs[0].0 as usize];
                let k = *x.last().unwrap_or(&0) as u64;
                let nn = *dims[n.id.0 as usize].last().unwrap_or(&0) as u64;
                bytes.add(class(n.inputs[0]), size(n.inputs[0]));
                let packed = if scheme.is_gguf() && scheme.gguf_block_size() > 0 {
                    (k * nn).div_ceil(scheme.gguf_block_size() as u64) * scheme.gguf_block_bytes() as u64
                } else {
                    (k * nn * scheme.bits_per_element_x10() as u64).div_ceil(80)
                };
                if let Some(&w) = n.inputs.get(1) {
                    bytes.add(class(w), packed);
                }
                for &i in n.inputs.iter().skip(2) {
                    bytes.add(class(i), size(i));
                }
            }
            _ => {
                // A tensor read twice by one op (`x * x`) moves once.
                let mut seen: Vec<NodeId> = Vec::with_capacity(n.inputs.len());
                for &i in &n.inputs {
                    if !seen.contains(&i) {
                        seen.push(i);
                        bytes.add(class(i), size(i));
                    }
                }
            }
        }
        // Write.
        bytes.add(class(n.id), size(n.id));

        let gemms = gemms_of(n, graph, &dims, &weight);
        let gemm_flops: u64 = gemms.iter().map(|g| g.flops()).sum();
        let in0 = || n.inputs.first().map(|&i| numel(i)).unwrap_or(0);
        let flops = match &n.op {
            Op::MatMul | Op::DotGeneral { .. } | Op::DequantMatMul { .. } => Some(gemm_flops),
            Op::FusedMatMulBiasAct { activation, .. } => Some(gemm_flops + o * (1 + activation.is_some() as u64)),
            Op::FusedMatMulResidual => Some(gemm_flops + o),
            Op::Attention { .. } => Some(gemm_flops + 5 * attention_scores(n, &dims)),
            Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Clamp { .. } | Op::Activation(_) => Some(o),
            Op::Fma => Some(2 * o),
            Op::FusedSwiGLU { .. } => Some(4 * o),
            Op::Softmax { .. } => Some(5 * o),
            Op::LayerNorm { .. } | Op::GroupNorm { .. } => Some(8 * o),
            Op::RmsNorm { .. } => Some(5 * o),
            Op::FusedResidualLN { .. } => Some(9 * o),
            Op::FusedResidualRmsNorm { .. } => Some(6 * o),
            Op::BatchNormInference { .. } => Some(2 * o),
            Op::Reduce { .. } | Op::Histogram { .. } | Op::ArgMax { .. } | Op::ArgMin { .. } | Op::Cumsum { .. } => Some(in0()),
            Op::Transpose { .. }
            | Op::Narrow { .. }
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Expand { .. }
            | Op::Gather { .. }
            | Op::GatherNd { .. }
            | Op::GatherElements { .. }
            | Op::Cast { .. }
            | Op::Pad { .. }
            | Op::Tile { .. }
            | Op::Reverse { .. }
            | Op::Roll { .. } => Some(0),
            _ => None,
        };
        out.push(NodeCost {
            node: n.id.0,
            site: names.get(&n.id.0).cloned().unwrap_or_else(|| format!("%{}", n.id.0)),
            op: super::op_name(&n.op),
            shape: dims[n.id.0 as usize].clone(),
            flops,
            bytes,
            gemms,
        });
    }
    Ok(GraphCost { graph: graph.name.clone(), nodes: out })
}

fn dtype_name(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}

/// `[B,H,Sq,Sk]` score elements of an attention node, from its operand layout.
fn attention_scores(n: &rlx_ir::Node, dims: &[Vec<usize>]) -> u64 {
    match attention_dims(n, dims) {
        Some((bh, sq, sk, _, _)) => bh * sq * sk,
        None => 0,
    }
}

/// `(B*H, Sq, Sk, D, Dv)` of an attention node: Q/K/V are `[B,S,H,D]` (heads at axis 2),
/// `[B,H,S,D]` (heads at axis 1) or rank-3 single-head `[B,S,D]` (see `Op::Attention`).
fn attention_dims(n: &rlx_ir::Node, dims: &[Vec<usize>]) -> Option<(u64, u64, u64, u64, u64)> {
    let Op::Attention { num_heads, head_dim, v_head_dim, .. } = &n.op else { return None };
    let q = &dims[n.inputs.first()?.0 as usize];
    let k = &dims[n.inputs.get(1)?.0 as usize];
    // Q's layout is K's, as the kernel dispatches (a grouped-query K read alone took its KV
    // head count for its keys when the sequence length equalled the head count).
    let (_, sq, sk, _) = super::attention_seqs(q, k, *num_heads).filter(|_| q.len() >= 3)?;
    let (sq, sk) = (sq as u64, sk as u64);
    // Rank 3 `[B, S, H*D]` holds every head too.
    let heads = *num_heads as u64;
    let b = q[0] as u64;
    let d = *head_dim as u64;
    Some((b * heads, sq, sk, d, v_head_dim.map(|v| v as u64).unwrap_or(d)))
}

/// The GEMMs a node runs (empty for non-GEMM ops).
fn gemms_of(n: &rlx_ir::Node, graph: &Graph, dims: &[Vec<usize>], weight: &[bool]) -> Vec<GemmShape> {
    let nodes = graph.nodes();
    match &n.op {
        Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual => {
            let (Some(&a), Some(&b)) = (n.inputs.first(), n.inputs.get(1)) else { return vec![] };
            let (ad, bd, od) = (&dims[a.0 as usize], &dims[b.0 as usize], &dims[n.id.0 as usize]);
            if ad.is_empty() || bd.len() < 2 || od.is_empty() {
                return vec![];
            }
            let k = *ad.last().unwrap() as u64;
            let nn = *od.last().unwrap() as u64;
            let (m, batch) = if bd.len() == 2 {
                // Right operand shared: the left operand's leading dims flatten into M.
                (ad[..ad.len() - 1].iter().product::<usize>() as u64, 1)
            } else {
                (od[od.len() - 2] as u64, od[..od.len() - 2].iter().product::<usize>() as u64)
            };
            vec![GemmShape { m, k, n: nn, batch, dtype: dtype_name(nodes[b.0 as usize].shape.dtype()), weight: weight[b.0 as usize] }]
        }
        Op::DequantMatMul { scheme } => {
            let Some(&a) = n.inputs.first() else { return vec![] };
            let (ad, od) = (&dims[a.0 as usize], &dims[n.id.0 as usize]);
            if ad.is_empty() || od.is_empty() {
                return vec![];
            }
            let m = ad[..ad.len() - 1].iter().product::<usize>() as u64;
            vec![GemmShape { m, k: *ad.last().unwrap() as u64, n: *od.last().unwrap() as u64, batch: 1, dtype: format!("{scheme:?}"), weight: true }]
        }
        Op::Attention { .. } => {
            let Some((bh, sq, sk, d, dv)) = attention_dims(n, dims) else { return vec![] };
            let dt = dtype_name(n.shape.dtype());
            vec![
                GemmShape { m: sq, k: d, n: sk, batch: bh, dtype: dt.clone(), weight: false },
                GemmShape { m: sq, k: sk, n: dv, batch: bh, dtype: dt, weight: false },
            ]
        }
        _ => vec![],
    }
}

/// A machine for the roofline: peak compute and memory bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Machine {
    /// Peak compute, FLOP/s.
    pub peak_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub bandwidth: f64,
}

/// Which roof bounds an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// Arithmetic intensity at or above the ridge point.
    Compute,
    /// Below the ridge point.
    Memory,
}

impl Machine {
    /// The ridge point, FLOP/byte: the intensity where the memory roof meets the compute roof.
    pub fn ridge(&self) -> f64 {
        self.peak_flops / self.bandwidth
    }

    /// Roofline class of an op of `intensity` FLOP/byte.
    pub fn bound(&self, intensity: f64) -> Bound {
        if intensity >= self.ridge() {
            Bound::Compute
        } else {
            Bound::Memory
        }
    }

    /// Attainable FLOP/s at `intensity`: `min(peak, intensity * bandwidth)`.
    pub fn attainable(&self, intensity: f64) -> f64 {
        self.peak_flops.min(intensity * self.bandwidth)
    }

    /// Lower bound on an op's time in seconds: `max(flops / peak, bytes / bandwidth)`.
    pub fn min_time(&self, flops: u64, bytes: u64) -> f64 {
        (flops as f64 / self.peak_flops).max(bytes as f64 / self.bandwidth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::Shape;

    #[test]
    fn batched_matmul_and_flattened_weight_gemm() {
        let s = |d: &[usize]| Shape::new(d, DType::F32);
        let mut g = Graph::new("t");
        let x = g.input("x", s(&[2, 3, 4]));
        let w = g.param("w", s(&[4, 5]));
        let y = g.matmul(x, w, s(&[2, 3, 5]));
        let z = g.input("z", s(&[2, 5, 7]));
        let p = g.matmul(y, z, s(&[2, 3, 7]));
        g.set_outputs(vec![p]);
        let c = graph_cost(&g, None, &Bindings::none()).unwrap();
        assert_eq!(c.nodes[0].gemms[0], GemmShape { m: 6, k: 4, n: 5, batch: 1, dtype: "f32".into(), weight: true });
        assert_eq!(c.nodes[1].gemms[0], GemmShape { m: 3, k: 5, n: 7, batch: 2, dtype: "f32".into(), weight: false });
        assert_eq!(c.flops(), 2 * 6 * 4 * 5 + 2 * 2 * 3 * 5 * 7);
        // First matmul: x (input) 96 B, w 80 B, y (activation) 120 B.
        assert_eq!(c.nodes[0].bytes, Bytes { weights: 80, inputs: 96, outputs: 0, activations: 120 });
    }

    #[test]
    fn packed_and_narrow_weights_count_at_their_stored_width() {
        let (k, n, m) = (256usize, 64usize, 4usize);
        let mut g = Graph::new("q");
        let x = g.input("x", Shape::new(&[m, k], DType::F32));
        // GGUF Q4_1: 32-element blocks of 20 bytes (f16 scale, f16 min, 16 bytes of nibbles).
        let packed = g.param("w4", Shape::new(&[k * n / 32 * 20], DType::U8));
        let y4 = g.dequant_matmul_packed(x, packed, rlx_ir::quant::QuantScheme::GgufQ4_1, Shape::new(&[m, n], DType::F32));
        // Int8 blocks of 32 along K: i8 weight, f32 scale and zero point per block.
        let w8 = g.param("w8", Shape::new(&[k, n], DType::I8));
        let sc = g.param("s8", Shape::new(&[k / 32, n], DType::F32));
        let zp = g.param("z8", Shape::new(&[k / 32, n], DType::F32));
        let y8 = g.dequant_matmul(x, w8, sc, zp, rlx_ir::quant::QuantScheme::Int8Block { block_size: 32 }, Shape::new(&[m, n], DType::F32));
        // f16 weight of a plain matmul.
        let wh = g.param("wh", Shape::new(&[k, n], DType::F16));
        let yh = g.matmul(x, wh, Shape::new(&[m, n], DType::F32));
        g.set_outputs(vec![y4, y8, yh]);
        let c = graph_cost(&g, None, &Bindings::none()).unwrap();
        let w = |i: usize| c.nodes[i].bytes.weights;
        assert_eq!(w(0), (k * n / 32 * 20) as u64, "Q4_1: 5 bits per weight");
        assert_eq!(w(1), (k * n + 2 * (k / 32) * n * 4) as u64, "int8 + scales + zero points");
        assert_eq!(w(2), (k * n * 2) as u64, "f16");
        for i in 0..3 {
            assert_eq!(c.nodes[i].flops, Some((2 * m * k * n) as u64));
            assert_eq!(c.nodes[i].bytes.inputs, (m * k * 4) as u64);
            assert_eq!(c.nodes[i].bytes.outputs, (m * n * 4) as u64);
        }
        assert_eq!(c.nodes[0].gemms[0].dtype, "GgufQ4_1");
        assert_eq!(c.nodes[2].gemms[0].dtype, "f16");
    }

    #[test]
    fn attention_is_two_gemms_and_a_softmax() {
        // [B,S,H,D] = [2,10,3,4], heads at axis 2.
        let (b, s, h, d) = (2usize, 10usize, 3usize, 4usize);
        let sh = Shape::new(&[b, s, h, d], DType::F32);
        let mut g = Graph::new("a");
        let q = g.input("q", sh.clone());
        let k = g.input("k", sh.clone());
        let v = g.input("v", sh.clone());
        let mask = g.input("mask", Shape::new(&[b, 1, s, s], DType::F32));
        let o = g.attention(q, k, v, mask, h, d, sh.clone());
        g.set_outputs(vec![o]);
        let c = graph_cost(&g, None, &Bindings::none()).unwrap();
        let bh = (b * h) as u64;
        assert_eq!(c.nodes[0].gemms, vec![
            GemmShape { m: s as u64, k: d as u64, n: s as u64, batch: bh, dtype: "f32".into(), weight: false },
            GemmShape { m: s as u64, k: s as u64, n: d as u64, batch: bh, dtype: "f32".into(), weight: false },
        ]);
        assert_eq!(c.nodes[0].flops, Some((2 * 2 * b * h * s * s * d + 5 * b * h * s * s) as u64));

        // Grouped-query [B,H,S,D] with S equal to the head count (SmolLM2 at 9 tokens: 9 query
        // heads, 3 KV heads): K [B,3,9,D] follows Q's layout, 9 keys (not its 3 heads); and
        // rank 3 [B,S,H*D], every head counted.
        for (qd, kd, out) in [
            (vec![1, 9, 9, 64], vec![1, 3, 9, 64], vec![1, 9, 9, 64]),
            (vec![2, 9, 9 * 64], vec![2, 9, 9 * 64], vec![2, 9, 9 * 64]),
        ] {
            let (h, s, d, b) = (9usize, 9usize, 64usize, qd[0]);
            let mut g = Graph::new("gqa");
            let q = g.input("q", Shape::new(&qd, DType::F32));
            let k = g.input("k", Shape::new(&kd, DType::F32));
            let v = g.input("v", Shape::new(&kd, DType::F32));
            let o = g.attention_kind_opts(q, k, v, h, d, rlx_ir::op::MaskKind::Causal, Shape::new(&out, DType::F32), None, None);
            g.set_outputs(vec![o]);
            let c = graph_cost(&g, None, &Bindings::none()).unwrap();
            let bh = (b * h) as u64;
            assert_eq!(c.nodes[0].gemms[0], GemmShape { m: s as u64, k: d as u64, n: s as u64, batch: bh, dtype: "f32".into(), weight: false }, "{qd:?}");
            assert_eq!(c.nodes[0].flops, Some((2 * 2 * b * h * s * s * d + 5 * b * h * s * s) as u64), "{qd:?}");
        }
    }

    #[test]
    fn empty_graph_and_unbound_dim_are_clear_errors() {
        let e = graph_cost(&Graph::new("empty"), None, &Bindings::none()).unwrap_err();
        assert_eq!(e, CostError::Empty { graph: "empty".into() });
        assert!(e.to_string().contains("has no compute nodes"), "{e}");
        let mut g = Graph::new("params_only");
        g.param("w", Shape::new(&[2, 2], DType::F32));
        assert!(matches!(graph_cost(&g, None, &Bindings::none()), Err(CostError::Empty { .. })));

        // x: [?0, 8] x w: [8, 16].
        let mut g = Graph::new("sym");
        let x = g.input("x", Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(8)], DType::F32));
        let w = g.param("w", Shape::new(&[8, 16], DType::F32));
        let y = g.matmul(x, w, Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(16)], DType::F32));
        g.set_outputs(vec![y]);
        let e = graph_cost(&g, None, &Bindings::none()).unwrap_err();
        assert_eq!(e, CostError::UnboundDim { node: 0, op: "input".into(), symbol: 0 });
        assert!(e.to_string().starts_with("unbound dim ?0 in node %0"), "{e}");
        let b = Bindings::from_inputs(&g, &[("x", &[5, 8])]).unwrap();
        assert_eq!(graph_cost(&g, None, &b).unwrap().flops(), 2 * 5 * 8 * 16);
        let e = Bindings::from_inputs(&g, &[("x", &[5, 9])]).unwrap_err();
        assert!(e.to_string().contains("dim 1 is 9, the graph declares 8"), "{e}");
        let e = Bindings::from_inputs(&g, &[("y", &[5, 8])]).unwrap_err();
        assert!(e.to_string().contains("no input of this name"), "{e}");
    }
}
