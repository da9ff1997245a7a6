//! The `attn` tap against an independent host reference (plain f64 loops, nothing shared with
//! opscope's probe or RLX's kernels).
//!
//! What is proven:
//! - the host reference probabilities `P[b,h,q,k]` (textbook softmax of `q.k * scale`, masked
//!   keys excluded) are the ones RLX's CPU `Op::Attention` uses: `P @ V` equals RLX's output
//!   within 1e-5, for 3 heads in rank 3 `[B,S,H*D]`, rank 4 `[B,S,H,D]` and rank 4 `[B,H,S,D]`,
//!   under a padded key mask, a causal mask (also with `Sq < Sk`), an additive bias, no mask,
//!   a custom score scale and a logit soft-cap (which RLX 0.2.19's CPU kernel applies on its
//!   `[B,H,S,D]` path only: the reference follows it, and `P @ V` proves which it used); and,
//!   in all three layouts, grouped-query (4 query heads over 2 K/V heads) and multi-query
//!   attention, sliding-window masks (also with `Sq < Sk`), and the soft-cap together with a
//!   key mask, a causal mask and a bias (RLX caps after masking, so masked keys keep mass);
//! - under that soft-cap with a key mask, padding keys get mass: the recorded `pad_mass` equals
//!   the host's (> 1e-3) and the miner's padding-leak health check fires;
//! - every statistic the `attn` tap records for those graphs (fused `Op::Attention`, rebuilt from
//!   Q and K) and for the unfused `MatMul -> Mul -> Add(bias) -> Softmax -> MatMul` an ONNX BERT
//!   arrives as equals the same statistic computed on the host from the reference `P` (with the
//!   mask bias `(1 - mask) * -10000` and `(1 - mask) * finfo(float32).min`), within
//!   1e-5 absolute, with the same indices recorded (NaN entries are not recorded);
//! - a rank-3 `[B*H, S, S]` softmax with no mask counts every query as valid and the manifest
//!   notes why;
//! - with only `attn` enabled the model outputs are bit-identical to an untapped run;
//! - the rewritten graphs pass RLX's verifier (insta snapshots `attn__*`).

mod common;

use std::collections::BTreeMap;

use common::{bits, randn, run_plain, run_tapped};
use opscope::{Manifest, Pipeline, Row};
use rlx_ir::op::{BinaryOp, MaskKind};
use rlx_ir::{DType, Graph, Op, Shape};

const TOL: f64 = 1e-5;

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

// ───────────────────────────── host reference ─────────────────────────────

/// How Q/K/V (and the output) are laid out, as RLX's CPU kernel reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Layout {
    /// `[B, S, H*D]`, head `h` = columns `h*D..(h+1)*D`.
    Rank3,
    /// `[B, S, H, D]` (rank 4 with dim 1 != H).
    Bshd,
    /// `[B, H, S, D]` (rank 4 with dim 1 == H).
    Bhsd,
}

/// Attention geometry.
#[derive(Debug, Clone, Copy)]
struct Geom {
    b: usize,
    h: usize,
    /// K/V heads (`< h` for grouped-query attention: query head `h` reads K/V head
    /// `h / (h / kv)`, Ainslie et al. 2023).
    kv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    layout: Layout,
}

impl Geom {
    fn dims(&self, s: usize) -> Vec<usize> {
        self.dims_heads(s, self.h)
    }
    /// Dims of K and V (`kv` heads).
    fn dims_kv(&self, s: usize) -> Vec<usize> {
        self.dims_heads(s, self.kv)
    }
    fn dims_heads(&self, s: usize, h: usize) -> Vec<usize> {
        let Geom { b, d, .. } = *self;
        match self.layout {
            Layout::Rank3 => vec![b, s, h * d],
            Layout::Bshd => vec![b, s, h, d],
            Layout::Bhsd => vec![b, h, s, d],
        }
    }
    /// Flat index into K or V of element `d` at position `s` for query head `h` (its K/V head
    /// is `h / (H / kv)`).
    fn at_kv(&self, len: usize, b: usize, s: usize, h: usize, d: usize) -> usize {
        let kvh = h / (self.h / self.kv);
        match self.layout {
            Layout::Rank3 | Layout::Bshd => ((b * len + s) * self.kv + kvh) * self.d + d,
            Layout::Bhsd => ((b * self.kv + kvh) * len + s) * self.d + d,
        }
    }
    /// Flat index of element `d` of head `h` at position `s` of sequence `b` (length `len`).
    fn at(&self, len: usize, b: usize, s: usize, h: usize, d: usize) -> usize {
        match self.layout {
            Layout::Rank3 | Layout::Bshd => ((b * len + s) * self.h + h) * self.d + d,
            Layout::Bhsd => ((b * self.h + h) * len + s) * self.d + d,
        }
    }
    fn p_at(&self, b: usize, h: usize, q: usize, k: usize) -> usize {
        ((b * self.h + h) * self.sq + q) * self.sk + k
    }
}

/// RLX 0.2.19's CPU attention sets a masked score to this (`RuntimeConfig::attn_mask_neg_inf`)
/// and soft-caps after masking ("post-mask, pre-softmax" in its kernel): a masked key's logit is
/// then `c * tanh(-1e9 / c) = -c`, not minus infinity, and the key keeps some mass. (Gemma 2 as
/// Hugging Face runs it caps before masking.) `P @ V` against RLX's output proves which it does.
const RLX_MASK_FILL: f64 = -1e9;

/// Reference probabilities `[B, H, Sq, Sk]` and which entries the mask allows. `mask(b,h,q,k)`
/// is `None` for an excluded key, else the additive bias on its score; `softcap` `c` maps a
/// score `s` to `c * tanh(s / c)`, after masking as RLX does: an excluded key then gets the
/// logit `c * tanh(RLX_MASK_FILL / c)` (and is still not allowed); without a soft-cap it gets
/// no mass.
fn ref_probs(
    g: &Geom,
    q: &[f32],
    k: &[f32],
    scale: f64,
    softcap: Option<f64>,
    mask: &dyn Fn(usize, usize, usize, usize) -> Option<f64>,
) -> (Vec<f64>, Vec<bool>) {
    let mut p = vec![0.0; g.b * g.h * g.sq * g.sk];
    let mut allowed = vec![false; p.len()];
    for b in 0..g.b {
        for h in 0..g.h {
            for qi in 0..g.sq {
                let logits: Vec<Option<f64>> = (0..g.sk)
                    .map(|ki| {
                        let masked = softcap.map(|c| c * (RLX_MASK_FILL / c).tanh());
                        mask(b, h, qi, ki).map(|bias| {
                            let dot: f64 = (0..g.d)
                                .map(|d| q[g.at(g.sq, b, qi, h, d)] as f64 * k[g.at_kv(g.sk, b, ki, h, d)] as f64)
                                .sum();
                            let s = dot * scale + bias;
                            softcap.map_or(s, |c| c * (s / c).tanh())
                        })
                        .or(masked)
                    })
                    .collect();
                let mx = logits.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logits.iter().flatten().map(|s| (s - mx).exp()).sum();
                for (ki, s) in logits.iter().enumerate() {
                    if let Some(s) = s {
                        p[g.p_at(b, h, qi, ki)] = (s - mx).exp() / z;
                    }
                    allowed[g.p_at(b, h, qi, ki)] = mask(b, h, qi, ki).is_some();
                }
            }
        }
    }
    (p, allowed)
}

