//! The one graph-rewrite helper every pass uses: site naming, appending sketch nodes as extra
//! outputs, de-duplicating identical sketches of one tensor, and building the manifest.

use std::collections::HashMap;

use rlx_ir::{Graph, NodeId, Op};

use crate::manifest::{Manifest, Role, Site, Skipped, TapOutput, TapUse};
use crate::sketch::{shape_text, static_dims, SketchSpec, KEEP_OP, SKETCH_OP};

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

    /// The node ids of the graph the pipeline started from (sites are found among these, so a
    /// pass never taps another pass's sketch nodes).
    pub fn original_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.names.len() as u32).map(NodeId)
    }

    /// Site name of an original node.
    pub fn site_name(&self, node: NodeId) -> String {
        self.names.get(&node.0).cloned().unwrap_or_else(|| format!("node.{}", node.0))
    }

    /// The pipeline is about to run its `idx`-th pass, `name`: sites and taps recorded from
    /// now on are attributed to it.
    pub fn begin_pass(&mut self, idx: usize, name: &'static str) {
        self.current = (idx, name);
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
    pub fn tap(&mut self, site: &str, role: Role, tensor: NodeId, mut spec: SketchSpec) {
        spec.tag = self.manifest.tag;
        let invariant = !self.dynamic.get(tensor.0 as usize).copied().unwrap_or(true);
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
        let attrs = spec.to_attrs();
        if let Some(&i) = self.dedupe.get(&(tensor.0, attrs.clone())) {
            self.manifest.outputs[i].uses.push(use_);
            return;
        }
        let output_index = if numel == Some(0) {
            None
        } else {
            let name = format!("opscope/{site}/{}", role.as_str());
            let mut id = self.graph.custom_op(SKETCH_OP, attrs.clone(), vec![tensor]);
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

    /// Users of `node` among the graph's own nodes (not sketch nodes appended by a pass).
    pub fn users(&self, node: NodeId) -> Vec<NodeId> {
        self.graph
            .users(node)
            .into_iter()
            .filter(|u| !matches!(&self.graph.node(*u).op, Op::Custom { name, .. } if name == SKETCH_OP || name == KEEP_OP))
            .collect()
    }

    /// Finish: the rewritten graph and its manifest.
    pub fn finish(self) -> (Graph, Manifest) {
        (self.graph, self.manifest)
    }
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
