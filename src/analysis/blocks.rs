//! Repeated blocks: sub-DAGs that occur several times in a graph (transformer layers, FFNs,
//! norm-and-add motifs), as DISJOINT occurrences, each confirmed isomorphic to the others.
//! Linear op chains are the width-1 case ([`Block::chain`]).
//!
//! The method:
//! 1. **Labels**: every node live on the way to the graph's outputs gets a label: its op with
//!    every attribute (its `Debug` form), output shape and dtype; inputs and params by kind, shape
//!    and dtype only (names differ from layer to layer); constants by their bytes' xxh3 hash.
//! 2. **Weisfeiler-Lehman hashing** (Shervashidze et al., "Weisfeiler-Lehman Graph Kernels",
//!    JMLR 2011), adapted to ordered operands: colour `h0` = hash of the label; round `k+1` hashes
//!    `h_k` of the node, the `h_k` of its inputs IN OPERAND ORDER, and the sorted multiset of its
//!    users' `(h_k, operand slot)`. After [`BlockOptions::wl_rounds`] rounds a colour summarises the
//!    node's neighbourhood of that radius.
//! 3. **Candidates**: nodes of one colour are anchors of candidate occurrences. From the anchors
//!    the occurrences grow in lockstep, one edge slot at a time (operand `j`; users grouped by label
//!    and slot, paired in colour then node order): an extension is taken only if every occurrence
//!    reaches a node of the same label that no occurrence holds yet and that are all distinct, so
//!    occurrences stay disjoint by construction.
//! 4. **Confirmation**: each occurrence's induced sub-DAG (labels on nodes, operand slots on
//!    edges) is checked against the others with `petgraph::algo::is_isomorphic_matching` (VF2);
//!    occurrences split into isomorphism classes, and only classes of two or more are blocks. A
//!    hash collision (non-isomorphic neighbourhoods of equal colours) is therefore never merged.
//!    Anchor classes are taken at every radius from `wl_rounds` down to 0, so blocks near the
//!    graph's ends (whose wide neighbourhoods differ) still have anchors.
//! 5. **Ranking**: by the ops a block covers, ops per occurrence x occurrences (time shares do
//!    not exist yet); dominated repeats are left out (see [`repeated_blocks`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use petgraph::graph::DiGraph;
use rlx_ir::{Graph, NodeId, Op};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

use super::{op_name, shape_text};

/// Options of [`repeated_blocks`].
#[derive(Debug, Clone, PartialEq)]
pub struct BlockOptions {
    /// Weisfeiler-Lehman rounds: the radius of the neighbourhood a colour summarises. Anchors of
    /// one colour must look alike this far out; 3 (default) tells a layer's Q, K and V paths apart.
    pub wl_rounds: usize,
    /// Fewest ops (nodes other than inputs, params and constants) per occurrence (default 2).
    pub min_ops: usize,
}

impl Default for BlockOptions {
    fn default() -> BlockOptions {
        BlockOptions { wl_rounds: 3, min_ops: 2 }
    }
}

/// A repeated block: two or more disjoint, pairwise isomorphic occurrences.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Block {
    /// Ops per occurrence (nodes other than inputs, params and constants).
    pub ops: usize,
    /// Nodes per occurrence, params and constants included.
    pub nodes: usize,
    /// The occurrences: node ids (`NodeId.0`), ascending; pairwise disjoint.
    pub occurrences: Vec<Vec<u32>>,
    /// Op names of the first occurrence's ops in node order (e.g. `["MatMul", "Add", "Relu"]`).
    pub op_names: Vec<String>,
    /// Op-name histogram of one occurrence.
    pub op_counts: BTreeMap<String, usize>,
    /// Width 1: the ops form one linear chain (each op feeds at most one op of the occurrence
    /// and is fed by at most one).
    pub chain: bool,
}

/// Why [`repeated_blocks`] cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BlocksError {
    /// The graph has no node, or no output.
    #[error("graph '{0}' is empty: it has no node on the way to an output (import the model, or set its outputs), so there is nothing to search for repeated blocks")]
    Empty(String),
    /// An option is out of range.
    #[error("{0}")]
    Options(String),
}

fn is_source(op: &Op) -> bool {
    matches!(op, Op::Input { .. } | Op::Param { .. } | Op::Constant { .. })
}

