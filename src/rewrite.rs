//! The one graph-rewrite helper every pass uses: site naming, appending sketch nodes as extra
//! outputs, de-duplicating identical sketches of one tensor, and building the manifest.

use std::collections::HashMap;

use rlx_ir::{Graph, NodeId, Op};

use crate::manifest::{Actuation, Manifest, Role, Site, Skipped, TapOutput, TapUse};
use crate::sketch::{is_sketch_op, shape_text, static_dims, SketchSpec, KEEP_OP, SKETCH2_OP, SKETCH3_OP, SKETCH_OP};

/// A graph being rewritten by a pipeline, and the manifest of what was done to it.
pub struct Rewrite {
    graph: Graph,
    manifest: Manifest,
    names: HashMap<u32, String>,
    by_param: HashMap<(String, String), String>,
    /// Per original node: reachable from a graph input or a nondeterministic op.
    dynamic: Vec<bool>,
    /// A run-time tensor read by `keep` nodes so that weight sketches can be hoisted.
    anchor: Option<NodeId>,
    /// (position in the pipeline, name) of the pass running now.
    current: (usize, &'static str),
    dedupe: HashMap<(u32, Vec<u8>), usize>,
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
}

impl Rewrite {
    /// Start from a copy of `graph`. When `graph` is the fused (deployed) form of `source`,
    /// site names are recovered from `source` (see [`Rewrite::site_name`]).
    pub fn new(graph: &Graph, source: Option<&Graph>, pipeline: String, tag: u32) -> Rewrite {
        let manifest = Manifest {
            graph: graph.name.clone(),
            pipeline,
            tag,
            user_outputs: graph.outputs.len(),
            sites: Vec::new(),
            outputs: Vec::new(),
            skipped: Vec::new(),
            actuations: Vec::new(),
        };
        let mut rw = Rewrite {
            graph: graph.clone(),
            manifest,
            names: HashMap::new(),
            by_param: HashMap::new(),
            dynamic: Vec::new(),
            anchor: None,
            current: (0, ""),
            dedupe: HashMap::new(),
            restructured: false,
            live: vec![true; graph.len()],
            blocks: None,
            elided: backend_elided(graph),
        };
        let mut dynamic = vec![false; graph.len()];
        for n in graph.nodes() {
            dynamic[n.id.0 as usize] = matches!(n.op, Op::Input { .. })
                || n.op.is_nondeterministic()
                || n.inputs.iter().any(|i| dynamic[i.0 as usize]);
        }
        rw.dynamic = dynamic;
        // The first run-time F32 tensor (measured on MiniLM: an I64 anchor such as `input_ids`
        // left the hoisted value unfilled).
        rw.anchor = graph
            .nodes()
            .iter()
            .find(|n| rw.dynamic[n.id.0 as usize] && n.shape.dtype() == rlx_ir::DType::F32)
            .map(|n| n.id);
        rw.name_nodes(source);
        rw
    }

