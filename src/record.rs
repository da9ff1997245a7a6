//! The recorder: turns the extra outputs of a tapped run into rows, using the manifest of the
//! compile that produced them, and hands them to a sink.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::capture::{Pick, Selector, Store};
use crate::error::Error;
use crate::manifest::Manifest;
use crate::recording::{Block, Sink};
use crate::sketch::{tensor, Stat};

type Use = (Arc<str>, u32, Arc<str>, Arc<str>, Arc<str>, Option<u64>);

/// Shared strings for the rows of one manifest, built once per compile.
struct Interned {
    graph: Arc<str>,
    /// Per output: per use: (pass, pass_idx, site, op, role, flops).
    uses: Vec<Vec<Use>>,
    /// Per output: shape.
    shapes: Vec<Arc<str>>,
    /// Per statistic of any layout: its name, shared.
    stats: HashMap<Stat, Arc<str>>,
}

impl Interned {
    fn new(m: &Manifest) -> Interned {
        let uses = m
            .outputs
            .iter()
            .map(|o| {
                o.uses
                    .iter()
                    .map(|u| {
                        let site = m.site_of(&u.site, u.pass_idx);
                        (
                            Arc::from(u.pass.as_str()),
                            u.pass_idx as u32,
                            Arc::from(u.site.as_str()),
                            Arc::from(site.map(|s| s.op.as_str()).unwrap_or("")),
                            Arc::from(u.role.as_str()),
                            site.and_then(|s| s.flops),
                        )
                    })
                    .collect()
            })
            .collect();
        Interned {
            graph: Arc::from(m.graph.as_str()),
            uses,
            shapes: m.outputs.iter().map(|o| Arc::from(o.shape.as_str())).collect(),
            stats: m
                .outputs
                .iter()
                .flat_map(|o| o.layout.iter().map(|s| s.stat))
                .chain([tensor::COUNT])
                .map(|s| (s, Arc::from(s.as_str())))
                .collect(),
        }
    }
}

/// One extra output of a tapped run as the recorder takes it: f32 values (`Session::run`), or
/// the bytes a backend returned with their dtype (`run_typed`, a scope's tap), decoded on the
/// writer thread. Little-endian F32 bytes at a 4-byte-aligned address (what the system
/// allocator returns for them) are read in place there, so the run's thread neither copies nor
/// allocates its sketches (a second copy of every sketch output was 110 KB of the chain MLP's
/// tapped heap at L = 16 and 443 KB at L = 64, `heaptrack`).
#[derive(Debug, Clone, PartialEq)]
pub enum RunOutput {
    /// Values as f32.
    F32(Vec<f32>),
    /// Little-endian bytes of `DType`: F32, or F64 (narrowed to f32). Any other dtype, or a
    /// byte count that is not a whole number of values, is refused when the run is decoded
    /// (the run is not recorded, and the recording's error names the output).
    Bytes(Vec<u8>, rlx_ir::DType),
}

impl RunOutput {
    /// The values as f32, borrowed when they already lie in memory as f32.
    ///
    /// Errors: bytes of a dtype other than F32 and F64, or a byte count that is not a multiple
    /// of the dtype's width (reading them as f32 would record wrong numbers).
    pub fn values(&self) -> Result<Cow<'_, [f32]>, String> {
        match self {
            RunOutput::F32(v) => Ok(Cow::Borrowed(v)),
            RunOutput::Bytes(b, d) => bytes_as_f32(b, *d),
        }
    }

    /// The values as an owned f32 vector (converted once for bytes). Errors as
    /// [`RunOutput::values`].
    pub fn into_f32(self) -> Result<Vec<f32>, String> {
        match self {
            RunOutput::F32(v) => Ok(v),
            RunOutput::Bytes(..) => self.values().map(Cow::into_owned),
        }
    }
}

