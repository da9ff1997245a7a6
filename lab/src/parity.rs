//! Parity: which node of a compiled program first computes something other than its op.
//!
//! The reference runs the deployed (fused) graph op by op: every node alone in a one-node RLX
//! program, fed the reference values of its operands, so no fusion, buffer reuse or in-place
//! trick spans two nodes. The candidate is the program as RLX compiles it. When the caller's
//! outputs differ beyond the tolerance, the nodes are scanned in execution order: for node `k`
//! the deployed graph is compiled again with `k` as one extra output and `k`'s value is compared
//! with the reference. The first node outside the tolerance is reported. Exposing `k` keeps only
//! `k`'s own buffer alive, so a fault in how a node reads its operands (a buffer reused too early,
//! a wrong in-place read) still shows at that node; a fault that exposing the node itself hides
//! is reported as "outputs differ, no single node diverges".
//!
//! **Search.** The scan in execution order compiles the program once per node up to the first
//! divergent one. Bisection ([`Search::Bisect`], the default) compiles it O(log n) times: among
//! the ancestors of a divergent output, in execution order, it finds by binary search the
//! earliest node that diverges when exposed, assuming a divergence propagates to what reads it.
//! That assumption is then checked, not trusted: every operand of the node found is exposed, and
//! if one diverges the search restarts among that operand's ancestors. It ends at a node whose
//! operands all agree with the reference and whose own value does not: the fault is in that
//! node, whatever order the divergences appeared in (with several independent faults, it finds
//! one of them; the linear scan finds the earliest in execution order).
//!
//! **A rewrite against the original.** With a pipeline ([`Check::pipeline`]) the candidate is
//! the deployed graph rewritten by opscope (a tap pipeline: tapped against untapped, where every
//! caller output and node must agree to 0 ULPs; an actuation: where the rewrite first changes
//! a value beyond the tolerance). The reference stays the original deployed graph op by op;
//! nodes are matched through the rewrite's node map ([`opscope::Pipeline::apply_mapped`]), and
//! a node an actuation removed is not compared.
//!
//! Distances: the absolute difference, and the distance in units in the last place (ULPs) of
//! f32 (adjacent floats differ by 1; +0 and -0 by 0). A node diverges when
//! `max |cand - ref| > atol + rtol * max |ref|` (a tensor-level `numpy.allclose`); defaults
//! `rtol = 1e-4`, `atol = 1e-6` (fusion reorders sums; measured differences of fused vs op-by-op
//! programs on MiniLM are far below this).

use anyhow::{bail, Context, Result};
use rlx_ir::{DType, Graph, NodeId, Op};
use rlx_runtime::{CompileOptions, Device, Session};
use serde::Serialize;

use std::collections::HashMap;

/// A typed buffer: little-endian bytes and their dtype, as `run_typed` takes and returns them.
pub type Typed = (Vec<u8>, DType);

/// What a parity check runs on.
pub struct ParityInput {
    /// The program as the caller builds it (the source graph).
    pub graph: Graph,
    /// Parameter values by name.
    pub params: Vec<(String, Typed)>,
    /// Input values by name.
    pub inputs: Vec<(String, Typed)>,
    /// Options RLX compiles the candidate with.
    pub options: CompileOptions,
    /// Device the candidate is compiled for and run on (its deployed graph is fused as that
    /// device fuses); the reference always runs op by op on the CPU. Another device than the
    /// CPU compares two backends: `opscope parity --device gpu`.
    pub device: Device,
}

/// Tolerance of the comparison (see the module docs).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tolerance {
    /// Relative to the reference tensor's max |x|.
    pub rtol: f64,
    /// Absolute.
    pub atol: f64,
}

impl Default for Tolerance {
    fn default() -> Tolerance {
        Tolerance { rtol: 1e-4, atol: 1e-6 }
    }
}

/// How the divergent node is searched for (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Search {
    /// Every node in execution order up to the first that diverges (one compile per node).
    Linear,
    /// Binary search over the ancestors of a divergent output, checked at the node found
    /// (O(log n) compiles on a chain).
    Bisect,
}

