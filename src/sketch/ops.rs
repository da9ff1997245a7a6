//! The sketch ops as RLX custom ops: shape inference, the CPU kernels (the tensor kernel, the
//! registered probes), the weight memo, and their registration.

use std::sync::{Arc, Once};

use rlx_cpu::op_registry::{CpuKernel, CpuTensorMut, CpuTensorRef};
use rlx_ir::op_registry::OpExtension;
use rlx_ir::{DType, Shape};

use super::kernel::{compute_into, compute_masked};
use super::probe::{self, Probe};
use super::{shape_text, static_dims, SketchSpec, SKETCH2_OP, SKETCH3_OP, SKETCH_OP};

/// Shape inference for [`SKETCH_OP`] and the multi-input probe ops.
struct SketchOp {
    name: String,
    inputs: usize,
}

impl OpExtension for SketchOp {
    fn name(&self) -> &str {
        &self.name
    }
    fn num_inputs(&self) -> usize {
        self.inputs
    }
    fn infer_shape(&self, _inputs: &[&Shape], attrs: &[u8]) -> Shape {
        // Attributes are written by `SketchSpec::to_attrs` only; a foreign blob gets a 1-value
        // output and the kernel reports the decode error at run time.
        let len = cached_spec(attrs).ok().and_then(|s| s.len().ok()).unwrap_or(1);
        Shape::new(&[len], DType::F32)
    }
}

/// CPU kernel for [`SKETCH_OP`] and the multi-input probe ops ([`SKETCH2_OP`], [`SKETCH3_OP`]),
/// and their gated forms (the sampling gate as an extra last input: see [`super::sample`]).
struct SketchKernel {
    name: String,
    gated: bool,
}

