//! MiniLM with the `matmul` tap's sketches lowered into RLX primitive ops
//! (`matmul{lower=true}`, what a device without a native sketch kernel runs) records the native
//! CPU kernel's statistics, padding rows excluded by both, and leaves the model's outputs
//! bit-identical.

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
