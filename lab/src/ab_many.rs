//! `opscope ab --pipeline NAME=PIPELINE ...`: several pipelines timed against the untapped model
//! in ONE sitting (one process, interleaved rounds; [`opscope_lab::timing::many_pipelines`]),
//! with an A/A row (a second untapped compile) as the noise floor of that same sitting, and
//! optionally each pipeline's accuracy (embedding cosine and SQNR against fp32, as `opscope
//! measure --also` computes them), so the table reads as accuracy against time.

use anyhow::{ensure, Context, Result};
use indicatif::ProgressBar;
use serde::Serialize;

use opscope::Pipeline;
use opscope_lab::model::Job;
use opscope_lab::timing::{AbOptions, AbReport};

use super::{ab_inputs, emit, write_json, AbArgs};

/// The name of the A/A row.
const AA: &str = "A/A";

/// One row of the table: a program against the untapped baseline.
#[derive(Debug, Clone, Serialize)]
struct Row {
    /// Its name (`A/A` for the second untapped compile).
    name: String,
    /// Its pipeline text (empty: untapped).
    pipeline: String,
    /// Ratio of medians program / untapped, its interval and counts.
    report: AbReport,
    /// Median over rounds of the paired difference program - untapped, ms.
    extra_ms: f64,
    /// Mean cos(embedding, fp32 embedding) over sentences (with `--accuracy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    cos_mean: Option<f64>,
    /// Worst sentence's cosine (with `--accuracy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    cos_min: Option<f64>,
    /// Embedding SQNR against fp32, dB (with `--accuracy`; infinite, written `null`, when identical).
    #[serde(skip_serializing_if = "Option::is_none")]
    sqnr_db: Option<f64>,
}

/// Split `NAME=PIPELINE` (the pipeline may be empty: untapped).
///
/// Errors: no `=`, or a name that is not letters, digits, '_', '-', '.', '/' or '+'.
fn split(text: &str) -> Result<(String, String)> {
    let bad = || anyhow::anyhow!("--pipeline '{text}': write NAME=PIPELINE, e.g. int8=fakequant{{scope=token,weights=true}} ('' after '=' is the untapped model)");
    let (name, pipeline) = text.split_once('=').ok_or_else(bad)?;
    let name = name.trim();
    ensure!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-./+".contains(c)),
        "--pipeline '{text}': the name '{name}' must be letters, digits or _-./+ (write NAME=PIPELINE)"
    );
    ensure!(name != AA, "--pipeline '{text}': '{AA}' is the name of the built-in untapped-vs-untapped row; pick another");
    Ok((name.to_string(), pipeline.trim().to_string()))
}