impl CpuKernel for SketchKernel {
    fn name(&self) -> &str {
        &self.name
    }
    fn execute(
        &self,
        inputs: &[CpuTensorRef<'_>],
        output: CpuTensorMut<'_>,
        attrs: &[u8],
    ) -> Result<(), String> {
        let inputs = if self.gated {
            let (gate, rest) = inputs.split_last().ok_or_else(|| format!("{}: no gate input", self.name))?;
            let open = gate.expect_f32("opscope sampling gate")?.first().copied().unwrap_or(1.0);
            if open == 0.0 {
                // Not sampled: nothing is computed. The negated tag tells the recorder that
                // this run was not sampled, and it reads nothing else of it (the other values
                // are left as the buffer holds them: never recorded).
                let tag = cached_tag(attrs)?;
                let out = output.expect_f32_mut("opscope.sketch output")?;
                if let Some(first) = out.first_mut() {
                    *first = -(tag as f32);
                }
                return Ok(());
            }
            rest
        } else {
            inputs
        };
        let spec = cached_spec(attrs)?;
        if let Probe::Pass { name, params } = &spec.probe {
            let out = output.expect_f32_mut("opscope probe output")?;
            return run_probe(&self.name, &spec, name, params.get(), inputs, out);
        }
        let x = inputs
            .first()
            .ok_or_else(|| format!("{SKETCH_OP}: no input"))?
            .expect_f32("opscope.sketch input")?;
        let out = output.expect_f32_mut("opscope.sketch output")?;
        let len = spec.len()?;
        if out.len() != len {
            return Err(format!("{SKETCH_OP}: output holds {} values, spec needs {len}", out.len()));
        }
        let dims = static_dims(inputs[0].shape()).ok_or_else(|| {
            format!("{SKETCH_OP}: input shape {} is not bound at run time", shape_text(inputs[0].shape()))
        })?;
        if dims.iter().product::<usize>() != x.len() {
            return Err(format!("{SKETCH_OP}: shape {dims:?} does not match {} values", x.len()));
        }
        // A second input is the padding row mask: one value per row (all leading dims).
        let mask = match inputs.get(1) {
            Some(m) => {
                let m = m.expect_f32("opscope.sketch row mask")?;
                let rows = x.len() / dims.last().copied().unwrap_or(1).max(1);
                let per_head = dims.len() == 4 && m.len() == dims[0] * dims[2];
                if m.len() != rows && !per_head {
                    return Err(format!("{SKETCH_OP}: row mask holds {} values, the tensor has {rows} rows", m.len()));
                }
                Some(m)
            }
            None => None,
        };
        match (spec.memo, mask) {
            (true, None) => memo_compute(x, &dims, &spec, out),
            (_, mask) => compute_masked(x, &dims, &spec, mask, out),
        }
        if let Some(key) = &spec.online {
            crate::online::observe(key, x);
        }
        Ok(())
    }
}

/// True if `graph` holds a sketch of a weight ([`SketchSpec::memo`]) that the CPU kernel runs:
/// its executable is wrapped so that the memo can follow param writes ([`super::epoch`]).
pub fn has_weight_sketch(graph: &rlx_ir::Graph) -> bool {
    graph.nodes().iter().any(|n| match &n.op {
        rlx_ir::Op::Custom { name, attrs, .. } if super::is_sketch_op(name) => {
            cached_spec(attrs).is_ok_and(|s| s.memo)
        }
        _ => false,
    })
}

/// Hashes the attribute bytes with foldhash (several hundred bytes of JSON per key: SipHash,
/// the standard map's default, spent about 0.4 us on each lookup, measured in a tapped compile;
/// `twox_hash`'s streaming XXH3-64, used until 2026-12-03, allocated and copied a buffer on
/// every lookup, which every sketch's kernel call does).
type AttrHash = foldhash::fast::RandomState;

thread_local! {
    /// Decoded sketch attributes on this thread, keyed by the bytes themselves (exact).
    static SPECS: std::cell::RefCell<std::collections::HashMap<Box<[u8]>, Arc<SketchSpec>, AttrHash>> =
        std::cell::RefCell::new(std::collections::HashMap::default());
}

/// A sketch's attributes decoded once per thread and attribute bytes (the key is the bytes
/// themselves: exact). Shape inference runs on every custom op of every compile pass and the
/// kernel on every run; parsing the JSON each time was measured at 3% of a tapped compile.
fn cached_spec(attrs: &[u8]) -> Result<Arc<SketchSpec>, String> {
    if let Some(s) = SPECS.with(|m| m.borrow().get(attrs).cloned()) {
        return Ok(s);
    }
    let spec = Arc::new(SketchSpec::from_attrs(attrs)?);
    insert_spec(attrs, spec.clone());
    Ok(spec)
}

fn insert_spec(attrs: &[u8], spec: Arc<SketchSpec>) {
    SPECS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= MEMO_CAPACITY {
            m.clear();
        }
        m.insert(attrs.into(), spec);
    });
}

/// Put the spec a rewrite just encoded into this thread's cache under its attribute bytes, so
/// the compile's shape inference does not parse back what was just written. Exact because
/// decoding is the inverse of [`SketchSpec::to_attrs`] (every field is written, numbers in a
/// round-tripping form; the snapshot tests check, on every graph they render, that each sketch
/// output's attributes decode to the spec the manifest holds).
pub(crate) fn seed_spec(attrs: &[u8], spec: &SketchSpec) {
    if SPECS.with(|m| !m.borrow().contains_key(attrs)) {
        insert_spec(attrs, Arc::new(spec.clone()));
    }
}

