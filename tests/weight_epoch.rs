//! The weight memo follows param writes (`opscope::sketch::epoch`): between two param writes a
//! weight sketch is reused without reading the weight, and after a write (whole or partial) the
//! recorded sketch is the new weight's, checked against statistics
//! computed here on the host. An executable that hands out its arena goes back to hashing.
//! RLX runs a schedule on the caller's thread (where the epoch is trusted) with one pool worker:
//! every test sets `RLX_WORKERS=1` before its first compile (read once per process).
//! `tests/weight_epoch_pool.rs` covers a pool of two workers.

mod common;

use std::sync::Mutex;

use common::{chain_mlp, randn};
use opscope::sketch::weight_memo_counts;
use opscope::{MemorySink, Pipeline, Row};
use rlx_runtime::{CompiledGraph, Device, Session};

/// The memo counts are process-wide: the tests of this file take turns.
static TURN: Mutex<()> = Mutex::new(());

/// Take the turn and pin RLX's pool to one worker (schedules run on the caller's thread).
fn turn() -> std::sync::MutexGuard<'static, ()> {
    let guard = TURN.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("RLX_WORKERS", "1");
    guard
}

const M: usize = 8;
const D: usize = 16;
const LAYERS: usize = 3;

/// `(max, min, sumsq)` of `w` in f64, as the sketch defines them.
fn host_stats(w: &[f32]) -> (f64, f64, f64) {
    let max = w.iter().map(|&v| v as f64).fold(f64::NEG_INFINITY, f64::max);
    let min = w.iter().map(|&v| v as f64).fold(f64::INFINITY, f64::min);
    let sumsq = w.iter().map(|&v| v as f64 * v as f64).sum();
    (max, min, sumsq)
}

/// The recorded `rhs` (weight) statistics of layer `layer` at `step`, if that run recorded them.
fn weight_stats(rows: &[Row], layer: usize, step: u64) -> Option<(f64, f64, f64)> {
    let site = format!("matmul.{layer}");
    let get = |stat: &str| {
        rows.iter()
            .find(|r| &*r.site == site && &*r.role == "rhs" && r.step == step && &*r.stat == stat)
            .map(|r| r.value as f64)
    };
    Some((get("max")?, get("min")?, get("sumsq")?))
}

fn assert_stats(got: Option<(f64, f64, f64)>, w: &[f32], what: &str) {
    let (max, min, sumsq) = host_stats(w);
    let (gmax, gmin, gsumsq) = got.unwrap_or_else(|| panic!("{what}: no weight rows recorded"));
    assert_eq!((gmax, gmin), (max as f32 as f64, min as f32 as f64), "{what}: max, min");
    assert!((gsumsq - sumsq).abs() <= 1e-5 * sumsq, "{what}: sumsq {gsumsq} against {sumsq}");
}

fn compile(g: &rlx_ir::Graph, params: &[(String, Vec<f32>)]) -> CompiledGraph {
    let mut c = Session::new(Device::Cpu).compile(g.clone());
    for (n, w) in params {
        c.set_param(n, w);
    }
    c
}

fn pipeline() -> Pipeline {
    Pipeline::parse("matmul{stats=[min,max,sumsq],roles=[rhs,out]}").unwrap()
}

#[test]
fn a_weight_written_between_runs_is_resketched_and_an_unwritten_one_is_not_reread() {
    let _turn = turn();
    let (g, mut params) = chain_mlp(M, D, LAYERS);
    let x = randn(M * D, 7);
    let sink = MemorySink::default();
    let mut counts = Vec::new();
    opscope::scope(&pipeline(), Box::new(sink.clone()), || {
        let mut c = compile(&g, &params);
        counts.push(weight_memo_counts());
        // Steps 0..4: no write. The first run hashes each weight once; the others reuse.
        for _ in 0..4 {
            c.run(&[("x", &x)]);
        }
        counts.push(weight_memo_counts());
        // Step 4: w1 replaced whole.
        params[1].1 = randn(D * D, 999).iter().map(|v| v * 3.0).collect();
        c.set_param("w1", &params[1].1);
        c.run(&[("x", &x)]);
        counts.push(weight_memo_counts());
        // Step 5: one element of w2 written in place (a partial update), larger than any other.
        params[2].1[37] = 50.0;
        assert!(c.set_param_range("w2", 37 * 4, &50.0f32.to_le_bytes()), "CPU supports set_param_range");
        c.run(&[("x", &x)]);
        // Steps 6, 7: no write again.
        c.run(&[("x", &x)]);
        c.run(&[("x", &x)]);
        counts.push(weight_memo_counts());
    })
    .unwrap();
    let rows = sink.rows();
    // Values: every recorded weight sketch is the weight of that run, by host statistics.
    for layer in 0..LAYERS {
        let w0 = chain_mlp(M, D, LAYERS).1[layer].1.clone();
        assert_stats(weight_stats(&rows, layer, 0), &w0, &format!("w{layer} at step 0"));
    }
    assert_stats(weight_stats(&rows, 1, 4), &params[1].1, "w1 after set_param");
    assert_stats(weight_stats(&rows, 2, 5), &params[2].1, "w2 after set_param_range");
    assert_eq!(weight_stats(&rows, 2, 5).unwrap().0, 50.0);
    // The recorder writes a weight's rows only when they change: w0 once, w1 twice, w2 twice.
    let steps = |layer: usize| -> Vec<u64> {
        let mut s: Vec<u64> = rows.iter().filter(|r| *r.site == *format!("matmul.{layer}") && &*r.role == "rhs").map(|r| r.step).collect();
        s.dedup();
        s
    };
    assert_eq!((steps(0), steps(1), steps(2)), (vec![0], vec![0, 4], vec![0, 5]));
    // Which path ran: between writes no weight is read (epoch hits); each run after a write
    // hashes all three weights (the write starts a new epoch for the whole executable).
    let d = |a: usize, b: usize| (counts[b].epoch_hits - counts[a].epoch_hits, counts[b].hashed - counts[a].hashed);
    assert_eq!(d(0, 1), (3 * 3, 3), "steps 0-3: one hash per weight, then reuse");
    assert_eq!(d(1, 2), (0, 3), "step 4: after set_param every weight is hashed");
    assert_eq!(d(2, 3), (2 * 3, 3), "step 5 hashed after set_param_range, steps 6-7 reused");
}

#[test]
fn an_executable_that_hands_out_its_arena_hashes_every_run() {
    let _turn = turn();
    let (g, params) = chain_mlp(M, D, LAYERS);
    let x = randn(M * D, 8);
    let sink = MemorySink::default();
    let mut counts = Vec::new();
    opscope::scope(&pipeline(), Box::new(sink.clone()), || {
        let mut c = compile(&g, &params);
        c.run(&[("x", &x)]);
        c.run(&[("x", &x)]);
        counts.push(weight_memo_counts());
        // A raw pointer into the arena: params may now be written around the wrapper.
        std::hint::black_box(c.arena_ptr());
        c.run(&[("x", &x)]);
        c.run(&[("x", &x)]);
        counts.push(weight_memo_counts());
    })
    .unwrap();
    let (hits, hashed) = (counts[1].epoch_hits - counts[0].epoch_hits, counts[1].hashed - counts[0].hashed);
    assert_eq!((hits, hashed), (0, 2 * 3), "after arena_ptr every weight sketch hashes");
    for layer in 0..LAYERS {
        assert_stats(weight_stats(&sink.rows(), layer, 0), &params[layer].1, &format!("w{layer}"));
    }
}
