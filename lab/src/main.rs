//! `opscope`: list passes; record a real ONNX encoder over real text.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::Ordering;

use opscope_lab::model::{split_entries, Job, INTERRUPTED};
use opscope_lab::output::Output;
use opscope_lab::summary::SummarySink;
use opscope::Pipeline;

mod plan_cmd;
mod ab_many;
use plan_cmd::{measure_plan, plan, PlanArgs};

/// `println!` through [`emit`]: a closed pipe ends the output quietly; other write errors are
/// returned.
macro_rules! say {
    ($($arg:tt)*) => {
        emit(&format!("{}\n", format_args!($($arg)*)))?
    };
}

#[derive(Parser)]
#[command(name = "opscope", version, about = "Record what flows through an RLX model's op sites")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List every registered pass with its kind, options, defaults and doc.
    Passes,
    /// Run a model over text with a tap pipeline and write a recording: an ONNX sentence encoder
    /// (--onnx, --tokenizer), a GGUF decoder (--gguf), or any ONNX model's inputs from a .npz
    /// (--inputs).
    Record(RecordArgs),
    /// Record synthetic tensors with planted structures (ground truth for the miner) through
    /// real tapped RLX matmul graphs; writes the recording and `<out>.truth.json`.
    Sweep(SweepArgs),
    /// Mine a recording (CSV, .csv.gz or Parquet): the verdicts its sketches support, by payoff.
    Mine(MineArgs),
    /// Mine a recording and write a self-contained HTML report summarising every run: site table
    /// in execution order, verdicts, and plots per site.
    Report(ReportArgs),
    /// Compare two recordings site by site (fp32 vs fake-quantized, two sequence lengths,
    /// before vs after a fine-tune): per statistic the median over runs, its relative change and
    /// the Kolmogorov-Smirnov D of the per-run values; the value histograms' Jensen-Shannon
    /// divergence (the ranking score) and Wasserstein distance; per-channel max|x| changes.
    Diff(DiffArgs),
    /// Compare two recordings of the same program on the same inputs value by value (one device
    /// against another, native sketches against lowered ones): one line per site, role and
    /// statistic; exit status 1 when a check fails.
    Compare(CompareArgs),
    /// Measure an ONNX encoder over text: attention concentration and sinks (attn), W8A8
    /// per-token vs per-channel (fakequant) and block influence vs layer skip (residual, skip).
    Measure(MeasureArgs),
    /// Per tensor, the int8 quantization range, scale and zero point from a recording (min-max,
    /// percentile or entropy, as ONNX Runtime computes them), written as ONNX Runtime's
    /// calibration table (`.json`) or a TensorRT calibration cache (`.cache`).
    Calibrate(CalibrateArgs),
    /// List the sites a pipeline finds in an ONNX model, without running it: the names to use in
    /// `sites=[..]` (as `record` prints them; the full ONNX names work too), op, roles, shape.
    Sites(SitesArgs),
    /// Check an ONNX encoder as RLX compiles it against the same graph run op by op, on one batch
    /// of text: per output the max difference and ULPs; if an output diverges, the node where it
    /// starts (bisection, or each node in execution order). `--pipeline` compares a rewrite or a
    /// tap pipeline against the original program node by node.
    Parity(ParityArgs),
    /// A memo guard (content-hash LRU cache of the model's outputs, verified byte for byte) over a
    /// replay of a pool of batches: the hit rate a recording of the replay predicts against the
    /// guard's measured hits, outputs against unguarded runs, and time (interleaved).
    Memo(MemoArgs),
    /// Cost of the deployed (fused) graph: per op kind and top sites, FLOPs, bytes moved,
    /// arithmetic intensity and roofline class against a ridge point measured in this process
    /// (copy bandwidth and GEMM peak through RLX on the CPU); the GEMM shapes RLX runs.
    Cost(CostArgs),
    /// Time the model under two pipelines, interleaved (ABBA pairs after a warm-up, as many as
    /// the time budget allows): the ratio of median run times A/B with a percentile-bootstrap
    /// confidence interval, outliers dropped by Tukey's outer fences (criterion's severe
    /// outliers). `--a matmul --b ''` is the cost of the matmul taps against the untapped model.
    Ab(AbArgs),
    /// Per-site and per-op-kind time shares of the deployed (fused) graph on one batch of text:
    /// every deployed node timed alone as a one-node program fed its real operands, in rounds
    /// interleaved with the whole program; shares of the sum of the per-node medians with
    /// percentile-bootstrap intervals (over rounds), beside the FLOP shares; and the sum check
    /// (sum of the nodes alone / whole program), with a warning beyond 1.5x. `--json` is what
    /// `opscope mine --time-shares` reads.
    Time(TimeArgs),
    /// Repeated blocks of an ONNX model's program (transformer layers, FFNs, norm motifs): found
    /// by Weisfeiler-Lehman colours, grown as disjoint occurrences, each confirmed isomorphic
    /// (petgraph VF2); ranked by the ops they cover. Without running the model.
    Blocks(BlocksArgs),
    /// Choose one option per matmul weight site (fp32 or a pipeline template such as int8 /
    /// int4 fake-quant) minimising the measured embedding error (noise-to-signal power, 1/SQNR)
    /// under a budget of weight bytes: each option measured end to end at each site alone, then
    /// an exact multiple-choice knapsack. Writes the table and the plan as JSON
    /// (`opscope measure --plan` applies it).
    Plan(PlanArgs),
    /// Host probes on the tensors a `capture` pass wrote (`<recording>.capture/`): per tensor
    /// the exact 2:4 group count along K and the distinct f32 count; per matmul site with both
    /// operands captured, the measured SQNR of the GEMM output under int8/int4 per-tensor,
    /// per-channel and per-token quantization, and under 2:4 pruning of the weight. With
    /// `--recording`, the miner's `two_four_probe` verdicts confirmed or refuted, and its int8
    /// SQNR estimates (noise model) against the SQNR measured on the captured tensors.
    Probe(ProbeArgs),
}

#[derive(clap::Args)]
struct ProbeArgs {
    /// The capture directory (holds manifest.json).
    #[arg(long)]
    capture: PathBuf,
    /// A recording to mine (the same run as the capture): its 2:4 probe verdicts are upgraded
    /// with the measured counts, and its int8 SQNR estimates are compared with the measured.
    #[arg(long)]
    recording: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct BlocksArgs {
    #[command(flatten)]
    model: ModelGraph,
    /// Weisfeiler-Lehman rounds (the radius anchors must look alike over).
    #[arg(long, default_value_t = 3)]
    wl_rounds: usize,
    /// Fewest ops per occurrence.
    #[arg(long, default_value_t = 2)]
    min_ops: usize,
    /// Rows of the table (0: all); JSON always holds every block.
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}



#[derive(clap::Args)]
struct CostArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Overwrite `--json` even when it is an input or an existing file that is not JSON.
    #[arg(long)]
    force: bool,
    /// Sites listed (by their roofline time bound).
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// MiB of the copy probe's tensor (input and output each; make the pair exceed the
    /// last-level cache to measure DRAM bandwidth).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=8192))]
    probe_mib: u32,
    /// Square size n of the GEMM probe ([n,n] x [n,n]).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(16..=8192))]
    probe_gemm: u32,
}

#[derive(clap::Args)]
struct TimeArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// Seconds the measured rounds take together (sets the round count; at least 10 rounds).
    #[arg(long, default_value_t = 10.0)]
    budget_secs: f64,
    /// Seconds of warm-up rounds (dropped).
    #[arg(long, default_value_t = 1.0)]
    warmup_secs: f64,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    resamples: u64,
    /// Seed of the bootstrap generator.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sites listed (by time share; 0: all). JSON always holds every site.
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Also write the shares as JSON here (read by `opscope mine --time-shares`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Overwrite `--json` even when it is an input or an existing file that is not JSON.
    #[arg(long)]
    force: bool,
}

fn time(a: TimeArgs) -> Result<()> {
    let c = &a.corpus;
    if let Some(path) = &a.json {
        opscope_lab::output::check(path, &c.inputs(), Output::Json, a.force)?;
    }
    for (flag, v) in [("--budget-secs", a.budget_secs), ("--warmup-secs", a.warmup_secs)] {
        if !(v.is_finite() && v >= 0.0 && v <= 86_400.0) {
            anyhow::bail!("{flag} {v} is not a number of seconds in [0, 86400]");
        }
    }
    let entries = c.entries()?;
    let (tokenizer, _) = c.text_files()?;
    let (batch, seq) = ((c.batch as usize).min(entries.len()), c.seq as usize);
    let model = opscope_lab::model::OnnxEncoder::load(c.onnx()?, batch, seq)?;
    let enc = opscope_lab::model::TextEncoder::load(tokenizer, seq)?.encode(&entries[..batch])?;
    let shape = [batch, seq];
    let inputs = opscope_lab::cost::text_input_dims(&model.graph, &shape);
    let bindings = opscope::analysis::cost::Bindings::from_inputs(&model.graph, &inputs)?;
    let opts = opscope_lab::shares::ShareOptions {
        warmup: std::time::Duration::from_secs_f64(a.warmup_secs),
        budget: std::time::Duration::from_secs_f64(a.budget_secs),
        resamples: a.resamples as usize,
        seed: a.seed,
        ..Default::default()
    };
    let bar = ProgressBar::new_spinner();
    bar.set_message("timing every deployed node alone and the whole program, in rounds");
    let shares = opscope_lab::shares::time_shares(&model.parity_input(&enc)?, &bindings, &opts);
    bar.finish_and_clear();
    let shares = shares?;
    write_json(a.json.as_deref(), &shares, "the time shares")?;
    emit(&shares.text(a.top))
}

fn cost(a: CostArgs) -> Result<()> {
    let c = &a.corpus;
    if let Some(path) = &a.json {
        opscope_lab::output::check(path, &c.inputs(), Output::Json, a.force)?;
    }
    let entries = c.entries()?;
    let (batch, seq) = (c.batch as usize, c.seq as usize);
    let full = batch.min(entries.len());
    let bar = ProgressBar::new_spinner();
    bar.set_message("probing copy bandwidth and GEMM peak");
    let probe = opscope_lab::cost::ProbeOptions { copy_bytes: (a.probe_mib as usize) << 20, gemm_n: a.probe_gemm as usize, ..Default::default() };
    let forwards = entries.len().div_ceil(batch);
    let report = match &c.gguf {
        // The prefill graph `record --gguf` runs (static shapes; packed weights at their width),
        // or with --decode its decode graph: one step over the cache of seq + decode - 1 slots
        // (preallocated and masked, so every step runs the same graph), steps x batches forwards.
        Some(gguf) => {
            let model = opscope_lab::llama::LlamaModel::load(gguf)?;
            match c.decode {
                Some(d) if d >= 2 => {
                    let steps = d as usize - 1;
                    opscope_lab::cost::graph_cost(&model.decode_graph(full, seq + steps), &[], &probe, forwards * steps, a.top)?
                }
                Some(d) => anyhow::bail!(
                    "--decode {d} runs no decode step (the first greedy token comes from the prefill): give --decode 2 or \
                     more for the cost of a decode step, or leave it out for the prefill's"
                ),
                None => opscope_lab::cost::graph_cost(&model.prefill_graph(full, seq, false), &[], &probe, forwards, a.top)?,
            }
        }
        None => opscope_lab::cost::model_cost(c.onnx()?, full, seq, &probe, forwards, a.top)?,
    };
    bar.finish_and_clear();
    write_json(a.json.as_deref(), &report, "the cost report")?;
    emit(&report.text())
}