/// The compile tag of a sketch's attributes, decoded once per thread and attribute bytes (an
/// unsampled run of a gated sketch needs only the tag: parsing the JSON spec on every call
/// was most of what such a run cost).
fn cached_tag(attrs: &[u8]) -> Result<u32, String> {
    use std::cell::RefCell;
    use std::collections::HashMap;
    // Keyed by where RLX holds the attribute bytes (a node's bytes stay put while its graph
    // lives), checked against a copy of the bytes: a reused address with other attributes is
    // a miss, never another node's tag. Hashing the bytes instead (several hundred of JSON)
    // cost about 0.3 us a call, measured.
    thread_local! {
        static TAGS: RefCell<HashMap<(usize, usize), (Box<[u8]>, u32)>> = RefCell::new(HashMap::new());
    }
    let key = (attrs.as_ptr() as usize, attrs.len());
    if let Some(t) = TAGS.with(|m| m.borrow().get(&key).and_then(|(bytes, t)| (**bytes == *attrs).then_some(*t))) {
        return Ok(t);
    }
    let tag = SketchSpec::from_attrs(attrs)?.tag;
    TAGS.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() >= MEMO_CAPACITY {
            m.clear();
        }
        m.insert(key, (attrs.into(), tag));
    });
    Ok(tag)
}

/// Run the registered probe `name` and lay its statistics out as `spec` says: the compile tag
/// at value 0, then each selected statistic.
fn run_probe(
    op: &str,
    spec: &SketchSpec,
    name: &str,
    params: &str,
    inputs: &[CpuTensorRef<'_>],
    out: &mut [f32],
) -> Result<(), String> {
    let kernel = probe::lookup(name).ok_or_else(|| format!("{op}: no linked pass registers the probe '{name}'"))?;
    let layout = spec.layout()?;
    let len = 1 + layout.iter().map(|s| s.len).sum::<usize>();
    if out.len() != len {
        return Err(format!("{op}: output holds {} values, spec needs {len}", out.len()));
    }
    let values = kernel.execute(params, inputs)?;
    out[0] = spec.tag as f32;
    for slot in layout {
        let v = values
            .iter()
            .find(|(s, _)| *s == slot.stat)
            .map(|(_, v)| v.as_slice())
            .ok_or_else(|| format!("opscope probe {name}: {} is not computed by this probe", slot.stat))?;
        if v.len() != slot.len {
            return Err(format!("opscope probe {name}: {} has {} values, layout {}", slot.stat, v.len(), slot.len));
        }
        out[slot.offset..slot.offset + slot.len].copy_from_slice(v);
    }
    Ok(())
}

/// Sketches of weights already seen, keyed by (content hash, dims, spec without tag and node).
type MemoKey = (u128, Vec<usize>, Vec<u8>);

/// Bounded: cleared when it holds this many sketches (a model has a few hundred weights).
const MEMO_CAPACITY: usize = 4096;

/// How the weight memo answered, counted over the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightMemoCounts {
    /// Weight sketches reused without reading the weight: same sketch node, same param epoch
    /// (no param write since; see [`super::epoch`]).
    pub epoch_hits: u64,
    /// Weight sketches that hashed the weight's bytes (a first run, a param write, or a run
    /// with no epoch), whether the hash then found a stored sketch or not.
    pub hashed: u64,
}

static EPOCH_HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static HASHED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The weight memo's counts so far in this process (what tests and benches read to tell which
/// path ran).
pub fn weight_memo_counts() -> WeightMemoCounts {
    use std::sync::atomic::Ordering::Relaxed;
    WeightMemoCounts { epoch_hits: EPOCH_HITS.load(Relaxed), hashed: HASHED.load(Relaxed) }
}

