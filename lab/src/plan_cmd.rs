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
    #[arg(long, conflicts_with = "budget_ratio", required_unless_present_any = ["budget_ratio", "time_budget_us"])]
    budget_bytes: Option<u64>,
    /// Budget as a fraction of the planned sites' fp32 weight bytes (0 < r <= 1).
    #[arg(long)]
    budget_ratio: Option<f64>,
    /// Time budget: extra microseconds per batch over the untapped model, summed over the planned
    /// sites. Each option's time at each site is measured alone, interleaved against untapped in
    /// one sitting (median of paired differences, negatives clamped to 0 and listed). Alone, or
    /// with a byte budget (both constraints solved at once, exactly). On this CPU fake-quant options
    /// only ADD time (RLX 0.2.19 has no int8 GEMM: the matmul still runs in f32, plus the
    /// quantize/dequantize ops), so a time budget bounds the overhead of the rewrite; it does
    /// not buy a speedup, and alone it picks fp32 everywhere (0 us, 0 error).
    #[arg(long, value_name = "US")]
    time_budget_us: Option<u64>,
    /// With --time-budget-us: time budget of the interleaved timing, ms.
    #[arg(long, default_value_t = 10_000, requires = "time_budget_us", value_parser = clap::value_parser!(u64).range(1..))]
    time_ms: u64,
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
        (Some(b), _) => Some(b),
        (None, Some(r)) => Some((r * table.fp32_bytes as f64).floor() as u64),
        (None, None) => None,
    };
    let mut notes = String::new();
    if let Some(us) = a.time_budget_us {
        let opts = opscope_lab::timing::AbOptions {
            warmup: std::time::Duration::from_millis(500),
            budget: std::time::Duration::from_millis(a.time_ms),
            min_pairs: 10,
            max_pairs: 1_000_000,
            resamples: 1000,
            confidence: 0.95,
            seed: 0,
        };
        let (model, batches) = ab_inputs(c)?;
        let bar = ProgressBar::new_spinner();
        bar.enable_steady_tick(std::time::Duration::from_millis(500));
        bar.set_message(format!("timing {} (site, option) programs against untapped", sites.len() * options.len()));
        let negative = table.measure_times(&model, &batches, &opts);
        bar.finish_and_clear();
        for (site, option, raw) in negative? {
            notes.push_str(&format!("note: {option} at {site} measured {raw:.0} us (faster than untapped, within noise); clamped to 0\n"));
        }
        match budget {
            Some(b) => table.choose_both(b, us)?,
            None => table.choose_time(us)?,
        }
        notes.push_str("time: extra us per batch, each option alone at its site; on this CPU fake-quant only adds time (no int8 GEMM in RLX 0.2.19), so the time budget bounds the overhead\n");
    } else {
        table.choose(budget.expect("clap requires a budget"))?;
    }
    write_json(Some(&a.out), &table, "the plan")?;
    emit(&format!("{}{notes}pipeline: {}\nwritten: {}\n", table.markdown(), if table.pipeline.is_empty() { "(none: every site fp32)" } else { &table.pipeline }, a.out.display()))
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
