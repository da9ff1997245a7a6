//! A deployed-stage tap fuses the caller's graph once: the tap fuses it to find the program that
//! runs, appends its sketches, and opscope's CPU backend wrapper plans that graph without running
//! RLX's fusion pipeline over it again (`opscope::activate::compiles_fused_once`). Checked here:
//! - a `matmul` tap in a scope takes that path (the count moves by one per compile), the
//!   caller's outputs are bit-identical to the untapped run's, and every recorded row equals,
//!   bit for bit, the row the same tap records when the compile fuses twice (a compile whose
//!   options differ from the tap's in a setting the fusion pipeline reads and this graph does
//!   not use, so the wrapper declines the plan);
//! - a `source`-stage tap, a graph with a symbolic dim, a compile asking for RLX's fusion
//!   diagnostics (`assert_fusion_clean` panics on the tapped compile as on the untapped one) and
//!   an actuation are fused by RLX as any graph is (the count stays);
//! - a mark whose compile panicked (caught) is forgotten when the scope ends;
//! - a tap that adds the attention mask's F32 cast and a `[B, S, C]` view of a flattened
//!   activation is fused once too, and records the same rows as fused twice.
//!
//! One test function: the count is process-wide, and tests of one binary run on parallel
//! threads.

mod common;
use common::*;
use opscope::activate::{compiles_fused_once, Stage};
use opscope::{MemorySink, Pipeline, Scope};
use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Dim, Graph, Shape};
use rlx_runtime::{CompileOptions, Device, Session};

/// x[B,S,D] -> (matmul [D,D] + bias -> gelu) x L: RLX's CPU fusion makes each layer one
/// `FusedMatMulBiasAct`, so the fused program differs from the source graph.
fn mlp(b: usize, s: usize, d: usize, layers: usize) -> Graph {
    let mut g = Graph::new("mlp");
    let sh = Shape::new(&[b, s, d], DType::F32);
    let mut h = g.input("x", sh.clone());
    for l in 0..layers {
        let w = g.param(format!("w{l}"), Shape::new(&[d, d], DType::F32));
        let bias = g.param(format!("b{l}"), Shape::new(&[d], DType::F32));
        let m = g.matmul(h, w, sh.clone());
        let a = g.binary(BinaryOp::Add, m, bias, sh.clone());
        h = g.activation(Activation::Gelu, a, sh.clone());
    }
    g.set_outputs(vec![h]);
    g
}

/// Compile `g` with `options` inside a scope of `pipeline` at `stage`, bind its params, run it
/// on each input: the outputs, the rows recorded, and how many compiles were fused once.
fn record(pipeline: &str, stage: Stage, options: &CompileOptions, g: &Graph, params: &[(String, Vec<f32>)], xs: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<opscope::Row>, u64) {
    let p = Pipeline::parse(pipeline).unwrap();
    let sink = MemorySink::default();
    let before = compiles_fused_once();
    let (outs, summary) = Scope::new(&p, Box::new(sink.clone())).stage(stage).run(|| {
        let mut c = Session::new(Device::Cpu).compile_with(g.clone(), options);
        for (n, v) in params {
            c.set_param(n, v);
        }
        xs.iter().flat_map(|x| c.run(&[("x", x)])).collect::<Vec<_>>()
    });
    let summary = summary.unwrap();
    assert!(summary.warnings.is_empty(), "{:?}", summary.warnings);
    (outs, sink.rows(), compiles_fused_once() - before)
}

/// (site, role, stat, idx, step, value bits) of every row, in recording order.
fn keyed(rows: &[opscope::Row]) -> Vec<(String, String, String, u64, u64, u32)> {
    rows.iter().map(|r| (r.site.to_string(), r.role.to_string(), r.stat.to_string(), r.idx, r.step, r.value.to_bits())).collect()
}