/// `bytes` of `dtype` as f32 values: borrowed for little-endian F32 bytes at a 4-byte-aligned
/// address, else converted ([`rlx_runtime::taps::to_f32`]: F32 as is, F64 narrowed). Errors as
/// [`RunOutput::values`].
fn bytes_as_f32(bytes: &[u8], dtype: rlx_ir::DType) -> Result<Cow<'_, [f32]>, String> {
    let width = match dtype {
        rlx_ir::DType::F32 => 4,
        rlx_ir::DType::F64 => 8,
        d => return Err(format!("a {d:?} output: tap outputs are F32 (or F64), and {d:?} bytes read as f32 would be wrong numbers")),
    };
    if bytes.len() % width != 0 {
        return Err(format!("{} bytes is not a whole number of {dtype:?} values ({width} bytes each)", bytes.len()));
    }
    Ok(match dtype {
        rlx_ir::DType::F32 if cfg!(target_endian = "little") => match bytemuck::try_cast_slice(bytes) {
            Ok(v) => Cow::Borrowed(v),
            Err(_) => Cow::Owned(rlx_runtime::taps::to_f32(bytes, dtype)),
        },
        d => Cow::Owned(rlx_runtime::taps::to_f32(bytes, d)),
    })
}

impl From<Vec<f32>> for RunOutput {
    fn from(v: Vec<f32>) -> RunOutput {
        RunOutput::F32(v)
    }
}

impl From<(Vec<u8>, rlx_ir::DType)> for RunOutput {
    fn from((b, d): (Vec<u8>, rlx_ir::DType)) -> RunOutput {
        RunOutput::Bytes(b, d)
    }
}

enum Msg {
    Manifest(Arc<Manifest>),
    Run { manifest: Arc<Manifest>, step: u64, outputs: Vec<RunOutput> },
    /// Whole tensors of one run to write into the capture directory `dir`.
    Capture { dir: PathBuf, manifest: Arc<Manifest>, step: u64, picks: Vec<Pick> },
    /// Every run is in: finish the sink (`true`), or close it as a partial recording
    /// (`false`: interrupted, readable, never renamed into place). Without it (a panic, an
    /// early drop) the sink is left unfinished, so an incomplete recording never looks complete.
    Finish(bool),
}

/// Compile tags are unique in the process, so a graph compiled under one recorder and run
/// under another is never mistaken for one of the other's compiles.
static NEXT_TAG: AtomicU32 = AtomicU32::new(1);

/// Runs queued for the writer before a tapped run waits for it (bounded memory).
const QUEUE: usize = 64;

struct Front {
    manifests: HashMap<u32, Arc<Manifest>>,
    steps: HashMap<u32, u64>,
    /// Compiles whose manifest appended at least one output (a recorded run is expected).
    appending: usize,
    /// Runs handed to the writer (sampled in, when a `sample` setting gates the taps).
    recorded: u64,
    error: Option<Error>,
    tx: Option<SyncSender<Msg>>,
    writer: Option<JoinHandle<Result<(), Error>>>,
    /// Where captured tensors go ([`Recorder::set_capture_dir`]; a file sink's
    /// `<path>.capture`).
    capture_dir: Option<PathBuf>,
    /// Sampling and budget state of captured tensors.
    selector: Selector,
}

/// What a [`Recorder`] has seen so far ([`Recorder::counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Compiles tapped (one manifest each).
    pub compiles: usize,
    /// Compiles whose pipeline appended at least one tap output (found a site).
    pub appending: usize,
    /// Runs of tapped compiles, sampled in or not (each run takes a step number).
    pub runs: u64,
    /// Runs whose rows were handed to the writer: `runs` less the runs a `sample` setting
    /// left out.
    pub recorded: u64,
}

/// Shared recording state of one scope (or of the environment-activated process).
///
/// The tapped run only hands its sketch vectors to a writer thread (a bounded queue); rows are
/// decoded and written to the sink there, off the model's critical path.
pub struct Recorder {
    run_id: Arc<str>,
    front: Mutex<Front>,
}

pub use crate::recording::new_run_id;

