//! Shared test helpers: small RLX graphs, running them with and without taps, and statistics
//! computed independently on the host (plain f64 loops, no code shared with the kernel).
#![allow(dead_code)]

use std::collections::BTreeMap;

use opscope::{MemorySink, Pipeline, Row};
use rlx_ir::{DType, Graph, NodeId, Shape};
use rlx_runtime::{Device, Session};

/// Deterministic pseudo-random data (SplitMix64 via `rand`'s StdRng).
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            // Box-Muller
            let u1: f64 = rng.gen_range(1e-12..1.0);
            let u2: f64 = rng.gen::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// `x[M,K] @ w[K,N]` (w a param), output the matmul.
pub fn matmul_2d(m: usize, k: usize, n: usize) -> Graph {
    let mut g = Graph::new("mm2d");
    let x = g.input("x", Shape::new(&[m, k], DType::F32));
    let w = g.param("w", Shape::new(&[k, n], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![y]);
    g
}

/// `a[B,M,K] @ b[B,K,N]`, both inputs.
pub fn matmul_3d(b: usize, m: usize, k: usize, n: usize) -> Graph {
    let mut g = Graph::new("mm3d");
    let x = g.input("a", Shape::new(&[b, m, k], DType::F32));
    let y = g.input("b", Shape::new(&[b, k, n], DType::F32));
    let z = g.matmul(x, y, Shape::new(&[b, m, n], DType::F32));
    g.set_outputs(vec![z]);
    g
}

/// The host reference of every scalar statistic, over finite values.
#[derive(Debug, Clone, Default)]
pub struct Reference {
    pub count: f64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub mean: Option<f64>,
    pub l1: f64,
    pub sumsq: f64,
    pub nnz: f64,
    pub kurtosis: Option<f64>,
    pub nan: f64,
    pub posinf: f64,
    pub neginf: f64,
    pub hist: Vec<f64>,
    pub hist_lo: f64,
    pub hist_hi: f64,
    /// Finite values outside `[hist_lo, hist_hi]` (0 for the absmax range; NaN and +-Inf are
    /// never "outside": they have their own counts).
    pub hist_outside: f64,
    pub chan_maxabs: Vec<f64>,
    pub chan_outlier: Option<f64>,
    pub pos_sumsq: Vec<f64>,
    pub row_absmax: Vec<f64>,
    pub adj_sumsq: f64,
    /// The `k` sampled elements `x[floor(j * numel / k)]`, NaN included (a NaN sample is not
    /// recorded: [`assert_matches_reference`] expects its index to be absent).
    pub elemsig: Vec<f64>,
}

/// Compute the reference for `x` with `dims` (row-major), `bins` absmax-range bins and
/// `k` signature elements.
pub fn reference(x: &[f32], dims: &[usize], bins: usize, k: usize) -> Reference {
    let finite: Vec<f64> = x.iter().filter(|v| v.is_finite()).map(|&v| v as f64).collect();
    let n = finite.len() as f64;
    let mut r = Reference {
        count: n,
        nan: x.iter().filter(|v| v.is_nan()).count() as f64,
        posinf: x.iter().filter(|v| **v == f32::INFINITY).count() as f64,
        neginf: x.iter().filter(|v| **v == f32::NEG_INFINITY).count() as f64,
        l1: finite.iter().map(|v| v.abs()).sum(),
        sumsq: finite.iter().map(|v| v * v).sum(),
        nnz: finite.iter().filter(|v| **v != 0.0).count() as f64,
        ..Default::default()
    };
    if !finite.is_empty() {
        let mn = finite.iter().cloned().fold(f64::INFINITY, f64::min);
        let mx = finite.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        // Two-pass mean: the naive mean, corrected by the mean of the residuals (whose sum is
        // small), so near-constant data is centred to f64 precision (Higham, section 1.9).
        let mean0 = finite.iter().sum::<f64>() / n;
        let mean = mean0 + finite.iter().map(|v| v - mean0).sum::<f64>() / n;
        r.min = Some(mn);
        r.max = Some(mx);
        r.mean = Some(mean);
        let m2 = finite.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let m4 = finite.iter().map(|v| (v - mean).powi(4)).sum::<f64>() / n;
        r.kurtosis = if m2 > 0.0 { Some(m4 / (m2 * m2)) } else { None };
        let a = mn.abs().max(mx.abs());
        let (lo, hi) = if a > 0.0 { (-a, a) } else { (-1.0, 1.0) };
        r.hist_lo = lo;
        r.hist_hi = hi;
        (r.hist, r.hist_outside) = numpy_histogram(&finite, lo, hi, bins);
    }
    let c = *dims.last().unwrap_or(&1);
    let rows = if c == 0 { 0 } else { x.len() / c };
    let block = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
    if rows > 0 {
        r.chan_maxabs = (0..c)
            .map(|j| {
                (0..rows)
                    .map(|i| x[i * c + j])
                    .filter(|v| v.is_finite())
                    .map(|v| (v as f64).abs())
                    .fold(0.0, f64::max)
            })
            .collect();
        let peak = r.chan_maxabs.iter().cloned().fold(0.0, f64::max);
        let mean = r.chan_maxabs.iter().sum::<f64>() / c as f64;
        r.chan_outlier = if mean > 0.0 { Some(peak / mean) } else { None };
    }
    r.pos_sumsq = (0..rows)
        .map(|i| {
            x[i * c..(i + 1) * c]
                .iter()
                .filter(|v| v.is_finite())
                .map(|&v| (v as f64).powi(2))
                .sum()
        })
        .collect();
    r.row_absmax = (0..rows)
        .map(|i| x[i * c..(i + 1) * c].iter().filter(|v| v.is_finite()).map(|&v| (v as f64).abs()).fold(0.0, f64::max))
        .collect();
    for i in 0..rows {
        if i % block == 0 {
            continue;
        }
        for j in 0..c {
            let (p, q) = (x[(i - 1) * c + j], x[i * c + j]);
            if p.is_finite() && q.is_finite() {
                r.adj_sumsq += (q as f64 - p as f64).powi(2);
            }
        }
    }
    r.elemsig = if x.is_empty() {
        vec![]
    } else {
        (0..k).map(|j| x[j * x.len() / k] as f64).collect()
    };
    r
}

/// `numpy.linspace(lo, hi, bins + 1)` in f64: `i * ((hi - lo) / bins) + lo`, the last edge
/// exactly `hi` (numpy's `linspace`: `arange(num) * step + start`, then `y[-1] = stop`).
pub fn numpy_edges(lo: f64, hi: f64, bins: usize) -> Vec<f64> {
    let step = (hi - lo) / bins as f64;
    let mut e: Vec<f64> = (0..=bins).map(|i| i as f64 * step + lo).collect();
    e[bins] = hi;
    e
}

/// `numpy.histogram(values, bins, range=(lo, hi))` on f64 values by its definition: a value
/// in `[lo, hi]` goes to the bin `i` with `edge[i] <= x < edge[i + 1]` (binary search over the
/// edges; `hi` itself to the last bin); returns (counts, values outside `[lo, hi]`).
pub fn numpy_histogram(values: &[f64], lo: f64, hi: f64, bins: usize) -> (Vec<f64>, f64) {
    let edges = numpy_edges(lo, hi, bins);
    let mut counts = vec![0.0; bins];
    let mut outside = 0.0;
    for &x in values {
        if !(lo..=hi).contains(&x) {
            outside += 1.0;
            continue;
        }
        // Number of edges <= x, minus one: the last edge at or below x.
        let i = edges.partition_point(|&e| e <= x) - 1;
        counts[i.min(bins - 1)] += 1.0;
    }
    (counts, outside)
}

/// Rows of one (site, role, step) as stat -> values (by idx).
pub fn stats_of(rows: &[Row], site: &str, role: &str, step: u64) -> BTreeMap<String, Vec<f64>> {
    let mut m: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| &*r.site == site && &*r.role == role && r.step == step) {
        m.entry(r.stat.to_string()).or_default().push((r.idx, r.value as f64));
    }
    m.into_iter()
        .map(|(k, mut v)| {
            v.sort_by_key(|p| p.0);
            (k, v.into_iter().map(|p| p.1).collect())
        })
        .collect()
}

