//! Derived parameters: weights an actuation computes on the host from a weight the caller binds.
//!
//! Most RLX programs bind their weights with `set_param` *after* compiling (MiniLM in the lab
//! does), so a compile-time rewrite such as `lowrank` cannot see the values it factors. It adds
//! new `Op::Param`s instead (`<W>/lowrank/r<R>/U`, `.../V`) and [`declare`]s a [`Derivation`]:
//! the source param name and a host function from the source's values to each target's. Whoever
//! binds weights calls [`bind`] instead of `set_param`; it sets the source and every target the
//! compiled graph declares. [`check`] refuses a compiled graph whose derived params were never
//! set (RLX would otherwise read zeros and only warn).
//!
//! Code that does not know about opscope (the environment mode, a scope around unchanged code)
//! calls plain `CompiledGraph::set_param`: opscope's backend wrapper (`activate::env`) wraps
//! every executable whose graph declares derived params, computes them in `set_param` /
//! `set_param_typed` through [`derive`], and refuses to run while one is unbound. [`derive`]
//! keeps the last result per derivation keyed by the source's XXH3-128 hash, so binding the same
//! weight twice (the wrapper, then [`bind`]) factors it once.
//!
//! The registry is process-wide and keyed by target name; target names encode everything the
//! derivation depends on (the pass and its options), so two compiles of one model share one entry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use rlx_ir::{Graph, Op};
use rlx_runtime::CompiledGraph;

use crate::error::Error;

/// A host function from the source param's values (row-major, as bound) to each target's values,
/// in [`Derivation::targets`] order. Errors are messages naming the problem.
pub type DeriveFn = dyn Fn(&[f32]) -> Result<Vec<Vec<f32>>, String> + Send + Sync;

/// How derived params are computed from one source param.
pub struct Derivation {
    /// The param the caller binds.
    pub source: String,
    /// The params computed from it, with their element counts.
    pub targets: Vec<(String, usize)>,
    /// The host computation.
    pub compute: Arc<DeriveFn>,
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Derivation>>> {
    static R: OnceLock<Mutex<HashMap<String, Arc<Derivation>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// Register `d` under each of its target names (a later declaration of the same names replaces it).
pub fn declare(d: Derivation) {
    let d = Arc::new(d);
    let mut r = registry().lock().unwrap_or_else(|e| e.into_inner());
    for (t, _) in &d.targets {
        r.insert(t.clone(), d.clone());
    }
}

/// The derivation that computes param `name`, if it is a derived param.
pub fn derivation(name: &str) -> Option<Arc<Derivation>> {
    registry().lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
}

/// The derived params `graph` declares (its `Op::Param`s with a declared [`Derivation`]), in
/// node order, with their derivations.
pub fn derived_in(graph: &Graph) -> Vec<(String, Arc<Derivation>)> {
    graph
        .nodes()
        .iter()
        .filter_map(|n| match &n.op {
            Op::Param { name } => derivation(name).map(|d| (name.clone(), d)),
            _ => None,
        })
        .collect()
}

/// The values of `d`'s targets computed from source values `data`, in [`Derivation::targets`]
/// order, each checked against its element count. The last result per derivation is kept, keyed
/// by the XXH3-128 hash of `data`'s bytes, so a second bind of the same weight is a lookup.
///
/// Errors: the derivation fails on `data` (wrong length, non-finite value), or returns a target
/// of the wrong length; the message names the param.
pub fn derive(d: &Derivation, data: &[f32]) -> Result<Arc<Vec<Vec<f32>>>, Error> {
    type Cache = Mutex<HashMap<String, (u128, Arc<Vec<Vec<f32>>>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let key = d.targets.first().map(|t| t.0.clone()).unwrap_or_default();
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hash = xxhash_rust::xxh3::xxh3_128(&bytes);
    let cache = CACHE.get_or_init(Default::default);
    if let Some((h, v)) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        if *h == hash {
            return Ok(v.clone());
        }
    }
    let values = (d.compute)(data).map_err(|why| Error::Params { why: format!("deriving {key} from '{}': {why}", d.source) })?;
    if values.len() != d.targets.len() {
        return Err(Error::Params { why: format!("deriving from '{}' gave {} values for {} targets", d.source, values.len(), d.targets.len()) });
    }
    for ((t, n), v) in d.targets.iter().zip(&values) {
        if v.len() != *n {
            return Err(Error::Params { why: format!("derived param '{t}' has {} values, its shape holds {n}", v.len()) });
        }
    }
    let values = Arc::new(values);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(key, (hash, values.clone()));
    Ok(values)
}

/// Set param `name` of `c` to `data` (as `CompiledGraph::set_param`) and every derived param of
/// `c` computed from it.
///
/// Errors: a derivation fails on `data` (wrong length, non-finite values), named with the param.
pub fn bind(c: &mut CompiledGraph, name: &str, data: &[f32]) -> Result<(), Error> {
    c.set_param(name, data);
    let mut done: Vec<*const Derivation> = Vec::new();
    for p in c.params() {
        let Some(d) = derivation(&p.name) else { continue };
        if d.source != name || done.contains(&Arc::as_ptr(&d)) {
            continue;
        }
        done.push(Arc::as_ptr(&d));
        let values = derive(&d, data)?;
        for ((t, _), v) in d.targets.iter().zip(values.iter()) {
            c.set_param(t, v);
        }
    }
    Ok(())
}

/// Refuse `c` when a derived param it declares was never set: RLX would read zeros.
///
/// Errors: the unset derived params, with the fix (bind their source through [`bind`]).
pub fn check(c: &CompiledGraph) -> Result<(), Error> {
    let unset: Vec<String> = match c.check_bindings(&[]) {
        Ok(()) => return Ok(()),
        // A param the executable holds (set by opscope's wrapper, which RLX's own bookkeeping
        // does not see) is bound.
        Err(rlx_runtime::io_check::IoError::Unbound { params, .. }) => params.into_iter().filter(|p| derivation(p).is_some() && !c.param_already_set(p)).collect(),
        Err(_) => return Ok(()),
    };
    if unset.is_empty() {
        return Ok(());
    }
    let sources: Vec<String> = unset.iter().filter_map(|p| derivation(p).map(|d| d.source.clone())).collect();
    Err(Error::Params {
        why: format!(
            "derived params {} were never set (they would read zeros): bind their source params {} with opscope::params::bind instead of set_param",
            unset.join(", "),
            sources.join(", ")
        ),
    })
}