/// The writer thread: decode each run into blocks ([`Block`]) and hand them to the sink; keep the first error and
/// drain the rest of the queue (so the producer never blocks on a dead writer). The sink is
/// finished only on `Msg::Finish` and only if nothing failed.
fn writer(mut sink: Box<dyn Sink>, run_id: Arc<str>, rx: Receiver<Msg>) -> Result<(), Error> {
    // The sink learns the recording id first (a Parquet dataset names its partition by it).
    let mut first: Option<Error> = sink.recording_id(&run_id).err();
    let mut finish = false;
    let mut partial = false;
    let mut interned: HashMap<u32, Arc<Interned>> = HashMap::new();
    // XXH3-128 of the bits of the last recorded sketch of each weight (compile tag, output
    // position): a weight is written again only when it changes (a `set_param` between runs).
    // A hash, not a copy of the sketch (at L=256 on the chain MLP the copies were 0.85 MB of the
    // tapped run's peak heap): two different sketches share a 128-bit hash with probability
    // about 2^-128 per comparison, and then the changed one would not be written again.
    let mut weights: HashMap<(u32, usize), u128> = HashMap::new();
    let mut store: Option<Store> = None;
    for msg in rx {
        if first.is_some() {
            continue;
        }
        let res = match msg {
            Msg::Manifest(m) => sink.manifest(&m),
            Msg::Run { manifest, step, outputs } => {
                let names = interned
                    .entry(manifest.tag)
                    .or_insert_with(|| Arc::new(Interned::new(&manifest)))
                    .clone();
                let mut changed = |k: usize, v: &[f32]| {
                    // Bitwise: a sketch holding NaN (a statistic not defined or not computed)
                    // is unchanged when its bits are (NaN != NaN would record it every run).
                    let h = twox_hash::XxHash3_128::oneshot(crate::bytes::f32_bytes(v));
                    weights.insert((manifest.tag, k), h) != Some(h)
                };
                decode_each(&run_id, &names, step, &manifest, &outputs, &mut changed, |block| sink.write_block(block))
                    .and_then(|_| sink.flush())
            }
            Msg::Capture { dir, manifest, step, picks } => {
                let s = match store.take() {
                    Some(s) => Ok(s),
                    None => Store::create(&dir, &run_id),
                };
                s.and_then(|mut s| {
                    let r = s.write(&manifest, step, picks);
                    store = Some(s);
                    r
                })
            }
            Msg::Finish(complete) => {
                finish = true;
                partial = !complete;
                Ok(())
            }
        };
        if let Err(e) = res {
            first = Some(e);
        }
    }
    match first {
        Some(e) => Err(e),
        None if finish && partial => sink.abandon(),
        None if finish => sink.finish(),
        None => Ok(()),
    }
}

impl Recorder {
    /// A recorder writing to `sink` from a writer thread.
    pub fn new(sink: Box<dyn Sink>, run_id: String) -> Recorder {
        let run_id: Arc<str> = Arc::from(run_id);
        let capture_dir = sink.capture_dir();
        let (tx, rx) = sync_channel(QUEUE);
        let id = run_id.clone();
        let writer = std::thread::Builder::new()
            .name("opscope-writer".into())
            .spawn(move || writer(sink, id, rx));
        let (tx, writer, error) = match writer {
            Ok(h) => (Some(tx), Some(h), None),
            Err(e) => (None, None, Some(Error::Internal(format!("cannot start the writer thread: {e}")))),
        };
        Recorder {
            run_id,
            front: Mutex::new(Front {
                manifests: HashMap::new(),
                steps: HashMap::new(),
                appending: 0,
                recorded: 0,
                error,
                tx,
                writer,
                capture_dir,
                selector: Selector::default(),
            }),
        }
    }

    /// Write captured tensors (a `capture` pass) into `dir` instead of the sink's default
    /// (`<recording>.capture` for a file sink; none for a [`crate::MemorySink`]).
    pub fn set_capture_dir(&self, dir: PathBuf) {
        self.with_front(|s| s.capture_dir = Some(dir));
    }

    /// The run id written in every row.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// A fresh compile tag, unique in the process (below 2^24, so exact as an f32; 0 is
    /// never handed out).
    pub fn next_tag(&self) -> u32 {
        (NEXT_TAG.fetch_add(1, Ordering::Relaxed) % ((1 << 24) - 1)) + 1
    }

    fn with_front<T>(&self, f: impl FnOnce(&mut Front) -> T) -> Option<T> {
        self.front.lock().ok().map(|mut s| f(&mut s))
    }

    /// Keep the first error; later ones are printed.
    pub fn fail(&self, e: Error) {
        self.with_front(|s| {
            if s.error.is_none() {
                s.error = Some(e);
            } else {
                eprintln!("opscope: {e}");
            }
        });
    }

