//! `opscope memo`: a memo guard on a real model, its hit rate against the one a recording
//! predicts, and its time against the unguarded program.
//!
//! A pool of `P` distinct batches is replayed for `T` runs in a seeded random order that uses
//! every batch at least once. First the replay is recorded with `matmul{stats=[sumsq,elemsig]}`
//! (no guard): each run's fingerprint is the tuple of its per-site fingerprints
//! ([`opscope::mine::fingerprints`]), and an LRU simulation of those ids
//! ([`opscope::memo::predicted_hits`]) is the predicted hit count at the guard's capacity
//! (`T - P` with room for the pool). Then the same replay runs through a
//! [`opscope::memo::MemoGuard`], each guarded run followed by an unguarded run of the same batch
//! (interleaved, so drift in machine load hits both alike): measured hits, outputs compared bit
//! for bit, and per-run times.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use rlx_ir::DType;
use rlx_runtime::{Device, Session};
use serde::Serialize;

use crate::model::{Encoded, OnnxEncoder};

/// The outcome of a replay.
#[derive(Debug, Clone, Serialize)]
pub struct MemoReport {
    /// Distinct batches in the pool.
    pub pool: usize,
    /// Runs replayed.
    pub runs: usize,
    /// Guard capacity (entries).
    pub capacity: usize,
    /// Distinct run fingerprints in the recording (equals `pool` unless two batches are equal
    /// or collide on every recorded value).
    pub recorded_distinct: usize,
    /// Sites whose fingerprints were combined.
    pub sites: usize,
    /// Hits the recording predicts at this capacity.
    pub predicted_hits: u64,
    /// Lookup counts of the guard.
    pub measured: opscope::memo::MemoStats,
    /// Every guarded output equal bit for bit to the unguarded run of the same batch.
    pub bit_identical: bool,
    /// Median unguarded run time, ms.
    pub plain_ms: f64,
    /// Median guarded run time on a hit, ms (None without hits).
    pub hit_ms: Option<f64>,
    /// Median guarded run time on a miss, ms (None without misses).
    pub miss_ms: Option<f64>,
    /// Total guarded time / total unguarded time over the replay.
    pub time_ratio: f64,
}

/// A replay order of `runs` runs over `pool` batches using each at least once (seeded).
pub fn replay_order(pool: usize, runs: usize, seed: u64) -> Result<Vec<usize>> {
    if pool == 0 || runs < pool {
        bail!("--runs ({runs}) must be at least --pool ({pool}), and the pool not empty: every batch of the pool is replayed at least once");
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..pool).collect();
    order.extend((pool..runs).map(|_| rng.gen_range(0..pool)));
    for i in (1..order.len()).rev() {
        order.swap(i, rng.gen_range(0..=i));
    }
    Ok(order)
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Record, predict, then replay through a guard (see the module docs).
///
/// Errors: a run fails; the recording holds no content statistic.
pub fn replay(model: &OnnxEncoder, pool: &[Encoded], order: &[usize], capacity: NonZeroUsize) -> Result<MemoReport> {
    let session = Session::new(Device::Cpu);
    // 1. The recording of the whole replay, no guard.
    let sink = opscope::MemorySink::default();
    let pipeline: opscope::Pipeline = "matmul{stats=[sumsq,elemsig]}".parse().expect("a valid pipeline");
    opscope::scope(&pipeline, Box::new(sink.clone()), || -> Result<()> {
        let mut c = model.compile(&session)?;
        for &k in order {
            model.run(&mut c, &pool[k])?;
        }
        Ok(())
    })
    .context("recording the replay")??;
    let series = opscope::mine::series_from_rows(&sink.rows());
    let per_site: Vec<Vec<usize>> = series.values().filter_map(opscope::mine::fingerprints).filter(|ids| ids.len() == order.len()).collect();
    if per_site.is_empty() {
        bail!("the recording of the replay holds no site with one fingerprint per run");
    }
    let mut combined: HashMap<Vec<usize>, usize> = HashMap::new();
    let ids: Vec<usize> = (0..order.len())
        .map(|r| {
            let key: Vec<usize> = per_site.iter().map(|s| s[r]).collect();
            let next = combined.len();
            *combined.entry(key).or_insert(next)
        })
        .collect();
    let predicted_hits = opscope::memo::predicted_hits(&ids, capacity);

    // 2. The guard, each guarded run followed by an unguarded one.
    let mut c = model.compile(&session)?;
    let mut guard = opscope::memo::MemoGuard::new(&model.graph, capacity).map_err(anyhow::Error::msg)?;
    let (mut plain, mut hit, mut miss) = (Vec::new(), Vec::new(), Vec::new());
    let mut bit_identical = true;
    for &k in order {
        let owned = model.inputs(&pool[k])?;
        let inputs: Vec<(&str, &[u8], DType)> = owned.iter().map(|(n, b, d)| (n.as_str(), b.as_slice(), *d)).collect();
        let before = guard.stats().hits;
        let t = Instant::now();
        let got = guard.run(&inputs, |i| c.run_typed(i));
        let guarded_ms = t.elapsed().as_secs_f64() * 1e3;
        if guard.stats().hits > before { hit.push(guarded_ms) } else { miss.push(guarded_ms) }
        let t = Instant::now();
        let want = c.run_typed(&inputs);
        plain.push(t.elapsed().as_secs_f64() * 1e3);
        bit_identical &= got == want;
    }
    let guarded_total: f64 = hit.iter().chain(&miss).sum();
    let plain_total: f64 = plain.iter().sum();
    Ok(MemoReport {
        pool: pool.len(),
        runs: order.len(),
        capacity: capacity.get(),
        recorded_distinct: combined.len(),
        sites: per_site.len(),
        predicted_hits,
        measured: guard.stats(),
        bit_identical,
        plain_ms: median(&mut plain).unwrap_or(f64::NAN),
        hit_ms: median(&mut hit),
        miss_ms: median(&mut miss),
        time_ratio: guarded_total / plain_total,
    })
}

impl MemoReport {
    /// The report as text.
    pub fn text(&self) -> String {
        let rate = |h: u64| h as f64 / self.runs as f64;
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.3} ms"));
        format!(
            "memo guard: {} runs over a pool of {} batches, capacity {}\n\
             recorded: {} distinct fingerprints over {} sites -> predicted hits {} (rate {:.4})\n\
             measured: hits {} (rate {:.4}), misses {}, collisions {}, evictions {}; outputs bit-identical to unguarded runs: {}\n\
             time (interleaved, medians): unguarded {:.3} ms, guarded hit {}, guarded miss {}; total guarded / unguarded {:.3}x\n",
            self.runs,
            self.pool,
            self.capacity,
            self.recorded_distinct,
            self.sites,
            self.predicted_hits,
            rate(self.predicted_hits),
            self.measured.hits,
            rate(self.measured.hits),
            self.measured.misses,
            self.measured.collisions,
            self.measured.evictions,
            self.bit_identical,
            self.plain_ms,
            ms(self.hit_ms),
            ms(self.miss_ms),
            self.time_ratio
        )
    }
}
