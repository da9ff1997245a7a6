//! Probes: sketches whose statistics need an op's semantics or several tensors, computed by the
//! same sketch op ([`crate::sketch::SKETCH_OP`] and its two- and three-input forms) in one call.
//!
//! - **Attention** ([`AttnProbe`]): from softmax probabilities (the unfused
//!   `MatMul -> Softmax -> MatMul` an ONNX BERT arrives as), or rebuilt from a fused
//!   `Op::Attention`'s Q and K exactly as RLX's CPU kernel computes them. Queries and keys that
//!   the attention mask marks as padding are excluded from every statistic and their leftover
//!   mass reported separately ([`Stat::PadMass`]).
//! - **Routing** ([`RouteProbe`]): a MoE router's chosen experts (and its scores): per-expert
//!   load, gate mass and importance.
//! - **Residual** ([`ResidualProbe`]): a residual stream `x` and a block's branch `f(x)`: the
//!   branch-to-stream norm ratio and the cosine between `x` and `x + f(x)` (block influence).
//!
//! Every probe writes the compile tag at value 0 and then the selected statistics in
//! [`Stat::ALL`] order, laid out by [`crate::sketch::SketchSpec::layout`]. A statistic with no
//! data (no non-padding query, a zero row) is NaN and is not recorded.

use rlx_cpu::op_registry::CpuTensorRef;
use serde::{Deserialize, Serialize};

use crate::sketch::{static_dims, SketchSpec, Stat};

/// An additive score bias at or below this masks the key: `exp(-1000)` is 0 in f32 and f64, so
/// such a key can receive no probability. It covers both conventions ONNX BERT exports use,
/// `(1 - mask) * -10000` (Hugging Face transformers before 4.27) and `finfo(float32).min`.
pub const MASKED_BIAS: f32 = -1000.0;

/// How a sketch op reads its inputs.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub enum Probe {
    /// One tensor, the plain statistics (`min`, `hist`, ...).
    #[default]
    Tensor,
    /// Attention weights.
    Attention(AttnProbe),
    /// MoE routing.
    Route(RouteProbe),
    /// A residual connection.
    Residual(ResidualProbe),
}

/// Attention geometry: probabilities are `[batch, heads, sq, sk]` (queries by keys per head).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttnProbe {
    /// Batch size `B`.
    pub batch: usize,
    /// Query heads `H`.
    pub heads: usize,
    /// Queries per sequence `Sq`.
    pub sq: usize,
    /// Keys per sequence `Sk`.
    pub sk: usize,
    /// `k` of [`Stat::TopkMass`].
    pub topk: usize,
    /// Where the probabilities come from.
    pub source: AttnSource,
}

/// Where attention probabilities come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AttnSource {
    /// Input 0 holds the probabilities, contiguous `[B, H, Sq, Sk]`. With `bias`, input 1 is the
    /// additive score bias the softmax read, of the given 4 dims (right-aligned to
    /// `[B, H, Sq, Sk]`, 1 = broadcast); an entry at or below [`MASKED_BIAS`] masks that key.
    Probs {
        /// Dims of the bias input, if any.
        bias: Option<[usize; 4]>,
    },
    /// Inputs Q and K (and the mask, for [`FusedMask::Keys`] / [`FusedMask::Bias`]) of a fused
    /// `Op::Attention`; the probabilities are rebuilt as RLX 0.2.19's CPU kernel computes them:
    /// `s = (q . k) * scale` in f32, masked scores set to the runtime's `attn_mask_neg_inf`, the
    /// bias added, the soft-cap `c * tanh(s / c)` applied (on the `[B, H, S, D]` path only: RLX
    /// 0.2.19's other layouts skip it, measured), then RLX's own softmax kernel
    /// (`rlx_cpu::kernels::neon_softmax`).
    Fused {
        /// Per-head width of Q and K.
        head_dim: usize,
        /// K/V heads (`< heads` for grouped-query attention; query head `h` reads K head
        /// `h / (heads / kv_heads)`, as the CPU kernel does).
        kv_heads: usize,
        /// Q/K are `[B, H, S, D]` (else `[B, S, H, D]`, or rank 3 `[B, S, H*D]`).
        bhsd: bool,
        /// Score scale (`score_scale`, default `head_dim^-0.5`).
        scale: f32,
        /// Logit soft-cap `c` (0 = none).
        softcap: f32,
        /// The op's mask kind.
        mask: FusedMask,
        /// Q is read in place from a wider tensor (a merged QKV projection, which RLX's kernel
        /// also reads in place): `[column offset, row stride]` of the `[B*S, stride]` rows.
        #[serde(default)]
        q_view: Option<[usize; 2]>,
        /// K likewise.
        #[serde(default)]
        k_view: Option<[usize; 2]>,
    },
}