/// What a parity check compares, beyond its input.
#[derive(Debug, Clone)]
pub struct Check {
    /// Tolerance.
    pub tol: Tolerance,
    /// Search for the divergent node.
    pub search: Search,
    /// An opscope pipeline applied to the deployed graph to make the candidate (a rewrite or a
    /// tap against the original program); `None`: the program as RLX compiles it.
    pub pipeline: Option<opscope::Pipeline>,
}

impl Check {
    /// The default search ([`Search::Bisect`]) and no pipeline, at `tol`.
    pub fn new(tol: Tolerance) -> Check {
        Check { tol, search: Search::Bisect, pipeline: None }
    }
}

/// One compared tensor.
#[derive(Debug, Clone, Serialize)]
pub struct Compared {
    /// Node id in the deployed graph.
    pub node: u32,
    /// Op, as RLX prints it.
    pub op: String,
    /// Node name, if any.
    pub name: Option<String>,
    /// Elements compared.
    pub numel: usize,
    /// Largest |candidate - reference|.
    pub max_abs: f64,
    /// Largest |reference|.
    pub ref_absmax: f64,
    /// Largest distance in f32 ULPs (`None` for integer tensors).
    pub max_ulps: Option<u64>,
    /// Elements where exactly one side is NaN.
    pub nan_mismatch: usize,
    /// Outside the tolerance.
    pub diverges: bool,
}

/// The outcome of a parity check.
#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    /// Graph name.
    pub graph: String,
    /// Nodes of the deployed graph (inputs and parameters included).
    pub deployed_nodes: usize,
    /// Tolerance used.
    pub tolerance: Tolerance,
    /// The caller's outputs: candidate against the op-by-op reference.
    pub outputs: Vec<Compared>,
    /// The pipeline that rewrote the candidate, if any.
    pub pipeline: Option<String>,
    /// How the divergent node was searched for.
    pub search: Search,
    /// Nodes exposed when an output diverged, in the order they were compiled and compared.
    pub scanned: Vec<Compared>,
    /// The divergent node the search ended at: with [`Search::Linear`] the first in execution
    /// order; with [`Search::Bisect`] one whose operands all agree with the reference.
    pub first_divergent: Option<Compared>,
}

impl ParityReport {
    /// True when every caller output is within the tolerance.
    pub fn outputs_agree(&self) -> bool {
        self.outputs.iter().all(|c| !c.diverges)
    }
}

/// f32 bit patterns ordered as the reals: adjacent floats differ by 1, -0 and +0 map to 0.
fn ordered(x: f32) -> i64 {
    let b = x.to_bits() as i32 as i64;
    if b < 0 {
        -(b & 0x7fff_ffff)
    } else {
        b
    }
}

fn values(t: &Typed) -> Result<Vec<f64>> {
    crate::model::decode(&t.0, t.1)
}

fn compare(node: u32, g: &Graph, cand: &Typed, reference: &Typed, tol: Tolerance) -> Result<Compared> {
    let n = g.node(NodeId(node));
    if cand.1 != reference.1 {
        bail!("node %{node} ({}): candidate dtype {:?}, reference {:?}", n.op, cand.1, reference.1);
    }
    let (a, r) = (values(cand)?, values(reference)?);
    if a.len() != r.len() {
        bail!("node %{node} ({}): candidate has {} values, reference {}", n.op, a.len(), r.len());
    }
    let float = cand.1 == DType::F32;
    let (mut max_abs, mut ref_absmax, mut max_ulps, mut nan_mismatch) = (0f64, 0f64, 0u64, 0usize);
    for (&x, &y) in a.iter().zip(&r) {
        if x.is_nan() || y.is_nan() {
            nan_mismatch += (x.is_nan() != y.is_nan()) as usize;
            continue;
        }
        if y.is_finite() {
            ref_absmax = ref_absmax.max(y.abs());
        }
        let d = if x == y { 0.0 } else { (x - y).abs() };
        max_abs = max_abs.max(if d.is_nan() { f64::INFINITY } else { d });
        if float {
            max_ulps = max_ulps.max(ordered(x as f32).abs_diff(ordered(y as f32)));
        }
    }
    let diverges = nan_mismatch > 0 || max_abs > tol.atol + tol.rtol * ref_absmax;
    Ok(Compared {
        node,
        op: n.op.to_string(),
        name: n.name.clone(),
        numel: a.len(),
        max_abs,
        ref_absmax,
        max_ulps: float.then_some(max_ulps),
        nan_mismatch,
        diverges,
    })
}