/// |a - b| <= tol * max(1, |b|).
pub fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

/// |a - b| <= tol * |b|: relative at every scale (a value below 1 is not held to `tol`
/// absolute, as [`close`] holds it).
pub fn close_rel(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs()
}

/// Assert every statistic recorded for (site, role) equals the reference. Statistics that are
/// one of the tensor's f32 values or a count (min, max, absmaxes, counts, histogram bins) must
/// be equal; sums, moments and ratios within `tol` relative (`tol` absolute only where the
/// reference is 0).
pub fn assert_matches_reference(rows: &[Row], site: &str, role: &str, r: &Reference, tol: f64) {
    let s = stats_of(rows, site, role, 0);
    let one = |name: &str| s.get(name).map(|v| v[0]);
    let near = |g: f64, w: f64| if w == 0.0 { g.abs() <= tol } else { close_rel(g, w, tol) };
    let check_with = |name: &str, got: Option<f64>, want: Option<f64>, exact: bool| match (got, want) {
        (Some(g), Some(w)) => assert!(if exact { g == w } else { near(g, w) }, "{site}/{role} {name}: got {g}, want {w}"),
        (None, None) => {}
        (g, w) => panic!("{site}/{role} {name}: got {g:?}, want {w:?}"),
    };
    let exact = |name: &str, got: Option<f64>, want: Option<f64>| check_with(name, got, want, true);
    let check = |name: &str, got: Option<f64>, want: Option<f64>| check_with(name, got, want, false);
    exact("count", one("count"), Some(r.count));
    exact("min", one("min"), r.min);
    exact("max", one("max"), r.max);
    check("mean", one("mean"), r.mean);
    check("l1", one("l1"), Some(r.l1));
    check("sumsq", one("sumsq"), Some(r.sumsq));
    exact("nnz", one("nnz"), Some(r.nnz));
    check("kurtosis", one("kurtosis"), r.kurtosis);
    exact("nan_count", one("nan_count"), Some(r.nan));
    exact("posinf_count", one("posinf_count"), Some(r.posinf));
    exact("neginf_count", one("neginf_count"), Some(r.neginf));
    check("adj_sumsq", one("adj_sumsq"), Some(r.adj_sumsq));
    check("chan_outlier", one("chan_outlier"), r.chan_outlier);
    if r.count > 0.0 {
        exact("hist_lo", one("hist_lo"), Some(r.hist_lo));
        exact("hist_hi", one("hist_hi"), Some(r.hist_hi));
        exact("hist_outside", one("hist_outside"), Some(r.hist_outside));
        assert_eq!(s.get("hist").cloned().unwrap_or_default(), r.hist, "{site}/{role} hist");
    } else {
        assert!(s.get("hist_lo").is_none(), "{site}/{role}: hist range recorded for no data");
    }
    let vec_eq = |name: &str, want: &[f64], exact: bool| {
        let got = s.get(name).cloned().unwrap_or_default();
        assert_eq!(got.len(), want.len(), "{site}/{role} {name} length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(if exact { g == w } else { near(*g, *w) }, "{site}/{role} {name}[{i}]: got {g}, want {w}");
        }
    };
    vec_eq("chan_maxabs", &r.chan_maxabs, true);
    vec_eq("pos_sumsq", &r.pos_sumsq, false);
    vec_eq("row_absmax", &r.row_absmax, true);
    // elemsig by index: sample j is element floor(j * numel / k); a sampled element that is NaN
    // is not recorded (README, Sketches: a recording never carries a NaN), so its index is absent
    // and the others keep theirs. Values are the tensor's own f32 elements: compared exactly.
    let mut sig: Vec<(u64, f64)> = rows
        .iter()
        .filter(|x| &*x.site == site && &*x.role == role && x.step == 0 && &*x.stat == "elemsig")
        .map(|x| (x.idx, x.value as f64))
        .collect();
    sig.sort_by_key(|p| p.0);
    let want_sig: Vec<(u64, f64)> =
        r.elemsig.iter().enumerate().filter(|(_, w)| !w.is_nan()).map(|(j, w)| (j as u64, *w)).collect();
    assert_eq!(sig.len(), want_sig.len(), "{site}/{role} elemsig: got {sig:?}, want {want_sig:?}");
    for ((gi, g), (wi, w)) in sig.iter().zip(&want_sig) {
        assert!(gi == wi && g == w, "{site}/{role} elemsig: got [{gi}] = {g}, want [{wi}] = {w}");
    }
    for (name, vals) in &s {
        assert!(vals.iter().all(|v| !v.is_nan()), "{site}/{role} {name} holds NaN");
    }
}

