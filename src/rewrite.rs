//! The one graph-rewrite helper every pass uses: site naming, appending sketch nodes as extra
//! outputs, de-duplicating identical sketches of one tensor, and building the manifest.

use std::collections::HashMap;

use rlx_ir::{DType, Graph, NodeId, Op, Shape};

pub use crate::analysis::{backend_elided, family, op_name, residual_blocks, ResidualBlock};
use crate::analysis::{shape_text, site_names_by_id, static_dims};
use crate::manifest::{Actuation, Manifest, Role, Site, Skipped, TapOutput, TapUse};
use crate::sketch::{is_sketch_op, SketchSpec, Stat, SKETCH2_OP, SKETCH3_OP, SKETCH_OP};

/// Name of the F32 cast of the graph input `attention_mask` that a tap adds
/// ([`Rewrite::row_mask`]).
pub const MASK_CAST: &str = "opscope/attention_mask/f32";

/// Name prefix of a tap's `[B, S, C]` view of a flattened `[B * S, C]` activation (the node id
/// of the activation follows).
pub const SEQ_VIEW: &str = "opscope/seq_view/";

/// A graph being rewritten by a pipeline, and the manifest of what was done to it.
pub struct Rewrite {
    graph: Graph,
    manifest: Manifest,
    names: Vec<String>,
    by_param: HashMap<(String, String), String>,
    /// Per original node: reachable from a graph input or a nondeterministic op.
    dynamic: Vec<bool>,
    /// (position in the pipeline, name) of the pass running now.
    current: (usize, &'static str),
    /// Per tapped tensor: the sketches already appended for it (attribute bytes, the ids of any
    /// further inputs, and the manifest output). A second identical tap shares the output.
    /// A short list per tensor, compared bytewise: hashing several hundred bytes of JSON per
    /// tap was 4% of a tapped compile's rewrite (measured).
    dedupe: HashMap<u32, Vec<(std::sync::Arc<[u8]>, Vec<NodeId>, usize)>>,
    /// The graph input `attention_mask` and its F32 cast, as far as the graph's first nodes
    /// show ([`Rewrite::row_mask`]).
    mask: MaskLookup,
    /// The attribute bytes of the last few distinct specs encoded ([`SketchSpec::to_attrs`]),
    /// most recent first: the same spec recurs for every same-shaped activation of a compile.
    encoded: Vec<(SketchSpec, std::sync::Arc<[u8]>)>,
    /// An actuation changed the graph's structure: `finish` rebuilds it in topological order
    /// without dead nodes.
    restructured: bool,
    /// Per original node: still needed by the caller's outputs (recomputed after an actuation;
    /// a tap never observes a node an actuation made dead).
    live: Vec<bool>,
    /// Residual blocks of the graph as the pipeline received it (numbered once, so that
    /// `skip` and `residual` agree on `block.K` whatever runs first).
    blocks: Option<Vec<ResidualBlock>>,
    /// Tensors RLX's CPU backend never writes (see [`backend_elided`]), with the reason.
    elided: HashMap<u32, String>,
    /// The target device has a native sketch kernel ([`crate::sketch::lower::native_kernel`]);
    /// when false every tensor sketch is lowered into primitive ops.
    native: bool,
    /// The running pass asked for lowered sketches on a device with a native kernel
    /// ([`Rewrite::force_lowering`]); reset at each pass.
    force_lower: bool,
    /// Record one run in N (`sample{every=N}`), applied to every native sketch by
    /// [`Rewrite::apply_sampling`].
    sample_every: Option<u64>,
    /// Feed the online state ([`crate::online`]) from every native tensor sketch.
    online: bool,
    /// Whole tensors a `capture` pass asked for: appended after every sketch output in
    /// [`Rewrite::finish`].
    captures: Vec<NodeId>,
}

/// `a` and `b` encode to the same attribute bytes: equal, and a fixed histogram range's bounds
/// equal bit for bit (-0.0 == 0.0, but they encode differently, and the dedupe key is the bytes).
fn same_encoding(a: &SketchSpec, b: &SketchSpec) -> bool {
    use crate::sketch::HistRange::Fixed;
    a == b
        && match (a.hist_range, b.hist_range) {
            (Fixed { lo: l1, hi: h1 }, Fixed { lo: l2, hi: h2 }) => l1.to_bits() == l2.to_bits() && h1.to_bits() == h2.to_bits(),
            _ => true,
        }
}

/// What [`Rewrite::row_mask`] has found of the padding mask in the graph's first `scanned`
/// nodes.
#[derive(Default)]
struct MaskLookup {
    scanned: usize,
    input: Option<NodeId>,
    cast: Option<NodeId>,
}

/// Distinct specs whose encoding a rewrite keeps ([`Rewrite::encode`]).
const ENCODED_CAPACITY: usize = 8;

impl Rewrite {
    /// Start from a copy of `graph`. When `graph` is the fused (deployed) form of `source`,
    /// site names are recovered from `source` (see [`Rewrite::site_name`]).
    pub fn new(graph: &Graph, source: Option<&Graph>, pipeline: String, tag: u32) -> Rewrite {
        Rewrite::new_owned(graph.clone(), source, pipeline, tag)
    }

    /// [`Rewrite::new`] starting from `graph` itself (no copy: a compile's fused graph is
    /// rewritten in place).
    pub fn new_owned(graph: Graph, source: Option<&Graph>, pipeline: String, tag: u32) -> Rewrite {
        let manifest = Manifest {
            graph: graph.name.clone(),
            pipeline,
            tag,
            compile: 0,
            user_outputs: graph.outputs.len(),
            sites: Vec::new(),
            outputs: Vec::new(),
            skipped: Vec::new(),
            actuations: Vec::new(),
            padding: None,
            sample_every: None,
            captures: Vec::new(),
        };
        let mut dynamic = vec![false; graph.len()];
        for n in graph.nodes() {
            dynamic[n.id.0 as usize] = matches!(n.op, Op::Input { .. })
                || n.op.is_nondeterministic()
                || n.inputs.iter().any(|i| dynamic[i.0 as usize]);
        }
        let (names, by_param) = site_names_by_id(&graph, source);
        let (live, elided) = (vec![true; graph.len()], backend_elided(&graph));
        Rewrite {
            graph,
            manifest,
            names,
            by_param,
            dynamic,
            current: (0, ""),
            dedupe: HashMap::new(),
            encoded: Vec::new(),
            mask: MaskLookup::default(),
            restructured: false,
            live,
            blocks: None,
            elided,
            native: true,
            force_lower: false,
            sample_every: None,
            online: false,
            captures: Vec::new(),
        }
    }