    fn send(&self, msg: Msg) {
        let tx = self.with_front(|s| s.tx.clone()).flatten();
        if let Some(tx) = tx {
            // A send fails only if the writer has gone; its error is reported by `finish`.
            let _ = tx.send(msg);
        }
    }

    /// A tapped compile: number it in this recording (1, 2, ...), remember its manifest and
    /// tell the sink.
    ///
    /// A manifest with tap outputs and tag 0 (what [`crate::Pipeline::apply`] gives) fails the
    /// recording ([`Error::Graph`], reported by [`Recorder::finish`]): value 0 of each sketch
    /// carries the tag, and a run the `sample` stage leaves out carries its negation, so with tag
    /// 0 every run would read as unsampled and nothing would be recorded. Apply with
    /// [`crate::Pipeline::apply_tagged`]`(&graph, None, recorder.next_tag())`.
    pub fn register(&self, mut manifest: Manifest) -> Arc<Manifest> {
        if manifest.tag == 0 && !manifest.outputs.is_empty() {
            self.fail(Error::Graph(format!(
                "graph '{}' was tapped with tag 0 (Pipeline::apply), which a recorder cannot tell from a run the sample stage \
                 left out: nothing of it would be recorded; tap it with pipeline.apply_tagged(&graph, None, recorder.next_tag())",
                manifest.graph
            )));
        }
        manifest.compile = self.with_front(|s| s.manifests.len() as u32 + 1).unwrap_or(0);
        let m = Arc::new(manifest);
        let appends = m.outputs.iter().any(|o| o.output_index.is_some());
        self.with_front(|s| {
            s.appending += appends as usize;
            s.manifests.insert(m.tag, m.clone())
        });
        self.send(Msg::Manifest(m.clone()));
        m
    }

    /// The extra outputs of one run whose manifest is identified by the tag in value 0.
    pub fn record_tagged(&self, outputs: Vec<Vec<f32>>) {
        let firsts = firsts(&outputs);
        self.record_tagged_with(&firsts, move || outputs)
    }

    /// [`Recorder::record_tagged`] from value 0 of each extra output (`firsts`) and the outputs
    /// themselves (`outputs`: f32 vectors or a backend's bytes, see [`RunOutput`]), called only
    /// when the run is recorded: a run that was not sampled is counted from its tags, without
    /// taking its outputs.
    pub fn record_tagged_with<O: Into<RunOutput>>(&self, firsts: &[Option<f32>], outputs: impl FnOnce() -> Vec<O>) {
        let Some(&Some(raw)) = firsts.first() else {
            return;
        };
        // A negated tag: a gated sketch of a run that was not sampled (see `record`).
        let raw = if raw < 0.0 { -raw } else { raw };
        let tag = raw as u32;
        let known = if raw == tag as f32 { self.with_front(|s| s.manifests.get(&tag).cloned()).flatten() } else { None };
        match known {
            Some(m) => self.record_with(&m, firsts, outputs),
            // 0 and non-integers are never handed out ([`Recorder::next_tag`]).
            None if raw == 0.0 || raw != tag as f32 => self.fail(Error::Mismatch {
                graph: "?".into(),
                detail: format!(
                    "the tap outputs carry tag {raw}, which no compile has: the backend returned values that are not \
                     the sketch (zeros, or another buffer: a lowered sketch's tag is NaN when its reductions did not see \
                     every element, or the backend does not keep NaN semantics); nothing of this run is recorded"
                ),
            }),
            None => self.fail(Error::Mismatch {
                graph: "?".into(),
                detail: format!(
                    "a graph compiled outside this recording (compile {tag}) ran inside it; \
                     compile and run a graph within the same scope"
                ),
            }),
        }
    }

