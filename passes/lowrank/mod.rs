//! `lowrank`: replace a weight `W [K, N]` by its best rank-`r` approximation (Eckart-Young:
//! the truncated SVD), as two matmuls: `x @ W` becomes `(x @ U) @ V` with
//!
//! ```text
//! W = U_full diag(sigma) V_full^T          exact (thin) SVD, crate::linalg, in f64
//! U = U_r diag(sigma_r)   [K, r]           V = V_r^T   [r, N]
//! ||W - U V||_F^2 = sum_{i > r} sigma_i^2  (the tail energy)
//! ```
//!
//! sigma goes to the left factor so that `V` keeps orthonormal rows; the product, and so the
//! error, is the same for any split. Cost per row of `x`: `2 r (K + N)` FLOPs against `2 K N`;
//! a rank `r >= K N / (K + N)` saves nothing and is skipped with the reason unless `force=true`.
//!
//! Weights are usually bound after compile, so the factors are *derived params*
//! (`<W>/lowrank/r<R>/U`, `.../V`, see [`crate::params`]): the pass declares how to compute them
//! from `W`'s values. Code that knows opscope binds with `opscope::params::bind`; plain RLX code
//! (the environment mode, a scope) binds `W` with `set_param` and opscope's executable wrapper
//! computes the factors there, refusing to run while they are unbound. Forms: `MatMul`,
//! `FusedMatMulBiasAct` (bias and activation kept: the fused kernel now reads `x @ U` and `V`).
//! A constant weight (an `Op::Constant`) is factored at compile time into constants. `energy=e`
//! (0 < e <= 1) picks `r` as the smallest rank keeping the fraction `e` of `sum sigma_i^2`
//! ([`crate::linalg::rank_for_energy`]); it needs the values at compile time, so a param weight
//! is skipped with the reason (use `rank=R`).
//! Skipped with a reason: a weight that is not one param or constant reached through reshapes and transposes
//! (concatenated Q/K/V, activations), non-f32 or symbolic shapes, a weight of rank other than 2.

use rlx_ir::{DType, Graph, NodeId, Op, Shape};

use crate::error::Error;
use crate::linalg::{self, LinalgError};
use crate::manifest::Role;
use crate::params::{declare, Derivation};
use crate::pass::{Globs, Opt, OptionSpec, Options, Pass, PassKind, PassRegistration};
use crate::rewrite::Rewrite;
use crate::sketch::static_dims;

const SITES: Opt<Globs> = Opt::globs("sites", "[*]", "glob patterns over site names (as the matmul tap names them)");
const RANK: Opt<u64> = Opt::uint("rank", 1, 1 << 20, "32", "rank r of the approximation W ~ U V (U [K,r], V [r,N])");
const FORCE: Opt<bool> = Opt::bool("force", "false", "rewrite also where r >= K N / (K + N) (no FLOP saving)");
const ENERGY: Opt<f32> = Opt::float("energy", 0.0, 1.0, "0", "if > 0: r = the smallest rank keeping this fraction of sum sigma_i^2 (replaces rank); needs W's values at compile time (a Constant weight)");

const OPTIONS: &[OptionSpec] = &[SITES.spec, RANK.spec, FORCE.spec, ENERGY.spec];

/// The `lowrank` actuation pass.
pub struct LowRank;

/// One step from the bound param to the matmul's `[K, N]` weight.
#[derive(Clone)]
enum Step {
    /// Row-major data unchanged.
    Reshape,
    /// Permute axes of a tensor of dims `dims`.
    Transpose { dims: Vec<usize>, perm: Vec<usize> },
}

/// Where the weight's values come from.
enum Source {
    /// A param bound after compile (factors are derived params).
    Param(String),
    /// A constant: its f32 values, known at compile time (factors are constants).
    Constant(Vec<f32>),
}

/// The param or constant feeding `id` through reshapes and transposes, and the steps from it to
/// `id`.
fn param_chain(g: &Graph, id: NodeId) -> Option<(Source, Vec<Step>)> {
    let n = g.node(id);
    match &n.op {
        Op::Param { name } => Some((Source::Param(name.clone()), Vec::new())),
        Op::Constant { data } if n.shape.dtype() == DType::F32 && data.len() % 4 == 0 => {
            Some((Source::Constant(data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()), Vec::new()))
        }
        Op::Reshape { .. } => {
            let (p, mut s) = param_chain(g, n.inputs[0])?;
            s.push(Step::Reshape);
            Some((p, s))
        }
        Op::Transpose { perm } => {
            let dims = static_dims(g.shape(n.inputs[0]))?;
            let (p, mut s) = param_chain(g, n.inputs[0])?;
            s.push(Step::Transpose { dims, perm: perm.clone() });
            Some((p, s))
        }
        _ => None,
    }
}

