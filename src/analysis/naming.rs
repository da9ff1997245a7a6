//! Site naming: a node's own name, else the name of the source node that consumed the same
//! weight (fusion drops node names, weights survive), else for a matmul the name of its dotted
//! weight (`fc1.weight` names the site `fc1`), else `{family}.{k}`.

use std::borrow::Cow;
use std::collections::HashMap;

use rlx_ir::{Graph, NodeId, Op};

/// Site names of every node of `graph`, and (for a fused graph) the source site name per
/// (op family, parameter) consumed by exactly one source node. A node's own name (ONNX node name without the leading '/') wins; else, for
/// a fused graph, the name of the source node of the same family that consumed the same
/// parameter (the weight survives fusion, node names do not), else the name of the k-th
/// parameter-less source node of that family when both graphs have the same number of
/// them; else `{family}.{k}`. Names are made unique with `#node`.
pub fn site_names(graph: &Graph, source: Option<&Graph>) -> (HashMap<u32, String>, HashMap<(String, String), String>) {
    let (names, by_param) = site_names_by_id(graph, source);
    (names.into_iter().enumerate().map(|(i, n)| (i as u32, n)).collect(), by_param)
}

/// [`site_names`] as a vector indexed by node id.
pub(crate) fn site_names_by_id(graph: &Graph, source: Option<&Graph>) -> (Vec<String>, HashMap<(String, String), String>) {
    let mut by_param_out: HashMap<(String, String), String> = HashMap::new();
    // Keys borrow from the graphs (names and parameter names): building them was most of a
    // tapped compile's naming time when every key was an owned copy (measured with perf).
    let mut names: Vec<String> = base_names(graph);
    if let Some(src) = source {
        let src_names = base_names(src);
        let mut by_param: HashMap<(Cow<'static, str>, &str), Vec<&str>> = HashMap::new();
        let mut paramless_src: HashMap<Cow<'static, str>, Vec<&str>> = HashMap::new();
        for n in src.nodes() {
            let fam = family_cow(&n.op);
            let params = param_refs(src, &n.inputs);
            let own = src_names[n.id.0 as usize].as_str();
            for p in &params {
                by_param.entry((fam.clone(), *p)).or_default().push(own);
            }
            if params.is_empty() {
                paramless_src.entry(fam).or_default().push(own);
            }
        }
        let mut paramless_dst: HashMap<Cow<'static, str>, Vec<usize>> = HashMap::new();
        for n in graph.nodes() {
            let i = n.id.0 as usize;
            if n.name.as_deref().is_some_and(|s| !s.is_empty()) {
                continue;
            }
            let fam = family_cow(&n.op);
            let params = param_refs(graph, &n.inputs);
            // Every parameter's source node, deduplicated: one source node names the fused
            // node; several (a merged op that is not split into parts) are joined with '+',
            // so a site never silently carries another site's name alone.
            let mut hits: Vec<&str> = Vec::new();
            for p in &params {
                if let Some(v) = by_param.get(&(fam.clone(), *p)) {
                    if v.len() == 1 && !hits.contains(&v[0]) {
                        hits.push(v[0]);
                    }
                }
            }
            if !hits.is_empty() {
                names[i] = hits.join("+");
            } else if params.is_empty() {
                paramless_dst.entry(fam).or_default().push(i);
            }
        }
        for (fam, dst) in paramless_dst {
            if let Some(src) = paramless_src.get(&fam) {
                if src.len() == dst.len() {
                    for (i, name) in dst.into_iter().zip(src) {
                        names[i] = name.to_string();
                    }
                }
            }
        }
        by_param_out = by_param
            .into_iter()
            .filter(|(_, v)| v.len() == 1)
            .map(|((fam, p), v)| ((fam.into_owned(), p.to_string()), v[0].to_string()))
            .collect();
    }
    // The first node of a name keeps it; later ones get `#node`.
    let mut taken: HashMap<&str, usize> = HashMap::with_capacity(names.len());
    let suffixed: Vec<bool> = names
        .iter()
        .map(|base| {
            let count = taken.entry(base.as_str()).or_default();
            *count += 1;
            *count > 1
        })
        .collect();
    let site_names = names
        .into_iter()
        .zip(suffixed)
        .enumerate()
        .map(|(i, (base, again))| if again { format!("{base}#{i}") } else { base })
        .collect();
    (site_names, by_param_out)
}

/// Base names of every node: own name without a leading '/', else `{family}.{k}`.
fn base_names(g: &Graph) -> Vec<String> {
    let mut per: HashMap<Cow<'static, str>, usize> = HashMap::new();
    g.nodes()
        .iter()
        .map(|n| {
            let fam = family_cow(&n.op);
            let name = match &n.name {
                Some(name) if !name.is_empty() => name.trim_start_matches('/').to_string(),
                _ => {
                    let k = per.get(&fam).copied().unwrap_or(0);
                    param_site_name(g, &fam, &n.inputs).unwrap_or_else(|| format!("{fam}.{k}"))
                }
            };
            *per.entry(fam).or_default() += 1;
            name
        })
        .collect()
}

/// The site name a matmul without a node name takes from its weight: a dotted parameter name
/// (a PyTorch state-dict key such as `fc1.weight`, or a GGUF tensor name such as
/// `blk.0.attn_q.weight`) whose last component is `weight`, `bias` or `kernel`, without it:
/// `fc1`, `blk.0.attn_q`. `None` for other families, other names (`w` says nothing; `head.proj`
/// is the parameter node's own name), or parameters that disagree (`fc1.weight`, `fc2.bias`).
fn param_site_name(g: &Graph, fam: &str, inputs: &[NodeId]) -> Option<String> {
    if fam != "matmul" {
        return None;
    }
    let mut names: Vec<String> = param_refs(g, inputs)
        .into_iter()
        .filter_map(|p| match p.rsplit_once('.') {
            Some((stem, "weight" | "bias" | "kernel")) if !stem.is_empty() => Some(stem.to_string()),
            _ => None,
        })
        .collect();
    names.dedup();
    match names.as_slice() {
        [one] => Some(one.clone()),
        _ => None,
    }
}

/// Names of the parameters among `inputs`, looking through reshapes, transposes and concats
/// (fusion concatenates the weights of merged projections), borrowed from `g`.
fn param_refs<'g>(g: &'g Graph, inputs: &[NodeId]) -> Vec<&'g str> {
    let mut out = Vec::new();
    let mut stack: Vec<NodeId> = inputs.to_vec();
    while let Some(i) = stack.pop() {
        let n = g.node(i);
        match &n.op {
            Op::Param { name } => out.push(name.as_str()),
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } => stack.extend(n.inputs.iter().rev()),
            _ => {}
        }
    }
    out
}

