//! Whole-tensor capture: what the `capture` tap pass appends is written here, as numpy `.npy`
//! files (one per tensor and run, read with `numpy.load`), never as rows.
//!
//! Layout of a capture directory (`<recording>.capture/` next to a file recording):
//!
//! ```text
//! manifest.json                      CaptureManifest (serde): what was captured and skipped
//! c<compile>-run<step>/<k>.npy       one tensor: F32, C order, the tensor's static dims
//! ```
//!
//! Every file is written to `<name>.partial` and renamed into place, and `manifest.json` is
//! rewritten (also through a rename) after each run, so a crash never leaves a truncated file
//! listed. Sampling: a run is captured when its step (0-based, per compile) is a multiple of
//! the pass's `every`. A weight (a tensor of parameters and constants only) is written once per
//! compile. Budget: the pass's byte budget covers the whole recording; the first tensor that
//! would exceed it stops that pass's capture for good (the sketches go on), is listed in
//! `skipped` with every later one, and is said once on stderr.

use std::collections::{HashMap, HashSet};
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::manifest::Manifest;

/// The `manifest.json` of a capture directory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CaptureManifest {
    /// The recording id (`run_id` column of the rows recorded alongside).
    pub recording: String,
    /// File format of every tensor: `npy` (numpy's format, version 1, little-endian `<f4`).
    pub format: String,
    /// Tensors written, in the order written.
    pub captured: Vec<Captured>,
    /// Tensors a sampled run held that were not written (the byte budget ran out), in order.
    pub skipped: Vec<NotCaptured>,
    /// Per capture pass of the pipeline: its budget and what it used.
    pub budgets: Vec<Budget>,
}

/// One tensor written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Captured {
    /// Site name (as in the recording's `site` column).
    pub site: String,
    /// Op of the site (`matmul`, `fused_matmul_bias_act`, ...).
    pub op: String,
    /// Role of the tensor at the site (`lhs`, `rhs`, `out`).
    pub role: String,
    /// Compile number in the recording (the `compile` column).
    pub compile: u32,
    /// The run's step within its compile (the `step` column).
    pub run: u64,
    /// Dims of the tensor (C order).
    pub shape: Vec<usize>,
    /// Element type: always `f32`.
    pub dtype: String,
    /// Bytes of tensor data (numel x 4; the `.npy` header adds 128).
    pub bytes: u64,
    /// Path of the `.npy` file, relative to the capture directory.
    pub file: String,
    /// A weight (parameters and constants only): written once per compile, valid for every
    /// run of that compile.
    pub invariant: bool,
}

/// One tensor not written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotCaptured {
    /// Site name.
    pub site: String,
    /// Role.
    pub role: String,
    /// Compile number.
    pub compile: u32,
    /// Step.
    pub run: u64,
    /// Bytes it would have taken.
    pub bytes: u64,
    /// Why.
    pub reason: String,
}

/// A capture pass's byte budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    /// Position of the pass in the pipeline.
    pub pass_idx: usize,
    /// Budget in bytes (tensor data), as stated in the pipeline text.
    pub budget: u64,
    /// Bytes written so far.
    pub used: u64,
    /// The budget ran out: nothing more is captured by this pass.
    pub exhausted: bool,
}

/// Parse a byte size: an integer with an optional binary unit, `B`, `KiB`, `MiB` or `GiB`
/// (`64MiB` = 67108864).
///
/// Errors: anything else, with the accepted forms.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(format!("bad byte size '{text}': write an integer with an optional unit B, KiB, MiB or GiB (64MiB)")),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad byte size '{text}': write an integer with an optional unit B, KiB, MiB or GiB (64MiB)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("byte size '{text}' overflows 64 bits"))
}

/// Budget and sampling state of the tensors a recorder captures (kept on the run's side, so a
/// tensor that is not written is dropped at once).
#[derive(Default)]
pub(crate) struct Selector {
    used: HashMap<usize, u64>,
    exhausted: HashSet<usize>,
    /// (compile tag, capture index) of weights already written.
    weights_done: HashSet<(u32, usize)>,
}

/// A tensor to write, or one the budget refused.
pub(crate) enum Pick {
    Write { index: usize, data: Vec<f32> },
    Skip { index: usize, reason: String },
}

impl Selector {
    /// What to do with the captured outputs `caps` (in [`Manifest::captures`] order) of run
    /// `step` of the compile `m`.
    pub(crate) fn pick(&mut self, m: &Manifest, step: u64, caps: Vec<Vec<f32>>) -> Vec<Pick> {
        let mut picks = Vec::new();
        for (index, (c, data)) in m.captures.iter().zip(caps).enumerate() {
            if step % c.every.max(1) != 0 {
                continue;
            }
            if c.invariant && self.weights_done.contains(&(m.tag, index)) {
                continue;
            }
            let bytes = 4 * data.len() as u64;
            if self.exhausted.contains(&c.pass_idx) {
                picks.push(Pick::Skip { index, reason: format!("byte budget {} of capture pass #{} ran out", c.budget, c.pass_idx) });
                continue;
            }
            let used = self.used.entry(c.pass_idx).or_default();
            if *used + bytes > c.budget {
                self.exhausted.insert(c.pass_idx);
                eprintln!(
                    "opscope: capture (pass #{}) stops: {}/{} of run {step} needs {bytes} bytes and {} of the {}-byte budget are \
                     used; sketches are still recorded, the capture manifest lists what was skipped",
                    c.pass_idx, c.site, c.role, *used, c.budget
                );
                picks.push(Pick::Skip { index, reason: format!("byte budget {} of capture pass #{} ran out", c.budget, c.pass_idx) });
                continue;
            }
            *used += bytes;
            if c.invariant {
                self.weights_done.insert((m.tag, index));
            }
            picks.push(Pick::Write { index, data });
        }
        picks
    }
}

