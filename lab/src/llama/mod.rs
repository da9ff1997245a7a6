//! A Llama-architecture decoder read from a GGUF file (read with `rlx-gguf`) and built into an
//! RLX graph here: token embedding (`Gather`), pre-norm blocks of RMSNorm, Q/K/V projections,
//! rotary position embedding (`Op::Rope`), grouped-query causal `Op::Attention`, the output
//! projection, SwiGLU feed-forward (gate, up, down), residual adds, a final RMSNorm and the output
//! head (tied to the token embedding when the file has no `output.weight`).
//!
//! Architecture as in Touvron et al. 2023 (LLaMA) and the GGUF conventions of llama.cpp
//! (`gguf-py/gguf/constants.py` names the tensors and metadata keys). Projection weights stay
//! packed as the file holds them (`Op::DequantMatMul` with a `QuantScheme::Gguf*` scheme, which
//! RLX's CPU kernel dequantizes block by block); what is dequantized to f32 is listed in
//! [`LlamaModel::dequantized`].
//!
//! RoPE: llama.cpp's HF-to-GGUF converter permutes the rows of `attn_q` and `attn_k` so that each
//! head's rotation pairs are adjacent `(2i, 2i+1)` (llama.cpp's `NORM` RoPE) instead of Hugging
//! Face's rotate-half pairs `(i, i + d/2)`. The graph therefore rotates with
//! [`rlx_ir::op::RopeStyle::GptJ`]; `scripts/llama_reference.py` checks this independently by
//! un-permuting the weights and rotating the Hugging Face way.

pub mod tokenizer;
pub mod job;
pub mod measure;

use std::path::Path;

use anyhow::{bail, Context, Result};
use rlx_gguf::{GgmlType, GgufFile, MetaValue};
use rlx_ir::op::{Activation, BinaryOp, MaskKind, RopeStyle};
use rlx_ir::quant::QuantScheme;
use rlx_ir::{DType, Graph, NodeId, Op, Shape};
use rlx_runtime::{CompiledGraph, Session};

