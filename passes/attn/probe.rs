//! The attention probe: per-head concentration and received mass from softmax probabilities,
//! or rebuilt from a fused `Op::Attention`'s Q and K exactly as RLX's CPU kernel computes them.
//! Queries and keys the mask marks as padding are excluded from every statistic and their
//! leftover mass reported separately ([`stats::PAD_MASS`]).

use crate::sketch::probe::{input, need};
use crate::sketch::{static_dims, Stat, TypedProbe};
use rlx_cpu::op_registry::CpuTensorRef;
use serde::{Deserialize, Serialize};

crate::stats! {
    /// Statistics of the attention probe, in layout order (`H` = query heads).
    pub mod stats {
        /// Non-padding queries `(batch, query)` the attention statistics average over (1 value).
        QUERIES = "queries", One;
        /// Mean non-padding keys per sequence (1 value).
        KEYS = "keys", One;
        /// Per head: mean over non-padding queries of the largest probability (`H` values).
        PEAK = "peak", Vector;
        /// Per head: mean over non-padding queries of the entropy `-sum p ln p`, in nats (`H`).
        ENTROPY = "entropy", Vector;
        /// Per head: mean over non-padding queries of entropy / ln(allowed keys), in [0, 1] (`H`).
        ENTROPY_NORM = "entropy_norm", Vector;
        /// The `k` of `topk_mass` (1 value).
        TOPK = "topk", One;
        /// Per head: mean over non-padding queries of the mass on the `topk` most probable keys (`H`).
        TOPK_MASS = "topk_mass", Vector;
        /// Per head: mean probability non-padding queries give the first non-padding key (`H`).
        /// The query at the key's own position is left out: a sink is mass other tokens give
        /// it (under a causal mask the first query sees only the first key, mass 1 trivially).
        SINK_FIRST = "sink_first", Vector;
        /// Per head: mean probability non-padding queries give the last non-padding key (`H`),
        /// the query at its own position left out (so a causal mask, where only that query sees
        /// the last key, records none).
        SINK_LAST = "sink_last", Vector;
        /// Per head: mean probability mass non-padding queries give padding keys (`H`; 0 when the
        /// mask works).
        PAD_MASS = "pad_mass", Vector;
        /// Per head: mean over sequences of the largest received mass of one non-padding key, the
        /// received mass being the mean probability over the sequence's non-padding queries (`H`).
        RECV_MAX = "recv_max", Vector;
        /// Per (head, query position): mean over sequences of the peak probability (`H x Sq`,
        /// row-major; undefined positions, padding in every sequence, are not recorded).
        PEAK_POS = "peak_pos", Vector;
        /// Per (head, key position): mean over sequences of the key's received mass (`H x Sk`).
        RECV_POS = "recv_pos", Vector;
        /// Per head: mean, over the queries counted in `sink_first`, of the first key's probability
        /// times the number of keys the query may attend to (`H`; no unit): the sink mass in
        /// multiples of a uniform query's share. 1 for uniform attention under any mask, so a
        /// causal prefix (query `q` sees `q + 1` keys) does not pass for a sink.
        SINK_FIRST_LIFT = "sink_first_lift", Vector;
        /// Per head: the same for the last non-padding key (`H`).
        SINK_LAST_LIFT = "sink_last_lift", Vector;
    }
}

inventory::submit! { crate::sketch::StatTable(stats::ALL) }
inventory::submit! { crate::sketch::ProbeRegistration(&crate::sketch::Typed::<AttnProbe>::NEW) }

/// An additive score bias at or below this masks the key: `exp(-1000)` is 0 in f32 and f64, so
/// such a key can receive no probability. It covers both conventions ONNX BERT exports use,
/// `(1 - mask) * -10000` (Hugging Face transformers before 4.27) and `finfo(float32).min`.
pub const MASKED_BIAS: f32 = -1000.0;

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
    /// `k` of [`stats::TOPK_MASS`].
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
        /// The last input is the program's padding row mask, `[B * Sk]` (see
        /// [`crate::rewrite::Rewrite::row_mask`]): a key whose entry is below 0.5 is padding (and,
        /// with `Sq == Sk`, so is the query at its position). Used when no mask feeds the scores.
        #[serde(default)]
        rows: bool,
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
        /// The last input is the program's padding row mask, as for [`AttnSource::Probs`]; used
        /// with [`FusedMask::None`], [`FusedMask::Causal`] and [`FusedMask::Window`], which carry
        /// no key mask of their own.
        #[serde(default)]
        rows: bool,
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



impl TypedProbe for AttnProbe {
    const NAME: &'static str = "Attention";