#[derive(clap::Args)]
struct ParityArgs {
    /// ONNX model.
    #[arg(long)]
    onnx: PathBuf,
    /// tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Text file; the first `--batch` entries (fortune format, or one per line) are used.
    #[arg(long)]
    text: PathBuf,
    /// Sentences in the batch.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    batch: u32,
    /// Tokens per sentence.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: u32,
    /// Relative tolerance (times the reference tensor's max |x|).
    #[arg(long, default_value_t = 1e-4)]
    rtol: f64,
    /// Absolute tolerance.
    #[arg(long, default_value_t = 1e-6)]
    atol: f64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Compile and run the candidate on this device (e.g. `gpu`: RLX's wgpu backend, built with
    /// `--features gpu`); the reference runs op by op on the CPU, so this compares two backends.
    #[arg(long, default_value = "cpu")]
    device: rlx_runtime::Device,
    /// How to search for the divergent node: `bisect` (O(log n) compiles, checked at the node
    /// found: its operands agree) or `linear` (every node in execution order).
    #[arg(long, value_enum, default_value = "bisect")]
    search: opscope_lab::parity::Search,
    /// Compare a rewrite against the original: the candidate is the deployed graph rewritten by
    /// this opscope pipeline (a tap pipeline: tapped against untapped, which must agree to 0
    /// ULPs; an actuation such as `fakequant`: the node where it first changes a value).
    #[arg(long)]
    pipeline: Option<String>,
}

fn parity(a: ParityArgs) -> Result<()> {
    check_device(a.device)?;
    if !(a.rtol >= 0.0 && a.atol >= 0.0 && a.rtol.is_finite() && a.atol.is_finite()) {
        anyhow::bail!("--rtol and --atol must be finite and >= 0 (got {} and {})", a.rtol, a.atol);
    }
    let text = opscope_lab::model::read_text(&a.text)?;
    let entries: Vec<String> = split_entries(&text).into_iter().take(a.batch as usize).collect();
    if entries.len() < a.batch as usize {
        anyhow::bail!("{} holds {} entries, --batch asks for {}", a.text.display(), entries.len(), a.batch);
    }
    let model = opscope_lab::model::OnnxEncoder::load(&a.onnx, a.batch as usize, a.seq as usize)?;
    let enc = opscope_lab::model::TextEncoder::load(&a.tokenizer, a.seq as usize)?.encode(&entries)?;
    let mut input = model.parity_input(&enc)?;
    input.device = a.device;
    let pipeline = a.pipeline.as_deref().map(|p| p.parse::<opscope::Pipeline>().with_context(|| format!("--pipeline '{p}'"))).transpose()?;
    let how = opscope_lab::parity::Check { tol: opscope_lab::parity::Tolerance { rtol: a.rtol, atol: a.atol }, search: a.search, pipeline };
    let report = opscope_lab::parity::check_with(&input, &how)?;
    if a.json {
        say!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        emit(&opscope_lab::parity::render(&report))?;
    }
    Ok(())
}

#[derive(clap::Args)]
struct MemoArgs {
    /// ONNX model.
    #[arg(long)]
    onnx: PathBuf,
    /// tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Text file; the first `--pool` x `--batch` entries make the pool.
    #[arg(long)]
    text: PathBuf,
    /// Sentences per batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    batch: u32,
    /// Tokens per sentence.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: u32,
    /// Distinct batches in the pool.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pool: u32,
    /// Runs replayed (each batch of the pool at least once).
    #[arg(long, default_value_t = 64)]
    runs: u32,
    /// Guard capacity in entries (default: the pool).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    capacity: Option<u32>,
    /// Seed of the replay order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn memo(a: MemoArgs) -> Result<()> {
    let (pool, runs) = (a.pool as usize, a.runs as usize);
    let order = opscope_lab::memo::replay_order(pool, runs, a.seed)?;
    let text = opscope_lab::model::read_text(&a.text)?;
    let entries = split_entries(&text);
    let need = pool * a.batch as usize;
    if entries.len() < need {
        anyhow::bail!("{} holds {} entries; --pool {} x --batch {} needs {need}", a.text.display(), entries.len(), a.pool, a.batch);
    }
    if let Some(j) = &a.json {
        opscope_lab::output::check(j, &[a.onnx.as_path(), a.tokenizer.as_path(), a.text.as_path()], opscope_lab::output::Output::Json, false)?;
    }
    let model = opscope_lab::model::OnnxEncoder::load(&a.onnx, a.batch as usize, a.seq as usize)?;
    let tok = opscope_lab::model::TextEncoder::load(&a.tokenizer, a.seq as usize)?;
    let batches = entries[..need].chunks(a.batch as usize).map(|c| tok.encode(c)).collect::<Result<Vec<_>>>()?;
    let capacity = std::num::NonZeroUsize::new(a.capacity.unwrap_or(a.pool) as usize).expect("capacity >= 1");
    let report = opscope_lab::memo::replay(&model, &batches, &order, capacity)?;
    write_json(a.json.as_deref(), &report, "the memo report")?;
    emit(&report.text())
}

fn blocks(a: BlocksArgs) -> Result<()> {
    let (source, file) = a.model.load()?;
    let graph = match a.model.stage {
        opscope::activate::Stage::Deployed => opscope::activate::fuse(&source, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::default()),
        _ => source.clone(),
    };
    let stage = match a.model.stage {
        opscope::activate::Stage::Deployed => "deployed",
        _ => "source",
    };
    let opts = opscope::analysis::BlockOptions { wl_rounds: a.wl_rounds, min_ops: a.min_ops };
    let found = opscope::analysis::repeated_blocks(&graph, &opts).with_context(|| format!("{}", file.display()))?;
    // People read occurrences by the site name of their first op (the ONNX names, recovered
    // through fusion from the weights), e.g. `layer.1/attention/self/query/MatMul`.
    let (names, _) = opscope::analysis::site_names(&graph, Some(&source));
    let is_op = |v: &u32| !matches!(graph.nodes()[*v as usize].op, rlx_ir::Op::Input { .. } | rlx_ir::Op::Param { .. } | rlx_ir::Op::Constant { .. });
    let first_sites: Vec<Vec<String>> = found
        .iter()
        .map(|b| b.occurrences.iter().map(|o| o.iter().find(|v| is_op(v)).and_then(|v| names.get(v)).cloned().unwrap_or_default()).collect())
        .collect();
    // What RLX fused inside each block (deployed program only: the source program is unfused).
    let fusion: Vec<Option<opscope::analysis::BlockFusion>> =
        found.iter().map(|b| (stage == "deployed").then(|| opscope::analysis::block_fusion(b, &source, &graph))).collect();
    if a.json {
        let doc = serde_json::json!({ "onnx": a.model.onnx, "gguf": a.model.gguf, "stage": stage, "rlx_fusion": fusion, "graph": graph.name, "nodes": graph.nodes().len(), "blocks": found, "first_sites": first_sites });
        return emit(&(serde_json::to_string_pretty(&doc).context("JSON")? + "\n"));
    }
    let mut out = format!("{} repeated block(s) in the {} program of {} ({} nodes), by ops covered\n", found.len(), stage, file.display(), graph.nodes().len());
    out.push_str("rank  ops  x  covered  chain  unfused  ops of one occurrence; site of each occurrence's first op\n");
    let shown = if a.top == 0 { found.len() } else { a.top.min(found.len()) };
    for (i, ((b, sites), f)) in found.iter().zip(&first_sites).zip(&fusion).take(shown).enumerate() {
        let ops: Vec<String> = b.op_counts.iter().map(|(k, v)| if *v > 1 { format!("{v}x{k}") } else { k.clone() }).collect();
        out.push_str(&format!(
            "{:>4}  {:>3}  {:<2} {:>7}  {:<5}  {:>7}  {}; {}\n",
            i + 1,
            b.ops,
            b.occurrences.len(),
            b.coverage(),
            if b.chain { "yes" } else { "no" },
            f.as_ref().map_or("-".to_string(), |f| f.unfused_ops.to_string()),
            ops.join(" "),
            sites.join(" | ")
        ));
    }
    if shown < found.len() {
        out.push_str(&format!("({} more; --top 0 shows all, --json gives node ids)\n", found.len() - shown));
    }
    out.push_str("unfused: ops of one occurrence that are not RLX fused kernels (fused_*, *region*); a repeat with many is a candidate for a fused kernel; --json lists RLX's missed fusions per block\n");
    emit(&out)
}

#[derive(clap::Args)]
struct AbArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// Pipeline of program A; '' is the untapped model.
    #[arg(long, required_unless_present = "pipelines", conflicts_with = "pipelines")]
    a: Option<String>,
    /// Pipeline of program B; '' is the untapped model.
    #[arg(long, required_unless_present = "pipelines", conflicts_with = "pipelines")]
    b: Option<String>,
    /// Instead of --a/--b: time every `NAME=PIPELINE` (repeat; '' after '=' is untapped) against
    /// the untapped model in ONE sitting, interleaved round by round, with an A/A row (a second
    /// untapped compile) as that sitting's noise floor; prints one Markdown row per pipeline.
    #[arg(long = "pipeline", value_name = "NAME=PIPELINE", id = "pipelines")]
    pipelines: Vec<String>,
    /// With --pipeline: also give each row its accuracy against fp32 (mean and worst embedding
    /// cosine, SQNR in dB, as `opscope measure --also`): one pass over the text per pipeline.
    #[arg(long, requires = "pipelines")]
    accuracy: bool,
    /// Which program the taps observe (`deployed` or `source`).
    #[arg(long, default_value = "deployed")]
    stage: opscope::activate::Stage,
    /// Warm-up, in ms, alternating A and B before measuring.
    #[arg(long, default_value_t = 1000)]
    warmup_ms: u64,
    /// Time budget of the measured pairs, in ms; sets the sample count.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    budget_ms: u64,
    /// Fewest measured pairs, whatever the budget.
    #[arg(long, default_value_t = 10)]
    min_pairs: usize,
    /// Confidence level of the interval.
    #[arg(long, default_value_t = 0.95)]
    confidence: f64,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = 10_000)]
    resamples: usize,
    /// Seed of the bootstrap generator.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the comparison as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Overwrite `--json` even when it is an input or an existing file that is not JSON.
    #[arg(long)]
    force: bool,
}

/// Batches `ab` cycles through (pair i runs batch i mod this on both sides).
const AB_BATCHES: usize = 16;

/// The model and the batches `opscope ab` times: at most [`AB_BATCHES`] full batches of the
/// corpus's entries (a batch is shrunk to the entry count when fewer entries exist).
///
/// Errors: the corpus's files cannot be read or tokenized, or the model cannot be loaded.
fn ab_inputs(c: &Corpus) -> Result<(opscope_lab::model::OnnxEncoder, Vec<opscope_lab::model::Encoded>)> {
    let (tok, _) = c.text_files()?;
    let mut entries = c.entries()?;
    let batch = (c.batch as usize).min(entries.len());
    entries.truncate((entries.len() / batch).min(AB_BATCHES) * batch);
    let text = opscope_lab::model::TextEncoder::load(tok, c.seq as usize)?;
    let batches = entries.chunks(batch).map(|b| text.encode(b)).collect::<Result<Vec<_>>>()?;
    let model = opscope_lab::model::OnnxEncoder::load(c.onnx()?, batch, c.seq as usize)?;
    Ok((model, batches))
}

fn ab(a: AbArgs) -> Result<()> {
    let c = &a.corpus;
    if let Some(path) = &a.json {
        opscope_lab::output::check(path, &c.inputs(), Output::Json, a.force)?;
    }
    let parse = |text: &str, side: &str| -> Result<Option<Pipeline>> {
        if text.trim().is_empty() {
            return Ok(None);
        }
        Ok(Some(Pipeline::parse(text).with_context(|| format!("--{side}"))?))
    };
    let opts = opscope_lab::timing::AbOptions {
        warmup: std::time::Duration::from_millis(a.warmup_ms),
        budget: std::time::Duration::from_millis(a.budget_ms),
        min_pairs: a.min_pairs,
        max_pairs: 1_000_000.max(a.min_pairs),
        resamples: a.resamples,
        confidence: a.confidence,
        seed: a.seed,
    };
    opts.validate()?;
    if !a.pipelines.is_empty() {
        return ab_many::ab_many(&a, &opts);
    }
    let (ta, tb) = (a.a.clone().unwrap_or_default(), a.b.clone().unwrap_or_default());
    let (pa, pb) = (parse(&ta, "a")?, parse(&tb, "b")?);
    let (model, batches) = ab_inputs(c)?;
    let bar = ProgressBar::new_spinner();
    bar.set_message(format!("timing A '{}' against B '{}'", ta, tb));
    let r = opscope_lab::timing::ab_pipelines(&model, &batches, pa.as_ref(), pb.as_ref(), a.stage, &opts);
    bar.finish_and_clear();
    let r = r?;
    let doc = serde_json::json!({ "onnx": c.onnx, "a": ta, "b": tb, "batch": model.batch, "seq": c.seq, "batches": batches.len(), "report": r });
    write_json(a.json.as_deref(), &doc, "the comparison")?;
    let name = |p: &str| if p.trim().is_empty() { "untapped".to_string() } else { format!("'{p}'") };
    let mut out = format!("A = {}, B = {} ({} x {} tokens, {} batches cycled)\n{}\n", name(&ta), name(&tb), model.batch, c.seq, batches.len(), r.line());
    let o = |x: &opscope_lab::timing::Outliers| format!("{} low / {} high severe (dropped), {} low / {} high mild (kept)", x.low_severe, x.high_severe, x.low_mild, x.high_mild);
    out.push_str(&format!("outliers A: {}\noutliers B: {}\n", o(&r.outliers_a), o(&r.outliers_b)));
    out.push_str(&format!(
        "{}\n",
        if r.differs() { format!("A and B differ at {:.0}% confidence", r.confidence * 100.0) } else { format!("no difference at {:.0}% confidence", r.confidence * 100.0) }
    ));
    emit(&out)
}

