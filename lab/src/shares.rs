//! Per-site and per-op-kind **time shares** of the deployed (fused) graph, with bootstrap
//! confidence intervals: what `opscope time` prints and writes, and what `opscope mine
//! --time-shares` weighs payoffs by.
//!
//! RLX has no per-op timing API, so a share must come from programs that RLX does run. Two
//! methods are open: *isolated* nodes (each deployed node alone as a one-node program) and
//! *differential* runs (the whole graph minus one site). This module uses **isolated nodes**:
//! - a differential run removes a node whose output others read, so the graph must be cut and
//!   fed, which changes fusion and buffer reuse around the cut; and the difference of two whole
//!   -graph times (each of them ~100x a small node) has a standard error far above a small
//!   node's time, so most sites would get an interval spanning 0;
//! - an isolated node is timed directly, its noise is its own, and the machinery exists: the
//!   parity check already builds every deployed node as a one-node program fed the real values
//!   of its operands ([`crate::parity::one_node`], [`crate::parity::reference_values`]).
//!
//! The method:
//! 1. The deployed graph is the source graph fused as RLX fuses it for the CPU
//!    (`opscope::activate::fuse` with the caller's compile options); every node but inputs,
//!    parameters and constants is built alone with its operands as **parameters** bound once to
//!    their reference values (resident in the arena, as a weight or a producer's output is in
//!    the whole program: no copy-in per run) and run with `run_raw` (no copy-out).
//! 2. **Rounds**: one round runs every node once and the whole program once; the node order is
//!    forward in even rounds and reversed in odd ones, and the whole program runs first in even
//!    rounds and last in odd ones, so drift of the machine (frequency, other load) hits every
//!    node alike (the interleaving of [`crate::timing`], across many programs).
//! 3. **Warm-up** rounds (at least [`MIN_WARMUP_ROUNDS`], for [`ShareOptions::warmup`]) are run
//!    and dropped; their median duration sets the number of measured rounds from the budget,
//!    clamped to `[min_rounds, max_rounds]`.
//! 4. **Estimate**: per node the median of its round times (a time distribution is skewed to
//!    the right; the median ignores preemptions without a fence); a site's share is its median
//!    over the sum of the medians of every node; an op kind's share is the sum of its nodes'.
//! 5. **Interval**: percentile bootstrap over ROUNDS (Efron & Tibshirani 1993, ch. 13): draw
//!    `rounds` round indices with replacement, recompute every median and share from the drawn
//!    rounds, take the `(1-c)/2` and `(1+c)/2` quantiles of each share (ChaCha8 seeded). A round
//!    is the unit of resampling because the nodes of one round share the machine's state.
//! 6. **Sum check**: `sum of isolated medians / median whole-program time`, with its bootstrap
//!    interval. Isolated timing adds per-run costs the whole program pays once (dispatch, the
//!    thread pool waking for each small kernel, zeroing the node's scratch) and loses what the
//!    whole program gains or pays between nodes (a producer's output still in cache, fusion
//!    across the node boundary); when the ratio is beyond [`SUM_CHECK_LIMIT`] (or below its
//!    inverse) the report carries a warning: shares of small nodes are then inflated relative to
//!    large ones.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rlx_ir::Op;
use rlx_runtime::{CompileOptions, Device, Session};
use serde::{Deserialize, Serialize};

use crate::parity::{one_node, reference_values, Operands, ParityInput};
use crate::timing::{median, quantile};

/// Fewest warm-up rounds: the first run of a compiled RLX program pays its lazy set-up.
pub const MIN_WARMUP_ROUNDS: usize = 2;

/// Fewest measured rounds accepted: below this the bootstrap distribution of a median takes
/// only a handful of values.
pub const MIN_ROUNDS: usize = 10;

/// The sum check's limit: `sum(isolated) / whole` above this (or below its inverse) is reported
/// as a warning. 1.5 is opscope's line (the brief of issue 14): beyond it, per-node overheads or
/// lost cache reuse are a large part of the isolated times and shares of small nodes are
/// inflated.
pub const SUM_CHECK_LIMIT: f64 = 1.5;

/// [`TimeShares::method`].
pub const METHOD: &str = "every deployed node alone as a one-node RLX program, operands bound once as parameters to \
their reference values, run without copy-in or copy-out; rounds of every node plus the whole program, node order \
reversed every other round; per node the median over rounds; share = median / sum of medians; percentile \
bootstrap over rounds, ChaCha8 seeded; sum check = sum of isolated medians / whole-program median";