/// Hyperparameters of a Llama model, from the GGUF metadata (`llama.*` keys).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LlamaConfig {
    /// Transformer blocks (`llama.block_count`).
    pub layers: usize,
    /// Residual width d_model (`llama.embedding_length`).
    pub dim: usize,
    /// SwiGLU hidden width (`llama.feed_forward_length`).
    pub ffn_dim: usize,
    /// Query heads (`llama.attention.head_count`).
    pub heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`; = heads without GQA).
    pub kv_heads: usize,
    /// Per-head width, `dim / heads`.
    pub head_dim: usize,
    /// Rotated dims per head (`llama.rope.dimension_count`, default `head_dim`).
    pub rope_dims: usize,
    /// RoPE base θ (`llama.rope.freq_base`, default 10000 as in RoFormer, Su et al. 2021).
    pub rope_base: f32,
    /// RMSNorm ε (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Training context length in tokens (`llama.context_length`).
    pub context: usize,
    /// Vocabulary size (rows of `token_embd.weight`).
    pub vocab: usize,
}

fn meta<'a>(f: &'a GgufFile, key: &str) -> Option<&'a MetaValue> {
    f.metadata.get(key)
}

fn meta_usize(f: &GgufFile, key: &str) -> Result<usize> {
    meta(f, key)
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .with_context(|| format!("GGUF metadata '{key}' is missing or not an unsigned integer; is this a Llama-architecture GGUF?"))
}

fn meta_f32(f: &GgufFile, key: &str) -> Option<f32> {
    match meta(f, key)? {
        MetaValue::F32(v) => Some(*v),
        MetaValue::F64(v) => Some(*v as f32),
        _ => None,
    }
}

impl LlamaConfig {
    /// Read the hyperparameters from `f`'s metadata.
    ///
    /// Errors: `general.architecture` is not `llama`, a required key is missing, or the sizes
    /// are inconsistent (`dim` not a multiple of `heads`, `heads` not a multiple of `kv_heads`,
    /// an odd `rope_dims` or one above `head_dim`).
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaConfig> {
        let arch = meta(f, "general.architecture").and_then(|v| v.as_str()).unwrap_or("");
        if arch != "llama" {
            bail!("general.architecture is '{arch}'; opscope builds Llama-architecture GGUF models only");
        }
        let dim = meta_usize(f, "llama.embedding_length")?;
        let heads = meta_usize(f, "llama.attention.head_count")?;
        let kv_heads = meta(f, "llama.attention.head_count_kv").and_then(|v| v.as_first_u32()).map(|v| v as usize).unwrap_or(heads);
        if heads == 0 || dim % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 {
            bail!("inconsistent attention sizes: embedding_length {dim}, head_count {heads}, head_count_kv {kv_heads}");
        }
        let head_dim = dim / heads;
        let rope_dims = meta(f, "llama.rope.dimension_count").and_then(|v| v.as_u64()).map(|v| v as usize).unwrap_or(head_dim);
        if rope_dims % 2 != 0 || rope_dims > head_dim {
            bail!("llama.rope.dimension_count {rope_dims} must be even and at most the head width {head_dim}");
        }
        let vocab = f
            .get("token_embd.weight")
            .and_then(|t| t.shape.get(1).copied())
            .context("the GGUF has no 2-D token_embd.weight tensor")?;
        Ok(LlamaConfig {
            layers: meta_usize(f, "llama.block_count")?,
            dim,
            ffn_dim: meta_usize(f, "llama.feed_forward_length")?,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            rope_base: meta_f32(f, "llama.rope.freq_base").unwrap_or(10000.0),
            rms_eps: meta_f32(f, "llama.attention.layer_norm_rms_epsilon")
                .context("GGUF metadata 'llama.attention.layer_norm_rms_epsilon' is missing")?,
            context: meta_usize(f, "llama.context_length")?,
            vocab,
        })
    }

    /// The RoPE tables `(cos, sin)` for absolute `positions`, each `[positions.len(), rope_dims/2]`
    /// row-major: angle `p * base^(-2i/rope_dims)` for pair `i` (Su et al. 2021, as llama.cpp
    /// computes it). Computed in f64 and rounded to f32.
    pub fn rope_tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.rope_dims / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for i in 0..half {
                let theta = p as f64 * (self.rope_base as f64).powf(-2.0 * i as f64 / self.rope_dims as f64);
                cos.push(theta.cos() as f32);
                sin.push(theta.sin() as f32);
            }
        }
        (cos, sin)
    }
}

/// The `DequantMatMul` scheme for a GGML tensor type, when RLX's CPU kernel decodes it
/// (`rlx-cpu` `gguf_matmul::dequant_block`).
pub fn packed_scheme(t: GgmlType) -> Option<QuantScheme> {
    Some(match t {
        GgmlType::Q4_0 => QuantScheme::GgufQ4_0,
        GgmlType::Q4_1 => QuantScheme::GgufQ4_1,
        GgmlType::Q5_0 => QuantScheme::GgufQ5_0,
        GgmlType::Q5_1 => QuantScheme::GgufQ5_1,
        GgmlType::Q8_0 => QuantScheme::GgufQ8_0,
        GgmlType::Q4K => QuantScheme::GgufQ4K,
        GgmlType::Q5K => QuantScheme::GgufQ5K,
        GgmlType::Q6K => QuantScheme::GgufQ6K,
        _ => return None,
    })
}

/// One weight bound to the compiled graph.
#[derive(Clone)]
enum WeightData {
    /// f32 values (norm gains, the embedding table, dequantized or transposed projections).
    F32(Vec<f32>),
    /// Raw GGUF block bytes, read by `DequantMatMul`.
    Packed(Vec<u8>),
}

/// How one weight reached the graph, for the manifest and stdout.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WeightNote {
    /// GGUF tensor name.
    pub tensor: String,
    /// Its GGML type in the file.
    pub ggml_type: String,
    /// `packed` (a `DequantMatMul` reads the file's blocks) or `f32` (dequantized on load).
    pub bound_as: &'static str,
    /// Bytes the graph holds for it.
    pub bytes: usize,
}

/// A Llama model loaded from GGUF: its configuration and weights, ready to build graphs.
pub struct LlamaModel {
    /// Hyperparameters.
    pub config: LlamaConfig,
    /// Graph parameter name -> data.
    weights: Vec<(String, WeightData)>,
    /// How every weight is bound.
    pub notes: Vec<WeightNote>,
    /// A short name for graph names (the file stem).
    pub name: String,
    /// The GGUF metadata (for the tokenizer).
    pub(crate) file: GgufFile,
    /// Projection parameter -> how it is bound.
    projs: std::collections::HashMap<String, Proj>,
    /// Keep projections packed where RLX decodes their type.
    packed: bool,
}

/// A projection `y = x W^T` with `W` the GGUF `[out, in]` tensor: packed or f32 `[in, out]`.
#[derive(Clone, Copy)]
enum Proj {
    Packed(QuantScheme),
    F32,
}

impl LlamaModel {
    /// Read `path` (a Llama-architecture GGUF).
    ///
    /// Errors: the file is missing or not GGUF, the metadata is not Llama's
    /// ([`LlamaConfig::from_gguf`]), a tensor is missing or has an unexpected shape, or a
    /// projection's type is neither one RLX's `DequantMatMul` decodes nor f32/f16/bf16.
    pub fn load(path: &Path) -> Result<LlamaModel> {
        Self::load_with(path, true)
    }

    /// [`LlamaModel::load`], with `packed = false` binding every projection (and the head) as
    /// f32 `[in, out]` dequantized from the file for a plain `MatMul`, as a model with f32
    /// weights arrives (the values are the file's: Q4_1 values stay on the Q4_1 grid).
    pub fn load_with(path: &Path, packed: bool) -> Result<LlamaModel> {
        if !path.is_file() {
            bail!("{}: no such GGUF file (run scripts/fetch-assets.sh to fetch SmolLM2-135M)", path.display());
        }
        let mut magic = [0u8; 4];
        let read = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
        if read.is_ok() && &magic != b"GGUF" {
            let hint = if magic[0] == 0x08 { " (it looks like ONNX: pass it as --onnx, with --tokenizer)" } else { "" };
            bail!("{}: not a GGUF file: it does not begin with 'GGUF'{hint}; --gguf takes a Llama-architecture GGUF decoder such as SmolLM2-135M", path.display());
        }
        let file = GgufFile::from_path(path).with_context(|| format!("reading {} as GGUF", path.display()))?;
        let config = LlamaConfig::from_gguf(&file).with_context(|| path.display().to_string())?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().replace(|c: char| !c.is_ascii_alphanumeric(), "_"))
            .unwrap_or_else(|| "llama".into());
        let mut m = LlamaModel { config, weights: Vec::new(), notes: Vec::new(), name, file, projs: Default::default(), packed };
        m.load_weights()?;
        Ok(m)
    }

    fn tensor(&self, name: &str, want: &[usize]) -> Result<&rlx_gguf::GgufTensor> {
        let t = self.file.get(name).with_context(|| format!("the GGUF has no tensor '{name}'"))?;
        if t.shape != want {
            bail!("tensor '{name}' has GGML shape {:?}, expected {want:?} from the metadata", t.shape);
        }
        Ok(t)
    }

    fn push_f32(&mut self, param: &str, tensor: &str, want: &[usize]) -> Result<()> {
        let t = self.tensor(tensor, want)?.clone();
        let (data, _) = self.file.dequant_f32(tensor).with_context(|| format!("dequantizing '{tensor}'"))?;
        self.notes.push(WeightNote { tensor: tensor.into(), ggml_type: format!("{:?}", t.dtype), bound_as: "f32", bytes: data.len() * 4 });
        self.weights.push((param.into(), WeightData::F32(data)));
        Ok(())
    }

    /// A projection weight, GGML shape `[k, n]` (`n` rows of `k`): packed when RLX decodes its
    /// type, else dequantized and transposed to f32 `[k, n]` for a plain `MatMul`.
    fn push_proj(&mut self, param: &str, tensor: &str, k: usize, n: usize) -> Result<Proj> {
        let t = self.tensor(tensor, &[k, n])?.clone();
        if let Some(scheme) = packed_scheme(t.dtype).filter(|_| self.packed) {
            if k % scheme.gguf_block_size() as usize != 0 {
                bail!("tensor '{tensor}': row length {k} is not a multiple of the {:?} block size", t.dtype);
            }
            let bytes = self.file.tensor_bytes(&t)?.to_vec();
            self.notes.push(WeightNote { tensor: tensor.into(), ggml_type: format!("{:?}", t.dtype), bound_as: "packed", bytes: bytes.len() });
            self.weights.push((param.into(), WeightData::Packed(bytes)));
            self.projs.insert(param.into(), Proj::Packed(scheme));
            return Ok(Proj::Packed(scheme));
        }
        if packed_scheme(t.dtype).is_none() && !matches!(t.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            bail!(
                "tensor '{tensor}' is {:?}: RLX's DequantMatMul decodes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, and f32/f16/bf16 are dequantized; convert the model to one of these",
                t.dtype
            );
        }
        let (w, _) = self.file.dequant_f32(tensor)?;
        // `w` is [n, k] row-major; MatMul wants [k, n].
        let mut wt = vec![0f32; k * n];
        for r in 0..n {
            for c in 0..k {
                wt[c * n + r] = w[r * k + c];
            }
        }
        self.notes.push(WeightNote { tensor: tensor.into(), ggml_type: format!("{:?}", t.dtype), bound_as: "f32", bytes: wt.len() * 4 });
        self.weights.push((param.into(), WeightData::F32(wt)));
        self.projs.insert(param.into(), Proj::F32);
        Ok(Proj::F32)
    }

    fn load_weights(&mut self) -> Result<()> {
        let c = self.config.clone();
        let (d, kv) = (c.dim, c.kv_heads * c.head_dim);
        self.push_f32("token_embd.weight", "token_embd.weight", &[d, c.vocab])?;
        for l in 0..c.layers {
            let p = format!("blk.{l}");
            self.push_f32(&format!("{p}.attn_norm.weight"), &format!("{p}.attn_norm.weight"), &[d])?;
            self.push_f32(&format!("{p}.ffn_norm.weight"), &format!("{p}.ffn_norm.weight"), &[d])?;
            for (w, k, n) in [("attn_q", d, d), ("attn_k", d, kv), ("attn_v", d, kv), ("attn_output", d, d), ("ffn_gate", d, c.ffn_dim), ("ffn_up", d, c.ffn_dim), ("ffn_down", c.ffn_dim, d)] {
                self.push_proj(&format!("{p}.{w}.weight"), &format!("{p}.{w}.weight"), k, n)?;
            }
        }
        self.push_f32("output_norm.weight", "output_norm.weight", &[d])?;
        self.weights.push((ZERO_BETA.into(), WeightData::F32(vec![0.0; d])));
        let head = if self.file.get("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
        // Tied head: the packed embedding bytes bound a second time, as `output.weight`.
        self.push_proj("output.weight", head, d, c.vocab)?;
        Ok(())
    }

    fn proj_kind(&self, param: &str) -> Proj {
        self.projs.get(param).copied().unwrap_or(Proj::F32)
    }

    /// The parsed GGUF file (metadata, e.g. for [`tokenizer::GgufTokenizer::from_gguf`]).
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }

    /// The weights dequantized to f32 on load (GGUF tensor and type), as the manifest lists them.
    pub fn dequantized(&self) -> Vec<&WeightNote> {
        self.notes.iter().filter(|n| n.bound_as == "f32").collect()
    }

    /// Bind every weight of `c` (parameters the graph does not use are skipped).
    pub fn bind(&self, c: &mut CompiledGraph, graph: &Graph) {
        for (name, data) in &self.weights {
            if graph.param_id(name).is_none() {
                continue;
            }
            match data {
                WeightData::F32(v) => c.set_param(name, v),
                WeightData::Packed(b) => c.set_param_typed(name, b, DType::U8),
            }
        }
    }

    /// Compile `graph` (through `Session::compile_with`, so taps see it) and bind the weights.
    pub fn compile(&self, session: &Session, graph: &Graph) -> CompiledGraph {
        let mut c = session.compile_with(graph.clone(), &crate::model::compile_options());
        self.bind(&mut c, graph);
        c
    }

    /// The prefill graph for `batch` sequences of `seq` tokens.
    ///
    /// Inputs: `input_ids` I64 `[batch*seq]` (row-major `[batch, seq]`), `rope_cos` and
    /// `rope_sin` F32 `[seq, rope_dims/2]` ([`LlamaConfig::rope_tables`] of `0..seq`), and
    /// `attention_mask` F32 `[batch, seq]` (1 on tokens, 0 on padding). The model itself needs no
    /// mask (causal attention keeps right padding out of real positions); opscope's taps read
    /// it, by its Hugging Face name, to leave padding rows out of their statistics, and its
    /// shape tells them which of the `[batch*seq, *]` rows belong to one sequence (no
    /// adjacent-row statistic pairs two sequences).
    /// Outputs: `logits` F32 `[batch*seq, vocab]`, then per block `k` and `v` F32
    /// `[batch, kv_heads, seq, head_dim]` (after RoPE: the KV cache) when `kv_outputs`, then
    /// `attention_mask` itself.
    ///
    /// Causal attention makes right padding harmless: position `t`'s logits depend only on
    /// tokens `0..=t`.
    pub fn prefill_graph(&self, batch: usize, seq: usize, kv_outputs: bool) -> Graph {
        let c = &self.config;
        let mut b = Builder::new(self, format!("{}_prefill_b{batch}_s{seq}", self.name));
        let ids = b.g.input("input_ids", Shape::new(&[batch * seq], DType::I64));
        let cos = b.g.input("rope_cos", Shape::new(&[seq, c.rope_dims / 2], DType::F32));
        let sin = b.g.input("rope_sin", Shape::new(&[seq, c.rope_dims / 2], DType::F32));
        let mask = b.g.input("attention_mask", Shape::new(&[batch, seq], DType::F32));
        let (logits, kvs) = b.forward(ids, cos, sin, batch, seq, None);
        let mut outs = vec![logits];
        if kv_outputs {
            for (k, v) in kvs {
                outs.push(k);
                outs.push(v);
            }
        }
        // Returned as the last output so that fusion's dead-code elimination keeps the input for
        // the taps (RLX drops an input no output depends on).
        outs.push(mask);
        b.g.set_outputs(outs);
        b.g
    }

    /// The decode graph: one new token per sequence against a KV cache of `cache` slots.
    ///
    /// Inputs: `input_ids` I64 `[batch]`, `rope_cos`/`rope_sin` F32 `[batch, rope_dims/2]` (each
    /// sequence's new token at its own position), per block
    /// `past_k.{l}` and `past_v.{l}` F32 `[batch, kv_heads, cache, head_dim]`, and `kv_mask` F32
    /// `[batch, cache + 1]` (1 on valid cache slots and on the last slot, the new token; 0 on
    /// unused slots), and `attention_mask` F32 `[batch, 1]` (all 1: the model does not read it;
    /// its shape tells opscope's taps that the `[batch, *]` rows are one token of each of
    /// `batch` sequences, so no adjacent-row statistic pairs two of them). Outputs: `logits` F32
    /// `[batch, vocab]`, then per block the new token's `k` and `v` F32
    /// `[batch, kv_heads, 1, head_dim]` for the caller to store in its cache, then
    /// `attention_mask` itself (kept alive for the taps, as in the prefill graph).
    /// The shapes are fixed, so one compile serves every decode step.
    pub fn decode_graph(&self, batch: usize, cache: usize) -> Graph {
        let c = &self.config;
        let mut b = Builder::new(self, format!("{}_decode_b{batch}_c{cache}", self.name));
        let ids = b.g.input("input_ids", Shape::new(&[batch], DType::I64));
        let cos = b.g.input("rope_cos", Shape::new(&[batch, c.rope_dims / 2], DType::F32));
        let sin = b.g.input("rope_sin", Shape::new(&[batch, c.rope_dims / 2], DType::F32));
        let mask = b.g.input("kv_mask", Shape::new(&[batch, cache + 1], DType::F32));
        let rows = b.g.input("attention_mask", Shape::new(&[batch, 1], DType::F32));
        let mut past = Vec::new();
        for l in 0..c.layers {
            let s = Shape::new(&[batch, c.kv_heads, cache, c.head_dim], DType::F32);
            let k = b.g.input(format!("past_k.{l}"), s.clone());
            let v = b.g.input(format!("past_v.{l}"), s);
            past.push((k, v));
        }
        let (logits, kvs) = b.forward(ids, cos, sin, batch, 1, Some((&past, mask, cache)));
        let mut outs = vec![logits];
        for (k, v) in kvs {
            outs.push(k);
            outs.push(v);
        }
        outs.push(rows);
        b.g.set_outputs(outs);
        b.g
    }
}

/// The parameter holding RmsNorm's zero bias.
const ZERO_BETA: &str = "rms_norm.zero_bias";

/// Graph construction state: the graph and the model it reads its weights' shapes from.
struct Builder<'a> {
    g: Graph,
    m: &'a LlamaModel,
}

fn f32s(dims: &[usize]) -> Shape {
    Shape::new(dims, DType::F32)
}

impl<'a> Builder<'a> {
    fn new(m: &'a LlamaModel, name: String) -> Builder<'a> {
        Builder { g: Graph::new(name), m }
    }

    fn named(&mut self, id: NodeId, name: String) -> NodeId {
        self.g.node_mut(id).name = Some(name);
        id
    }

    /// `x [rows, k] -> [rows, n]` through the projection `site` (weight `{site}.weight`).
    fn proj(&mut self, x: NodeId, site: &str, rows: usize, k: usize, n: usize) -> NodeId {
        let param = &format!("{site}.weight");
        let y = match self.m.proj_kind(param) {
            Proj::Packed(scheme) => {
                let bytes = match self.m.weights.iter().find(|(p, _)| p == param) {
                    Some((_, WeightData::Packed(b))) => b.len(),
                    _ => 0,
                };
                let w = self.g.param(param, Shape::new(&[bytes], DType::U8));
                self.g.dequant_matmul_packed(x, w, scheme, f32s(&[rows, n]))
            }
            Proj::F32 => {
                let w = self.g.param(param, f32s(&[k, n]));
                self.g.matmul(x, w, f32s(&[rows, n]))
            }
        };
        self.named(y, site.to_string())
    }

    /// RMSNorm `site` (gain `{site}.weight`) over the last axis of `x [rows, dim]`.
    fn rms_norm(&mut self, x: NodeId, site: &str, rows: usize) -> NodeId {
        let d = self.m.config.dim;
        let gamma = self.g.param(format!("{site}.weight"), f32s(&[d]));
        // RLX's RmsNorm takes `[x, gamma, beta]` (rlx-fusion's residual fusion reads input 2);
        // Llama has no bias: one shared zero vector.
        let beta = match self.g.param_id(ZERO_BETA) {
            Some(id) => id,
            None => self.g.param(ZERO_BETA, f32s(&[d])),
        };
        let y = self.g.add_node(Op::RmsNorm { axis: -1, eps: self.m.config.rms_eps }, vec![x, gamma, beta], f32s(&[rows, d]));
        self.named(y, site.to_string())
    }

    fn reshape(&mut self, x: NodeId, dims: &[usize]) -> NodeId {
        self.g.reshape(x, dims.iter().map(|&d| d as i64).collect(), f32s(dims))
    }

    fn transpose_bshd(&mut self, x: NodeId, dims_in: [usize; 4]) -> NodeId {
        let [a, b, c, d] = dims_in;
        self.g.add_node(Op::Transpose { perm: vec![0, 2, 1, 3] }, vec![x], f32s(&[a, c, b, d]))
    }

    /// Rotate `x [rows, heads*head_dim]` as `[batch, seq, heads*head_dim]` with the tables.
    fn rope(&mut self, x: NodeId, cos: NodeId, sin: NodeId, batch: usize, seq: usize, width: usize, name: String) -> NodeId {
        let c = &self.m.config;
        let x3 = self.reshape(x, &[batch, seq, width]);
        let op = Op::Rope { head_dim: c.head_dim, n_rot: c.rope_dims, style: RopeStyle::GptJ };
        let y = self.g.add_node(op, vec![x3, cos, sin], f32s(&[batch, seq, width]));
        self.named(y, name)
    }

    /// The whole forward pass; `past` = (per-block cache inputs, mask, cache slots) for decode.
    /// Returns the logits and per block the new K (after RoPE) and V as `[batch, kv_heads, seq, head_dim]`.
    fn forward(&mut self, ids: NodeId, cos: NodeId, sin: NodeId, batch: usize, seq: usize, past: Option<(&[(NodeId, NodeId)], NodeId, usize)>) -> (NodeId, Vec<(NodeId, NodeId)>) {
        let c = self.m.config.clone();
        let rows = batch * seq;
        let (d, hd, kvw) = (c.dim, c.head_dim, c.kv_heads * c.head_dim);
        let table = self.g.param("token_embd.weight", f32s(&[c.vocab, d]));
        let mut x = self.g.gather(table, ids, 0, f32s(&[rows, d]));
        x = self.named(x, "token_embd".into());
        let mut kvs = Vec::new();
        for l in 0..c.layers {
            let p = format!("blk.{l}");
            let h = self.rms_norm(x, &format!("{p}.attn_norm"), rows);
            let q = self.proj(h, &format!("{p}.attn_q"), rows, d, d);
            let k = self.proj(h, &format!("{p}.attn_k"), rows, d, kvw);
            let v = self.proj(h, &format!("{p}.attn_v"), rows, d, kvw);
            let q = self.rope(q, cos, sin, batch, seq, d, format!("{p}.rope_q"));
            let k = self.rope(k, cos, sin, batch, seq, kvw, format!("{p}.rope_k"));
            // [B, S, H, D] -> [B, H, S, D]: the head-canonical layout, which the CPU kernel tells
            // apart from [B, S, H, D] by `dim(1) == num_heads` — unambiguous even when S == H.
            let q4 = self.reshape(q, &[batch, seq, c.heads, hd]);
            let q4 = self.transpose_bshd(q4, [batch, seq, c.heads, hd]);
            let k4 = self.reshape(k, &[batch, seq, c.kv_heads, hd]);
            let k4 = self.transpose_bshd(k4, [batch, seq, c.kv_heads, hd]);
            let v4 = self.reshape(v, &[batch, seq, c.kv_heads, hd]);
            let v4 = self.transpose_bshd(v4, [batch, seq, c.kv_heads, hd]);
            kvs.push((k4, v4));
            let attn_op = |mask_kind| Op::Attention { num_heads: c.heads, head_dim: hd, v_head_dim: None, mask_kind, score_scale: None, attn_logit_softcap: None };
            let att = match past {
                None => self.g.add_node(attn_op(MaskKind::Causal), vec![q4, k4, v4], f32s(&[batch, c.heads, seq, hd])),
                Some((past, mask, cache)) => {
                    let (pk, pv) = past[l];
                    let kk = self.g.concat(vec![pk, k4], 2, f32s(&[batch, c.kv_heads, cache + seq, hd]));
                    let vv = self.g.concat(vec![pv, v4], 2, f32s(&[batch, c.kv_heads, cache + seq, hd]));
                    self.g.add_node(attn_op(MaskKind::Custom), vec![q4, kk, vv, mask], f32s(&[batch, c.heads, seq, hd]))
                }
            };
            let att = self.named(att, format!("{p}.attn"));
            let att = self.transpose_bshd(att, [batch, c.heads, seq, hd]);
            let att = self.reshape(att, &[rows, d]);
            let o = self.proj(att, &format!("{p}.attn_output"), rows, d, d);
            x = self.g.binary(BinaryOp::Add, x, o, f32s(&[rows, d]));
            x = self.named(x, format!("{p}.attn_residual"));
            let h = self.rms_norm(x, &format!("{p}.ffn_norm"), rows);
            let gate = self.proj(h, &format!("{p}.ffn_gate"), rows, d, c.ffn_dim);
            let up = self.proj(h, &format!("{p}.ffn_up"), rows, d, c.ffn_dim);
            let act = self.g.activation(Activation::Silu, gate, f32s(&[rows, c.ffn_dim]));
            let gu = self.g.binary(BinaryOp::Mul, act, up, f32s(&[rows, c.ffn_dim]));
            let down = self.proj(gu, &format!("{p}.ffn_down"), rows, c.ffn_dim, d);
            x = self.g.binary(BinaryOp::Add, x, down, f32s(&[rows, d]));
            x = self.named(x, format!("{p}.ffn_residual"));
        }
        let h = self.rms_norm(x, "output_norm", rows);
        let logits = self.proj(h, "output", rows, d, c.vocab);
        (logits, kvs)
    }
}
