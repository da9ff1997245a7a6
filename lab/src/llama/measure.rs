//! `opscope measure --gguf`: the decisions the taps and actuations exist for, measured on a
//! Llama-architecture decoder (SmolLM2-135M) over real text. Every number is a perplexity or a
//! logits comparison against the unmodified model (Q4_1 weights, f32 activations), or a
//! statistic the taps recorded on it.
//!
//! 1. **Attention sinks** per layer and head (`attn` tap): mean probability on the first token
//!    and its lift over a uniform query's share (StreamingLLM, Xiao et al. 2024).
//! 2. **Massive activations** per residual block (`residual` tap): the largest |h| of the block's
//!    output, where (channel, position, token) and how large against the median |h| (Sun et al.
//!    2024: > 100 and about 1000x the median).
//! 3. **Activation quantization** (`fakequant`): perplexity and logits SQNR with int8
//!    activations per tensor and per token on the file's packed Q4_1 weights (W4A8), and with
//!    the weights also rounded to int8 per output channel from their Q4_1 values (W8A8 over the
//!    Q4_1 grid: the file holds no higher-precision weights).
//! 4. **Block influence vs layer skip**: ShortGPT's block influence `1 - cos(x, x + f(x))` per
//!    residual block (Men et al. 2024) against the perplexity change when `skip` bypasses that
//!    block; Spearman rank correlation.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use opscope::activate::Stage;
use opscope::{Manifest, MemorySink, Pipeline, Row};

use super::job::{argmax, LlamaJob, Perplexity};
use crate::measure::spearman;

/// The taps of the reference run.
pub const BASELINE: &str = "attn{stats=[queries,entropy_norm,sink_first,sink_first_lift,pad_mass]},residual{stats=[rows,cos,ratio,out_median_abs,out_top,out_chan_absmax]}";

/// The activation-quantization configurations: (name, pipeline, weights dequantized to f32).
/// `W4A8`: int8 activations on the file's packed 4-bit weights; `W8A8`: the weights also
/// fake-quantized to int8 per output channel (from their Q4_1 values).
pub const QUANT: [(&str, &str, bool); 4] = [
    ("W4A8 (Q4_1 weights), per-tensor int8 activations", "fakequant{scope=tensor}", false),
    ("W4A8 (Q4_1 weights), per-token int8 activations", "fakequant{scope=token}", false),
    ("W8A8 over the Q4_1 grid, per-tensor activations", "fakequant{scope=tensor,weights=true}", true),
    ("W8A8 over the Q4_1 grid, per-token activations", "fakequant{scope=token,weights=true}", true),
];

/// A head is counted a sink head at lift >= 5 and mass >= 0.2 (the `attention_sink` rule's lines).
const SINK_LIFT: f64 = 5.0;
const SINK_MASS: f64 = 0.2;
/// Sun et al. 2024's magnitude line for a massive activation.
const MASSIVE_ABS: f64 = 100.0;

/// One attention layer, averaged over the text (weighted by each batch's non-padding queries).
#[derive(Debug, Clone, Serialize)]
pub struct SinkLayer {
    /// Site name (`blk.L.attn`).
    pub site: String,
    /// Per head: mean probability on the first token.
    pub sink_first: Vec<f64>,
    /// Per head: mean of (probability on the first token x keys the query sees); 1 = uniform.
    pub lift: Vec<f64>,
    /// Per head: mean normalized entropy (1 = uniform over the allowed keys).
    pub entropy_norm: Vec<f64>,
    /// Heads with lift >= 5 and mass >= 0.2.
    pub sink_heads: usize,
    /// Largest per-head mass on padding keys (0 when padding is kept out).
    pub pad_mass_max: f64,
}