/// `Op::Attention`'s mask kinds as the probe applies them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum FusedMask {
    /// Every query attends to every key.
    None,
    /// Query `q` (absolute position `Sk - Sq + q`) attends to keys at or before it.
    Causal,
    /// Keys in `[pos - w, pos]`.
    Window(usize),
    /// Input 2 is `[B, Sk]`, a key is padding when below the runtime's `mask_binary_threshold`
    /// (0.5 by default).
    Keys,
    /// Input 2 is an additive `[B, H, Sq, Sk]` bias.
    Bias,
}

/// Router geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteProbe {
    /// Number of experts `E`.
    pub experts: usize,
    /// Tokens `T` (rows).
    pub tokens: usize,
    /// Experts chosen per token `k`.
    pub k: usize,
    /// What input 1 holds, if anything.
    pub scores: RouteScores,
}

/// The router scores a route probe reads next to the chosen expert ids (input 0, `[T, k]` or
/// `[T]`, f32-encoded ids as RLX's `TopK` and `GroupedMatMul` use).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum RouteScores {
    /// No scores: load only.
    None,
    /// Input 1 is `[T, E]` gate values used as they are: the router's softmax output, or its
    /// sigmoid output (per-expert gates that need not sum to 1).
    Probs,
    /// Input 1 is `[T, E]` logits; gate probabilities are their softmax (computed in f64).
    Logits,
}

/// Residual geometry: `x` and `f(x)` are `[rows, width]` after flattening leading dims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResidualProbe {
    /// Rows `R` (tokens).
    pub rows: usize,
    /// Width `D` (hidden size).
    pub width: usize,
    /// Input 2 is a `[rows]` row mask (1 = token, 0 = padding): padding rows are left out of
    /// every statistic.
    #[serde(default)]
    pub masked: bool,
}

impl Probe {
    /// Values statistic `s` occupies under this probe, `None` for [`Probe::Tensor`].
    pub fn stat_len(&self, s: Stat) -> Option<usize> {
        Some(match self {
            Probe::Tensor => return None,
            Probe::Attention(a) => match s {
                Stat::Queries | Stat::Keys | Stat::Topk => 1,
                Stat::PeakPos => a.heads * a.sq,
                Stat::RecvPos => a.heads * a.sk,
                _ => a.heads,
            },
            Probe::Route(r) => match s {
                Stat::Load | Stat::GateMass | Stat::Importance => r.experts,
                _ => 1,
            },
            Probe::Residual(r) => match s {
                Stat::CosRow => r.rows,
                _ => 1,
            },
        })
    }

    /// The statistics this probe can compute.
    pub fn stats(&self) -> &'static [Stat] {
        match self {
            Probe::Tensor => &[],
            Probe::Attention(_) => &ATTN_STATS,
            Probe::Route(r) if r.scores == RouteScores::None => &[Stat::Tokens, Stat::Load, Stat::BadIds],
            Probe::Route(_) => &ROUTE_STATS,
            Probe::Residual(_) => &RESIDUAL_STATS,
        }
    }
}

/// Statistics of an attention probe, in layout order.
pub const ATTN_STATS: [Stat; 13] = [
    Stat::Queries,
    Stat::Keys,
    Stat::Peak,
    Stat::Entropy,
    Stat::EntropyNorm,
    Stat::Topk,
    Stat::TopkMass,
    Stat::SinkFirst,
    Stat::SinkLast,
    Stat::PadMass,
    Stat::RecvMax,
    Stat::PeakPos,
    Stat::RecvPos,
];