#[derive(clap::Args)]
struct SitesArgs {
    #[command(flatten)]
    model: ModelGraph,
    /// Pass pipeline whose sites to list.
    #[arg(long, default_value = "matmul")]
    pipeline: String,
}

/// An ONNX model imported for a fixed `[batch, seq]`, or a GGUF decoder's prefill graph built for
/// it, and which of its programs to look at (`sites`, `blocks`).
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("model").required(true).multiple(false).args(["onnx", "gguf"])))]
struct ModelGraph {
    /// ONNX model.
    #[arg(long)]
    onnx: Option<PathBuf>,
    /// Instead of --onnx: a Llama-architecture GGUF decoder; its prefill graph as `record --gguf`
    /// builds it (packed weights as `DequantMatMul`).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Sentences per batch the model is imported for.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// Tokens per sentence.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: u32,
    /// Which program: `deployed` (after RLX's fusion, what runs) or `source` (as built).
    #[arg(long, default_value = "deployed")]
    stage: opscope::activate::Stage,
}

impl ModelGraph {
    /// The model's graph for `[batch, seq]` and its file.
    fn load(&self) -> Result<(rlx_ir::Graph, &std::path::Path)> {
        let (b, s) = (self.batch as usize, self.seq as usize);
        match (&self.onnx, &self.gguf) {
            (Some(onnx), _) => Ok((opscope_lab::model::OnnxEncoder::load(onnx, b, s)?.graph, onnx.as_path())),
            (None, Some(gguf)) => Ok((opscope_lab::llama::LlamaModel::load(gguf)?.prefill_graph(b, s, false), gguf.as_path())),
            (None, None) => anyhow::bail!("give --onnx or --gguf"),
        }
    }
}

/// The sites `pipeline` finds in `graph` as `(short name, full name, pass, op, roles, shapes)`.
fn site_table(pipeline: &Pipeline, graph: &rlx_ir::Graph, stage: opscope::activate::Stage) -> Result<Vec<[String; 5]>> {
    let options = rlx_runtime::CompileOptions::default();
    let (_, m) = opscope::activate::rewrite(pipeline, graph, stage, &options, 0)?;
    let names: Vec<&str> = m.sites.iter().map(|s| s.site.as_str()).collect();
    let prefix = opscope_lab::summary::common_prefix(&names);
    Ok(m.sites
        .iter()
        .map(|s| {
            let roles: Vec<String> = m
                .outputs
                .iter()
                .flat_map(|o| o.uses.iter().filter(|u| u.site == s.site && u.pass_idx == s.pass_idx).map(move |u| format!("{} {}", u.role, o.shape)))
                .collect();
            [s.site.strip_prefix(prefix).unwrap_or(&s.site).to_string(), s.site.clone(), s.pass.clone(), s.op.clone(), roles.join(", ")]
        })
        .collect())
}

fn sites(a: SitesArgs) -> Result<()> {
    let pipeline = Pipeline::parse(&a.pipeline)?;
    let (graph, file) = a.model.load()?;
    let rows = site_table(&pipeline, &graph, a.model.stage)?;
    let mut out = String::new();
    for [short, full, pass, op, roles] in &rows {
        out.push_str(&format!("{short}\t{pass}\t{op}\t{roles}\t{full}\n"));
    }
    out.push_str(&format!("{} site(s) of '{pipeline}' in {}\n", rows.len(), file.display()));
    emit(&out)
}

/// The model and the text both `record` and `measure` run.
#[derive(clap::Args)]
// One model is required: a missing one is reported as "--onnx or --gguf", not as --onnx alone.
#[command(group(clap::ArgGroup::new("model").required(true).multiple(false).args(["onnx", "gguf"])))]
struct Corpus {
    /// ONNX model (BERT-style encoder with inputs input_ids, attention_mask; for `measure`, its
    /// last output is the sentence embedding). Or --gguf, a decoder.
    #[arg(long)]
    onnx: Option<PathBuf>,
    /// Instead of --onnx: a Llama-architecture GGUF decoder (e.g. SmolLM2-135M), its tokenizer
    /// read from the file. `record`: each batch is prefilled (one step of the prefill compile),
    /// then decoded greedily for `--decode` tokens with a KV cache (the first token comes from
    /// the prefill's logits, each later one is one step of the decode compile: N tokens, N - 1
    /// decode steps); prints the text's perplexity. `measure`: perplexity, sinks, massive
    /// activations, W4A8/W8A8 and the skip of each block. `cost`: the prefill graph's cost.
    #[arg(long, conflicts_with_all = ["onnx", "tokenizer", "inputs"])]
    gguf: Option<PathBuf>,
    /// With --gguf: greedy tokens generated after each prefill (0: prefill only). The first
    /// comes from the prefill, so N tokens run the decode graph N - 1 times (recorded steps of
    /// the decode compile: 0 .. N - 2).
    #[arg(long, requires = "gguf", value_parser = clap::value_parser!(u32).range(0..=4096))]
    decode: Option<u32>,
    /// Hugging Face tokenizer.json.
    #[arg(long, required_unless_present_any = ["inputs", "gguf"])]
    tokenizer: Option<PathBuf>,
    /// Text file: entries separated by lines holding only '%' (fortune format); a file without
    /// any '%' line is split on blank lines instead.
    #[arg(long, required_unless_present = "inputs")]
    text: Option<PathBuf>,
    /// Instead of text: the model's inputs from a numpy `.npz` (one array per input the model
    /// declares); batch i is every array's index i along `--axis`. `record` only.
    #[arg(long, conflicts_with_all = ["tokenizer", "text"])]
    inputs: Option<PathBuf>,
    /// The axis of the `--inputs` arrays that indexes batches.
    #[arg(long, default_value_t = 0, requires = "inputs")]
    axis: usize,
    /// Sentences per batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// Tokens per sentence (truncate and pad to this length).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: u32,
    /// Use at most this many text entries.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    limit: Option<u64>,
}

impl Corpus {
    /// The ONNX model (required unless `--gguf` is given).
    fn onnx(&self) -> Result<&PathBuf> {
        self.onnx.as_ref().context("this command needs --onnx (--gguf works with `record`, `measure`, `cost`, `sites` and `blocks` only)")
    }

    /// The tokenizer and text files (required unless `--inputs` is given).
    fn text_files(&self) -> Result<(&PathBuf, &PathBuf)> {
        match (&self.tokenizer, &self.text) {
            (Some(t), Some(x)) => Ok((t, x)),
            (None, _) if self.gguf.is_some() => anyhow::bail!(
                "this command runs an ONNX encoder (--onnx, --tokenizer, --text); --gguf works with `record`, `measure`, \
                 `cost`, `sites` and `blocks` only"
            ),
            _ => anyhow::bail!("this command needs --tokenizer and --text (--inputs is for `record` only)"),
        }
    }

    /// Every file the command reads.
    fn inputs(&self) -> Vec<&std::path::Path> {
        [self.onnx.as_ref(), self.gguf.as_ref(), self.tokenizer.as_ref(), self.text.as_ref(), self.inputs.as_ref()].into_iter().flatten().map(|p| p.as_path()).collect()
    }

    /// The text's entries, at most `--limit`. Errors if the file is unreadable or empty.
    fn entries(&self) -> Result<Vec<String>> {
        let path = self.text.as_ref().context("this command needs --text")?;
        let text = opscope_lab::model::read_text(path)?;
        let mut entries = split_entries(&text);
        if let Some(n) = self.limit {
            entries.truncate(n as usize);
        }
        anyhow::ensure!(!entries.is_empty(), "{}: no text entries found", path.display());
        Ok(entries)
    }
}

#[derive(clap::Args)]
struct MeasureArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// Also write the measurement as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Overwrite `--json` even when it is an input or an existing file that is not JSON.
    #[arg(long)]
    force: bool,
    /// With --gguf: leave out the skip of each residual block (one full pass over the text per
    /// block: 60 for SmolLM2-135M).
    #[arg(long)]
    no_skip: bool,
    /// With --gguf: leave out the W8A8 rows (they load a second copy of the model with f32
    /// projections, about 4x the packed size).
    #[arg(long)]
    no_w8a8: bool,
    /// Also measure this actuation pipeline against the unchanged model (repeat for more), e.g.
    /// `smoothquant{alpha=0.5},fakequant{scope=tensor,weights=true}` or
    /// `staticquant{table=table.json}`: a W8A8 row (--onnx), a row beside W4A8 run on the packed
    /// weights (--gguf).
    #[arg(long, value_name = "PIPELINE")]
    also: Vec<String>,
    /// With --onnx: instead of the standard measurements, apply a plan written by `opscope plan`
    /// and report its embedding cosine, SQNR and joint error beside the plan's prediction, and
    /// its time against fp32 (interleaved, as `opscope ab`).
    #[arg(long, conflicts_with_all = ["also", "gguf"])]
    plan: Option<PathBuf>,
    /// With --plan: time budget of the interleaved timing, ms (0: no timing).
    #[arg(long, default_value_t = 3000, requires = "plan")]
    time_budget_ms: u64,
}

fn measure(a: MeasureArgs) -> Result<()> {
    let c = &a.corpus;
    if let Some(path) = &a.json {
        opscope_lab::output::check(path, &c.inputs(), Output::Json, a.force)?;
    }
    if c.gguf.is_none() && (a.no_skip || a.no_w8a8) {
        anyhow::bail!("--no-skip and --no-w8a8 apply to --gguf only: the ONNX measurement always runs every skip and W8A8 configuration");
    }
    if let Some(gguf) = &c.gguf {
        use opscope_lab::llama::job::LlamaJob;
        anyhow::ensure!(c.decode.is_none(), "--decode is for `record`: measure scores the prefill's next-token predictions");
        let entries = c.entries()?;
        let (b, s) = (c.batch as usize, c.seq as usize);
        let job = LlamaJob::new(gguf, &entries, b, s, 0)?;
        let f32_job = if a.no_w8a8 { None } else { Some(LlamaJob::new_with(gguf, &entries, b, s, 0, false)?) };
        let bar = ProgressBar::new_spinner();
        bar.enable_steady_tick(std::time::Duration::from_millis(500));
        let m = opscope_lab::llama::measure::measure(&job, f32_job.as_ref(), !a.no_skip, &a.also, |stage| bar.set_message(stage.to_string()))?;
        bar.finish_and_clear();
        write_json(a.json.as_deref(), &m, "the measurement")?;
        return emit(&m.markdown());
    }
    if let Some(plan) = &a.plan {
        return measure_plan(c, plan, a.time_budget_ms, a.json.as_deref());
    }
    let job = Job::new(c.onnx()?, c.text_files()?.0, c.entries()?, c.batch as usize, c.seq as usize)?;
    let bar = ProgressBar::new_spinner();
    let m = opscope_lab::measure::measure_with(&job, &a.also, |stage| bar.set_message(stage.to_string()))?;
    bar.finish_and_clear();
    write_json(a.json.as_deref(), &m, "the measurement")?;
    emit(&m.markdown())
}