    fn stats(&self) -> &'static [Stat] {
        stats::ALL
    }

    fn stat_len(&self, s: Stat) -> usize {
        match s {
            stats::QUERIES | stats::KEYS | stats::TOPK => 1,
            stats::PEAK_POS => self.heads * self.sq,
            stats::RECV_POS => self.heads * self.sk,
            _ => self.heads,
        }
    }

    fn execute(&self, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String> {
        let a = self;
        Ok(match &a.source {
            AttnSource::Probs { bias, rows } => {
                let rm = row_mask(a, inputs, *rows)?;
                let p = input(inputs, 0, "attention probabilities")?;
                need(p.len(), a.batch * a.heads * a.sq * a.sk, "attention probabilities")?;
                let bias = match bias {
                    Some(d) => {
                        let b = input(inputs, 1, "attention bias")?;
                        need(b.len(), d.iter().product(), "attention bias")?;
                        Some((b, *d))
                    }
                    None => None,
                };
                let allowed = |b: usize, h: usize, q: usize, k: usize| {
                    rm.is_none_or(|m| m[b * a.sk + k] >= ROW_KEEP)
                        && match &bias {
                            None => true,
                            Some((v, d)) => v[bcast(d, [b, h, q, k])] > MASKED_BIAS,
                        }
                };
                attn_stats(a, p, &allowed)
            }
            AttnSource::Fused { mask: kind, rows, .. } => {
                let rm = row_mask(a, inputs, *rows)?;
                let q = input(inputs, 0, "attention Q")?;
                let k = input(inputs, 1, "attention K")?;
                let mask = if matches!(kind, FusedMask::Keys | FusedMask::Bias) { Some(input(inputs, 2, "attention mask")?) } else { None };
                let (p, allowed) = rebuild_fused(a, q, k, mask)?;
                attn_stats(a, &p, &|b, h, qi, ki| {
                    allowed[((b * a.heads + h) * a.sq + qi) * a.sk + ki] && rm.is_none_or(|m| m[b * a.sk + ki] >= ROW_KEEP)
                })
            }
        })
    }

    fn lowering(&self) -> Result<(), String> {
        super::lower::lowering(self)
    }

    fn lower(&self, g: &mut rlx_ir::Graph, inputs: &[rlx_ir::NodeId], stats: &[Stat]) -> Vec<crate::sketch::probe::LoweredStat> {
        super::lower::lower(self, g, inputs, stats)
    }
}

/// A row-mask entry at or above this marks a real token (the mask holds 1 on tokens and 0 on
/// padding; 0.5 as RLX's `mask_binary_threshold` default).
const ROW_KEEP: f32 = 0.5;

/// The padding row mask (the last input, `[B * Sk]`), when the probe has one.
fn row_mask<'a>(a: &AttnProbe, inputs: &'a [CpuTensorRef<'_>], rows: bool) -> Result<Option<&'a [f32]>, String> {
    if !rows {
        return Ok(None);
    }
    let m = input(inputs, inputs.len().saturating_sub(1), "padding row mask")?;
    need(m.len(), a.batch * a.sk, "padding row mask")?;
    Ok(Some(m))
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
    let AttnSource::Fused { head_dim: dh, kv_heads, bhsd, scale, softcap, mask: kind, q_view, k_view, .. } = &a.source else {
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
/// no position statistics, and the mass valid queries put on them is [`stats::PAD_MASS`]. The first
/// and last keys are the first and last non-padding ones; a sink statistic counts only the
/// queries the mask lets see that key (its lift weighs each by the keys that query may see), and
/// `topk_mass` only queries allowed more than `topk` keys.
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
    let mut first_lift = vec![0f64; nh];
    let mut last_lift = vec![0f64; nh];
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
                // Absolute position of query q: the queries are the last Sq of the Sk positions.
                // With more queries than keys (cross attention) the first Sq - Sk queries have
                // no own key position.
                let own = (q + sk).checked_sub(sq);
                if let Some(f) = first_key.filter(|&f| Some(f) != own && allowed(b, h, q, f)) {
                    first[h] += row[f] as f64;
                    first_lift[h] += row[f] as f64 * n_allowed as f64;
                    first_n[h] += 1.0;
                }
                if let Some(l) = last_key.filter(|&l| Some(l) != own && allowed(b, h, q, l)) {
                    last[h] += row[l] as f64;
                    last_lift[h] += row[l] as f64 * n_allowed as f64;
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
        (stats::QUERIES, vec![queries as f32]),
        (stats::KEYS, vec![if nb > 0 { (keys / nb as f64) as f32 } else { f32::NAN }]),
        (stats::PEAK, per_q(&peak)),
        (stats::ENTROPY, per_q(&ent)),
        (stats::ENTROPY_NORM, div(&ent_norm, &ent_norm_n)),
        (stats::TOPK, vec![topk as f32]),
        (stats::TOPK_MASS, div(&topm, &topm_n)),
        (stats::SINK_FIRST, div(&first, &first_n)),
        (stats::SINK_LAST, div(&last, &last_n)),
        (stats::PAD_MASS, per_q(&pad)),
        (stats::RECV_MAX, div(&recv_max, &seqs)),
        (stats::PEAK_POS, div(&peak_pos, &peak_pos_n)),
        (stats::RECV_POS, div(&recv_pos, &recv_pos_n)),
        (stats::SINK_FIRST_LIFT, div(&first_lift, &first_n)),
        (stats::SINK_LAST_LIFT, div(&last_lift, &last_n)),
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


/// Referenced by the pass's `link` so that this file's registrations are linked (see
/// [`crate::passes::link`]).
#[inline(never)]
pub(super) fn link() {}