/// Statistics of a route probe with scores, in layout order.
pub const ROUTE_STATS: [Stat; 6] = [
    Stat::Tokens,
    Stat::Load,
    Stat::GateMass,
    Stat::Importance,
    Stat::KeptMass,
    Stat::BadIds,
];

/// Statistics of a residual probe, in layout order.
pub const RESIDUAL_STATS: [Stat; 4] = [Stat::Rows, Stat::Ratio, Stat::Cos, Stat::CosRow];

/// A spec for `probe` computing `stats` (filtered to what the probe computes, sorted).
pub fn spec(probe: Probe, stats: &[Stat]) -> SketchSpec {
    let mut set: Vec<Stat> = stats.iter().copied().filter(|s| probe.stats().contains(s)).collect();
    if set.contains(&Stat::TopkMass) {
        set.push(Stat::Topk); // the k that topk_mass is about travels with it
    }
    set.sort();
    set.dedup();
    SketchSpec {
        stats: set,
        hist_bins: 1,
        hist_range: crate::sketch::HistRange::Absmax,
        elemsig_k: 1,
        chans: 0,
        rows: 0,
        tag: 0,
        memo: false,
        probe,
    }
}

/// Run a probe's kernel: `out` has `spec.len()` values.
///
/// Errors: an input count or size that does not match the probe's geometry.
pub fn execute(spec: &SketchSpec, inputs: &[CpuTensorRef<'_>], out: &mut [f32]) -> Result<(), String> {
    let f32s = |i: usize, what: &str| -> Result<&[f32], String> {
        inputs
            .get(i)
            .ok_or_else(|| format!("opscope probe: missing input {i} ({what})"))?
            .expect_f32(what)
    };
    let values: Vec<(Stat, Vec<f32>)> = match &spec.probe {
        Probe::Tensor => return Err("opscope probe: a tensor sketch reached the probe kernel".into()),
        Probe::Attention(a) => {
            let stats = match &a.source {
                AttnSource::Probs { bias } => {
                    let p = f32s(0, "attention probabilities")?;
                    need(p.len(), a.batch * a.heads * a.sq * a.sk, "attention probabilities")?;
                    let bias = match bias {
                        Some(d) => {
                            let b = f32s(1, "attention bias")?;
                            need(b.len(), d.iter().product(), "attention bias")?;
                            Some((b, *d))
                        }
                        None => None,
                    };
                    let allowed = |b: usize, h: usize, q: usize, k: usize| match &bias {
                        None => true,
                        Some((v, d)) => v[bcast(d, [b, h, q, k])] > MASKED_BIAS,
                    };
                    attn_stats(a, p, &allowed)
                }
                AttnSource::Fused { .. } => {
                    let q = f32s(0, "attention Q")?;
                    let k = f32s(1, "attention K")?;
                    let mask = if inputs.len() > 2 { Some(f32s(2, "attention mask")?) } else { None };
                    let (p, allowed) = rebuild_fused(a, q, k, mask)?;
                    attn_stats(a, &p, &|b, h, qi, ki| allowed[((b * a.heads + h) * a.sq + qi) * a.sk + ki])
                }
            };
            stats
        }
        Probe::Route(r) => {
            let ids = f32s(0, "expert ids")?;
            need(ids.len(), r.tokens * r.k, "expert ids")?;
            let scores = match r.scores {
                RouteScores::None => None,
                _ => {
                    let s = f32s(1, "router scores")?;
                    need(s.len(), r.tokens * r.experts, "router scores")?;
                    Some(s)
                }
            };
            route_stats(r, ids, scores)
        }
        Probe::Residual(r) => {
            let x = f32s(0, "residual stream")?;
            let f = f32s(1, "residual branch")?;
            need(x.len(), r.rows * r.width, "residual stream")?;
            need(f.len(), r.rows * r.width, "residual branch")?;
            let mask = if r.masked {
                let m = f32s(2, "residual row mask")?;
                need(m.len(), r.rows, "residual row mask")?;
                Some(m)
            } else {
                None
            };
            residual_stats(r, x, f, mask)
        }
    };
    out[0] = spec.tag as f32;
    for slot in spec.layout() {
        let v = values
            .iter()
            .find(|(s, _)| *s == slot.stat)
            .map(|(_, v)| v.as_slice())
            .ok_or_else(|| format!("opscope probe: {} is not computed by this probe", slot.stat.as_str()))?;
        if v.len() != slot.len {
            return Err(format!("opscope probe: {} has {} values, layout {}", slot.stat.as_str(), v.len(), slot.len));
        }
        out[slot.offset..slot.offset + slot.len].copy_from_slice(v);
    }
    Ok(())
}

fn need(got: usize, want: usize, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("opscope probe: {what} holds {got} values, the geometry needs {want}"))
    }
}