#[derive(clap::Args)]
struct ReportArgs {
    /// Recording (.csv, .csv.gz or .parquet; its .manifest.json sidecar names graphs and pipeline).
    recording: PathBuf,
    /// The HTML file to write.
    #[arg(short, long)]
    out: PathBuf,
    /// Also write the overview (where the time goes, roofline, GEMM shapes, heatmap, one row
    /// per site) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The cost of the recorded graph, as `opscope cost --json` wrote it (FLOPs, bytes,
    /// roofline, GEMM shapes in the overview).
    #[arg(long, conflicts_with = "onnx")]
    cost: Option<PathBuf>,
    /// Measured per-site time shares, as `opscope time --json` wrote them: the overview's share
    /// column and every payoff use them (sites the file lacks keep their FLOP share).
    #[arg(long)]
    time_shares: Option<PathBuf>,
    /// Instead of --cost: compute the cost here from the recorded ONNX model (roofs probed in
    /// this process, as `opscope cost` does; token ids do not change the cost, so no tokenizer
    /// or text is read).
    #[arg(long)]
    onnx: Option<PathBuf>,
    /// With --onnx: sentences per batch the model is costed for (default: the batch of the
    /// recording's graph name, `<model>_b<batch>_s<seq>`).
    #[arg(long, requires = "onnx", value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: Option<u32>,
    /// With --onnx: tokens per sentence (default: the recording's, as --batch).
    #[arg(long, requires = "onnx", value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: Option<u32>,
    /// With --onnx: MiB of the copy probe's tensor (see `opscope cost`).
    #[arg(long, default_value_t = 256, requires = "onnx", value_parser = clap::value_parser!(u32).range(1..=8192))]
    probe_mib: u32,
    /// With --onnx: square size n of the GEMM probe (see `opscope cost`).
    #[arg(long, default_value_t = 1024, requires = "onnx", value_parser = clap::value_parser!(u32).range(16..=8192))]
    probe_gemm: u32,
    /// Overwrite `--out` / `--json` even when it is an input or an existing file of another kind.
    #[arg(long)]
    force: bool,
}

/// `(batch, seq)` of an importer graph name `<model>_b<batch>_s<seq>`.
fn batch_seq_of(graph: &str) -> Option<(u32, u32)> {
    let (rest, s) = graph.rsplit_once("_s")?;
    let (_, b) = rest.rsplit_once("_b")?;
    Some((b.parse().ok()?, s.parse().ok()?))
}

fn report(a: ReportArgs) -> Result<()> {
    let inputs: Vec<&std::path::Path> =
        [Some(&a.recording), a.cost.as_ref(), a.onnx.as_ref(), a.time_shares.as_ref()].into_iter().flatten().map(|p| p.as_path()).collect();
    opscope_lab::output::check(&a.out, &inputs, Output::Report, a.force)?;
    if let Some(path) = &a.json {
        opscope_lab::output::check(path, &inputs, Output::Json, a.force)?;
    }
    // Compact: the report reads each run's scalars, histograms and channel maxima, and of the
    // per-row energies only their mean over runs (`Series::mean_row_energy`).
    let series = opscope::mine::load_compact(&a.recording)?;
    let measured = a.time_shares.as_deref().map(opscope::mine::TimeShares::load).transpose()?;
    let verdicts = opscope::mine::mine_with(&series, measured.as_ref());
    let time = measured.as_ref().map(|t| opscope_lab::report::TimeShares {
        method: format!("measured by `opscope time` ({}): each deployed node timed alone", t.source),
        sites: t.shares.iter().chain(&t.parts).map(|(k, v)| (k.clone(), *v)).collect(),
    });
    let mut notes = opscope::mine::no_data(&a.recording, &series)?;
    notes.extend(opscope::mine::sidecar_note(&a.recording)?);
    notes.push(opscope::mine::NOT_OBSERVABLE.to_string());
    let manifests = opscope::recording::read_sidecar(&a.recording)?.map(|s| s.graphs).unwrap_or_default();
    let cost = match (&a.cost, &a.onnx) {
        (Some(path), _) => {
            let bytes = std::fs::read(path).with_context(|| format!("reading --cost {}", path.display()))?;
            let view = opscope_lab::report::CostView::from_json(&bytes).map_err(|e| anyhow::anyhow!("--cost {}: {e}", path.display()))?;
            Some((view, opscope_lab::report::CostSource::File { path: path.display().to_string() }))
        }
        (None, Some(onnx)) => {
            let recorded = manifests.iter().find_map(|m| batch_seq_of(&m.graph));
            let batch = a.batch.or(recorded.map(|r| r.0)).unwrap_or(8) as usize;
            let seq = a.seq.or(recorded.map(|r| r.1)).unwrap_or(64) as usize;
            let runs: std::collections::BTreeSet<(u32, u64)> = series.values().flat_map(|s| s.runs.iter().map(|r| (r.compile, r.step))).collect();
            let bar = ProgressBar::new_spinner();
            bar.set_message("costing the model: probing copy bandwidth and GEMM peak");
            let probe = opscope_lab::cost::ProbeOptions { copy_bytes: (a.probe_mib as usize) << 20, gemm_n: a.probe_gemm as usize, ..Default::default() };
            let r = opscope_lab::cost::model_cost(onnx, batch, seq, &probe, runs.len(), opscope_lab::report::TOP_SITES)?;
            bar.finish_and_clear();
            let view = opscope_lab::report::CostView::from_report(&r).map_err(|e| anyhow::anyhow!(e))?;
            Some((view, opscope_lab::report::CostSource::Computed { onnx: onnx.display().to_string() }))
        }
        (None, None) => None,
    };
    if let Some((view, _)) = &cost {
        if !manifests.is_empty() && !manifests.iter().any(|m| m.graph == view.graph) {
            let graphs: Vec<&str> = manifests.iter().map(|m| m.graph.as_str()).collect();
            anyhow::bail!(
                "the cost is of graph '{}', the recording's graph(s) are {}: cost the model at the batch and sequence length it was recorded with \
                 (`opscope cost --batch B --seq S`, or `report --onnx` with --batch/--seq)",
                view.graph,
                graphs.join(", ")
            );
        }
    }
    let title = format!("opscope report: {}", a.recording.display());
    let (html, overview) = opscope_lab::report::render_with_overview(&opscope_lab::report::Input {
        title: &title,
        manifests: &manifests,
        series: &series,
        verdicts: &verdicts,
        notes: &notes,
        cost: cost.as_ref().map(|(v, s)| (v, s)),
        time: time.as_ref(),
    })?;
    opscope::recording::write_atomic(&a.out, html.as_bytes())?;
    write_json(a.json.as_deref(), &overview, "the overview")?;
    let said = match &cost {
        Some((_, opscope_lab::report::CostSource::File { .. })) => "cost read from --cost",
        Some(_) => "cost computed from --onnx",
        None => "no cost: pass --cost or --onnx for FLOPs, bytes and the roofline",
    };
    emit(&format!("wrote {} ({} verdicts, {} site/roles; {said})\n", a.out.display(), verdicts.len(), series.len()))
}

#[derive(clap::Args)]
struct DiffArgs {
    /// Recording A, the baseline (`.parquet`, `.csv` or `.csv.gz`).
    a: PathBuf,
    /// Recording B, compared with A.
    b: PathBuf,
    /// Print JSON (every series, every measure, the notes) instead of the table.
    #[arg(long)]
    json: bool,
    /// Rows of the table, the series that moved most first (0: all); the first 3 are also shown
    /// statistic by statistic. JSON always holds every series.
    #[arg(long, default_value_t = 20)]
    top: usize,
}

fn diff(a: DiffArgs) -> Result<()> {
    // Compact: the diff reads verdicts, histograms and channel maxima, not per-row vectors.
    let load = |p: &PathBuf, side: &str| opscope::mine::load_compact(p).with_context(|| format!("reading recording {side} ({})", p.display()));
    let (sa, sb) = (load(&a.a, "A")?, load(&a.b, "B")?);
    let d = opscope_lab::diff::diff(&sa, &sb).with_context(|| format!("comparing {} with {}", a.a.display(), a.b.display()))?;
    if a.json {
        #[derive(serde::Serialize)]
        struct Doc<'a> {
            a: &'a std::path::Path,
            b: &'a std::path::Path,
            diff: &'a opscope_lab::diff::Diff,
        }
        let doc = Doc { a: &a.a, b: &a.b, diff: &d };
        return emit(&(serde_json::to_string_pretty(&doc).context("JSON")? + "\n"));
    }
    emit(&d.text(&a.a.display().to_string(), &a.b.display().to_string(), a.top, 3))
}

#[derive(clap::Args)]
struct CompareArgs {
    /// Recording A, the reference (e.g. the CPU's).
    a: PathBuf,
    /// Recording B.
    b: PathBuf,
    /// Relative tolerance of every statistic that is neither a count nor a histogram.
    #[arg(long, default_value_t = 1e-5)]
    rtol: f64,
    /// Allowed L1 difference of a histogram per run, as a fraction of its total (0: equal counts).
    #[arg(long, default_value_t = 0.0)]
    hist_tol: f64,
    /// Print JSON instead of one line per check.
    #[arg(long)]
    json: bool,
}

fn compare(a: CompareArgs) -> Result<()> {
    for (name, v) in [("--rtol", a.rtol), ("--hist-tol", a.hist_tol)] {
        anyhow::ensure!(v.is_finite() && v >= 0.0, "{name} {v}: a tolerance is a finite number >= 0");
    }
    let tol = opscope_lab::compare::Tolerance { rtol: a.rtol, hist_tol: a.hist_tol };
    let comparison = opscope_lab::compare::compare(&a.a, &a.b, tol)?;
    if a.json {
        let doc = serde_json::json!({ "a": a.a, "b": a.b, "tolerance": tol, "runs_differ": comparison.runs, "checks": comparison.checks });
        emit(&(serde_json::to_string_pretty(&doc).context("JSON")? + "\n"))?;
    } else {
        emit(&opscope_lab::compare::text(&comparison))?;
    }
    if comparison.checks.iter().any(|c| !c.ok) {
        std::process::exit(1);
    }
    Ok(())
}

#[derive(clap::Args)]
struct MineArgs {
    /// Recording (`.csv`, `.csv.gz` or `.parquet`).
    recording: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Weigh payoffs by measured time shares (`opscope time --json` of the same model, batch and
    /// sequence length) instead of FLOP shares; sites the file does not list keep their FLOP
    /// share, and each verdict says which basis it used.
    #[arg(long)]
    time_shares: Option<PathBuf>,
    /// Read at most N runs per series and tensor shape (a uniform sample by a hash of each run),
    /// so memory stays bounded whatever the run count; `all` reads every run. Run counts,
    /// min/max, FLOP shares, NaN/Inf counts, the compiles that ran and per-channel maxima stay
    /// exact; medians and trends of a sampled series are estimated from the sample (README,
    /// "Mining in bounded memory"). The default, 1000, is TensorBoard's for scalars.
    #[arg(long, value_name = "N|all", default_value_t = MaxRuns(Some(opscope::mine::DEFAULT_MAX_RUNS as u32)), value_parser = parse_max_runs)]
    max_runs: MaxRuns,
}

/// `--max-runs`: a number of runs per series and shape (at least [`opscope::mine::MIN_STEPS`]),
/// or `None` for every run (`all`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct MaxRuns(Option<u32>);

impl std::fmt::Display for MaxRuns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("all"),
        }
    }
}

fn parse_max_runs(s: &str) -> Result<MaxRuns, String> {
    if s == "all" {
        return Ok(MaxRuns(None));
    }
    let n: u32 = s.parse().map_err(|_| format!("`{s}` is neither a number of runs (4 to {}) nor `all`", u32::MAX))?;
    if (n as usize) < opscope::mine::MIN_STEPS {
        return Err(format!(
            "{n} runs are too few: the across-run rules need at least {}; pass a larger N, or `all` to read every run",
            opscope::mine::MIN_STEPS
        ));
    }
    Ok(MaxRuns(Some(n)))
}

