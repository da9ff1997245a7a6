//! MiniLM with the `matmul` tap's sketches lowered into RLX primitive ops
//! (`matmul{lower=true}`, what a device without a native sketch kernel runs) records the native
//! CPU kernel's statistics, padding rows excluded by both, and leaves the model's outputs
//! bit-identical. Likewise the probes: `attn{lower=true}` and `residual{lower=true}` against
//! their native kernels (every statistic of both is lowered).

use std::collections::BTreeMap;

use opscope::{MemorySink, Pipeline};
use opscope_lab::model::{split_entries, Job, MiniLmAssets};

type Key = (String, String, u64, String, u64);

/// Rows as (site, role, step, stat, idx) -> value, and the model's output bytes per batch.
fn record(a: &MiniLmAssets, entries: &[String], pipeline: &str) -> (BTreeMap<Key, f64>, Vec<Vec<u8>>) {
    let job = Job::new(&a.onnx, &a.tokenizer, entries.to_vec(), 8, 32).unwrap();
    let p = Pipeline::parse(pipeline).unwrap();
    let sink = MemorySink::default();
    let mut outs = Vec::new();
    job.run(&p, opscope::Stage::Deployed, Box::new(sink.clone()), |_, o| {
        outs.push(o.into_iter().flat_map(|(b, _)| b).collect());
        Ok(())
    })
    .unwrap();
    let rows = sink.rows();
    let m = rows.iter().map(|r| ((r.site.to_string(), r.role.to_string(), r.step, r.stat.to_string(), r.idx), r.value as f64)).collect();
    (m, outs)
}

#[test]
fn minilm_lowered_sketches_equal_the_native_kernel() {
    let a = MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let entries: Vec<String> = split_entries(&std::fs::read_to_string(&a.text).unwrap()).into_iter().take(16).collect();
    let opts = "hist_bins=16,hist_range=-8:8,elemsig=8";
    let (native, n_out) = record(&a, &entries, &format!("matmul{{{opts}}}"));
    let (lowered, l_out) = record(&a, &entries, &format!("matmul{{{opts},lower=true}}"));
    assert_eq!(n_out, l_out, "model outputs bit-identical");
    assert_eq!(n_out.len(), 2);
    // With a fixed histogram range every statistic is lowered: the same rows.
    assert_eq!(lowered.keys().collect::<Vec<_>>(), native.keys().collect::<Vec<_>>(), "the same rows");
    assert!(native.keys().any(|k| k.3 == "adj_sumsq"));
    let sites: std::collections::BTreeSet<&str> = lowered.keys().map(|k| k.0.as_str()).collect();
    assert_eq!(sites.len(), 24, "every MiniLM matmul");
    let exact = ["count", "nnz", "nan_count", "posinf_count", "neginf_count", "hist", "hist_outside", "hist_lo", "hist_hi", "elemsig", "min", "max", "chan_maxabs", "row_absmax"];
    let mut worst = 0f64;
    for (k, &l) in &lowered {
        let n = native[k];
        if exact.contains(&k.3.as_str()) {
            assert_eq!(l, n, "{k:?}");
            continue;
        }
        // mean: relative to mean|x| (the kernel's own accuracy statement where it cancels).
        let scale = if k.3 == "mean" {
            let at = |s: &str| native[&(k.0.clone(), k.1.clone(), k.2, s.to_string(), 0)];
            at("l1") / at("count")
        } else {
            n.abs()
        };
        let err = (l - n).abs() / scale;
        worst = worst.max(err);
        assert!(err <= 1e-5, "{k:?}: lowered {l}, native {n}");
    }
    eprintln!("largest relative difference: {worst:.2e} over {} rows", lowered.len());
}

/// Record `pipeline` natively and with `lower=true` appended to its options; returns both
/// recordings (outputs compared bit for bit) and the manifests' not-lowered entries.
fn record_probe(a: &MiniLmAssets, entries: &[String], native: &str, lowered: &str) -> (BTreeMap<Key, f64>, BTreeMap<Key, f64>) {
    let (n, n_out) = record(a, entries, native);
    let (l, l_out) = record(a, entries, lowered);
    assert_eq!(n_out, l_out, "{lowered}: model outputs bit-identical");
    (n, l)
}

/// Every native row is present lowered within 1e-5 relative (exact for `exact`), except the
/// statistics in `absent`, which are not recorded at all; no row only when lowered.
fn assert_probe_same(native: &BTreeMap<Key, f64>, lowered: &BTreeMap<Key, f64>, absent: &[&str], exact: &[&str]) -> f64 {
    let mut worst = 0f64;
    for (k, &n) in native {
        let got = lowered.get(k);
        if absent.contains(&k.3.as_str()) {
            assert!(got.is_none(), "{k:?}: not lowered, yet recorded");
            continue;
        }
        let l = *got.unwrap_or_else(|| panic!("{k:?}: recorded natively, missing when lowered"));
        if exact.contains(&k.3.as_str()) {
            assert_eq!(l, n, "{k:?}");
            continue;
        }
        let err = (l - n).abs() / n.abs();
        worst = worst.max(if err.is_nan() { 0.0 } else { err });
        assert!((l - n).abs() <= 1e-5 * n.abs(), "{k:?}: lowered {l}, native {n}");
    }
    for k in lowered.keys() {
        assert!(native.contains_key(k), "{k:?}: only when lowered");
    }
    worst
}

#[test]
fn minilm_lowered_probes_equal_the_native_kernels() {
    let a = MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let entries: Vec<String> = split_entries(&std::fs::read_to_string(&a.text).unwrap()).into_iter().take(16).collect();
    let (n, l) = record_probe(&a, &entries, "residual", "residual{lower=true}");
    let blocks: std::collections::BTreeSet<&str> = n.keys().map(|k| k.0.as_str()).collect();
    assert_eq!(blocks.len(), 6, "every residual block of the 3-layer MiniLM (attention, MLP): {blocks:?}");
    let worst = assert_probe_same(&n, &l, &[], &["rows", "out_chan_absmax", "out_median_abs", "out_top"]);
    assert!(n.keys().any(|k| k.3 == "out_top") && n.keys().any(|k| k.3 == "out_median_abs"));
    eprintln!("residual: largest relative difference {worst:.2e} over {} rows", l.len());

    let (n, l) = record_probe(&a, &entries, "attn{topk=4}", "attn{topk=4,lower=true}");
    let sites: std::collections::BTreeSet<&str> = n.keys().map(|k| k.0.as_str()).collect();
    assert_eq!(sites.len(), 3, "every attention of the 3-layer MiniLM: {sites:?}");
    let stats: std::collections::BTreeSet<&str> = n.keys().map(|k| k.3.as_str()).collect();
    assert!(stats.len() >= 14, "{stats:?}");
    let worst = assert_probe_same(&n, &l, &[], &["queries", "keys", "topk"]);
    eprintln!("attn: largest relative difference {worst:.2e} over {} rows", l.len());
}
