//! The memo guard: hit rate against the repeat rate a recording predicts, an LRU bound checked
//! against a host LRU, full verification under planted hash collisions, and cached outputs
//! bit-identical to fresh runs.

mod common;
use common::*;

use std::num::NonZeroUsize;

use opscope::memo::{MemoGuard, MemoStats};
use opscope::{MemorySink, Pipeline};
use rlx_ir::{DType, Graph, Op, Shape};
use rlx_runtime::{Device, Session};

const M: usize = 8;
const D: usize = 32;

/// A pool of `p` distinct inputs and a replay order of `t` runs that uses each at least once
/// (a fixed pseudo-random order: splitmix64).
fn replay(p: usize, t: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<usize>) {
    let pool: Vec<Vec<f32>> = (0..p).map(|i| randn(M * D, 500 + i as u64)).collect();
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..p).collect();
    order.extend((p..t).map(|_| (next() % p as u64) as usize));
    // Shuffle so first uses are spread over the replay (Fisher-Yates).
    for i in (1..order.len()).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    (pool, order)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Hits a least-recently-used cache of `cap` entries would have on `order` (host reference).
fn lru_hits(order: &[usize], cap: usize) -> u64 {
    let mut recent: Vec<usize> = Vec::new(); // most recent last
    let mut hits = 0;
    for &k in order {
        if let Some(i) = recent.iter().position(|&r| r == k) {
            hits += 1;
            recent.remove(i);
        } else if recent.len() == cap {
            recent.remove(0);
        }
        recent.push(k);
    }
    hits
}

/// Run `order` through a guard of `cap` entries; every output is checked bit for bit against
/// an unguarded run of the same input.
fn guarded(cap: usize, hasher: Option<fn(&[(&str, &[u8], DType)]) -> u128>, pool: &[Vec<f32>], order: &[usize]) -> MemoStats {
    let (g, params) = chain_mlp(M, D, 3);
    let session = Session::new(Device::Cpu);
    let mut c = session.compile(g.clone());
    for (n, d) in &params {
        c.set_param(n, d);
    }
    let fresh: Vec<Vec<Vec<u32>>> = pool.iter().map(|x| bits(&c.run(&[("x", x)]))).collect();
    let mut guard = MemoGuard::new(&g, NonZeroUsize::new(cap).unwrap()).unwrap();
    if let Some(h) = hasher {
        guard = guard.with_hasher(h);
    }
    for &k in order {
        let bytes = f32_bytes(&pool[k]);
        let out = guard.run(&[("x", &bytes, DType::F32)], |i| c.run_typed(i));
        let got: Vec<Vec<u32>> =
            out.iter().map(|(b, _)| b.chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).collect()).collect();
        assert_eq!(got, fresh[k], "input {k}: guarded outputs differ from a fresh run");
    }
    assert!(guard.len() <= cap);
    guard.stats()
}

#[test]
fn hit_rate_equals_the_recorded_repeat_rate_one_minus_p_over_t() {
    let (p, t) = (5, 40);
    let (pool, order) = replay(p, t, 7);
    // The recording of every run (no guard): the miner's repeat rate of the input.
    let (g, params) = chain_mlp(M, D, 3);
    let sink = MemorySink::default();
    let pipeline = Pipeline::parse("matmul{stats=[sumsq,elemsig]}").unwrap();
    opscope::scope(&pipeline, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        for (n, d) in &params {
            c.set_param(n, d);
        }
        for &k in &order {
            c.run(&[("x", &pool[k])]);
        }
    })
    .unwrap();
    let series = opscope::mine::series_from_rows(&sink.rows());
    let (key, s) = series.iter().find(|(k, _)| k.1 == "lhs" && k.0.ends_with('0')).expect("the first matmul's input");
    let rr = opscope::mine::repeat_rate(s).unwrap();
    assert_eq!((rr.runs, rr.distinct, rr.repeats), (t, p, t - p), "{key:?}");
    let expected = 1.0 - p as f64 / t as f64;
    assert_eq!(rr.rate(), Some(expected));

    // The guard with room for the pool answers exactly the repeats from its cache.
    let st = guarded(p, None, &pool, &order);
    assert_eq!((st.hits, st.misses, st.collisions, st.evictions), ((t - p) as u64, p as u64, 0, 0));
    assert_eq!(st.hit_rate(), Some(expected));
}

#[test]
fn a_smaller_capacity_evicts_least_recently_used_as_a_host_lru_does() {
    let (pool, order) = replay(9, 60, 11);
    for cap in [1, 3, 6] {
        let st = guarded(cap, None, &pool, &order);
        let hits = lru_hits(&order, cap);
        assert_eq!(st.hits, hits, "capacity {cap}");
        assert_eq!(opscope::memo::predicted_hits(&order, NonZeroUsize::new(cap).unwrap()), hits, "capacity {cap}");
        assert_eq!(st.misses, order.len() as u64 - hits);
        assert!(st.evictions > 0, "capacity {cap} below the pool must evict");
    }
}

#[test]
fn planted_collisions_are_verified_and_never_served() {
    // Every input hashes to the same key: only byte-for-byte equal inputs may hit.
    let (pool, order) = replay(4, 30, 3);
    let st = guarded(4, Some(|_| 42), &pool, &order);
    // One entry per key: a hit needs the same input as the previous run.
    let same_as_last = order.windows(2).filter(|w| w[0] == w[1]).count() as u64;
    assert_eq!(st.hits, same_as_last);
    assert_eq!(st.collisions, order.len() as u64 - 1 - same_as_last);
    assert_eq!(st.evictions, 0, "a replaced entry of the same key is not an eviction");
}

#[test]
fn invalidate_drops_outputs_computed_with_old_parameters() {
    let (g, params) = chain_mlp(M, D, 2);
    let mut c = Session::new(Device::Cpu).compile(g.clone());
    for (n, d) in &params {
        c.set_param(n, d);
    }
    let x = f32_bytes(&randn(M * D, 1));
    let mut guard = MemoGuard::new(&g, NonZeroUsize::new(4).unwrap()).unwrap();
    let before = guard.run(&[("x", &x, DType::F32)], |i| c.run_typed(i));
    let scaled: Vec<f32> = params[0].1.iter().map(|v| v * 2.0).collect();
    c.set_param(&params[0].0, &scaled);
    guard.invalidate();
    let after = guard.run(&[("x", &x, DType::F32)], |i| c.run_typed(i));
    assert_ne!(before, after, "the new weight must be used");
    assert_eq!(after, c.run_typed(&[("x", &x, DType::F32)]));
    assert_eq!(guard.stats().misses, 2);
}

#[test]
fn a_nondeterministic_graph_is_refused_with_the_op_named() {
    let mut g = Graph::new("noisy");
    let x = g.input("x", Shape::new(&[4], DType::F32));
    let n = g.add_node(Op::RngNormal { mean: 0.0, scale: 1.0, key: 1, op_seed: None }, vec![], Shape::new(&[4], DType::F32));
    let y = g.binary(rlx_ir::op::BinaryOp::Add, x, n, Shape::new(&[4], DType::F32));
    g.set_outputs(vec![y]);
    let e = MemoGuard::new(&g, NonZeroUsize::new(2).unwrap()).err().expect("refused");
    assert!(e.contains("nondeterministic") && e.contains("noisy"), "{e}");
}