fn probe(a: ProbeArgs) -> Result<()> {
    let report = opscope_lab::probe::probe_dir(&a.capture).with_context(|| format!("probing {}", a.capture.display()))?;
    let upgraded = match &a.recording {
        Some(rec) => {
            let series = opscope::mine::load_compact(rec)?;
            let verdicts = opscope::mine::mine(&series);
            Some(opscope_lab::probe::upgrade(verdicts, &report))
        }
        None => None,
    };
    let noise = match &a.recording {
        Some(rec) => opscope_lab::probe::noise_check(&a.capture, rec)?,
        None => Vec::new(),
    };
    if a.json {
        let doc = serde_json::json!({ "capture": a.capture, "tensors": report.tensors, "gemms": report.gemms, "verdicts": upgraded, "noise_check": noise });
        return emit(&(serde_json::to_string_pretty(&doc).context("JSON")? + "\n"));
    }
    let mut text = opscope_lab::probe::render(&report);
    if let Some(v) = &upgraded {
        let probed: Vec<_> = v.iter().filter(|v| v.kind.name.starts_with("two_four")).collect();
        text.push_str(&format!("\n2:4 verdicts ({}):\n", probed.len()));
        for v in probed {
            let ev: Vec<String> = v.evidence.iter().map(|(k, x)| format!("{k}={x:.4}")).collect();
            text.push_str(&format!("  {} {} {}: {}\n", v.site, v.role, v.kind.name, ev.join(" ")));
        }
    }
    if !noise.is_empty() {
        text.push_str(&opscope_lab::probe::render_noise(&noise));
    }
    emit(&text)
}

fn mine(a: MineArgs) -> Result<()> {
    // Per-row vectors reduced as each run's rows end: the same verdicts, a fifth of the memory per run.
    let series = match a.max_runs.0 {
        Some(n) => opscope::mine::load_sampled(&a.recording, n as usize)?,
        None => opscope::mine::load_compact(&a.recording)?,
    };
    let sampled = series.values().filter(|s| s.is_sampled()).count();
    if series.is_empty() {
        anyhow::bail!(
            "{}: the recording holds no row of a statistic opscope mines, so there is nothing to mine (a recording \
             stopped before its first run, or a pipeline that matched no site: `opscope record` lists the sites it taps)",
            a.recording.display()
        );
    }
    let time = a.time_shares.as_deref().map(opscope::mine::TimeShares::load).transpose()?;
    let verdicts = opscope::mine::mine_with(&series, time.as_ref());
    let no_data = opscope::mine::no_data(&a.recording, &series)?;
    let notes: Vec<String> = opscope::mine::sidecar_note(&a.recording)?.into_iter().collect();
    let cannot = opscope::mine::cannot_run(&series);
    let untimed = time.as_ref().map(|t| opscope::mine::untimed_sites(&series, t));
    if a.json {
        let mut doc = serde_json::json!({
            "recording": a.recording,
            "verdicts": verdicts,
            "cannot_run": cannot,
            "no_data": no_data,
            "notes": notes,
            "not_observable": opscope::mine::NOT_OBSERVABLE,
            "series": opscope_lab::verdicts::series_summary(&series),
        });
        if let (Some(path), Some(untimed)) = (&a.time_shares, &untimed) {
            doc["payoff_basis"] = serde_json::json!({ "time_shares": path, "untimed_sites": untimed });
        }
        if let Some(n) = a.max_runs.0 {
            doc["sampled"] = serde_json::json!({ "max_runs": n, "series_sampled": sampled });
        }
        return emit(&(serde_json::to_string_pretty(&doc).context("JSON")? + "\n"));
    }
    let mut text = String::new();
    if let (Some(n), true) = (a.max_runs.0, sampled > 0) {
        text.push_str(&format!(
            "{sampled} series hold more than {n} runs of one shape: their medians and trends (and a trend's `runs`) are read \
             from a sample of {n} runs per shape; the series' run counts, min/max, FLOP shares, NaN/Inf counts and \
             per-channel maxima are over every run (`--max-runs all` reads every run)\n"
        ));
    }
    if let (Some(path), Some(untimed)) = (&a.time_shares, &untimed) {
        text.push_str(&format!("payoff = measured time share (from {}) x the kernel's fraction", path.display()));
        if untimed.is_empty() {
            text.push_str("; every site is timed\n");
        } else {
            text.push_str(&format!(
                "; {} site(s) not in the time shares use their FLOP share instead (basis 'flops'): {}\n",
                untimed.len(),
                untimed.join(", ")
            ));
        }
    }
    text.push_str(&opscope_lab::verdicts::text(&verdicts, &cannot, &no_data, &series));
    for n in &notes {
        text.push_str(&format!("note: {n}\n"));
    }
    emit(&text)
}

/// A calibration method on the command line.
#[derive(Clone, Copy, clap::ValueEnum)]
enum MethodArg {
    /// Smallest min and largest max over runs.
    Minmax,
    /// The central --percentile percent of the merged histogram.
    Percentile,
    /// The KL-divergence threshold search (TensorRT's entropy calibration, as ORT implements it).
    Entropy,
}

/// How min-max combines the runs' ranges on the command line.
#[derive(Clone, Copy, clap::ValueEnum)]
enum AverageArg {
    /// The smallest min and largest max of any run (ORT's MinMax default).
    Extremes,
    /// The mean of the runs' min and max (ORT's MinMax with moving_average=True in quantize_static).
    Mean,
    /// Exponential moving average in run order (PyTorch's MovingAverageMinMaxObserver).
    Ema,
}

#[derive(clap::Args)]
struct CalibrateArgs {
    /// Recording (CSV, .csv.gz or Parquet) made with `matmul{stats=[min,max,hist],hist_bins=2048,hist_range=-A:A}`
    /// (min-max needs only min and max).
    recording: PathBuf,
    /// Calibration method.
    #[arg(long, value_enum)]
    method: MethodArg,
    /// Percent of the values the range keeps (percentile method; ORT's default 99.999).
    #[arg(long)]
    percentile: Option<f64>,
    /// Min-max: how the runs' ranges combine (each run is one batch).
    #[arg(long, value_enum, default_value = "extremes")]
    average: AverageArg,
    /// `--average ema`: the weight of each new run, in (0, 1] (PyTorch's averaging_constant).
    #[arg(long)]
    averaging_constant: Option<f64>,
    /// Symmetric range and int8 [-127, 127] scales with zero point 0 (else uint8 [0, 255] with a
    /// zero point).
    #[arg(long)]
    symmetric: bool,
    /// Output: `.json` (ONNX Runtime's calibration table, keyed site/role) or `.cache` (TensorRT
    /// calibration cache).
    #[arg(short, long)]
    out: PathBuf,
    /// TensorRT version in the cache header `TRT-<version>-EntropyCalibration2` (8601 = 8.6.1).
    #[arg(long, default_value_t = 8601)]
    trt_version: u32,
    /// Overwrite `--out` even when it is an input or an existing file of another kind.
    #[arg(long)]
    force: bool,
}

fn calibrate(a: CalibrateArgs) -> Result<()> {
    use opscope::mine::{CalibrationMethod, CalibrationOptions, RangeAveraging};
    use std::fmt::Write as _;
    let name = a.out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let kind = if name.ends_with(".json") {
        Output::Json
    } else if name.ends_with(".cache") {
        Output::TrtCache
    } else {
        anyhow::bail!("{}: calibrate writes .json (ONNX Runtime calibration table) or .cache (TensorRT calibration cache); name the output so", a.out.display());
    };
    let sidecar = opscope::recording::sidecar_path(&a.recording);
    opscope_lab::output::check(&a.out, &[&a.recording, &sidecar], kind, a.force)?;
    let method = match (a.method, a.percentile) {
        (MethodArg::Percentile, p) => CalibrationMethod::Percentile(p.unwrap_or(99.999)),
        (_, Some(_)) => anyhow::bail!("--percentile applies to --method percentile only"),
        (MethodArg::Minmax, None) => CalibrationMethod::MinMax,
        (MethodArg::Entropy, None) => CalibrationMethod::Entropy,
    };
    let averaging = match (a.average, a.averaging_constant) {
        (AverageArg::Ema, c) => RangeAveraging::Ema(c.unwrap_or(0.01)),
        (_, Some(_)) => anyhow::bail!("--averaging-constant applies to --average ema only"),
        (AverageArg::Extremes, None) => RangeAveraging::Extremes,
        (AverageArg::Mean, None) => RangeAveraging::Mean,
    };
    if averaging != RangeAveraging::Extremes && method != CalibrationMethod::MinMax {
        anyhow::bail!("--average {} applies to --method minmax only (ORT's moving_average is a MinMax calibrator option)", averaging.name());
    }
    let options = CalibrationOptions { symmetric: a.symmetric, averaging, ..CalibrationOptions::new(method) };
    let flag = if matches!(averaging, RangeAveraging::Ema(_)) { "--averaging-constant" } else { "--percentile" };
    options.validate().map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    // Compact: calibration reads extremes, histograms and channel maxima, not per-row vectors.
    let series = opscope::mine::load_compact(&a.recording)?;
    let table = opscope::mine::calibrate_all(&series, &options);
    if !table.failed.is_empty() {
        // One line per distinct reason, with the tensors it applies to (short names).
        let names: Vec<&str> = table.failed.iter().map(|(n, _)| n.as_str()).collect();
        let prefix = opscope_lab::summary::common_prefix(&names);
        let mut by_reason: Vec<(String, Vec<&str>)> = Vec::new();
        for (n, e) in &table.failed {
            let (e, n) = (e.to_string(), n.strip_prefix(prefix).unwrap_or(n));
            match by_reason.iter_mut().find(|(r, _)| *r == e) {
                Some((_, v)) => v.push(n),
                None => by_reason.push((e, vec![n])),
            }
        }
        let lines: Vec<String> = by_reason
            .iter()
            .map(|(e, v)| {
                let shown = v.iter().take(3).copied().collect::<Vec<_>>().join(", ");
                let more = if v.len() > 3 { format!(" and {} more", v.len() - 3) } else { String::new() };
                format!("  {} tensor(s) ({shown}{more}): {e}", v.len())
            })
            .collect();
        anyhow::bail!(
            "{} of {} tensor(s) cannot be calibrated by {method} (nothing written):\n{}",
            table.failed.len(),
            table.failed.len() + table.tensors.len(),
            lines.join("\n")
        );
    }
    if table.tensors.is_empty() {
        anyhow::bail!("{}: no tensor statistics to calibrate: record with matmul{{stats=[min,max,hist],..}}", a.recording.display());
    }
    let body = match kind {
        Output::TrtCache => opscope::mine::calibrate::trt_cache(&table.tensors, a.trt_version)?.into_bytes(),
        _ => serde_json::to_vec(&opscope::mine::calibrate::ort_json(&table.tensors, &options)).context("encoding the table")?,
    };
    opscope::recording::write_atomic(&a.out, &body)?;

    let names: Vec<&str> = table.tensors.iter().map(|t| t.name.as_str()).collect();
    let prefix = opscope_lab::summary::common_prefix(&names);
    let w = names.iter().map(|n| n.len() - prefix.len()).max().unwrap_or(0).max(6);
    let mut out = String::new();
    let _ = writeln!(out, "{:<w$}  {:>11}  {:>11}  {:>11}  {:>4}  {:>4}  note", "tensor", "lowest", "highest", "scale", "zp", "runs");
    let mut kinds: Vec<&'static str> = Vec::new();
    for t in &table.tensors {
        let short = &t.name[prefix.len()..];
        let q = &t.quant;
        let notes: Vec<String> = t.notes.iter().map(|n| n.short()).collect();
        let _ = writeln!(out, "{short:<w$}  {:>11.5}  {:>11.5}  {:>11.4e}  {:>4}  {:>4}  {}", t.lowest, t.highest, q.scale, q.zero_point, t.runs, notes.join(", "));
        for n in &t.notes {
            if !kinds.contains(&n.explain()) {
                kinds.push(n.explain());
            }
        }
    }
    for k in kinds {
        let _ = writeln!(out, "note: {k}");
    }
    if method == CalibrationMethod::Entropy {
        // How finely the search could move: bins from 0 to each tensor's absmax in the recorded
        // histogram, against ORT's HistogramCollector, which bins each tensor over its own
        // +-absmax (num_bins / 2 a side).
        let mut spans: Vec<usize> = table
            .tensors
            .iter()
            .filter_map(|t| {
                let h = t.histogram.as_ref()?;
                let width = (h.hi - h.lo) / h.counts.len().max(1) as f64;
                (width > 0.0).then(|| (t.data_min.abs().max(t.data_max.abs()) as f64 / width).ceil() as usize)
            })
            .collect();
        spans.sort_unstable();
        if let (Some(lo), Some(hi)) = (spans.first(), spans.last()) {
            let _ = writeln!(
                out,
                "note: the entropy search read {lo}..{hi} bins (median {}) from 0 to a tensor's absmax in the recorded \
                 histograms; ONNX Runtime's HistogramCollector bins each tensor over its own +-absmax, num_bins / 2 a side \
                 (64 by default, 1024 with TensorRT's 2048), so where a tensor has fewer its threshold is chosen on a finer \
                 grid than here and can differ: for ORT's thresholds on the raw tensors, record with a hist_range near \
                 the tensors' absmax",
                spans[spans.len() / 2]
            );
        }
    }
    let q = &table.tensors[0].quant;
    let how = match averaging {
        RangeAveraging::Extremes => method.to_string(),
        RangeAveraging::Mean => format!("{method} averaged: the mean of the runs' ranges"),
        RangeAveraging::Ema(c) => format!("{method} averaged: moving average of the runs' ranges, constant {c}"),
    };
    let _ = writeln!(
        out,
        "wrote {} ({} tensors, {how}, {} [{}, {}]{}); keys are site/role, not ONNX tensor names{}",
        a.out.display(),
        table.tensors.len(),
        q.dtype(),
        q.qmin,
        q.qmax,
        if kind == Output::TrtCache { "; the cache holds amax/127" } else { "" },
        if prefix.is_empty() { String::new() } else { format!(" (printed without the prefix '{prefix}')") }
    );
    if table.not_tensors > 0 {
        let _ = writeln!(out, "{} series without tensor statistics (probes, captures) left out", table.not_tensors);
    }
    emit(&out)
}