/// `P @ V`, laid out like Q.
fn ref_output(g: &Geom, p: &[f64], v: &[f32]) -> Vec<f64> {
    let mut o = vec![0.0; g.b * g.sq * g.h * g.d];
    for b in 0..g.b {
        for h in 0..g.h {
            for qi in 0..g.sq {
                for d in 0..g.d {
                    o[g.at(g.sq, b, qi, h, d)] =
                        (0..g.sk).map(|ki| p[g.p_at(b, h, qi, ki)] * v[g.at_kv(g.sk, b, ki, h, d)] as f64).sum();
                }
            }
        }
    }
    o
}

/// Statistic -> (idx, value), NaN entries left out.
type Stats = BTreeMap<String, Vec<(u64, f64)>>;

/// The `attn` statistics of `p` by their definitions (src/probes.rs `attn_stats`): a key is
/// padding when no (head, query) may attend to it; with `Sq == Sk` query `i` is padding when key
/// `i` is; padding queries are left out; per-head statistics are means over valid queries.
fn host_stats(g: &Geom, p: &[f64], allowed: &[bool], topk: usize) -> Stats {
    let mut acc: BTreeMap<(&str, usize), (f64, f64)> = BTreeMap::new();
    let mut add = |stat: &'static str, idx: usize, v: f64| {
        let e = acc.entry((stat, idx)).or_default();
        e.0 += v;
        e.1 += 1.0;
    };
    let mut queries = 0usize;
    let mut keys = 0usize;
    for b in 0..g.b {
        let key_pad: Vec<bool> = (0..g.sk)
            .map(|k| (0..g.h).all(|h| (0..g.sq).all(|q| !allowed[g.p_at(b, h, q, k)])))
            .collect();
        let valid: Vec<usize> = (0..g.sq).filter(|&q| !(g.sq == g.sk && key_pad[q])).collect();
        queries += valid.len();
        let first = (0..g.sk).find(|&k| !key_pad[k]);
        let last = (0..g.sk).rev().find(|&k| !key_pad[k]);
        keys += key_pad.iter().filter(|p| !**p).count();
        for h in 0..g.h {
            for &q in &valid {
                let row: Vec<f64> = (0..g.sk).map(|k| p[g.p_at(b, h, q, k)]).collect();
                let peak = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ent: f64 = row.iter().filter(|&&x| x > 0.0).map(|&x| -x * x.ln()).sum();
                let n_allowed = (0..g.sk).filter(|&k| allowed[g.p_at(b, h, q, k)]).count();
                let mut sorted = row.clone();
                sorted.sort_by(|x, y| y.total_cmp(x));
                add("peak", h, peak);
                add("entropy", h, ent);
                if n_allowed >= 2 {
                    add("entropy_norm", h, ent / (n_allowed as f64).ln());
                }
                // topk >= keys keeps every key: the tap drops topk_mass (mass 1 by definition);
                // a query allowed topk keys or fewer is left out of it.
                if topk < g.sk && n_allowed > topk {
                    add("topk_mass", h, sorted[..topk].iter().sum());
                }
                // Sinks: the first / last non-padding key, for queries allowed to see it.
                // The lift: the sink mass in multiples of this query's uniform share. The query at
                // the key's own (absolute) position does not count.
                let own = g.sk - g.sq + q;
                if let Some(f) = first.filter(|&f| f != own && allowed[g.p_at(b, h, q, f)]) {
                    add("sink_first", h, row[f]);
                    add("sink_first_lift", h, row[f] * n_allowed as f64);
                }
                if let Some(l) = last.filter(|&l| l != own && allowed[g.p_at(b, h, q, l)]) {
                    add("sink_last", h, row[l]);
                    add("sink_last_lift", h, row[l] * n_allowed as f64);
                }
                add("pad_mass", h, (0..g.sk).filter(|&k| key_pad[k]).map(|k| row[k]).sum());
                add("peak_pos", h * g.sq + q, peak);
            }
            if valid.is_empty() || last.is_none() {
                continue;
            }
            // Mass each non-padding key receives, averaged over the valid queries.
            let recv: Vec<(usize, f64)> = (0..g.sk)
                .filter(|&k| !key_pad[k])
                .map(|k| (k, valid.iter().map(|&q| p[g.p_at(b, h, q, k)]).sum::<f64>() / valid.len() as f64))
                .collect();
            add("recv_max", h, recv.iter().map(|r| r.1).fold(f64::NEG_INFINITY, f64::max));
            for (k, r) in recv {
                add("recv_pos", h * g.sk + k, r);
            }
        }
    }
    let mut out = Stats::new();
    out.insert("queries".into(), vec![(0, queries as f64)]);
    out.insert("keys".into(), vec![(0, keys as f64 / g.b as f64)]);
    if topk < g.sk {
        out.insert("topk".into(), vec![(0, topk as f64)]);
    }
    for ((stat, idx), (s, n)) in acc {
        out.entry(stat.to_string()).or_default().push((idx as u64, s / n));
    }
    out
}

/// The one attention site's recorded statistics (role `probs`, step 0).
fn recorded(rows: &[Row]) -> (String, Stats) {
    let rows: Vec<&Row> = rows.iter().filter(|r| &*r.role == "probs" && r.step == 0).collect();
    let mut sites: Vec<&str> = rows.iter().map(|r| &*r.site).collect();
    sites.dedup();
    assert_eq!(sites.len(), 1, "one attention site expected, got {sites:?}");
    let mut s = Stats::new();
    for r in &rows {
        s.entry(r.stat.to_string()).or_default().push((r.idx, r.value as f64));
    }
    s.values_mut().for_each(|v| v.sort_by_key(|p| p.0));
    (sites[0].to_string(), s)
}

