//! The `fakequant` actuation pass against a host reference quantizer written here in plain Rust:
//! bit-exact fake-quantized activations, exact .5 ties, saturation, int4, an integer W8A8 GEMM,
//! outputs and verifier, snapshots of the rewritten graphs, and option errors.

mod common;

use common::{randn, run_plain};
use opscope::{Manifest, PassKind, Pipeline};
use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, Shape};

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// The host reference quantizer's settings (the pass's options).
#[derive(Clone, Copy, Debug)]
struct Fq {
    bits: u32,
    /// `token`, `channel` or `tensor`.
    scope: &'static str,
    away: bool,
    full: bool,
    clip: f32,
}

const INT8: Fq = Fq { bits: 8, scope: "token", away: false, full: false, clip: 1.0 };

impl Fq {
    fn pipeline(&self, extra: &str) -> String {
        format!(
            "fakequant{{bits={},scope={},rounding={},range={},clip={}{extra}}}",
            self.bits,
            self.scope,
            if self.away { "away" } else { "even" },
            if self.full { "full" } else { "narrow" },
            self.clip
        )
    }

    /// Codes and per-element scales `s'` of `x` viewed as `[rows, cols]` (leading axes
    /// flattened): absmax per row (token), per column (channel) or over all (tensor), then
    /// `s = (clip * absmax) / Q`, `s' = s if s > 0 else 1`, `q = clamp(round(x / s'), lo, Q)`,
    /// every step one f32 operation as in the graph.
    fn codes(&self, x: &[f32], cols: usize) -> (Vec<f32>, Vec<f32>) {
        let q = ((1u32 << (self.bits - 1)) - 1) as f32;
        let lo = if self.full { -q - 1.0 } else { -q };
        let slice = |i: usize| match self.scope {
            "token" => i / cols,
            "channel" => i % cols,
            _ => 0,
        };
        let mut amax = vec![0f32; x.len()];
        for (i, v) in x.iter().enumerate() {
            amax[slice(i)] = amax[slice(i)].max(v.abs());
        }
        let scale: Vec<f32> = (0..x.len())
            .map(|i| {
                let s = (self.clip * amax[slice(i)]) / q;
                if s > 0.0 { s } else { 1.0 }
            })
            .collect();
        let codes = x
            .iter()
            .zip(&scale)
            .map(|(v, s)| {
                let r = v / s;
                let r = if self.away { r.round() } else { r.round_ties_even() };
                r.clamp(lo, q)
            })
            .collect();
        (codes, scale)
    }

    /// The fake-quantized tensor `q * s'`.
    fn apply(&self, x: &[f32], cols: usize) -> Vec<f32> {
        let (c, s) = self.codes(x, cols);
        c.iter().zip(&s).map(|(c, s)| c * s).collect()
    }
}

/// `y = x @ I`: the identity weight makes y the matmul's (fake-quantized) lhs exactly, since
/// every output is one product `v * 1.0` plus exact zeros. (The GEMM's sum turns a -0.0 into
/// +0.0, hence the `+ 0.0` in [`ident_ref`].)
fn ident_graph(dims: &[usize]) -> Graph {
    let k = *dims.last().unwrap();
    let mut g = Graph::new("ident");
    let x = g.input("x", f32s(dims));
    let w = g.param("w", f32s(&[k, k]));
    let y = g.matmul(x, w, f32s(dims));
    g.set_outputs(vec![y]);
    g
}

fn identity(k: usize) -> Vec<f32> {
    (0..k * k).map(|i| if i / k == i % k { 1.0 } else { 0.0 }).collect()
}

fn ident_ref(fq: Fq, x: &[f32], cols: usize) -> Vec<u32> {
    fq.apply(x, cols).iter().map(|v| (v + 0.0).to_bits()).collect()
}

/// Apply `pipeline` to `g`, check the verifier and the outputs' count and shapes, compile the
/// rewritten graph with RLX and run it.
fn run_fq(pipeline: &str, g: &Graph, params: &[(&str, &[f32])], inputs: &[(&str, &[f32])]) -> (Vec<Vec<f32>>, Manifest) {
    let (out, m) = Pipeline::parse(pipeline).unwrap().apply(g).unwrap();
    let errors = rlx_ir::verify::verify_all(&out);
    assert!(errors.is_empty(), "{pipeline}: verifier: {errors:?}");
    assert_eq!(out.outputs.len(), g.outputs.len());
    for (a, b) in out.outputs.iter().zip(&g.outputs) {
        assert_eq!(out.node(*a).shape, g.node(*b).shape, "{pipeline}: output shape");
    }
    (run_plain(&out, params, inputs), m)
}