#[derive(clap::Args)]
struct SweepArgs {
    /// Recording path (`.parquet`, `.csv` or `.csv.gz`); ground truth goes to `<out>.truth.json`.
    #[arg(long)]
    out: PathBuf,
    /// Seeds per structure and shape (seeds 0..N).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    seeds: u64,
    /// Pass pipeline.
    #[arg(long, default_value = "matmul{roles=[lhs,rhs]}")]
    pipeline: String,
    /// Mine the sweep and print the confusion matrix of verdicts against the ground truth;
    /// exits non-zero unless every planted structure got its verdicts and nothing else fired.
    #[arg(long)]
    check: bool,
    /// With `--check`: also capture the 2:4 and low-rank activations (into `<out>.capture/`),
    /// probe them on the host, and require the probe verdicts to be confirmed.
    #[arg(long, requires = "check")]
    confirm: bool,
    /// Overwrite `--out` even when it is an existing CSV recording or a file that is not a recording (a Parquet dataset
    /// holding recordings is never overwritten).
    #[arg(long)]
    force: bool,
}

/// A capture pass writes `<out>.capture`, which never holds two captures: refused before the
/// model runs, not after (when the recording's first part is already open).
///
/// Errors: `pipeline` has a capture pass and `<out>.capture` holds a capture already.
fn check_capture_dir(pipeline: &Pipeline, out: &std::path::Path) -> Result<()> {
    let capture = opscope::recording::capture_dir_of(out);
    if pipeline.instances().iter().any(|i| i.pass.name() == "capture") && capture.join("manifest.json").exists() {
        anyhow::bail!(
            "{} already holds a capture (its manifest.json), and a capture pass writes there: move it away (or pick \
             another --out)",
            capture.display()
        );
    }
    Ok(())
}

fn sweep(a: SweepArgs) -> Result<()> {
    let text = if a.confirm { format!("{},{}", a.pipeline, opscope_lab::sweep::CONFIRM_CAPTURE) } else { a.pipeline.clone() };
    let pipeline = Pipeline::parse(&text)?;
    opscope_lab::output::check(&a.out, &[], Output::Recording, a.force)?;
    check_capture_dir(&pipeline, &a.out)?;
    let _claim = opscope_lab::output::claim(&a.out, Output::Recording)?;
    let before = partitions_before(&a.out);
    let sink = opscope::recording::open(&a.out)?;
    let seeds: Vec<u64> = (0..a.seeds).collect();
    let memory = opscope::MemorySink::default();
    let tee = opscope::recording::Tee(vec![sink, Box::new(memory.clone())]);
    interrupt_on_signals()?;
    let (truth, summary) = opscope_lab::sweep::run(&pipeline, &seeds, Box::new(tee), None, true)?;
    after_recording(&summary, &a.out, || {
        format!(
            "opscope: interrupted after {} of {} planted sites: the rows recorded so far are in {}; no ground truth was \
             written (a partial sweep has no complete truth to check against)",
            truth.sites.len(),
            opscope_lab::sweep::Planted::ALL.len() * opscope_lab::sweep::SHAPES.len() * seeds.len(),
            interrupted_rows(&a.out)
        )
    });
    let mut truth_path = a.out.clone().into_os_string();
    truth_path.push(".truth.json");
    let json = serde_json::to_vec_pretty(&truth).context("ground truth JSON")?;
    opscope::recording::write_atomic(std::path::Path::new(&truth_path), &json)?;
    say!(
        "recorded {} planted sites ({} structures x {} shapes x {} seeds) to {}, ground truth in {}",
        truth.sites.len(),
        opscope_lab::sweep::Planted::ALL.len(),
        opscope_lab::sweep::SHAPES.len(),
        seeds.len(),
        written_to(&a.out, &before),
        std::path::Path::new(&truth_path).display()
    );
    if a.check {
        let mut verdicts = opscope::mine::mine(&opscope::mine::series_from_rows(&memory.rows()));
        let mut expected: opscope_lab::sweep::Expectation = opscope_lab::sweep::expected;
        if a.confirm {
            verdicts = opscope_lab::sweep::confirm(verdicts, &opscope::recording::capture_dir_of(&a.out))?;
            expected = opscope_lab::sweep::expected_confirmed;
        }
        let check = opscope_lab::sweep::check(&truth, &verdicts, expected);
        emit(&check.table())?;
        if !check.perfect() {
            anyhow::bail!("{} departures from the ground truth:\n{}", check.errors.len(), check.errors.join("\n"));
        }
        say!("perfect: every planted structure got its verdicts; no verdict on any Gaussian null");
    }
    Ok(())
}

#[derive(clap::Args)]
struct RecordArgs {
    #[command(flatten)]
    corpus: Corpus,
    /// Pass pipeline, e.g. `matmul{hist_bins=16}`.
    #[arg(long, default_value = "matmul")]
    pipeline: String,
    /// Which program to observe: `deployed` (after RLX's fusion; outputs bit-identical) or
    /// `source` (the graph as imported, before fusion).
    #[arg(long, default_value = "deployed")]
    stage: opscope::activate::Stage,
    /// Recording path: `.parquet` (a dataset directory, `<out>/recording=<id>/part-NNNNN.parquet`,
    /// a part closed every `RLX_OPSCOPE_PART_RUNS` runs (32) or `RLX_OPSCOPE_PART_BYTES` bytes
    /// (64 MiB), manifest in `recording=<id>/_manifest.json`), `.csv` or `.csv.gz` (manifest in
    /// `<out>.manifest.json`). Parquet by default: a third of the size of csv.gz, several times faster to mine,
    /// a crash loses one part at most.
    #[arg(long, default_value = "recording.parquet")]
    out: PathBuf,
    /// Device to compile and run on (RLX's names: cpu, cuda, gpu (wgpu), metal, ...). A device
    /// other than the CPU needs its RLX backend built in (`--features gpu` or `--features cuda`
    /// of opscope-lab) and runs the sketches lowered into RLX primitive ops. ONNX models only.
    #[arg(long, default_value = "cpu")]
    device: rlx_runtime::Device,
    /// Add this recording to an existing Parquet dataset `--out` as a new `recording=<id>`
    /// partition (several processes or hosts may write into one dataset; they are mined
    /// together).
    #[arg(long)]
    append: bool,
    /// Overwrite `--out` even when it is an input, an existing CSV recording, or a file that is not a recording (a
    /// Parquet dataset holding recordings is never overwritten: --append adds beside them).
    #[arg(long)]
    force: bool,
}

/// Where a finished recording's rows and manifest are, for its closing line: a CSV file and its
/// manifest sidecar, or the partition of the Parquet dataset at `out` that the recording added
/// (`before`: the dataset's partitions before it started, [`partitions_before`]); the layout
/// in general when that is not one partition.
fn written_to(out: &std::path::Path, before: &[PathBuf]) -> String {
    if opscope::recording::is_dataset_path(out) || out.is_dir() {
        let new: Vec<opscope::recording::Partition> =
            opscope::recording::partitions(out).unwrap_or_default().into_iter().filter(|p| !before.contains(&p.dir)).collect();
        match new.as_slice() {
            [p] => format!(
                "{} (Parquet dataset; this recording: {}, {} part(s) and {})",
                out.display(),
                p.dir.strip_prefix(out).unwrap_or(&p.dir).display(),
                p.parts.len(),
                opscope::recording::PARTITION_SIDECAR
            ),
            _ => format!("{} (Parquet dataset: recording=<id>/part-*.parquet + {})", out.display(), opscope::recording::PARTITION_SIDECAR),
        }
    } else {
        format!("{} (manifest: {})", out.display(), opscope::recording::sidecar_path(out).display())
    }
}

/// The partition directories of the dataset at `out` before a recording starts (none for a CSV
/// path or a new dataset): [`written_to`] names the one the recording adds.
fn partitions_before(out: &std::path::Path) -> Vec<PathBuf> {
    if out.is_dir() {
        opscope::recording::partitions(out).unwrap_or_default().into_iter().map(|p| p.dir).collect()
    } else {
        Vec::new()
    }
}

/// Where the rows of an interrupted recording are: the closed parts of a dataset, the
/// `.partial` of a file.
fn interrupted_rows(out: &std::path::Path) -> String {
    if opscope::recording::is_dataset_path(out) || out.is_dir() {
        format!("{} (every recorded run is in a closed part)", out.display())
    } else {
        format!("{0}.partial (with its .manifest.json; `opscope mine {0}.partial` reads it)", out.display())
    }
}

/// The signal that interrupted the job (0: none yet): [`exit_interrupted`] ends the process by
/// it.
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The job's recording is closed ([`after_recording`]): from then on a signal ends the process
/// at once, as if it were not handled.
static RECORDING_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Write a line to stderr, ignoring a failed write: after a hang-up (SIGHUP from a dropped SSH
/// session) stderr may return EIO, and `eprintln!` would panic.
fn note(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{text}");
}

/// Stop a running job after the batch in progress on Ctrl-C (SIGINT), SIGTERM or SIGHUP (what
/// `timeout`, `docker stop`, systemd and Slurm send first), closing its recording as partial; a
/// second signal, or a signal once the recording is closed, ends the process at once. Either
/// way the process then ends by the signal that stopped it ([`exit_interrupted`]).
///
/// Errors: the handler thread or the signal registration cannot be set up.
fn interrupt_on_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // A signal the process was started with ignored stays ignored: `nohup` ignores SIGHUP, and a
    // non-interactive shell's background job ignores SIGINT; a handler would take them over.
    let handled: Vec<libc::c_int> = [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .filter(|&sig| {
            // SAFETY: a query (null new action) into a zeroed sigaction the call fills in.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            !unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN }
        })
        .collect();
    let mut signals = signal_hook::iterator::Signals::new(&handled).context("installing the signal handlers")?;
    std::thread::Builder::new()
        .name("opscope-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                // The signal is stored before the flag is raised, so whoever sees the flag
                // finds the signal; only the first is kept.
                let first = STOP_SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst).is_ok();
                INTERRUPTED.store(true, Ordering::SeqCst);
                // Raised before RECORDING_CLOSED is read, as `after_recording` sets it before it
                // reads the flag: at least one of the two sees the other's write.
                if !first || RECORDING_CLOSED.load(Ordering::SeqCst) {
                    opscope_lab::output::release_claims();
                    die_by(sig);
                }
                note(&format!(
                    "\nopscope: {} received, interrupting after the batch in progress; a second signal (Ctrl-C again) stops \
                     at once, losing the runs not yet closed (a Parquet recording's open part, a CSV recording's run in \
                     progress)",
                    signal_hook::low_level::signal_name(sig).unwrap_or("a signal")
                ));
            }
        })
        .context("starting the signal handler thread")?;
    Ok(())
}

