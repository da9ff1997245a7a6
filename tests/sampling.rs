//! Sampled recording (`sample{every=N}`) and the `hash` statistic: which runs are recorded
//! (exactly those whose inputs hash to 0 mod N, by a host XXH3-64 written here from the
//! documented byte stream), that a sampled run records the same values as a full recording,
//! that the caller's outputs are untouched, that `hash` is XXH3-64 of the tensor's bytes, and
//! that a replay of P distinct inputs over T runs has a repeat rate of exactly 1 - P/T.

mod common;
use common::*;

use std::collections::{BTreeMap, BTreeSet};

use opscope::sketch::hash_from_limbs;
use opscope::{MemorySink, Pipeline, Row};
use rlx_runtime::{Device, Session};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

const M: usize = 8;
const D: usize = 32;

/// A pool of `p` distinct inputs and a replay order of `t` runs using each at least once
/// (seeded LCG order).
fn replay(p: usize, t: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<usize>) {
    let pool: Vec<Vec<f32>> = (0..p).map(|i| randn(M * D, 900 + i as u64)).collect();
    let mut s = seed;
    let mut order: Vec<usize> = (0..p).collect();
    order.extend((p..t).map(|_| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) % p as u64) as usize
    }));
    (pool, order)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The documented sampling hash of a run with the one input `x` (F32): XXH3-64 over the name's
/// length (u64 LE), the name, the dtype name, the byte length (u64 LE) and the bytes.
fn host_input_hash(x: &[f32]) -> u64 {
    let bytes = f32_bytes(x);
    let mut h = Xxh3::new();
    h.update(&1u64.to_le_bytes());
    h.update(b"x");
    h.update(b"F32");
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(&bytes);
    h.digest()
}

/// Record `order` over the chain MLP under `pipeline`; returns the caller's outputs per run
/// and the rows.
fn record(pipeline: &str, pool: &[Vec<f32>], order: &[usize]) -> (Vec<Vec<Vec<u32>>>, Vec<Row>) {
    let (g, params) = chain_mlp(M, D, 3);
    let sink = MemorySink::default();
    let p = Pipeline::parse(pipeline).unwrap();
    let outs = opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        for (n, d) in &params {
            c.set_param(n, d);
        }
        order.iter().map(|&k| bits(&c.run(&[("x", &pool[k])]))).collect::<Vec<_>>()
    })
    .unwrap();
    (outs, sink.rows())
}

type Key = (String, String, String, u64);

/// Rows of one step by (site, role, stat, idx) -> value bits.
fn at_step(rows: &[Row], step: u64, role: &str) -> BTreeMap<Key, u32> {
    rows.iter()
        .filter(|r| r.step == step && &*r.role == role)
        .map(|r| ((r.site.to_string(), r.role.to_string(), r.stat.to_string(), r.idx), r.value.to_bits()))
        .collect()
}

#[test]
fn sampled_runs_are_exactly_those_whose_inputs_hash_to_zero_mod_n() {
    let every = 4u64;
    let (p, t) = (12, 96);
    let (pool, order) = replay(p, t, 5);
    let chosen: Vec<bool> = pool.iter().map(|x| host_input_hash(x) % every == 0).collect();
    let n_chosen = chosen.iter().filter(|&&c| c).count();
    assert!(n_chosen > 0 && n_chosen < p, "the pool must hold sampled and unsampled inputs ({n_chosen} of {p})");
    let expected: BTreeSet<u64> = (0..t).filter(|&i| chosen[order[i]]).map(|i| i as u64).collect();

    let stats = "stats=[min,max,sumsq,hist,chan_maxabs,hash]";
    let (full_outs, full) = record(&format!("matmul{{{stats}}}"), &pool, &order);
    let (samp_outs, samp) = record(&format!("sample{{every={every}}},matmul{{{stats}}}"), &pool, &order);
    let (plain_outs, _) = record("sample{every=1}", &pool, &order); // no tap: the caller's outputs
    assert_eq!(samp_outs, plain_outs, "sampling changed the caller's outputs");
    assert_eq!(full_outs, plain_outs, "tapping changed the caller's outputs");

    // Activations: rows exactly at the sampled steps, equal bit for bit to the full recording's.
    let steps: BTreeSet<u64> = samp.iter().filter(|r| &*r.role != "rhs").map(|r| r.step).collect();
    assert_eq!(steps, expected, "recorded steps are not the runs whose inputs hash to 0 mod {every}");
    for &s in &expected {
        for role in ["lhs", "out"] {
            let (a, b) = (at_step(&samp, s, role), at_step(&full, s, role));
            assert!(!a.is_empty(), "step {s} {role}: no rows");
            assert_eq!(a, b, "step {s} {role}: a sampled run must record what a full recording records");
        }
    }
    // Weights: recorded once, on the first sampled run, with the values of the full recording.
    let first = *expected.iter().next().unwrap();
    let rhs_steps: BTreeSet<u64> = samp.iter().filter(|r| &*r.role == "rhs").map(|r| r.step).collect();
    assert_eq!(rhs_steps, BTreeSet::from([first]));
    let strip = |m: BTreeMap<Key, u32>| m.into_iter().collect::<Vec<_>>();
    assert_eq!(strip(at_step(&samp, first, "rhs")), strip(at_step(&full, 0, "rhs")));
}