/// The op family used for naming: fusion turns a MatMul into a fused matmul, so all matmul
/// forms share the family `matmul`; other ops are their own family.
pub fn family(op: &Op) -> String {
    family_cow(op).into_owned()
}

/// [`family`] without an allocation for the matmul family.
fn family_cow(op: &Op) -> Cow<'static, str> {
    match op {
        Op::MatMul | Op::FusedMatMulBiasAct { .. } | Op::FusedMatMulResidual | Op::DequantMatMul { .. } => {
            Cow::Borrowed("matmul")
        }
        // What `op_name` gives them, without printing the node's name or data first.
        Op::Input { .. } => Cow::Borrowed("input"),
        Op::Param { .. } => Cow::Borrowed("param"),
        Op::Constant { .. } => Cow::Borrowed("const"),
        _ => Cow::Owned(op_name(op)),
    }
}

/// Op name as RLX prints it, without attributes (`matmul`, `softmax`, `fused_mm_bias`).
pub fn op_name(op: &Op) -> String {
    let mut s = op.to_string();
    let end = s.find(['(', '{', ' ']).unwrap_or(s.len());
    s.truncate(end);
    s
}


#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, Shape};

    /// The family names given without printing the op are what printing it gives.
    #[test]
    fn shortcut_families_equal_the_printed_op_names() {
        let s = |d: &[usize]| Shape::new(d, DType::F32);
        let mut g = Graph::new("t");
        let ids = [g.input("x(1) y", s(&[2])), g.param("w{0}", s(&[2])), rlx_ir::rf::const_f32(&mut g, 1.0, s(&[2]))];
        for id in ids {
            let op = &g.node(id).op;
            assert_eq!(family_cow(op), op_name(op), "{op}");
        }
    }

    #[test]
    fn unnamed_matmuls_take_their_dotted_weight_names() {
        let s = |d: &[usize]| Shape::new(d, DType::F32);
        let mut g = Graph::new("t");
        let x = g.input("x", s(&[2, 4]));
        let mut ids = Vec::new();
        for w in ["fc1.weight", "blk.0.attn_q.weight", "w", "head.proj"] {
            let p = g.param(w, s(&[4, 4]));
            ids.push(g.matmul(x, p, s(&[2, 4])));
        }
        let named = g.matmul(x, ids[0], s(&[2, 4]));
        g.node_mut(named).name = Some("/own/MatMul".into());
        g.set_outputs(vec![named]);
        let (names, _) = site_names(&g, None);
        let got: Vec<&str> = ids.iter().chain([&named]).map(|i| names[&i.0].as_str()).collect();
        // `w` says nothing and `head.proj` names its parameter node: the family name and ordinal.
        assert_eq!(got, ["fc1", "blk.0.attn_q", "matmul.2", "matmul.3", "own/MatMul"]);
    }
}