/// End the process by `sig`, as if it had not been handled, so that the caller sees what stopped
/// it: a shell's `$?` reads 128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 129 for
/// SIGHUP), a shell loop stops on Ctrl-C, and systemd and Slurm see the signal (the convention of
/// GNU tools that clean up on a signal, e.g. `sort`). Where the raised signal does not end the
/// process (as PID 1 in a container, whose default-action signals from itself the kernel
/// drops), it exits with status 128 + `sig`.
fn die_by(sig: libc::c_int) -> ! {
    // SAFETY: restoring the default action of a terminating signal, unblocking it in this thread
    // and raising it; all three are async-signal-safe and take no pointer but the set built here.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
    std::process::exit(128 + sig)
}

/// After a job stopped by a signal has closed its recording: release the output claims and end
/// the process by that signal ([`die_by`]).
fn exit_interrupted() -> ! {
    opscope_lab::output::release_claims();
    let sig = STOP_SIGNAL.load(Ordering::SeqCst);
    die_by(if sig == 0 { libc::SIGINT } else { sig })
}

/// Remove the recording `run_id` left at `out` when it recorded no run: its partition of a
/// dataset (only when it holds nothing but its parts, sidecar and manifest files), or a CSV recording's
/// `.partial` and sidecar. True when removed.
fn remove_empty_recording(out: &std::path::Path, run_id: &str) -> bool {
    if out.is_dir() {
        let dir = out.join(format!("recording={run_id}"));
        let ours = |e: &std::fs::DirEntry| {
            let n = e.file_name().to_string_lossy().to_string();
            n == opscope::recording::PARTITION_SIDECAR || n.starts_with("part-") && n.ends_with(".parquet") || n.starts_with("_graphs-") && n.ends_with(".json")
        };
        let only_ours = std::fs::read_dir(&dir).is_ok_and(|d| d.flatten().all(|e| ours(&e)));
        return only_ours && std::fs::remove_dir_all(&dir).is_ok();
    }
    let partial = opscope::recording::partial_path(out);
    let side = opscope::recording::sidecar_path(&partial);
    let _ = std::fs::remove_file(&side);
    std::fs::remove_file(&partial).is_ok()
}

/// Once a job's recording is closed, by what the recorder itself decided
/// ([`opscope::activate::Summary::interrupted`], not a second read of the flag, which a signal
/// may have raised since): closed as partial, say where its rows are (`partial`) and end by the
/// signal; finished, a signal from now on ends the process at once, and one that came during
/// the last batch lets the command finish what follows the recording (ground truth, the
/// model's description, the summary) and `main` then ends by it.
fn after_recording(summary: &opscope::activate::Summary, out: &std::path::Path, partial: impl FnOnce() -> String) {
    if summary.interrupted && summary.recorded == 0 {
        // Stopped before any run was recorded: what the recorder left (an empty part and its
        // sidecar, or a `.partial` of only the header) holds no row and would only stand in the
        // way of the next recording to this path.
        let removed = remove_empty_recording(out, &summary.run_id);
        note(&format!(
            "opscope: interrupted before any run was recorded: {}",
            if removed { format!("nothing is left at {}", out.display()) } else { format!("see {}", interrupted_rows(out)) }
        ));
        // Releasing the claim also removes the dataset directory if this process created it.
        exit_interrupted();
    }
    if summary.interrupted {
        note(&partial());
        exit_interrupted();
    }
    RECORDING_CLOSED.store(true, Ordering::SeqCst);
    if INTERRUPTED.load(Ordering::SeqCst) {
        note(&format!(
            "opscope: the signal came during the last batch: the recording is complete at {}; finishing what follows it, \
             then stopping",
            out.display()
        ));
    }
}

/// Write `value` as pretty JSON to `path` (temp name, then rename) when a path is given.
fn write_json(path: Option<&std::path::Path>, value: &impl serde::Serialize, what: &str) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let body = serde_json::to_vec_pretty(value).with_context(|| format!("encoding {what}"))?;
    opscope::recording::write_atomic(path, &body)?;
    Ok(())
}

/// Write to stdout; a closed pipe (`| head`) ends the output quietly instead of panicking
/// (Rust ignores SIGPIPE, so `println!` panics on it).
fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("writing to stdout"),
    }
}

/// `passes`: every registered pass, its options, defaults and types (one write: a closed pipe
/// ends it quietly).
fn passes() -> Result<()> {
    let mut out = String::new();
    for p in opscope::pass::registered() {
        out.push_str(&format!("{}  ({})  {}\n", p.name(), p.kind(), p.doc()));
        let w = p.options().iter().map(|o| o.name.len()).max().unwrap_or(0);
        let d = p.options().iter().map(|o| o.default.len()).max().unwrap_or(0);
        for o in p.options() {
            out.push_str(&format!("    {:<w$}  default {:<d$}  {}\n", o.name, o.default, o.doc));
            out.push_str(&format!("    {:<w$}  {:<8}{}\n", "", "type", o.ty.describe()));
        }
    }
    emit(&out)
}

/// `record --inputs FILE.npz`: any ONNX model, its inputs from numpy arrays.
fn record_npz(a: &RecordArgs, pipeline: &Pipeline, npz: &std::path::Path) -> Result<()> {
    let onnx = a.corpus.onnx()?;
    let job = opscope_lab::npz::NpzJob::load(onnx, npz, a.corpus.axis)?;
    let options = rlx_runtime::CompileOptions::default();
    let (_, manifest) = opscope::activate::rewrite(pipeline, job.graph(), a.stage, &options, 0)?;
    if manifest.sites.is_empty() {
        anyhow::bail!("nothing to record: the pipeline '{pipeline}' finds no site in {}", onnx.display());
    }
    interrupt_on_signals()?;
    let before = partitions_before(&a.out);
    check_out(a)?;
    // `check_out` made the lab's checks (with --force and --append), so the sink opens unchecked.
    let summary = job.run(pipeline, a.stage, opscope::recording::open(&a.out)?)?;
    after_recording(&summary, &a.out, || {
        format!("opscope: interrupted: the rows recorded so far are in {}", interrupted_rows(&a.out))
    });
    write_side_outputs(pipeline, &a.out)?;
    say!("recorded {} batches of {} with '{pipeline}' to {}", job.batches(), npz.display(), written_to(&a.out, &before));
    Ok(())
}

/// What a recording has beside its rows, said at the end of every `record` path (text, `.npz`
/// inputs, a GGUF decoder): with `online` in the pipeline, write the process's online state
/// (quantile sketches, distinct tensors per site) to `<out>.online.json`; with `capture`, where
/// the captured tensors are (the summary table's capture rows carry counts only, so without this
/// line a capture-only recording would show a table of dashes and no tensors).
fn write_side_outputs(pipeline: &Pipeline, out: &std::path::Path) -> Result<()> {
    if opscope::online::enabled(pipeline) {
        let path = opscope::online::state_path(out);
        opscope::online::take().write(&path).map_err(|e| anyhow::anyhow!(e))?;
        say!("online state (DDSketch quantiles, distinct tensors per site) in {}", path.display());
    }
    if pipeline.instances().iter().any(|i| i.pass.name() == "capture") {
        let dir = opscope::recording::capture_dir_of(out);
        let m = if dir.join("manifest.json").is_file() { Some(opscope::capture::read_manifest(&dir)?) } else { None };
        match m {
            Some(m) if !m.captured.is_empty() => say!(
                "captured {} tensor(s) in {} (their table rows hold counts only; {} left out by the byte budget): opscope probe --capture {}",
                m.captured.len(),
                dir.display(),
                m.skipped.len(),
                dir.display()
            ),
            Some(m) => say!(
                "capture wrote no tensor: the byte budget left out all {} it was given ({}); raise budget=..",
                m.skipped.len(),
                dir.join("manifest.json").display()
            ),
            None => say!("capture wrote no tensor: no tapped tensor could be captured (the recording's manifest lists the skipped sites and why)"),
        }
    }
    Ok(())
}

/// `record`'s check of `--out` ([`opscope_lab::output::check`]): at the start, and again right
/// before the recording is created, since the model takes seconds to load and a file that
/// appeared at the path meanwhile is refused as at the start (the sink itself only refuses one
/// that appears while it records).
fn check_out(a: &RecordArgs) -> Result<()> {
    let kind = if a.append { Output::RecordingAppend } else { Output::Recording };
    opscope_lab::output::check(&a.out, &a.corpus.inputs(), kind, a.force)
}

/// `<out>.model.json`: what `record --gguf` ran (beside a CSV recording and its manifest; in a
/// Parquet dataset, `_model.json` in the recording's own partition: [`MODEL_IN_PARTITION`]).
fn model_sidecar(out: &std::path::Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".model.json");
    PathBuf::from(s)
}

/// The name of a GGUF recording's model description inside its partition of a Parquet
/// dataset: one per recording, so a recording appended beside it keeps its own.
const MODEL_IN_PARTITION: &str = "_model.json";