/// Compile and run `g` untapped; inputs by name.
pub fn run_plain(g: &Graph, params: &[(&str, &[f32])], inputs: &[(&str, &[f32])]) -> Vec<Vec<f32>> {
    let mut c = Session::new(Device::Cpu).compile(g.clone());
    for (n, d) in params {
        c.set_param(n, d);
    }
    c.run(inputs)
}

/// Compile and run `g` inside an opscope scope; returns outputs and recorded rows.
pub fn run_tapped(
    pipeline: &str,
    g: &Graph,
    params: &[(&str, &[f32])],
    inputs: &[(&str, &[f32])],
) -> (Vec<Vec<f32>>, MemorySink) {
    let p = Pipeline::parse(pipeline).expect("pipeline parses");
    let sink = MemorySink::default();
    let outs = opscope::scope(&p, Box::new(sink.clone()), || run_plain(g, params, inputs)).expect("recording ok");
    (outs, sink)
}

/// Bit patterns of outputs, for bit-identity checks.
pub fn bits(outs: &[Vec<f32>]) -> Vec<Vec<u32>> {
    outs.iter().map(|o| o.iter().map(|v| v.to_bits()).collect()).collect()
}

/// `x[m, k] -> DequantMatMul(x, w) -> y[m, n]` over a packed GGUF Q8_0 weight `w` (n rows of
/// 34 bytes: an f16 scale of 1.0 and k = 32 int8 codes), and the packed bytes.
pub fn q8_0_dequant_matmul(m: usize, k: usize, n: usize) -> (Graph, Vec<u8>) {
    assert_eq!(k, 32, "one Q8_0 block per row");
    let mut g = Graph::new("dequant");
    let x = g.input("x", Shape::new(&[m, k], DType::F32));
    let w = g.param("w", Shape::new(&[n * 34], DType::U8));
    let y = g.dequant_matmul_packed(x, w, rlx_ir::quant::QuantScheme::GgufQ8_0, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![y]);
    let mut packed = Vec::new();
    for r in 0..n {
        packed.extend_from_slice(&0x3C00u16.to_le_bytes()); // f16 1.0
        packed.extend((0..k).map(|c| (((r * 7 + c * 5) % 41) as i8 - 20) as u8));
    }
    (g, packed)
}