/// A residual block's massive activations.
#[derive(Debug, Clone, Serialize)]
pub struct MassiveBlock {
    /// Block index `K` of `block.K`.
    pub block: usize,
    /// The largest |h| of the block's output over the text (signed).
    pub top: f64,
    /// Its channel.
    pub channel: usize,
    /// Its position in the sequence (0 = first token).
    pub position: usize,
    /// Its token, decoded.
    pub token: String,
    /// Median over batches of the median |h| of the block's output.
    pub median_abs: f64,
    /// `|top| / median_abs`.
    pub ratio: f64,
    /// Channels whose max |h| exceeded 100 in any batch.
    pub channels_above_100: Vec<usize>,
    /// Of the recorded top-4 entries above 100 (over every batch), the share at position 0.
    pub share_at_first_token: f64,
}

/// One quantization configuration against the reference.
#[derive(Debug, Clone, Serialize)]
pub struct LlmQuant {
    /// What it is.
    pub name: String,
    /// The pipeline run.
    pub pipeline: String,
    /// Perplexity of the text under it.
    pub perplexity: f64,
    /// Perplexity of its reference run (the packed model for W4A8, the f32-weight model for W8A8).
    pub reference_perplexity: f64,
    /// `10 log10(sum l^2 / sum (l - l_q)^2)` over the logits of every non-padding position, dB.
    pub logits_sqnr_db: f64,
    /// Share of non-padding positions whose next-token argmax is unchanged.
    pub top1_agree: f64,
    /// 95% interval of the perplexity change `perplexity / reference_perplexity - 1` over the
    /// text's sequences: a paired percentile bootstrap ([`change_interval`]). How far the same
    /// configuration can land on other text of this kind; its width also bounds how many digits
    /// of the change mean anything.
    pub change_ci95: (f64, f64),
}

/// One residual block: its influence and what skipping it costs.
#[derive(Debug, Clone, Serialize)]
pub struct LlmBlock {
    /// Block index `K` (`block.K`, execution order).
    pub block: usize,
    /// Transformer layer (`K / 2`).
    pub layer: usize,
    /// `attention` or `ffn` (even / odd `K`).
    pub kind: &'static str,
    /// ShortGPT's block influence: 1 - mean over non-padding tokens of cos(x, x + f(x)).
    pub influence: f64,
    /// Perplexity with the block bypassed.
    pub skip_perplexity: f64,
    /// Logits SQNR (dB) with the block bypassed.
    pub skip_logits_sqnr_db: f64,
    /// Share of positions whose argmax is unchanged with the block bypassed.
    pub skip_top1_agree: f64,
}

/// Everything `measure --gguf` reports.
#[derive(Debug, Clone, Serialize)]
pub struct LlmMeasurement {
    /// The model file's stem.
    pub model: String,
    /// Sequences measured.
    pub sequences: usize,
    /// Next-token predictions the perplexity averages over.
    pub predictions: usize,
    /// Prefill length (tokens, right-padded).
    pub seq: usize,
    /// Perplexity of the unmodified model.
    pub perplexity: f64,
    /// Attention sinks per layer.
    pub attention: Vec<SinkLayer>,
    /// Massive activations per residual block.
    pub massive: Vec<MassiveBlock>,
    /// Activation quantization.
    pub quant: Vec<LlmQuant>,
    /// Block influence and skip cost per residual block (empty without `skip`).
    pub blocks: Vec<LlmBlock>,
    /// Spearman rank correlation of influence with the skip's perplexity increase.
    pub spearman_perplexity: f64,
    /// Spearman rank correlation of influence with the skip's logits error (-SQNR).
    pub spearman_logits: f64,
}

/// Logits of the non-padding positions of a run, `[positions, vocab]`, and its perplexity
/// (over the text, and per sequence in run order).
struct Run {
    logits: Vec<f32>,
    ppl: Perplexity,
    per_sequence: Vec<Perplexity>,
    rows: Vec<Row>,
    manifests: Vec<Manifest>,
}