/// `record --gguf MODEL --text FILE`: a Llama GGUF decoder over text, prefill and greedy decode
/// with a KV cache; prints the perplexity and the weights dequantized to f32, and writes both
/// (with the hyperparameters) to `<out>.model.json`.
fn record_gguf(a: &RecordArgs, pipeline: &Pipeline, gguf: &std::path::Path) -> Result<()> {
    use opscope_lab::llama::job::{LlamaJob, Perplexity};
    let c = &a.corpus;
    let dataset = opscope::recording::is_dataset_path(&a.out);
    let side = model_sidecar(&a.out);
    if !dataset && side.exists() && !a.force && !opscope::recording::holds_recording(&a.out) {
        anyhow::bail!(
            "{} is there beside no recording at {}: a new model description would replace it; move it away, or pass --force",
            side.display(),
            a.out.display()
        );
    }
    let entries = c.entries()?;
    let job = LlamaJob::new(gguf, &entries, c.batch as usize, c.seq as usize, c.decode.unwrap_or(0) as usize)?;
    let options = rlx_runtime::CompileOptions::default();
    let (_, manifest) = opscope::activate::rewrite(pipeline, &job.graph(), a.stage, &options, 0)?;
    if manifest.sites.is_empty() {
        anyhow::bail!("nothing to record: the pipeline '{pipeline}' finds no site in {}", gguf.display());
    }
    let cfg = &job.model.config;
    say!(
        "{}: Llama, {} blocks, d_model {}, {} heads ({} KV heads, head width {}), SwiGLU {}, vocabulary {}, RoPE base {}",
        gguf.display(),
        cfg.layers,
        cfg.dim,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.ffn_dim,
        cfg.vocab,
        cfg.rope_base
    );
    let packed = job.model.notes.iter().filter(|n| n.bound_as == "packed").count();
    // Named, with the norm gains counted apart (a file with f32 projections lists them too).
    let (norms, rest): (Vec<_>, Vec<_>) = job.model.dequantized().into_iter().partition(|n| n.tensor.contains("_norm."));
    let mut deq: Vec<String> = rest.iter().take(6).map(|n| format!("{} ({})", n.tensor, n.ggml_type)).collect();
    if rest.len() > 6 {
        deq.push(format!("{} more", rest.len() - 6));
    }
    if !norms.is_empty() {
        deq.push(format!("{} norm gains", norms.len()));
    }
    say!("{packed} projections stay packed (DequantMatMul); dequantized to f32 on load: {}", deq.join(", "));

    let before = partitions_before(&a.out);
    check_out(a)?;
    let file = opscope::recording::open(&a.out)?;
    let summary = SummarySink::default();
    let sink = opscope::recording::Tee(vec![file, Box::new(summary.clone())]);
    let bar = ProgressBar::new(job.seqs.len() as u64)
        .with_style(ProgressStyle::with_template("{bar:40} {pos}/{len} sequences {elapsed} {msg}").context("progress template")?);
    interrupt_on_signals()?;
    let (seq, vocab) = (job.seq, cfg.vocab);
    let mut ppl = Perplexity::default();
    let mut samples: Vec<(String, String)> = Vec::new();
    let res = job.run(pipeline, a.stage, Box::new(sink), |rows, logits, cont| {
        for (i, r) in rows.iter().enumerate() {
            ppl.add(&logits[i * seq * vocab..(i + 1) * seq * vocab], vocab, r);
        }
        if samples.len() < 3 {
            if let (Some(r), Some(cn)) = (rows.first(), cont.first()) {
                if !cn.is_empty() {
                    samples.push((job.tokenizer.decode(r)?, job.tokenizer.decode(cn)?));
                }
            }
        }
        bar.inc(rows.len() as u64);
        bar.set_message(format!("perplexity {:.2}", ppl.value()));
        Ok(())
    });
    bar.finish();
    let recorded = res?;
    after_recording(&recorded, &a.out, || {
        format!("opscope: interrupted: the rows recorded so far are in {}", interrupted_rows(&a.out))
    });
    emit(&summary.table())?;
    write_side_outputs(pipeline, &a.out)?;
    for (p, cn) in &samples {
        say!("greedy: {:?} -> {:?}", p, cn);
    }
    say!(
        "perplexity {:.3} over {} next-token predictions in {} sequences (--seq {seq}; {} entries truncated; no BOS, as the GGUF asks)",
        ppl.value(),
        ppl.tokens,
        job.seqs.len(),
        job.truncated
    );
    #[derive(serde::Serialize)]
    struct ModelDoc<'a> {
        gguf: &'a std::path::Path,
        config: &'a opscope_lab::llama::LlamaConfig,
        weights: &'a [opscope_lab::llama::WeightNote],
        perplexity: f64,
        perplexity_nll_sum: f64,
        predictions: usize,
        sequences: usize,
        truncated: usize,
        seq: usize,
        decode: usize,
    }
    let doc = ModelDoc {
        gguf,
        config: cfg,
        weights: &job.model.notes,
        perplexity: ppl.value(),
        perplexity_nll_sum: ppl.nll,
        predictions: ppl.tokens,
        sequences: job.seqs.len(),
        truncated: job.truncated,
        seq,
        decode: job.decode,
    };
    // In a dataset: inside the partition this recording added (an appended recording keeps
    // each one's own).
    let side = if dataset {
        // The partition is named after the recording id (another process may append its own
        // beside it meanwhile).
        let ours = format!("recording={}", recorded.run_id);
        match partitions_before(&a.out).into_iter().find(|p| p.file_name().is_some_and(|n| n.to_string_lossy() == ours)) {
            Some(dir) => dir.join(MODEL_IN_PARTITION),
            None => anyhow::bail!(
                "{}: no partition {ours} after the recording, so its model description is not written",
                a.out.display()
            ),
        }
    } else {
        side
    };
    opscope::recording::write_atomic(&side, &serde_json::to_vec_pretty(&doc).context("model JSON")?)?;
    say!(
        "recorded {} sequences ({} per batch, {seq} tokens{}) with '{pipeline}' to {}; the model and its perplexity in {}",
        job.seqs.len(),
        job.batch.min(job.seqs.len()),
        if job.decode > 0 { format!(", {} greedy tokens: {} decode steps", job.decode, job.decode - 1) } else { String::new() },
        written_to(&a.out, &before),
        side.display()
    );
    Ok(())
}

/// `device` has a backend in this build and is present at run time.
///
/// Errors: not built in (names the feature to build with), or not available on this machine.
fn check_device(device: rlx_runtime::Device) -> Result<()> {
    if !rlx_runtime::registered_devices().contains(&device) {
        let built: Vec<&str> = rlx_runtime::registered_devices().iter().map(|d| d.as_arg()).collect();
        anyhow::bail!(
            "device '{}' is not built into this opscope (built in: {}): rebuild with RLX's backend, e.g. \
             `cargo build --release -p opscope-lab --features gpu` (wgpu: Vulkan, Metal, DX12) or `--features cuda`",
            device.as_arg(),
            built.join(", ")
        );
    }
    if !rlx_runtime::is_available(device) {
        anyhow::bail!("device '{}' is built in but not present on this machine (RLX's is_available says no)", device.as_arg());
    }
    Ok(())
}

fn record(a: RecordArgs) -> Result<()> {
    let pipeline = Pipeline::parse(&a.pipeline)?;
    if !pipeline.has_tap() {
        anyhow::bail!(
            "the pipeline '{pipeline}' has no tap: actuation passes change the model but record nothing; \
             add a tap after them, e.g. '{pipeline},residual' or '{pipeline},matmul'"
        );
    }
    let (batch, seq) = (a.corpus.batch as usize, a.corpus.seq as usize);
    // A bad --out fails before the model is imported; the file is created once the inputs
    // have loaded, so a failed start never touches an earlier recording.
    let c = &a.corpus;
    if c.decode.is_some() && c.gguf.is_none() {
        anyhow::bail!("--decode needs --gguf: ONNX encoders have no decoding");
    }
    let kind = if a.append { Output::RecordingAppend } else { Output::Recording };
    check_out(&a)?;
    check_capture_dir(&pipeline, &a.out)?;
    // Held until this recording ends: a second `record` into the same new path is refused.
    let _claim = opscope_lab::output::claim(&a.out, kind)?;
    check_device(a.device)?;
    if a.device != rlx_runtime::Device::Cpu && (c.inputs.is_some() || c.gguf.is_some()) {
        anyhow::bail!("--device {} applies to ONNX models (--onnx); --inputs and --gguf run on the CPU", a.device.as_arg());
    }
    if let Some(npz) = &c.inputs {
        return record_npz(&a, &pipeline, npz);
    }
    if let Some(gguf) = &c.gguf {
        return record_gguf(&a, &pipeline, gguf);
    }
    let entries = c.entries()?;
    let onnx = c.onnx()?;
    let job = Job::new(onnx, c.text_files()?.0, entries, batch, seq)?;
    // Dry run on the program that will be observed: a pipeline that does not fit the model
    // (skip of a block that does not exist) fails here, before any file is written, and taps
    // that find nothing are named.
    let options = rlx_runtime::CompileOptions::default();
    let (_, manifest) = opscope::activate::rewrite_on(&pipeline, job.graph(), a.stage, a.device, &options, 0)?;
    for skip in manifest.skipped.iter().filter(|_| a.device != rlx_runtime::Device::Cpu) {
        let role = skip.role.as_ref().map(|r| format!("/{}", r.as_str())).unwrap_or_default();
        eprintln!("opscope: on {}: {}{role}: {}", a.device.as_arg(), skip.site, skip.reason);
    }
    let idle = pipeline.idle_taps(&manifest);
    let lines: Vec<String> = idle
        .iter()
        .map(|(i, text, doc)| {
            // The sites the same pass finds with its default options, closest to the patterns.
            let instance = &pipeline.instances()[*i];
            let all = Pipeline::parse(instance.pass.name()).ok().and_then(|p| site_table(&p, job.graph(), a.stage).ok()).unwrap_or_default();
            let wanted = instance.options.value("sites").map(|v| v.to_string()).unwrap_or_default();
            let near = opscope::error::closest(&wanted, all.iter().map(|r| r[0].as_str()));
            let near: Vec<&str> = near.into_iter().take(5).collect();
            let hint = if near.is_empty() { String::new() } else { format!("; closest sites: {}", near.join(", ")) };
            format!(
                "pass {i} '{text}' found no site in {} (it looks for: {doc}){hint}; `opscope sites --onnx {} --pipeline {}` lists them",
                onnx.display(),
                onnx.display(),
                instance.pass.name()
            )
        })
        .collect();
    if idle.len() == pipeline.instances().iter().filter(|p| p.pass.kind() == opscope::PassKind::Tap).count() {
        anyhow::bail!("nothing to record:\n  {}", lines.join("\n  "));
    }
    for l in &lines {
        eprintln!("opscope: warning: {l}");
    }

    let before = partitions_before(&a.out);
    check_out(&a)?;
    let file = opscope::recording::open(&a.out)?;
    let summary = SummarySink::default();
    let sink = opscope::recording::Tee(vec![file, Box::new(summary.clone())]);
    let bar = ProgressBar::new(job.sentences() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} sentences {elapsed} {msg}")
            .context("progress template")?,
    );
    interrupt_on_signals()?;
    let mut done = 0usize;
    let res = job.run_on(a.device, &pipeline, a.stage, Box::new(sink), |sentences, _| {
        bar.inc(sentences as u64);
        done += sentences;
        Ok(())
    });
    bar.finish();
    let recorded = res?;
    after_recording(&recorded, &a.out, || {
        format!(
            "opscope: interrupted after {done} of {} text entries: the rows recorded so far are in {}",
            job.sentences(),
            interrupted_rows(&a.out)
        )
    });
    if summary.sites().is_empty() {
        // Sites were tapped (the manifests list them) but no run wrote a row: a `sample` stage
        // skipped every run of this job.
        let tapped: usize = opscope::recording::read_sidecar(&a.out)?.map_or(0, |s| s.graphs.iter().map(|g| g.sites.len()).sum());
        let sampled = pipeline.instances().iter().any(|i| i.pass.name() == "sample");
        if tapped > 0 && sampled {
            anyhow::bail!(
                "nothing was recorded: the pipeline '{pipeline}' tapped {tapped} site(s) but wrote no run: its `sample` stage \
                 records one run in `every` and skipped all {} run(s) of this job (the header-only recording is at {}); \
                 record more text or lower `every`",
                job.sentences().div_ceil(batch.max(1)),
                a.out.display()
            );
        }
        anyhow::bail!(
            "nothing was recorded: the pipeline '{pipeline}' matched no site in {} (the header-only \
             recording is at {}; run with --pipeline matmul to see every site's name)",
            onnx.display(),
            a.out.display()
        );
    }
    emit(&summary.table())?;
    write_side_outputs(&pipeline, &a.out)?;
    say!(
        "recorded {} text entries ({} per batch, {} tokens, {}) with '{}' to {}",
        job.sentences(),
        batch.min(job.sentences()),
        seq,
        match job.truncated() {
            0 => "none longer".to_string(),
            n => format!("{n} longer, cut to {seq}: pass --seq to run more of them"),
        },
        pipeline,
        written_to(&a.out, &before)
    );
    Ok(())
}

fn main() -> ExitCode {
    // A write past the file-size limit (`ulimit -f`) raises SIGXFSZ, whose default action ends
    // the process without a word; ignored, the write fails with EFBIG and the recording says
    // which file, and that the parts closed before it are intact.
    // SAFETY: setting a signal's disposition to SIG_IGN, before any thread is started.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Passes => passes(),
        Cmd::Record(a) => record(a),
        Cmd::Sweep(a) => sweep(a),
        Cmd::Mine(a) => mine(a),
        Cmd::Report(a) => report(a),
        Cmd::Diff(a) => diff(a),
        Cmd::Compare(a) => compare(a),
        Cmd::Measure(a) => measure(a),
        Cmd::Sites(a) => sites(a),
        Cmd::Parity(a) => parity(a),
        Cmd::Memo(a) => memo(a),
        Cmd::Cost(a) => cost(a),
        Cmd::Calibrate(a) => calibrate(a),
        Cmd::Ab(a) => ab(a),
        Cmd::Time(a) => time(a),
        Cmd::Blocks(a) => blocks(a),
        Cmd::Plan(a) => plan(a),
        Cmd::Probe(a) => probe(a),
    };
    let code = match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            note(&format!("opscope: {e:#}"));
            ExitCode::FAILURE
        }
    };
    // A signal during a job's last batch let the command finish what follows its recording
    // (`after_recording`); the process now ends by it.
    if INTERRUPTED.load(Ordering::SeqCst) {
        exit_interrupted();
    }
    code
}