fn assert_stats(what: &str, got: &Stats, want: &Stats) {
    let names = |s: &Stats| s.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: recorded statistics");
    for (stat, w) in want {
        let g = &got[stat];
        let idx = |v: &[(u64, f64)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
        assert_eq!(idx(g), idx(w), "{what} {stat}: recorded indices");
        for ((i, gv), (_, wv)) in g.iter().zip(w) {
            assert!((gv - wv).abs() <= TOL, "{what} {stat}[{i}]: tap {gv}, host {wv} (diff {:e})", (gv - wv).abs());
        }
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let (i, diff) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .enumerate()
        .fold((0, 0.0), |m, (i, d)| if d > m.1 { (i, d) } else { m });
    assert!(diff <= TOL, "{what}: output[{i}] = {}, host {} (diff {diff:e})", got[i], want[i]);
}

// ───────────────────────────── fixtures ─────────────────────────────

/// A fused attention's mask.
#[derive(Debug, Clone)]
enum Mask {
    None,
    Causal,
    /// `MaskKind::SlidingWindow(w)`: query at absolute position `i` (`Sk - Sq + q`) sees keys
    /// `i - w ..= i` (Longformer / Mistral-style local attention).
    Window(usize),
    /// `[B, Sk]`, 1 = valid, 0 = padding.
    Keys(Vec<f32>),
    /// Additive `[B, H, Sq, Sk]`.
    Bias(Vec<f32>),
}

/// A fused `Op::Attention` graph and its inputs.
struct Fused {
    name: String,
    g: Geom,
    mask: Mask,
    scale: Option<f32>,
    softcap: Option<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Keys of sequence 1 from `valid` on are padding (sequence 0 has none).
fn key_mask(b: usize, sk: usize, valid: usize) -> Vec<f32> {
    (0..b * sk).map(|i| if i / sk == 1 && i % sk >= valid { 0.0 } else { 1.0 }).collect()
}

fn fused(name: &str, g: Geom, mask: Mask, scale: Option<f32>, seed: u64) -> Fused {
    let (nq, nk) = (g.b * g.sq * g.h * g.d, g.b * g.sk * g.kv * g.d);
    // Q scaled up so some rows are peaked and some flat.
    let q = randn(nq, seed).iter().map(|x| 1.5 * x).collect();
    Fused { name: name.into(), g, mask, scale, softcap: None, q, k: randn(nk, seed + 1), v: randn(nk, seed + 2) }
}

impl Fused {
    fn graph(&self) -> Graph {
        let g = &self.g;
        let mut gr = Graph::new(&self.name);
        let q = gr.input("q", f32s(&g.dims(g.sq)));
        let k = gr.input("k", f32s(&g.dims_kv(g.sk)));
        let v = gr.input("v", f32s(&g.dims_kv(g.sk)));
        let out = f32s(&g.dims(g.sq));
        let o = match &self.mask {
            Mask::None | Mask::Causal | Mask::Window(_) => {
                let kind = match self.mask {
                    Mask::Causal => MaskKind::Causal,
                    Mask::Window(w) => MaskKind::SlidingWindow(w),
                    _ => MaskKind::None,
                };
                gr.attention_kind_opts(q, k, v, g.h, g.d, kind, out, self.scale, self.softcap)
            }
            Mask::Keys(_) => {
                let m = gr.input("mask", f32s(&[g.b, g.sk]));
                gr.attention_opts(q, k, v, m, g.h, g.d, out, self.scale, self.softcap)
            }
            Mask::Bias(_) => {
                let m = gr.input("mask", f32s(&[g.b, g.h, g.sq, g.sk]));
                gr.attention_bias_opts(q, k, v, m, g.h, g.d, out, self.scale, self.softcap)
            }
        };
        gr.set_outputs(vec![o]);
        gr
    }

    fn inputs(&self) -> Vec<(&str, &[f32])> {
        let mut i: Vec<(&str, &[f32])> = vec![("q", &self.q), ("k", &self.k), ("v", &self.v)];
        if let Mask::Keys(m) | Mask::Bias(m) = &self.mask {
            i.push(("mask", m));
        }
        i
    }

    fn reference(&self) -> (Vec<f64>, Vec<bool>) {
        let g = self.g;
        let scale = self.scale.map_or((g.d as f64).powf(-0.5), |s| s as f64);
        let q_off = g.sk - g.sq;
        let mask = |b: usize, h: usize, q: usize, k: usize| -> Option<f64> {
            match &self.mask {
                Mask::None => Some(0.0),
                Mask::Causal => (k <= q_off + q).then_some(0.0),
                Mask::Window(w) => (k + w >= q_off + q && k <= q_off + q).then_some(0.0),
                Mask::Keys(m) => (m[b * g.sk + k] > 0.5).then_some(0.0),
                // An additive bias of -10000 (or below -1000) excludes the key.
                Mask::Bias(m) => Some(m[g.p_at(b, h, q, k)] as f64).filter(|x| *x > -1000.0),
            }
        };
        // RLX 0.2.19's CPU kernel applies the soft-cap on its [B, H, S, D] path only.
        let cap = self.softcap.filter(|_| g.layout == Layout::Bhsd).map(|c| c as f64);
        ref_probs(&g, &self.q, &self.k, scale, cap, &mask)
    }
}

fn geom(layout: Layout) -> Geom {
    Geom { b: 2, h: 3, kv: 3, sq: 5, sk: 5, d: 4, layout }
}

/// The fused cases: three layouts x {padded key mask, causal}, plus bias, no mask with
/// `Sq < Sk` (cross attention), causal with `Sq < Sk` and a custom scale.
fn fused_cases() -> Vec<Fused> {
    let mut cases = Vec::new();
    for (i, layout) in [Layout::Rank3, Layout::Bshd, Layout::Bhsd].into_iter().enumerate() {
        let seed = 10 * i as u64;
        cases.push(fused(&format!("keys_{layout:?}"), geom(layout), Mask::Keys(key_mask(2, 5, 3)), None, seed));
        cases.push(fused(&format!("causal_{layout:?}"), geom(layout), Mask::Causal, None, seed + 5));
    }
    // Bias: small random values, keys 3.. of sequence 1 masked everywhere (padding), and
    // one (b, h, q, k) masked alone (not padding, but one fewer allowed key for that query).
    let g = geom(Layout::Bhsd);
    let mut bias: Vec<f32> = randn(g.b * g.h * g.sq * g.sk, 77).iter().map(|x| 0.5 * x).collect();
    for b in 0..g.b {
        for h in 0..g.h {
            for q in 0..g.sq {
                for k in 0..g.sk {
                    if (b == 1 && k >= 3) || (b, h, q, k) == (0, 1, 2, 0) {
                        bias[g.p_at(b, h, q, k)] = -10000.0;
                    }
                }
            }
        }
    }
    cases.push(fused("bias_Bhsd", g, Mask::Bias(bias.clone()), None, 40));
    cases.push(fused("bias_Rank3", geom(Layout::Rank3), Mask::Bias(bias), None, 45));
    let cross = Geom { sq: 3, sk: 6, ..geom(Layout::Rank3) };
    cases.push(fused("none_cross_Rank3", cross, Mask::None, Some(0.3), 50));
    // No mask, a logit soft-cap of 1 (scores of 3x-scaled Q reach past it).
    for layout in [Layout::Rank3, Layout::Bshd, Layout::Bhsd] {
        let mut f = fused(&format!("softcap_{layout:?}"), geom(layout), Mask::None, None, 70);
        f.q.iter_mut().for_each(|x| *x *= 2.0);
        f.softcap = Some(1.0);
        cases.push(f);
    }
    // Sq != H here: a [B, S, H, D] tensor with S == H is read as [B, H, S, D].
    let cross = Geom { sq: 4, sk: 6, ..geom(Layout::Bshd) };
    cases.push(fused("causal_cross_Bshd", cross, Mask::Causal, None, 60));
    // Left padding (decoder batches): sequence 1's first two keys are padding, so its first
    // non-padding key, the sink position, is key 2.
    let left: Vec<f32> = (0..2 * 5).map(|i| if i / 5 == 1 && i % 5 < 2 { 0.0 } else { 1.0 }).collect();
    cases.push(fused("keys_left_padded_Rank3", geom(Layout::Rank3), Mask::Keys(left), None, 80));
    cases.extend(feature_cases());
    cases
}

/// The README's other attention features, each in every layout:
/// - grouped-query attention: 4 query heads over 2 K/V heads (padded key mask), and
///   multi-query (1 K/V head, causal);
/// - sliding-window masks: `SlidingWindow(1)` self-attention and `SlidingWindow(2)` with
///   `Sq < Sk`;
/// - a logit soft-cap of 2 together with a padded key mask, a causal mask and an additive bias
///   (RLX caps on `[B,H,S,D]` only, after masking: there masked keys keep mass, see
///   [`RLX_MASK_FILL`]);
/// - an additive bias of `finfo(float32).min` on padding keys.
fn feature_cases() -> Vec<Fused> {
    let mut cases = Vec::new();
    for (i, layout) in [Layout::Rank3, Layout::Bshd, Layout::Bhsd].into_iter().enumerate() {
        let seed = 100 + 20 * i as u64;
        let gqa = Geom { h: 4, kv: 2, ..geom(layout) };
        cases.push(fused(&format!("gqa_keys_{layout:?}"), gqa, Mask::Keys(key_mask(2, 5, 3)), None, seed));
        let mqa = Geom { h: 4, kv: 1, ..geom(layout) };
        cases.push(fused(&format!("mqa_causal_{layout:?}"), mqa, Mask::Causal, None, seed + 3));
        cases.push(fused(&format!("window1_{layout:?}"), geom(layout), Mask::Window(1), None, seed + 6));
        let cross = Geom { sq: 4, sk: 7, ..geom(layout) };
        cases.push(fused(&format!("window2_cross_{layout:?}"), cross, Mask::Window(2), None, seed + 9));
        let mut f = fused(&format!("softcap_keys_{layout:?}"), geom(layout), Mask::Keys(key_mask(2, 5, 3)), None, seed + 12);
        f.softcap = Some(2.0);
        cases.push(f);
        let mut f = fused(&format!("softcap_causal_{layout:?}"), geom(layout), Mask::Causal, None, seed + 15);
        f.softcap = Some(2.0);
        cases.push(f);
    }
    let g = geom(Layout::Bhsd);
    let bias: Vec<f32> = (0..g.b * g.h * g.sq * g.sk)
        .map(|i| if (i / (g.h * g.sq * g.sk)) == 1 && i % g.sk >= 3 { -10000.0 } else { 0.0 })
        .collect();
    let mut f = fused("softcap_bias_Bhsd", g, Mask::Bias(bias.clone()), None, 190);
    f.softcap = Some(2.0);
    cases.push(f);
    // The same padding as a `finfo(float32).min` bias (Hugging Face's additive mask).
    let finfo: Vec<f32> = bias.iter().map(|&x| if x < 0.0 { f32::MIN } else { 0.0 }).collect();
    cases.push(fused("bias_finfo_min_Bhsd", g, Mask::Bias(finfo.clone()), None, 195));
    cases.push(fused("bias_finfo_min_Rank3", geom(Layout::Rank3), Mask::Bias(finfo), None, 197));
    cases
}

fn scalar(g: &mut Graph, v: f32) -> rlx_ir::NodeId {
    g.add_node(Op::Constant { data: v.to_le_bytes().to_vec() }, vec![], f32s(&[1]))
}

const BERT: Geom = Geom { b: 2, h: 3, kv: 3, sq: 5, sk: 5, d: 4, layout: Layout::Bhsd };

/// The unfused attention of an ONNX BERT: `scores = (Q @ K^T) * scale + (1 - mask) * -10000`
/// (mask `[B, S]` reshaped to `[B,1,1,S]`), `Softmax(-1)`, `@ V`; Q, K, V `[B, H, S, D]`.
fn bert_graph() -> Graph {
    bert_graph_with(-10000.0)
}

/// [`bert_graph`] with the mask bias `(1 - mask) * neg`.
fn bert_graph_with(neg_bias: f32) -> Graph {
    let Geom { b, h, sq: s, d, .. } = BERT;
    let mut g = Graph::new("bert_unfused");
    let q = g.input("q", f32s(&[b, h, s, d]));
    let k = g.input("k", f32s(&[b, h, s, d]));
    let v = g.input("v", f32s(&[b, h, s, d]));
    let mask = g.input("mask", f32s(&[b, s]));
    let kt = g.add_node(Op::Transpose { perm: vec![0, 1, 3, 2] }, vec![k], f32s(&[b, h, d, s]));
    let scores = g.matmul(q, kt, f32s(&[b, h, s, s]));
    let c = scalar(&mut g, (d as f32).powf(-0.5));
    let scaled = g.binary(BinaryOp::Mul, scores, c, f32s(&[b, h, s, s]));
    let m4 = g.reshape(mask, vec![b as i64, 1, 1, s as i64], f32s(&[b, 1, 1, s]));
    let one = scalar(&mut g, 1.0);
    let inv = g.binary(BinaryOp::Sub, one, m4, f32s(&[b, 1, 1, s]));
    let neg = scalar(&mut g, neg_bias);
    let bias = g.binary(BinaryOp::Mul, inv, neg, f32s(&[b, 1, 1, s]));
    let z = g.binary(BinaryOp::Add, scaled, bias, f32s(&[b, h, s, s]));
    let p = g.softmax(z, -1, f32s(&[b, h, s, s]));
    let ctx = g.matmul(p, v, f32s(&[b, h, s, d]));
    g.set_outputs(vec![ctx]);
    g
}

/// Rank-3 unfused attention over `[B*H, S, D]` with no mask: `softmax((Q @ K^T) * scale) @ V`.
fn rank3_graph(bh: usize, s: usize, d: usize) -> Graph {
    let mut g = Graph::new("rank3_unfused");
    let q = g.input("q", f32s(&[bh, s, d]));
    let k = g.input("k", f32s(&[bh, s, d]));
    let v = g.input("v", f32s(&[bh, s, d]));
    let kt = g.add_node(Op::Transpose { perm: vec![0, 2, 1] }, vec![k], f32s(&[bh, d, s]));
    let scores = g.matmul(q, kt, f32s(&[bh, s, s]));
    let c = scalar(&mut g, (d as f32).powf(-0.5));
    let scaled = g.binary(BinaryOp::Mul, scores, c, f32s(&[bh, s, s]));
    let p = g.softmax(scaled, -1, f32s(&[bh, s, s]));
    let ctx = g.matmul(p, v, f32s(&[bh, s, d]));
    g.set_outputs(vec![ctx]);
    g
}

/// Run `g` untapped, compare with the host `P @ V`, run it tapped by `pipeline`, check the
/// outputs are bit-identical and return the recorded rows and manifests.
fn run_both(
    what: &str,
    pipeline: &str,
    g: &Graph,
    inputs: &[(&str, &[f32])],
    want_out: &[f64],
) -> (Vec<Row>, Vec<Manifest>) {
    let plain = run_plain(g, &[], inputs);
    assert_close(what, &plain[0], want_out);
    let (tapped, sink) = run_tapped(pipeline, g, &[], inputs);
    assert_eq!(bits(&tapped), bits(&plain), "{what}: outputs changed by {pipeline}");
    (sink.rows(), sink.manifests())
}

// ───────────────────────────── tests ─────────────────────────────

/// Fused `Op::Attention`: host `P @ V` equals RLX's output, and every statistic the tap records
/// (rebuilt from Q and K) equals the host's from `P`, with `topk` at its default (8, clamped to
/// `Sk`) and at 2.
#[test]
fn fused_attention_stats_match_host_reference() {
    for f in fused_cases() {
        let (p, allowed) = f.reference();
        let want_out = ref_output(&f.g, &p, &f.v);
        for (pipeline, topk) in [("attn", 8), ("attn{topk=2}", 2)] {
            let what = format!("{} {pipeline}", f.name);
            let (rows, manifests) = run_both(&what, pipeline, &f.graph(), &f.inputs(), &want_out);
            let (site, got) = recorded(&rows);
            let m = manifests.last().expect("manifest");
            assert!(m.sites.iter().any(|s| s.site == site && s.op == "attention"), "{what}: {site} is not the Attention");
            // The probabilities are listed with their own shape, not Q's (rows carry it).
            let want_shape = format!("[{},{},{},{}]", f.g.b, f.g.h, f.g.sq, f.g.sk);
            assert!(rows.iter().all(|r| &*r.shape == want_shape), "{what}: shape {} is not {want_shape}", rows[0].shape);
            assert_stats(&what, &got, &host_stats(&f.g, &p, &allowed, topk));
        }
    }
}

/// The padded key mask makes keys 3, 4 of sequence 1 padding: they are left out as queries
/// (`queries` = 5 + 3) and the mass on them is 0; the host and the tap agree on it.
#[test]
fn padded_queries_are_excluded() {
    let f = fused("keys", geom(Layout::Rank3), Mask::Keys(key_mask(2, 5, 3)), None, 3);
    let (p, allowed) = f.reference();
    let want = host_stats(&f.g, &p, &allowed, 8);
    assert_eq!(want["queries"], vec![(0, 8.0)]);
    assert!(want["pad_mass"].iter().all(|(_, v)| *v == 0.0));
    // recv_pos: no entry for the padded keys 3, 4 of sequence 1, but sequence 0 has them.
    assert_eq!(want["recv_pos"].len(), 3 * 5);
    let (rows, _) = run_both("keys", "attn", &f.graph(), &f.inputs(), &ref_output(&f.g, &p, &f.v));
    assert_stats("keys", &recorded(&rows).1, &want);
}

/// The feature fixtures are what they claim: K/V have fewer heads than Q, and a window hides keys
/// a causal mask would show (the head sharing and the window are proven against RLX by `P @ V`
/// in `fused_attention_stats_match_host_reference`).
#[test]
fn feature_fixtures_exercise_their_feature() {
    let cases = feature_cases();
    let by = |name: &str| cases.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("{name}"));
    for layout in ["Rank3", "Bshd", "Bhsd"] {
        let f = by(&format!("gqa_keys_{layout}"));
        assert_eq!((f.g.h, f.g.kv), (4, 2));
        assert_eq!(f.k.len() * 2, f.q.len(), "{layout}: K holds half the heads");
        assert_eq!(f.graph().nodes().iter().find(|n| n.name.as_deref() == Some("k")).map(|n| n.shape.num_elements()), Some(Some(f.k.len())));
        let f = by(&format!("window1_{layout}"));
        let (_, allowed) = f.reference();
        // Query 3 sees keys 2 and 3 only (causal would show 0..=3).
        let seen: Vec<usize> = (0..5).filter(|&k| allowed[f.g.p_at(0, 0, 3, k)]).collect();
        assert_eq!(seen, vec![2, 3], "{layout}");
        let f = by(&format!("window2_cross_{layout}"));
        let (_, allowed) = f.reference();
        // Sq = 4 < Sk = 7: query 0 is at absolute position 3 and sees keys 1..=3.
        let seen: Vec<usize> = (0..7).filter(|&k| allowed[f.g.p_at(0, 0, 0, k)]).collect();
        assert_eq!(seen, vec![1, 2, 3], "{layout}");
    }
}

/// Unfused attention with the mask bias `(1 - mask) * finfo(float32).min` (Hugging Face
/// transformers since 4.27) instead of `-10000`: the tap reads the bias (an entry <= -1000 masks
/// the key) and every statistic matches the host softmax.
#[test]
fn unfused_finfo_min_mask_bias_matches_host_reference() {
    let (q, k, v, mask) = bert_inputs();
    let scale = (BERT.d as f64).powf(-0.5);
    let (p, allowed) = ref_probs(&BERT, &q, &k, scale, None, &|b, _, _, k| (mask[b * BERT.sk + k] > 0.5).then_some(0.0));
    let want_out = ref_output(&BERT, &p, &v);
    let inputs: Vec<(&str, &[f32])> = vec![("q", &q), ("k", &k), ("v", &v), ("mask", &mask)];
    let g = bert_graph_with(f32::MIN);
    let (rows, manifests) = run_both("finfo.min", "attn", &g, &inputs, &want_out);
    let (site, got) = recorded(&rows);
    let m = manifests.last().expect("manifest");
    assert_eq!(m.sites.iter().find(|s| s.site == site).expect("site").op, "softmax");
    let want = host_stats(&BERT, &p, &allowed, 8);
    assert_eq!(want["queries"], vec![(0, 8.0)], "keys 3, 4 of sequence 1 are padding");
    assert_stats("finfo.min", &got, &want);
}

fn health_verdicts(rows: &[Row]) -> Vec<opscope::mine::Verdict> {
    let series = opscope::mine::series_from_rows(rows);
    opscope::mine::mine(&series).into_iter().filter(|v| v.kind == opscope::mine::HEALTH).collect()
}

/// Padding keys that do get mass: RLX 0.2.19's CPU attention on `[B,H,S,D]` soft-caps after
/// masking, so a padded key's score -1e9 becomes -c (c = 2 here) and keeps `exp(-2 - s) / Z` of
/// each query's mass. `P @ V` with that leak equals RLX's output (and without it does not); the
/// recorded `pad_mass` equals the host's (> 1e-3 on every head) and the miner's padding-leak
/// health check fires with the largest head's mass. The same fixture in `[B,S,H*D]`, where RLX
/// 0.2.19 does not soft-cap, has `pad_mass` 0 and no verdict.
#[test]
fn softcap_with_a_key_mask_leaks_mass_to_padding_keys() {
    let cases = feature_cases();
    let leaky = cases.iter().find(|f| f.name == "softcap_keys_Bhsd").expect("case");
    let (p, allowed) = leaky.reference();
    let want_out = ref_output(&leaky.g, &p, &leaky.v);
    let want = host_stats(&leaky.g, &p, &allowed, 8);
    let pad: Vec<f64> = want["pad_mass"].iter().map(|x| x.1).collect();
    assert_eq!(pad.len(), 3);
    assert!(pad.iter().all(|&m| m > 1e-3), "host pad_mass {pad:?}");
    // Without the leak (padding mass dropped, rows renormalized) RLX's output is not matched.
    let g = leaky.g;
    let mut tight = p.clone();
    for b in 0..g.b {
        for h in 0..g.h {
            for q in 0..g.sq {
                let row: Vec<usize> = (0..g.sk).map(|k| g.p_at(b, h, q, k)).collect();
                let z: f64 = row.iter().filter(|&&i| allowed[i]).map(|&i| p[i]).sum();
                for &i in &row {
                    tight[i] = if allowed[i] { p[i] / z } else { 0.0 };
                }
            }
        }
    }
    let plain = run_plain(&leaky.graph(), &[], &leaky.inputs());
    let off = plain[0].iter().zip(&ref_output(&g, &tight, &leaky.v)).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(off > 1e-3, "RLX no longer leaks mass to masked keys under a soft-cap (off by {off}): revisit this test");

    let (rows, _) = run_both("softcap_keys_Bhsd", "attn", &leaky.graph(), &leaky.inputs(), &want_out);
    let got = recorded(&rows).1;
    assert_stats("softcap_keys_Bhsd", &got, &want);
    let verdicts = health_verdicts(&rows);
    assert_eq!(verdicts.len(), 1, "{verdicts:?}");
    let ev: BTreeMap<&str, f64> = verdicts[0].evidence.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let pad_max = pad.iter().copied().fold(0.0, f64::max);
    assert!((ev["pad_mass_max_head"] - pad_max).abs() <= TOL, "evidence {ev:?}, host {pad_max}");

    let tight_case = cases.iter().find(|f| f.name == "softcap_keys_Rank3").expect("case");
    let (p, allowed) = tight_case.reference();
    let want = host_stats(&tight_case.g, &p, &allowed, 8);
    assert!(want["pad_mass"].iter().all(|x| x.1 == 0.0));
    let (rows, _) = run_both("softcap_keys_Rank3", "attn", &tight_case.graph(), &tight_case.inputs(), &ref_output(&tight_case.g, &p, &tight_case.v));
    assert_stats("softcap_keys_Rank3", &recorded(&rows).1, &want);
    assert!(health_verdicts(&rows).is_empty());
}

fn bert_inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = BERT.b * BERT.h * BERT.sq * BERT.d;
    let q = randn(n, 100).iter().map(|x| 1.5 * x).collect();
    (q, randn(n, 101), randn(n, 102), key_mask(BERT.b, BERT.sk, 3))
}

/// Unfused BERT-style attention: the tap reads the Softmax output and the `[B,1,1,S]` bias; the
/// probabilities are exactly `softmax((q.k) * scale + (1 - mask) * -10000)`.
#[test]
fn unfused_bert_stats_match_host_reference() {
    let (q, k, v, mask) = bert_inputs();
    let scale = (BERT.d as f64).powf(-0.5);
    // exp(-10000 + ...) is 0 in f64: a key with mask 0 is excluded.
    let (p, allowed) = ref_probs(&BERT, &q, &k, scale, None, &|b, _, _, k| (mask[b * BERT.sk + k] > 0.5).then_some(0.0));
    let want_out = ref_output(&BERT, &p, &v);
    let inputs: Vec<(&str, &[f32])> = vec![("q", &q), ("k", &k), ("v", &v), ("mask", &mask)];
    for (pipeline, topk) in [("attn", 8), ("attn{topk=2}", 2)] {
        let (rows, manifests) = run_both(pipeline, pipeline, &bert_graph(), &inputs, &want_out);
        let (site, got) = recorded(&rows);
        let m = manifests.last().expect("manifest");
        let s = m.sites.iter().find(|s| s.site == site).expect("site in manifest");
        assert_eq!(s.op, "softmax", "the deployed site is the Softmax");
        let notes: Vec<_> = m.skipped.iter().filter(|k| !k.reason.starts_with("topk_mass not computed")).collect();
        assert!(notes.is_empty(), "a bias feeds the softmax: nothing to note, got {notes:?}");
        assert_stats(&format!("bert {pipeline}"), &got, &host_stats(&BERT, &p, &allowed, topk));
    }
}

/// Rank-3 `[B*H, S, S]` softmax with no additive mask: one "head" per batch row, every query
/// and key valid, and a note in the manifest's skipped list.
#[test]
fn unfused_rank3_without_mask_counts_every_query() {
    let (bh, s, d) = (6, 5, 4);
    let g = Geom { b: bh, h: 1, kv: 1, sq: s, sk: s, d, layout: Layout::Rank3 };
    let q: Vec<f32> = randn(bh * s * d, 200).iter().map(|x| 1.5 * x).collect();
    let (k, v) = (randn(bh * s * d, 201), randn(bh * s * d, 202));
    let (p, allowed) = ref_probs(&g, &q, &k, (d as f64).powf(-0.5), None, &|_, _, _, _| Some(0.0));
    let inputs: Vec<(&str, &[f32])> = vec![("q", &q), ("k", &k), ("v", &v)];
    let (rows, manifests) = run_both("rank3", "attn{topk=2}", &rank3_graph(bh, s, d), &inputs, &ref_output(&g, &p, &v));
    let (site, got) = recorded(&rows);
    let want = host_stats(&g, &p, &allowed, 2);
    assert_eq!(want["queries"], vec![(0, (bh * s) as f64)]);
    assert_eq!(got["queries"], vec![(0, (bh * s) as f64)], "every query counts");
    assert_eq!(got["pad_mass"], vec![(0, 0.0)]);
    assert_stats("rank3", &got, &want);
    let m = manifests.last().expect("manifest");
    assert!(
        m.skipped.iter().any(|k| k.site == site && k.reason.contains("no additive mask")),
        "note expected in skipped, got {:?}",
        m.skipped
    );
}

/// A fused attention with no key mask of its own (causal, or none) in a program with a graph
/// input `attention_mask` (one value per token, sequence 1 right-padded after 3 tokens): the tap
/// takes padding from it. Causal: the padding queries are left out (`queries` = 5 + 3) and get
/// no mass, where without the row mask all 10 would count. No mask: real queries put mass on the
/// padding keys, `pad_mass` > 0, and the miner says the mask leaks.
#[test]
fn fused_attention_without_a_key_mask_takes_padding_from_attention_mask() {
    for (mask, layout) in [(Mask::Causal, Layout::Rank3), (Mask::Causal, Layout::Bhsd), (Mask::None, Layout::Bshd)] {
        let unmasked = matches!(mask, Mask::None);
        let f = fused(&format!("rows_{mask:?}_{layout:?}"), geom(layout), mask, None, 300);
        let rows_mask = key_mask(2, 5, 3);
        let mut gr = f.graph();
        let am = gr.input("attention_mask", f32s(&[2 * 5]));
        let mut outs = gr.outputs.clone();
        outs.push(am); // keep the input alive, as the SmolLM2 prefill graph does
        gr.set_outputs(outs);
        let mut inputs = f.inputs();
        inputs.push(("attention_mask", &rows_mask));
        let (p, allowed) = f.reference();
        let allowed: Vec<bool> = allowed
            .iter()
            .enumerate()
            .map(|(i, &a)| a && rows_mask[(i / (f.g.h * f.g.sq * f.g.sk)) * f.g.sk + i % f.g.sk] > 0.5)
            .collect();
        let want = host_stats(&f.g, &p, &allowed, 8);
        assert_eq!(want["queries"], vec![(0, 8.0)], "{}", f.name);
        let (rows, manifests) = run_both(&f.name, "attn", &gr, &inputs, &ref_output(&f.g, &p, &f.v));
        let (site, got) = recorded(&rows);
        assert_stats(&f.name, &got, &want);
        let m = manifests.last().expect("manifest");
        assert!(m.padding.as_deref().is_some_and(|p| p.contains("attention_mask")), "{}: {:?}", f.name, m.padding);
        assert!(!m.skipped.iter().any(|k| k.site == site && k.reason.contains("no key mask")), "{}: {:?}", f.name, m.skipped);
        let pad = &got["pad_mass"];
        let leaks = health_verdicts(&rows);
        if unmasked {
            assert!(pad.iter().all(|(_, v)| *v > 1e-2), "{}: padding keys get mass without a mask: {pad:?}", f.name);
            assert_eq!(leaks.len(), 1, "{}: the leak is reported", f.name);
        } else {
            assert!(pad.iter().all(|(_, v)| *v == 0.0), "{}: {pad:?}", f.name);
            assert!(leaks.is_empty(), "{}: {leaks:?}", f.name);
        }
    }
}

/// The unfused form of the test above: a BERT-layout `softmax((Q K^T) * scale) @ V` with no
/// additive mask, in a program with a graph input `attention_mask` (batch 0 whole, batch 1
/// right-padded after 3 tokens): the probe reads the Softmax output and takes padding from the
/// row mask per batch (batch 1's padding is its own, not batch 0's). Padding keys get mass.
#[test]
fn unfused_attention_without_a_mask_takes_padding_from_attention_mask() {
    let Geom { b, h, sq: s, d, .. } = BERT;
    let mut g = Graph::new("bert_rows");
    let q = g.input("q", f32s(&[b, h, s, d]));
    let k = g.input("k", f32s(&[b, h, s, d]));
    let v = g.input("v", f32s(&[b, h, s, d]));
    let am = g.input("attention_mask", f32s(&[b, s]));
    let kt = g.add_node(Op::Transpose { perm: vec![0, 1, 3, 2] }, vec![k], f32s(&[b, h, d, s]));
    let scores = g.matmul(q, kt, f32s(&[b, h, s, s]));
    let c = scalar(&mut g, (d as f32).powf(-0.5));
    let scaled = g.binary(BinaryOp::Mul, scores, c, f32s(&[b, h, s, s]));
    let p = g.softmax(scaled, -1, f32s(&[b, h, s, s]));
    let ctx = g.matmul(p, v, f32s(&[b, h, s, d]));
    g.set_outputs(vec![ctx, am]);
    let (qv, kv, vv, _) = bert_inputs();
    let rows_mask = key_mask(b, s, 3);
    assert!(rows_mask[..s].iter().all(|m| *m > 0.5) && rows_mask[s + 3] < 0.5, "batch 0 whole, batch 1 padded");
    let (p, allowed) = ref_probs(&BERT, &qv, &kv, (d as f64).powf(-0.5), None, &|_, _, _, _| Some(0.0));
    let allowed: Vec<bool> = allowed.iter().enumerate().map(|(i, &a)| a && rows_mask[(i / (h * s * s)) * s + i % s] > 0.5).collect();
    let want = host_stats(&BERT, &p, &allowed, 8);
    assert_eq!(want["queries"][0], (0, (s + 3) as f64), "per head: 5 + 3 real queries");
    let inputs: Vec<(&str, &[f32])> = vec![("q", &qv), ("k", &kv), ("v", &vv), ("attention_mask", &rows_mask)];
    let (rows, manifests) = run_both("unfused rows", "attn", &g, &inputs, &ref_output(&BERT, &p, &vv));
    let (_, got) = recorded(&rows);
    assert_stats("unfused rows", &got, &want);
    assert!(manifests.last().unwrap().padding.as_deref().is_some_and(|p| p.contains("attention_mask")));
    assert!(got["pad_mass"].iter().all(|(_, v)| *v > 1e-2), "padding keys get mass without a mask: {:?}", got["pad_mass"]);
}

/// Uniform attention under a causal mask is no sink: query `q` sees `q + 1` keys, so the first
/// key's mean mass over queries 1..4 of a 5-token prefix (query 0 is the key's own position) is
/// (1/2 + 1/3 + 1/4 + 1/5) / 4 = 0.321, above the rule's 0.2 and 1.6x the share `1 / keys`; its
/// lift is exactly 1. The last key is seen only by its own query: no `sink_last` at all. With Q = 0 every score is
/// equal, so RLX's kernel computes exact uniform rows.
#[test]
fn uniform_causal_attention_has_lift_one_and_no_sink_verdict() {
    let mut f = fused("uniform_causal", geom(Layout::Bhsd), Mask::Causal, None, 310);
    f.q.iter_mut().for_each(|x| *x = 0.0);
    let (p, allowed) = f.reference();
    let (rows, _) = run_both(&f.name, "attn", &f.graph(), &f.inputs(), &ref_output(&f.g, &p, &f.v));
    let (_, got) = recorded(&rows);
    assert_stats(&f.name, &got, &host_stats(&f.g, &p, &allowed, 8));
    let harmonic: f64 = (2..=5).map(|n| 1.0 / n as f64).sum::<f64>() / 4.0;
    for (_, v) in &got["sink_first"] {
        assert!((v - harmonic).abs() < 1e-6, "sink_first {v} vs {harmonic}");
    }
    for (_, v) in &got["sink_first_lift"] {
        assert!((v - 1.0).abs() < 1e-6, "lift {v}");
    }
    assert!(!got.contains_key("sink_last"), "causal: only the last query sees the last key");
    let verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&rows));
    assert!(!verdicts.iter().any(|v| v.kind.name == "attention_sink"), "{verdicts:?}");
}