/// How to time the shares.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ShareOptions {
    /// Time spent in warm-up rounds before measuring.
    pub warmup: Duration,
    /// Time the measured rounds should take together; sets the round count.
    pub budget: Duration,
    /// Fewest measured rounds (>= [`MIN_ROUNDS`]).
    pub min_rounds: usize,
    /// Most measured rounds.
    pub max_rounds: usize,
    /// Bootstrap resamples (>= 100).
    pub resamples: usize,
    /// Confidence level of the intervals, in (0, 1).
    pub confidence: f64,
    /// Seed of the bootstrap's ChaCha8 generator.
    pub seed: u64,
}

impl Default for ShareOptions {
    /// 1 s warm-up, 10 s budget, 10..=2000 rounds, 2000 resamples, 95% confidence, seed 0.
    fn default() -> ShareOptions {
        ShareOptions {
            warmup: Duration::from_secs(1),
            budget: Duration::from_secs(10),
            min_rounds: MIN_ROUNDS,
            max_rounds: 2000,
            resamples: 2000,
            confidence: 0.95,
            seed: 0,
        }
    }
}

impl ShareOptions {
    /// Errors: a count or level out of range, named with its bounds.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.min_rounds >= MIN_ROUNDS, "min_rounds {} is below {MIN_ROUNDS}: a median of fewer rounds has no usable bootstrap", self.min_rounds);
        ensure!(self.max_rounds >= self.min_rounds, "max_rounds {} is below min_rounds {}", self.max_rounds, self.min_rounds);
        ensure!(self.resamples >= 100, "resamples {} is below 100: the interval's end points would be single resamples", self.resamples);
        ensure!(
            self.confidence > 0.0 && self.confidence < 1.0,
            "confidence {} is not in (0, 1) (e.g. 0.95 for a 95% interval)",
            self.confidence
        );
        Ok(())
    }
}

/// One site (one deployed node) of [`TimeShares`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SiteTime {
    /// Site name, as recordings name it (`opscope::analysis::site_names` of the deployed graph
    /// against the source graph).
    pub site: String,
    /// Op kind, as RLX prints it (`matmul`, `fused_residual_ln`).
    pub op: String,
    /// Node id in the deployed graph.
    pub node: u32,
    /// Median time of the node alone, seconds.
    pub median_s: f64,
    /// Share of the sum of all nodes' medians, in [0, 1].
    pub share: f64,
    /// Lower end of the share's bootstrap interval.
    pub share_ci_low: f64,
    /// Upper end of the share's bootstrap interval.
    pub share_ci_high: f64,
    /// FLOPs of one execution (`opscope::analysis::cost`), `None` when not modelled.
    pub flops: Option<u64>,
    /// Share of the graph's modelled FLOPs, in [0, 1] (0 when not modelled).
    pub flop_share: f64,
    /// Bytes one execution moves (`opscope::analysis::cost`: operands, weights at their stored
    /// width, output); `None` from [`analyze`] alone and in files written before it was recorded.
    /// `bytes / median_s` is the node's achieved bandwidth, to hold against the roof at its
    /// working set (`opscope_lab::cost::MachineProbe::roof_at`).
    #[serde(default)]
    pub bytes: Option<u64>,
}

/// One op kind of [`TimeShares`]: the sum over its nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindTime {
    /// Op kind.
    pub op: String,
    /// Nodes of this kind.
    pub nodes: usize,
    /// Sum of its nodes' median times, seconds.
    pub median_s: f64,
    /// Share of the sum of all nodes' medians.
    pub share: f64,
    /// Lower end of the share's bootstrap interval.
    pub share_ci_low: f64,
    /// Upper end of the share's bootstrap interval.
    pub share_ci_high: f64,
    /// Share of the graph's modelled FLOPs.
    pub flop_share: f64,
}

