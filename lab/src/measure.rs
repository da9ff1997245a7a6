//! `opscope measure`: the decisions the inference taps and actuations exist for, measured on a
//! BERT-style ONNX encoder (MiniLM-L3) over real text.
//!
//! 1. **Attention**: per layer and head, concentration (peak probability, normalized entropy,
//!    top-k mass) and sink keys (`[CLS]` = first key, `[SEP]` = last non-padding key), padding
//!    excluded, from the `attn` tap.
//! 2. **W8A8**: sentence embeddings under `fakequant` (per-token vs per-channel activation
//!    scales, per-output-channel int8 weights) against fp32: cosine similarity and SQNR.
//! 3. **Block influence vs layer skip**: `1 - cos(x, x + f(x))` per residual block from the
//!    `residual` tap (padding rows excluded), against the actual change of the sentence
//!    embedding when `skip` bypasses that block; Spearman rank correlation reported.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use opscope::activate::Stage;
use crate::model::{decode, Job};
use opscope::{MemorySink, Pipeline, Row};

/// The taps of the fp32 reference run.
pub const BASELINE: &str =
    "attn{stats=[queries,peak,entropy_norm,topk_mass,sink_first,sink_last,pad_mass,recv_max]},residual{stats=[ratio,cos_row]}";

/// The W8A8 configurations compared (scales per `fakequant`'s docs).
pub const W8A8: [(&str, &str); 3] = [
    ("per-tensor activations, per-channel weights", "fakequant{scope=tensor,weights=true}"),
    ("per-token activations, per-channel weights", "fakequant{scope=token,weights=true}"),
    ("per-channel activations, per-channel weights", "fakequant{scope=channel,weights=true}"),
];

/// One attention layer's statistics, averaged over the corpus (weighted by non-padding queries).
#[derive(Debug, Clone, Serialize)]
pub struct AttnLayer {
    /// Site name.
    pub site: String,
    /// Per head: mean peak probability.
    pub peak: Vec<f64>,
    /// Per head: mean entropy / ln(allowed keys), in [0, 1].
    pub entropy_norm: Vec<f64>,
    /// Per head: mean probability mass on the top-8 keys.
    pub topk_mass: Vec<f64>,
    /// Per head: mean probability on the first key (`[CLS]`).
    pub sink_first: Vec<f64>,
    /// Per head: mean probability on the last non-padding key (`[SEP]`).
    pub sink_last: Vec<f64>,
    /// Per head: mean probability on padding keys (0 when the mask works).
    pub pad_mass: Vec<f64>,
    /// Per head: mean over sentences of the largest received mass of one key.
    pub recv_max: Vec<f64>,
}

/// One W8A8 configuration against fp32.
#[derive(Debug, Clone, Serialize)]
pub struct Quant {
    /// What it is.
    pub name: String,
    /// The pipeline run.
    pub pipeline: String,
    /// Mean over sentences of cos(embedding, fp32 embedding).
    pub cos_mean: f64,
    /// Worst sentence.
    pub cos_min: f64,
    /// 10 log10(sum e^2 / sum (e - e_q)^2) over every embedding value, in dB.
    pub sqnr_db: f64,
}

/// One residual block.
#[derive(Debug, Clone, Serialize)]
pub struct Block {
    /// Block index (`block.K`, as `residual` and `skip` name it).
    pub block: usize,
    /// Block influence: 1 - mean over non-padding tokens of cos(x, x + f(x)) (ShortGPT).
    pub influence: f64,
    /// Mean over runs of ||f(x)|| / ||x|| over non-padding rows.
    pub ratio: f64,
    /// 1 - mean over sentences of cos(embedding with the block skipped, fp32 embedding).
    pub skip_change: f64,
    /// Worst sentence's cos(embedding with the block skipped, fp32 embedding).
    pub skip_cos_min: f64,
}

/// Everything `opscope measure` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// Sentences embedded.
    pub sentences: usize,
    /// Non-padding tokens.
    pub tokens: usize,
    /// Padding share of all positions.
    pub padding: f64,
    /// Attention per layer.
    pub attention: Vec<AttnLayer>,
    /// W8A8 configurations.
    pub w8a8: Vec<Quant>,
    /// Other actuation pipelines asked for (`opscope measure --also`), measured as the W8A8 rows.
    pub also: Vec<Quant>,
    /// Residual blocks in execution order.
    pub blocks: Vec<Block>,
    /// Spearman rank correlation between `influence` and `skip_change` over the blocks.
    pub spearman: f64,
}