/// Flat index into a tensor of dims `d` broadcast to `[B, H, Sq, Sk]`.
fn bcast(d: &[usize; 4], i: [usize; 4]) -> usize {
    let mut idx = 0;
    for a in 0..4 {
        idx = idx * d[a] + if d[a] == 1 { 0 } else { i[a] };
    }
    idx
}

/// Rebuild a fused `Op::Attention`'s probabilities, `[B, H, Sq, Sk]`, and which (b, h, q, k)
/// the mask allows, exactly as RLX 0.2.19's CPU kernel does (see [`AttnSource::Fused`]).
fn rebuild_fused(a: &AttnProbe, q: &[f32], k: &[f32], mask: Option<&[f32]>) -> Result<(Vec<f32>, Vec<bool>), String> {
    let AttnSource::Fused { head_dim: dh, kv_heads, bhsd, scale, softcap, mask: kind, q_view, k_view } = &a.source else {
        unreachable!("called for fused attention only")
    };
    let (b, nh, sq, sk, dh) = (a.batch, a.heads, a.sq, a.sk, *dh);
    let nkv = (*kv_heads).max(1);
    let group = (nh / nkv).max(1);
    // Row stride and column offset of the [B*S, ...] rows Q and K are read from.
    let [q_col, q_rs] = q_view.unwrap_or([0, nh * dh]);
    let [k_col, k_rs] = k_view.unwrap_or([0, nkv * dh]);
    if *bhsd && (q_view.is_some() || k_view.is_some()) {
        return Err("opscope probe: an in-place Q/K view needs the [B,S,H*D] row layout".into());
    }
    need(q.len(), b * sq * q_rs, "attention Q")?;
    need(k.len(), b * sk * k_rs, "attention K")?;
    if q_col + nh * dh > q_rs || k_col + nkv * dh > k_rs {
        return Err("opscope probe: the Q/K view runs past its row".into());
    }
    let cfg = rlx_cpu::config::RuntimeConfig::global();
    let (thr, neg) = (cfg.mask_binary_threshold, cfg.attn_mask_neg_inf);
    let m = match kind {
        FusedMask::Keys => {
            let m = mask.ok_or("opscope probe: fused attention with a key mask has no mask input")?;
            need(m.len(), b * sk, "attention key mask")?;
            Some(m)
        }
        FusedMask::Bias => {
            let m = mask.ok_or("opscope probe: fused attention with a bias has no bias input")?;
            need(m.len(), b * nh * sq * sk, "attention bias")?;
            Some(m)
        }
        _ => None,
    };
    let q_off = sk.saturating_sub(sq);
    let mut p = vec![0f32; b * nh * sq * sk];
    let mut allowed = vec![true; p.len()];
    for bi in 0..b {
        for hi in 0..nh {
            let kv = hi / group;
            let base = (bi * nh + hi) * sq * sk;
            let scores = &mut p[base..base + sq * sk];
            for qi in 0..sq {
                let qo = if *bhsd { ((bi * nh + hi) * sq + qi) * dh } else { (bi * sq + qi) * q_rs + q_col + hi * dh };
                for ki in 0..sk {
                    let ko = if *bhsd { ((bi * nkv + kv) * sk + ki) * dh } else { (bi * sk + ki) * k_rs + k_col + kv * dh };
                    let mut dot = 0f32;
                    for d in 0..dh {
                        dot += q[qo + d] * k[ko + d];
                    }
                    let i = qi * sk + ki;
                    scores[i] = dot * scale;
                    let abs_q = q_off + qi;
                    let ok = match kind {
                        FusedMask::None | FusedMask::Bias => true,
                        FusedMask::Keys => m.is_some_and(|m| m[bi * sk + ki] >= thr),
                        FusedMask::Causal => ki <= abs_q,
                        FusedMask::Window(w) => ki >= abs_q.saturating_sub(*w) && ki <= abs_q,
                    };
                    if !ok {
                        scores[i] = neg;
                        allowed[base + i] = false;
                    }
                }
            }
            if let (FusedMask::Bias, Some(m)) = (kind, m) {
                for i in 0..sq * sk {
                    scores[i] += m[base + i];
                    if m[base + i] <= MASKED_BIAS {
                        allowed[base + i] = false;
                    }
                }
            }
            if *softcap > 0.0 && *bhsd { // RLX 0.2.19 soft-caps only on its [B,H,S,D] path
                for s in scores.iter_mut() {
                    *s = softcap * (*s / softcap).tanh();
                }
            }
            rlx_cpu::kernels::neon_softmax(scores, sq, sk);
        }
    }
    Ok((p, allowed))
}