    /// The source site name of the node of `family` that consumed parameter `param`, if the
    /// graph was fused from a source graph (used to name the parts of a horizontally merged
    /// matmul after the weights they concatenate).
    pub fn source_name_for_param(&self, family: &str, param: &str) -> Option<String> {
        self.by_param.get(&(family.to_string(), param.to_string())).cloned()
    }

    /// The graph as rewritten so far.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The node ids of the graph the pipeline started from that the caller's outputs still
    /// need (sites are found among these, so a pass never taps another pass's sketch nodes,
    /// nor a block an earlier `skip` made dead).
    pub fn original_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.names.len() as u32).map(NodeId).filter(|i| self.live[i.0 as usize])
    }

    /// The graph, for an actuation pass to change on purpose (insert fake-quant nodes, rewire a
    /// residual). New nodes may be appended anywhere and consumed by earlier ones: when the
    /// pipeline finishes, the graph is rebuilt in topological order and nodes no output needs
    /// are removed (graph inputs and parameters are kept, so the caller binds the same names).
    /// The caller's outputs must keep their count, order and shapes.
    pub fn graph_mut(&mut self) -> &mut Graph {
        self.restructured = true;
        &mut self.graph
    }

    /// The residual blocks of the graph the pipeline started from ([`residual_blocks`]),
    /// numbered before any actuation changed it; a block an earlier `skip` bypassed is no longer
    /// listed (its sum is gone).
    pub fn residual_blocks(&mut self) -> Vec<ResidualBlock> {
        let blocks = self.blocks.get_or_insert_with(|| residual_blocks(&self.graph)).clone();
        blocks
            .into_iter()
            .filter_map(|mut b| {
                let n = self.graph.node(b.node);
                let still = matches!(
                    n.op,
                    Op::Binary(rlx_ir::op::BinaryOp::Add) | Op::FusedResidualLN { .. } | Op::FusedResidualRmsNorm { .. }
                );
                if !still || !self.live[b.node.0 as usize] {
                    return None;
                }
                // An earlier bypass may have rewired the stream (x of block k+1 was block k's sum).
                b.stream = n.inputs[b.stream_input];
                b.branch = n.inputs[1 - b.stream_input];
                Some(b)
            })
            .collect()
    }

    /// The graph, for a tap to append helper nodes its sketches read (a cast of the attention
    /// mask). Appended nodes feed only appended sketches, so the caller's program is unchanged
    /// and no rebuild is needed (unlike [`Rewrite::graph_mut`]).
    pub fn graph_append(&mut self) -> &mut Graph {
        &mut self.graph
    }

    /// For a tap: record, as skipped, every original node that `is_site` would have made a site
    /// but that an earlier actuation removed (a `skip` that made an attention block dead), so
    /// that a site never disappears without a word.
    pub fn note_removed(&mut self, is_site: impl Fn(&Op) -> bool) {
        if self.manifest.actuations.is_empty() {
            return;
        }
        let by: Vec<String> = self.manifest.actuations.iter().map(|a| format!("{} {}", a.pass, a.site)).collect();
        let dead: Vec<NodeId> = (0..self.names.len() as u32)
            .map(NodeId)
            .filter(|i| !self.live[i.0 as usize] && is_site(&self.graph.node(*i).op))
            .collect();
        for id in dead {
            let site = self.site_name(id);
            self.skip(&site, None, None, format!("removed by an earlier actuation ({}): not observed", by.join(", ")));
        }
    }

    /// The changes actuation passes made so far.
    pub fn actuations(&self) -> &[Actuation] {
        &self.manifest.actuations
    }

    /// Record that the current pass changed the program at `node` (shown as `site`): `action`
    /// says what, in words (`fake-quant lhs int8 per-token`, `bypass block`).
    pub fn actuate(&mut self, site: &str, node: NodeId, action: String) {
        let (pass_idx, pass) = self.current;
        self.manifest.actuations.push(Actuation {
            site: site.to_string(),
            node: node.0,
            pass: pass.to_string(),
            pass_idx,
            action,
        });
    }

    /// Site name of an original node.
    pub fn site_name(&self, node: NodeId) -> String {
        self.names.get(node.0 as usize).cloned().unwrap_or_else(|| format!("node.{}", node.0))
    }

    /// The pipeline is about to run its `idx`-th pass, `name`: sites and taps recorded from
    /// now on are attributed to it.
    pub fn begin_pass(&mut self, idx: usize, name: &'static str) {
        self.current = (idx, name);
        self.force_lower = false;
        if self.restructured {
            let keep = reachable(&self.graph, self.manifest.user_outputs);
            for (i, l) in self.live.iter_mut().enumerate() {
                *l = keep[i];
            }
        }
    }

    /// Set whether the target device has a native sketch kernel (true by default: the CPU).
    /// Without one every tensor sketch is lowered into RLX primitive ops
    /// ([`crate::sketch::lower`]), and a sketch that has no lowering is skipped with the reason.
    pub fn set_native_kernel(&mut self, native: bool) {
        self.native = native;
    }

    /// Lower the sketches (tensor and probe) the running pass appends from now on, even where a
    /// native kernel exists (a pass option such as `matmul{lower=true}`, `residual{lower=true}`;
    /// for testing the lowering on the CPU against the kernel). Reset when the next pass begins.
    pub fn force_lowering(&mut self, on: bool) {
        self.force_lower = on;
    }

    /// Record a site at `node`, named [`Rewrite::site_name`].
    pub fn add_site(&mut self, node: NodeId, flops: Option<u64>) -> String {
        let site = self.site_name(node);
        self.add_site_named(node, site, flops)
    }

    /// Record a site with an explicit name (a logical part of a merged op).
    pub fn add_site_named(&mut self, node: NodeId, site: String, flops: Option<u64>) -> String {
        let (pass_idx, pass) = self.current;
        self.manifest.sites.push(Site {
            site: site.clone(),
            op: op_name(&self.graph.node(node).op),
            node: node.0,
            flops,
            pass: pass.to_string(),
            pass_idx,
        });
        site
    }

    /// Record that `role` at `site` (or the whole site) could not be tapped, and why.
    pub fn skip(&mut self, site: &str, role: Option<Role>, tensor: Option<NodeId>, reason: String) {
        self.skip_stat(site, role, tensor, None, reason);
    }

    /// [`Rewrite::skip`] of one statistic only (`stat`), the rest of the sketch being taken.
    fn skip_stat(&mut self, site: &str, role: Option<Role>, tensor: Option<NodeId>, stat: Option<Stat>, reason: String) {
        let shape = tensor.map(|t| shape_text(&self.graph.node(t).shape));
        self.manifest.skipped.push(Skipped {
            site: site.to_string(),
            role,
            shape,
            stat: stat.map(|s| s.as_str().to_string()),
            reason,
            pass_idx: Some(self.current.0),
        });
    }

    /// Append a sketch of `tensor` as an extra graph output, used as `role` at `site`.
    ///
    /// A zero-size tensor gets no node: the manifest lists it with `numel = 0`, and the
    /// recorder writes `count = 0` for it on every run (there is nothing to compute).
    /// The same tensor with the same spec is computed once and listed once per use.
    pub fn tap(&mut self, site: &str, role: Role, tensor: NodeId, spec: SketchSpec) {
        self.tap_inputs(site, role, &[tensor], spec)
    }

    /// [`Rewrite::tap_inputs`] for a probe that rebuilds a tensor the program never holds (a
    /// fused attention's probabilities, rebuilt from Q and K): the manifest lists `dims` as the
    /// tapped tensor's shape, not input 0's.
    pub fn tap_rebuilt(&mut self, site: &str, role: Role, inputs: &[NodeId], spec: SketchSpec, dims: &[usize]) {
        let before = self.manifest.outputs.len();
        self.tap_inputs(site, role, inputs, spec);
        if self.manifest.outputs.len() > before {
            if let Some(o) = self.manifest.outputs.last_mut() {
                o.shape = shape_text(&Shape::new(dims, DType::F32));
            }
        }
    }

    /// [`Rewrite::tap`] for a probe that reads several tensors (1 to 3; see
    /// [`crate::sketch::Probe`]): `inputs[0]` is the tensor the row's shape and count describe.
    pub fn tap_inputs(&mut self, site: &str, role: Role, inputs: &[NodeId], mut spec: SketchSpec) {
        let tensor = inputs[0];
        if let Some(why) = inputs.iter().find_map(|t| self.elided(*t)) {
            let why = why.to_string();
            self.skip(site, Some(role), Some(tensor), why);
            return;
        }
        let layout = match spec.layout() {
            Ok(l) => l,
            Err(why) => {
                self.skip(site, Some(role), Some(tensor), why);
                return;
            }
        };
        // A fixed histogram range must be finite with lo < hi (the options parser checks it;
        // a pass building its spec by hand might not): JSON has no infinity, so such a spec
        // would not survive its encoding into the node's attributes.
        if let crate::sketch::HistRange::Fixed { lo, hi } = spec.hist_range {
            if !(lo.is_finite() && hi.is_finite() && lo < hi) {
                self.skip(site, Some(role), Some(tensor), format!("hist_range [{lo}, {hi}] is not a finite range with lo < hi"));
                return;
            }
        }
        let op = match inputs.len() {
            1 => SKETCH_OP,
            2 => SKETCH2_OP,
            _ => SKETCH3_OP,
        };
        spec.tag = self.manifest.tag;
        let invariant = inputs.iter().all(|t| !self.dynamic.get(t.0 as usize).copied().unwrap_or(true));
        spec.memo = invariant;
        // A weight sketch names its node: see `SketchSpec::node`.
        spec.node = if invariant { tensor.0 + 1 } else { 0 };
        let shape = self.graph.node(tensor).shape.clone();
        // `None` for a symbolic shape: the element count is only known at run time.
        let numel: Option<u64> = static_dims(&shape).map(|d| d.iter().product::<usize>() as u64);
        let use_ = TapUse {
            pass: self.current.1.to_string(),
            pass_idx: self.current.0,
            site: site.to_string(),
            role,
        };
        let spec_attrs = self.encode(&spec);
        // The dedupe key: the attribute bytes and every input.
        let found = self.dedupe.get(&tensor.0).and_then(|v| v.iter().find(|(a, rest, _)| **a == *spec_attrs && rest[..] == inputs[1..]));
        if let Some(i) = found.map(|(_, _, i)| *i) {
            // The shared sketch's statistics that the lowering leaves out are left out for
            // this use too: list them under its site and role as well.
            let first = &self.manifest.outputs[i].uses[0];
            let same: Vec<Skipped> = self
                .manifest
                .skipped
                .iter()
                .filter(|s| s.site == first.site && s.role.as_ref() == Some(&first.role) && s.stat.is_some())
                .map(|s| Skipped { site: use_.site.clone(), role: Some(use_.role.clone()), ..s.clone() })
                .collect();
            self.manifest.skipped.extend(same);
            self.manifest.outputs[i].uses.push(use_);
            return;
        }
        let output_index = if numel == Some(0) {
            None
        } else {
            let name = format!("opscope/{site}/{}", use_.role.as_str());
            let lower = !self.native || self.force_lower;
            let why_not = if lower { crate::sketch::lower::unlowerable(&spec, &shape) } else { None };
            if let (false, Some(why)) = (self.native, &why_not) {
                self.skip(site, Some(use_.role.clone()), Some(tensor), format!("no native sketch kernel on the device, and {why}"));
                return;
            }
            // Forced lowering that cannot lower: not recorded at all, rather than silently by the
            // native kernel the caller asked not to use.
            if let (true, Some(why)) = (self.force_lower, &why_not) {
                self.skip(site, Some(use_.role.clone()), Some(tensor), format!("lower=true asked for the lowered sketch, and {why}"));
                return;
            }
            if let (true, None) = (lower, &why_not) {
                let low = if matches!(spec.probe, crate::sketch::Probe::Tensor) {
                    let mask = if op == SKETCH2_OP { inputs.get(1).copied() } else { None };
                    crate::sketch::lower::lower(&mut self.graph, tensor, mask, &spec)
                } else {
                    match crate::sketch::lower::lower_probe(&mut self.graph, inputs, &spec) {
                        Ok(l) => l,
                        Err(why) => {
                            self.skip(site, Some(use_.role.clone()), Some(tensor), format!("the probe's lowering failed: {why}"));
                            return;
                        }
                    }
                };
                for (stat, why) in low.not_computed {
                    self.skip_stat(site, Some(use_.role.clone()), Some(tensor), Some(stat), format!("{} not computed by the lowered sketch: {why}", stat.as_str()));
                }
                self.graph.node_mut(low.node).name = Some(format!("{name}/lowered"));
                self.graph.outputs.push(low.node);
            } else {
                // The output shape is the spec's length, as the op's shape inference gives it
                // (from the decoded spec `encode` seeded, without parsing the bytes back).
                let out_shape = Shape::new(&[spec.len().unwrap_or(1)], DType::F32);
                // A weight's sketch is a graph output itself. Under RLX's `cache_param_invariant`
                // it is hoisted into the run-once prepare graph and its value reaches the output
                // under `run` (`tests/outputs_unchanged.rs`); under `run_typed` RLX 0.2.19 returns
                // it unfilled and the recorder refuses the run (the same test). A `keep` copy
                // reading a run-time tensor, added here until 2026-12-03, changed neither.
                let id = self.graph.custom_op_packed(op, spec_attrs.to_vec(), inputs.to_vec(), out_shape);
                self.graph.node_mut(id).name = Some(name.clone());
                self.graph.outputs.push(id);
            }
            Some(self.graph.outputs.len() - 1)
        };
        self.dedupe.entry(tensor.0).or_default().push((spec_attrs, inputs[1..].to_vec(), self.manifest.outputs.len()));
        self.manifest.outputs.push(TapOutput {
            output_index,
            tensor: tensor.0,
            shape: shape_text(&shape),
            numel,
            uses: vec![use_],
            invariant,
            layout,
            spec,
        });
    }

    /// `spec`'s attribute bytes, from a cache of the last [`ENCODED_CAPACITY`] distinct specs
    /// (the one returned moved to the front). A spec encoded anew is also seeded for the sketch
    /// op's shape inference ([`crate::sketch::seed_spec`]).
    fn encode(&mut self, spec: &SketchSpec) -> std::sync::Arc<[u8]> {
        if let Some(i) = self.encoded.iter().position(|(s, _)| same_encoding(s, spec)) {
            let hit = self.encoded.remove(i);
            let bytes = hit.1.clone();
            self.encoded.insert(0, hit);
            return bytes;
        }
        let bytes: std::sync::Arc<[u8]> = spec.to_attrs().into();
        crate::sketch::seed_spec(&bytes, spec);
        self.encoded.truncate(ENCODED_CAPACITY - 1);
        self.encoded.insert(0, (spec.clone(), bytes.clone()));
        bytes
    }

    /// Record one run in `every` (the `sample` pass): the sketches of every tap in the pipeline
    /// are gated by the run's input contents when the pipeline finishes
    /// ([`Rewrite::apply_sampling`]).
    ///
    /// Errors: sampling is already set to another period (two `sample` entries disagree).
    pub fn set_sampling(&mut self, every: u64) -> Result<(), crate::error::Error> {
        match self.sample_every {
            Some(n) if n != every => Err(crate::error::Error::Graph(format!(
                "sample: every={every} and every={n} in one pipeline: give one sample entry"
            ))),
            _ => {
                self.sample_every = Some(every);
                Ok(())
            }
        }
    }

    /// Feed the process-wide online state ([`crate::online`]) from every native tensor sketch
    /// of the pipeline (the `online` setting), keyed by `site/role`.
    pub fn set_online(&mut self) {
        self.online = true;
    }

    /// Gate every native sketch of the graph by one sampling gate (see
    /// [`crate::sketch::sample`]): a gate node reading the graph's inputs, wired as the extra
    /// last input of every sketch node, whose op becomes the gated form. Does nothing without
    /// [`Rewrite::set_sampling`], for `every = 1`, for a graph with no sketch, or for a graph
    /// with no input (every run then has the same content: each is recorded).
    ///
    /// Errors: a sketch is lowered into RLX ops (a device without the native kernel, or
    /// `lower=true`): an RLX graph has no conditional execution, so a lowered sketch would run
    /// on every run; or the graph has more inputs than a gate reads
    /// ([`crate::sketch::sample::MAX_GATE_INPUTS`]).
    pub fn apply_sampling(&mut self) -> Result<(), crate::error::Error> {
        use crate::sketch::sample::{gated_name, GateSpec, GATE_PREFIX, MAX_GATE_INPUTS};
        if self.online {
            self.mark_online();
        }
        let Some(every) = self.sample_every.filter(|&n| n > 1) else { return Ok(()) };
        let g = &self.graph;
        if let Some(n) = g.nodes().iter().find(|n| n.name.as_deref().is_some_and(|s| s.starts_with("opscope/") && s.ends_with("/lowered"))) {
            return Err(crate::error::Error::Graph(format!(
                "sample{{every={every}}}: the sketch {} is lowered into RLX ops (no native sketch kernel on the device, or \
                 lower=true), and a lowered sketch runs on every run (an RLX graph has no conditional execution): \
                 sample only with the native CPU kernel, or record every run",
                n.name.as_deref().unwrap_or("?")
            )));
        }
        let sketches: Vec<NodeId> = g
            .nodes()
            .iter()
            .filter(|n| matches!(&n.op, Op::Custom { name, .. } if name == SKETCH_OP || name == SKETCH2_OP || name == SKETCH3_OP))
            .map(|n| n.id)
            .collect();
        let inputs: Vec<(NodeId, String)> = g
            .nodes()
            .iter()
            .filter_map(|n| match &n.op {
                Op::Input { name } => Some((n.id, name.clone())),
                _ => None,
            })
            .collect();
        if sketches.is_empty() || inputs.is_empty() {
            return Ok(());
        }
        if inputs.len() > MAX_GATE_INPUTS {
            return Err(crate::error::Error::Graph(format!(
                "sample{{every={every}}}: graph '{}' has {} inputs, a sampling gate reads at most {MAX_GATE_INPUTS}: record every run",
                g.name,
                inputs.len()
            )));
        }
        let spec = GateSpec { every, names: inputs.iter().map(|(_, n)| n.clone()).collect() };
        let attrs = serde_json::to_vec(&spec).map_err(|e| crate::error::Error::Internal(format!("gate attributes: {e}")))?;
        let gate = self.graph.custom_op(format!("{GATE_PREFIX}{}", inputs.len()), attrs, inputs.iter().map(|(id, _)| *id).collect());
        self.graph.node_mut(gate).name = Some("opscope/sample".into());
        for id in sketches {
            let node = self.graph.node(id).clone();
            let Op::Custom { name, num_inputs, attrs } = node.op else { continue };
            self.graph.node_mut(id).op = Op::Custom { name: gated_name(&name), num_inputs: num_inputs + 1, attrs };
            let mut wired = node.inputs.clone();
            wired.push(gate);
            self.graph.set_inputs(id, wired);
        }
        // The gate was appended after the sketches that read it: `finish` rebuilds the graph
        // in topological order (RLX runs nodes in index order).
        self.restructured = true;
        self.manifest.sample_every = Some(every);
        Ok(())
    }

    /// Give every native tensor sketch its online key (`site/role` of its first use).
    fn mark_online(&mut self) {
        let keys: HashMap<u32, String> = self
            .manifest
            .outputs
            .iter()
            .filter_map(|o| o.uses.first().map(|u| (o.tensor, format!("{}/{}", u.site, u.role.as_str()))))
            .collect();
        let ids: Vec<NodeId> = self
            .graph
            .nodes()
            .iter()
            // A tensor sketch with a padding row mask is the two-input form.
            .filter(|n| matches!(&n.op, Op::Custom { name, .. } if name == SKETCH_OP || name == SKETCH2_OP || name == SKETCH3_OP))
            .map(|n| n.id)
            .collect();
        // One sketch per tensor feeds the state: two taps with different statistics on one
        // tensor (`matmul` and `capture`'s count) would add its values twice.
        let mut fed: std::collections::HashSet<u32> = std::collections::HashSet::new();
        for id in ids {
            let node = self.graph.node(id).clone();
            let Op::Custom { name, num_inputs, attrs } = node.op else { continue };
            let (Ok(mut spec), Some((tensor, key))) =
                (SketchSpec::from_attrs(&attrs), node.inputs.first().and_then(|t| keys.get(&t.0).map(|k| (t.0, k))))
            else {
                continue;
            };
            // A probe (attn, route, residual) computes its own statistics, not the tensor's.
            if matches!(spec.probe, crate::sketch::Probe::Pass { .. }) || !fed.insert(tensor) {
                continue;
            }
            spec.online = Some(key.clone());
            self.graph.node_mut(id).op = Op::Custom { name, num_inputs, attrs: spec.to_attrs() };
        }
    }

    /// Append the whole tensor `tensor` (F32, static shape) as an extra output, written by the
    /// recorder as `.npy` on the runs a `capture` pass samples (`every`, byte `budget`: see
    /// [`crate::capture`]). A count sketch of the tensor is tapped too, so every tapped run still
    /// starts with a compile tag and records `count` for the site. Returns `false` (after
    /// [`Rewrite::skip`] with the reason) when the tensor cannot be captured: not F32, a
    /// symbolic or zero-size shape, or never written by the backend.
    pub fn capture(&mut self, site: &str, role: Role, tensor: NodeId, every: u64, budget: u64) -> bool {
        let shape = self.graph.node(tensor).shape.clone();
        let why = if shape.dtype() != DType::F32 {
            Some(format!("capture writes F32 tensors only; this one is {:?}", shape.dtype()))
        } else if static_dims(&shape).is_none() {
            Some("capture needs a static shape (a symbolic dim is only known at run time)".to_string())
        } else if static_dims(&shape).is_some_and(|d| d.iter().product::<usize>() == 0) {
            Some("zero-size tensor: nothing to capture".to_string())
        } else {
            self.elided(tensor).map(|w| w.to_string())
        };
        if let Some(why) = why {
            self.skip(site, Some(role), Some(tensor), why);
            return false;
        }
        let dims = static_dims(&shape).unwrap_or_default();
        if let Ok(plan) = SketchSpec::for_shape(&shape, &[], 1, crate::sketch::HistRange::Absmax, 1) {
            self.tap(site, role.clone(), tensor, plan.spec);
        }
        self.manifest.captures.push(crate::manifest::CaptureOutput {
            output_index: 0, // set by `finish`
            tensor: tensor.0,
            site: site.to_string(),
            role,
            dims,
            invariant: !self.is_dynamic(tensor),
            pass_idx: self.current.0,
            every,
            budget,
        });
        self.captures.push(tensor);
        true
    }

    /// The padding row mask of this program for a tensor of `rows` rows (all leading dims
    /// flattened): the graph input `attention_mask` (the Hugging Face export name) as F32, when
    /// it holds exactly `rows` values, one per token; `None` otherwise (every row then counts).
    /// Non-F32 masks get one shared cast node. The manifest records the mask used
    /// ([`Manifest::padding`]). Shared by every tap that excludes padding.
    pub fn row_mask(&mut self, rows: usize) -> Option<NodeId> {
        // Nodes are only appended until the pipeline finishes: each call looks at the nodes
        // added since the last (a scan of the whole graph on every tap was quadratic in the
        // sites). The first input of that name counts, as before; an input renamed in place
        // after a call is not seen.
        let m = &mut self.mask;
        for n in &self.graph.nodes()[m.scanned..] {
            match (&n.op, m.input) {
                (Op::Input { name }, None) if name == "attention_mask" => m.input = Some(n.id),
                (Op::Cast { to: DType::F32 }, Some(i)) if m.cast.is_none() && n.inputs == [i] && n.name.as_deref() == Some(MASK_CAST) => {
                    m.cast = Some(n.id)
                }
                _ => {}
            }
        }
        m.scanned = self.graph.len();
        let g = &self.graph;
        let input = g.node(self.mask.input?);
        let dims = static_dims(&input.shape)?;
        if dims.iter().product::<usize>() != rows {
            return None;
        }
        self.manifest.padding.get_or_insert_with(|| {
            format!(
                "graph input attention_mask {} {:?}: rows where it is 0 are padding, excluded",
                shape_text(&input.shape),
                input.shape.dtype()
            )
        });
        if input.shape.dtype() == DType::F32 {
            return Some(input.id);
        }
        let id = input.id;
        let shape = Shape::new(&dims, DType::F32);
        Some(self.mask.cast.unwrap_or_else(|| {
            let c = self.graph.add_node(Op::Cast { to: DType::F32 }, vec![id], shape);
            self.graph.node_mut(c).name = Some(MASK_CAST.into());
            self.mask.cast = Some(c);
            c
        }))
    }

    /// True if `node` depends on a graph input or a nondeterministic op (an activation), false
    /// for a tensor made of parameters and constants only (a weight).
    pub fn is_dynamic(&self, node: NodeId) -> bool {
        self.dynamic.get(node.0 as usize).copied().unwrap_or(true)
    }

    /// Why RLX's CPU backend never writes `node`'s buffer, if it does not (see
    /// [`backend_elided`]). A tap must not read such a tensor.
    pub fn elided(&self, node: NodeId) -> Option<&str> {
        self.elided.get(&node.0).map(|s| s.as_str())
    }

    /// Users of `node` among the graph's own nodes (not sketch nodes appended by a pass).
    pub fn users(&self, node: NodeId) -> Vec<NodeId> {
        self.graph
            .users(node)
            .into_iter()
            .filter(|u| !matches!(&self.graph.node(*u).op, Op::Custom { name, .. } if is_sketch_op(name)))
            .collect()
    }

    /// Finish: the rewritten graph and its manifest. After an actuation the graph is rebuilt
    /// in topological order without dead nodes. Then every node only the tap outputs need (the
    /// sketches and what feeds them alone) is moved to just after the last node it reads, so
    /// RLX (which runs nodes in index order) computes a sketch while its tensor is still in
    /// cache and frees the tensor at its last real use, instead of keeping every tapped tensor
    /// alive to the end of the run. Node ids in the manifest are renumbered.
    pub fn finish(self) -> (Graph, Manifest) {
        let (g, m, _) = self.finish_mapped();
        (g, m)
    }

    /// [`Rewrite::finish`], also returning where each node of the graph given to
    /// [`Rewrite::new`] is in the finished graph: entry `i` is the new id of original node `i`,
    /// `None` when an actuation made it dead and it was removed. Used to compare a rewritten
    /// program with the original node by node (`opscope parity --pipeline`).
    pub fn finish_mapped(mut self) -> (Graph, Manifest, Vec<Option<NodeId>>) {
        let original = self.live.len();
        let user_outputs = self.manifest.user_outputs;
        // Captured tensors go after every sketch output (the recorder reads the compile tag
        // from the first extra output).
        for (c, &t) in self.manifest.captures.iter_mut().zip(&self.captures) {
            c.output_index = self.graph.outputs.len();
            self.graph.outputs.push(t);
        }
        let (graph, first) = if self.restructured {
            let (g, m) = rebuild(&self.graph);
            (g, Some(m))
        } else {
            (self.graph, None)
        };
        let (graph, second) = place_early(graph, user_outputs);
        let to_new = |old: u32| -> u32 {
            let mid = match &first {
                Some(m) => match m.get(&old) {
                    Some(&v) => v,
                    None => return u32::MAX,
                },
                None => old,
            };
            second[mid as usize]
        };
        let m = &mut self.manifest;
        for s in &mut m.sites {
            s.node = to_new(s.node);
        }
        for o in &mut m.outputs {
            o.tensor = to_new(o.tensor);
        }
        for a in &mut m.actuations {
            a.node = to_new(a.node);
        }
        for c in &mut m.captures {
            c.tensor = to_new(c.tensor);
        }
        let map = (0..original as u32).map(|old| Some(to_new(old)).filter(|&v| v != u32::MAX).map(NodeId)).collect();
        (graph, self.manifest, map)
    }
}