/// What [`time_shares`] measured: the JSON of `opscope time --json` (stable: `opscope mine
/// --time-shares` and the report read `sites[].site` and `sites[].share`; [`TimeShares::load`]
/// reads the whole document back). Times in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimeShares {
    /// Graph name.
    pub graph: String,
    /// The method, in words.
    pub method: String,
    /// Measured rounds.
    pub rounds: usize,
    /// Warm-up rounds run (dropped).
    pub warmup_rounds: usize,
    /// Confidence level of the intervals.
    pub confidence: f64,
    /// Bootstrap resamples.
    pub resamples: usize,
    /// Seed of the bootstrap generator.
    pub seed: u64,
    /// Median time of the whole compiled program (inputs in, outputs out), seconds.
    pub whole_median_s: f64,
    /// Sum of the nodes' median times, seconds.
    pub isolated_sum_s: f64,
    /// `isolated_sum_s / whole_median_s`.
    pub sum_over_whole: f64,
    /// Lower end of the bootstrap interval of `sum_over_whole`.
    pub sum_over_whole_ci_low: f64,
    /// Upper end of the bootstrap interval of `sum_over_whole`.
    pub sum_over_whole_ci_high: f64,
    /// Set when `sum_over_whole` is beyond [`SUM_CHECK_LIMIT`] or below its inverse: what it
    /// means for the shares.
    pub warning: Option<String>,
    /// Per site, by share (highest first).
    pub sites: Vec<SiteTime>,
    /// Per op kind, by share (highest first).
    pub kinds: Vec<KindTime>,
}

/// One timed program: a closure running it once.
type Runner<'a> = Box<dyn FnMut() + 'a>;

