//! Tensor miner rules on recordings of real tapped matmuls: the scale-drift rule.

mod common;
use common::*;
use opscope::{MemorySink, Pipeline};
use rlx_runtime::{Device, Session};

/// Record `x * scale(i)` through a tapped matmul for 20 runs and mine it.
fn mine_scaled(scale: impl Fn(usize) -> f32) -> Vec<opscope::mine::Verdict> {
    let sink = MemorySink::default();
    let p = Pipeline::parse("matmul{roles=[lhs]}").unwrap();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(64, 128, 16));
        c.set_param("w", &randn(128 * 16, 1));
        for i in 0..20 {
            let x: Vec<f32> = randn(64 * 128, 100 + i as u64).iter().map(|v| v * scale(i)).collect();
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    opscope::mine::mine(&opscope::mine::series_from_rows(&sink.rows()))
}

fn kinds(v: &[opscope::mine::Verdict]) -> Vec<&'static str> {
    v.iter().map(|v| v.kind.name).collect()
}

#[test]
fn a_range_that_triples_is_scale_drift_not_stationary() {
    use opscope::mine::kinds::{DRIFTING, SCALE_DRIFT, STATIONARY};
    // Planted: the scale ramps from 1.0 to 2.9 over 20 runs (the mean stays 0).
    let v = mine_scaled(|i| 1.0 + 0.1 * i as f32);
    let k = kinds(&v);
    assert!(k.contains(&SCALE_DRIFT.name), "{k:?}");
    assert!(!k.contains(&DRIFTING.name) && !k.contains(&STATIONARY.name), "{k:?}");
    let d = v.iter().find(|v| v.kind == SCALE_DRIFT).unwrap();
    let ratio = d.evidence.iter().find(|(n, _)| n == "absmax_end_over_start").unwrap().1;
    assert!((2.4..3.4).contains(&ratio), "a 2.9x ramp of Gaussian absmax: {ratio}");
    // Just inside the line (1.4x): no verdict; a constant scale: stationary.
    assert!(!kinds(&mine_scaled(|i| 1.0 + 0.4 * i as f32 / 19.0)).contains(&SCALE_DRIFT.name));
    let k = kinds(&mine_scaled(|_| 1.0));
    assert!(k.contains(&STATIONARY.name) && !k.contains(&SCALE_DRIFT.name), "{k:?}");
}