/// `g` with every node that only the tap outputs need (not reachable from the first
/// `user_outputs` outputs) placed right after the last node it reads; the other nodes keep
/// their relative order. Returns the graph and the map old index -> new index.
fn place_early(g: Graph, user_outputs: usize) -> (Graph, Vec<u32>) {
    let live = reachable(&g, user_outputs);
    // Sort key: (position among the caller's nodes after which the node runs, tie-break).
    // A caller's node i keeps (i, 0); a tap-only node goes after its latest input's position,
    // ordered among its peers by index (inputs are created before their users, so a
    // tap-only chain keeps its order).
    //
    // A weight sketch therefore runs where the graph declares the weight, before the node
    // that reads it. Running it right after that node instead (the weight warm in cache; the
    // memo's hash ran several times faster on the chain MLP) changed a caller's outputs:
    // `tests/attn_reference.rs::fused_attention_from_a_merged_qkv_projection` at 16 tokens.
    // RLX 0.2.19 miscompiles that program above 64 tokens (it reuses the QKV buffer before
    // its Attention reads it); moving the sketch's output allocation between those nodes most
    // likely opened the same window at 16 tokens. Tap nodes must not move the caller's arena
    // plan in ways the tests have not covered.
    let mut key: Vec<(i64, u32)> = Vec::with_capacity(g.len());
    for n in g.nodes() {
        let i = n.id.0 as usize;
        let k = if live[i] { (i as i64, 0) } else { (n.inputs.iter().map(|p| key[p.0 as usize].0).max().unwrap_or(-1), 1 + n.id.0) };
        key.push(k);
    }
    let mut order: Vec<NodeId> = g.nodes().iter().map(|n| n.id).collect();
    // Keys are distinct (a caller's node by its index, a tap-only node by 1 + its id).
    order.sort_unstable_by_key(|id| key[id.0 as usize]);
    permute(g, &order)
}