/// The capture directory being written (owned by the recorder's writer thread).
pub(crate) struct Store {
    dir: PathBuf,
    manifest: CaptureManifest,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |error| Error::Io { path: path.to_path_buf(), error }
}

/// Write `bytes` to `path` through `<path>.partial` and a rename.
fn write_atomic(path: &Path, write: impl FnOnce(&mut BufWriter<std::fs::File>) -> std::io::Result<()>) -> Result<(), Error> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut w = BufWriter::new(file);
    write(&mut w).map_err(io(&tmp))?;
    let file = w.into_inner().map_err(|e| Error::Io { path: tmp.clone(), error: e.into_error() })?;
    file.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

impl Store {
    /// Create the capture directory `dir` (it must not hold a capture already).
    ///
    /// Errors: `dir` holds a `manifest.json` (an earlier capture: remove it or record to
    /// another path), or cannot be created.
    pub(crate) fn create(dir: &Path, recording: &str) -> Result<Store, Error> {
        if dir.join("manifest.json").exists() {
            return Err(Error::Capture {
                path: dir.to_path_buf(),
                why: "already holds a capture (manifest.json): remove the directory or record to another path".into(),
            });
        }
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        Ok(Store {
            dir: dir.to_path_buf(),
            manifest: CaptureManifest { recording: recording.to_string(), format: "npy".into(), ..Default::default() },
        })
    }

    /// Write the picks of one run and the updated `manifest.json`.
    pub(crate) fn write(&mut self, m: &Manifest, step: u64, picks: Vec<Pick>) -> Result<(), Error> {
        let run_dir = format!("c{}-run{}", m.compile, step);
        for c in m.captures.iter() {
            if !self.manifest.budgets.iter().any(|b| b.pass_idx == c.pass_idx) {
                self.manifest.budgets.push(Budget { pass_idx: c.pass_idx, budget: c.budget, used: 0, exhausted: false });
            }
        }
        for pick in picks {
            match pick {
                Pick::Write { index, data } => {
                    let c = &m.captures[index];
                    let rel = format!("{run_dir}/{index}.npy");
                    std::fs::create_dir_all(self.dir.join(&run_dir)).map_err(io(&self.dir))?;
                    let path = self.dir.join(&rel);
                    let shape: Vec<u64> = c.dims.iter().map(|&d| d as u64).collect();
                    write_atomic(&path, |w| {
                        use npyz::WriterBuilder;
                        let mut out = npyz::WriteOptions::<f32>::new().default_dtype().shape(&shape).writer(w).begin_nd()?;
                        out.extend(data.iter().copied())?;
                        out.finish()
                    })?;
                    let bytes = 4 * data.len() as u64;
                    if let Some(b) = self.manifest.budgets.iter_mut().find(|b| b.pass_idx == c.pass_idx) {
                        b.used += bytes;
                    }
                    self.manifest.captured.push(Captured {
                        site: c.site.clone(),
                        op: m.site_of(&c.site, c.pass_idx).map(|s| s.op.clone()).unwrap_or_default(),
                        role: c.role.as_str().to_string(),
                        compile: m.compile,
                        run: step,
                        shape: c.dims.clone(),
                        dtype: "f32".into(),
                        bytes,
                        file: rel,
                        invariant: c.invariant,
                    });
                }
                Pick::Skip { index, reason } => {
                    let c = &m.captures[index];
                    if let Some(b) = self.manifest.budgets.iter_mut().find(|b| b.pass_idx == c.pass_idx) {
                        b.exhausted = true;
                    }
                    self.manifest.skipped.push(NotCaptured {
                        site: c.site.clone(),
                        role: c.role.as_str().to_string(),
                        compile: m.compile,
                        run: step,
                        bytes: 4 * c.dims.iter().product::<usize>() as u64,
                        reason,
                    });
                }
            }
        }
        let json = serde_json::to_vec_pretty(&self.manifest).map_err(|e| Error::Internal(format!("capture manifest: {e}")))?;
        write_atomic(&self.dir.join("manifest.json"), |w| std::io::Write::write_all(w, &json))
    }
}

/// Read the `manifest.json` of the capture directory `dir`.
///
/// Errors: missing (not a capture directory: pass `<recording>.capture`) or malformed.
pub fn read_manifest(dir: &Path) -> Result<CaptureManifest, Error> {
    let path = dir.join("manifest.json");
    let bytes = std::fs::read(&path).map_err(|e| Error::Capture {
        path: path.clone(),
        why: format!("{e}: not a capture directory (pass the `<recording>.capture` directory a capture pass wrote)"),
    })?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Capture { path, why: format!("not a capture manifest: {e}") })
}

/// Read one captured tensor: its values in C order. The file's shape must be the entry's.
///
/// Errors: the file is missing, not an f32 `.npy`, or its shape differs from the manifest's.
pub fn read_tensor(dir: &Path, entry: &Captured) -> Result<Vec<f32>, Error> {
    let path = dir.join(&entry.file);
    let bad = |why: String| Error::Capture { path: path.clone(), why };
    let file = std::fs::File::open(&path).map_err(io(&path))?;
    let npy = npyz::NpyFile::new(std::io::BufReader::new(file)).map_err(|e| bad(format!("not a .npy file: {e}")))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    if shape != entry.shape {
        return Err(bad(format!("shape {shape:?}, the capture manifest says {:?}", entry.shape)));
    }
    npy.into_vec::<f32>().map_err(|e| bad(format!("not an f32 array: {e}")))
}