/// Run `g` on the CPU with the packed `U8` param `w` and input `x`; bit patterns of output 0.
pub fn run_packed(g: &Graph, packed: &[u8], x: &[f32]) -> Vec<u32> {
    let mut c = Session::new(Device::Cpu).compile(g.clone());
    c.set_param_typed("w", packed, DType::U8);
    c.run(&[("x", x)])[0].iter().map(|v| v.to_bits()).collect()
}

pub fn node_named(g: &Graph, name: &str) -> NodeId {
    g.nodes().iter().find(|n| n.name.as_deref() == Some(name)).map(|n| n.id).expect("node")
}

/// `rlx_ir::text::print(g)` with the attribute bytes of opscope's custom ops (JSON, printed by
/// RLX as a byte array) shown as the JSON text they hold, so snapshots are reviewable.
pub fn print_graph(g: &Graph) -> String {
    let text = rlx_ir::text::print(g);
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let decoded = line.contains("\"name\":\"opscope.").then(|| {
            let start = line.find("\"attrs\":[")? + "\"attrs\":[".len();
            let end = start + line[start..].find(']')?;
            let bytes: Vec<u8> = line[start..end].split(',').map(|b| b.trim().parse::<u8>().ok()).collect::<Option<_>>()?;
            let json = String::from_utf8(bytes).ok()?;
            Some(format!("{}{}{}", &line[..start - 1], json, &line[end + 1..]))
        });
        out.push_str(&decoded.flatten().unwrap_or_else(|| line.to_string()));
        out.push('\n');
    }
    out
}