    /// The extra outputs of one run of the graph `manifest` describes: the sketches, then the
    /// whole tensors of a `capture` pass. `outputs` holds exactly the graph's outputs past its
    /// own (`manifest.user_outputs` onward), in the manifest's order: each sketch's vector of
    /// `spec.len()` values with the compile tag at index 0, then each captured tensor. A run
    /// that was not sampled (`sample{every=N}`: every sketch output carries the negated compile
    /// tag) is counted as a step and writes no row and no captured tensor. A run that does not
    /// match the manifest (another count, a vector of another length, another tag) writes
    /// nothing, nor does any run after it: the recorder keeps [`Error::Mismatch`] and returns
    /// it from [`Recorder::finish`].
    pub fn record(&self, manifest: &Arc<Manifest>, outputs: Vec<Vec<f32>>) {
        let firsts = firsts(&outputs);
        self.record_with(manifest, &firsts, move || outputs)
    }

    /// [`Recorder::record`] from value 0 of each extra output (`firsts`, `None` for an empty
    /// one) and the outputs themselves (`outputs`: f32 vectors or a backend's bytes, see
    /// [`RunOutput`]; called only when the run is recorded).
    pub fn record_with<O: Into<RunOutput>>(&self, manifest: &Arc<Manifest>, firsts: &[Option<f32>], outputs: impl FnOnce() -> Vec<O>) {
        let ncap = manifest.captures.len();
        let sketches = if ncap > 0 && firsts.len() >= ncap { &firsts[..firsts.len() - ncap] } else { firsts };
        let negated = -(manifest.tag as f32);
        let unsampled = sketches.iter().filter(|o| **o == Some(negated)).count();
        if unsampled > 0 && unsampled != sketches.len() {
            self.fail(Error::Mismatch {
                graph: manifest.graph.clone(),
                detail: format!(
                    "{unsampled} of {} tap outputs say the run was not sampled: one gate decides for every sketch of a run; \
                     nothing of this run is recorded",
                    sketches.len()
                ),
            });
            return;
        }
        let step = self.with_front(|s| {
            let step = s.steps.entry(manifest.tag).or_default();
            let now = *step;
            *step += 1;
            s.recorded += u64::from(unsampled == 0);
            now
        });
        if let (Some(step), 0) = (step, unsampled) {
            let mut outputs: Vec<RunOutput> = outputs().into_iter().map(Into::into).collect();
            let captures: Result<Vec<Vec<f32>>, String> = if ncap > 0 && outputs.len() >= ncap {
                outputs.split_off(outputs.len() - ncap).into_iter().map(RunOutput::into_f32).collect()
            } else {
                Ok(Vec::new())
            };
            let captures = match captures {
                Ok(c) => c,
                Err(why) => {
                    self.fail(Error::Mismatch { graph: manifest.graph.clone(), detail: format!("a captured tensor: {why}") });
                    return;
                }
            };
            self.send(Msg::Run {
                manifest: manifest.clone(),
                step,
                outputs,
            });
            if ncap > 0 {
                self.capture(manifest, step, captures);
            }
        }
    }

    /// Hand the sampled, in-budget captured tensors of one run to the writer.
    fn capture(&self, manifest: &Arc<Manifest>, step: u64, captures: Vec<Vec<f32>>) {
        let picked = self.with_front(|s| {
            let dir = s.capture_dir.clone();
            (dir, s.selector.pick(manifest, step, captures))
        });
        let Some((dir, picks)) = picked else { return };
        if picks.is_empty() {
            return;
        }
        match dir {
            Some(dir) => self.send(Msg::Capture { dir, manifest: manifest.clone(), step, picks }),
            None => self.fail(Error::BadPath {
                path: PathBuf::new(),
                why: "the pipeline captures tensors but the recording has no capture directory: record to a file \
                      (tensors go to <path>.capture/) or call Scope::capture_dir"
                    .into(),
            }),
        }
    }

    /// Finish: close the queue, wait for the writer to write every run and finish the sink
    /// (if nothing failed: a failed recording is left unfinished, never made to look
    /// complete). Returns the first error seen while recording; a second one is printed.
    /// Later calls return `Ok`.
    pub fn finish(&self) -> Result<(), Error> {
        self.close(Some(true))
    }

    /// Stop early (an interrupt): write every run that arrived and close the sink as a partial
    /// recording ([`Sink::abandon`]: readable, left at its `.partial` name). Errors as
    /// [`Recorder::finish`].
    pub fn abandon(&self) -> Result<(), Error> {
        self.close(Some(false))
    }