/// Row-major permutation of `data` of dims `dims`: output axis `i` is input axis `perm[i]`.
fn permute(data: &[f32], dims: &[usize], perm: &[usize]) -> Vec<f32> {
    let rank = dims.len();
    let mut in_strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        in_strides[i] = in_strides[i + 1] * dims[i + 1];
    }
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let mut out = Vec::with_capacity(data.len());
    let mut idx = vec![0usize; rank];
    for _ in 0..data.len() {
        out.push(data[(0..rank).map(|i| idx[i] * in_strides[perm[i]]).sum::<usize>()]);
        for a in (0..rank).rev() {
            idx[a] += 1;
            if idx[a] < out_dims[a] {
                break;
            }
            idx[a] = 0;
        }
    }
    out
}

/// The factors `U = U_r diag(sigma_r) [k, r]` and `V = V_r^T [r, n]` of row-major `w [k, n]`
/// from the exact SVD ([`crate::linalg::svd`]), row-major f32.
///
/// Errors: as [`crate::linalg::svd`] (wrong length, non-finite value, no convergence).
pub fn factors(w: &[f32], k: usize, n: usize, r: usize) -> Result<(Vec<f32>, Vec<f32>), LinalgError> {
    let s = linalg::svd(w, k, n)?;
    let m = s.rank();
    let r = r.min(m);
    let uf = (0..k * r).map(|x| (s.u[(x / r) * m + x % r] * s.sigma[x % r]) as f32).collect();
    let vf = s.vt[..r * n].iter().map(|&v| v as f32).collect();
    Ok((uf, vf))
}

/// Replay the reshapes and transposes from the bound values to the matmul's `[K, N]` weight.
fn replay(mut m: Vec<f32>, steps: &[Step]) -> Vec<f32> {
    for s in steps {
        if let Step::Transpose { dims, perm } = s {
            m = permute(&m, dims, perm);
        }
    }
    m
}