/// A rewritten graph and its manifest as snapshot text: the graph ([`print_graph`]), then the
/// pipeline, sites, appended outputs with their layouts, skipped sites with reasons, and
/// actuations.
pub fn render(g: &Graph, m: &opscope::Manifest) -> String {
    // The rewrite caches the spec it encoded instead of decoding the bytes back: exact only if
    // decoding gives that spec back. Checked on every sketch output against the manifest's spec
    // (the one the rewrite encoded), and on every sketch node as bytes -> spec -> bytes.
    for (i, node) in g.nodes().iter().enumerate() {
        if let rlx_ir::Op::Custom { name, attrs, .. } = &node.op {
            if opscope::sketch::is_sketch_op(name) {
                let spec = opscope::sketch::SketchSpec::from_attrs(attrs).unwrap_or_else(|e| panic!("%{i}: {e}"));
                assert_eq!(spec.to_attrs(), *attrs, "%{i}: the sketch attributes do not round-trip");
            }
        }
    }
    for o in &m.outputs {
        let Some(k) = o.output_index else { continue };
        let id = g.outputs[k];
        if let rlx_ir::Op::Custom { name, attrs, .. } = &g.node(id).op {
            if opscope::sketch::is_sketch_op(name) {
                let decoded = opscope::sketch::SketchSpec::from_attrs(attrs).unwrap_or_else(|e| panic!("%{}: {e}", id.0));
                assert_eq!(decoded, o.spec, "%{}: the node's attributes decode to another spec than the rewrite encoded", id.0);
            }
        }
    }
    let mut s = print_graph(g);
    s.push_str(&format!("\n# pipeline: {}\n# user outputs: {}\n", m.pipeline, m.user_outputs));
    for site in &m.sites {
        s.push_str(&format!("# site {} op={} node=%{} flops={:?}\n", site.site, site.op, site.node, site.flops));
    }
    for o in &m.outputs {
        let uses: Vec<String> = o.uses.iter().map(|u| format!("{}/{}", u.site, u.role.as_str())).collect();
        let layout: Vec<String> = o.layout.iter().map(|l| format!("{}@{}x{}", l.stat.as_str(), l.offset, l.len)).collect();
        s.push_str(&format!(
            "# output {:?} tensor=%{} shape={} numel={:?} invariant={} uses=[{}]\n#   layout {}\n",
            o.output_index,
            o.tensor,
            o.shape,
            o.numel,
            o.invariant,
            uses.join(", "),
            layout.join(" ")
        ));
    }
    for k in &m.skipped {
        s.push_str(&format!("# skipped {}/{:?} shape={:?}: {}\n", k.site, k.role.as_ref().map(|r| r.as_str()), k.shape, k.reason));
    }
    for a in &m.actuations {
        s.push_str(&format!("# actuation {} node=%{} pass={}#{}: {}\n", a.site, a.node, a.pass, a.pass_idx, a.action));
    }
    if let Some(n) = m.sample_every {
        s.push_str(&format!("# sampled: one run in {n}\n"));
    }
    s
}

/// Assert the snapshot `name` (in `snapshots/`) of a rewritten graph and its manifest; the graph
/// must also pass RLX's verifier.
/// The rewritten graph `out` gives the caller `g`'s outputs first: the same count of leading
/// outputs, each the same op, shape and name (node ids change: sketches are placed right after
/// the node they read).
pub fn assert_caller_outputs_first(g: &Graph, out: &Graph) {
    assert!(out.outputs.len() >= g.outputs.len(), "caller's outputs kept");
    for (a, b) in g.outputs.iter().zip(&out.outputs) {
        let (a, b) = (g.node(*a), out.node(*b));
        assert_eq!((format!("{:?}", a.op), &a.shape, &a.name), (format!("{:?}", b.op), &b.shape, &b.name), "caller's outputs first");
    }
}

pub fn snapshot(name: &str, g: &Graph, m: &opscope::Manifest) {
    let errors = rlx_ir::verify::verify_all(g);
    assert!(errors.is_empty(), "{name}: verifier: {errors:?}");
    // Relative to this file (tests/common/): the repository's snapshots/ folder.
    insta::with_settings!({snapshot_path => "../../snapshots", prepend_module_to_snapshot => false}, {
        insta::assert_snapshot!(name, render(g, m));
    });
}