fn bitpat(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Random data with an outlier row and column, one all-zero row and one all-zero column.
fn data(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut x = randn(rows * cols, seed);
    for j in 0..cols {
        x[j] *= 40.0; // an outlier token
        x[cols + j] = 0.0; // an all-zero token
    }
    for i in 0..rows {
        x[i * cols + 3] *= 25.0; // an outlier channel
        x[i * cols + 5] = 0.0; // an all-zero channel
    }
    x
}

#[test]
fn fake_quantized_activation_matches_host_reference_bit_for_bit() {
    let (rows, k) = (6, 16);
    let x = data(rows, k, 1);
    let w = identity(k);
    let mut n = 0;
    for scope in ["token", "channel", "tensor"] {
        for (bits, clip) in [(8, 1.0), (4, 1.0), (8, 0.5), (2, 0.3)] {
            for away in [false, true] {
                for full in [false, true] {
                    let fq = Fq { bits, scope, away, full, clip };
                    let (outs, m) = run_fq(&fq.pipeline(""), &ident_graph(&[rows, k]), &[("w", &w)], &[("x", &x)]);
                    assert_eq!(bitpat(&outs[0]), ident_ref(fq, &x, k), "{fq:?}");
                    assert!(outs[0].iter().all(|v| v.is_finite()), "{fq:?}");
                    assert_eq!(m.actuations.len(), 1);
                    n += 1;
                }
            }
        }
    }
    assert_eq!(n, 48);
    // The all-zero token (token scope) and channel (channel scope) come out as exact zeros.
    let y = &run_fq("fakequant", &ident_graph(&[rows, k]), &[("w", &w)], &[("x", &x)]).0[0];
    assert!(y[k..2 * k].iter().all(|v| *v == 0.0));
    let y = &run_fq("fakequant{scope=channel}", &ident_graph(&[rows, k]), &[("w", &w)], &[("x", &x)]).0[0];
    assert!((0..rows).all(|i| y[i * k + 5] == 0.0));
}

#[test]
fn rank3_activation_scales_flatten_leading_axes() {
    // x[2,3,16]: per-channel absmax over both leading axes (one Reduce over axes [0,1]),
    // per-token over the last axis of each of the 6 rows.
    let k = 16;
    let x = data(6, k, 2);
    let w = identity(k);
    for scope in ["token", "channel", "tensor"] {
        let fq = Fq { scope, ..INT8 };
        let (outs, _) = run_fq(&fq.pipeline(""), &ident_graph(&[2, 3, k]), &[("w", &w)], &[("x", &x)]);
        assert_eq!(bitpat(&outs[0]), ident_ref(fq, &x, k), "{scope}");
    }
}

/// `padding=exclude`: per-tensor and per-channel scales from the rows the graph input
/// `attention_mask` marks as tokens (padding rows 1000x larger would set them otherwise), every
/// row then quantized with them, bit for bit as a host quantizer whose scales read the token
/// rows; `padding=include` (the default) reads every row; without an `attention_mask` input the
/// site is skipped with the reason.
#[test]
fn padding_rows_can_be_left_out_of_per_tensor_and_per_channel_scales() {
    let (b, s, k) = (2usize, 4usize, 16usize);
    let mut g = ident_graph(&[b, s, k]);
    // The row mask as the taps find it: a graph input the model itself need not read.
    g.input("attention_mask", f32s(&[b, s]));
    let mask: Vec<f32> = (0..b * s).map(|i| if i >= s + 2 { 0.0 } else { 1.0 }).collect();
    let mut x = data(b * s, k, 7);
    for r in 0..b * s {
        if mask[r] == 0.0 {
            x[r * k..(r + 1) * k].iter_mut().for_each(|v| *v *= 1000.0);
        }
    }
    let w = identity(k);
    let ins: Vec<(&str, &[f32])> = vec![("x", &x), ("attention_mask", &mask)];
    for scope in ["tensor", "channel"] {
        let fq = Fq { scope, ..INT8 };
        // Host: scales from the token rows (padding rows zeroed: they add nothing to a max of
        // |x|), applied to every row.
        let tokens: Vec<f32> = x.iter().enumerate().map(|(i, v)| if mask[i / k] > 0.5 { *v } else { 0.0 }).collect();
        let (_, scale) = fq.codes(&tokens, k);
        let q = 127f32;
        let want: Vec<u32> = x.iter().zip(&scale).map(|(v, s)| ((v / s).round_ties_even().clamp(-q, q) * s + 0.0).to_bits()).collect();
        let (outs, m) = run_fq(&fq.pipeline(",padding=exclude"), &g, &[("w", &w)], &ins);
        assert!(m.actuations[0].action.contains("scale over token rows"), "{:?}", m.actuations);
        assert_eq!(bitpat(&outs[0]), want, "{scope}, padding=exclude");
        let (outs, _) = run_fq(&fq.pipeline(""), &g, &[("w", &w)], &ins);
        assert_eq!(bitpat(&outs[0]), ident_ref(fq, &x, k), "{scope}, padding=include");
        assert_ne!(ident_ref(fq, &x, k), want, "{scope}: the padding rows set the scale when included");
    }
    // No attention_mask input: skipped with the reason.
    let (_, m) = run_fq(&Fq { scope: "tensor", ..INT8 }.pipeline(",padding=exclude"), &ident_graph(&[b, s, k]), &[("w", &w)], &[("x", &x)]);
    assert!(m.actuations.is_empty() && m.skipped.iter().any(|s| s.reason.contains("padding=exclude needs a graph input attention_mask")), "{:?}", m.skipped);
}

/// Rows of 8 with absmax 127 in the first element: s = 127 / 127 = 1 exactly, so x / s lands
/// exactly on the written ties and y is the code itself.
const TIES: [f32; 16] = [127.0, 2.5, -2.5, 3.5, -3.5, 126.5, 0.5, -0.5, 127.0, 0.49999997, -0.49999997, 1.5, -1.5, 0.0, 64.5, -126.5];

#[test]
fn exact_ties_even_versus_away() {
    let w = identity(8);
    let g = ident_graph(&[2, 8]);
    let even = &run_fq("fakequant", &g, &[("w", &w)], &[("x", &TIES)]).0[0];
    let away = &run_fq("fakequant{rounding=away}", &g, &[("w", &w)], &[("x", &TIES)]).0[0];
    let want_even = [127.0, 2.0, -2.0, 4.0, -4.0, 126.0, 0.0, 0.0, 127.0, 0.0, 0.0, 2.0, -2.0, 0.0, 64.0, -126.0];
    // Away: 0.49999997 still rounds to 0 (a floor(|r| + 0.5) construction would give 1).
    let want_away = [127.0, 3.0, -3.0, 4.0, -4.0, 127.0, 1.0, -1.0, 127.0, 0.0, 0.0, 2.0, -2.0, 0.0, 65.0, -127.0];
    assert_eq!(even, &want_even);
    assert_eq!(away, &want_away);
    assert_eq!(bitpat(even), ident_ref(INT8, &TIES, 8));
    assert_eq!(bitpat(away), ident_ref(Fq { away: true, ..INT8 }, &TIES, 8));
}

#[test]
fn saturation_narrow_and_full_range_and_int4() {
    let w = identity(8);
    let g = ident_graph(&[1, 8]);
    // clip = 0.5, absmax 254: s = (0.5 * 254) / 127 = 1; beyond +-127 saturates.
    let x = [254.0, -254.0, 127.0, -127.0, 128.0, -130.0, -127.5, 5.5];
    let run = |p: &str, x: &[f32]| run_fq(p, &g, &[("w", &w)], &[("x", x)]).0.remove(0);
    assert_eq!(run("fakequant{clip=0.5}", &x), [127.0, -127.0, 127.0, -127.0, 127.0, -127.0, -127.0, 6.0]);
    assert_eq!(run("fakequant{clip=0.5,range=full}", &x), [127.0, -128.0, 127.0, -127.0, 127.0, -128.0, -128.0, 6.0]);
    // int4: Q = 7. absmax 7 -> s = 1.
    let x4 = [7.0, -7.0, 2.5, 6.5, -6.5, 3.49, -0.5, 1.5];
    assert_eq!(run("fakequant{bits=4}", &x4), [7.0, -7.0, 2.0, 6.0, -6.0, 3.0, 0.0, 2.0]);
    assert_eq!(run("fakequant{bits=4,rounding=away}", &x4), [7.0, -7.0, 3.0, 7.0, -7.0, 3.0, -1.0, 2.0]);
    // int4 saturation, clip 0.5 of absmax 14: s = 7 / 7 = 1; codes [-7,7] or [-8,7].
    let x4s = [14.0, -14.0, -8.0, 7.5, -7.5, 3.0, 0.0, 1.0];
    assert_eq!(run("fakequant{bits=4,clip=0.5}", &x4s), [7.0, -7.0, -7.0, 7.0, -7.0, 3.0, 0.0, 1.0]);
    assert_eq!(run("fakequant{bits=4,clip=0.5,range=full}", &x4s), [7.0, -8.0, -8.0, 7.0, -8.0, 3.0, 0.0, 1.0]);
}

#[test]
fn w8a8_equals_an_integer_gemm() {
    let (m, k, n) = (8, 64, 12);
    let x = data(m, k, 3);
    let w = randn(k * n, 4);
    let g = common::matmul_2d(m, k, n);
    let (outs, man) = run_fq("fakequant{weights=true}", &g, &[("w", &w)], &[("x", &x)]);
    assert!(man.actuations[0].action.contains("rhs per-column"), "{:?}", man.actuations);
    let y = &outs[0];

    // The int8 kernel: i8 codes, exact i32 accumulation, one rescale by s_x[row] * s_w[col].
    let (qx, sx) = INT8.codes(&x, k); // per token
    let (qw, sw) = Fq { scope: "channel", ..INT8 }.codes(&w, n); // per output column of W[K,N]
    let to_i8 = |v: &f32| {
        assert!(v.fract() == 0.0 && (-127.0..=127.0).contains(v));
        *v as i8
    };
    let (qx, qw): (Vec<i8>, Vec<i8>) = (qx.iter().map(to_i8).collect(), qw.iter().map(to_i8).collect());
    let fp = run_plain(&g, &[("w", &w)], &[("x", &x)]).remove(0);
    let mut beyond_tol = 0;
    for i in 0..m {
        for j in 0..n {
            let acc: i32 = (0..k).map(|t| qx[i * k + t] as i32 * qw[t * n + j] as i32).sum();
            let want = acc as f64 * sx[i * k] as f64 * sw[j] as f64;
            // RLX computes sum_t (qx*sx)*(qw*sw) in f32, in its own order: each term and each
            // partial sum rounds, so |error| <= ~k * eps * sum_t |term| (Higham's gamma_k bound).
            // Between exact integer codes and f32 rescaling this is the only difference.
            let mag: f64 = (0..k).map(|t| (qx[i * k + t] as f64 * sx[i * k] as f64 * qw[t * n + j] as f64 * sw[j] as f64).abs()).sum();
            let tol = k as f64 * f32::EPSILON as f64 * mag;
            assert!((y[i * n + j] as f64 - want).abs() <= tol, "[{i},{j}]: {} vs {want} (tol {tol})", y[i * n + j]);
            beyond_tol += usize::from((fp[i * n + j] as f64 - want).abs() > tol);
        }
    }
    // The tolerance is tight enough to tell the fp32 matmul from the W8A8 one.
    assert!(beyond_tol > m * n / 2, "fp32 output within the W8A8 tolerance at {} of {}", m * n - beyond_tol, m * n);
    // scope=channel is not representable this way: its scale s_x[k] varies along the reduction
    // axis, so sum_k (q_x[m,k] s_x[k]) (q_w[k,n] s_w[n]) has no common factor to pull out of the
    // sum and an integer GEMM would need a per-k rescale inside the dot product (SmoothQuant
    // instead folds s_x[k] into W's rows before quantizing W). Nothing to assert.
}

/// x feeds the matmul and, unchanged, a second output; output order [relu(x), x @ I].
fn shared_input_graph(k: usize) -> Graph {
    let mut g = Graph::new("shared");
    let x = g.input("x", f32s(&[4, k]));
    let w = g.param("w", f32s(&[k, k]));
    let r = g.activation(Activation::Relu, x, f32s(&[4, k]));
    let y = g.matmul(x, w, f32s(&[4, k]));
    g.node_mut(y).name = Some("/proj/MatMul".into());
    g.set_outputs(vec![r, y]);
    g
}

#[test]
fn outputs_keep_count_and_order_and_other_users_see_f32() {
    let k = 8;
    let x = data(4, k, 5);
    let w = identity(k);
    let g = shared_input_graph(k);
    let (outs, m) = run_fq("fakequant", &g, &[("w", &w)], &[("x", &x)]);
    assert_eq!(outs.len(), 2);
    let relu: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
    assert_eq!(bitpat(&outs[0]), bitpat(&relu), "the other user of x sees f32 x");
    assert_eq!(bitpat(&outs[1]), ident_ref(INT8, &x, k));
    assert_eq!((m.actuations[0].site.as_str(), m.actuations[0].pass.as_str()), ("proj/MatMul", "fakequant"));
    // A site filter that matches nothing changes nothing.
    let (outs, m) = run_fq("fakequant{sites=[*attention*]}", &g, &[("w", &w)], &[("x", &x)]);
    assert!(m.actuations.is_empty());
    assert_eq!(bitpat(&outs[1]), bitpat(&x));
}

#[test]
fn batched_activation_rhs_stays_f32_with_reason() {
    // a[2,4,8] @ b[2,8,8] with b an input (like K^T): by default an attention BMM stays float.
    let (bsz, mm, k) = (2, 4, 8);
    let a = data(bsz * mm, k, 6);
    let eye = identity(k);
    let b: Vec<f32> = eye.iter().chain(&eye).copied().collect();
    let g = common::matmul_3d(bsz, mm, k, k);
    let (outs, m) = run_fq("fakequant{weights=true}", &g, &[], &[("a", &a), ("b", &b)]);
    assert_eq!(bitpat(&outs[0]), bitpat(&a), "left in float");
    assert!(m.actuations.is_empty() && m.skipped[0].reason.contains("attention BMM"), "{:?}", m.skipped);
    // bmm=true: weights=true quantizes a only.
    let (outs, m) = run_fq("fakequant{weights=true,bmm=true}", &g, &[], &[("a", &a), ("b", &b)]);
    assert_eq!(bitpat(&outs[0]), ident_ref(INT8, &a, k));
    assert_eq!(m.skipped.len(), 1);
    assert!(m.skipped[0].reason.contains("not a weight"), "{:?}", m.skipped);
    assert!(!m.actuations[0].action.contains("rhs"));
}

/// A `DequantMatMul` over a packed GGUF Q8_0 weight (3 output rows of 32: an f16 scale of 1.0 and
/// 32 int8 codes per row): its activation is fake-quantized and its weight kept packed, so the
/// output equals the same graph run on the host's fake-quantized input, bit for bit, for each
/// scope; `weights=true` says the weight is kept.
#[test]
fn dequant_matmul_quantizes_its_activation_and_keeps_the_packed_weight() {
    let (m, k, n) = (4, 32, 3);
    let (g, packed) = common::q8_0_dequant_matmul(m, k, n);
    let run = |g: &Graph, x: &[f32]| common::run_packed(g, &packed, x);
    let xv = data(m, k, 41);
    for scope in ["token", "channel", "tensor"] {
        let fq = Fq { scope, ..INT8 };
        let (out, man) = Pipeline::parse(&fq.pipeline(",weights=true")).unwrap().apply(&g).unwrap();
        assert_eq!(man.actuations.len(), 1, "{scope}: the DequantMatMul is actuated");
        assert!(man.actuations[0].action.contains("packed"), "{:?}", man.actuations[0].action);
        assert!(man.skipped.iter().any(|s| s.reason.contains("already quantized")), "{scope}: {:?}", man.skipped);
        let want = run(&g, &fq.apply(&xv, k));
        assert_eq!(run(&out, &xv), want, "{scope}: DequantMatMul on fake-quantized x");
        assert_ne!(run(&g, &xv), want, "{scope}: the quantization changes the output");
    }
}

fn snap(name: &str, pipeline: &str, source: &Graph, deployed: bool) {
    let p = Pipeline::parse(pipeline).unwrap();
    let (g, src) = if deployed {
        let cpu = rlx_runtime::Device::Cpu;
        (opscope::activate::fuse(source, cpu, &rlx_runtime::CompileOptions::new()), Some(source))
    } else {
        (source.clone(), None)
    };
    let (out, m) = p.apply_tagged(&g, src, 0).unwrap();
    assert_eq!(out.outputs.len(), g.outputs.len());
    common::snapshot(name, &out, &m);
}

/// Q projection of x (a weight), then scores q @ kt with kt an input (an activation rhs).
fn fixture_attn_like() -> Graph {
    let mut g = Graph::new("attn_like");
    let x = g.input("x", f32s(&[4, 8]));
    let kt = g.input("kt", f32s(&[8, 4]));
    let wq = g.param("wq", f32s(&[8, 8]));
    let q = g.matmul(x, wq, f32s(&[4, 8]));
    g.node_mut(q).name = Some("/attn/query/MatMul".into());
    let s = g.matmul(q, kt, f32s(&[4, 4]));
    g.node_mut(s).name = Some("/attn/scores/MatMul".into());
    g.set_outputs(vec![s]);
    g
}


#[test]
fn snapshot_2d_token() {
    snap("fakequant__2d_token", "fakequant", &common::matmul_2d(4, 8, 3), false);
}

#[test]
fn snapshot_channel_weights() {
    snap("fakequant__channel_weights", "fakequant{scope=channel,weights=true}", &fixture_attn_like(), false);
}

#[test]
fn snapshot_deployed_bias_gelu_away_int4() {
    let p = "fakequant{bits=4,weights=true,rounding=away,clip=0.9}";
    snap("fakequant__deployed_bias_gelu", p, &common::fixture_bias_gelu(), true);
}

#[test]
fn deployed_fused_site_runs_on_the_quantized_activation() {
    // gelu(fq(x) @ w + b) in the fused kernel equals the fused kernel run on host-quantized x.
    let g = common::fixture_bias_gelu();
    let fused = opscope::activate::fuse(&g, rlx_runtime::Device::Cpu, &rlx_runtime::CompileOptions::new());
    assert!(fused.nodes().iter().any(|n| matches!(n.op, rlx_ir::Op::FusedMatMulBiasAct { .. })));
    let (out, m) = Pipeline::parse("fakequant").unwrap().apply_tagged(&fused, Some(&g), 0).unwrap();
    assert_eq!(m.actuations[0].site, "fc/MatMul");
    let (x, w, b) = (data(4, 8, 7), randn(48, 8), randn(6, 9));
    let params: [(&str, &[f32]); 2] = [("w", &w), ("b", &b)];
    let got = run_plain(&out, &params, &[("x", &x)]);
    let want = run_plain(&g, &params, &[("x", &INT8.apply(&x, 8))]);
    assert_eq!(bitpat(&got[0]), bitpat(&want[0]));
}

#[test]
fn bad_options_are_errors_naming_the_range() {
    let err = |p: &str| Pipeline::parse(p).unwrap_err().to_string();
    assert!(err("fakequant{bits=9}").contains("'9': expected integer 2..=8"), "{}", err("fakequant{bits=9}"));
    assert!(err("fakequant{bits=1}").contains("integer 2..=8"));
    assert!(err("fakequant{clip=0}").contains("'0': expected number 0.01..=1"), "{}", err("fakequant{clip=0}"));
    assert!(err("fakequant{clip=1.5}").contains("number 0.01..=1"));
    assert!(err("fakequant{scope=row}").contains("one of token|channel|tensor"));
    assert!(err("fakequant{rounding=up}").contains("one of even|away"));
    assert!(err("fakequant{range=wide}").contains("one of narrow|full"));
    assert!(err("fakequant{weights=1}").contains("expected bool"));
    // Canonical text round-trips; the pass is an actuation.
    let p = Pipeline::parse("fakequant{clip=0.5, bits=4,scope=channel}").unwrap();
    assert_eq!(p.to_string(), "fakequant{bits=4,scope=channel,clip=0.5}");
    assert_eq!(Pipeline::parse(&p.to_string()).unwrap(), p);
    assert_eq!(opscope::pass::lookup("fakequant").unwrap().kind(), PassKind::Actuation);
}
