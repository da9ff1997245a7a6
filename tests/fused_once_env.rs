//! The environment mode fuses a tapped compile once, as a scope does (`tests/fused_once.rs`):
//! its backend wrapper fuses the caller's graph with the compile's own options, appends the
//! sketches and plans that graph. One test in its own binary: `RLX_OPSCOPE` is read at the
//! first compile of the process and holds for it (set here with RLX's code-side override).

mod common;
use common::*;
use opscope::activate::compiles_fused_once;
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{CompileOptions, Device, Session};

#[test]
fn the_environment_mode_fuses_a_tapped_compile_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("env.csv");
    let _p = rlx_ir::env::scoped("RLX_OPSCOPE", "matmul");
    let _o = rlx_ir::env::scoped("RLX_OPSCOPE_OUT", out.display().to_string());

    // x[4, 8] -> matmul + bias -> gelu: one FusedMatMulBiasAct after RLX's CPU fusion.
    let (m, k, n) = (4usize, 8usize, 6usize);
    let mut g = Graph::new("env_once");
    let x = g.input("x", Shape::new(&[m, k], DType::F32));
    let w = g.param("w", Shape::new(&[k, n], DType::F32));
    let b = g.param("b", Shape::new(&[n], DType::F32));
    let y = g.matmul(x, w, Shape::new(&[m, n], DType::F32));
    let z = g.binary(BinaryOp::Add, y, b, Shape::new(&[m, n], DType::F32));
    let a = g.activation(Activation::Gelu, z, Shape::new(&[m, n], DType::F32));
    g.set_outputs(vec![a]);
    let (wv, bv, xv) = (randn(k * n, 1), randn(n, 2), randn(m * k, 3));

    let before = compiles_fused_once();
    let run = |options: &CompileOptions| {
        let mut c = Session::new(Device::Cpu).compile_with(g.clone(), options);
        c.set_param("w", &wv);
        c.set_param("b", &bv);
        c.run(&[("x", &xv)])
    };
    let once = run(&CompileOptions::new());
    assert_eq!(compiles_fused_once() - before, 1, "the tapped compile was fused once");
    // Any options: the wrapper fuses with the compile's own.
    let mut other = CompileOptions::new();
    other.disable_conv_bias_act_fusion = true;
    let again = run(&other);
    assert_eq!(compiles_fused_once() - before, 2);
    assert_eq!(bits(&once), bits(&again));
    // The caller's output is the graph's: gelu(x @ w + b), within f32 rounding of the host's.
    assert_eq!(once.len(), 1, "tap outputs stripped");
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k).map(|l| xv[i * k + l] as f64 * wv[l * n + j] as f64).sum::<f64>() + bv[j] as f64;
            let gelu = 0.5 * s * (1.0 + libm_erf(s / std::f64::consts::SQRT_2));
            assert!((once[0][i * n + j] as f64 - gelu).abs() < 1e-3, "({i},{j}): {} vs {gelu}", once[0][i * n + j]);
        }
    }
    // Both compiles recorded: the activation's element count and largest value, per compile.
    opscope::activate::env::finish().unwrap();
    let rows: Vec<opscope::Row> = csv::Reader::from_path(&out).unwrap().deserialize().collect::<Result<_, _>>().unwrap();
    let lhs = |stat: &str| -> Vec<f32> { rows.iter().filter(|r| &*r.role == "lhs" && &*r.stat == stat).map(|r| r.value).collect() };
    assert_eq!(lhs("count"), vec![(m * k) as f32; 2]);
    let max = xv.iter().copied().fold(f32::MIN, f32::max);
    assert_eq!(lhs("max"), vec![max; 2]);
}

/// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), for the host GELU.
fn libm_erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * (-x * x).exp();
    y.copysign(x)
}