/// The label of a node (see the module doc): op and attributes, shape, dtype; no names.
pub fn node_label(g: &Graph, id: NodeId) -> String {
    let n = g.node(id);
    let op = match &n.op {
        Op::Input { .. } => "Input".to_string(),
        Op::Param { .. } => "Param".to_string(),
        Op::Constant { data } => format!("Constant#{:016x}", xxh3_64(data)),
        op => format!("{op:?}"),
    };
    format!("{op}|{}|{:?}", shape_text(&n.shape), n.shape.dtype())
}

/// Weisfeiler-Lehman colours of the live nodes, one vector per round `0..=rounds` (index =
/// `NodeId.0`; dead nodes 0). Round 0 is the label hash. `live` and `users` as [`repeated_blocks`]
/// computes them (every node live, users by operand slot).
pub fn wl_colours(g: &Graph, live: &[bool], users: &[Vec<(u32, u32)>], rounds: usize) -> Vec<Vec<u64>> {
    let n = g.nodes().len();
    let h0: Vec<u64> = (0..n).map(|i| if live[i] { xxh3_64(node_label(g, NodeId(i as u32)).as_bytes()) } else { 0 }).collect();
    let mut all = vec![h0];
    for _ in 0..rounds {
        let h = all.last().expect("round 0");
        let next: Vec<u64> = (0..n)
            .map(|i| {
                if !live[i] {
                    return 0;
                }
                let mut buf: Vec<u64> = vec![h[i], g.nodes()[i].inputs.len() as u64];
                buf.extend(g.nodes()[i].inputs.iter().map(|u| h[u.0 as usize]));
                let mut outs: Vec<(u64, u32)> = users[i].iter().map(|&(u, s)| (h[u as usize], s)).collect();
                outs.sort_unstable();
                buf.push(u64::MAX);
                buf.extend(outs.iter().flat_map(|&(c, s)| [c, s as u64]));
                let bytes: Vec<u8> = buf.iter().flat_map(|v| v.to_le_bytes()).collect();
                xxh3_64(&bytes)
            })
            .collect();
        all.push(next);
    }
    all
}

/// Each node's users as `(user, operand slot)`, counting only `live` users.
pub fn users_of(g: &Graph, live: &[bool]) -> Vec<Vec<(u32, u32)>> {
    let mut users = vec![Vec::new(); g.nodes().len()];
    for (i, node) in g.nodes().iter().enumerate() {
        if live[i] {
            for (slot, u) in node.inputs.iter().enumerate() {
                users[u.0 as usize].push((i as u32, slot as u32));
            }
        }
    }
    users
}

/// Nodes on the way to an output, and each live node's live users as `(user, operand slot)`.
fn liveness(g: &Graph) -> (Vec<bool>, Vec<Vec<(u32, u32)>>) {
    let n = g.nodes().len();
    let mut live = vec![false; n];
    let mut stack: Vec<u32> = g.outputs.iter().map(|o| o.0).collect();
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut live[v as usize], true) {
            continue;
        }
        stack.extend(g.nodes()[v as usize].inputs.iter().map(|u| u.0));
    }
    let users = users_of(g, &live);
    (live, users)
}

struct Ctx<'a> {
    g: &'a Graph,
    h0: &'a [u64],
    hr: &'a [u64],
    users: &'a [Vec<(u32, u32)>],
}

