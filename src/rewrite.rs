//! The one graph-rewrite helper every pass uses: site naming, appending sketch nodes as extra
//! outputs, de-duplicating identical sketches of one tensor, and building the manifest.

use std::collections::HashMap;

use rlx_ir::{Graph, NodeId, Op};

use crate::manifest::{Manifest, Role, Site, Skipped, TapOutput, TapUse};
use crate::sketch::{shape_text, static_dims, SketchSpec, SKETCH_OP};

/// A graph being rewritten by a pipeline, and the manifest of what was done to it.
pub struct Rewrite {
    graph: Graph,
    manifest: Manifest,
    names: HashMap<u32, String>,
    dedupe: HashMap<(u32, Vec<u8>), usize>,
}

impl Rewrite {
    /// Start from a copy of `graph`.
    pub fn new(graph: &Graph, pipeline: String, tag: u32) -> Rewrite {
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
            dedupe: HashMap::new(),
        };
        rw.name_nodes();
        rw
    }

    /// Stable, unique site names: the node's own name without a leading '/', else
    /// `{op}.{k}` with `k` counting nodes of that op in graph order.
    fn name_nodes(&mut self) {
        let mut per_op: HashMap<String, usize> = HashMap::new();
        let mut taken: HashMap<String, usize> = HashMap::new();
        for n in self.graph.nodes() {
            let op = op_name(&n.op);
            let k = per_op.entry(op.clone()).or_default();
            let base = match &n.name {
                Some(name) if !name.is_empty() => name.trim_start_matches('/').to_string(),
                _ => format!("{op}.{k}"),
            };
            *k += 1;
            let count = taken.entry(base.clone()).or_default();
            let name = if *count == 0 { base.clone() } else { format!("{base}#{}", n.id.0) };
            *count += 1;
            self.names.insert(n.id.0, name);
        }
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

    /// Record a site found by `pass`.
    pub fn add_site(&mut self, pass: &str, node: NodeId, flops: Option<u64>) -> String {
        let site = self.site_name(node);
        self.manifest.sites.push(Site {
            site: site.clone(),
            op: op_name(&self.graph.node(node).op),
            node: node.0,
            flops,
            pass: pass.to_string(),
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
        let shape = self.graph.node(tensor).shape.clone();
        let numel: u64 = static_dims(&shape)
            .map(|d| d.iter().product::<usize>() as u64)
            .unwrap_or(0);
        let use_ = TapUse {
            site: site.to_string(),
            role,
        };
        let attrs = spec.to_attrs();
        if let Some(&i) = self.dedupe.get(&(tensor.0, attrs.clone())) {
            self.manifest.outputs[i].uses.push(use_);
            return;
        }
        let output_index = if numel == 0 {
            None
        } else {
            let id = self.graph.custom_op(SKETCH_OP, attrs.clone(), vec![tensor]);
            self.graph.node_mut(id).name = Some(format!("opscope/{site}/{}", role.as_str()));
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
            layout: spec.layout(),
            spec,
        });
    }

    /// Finish: the rewritten graph and its manifest.
    pub fn finish(self) -> (Graph, Manifest) {
        (self.graph, self.manifest)
    }
}

/// Op name as RLX prints it, without attributes (`matmul`, `softmax`, `fused_mm_bias`).
pub fn op_name(op: &Op) -> String {
    let s = op.to_string();
    let end = s.find(['(', '{', ' ']).unwrap_or(s.len());
    s[..end].to_string()
}
