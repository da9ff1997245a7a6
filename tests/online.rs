//! The online state (`online` setting, `opscope::online`): DDSketch quantiles of |x| within
//! alpha (1%, relative) of the exact quantiles of the same tensors (the graph returns every
//! tapped matmul output, so the exact values are the host's copy of what the kernel saw);
//! sketches built on two threads, or written by two "processes" and read back, merged equal one
//! pass over the same data; HyperLogLog++ within 3 x 1.04 / sqrt(m) of the exact distinct
//! count; with `sample{every=N}` only sampled runs feed the state.

mod common;
use common::*;

use std::sync::Mutex;

use opscope::online::{self, OnlineState, SiteState, ALPHA, HLL_PRECISION};
use opscope::{MemorySink, Pipeline};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};

const M: usize = 16;
const D: usize = 64;
const L: usize = 3;

/// The process-wide state is shared by the tests of this binary: one at a time.
static LOCK: Mutex<()> = Mutex::new(());

/// Chain MLP x -> (matmul w_i -> relu) x L whose outputs are the final activation and every
/// matmul output y_i (so the host holds exactly the tensors the taps read).
fn chain_exposed() -> (Graph, Vec<(String, Vec<f32>)>) {
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    let mut g = Graph::new("chain_exposed");
    let mut h = g.input("x", f(&[M, D]));
    let mut outs = Vec::new();
    let mut params = Vec::new();
    let he = (2.0 / D as f32).sqrt();
    for i in 0..L {
        let w = g.param(&format!("w{i}"), f(&[D, D]));
        let y = g.matmul(h, w, f(&[M, D]));
        outs.push(y);
        h = g.activation(rlx_ir::op::Activation::Relu, y, f(&[M, D]));
        params.push((format!("w{i}"), randn(D * D, 300 + i as u64).iter().map(|v| v * he).collect()));
    }
    let mut all = vec![h];
    all.extend(outs);
    g.set_outputs(all);
    (g, params)
}

/// Run `inputs` in order under `pipeline` on this thread; returns the caller's outputs per run.
fn run(pipeline: &str, inputs: &[Vec<f32>]) -> Vec<Vec<Vec<f32>>> {
    let (g, params) = chain_exposed();
    let p = Pipeline::parse(pipeline).unwrap();
    opscope::scope(&p, Box::new(MemorySink::default()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        for (n, d) in &params {
            c.set_param(n, d);
        }
        inputs.iter().map(|x| c.run(&[("x", x)])).collect::<Vec<_>>()
    })
    .unwrap()
}

/// Exact quantile of |v| as DDSketch defines the rank: element floor(q (n - 1)) of the sorted
/// magnitudes.
fn exact_quantile(v: &[f32], q: f64) -> f64 {
    let mut a: Vec<f64> = v.iter().filter(|x| x.is_finite()).map(|x| x.abs() as f64).collect();
    a.sort_by(|x, y| x.total_cmp(y));
    a[(q * (a.len() as f64 - 1.0)) as usize]
}

#[test]
fn quantiles_are_within_alpha_of_the_exact_quantiles_of_the_same_tensors() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    online::take();
    let inputs: Vec<Vec<f32>> = (0..6).map(|i| randn(M * D, 40 + i)).collect();
    let outs = run("online,matmul{stats=[max],roles=[lhs,out]}", &inputs);
    let state = online::take();
    for i in 0..L {
        // The tensors of site matmul.i, pooled over runs, from the graph's own outputs.
        let out: Vec<f32> = outs.iter().flat_map(|o| o[1 + i].clone()).collect();
        let lhs: Vec<f32> = if i == 0 {
            inputs.concat()
        } else {
            outs.iter().flat_map(|o| o[i].iter().map(|&v| v.max(0.0)).collect::<Vec<_>>()).collect()
        };
        for (role, values) in [("lhs", &lhs), ("out", &out)] {
            let key = format!("matmul.{i}/{role}");
            let s = state.sites.get(&key).unwrap_or_else(|| panic!("no state for {key}: {:?}", state.sites.keys()));
            assert_eq!(s.tensors, inputs.len() as u64, "{key}");
            assert_eq!(s.magnitudes.count(), values.len(), "{key}");
            for q in [0.5, 0.9, 0.99, 0.999] {
                let (est, exact) = (s.magnitudes.quantile(q).unwrap().unwrap(), exact_quantile(values, q));
                assert!((est - exact).abs() <= ALPHA * exact * (1.0 + 1e-9), "{key} q={q}: sketch {est}, exact {exact}");
            }
            let qs = s.quantiles().unwrap();
            let absmax = values.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            assert_eq!(qs.absmax, absmax, "{key}");
            assert!((qs.headroom.unwrap() - absmax / qs.p999).abs() < 1e-12);
            assert!((s.distinct() - inputs.len() as f64).abs() <= 3.0 * 1.04 / 128.0 * inputs.len() as f64, "{key}: {}", s.distinct());
        }
    }
}