/// `opscope ab --pipeline ...`.
pub(crate) fn ab_many(a: &AbArgs, opts: &AbOptions) -> Result<()> {
    let c = &a.corpus;
    let mut named = Vec::new();
    for text in &a.pipelines {
        let (name, pipeline) = split(text)?;
        ensure!(!named.iter().any(|(n, _, _): &(String, String, Option<Pipeline>)| *n == name), "--pipeline {name} is given twice");
        let parsed = if pipeline.is_empty() { None } else { Some(Pipeline::parse(&pipeline).with_context(|| format!("--pipeline {name}"))?) };
        named.push((name, pipeline, parsed));
    }
    let (model, batches) = ab_inputs(c)?;
    // Program 0: the untapped baseline; 1: the A/A twin; then the pipelines in order.
    let mut programs: Vec<Option<&Pipeline>> = vec![None, None];
    programs.extend(named.iter().map(|(_, _, p)| p.as_ref()));
    let bar = ProgressBar::new_spinner();
    bar.enable_steady_tick(std::time::Duration::from_millis(500));
    bar.set_message(format!("timing {} programs interleaved against untapped", programs.len() - 1));
    let times = opscope_lab::timing::many_pipelines(&model, &batches, &programs, a.stage, opts).map_err(|e| {
        // Name the pipeline behind a program index.
        let msg = format!("{e:#}");
        let who = (2..programs.len()).find(|&k| msg.starts_with(&format!("program {k}")));
        match who {
            Some(k) => e.context(format!("--pipeline {}={}", named[k - 2].0, named[k - 2].1)),
            None => e,
        }
    });
    bar.finish_and_clear();
    let times = times?;
    let mut rows = Vec::new();
    for k in 1..programs.len() {
        let (name, pipeline) = if k == 1 { (AA.to_string(), String::new()) } else { (named[k - 2].0.clone(), named[k - 2].1.clone()) };
        rows.push(Row {
            name,
            pipeline,
            report: times.against_baseline(k, opts)?,
            extra_ms: times.median_extra_us(k)? / 1e3,
            cos_mean: None,
            cos_min: None,
            sqnr_db: None,
        });
    }
    if a.accuracy {
        let job = Job::new(c.onnx()?, c.text_files()?.0, c.entries()?, c.batch as usize, c.seq as usize)?;
        let (fp32, _, _) = opscope_lab::measure::embed(&job, &Pipeline::default())?;
        for (k, row) in rows.iter_mut().enumerate() {
            let got = match programs[k + 1] {
                None => fp32.clone(),
                Some(p) => opscope_lab::measure::embed(&job, p).with_context(|| format!("--pipeline {}", row.name))?.0,
            };
            let (mean, min, sqnr) = opscope_lab::measure::compare(&fp32, &got);
            (row.cos_mean, row.cos_min, row.sqnr_db) = (Some(mean), Some(min), Some(sqnr));
        }
    }
    let doc = serde_json::json!({
        "onnx": c.onnx, "batch": model.batch, "seq": c.seq, "batches": batches.len(),
        "rounds": times.times[0].len(), "warmup_rounds": times.warmup_rounds,
        "method": "one sitting: every round runs the untapped baseline, its A/A twin and each pipeline once (index order on even rounds, reversed on odd), round r on batch r mod batches; each row is analysed against the baseline as `opscope ab` (ratio of medians, severe-outlier pairs dropped, paired percentile bootstrap)",
        "rows": rows,
    });
    write_json(a.json.as_deref(), &doc, "the comparison")?;
    emit(&markdown(&rows, model.batch, c.seq as usize, batches.len(), times.times[0].len(), opts.confidence))
}

fn markdown(rows: &[Row], batch: usize, seq: usize, batches: usize, rounds: usize, confidence: f64) -> String {
    let acc = rows.iter().any(|r| r.sqnr_db.is_some());
    let mut s = format!(
        "{} programs against untapped in one sitting: {rounds} interleaved rounds, {batch} x {seq} tokens, {batches} batches cycled; {:.0}% percentile bootstrap\n\n",
        rows.len(),
        confidence * 100.0
    );
    s.push_str("| name | pipeline | time / untapped | interval | extra ms (median paired) | median ms | pairs kept |");
    s.push_str(if acc { " mean cos | worst cos | SQNR dB |\n|---|---|---|---|---|---|---|---|---|---|\n" } else { "\n|---|---|---|---|---|---|---|\n" });
    for r in rows {
        let p = &r.report;
        s.push_str(&format!(
            "| {} | `{}` | {:.3}x | [{:.3}, {:.3}] | {:+.2} | {:.2} | {} of {} |",
            r.name,
            if r.pipeline.is_empty() { "''" } else { &r.pipeline },
            p.ratio,
            p.ci_low,
            p.ci_high,
            r.extra_ms,
            p.median_a * 1e3,
            p.kept,
            p.pairs
        ));
        if acc {
            let f = |x: Option<f64>, d: usize| x.map_or("-".into(), |v| if v.is_infinite() { "inf".into() } else { format!("{v:.d$}") });
            s.push_str(&format!(" {} | {} | {} |", f(r.cos_mean, 5), f(r.cos_min, 4), f(r.sqnr_db, 1)));
        }
        s.push('\n');
    }
    let floor = rows.iter().find(|r| r.name == AA).map(|r| r.report.ratio);
    if let Some(f) = floor {
        s.push_str(&format!("\nA/A (untapped against a second untapped compile) is the noise floor of this sitting: {f:.3}x\n"));
    }
    s
}