impl Ctx<'_> {
    /// Grow occurrences from `anchors` in lockstep (module doc, step 3).
    fn grow(&self, anchors: &[u32]) -> Vec<Vec<u32>> {
        let c = anchors.len();
        let mut owner: HashMap<u32, usize> = anchors.iter().enumerate().map(|(k, &a)| (a, k)).collect();
        let mut occ: Vec<Vec<u32>> = anchors.iter().map(|&a| vec![a]).collect();
        let mut queue: VecDeque<Vec<u32>> = VecDeque::from([anchors.to_vec()]);
        let take = |t: Vec<u32>, owner: &mut HashMap<u32, usize>, occ: &mut Vec<Vec<u32>>, queue: &mut VecDeque<Vec<u32>>| {
            let l = self.h0[t[0] as usize];
            if t.iter().any(|v| self.h0[*v as usize] != l || owner.contains_key(v)) {
                return;
            }
            let distinct: HashSet<u32> = t.iter().copied().collect();
            if distinct.len() != c {
                return;
            }
            for (k, &v) in t.iter().enumerate() {
                owner.insert(v, k);
                occ[k].push(v);
            }
            queue.push_back(t);
        };
        while let Some(t) = queue.pop_front() {
            let arity = self.g.nodes()[t[0] as usize].inputs.len();
            if t.iter().any(|v| self.g.nodes()[*v as usize].inputs.len() != arity) {
                continue;
            }
            for j in 0..arity {
                let next: Vec<u32> = t.iter().map(|v| self.g.nodes()[*v as usize].inputs[j].0).collect();
                take(next, &mut owner, &mut occ, &mut queue);
            }
            // Users grouped by (label, slot); within a group paired in (colour, id) order.
            let groups: Vec<BTreeMap<(u64, u32), Vec<(u64, u32)>>> = t
                .iter()
                .map(|v| {
                    let mut m: BTreeMap<(u64, u32), Vec<(u64, u32)>> = BTreeMap::new();
                    for &(u, s) in &self.users[*v as usize] {
                        m.entry((self.h0[u as usize], s)).or_default().push((self.hr[u as usize], u));
                    }
                    m.values_mut().for_each(|g| g.sort_unstable());
                    m
                })
                .collect();
            for (key, first) in &groups[0] {
                let lists: Option<Vec<&Vec<(u64, u32)>>> = groups.iter().map(|m| m.get(key).filter(|l| l.len() == first.len())).collect();
                let Some(lists) = lists else { continue };
                for i in 0..first.len() {
                    take(lists.iter().map(|l| l[i].1).collect(), &mut owner, &mut occ, &mut queue);
                }
            }
        }
        for o in &mut occ {
            o.sort_unstable();
        }
        occ
    }

    /// The induced sub-DAG of `nodes`: node weights the round-0 colours, edge weights the operand slots.
    fn induced(&self, nodes: &[u32]) -> DiGraph<u64, u32> {
        let mut d = DiGraph::with_capacity(nodes.len(), nodes.len() * 2);
        let idx: HashMap<u32, _> = nodes.iter().map(|&v| (v, d.add_node(self.h0[v as usize]))).collect();
        for &v in nodes {
            for (slot, u) in self.g.nodes()[v as usize].inputs.iter().enumerate() {
                if let Some(&a) = idx.get(&u.0) {
                    d.add_edge(a, idx[&v], slot as u32);
                }
            }
        }
        d
    }

    /// Split occurrences into isomorphism classes (module doc, step 4).
    fn confirm(&self, occ: Vec<Vec<u32>>) -> Vec<Vec<Vec<u32>>> {
        let mut classes: Vec<(DiGraph<u64, u32>, Vec<Vec<u32>>)> = Vec::new();
        for o in occ {
            let d = self.induced(&o);
            match classes.iter_mut().find(|(r, _)| petgraph::algo::is_isomorphic_matching(r, &d, |a, b| a == b, |a, b| a == b)) {
                Some((_, members)) => members.push(o),
                None => classes.push((d, vec![o])),
            }
        }
        classes.into_iter().map(|(_, m)| m).filter(|m| m.len() >= 2).collect()
    }

    /// Grow from `anchors`, confirm, and grow again from each isomorphism class that holds only
    /// some of the anchors (a non-isomorphic occurrence also holds back the growth of the others).
    fn grow_confirmed(&self, anchors: &[u32]) -> Vec<Vec<Vec<u32>>> {
        let classes = self.confirm(self.grow(anchors));
        if classes.len() == 1 && classes[0].len() == anchors.len() {
            return classes;
        }
        let mut out = Vec::new();
        for class in classes {
            let sub: Vec<u32> = anchors.iter().copied().filter(|a| class.iter().any(|o| o.binary_search(a).is_ok())).collect();
            if sub.len() >= 2 && sub.len() < anchors.len() {
                out.extend(self.grow_confirmed(&sub));
            } else {
                out.push(class);
            }
        }
        out
    }

    fn block(&self, occurrences: Vec<Vec<u32>>) -> Block {
        let first = &occurrences[0];
        let ops: Vec<u32> = first.iter().copied().filter(|v| !is_source(&self.g.nodes()[*v as usize].op)).collect();
        let op_names: Vec<String> = ops.iter().map(|v| op_name(&self.g.nodes()[*v as usize].op)).collect();
        let mut op_counts = BTreeMap::new();
        for n in &op_names {
            *op_counts.entry(n.clone()).or_insert(0) += 1;
        }
        let set: HashSet<u32> = ops.iter().copied().collect();
        let chain = ops.iter().all(|&v| {
            let ins = self.g.nodes()[v as usize].inputs.iter().filter(|u| set.contains(&u.0)).count();
            let outs = self.users[v as usize].iter().filter(|(u, _)| set.contains(u)).count();
            ins <= 1 && outs <= 1
        });
        Block { ops: ops.len(), nodes: first.len(), occurrences, op_names, op_counts, chain }
    }
}

