//! The `staticquant` actuation against host references written here in plain Rust, with tables
//! written by opscope's own calibration-table writer (`opscope::mine::calibrate::ort_json`):
//! - the QDQ'd activation equals ONNX QuantizeLinear/DequantizeLinear on the host bit for bit
//!   (uint8 with a zero point, int8), ties to even, saturation at the code type's ends;
//! - static W8A8 (and W4A8) equals an integer GEMM with i32 accumulation: bit for bit with
//!   power-of-two scales (every f32 step is then exact), within the f32 summation bound otherwise;
//! - the rewrite is pinned (insta), and a bad table is an error naming the file, tensor and fix.

mod common;

use common::{randn, run_plain};
use opscope::mine::calibrate::ort_json;
use opscope::mine::{quant_params, CalibrationMethod, CalibrationOptions, QuantParams, TensorCalibration};
use opscope::{Manifest, Pipeline};
use rlx_ir::{DType, Graph, Shape};
use std::path::{Path, PathBuf};

fn f32s(d: &[usize]) -> Shape {
    Shape::new(d, DType::F32)
}

/// A table entry for `site/role` with the given quantizer (ranges as the scale implies).
fn entry(site: &str, role: &str, quant: QuantParams) -> TensorCalibration {
    let lo = (quant.qmin - quant.zero_point) as f32 * quant.scale;
    let hi = (quant.qmax - quant.zero_point) as f32 * quant.scale;
    TensorCalibration {
        name: format!("{site}/{role}"),
        site: site.into(),
        role: role.into(),
        pass_idx: 0,
        method: CalibrationMethod::MinMax,
        lowest: lo,
        highest: hi,
        data_min: lo,
        data_max: hi,
        quant,
        histogram: None,
        runs: 1,
        notes: vec![],
    }
}

fn uint8(scale: f32, zero_point: i32) -> QuantParams {
    QuantParams { qmin: 0, qmax: 255, scale, zero_point }
}

fn int8(scale: f32) -> QuantParams {
    QuantParams { qmin: -127, qmax: 127, scale, zero_point: 0 }
}

/// Write the table as `opscope calibrate` does into `dir`; returns its path.
fn write_table(dir: &Path, entries: &[TensorCalibration]) -> PathBuf {
    let path = dir.join("table.json");
    let json = ort_json(entries, &CalibrationOptions::new(CalibrationMethod::MinMax));
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    path
}

/// Host ONNX QuantizeLinear codes: `clamp(round_half_even(x / s) + zp, qlo, qhi)` with `[qlo, qhi]`
/// the type's whole range (uint8 [0, 255], int8 [-128, 127]), as integers.
fn quantize_linear(x: &[f32], q: QuantParams) -> Vec<i32> {
    let (lo, hi) = if q.qmin < 0 { (-128, 127) } else { (0, 255) };
    x.iter().map(|v| (((v / q.scale).round_ties_even() as i64 + q.zero_point as i64).clamp(lo, hi)) as i32).collect()
}

/// Host DequantizeLinear of QuantizeLinear: `(q - zp) * s`, integer subtraction, one f32 multiply.
fn qdq_host(x: &[f32], q: QuantParams) -> Vec<f32> {
    quantize_linear(x, q).iter().map(|c| (c - q.zero_point) as f32 * q.scale).collect()
}

/// Symmetric per-column codes of `w[K, N]` and the column scales (`fakequant`'s weight formula:
/// `s = absmax / Q` in f32, `round_half_even(w / s)` clamped to `[-Q, Q]`).
fn weight_codes(w: &[f32], n: usize, qmax: f32) -> (Vec<i32>, Vec<f32>) {
    let k = w.len() / n;
    let s: Vec<f32> = (0..n)
        .map(|j| {
            let a = (0..k).map(|t| w[t * n + j].abs()).fold(0f32, f32::max) / qmax;
            if a > 0.0 { a } else { 1.0 }
        })
        .collect();
    let q = w.iter().enumerate().map(|(i, v)| (v / s[i % n]).round_ties_even().clamp(-qmax, qmax) as i32).collect();
    (q, s)
}

