//! Mergeable online state per site: quantiles of |x| (DDSketch) and the number of distinct
//! tensors (HyperLogLog++), for production recording where rows per run are too many.
//!
//! With `online` in the pipeline (`sample{every=16},online,matmul`), every native tensor sketch
//! also feeds, on the runs it computes (the sampled ones), the state of its `site/role`:
//! - a DDSketch (Masson, Rim and Lee, VLDB 2019; crate `sketches-ddsketch`, the port of
//!   DataDog's sketches-java) of |x| over the finite elements, relative accuracy
//!   [`ALPHA`] = 1%: a quantile it returns is within 1% (relative) of the exact quantile of
//!   the values added (rank `floor(q (n - 1))` of the sorted values), bounded to
//!   [`MAX_BINS`] bins per sign (about e^41 of dynamic range before the lowest bins collapse;
//!   magnitudes at or below 1e-9 are counted as zero);
//! - a HyperLogLog++ (Heule, Nunkesser and Hall, EDBT 2013; crate `hyperloglogplus`) of the
//!   tensor's XXH3-64 content hash, precision [`HLL_PRECISION`] (m = 2^14 registers, standard
//!   error 1.04 / sqrt(m) = 0.81%; exact-ish in its sparse mode at small counts).
//!
//! Both merge: sketches built on different threads or processes merge into the sketch one pass
//! over all the data builds (DDSketch: the same bins and counts; HLL++: register-wise max).
//! The kernels of every thread merge their per-tensor sketch into one process-wide state
//! ([`take`], [`snapshot`]); [`OnlineState::merge`] merges states, [`OnlineState::write`] /
//! [`OnlineState::read`] store them as JSON (serde), written to a temp name and renamed.
//! Size per site is bounded: at most 2 x [`MAX_BINS`] DDSketch bins and 2^14 HLL registers
//! (about 70 KB of JSON at worst; a few KB for a typical activation).

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::Mutex;

use hyperloglogplus::{HyperLogLog, HyperLogLogPlus};
use serde::{Deserialize, Serialize};
use sketches_ddsketch::{Config, DDSketch};

/// DDSketch relative accuracy (1%).
pub const ALPHA: f64 = 0.01;
/// DDSketch bins per sign (the crate's default bound).
pub const MAX_BINS: u32 = 2048;
/// Magnitudes at or below this are counted as zero (the crate's default).
pub const MIN_VALUE: f64 = 1e-9;
/// HyperLogLog++ precision p (m = 2^p registers).
pub const HLL_PRECISION: u8 = 14;

/// The hasher HLL++ applies to the content hashes it is given (XXH3-64, seed 0). A unit type
/// so that the sketch serializes.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Xxh3Builder;

impl BuildHasher for Xxh3Builder {
    type Hasher = xxhash_rust::xxh3::Xxh3;
    fn build_hasher(&self) -> Self::Hasher {
        xxhash_rust::xxh3::Xxh3::new()
    }
}

/// Quantiles and distinct count of one site and role.
#[derive(Clone, Serialize, Deserialize)]
pub struct SiteState {
    /// DDSketch of |x| over the finite elements of every tensor added.
    pub magnitudes: DDSketch,
    /// HyperLogLog++ of the tensors' XXH3-64 content hashes.
    pub distinct: HyperLogLogPlus<u64, Xxh3Builder>,
    /// Tensors added.
    pub tensors: u64,
}

impl std::fmt::Debug for SiteState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SiteState {{ tensors: {}, values: {} }}", self.tensors, self.magnitudes.count())
    }
}

impl Default for SiteState {
    fn default() -> Self {
        SiteState {
            magnitudes: DDSketch::new(Config::new(ALPHA, MAX_BINS, MIN_VALUE)),
            distinct: HyperLogLogPlus::new(HLL_PRECISION, Xxh3Builder).expect("precision 14 is in 4..=18"),
            tensors: 0,
        }
    }
}

/// What a site's state says about clipping: quantiles of |x| and the headroom of the absmax
/// over p99.9 (how much of an absmax int8 range only the top 0.1% of magnitudes use).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Quantiles {
    /// Median |x| (within [`ALPHA`] relative).
    pub p50: f64,
    /// 99th percentile of |x| (within [`ALPHA`]).
    pub p99: f64,
    /// 99.9th percentile of |x| (within [`ALPHA`]).
    pub p999: f64,
    /// max |x| (exact).
    pub absmax: f64,
    /// absmax / p99.9 (no unit; 1 = no tail above p99.9). `None` when p99.9 is 0.
    pub headroom: Option<f64>,
}