/// Only `attn` enabled: every fixture's outputs are bit-identical to the untapped run.
#[test]
fn attn_only_outputs_are_bit_identical() {
    let (q, k, v, mask) = bert_inputs();
    let mut runs: Vec<(Graph, Vec<(String, Vec<f32>)>)> = vec![(
        bert_graph(),
        vec![("q".into(), q.clone()), ("k".into(), k.clone()), ("v".into(), v.clone()), ("mask".into(), mask)],
    )];
    let n = 6 * 5 * 4;
    runs.push((rank3_graph(6, 5, 4), vec![("q".into(), randn(n, 1)), ("k".into(), randn(n, 2)), ("v".into(), randn(n, 3))]));
    for f in fused_cases() {
        runs.push((f.graph(), f.inputs().into_iter().map(|(n, d)| (n.to_string(), d.to_vec())).collect()));
    }
    for (g, data) in &runs {
        let inputs: Vec<(&str, &[f32])> = data.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
        let plain = run_plain(g, &[], &inputs);
        let (tapped, sink) = run_tapped("attn", g, &[], &inputs);
        assert!(!sink.rows().is_empty(), "{}: nothing recorded", g.name);
        assert_eq!(bits(&tapped), bits(&plain), "{}: outputs changed", g.name);
    }
}

