//! Cost of mining against the cost of recording, measured in one run: a chain MLP with 24
//! matmul sites (x[64,256] -> (matmul [256,256] -> relu) x 24), 100 recorded runs with the full
//! sketch set, written to Parquet, CSV and gzip CSV; then `mine::load` + `mine::mine` on each.
//!
//! Prints both times and their ratio (the miner issue's target: under 10%).

use std::time::Instant;

use opscope::Pipeline;
use rlx_ir::op::Activation;
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

fn main() {
    let (m, d, layers, steps) = (64usize, 256usize, 24usize, 100usize);
    let mut g = Graph::new("chain24");
    let sh = Shape::new(&[m, d], DType::F32);
    let mut h = g.input("x", sh.clone());
    for l in 0..layers {
        let w = g.param(format!("w{l}"), Shape::new(&[d, d], DType::F32));
        let y = g.matmul(h, w, sh.clone());
        h = g.activation(Activation::Relu, y, sh.clone());
    }
    g.set_outputs(vec![h]);
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["rec.parquet", "rec.csv", "rec.csv.gz"] {
        let path = dir.path().join(name);
        let t = Instant::now();
        opscope::scope(&Pipeline::parse("matmul").unwrap(), opscope::sink::create(&path).unwrap(), || {
            let mut c = Session::new(Device::Cpu).compile(g.clone());
            for l in 0..layers {
                let w: Vec<f32> = (0..d * d).map(|i| (((i * 31 + l * 17) % 97) as f32 - 48.0) / (48.0 * 16.0)).collect();
                c.set_param(&format!("w{l}"), &w);
            }
            for s in 0..steps {
                let x: Vec<f32> = (0..m * d).map(|i| (((i + s * 7) % 13) as f32 - 6.0) / 6.0).collect();
                c.run(&[("x", &x)]);
            }
        })
        .expect("recording");
        let record = t.elapsed();
        let t = Instant::now();
        let series = opscope::mine::load(&path).expect("load");
        let verdicts = opscope::mine::mine(&series);
        let mine = t.elapsed();
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        println!(
            "{name:>10}: {steps} runs x {layers} sites, {:.1} MB: record {:.2} s, mine {:.2} s ({} verdicts): mine/record = {:.1}%",
            size as f64 / 1e6,
            record.as_secs_f64(),
            mine.as_secs_f64(),
            verdicts.len(),
            100.0 * mine.as_secs_f64() / record.as_secs_f64()
        );
    }
}