    /// Site names. A node's own name (ONNX node name without the leading '/') wins; else, for
    /// a fused graph, the name of the source node of the same family that consumed the same
    /// parameter (the weight survives fusion, node names do not), else the name of the k-th
    /// parameter-less source node of that family when both graphs have the same number of
    /// them; else `{family}.{k}`. Names are made unique with `#node`.
    fn name_nodes(&mut self, source: Option<&Graph>) {
        let own = base_names(&self.graph);
        let mut names: Vec<String> = own.clone();
        if let Some(src) = source {
            let src_names = base_names(src);
            let mut by_param: HashMap<(String, String), Vec<String>> = HashMap::new();
            let mut paramless_src: HashMap<String, Vec<String>> = HashMap::new();
            for n in src.nodes() {
                let fam = family(&n.op);
                let params = param_inputs(src, &n.inputs);
                for p in &params {
                    by_param.entry((fam.clone(), p.clone())).or_default().push(src_names[n.id.0 as usize].clone());
                }
                if params.is_empty() {
                    paramless_src.entry(fam).or_default().push(src_names[n.id.0 as usize].clone());
                }
            }
            let mut paramless_dst: HashMap<String, Vec<usize>> = HashMap::new();
            for n in self.graph.nodes() {
                let i = n.id.0 as usize;
                if n.name.as_deref().is_some_and(|s| !s.is_empty()) {
                    continue;
                }
                let fam = family(&n.op);
                let params = param_inputs(&self.graph, &n.inputs);
                // Every parameter's source node, deduplicated: one source node names the fused
                // node; several (a merged op that is not split into parts) are joined with '+',
                // so a site never silently carries another site's name alone.
                let mut hits: Vec<&String> = Vec::new();
                for p in &params {
                    if let Some(v) = by_param.get(&(fam.clone(), p.clone())) {
                        if v.len() == 1 && !hits.contains(&&v[0]) {
                            hits.push(&v[0]);
                        }
                    }
                }
                let hit = (!hits.is_empty()).then(|| hits.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("+"));
                match hit {
                    Some(name) => names[i] = name,
                    None if params.is_empty() => paramless_dst.entry(fam).or_default().push(i),
                    None => {}
                }
            }
            for (fam, dst) in paramless_dst {
                if let Some(src) = paramless_src.get(&fam) {
                    if src.len() == dst.len() {
                        for (i, name) in dst.into_iter().zip(src) {
                            names[i] = name.clone();
                        }
                    }
                }
            }
            self.by_param = by_param
                .into_iter()
                .filter(|(_, v)| v.len() == 1)
                .map(|(k, mut v)| (k, v.remove(0)))
                .collect();
        }
        let mut taken: HashMap<String, usize> = HashMap::new();
        for (i, base) in names.into_iter().enumerate() {
            let count = taken.entry(base.clone()).or_default();
            let name = if *count == 0 { base } else { format!("{base}#{i}") };
            *count += 1;
            self.names.insert(i as u32, name);
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
        self.names.get(&node.0).cloned().unwrap_or_else(|| format!("node.{}", node.0))
    }

    /// The pipeline is about to run its `idx`-th pass, `name`: sites and taps recorded from
    /// now on are attributed to it.
    pub fn begin_pass(&mut self, idx: usize, name: &'static str) {
        self.current = (idx, name);
        if self.restructured {
            let keep = reachable(&self.graph, self.manifest.user_outputs);
            for (i, l) in self.live.iter_mut().enumerate() {
                *l = keep[i];
            }
        }
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
        let shape = tensor.map(|t| shape_text(&self.graph.node(t).shape));
        self.manifest.skipped.push(Skipped {
            site: site.to_string(),
            role,
            shape,
            reason,
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

    /// [`Rewrite::tap`] for a probe that reads several tensors (1 to 3; see
    /// [`crate::probes::Probe`]): `inputs[0]` is the tensor the row's shape and count describe.
    pub fn tap_inputs(&mut self, site: &str, role: Role, inputs: &[NodeId], mut spec: SketchSpec) {
        let tensor = inputs[0];
        if let Some(why) = inputs.iter().find_map(|t| self.elided(*t)) {
            let why = why.to_string();
            self.skip(site, Some(role), Some(tensor), why);
            return;
        }
        let op = match inputs.len() {
            1 => SKETCH_OP,
            2 => SKETCH2_OP,
            _ => SKETCH3_OP,
        };
        spec.tag = self.manifest.tag;
        let invariant = inputs.iter().all(|t| !self.dynamic.get(t.0 as usize).copied().unwrap_or(true));
        spec.memo = invariant;
        let shape = self.graph.node(tensor).shape.clone();
        // `None` for a symbolic shape: the element count is only known at run time.
        let numel: Option<u64> = static_dims(&shape).map(|d| d.iter().product::<usize>() as u64);
        let use_ = TapUse {
            pass: self.current.1.to_string(),
            pass_idx: self.current.0,
            site: site.to_string(),
            role,
        };
        let mut attrs = spec.to_attrs();
        for t in &inputs[1..] {
            attrs.extend_from_slice(&t.0.to_le_bytes()); // the dedupe key names every input
        }
        if let Some(&i) = self.dedupe.get(&(tensor.0, attrs.clone())) {
            self.manifest.outputs[i].uses.push(use_);
            return;
        }
        let output_index = if numel == Some(0) {
            None
        } else {
            let name = format!("opscope/{site}/{}", role.as_str());
            let mut id = self.graph.custom_op(op, spec.to_attrs(), inputs.to_vec());
            self.graph.node_mut(id).name = Some(name.clone());
            if let (true, Some(anchor)) = (invariant, self.anchor) {
                id = self.graph.custom_op(KEEP_OP, Vec::new(), vec![id, anchor]);
                self.graph.node_mut(id).name = Some(format!("{name}/keep"));
            }
            self.graph.outputs.push(id);
            Some(self.graph.outputs.len() - 1)
        };
        self.dedupe.insert((tensor.0, attrs), self.manifest.outputs.len());
        self.manifest.outputs.push(TapOutput {
            output_index,
            tensor: tensor.0,
            shape: shape_text(&shape),
            numel,
            uses: vec![use_],
            invariant,
            layout: spec.layout(),
            spec,
        });
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
            .filter(|u| !matches!(&self.graph.node(*u).op, Op::Custom { name, .. } if is_sketch_op(name) || name == KEEP_OP))
            .collect()
    }

    /// Finish: the rewritten graph and its manifest. After an actuation the graph is rebuilt
    /// in topological order without dead nodes, and node ids in the manifest are renumbered.
    pub fn finish(mut self) -> (Graph, Manifest) {
        if !self.restructured {
            return (self.graph, self.manifest);
        }
        let (graph, map) = rebuild(&self.graph);
        let m = &mut self.manifest;
        let dead = u32::MAX;
        for s in &mut m.sites {
            s.node = map.get(&s.node).copied().unwrap_or(dead);
        }
        for o in &mut m.outputs {
            o.tensor = map.get(&o.tensor).copied().unwrap_or(dead);
        }
        for a in &mut m.actuations {
            a.node = map.get(&a.node).copied().unwrap_or(dead);
        }
        (graph, self.manifest)
    }
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
    let mut map: HashMap<u32, u32> = HashMap::new();
    let mut out = Graph::new(&g.name);
    for old in &order {
        let n = g.node(*old);
        let inputs = n.inputs.iter().map(|i| NodeId(map[&i.0])).collect();
        let id = out.add_node(n.op.clone(), inputs, n.shape.clone());
        let m = out.node_mut(id);
        m.name = n.name.clone();
        m.origin = n.origin.clone();
        map.insert(old.0, id.0);
    }
    out.set_outputs(g.outputs.iter().map(|o| NodeId(map[&o.0])).collect());
    out.set_output_names(g.output_names().to_vec());
    out.set_vars(g.vars().iter().filter_map(|(i, o)| Some((NodeId(*map.get(&i.0)?), *o))).collect());
    out.set_sym_attrs(
        g.sym_attrs()
            .iter()
            .filter_map(|a| Some(rlx_ir::dynamic::SymAttr { node: NodeId(*map.get(&a.node.0)?), ..a.clone() }))
            .collect(),
    );
    out.set_sym_defs(g.sym_defs().to_vec());
    (out, map)
}

/// Base names of every node: own name without a leading '/', else `{family}.{k}`.
fn base_names(g: &Graph) -> Vec<String> {
    let mut per: HashMap<String, usize> = HashMap::new();
    g.nodes()
        .iter()
        .map(|n| {
            let fam = family(&n.op);
            let k = per.entry(fam.clone()).or_default();
            let name = match &n.name {
                Some(name) if !name.is_empty() => name.trim_start_matches('/').to_string(),
                _ => format!("{fam}.{k}"),
            };
            *k += 1;
            name
        })
        .collect()
}

/// Names of the parameters among `inputs`, looking through reshapes, transposes and concats
/// (fusion concatenates the weights of merged projections).
fn param_inputs(g: &Graph, inputs: &[NodeId]) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack: Vec<NodeId> = inputs.to_vec();
    while let Some(i) = stack.pop() {
        let n = g.node(i);
        match &n.op {
            Op::Param { name } => out.push(name.clone()),
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } => stack.extend(n.inputs.iter().rev()),
            _ => {}
        }
    }
    out
}

/// The op family used for naming: fusion turns a MatMul into a fused matmul, so all matmul
/// forms share the family `matmul`; other ops are their own family.
pub fn family(op: &Op) -> String {
    match op {
        Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual | Op::DequantMatMul { .. } => {
            "matmul".into()
        }
        _ => op_name(op),
    }
}

/// Op name as RLX prints it, without attributes (`matmul`, `softmax`, `fused_mm_bias`).
pub fn op_name(op: &Op) -> String {
    let s = op.to_string();
    let end = s.find(['(', '{', ' ']).unwrap_or(s.len());
    s[..end].to_string()
}

/// A residual connection `x + f(x)` found in a graph.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualBlock {
    /// Block index in execution (node) order, shared by the `residual` tap and the `skip`
    /// actuation: `block.{index}`.
    pub index: usize,
    /// The node computing the sum: `Binary(Add)`, or a `FusedResidualLN` / `FusedResidualRmsNorm`
    /// (RLX's CPU fusion of `Add` + norm) that normalizes it.
    pub node: NodeId,
    /// The residual stream `x`.
    pub stream: NodeId,
    /// The branch `f(x)`.
    pub branch: NodeId,
    /// Which input of `node` (0 or 1) is the stream.
    pub stream_input: usize,
}

/// Every residual connection of `g`, in node order: an `Add` (or a fused residual norm, whose
/// inputs 0 and 1 are summed) of two same-shape F32 tensors where one (`x`) is an ancestor of
/// the other (`f(x)`) through a path holding at least one matmul or attention op. Bias adds
/// (broadcast) and sums of independent tensors (token + position embeddings) are not blocks.
pub fn residual_blocks(g: &Graph) -> Vec<ResidualBlock> {
    let mut out = Vec::new();
    for n in g.nodes() {
        let pair = match &n.op {
            Op::Binary(rlx_ir::op::BinaryOp::Add) => true,
            Op::FusedResidualLN { .. } | Op::FusedResidualRmsNorm { .. } => true,
            _ => false,
        };
        if !pair || n.inputs.len() < 2 {
            continue;
        }
        let (a, b) = (n.inputs[0], n.inputs[1]);
        let (sa, sb) = (&g.node(a).shape, &g.node(b).shape);
        if sa != sb || sa.dtype() != rlx_ir::DType::F32 {
            continue;
        }
        let found = if through_matmul(g, b, a) {
            Some((a, b, 0))
        } else if through_matmul(g, a, b) {
            Some((b, a, 1))
        } else {
            None
        };
        if let Some((stream, branch, stream_input)) = found {
            out.push(ResidualBlock { index: out.len(), node: n.id, stream, branch, stream_input });
        }
    }
    out
}

/// True if `ancestor` is reached walking back from `from` along a path that passes through a
/// matmul-family or attention node (nodes before `ancestor` are not visited).
fn through_matmul(g: &Graph, from: NodeId, ancestor: NodeId) -> bool {
    if from.0 <= ancestor.0 {
        return false;
    }
    // state: 1 = reaches ancestor without a matmul yet, 2 = with one; search (node, seen_mm).
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![(from, false)];
    while let Some((id, mm)) = stack.pop() {
        if !seen.insert((id, mm)) {
            continue;
        }
        let node = g.node(id);
        let mm = mm || family(&node.op) == "matmul" || matches!(node.op, Op::Attention { .. });
        for &i in &node.inputs {
            if i == ancestor {
                if mm {
                    return true;
                }
            } else if i.0 > ancestor.0 {
                stack.push((i, mm));
            }
        }
    }
    false
}

/// Tensors of `g` that RLX 0.2.19's CPU backend never writes, because a thunk-level fusion reads
/// around them (measured: a sketch reading one sees stale memory). RLX decides these fusions
/// after opscope's rewrite and does not count a custom op as a reader, so they are predicted
/// here from the graph, mirroring `rlx-cpu` `thunk/compile_dispatch.rs`:
/// - `Narrow` -> `Attention` / `Rope`: a last-axis slice whose only reader is an attention (all
///   three of Q, K, V sliced) or a rope is read in place from its parent;
/// - `FusedAttnBlock`: at batch x seq <= `RLX_FUSE_ATTN_THRESHOLD` (default 64), a QKV projection
///   sliced three ways into an attention whose output feeds one projection is one kernel: the
///   QKV output, the slices and the attention output never exist.
pub fn backend_elided(g: &Graph) -> HashMap<u32, String> {
    let mut out: HashMap<u32, String> = HashMap::new();
    let users = |id: NodeId| g.users(id);
    // The node and the reshape views above it (a Reshape shares its input's buffer).
    let strip = |mut id: NodeId| -> (NodeId, Vec<NodeId>) {
        let mut views = Vec::new();
        while matches!(g.node(id).op, Op::Reshape { .. }) {
            views.push(id);
            id = g.node(id).inputs[0];
        }
        (id, views)
    };
    let last_axis_narrow = |id: NodeId| matches!(g.node(id).op, Op::Narrow { axis, .. } if axis + 1 == g.node(id).shape.rank());
    let single_reader = |id: NodeId, views: &[NodeId]| {
        // The narrow feeds only the view chain, and the chain's top only its one reader.
        let chain: Vec<NodeId> = std::iter::once(id).chain(views.iter().rev().copied()).collect();
        chain.iter().all(|&n| users(n).len() == 1)
    };
    let strided = "RLX 0.2.19's CPU backend reads this slice in place from its parent (Narrow -> Attention/Rope \
                   fusion) and never writes it: a sketch would read stale memory";
    // Read as rlx-cpu reads it (`rlx_ir::env::var`, registry overrides included).
    let threshold: usize = rlx_ir::env::var("RLX_FUSE_ATTN_THRESHOLD").and_then(|v| v.parse().ok()).unwrap_or(64);
    for n in g.nodes() {
        match &n.op {
            Op::Rope { .. } => {
                let (src, views) = strip(n.inputs[0]);
                if last_axis_narrow(src) && single_reader(src, &views) {
                    for v in std::iter::once(src).chain(views) {
                        out.insert(v.0, strided.into());
                    }
                }
            }
            Op::Attention { num_heads, .. } => {
                if n.inputs.len() < 3 {
                    continue;
                }
                // Q and K may pass through a Rope (its output is written).
                let through_rope = |id: NodeId| match g.node(strip(id).0).op {
                    Op::Rope { .. } => g.node(strip(id).0).inputs[0],
                    _ => id,
                };
                let parts: Vec<(NodeId, Vec<NodeId>)> =
                    [through_rope(n.inputs[0]), through_rope(n.inputs[1]), n.inputs[2]].into_iter().map(strip).collect();
                if !parts.iter().all(|(p, _)| last_axis_narrow(*p)) {
                    continue;
                }
                if parts.iter().all(|(p, v)| single_reader(*p, v)) {
                    for (p, v) in &parts {
                        for x in std::iter::once(*p).chain(v.iter().copied()) {
                            out.insert(x.0, strided.into());
                        }
                    }
                }
                // FusedAttnBlock: batch x seq from Q as the CPU kernel reads it.
                let q = static_dims(&g.node(n.inputs[0]).shape).unwrap_or_default();
                let (b, s) = match q.as_slice() {
                    [b, d1, d2, _] => (*b, if *d1 == *num_heads { *d2 } else { *d1 }),
                    [b, s, _] => (*b, *s),
                    [s, _] => (1, *s),
                    _ => continue,
                };
                let parent = g.node(parts[0].0).inputs[0];
                let same_parent = parts.iter().all(|(p, _)| g.node(*p).inputs[0] == parent);
                let qkv_matmul = matches!(
                    g.node(parent).op,
                    Op::MatMul | Op::FusedMatMulBiasAct { activation: None, .. }
                );
                let out_users: Vec<NodeId> = {
                    let mut u = users(n.id);
                    while u.len() == 1 && matches!(g.node(u[0]).op, Op::Reshape { .. }) {
                        u = users(u[0]);
                    }
                    u
                };
                let out_proj = out_users.len() == 1 && family(&g.node(out_users[0]).op) == "matmul";
                if b * s <= threshold && same_parent && qkv_matmul && out_proj {
                    let block = format!(
                        "RLX 0.2.19's CPU backend fuses the QKV projection, its slices, this attention and the output \
                         projection into one kernel at batch x seq = {} <= {threshold} (RLX_FUSE_ATTN_THRESHOLD): this \
                         tensor is never written, a sketch would read stale memory (RLX_FUSE_ATTN_THRESHOLD=0 makes it \
                         observable, in a different program)",
                        b * s
                    );
                    let mut ids = vec![parent, n.id];
                    for (p, v) in &parts {
                        ids.push(*p);
                        ids.extend(v.iter().copied());
                    }
                    let mut u = users(n.id);
                    while u.len() == 1 && matches!(g.node(u[0]).op, Op::Reshape { .. }) {
                        ids.push(u[0]);
                        u = users(u[0]);
                    }
                    for id in ids {
                        out.insert(id.0, block.clone());
                    }
                }
            }
            _ => {}
        }
    }
    out
}