    /// The manifests of the compiles tapped so far, in compile order (empty if the recorder's
    /// lock is poisoned).
    pub fn manifests(&self) -> Vec<Arc<Manifest>> {
        let mut m: Vec<Arc<Manifest>> = self.with_front(|s| s.manifests.values().cloned().collect()).unwrap_or_default();
        m.sort_by_key(|m| m.compile);
        m
    }

    /// What was recorded so far (all zero if the recorder's lock is poisoned).
    pub fn counts(&self) -> RecordCounts {
        self.with_front(|s| RecordCounts {
            compiles: s.manifests.len(),
            appending: s.appending,
            runs: s.steps.values().sum(),
            recorded: s.recorded,
        })
        .unwrap_or_default()
    }

    fn close(&self, end: Option<bool>) -> Result<(), Error> {
        let (writer, early) = self
            .with_front(|s| {
                if let Some(tx) = s.tx.take() {
                    if let (Some(complete), true) = (end, s.error.is_none()) {
                        let _ = tx.send(Msg::Finish(complete));
                    }
                }
                (s.writer.take(), s.error.take())
            })
            .ok_or_else(|| Error::Internal("recorder lock poisoned".into()))?;
        let written = match writer {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(Error::Internal("the writer thread panicked".into()))),
            None => Ok(()),
        };
        match (early, written) {
            (Some(e), Err(w)) => {
                eprintln!("opscope: {w}");
                Err(e)
            }
            (Some(e), Ok(())) => Err(e),
            (None, w) => w,
        }
    }
}

impl Drop for Recorder {
    /// Dropped without `finish` (a panic in the scope, an early return): close the recording as
    /// an interrupted one ([`Recorder::abandon`]): every run that arrived is written, a CSV
    /// recording stays at `<path>.partial` with a sidecar saying it ends on a whole run, and a
    /// Parquet recording's open part is closed (readable). Until 2026-12-07 the open part was
    /// left without a footer, losing every run of it although the process was alive (a
    /// helper's find). After a recording error nothing more is written.
    fn drop(&mut self) {
        if let Err(e) = self.close(Some(false)) {
            eprintln!("opscope: recording incomplete: {e}");
        }
    }
}

/// Value 0 of each output (`None` for an empty one): the compile tag of a sketch output.
fn firsts(outputs: &[Vec<f32>]) -> Vec<Option<f32>> {
    outputs.iter().map(|o| o.first().copied()).collect()
}

