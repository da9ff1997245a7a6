//! A corpus through a GGUF Llama model: prefill in batches of `[batch, seq]` (right-padded with
//! the EOS id; causal attention keeps padding out of every real position), greedy decode steps
//! against a KV cache, and the perplexity of the text.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rlx_ir::{DType, Graph};
use rlx_runtime::{CompiledGraph, Session};

use super::tokenizer::GgufTokenizer;
use super::LlamaModel;

/// Perplexity over a corpus: `exp(mean NLL)` of every next-token prediction inside a sequence
/// (position `t` predicts token `t+1`; a sequence of `n` tokens gives `n-1` predictions; the
/// first token of each sequence is not predicted). NLL in nats.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Perplexity {
    /// Sum of the negative log-likelihoods (nats).
    pub nll: f64,
    /// Predictions summed.
    pub tokens: usize,
}

impl Perplexity {
    /// `exp(nll / tokens)` (NaN with no prediction).
    pub fn value(&self) -> f64 {
        (self.nll / self.tokens as f64).exp()
    }

    /// Add the predictions of one sequence: `logits` `[>= ids.len(), vocab]` row-major.
    pub fn add(&mut self, logits: &[f32], vocab: usize, ids: &[u32]) {
        for t in 0..ids.len().saturating_sub(1) {
            let row = &logits[t * vocab..(t + 1) * vocab];
            self.nll += log_softmax_at(row, ids[t + 1] as usize);
            self.tokens += 1;
        }
    }
}

/// `-log softmax(row)[i]` in f64 (log-sum-exp with the maximum subtracted).
pub fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    lse - row[i] as f64
}

/// Index of the largest value (the first on ties).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn i64_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// What one prefill batch gives back.
pub struct Prefill {
    /// Logits `[rows * seq, vocab]` row-major (rows of the batch; padded positions included).
    pub logits: Vec<f32>,
    /// Per block, K and V `[rows, kv_heads, seq, head_dim]` (when the graph outputs them).
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
}

/// A GGUF Llama model, its tokenizer and a tokenized corpus.
pub struct LlamaJob {
    /// The model.
    pub model: LlamaModel,
    /// Its tokenizer.
    pub tokenizer: GgufTokenizer,
    /// Token ids per entry, truncated to `seq`.
    pub seqs: Vec<Vec<u32>>,
    /// Entries longer than `seq` tokens (truncated).
    pub truncated: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence (prefill length).
    pub seq: usize,
    /// Greedy decode steps after each prefill (0: prefill only).
    pub decode: usize,
}

impl LlamaJob {
    /// Load `gguf`, tokenize `entries` (truncated to `seq` tokens; entries of fewer than 2 tokens
    /// are dropped: they predict nothing).
    ///
    /// Errors: the model or its tokenizer does not load, `seq + decode` exceeds the model's
    /// context, or no entry is left.
    pub fn new(gguf: &Path, entries: &[String], batch: usize, seq: usize, decode: usize) -> Result<LlamaJob> {
        Self::new_with(gguf, entries, batch, seq, decode, true)
    }

    /// [`LlamaJob::new`] with the projections packed or not ([`LlamaModel::load_with`]).
    pub fn new_with(gguf: &Path, entries: &[String], batch: usize, seq: usize, decode: usize, packed: bool) -> Result<LlamaJob> {
        let model = LlamaModel::load_with(gguf, packed)?;
        let tokenizer = GgufTokenizer::from_gguf(&model.file).with_context(|| format!("the tokenizer of {}", gguf.display()))?;
        if seq + decode > model.config.context {
            bail!("--seq {seq} plus {decode} decode steps exceed the model's context of {} tokens", model.config.context);
        }
        let mut seqs = Vec::new();
        let mut truncated = 0;
        for e in entries {
            let mut ids = tokenizer.encode(e)?;
            if ids.len() > seq {
                ids.truncate(seq);
                truncated += 1;
            }
            if ids.len() >= 2 {
                seqs.push(ids);
            }
        }
        if seqs.is_empty() {
            bail!("no text entry has 2 or more tokens");
        }
        Ok(LlamaJob { model, tokenizer, seqs, truncated, batch: batch.max(1), seq, decode })
    }

    /// The prefill graph of a full batch (what a tap sees).
    pub fn graph(&self) -> Graph {
        self.model.prefill_graph(self.batch.min(self.seqs.len()), self.seq, self.decode > 1)
    }

    /// Run one prefill batch on `c` (compiled from [`LlamaModel::prefill_graph`] for
    /// `rows.len()` sequences of `seq` tokens): ids right-padded with EOS to `seq`.
    pub fn prefill(&self, c: &mut CompiledGraph, rows: &[Vec<u32>], kv: bool) -> Result<Prefill> {
        self.model.prefill(c, rows, self.seq, self.tokenizer.eos, kv)
    }