fn apply(pipeline: &str, g: &Graph) -> (Graph, Manifest) {
    let (out, m) = Pipeline::parse(pipeline).unwrap().apply(g).unwrap_or_else(|e| panic!("{pipeline}: {e}"));
    let errors = rlx_ir::verify::verify_all(&out);
    assert!(errors.is_empty(), "{pipeline}: verifier: {errors:?}");
    assert_eq!(out.outputs.len(), g.outputs.len());
    (out, m)
}

fn bitpat(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn identity(k: usize) -> Vec<f32> {
    (0..k * k).map(|i| if i / k == i % k { 1.0 } else { 0.0 }).collect()
}

#[test]
fn qdq_activation_matches_host_quantize_dequantize_linear_bit_for_bit() {
    // x @ I with float weights: the output is the QDQ'd lhs exactly (each output is one
    // product v * 1.0 plus exact zeros; the sum turns -0.0 into +0.0, as integer codes do).
    let (m, k) = (6, 16);
    let x: Vec<f32> = randn(m * k, 11).iter().map(|v| v * 3.0 + 0.7).collect();
    let dir = tempfile::tempdir().unwrap();
    // An asymmetric range calibrated on a narrower sample ([-2, 4]): some values saturate.
    for q in [quant_params(-2.0, 4.0, false), quant_params(-2.0, 4.0, true), uint8(0.027, 100), int8(0.011)] {
        let table = write_table(dir.path(), &[entry("matmul.0", "lhs", q)]);
        let (out, man) = apply(&format!("staticquant{{table={},weights=float}}", table.display()), &common::matmul_2d(m, k, k));
        assert!(man.actuations[0].action.contains(if q.qmin < 0 { "lhs int8" } else { "lhs uint8" }), "{:?}", man.actuations);
        let y = run_plain(&out, &[("w", &identity(k))], &[("x", &x)]).remove(0);
        let want: Vec<f32> = qdq_host(&x, q).iter().map(|v| v + 0.0).collect();
        assert_eq!(bitpat(&y), bitpat(&want), "{q:?}");
        let codes = quantize_linear(&x, q);
        let (lo, hi) = if q.qmin < 0 { (-128, 127) } else { (0, 255) };
        assert!(codes.iter().any(|&c| c == lo) && codes.iter().any(|&c| c == hi), "{q:?}: the data exercise both saturation ends");
    }
}

#[test]
fn saturation_and_ties_are_quantize_linear_s() {
    let dir = tempfile::tempdir().unwrap();
    let run = |q: QuantParams, x: &[f32]| {
        let table = write_table(dir.path(), &[entry("matmul.0", "lhs", q)]);
        let (out, _) = apply(&format!("staticquant{{table={},weights=float}}", table.display()), &common::matmul_2d(1, 8, 8));
        run_plain(&out, &[("w", &identity(8))], &[("x", x)]).remove(0)
    };
    // uint8, scale 0.5, zero point 10: representable [-5, 122.5].
    let x = [-5.0, -5.5, -100.0, 200.0, 0.25, 0.75, 122.5, 122.75];
    // -5.5 / 0.5 = -11 -> -1 -> 0 (saturates to -5); 0.25 / 0.5 = 0.5 ties to 0; 0.75 -> 1.5 -> 2.
    assert_eq!(run(uint8(0.5, 10), &x), [-5.0, -5.0, -5.0, 122.5, 0.0, 1.0, 122.5, 122.5]);
    // int8 symmetric, scale 1: the calibration grid is [-127, 127], QuantizeLinear's int8 is
    // [-128, 127]: -130 saturates to -128, 130 to 127; -2.5 ties to -2, 3.5 to 4.
    let x = [-130.0, 130.0, -127.5, 127.5, -2.5, 3.5, -0.5, 0.0];
    assert_eq!(run(int8(1.0), &x), [-128.0, 127.0, -128.0, 127.0, -2.0, 4.0, 0.0, 0.0]);
}

/// Integer GEMM: `acc[m, n] = sum_k (qx[m, k] - zp) * qw[k, n]` in i32.
fn int_gemm(qx: &[i32], zp: i32, qw: &[i32], m: usize, k: usize, n: usize) -> Vec<i32> {
    let mut acc = vec![0i32; m * n];
    for i in 0..m {
        for j in 0..n {
            acc[i * n + j] = (0..k).map(|t| (qx[i * k + t] - zp) * qw[t * n + j]).sum();
        }
    }
    acc
}

#[test]
fn static_w8a8_is_an_integer_gemm_bit_for_bit_with_power_of_two_scales() {
    // s_x = 2^-4 (uint8, zp 128), s_w[n] = 2^-6 (each column's absmax is 127 * 2^-6): every
    // (q - zp) * s, every product and every partial sum is a multiple of 2^-10 below 2^14, so
    // exact in f32, and RLX's float GEMM equals the i32 GEMM times s_x * s_w in any order.
    let (m, k, n) = (8, 64, 12);
    let sx = 1.0 / 16.0;
    let qx = uint8(sx, 128);
    let x: Vec<f32> = randn(m * k, 3).iter().map(|v| v * 3.0).collect();
    let sw = 1.0 / 64.0;
    let mut w: Vec<f32> = randn(k * n, 4).iter().map(|v| (v * 0.5).clamp(-1.9, 1.9)).collect();
    for j in 0..n {
        w[(j % k) * n + j] = if j % 2 == 0 { 127.0 * sw } else { -127.0 * sw };
    }
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(dir.path(), &[entry("matmul.0", "lhs", qx)]);
    let (out, man) = apply(&format!("staticquant{{table={}}}", table.display()), &common::matmul_2d(m, k, n));
    assert!(man.actuations[0].action.contains("rhs int8 per-column"), "{:?}", man.actuations);
    let y = run_plain(&out, &[("w", &w)], &[("x", &x)]).remove(0);

    let codes = quantize_linear(&x, qx);
    assert!(codes.iter().any(|&c| c == 255) && codes.iter().any(|&c| c == 0), "saturation exercised");
    let (qw, s) = weight_codes(&w, n, 127.0);
    assert!(s.iter().all(|&v| v == sw));
    let acc = int_gemm(&codes, 128, &qw, m, k, n);
    let want: Vec<f32> = acc.iter().map(|&a| (a as f64 * sx as f64 * sw as f64) as f32).collect();
    assert_eq!(bitpat(&y), bitpat(&want), "static W8A8 = integer GEMM");
    let fp = run_plain(&common::matmul_2d(m, k, n), &[("w", &w)], &[("x", &x)]).remove(0);
    assert_ne!(bitpat(&fp), bitpat(&want), "the quantization changes the output");
}

#[test]
fn static_w8a8_and_w4a8_with_calibrated_scales_are_the_integer_gemm_to_f32_rounding() {
    let (m, k, n) = (8, 64, 12);
    let x: Vec<f32> = randn(m * k, 5).iter().map(|v| v * 2.0 + 0.3).collect();
    let w: Vec<f32> = randn(k * n, 6).iter().map(|v| v * 0.2).collect();
    let dir = tempfile::tempdir().unwrap();
    // Calibrated on a sample whose range is narrower than this data (values saturate).
    for (sym, bits) in [(false, 8u32), (true, 8), (false, 4)] {
        let qx = quant_params(-3.5, 4.5, sym);
        let table = write_table(dir.path(), &[entry("matmul.0", "lhs", qx)]);
        let weights = if bits == 8 { "int8" } else { "int4" };
        let (out, _) = apply(&format!("staticquant{{table={},weights={weights}}}", table.display()), &common::matmul_2d(m, k, n));
        let y = run_plain(&out, &[("w", &w)], &[("x", &x)]).remove(0);
        let codes = quantize_linear(&x, qx);
        let qmax = ((1 << (bits - 1)) - 1) as f32;
        let (qw, sw) = weight_codes(&w, n, qmax);
        let acc = int_gemm(&codes, qx.zero_point, &qw, m, k, n);
        let mut beyond = 0;
        let fp = run_plain(&common::matmul_2d(m, k, n), &[("w", &w)], &[("x", &x)]).remove(0);
        for i in 0..m {
            for j in 0..n {
                let want = acc[i * n + j] as f64 * qx.scale as f64 * sw[j] as f64;
                // RLX sums k f32 products of f32-rounded factors (q - zp) * s_x and q_w * s_w,
                // in its own order: |error| <= (k + 2) eps sum |term| (Higham's gamma bound).
                let mag: f64 = (0..k)
                    .map(|t| ((codes[i * k + t] - qx.zero_point) as f64 * qx.scale as f64 * qw[t * n + j] as f64 * sw[j] as f64).abs())
                    .sum();
                let tol = (k + 2) as f64 * f32::EPSILON as f64 * mag;
                let got = y[i * n + j] as f64;
                assert!((got - want).abs() <= tol, "sym {sym} int{bits} [{i},{j}]: {got} vs {want} (tol {tol})");
                beyond += usize::from((fp[i * n + j] as f64 - want).abs() > tol);
            }
        }
        assert!(beyond > m * n / 2, "the tolerance tells fp32 from the quantized GEMM ({beyond} of {})", m * n);
    }
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

fn attn_table(dir: &Path) -> PathBuf {
    write_table(
        dir,
        &[
            entry("attn/query/MatMul", "lhs", quant_params(-2.0, 3.0, false)),
            entry("attn/scores/MatMul", "lhs", quant_params(-4.0, 4.0, true)),
            entry("attn/scores/MatMul", "rhs", quant_params(-1.0, 6.0, false)),
        ],
    )
}

fn snap(name: &str, pipeline: &str, g: &Graph, table: &Path) {
    let (out, mut m) = apply(pipeline, g);
    m.pipeline = m.pipeline.replace(&table.display().to_string(), "TABLE");
    common::snapshot(name, &out, &m);
}

#[test]
fn snapshot_weight_matmul_and_bmm_left_in_float() {
    let dir = tempfile::tempdir().unwrap();
    let t = attn_table(dir.path());
    snap("staticquant__attn_like", &format!("staticquant{{table={}}}", t.display()), &fixture_attn_like(), &t);
}

#[test]
fn snapshot_bmm_int4() {
    let dir = tempfile::tempdir().unwrap();
    let t = attn_table(dir.path());
    snap("staticquant__attn_like_bmm_int4", &format!("staticquant{{table={},weights=int4,bmm=true}}", t.display()), &fixture_attn_like(), &t);
}

#[test]
fn bmm_quantizes_both_operands_from_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let t = attn_table(dir.path());
    let (out, m) = apply(&format!("staticquant{{table={},weights=float,bmm=true}}", t.display()), &fixture_attn_like());
    assert_eq!(m.actuations.len(), 2);
    let (x, kt) = (randn(32, 7).iter().map(|v| v * 2.0).collect::<Vec<f32>>(), randn(32, 8).iter().map(|v| v * 3.0).collect::<Vec<f32>>());
    let wq = randn(64, 9);
    let got = run_plain(&out, &[("wq", &wq)], &[("x", &x), ("kt", &kt)]).remove(0);
    // Host: qdq(qdq(x) @ wq) @ qdq(kt), each matmul by RLX on host-QDQ'd operands.
    let mut mm = Graph::new("mm");
    let a = mm.input("a", f32s(&[4, 8]));
    let b = mm.input("b", f32s(&[8, 8]));
    let y = mm.matmul(a, b, f32s(&[4, 8]));
    mm.set_outputs(vec![y]);
    let q = run_plain(&mm, &[], &[("a", &qdq_host(&x, quant_params(-2.0, 3.0, false))), ("b", &wq)]).remove(0);
    let mut mm2 = Graph::new("mm2");
    let a = mm2.input("a", f32s(&[4, 8]));
    let b = mm2.input("b", f32s(&[8, 4]));
    let y = mm2.matmul(a, b, f32s(&[4, 4]));
    mm2.set_outputs(vec![y]);
    let want = run_plain(&mm2, &[], &[("a", &qdq_host(&q, quant_params(-4.0, 4.0, true))), ("b", &qdq_host(&kt, quant_params(-1.0, 6.0, false)))]).remove(0);
    assert_eq!(bitpat(&got), bitpat(&want));
}

#[test]
fn bad_tables_are_errors_naming_the_file_the_tensor_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let g = common::matmul_2d(2, 8, 3);
    let err = |p: &str| Pipeline::parse(p).unwrap().apply(&g).map(|_| ()).unwrap_err().to_string();

    let e = err("staticquant");
    assert!(e.contains("needs table=PATH") && e.contains("opscope calibrate"), "{e}");

    let missing = dir.path().join("nope.json");
    let e = err(&format!("staticquant{{table={}}}", missing.display()));
    assert!(e.contains(&missing.display().to_string()) && e.contains("No such file"), "{e}");

    let trt = dir.path().join("table.cache");
    std::fs::write(&trt, "TRT-8601-EntropyCalibration2\nmatmul.0/lhs: 3c010204\n").unwrap();
    let e = err(&format!("staticquant{{table={}}}", trt.display()));
    assert!(e.contains("not a calibration table of `opscope calibrate`"), "{e}");

    let ort = dir.path().join("ort.json");
    std::fs::write(&ort, r#"{"CLS":"TensorsData","data":{"x":{"lowest":-1.0,"highest":1.0,"CLS":"TensorData"}}}"#).unwrap();
    let e = err(&format!("staticquant{{table={}}}", ort.display()));
    assert!(e.contains("no \"opscope\" object"), "{e}");

    // A table of another model: the site is named, with the closest the table holds.
    let other = write_table(dir.path(), &[entry("matmul.1", "lhs", uint8(0.1, 5)), entry("other/MatMul", "lhs", uint8(0.1, 5))]);
    let e = err(&format!("staticquant{{table={}}}", other.display()));
    assert!(e.contains("no entry for site 'matmul.0' role lhs") && e.contains("closest: matmul.1, other/MatMul"), "{e}");
    assert!(e.contains("sites=[..]"), "{e}");
    // ... and restricting the sites to what the table holds leaves the graph unchanged.
    let (out, m) = apply(&format!("staticquant{{table={},sites=[nothing]}}", other.display()), &g);
    assert!(m.actuations.is_empty() && out.len() == g.len());

    // A broken entry: zero scale, a zero point outside uint8.
    for (q, needle) in [(uint8(0.0, 5), "scale 0 is not a finite positive"), (uint8(0.1, 300), "zero point 300 is outside uint8 [0, 255]")] {
        let t = write_table(dir.path(), &[entry("matmul.0", "lhs", q)]);
        let e = err(&format!("staticquant{{table={}}}", t.display()));
        assert!(e.contains(needle) && e.contains("matmul.0/lhs"), "{e}");
    }
}

#[test]
fn options_round_trip_and_are_checked() {
    let p = Pipeline::parse("staticquant{ bmm=true, table=/tmp/t.json ,weights=int4}").unwrap();
    assert_eq!(p.to_string(), "staticquant{table=/tmp/t.json,weights=int4,bmm=true}");
    assert_eq!(Pipeline::parse(&p.to_string()).unwrap(), p);
    let e = Pipeline::parse("staticquant{weights=int2}").unwrap_err().to_string();
    assert!(e.contains("one of int8|int4|float"), "{e}");
    assert_eq!(opscope::pass::lookup("staticquant").unwrap().kind(), opscope::PassKind::Actuation);
}

/// A `DequantMatMul` over a packed GGUF Q8_0 weight (3 output rows of 32: an f16 scale of 1.0
/// and 32 int8 codes per row): its activation goes through the table's QDQ and its weight stays
/// packed, so the output equals the same graph run on the host's QDQ'd input, bit for bit.
#[test]
fn dequant_matmul_quantizes_its_activation_and_keeps_the_packed_weight() {
    let (m, k, n) = (4, 32, 3);
    let (g, packed) = common::q8_0_dequant_matmul(m, k, n);
    let run = |g: &Graph, x: &[f32]| common::run_packed(g, &packed, x);
    let xv: Vec<f32> = randn(m * k, 41).iter().map(|v| v * 2.0).collect();
    let q = quant_params(-1.5, 2.5, false);
    let dir = tempfile::tempdir().unwrap();
    let table = write_table(dir.path(), &[entry("matmul.0", "lhs", q)]);
    let (out, man) = apply(&format!("staticquant{{table={}}}", table.display()), &g);
    assert_eq!(man.actuations.len(), 1, "{:?}", man.skipped);
    assert!(man.actuations[0].action.contains("packed"), "{:?}", man.actuations[0].action);
    let want = run(&g, &qdq_host(&xv, q));
    assert_eq!(run(&out, &xv), want);
    assert_ne!(run(&g, &xv), want, "the quantization changes the output");
}