// ───────────────────────────── snapshots ─────────────────────────────


fn snap(name: &str, g: &Graph) {
    let (out, m) = Pipeline::parse("attn").unwrap().apply(g).unwrap();
    common::assert_caller_outputs_first(g, &out);
    common::snapshot(name, &out, &m);
}

#[test]
fn snapshot_unfused_bert() {
    snap("attn__unfused_bert", &bert_graph());
}

#[test]
fn snapshot_fused_custom_mask() {
    snap("attn__fused_custom_mask", &fused_cases().remove(0).graph());
}

/// A fused attention fed by one merged QKV projection sliced with `Narrow`, the form RLX's CPU
/// backend fuses further at the thunk level, where the slices are never written: above 64
/// tokens per batch the kernel reads Q/K/V in place from the projection, and so does the probe
/// (RLX 0.2.19 gets this case wrong; the tapped run must reproduce it exactly); at 64 or fewer the projection, attention and output
/// projection are one kernel and nothing in between exists, so the site is skipped with the
/// reason (and the matmul tap skips the projection's output and the output projection's input),
/// never recorded from stale memory.
#[test]
fn fused_attention_from_a_merged_qkv_projection() {
    for (b, s) in [(2usize, 40usize), (2, 8)] {
        let (h, d) = (2usize, 4usize);
        let e = h * d;
        let gr = common::qkv_attention_graph(b, s, h, d);

        let xs = randn(b * s * e, 40);
        let ws: Vec<f32> = randn(e * 3 * e, 41).iter().map(|v| v * 0.7).collect();
        let wos = randn(e * e, 42);
        let mask = key_mask(b, s, s - 3);
        let params: [(&str, &[f32]); 2] = [("w_qkv", &ws), ("w_o", &wos)];
        let inputs: [(&str, &[f32]); 2] = [("x", &xs), ("mask", &mask)];
        // Host y = attention(x Wq, x Wk, x Wv) Wo.
        let proj = |col0: usize| -> Vec<f32> {
            let mut out = vec![0f32; b * s * e];
            for r in 0..b * s {
                for c in 0..e {
                    out[r * e + c] = (0..e).map(|i| xs[r * e + i] as f64 * ws[i * 3 * e + col0 + c] as f64).sum::<f64>() as f32;
                }
            }
            out
        };
        let g = Geom { b, h, kv: h, sq: s, sk: s, d, layout: Layout::Rank3 };
        let (p, allowed) = ref_probs(&g, &proj(0), &proj(e), (d as f64).powf(-0.5), None, &|bi, _, _, ki| (mask[bi * s + ki] > 0.5).then_some(0.0));
        let o = ref_output(&g, &p, &proj(2 * e));
        let y: Vec<f64> = (0..b * s * e)
            .map(|i| (0..e).map(|j| o[(i / e) * e + j] * wos[j * e + i % e] as f64).sum())
            .collect();
        let worst = |out: &[f32]| {
            assert_eq!(out.len(), y.len(), "B={b} S={s}: output length");
            out.iter().zip(&y).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max)
        };
        let plain = run_plain(&gr, &params, &inputs);
        let (tapped, sink) = run_tapped("attn,matmul{stats=[max]}", &gr, &params, &inputs);
        // The tap never changes the caller's outputs, even where RLX computes them wrong.
        assert_eq!(bits(&tapped), bits(&plain), "B={b} S={s}: outputs changed");
        // RLX 0.2.19 miscompiles this program above 64 tokens: its Narrow x3 -> Attention
        // rewrite reads the QKV buffer after the arena plan has reused it (measured: off by
        // ~18). The sketches run right after the nodes they read, so they do not keep that
        // buffer alive and the tapped run reproduces the miscompile bit for bit.
        let miscompiled = b * s > 64;
        if miscompiled {
            assert!(worst(&plain[0]) > 1.0, "RLX fixed its in-place QKV attention: make this test assert the host output again");
        } else {
            assert!(worst(&tapped[0]) < 1e-4, "B={b} S={s}: output off the host by {}", worst(&tapped[0]));
        }
        let rows = sink.rows();
        let m = sink.manifests().pop().expect("manifest");
        let skipped = |site: &str, role: &str| {
            m.skipped.iter().any(|k| k.site == site && k.role.as_ref().map(|r| r.as_str()) == Some(role) && k.reason.contains("never written"))
        };
        if b * s <= 64 {
            assert!(skipped("attention.0", "probs"), "{:?}", m.skipped);
            assert!(skipped("matmul.0", "out") && skipped("matmul.1", "lhs"), "{:?}", m.skipped);
            assert!(!rows.iter().any(|r| &*r.role == "probs"), "nothing recorded from stale memory");
            continue;
        }
        let got: Stats = {
            let mut st = Stats::new();
            for r in rows.iter().filter(|r| &*r.role == "probs") {
                st.entry(r.stat.to_string()).or_default().push((r.idx, r.value as f64));
            }
            st.values_mut().for_each(|v| v.sort_by_key(|p| p.0));
            st
        };
        if miscompiled {
            // The probe saw the stale Q/K the attention read: not the host's probabilities.
            assert!(rows.iter().any(|r| &*r.site == "matmul.0" && &*r.role == "out" && &*r.stat == "max"));
            continue;
        }
        let want = host_stats(&g, &p, &allowed, 8);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
        for (stat, w) in &want {
            assert_eq!(got[stat].len(), w.len(), "B={b} S={s} {stat}: recorded entries");
            for ((gi, gv), (wi, wv)) in got[stat].iter().zip(w) {
                assert_eq!(gi, wi);
                assert!((gv - wv).abs() < 1e-4, "B={b} S={s} {stat}[{gi}]: tap {gv}, host {wv}");
            }
        }
        // The projection's output is written here (the attention reads it in place): sketched.
        assert!(rows.iter().any(|r| &*r.site == "matmul.0" && &*r.role == "out" && &*r.stat == "max"));
    }
}