/// Parse the `--also` pipelines, each of which must hold an actuation (checked before any run).
///
/// Errors: a pipeline does not parse, or holds no actuation (it would measure the unchanged
/// model).
pub fn parse_also(also: &[String]) -> Result<Vec<Pipeline>> {
    also.iter()
        .map(|text| {
            let p = Pipeline::parse(text).with_context(|| format!("--also {text}"))?;
            if !p.passes.iter().any(|i| i.pass.kind() == opscope::PassKind::Actuation) {
                bail!("--also '{text}' holds no actuation (fakequant, staticquant, smoothquant, lowrank, sparseattn, skip): it would measure the unchanged model");
            }
            Ok(p)
        })
        .collect()
}

/// An `--also` pipeline must change the model: an actuation that changed no site (no site
/// matched, or every site was skipped with a reason) would be measured as a row equal to the
/// reference.
///
/// Errors: one of its actuations changed nothing in the graphs `manifests` describe (the
/// message gives the reasons the sites were skipped).
pub fn ensure_actuated(pipeline: &Pipeline, manifests: &[opscope::Manifest]) -> Result<()> {
    let arcs: Vec<std::sync::Arc<opscope::Manifest>> = manifests.iter().cloned().map(std::sync::Arc::new).collect();
    if let Some(idle) = pipeline.idle_actuations(&arcs).first() {
        bail!("--also: {}", pipeline.idle_actuation_warning(idle, manifests.len()));
    }
    Ok(())
}

/// Run the corpus under `pipeline` (observing the deployed program): sentence embeddings
/// (`[sentences][hidden]`, the model's last output), the recorded rows and the manifests of the
/// compiles.
pub fn embed(job: &Job, pipeline: &Pipeline) -> Result<(Vec<Vec<f32>>, Vec<Row>, Vec<opscope::Manifest>)> {
    let sink = MemorySink::default();
    let mut emb = Vec::new();
    job.run(pipeline, Stage::Deployed, Box::new(sink.clone()), |sentences, outs| {
        let (bytes, dtype) = outs.last().context("the model has no outputs")?;
        let v = decode(bytes, *dtype)?;
        let hidden = v.len() / sentences;
        emb.extend(v.chunks(hidden).map(|r| r.iter().map(|&x| x as f32).collect::<Vec<f32>>()));
        Ok(())
    })?;
    Ok((emb, sink.rows(), sink.manifests()))
}

fn cos(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// (mean cos, min cos, SQNR dB) of `got` against `want`.
pub fn compare(want: &[Vec<f32>], got: &[Vec<f32>]) -> (f64, f64, f64) {
    let c: Vec<f64> = want.iter().zip(got).map(|(a, b)| cos(a, b)).collect();
    let (mut s, mut n) = (0f64, 0f64);
    for (a, b) in want.iter().zip(got) {
        for (&x, &y) in a.iter().zip(b) {
            s += (x as f64).powi(2);
            n += (x as f64 - y as f64).powi(2);
        }
    }
    let mean = c.iter().sum::<f64>() / c.len() as f64;
    let min = c.iter().copied().fold(f64::INFINITY, f64::min);
    (mean, min, 10.0 * (s / n).log10())
}

/// The `attn` tap's per-head statistics (role `probs`) per site, each averaged over the runs
/// weighted by the run's non-padding queries (as the attention rules weigh them): site -> stat ->
/// per-index mean (NaN where no run recorded the index). Non-finite values are not recorded.
/// A statistic whose per-run mean is over fewer queries (`topk_mass`: those with more than K
/// keys; `sink_first`, `sink_last`: not the key's own query) is weighted by the same count, an
/// approximation of the pooled mean over its queries (the tap records one count per run).
pub fn attention_means(rows: &[Row]) -> BTreeMap<String, BTreeMap<String, Vec<f64>>> {
    let mut queries: BTreeMap<(&str, u32, u64), f64> = BTreeMap::new();
    for r in rows.iter().filter(|r| &*r.role == "probs" && &*r.stat == "queries") {
        queries.insert((&r.site, r.compile, r.step), r.value as f64);
    }
    let mut acc: BTreeMap<&str, BTreeMap<&str, (Vec<f64>, Vec<f64>)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| &*r.role == "probs" && &*r.stat != "queries" && r.value.is_finite()) {
        let w = queries.get(&(&*r.site, r.compile, r.step)).copied().unwrap_or(0.0);
        let e = acc.entry(&r.site).or_default().entry(&r.stat).or_default();
        let i = r.idx as usize;
        if e.0.len() <= i {
            e.0.resize(i + 1, 0.0);
            e.1.resize(i + 1, 0.0);
        }
        e.0[i] += w * r.value as f64;
        e.1[i] += w;
    }
    acc.into_iter()
        .map(|(site, stats)| {
            let means = stats
                .into_iter()
                .map(|(stat, (v, w))| (stat.to_string(), v.iter().zip(&w).map(|(v, w)| if *w > 0.0 { v / w } else { f64::NAN }).collect()))
                .collect();
            (site.to_string(), means)
        })
        .collect()
}

