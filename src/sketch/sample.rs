//! Sampled recording: the gate op that decides, per run and from the run's input contents,
//! whether the sketches of that run are computed.
//!
//! A pipeline holding `sample{every=N}` gets one gate node `opscope.sample.K` reading the
//! graph's `K` inputs; every native sketch node then reads the gate as an extra last input
//! (the gated ops [`gated_name`]). The gate hashes the run's inputs with XXH3-64
//! ([`input_hash`]) and writes `1` when `hash % N == 0`, else `0`. A gated sketch kernel that
//! reads `0` computes nothing: it writes the negated compile tag as value 0 (the rest of its
//! output is not written, and not read), and the recorder writes no row for that run (its `step` is still counted, so the steps of a
//! sampled recording say which runs were recorded).
//!
//! Consistent hashing (as in Broder's min-wise / content-defined sampling, and as trace
//! samplers such as OpenTelemetry's `TraceIdRatioBased` decide from an id): the decision is a
//! function of the input bytes, so a repeated input is always sampled or always not. Each
//! distinct input is recorded with probability 1/N (XXH3-64 is uniform to within its
//! published SMHasher results), so an average over sampled runs is an unbiased estimate of the
//! average over distinct inputs weighted by their repeats, and a repeat rate measured on the
//! sampled runs is the repeat rate of the recorded inputs.

use std::sync::Arc;

use rlx_cpu::op_registry::{CpuKernel, CpuTensorMut, CpuTensorRef};
use rlx_ir::op_registry::OpExtension;
use rlx_ir::{DType, Shape};
use serde::{Deserialize, Serialize};

/// Most graph inputs a gate reads (one registered gate op per input count, 1..=this).
pub const MAX_GATE_INPUTS: usize = 16;

/// Prefix of the gate op names: `opscope.sample.K` reads `K` graph inputs.
pub const GATE_PREFIX: &str = "opscope.sample.";

/// Suffix of the gated sketch ops: `opscope.sketch.gated` is `opscope.sketch` with the gate as
/// an extra last input.
pub const GATED_SUFFIX: &str = ".gated";

/// The gated form of a sketch op name (`opscope.sketch` -> `opscope.sketch.gated`).
pub fn gated_name(op: &str) -> String {
    format!("{op}{GATED_SUFFIX}")
}

/// What the gate needs: the sampling period and the names of the inputs it reads, in order.
/// Serialized (JSON) into the gate op's attribute bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GateSpec {
    /// Record one run in `every` (>= 1).
    pub every: u64,
    /// Graph input names, in the order the gate's inputs are wired.
    pub names: Vec<String>,
}

/// XXH3-64 (seed 0) of a run's inputs: per input in order, its name's byte length (u64 LE), the
/// name, the dtype as RLX's `Debug` prints it (`F32`, `I64`), the data's byte length (u64 LE)
/// and the bytes (little-endian elements). The same stream as [`crate::memo::content_hash`],
/// with the 64-bit digest.
pub fn input_hash(inputs: &[(&str, &[u8], DType)]) -> u64 {
    crate::memo::content_hasher(inputs).digest()
}

/// True when a run whose inputs hash to `hash` ([`input_hash`]) is recorded at 1 in `every`.
pub fn sampled(hash: u64, every: u64) -> bool {
    every <= 1 || hash % every == 0
}

/// The bytes of a CPU tensor view, whatever its dtype (little-endian, as RLX stores them).
fn bytes_of<'a>(t: &'a CpuTensorRef<'a>) -> &'a [u8] {
    fn raw<T>(s: &[T]) -> &[u8] {
        // SAFETY: the element types below are plain numbers (no padding); the slice covers
        // exactly `s`'s memory, read-only, for the duration of the borrow.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
    }
    match t {
        CpuTensorRef::F32 { data, .. } => raw(data),
        CpuTensorRef::F64 { data, .. } => raw(data),
        CpuTensorRef::F16 { data, .. } => raw(data),
        CpuTensorRef::BF16 { data, .. } => raw(data),
        CpuTensorRef::I8 { data, .. } => raw(data),
        CpuTensorRef::I16 { data, .. } => raw(data),
        CpuTensorRef::I32 { data, .. } => raw(data),
        CpuTensorRef::I64 { data, .. } => raw(data),
        CpuTensorRef::U8 { data, .. } => raw(data),
        CpuTensorRef::U32 { data, .. } => raw(data),
        CpuTensorRef::Bool { data, .. } => raw(data),
    }
}

/// Shape inference of a gate: one F32 value.
struct GateOp {
    name: String,
    inputs: usize,
}

impl OpExtension for GateOp {
    fn name(&self) -> &str {
        &self.name
    }
    fn num_inputs(&self) -> usize {
        self.inputs
    }
    fn infer_shape(&self, _inputs: &[&Shape], _attrs: &[u8]) -> Shape {
        Shape::new(&[1], DType::F32)
    }
}

/// CPU kernel of a gate: `1` when the run's inputs are sampled, else `0`.
struct GateKernel {
    name: String,
}

impl CpuKernel for GateKernel {
    fn name(&self) -> &str {
        &self.name
    }
    fn execute(&self, inputs: &[CpuTensorRef<'_>], output: CpuTensorMut<'_>, attrs: &[u8]) -> Result<(), String> {
        let spec: GateSpec = serde_json::from_slice(attrs).map_err(|e| format!("{}: bad attributes: {e}", self.name))?;
        if spec.names.len() != inputs.len() {
            return Err(format!("{}: {} input names for {} inputs", self.name, spec.names.len(), inputs.len()));
        }
        let views: Vec<(&str, &[u8], DType)> =
            spec.names.iter().zip(inputs).map(|(n, t)| (n.as_str(), bytes_of(t), t.dtype())).collect();
        let out = output.expect_f32_mut("opscope.sample output")?;
        out[0] = if sampled(input_hash(&views), spec.every) { 1.0 } else { 0.0 };
        Ok(())
    }
}

/// Register the gate ops for 1..=[`MAX_GATE_INPUTS`] inputs (called once, from
/// [`super::register_kernels`]).
pub(crate) fn register_gates() {
    for k in 1..=MAX_GATE_INPUTS {
        let name = format!("{GATE_PREFIX}{k}");
        rlx_ir::op_registry::register_op(Arc::new(GateOp { name: name.clone(), inputs: k }));
        rlx_cpu::op_registry::register_cpu_kernel(Arc::new(GateKernel { name }));
    }
}