/// The repeated blocks of `g`, by the ops they cover ([`Block::coverage`]: ops per occurrence x
/// occurrences; ties: more occurrences first). Every block's occurrences are pairwise disjoint
/// and isomorphic (labels and operand slots). A block is left out when a higher-ranked block
/// with at least as many occurrences holds more than half of each of its occurrences within one
/// of its own (the same repeat seen from other anchors, shifted by a node, or a part of it); a
/// block repeated MORE often inside another is kept (an FFN repeated 6 times inside a layer
/// repeated 3 times), and so is a larger block built of several occurrences of a smaller one.
///
/// Errors: the graph has no live node ([`BlocksError::Empty`]); `wl_rounds` above 16 or
/// `min_ops` 0.
pub fn repeated_blocks(g: &Graph, opts: &BlockOptions) -> Result<Vec<Block>, BlocksError> {
    if opts.wl_rounds > 16 {
        return Err(BlocksError::Options(format!("wl_rounds {} is above 16: a colour that wide only matches whole graphs", opts.wl_rounds)));
    }
    if opts.min_ops == 0 {
        return Err(BlocksError::Options("min_ops 0: a block needs at least one op".into()));
    }
    let (live, users) = liveness(g);
    if !live.iter().any(|&l| l) {
        return Err(BlocksError::Empty(g.name.clone()));
    }
    let colours = wl_colours(g, &live, &users, opts.wl_rounds);
    let ctx = Ctx { g, h0: &colours[0], hr: colours.last().expect("round 0"), users: &users };
    // Anchor classes: nodes of one colour, the widest radius first (most alike), rarer colours
    // first within a round; each class grows once unless a block found already explains it.
    let mut order: Vec<Vec<u32>> = Vec::new();
    for h in colours.iter().rev() {
        let mut classes: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        for (i, &l) in live.iter().enumerate() {
            if l {
                classes.entry(h[i]).or_default().push(i as u32);
            }
        }
        let mut classes: Vec<Vec<u32>> = classes.into_values().filter(|c| c.len() >= 2).collect();
        classes.sort_by_key(|c| (c.len(), c[0]));
        order.extend(classes);
    }
    let mut found: Vec<Block> = Vec::new();
    let mut tried: HashSet<Vec<u32>> = HashSet::new();
    // For each found block, node -> occurrence index, to skip anchors it already explains.
    let mut covered: Vec<(usize, HashMap<u32, usize>)> = Vec::new();
    for anchors in order {
        let explained = covered.iter().any(|(count, at)| {
            *count == anchors.len() && {
                let occ: Option<HashSet<usize>> = anchors.iter().map(|a| at.get(a).copied()).collect();
                occ.is_some_and(|o| o.len() == anchors.len())
            }
        });
        if explained || !tried.insert(anchors.clone()) {
            continue;
        }
        for occurrences in ctx.grow_confirmed(&anchors) {
            let b = ctx.block(occurrences);
            if b.ops < opts.min_ops || found.iter().any(|x| x.occurrences == b.occurrences) {
                continue;
            }
            let at = b.occurrences.iter().enumerate().flat_map(|(k, o)| o.iter().map(move |&v| (v, k))).collect();
            covered.push((b.occurrences.len(), at));
            found.push(b);
        }
    }
    // Rank by coverage, then keep a block only if no kept block dominates it.
    found.sort_by(|a, b| (b.coverage(), b.occurrences.len(), &a.occurrences).cmp(&(a.coverage(), a.occurrences.len(), &b.occurrences)));
    let mut kept: Vec<(Block, HashMap<u32, usize>)> = Vec::new();
    for b in found {
        let dominated = kept.iter().any(|(k, at)| {
            b.occurrences.len() <= k.occurrences.len()
                && b.occurrences.iter().all(|o| {
                    let mut per: HashMap<usize, usize> = HashMap::new();
                    for v in o {
                        if let Some(&i) = at.get(v) {
                            *per.entry(i).or_insert(0) += 1;
                        }
                    }
                    2 * per.values().copied().max().unwrap_or(0) > o.len()
                })
        });
        if !dominated {
            let at = b.occurrences.iter().enumerate().flat_map(|(k, o)| o.iter().map(move |&v| (v, k))).collect();
            kept.push((b, at));
        }
    }
    Ok(kept.into_iter().map(|(b, _)| b).collect())
}