/// Measured round times `times[node][round]` and `whole[round]`; the bootstrap and the report.
///
/// `nodes` gives, per timed node, (site, op, node id, FLOPs). Errors: lengths disagree, fewer
/// than [`MIN_ROUNDS`] rounds, a time not finite and positive, invalid options.
pub fn analyze(
    graph: &str,
    nodes: &[(String, String, u32, Option<u64>)],
    times: &[Vec<f64>],
    whole: &[f64],
    opts: &ShareOptions,
    warmup_rounds: usize,
) -> Result<TimeShares> {
    opts.validate()?;
    ensure!(!nodes.is_empty(), "graph {graph} has no compute node to time");
    ensure!(times.len() == nodes.len(), "{} node time series for {} nodes", times.len(), nodes.len());
    let rounds = whole.len();
    ensure!(rounds >= MIN_ROUNDS, "{rounds} round(s) measured; at least {MIN_ROUNDS} are needed: raise the time budget");
    for (t, n) in times.iter().zip(nodes) {
        ensure!(t.len() == rounds, "node {} has {} times for {rounds} rounds", n.0, t.len());
    }
    if let Some(v) = times.iter().flatten().chain(whole).find(|v| !(v.is_finite() && **v > 0.0)) {
        bail!("a time of {v} s: times must be finite and positive");
    }
    // Kinds in order of first appearance; node -> kind index.
    let mut kind_names: Vec<String> = Vec::new();
    let kind_of: Vec<usize> = nodes
        .iter()
        .map(|n| match kind_names.iter().position(|k| *k == n.1) {
            Some(i) => i,
            None => {
                kind_names.push(n.1.clone());
                kind_names.len() - 1
            }
        })
        .collect();
    let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
    let sum: f64 = medians.iter().sum();
    let whole_median = median(whole);
    let mut kind_median = vec![0.0; kind_names.len()];
    for (k, m) in kind_of.iter().zip(&medians) {
        kind_median[*k] += m;
    }

    // Bootstrap over rounds.
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut idx = vec![0usize; rounds];
    let mut scratch = Vec::with_capacity(rounds);
    let mut node_shares: Vec<Vec<f64>> = vec![Vec::with_capacity(opts.resamples); nodes.len()];
    let mut kind_shares: Vec<Vec<f64>> = vec![Vec::with_capacity(opts.resamples); kind_names.len()];
    let mut ratios = Vec::with_capacity(opts.resamples);
    let mut med = vec![0.0; nodes.len()];
    let mut kind_sum = vec![0.0; kind_names.len()];
    let mut drawn_median = |x: &[f64], idx: &[usize]| {
        scratch.clear();
        scratch.extend(idx.iter().map(|&i| x[i]));
        median(&scratch)
    };
    for _ in 0..opts.resamples {
        for i in idx.iter_mut() {
            *i = rng.gen_range(0..rounds);
        }
        kind_sum.iter_mut().for_each(|k| *k = 0.0);
        for (j, t) in times.iter().enumerate() {
            med[j] = drawn_median(t, &idx);
            kind_sum[kind_of[j]] += med[j];
        }
        let s: f64 = med.iter().sum();
        for (j, m) in med.iter().enumerate() {
            node_shares[j].push(m / s);
        }
        for (k, m) in kind_sum.iter().enumerate() {
            kind_shares[k].push(m / s);
        }
        ratios.push(s / drawn_median(whole, &idx));
    }
    let alpha = 1.0 - opts.confidence;
    let ci = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (quantile(v, alpha / 2.0), quantile(v, 1.0 - alpha / 2.0))
    };
    let total_flops: u64 = nodes.iter().filter_map(|n| n.3).sum();
    let flop_share = |f: u64| if total_flops > 0 { f as f64 / total_flops as f64 } else { 0.0 };
    let mut sites: Vec<SiteTime> = nodes
        .iter()
        .zip(&medians)
        .zip(node_shares.iter_mut())
        .map(|((n, &m), b)| {
            let (lo, hi) = ci(b);
            SiteTime {
                site: n.0.clone(),
                op: n.1.clone(),
                node: n.2,
                median_s: m,
                share: m / sum,
                share_ci_low: lo,
                share_ci_high: hi,
                flops: n.3,
                flop_share: flop_share(n.3.unwrap_or(0)),
                bytes: None,
            }
        })
        .collect();
    sites.sort_by(|a, b| b.share.total_cmp(&a.share).then(a.node.cmp(&b.node)));
    let mut kinds: Vec<KindTime> = kind_names
        .iter()
        .enumerate()
        .map(|(k, name)| {
            let (lo, hi) = ci(&mut kind_shares[k]);
            let members = || nodes.iter().zip(&kind_of).filter(move |(_, &x)| x == k).map(|(n, _)| n);
            KindTime {
                op: name.clone(),
                nodes: members().count(),
                median_s: kind_median[k],
                share: kind_median[k] / sum,
                share_ci_low: lo,
                share_ci_high: hi,
                flop_share: flop_share(members().filter_map(|n| n.3).sum()),
            }
        })
        .collect();
    kinds.sort_by(|a, b| b.share.total_cmp(&a.share).then(a.op.cmp(&b.op)));
    let (rlo, rhi) = ci(&mut ratios);
    let ratio = sum / whole_median;
    let warning = if ratio > SUM_CHECK_LIMIT {
        Some(format!(
            "the nodes timed alone take {ratio:.2}x the whole program (limit {SUM_CHECK_LIMIT}): per-run costs each isolated \
             node pays (dispatch, waking the thread pool, zeroing its scratch) or cache reuse the whole program has between \
             nodes are a large part of the isolated times, so shares of small nodes are inflated relative to large ones"
        ))
    } else if ratio < 1.0 / SUM_CHECK_LIMIT {
        Some(format!(
            "the nodes timed alone take only {ratio:.2}x the whole program (limit 1/{SUM_CHECK_LIMIT}): the whole program \
             pays costs no isolated node does (copying inputs and outputs, nodes not timed, memory traffic between nodes)"
        ))
    } else {
        None
    };
    Ok(TimeShares {
        graph: graph.to_string(),
        method: METHOD.to_string(),
        rounds,
        warmup_rounds,
        confidence: opts.confidence,
        resamples: opts.resamples,
        seed: opts.seed,
        whole_median_s: whole_median,
        isolated_sum_s: sum,
        sum_over_whole: ratio,
        sum_over_whole_ci_low: rlo,
        sum_over_whole_ci_high: rhi,
        warning,
        sites,
        kinds,
    })
}