/// The DDSketch of a state as JSON without its f64 `sum` (summed in another order when merged):
/// config, bins, counts, min, max, zero count.
/// Each store is compared as its nonzero (key, count) pairs: the dense array's `offset` and
/// padding depend on the order the store grew in (measured: a merge of two threads' sketches
/// left one more leading empty bin, offset -511 against -510, with the same keys and counts).
fn bins(s: &SiteState) -> serde_json::Value {
    let mut v = serde_json::to_value(&s.magnitudes).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("sum");
    for store in ["store", "negative_store"] {
        let st = o[store].as_object_mut().unwrap();
        let offset = st["offset"].as_i64().unwrap();
        let keyed: Vec<(i64, u64)> = st["bins"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_u64().filter(|&c| c > 0).map(|c| (offset + i as i64, c)))
            .collect();
        st.remove("offset");
        st.insert("bins".into(), serde_json::to_value(keyed).unwrap());
    }
    v
}

fn assert_same(a: &OnlineState, b: &OnlineState) {
    assert_eq!(a.sites.keys().collect::<Vec<_>>(), b.sites.keys().collect::<Vec<_>>());
    assert!(!a.sites.is_empty());
    for (k, x) in &a.sites {
        let y = &b.sites[k];
        assert_eq!(bins(x), bins(y), "{k}: merged bins differ from one pass");
        assert_eq!(x.tensors, y.tensors, "{k}");
        assert_eq!(x.distinct(), y.distinct(), "{k}");
        let (sx, sy) = (x.magnitudes.sum().unwrap(), y.magnitudes.sum().unwrap());
        assert!((sx - sy).abs() <= 1e-12 * sy.abs(), "{k}: sum {sx} vs {sy}");
    }
}

#[test]
fn two_threads_merged_equal_one_pass_and_files_merge_too() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let inputs: Vec<Vec<f32>> = (0..8).map(|i| randn(M * D, 70 + i)).collect();
    let pipeline = "online,matmul{stats=[max],roles=[lhs,out]}";
    online::take();
    run(pipeline, &inputs);
    let one_pass = online::take();
    // Two threads, each with its own scope, each a half of the inputs, at the same time.
    std::thread::scope(|s| {
        let (a, b) = inputs.split_at(3);
        let ta = s.spawn(|| run(pipeline, a));
        let tb = s.spawn(|| run(pipeline, b));
        ta.join().unwrap();
        tb.join().unwrap();
    });
    let threads = online::take();
    assert_same(&threads, &one_pass);

    // Two processes' states, written and read back, merged.
    let dir = tempfile::tempdir().unwrap();
    let mut halves = Vec::new();
    for (i, part) in [&inputs[..5], &inputs[5..]].into_iter().enumerate() {
        run(pipeline, part);
        let path = dir.path().join(format!("p{i}.json"));
        online::take().write(&path).unwrap();
        assert!(!dir.path().join(format!("p{i}.json.partial")).exists());
        halves.push(OnlineState::read(&path).unwrap());
    }
    let mut merged = OnlineState::default();
    for h in &halves {
        merged.merge(h).unwrap();
    }
    assert_same(&merged, &one_pass);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, b"{}x").unwrap();
    let e = OnlineState::read(&bad).unwrap_err();
    assert!(e.contains("bad.json") && e.contains("not an opscope online state"), "{e}");
}

#[test]
fn hyperloglog_is_within_three_standard_errors_of_the_exact_distinct_count() {
    let m = (1u64 << HLL_PRECISION) as f64;
    let bound = 3.0 * 1.04 / m.sqrt();
    for n in [100u64, 5_000, 60_000, 300_000] {
        let mut s = SiteState::default();
        // Every content hash twice: distinct = n.
        for rep in 0..2 {
            for i in 0..n {
                s.add(&[], xxhash_rust::xxh3::xxh3_64(&(i ^ 0x5eed).to_le_bytes()));
            }
            assert_eq!(s.tensors, (rep + 1) * n);
        }
        let est = s.distinct();
        assert!((est - n as f64).abs() <= bound * n as f64, "n={n}: estimate {est}, bound {:.4}", bound);
    }
}

#[test]
fn with_sampling_only_sampled_runs_feed_the_state() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let every = 4u64;
    let inputs: Vec<Vec<f32>> = (0..24).map(|i| randn(M * D, 500 + i)).collect();
    let hash = |x: &[f32]| {
        let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&1u64.to_le_bytes());
        h.update(b"x");
        h.update(b"F32");
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(&b);
        h.digest()
    };
    let sampled: Vec<&Vec<f32>> = inputs.iter().filter(|x| hash(x) % every == 0).collect();
    assert!(!sampled.is_empty() && sampled.len() < inputs.len());
    online::take();
    run(&format!("sample{{every={every}}},online,matmul{{stats=[max],roles=[lhs]}}"), &inputs);
    let state = online::take();
    let s = &state.sites["matmul.0/lhs"];
    assert_eq!(s.tensors, sampled.len() as u64);
    let exact: Vec<f32> = sampled.iter().flat_map(|x| x.iter().copied()).collect();
    assert_eq!(s.magnitudes.count(), exact.len());
    let q = s.magnitudes.quantile(0.99).unwrap().unwrap();
    let e = exact_quantile(&exact, 0.99);
    assert!((q - e).abs() <= ALPHA * e, "{q} vs {e}");
}
