use rlx_onnx_import::{build_hir_from_onnx_file, ImportOptions};
use rlx_runtime::*;
use std::collections::HashMap;
fn main() {
    let path = std::path::Path::new("/root/.cache/opscope/paraphrase-MiniLM-L3-v2.onnx");
    let mut opts = ImportOptions::default();
    opts.sequence_length = 16;
    opts.named_lengths = HashMap::from([("batch_size".to_string(), 2usize)]);
    let (hir, params, _rep, _man) = build_hir_from_onnx_file(path, opts).unwrap();
    let g = hir.lower_to_mir().unwrap().into_graph();
    println!("nodes {} outputs {:?} params {}", g.len(), g.outputs.len(), params.len());
    for n in g.nodes() {
        let s = format!("{}", n.op);
        if s.contains("matmul") || s.contains("softmax") || matches!(n.op, rlx_ir::Op::Input{..}) || g.outputs.contains(&n.id) {
            println!("PRE {:?} {} {:?} name={:?} inputs={:?}", n.id, n.op, n.shape, n.name, n.inputs);
        }
    }
    let o = CompileOptions::default();
    let fused = rlx_runtime::stages::pipeline_for(Device::Cpu, &o).optimize(rlx_ir::MirModule::from_graph(g.clone())).into_graph();
    for n in fused.nodes().iter().take(75) {
        if matches!(n.op, rlx_ir::Op::Param{..}) && !format!("{}", n.op).contains("layer.0") { continue; }
        println!("F {:?} {} {:?} inputs={:?}", n.id, n.op, rlx_opscope_shape(&n.shape), n.inputs);
    }
}
fn rlx_opscope_shape(s: &rlx_ir::Shape) -> Vec<String> { s.dims().iter().map(|d| format!("{:?}", d)).collect() }