/// Spearman's rank correlation (average ranks for ties).
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    fn ranks(v: &[f64]) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&i, &j| v[i].total_cmp(&v[j]));
        let mut r = vec![0.0; v.len()];
        let mut i = 0;
        while i < idx.len() {
            let mut j = i;
            while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
                j += 1;
            }
            for &k in &idx[i..=j] {
                r[k] = (i + j) as f64 / 2.0 + 1.0;
            }
            i = j + 1;
        }
        r
    }
    let (ra, rb) = (ranks(a), ranks(b));
    let n = a.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    cov / (va.sqrt() * vb.sqrt())
}

/// Run every measurement. `progress` is told each stage's name.
pub fn measure(job: &Job, progress: impl FnMut(&str)) -> Result<Measurement> {
    measure_with(job, &[], progress)
}

/// [`measure`], plus each pipeline of `also` (an actuation such as
/// `smoothquant,fakequant{scope=tensor,weights=true}`) against fp32, as the W8A8 rows are.
///
/// Errors: those of [`measure`]; a pipeline of `also` that does not parse (named).
pub fn measure_with(job: &Job, also: &[String], mut progress: impl FnMut(&str)) -> Result<Measurement> {
    let also_parsed = parse_also(also)?;
    progress("fp32 with attn + residual taps");
    let (fp32, rows, _) = embed(job, &Pipeline::parse(BASELINE)?)?;
    // Runs in execution order: (compile, step) of each batch as first seen.
    let mut run_of: BTreeMap<(u32, u64), usize> = BTreeMap::new();
    let mut order: Vec<(u32, u64)> = Vec::new();
    for r in &rows {
        if !run_of.contains_key(&(r.compile, r.step)) {
            run_of.insert((r.compile, r.step), order.len());
            order.push((r.compile, r.step));
        }
    }
    if order.len() != job.encoded().len() {
        bail!("recorded {} runs for {} batches", order.len(), job.encoded().len());
    }

    let attention: Vec<AttnLayer> = attention_means(&rows)
        .into_iter()
        .map(|(site, stats)| {
            let get = |s: &str| stats.get(s).cloned().unwrap_or_default();
            AttnLayer {
                site,
                peak: get("peak"),
                entropy_norm: get("entropy_norm"),
                topk_mass: get("topk_mass"),
                sink_first: get("sink_first"),
                sink_last: get("sink_last"),
                pad_mass: get("pad_mass"),
                recv_max: get("recv_max"),
            }
        })
        .collect();

    // Block influence over non-padding tokens.
    let mut infl: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    let mut ratio: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for r in rows.iter().filter(|r| &*r.role == "block") {
        let Some(k) = r.site.strip_prefix("block.").and_then(|k| k.parse::<usize>().ok()) else { continue };
        match &*r.stat {
            "cos_row" => {
                let mask = &job.encoded()[run_of[&(r.compile, r.step)]].mask;
                if mask.get(r.idx as usize) == Some(&1) {
                    let e = infl.entry(k).or_default();
                    e.0 += 1.0 - r.value as f64;
                    e.1 += 1.0;
                }
            }
            "ratio" => {
                let e = ratio.entry(k).or_default();
                e.0 += r.value as f64;
                e.1 += 1.0;
            }
            _ => {}
        }
    }

    let mut w8a8 = Vec::new();
    for (name, p) in W8A8 {
        progress(p);
        let (q, _, _) = embed(job, &Pipeline::parse(p)?)?;
        let (cos_mean, cos_min, sqnr_db) = compare(&fp32, &q);
        w8a8.push(Quant { name: name.into(), pipeline: p.into(), cos_mean, cos_min, sqnr_db });
    }
    let mut also_rows = Vec::new();
    for (text, p) in also.iter().zip(&also_parsed) {
        progress(text);
        let (q, _, manifests) = embed(job, p)?;
        ensure_actuated(p, &manifests)?;
        let (cos_mean, cos_min, sqnr_db) = compare(&fp32, &q);
        also_rows.push(Quant { name: "--also".into(), pipeline: text.clone(), cos_mean, cos_min, sqnr_db });
    }

    let mut blocks = Vec::new();
    for (&k, &(s, n)) in &infl {
        let p = format!("skip{{blocks=[{k}]}}");
        progress(&p);
        let (e, _, manifests) = embed(job, &Pipeline::parse(&p)?)?;
        // A block skip refused (a fused residual norm with a bias) must not enter the ranking
        // as "skipping costs nothing".
        let site = format!("block.{k}");
        for m in &manifests {
            if !m.actuations.iter().any(|a| a.site == site) {
                let why = m.skipped.iter().find(|s| s.site == site).map(|s| s.reason.clone()).unwrap_or_default();
                bail!("{p} did not bypass {site} in graph '{}': {why}", m.graph);
            }
        }
        let (cos_mean, cos_min, _) = compare(&fp32, &e);
        let (rs, rn) = ratio.get(&k).copied().unwrap_or((f64::NAN, 1.0));
        blocks.push(Block { block: k, influence: s / n, ratio: rs / rn, skip_change: 1.0 - cos_mean, skip_cos_min: cos_min });
    }
    let spearman = spearman(
        &blocks.iter().map(|b| b.influence).collect::<Vec<_>>(),
        &blocks.iter().map(|b| b.skip_change).collect::<Vec<_>>(),
    );
    let tokens: usize = job.encoded().iter().map(|e| e.mask.iter().filter(|m| **m == 1).count()).sum();
    let positions: usize = job.encoded().iter().map(|e| e.mask.len()).sum();
    Ok(Measurement {
        sentences: fp32.len(),
        tokens,
        padding: 1.0 - tokens as f64 / positions as f64,
        attention,
        w8a8,
        also: also_rows,
        blocks,
        spearman,
    })
}