/// What RLX's fusion did inside a block (rlx-fusion's `FusionReport::analyze(source, deployed)`),
/// per occurrence of the block in the deployed graph.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockFusion {
    /// Ops of one occurrence that are RLX fused kernels (op names starting `fused_` or holding
    /// `region`), by name.
    pub fused: BTreeMap<String, usize>,
    /// Ops of one occurrence that are not fused kernels.
    pub unfused_ops: usize,
    /// Fusions RLX recognised but missed inside the first occurrence: `pattern: reason`.
    pub missed: Vec<String>,
}

/// [`BlockFusion`] of `block`, found in `deployed` (the graph RLX's fusion made of `source`).
pub fn block_fusion(block: &Block, source: &Graph, deployed: &Graph) -> BlockFusion {
    let report = rlx_fusion::FusionReport::analyze(source, deployed);
    let first: HashSet<u32> = block.occurrences[0].iter().copied().collect();
    let mut fused = BTreeMap::new();
    let mut unfused_ops = 0;
    for n in &block.op_names {
        if n.starts_with("fused_") || n.contains("region") {
            *fused.entry(n.clone()).or_insert(0) += 1;
        } else {
            unfused_ops += 1;
        }
    }
    let missed = report.missed.iter().filter(|m| first.contains(&m.node.0)).map(|m| format!("{}: {:?}", m.pattern, m.reason)).collect();
    BlockFusion { fused, unfused_ops, missed }
}