/// Time every node of the deployed graph of `input` alone, and the whole program, in rounds;
/// shares with bootstrap intervals (see the module doc). `bindings` sizes symbolic dims for the
/// FLOP counts (`opscope::analysis::cost::Bindings::none()` for a static graph).
///
/// Errors: an input or parameter has no value; a node alone fails to give one output; costing
/// the deployed graph fails (an unbound dim); invalid options; as [`analyze`].
pub fn time_shares(input: &ParityInput, bindings: &opscope::analysis::cost::Bindings, opts: &ShareOptions) -> Result<TimeShares> {
    opts.validate()?;
    let deployed = opscope::activate::fuse(&input.graph, Device::Cpu, &input.options);
    let cost = opscope::analysis::cost::graph_cost(&deployed, Some(&input.graph), bindings).context("costing the deployed graph")?;
    let flops: HashMap<u32, Option<u64>> = cost.nodes.iter().map(|n| (n.node, n.flops)).collect();
    let bytes: HashMap<u32, u64> = cost.nodes.iter().map(|n| (n.node, n.bytes.total())).collect();
    let (names, _) = opscope::analysis::site_names(&deployed, Some(&input.graph));
    let values = reference_values(&deployed, input).context("computing every node's operands")?;
    let session = Session::new(Device::Cpu);

    let mut nodes = Vec::new();
    let mut programs = Vec::new();
    for n in deployed.nodes() {
        if matches!(n.op, Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }) {
            continue;
        }
        let mut c = session.compile_with(one_node(&deployed, n, Operands::Params), &CompileOptions::new());
        for (j, i) in n.inputs.iter().enumerate() {
            let (bytes, dtype) = &values[&i.0];
            c.set_param_typed(&format!("operand{j}"), bytes, *dtype);
        }
        let site = names.get(&n.id.0).cloned().unwrap_or_else(|| format!("node{}", n.id.0));
        nodes.push((site, opscope::analysis::op_name(&n.op), n.id.0, flops.get(&n.id.0).copied().flatten()));
        programs.push(c);
    }
    ensure!(!programs.is_empty(), "graph {} has no compute node to time", deployed.name);
    let mut runners: Vec<Runner> = programs
        .iter_mut()
        .map(|c| -> Runner {
            Box::new(move || {
                std::hint::black_box(c.run_raw(&[]));
            })
        })
        .collect();
    let params: HashMap<&str, &crate::parity::Typed> = input.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut whole_prog = crate::parity::compile(&session, input.graph.clone(), &input.options, &params);
    let mut whole: Runner = Box::new(|| {
        std::hint::black_box(crate::parity::run(&mut whole_prog, &input.inputs));
    });
    let (times, whole_times, warm) = run_rounds(&mut runners, &mut whole, opts);
    drop(runners);
    drop(whole);
    let mut shares = analyze(&deployed.name, &nodes, &times, &whole_times, opts, warm)?;
    for s in &mut shares.sites {
        s.bytes = bytes.get(&s.node).copied();
    }
    Ok(shares)
}

/// Run rounds (see the module doc, steps 2-3): warm-up, then as many rounds as the budget
/// allows. Returns `times[node][round]`, `whole[round]` and the warm-up round count.
fn run_rounds(nodes: &mut [Runner], whole: &mut Runner, opts: &ShareOptions) -> (Vec<Vec<f64>>, Vec<f64>, usize) {
    let time = |f: &mut Runner| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    let round = |r: usize, nodes: &mut [Runner], whole: &mut Runner, out: Option<(&mut Vec<Vec<f64>>, &mut Vec<f64>)>| {
        let mut t = vec![0.0; nodes.len()];
        let even = r % 2 == 0;
        let w0 = if even { time(whole) } else { 0.0 };
        for k in 0..nodes.len() {
            let j = if even { k } else { nodes.len() - 1 - k };
            t[j] = time(&mut nodes[j]);
        }
        let w = if even { w0 } else { time(whole) };
        let total = t.iter().sum::<f64>() + w;
        if let Some((times, wt)) = out {
            for (j, x) in t.into_iter().enumerate() {
                times[j].push(x);
            }
            wt.push(w);
        }
        total
    };
    let start = Instant::now();
    let mut warm = Vec::new();
    while warm.len() < MIN_WARMUP_ROUNDS || start.elapsed() < opts.warmup {
        warm.push(round(warm.len(), nodes, whole, None));
    }
    let per_round = median(&warm).max(1e-9);
    let rounds = ((opts.budget.as_secs_f64() / per_round) as usize).clamp(opts.min_rounds, opts.max_rounds);
    let mut times = vec![Vec::with_capacity(rounds); nodes.len()];
    let mut whole_times = Vec::with_capacity(rounds);
    for r in 0..rounds {
        round(r, nodes, whole, Some((&mut times, &mut whole_times)));
    }
    (times, whole_times, warm.len())
}

