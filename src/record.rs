//! The recorder: turns the extra outputs of a tapped run into rows, using the manifest of the
//! compile that produced them, and hands them to a sink.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::manifest::Manifest;
use crate::sink::{Row, Sink};
use crate::sketch::Stat;

struct State {
    sink: Box<dyn Sink>,
    manifests: HashMap<u32, Arc<Manifest>>,
    steps: HashMap<u32, u64>,
    error: Option<Error>,
    finished: bool,
}

/// Shared recording state of one scope (or of the environment-activated process).
pub struct Recorder {
    run_id: String,
    next_tag: AtomicU32,
    state: Mutex<State>,
}

/// A run id: `run-<unix seconds>-<pid>`.
pub fn new_run_id() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("run-{secs}-{}", std::process::id())
}

impl Recorder {
    /// A recorder writing to `sink`.
    pub fn new(sink: Box<dyn Sink>, run_id: String) -> Recorder {
        Recorder {
            run_id,
            next_tag: AtomicU32::new(1),
            state: Mutex::new(State {
                sink,
                manifests: HashMap::new(),
                steps: HashMap::new(),
                error: None,
                finished: false,
            }),
        }
    }

    /// The run id written in every row.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// A fresh compile tag (below 2^24, so exact as an f32).
    pub fn next_tag(&self) -> u32 {
        self.next_tag.fetch_add(1, Ordering::Relaxed) % (1 << 24)
    }

    fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        match self.state.lock() {
            Ok(mut s) => Some(f(&mut s)),
            Err(_) => None,
        }
    }

    /// Keep the first error; later ones are printed.
    pub fn fail(&self, e: Error) {
        self.with_state(|s| {
            if s.error.is_none() {
                s.error = Some(e);
            } else {
                eprintln!("opscope: {e}");
            }
        });
    }

    /// A tapped compile: remember its manifest and tell the sink.
    pub fn register(&self, manifest: Manifest) -> Arc<Manifest> {
        let m = Arc::new(manifest);
        let res = self.with_state(|s| {
            s.manifests.insert(m.tag, m.clone());
            s.sink.manifest(&m)
        });
        if let Some(Err(e)) = res {
            self.fail(e);
        }
        m
    }

    /// The extra outputs of one run whose manifest is identified by the tag in value 0.
    pub fn record_tagged(&self, outputs: &[Vec<f32>]) {
        let Some(tag) = outputs.first().and_then(|o| o.first()).map(|&t| t as u32) else {
            return;
        };
        let m = self.with_state(|s| s.manifests.get(&tag).cloned()).flatten();
        match m {
            Some(m) => self.record(&m, outputs),
            None => self.fail(Error::Mismatch {
                graph: "?".into(),
                detail: format!("no compile with tag {tag}"),
            }),
        }
    }

    /// The extra outputs of one run of the graph `manifest` describes.
    pub fn record(&self, manifest: &Manifest, outputs: &[Vec<f32>]) {
        let res = self.with_state(|s| {
            if s.finished {
                return Ok(());
            }
            let step = s.steps.entry(manifest.tag).or_default();
            let rows = rows_for(&self.run_id, *step, manifest, outputs)?;
            *step += 1;
            s.sink.write(&rows)
        });
        if let Some(Err(e)) = res {
            self.fail(e);
        }
    }

    /// Finish the sink; return the first error seen while recording, if any.
    pub fn finish(&self) -> Result<(), Error> {
        self.with_state(|s| {
            if s.finished {
                return s.error.take().map_or(Ok(()), Err);
            }
            s.finished = true;
            let fin = s.sink.finish();
            match s.error.take() {
                Some(e) => Err(e),
                None => fin,
            }
        })
        .unwrap_or_else(|| Err(Error::Internal("recorder lock poisoned".into())))
    }
}

/// Decode one run's tap outputs (in output order, caller outputs already removed) into rows.
///
/// Errors with [`Error::Mismatch`] if the outputs do not have the count, lengths or tag the
/// manifest says. Statistics that are undefined for the data (NaN in a slot whose
/// [`Stat::nan_means_undefined`]) are left out.
pub fn rows_for(run_id: &str, step: u64, m: &Manifest, outputs: &[Vec<f32>]) -> Result<Vec<Row>, Error> {
    let mismatch = |detail: String| Error::Mismatch {
        graph: m.graph.clone(),
        detail,
    };
    let appended = m.outputs.iter().filter(|o| o.output_index.is_some()).count();
    if outputs.len() != appended {
        return Err(mismatch(format!("{} outputs, manifest lists {appended}", outputs.len())));
    }
    let mut rows = Vec::new();
    let mut k = 0;
    for out in &m.outputs {
        let values: Option<&Vec<f32>> = match out.output_index {
            Some(_) => {
                let v = &outputs[k];
                k += 1;
                if v.len() != out.spec.len() {
                    return Err(mismatch(format!("output {k} has {} values, spec {}", v.len(), out.spec.len())));
                }
                if v[0] as u32 != m.tag {
                    return Err(mismatch(format!("output {k} has tag {}, manifest {}", v[0], m.tag)));
                }
                Some(v)
            }
            None => None,
        };
        if out.invariant && step > 0 {
            continue; // a weight's sketch is the same on every run: recorded at step 0
        }
        for u in &out.uses {
            let site = m.site(&u.site);
            let row = |stat: Stat, idx: usize, value: f32| Row {
                run_id: run_id.to_string(),
                step,
                graph: m.graph.clone(),
                site: u.site.clone(),
                op: site.map(|s| s.op.clone()).unwrap_or_default(),
                role: u.role.as_str().to_string(),
                stat: stat.as_str().to_string(),
                idx: idx as u64,
                value: value as f64,
                numel: out.numel,
                shape: out.shape.clone(),
                flops: site.and_then(|s| s.flops),
            };
            match values {
                None => rows.push(row(Stat::Count, 0, 0.0)),
                Some(v) => {
                    for slot in &out.layout {
                        for (i, &x) in v[slot.offset..slot.offset + slot.len].iter().enumerate() {
                            if x.is_nan() && slot.stat.nan_means_undefined() {
                                continue;
                            }
                            rows.push(row(slot.stat, i, x));
                        }
                    }
                }
            }
        }
    }
    Ok(rows)
}