impl SiteState {
    /// Add one tensor: |x| of every finite element to the DDSketch, `content_hash` (XXH3-64 of
    /// the tensor's bytes) to the HLL++.
    pub fn add(&mut self, values: &[f32], content_hash: u64) {
        for &x in values {
            if x.is_finite() {
                self.magnitudes.add(x.abs() as f64);
            }
        }
        self.distinct.insert(&content_hash);
        self.tensors += 1;
    }

    /// Merge `other` into this state.
    ///
    /// Errors: the states were built with different parameters (another alpha, bin bound or
    /// HLL precision).
    pub fn merge(&mut self, other: &SiteState) -> Result<(), String> {
        self.magnitudes.merge(&other.magnitudes).map_err(|e| format!("DDSketch merge: {e}"))?;
        self.distinct.merge(&other.distinct).map_err(|e| format!("HyperLogLog++ merge: {e:?}"))?;
        self.tensors += other.tensors;
        Ok(())
    }

    /// Quantiles of |x| and the clipping headroom; `None` before any finite value.
    pub fn quantiles(&self) -> Option<Quantiles> {
        let q = |p: f64| self.magnitudes.quantile(p).ok().flatten();
        let (p50, p99, p999, absmax) = (q(0.5)?, q(0.99)?, q(0.999)?, self.magnitudes.max()?);
        Some(Quantiles { p50, p99, p999, absmax, headroom: (p999 > 0.0).then(|| absmax / p999) })
    }

    /// Estimated number of distinct tensors added (HLL++; within 3 x 1.04 / sqrt(2^14) = 2.4%
    /// relative with probability above 99%).
    pub fn distinct(&self) -> f64 {
        self.distinct.clone().count()
    }
}

/// Per `site/role`, its state.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct OnlineState {
    /// States by `site/role`.
    pub sites: BTreeMap<String, SiteState>,
}

impl OnlineState {
    /// Merge every site of `other` into this state (a site only `other` has is copied).
    ///
    /// Errors: as [`SiteState::merge`], naming the site.
    pub fn merge(&mut self, other: &OnlineState) -> Result<(), String> {
        for (k, v) in &other.sites {
            self.sites.entry(k.clone()).or_default().merge(v).map_err(|e| format!("site {k}: {e}"))?;
        }
        Ok(())
    }

    /// Write as JSON to `path`: to `<path>.partial`, synced, then renamed (never a truncated
    /// file at `path`).
    ///
    /// Errors: the file cannot be written or renamed (the message names the path).
    pub fn write(&self, path: &Path) -> Result<(), String> {
        let tmp = path.with_extension(format!("{}partial", path.extension().map(|e| format!("{}.", e.to_string_lossy())).unwrap_or_default()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            serde_json::to_writer(&mut f, self).map_err(std::io::Error::other)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| format!("online state {}: {e}", path.display()))
    }

    /// Read a state [`OnlineState::write`] wrote.
    ///
    /// Errors: the file cannot be read or is not an online state (the message names the path).
    pub fn read(path: &Path) -> Result<OnlineState, String> {
        let text = std::fs::read(path).map_err(|e| format!("online state {}: {e}", path.display()))?;
        serde_json::from_slice(&text).map_err(|e| format!("online state {}: not an opscope online state: {e}", path.display()))
    }
}

static GLOBAL: Mutex<Option<OnlineState>> = Mutex::new(None);

/// Called by the sketch kernel for a tensor whose spec names an online key: one local
/// [`SiteState`] for the tensor, merged into the process-wide state under a short lock.
pub(crate) fn observe(key: &str, values: &[f32]) {
    let bytes = crate::bytes::f32_bytes(values);
    let mut local = SiteState::default();
    local.add(values, xxhash_rust::xxh3::xxh3_64(bytes));
    if let Ok(mut g) = GLOBAL.lock() {
        let state = g.get_or_insert_with(OnlineState::default);
        // Same parameters by construction: a merge cannot fail.
        let _ = state.sites.entry(key.to_string()).or_default().merge(&local);
    }
}

/// Where a recording's online state is written: `<recording>.online.json` beside it (the
/// environment mode and `opscope record` write it when the pipeline holds `online`).
pub fn state_path(recording: &std::path::Path) -> std::path::PathBuf {
    let mut p = recording.as_os_str().to_os_string();
    p.push(".online.json");
    std::path::PathBuf::from(p)
}

/// True if `pipeline` holds the `online` setting.
pub fn enabled(pipeline: &crate::Pipeline) -> bool {
    pipeline.instances().iter().any(|i| i.pass.name() == "online")
}

/// A copy of the process-wide state (every thread's kernels merged).
pub fn snapshot() -> OnlineState {
    GLOBAL.lock().ok().and_then(|g| g.clone()).unwrap_or_default()
}

/// Take the process-wide state, leaving it empty.
pub fn take() -> OnlineState {
    GLOBAL.lock().ok().and_then(|mut g| g.take()).unwrap_or_default()
}
