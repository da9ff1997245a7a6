//! The weight memo's param epoch on a multi-worker RLX pool (`RLX_WORKERS=2`, its own test
//! binary: the pool size is read once per process). Executable A runs in a loop on a pool worker
//! (inside `rayon::spawn`), so a worker waiting inside A's parallel GEMM may pick up B's whole
//! schedule; B's weight is rewritten before each of its runs, with a new maximum each time, and
//! every run of B must record that maximum. Before the kernel refused the epoch on pool workers,
//! B's kernels read A's epoch and served B's old sketch in 3 000-7 000 of 20 000 steps (found by
//! review; this is its reproduction).

mod common;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use common::{chain_mlp, randn};
use opscope::{MemorySink, Pipeline};
use rlx_runtime::{Device, Session};

#[test]
fn a_schedule_run_on_a_pool_worker_never_gets_another_executables_epoch() {
    std::env::set_var("RLX_WORKERS", "2");
    let pipe = Pipeline::parse("matmul{stats=[max],roles=[rhs]}").unwrap();
    let sink = MemorySink::default();
    const N: usize = 3000;
    let mut expected = Vec::new();
    opscope::scope(&pipe, Box::new(sink.clone()), || {
        let (mut ga, pa) = chain_mlp(256, 256, 4);
        ga.name = "big".into();
        let mut a = Session::new(Device::Cpu).compile(ga);
        for (n, w) in &pa { a.set_param(n, w); }
        let (mut gb, pb) = chain_mlp(8, 16, 1);
        gb.name = "small".into();
        let mut b = Session::new(Device::Cpu).compile(gb);
        for (n, w) in &pb { b.set_param(n, w); }
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let (s2, d2) = (stop.clone(), done.clone());
        let xa = randn(256 * 256, 1);
        rayon::spawn(move || {
            while !s2.load(Ordering::Relaxed) { a.run(&[("x", &xa)]); }
            d2.store(true, Ordering::Relaxed);
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let xb = randn(8 * 16, 2);
        for step in 0..N {
            let w: Vec<f32> = (0..256).map(|i| if i == 5 { step as f32 + 1.0 } else { 0.0 }).collect();
            b.set_param("w0", &w);
            b.run(&[("x", &xb)]);
            expected.push(step as f32 + 1.0);
        }
        stop.store(true, Ordering::Relaxed);
        while !done.load(Ordering::Relaxed) { std::thread::sleep(std::time::Duration::from_millis(5)); }
    }).unwrap();
    let rows = sink.rows();
    let mut bad = 0;
    for (step, e) in expected.iter().enumerate() {
        let got = rows.iter().find(|r| &*r.graph == "small" && &*r.role == "rhs" && &*r.stat == "max" && r.step == step as u64).map(|r| r.value);
        if got != Some(*e) { bad += 1; if bad < 5 { eprintln!("step {step}: got {got:?} want {e}"); } }
    }
    eprintln!("weight memo {:?}; {bad} of {N} steps wrong", opscope::sketch::weight_memo_counts());
    assert_eq!(bad, 0, "{bad} of {N} runs of B recorded a stale or missing weight maximum");
}