/// Value 0 of an output as the backend hands it (bytes of `dtype`), without converting the
/// rest: the compile tag of a sketch output (sketch outputs are f32; another dtype is
/// converted whole).
pub fn first_value(bytes: &[u8], dtype: rlx_ir::DType) -> Option<f32> {
    match dtype {
        rlx_ir::DType::F32 => bytes.get(..4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        d => rlx_runtime::taps::to_f32(bytes, d).first().copied(),
    }
}

/// Decode one run's tap outputs (in output order, caller outputs removed): check them against
/// the manifest ([`Error::Mismatch`] on a wrong count, length or tag), then hand each statistic
/// of each recorded tensor use to `emit` as one [`Block`] (no row is built here; a columnar
/// sink appends the values as they are).
fn decode_each(
    run_id: &Arc<str>,
    names: &Interned,
    step: u64,
    m: &Manifest,
    outputs: &[RunOutput],
    mut weight_changed: impl FnMut(usize, &[f32]) -> bool,
    mut emit: impl FnMut(&Block<'_>) -> Result<(), Error>,
) -> Result<(), Error> {
    let mismatch = |detail: String| Error::Mismatch {
        graph: m.graph.clone(),
        detail,
    };
    let appended = m.outputs.iter().filter(|o| o.output_index.is_some()).count();
    if outputs.len() != appended {
        return Err(mismatch(format!("{} outputs, manifest lists {appended}", outputs.len())));
    }
    // Validate everything before writing anything: a run is recorded whole or not at all.
    let mut values: Vec<Option<Cow<'_, [f32]>>> = Vec::with_capacity(m.outputs.len());
    let mut k = 0;
    for out in &m.outputs {
        values.push(match out.output_index {
            Some(_) => {
                let v = outputs[k].values().map_err(|why| mismatch(format!("output {}: {why}", k + 1)))?;
                k += 1;
                if v.len() != out.len() {
                    return Err(mismatch(format!("output {k} has {} values, spec {}", v.len(), out.len())));
                }
                if v[0] != m.tag as f32 {
                    return Err(mismatch(format!(
                        "output {k} has tag {}, manifest {}: the backend returned values that are not this compile's sketch \
                         (a lowered sketch's tag is NaN when its reductions did not see every element, so a backend that \
                         read zeros or another buffer shows here; nothing of this run is recorded)",
                        v[0], m.tag
                    )));
                }
                Some(v)
            }
            None => None,
        });
    }
    for (oi, out) in m.outputs.iter().enumerate() {
        if out.invariant {
            // A weight is recorded when first seen and again only when it changes (value 0,
            // the compile tag, is the same for every run of a compile).
            let unchanged = values[oi].as_deref().is_some_and(|v| !weight_changed(oi, &v[1..]));
            if unchanged || (values[oi].is_none() && step > 0) {
                continue;
            }
        }
        for (pass, pass_idx, site, op, role, flops) in &names.uses[oi] {
            let block = |stat: Stat, values| Block {
                run_id,
                compile: m.compile,
                step,
                graph: &names.graph,
                pass,
                pass_idx: *pass_idx,
                site,
                op,
                role,
                stat: &names.stats[&stat],
                numel: out.numel,
                shape: &names.shapes[oi],
                flops: *flops,
                values,
            };
            match values[oi].as_deref() {
                // Not computed (a skipped tensor): one `count` row of 0.
                None => emit(&block(tensor::COUNT, &[0.0]))?,
                // NaN elements ("undefined for this data"; a sampled element that is itself
                // NaN is counted in nan_count) are not rows: `Block` leaves them out.
                Some(v) => {
                    for slot in &out.layout {
                        emit(&block(slot.stat, &v[slot.offset..slot.offset + slot.len]))?;
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::RunOutput;
    use rlx_ir::DType;
    use std::borrow::Cow;

    /// F32 bytes are read in place when aligned, copied when not, and give the same values
    /// either way; F64 bytes are narrowed; a partial value or another dtype is an error.
    #[test]
    fn run_output_values_borrow_aligned_f32_bytes_and_convert_the_rest() {
        let want = [3.0f32, -0.5, f32::NAN, 1e-40, f32::INFINITY];
        let bytes: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
        let same = |got: &[f32]| got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        let out = RunOutput::Bytes(bytes.clone(), DType::F32);
        let v = out.values().unwrap();
        if bytes.as_ptr().align_offset(4) == 0 {
            assert!(matches!(v, Cow::Borrowed(_)), "aligned f32 bytes are read in place");
        }
        assert!(same(&v));
        // The same bytes at an address that is not a multiple of 4: copied, same values.
        let mut shifted = vec![0u8; bytes.len() + 4];
        let off = (1..4).find(|o| shifted[*o..].as_ptr().align_offset(4) != 0).expect("a misaligned offset");
        shifted[off..off + bytes.len()].copy_from_slice(&bytes);
        let v = super::bytes_as_f32(&shifted[off..off + bytes.len()], DType::F32).unwrap();
        assert!(matches!(v, Cow::Owned(_)));
        assert!(same(&v));
        assert!(same(&RunOutput::Bytes(bytes.clone(), DType::F32).into_f32().unwrap()));
        let wide: Vec<u8> = [3.0f64, -0.5].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&*RunOutput::Bytes(wide, DType::F64).values().unwrap(), &[3.0f32, -0.5]);
        assert_eq!(&*RunOutput::from(vec![1.0f32]).values().unwrap(), &[1.0f32]);
        // Refused, not read as wrong numbers: a partial value, another dtype.
        let e = RunOutput::Bytes(vec![0, 0, 128, 63, 7], DType::F32).values().unwrap_err();
        assert!(e.contains("5 bytes is not a whole number of F32 values"), "{e}");
        let e = RunOutput::Bytes(vec![0, 60, 0, 60], DType::F16).into_f32().unwrap_err();
        assert!(e.contains("F16"), "{e}");
    }
}
