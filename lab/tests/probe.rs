//! `opscope probe` against numpy (python3 subprocess). numpy writes a capture directory (the
//! `.npy` files and `manifest.json` a `capture` pass writes) and computes every reference in
//! float64; the probe reads the directory and must agree:
//! - group-of-4 counts along K (last axis of lhs/out, K of the weight `[K, N]`) equal numpy's
//!   exactly, on random tensors with ~50% zeros (the density that triggers `two_four_probe`)
//!   and on a planted 2:4 weight (every group satisfies);
//! - distinct f32 bit patterns equal `np.unique(a.view(np.uint32)).size` (0.0 and -0.0 apart);
//! - the 2:4-pruned GEMM output SQNR (2 largest |w| of each group of 4 along K kept) equals
//!   numpy's (infinite for the planted weight, which is 2:4 already);
//! - the quantized GEMM output SQNR equals numpy's for each of int8/int4 x weights per tensor or
//!   per column x activations per tensor or per token; the activations hold exact rounding
//!   ties (x.5 at scale 1), so round-half-away would differ from numpy's half-to-even;
//! - singular values equal `numpy.linalg.svd` to 1e-4 of sigma_1; the effective rank (Roy &
//!   Vetterli) and the 99%-energy rank equal numpy's;
//! - the miner's `two_four_probe` verdict becomes confirmed on the planted weight, refuted on
//!   the random one; other verdicts are untouched.

use std::path::Path;
use std::process::Command;

use opscope_lab::probe::{probe_dir, two_four_evidence, ProbeReport};
use serde_json::Value;

const NUMPY: &str = r#"
import json, sys, numpy as np
d = sys.argv[1]
rng = np.random.default_rng(7)
B, S, K, N = 2, 8, 32, 12

def sparse(shape, p):
    a = rng.standard_normal(shape).astype(np.float32)
    a[rng.random(shape) < p] = 0.0
    return a

# Activations: ~50% zeros, a -0.0, exact ties at scale 1 (absmax 127 -> int8 per-tensor scale 1).
xa = sparse((B, S, K), 0.5) * 4
xa[0, 0, :6] = [0.0, -0.0, 2.5, -3.5, 0.5, 127.0]
xa[1, 3, :3] = [10.5, -6.5, 1.5]
# Planted 2:4 weight: 2 random zeros in every group of 4 along K of every column.
wa = rng.standard_normal((K, N)).astype(np.float32)
for g in range(0, K, 4):
    for c in range(N):
        z = rng.choice(4, 2, replace=False)
        wa[g + z, c] = 0.0
# Random weight with ~50% zeros, and an activation with outlier channels.
xb = rng.standard_normal((B * S, K)).astype(np.float32)
xb[:, [3, 17]] *= 30
# Subnormals (RLX's softmax leaves ~1e-39 on masked keys): one group of 4 along K with 1 exact
# zero and 3 values a flush-to-zero kernel reads as 0.
xb[0, :4] = np.array([1e-39, -1e-40, 0.0, 1.0], dtype=np.float32)
wb = sparse((K, N), 0.5)
ob = (xb @ wb).astype(np.float32)

tensors = [("a", "lhs", xa), ("a", "rhs", wa), ("b", "lhs", xb), ("b", "rhs", wb), ("b", "out", ob)]
entries = []
for i, (site, role, t) in enumerate(tensors):
    f = "c1-run0/%d.npy" % i
    import os
    os.makedirs(d + "/c1-run0", exist_ok=True)
    np.save(d + "/" + f, t)
    entries.append({"site": site, "op": "matmul", "role": role, "compile": 1, "run": 0, "shape": list(t.shape),
                    "dtype": "f32", "bytes": t.size * 4, "file": f, "invariant": role == "rhs"})
json.dump({"recording": "numpy", "format": "npy", "captured": entries, "skipped": [], "budgets": []}, open(d + "/manifest.json", "w"))