impl Measurement {
    /// The report as Markdown tables.
    pub fn markdown(&self) -> String {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let argmax = |v: &[f64]| v.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
        let mut s = format!(
            "{} sentences, {} tokens ({:.0}% of positions are padding, excluded below)\n\n",
            self.sentences,
            self.tokens,
            100.0 * self.padding
        );
        s.push_str("### Attention (mean over heads; max head in brackets)\n\n");
        s.push_str("| layer | peak | entropy/ln(n) | top-8 mass | [CLS] mass | [SEP] mass | padding mass | heaviest key |\n|---|---|---|---|---|---|---|---|\n");
        for a in &self.attention {
            let (hf, f) = argmax(&a.sink_first);
            let (hl, l) = argmax(&a.sink_last);
            let (hp, p) = argmax(&a.peak);
            s.push_str(&format!(
                "| {} | {:.3} (h{hp} {p:.3}) | {:.3} | {:.3} | {:.3} (h{hf} {f:.3}) | {:.3} (h{hl} {l:.3}) | {:.1e} | {:.3} |\n",
                short_site(&a.site),
                mean(&a.peak),
                mean(&a.entropy_norm),
                mean(&a.topk_mass),
                mean(&a.sink_first),
                mean(&a.sink_last),
                mean(&a.pad_mass),
                mean(&a.recv_max),
            ));
        }
        s.push_str("\n### W8A8 fake-quant vs fp32 sentence embeddings\n\n| configuration | pipeline | mean cos | worst cos | SQNR |\n|---|---|---|---|---|\n");
        for q in self.w8a8.iter().chain(&self.also) {
            s.push_str(&format!("| {} | `{}` | {:.5} | {:.4} | {:.1} dB |\n", q.name, q.pipeline, q.cos_mean, q.cos_min, q.sqnr_db));
        }
        s.push_str("\n### Block influence (residual tap) vs skipping the block (skip actuation)\n\n| block | influence 1-cos(x, x+f(x)) | norm ratio | embedding change 1-cos when skipped | worst cos |\n|---|---|---|---|---|\n");
        for b in &self.blocks {
            s.push_str(&format!("| block.{} | {:.4} | {:.3} | {:.4} | {:.3} |\n", b.block, b.influence, b.ratio, b.skip_change, b.skip_cos_min));
        }
        s.push_str(&format!("\nSpearman rank correlation (influence vs embedding change), {} blocks: {:.3}\n", self.blocks.len(), self.spearman));
        s
    }
}

/// `layer.0/attention/self/Softmax` from a full ONNX node path.
fn short_site(site: &str) -> &str {
    site.find("layer.").map(|i| &site[i..]).unwrap_or(site)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_matches_hand_computed_values() {
        assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // scipy.stats.spearmanr([1,2,3,4],[1,3,2,4]) = 0.8
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[1.0, 3.0, 2.0, 4.0]) - 0.8).abs() < 1e-12);
        // ties: spearmanr([1,1,2,3],[1,2,3,4]) = 0.9486832980505138
        assert!((spearman(&[1.0, 1.0, 2.0, 3.0], &[1.0, 2.0, 3.0, 4.0]) - 0.9486832980505138).abs() < 1e-12);
    }
}
