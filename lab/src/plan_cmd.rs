//! The CLI side of `opscope plan` and `opscope measure --plan` (the work is in
//! [`opscope_lab::plan`]).

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use opscope_lab::model::Job;
use opscope_lab::output::Output;
use opscope_lab::plan::{self, OptionSpec};
use opscope::Pipeline;

use super::{ab_inputs, emit, write_json, Corpus};

#[derive(clap::Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// An option other than fp32 (the implicit baseline): `NAME=PIPELINE` with `{site}` where the
    /// site's name goes, e.g. `int8=fakequant{sites=[{site}],scope=token,weights=true}`. Repeat.
    #[arg(long = "option", value_name = "NAME=PIPELINE", required = true)]
    options: Vec<String>,
    /// Bytes per weight element of an option the tool cannot size (`NAME=X`, e.g. `lr=0.3`).
    #[arg(long, value_name = "NAME=X")]
    bytes_per_elem: Vec<String>,
    /// Only the weight sites whose name matches one of these globs (full or short name).
    #[arg(long, value_name = "GLOB")]
    sites: Vec<String>,
    /// Budget: weight bytes over the planned sites.
    #[arg(long, conflicts_with = "budget_ratio", required_unless_present = "budget_ratio")]
    budget_bytes: Option<u64>,
    /// Budget as a fraction of the planned sites' fp32 weight bytes (0 < r <= 1).
    #[arg(long)]
    budget_ratio: Option<f64>,
    /// The plan (table, choice, pipeline) as JSON.
    #[arg(long)]
    out: PathBuf,
    /// Overwrite `--out` even when it is an input or an existing file that is not JSON.
    #[arg(long)]
    force: bool,
}

pub(crate) fn plan(a: PlanArgs) -> Result<()> {
    let c = &a.corpus;
    opscope_lab::output::check(&a.out, &c.inputs(), Output::Json, a.force)?;
    let mut options = a.options.iter().map(|o| OptionSpec::parse(o)).collect::<Result<Vec<_>>>()?;
    for b in &a.bytes_per_elem {
        let (name, x) = b.split_once('=').with_context(|| format!("--bytes-per-elem '{b}': write NAME=X"))?;
        let x: f64 = x.trim().parse().with_context(|| format!("--bytes-per-elem '{b}': X is not a number"))?;
        let o = options.iter_mut().find(|o| o.name == name.trim()).with_context(|| format!("--bytes-per-elem '{b}': no --option is named '{name}'"))?;
        o.bytes_per_elem = Some(x);
    }
    for (i, o) in options.iter().enumerate() {
        ensure!(!options[..i].iter().any(|p| p.name == o.name), "--option {} is given twice", o.name);
    }
    if let Some(r) = a.budget_ratio {
        ensure!(r > 0.0 && r <= 1.0, "--budget-ratio {r}: give a fraction in (0, 1]");
    }
    let job = Job::new(c.onnx()?, c.text_files()?.0, c.entries()?, c.batch as usize, c.seq as usize)?;
    let sites = plan::weight_sites(job.graph(), &a.sites)?;
    // Size every option before the long measurement, so a bad option fails at once.
    for o in &options {
        plan::option_bytes(o, &sites[0])?;
    }
    let bar = ProgressBar::new((1 + sites.len() * options.len()) as u64);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} runs, {elapsed} elapsed, ~{eta} left: {msg}")?);
    let mut table = plan::measure_table(&job, &sites, &options, |done, _, what| {
        bar.set_position(done as u64);
        bar.set_message(what.to_string());
    })?;
    bar.finish_and_clear();
    let budget = match (a.budget_bytes, a.budget_ratio) {
        (Some(b), _) => b,
        (None, Some(r)) => (r * table.fp32_bytes as f64).floor() as u64,
        (None, None) => unreachable!("clap requires one budget"),
    };
    table.choose(budget)?;
    write_json(Some(&a.out), &table, "the plan")?;
    emit(&format!("{}pipeline: {}\nwritten: {}\n", table.markdown(), if table.pipeline.is_empty() { "(none: every site fp32)" } else { &table.pipeline }, a.out.display()))
}

/// `opscope measure --plan`.
pub(crate) fn measure_plan(c: &Corpus, path: &Path, time_budget_ms: u64, json: Option<&Path>) -> Result<()> {
    let p = plan::Plan::load(path)?;
    let job = Job::new(c.onnx()?, c.text_files()?.0, c.entries()?, c.batch as usize, c.seq as usize)?;
    let bar = ProgressBar::new_spinner();
    bar.set_message("fp32 and the plan");
    let applied = plan::apply(&job, &p);
    bar.finish_and_clear();
    let applied = applied?;
    let mut out = applied.markdown();
    let timing = if time_budget_ms > 0 && !p.pipeline.trim().is_empty() {
        let r = time_plan(c, &p.pipeline, time_budget_ms)?;
        out.push_str(&format!("time, plan / fp32 (interleaved ABBA pairs, `opscope ab`): {}\n", r.line()));
        out.push_str("(the time of the program as rewritten: fake-quant adds f32 quantize/dequantize ops, it is not the time of an int8/int4 kernel)\n");
        Some(r)
    } else {
        None
    };
    write_json(json, &serde_json::json!({ "plan": path, "applied": applied, "timing": timing }), "the measurement")?;
    emit(&out)
}

/// Time the plan's pipeline against the untapped fp32 model as `opscope ab` does.
fn time_plan(c: &Corpus, pipeline: &str, budget_ms: u64) -> Result<opscope_lab::timing::AbReport> {
    let p = Pipeline::parse(pipeline)?;
    let opts = opscope_lab::timing::AbOptions {
        warmup: std::time::Duration::from_millis(500),
        budget: std::time::Duration::from_millis(budget_ms),
        min_pairs: 10,
        max_pairs: 1_000_000,
        resamples: 10_000,
        confidence: 0.95,
        seed: 0,
    };
    let (model, batches) = ab_inputs(c)?;
    let bar = ProgressBar::new_spinner();
    bar.set_message("timing the plan against fp32");
    let r = opscope_lab::timing::ab_pipelines(&model, &batches, Some(&p), None, opscope::activate::Stage::Deployed, &opts);
    bar.finish_and_clear();
    r
}