/// `g` with its nodes in `order` (a topological permutation of all of them), moved in place
/// rather than copied as [`emit`] does: the tap pass reorders every tapped graph, and cloning
/// each node's op, name and origin was an eighth of its time (`perf`, chain MLP at L = 64).
/// Returns the graph and the map old id -> new id.
fn permute(mut g: Graph, order: &[NodeId]) -> (Graph, Vec<u32>) {
    debug_assert_eq!(order.len(), g.len(), "permute: order must list every node once");
    let mut to_new = vec![0u32; g.len()];
    for (new, old) in order.iter().enumerate() {
        to_new[old.0 as usize] = new as u32;
    }
    let renumber = |i: NodeId| NodeId(to_new[i.0 as usize]);
    for n in g.nodes_mut() {
        n.id = renumber(n.id);
        for i in n.inputs.iter_mut() {
            *i = renumber(*i);
        }
    }
    // Move each node to its new slot by following the permutation's cycles: every swap puts
    // one node where it belongs.
    let mut dest = to_new.clone();
    let nodes = g.nodes_mut();
    for i in 0..nodes.len() {
        while dest[i] as usize != i {
            let j = dest[i] as usize;
            nodes.swap(i, j);
            dest.swap(i, j);
        }
    }
    g.outputs = g.outputs.iter().map(|&o| renumber(o)).collect();
    let (vars, attrs) = node_refs(&g, |i| Some(renumber(i)));
    g.set_vars(vars);
    g.set_sym_attrs(attrs);
    (g, to_new)
}

