//! Probes: sketch kernels that need an op's semantics or several tensors (attention weights,
//! routing, residual blocks). A probe is declared by the pass that uses it, next to its
//! statistics table, and registered with
//! `inventory::submit! { ProbeRegistration(&Typed::<MyProbe>::NEW) }`; the sketch op with two
//! or three inputs ([`crate::sketch::SKETCH2_OP`], [`crate::sketch::SKETCH3_OP`]) dispatches
//! to it by name. The core knows no concrete probe.

use std::fmt;
use std::marker::PhantomData;

use rlx_cpu::op_registry::CpuTensorRef;
use rlx_ir::{Graph, NodeId};
use serde::de::{DeserializeOwned, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::sketch::Stat;

/// What a sketch op reads: one tensor (the tensor statistics), or the inputs of a registered
/// probe with its parameters (geometry, options) as the probe serialized them.
///
/// Serialized as `"Tensor"` or `{"<probe name>": <parameters>}`.
#[derive(Debug, Clone, Default)]
pub enum Probe {
    /// One tensor, the plain statistics (`min`, `hist`, ...).
    #[default]
    Tensor,
    /// A registered probe.
    Pass {
        /// The probe's name ([`TypedProbe::NAME`]).
        name: String,
        /// Its parameters, JSON as the probe serialized them.
        params: Box<RawValue>,
    },
}

impl PartialEq for Probe {
    fn eq(&self, other: &Probe) -> bool {
        match (self, other) {
            (Probe::Tensor, Probe::Tensor) => true,
            (Probe::Pass { name: a, params: p }, Probe::Pass { name: b, params: q }) => a == b && p.get() == q.get(),
            _ => false,
        }
    }
}

impl Serialize for Probe {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Probe::Tensor => s.serialize_str("Tensor"),
            Probe::Pass { name, params } => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry(name, params)?;
                m.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Probe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Probe, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Probe;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"Tensor\" or {\"<probe>\": parameters}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Probe, E> {
                match v {
                    "Tensor" => Ok(Probe::Tensor),
                    other => Err(E::custom(format!("unknown probe '{other}'"))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Probe, A::Error> {
                let (name, params): (String, Box<RawValue>) =
                    map.next_entry()?.ok_or_else(|| serde::de::Error::custom("empty probe"))?;
                Ok(Probe::Pass { name, params })
            }
        }
        d.deserialize_any(V)
    }
}

/// A probe's kernel, as the sketch op sees it: untyped parameters in, statistics out.
/// Implemented for every [`TypedProbe`] by [`Typed`]; a pass implements [`TypedProbe`].
pub trait ProbeKernel: Sync {
    /// The probe's name (the key of [`Probe::Pass`]).
    fn name(&self) -> &'static str;
    /// Values each of `stats` occupies, in order, for these parameters.
    ///
    /// Errors: parameters that do not decode.
    fn lengths(&self, params: &str, stats: &[Stat]) -> Result<Vec<usize>, String>;
    /// Compute every statistic the probe computes from `inputs`; the caller lays out the ones
    /// the spec selected.
    ///
    /// Errors: parameters that do not decode, an input count or size that does not match the
    /// geometry.
    fn execute(&self, params: &str, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String>;
    /// Why this probe (with these parameters) has no lowering into RLX primitive ops, or `Ok`
    /// when [`ProbeKernel::lower`] builds one ([`TypedProbe::lowering`]).
    ///
    /// Errors: the reason, in words (also for parameters that do not decode).
    fn lowering(&self, params: &str) -> Result<(), String>;
    /// Build the lowering of `stats` reading `inputs` (the sketch op's inputs) into `g`
    /// ([`TypedProbe::lower`]). Call only when [`ProbeKernel::lowering`] is `Ok`.
    ///
    /// Errors: parameters that do not decode.
    fn lower(&self, params: &str, g: &mut Graph, inputs: &[NodeId], stats: &[Stat]) -> Result<Vec<LoweredStat>, String>;
}

/// One statistic of a probe's lowering: the node computing it (`[len]` F32 where `len` is
/// [`TypedProbe::stat_len`], NaN where the kernel writes NaN: the recorder drops those), or
/// the reason it is not lowered (the slot is then filled with NaN and the manifest lists it).
pub type LoweredStat = Result<NodeId, String>;

/// A probe with typed parameters: the type is its parameters (serialized into the op's
/// attributes), and its methods give the statistics' lengths and compute them.
pub trait TypedProbe: Serialize + DeserializeOwned + Sync + 'static {
    /// Name of the probe, unique among linked probes (`Attention`).
    const NAME: &'static str;
    /// The statistics this probe (with these parameters) can compute, in layout order.
    fn stats(&self) -> &'static [Stat];
    /// Values statistic `s` occupies.
    fn stat_len(&self, s: Stat) -> usize;
    /// Compute the statistics from the op's inputs: one `(stat, values)` per statistic the spec
    /// selected, in its order, each `values` of exactly [`TypedProbe::stat_len`] values (the
    /// sketch op lays them out at the spec's offsets).
    ///
    /// Errors: an input count or size that does not match the geometry.
    fn execute(&self, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String>;
    /// `Ok` when [`TypedProbe::lower`] builds a lowering into RLX primitive ops (what a device
    /// without a native sketch kernel runs, or `lower=true` on the CPU); else why not. The
    /// default: no lowering.
    ///
    /// Errors: the reason, in words.
    fn lowering(&self) -> Result<(), String> {
        Err(format!("the {} probe has no lowering into RLX primitive ops", Self::NAME))
    }
    /// Append to `g` the primitive ops computing `stats` (in layout order) from `inputs` (the
    /// sketch op's inputs), one [`LoweredStat`] per statistic: the node must hold exactly the
    /// values [`TypedProbe::execute`] writes for it (the layout is the kernel's), or the reason
    /// the statistic cannot be lowered exactly. Called only when [`TypedProbe::lowering`] is
    /// `Ok`; the default lowers nothing.
    fn lower(&self, g: &mut Graph, inputs: &[NodeId], stats: &[Stat]) -> Vec<LoweredStat> {
        let _ = (g, inputs);
        stats.iter().map(|_| Err(format!("the {} probe has no lowering", Self::NAME))).collect()
    }
}

/// The [`ProbeKernel`] of a [`TypedProbe`]: `Typed::<MyProbe>::NEW`.
pub struct Typed<P>(PhantomData<fn() -> P>);

impl<P> Typed<P> {
    /// The kernel value to register.
    pub const NEW: Typed<P> = Typed(PhantomData);
}

fn decode<P: TypedProbe>(params: &str) -> Result<P, String> {
    serde_json::from_str(params).map_err(|e| format!("probe {}: bad parameters: {e}", P::NAME))
}

impl<P: TypedProbe> ProbeKernel for Typed<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }
    fn lengths(&self, params: &str, stats: &[Stat]) -> Result<Vec<usize>, String> {
        let p: P = decode(params)?;
        Ok(stats.iter().map(|&s| p.stat_len(s)).collect())
    }
    fn execute(&self, params: &str, inputs: &[CpuTensorRef<'_>]) -> Result<Vec<(Stat, Vec<f32>)>, String> {
        decode::<P>(params)?.execute(inputs)
    }
    fn lowering(&self, params: &str) -> Result<(), String> {
        decode::<P>(params)?.lowering()
    }
    fn lower(&self, params: &str, g: &mut Graph, inputs: &[NodeId], stats: &[Stat]) -> Result<Vec<LoweredStat>, String> {
        Ok(decode::<P>(params)?.lower(g, inputs, stats))
    }
}

/// An entry in the probe registry.
pub struct ProbeRegistration(pub &'static dyn ProbeKernel);

inventory::collect!(ProbeRegistration);

/// The registered probe named `name`.
pub fn lookup(name: &str) -> Option<&'static dyn ProbeKernel> {
    inventory::iter::<ProbeRegistration>.into_iter().map(|r| r.0).find(|k| k.name() == name)
}

/// Check that an input holds the number of values the geometry needs (the message names it).
///
/// Errors: `got != want`.
pub fn need(got: usize, want: usize, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("opscope probe: {what} holds {got} values, the geometry needs {want}"))
    }
}

/// Input `i` as f32 values (the message names it when missing or not f32).
///
/// Errors: no input `i`, or not F32.
pub fn input<'a>(inputs: &'a [CpuTensorRef<'_>], i: usize, what: &str) -> Result<&'a [f32], String> {
    inputs
        .get(i)
        .ok_or_else(|| format!("opscope probe: missing input {i} ({what})"))?
        .expect_f32(what)
}