/// x[4,8] @ w + b -> gelu (matmul named `/fc/MatMul`): RLX's CPU fusion makes it one
/// `FusedMatMulBiasAct`, whose output is the fused kernel's.
pub fn fixture_bias_gelu() -> Graph {
    use rlx_ir::op::{Activation, BinaryOp};
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    let mut g = Graph::new("bias_gelu");
    let x = g.input("x", f(&[4, 8]));
    let w = g.param("w", f(&[8, 6]));
    let b = g.param("b", f(&[6]));
    let y = g.matmul(x, w, f(&[4, 6]));
    g.node_mut(y).name = Some("/fc/MatMul".into());
    let z = g.binary(BinaryOp::Add, y, b, f(&[4, 6]));
    let a = g.activation(Activation::Gelu, z, f(&[4, 6]));
    g.set_outputs(vec![a]);
    g
}

/// An attention fed by one merged QKV projection sliced with `Narrow` (the form RLX's CPU backend
/// fuses at the thunk level): `y = attention(narrow_q, narrow_k, narrow_v, mask) @ w_o` with
/// `qkv = x @ w_qkv`. Inputs `x[b,s,h*d]`, `mask[b,s]`; params `w_qkv[e,3e]`, `w_o[e,e]`.
/// RLX 0.2.19 computes it wrong above 64 tokens (the QKV buffer is reused while the attention
/// still reads it in place).
pub fn qkv_attention_graph(b: usize, s: usize, h: usize, d: usize) -> Graph {
    let f = |dims: &[usize]| Shape::new(dims, DType::F32);
    let e = h * d;
    let mut gr = Graph::new("qkv_attn");
    let x = gr.input("x", f(&[b, s, e]));
    let w = gr.param("w_qkv", f(&[e, 3 * e]));
    let wo = gr.param("w_o", f(&[e, e]));
    let m = gr.input("mask", f(&[b, s]));
    let qkv = gr.matmul(x, w, f(&[b, s, 3 * e]));
    let part = |gr: &mut Graph, i: usize| gr.add_node(rlx_ir::Op::Narrow { axis: 2, start: i * e, len: e }, vec![qkv], f(&[b, s, e]));
    let (q, k, v) = (part(&mut gr, 0), part(&mut gr, 1), part(&mut gr, 2));
    let o = gr.attention(q, k, v, m, h, d, f(&[b, s, e]));
    let y = gr.matmul(o, wo, f(&[b, s, e]));
    gr.set_outputs(vec![y]);
    gr
}

/// Chain MLP: x[M,D] -> (matmul w_i[D,D] He-scaled -> relu) x layers; w_i are params, returned
/// with their values (variance-preserving, so activations stay at unit scale: no denormals).
pub fn chain_mlp(m: usize, d: usize, layers: usize) -> (Graph, Vec<(String, Vec<f32>)>) {
    let mut g = Graph::new("chain");
    let mut h = g.input("x", Shape::new(&[m, d], DType::F32));
    let mut params = Vec::new();
    let he = (2.0 / d as f32).sqrt();
    for i in 0..layers {
        let name = format!("w{i}");
        let w = g.param(&name, Shape::new(&[d, d], DType::F32));
        let y = g.matmul(h, w, Shape::new(&[m, d], DType::F32));
        h = g.activation(rlx_ir::op::Activation::Relu, y, Shape::new(&[m, d], DType::F32));
        params.push((name, randn(d * d, 100 + i as u64).iter().map(|v| v * he).collect()));
    }
    g.set_outputs(vec![h]);
    (g, params)
}

/// An example program `cargo test` built in `<target>/<profile>/examples` (beside the `deps`
/// folder the test runs from), with opscope's environment variables cleared.
pub fn example(name: &str) -> std::process::Command {
    let exe = std::env::current_exe().unwrap();
    let path: std::path::PathBuf = exe.parent().unwrap().parent().unwrap().join("examples").join(name);
    assert!(path.is_file(), "{} not built (cargo test builds the examples)", path.display());
    let mut c = std::process::Command::new(path);
    c.env_remove("RLX_OPSCOPE").env_remove("RLX_OPSCOPE_OUT").env_remove("RLX_OPSCOPE_STAGE");
    c
}