/// `g`'s variables and symbolic attributes with their nodes renumbered by `map`; an entry
/// whose node `map` drops (`None`) is dropped with it.
fn node_refs(g: &Graph, map: impl Fn(NodeId) -> Option<NodeId>) -> (Vec<(NodeId, usize)>, Vec<rlx_ir::dynamic::SymAttr>) {
    let vars = g.vars().iter().filter_map(|&(i, o)| Some((map(i)?, o))).collect();
    let attrs = g.sym_attrs().iter().filter_map(|a| Some(rlx_ir::dynamic::SymAttr { node: map(a.node)?, ..a.clone() })).collect();
    (vars, attrs)
}

/// Nodes reachable from the first `user_outputs` outputs (inputs and parameters always count).
fn reachable(g: &Graph, user_outputs: usize) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    let mut stack: Vec<NodeId> = g.outputs.iter().take(user_outputs).copied().collect();
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id.0 as usize], true) {
            stack.extend(g.node(id).inputs.iter().copied());
        }
    }
    for n in g.nodes() {
        if matches!(n.op, Op::Input { .. } | Op::Param { .. }) {
            live[n.id.0 as usize] = true;
        }
    }
    live
}

/// `g` rebuilt in topological order (inputs before users, original order kept where it already
/// is) with only the nodes some output needs, plus every input and parameter. Returns the new
/// graph and the map old id -> new id.
fn rebuild(g: &Graph) -> (Graph, HashMap<u32, u32>) {
    let mut order: Vec<NodeId> = Vec::new();
    let mut state = vec![0u8; g.len()]; // 0 unseen, 1 open, 2 emitted
    let roots: Vec<NodeId> = g
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, Op::Input { .. } | Op::Param { .. }))
        .map(|n| n.id)
        .chain(g.outputs.iter().copied())
        .collect();
    for root in roots {
        // Iterative post-order DFS: a node is emitted after all its inputs.
        let mut stack = vec![(root, false)];
        while let Some((id, expanded)) = stack.pop() {
            let i = id.0 as usize;
            if state[i] == 2 {
                continue;
            }
            if expanded {
                state[i] = 2;
                order.push(id);
                continue;
            }
            state[i] = 1;
            stack.push((id, true));
            for &inp in g.node(id).inputs.iter().rev() {
                if state[inp.0 as usize] == 0 {
                    stack.push((inp, false));
                }
            }
        }
    }
    let (out, to_new) = emit(g, &order);
    let map = to_new.iter().enumerate().filter(|(_, &n)| n != u32::MAX).map(|(o, &n)| (o as u32, n)).collect();
    (out, map)
}

