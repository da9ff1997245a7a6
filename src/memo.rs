//! A memo guard: a compiled program behind a content-hash cache of its outputs.
//!
//! When the miner reports an exact repeat (the same input tensor in many runs: a fixed prompt
//! prefix, a retried request, a sentence seen before), the kernel it justifies is memoization.
//! [`MemoGuard`] is that kernel, measured: each run's inputs (names, dtypes and bytes, in order)
//! are hashed with XXH3-128; on a hit the stored inputs are compared byte for byte with the new
//! ones (full verification: a hash collision is counted and treated as a miss, never served),
//! and the stored outputs are returned without running the program. Entries are evicted least
//! recently used beyond `capacity` entries (the `lru` crate). The hit rate it reports is
//! checked against the repeat rate a recording predicts ([`crate::mine::repeat_rate`]).
//!
//! What a guard may wrap: a program whose outputs are a function of its inputs and parameters.
//! A graph with a nondeterministic op (dropout, random sampling) is refused at construction;
//! [`MemoGuard::invalidate`] must be called when a parameter changes (`set_param`): the guard
//! cannot see parameter writes made around it.

use std::num::NonZeroUsize;

use lru::LruCache;
use rlx_ir::{DType, Graph};
use serde::Serialize;
use xxhash_rust::xxh3::Xxh3;

/// One typed buffer as `run_typed` returns it: little-endian bytes and the dtype.
pub type Typed = (Vec<u8>, DType);

/// Counts of a guard's lookups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemoStats {
    /// Runs answered from the cache (inputs verified equal byte for byte).
    pub hits: u64,
    /// Runs that ran the program (no entry, or a collision).
    pub misses: u64,
    /// Lookups whose hash matched an entry whose inputs differ (served as misses).
    pub collisions: u64,
    /// Entries evicted to stay within the capacity.
    pub evictions: u64,
}

impl MemoStats {
    /// hits / (hits + misses); `None` before the first run.
    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }
}

struct Entry {
    inputs: Vec<(String, Vec<u8>, DType)>,
    outputs: Vec<Typed>,
}

/// A content-hash memo of one compiled program's outputs, bounded to `capacity` entries (LRU).
pub struct MemoGuard {
    cache: LruCache<u128, Entry>,
    stats: MemoStats,
    hasher: fn(&[(&str, &[u8], DType)]) -> u128,
}

/// XXH3-128 of the inputs: per input its name, dtype, byte length and bytes.
pub fn content_hash(inputs: &[(&str, &[u8], DType)]) -> u128 {
    content_hasher(inputs).digest128()
}

/// The XXH3 state after the content stream of `inputs`: per input, in order, the name's length
/// (u64 LE), the name, the dtype (`F32`, `I64`, ...), the byte length (u64 LE) and the bytes.
/// [`content_hash`] takes its 128-bit digest, the sampling gate its 64-bit one.
pub(crate) fn content_hasher(inputs: &[(&str, &[u8], DType)]) -> Xxh3 {
    let mut h = Xxh3::new();
    for (name, bytes, dtype) in inputs {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(format!("{dtype:?}").as_bytes());
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h
}

/// Hits a [`MemoGuard`] of `capacity` entries would have over a sequence of input ids (equal
/// ids: byte-identical inputs), simulated with the same LRU policy: the prediction a recording
/// makes ([`crate::mine::fingerprints`] gives the ids).
pub fn predicted_hits(ids: &[usize], capacity: NonZeroUsize) -> u64 {
    let mut cache: LruCache<usize, ()> = LruCache::new(capacity);
    ids.iter().filter(|&&k| cache.put(k, ()).is_some()).count() as u64
}

impl MemoGuard {
    /// A guard for programs compiled from `graph`, holding at most `capacity` entries.
    ///
    /// Errors: the graph holds a nondeterministic op (its outputs are not a function of its
    /// inputs, so a cached answer would be wrong); the message names the op.
    pub fn new(graph: &Graph, capacity: NonZeroUsize) -> Result<MemoGuard, String> {
        if let Some(n) = graph.nodes().iter().find(|n| n.op.is_nondeterministic()) {
            return Err(format!(
                "graph '{}' holds the nondeterministic op %{} ({}): its outputs are not a function of its inputs, so it cannot be memoized",
                graph.name, n.id.0, n.op
            ));
        }
        Ok(MemoGuard { cache: LruCache::new(capacity), stats: MemoStats::default(), hasher: content_hash })
    }

    /// Replace the hash function (tests plant collisions with a constant hash to check that
    /// full verification never serves another input's outputs).
    pub fn with_hasher(mut self, hasher: fn(&[(&str, &[u8], DType)]) -> u128) -> MemoGuard {
        self.hasher = hasher;
        self
    }

    /// The outputs for `inputs`: from the cache when an entry's inputs equal them byte for
    /// byte, else from `run` (whose outputs are then stored, evicting the least recently used
    /// entry beyond the capacity). `run` is typically `|i| compiled.run_typed(i)`.
    pub fn run(&mut self, inputs: &[(&str, &[u8], DType)], run: impl FnOnce(&[(&str, &[u8], DType)]) -> Vec<Typed>) -> Vec<Typed> {
        let key = (self.hasher)(inputs);
        if let Some(e) = self.cache.get(&key) {
            let same = e.inputs.len() == inputs.len()
                && e.inputs.iter().zip(inputs).all(|((n, b, d), (n2, b2, d2))| n == n2 && d == d2 && b.as_slice() == *b2);
            if same {
                self.stats.hits += 1;
                return e.outputs.clone();
            }
            self.stats.collisions += 1;
        }
        self.stats.misses += 1;
        let outputs = run(inputs);
        let entry = Entry { inputs: inputs.iter().map(|(n, b, d)| (n.to_string(), b.to_vec(), *d)).collect(), outputs: outputs.clone() };
        if let Some((old, _)) = self.cache.push(key, entry) {
            // `push` returns the replaced entry of the same key too (a collision): not an eviction.
            if old != key {
                self.stats.evictions += 1;
            }
        }
        outputs
    }

    /// Drop every entry (call after `set_param`: cached outputs were computed with the old
    /// parameters). Counts are kept.
    pub fn invalidate(&mut self) {
        self.cache.clear();
    }

    /// Lookup counts so far.
    pub fn stats(&self) -> MemoStats {
        self.stats
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}