impl Pass for LowRank {
    fn name(&self) -> &'static str {
        "lowrank"
    }
    fn kind(&self) -> PassKind {
        PassKind::Actuation
    }
    fn doc(&self) -> &'static str {
        "truncated-SVD low rank: x @ W becomes (x @ U) @ V, U = U_r diag(sigma_r) [K,r], V = V_r^T [r,N]; factors are derived params bound with opscope::params::bind"
    }
    fn options(&self) -> &'static [OptionSpec] {
        OPTIONS
    }

    fn run(&self, opts: &Options, rw: &mut Rewrite) -> Result<(), Error> {
        let patterns = opts.get(&SITES)?;
        let rank = opts.get(&RANK)? as usize;
        let force = opts.get(&FORCE)?;
        let energy = opts.get(&ENERGY)?;
        let nodes: Vec<NodeId> = rw.original_nodes().collect();
        for id in nodes {
            let node = rw.graph().node(id);
            if !matches!(node.op, Op::MatMul | Op::FusedMatMulBiasAct { .. }) {
                continue;
            }
            let site = rw.site_name(id);
            let parts: Vec<&str> = site.split('+').collect();
            if parts.len() > 1 {
                // RLX's merged Q/K/V GEMM reads a concatenated weight, which lowrank does not
                // factor (whole or in part): say so for any selection that touches it.
                if parts.iter().any(|p| patterns.matches(p)) || patterns.matches(&site) {
                    let why = "RLX's fusion merged these projections into one GEMM over a concatenated weight, which lowrank does not factor: rewrite the source program, where they are separate ops (opscope record --stage source; Stage::Source)";
                    rw.skip(&site, Some(Role::RHS), None, why.into());
                }
                continue;
            }
            if !patterns.matches(&site) {
                continue;
            }
            let (x, w) = (node.inputs[0], node.inputs[1]);
            let g = rw.graph();
            let Some((source, steps)) = param_chain(g, w) else {
                rw.skip(&site, Some(Role::RHS), Some(w), "rhs is not one param or f32 constant reached through reshapes and transposes (an activation or a concatenated weight)".into());
                continue;
            };
            let (xs, ws) = (g.shape(x).clone(), g.shape(w).clone());
            let (Some(xd), Some(wd)) = (static_dims(&xs), static_dims(&ws)) else {
                rw.skip(&site, Some(Role::RHS), Some(w), "symbolic dims".into());
                continue;
            };
            if xs.dtype() != DType::F32 || ws.dtype() != DType::F32 || wd.len() != 2 || xd.is_empty() {
                rw.skip(&site, Some(Role::RHS), Some(w), format!("needs f32 operands and a rank-2 weight, got {:?} {:?} rank {}", xs.dtype(), ws.dtype(), wd.len()));
                continue;
            }
            let (k, n) = (wd[0], wd[1]);
            let break_even = (k * n) as f64 / (k + n) as f64;
            // The weight as the matmul reads it, when known at compile time.
            let known: Option<Vec<f32>> = match &source {
                Source::Constant(data) if data.len() == k * n => Some(replay(data.clone(), &steps)),
                _ => None,
            };
            let rank = if energy > 0.0 {
                let Some(m) = known.as_ref() else {
                    let why = match &source {
                        Source::Param(p) => format!("energy={energy} needs W's values at compile time, but '{p}' is a param bound after compile: use rank=R (opscope::linalg::rank_for_energy of W's singular values gives R)"),
                        Source::Constant(_) => "constant weight whose data does not match its shape".to_string(),
                    };
                    rw.skip(&site, Some(Role::RHS), Some(w), why);
                    continue;
                };
                let sigma = match linalg::svd(m, k, n) {
                    Ok(s) => s.sigma,
                    Err(e) => {
                        rw.skip(&site, Some(Role::RHS), Some(w), format!("SVD of the constant weight: {e}"));
                        continue;
                    }
                };
                linalg::rank_for_energy(&sigma, energy as f64).map_err(|e| Error::Graph(format!("lowrank at {site}: {e}")))?.max(1)
            } else {
                rank
            };
            if rank * (k + n) >= k * n && !force {
                rw.skip(&site, Some(Role::RHS), Some(w), format!("rank {rank} >= K N / (K + N) = {break_even:.1} for [{k}, {n}]: no FLOP saving (force=true to rewrite anyway)"));
                continue;
            }
            let r = rank.min(k.min(n));
            let (u, v, from) = match (&source, known) {
                (Source::Constant(_), Some(m)) => {
                    let (uf, vf) = match factors(&m, k, n, r) {
                        Ok(f) => f,
                        Err(e) => {
                            rw.skip(&site, Some(Role::RHS), Some(w), format!("SVD of the constant weight: {e}"));
                            continue;
                        }
                    };
                    let g = rw.graph_mut();
                    let to_bytes = |v: Vec<f32>| v.into_iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
                    let u = g.add_node(Op::Constant { data: to_bytes(uf) }, vec![], Shape::new(&[k, r], DType::F32));
                    let v = g.add_node(Op::Constant { data: to_bytes(vf) }, vec![], Shape::new(&[r, n], DType::F32));
                    (u, v, "a constant W (factored at compile time)".to_string())
                }
                (Source::Constant(_), None) => {
                    rw.skip(&site, Some(Role::RHS), Some(w), "constant weight whose data does not match its shape".into());
                    continue;
                }
                (Source::Param(param), _) => {
                    let param = param.clone();
                    let (un, vn) = (format!("{param}/lowrank/r{r}/U"), format!("{param}/lowrank/r{r}/V"));
                    let src_dims = static_dims(g.shape(g.param_id(&param).expect("chain starts at this param"))).unwrap_or_default();
                    let src_len: usize = src_dims.iter().product();
                    let compute = move |data: &[f32]| -> Result<Vec<Vec<f32>>, String> {
                        if data.len() != src_len {
                            return Err(format!("{} values, the param's shape holds {src_len}", data.len()));
                        }
                        let m = replay(data.to_vec(), &steps);
                        let (u, v) = factors(&m, k, n, r).map_err(|e| e.to_string())?;
                        Ok(vec![u, v])
                    };
                    declare(Derivation { source: param.clone(), targets: vec![(un.clone(), k * r), (vn.clone(), r * n)], compute: std::sync::Arc::new(compute) });
                    let g = rw.graph_mut();
                    let u = g.param(un, Shape::new(&[k, r], DType::F32));
                    let v = g.param(vn, Shape::new(&[r, n], DType::F32));
                    (u, v, format!("'{param}'"))
                }
            };
            let g = rw.graph_mut();
            let mut hd = xd.clone();
            *hd.last_mut().expect("rank >= 1") = r;
            let h = g.add_node(Op::MatMul, vec![x, u], Shape::new(&hd, DType::F32));
            g.node_mut(h).name = Some(format!("opscope/lowrank/{site}/xU"));
            let mut inputs = g.node(id).inputs.clone();
            inputs[0] = h;
            inputs[1] = v;
            g.set_inputs(id, inputs);
            rw.actuate(&site, id, format!("lowrank r {r}: x @ W -> (x @ U[{k},{r}]) @ V[{r},{n}], factors derived from {from}"));
        }
        Ok(())
    }
}

/// Referenced by [`super::link`] so that this file's registration is linked.
#[inline(never)]
pub(super) fn link() {}

inventory::submit! { PassRegistration(&LowRank) }