impl TimeShares {
    /// The report as text: the method, the whole-program time and the sum check (with the
    /// warning when there is one), the top `top` sites and every op kind, shares in percent
    /// with their intervals beside the FLOP share.
    pub fn text(&self, top: usize) -> String {
        let pct = |x: f64| format!("{:.2}", 100.0 * x);
        let mut s = format!(
            "time shares of {} ({} rounds after {} warm-up; {:.0}% percentile bootstrap over rounds, {} resamples)\n\
             whole program: median {:.4} ms; sum of the nodes alone: {:.4} ms; sum / whole = {:.3} [{:.3}, {:.3}]\n",
            self.graph,
            self.rounds,
            self.warmup_rounds,
            self.confidence * 100.0,
            self.resamples,
            self.whole_median_s * 1e3,
            self.isolated_sum_s * 1e3,
            self.sum_over_whole,
            self.sum_over_whole_ci_low,
            self.sum_over_whole_ci_high
        );
        if let Some(w) = &self.warning {
            s.push_str(&format!("WARNING: {w}\n"));
        }
        s.push_str("\n| op kind | nodes | median ms | time share % | 95% CI | FLOP share % |\n|---|---|---|---|---|---|\n");
        for k in &self.kinds {
            s.push_str(&format!(
                "| {} | {} | {:.4} | {} | [{}, {}] | {} |\n",
                k.op,
                k.nodes,
                k.median_s * 1e3,
                pct(k.share),
                pct(k.share_ci_low),
                pct(k.share_ci_high),
                pct(k.flop_share)
            ));
        }
        let names: Vec<&str> = self.sites.iter().map(|t| t.site.as_str()).collect();
        let prefix = if names.len() > 1 { crate::summary::common_prefix(&names) } else { "" };
        if !prefix.is_empty() {
            s.push_str(&format!("\nsites below are named without their common prefix '{prefix}' (the JSON has full names)"));
        }
        s.push_str("\n| site | op | median ms | time share % | CI | FLOP share % |\n|---|---|---|---|---|---|\n");
        for t in self.sites.iter().take(if top == 0 { usize::MAX } else { top }) {
            s.push_str(&format!(
                "| {} | {} | {:.4} | {} | [{}, {}] | {} |\n",
                t.site.replace(prefix, ""),
                t.op,
                t.median_s * 1e3,
                pct(t.share),
                pct(t.share_ci_low),
                pct(t.share_ci_high),
                pct(t.flop_share)
            ));
        }
        s
    }

    /// Read the JSON `opscope time --json` wrote.
    ///
    /// Errors: the file is unreadable or not that JSON (named, with the command that writes it).
    pub fn load(path: &std::path::Path) -> Result<TimeShares> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading time shares {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not the JSON of `opscope time --json`; write one with `opscope time ... --json FILE`", path.display()))
    }

    /// Site -> share, for the miner (`opscope::mine::TimeShares::from_sites`).
    pub fn by_site(&self) -> BTreeMap<String, f64> {
        self.sites.iter().map(|s| (s.site.clone(), s.share)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<(String, String, u32, Option<u64>)> {
        (0..n).map(|i| (format!("s{i}"), if i == 0 { "matmul".into() } else { "add".into() }, i as u32, Some(10))).collect()
    }

    #[test]
    fn shares_are_medians_over_their_sum() {
        // Node 0 takes 3 ms, node 1 1 ms in every round: shares 0.75 and 0.25 exactly, and every
        // resample gives the same (no spread).
        let t = vec![vec![3e-3; 12], vec![1e-3; 12]];
        let r = analyze("g", &nodes(2), &t, &[2e-3; 12], &ShareOptions { resamples: 200, ..Default::default() }, 2).unwrap();
        assert_eq!(r.sites[0].site, "s0");
        assert!((r.sites[0].share - 0.75).abs() < 1e-12 && (r.sites[1].share - 0.25).abs() < 1e-12);
        assert!((r.sites[0].share_ci_low - 0.75).abs() < 1e-12 && (r.sites[0].share_ci_high - 0.75).abs() < 1e-12);
        assert!((r.sum_over_whole - 2.0).abs() < 1e-12);
        assert!(r.warning.as_deref().is_some_and(|w| w.contains("2.00x")));
        assert_eq!(r.kinds.len(), 2);
        assert!((r.sites[0].flop_share - 0.5).abs() < 1e-12);
    }

    #[test]
    fn bad_input_is_named() {
        let t = vec![vec![1e-3; 5]];
        let e = analyze("g", &nodes(1), &t, &[1e-3; 5], &ShareOptions::default(), 0).unwrap_err();
        assert!(e.to_string().contains("raise the time budget"), "{e}");
        let mut t = vec![vec![1e-3; 12]];
        t[0][3] = 0.0;
        let e = analyze("g", &nodes(1), &t, &[1e-3; 12], &ShareOptions::default(), 0).unwrap_err();
        assert!(e.to_string().contains("finite and positive"), "{e}");
    }
}
