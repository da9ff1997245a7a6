//! Cost of mining against the cost of recording, measured in one run (the miner issue's target:
//! under 10% of the recording time for 100 steps x 24 sites):
//! - MiniLM-L3 (24 MatMul sites) over 100 batches of 8 fortunes, recorded to Parquet, when the
//!   assets of scripts/fetch-assets.sh are present;
//! - a chain MLP with 24 matmul sites (x[64,256] -> (matmul [256,256] -> relu) x 24), 100 runs,
//!   to Parquet, CSV and gzip CSV: a worst case, the model costing almost nothing to run.

use std::time::Instant;

#[path = "../../benches/common/mod.rs"]
mod common;

use opscope::Pipeline;
use rlx_runtime::{Device, Session};

/// Mine `path` and print the ratio to `record_s`.
fn mine_and_report(name: &str, path: &std::path::Path, record_s: f64) {
    let t = Instant::now();
    let series = opscope::mine::load(path).expect("load");
    let load = t.elapsed();
    let verdicts = opscope::mine::mine(&series);
    let mine = t.elapsed();
    // A Parquet recording is a dataset directory: its size is that of its parts.
    let size = match opscope::recording::partitions(path) {
        Ok(p) if path.is_dir() => p.iter().flat_map(|p| &p.parts).filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum(),
        _ => std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
    };
    println!(
        "{name:>22}: {:.1} MB: record {:.2} s, mine {:.2} s (load {:.2} s; {} verdicts): mine/record = {:.1}%",
        size as f64 / 1e6,
        record_s,
        mine.as_secs_f64(),
        load.as_secs_f64(),
        verdicts.len(),
        100.0 * mine.as_secs_f64() / record_s
    );
}

fn minilm(dir: &std::path::Path) {
    let (onnx, tok, text) = match opscope_lab::model::MiniLmAssets::from_cache() {
        Ok(a) => (a.onnx, a.tokenizer, a.text),
        Err(e) => {
            println!("MiniLM skipped: {e}");
            return;
        }
    };
    let (batch, seq, steps) = (8usize, 64usize, 100usize);
    let entries = opscope_lab::model::split_entries(&std::fs::read_to_string(&text).unwrap());
    let enc = opscope_lab::model::TextEncoder::load(&tok, seq).unwrap();
    let model = opscope_lab::model::OnnxEncoder::load(&onnx, batch, seq).unwrap();
    let path = dir.join("minilm.parquet");
    let t = Instant::now();
    opscope::scope(&Pipeline::parse("matmul").unwrap(), opscope::recording::open(&path).unwrap(), || {
        let mut c = model.compile(&Session::new(Device::Cpu)).unwrap();
        for chunk in entries.chunks(batch).take(steps) {
            if chunk.len() == batch {
                model.run(&mut c, &enc.encode(chunk).unwrap()).unwrap();
            }
        }
    })
    .expect("recording");
    mine_and_report("MiniLM 100x24 parquet", &path, t.elapsed().as_secs_f64());
}

fn main() {
    let (m, d, layers, steps) = (64usize, 256usize, 24usize, 100usize);
    let g = common::chain(m, d, layers);
    let dir = tempfile::tempdir().expect("temp dir");
    minilm(dir.path());
    for name in ["rec.parquet", "rec.csv", "rec.csv.gz"] {
        let path = dir.path().join(name);
        let t = Instant::now();
        opscope::scope(&Pipeline::parse("matmul").unwrap(), opscope::recording::open(&path).unwrap(), || {
            let mut c = Session::new(Device::Cpu).compile(g.clone());
            for l in 0..layers {
                c.set_param(&format!("w{l}"), &common::weight(d, l));
            }
            for s in 0..steps {
                let x: Vec<f32> = (0..m * d).map(|i| (((i + s * 7) % 13) as f32 - 6.0) / 6.0).collect();
                c.run(&[("x", &x)]);
            }
        })
        .expect("recording");
        mine_and_report(&format!("chain MLP 100x24 {}", name.trim_start_matches("rec.")), &path, t.elapsed().as_secs_f64());
    }
}