/// The attention statistics of probabilities `p` (`[B, H, Sq, Sk]`) under the mask `allowed`.
///
/// A key of sequence `b` is padding when no (head, query) may attend to it; when `Sq == Sk`
/// (self-attention), query `i` is padding when key `i` is (the BERT convention: a padded token
/// is padded as a query too). Padding queries are left out of every statistic; padding keys get
/// no position statistics, and the mass valid queries put on them is [`Stat::PadMass`]. The first
/// and last keys are the first and last non-padding ones; a sink statistic counts only the
/// queries the mask lets see that key, and `topk_mass` only queries allowed more than `topk` keys.
fn attn_stats(a: &AttnProbe, p: &[f32], allowed: &dyn Fn(usize, usize, usize, usize) -> bool) -> Vec<(Stat, Vec<f32>)> {
    let (nb, nh, sq, sk) = (a.batch, a.heads, a.sq, a.sk);
    let topk = a.topk.clamp(1, sk.max(1));
    let mut peak = vec![0f64; nh];
    let mut ent = vec![0f64; nh];
    let mut ent_norm = vec![0f64; nh];
    let mut ent_norm_n = vec![0f64; nh];
    let mut topm = vec![0f64; nh];
    let mut topm_n = vec![0f64; nh];
    let mut first = vec![0f64; nh];
    let mut first_n = vec![0f64; nh];
    let mut keys = 0f64;
    let mut last = vec![0f64; nh];
    let mut last_n = vec![0f64; nh];
    let mut pad = vec![0f64; nh];
    let mut recv_max = vec![0f64; nh];
    let mut seqs = vec![0f64; nh];
    let mut peak_pos = vec![0f64; nh * sq];
    let mut peak_pos_n = vec![0f64; nh * sq];
    let mut recv_pos = vec![0f64; nh * sk];
    let mut recv_pos_n = vec![0f64; nh * sk];
    let mut queries = 0f64;
    let mut sorted = vec![0f32; sk];
    let mut recv = vec![0f64; sk];
    for b in 0..nb {
        let key_pad: Vec<bool> = (0..sk).map(|k| (0..nh).all(|h| (0..sq).all(|q| !allowed(b, h, q, k)))).collect();
        let valid_q: Vec<bool> = (0..sq).map(|q| !(sq == sk && key_pad[q])).collect();
        let nq = valid_q.iter().filter(|v| **v).count();
        queries += nq as f64;
        let first_key = (0..sk).find(|&k| !key_pad[k]);
        let last_key = (0..sk).rev().find(|&k| !key_pad[k]);
        keys += (sk - key_pad.iter().filter(|p| **p).count()) as f64;
        for h in 0..nh {
            recv.iter_mut().for_each(|r| *r = 0.0);
            for q in (0..sq).filter(|&q| valid_q[q]) {
                let row = &p[((b * nh + h) * sq + q) * sk..][..sk];
                let mut mx = f32::NEG_INFINITY;
                let mut e = 0f64;
                let mut n_allowed = 0usize;
                for (k, &x) in row.iter().enumerate() {
                    mx = mx.max(x);
                    if x > 0.0 {
                        e -= x as f64 * (x as f64).ln();
                    }
                    if allowed(b, h, q, k) {
                        n_allowed += 1;
                    }
                    if key_pad[k] {
                        pad[h] += x as f64;
                    }
                    recv[k] += x as f64;
                }
                peak[h] += mx as f64;
                ent[h] += e;
                if n_allowed >= 2 {
                    ent_norm[h] += e / (n_allowed as f64).ln();
                    ent_norm_n[h] += 1.0;
                }
                // A query that may attend to topk keys or fewer keeps all its mass trivially
                // (the first queries of a causal mask): it says nothing about sparsity.
                if n_allowed > topk {
                    sorted.copy_from_slice(row);
                    sorted.select_nth_unstable_by(topk - 1, |x, y| y.total_cmp(x));
                    topm[h] += sorted[..topk].iter().map(|&x| x as f64).sum::<f64>();
                    topm_n[h] += 1.0;
                }
                // Sinks among the keys this query may see (left padding moves the first key;
                // a causal mask hides the last key from earlier queries).
                if let Some(f) = first_key.filter(|&f| allowed(b, h, q, f)) {
                    first[h] += row[f] as f64;
                    first_n[h] += 1.0;
                }
                if let Some(l) = last_key.filter(|&l| allowed(b, h, q, l)) {
                    last[h] += row[l] as f64;
                    last_n[h] += 1.0;
                }
                peak_pos[h * sq + q] += mx as f64;
                peak_pos_n[h * sq + q] += 1.0;
            }
            if nq > 0 {
                let mut best = f64::NEG_INFINITY;
                for k in (0..sk).filter(|&k| !key_pad[k]) {
                    let r = recv[k] / nq as f64;
                    best = best.max(r);
                    recv_pos[h * sk + k] += r;
                    recv_pos_n[h * sk + k] += 1.0;
                }
                if best.is_finite() {
                    recv_max[h] += best;
                    seqs[h] += 1.0;
                }
            }
        }
    }
    let div = |s: &[f64], n: &[f64]| -> Vec<f32> {
        s.iter().zip(n).map(|(s, n)| if *n > 0.0 { (s / n) as f32 } else { f32::NAN }).collect()
    };
    let per_q = |s: &[f64]| -> Vec<f32> { s.iter().map(|s| if queries > 0.0 { (s / queries) as f32 } else { f32::NAN }).collect() };
    vec![
        (Stat::Queries, vec![queries as f32]),
        (Stat::Keys, vec![if nb > 0 { (keys / nb as f64) as f32 } else { f32::NAN }]),
        (Stat::Peak, per_q(&peak)),
        (Stat::Entropy, per_q(&ent)),
        (Stat::EntropyNorm, div(&ent_norm, &ent_norm_n)),
        (Stat::Topk, vec![topk as f32]),
        (Stat::TopkMass, div(&topm, &topm_n)),
        (Stat::SinkFirst, div(&first, &first_n)),
        (Stat::SinkLast, div(&last, &last_n)),
        (Stat::PadMass, per_q(&pad)),
        (Stat::RecvMax, div(&recv_max, &seqs)),
        (Stat::PeakPos, div(&peak_pos, &peak_pos_n)),
        (Stat::RecvPos, div(&recv_pos, &recv_pos_n)),
    ]
}