#[test]
fn a_deployed_tap_is_fused_once_and_records_what_a_second_fusion_records() {
    let (b, s, d, layers) = (2, 5, 16, 3);
    let g = mlp(b, s, d, layers);
    let params: Vec<(String, Vec<f32>)> = (0..layers)
        .flat_map(|l| {
            let w = randn(d * d, 10 + l as u64).iter().map(|v| v / (d as f32).sqrt()).collect();
            [(format!("w{l}"), w), (format!("b{l}"), randn(d, 20 + l as u64))]
        })
        .collect();
    let xs: Vec<Vec<f32>> = (0..3).map(|i| randn(b * s * d, 30 + i)).collect();
    let pr: Vec<(&str, &[f32])> = params.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    let plain: Vec<Vec<f32>> = xs.iter().flat_map(|x| run_plain(&g, &pr, &[("x", x)])).collect();

    // `Session::compile_with(CompileOptions::new())` fuses as the scope's tap does: fused once.
    let (outs, once, n) = record("matmul", Stage::Deployed, &CompileOptions::new(), &g, &params, &xs);
    assert_eq!(n, 1, "the tapped compile was fused once");
    assert_eq!(bits(&outs), bits(&plain), "the caller's outputs are bit-identical");
    let sites: std::collections::BTreeSet<String> = once.iter().map(|r| r.site.to_string()).collect();
    assert_eq!(sites.len(), layers, "one matmul site a layer: {sites:?}");

    // A setting the fusion pipeline reads (and this graph, with no convolution, does not use):
    // the wrapper cannot vouch that the tap's fusion is the compile's, so RLX fuses again.
    let mut twice = CompileOptions::new();
    twice.disable_conv_bias_act_fusion = true;
    let (outs2, fused_twice, n2) = record("matmul", Stage::Deployed, &twice, &g, &params, &xs);
    assert_eq!(n2, 0, "options that fuse otherwise than the tap's: fused twice");
    assert_eq!(bits(&outs2), bits(&plain));
    assert_eq!(keyed(&once), keyed(&fused_twice), "every row, bit for bit");
    assert!(once.len() > 100, "{} rows", once.len());

    // The source stage taps the graph before fusion: RLX must fuse it.
    let (outs3, rows3, n3) = record("matmul", Stage::Source, &CompileOptions::new(), &g, &params, &xs);
    assert_eq!(n3, 0, "a source-stage tap is fused by RLX");
    assert!(!rows3.is_empty());
    assert_eq!(outs3.len(), plain.len());

    // A symbolic batch: `Session::compile` defers the compile to the first run, which binds the
    // dims and must fuse the bound graph (RLX decides some fusions by shape).
    let mut sg = Graph::new("symbolic");
    let x = sg.input("x", Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(d)], DType::F32));
    let w = sg.param("w0", Shape::new(&[d, d], DType::F32));
    let y = sg.matmul(x, w, Shape::from_dims(&[Dim::Dynamic(0), Dim::Static(d)], DType::F32));
    sg.set_outputs(vec![y]);
    let w0 = vec![params[0].clone()];
    let (outs5, rows5, n5) = record("matmul", Stage::Deployed, &CompileOptions::new(), &sg, &w0, &xs);
    assert_eq!(n5, 0, "a graph with a symbolic dim is fused by RLX when its dims are bound");
    assert!(!rows5.is_empty());
    let plain5: Vec<Vec<f32>> = xs.iter().flat_map(|x| run_plain(&sg, &[("w0", &params[0].1)], &[("x", x)])).collect();
    assert_eq!(bits(&outs5), bits(&plain5));

    // A compile asking for RLX's fusion diagnostics is fused again, so that they run on it: the
    // fusion contract of `assert_fusion_clean` panics on the tapped compile as on the untapped
    // one (the chain MLP's matmul -> relu leaves fusions RLX reports as missed).
    let (chain, _) = chain_mlp(4, 16, 2);
    let mut strict = CompileOptions::new();
    strict.assert_fusion_clean = true;
    let compile_strict = |g: &Graph| {
        let g = g.clone();
        let strict = strict.clone();
        std::panic::catch_unwind(move || drop(Session::new(Device::Cpu).compile_with(g, &strict))).is_err()
    };
    let before = compiles_fused_once();
    let plain_panics = compile_strict(&chain);
    let p = Pipeline::parse("matmul").unwrap();
    let (tapped_panics, _) = Scope::new(&p, Box::new(MemorySink::default())).run(|| compile_strict(&chain));
    assert_eq!(tapped_panics, plain_panics, "the tapped compile keeps the untapped one's fusion contract");
    assert!(plain_panics, "the fixture must miss a fusion for this check to mean anything");
    let mut report = CompileOptions::new();
    report.fusion_report = true;
    let (_, _, n_report) = record("matmul", Stage::Deployed, &report, &g, &params, &xs);
    assert_eq!((n_report, compiles_fused_once() - before), (0, 0), "fusion diagnostics: fused again");

    // A graph marked fused whose compile panicked (and the panic was caught) is forgotten when
    // the scope ends: a compile after the scope of the same tapped graph is fused by RLX.
    let (tapped_g, _) = opscope::activate::rewrite(&p, &g, Stage::Deployed, &CompileOptions::new(), 0).unwrap();
    let before = compiles_fused_once();
    // RLX 0.2.19 has no f64 kernel for a custom op: the compile panics after the tap marked it.
    let mut f64_format = CompileOptions::new();
    f64_format.number_format = Some(rlx_ir::NumberFormat::F64);
    let (caught, _) = Scope::new(&p, Box::new(MemorySink::default())).run(|| {
        let g = g.clone();
        std::panic::catch_unwind(move || drop(Session::new(Device::Cpu).compile_with(g, &f64_format))).is_err()
    });
    assert!(caught, "the f64 compile of a tapped graph panics in RLX 0.2.19");
    drop(Session::new(Device::Cpu).compile(tapped_g.clone()));
    assert_eq!(compiles_fused_once() - before, 0, "no stale mark after the scope");

    // A model with an `attention_mask` input (the Hugging Face name; I64 as exported) and a
    // flattened [B*S, D] activation: the matmul tap adds the mask's F32 cast and a [B, S, D]
    // view of the activation, both standard ops the CPU runs as they are. Fused once, and every
    // row the same as fused twice.
    let mut mg = Graph::new("masked");
    let x = mg.input("x", Shape::new(&[b * s, d], DType::F32));
    let mask = mg.input("attention_mask", Shape::new(&[b, s], DType::I64));
    let w = mg.param("w0", Shape::new(&[d, d], DType::F32));
    let y = mg.matmul(x, w, Shape::new(&[b * s, d], DType::F32));
    let m = mg.add_node(rlx_ir::Op::Cast { to: DType::F32 }, vec![mask], Shape::new(&[b, s], DType::F32));
    let m = mg.reshape(m, vec![(b * s) as i64, 1], Shape::new(&[b * s, 1], DType::F32));
    let z = mg.binary(BinaryOp::Mul, y, m, Shape::new(&[b * s, d], DType::F32));
    mg.set_outputs(vec![z]);
    let mask_v: Vec<i64> = (0..b * s).map(|i| i64::from(i % s < 3)).collect();
    let masked = |options: &CompileOptions| {
        let p = Pipeline::parse("matmul").unwrap();
        let sink = MemorySink::default();
        let before = compiles_fused_once();
        let (outs, summary) = Scope::new(&p, Box::new(sink.clone())).run(|| {
            let mut c = Session::new(Device::Cpu).compile_with(mg.clone(), options);
            c.set_param("w0", &params[0].1);
            xs.iter()
                .flat_map(|x| {
                    let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                    let mask_bytes: Vec<u8> = mask_v.iter().flat_map(|v| v.to_le_bytes()).collect();
                    c.run_typed(&[("x", &x_bytes, DType::F32), ("attention_mask", &mask_bytes, DType::I64)])
                })
                .collect::<Vec<_>>()
        });
        assert!(summary.unwrap().warnings.is_empty());
        (outs, sink, compiles_fused_once() - before)
    };
    let (tapped_mg, _) = opscope::activate::rewrite(&Pipeline::parse("matmul").unwrap(), &mg, Stage::Deployed, &CompileOptions::new(), 0).unwrap();
    let named = |prefix: &str| tapped_mg.nodes().iter().filter(|n| n.name.as_deref().is_some_and(|x| x.starts_with(prefix))).count();
    assert_eq!((named(opscope::rewrite::MASK_CAST), named(opscope::rewrite::SEQ_VIEW)), (1, 2), "the mask's cast, a view of lhs and of out");
    let (o_once, s_once, n_once) = masked(&CompileOptions::new());
    let (o_twice, s_twice, n_twice) = masked(&twice);
    let m0 = &s_once.manifests()[0];
    assert!(m0.padding.is_some(), "the tap found the mask: {m0:?}");
    assert_eq!((n_once, n_twice), (1, 0), "a tap with the mask's cast and the sequence view is fused once");
    assert_eq!(o_once, o_twice);
    assert_eq!(keyed(&s_once.rows()), keyed(&s_twice.rows()), "every row, bit for bit");

    // An actuation changes the program: RLX fuses what it made.
    let (_, rows4, n4) = record("fakequant,matmul", Stage::Deployed, &CompileOptions::new(), &g, &params, &xs);
    assert_eq!(n4, 0, "an actuated graph is fused by RLX");
    assert!(!rows4.is_empty());
}