pub(crate) fn compile(session: &Session, g: Graph, options: &CompileOptions, params: &HashMap<&str, &Typed>) -> rlx_runtime::CompiledGraph {
    let names: Vec<String> = g.nodes().iter().filter_map(|n| match &n.op {
        Op::Param { name } => Some(name.clone()),
        _ => None,
    }).collect();
    let mut c = session.compile_with(g, options);
    for name in names {
        if let Some((bytes, dtype)) = params.get(name.as_str()) {
            c.set_param_typed(&name, bytes, *dtype);
        }
    }
    c
}

pub(crate) fn run(c: &mut rlx_runtime::CompiledGraph, inputs: &[(String, Typed)]) -> Vec<Typed> {
    let feeds: Vec<(&str, &[u8], DType)> = inputs.iter().map(|(n, (b, d))| (n.as_str(), b.as_slice(), *d)).collect();
    c.run_typed(&feeds)
}

/// How a one-node program ([`one_node`]) takes its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operands {
    /// Each operand an `Input` named `operand{j}`, fed at every run (the parity reference).
    Inputs,
    /// Each operand a `Param` named `operand{j}`, bound once and resident in the arena, as a
    /// weight or a producer's output is in the whole program (isolated timing: no copy-in per run).
    Params,
}

/// Node `n` of `g` alone as a one-node RLX program: operand `j` becomes `operand{j}` (an input
/// or a parameter, see [`Operands`]) with the operand's shape; the node is the only output.
pub fn one_node(g: &Graph, n: &rlx_ir::Node, how: Operands) -> Graph {
    let mut one = Graph::new(format!("one_node_{}_{}", n.id.0, if how == Operands::Params { "params" } else { "inputs" }));
    let ins: Vec<NodeId> = n
        .inputs
        .iter()
        .enumerate()
        .map(|(j, i)| {
            let name = format!("operand{j}");
            let shape = g.node(*i).shape.clone();
            match how {
                Operands::Inputs => one.input(name, shape),
                Operands::Params => one.param(name, shape),
            }
        })
        .collect();
    let id = one.add_node(n.op.clone(), ins, n.shape.clone());
    one.set_outputs(vec![id]);
    one
}

/// Each node of `g` alone, in order, fed the reference values of its operands. Returns the
/// reference value of every node (keyed by node id), inputs and parameters included.
///
/// Errors: an input or parameter of `g` has no value in `input`; a node alone gives other than
/// one output.
pub fn reference_values(g: &Graph, input: &ParityInput) -> Result<HashMap<u32, Typed>> {
    let params: HashMap<&str, &Typed> = input.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    reference(g, input, &params)
}

/// Each node of `g` alone, in order, fed the reference values of its operands. Returns the
/// reference value of every node.
fn reference(g: &Graph, input: &ParityInput, params: &HashMap<&str, &Typed>) -> Result<HashMap<u32, Typed>> {
    let session = Session::new(Device::Cpu);
    let by_input: HashMap<&str, &Typed> = input.inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out: HashMap<u32, Typed> = HashMap::new();
    for n in g.nodes() {
        let v = match &n.op {
            Op::Input { name } => (*by_input.get(name.as_str()).with_context(|| format!("no value for graph input '{name}'"))?).clone(),
            Op::Param { name } => (*params.get(name.as_str()).with_context(|| format!("no value for parameter '{name}'"))?).clone(),
            op => {
                let one = one_node(g, n, Operands::Inputs);
                let feeds: Vec<(String, Typed)> =
                    n.inputs.iter().enumerate().map(|(j, i)| (format!("operand{j}"), out[&i.0].clone())).collect();
                let mut c = session.compile_with(one, &CompileOptions::new());
                let mut r = run(&mut c, &feeds);
                if r.len() != 1 {
                    bail!("node %{} ({op}) alone gave {} outputs", n.id.0, r.len());
                }
                r.remove(0)
            }
        };
        out.insert(n.id.0, v);
    }
    Ok(out)
}