#[test]
fn hash_is_xxh3_64_of_the_tensor_bytes_and_the_repeat_rate_is_exactly_one_minus_p_over_t() {
    let (p, t) = (5, 40);
    let (pool, order) = replay(p, t, 7);
    let (_, rows) = record("matmul{stats=[hash],roles=[lhs,out]}", &pool, &order);
    // The first matmul's lhs is the graph input x: its hash is XXH3-64 of x's bytes.
    let series = opscope::mine::series_from_rows(&rows);
    let (_, s) = series.iter().find(|(k, _)| k.1 == "lhs" && k.0.ends_with('0')).expect("the first matmul's input");
    assert_eq!(s.runs.len(), t);
    for (i, run) in s.runs.iter().enumerate() {
        let limbs = run.vector(opscope::sketch::tensor::HASH).expect("hash recorded");
        assert_eq!(hash_from_limbs(limbs), Some(xxh3_64(&f32_bytes(&pool[order[i]]))), "run {i}");
    }
    // Only `hash` recorded: the fingerprint is the content hash, and the rate is exact.
    for (key, s) in &series {
        let rr = opscope::mine::repeat_rate(s).expect("hash is a content statistic");
        assert_eq!((rr.runs, rr.distinct, rr.repeats), (t, p, t - p), "{key:?}");
        assert_eq!(rr.rate(), Some(1.0 - p as f64 / t as f64), "{key:?}");
    }
}

#[test]
fn hash_is_opt_in_and_limbs_decode_only_when_exact() {
    let p = Pipeline::parse("matmul").unwrap();
    let (g, m) = p.apply(&matmul_2d(4, 8, 6)).unwrap();
    assert!(g.len() > 0);
    assert!(m.outputs.iter().all(|o| o.layout.iter().all(|l| l.stat.as_str() != "hash")), "stats=[all] must leave hash out");
    let h = 0x0123_4567_89ab_cdefu64;
    let limbs: Vec<f32> = (0..4).map(|i| ((h >> (16 * i)) & 0xffff) as f32).collect();
    assert_eq!(hash_from_limbs(&limbs), Some(h));
    assert_eq!(hash_from_limbs(&limbs[..3]), None);
    assert_eq!(hash_from_limbs(&[0.5, 0.0, 0.0, 0.0]), None);
    assert_eq!(hash_from_limbs(&[65536.0, 0.0, 0.0, 0.0]), None);
}

#[test]
fn sampling_a_lowered_sketch_is_refused_with_the_reason() {
    let p = Pipeline::parse("sample{every=4},matmul{lower=true}").unwrap();
    let e = p.apply(&matmul_2d(4, 8, 6)).err().expect("refused").to_string();
    assert!(e.contains("lowered") && e.contains("every run"), "{e}");
    let p = Pipeline::parse("sample{every=4},sample{every=8},matmul").unwrap();
    let e = p.apply(&matmul_2d(4, 8, 6)).err().expect("refused").to_string();
    assert!(e.contains("every=8") && e.contains("every=4"), "{e}");
}

#[test]
fn snapshot_sample_gates_every_sketch() {
    let g = matmul_2d(4, 8, 6);
    let (out, m) = Pipeline::parse("sample{every=16},matmul{stats=[max,hash]}").unwrap().apply(&g).unwrap();
    assert_caller_outputs_first(&g, &out);
    assert_eq!(m.sample_every, Some(16));
    snapshot("sample_every_16_matmul_2d", &out, &m);
}