fn run(job: &LlamaJob, pipeline: &str) -> Result<Run> {
    let p = Pipeline::parse(pipeline)?;
    let sink = MemorySink::default();
    let (seq, vocab) = (job.seq, job.model.config.vocab);
    let mut logits = Vec::new();
    let mut ppl = Perplexity::default();
    let mut per_sequence = Vec::new();
    job.run(&p, Stage::Deployed, Box::new(sink.clone()), |rows, l, _| {
        for (i, r) in rows.iter().enumerate() {
            let at = &l[i * seq * vocab..(i * seq + r.len()) * vocab];
            let mut one = Perplexity::default();
            one.add(at, vocab, r);
            ppl.nll += one.nll;
            ppl.tokens += one.tokens;
            per_sequence.push(one);
            logits.extend_from_slice(at);
        }
        Ok(())
    })
    .with_context(|| format!("running '{pipeline}'"))?;
    Ok(Run { logits, ppl, per_sequence, rows: sink.rows(), manifests: sink.manifests() })
}

/// Bootstrap resamples of [`change_interval`] in `measure`.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// The `confidence` interval of the perplexity change of `got` over `want`, the same sequences
/// run twice (`[sequences]`, in the same order): a paired percentile bootstrap over sequences
/// (Efron & Tibshirani 1993, ch. 13; paired resampling of test items as in Koehn 2004's
/// significance tests for MT), `resamples` draws from ChaCha8 seeded 0. Each draw takes
/// sequences with replacement and computes `exp((sum nll_got - sum nll_want) / sum tokens) - 1`
/// over them (a sequence's tokens stay together: they are not independent); the interval is the
/// draws' `(1 - c)/2` and `(1 + c)/2` quantiles. `(NaN, NaN)` with fewer than 2 sequences or
/// none predicted.
pub fn change_interval(want: &[Perplexity], got: &[Perplexity], confidence: f64, resamples: usize) -> (f64, f64) {
    use rand::{Rng, SeedableRng};
    let n = want.len().min(got.len());
    let total: usize = want[..n].iter().map(|p| p.tokens).sum();
    if n < 2 || total == 0 || resamples == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let mut draws: Vec<f64> = (0..resamples)
        .map(|_| {
            let (mut d, mut t) = (0.0, 0usize);
            for _ in 0..n {
                let i = rng.gen_range(0..n);
                d += got[i].nll - want[i].nll;
                t += want[i].tokens;
            }
            if t == 0 { 0.0 } else { (d / t as f64).exp() - 1.0 }
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    let at = |q: f64| draws[((q * resamples as f64).floor() as usize).min(resamples - 1)];
    (at((1.0 - confidence) / 2.0), at((1.0 + confidence) / 2.0))
}

/// (logits SQNR in dB, share of positions with the same argmax) of `got` against `want`.
fn compare(want: &[f32], got: &[f32], vocab: usize) -> (f64, f64) {
    let (mut s, mut n) = (0f64, 0f64);
    for (&a, &b) in want.iter().zip(got) {
        s += (a as f64).powi(2);
        n += (a as f64 - b as f64).powi(2);
    }
    let rows = want.len() / vocab;
    let same = (0..rows).filter(|&r| argmax(&want[r * vocab..(r + 1) * vocab]) == argmax(&got[r * vocab..(r + 1) * vocab])).count();
    (10.0 * (s / n).log10(), same as f64 / rows.max(1) as f64)
}

/// Runs in execution order: `(compile, step)` -> batch index.
fn batches(rows: &[Row]) -> BTreeMap<(u32, u64), usize> {
    let mut of = BTreeMap::new();
    for r in rows {
        let n = of.len();
        of.entry((r.compile, r.step)).or_insert(n);
    }
    of
}

/// The attention sinks per layer, from [`crate::measure::attention_means`].
fn attention(rows: &[Row]) -> Vec<SinkLayer> {
    let mut out: Vec<SinkLayer> = crate::measure::attention_means(rows)
        .into_iter()
        .map(|(site, stats)| {
            let get = |s: &str| stats.get(s).cloned().unwrap_or_default();
            let (sink_first, lift) = (get("sink_first"), get("sink_first_lift"));
            let sink_heads = sink_first.iter().zip(&lift).filter(|(m, l)| **m >= SINK_MASS && **l >= SINK_LIFT).count();
            SinkLayer {
                site,
                pad_mass_max: get("pad_mass").iter().copied().fold(0.0, f64::max),
                entropy_norm: get("entropy_norm"),
                sink_first,
                lift,
                sink_heads,
            }
        })
        .collect();
    out.sort_by_key(|l| layer_of(&l.site));
    out
}

/// `L` of a site named `blk.L.…` (else `usize::MAX`, sorted last).
fn layer_of(site: &str) -> usize {
    site.strip_prefix("blk.").and_then(|s| s.split('.').next()).and_then(|l| l.parse().ok()).unwrap_or(usize::MAX)
}

fn block_of(site: &str) -> Option<usize> {
    site.strip_prefix("block.")?.parse().ok()
}

/// Block influence (rows-weighted mean of 1 - cos) and massive activations per residual block.
fn residual(job: &LlamaJob, rows: &[Row]) -> Result<(BTreeMap<usize, f64>, Vec<MassiveBlock>)> {
    let batch_of = batches(rows);
    // (sum of rows x influence, rows, per-batch medians, channels above 100)
    type Acc = (f64, f64, Vec<f64>, std::collections::BTreeSet<usize>);
    let mut per: BTreeMap<usize, BTreeMap<(u32, u64), Vec<&Row>>> = BTreeMap::new();
    for r in rows.iter().filter(|r| &*r.role == "block") {
        if let Some(k) = block_of(&r.site) {
            per.entry(k).or_default().entry((r.compile, r.step)).or_default().push(r);
        }
    }
    let mut influence = BTreeMap::new();
    let mut massive = Vec::new();
    for (k, runs) in per {
        let mut a: Acc = (0.0, 0.0, Vec::new(), Default::default());
        for rs in runs.values() {
            let scalar = |s: &str| rs.iter().find(|r| &*r.stat == s).map(|r| r.value as f64);
            if let (Some(n), Some(c)) = (scalar("rows"), scalar("cos")) {
                if c.is_finite() {
                    a.0 += n * (1.0 - c);
                    a.1 += n;
                }
            }
            if let Some(m) = scalar("out_median_abs") {
                a.2.push(m);
            }
            for r in rs.iter().filter(|r| &*r.stat == "out_chan_absmax" && r.value as f64 > MASSIVE_ABS) {
                a.3.insert(r.idx as usize);
            }
        }
        if a.1 > 0.0 {
            influence.insert(k, a.0 / a.1);
        }
        // The largest entry (value, sequence, position, channel) over every batch's top 4.
        let mut best: Option<(f64, usize, usize, usize)> = None;
        let (mut above, mut first) = (0usize, 0usize);
        for (run, rs) in &runs {
            let mut top = vec![f64::NAN; 12];
            for r in rs.iter().filter(|r| &*r.stat == "out_top") {
                if let Some(t) = top.get_mut(r.idx as usize) {
                    *t = r.value as f64;
                }
            }
            for t in top.chunks(3).filter(|t| t[0].is_finite()) {
                let (row, ch) = (t[1] as usize, t[2] as usize);
                let (sq, pos) = (batch_of[run] * job.batch + row / job.seq, row % job.seq);
                if t[0].abs() > MASSIVE_ABS {
                    above += 1;
                    first += (pos == 0) as usize;
                }
                if best.is_none_or(|b| t[0].abs() > b.0.abs()) {
                    best = Some((t[0], sq, pos, ch));
                }
            }
        }
        let Some((top, sq, pos, ch)) = best else { continue };
        let token = match job.seqs.get(sq).and_then(|s| s.get(pos)) {
            Some(&id) => job.tokenizer.decode(&[id])?,
            None => bail!("block.{k}: the top entry's row {sq}/{pos} is outside the text (padding counted?)"),
        };
        let median_abs = crate::timing::median(&a.2);
        massive.push(MassiveBlock {
            block: k,
            top,
            channel: ch,
            position: pos,
            token,
            median_abs,
            ratio: top.abs() / median_abs,
            channels_above_100: a.3.into_iter().collect(),
            share_at_first_token: if above > 0 { first as f64 / above as f64 } else { f64::NAN },
        });
    }
    Ok((influence, massive))
}

/// Measure `job` (loaded with packed weights) and, for the W8A8 rows, `dequantized` (the same
/// model with every projection bound as f32; `None` leaves those rows out). `skip`: also run one
/// skip per residual block (a full pass over the text each). `also`: more actuation pipelines
/// (`opscope measure --also`), each run on the packed model and reported as a row beside the
/// W4A8 rows, against the packed reference. `progress` gets each stage's name.
///
/// Errors: a run fails, a pipeline of `also` does not parse, holds no actuation or changed
/// nothing ([`crate::measure::parse_also`], [`crate::measure::ensure_actuated`]), or a skip did
/// not bypass its block.
pub fn measure(job: &LlamaJob, dequantized: Option<&LlamaJob>, skip: bool, also: &[String], mut progress: impl FnMut(&str)) -> Result<LlmMeasurement> {
    let also_parsed = crate::measure::parse_also(also)?;
    let vocab = job.model.config.vocab;
    progress("reference run with attn + residual taps");
    let base = run(job, BASELINE)?;
    let attention = attention(&base.rows);
    let (influence, massive) = residual(job, &base.rows)?;

    let mut quant = Vec::new();
    let mut f32_base: Option<Run> = None;
    for (name, p, deq) in QUANT {
        let (j, reference) = match (deq, dequantized) {
            (false, _) => (job, &base),
            (true, Some(d)) => {
                if f32_base.is_none() {
                    progress("reference run with f32 (dequantized) weights");
                    f32_base = Some(run(d, "skip{blocks=[]}")?);
                }
                (d, f32_base.as_ref().expect("set above"))
            }
            (true, None) => continue,
        };
        progress(p);
        let r = run(j, p)?;
        let (sqnr, agree) = compare(&reference.logits, &r.logits, vocab);
        quant.push(LlmQuant {
            name: name.into(),
            pipeline: p.into(),
            perplexity: r.ppl.value(),
            reference_perplexity: reference.ppl.value(),
            logits_sqnr_db: sqnr,
            top1_agree: agree,
            change_ci95: change_interval(&reference.per_sequence, &r.per_sequence, 0.95, BOOTSTRAP_RESAMPLES),
        });
    }

    for (text, p) in also.iter().zip(&also_parsed) {
        progress(text);
        let r = run(job, text)?;
        crate::measure::ensure_actuated(p, &r.manifests)?;
        let (sqnr, agree) = compare(&base.logits, &r.logits, vocab);
        quant.push(LlmQuant {
            name: "--also (packed weights)".into(),
            pipeline: text.clone(),
            perplexity: r.ppl.value(),
            reference_perplexity: base.ppl.value(),
            logits_sqnr_db: sqnr,
            top1_agree: agree,
            change_ci95: change_interval(&base.per_sequence, &r.per_sequence, 0.95, BOOTSTRAP_RESAMPLES),
        });
    }

    let mut blocks = Vec::new();
    if skip {
        for (&k, &infl) in &influence {
            let p = format!("skip{{blocks=[{k}]}}");
            progress(&p);
            let r = run(job, &p)?;
            let site = format!("block.{k}");
            for m in &r.manifests {
                if !m.actuations.iter().any(|a| a.site == site) {
                    let why = m.skipped.iter().find(|s| s.site == site).map(|s| s.reason.clone()).unwrap_or_default();
                    bail!("{p} did not bypass {site} in graph '{}': {why}", m.graph);
                }
            }
            let (sqnr, agree) = compare(&base.logits, &r.logits, vocab);
            blocks.push(LlmBlock {
                block: k,
                layer: k / 2,
                kind: if k % 2 == 0 { "attention" } else { "ffn" },
                influence: infl,
                skip_perplexity: r.ppl.value(),
                skip_logits_sqnr_db: sqnr,
                skip_top1_agree: agree,
            });
        }
    }
    let infl: Vec<f64> = blocks.iter().map(|b| b.influence).collect();
    let spearman_perplexity = spearman(&infl, &blocks.iter().map(|b| b.skip_perplexity).collect::<Vec<_>>());
    let spearman_logits = spearman(&infl, &blocks.iter().map(|b| -b.skip_logits_sqnr_db).collect::<Vec<_>>());
    Ok(LlmMeasurement {
        model: job.model.name.clone(),
        sequences: job.seqs.len(),
        predictions: base.ppl.tokens,
        seq: job.seq,
        perplexity: base.ppl.value(),
        attention,
        massive,
        quant,
        blocks,
        spearman_perplexity,
        spearman_logits,
    })
}

/// `x` as a signed percentage, to the digits an interval of width `width` (a fraction) supports:
/// one decimal below a width of 2%, none up to 20%, tens above (a width of NaN: two decimals).
fn percent(x: f64, width: f64) -> String {
    let w = width.abs() * 100.0;
    match w {
        w if w.is_nan() => format!("{:+.2}%", 100.0 * x),
        w if w < 2.0 => format!("{:+.1}%", 100.0 * x),
        w if w < 20.0 => format!("{:+.0}%", 100.0 * x),
        _ => format!("{:+.0}%", (10.0 * x).round() * 10.0),
    }
}

impl LlmMeasurement {
    /// The report as Markdown tables.
    pub fn markdown(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "## {}: {} sequences, {} next-token predictions (--seq {})\n\nperplexity {:.3}\n",
            self.model, self.sequences, self.predictions, self.seq, self.perplexity
        );
        let _ = writeln!(o, "### Attention sinks (first token; lift 1 = uniform over the keys a query sees)\n");
        let _ = writeln!(o, "| layer | sink heads (lift >= 5, mass >= 0.2) | mass on first token, per head | lift, per head | pad mass max |");
        let _ = writeln!(o, "|---|---|---|---|---|");
        let f = |v: &[f64], p: usize| v.iter().map(|x| format!("{x:.p$}")).collect::<Vec<_>>().join(" ");
        for l in &self.attention {
            let _ = writeln!(o, "| {} | {}/{} | {} | {} | {:.1e} |", l.site, l.sink_heads, l.sink_first.len(), f(&l.sink_first, 2), f(&l.lift, 1), l.pad_mass_max);
        }
        let _ = writeln!(o, "\n### Massive activations (block output h = x + f(x); Sun et al. 2024: |h| > 100 and ~1000x the median)\n");
        let _ = writeln!(o, "| block | largest h | channel | position | token | median abs (median over batches of each batch's median) | ratio | channels > 100 | share at token 0 |");
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|");
        for m in &self.massive {
            let _ = writeln!(
                o,
                "| block.{} | {:.1} | {} | {} | {:?} | {:.3} | {:.0} | {} | {:.2} |",
                m.block,
                m.top,
                m.channel,
                m.position,
                m.token,
                m.median_abs,
                m.ratio,
                m.channels_above_100.len(),
                m.share_at_first_token
            );
        }
        let _ = writeln!(o, "\n### Activation quantization (against the reference run of the same weights)\n");
        let _ = writeln!(
            o,
            "| configuration | pipeline | reference perplexity | perplexity | change | 95% interval over sequences | logits SQNR (dB) | top-1 agree |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
        for q in &self.quant {
            let (lo, hi) = q.change_ci95;
            let _ = writeln!(
                o,
                "| {} | `{}` | {:.3} | {:.3} | {} | {} | {:.1} | {:.3} |",
                q.name,
                q.pipeline,
                q.reference_perplexity,
                q.perplexity,
                percent(q.perplexity / q.reference_perplexity - 1.0, hi - lo),
                if lo.is_nan() { "-".to_string() } else { format!("{} .. {}", percent(lo, hi - lo), percent(hi, hi - lo)) },
                q.logits_sqnr_db,
                q.top1_agree
            );
        }
        let _ = writeln!(
            o,
            "\nThe interval is a paired bootstrap over the {} sequences (which text was drawn); the change is printed \
             to the digits its width supports. Where it is wide, read the row as a direction, not a figure.",
            self.sequences
        );
        if !self.blocks.is_empty() {
            let _ = writeln!(o, "\n### Block influence vs layer skip\n");
            let _ = writeln!(o, "| block | layer | kind | influence | perplexity skipped | change | logits SQNR (dB) | top-1 agree |");
            let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
            for b in &self.blocks {
                let _ = writeln!(
                    o,
                    "| block.{} | {} | {} | {:.4} | {:.2} | {:+.1}% | {:.1} | {:.3} |",
                    b.block,
                    b.layer,
                    b.kind,
                    b.influence,
                    b.skip_perplexity,
                    100.0 * (b.skip_perplexity / self.perplexity - 1.0),
                    b.skip_logits_sqnr_db,
                    b.skip_top1_agree
                );
            }
            let _ = writeln!(
                o,
                "\nSpearman rank correlation of block influence with the skip's perplexity: {:.3}; with its logits error (-SQNR): {:.3} ({} blocks)",
                self.spearman_perplexity,
                self.spearman_logits,
                self.blocks.len()
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(v: &[(f64, usize)]) -> Vec<Perplexity> {
        v.iter().map(|&(nll, tokens)| Perplexity { nll, tokens }).collect()
    }

    #[test]
    fn the_change_interval_is_a_paired_bootstrap_over_sequences() {
        let want = seqs(&[(10.0, 5), (30.0, 10), (7.0, 3), (20.0, 8)]);
        // The same run twice: no change in any draw.
        assert_eq!(change_interval(&want, &want, 0.95, 500), (0.0, 0.0));
        // Every token's NLL up by 0.1 nats: every draw is e^0.1 - 1, whichever sequences it takes.
        let shifted = seqs(&[(10.5, 5), (31.0, 10), (7.3, 3), (20.8, 8)]);
        let (lo, hi) = change_interval(&want, &shifted, 0.95, 500);
        let c = 0.1f64.exp() - 1.0;
        assert!((lo - c).abs() < 1e-12 && (hi - c).abs() < 1e-12, "{lo} {hi}");
        // One sequence much worse: the interval spans the draws without it (change 0) to draws of
        // it alone, and holds the whole-text change.
        let one_bad = seqs(&[(10.0, 5), (30.0, 10), (7.0 + 3.0, 3), (20.0, 8)]);
        let (lo, hi) = change_interval(&want, &one_bad, 0.95, 2000);
        let whole = (3.0f64 / 26.0).exp() - 1.0;
        assert!(lo <= whole && whole <= hi, "{lo} {whole} {hi}");
        assert!(lo.abs() < 1e-12, "some draws leave the bad sequence out: {lo}");
        assert!(hi > 2.0 * whole, "draws taking it more than once: {hi}");
        assert!(hi <= 1.0f64.exp() - 1.0 + 1e-12, "no draw is worse than the bad sequence alone (1 nat a token): {hi}");
        // Fewer than two sequences: no interval.
        assert!(change_interval(&want[..1], &shifted[..1], 0.95, 100).0.is_nan());
    }

    #[test]
    fn a_change_is_printed_to_the_digits_its_interval_supports() {
        assert_eq!(percent(0.0123, 0.01), "+1.2%");
        assert_eq!(percent(0.0123, 0.1), "+1%");
        assert_eq!(percent(0.136, 0.5), "+10%");
        assert_eq!(percent(-0.27, 0.9), "-30%");
        assert_eq!(percent(0.0123, f64::NAN), "+1.23%");
    }
}
