//! MiniLM activations recorded with padding excluded do not depend on how much padding there is:
//! the same sentences at --seq 32 and --seq 64 give the same per-token statistics.

use std::collections::BTreeMap;

use opscope::{MemorySink, Pipeline};
use opscope_lab::model::{split_entries, Job, MiniLmAssets, TextEncoder};

/// (site, role, step, stat) -> values, for the activations with one row per token ([B,S,*]).
fn record(a: &MiniLmAssets, entries: &[String], seq: usize, padding: &str) -> BTreeMap<(String, String, u64, String), Vec<f64>> {
    let job = Job::new(&a.onnx, &a.tokenizer, entries.to_vec(), 8, seq).unwrap();
    let p = Pipeline::parse(&format!("matmul{{roles=[lhs,out],stats=[mean,min,max,chan_maxabs],padding={padding}}}")).unwrap();
    let sink = MemorySink::default();
    job.run(&p, opscope::Stage::Deployed, Box::new(sink.clone()), |_, _| Ok(())).unwrap();
    let mut out: BTreeMap<(String, String, u64, String), Vec<f64>> = BTreeMap::new();
    for r in sink.rows() {
        // Per-token tensors are rank 3 [B, S, width]; attention's per-head operands are rank 4.
        if r.shape.split(',').count() != 3 {
            continue;
        }
        let v = out.entry((r.site.to_string(), r.role.to_string(), r.step, r.stat.to_string())).or_default();
        if v.len() <= r.idx as usize {
            v.resize(r.idx as usize + 1, f64::NAN);
        }
        v[r.idx as usize] = r.value as f64;
    }
    out
}

#[test]
fn per_token_statistics_agree_at_seq_32_and_64() {
    let a = MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let all = split_entries(&std::fs::read_to_string(&a.text).unwrap());
    // Sentences that fit in 32 tokens, so truncation does not differ between the two lengths.
    let enc = TextEncoder::load(&a.tokenizer, 64).unwrap();
    let short: Vec<String> = all
        .into_iter()
        .filter(|t| enc.encode(std::slice::from_ref(t)).unwrap().mask.iter().sum::<i64>() <= 32)
        .take(16)
        .collect();
    assert_eq!(short.len(), 16);
    let (s32, s64) = (record(&a, &short, 32, "exclude"), record(&a, &short, 64, "exclude"));
    assert_eq!(s32.keys().collect::<Vec<_>>(), s64.keys().collect::<Vec<_>>(), "the same site/role/step/stat rows");
    assert!(s32.len() >= 2 * 8 * 4, "per-token sites recorded: {}", s32.len());
    let mut worst = 0f64;
    for (k, a) in &s32 {
        let b = &s64[k];
        assert_eq!(a.len(), b.len(), "{k:?}");
        // Relative to the tensor's scale (a mean near 0 is compared with the absmax's scale).
        let scale = s32[&(k.0.clone(), k.1.clone(), k.2, "max".to_string())][0]
            .abs()
            .max(s32[&(k.0.clone(), k.1.clone(), k.2, "min".to_string())][0].abs());
        for (x, y) in a.iter().zip(b) {
            let err = (x - y).abs() / scale;
            worst = worst.max(err);
            assert!(err <= 1e-4, "{k:?}: {x} at seq 32, {y} at seq 64");
        }
    }
    eprintln!("largest difference relative to the tensor's absmax: {worst:.2e}");
    // With the padding rows counted the means do move with the padding (the check can fail).
    let (i32_, i64_) = (record(&a, &short, 32, "include"), record(&a, &short, 64, "include"));
    let moved = i32_.iter().filter(|(k, v)| k.3 == "mean" && (v[0] - i64_[*k][0]).abs() > 1e-3 * v[0].abs().max(1e-3)).count();
    assert!(moved > 10, "only {moved} means moved with padding=include");
}