fn memo_compute(x: &[f32], dims: &[usize], spec: &Arc<SketchSpec>, out: &mut [f32]) {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Mutex;
    // (epoch, the spec's address) -> (the spec, kept alive so its address is not reused while
    // the entry lives, and the sketch). Attributes are unique per weight-sketch node and compile
    // (`SketchSpec::node`, `tag`), and `cached_spec` hands out one `Arc` per distinct attribute
    // bytes on this thread, so the address names the node.
    // The sketch is shared with the content memo below (one allocation per weight sketch, not
    // two: at L=256 on the chain MLP the two copies were 1.7 MB of the tapped run's peak heap).
    // Element 0 is the compile tag, set from `spec` on every answer.
    type EpochMemo = HashMap<(u64, usize), (Arc<SketchSpec>, Arc<[f32]>)>;
    thread_local! {
        static BY_EPOCH: RefCell<EpochMemo> = RefCell::new(HashMap::new());
    }
    static MEMO: Mutex<Option<HashMap<MemoKey, Arc<[f32]>>>> = Mutex::new(None);
    // Trusted only on a thread outside RLX's rayon pool: such a thread runs nothing but the
    // schedule of the run it called (inline: one worker, or `RLX_CPU_EXEC_IN_POOL=0`), so the
    // epoch it carries is this executable's. A pool worker may be running another executable's
    // schedule it picked up while waiting inside a parallel kernel, under the epoch of the run
    // it came from (measured: stale sketches in 3 000-7 000 of 20 000 steps), so there it is 0.
    let epoch = if rayon::current_thread_index().is_none() { super::epoch::current() } else { 0 };
    let epoch_key = (epoch, Arc::as_ptr(spec) as usize);
    if epoch != 0 {
        let hit = BY_EPOCH.with(|m| {
            let m = m.borrow();
            match m.get(&epoch_key) {
                Some((_, v)) if v.len() == out.len() => {
                    out.copy_from_slice(v);
                    out[0] = spec.tag as f32;
                    true
                }
                _ => false,
            }
        });
        if hit {
            EPOCH_HITS.fetch_add(1, Relaxed);
            return;
        }
    }
    HASHED.fetch_add(1, Relaxed);
    let bytes = crate::bytes::f32_bytes(x);
    let untagged = SketchSpec { tag: 0, node: 0, ..SketchSpec::clone(spec) };
    // XXH3-128 (twox-hash: AVX2 where the CPU has it, measured 1.8x the SSE2 build on a
    // 256 KB weight in cache).
    let key: MemoKey = (twox_hash::XxHash3_128::oneshot(bytes), dims.to_vec(), untagged.to_attrs());
    let hit = MEMO.lock().ok().and_then(|g| g.as_ref().and_then(|m| m.get(&key).cloned()));
    let stored = match hit {
        Some(v) if v.len() == out.len() => {
            out.copy_from_slice(&v);
            out[0] = spec.tag as f32;
            v
        }
        _ => {
            // Computed outside the lock: other kernels sketching other weights are not held up.
            compute_into(x, dims, spec, out);
            let v: Arc<[f32]> = Arc::from(&*out);
            if let Ok(mut guard) = MEMO.lock() {
                let map = guard.get_or_insert_with(HashMap::new);
                if map.len() >= MEMO_CAPACITY {
                    map.clear();
                }
                map.insert(key, v.clone());
            }
            v
        }
    };
    if epoch != 0 {
        BY_EPOCH.with(|m| {
            let mut m = m.borrow_mut();
            if m.len() >= MEMO_CAPACITY {
                // Entries of past epochs are never hit again; clearing drops them too.
                m.clear();
            }
            m.insert(epoch_key, (spec.clone(), stored));
        });
    }
}

/// Register the sketch ops with RLX's op registry and their CPU kernels (idempotent). Called
/// once, from the one place every activation path goes through before a tapped compile
/// ([`crate::pipeline::Pipeline::apply_tagged`]): RLX panics when it builds an executable
/// holding a custom op with no registered kernel. Probes need no registration of their own:
/// the two- and three-input ops dispatch to them by name.
pub fn register_kernels() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for (name, inputs) in [(SKETCH_OP, 1), (SKETCH2_OP, 2), (SKETCH3_OP, 3)] {
            rlx_ir::op_registry::register_op(Arc::new(SketchOp { name: name.to_string(), inputs }));
            rlx_cpu::op_registry::register_cpu_kernel(Arc::new(SketchKernel { name: name.to_string(), gated: false }));
            let gated = super::sample::gated_name(name);
            rlx_ir::op_registry::register_op(Arc::new(SketchOp { name: gated.clone(), inputs: inputs + 1 }));
            rlx_cpu::op_registry::register_cpu_kernel(Arc::new(SketchKernel { name: gated, gated: true }));
        }
        super::sample::register_gates();
    });
}