impl Block {
    /// Ops the block covers: ops per occurrence x occurrences (the ranking key).
    pub fn coverage(&self) -> usize {
        self.ops * self.occurrences.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::op::{Activation, BinaryOp};
    use rlx_ir::{DType, Shape};

    fn f32s(d: &[usize]) -> Shape {
        Shape::new(d, DType::F32)
    }

    /// An L-layer residual MLP stack `x <- x + relu(x W1 + b1) W2`; returns the graph and each
    /// layer's node ids (its params included).
    fn stack(layers: usize) -> (Graph, Vec<Vec<u32>>) {
        let (m, d, h) = (4, 8, 16);
        let mut g = Graph::new(format!("stack{layers}"));
        let mut x = g.input("x", f32s(&[m, d]));
        let mut ids = Vec::new();
        for l in 0..layers {
            let before = g.nodes().len() as u32;
            let w1 = g.param(&format!("l{l}.w1"), f32s(&[d, h]));
            let b1 = g.param(&format!("l{l}.b1"), f32s(&[h]));
            let w2 = g.param(&format!("l{l}.w2"), f32s(&[h, d]));
            let a = g.matmul(x, w1, f32s(&[m, h]));
            let a = g.binary(BinaryOp::Add, a, b1, f32s(&[m, h]));
            let a = g.activation(Activation::Relu, a, f32s(&[m, h]));
            let a = g.matmul(a, w2, f32s(&[m, d]));
            x = g.binary(BinaryOp::Add, x, a, f32s(&[m, d]));
            ids.push((before..g.nodes().len() as u32).collect());
        }
        g.set_outputs(vec![x]);
        (g, ids)
    }

    #[test]
    fn an_l_layer_stack_gives_its_layer_l_times() {
        for layers in [2, 5, 8] {
            let (g, ids) = stack(layers);
            let blocks = repeated_blocks(&g, &BlockOptions::default()).unwrap();
            let top = &blocks[0];
            assert_eq!(top.occurrences, ids, "L={layers}: {blocks:#?}");
            // Inside a layer the ops form one chain (x enters twice from outside): width 1.
            assert_eq!((top.ops, top.nodes, top.chain), (5, 8, true));
            assert_eq!(top.op_names, ["matmul", "Add", "Relu", "matmul", "Add"]);
            // Nothing else repeats as a whole layer; no occurrence overlaps another.
            for b in &blocks {
                let all: Vec<u32> = b.occurrences.iter().flatten().copied().collect();
                assert_eq!(all.len(), all.iter().collect::<HashSet<_>>().len(), "overlapping occurrences: {b:?}");
            }
        }
    }

    /// A root feeding 6 `relu`s, summed pairwise around a 6-cycle (`hexagon`) or around two
    /// 3-cycles (`triangles`): every node has the same WL colour in both at every round (each relu
    /// feeds one add at slot 0 and one at slot 1), yet the two are not isomorphic.
    fn ring(g: &mut Graph, name: &str, triangles: bool) -> (u32, u32) {
        let s = f32s(&[4]);
        let before = g.nodes().len() as u32;
        let r = g.input(name, s.clone());
        let relus: Vec<NodeId> = (0..6).map(|_| g.activation(Activation::Relu, r, s.clone())).collect();
        let next = |k: usize| if triangles { [1, 2, 0, 4, 5, 3][k] } else { (k + 1) % 6 };
        let adds: Vec<NodeId> = (0..6).map(|k| g.binary(BinaryOp::Add, relus[k], relus[next(k)], s.clone())).collect();
        let mut outs = g.outputs.clone();
        outs.extend(adds);
        g.set_outputs(outs);
        (before, g.nodes().len() as u32)
    }

    #[test]
    fn a_planted_wl_collision_is_not_merged() {
        let mut g = Graph::new("collision");
        let h1 = ring(&mut g, "a", false);
        let h2 = ring(&mut g, "b", false);
        let t = ring(&mut g, "c", true);
        let live = vec![true; g.nodes().len()];
        let users = users_of(&g, &live);
        let col = wl_colours(&g, &live, &users, 6).pop().unwrap();
        // The collision is real: the hexagon's and the triangles' colours are one multiset.
        let mut ch: Vec<u64> = (h1.0..h1.1).map(|i| col[i as usize]).collect();
        let mut ct: Vec<u64> = (t.0..t.1).map(|i| col[i as usize]).collect();
        ch.sort_unstable();
        ct.sort_unstable();
        assert_eq!(ch, ct);
        let blocks = repeated_blocks(&g, &BlockOptions::default()).unwrap();
        // The two hexagons are one block; the triangles are not a third occurrence.
        let rings: Vec<&Block> = blocks.iter().filter(|b| b.nodes == 13).collect();
        assert_eq!(rings.len(), 1, "{blocks:#?}");
        assert_eq!(rings[0].occurrences, vec![(h1.0..h1.1).collect::<Vec<_>>(), (h2.0..h2.1).collect()], "{blocks:#?}");
        for b in &blocks {
            for o in &b.occurrences {
                let in_t = o.iter().filter(|v| (t.0..t.1).contains(v)).count();
                assert!(in_t == 0 || b.ops < 12, "the triangles were merged with the hexagons: {b:?}");
            }
        }
    }

    #[test]
    fn a_linear_chain_is_the_width_one_case() {
        let s = f32s(&[4]);
        let mut g = Graph::new("chains");
        let mut outs = Vec::new();
        for k in 0..3 {
            let x = g.input(&format!("x{k}"), s.clone());
            let a = g.activation(Activation::Exp, x, s.clone());
            let a = g.activation(Activation::Tanh, a, s.clone());
            outs.push(g.activation(Activation::Relu, a, s.clone()));
        }
        g.set_outputs(outs);
        let blocks = repeated_blocks(&g, &BlockOptions::default()).unwrap();
        assert_eq!(blocks.len(), 1, "{blocks:#?}");
        assert_eq!((blocks[0].ops, blocks[0].occurrences.len(), blocks[0].chain), (3, 3, true));
    }

    #[test]
    fn an_empty_graph_is_a_clear_error() {
        let e = repeated_blocks(&Graph::new("nothing"), &BlockOptions::default()).unwrap_err();
        assert!(e.to_string().contains("graph 'nothing' is empty"), "{e}");
    }
}
