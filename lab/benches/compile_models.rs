//! Compile cost of the tap on the real models: `Session::compile_with` of MiniLM-L3 (ONNX,
//! batch 8 x 64 tokens, as `record` compiles it) and of SmolLM2-135M's prefill graph (GGUF,
//! packed 4-bit projections, 1 x 64 tokens) inside a recording scope, over the same compile
//! without one. `benches/compile.rs` measures the chain MLP, whose untapped compile at 16
//! layers is so small (0.4 ms) that the tap pass alone is most of it; this bench prices the
//! same tap where users run it.
//!
//! Each model's graph is built once (import or GGUF read, outside the timer). Compiles run in
//! interleaved pairs after one warm-up pair, the order swapped every pair, so both see the
//! same machine state; only `compile_with` is timed (the graph's clone and the weights'
//! binding are not). Each tapped compile is then bound and run once on real text, untimed, so
//! the scope records what it compiled (a scope whose tapped graph never ran warns). Printed
//! per model and pipeline: the median untapped and tapped compile, the ratio of medians, the
//! 25th-75th percentile of the per-pair ratios, the matmul sites tapped and the extra
//! microseconds per site.
//!
//! Goal (issue 13): tapped / untapped <= 1.5x. `cargo bench -p opscope-lab --bench
//! compile_models` (needs scripts/fetch-assets.sh's assets); `-- --quick` for 3 pairs a cell
//! instead of 9.

use std::time::{Duration, Instant};

#[path = "../../benches/common/mod.rs"]
#[allow(dead_code)]
mod shared;

use opscope::Pipeline;
use opscope_lab::llama::job::LlamaJob;
use opscope_lab::model::{compile_options, split_entries, MiniLmAssets, OnnxEncoder, TextEncoder};
use rlx_ir::Graph;
use rlx_runtime::{CompiledGraph, Device, Session};
use shared::quantile;

/// A model to compile: its graph, and how to bind and run a compile of it once.
struct Model {
    name: String,
    graph: Graph,
    bind_and_run: Box<dyn Fn(&mut CompiledGraph)>,
}

fn models(a: &MiniLmAssets, entries: &[String]) -> Vec<Model> {
    let (batch, seq) = (8, 64);
    let enc = OnnxEncoder::load(&a.onnx, batch, seq).expect("MiniLM imports");
    let text = TextEncoder::load(&a.tokenizer, seq).expect("tokenizer").encode(&entries[..batch]).expect("encode");
    let graph = enc.graph.clone();
    let minilm = Model {
        name: format!("MiniLM-L3 [{batch}, {seq}]"),
        graph,
        bind_and_run: Box::new(move |c| {
            enc.bind(c).expect("bind MiniLM");
            std::hint::black_box(enc.run(c, &text).expect("run MiniLM"));
        }),
    };
    let gguf = a.text.parent().expect("cache dir").join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let job = LlamaJob::new(&gguf, entries, 1, seq, 0).expect("SmolLM2 loads (scripts/fetch-assets.sh)");
    let graph = job.graph();
    let g = graph.clone();
    let smollm = Model {
        name: format!("SmolLM2-135M prefill [1, {seq}]"),
        graph,
        bind_and_run: Box::new(move |c| {
            job.model.bind(c, &g);
            std::hint::black_box(job.prefill(c, &job.seqs[..1], false).expect("run SmolLM2"));
        }),
    };
    vec![minilm, smollm]
}

/// One compile of `m`, timed; tapped (inside a scope recording `p` to an in-memory sink) it is
/// bound and run once afterwards. Returns the compile time and the sites the scope tapped.
fn compile(m: &Model, p: Option<&Pipeline>) -> (Duration, usize) {
    let session = Session::new(Device::Cpu);
    let once = |run: bool| {
        let g = m.graph.clone();
        let t = Instant::now();
        let mut c = session.compile_with(g, &compile_options());
        let took = t.elapsed();
        if run {
            (m.bind_and_run)(&mut c);
        }
        took
    };
    match p {
        None => (once(false), 0),
        Some(p) => {
            let sink = opscope::recording::MemorySink::default();
            let before = opscope::activate::compiles_fused_once();
            let (took, summary) = opscope::Scope::new(p, Box::new(sink.clone())).run(|| once(true));
            summary.expect("recording");
            // The scope's compile plans the tap's fused graph (RLX fuses the model once).
            assert_eq!(opscope::activate::compiles_fused_once() - before, 1, "{}: the tapped compile is fused once", m.name);
            let sites = sink.manifests().first().map_or(0, |mf| mf.sites.len());
            (took, sites)
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let pairs = if quick { 3 } else { 9 };
    let a = MiniLmAssets::from_cache().expect("MiniLM assets (scripts/fetch-assets.sh)");
    let entries: Vec<String> = split_entries(&std::fs::read_to_string(&a.text).expect("text")).into_iter().take(64).collect();
    let models = models(&a, &entries);
    let pipelines = ["matmul", "matmul{stats=[max]}"];
    println!("compile tapped/untapped on the real models, {pairs} interleaved pairs after 1 warm-up pair");
    println!("| model | pipeline | sites | untapped (median) | tapped (median) | ratio of medians | per-pair ratio: median, 25-75% | extra us per site |");
    println!("|---|---|---|---|---|---|---|---|");
    for m in &models {
        for text in pipelines {
            let p = Pipeline::parse(text).expect("pipeline");
            let (mut a, mut b, mut r, mut sites) = (Vec::new(), Vec::new(), Vec::new(), 0);
            for i in 0..pairs + 1 {
                let (ta, tb);
                if i % 2 == 0 {
                    ta = compile(m, None).0;
                    (tb, sites) = compile(m, Some(&p));
                } else {
                    (tb, sites) = compile(m, Some(&p));
                    ta = compile(m, None).0;
                }
                if i >= 1 {
                    a.push(ta.as_secs_f64());
                    b.push(tb.as_secs_f64());
                    r.push(tb.as_secs_f64() / ta.as_secs_f64());
                }
            }
            let (ma, mb) = (quantile(&a, 0.5), quantile(&b, 0.5));
            println!(
                "| {} | {text} | {sites} | {:.1} ms | {:.1} ms | {:.2}x | {:.2}x, {:.2}-{:.2}x | {:.0} |",
                m.name,
                ma * 1e3,
                mb * 1e3,
                mb / ma,
                quantile(&r, 0.5),
                quantile(&r, 0.25),
                quantile(&r, 0.75),
                (mb - ma) * 1e6 / sites.max(1) as f64
            );
        }
    }
}
