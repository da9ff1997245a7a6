//! `opscope_lab::parity` finds the node RLX computes wrong, without being told where it is.

#[path = "../../tests/common/mod.rs"]
mod common;
use common::*;

use opscope_lab::parity::{check, check_with, render, Check, ParityInput, Search, Tolerance, Typed};
use rlx_ir::DType;

fn typed(v: &[f32]) -> Typed {
    (v.iter().flat_map(|x| x.to_le_bytes()).collect(), DType::F32)
}

fn qkv_input(b: usize, s: usize) -> ParityInput {
    let (h, d) = (2usize, 4usize);
    let e = h * d;
    let ws: Vec<f32> = randn(e * 3 * e, 41).iter().map(|v| v * 0.7).collect();
    // Keys of sequence 1 from s - 3 on are padding.
    let mask: Vec<f32> = (0..b * s).map(|i| if i / s == 1 && i % s >= s - 3 { 0.0 } else { 1.0 }).collect();
    ParityInput {
        graph: qkv_attention_graph(b, s, h, d),
        params: vec![("w_qkv".into(), typed(&ws)), ("w_o".into(), typed(&randn(e * e, 42)))],
        inputs: vec![("x".into(), typed(&randn(b * s * e, 40))), ("mask".into(), typed(&mask))],
        options: rlx_runtime::CompileOptions::new(),
        device: rlx_runtime::Device::Cpu,
    }
}

#[test]
fn parity_localizes_rlx_in_place_qkv_attention_miscompile_to_the_attention_node() {
    // 2 x 40 tokens: RLX 0.2.19 reuses the QKV buffer while its fused attention still reads it.
    let linear = Check { search: Search::Linear, ..Check::new(Tolerance::default()) };
    let r = check_with(&qkv_input(2, 40), &linear).unwrap();
    println!("{}", render(&r));
    assert!(!r.outputs_agree(), "RLX fixed its in-place QKV attention: pick another known miscompile");
    let first = r.first_divergent.as_ref().expect("a divergent node");
    assert!(first.op.to_lowercase().contains("attention"), "first divergent node is {first:?}");
    // Everything before it agrees with the op-by-op reference, to a few ULPs.
    let before = &r.scanned[..r.scanned.len() - 1];
    assert!(!before.is_empty(), "the projection was scanned first");
    assert!(before.iter().all(|c| !c.diverges && c.max_ulps.unwrap() <= 64), "{before:?}");
    assert!(first.max_abs > 1.0, "off by far more than rounding: {first:?}");
}

#[test]
fn bisection_finds_the_same_attention_node_and_checks_its_operands() {
    let input = qkv_input(2, 40);
    let linear = check_with(&input, &Check { search: Search::Linear, ..Check::new(Tolerance::default()) }).unwrap();
    let r = check(&input, Tolerance::default()).unwrap();
    println!("{}", render(&r));
    assert_eq!(r.search, Search::Bisect);
    let found = r.first_divergent.as_ref().expect("a divergent node");
    let first = linear.first_divergent.as_ref().unwrap();
    assert_eq!(found.node, first.node, "bisection {found:?} vs linear scan {first:?}");
    // The node's operands were compared (the check that ends the search) and agree.
    let deployed = opscope::activate::fuse(&input.graph, rlx_runtime::Device::Cpu, &input.options);
    for op in &deployed.node(rlx_ir::NodeId(found.node)).inputs {
        if matches!(deployed.node(*op).op, rlx_ir::Op::Input { .. } | rlx_ir::Op::Param { .. }) {
            continue;
        }
        let c = r.scanned.iter().find(|c| c.node == op.0).unwrap_or_else(|| panic!("operand %{} not compared", op.0));
        assert!(!c.diverges, "{c:?}");
    }
    assert!(r.scanned.len() <= linear.scanned.len(), "bisection compared {} nodes, the scan {}", r.scanned.len(), linear.scanned.len());
}

#[test]
fn a_tap_pipeline_leaves_every_value_and_an_actuation_is_localized_to_its_first_matmul() {
    // Tapped against untapped: the sketches read the program's tensors and change nothing.
    let input = qkv_input(2, 8);
    let pipeline = |p: &str| Check { pipeline: Some(p.parse().unwrap()), ..Check::new(Tolerance::default()) };
    let r = check_with(&input, &pipeline("matmul,attn")).unwrap();
    println!("{}", render(&r));
    assert!(r.outputs_agree(), "{}", render(&r));
    assert!(r.outputs.iter().all(|c| c.max_ulps == Some(0)), "{:?}", r.outputs);
    // An int4 fake-quant of every matmul input: the search ends at the projection that reads
    // the first quantized activation (its operands are the input and the weight).
    let r = check_with(&input, &pipeline("fakequant{bits=4}")).unwrap();
    println!("{}", render(&r));
    assert!(!r.outputs_agree());
    let found = r.first_divergent.as_ref().expect("a divergent node");
    let deployed = opscope::activate::fuse(&input.graph, rlx_runtime::Device::Cpu, &input.options);
    let first_matmul = deployed
        .nodes()
        .iter()
        .find(|n| n.op.to_string().to_lowercase().contains("matmul"))
        .unwrap();
    assert_eq!(found.node, first_matmul.id.0, "{found:?}");
    // A pipeline that does not parse is refused before anything runs.
    assert!("fakequant{bits=99}".parse::<opscope::Pipeline>().is_err());
}

#[test]
fn parity_holds_where_rlx_computes_the_same_program_right() {
    // 2 x 8 tokens: the whole block is one kernel and agrees with the op-by-op reference.
    let r = check(&qkv_input(2, 8), Tolerance::default()).unwrap();
    println!("{}", render(&r));
    assert!(r.outputs_agree(), "{}", render(&r));
    assert!(r.scanned.is_empty() && r.first_divergent.is_none());
    assert!(r.outputs[0].max_abs < 1e-4 && r.outputs[0].ref_absmax > 0.1, "{:?}", r.outputs[0]);
}

#[test]
fn a_missing_input_is_an_error_naming_it() {
    let mut input = qkv_input(2, 8);
    input.inputs.retain(|(n, _)| n != "mask");
    let e = check(&input, Tolerance::default()).unwrap_err();
    assert!(format!("{e:#}").contains("'mask'"), "{e:#}");
}

#[test]
fn opscope_parity_on_minilm_agrees_with_its_op_by_op_reference() {
    // Every fused kernel RLX runs for MiniLM reproduces the same ops run one at a time; the
    // JSON lists each caller output with its distances.
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_opscope"))
        .args(["parity", "--json", "--batch", "2", "--seq", "16"])
        .args(a.cli_args())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["deployed_nodes"].as_u64().unwrap() > 100, "{v}");
    let outputs = v["outputs"].as_array().unwrap();
    let embedding = outputs.iter().find(|o| o["numel"] == 2 * 384).expect("the [2,384] sentence embedding");
    assert!(embedding["ref_absmax"].as_f64().unwrap() > 0.1, "{embedding}");
    for o in outputs {
        assert_eq!(o["diverges"], false, "{o}");
        assert!(o["max_abs"].as_f64().unwrap() <= 1e-4 * o["ref_absmax"].as_f64().unwrap() + 1e-6, "{o}");
    }
    assert!(v["scanned"].as_array().unwrap().is_empty() && v["first_divergent"].is_null());

    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_opscope"))
        .args(["parity", "--rtol=nan", "--onnx", "x", "--tokenizer", "y", "--text", "z"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--rtol"), "{}", String::from_utf8_lossy(&bad.stderr));
}