    /// Run every batch with `pipeline` active at `stage`, recording to `sink`. Per batch: the
    /// prefill (one step of the prefill graph's compile), then `decode` greedy decode steps
    /// (each one step of the decode graph's compile). `each` gets the batch's sequences, the
    /// prefill logits `[rows*seq, vocab]` and the greedy continuations (one per sequence).
    /// Stops after the batch in progress when [`crate::model::INTERRUPTED`] is set.
    pub fn run(
        &self,
        pipeline: &opscope::Pipeline,
        stage: opscope::activate::Stage,
        sink: Box<dyn opscope::Sink>,
        mut each: impl FnMut(&[Vec<u32>], &[f32], &[Vec<u32>]) -> Result<()>,
    ) -> Result<opscope::activate::Summary> {
        let session = Session::new(rlx_runtime::Device::Cpu);
        crate::model::STOPPED_EARLY.store(false, std::sync::atomic::Ordering::SeqCst);
        let scope = opscope::Scope::new(pipeline, sink).stage(stage).interrupt_flag(&crate::model::STOPPED_EARLY);
        let (res, recorded) = scope.run(|| -> Result<()> { self.run_untapped(&session, &mut each) });
        res?;
        recorded.context("recording")
    }

    /// [`LlamaJob::run`] without a scope (taps only if the caller opened one).
    pub fn run_untapped(&self, session: &Session, each: &mut impl FnMut(&[Vec<u32>], &[f32], &[Vec<u32>]) -> Result<()>) -> Result<()> {
        // The first continuation token comes from the prefill; the decode graph runs from the second.
        let kv = self.decode > 1;
        let mut compiled: Vec<(usize, Graph, CompiledGraph, Option<(Graph, CompiledGraph)>)> = Vec::new();
        for chunk in self.seqs.chunks(self.batch) {
            if crate::model::stop_before_next() {
                break;
            }
            let rows = chunk.len();
            if !compiled.iter().any(|(r, ..)| *r == rows) {
                let g = self.model.prefill_graph(rows, self.seq, kv);
                let c = self.model.compile(session, &g);
                let d = kv.then(|| {
                    let dg = self.model.decode_graph(rows, self.seq + self.decode - 1);
                    let dc = self.model.compile(session, &dg);
                    (dg, dc)
                });
                compiled.push((rows, g, c, d));
            }
            let (_, _, c, d) = compiled.iter_mut().find(|(r, ..)| *r == rows).expect("compiled above");
            let pre = self.prefill(c, chunk, kv)?;
            let cont = match d {
                Some((_, dc)) => self.greedy(dc, chunk, &pre)?,
                None if self.decode == 1 => chunk.iter().enumerate().map(|(i, r)| vec![self.last_argmax(&pre, i, r.len())]).collect(),
                None => vec![Vec::new(); rows],
            };
            each(chunk, &pre.logits, &cont)?;
        }
        Ok(())
    }

    /// The argmax of the prefill logits at the last token of row `i` (of `len` tokens).
    fn last_argmax(&self, pre: &Prefill, i: usize, len: usize) -> u32 {
        let (at, vocab) = (i * self.seq + len - 1, self.model.config.vocab);
        argmax(&pre.logits[at * vocab..(at + 1) * vocab]) as u32
    }

