//! The recorder alone, on MiniLM's real sketches: how many recorded values per second its writer
//! thread decodes and writes to a Parquet dataset on disk, how many bytes each value costs on
//! disk, and whether its memory stays bounded as the run count grows.
//!
//! Setup: MiniLM-L3 (batch 8, 64 tokens), its deployed graph rewritten by `matmul` (the full
//! sketch set) and compiled as a plain program (no scope), run on 16 batches of the fortunes;
//! each run's appended outputs (the sketches, as the backend computed them) are kept. Then a
//! fresh `opscope::record::Recorder` with the Parquet sink is handed those outputs for N runs
//! (cycling over the 16 batches, each a clone as a tapped run hands them over) and finished
//! (footer written, part closed and renamed). Timed: first `record` to the end of `finish`.
//! Values: the rows the recording holds, counted by reading it back (a weight's sketch is written
//! again only when it changes, so a run records fewer rows than its outputs hold). Heap: peak
//! bytes allocated above the start, for N and 4N runs (bounded: the same).
//!
//! The same sketches scaled by 1e-10 and by 1e25 are recorded too (100 runs each): the writer's
//! cost must not depend on the values' magnitude.
//!
//! Goal (issue 13): >= 20 M values/s, <= 4 bytes per value on disk, memory bounded in N.
//! `cargo bench -p opscope-lab --bench recorder` (needs scripts/fetch-assets.sh's assets).

use std::time::Instant;

mod common;

use common::dir_bytes;

use opscope::activate::{rewrite_on, Stage};
use opscope::record::Recorder;
use opscope::Pipeline;
use peak_alloc::PeakAlloc;
use rlx_runtime::{CompileOptions, DType, Device, Session};

#[global_allocator]
static PEAK: PeakAlloc = PeakAlloc;

fn main() {
    let a = match opscope_lab::model::MiniLmAssets::from_cache() {
        Ok(a) => a,
        Err(e) => {
            println!("MiniLM skipped: {e}");
            return;
        }
    };
    let (batch, seq, batches) = (8usize, 64usize, 16usize);
    let entries = opscope_lab::model::split_entries(&std::fs::read_to_string(&a.text).unwrap());
    let enc = opscope_lab::model::TextEncoder::load(&a.tokenizer, seq).unwrap();
    let mut model = opscope_lab::model::OnnxEncoder::load(&a.onnx, batch, seq).unwrap();
    let encoded: Vec<_> = entries.chunks(batch).take(batches).map(|c| enc.encode(c).unwrap()).collect();

    // The sketches as a tapped run produces them: the rewritten graph, compiled without a scope
    // (its appended outputs come back as ordinary outputs), tag 1 as the recorder hands out first.
    let pipeline = Pipeline::parse("matmul").unwrap();
    let probe = Recorder::new(Box::new(opscope::MemorySink::default()), "probe".into());
    let tag = probe.next_tag();
    drop(probe);
    let (tapped, manifest) =
        rewrite_on(&pipeline, &model.graph, Stage::Deployed, Device::Cpu, &CompileOptions::default(), tag).expect("rewrite");
    let extra = manifest.outputs.iter().filter(|o| o.output_index.is_some()).count();
    model.graph = tapped;
    let session = Session::new(Device::Cpu);
    let mut compiled = model.compile(&session).expect("compile");
    let runs: Vec<Vec<Vec<f32>>> = encoded
        .iter()
        .map(|b| {
            let outs = model.run(&mut compiled, b).unwrap();
            outs[outs.len() - extra..]
                .iter()
                .map(|(bytes, dt)| {
                    assert_eq!(*dt, DType::F32, "sketch outputs are f32");
                    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                })
                .collect()
        })
        .collect();
    let per_run: usize = runs[0].iter().map(Vec::len).sum();
    println!("MiniLM-L3 {batch}x{seq}, `matmul` full set: {} sites' outputs, {per_run} values per run", extra);
    println!("{:>6} {:>6} | {:>10} {:>12} | {:>9} | {:>12} | {:>9}", "scale", "runs", "rows", "M rows/s", "B/row", "peak heap MB", "seconds");

    let dir = tempfile::tempdir().unwrap();
    // The real sketches, then the same scaled by 1e-10 and 1e25 (values of other magnitudes:
    // the encoder and Snappy must cost the same; subnormal and huge values included).
    for (scale, n) in [(1.0f32, 100usize), (1.0, 400), (1e-10, 100), (1e25, 100)] {
        // Element 0 of each output is the compile's tag, which the recorder checks: kept.
        let runs: Vec<Vec<Vec<f32>>> = runs
            .iter()
            .map(|r| r.iter().map(|v| v.iter().enumerate().map(|(i, x)| if i == 0 { *x } else { x * scale }).collect()).collect())
            .collect();
        let out = dir.path().join(format!("rec{n}_{scale:e}.parquet"));
        let sink = opscope::recording::open(&out).expect("parquet sink");
        let rec = Recorder::new(sink, format!("bench-{n}"));
        let m = rec.register(manifest.clone());
        PEAK.reset_peak_usage();
        let base = PEAK.current_usage();
        let t = Instant::now();
        for i in 0..n {
            rec.record(&m, runs[i % runs.len()].clone());
        }
        rec.finish().expect("finish");
        let secs = t.elapsed().as_secs_f64();
        let heap = PEAK.peak_usage().saturating_sub(base) as f64 / (1024.0 * 1024.0);
        let mut rows = 0u64;
        opscope::recording::read_rows(&out, |_| rows += 1).expect("read back");
        let bytes = dir_bytes(&out);
        println!(
            "{:>6.0e} {:>6} | {:>10} {:>12.1} | {:>9.2} | {:>12.1} | {:>9.2}",
            scale,
            n,
            rows,
            rows as f64 / secs / 1e6,
            bytes as f64 / rows as f64,
            heap,
            secs
        );
    }
}
