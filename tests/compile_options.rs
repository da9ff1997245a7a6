//! Passes enabled from `CompileOptions` (RLX patched with
//! `upstream/rlx-compile-options-ir-passes.patch`, opscope built with `rlx-ir-pass-list`): the
//! entry `opscope:<actuation pipeline>` of `CompileOptions::ir_passes` runs that actuation in
//! that compile only, as applying the pipeline to the graph by hand does, bit for bit; a compile
//! without the entry is untouched; a bad entry stops the compile with the reason.
//!
//! Run: see the README section "Enabling passes from CompileOptions".
#![cfg(feature = "rlx-ir-pass-list")]

mod common;
use common::*;
use opscope::Pipeline;
use rlx_runtime::{CompileOptions, Device, Session};

fn run_with(g: &rlx_ir::Graph, options: &CompileOptions, w: &[f32], x: &[f32]) -> Vec<Vec<f32>> {
    let mut c = Session::new(Device::Cpu).compile_with(g.clone(), options);
    c.set_param("w", w);
    c.run(&[("x", x)])
}

#[test]
fn a_listed_actuation_runs_in_that_compile_only() {
    let (m, k, n) = (8, 32, 16);
    let g = matmul_2d(m, k, n);
    let x = randn(m * k, 3);
    let w = randn(k * n, 4);
    let text = "fakequant{bits=4}";
    let listed = run_with(&g, &CompileOptions::new().with_ir_passes([format!("opscope:{text}")]), &w, &x);
    let plain = run_with(&g, &CompileOptions::new(), &w, &x);
    // The reference: the pipeline applied to the graph by hand, compiled plainly.
    let (by_hand, _) = Pipeline::parse(text).unwrap().apply(&g).unwrap();
    let reference = run_with(&by_hand, &CompileOptions::new(), &w, &x);
    assert_eq!(bits(&listed), bits(&reference), "listed pass = pipeline applied by hand");
    assert_ne!(bits(&listed), bits(&plain), "int4 fake-quant changes the output");
    // The compile after it, without the entry, is untouched.
    assert_eq!(bits(&run_with(&g, &CompileOptions::new(), &w, &x)), bits(&plain));
}

#[test]
#[should_panic(expected = "no IR pass named 'opscop' is registered (registered: opscope)")]
fn an_unknown_pass_name_stops_the_compile_with_the_registered_names() {
    let g = matmul_2d(2, 4, 3);
    let _ = Session::new(Device::Cpu).compile_with(g, &CompileOptions::new().with_ir_passes(["opscop:fakequant"]));
}

#[test]
#[should_panic(expected = "holds a tap")]
fn a_tap_in_the_pass_list_is_refused() {
    let g = matmul_2d(2, 4, 3);
    let _ = Session::new(Device::Cpu).compile_with(g, &CompileOptions::new().with_ir_passes(["opscope:matmul"]));
}
