//! Cost of the inference taps and actuations on the real model, as ratios to the untapped run
//! measured in one process: MiniLM-L3 (batch 8, 64 tokens) over the first 40 batches of the
//! fortunes, each configuration compiled once, then the configurations run in interleaved rounds
//! (so drift of the machine hits them all alike); the median round decides.
//! Needs the assets of scripts/fetch-assets.sh.

use std::time::Instant;

use opscope::{MemorySink, Pipeline};
use rlx_runtime::{Device, Session};

const CONFIGS: [&str; 7] = [
    "",
    "attn",
    "residual",
    "attn,residual",
    "matmul",
    "fakequant{scope=token}",
    "fakequant{scope=token,weights=true}",
];

fn main() {
    let (onnx, tok, text) = match opscope_lab::model::MiniLmAssets::from_cache() {
        Ok(a) => (a.onnx, a.tokenizer, a.text),
        Err(e) => {
            println!("MiniLM skipped: {e}");
            return;
        }
    };
    let (batch, seq, steps, rounds) = (8usize, 64usize, 40usize, 5usize);
    let entries = opscope_lab::model::split_entries(&std::fs::read_to_string(&text).unwrap());
    let enc = opscope_lab::model::TextEncoder::load(&tok, seq).unwrap();
    let model = opscope_lab::model::OnnxEncoder::load(&onnx, batch, seq).unwrap();
    let batches: Vec<_> = entries.chunks(batch).take(steps).map(|c| enc.encode(c).unwrap()).collect();
    let session = Session::new(Device::Cpu);
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); CONFIGS.len()];
    for _ in 0..rounds {
        for (i, cfg) in CONFIGS.iter().enumerate() {
            let run = || {
                let mut c = model.compile(&session).unwrap();
                let t = Instant::now();
                for b in &batches {
                    model.run(&mut c, b).unwrap();
                }
                t.elapsed().as_secs_f64()
            };
            let s = if cfg.is_empty() {
                run()
            } else {
                let p = Pipeline::parse(cfg).unwrap();
                opscope::scope(&p, Box::new(MemorySink::default()), run).expect("recording")
            };
            times[i].push(s);
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&times[0]);
    println!("MiniLM-L3, {steps} batches of {batch} x {seq} tokens, median of {rounds} interleaved rounds (run time only; compile excluded)");
    for (cfg, t) in CONFIGS.iter().zip(&times) {
        let name = if cfg.is_empty() { "untapped" } else { cfg };
        println!("{name:>38}: {:7.1} ms  {:.2}x", 1e3 * median(t), median(t) / base);
    }
}