/// The nodes of `g` listed in `order` (a topological order), as a new graph with the same
/// outputs, names, variables and symbolic attributes. Returns the graph and, per old id, the
/// new id (`u32::MAX` for a node not in `order`).
fn emit(g: &Graph, order: &[NodeId]) -> (Graph, Vec<u32>) {
    const NONE: u32 = u32::MAX;
    let mut map = vec![NONE; g.len()];
    let get = |map: &[u32], i: NodeId| Some(map[i.0 as usize]).filter(|&v| v != NONE).map(NodeId);
    let mut out = Graph::new(&g.name);
    for old in order {
        let n = g.node(*old);
        // `order` is topological: every input is already emitted.
        let inputs = n.inputs.iter().map(|&i| get(&map, i).expect("emit: an input after its user")).collect();
        let id = out.add_node(n.op.clone(), inputs, n.shape.clone());
        let m = out.node_mut(id);
        m.name = n.name.clone();
        m.origin = n.origin.clone();
        map[old.0 as usize] = id.0;
    }
    out.set_outputs(g.outputs.iter().map(|&o| get(&map, o).expect("emit: an output not emitted")).collect());
    out.set_output_names(g.output_names().to_vec());
    let (vars, attrs) = node_refs(g, |i| get(&map, i));
    out.set_vars(vars);
    out.set_sym_attrs(attrs);
    out.set_sym_defs(g.sym_defs().to_vec());
    (out, map)
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::sketch::{tensor, HistRange};

    /// A spec with a non-finite fixed histogram range (JSON cannot encode it) is skipped with
    /// the reason, not appended as a node whose attributes no kernel can decode.
    #[test]
    fn a_non_finite_fixed_range_is_skipped_with_the_reason() {
        crate::sketch::register_kernels();
        let mut g = Graph::new("g");
        let x = g.input("x", Shape::new(&[4, 8], DType::F32));
        g.set_outputs(vec![x]);
        for (lo, hi) in [(f32::NEG_INFINITY, 1.0), (0.0, f32::NAN), (1.0, 1.0)] {
            let mut rw = Rewrite::new(&g, None, "test".into(), 1);
            let plan = SketchSpec::for_shape(&g.node(x).shape, &[tensor::HIST], 8, HistRange::Fixed { lo, hi }, 4).unwrap();
            rw.tap("s", crate::manifest::Role::LHS, x, plan.spec);
            let (out, m) = rw.finish();
            assert!(m.outputs.is_empty(), "[{lo}, {hi}]: appended");
            assert_eq!(out.outputs.len(), 1);
            assert!(m.skipped.iter().any(|k| k.reason.contains("not a finite range")), "[{lo}, {hi}]: {:?}", m.skipped);
        }
        // A finite range is appended.
        let mut rw = Rewrite::new(&g, None, "test".into(), 1);
        let plan = SketchSpec::for_shape(&g.node(x).shape, &[tensor::HIST], 8, HistRange::Fixed { lo: -1.0, hi: 1.0 }, 4).unwrap();
        rw.tap("s", crate::manifest::Role::LHS, x, plan.spec);
        assert_eq!(rw.finish().1.outputs.len(), 1);
    }

    /// The in-place reorder gives the graph the copying one builds: the same nodes in the same
    /// order with the same ids, inputs, names and origins, the same outputs, output names,
    /// variables and symbolic attributes, and the same map old -> new.
    #[test]
    fn permute_in_place_matches_emit() {
        let s = Shape::new(&[4, 4], DType::F32);
        let mut g = Graph::new("g");
        let x = g.input("x", s.clone());
        let k = g.input("k", s.clone());
        let w = g.param("w", s.clone());
        let a = g.matmul(x, w, s.clone());
        let b = g.matmul(a, k, s.clone());
        let c = g.matmul(x, a, s.clone());
        g.node_mut(c).name = Some("c".into());
        g.set_outputs(vec![b, c, a]);
        g.set_output_names(vec![(0, "b".into()), (2, "a_out".into())]);
        g.set_vars(vec![(k, 2)]);
        // An attribute of c that is a symbol's size (a decode step's cache position).
        g.set_sym_attrs(vec![rlx_ir::dynamic::SymAttr { node: c, path: vec!["pos".into()], sym: 0, scale: 1, offset: 0 }]);
        // Inputs first, then c before b: a topological order other than the identity.
        let order = [x, k, w, a, c, b];
        let (want, want_map) = emit(&g, &order);
        let (got, got_map) = permute(g.clone(), &order);
        assert_eq!(got_map, want_map);
        assert_eq!(got.len(), want.len());
        for (m, n) in got.nodes().iter().zip(want.nodes()) {
            assert_eq!((m.id, &m.inputs, &m.name, &m.shape), (n.id, &n.inputs, &n.name, &n.shape));
            assert_eq!(format!("{:?} {:?}", m.op, m.origin), format!("{:?} {:?}", n.op, n.origin));
        }
        assert_eq!(got.outputs, want.outputs);
        assert_eq!(got.output_names(), want.output_names());
        assert_eq!(got.vars(), want.vars());
        assert_eq!(got.sym_attrs(), want.sym_attrs());
        assert_eq!(got.sym_attrs()[0].node, NodeId(4), "c's symbolic attribute follows it");
        assert_eq!(got.node(NodeId(4)).name.as_deref(), Some("c"), "c moved to slot 4");
        assert_eq!(got.node(NodeId(5)).inputs, vec![NodeId(3), NodeId(1)], "b reads a and k at their new ids");
    }

    /// `apply_mapped`'s map (what `opscope parity` matches nodes by) sends every node of the
    /// caller's graph to the node of the rewritten graph holding the same op, reading the
    /// images of its inputs: for a tap (nodes reordered) and for an actuation that inserts nodes
    /// before the matmuls (the graph rebuilt).
    #[test]
    fn apply_mapped_maps_each_node_to_its_image() {
        crate::sketch::register_kernels();
        let s = |d: &[usize]| Shape::new(d, DType::F32);
        let mut g = Graph::new("g");
        let x = g.input("x", s(&[4, 8]));
        let w1 = g.param("w1", s(&[8, 8]));
        let w2 = g.param("w2", s(&[8, 8]));
        let a = g.matmul(x, w1, s(&[4, 8]));
        let b = g.matmul(a, w2, s(&[4, 8]));
        g.set_outputs(vec![b]);
        for text in ["matmul", "fakequant,matmul"] {
            let p = crate::Pipeline::parse(text).unwrap();
            let (out, _, map) = p.apply_mapped(&g, None, 1, rlx_runtime::Device::Cpu).unwrap();
            assert_eq!(map.len(), g.len(), "{text}");
            for n in g.nodes() {
                let img = map[n.id.0 as usize].unwrap_or_else(|| panic!("{text}: node {} has no image", n.id.0));
                assert_eq!(format!("{:?}", out.node(img).op), format!("{:?}", n.op), "{text}: node {}", n.id.0);
                if text == "matmul" {
                    let inputs: Vec<NodeId> = n.inputs.iter().map(|i| map[i.0 as usize].unwrap()).collect();
                    assert_eq!(out.node(img).inputs, inputs, "{text}: node {}", n.id.0);
                }
            }
            assert_eq!(out.outputs[0], map[b.0 as usize].unwrap(), "{text}: the caller's output");
        }
    }

    /// One tensor read by two sites is sketched once (the second use shares the first's
    /// output); a statistic the lowered sketch leaves out is listed as skipped under each use's
    /// own site and role, not twice under the first's.
    #[test]
    fn a_shared_lowered_sketch_lists_its_missing_statistics_under_every_use() {
        crate::sketch::register_kernels();
        let s = |d: &[usize]| Shape::new(d, DType::F32);
        let mut g = Graph::new("g");
        let x = g.input("x", s(&[4, 8]));
        let (w1, w2) = (g.param("w1", s(&[8, 8])), g.param("w2", s(&[8, 8])));
        let a = g.matmul(x, w1, s(&[4, 8]));
        let b = g.matmul(x, w2, s(&[4, 8]));
        // x also as the rhs of an activation x activation product.
        let y = g.input("y", s(&[4, 4]));
        let c = g.matmul(y, x, s(&[4, 8]));
        g.set_outputs(vec![a, b, c]);
        let p = crate::Pipeline::parse("matmul{roles=[lhs,rhs],lower=true}").unwrap();
        let (_, m) = p.apply_tagged(&g, None, 1).unwrap();
        // x's sketch: the one the first matmul's lhs uses (one output for all three uses).
        let shared = m.outputs.iter().find(|o| o.uses.iter().any(|u| u.role == Role::LHS && u.site == m.outputs[0].uses[0].site)).expect("x is sketched");
        assert_eq!(m.outputs.iter().filter(|o| o.tensor == shared.tensor).count(), 1, "x is sketched once: {:?}", m.outputs);
        let uses: Vec<(&str, &Role)> = shared.uses.iter().map(|u| (u.site.as_str(), &u.role)).collect();
        assert_eq!(uses.len(), 3, "{uses:?}");
        let hist: Vec<(&str, &Role)> = m
            .skipped
            .iter()
            .filter(|k| k.stat.as_deref() == Some("hist") && uses.iter().any(|u| u.0 == k.site))
            .filter_map(|k| Some((k.site.as_str(), k.role.as_ref()?)))
            .filter(|k| uses.contains(k))
            .collect();
        assert_eq!(hist, uses, "{:?}", m.skipped);
    }
}
