//! Plain RLX code that runs one small graph through the run path named by its argument:
//! `run`, `run_typed`, `run_raw`, `run_slots` or `run_pipelined` (the ways a program can
//! execute a `CompiledGraph`), or `set_param` (`run`, with `fc1.weight` doubled before step 1). It prints each step's output exactly (`{:?}` of f32 round-trips).
//!
//! The graph: `h = relu(x @ fc1.weight + fc1.bias)`, `y = h @ fc2.weight + fc2.bias`, with
//! `x [4, 8]`, `fc1.weight [8, 8]`, `fc2.weight [8, 6]`, two steps. `tests/env_mode.rs`
//! recomputes every value on the host. The one opscope line is `use opscope as _;`.

use opscope as _; // links opscope; RLX_OPSCOPE in the environment turns it on

use rlx_ir::op::{Activation, BinaryOp};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

const B: usize = 4;
const K: usize = 8;
const H: usize = 8;
const N: usize = 6;
const STEPS: usize = 2;

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| "run".into());
    let mut g = Graph::new("run_paths");
    let x = g.input("x", Shape::new(&[B, K], DType::F32));
    let w1 = g.param("fc1.weight", Shape::new(&[K, H], DType::F32));
    let b1 = g.param("fc1.bias", Shape::new(&[H], DType::F32));
    let w2 = g.param("fc2.weight", Shape::new(&[H, N], DType::F32));
    let b2 = g.param("fc2.bias", Shape::new(&[N], DType::F32));
    let m1 = g.matmul(x, w1, Shape::new(&[B, H], DType::F32));
    let a1 = g.binary(BinaryOp::Add, m1, b1, Shape::new(&[B, H], DType::F32));
    let h = g.activation(Activation::Relu, a1, Shape::new(&[B, H], DType::F32));
    let m2 = g.matmul(h, w2, Shape::new(&[B, N], DType::F32));
    let y = g.binary(BinaryOp::Add, m2, b2, Shape::new(&[B, N], DType::F32));
    g.set_outputs(vec![y]);

    let mut c = Session::new(Device::Cpu).compile(g);
    // Fixed patterns; tests/env_mode.rs has the same formulas.
    let w1v: Vec<f32> = (0..K * H).map(|i| ((i * 5 % 13) as f32 - 6.0) / 8.0).collect();
    let b1v: Vec<f32> = (0..H).map(|i| (i as f32 - 3.5) / 4.0).collect();
    let w2v: Vec<f32> = (0..H * N).map(|i| ((i * 3 % 11) as f32 - 5.0) / 4.0).collect();
    let b2v: Vec<f32> = (0..N).map(|i| i as f32 / 8.0 - 0.25).collect();
    c.set_param("fc1.weight", &w1v);
    c.set_param("fc1.bias", &b1v);
    c.set_param("fc2.weight", &w2v);
    c.set_param("fc2.bias", &b2v);
    let xs: Vec<Vec<f32>> = (0..STEPS)
        .map(|s| (0..B * K).map(|i| ((i * 7 + s * 3) % 17) as f32 / 4.0 - 2.0).collect())
        .collect();

    let outs: Vec<Vec<f32>> = match path.as_str() {
        "run" => xs.iter().map(|x| c.run(&[("x", x)]).remove(0)).collect(),
        "run_typed" => xs
            .iter()
            .map(|x| {
                let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                let out = c.run_typed(&[("x", &bytes, DType::F32)]);
                assert_eq!(out.len(), 1, "run_typed: one output");
                assert_eq!(out[0].1, DType::F32);
                out[0].0.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            })
            .collect(),
        "run_raw" => xs
            .iter()
            .map(|x| {
                let raw = c.run_raw(&[("x", x)]);
                assert_eq!(raw.len(), 1, "run_raw: one output");
                let (p, n) = raw[0];
                // SAFETY: valid until the next run (CompiledGraph::run_raw); copied right away.
                unsafe { std::slice::from_raw_parts(p, n) }.to_vec()
            })
            .collect(),
        "run_slots" => xs
            .iter()
            .map(|x| {
                let slots = c.run_slots(&[x]).to_vec();
                assert_eq!(slots.len(), 1, "run_slots: one output");
                let (off, n) = slots[0];
                // SAFETY: (byte offset, length) of an f32 output in the arena, valid until the next run.
                unsafe { std::slice::from_raw_parts(c.arena_ptr().add(off).cast::<f32>(), n) }.to_vec()
            })
            .collect(),
        "run_pipelined" => {
            let sets: Vec<Vec<(&str, &[f32])>> = xs.iter().map(|x| vec![("x", x.as_slice())]).collect();
            c.run_pipelined(&sets)
                .into_iter()
                .map(|mut o| {
                    assert_eq!(o.len(), 1, "run_pipelined: one output per run");
                    o.remove(0)
                })
                .collect()
        }
        "set_param" => {
            // `run`, with fc1.weight doubled before step 1: a weight written between runs.
            let mut outs = Vec::new();
            for (s, x) in xs.iter().enumerate() {
                if s == 1 {
                    let doubled: Vec<f32> = w1v.iter().map(|v| v * 2.0).collect();
                    c.set_param("fc1.weight", &doubled);
                }
                outs.push(c.run(&[("x", x)]).remove(0));
            }
            outs
        }
        other => {
            eprintln!("unknown run path '{other}': expected run, run_typed, run_raw, run_slots, run_pipelined or set_param");
            std::process::exit(2);
        }
    };
    for (s, y) in outs.iter().enumerate() {
        println!("step {s}: {y:?}");
    }
}