def two_four(t, role):
    a = t if role != "rhs" else np.swapaxes(t, -1, -2)       # K last
    g = (a.reshape(-1, a.shape[-1] // 4, 4) == 0).sum(-1)
    f = (np.abs(a.reshape(-1, a.shape[-1] // 4, 4)) < np.finfo(np.float32).tiny).sum(-1)
    return [int(g.size), int((g >= 2).sum()), int((f >= 2).sum())]

def q(v, qmax, axis):
    amax = np.abs(v).max() if axis is None else np.abs(v).max(axis=axis, keepdims=True)
    s = amax / qmax
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.clip(np.round(v / s), -qmax, qmax) * s
    return np.where(s == 0, 0.0, r)

def sqnr(y, yq):
    e = ((y - yq) ** 2).sum()
    return None if e == 0 else float(10 * np.log10((y ** 2).sum() / e))

def prune(w):
    p = w.copy()
    for g in range(0, w.shape[0], 4):
        for c in range(w.shape[1]):
            o = np.argsort(-np.abs(w[g:g + 4, c]), kind="stable")
            p[g + o[2:], c] = 0.0
    return p

out = {"tensors": [], "gemms": {}}
for site, role, t in tensors:
    sv = np.linalg.svd(t.reshape(-1, t.shape[-1]).astype(np.float64), compute_uv=False)
    p = sv / sv.sum()
    p = p[p > 0]
    e = np.cumsum(sv ** 2) / (sv ** 2).sum()
    out["tensors"].append({"site": site, "role": role, "two_four": two_four(t, role),
                           "distinct": int(np.unique(t.view(np.uint32)).size),
                           "sigma": sv.tolist(), "erank": float(np.exp(-(p * np.log(p)).sum())),
                           "energy99": int(np.argmax(e >= 0.99 * (1 - 1e-12)) + 1)})
for site, x, w in [("a", xa, wa), ("b", xb, wb)]:
    x2 = x.reshape(-1, K).astype(np.float64); w2 = w.astype(np.float64)
    y = x2 @ w2
    res = []
    for bits in (8, 4):
        qmax = 2 ** (bits - 1) - 1
        for wg, ag in (("tensor", "tensor"), ("tensor", "token"), ("channel", "tensor"), ("channel", "token")):
            qw = q(w2, qmax, None if wg == "tensor" else 0)
            qx = q(x2, qmax, None if ag == "tensor" else 1)
            res.append([bits, wg, ag, sqnr(y, qx @ qw)])
    out["gemms"][site] = {"quant": res, "pruned": sqnr(y, x2 @ prune(w2))}
print(json.dumps(out))
"#;

/// numpy writes the capture into `dir` and returns its references.
fn numpy(dir: &Path) -> Value {
    let out = Command::new("python3").args(["-c", NUMPY]).arg(dir).output().expect("python3 runs");
    assert!(out.status.success(), "numpy: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("numpy JSON")
}

fn close_db(a: Option<f64>, b: &Value, what: &str) {
    match (a, b.as_f64()) {
        (None, None) => {}
        (Some(a), Some(b)) => assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{what}: probe {a} dB, numpy {b} dB"),
        (a, _) => panic!("{what}: probe {a:?}, numpy {b}"),
    }
}

fn setup() -> (tempfile::TempDir, Value, ProbeReport) {
    let dir = tempfile::tempdir().unwrap();
    let reference = numpy(dir.path());
    let report = probe_dir(dir.path()).expect("probe reads numpy's capture");
    (dir, reference, report)
}

#[test]
fn group_of_4_counts_and_distinct_values_equal_numpy() {
    let (_dir, reference, report) = setup();
    let want = reference["tensors"].as_array().unwrap();
    assert_eq!(report.tensors.len(), want.len());
    for (t, w) in report.tensors.iter().zip(want) {
        let tf = t.two_four.as_ref().unwrap_or_else(|e| panic!("{}/{}: {e}", t.site, t.role));
        let what = format!("{}/{}", t.site, t.role);
        let n = |i: usize| w["two_four"][i].as_u64().unwrap();
        assert_eq!([tf.groups, tf.satisfying, tf.satisfying_ftz], [n(0), n(1), n(2)], "{what}");
        assert_eq!(t.distinct, w["distinct"].as_u64().unwrap(), "{what} distinct");
    }
    // The planted subnormals: one more group with subnormals read as 0 than with exact zeros.
    let b = report.tensors.iter().find(|t| t.site == "b" && t.role == "lhs").unwrap().two_four.as_ref().unwrap();
    assert_eq!(b.satisfying_ftz, b.satisfying + 1);
    // The planted 2:4 weight satisfies in every group; the ~50%-zero random ones do not.
    let planted = report.tensors.iter().find(|t| t.site == "a" && t.role == "rhs").unwrap();
    assert_eq!(planted.two_four.as_ref().unwrap().fraction, 1.0);
    for t in report.tensors.iter().filter(|t| (t.site == "b" && t.role == "rhs") || (t.site == "a" && t.role == "lhs")) {
        let f = t.two_four.as_ref().unwrap().fraction;
        assert!(f > 0.4 && f < 0.9, "{}/{}: {f}", t.site, t.role);
    }
}

#[test]
fn singular_values_and_effective_ranks_equal_numpy() {
    let (_dir, reference, report) = setup();
    for (t, w) in report.tensors.iter().zip(reference["tensors"].as_array().unwrap()) {
        let what = format!("{}/{}", t.site, t.role);
        let sp = t.spectrum.as_ref().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(sp.method, "exact");
        let want: Vec<f64> = w["sigma"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(sp.sigma.len(), want.len(), "{what}");
        for (i, (a, b)) in sp.sigma.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * want[0], "{what} sigma_{i}: {a} vs numpy {b}");
        }
        let er = w["erank"].as_f64().unwrap();
        assert!((sp.effective_rank - er).abs() <= 1e-6 * er, "{what} effective rank {} vs numpy {er}", sp.effective_rank);
        assert_eq!(sp.energy_rank_99.unwrap() as u64, w["energy99"].as_u64().unwrap(), "{what} 99% energy rank");
    }
}

#[test]
fn quantized_and_pruned_gemm_sqnr_equal_numpy() {
    let (_dir, reference, report) = setup();
    assert_eq!(report.gemms.len(), 2);
    for g in &report.gemms {
        let want = &reference["gemms"][&g.site];
        let quant = want["quant"].as_array().unwrap();
        assert_eq!(g.quant.len(), quant.len());
        for (q, w) in g.quant.iter().zip(quant) {
            assert_eq!((q.bits as u64, q.weights, q.activations), (w[0].as_u64().unwrap(), w[1].as_str().unwrap(), w[2].as_str().unwrap()));
            close_db(q.sqnr_db, &w[3], &format!("{} int{} w:{} a:{}", g.site, q.bits, q.weights, q.activations));
        }
        close_db(g.pruned_2_4_sqnr_db, &want["pruned"], &format!("{} pruned", g.site));
    }
    // The planted weight is 2:4 already: pruning changes nothing.
    assert_eq!(report.gemms.iter().find(|g| g.site == "a").unwrap().pruned_2_4_sqnr_db, None);
    let b = report.gemms.iter().find(|g| g.site == "b").unwrap();
    // Outlier channels in the activation: per-token scales gain over per-tensor.
    let db = |bits, w, a| b.quant.iter().find(|q| q.bits == bits && q.weights == w && q.activations == a).unwrap().sqnr_db.unwrap();
    assert!(db(8, "channel", "token") > db(8, "tensor", "tensor"));
}

#[test]
fn two_four_probe_verdicts_are_confirmed_or_refuted_by_the_counts() {
    use opscope::mine::probe::{kinds, upgrade_two_four};
    use opscope::mine::{kinds as k, Verdict};
    let (_dir, _reference, report) = setup();
    let key = |site: &str, role: &str| (site.to_string(), role.to_string(), 0u32);
    let verdicts = vec![
        Verdict::new(&key("a", "rhs"), k::TWO_FOUR_PROBE, vec![("density", 0.5)], "r", "s"),
        Verdict::new(&key("b", "rhs"), k::TWO_FOUR_PROBE, vec![("density", 0.5)], "r", "s"),
        Verdict::new(&key("c", "rhs"), k::TWO_FOUR_PROBE, vec![("density", 0.5)], "r", "s"),
        Verdict::new(&key("a", "rhs"), k::SPARSE_GEMM, vec![("density", 0.2)], "r", "s"),
    ];
    let up = upgrade_two_four(verdicts, &two_four_evidence(&report));
    let kinds_of: Vec<&str> = up.iter().map(|v| v.kind.name).collect();
    assert_eq!(kinds_of, [kinds::TWO_FOUR_CONFIRMED.name, kinds::TWO_FOUR_REFUTED.name, k::TWO_FOUR_PROBE.name, k::SPARSE_GEMM.name]);
    let ev = |v: &Verdict, name: &str| v.evidence.iter().find(|(n, _)| n == name).map(|(_, x)| *x);
    // a's weight [32, 12]: 8 x 12 groups, all satisfying.
    assert_eq!((ev(&up[0], "groups_4"), ev(&up[0], "groups_2_4")), (Some(96.0), Some(96.0)));
    let b = report.tensors.iter().find(|t| t.site == "b" && t.role == "rhs").unwrap().two_four.clone().unwrap();
    assert_eq!(ev(&up[1], "fraction_2_4"), Some(b.fraction));
    assert!(ev(&up[1], "pruned_sqnr_db").is_some());
    assert_eq!(up[2].evidence.len(), 1);
}

#[test]
fn cli_prints_json_and_refuses_a_directory_without_a_manifest() {
    let (dir, reference, _) = setup();
    let out = Command::new(env!("CARGO_BIN_EXE_opscope")).args(["probe", "--json", "--capture"]).arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["tensors"].as_array().unwrap().len(), reference["tensors"].as_array().unwrap().len());
    assert_eq!(doc["gemms"].as_array().unwrap().len(), 2);
    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_opscope")).args(["probe", "--capture"]).arg(empty.path()).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("manifest.json") && err.contains(".capture"), "{err}");
}

#[test]
fn low_rank_probe_verdicts_are_confirmed_or_refuted_by_the_spectrum() {
    use opscope::mine::probe::{kinds, upgrade_low_rank, LowRankEvidence};
    use opscope::mine::{kinds as k, Verdict};
    let key = |site: &str| (site.to_string(), "lhs".to_string(), 0u32);
    let probe = |site: &str| Verdict::new(&key(site), k::LOW_RANK_PROBE, vec![("row_energy_cv", 0.5)], "r", "s");
    // [64, 256]: a factorization pays up to rank 64 * 256 / (2 * 320) = 25.6.
    let ev = |site: &str, rank: Option<usize>| LowRankEvidence { site: site.into(), role: "lhs".into(), rows: 64, cols: 256, energy_rank_99: rank };
    assert_eq!(ev("x", None).max_paying_rank(), 25.6);
    let evidence = [ev("at", Some(25)), ev("above", Some(26)), ev("unknown", None), ev("runs", Some(3)), ev("runs", Some(40)), ev("runs", Some(5))];
    let verdicts = vec![probe("at"), probe("above"), probe("unknown"), probe("runs"), probe("unprobed"), Verdict::new(&key("at"), k::SPARSE_GEMM, vec![], "r", "s")];
    let up = upgrade_low_rank(verdicts, &evidence);
    let kinds_of: Vec<&str> = up.iter().map(|v| v.kind.name).collect();
    let (c, r) = (kinds::LOW_RANK_CONFIRMED.name, kinds::LOW_RANK_REFUTED.name);
    assert_eq!(kinds_of, [c, r, r, r, k::LOW_RANK_PROBE.name, k::SPARSE_GEMM.name]);
    let get = |v: &Verdict, name: &str| v.evidence.iter().find(|(n, _)| n == name).map(|(_, x)| *x).unwrap();
    assert_eq!(get(&up[0], "energy_rank_99"), 25.0);
    assert!(get(&up[2], "energy_rank_99").is_nan(), "a rank above the randomized SVD's is not a number");
    // The run that refutes is the one reported, with the count of runs probed.
    assert_eq!((get(&up[3], "energy_rank_99"), get(&up[3], "runs_probed")), (40.0, 3.0));
    assert_eq!(up[4].evidence.len(), 1, "no evidence: unchanged");
}

/// Above [`opscope_lab::probe::EXACT_SVD_MAX`] the spectrum is a randomized top 64: its 99%
/// energy rank must be measured against the whole tensor's energy (the sum of squares of the
/// data), not the top 64's, and be `None` when the top 64 hold less than 99% of it.
#[test]
fn randomized_spectrum_measures_the_energy_rank_against_the_whole_tensor() {
    use rand::{Rng, SeedableRng};
    let (rows, cols) = (1100, 1040);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut gauss = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen::<f32>() - 0.5).collect() };
    let full = gauss(rows * cols);
    let sp = opscope_lab::probe::spectrum(&full, &[rows, cols]).unwrap();
    assert_eq!((sp.method, sp.sigma.len()), ("randomized", 64));
    // A dense random matrix needs about 90% of its 1040 dims for 99% of its energy.
    assert_eq!(sp.energy_rank_99, None, "the top 64 of a full-rank tensor hold {:.1}% of its energy", 100.0 * sp.sigma.iter().map(|s| s * s).sum::<f64>() / full.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>());
    // Rank 8 plus noise at 1e-3 of its scale: 8 components hold >= 99%.
    let (a, b) = (gauss(rows * 8), gauss(8 * cols));
    let noise = gauss(rows * cols);
    let planted: Vec<f32> = (0..rows * cols)
        .map(|ij| {
            let (i, j) = (ij / cols, ij % cols);
            (0..8).map(|t| a[i * 8 + t] * b[t * cols + j]).sum::<f32>() + 1e-3 * noise[ij]
        })
        .collect();
    let sp = opscope_lab::probe::spectrum(&planted, &[rows, cols]).unwrap();
    assert_eq!(sp.method, "randomized");
    let r = sp.energy_rank_99.expect("8 components hold 99%");
    assert!((1..=8).contains(&r), "99% energy rank {r} of a rank-8 tensor");
}

/// Up to [`opscope_lab::probe::DISTINCT_EXACT_MAX`] values the distinct count is exact; above,
/// HyperLogLog++ must land within 3 standard errors (3 x 1.04 / sqrt(2^14) = 2.4%) of the truth.
#[test]
fn distinct_values_are_exact_up_to_the_limit_then_hyperloglog() {
    use opscope_lab::probe::{distinct_bits, DISTINCT_EXACT_MAX};
    let tensor = |n: usize, distinct: u32| -> Vec<f32> { (0..n).map(|i| f32::from_bits(0x3f80_0000 + ((i as u64 * 7919) % u64::from(distinct)) as u32)).collect() };
    assert_eq!(distinct_bits(&tensor(DISTINCT_EXACT_MAX, 3_000_001)), (3_000_001, true));
    let (est, exact) = distinct_bits(&tensor(DISTINCT_EXACT_MAX + 1, 3_000_001));
    assert!(!exact);
    let err = (est as f64 - 3_000_001.0).abs() / 3_000_001.0;
    assert!(err <= 3.0 * 1.04 / 128.0, "HyperLogLog++ estimate {est} of 3000001 distinct: {:.2}% off", 100.0 * err);
}