    /// `decode` greedy steps for the batch `rows` after its prefill: the first token is the
    /// prefill's argmax at each sequence's last position, each later one comes from one run of
    /// the decode graph. Each sequence decodes at its own positions (`len`, `len+1`, ...), its
    /// new K/V stored at the cache slot of that position; the mask hides the padded slots.
    fn greedy(&self, dc: &mut CompiledGraph, rows: &[Vec<u32>], pre: &Prefill) -> Result<Vec<Vec<u32>>> {
        let c = &self.model.config;
        let (b, vocab, hd, kvh) = (rows.len(), c.vocab, c.head_dim, c.kv_heads);
        let cache = self.seq + self.decode - 1;
        // Cache per block, [b, kv_heads, cache, head_dim], filled from the prefill's K/V.
        let mut caches: Vec<(Vec<f32>, Vec<f32>)> = pre
            .kv
            .iter()
            .map(|(k, v)| {
                let mut kc = vec![0f32; b * kvh * cache * hd];
                let mut vc = vec![0f32; b * kvh * cache * hd];
                for bh in 0..b * kvh {
                    let (src, dst) = (bh * self.seq * hd, bh * cache * hd);
                    kc[dst..dst + self.seq * hd].copy_from_slice(&k[src..src + self.seq * hd]);
                    vc[dst..dst + self.seq * hd].copy_from_slice(&v[src..src + self.seq * hd]);
                }
                (kc, vc)
            })
            .collect();
        let mut valid: Vec<Vec<bool>> = rows.iter().map(|r| (0..cache).map(|i| i < r.len()).collect()).collect();
        let mut next: Vec<u32> = rows.iter().enumerate().map(|(i, r)| self.last_argmax(pre, i, r.len())).collect();
        let mut out: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        for step in 0..self.decode.saturating_sub(1) {
            let pos: Vec<usize> = rows.iter().map(|r| r.len() + step).collect();
            let (cos, sin) = c.rope_tables(&pos);
            let mut mask = Vec::with_capacity(b * (cache + 1));
            for v in &valid {
                mask.extend(v.iter().map(|&x| if x { 1f32 } else { 0f32 }));
                mask.push(1.0);
            }
            let names: Vec<(String, String)> = (0..c.layers).map(|l| (format!("past_k.{l}"), format!("past_v.{l}"))).collect();
            let cache_bytes: Vec<(Vec<u8>, Vec<u8>)> = caches.iter().map(|(k, v)| (f32_bytes(k), f32_bytes(v))).collect();
            let (idb, cb, sb, mb) = (i64_bytes(&next), f32_bytes(&cos), f32_bytes(&sin), f32_bytes(&mask));
            let rows_mask = f32_bytes(&vec![1f32; b]);
            let mut inputs: Vec<(&str, &[u8], DType)> = vec![
                ("input_ids", &idb, DType::I64),
                ("rope_cos", &cb, DType::F32),
                ("rope_sin", &sb, DType::F32),
                ("kv_mask", &mb, DType::F32),
                ("attention_mask", &rows_mask, DType::F32),
            ];
            for ((kn, vn), (kb, vb)) in names.iter().zip(&cache_bytes) {
                inputs.push((kn, kb, DType::F32));
                inputs.push((vn, vb, DType::F32));
            }
            let outs = dc.run_typed(&inputs);
            if outs.len() != 2 + 2 * c.layers {
                bail!("the decode graph returned {} outputs, expected {}", outs.len(), 2 + 2 * c.layers);
            }
            let logits = f32_values(&outs[0].0);
            // The new token's K/V go to cache slot `pos` (slot order does not matter to attention).
            for (l, (kc, vc)) in caches.iter_mut().enumerate() {
                let (nk, nv) = (f32_values(&outs[1 + 2 * l].0), f32_values(&outs[2 + 2 * l].0));
                for bh in 0..b * kvh {
                    let dst = (bh * cache + pos[bh / kvh]) * hd;
                    kc[dst..dst + hd].copy_from_slice(&nk[bh * hd..(bh + 1) * hd]);
                    vc[dst..dst + hd].copy_from_slice(&nv[bh * hd..(bh + 1) * hd]);
                }
            }
            for (v, &p) in valid.iter_mut().zip(&pos) {
                v[p] = true;
            }
            for i in 0..b {
                next[i] = argmax(&logits[i * vocab..(i + 1) * vocab]) as u32;
                out[i].push(next[i]);
            }
        }
        Ok(out)
    }
}

impl LlamaModel {
    /// Run one prefill batch on `c` (compiled from [`LlamaModel::prefill_graph`] for
    /// `rows.len()` sequences of `seq` tokens, with `kv` outputs or not): ids right-padded with
    /// `pad` to `seq`.
    ///
    /// Errors: a row longer than `seq`, or outputs other than the graph's.
    pub fn prefill(&self, c: &mut CompiledGraph, rows: &[Vec<u32>], seq: usize, pad: u32, kv: bool) -> Result<Prefill> {
        let mut ids = Vec::with_capacity(rows.len() * seq);
        let mut mask = Vec::with_capacity(rows.len() * seq);
        for r in rows {
            mask.extend((0..seq).map(|t| if t < r.len() { 1f32 } else { 0f32 }));
            if r.len() > seq {
                bail!("a sequence of {} tokens is longer than --seq {}", r.len(), seq);
            }
            ids.extend_from_slice(r);
            ids.extend(std::iter::repeat(pad).take(seq - r.len()));
        }
        let positions: Vec<usize> = (0..seq).collect();
        let (cos, sin) = self.config.rope_tables(&positions);
        let (idb, cb, sb, mb) = (i64_bytes(&ids), f32_bytes(&cos), f32_bytes(&sin), f32_bytes(&mask));
        let inputs: Vec<(&str, &[u8], DType)> = vec![("input_ids", &idb, DType::I64), ("rope_cos", &cb, DType::F32), ("rope_sin", &sb, DType::F32), ("attention_mask", &mb, DType::F32)];
        let outs = c.run_typed(&inputs);
        let want = 2 + if kv { 2 * self.config.layers } else { 0 };
        if outs.len() != want || outs.iter().any(|(_, d)| *d != DType::F32) {
            bail!("the prefill graph returned {} outputs, expected {want} f32 outputs", outs.len());
        }
        let mut it = outs[..want - 1].iter().map(|(b, _)| f32_values(b));
        let logits = it.next().unwrap_or_default();
        let mut kvs = Vec::new();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            kvs.push((k, v));
        }
        Ok(Prefill { logits, kv: kvs })
    }

}