/// Run the parity check (see the module docs) with the default search and no pipeline.
///
/// Errors: as [`check_with`].
pub fn check(input: &ParityInput, tol: Tolerance) -> Result<ParityReport> {
    check_with(input, &Check::new(tol))
}

/// Run the parity check (see the module docs).
///
/// Errors: an input or parameter of the graph has no value; the pipeline fails on the graph or
/// changes the caller's outputs' count; a node's candidate and reference differ in dtype or
/// length; a dtype other than F32, F64, I32 or I64 is compared.
pub fn check_with(input: &ParityInput, how: &Check) -> Result<ParityReport> {
    let tol = how.tol;
    let params: HashMap<&str, &Typed> = input.params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let deployed = opscope::activate::fuse(&input.graph, input.device, &input.options);
    let reference = reference(&deployed, input, &params)?;
    // The candidate graph and where each deployed node is in it.
    let (cand_graph, map): (Graph, Vec<Option<NodeId>>) = match &how.pipeline {
        None => (deployed.clone(), deployed.nodes().iter().map(|n| Some(n.id)).collect()),
        Some(p) => {
            let (g, _manifest, map) = p
                .apply_mapped(&deployed, Some(&input.graph), 0, input.device)
                .with_context(|| format!("applying pipeline '{p}' to the deployed graph"))?;
            if g.outputs.len() < deployed.outputs.len() {
                bail!("pipeline '{p}' left {} outputs of the caller's {}", g.outputs.len(), deployed.outputs.len());
            }
            (g, map)
        }
    };
    let session = Session::new(input.device);
    let user = deployed.outputs.len();
    let mut cand = compile(&session, cand_graph.clone(), &input.options, &params);
    let outs = run(&mut cand, &input.inputs);
    if outs.len() < user {
        bail!("the program gave {} outputs, its deployed graph lists {user}", outs.len());
    }
    let outputs = deployed
        .outputs
        .iter()
        .zip(&outs[..user])
        .map(|(id, o)| compare(id.0, &deployed, o, &reference[&id.0], tol))
        .collect::<Result<Vec<_>>>()?;
    let mut report = ParityReport {
        graph: input.graph.name.clone(),
        deployed_nodes: deployed.len(),
        tolerance: tol,
        outputs,
        pipeline: how.pipeline.as_ref().map(|p| p.to_string()),
        search: how.search,
        scanned: Vec::new(),
        first_divergent: None,
    };
    if report.outputs_agree() {
        return Ok(report);
    }
    // Node `k` of the deployed graph exposed as one extra output of the candidate, compared
    // with its reference (memoized: bisection asks again for operands it already saw).
    let mut seen: HashMap<u32, Compared> = HashMap::new();
    let mut probe = |k: NodeId, report: &mut ParityReport| -> Result<Option<bool>> {
        if let Some(c) = seen.get(&k.0) {
            return Ok(Some(c.diverges));
        }
        let Some(at) = map.get(k.0 as usize).copied().flatten() else { return Ok(None) };
        let mut g = cand_graph.clone();
        g.name = format!("{}_parity_{}", deployed.name, k.0);
        g.outputs.push(at);
        let mut c = compile(&session, g, &input.options, &params);
        let mut o = run(&mut c, &input.inputs);
        let Some(v) = o.pop() else { bail!("node %{}: no output", k.0) };
        let cmp = compare(k.0, &deployed, &v, &reference[&k.0], tol)?;
        let d = cmp.diverges;
        report.scanned.push(cmp.clone());
        seen.insert(k.0, cmp);
        Ok(Some(d))
    };
    let computed = |n: &rlx_ir::Node| !matches!(n.op, Op::Input { .. } | Op::Param { .. });
    match how.search {
        Search::Linear => {
            for n in deployed.nodes() {
                if computed(n) && probe(n.id, &mut report)? == Some(true) {
                    report.first_divergent = seen.get(&n.id.0).cloned();
                    break;
                }
            }
        }
        Search::Bisect => {
            // Start from the first divergent caller output.
            let mut target = deployed.outputs[report.outputs.iter().position(|c| c.diverges).unwrap_or(0)];
            loop {
                let anc: Vec<NodeId> = ancestors(&deployed, target)
                    .into_iter()
                    .filter(|&k| computed(deployed.node(k)) && map.get(k.0 as usize).copied().flatten().is_some())
                    .collect();
                // Invariant: anc[hi] diverges (the target does, when comparable).
                let (mut lo, mut hi) = (0usize, anc.len().saturating_sub(1));
                if anc.is_empty() || probe(anc[hi], &mut report)? != Some(true) {
                    break;
                }
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if probe(anc[mid], &mut report)? == Some(true) {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                let found = anc[lo];
                let mut bad_operand = None;
                for &op in &deployed.node(found).inputs {
                    if computed(deployed.node(op)) && probe(op, &mut report)? == Some(true) {
                        bad_operand = Some(op);
                        break;
                    }
                }
                match bad_operand {
                    Some(op) => target = op,
                    None => {
                        report.first_divergent = seen.get(&found.0).cloned();
                        break;
                    }
                }
            }
        }
    }
    Ok(report)
}

/// The ancestors of `target` in `g` (itself included), in execution (index) order.
fn ancestors(g: &Graph, target: NodeId) -> Vec<NodeId> {
    let mut keep = vec![false; g.len()];
    let mut stack = vec![target];
    while let Some(k) = stack.pop() {
        if !std::mem::replace(&mut keep[k.0 as usize], true) {
            stack.extend(g.node(k).inputs.iter().copied());
        }
    }
    (0..g.len() as u32).map(NodeId).filter(|k| keep[k.0 as usize]).collect()
}

/// The report as text: the outputs, then the scanned nodes with the first divergent marked.
pub fn render(r: &ParityReport) -> String {
    let line = |c: &Compared| {
        format!(
            "  %{:<4} {:<28} {:>8} max|diff| {:<10.3e} ref absmax {:<10.3e} ulps {:<10} {}{}",
            c.node,
            c.name.clone().unwrap_or_else(|| c.op.chars().take(28).collect()),
            c.numel,
            c.max_abs,
            c.ref_absmax,
            c.max_ulps.map_or("-".to_string(), |u| u.to_string()),
            if c.diverges { "DIVERGES" } else { "ok" },
            if c.nan_mismatch > 0 { format!(" ({} NaN mismatches)", c.nan_mismatch) } else { String::new() },
        )
    };
    let mut s = format!(
        "parity of {}{} ({} deployed nodes) against its op-by-op reference; tolerance atol {:e} + rtol {:e} x ref absmax\noutputs:\n",
        r.graph,
        r.pipeline.as_ref().map_or(String::new(), |p| format!(" rewritten by '{p}'")),
        r.deployed_nodes,
        r.tolerance.atol,
        r.tolerance.rtol
    );
    for c in &r.outputs {
        s.push_str(&line(c));
        s.push('\n');
    }
    if r.outputs_agree() {
        s.push_str("every output agrees: no scan needed\n");
        return s;
    }
    s.push_str(match r.search {
        Search::Linear => "scan (each node exposed alone, in execution order):\n",
        Search::Bisect => "bisection (each node exposed alone, in the order compared):\n",
    });
    for c in &r.scanned {
        s.push_str(&line(c));
        s.push('\n');
    }
    match &r.first_divergent {
        Some(c) => s.push_str(&format!(
            "{}: %{} {} ({} nodes compared)\n",
            match r.search {
                Search::Linear => "first divergent node",
                Search::Bisect => "divergent node whose operands agree",
            },
            c.node,
            c.op,
            r.scanned.len()
        )),
        None => s.push_str("outputs differ, but no node diverges when exposed alone (exposing a node changes buffer lifetimes)\n"),
    }
    s
}