/// Routing statistics. An id is valid when it is an integer in `[0, E)`; invalid ids are
/// counted in [`Stat::BadIds`] and assigned to no expert.
fn route_stats(r: &RouteProbe, ids: &[f32], scores: Option<&[f32]>) -> Vec<(Stat, Vec<f32>)> {
    let e = r.experts;
    let mut load = vec![0f64; e];
    let mut gate = vec![0f64; e];
    let mut importance = vec![0f64; e];
    let mut kept = 0f64;
    let mut bad = 0f64;
    let mut probs = vec![0f64; e];
    for t in 0..r.tokens {
        if let Some(s) = scores {
            let row = &s[t * e..(t + 1) * e];
            match r.scores {
                RouteScores::Logits => {
                    let mx = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
                    let z: f64 = row.iter().map(|&x| (x as f64 - mx).exp()).sum();
                    for (p, &x) in probs.iter_mut().zip(row) {
                        *p = (x as f64 - mx).exp() / z;
                    }
                }
                _ => probs.iter_mut().zip(row).for_each(|(p, &x)| *p = x as f64),
            }
            for (i, p) in importance.iter_mut().zip(&probs) {
                *i += p;
            }
        }
        for &id in &ids[t * r.k..(t + 1) * r.k] {
            if id.fract() != 0.0 || !(0.0..e as f32).contains(&id) {
                bad += 1.0;
                continue;
            }
            let x = id as usize;
            load[x] += 1.0;
            if scores.is_some() {
                gate[x] += probs[x];
                kept += probs[x];
            }
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
    let kept = if r.tokens > 0 { (kept / r.tokens as f64) as f32 } else { f32::NAN };
    vec![
        (Stat::Tokens, vec![r.tokens as f32]),
        (Stat::Load, f(load)),
        (Stat::GateMass, f(gate)),
        (Stat::Importance, f(importance)),
        (Stat::KeptMass, vec![kept]),
        (Stat::BadIds, vec![bad as f32]),
    ]
}

/// Residual statistics, accumulated in f64, over the rows `mask` keeps (every row without one).
fn residual_stats(r: &ResidualProbe, x: &[f32], f: &[f32], mask: Option<&[f32]>) -> Vec<(Stat, Vec<f32>)> {
    let (mut xx, mut ff) = (0f64, 0f64);
    let mut cos_row = Vec::with_capacity(r.rows);
    let (mut cos_sum, mut cos_n) = (0f64, 0f64);
    let mut kept = 0usize;
    for i in 0..r.rows {
        if mask.is_some_and(|m| m[i] == 0.0) {
            cos_row.push(f32::NAN);
            continue;
        }
        kept += 1;
        let (xr, fr) = (&x[i * r.width..(i + 1) * r.width], &f[i * r.width..(i + 1) * r.width]);
        let (mut rx, mut ry, mut xy, mut rf) = (0f64, 0f64, 0f64, 0f64);
        for (&a, &b) in xr.iter().zip(fr) {
            let (a, b) = (a as f64, b as f64);
            let y = a + b;
            rx += a * a;
            ry += y * y;
            xy += a * y;
            rf += b * b;
        }
        xx += rx;
        ff += rf;
        let c = if rx > 0.0 && ry > 0.0 { xy / (rx.sqrt() * ry.sqrt()) } else { f64::NAN };
        if c.is_finite() {
            cos_sum += c;
            cos_n += 1.0;
        }
        cos_row.push(c as f32);
    }
    let ratio = if xx > 0.0 { (ff / xx).sqrt() as f32 } else { f32::NAN };
    let cos = if cos_n > 0.0 { (cos_sum / cos_n) as f32 } else { f32::NAN };
    vec![
        (Stat::Rows, vec![kept as f32]),
        (Stat::Ratio, vec![ratio]),
        (Stat::Cos, vec![cos]),
        (Stat::CosRow, cos_row),
    ]
}

/// Static dims of `shape` as `[B, H, Sq, Sk]`: rank 4 as is, rank 3 `[B, Sq, Sk]` with one
/// head, rank 2 `[Sq, Sk]` with one sequence. `None` for a symbolic dim or another rank.
pub fn bhqk(shape: &rlx_ir::Shape) -> Option<[usize; 4]> {
    let d = static_dims(shape)?;
    match d.as_slice() {
        [b, h, q, k] => Some([*b, *h, *q, *k]),
        [b, q, k] => Some([*b, 1, *q, *k]),
        [q, k] => Some([1, 1, *q, *k]),
        _ => None,
    }
}
