//! Tensor miner rules on recordings of real tapped matmuls: the scale-drift rule.

mod common;
use common::*;
use opscope::{MemorySink, Pipeline};
use rlx_runtime::{Device, Session};

/// Record `x * scale(i)` through a tapped matmul for 20 runs and mine it.
fn mine_scaled(scale: impl Fn(usize) -> f32) -> Vec<opscope::mine::Verdict> {
    let sink = MemorySink::default();
    let p = Pipeline::parse("matmul{roles=[lhs]}").unwrap();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(64, 128, 16));
        c.set_param("w", &randn(128 * 16, 1));
        for i in 0..20 {
            let x: Vec<f32> = randn(64 * 128, 100 + i as u64).iter().map(|v| v * scale(i)).collect();
            c.run(&[("x", &x)]);
        }
    })
    .unwrap();
    opscope::mine::mine(&opscope::mine::series_from_rows(&sink.rows()))
}

fn kinds(v: &[opscope::mine::Verdict]) -> Vec<&'static str> {
    v.iter().map(|v| v.kind.name).collect()
}

#[test]
fn a_range_that_triples_is_scale_drift_not_stationary() {
    use opscope::mine::kinds::{DRIFTING, SCALE_DRIFT, STATIONARY};
    // Planted: the scale ramps from 1.0 to 2.9 over 20 runs (the mean stays 0).
    let v = mine_scaled(|i| 1.0 + 0.1 * i as f32);
    let k = kinds(&v);
    assert!(k.contains(&SCALE_DRIFT.name), "{k:?}");
    assert!(!k.contains(&DRIFTING.name) && !k.contains(&STATIONARY.name), "{k:?}");
    let d = v.iter().find(|v| v.kind == SCALE_DRIFT).unwrap();
    let ratio = d.evidence.iter().find(|(n, _)| n == "absmax_end_over_start").unwrap().1;
    assert!((2.4..3.4).contains(&ratio), "a 2.9x ramp of Gaussian absmax: {ratio}");
    // Just inside the line (1.4x): no verdict; a constant scale: stationary.
    assert!(!kinds(&mine_scaled(|i| 1.0 + 0.4 * i as f32 / 19.0)).contains(&SCALE_DRIFT.name));
    let k = kinds(&mine_scaled(|_| 1.0));
    assert!(k.contains(&STATIONARY.name) && !k.contains(&SCALE_DRIFT.name), "{k:?}");
}

/// Record `x` (64 tokens x 128 channels) once through a tapped matmul and mine it.
fn mine_once(x: &[f32]) -> Vec<opscope::mine::Verdict> {
    let sink = MemorySink::default();
    let p = Pipeline::parse("matmul{roles=[lhs]}").unwrap();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(64, 128, 16));
        c.set_param("w", &randn(128 * 16, 1));
        c.run(&[("x", x)]);
    })
    .unwrap();
    opscope::mine::mine(&opscope::mine::series_from_rows(&sink.rows()))
}

fn evidence(v: &opscope::mine::Verdict, name: &str) -> f64 {
    v.evidence.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} missing in {:?}", v.evidence)).1
}

#[test]
fn per_token_sqnr_from_sketches_equals_the_host_computation() {
    use opscope::mine::kinds::{PER_CHANNEL_INT8, PER_TOKEN_INT8};
    // Planted: token r has scale 4^(r mod 8) / 64 (a 16384x spread across tokens), channels alike.
    let (t, c) = (64usize, 128usize);
    let x: Vec<f32> = randn(t * c, 7).iter().enumerate().map(|(i, v)| v * 4f32.powi((i / c % 8) as i32) / 64.0).collect();
    let v = mine_once(&x);
    let tok = v.iter().find(|v| v.kind == PER_TOKEN_INT8).unwrap_or_else(|| panic!("no per-token verdict: {v:?}"));
    assert_eq!(tok.role, "lhs");

    // Host: the Δ²/12 model per tensor, per token, per channel, in f64 from the raw values.
    let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let p = xd.iter().map(|v| v * v).sum::<f64>() / xd.len() as f64;
    let db = |x: f64| 10.0 * x.log10();
    let absmax = xd.iter().fold(0.0f64, |a, v| a.max(v.abs()));
    let row_max: Vec<f64> = (0..t).map(|r| xd[r * c..(r + 1) * c].iter().fold(0.0f64, |a, v| a.max(v.abs()))).collect();
    let col_max: Vec<f64> = (0..c).map(|j| (0..t).map(|r| xd[r * c + j].abs()).fold(0.0, f64::max)).collect();
    let model = |scales: &[f64]| db(p / (scales.iter().map(|a| (a / 127.0).powi(2) / 12.0).sum::<f64>() / scales.len() as f64));
    let want_token = model(&row_max);
    assert!((evidence(tok, "sqnr_int8_per_token_db") - want_token).abs() < 1e-3, "{:?} vs {want_token}", tok.evidence);
    assert!((evidence(tok, "sqnr_int8_per_tensor_db") - model(&[absmax])).abs() < 1e-3);
    assert!((evidence(tok, "sqnr_int8_per_channel_db") - model(&col_max)).abs() < 1e-3);

    // The model agrees with fake-quantizing each token on the host (round to nearest, scale
    // absmax/127): the estimate is a measurement, not just a formula.
    let noise: f64 = (0..t)
        .flat_map(|r| {
            let d = row_max[r] / 127.0;
            xd[r * c..(r + 1) * c].iter().map(move |v| (v - (v / d).round() * d).powi(2)).collect::<Vec<_>>()
        })
        .sum::<f64>()
        / xd.len() as f64;
    assert!((db(p / noise) - want_token).abs() < 1.0, "measured {} dB vs model {want_token} dB", db(p / noise));

    // A per-channel verdict on an activation says it is an accuracy bound.
    if let Some(ch) = v.iter().find(|v| v.kind == PER_CHANNEL_INT8) {
        assert!(ch.rule.contains("accuracy bound"), "{}", ch.rule);
    }

    // The null: every token on one scale gets no per-token verdict.
    let null = mine_once(&randn(t * c, 8));
    assert!(!null.iter().any(|v| v.kind == PER_TOKEN_INT8), "{null:?}");
}

#[test]
fn a_recording_too_thin_for_a_rule_names_the_rule_and_what_it_needs() {
    use opscope::mine::kinds::CHANNEL_OUTLIERS;
    // Planted: channel 5 of 128 is 40x the others, in every token.
    let x: Vec<f32> = randn(64 * 128, 3).iter().enumerate().map(|(i, v)| if i % 128 == 5 { v * 40.0 } else { *v }).collect();
    let record = |stats: &str| {
        let sink = MemorySink::default();
        let p = Pipeline::parse(&format!("matmul{{roles=[lhs],stats=[{stats}]}}")).unwrap();
        opscope::scope(&p, Box::new(sink.clone()), || {
            let mut c = Session::new(Device::Cpu).compile(matmul_2d(64, 128, 16));
            c.set_param("w", &randn(128 * 16, 1));
            c.run(&[("x", &x)]);
        })
        .unwrap();
        opscope::mine::series_from_rows(&sink.rows())
    };
    let thin = record("min,max");
    assert!(opscope::mine::mine(&thin).is_empty());
    let cannot = opscope::mine::cannot_run(&thin);
    let ch = cannot.iter().find(|c| c.kind == CHANNEL_OUTLIERS).unwrap_or_else(|| panic!("{cannot:?}"));
    assert_eq!((ch.missing.clone(), ch.series, ch.runs_needed), (vec!["chan_outlier", "chan_maxabs"], 1, 0));
    // With every statistic the rule runs and finds the channel; it is no longer listed.
    let full = record("all");
    assert!(opscope::mine::mine(&full).iter().any(|v| v.kind == CHANNEL_OUTLIERS));
    let cannot = opscope::mine::cannot_run(&full);
    assert!(!cannot.iter().any(|c| c.kind == CHANNEL_OUTLIERS), "{cannot:?}");
    // One run: the across-run rules say they need MIN_STEPS runs.
    assert!(cannot.iter().any(|c| c.kind == opscope::mine::kinds::STATIONARY && c.runs_needed == opscope::mine::MIN_STEPS && c.missing.is_empty()));
}

/// Record each of `runs` (64 tokens x 128 channels) through one compile of a tapped matmul
/// (weight `randn(128 x 16, 1)`) under `pipeline`; the series the miner reads.
fn record_runs(pipeline: &str, runs: &[Vec<f32>]) -> std::collections::BTreeMap<opscope::mine::SeriesKey, opscope::mine::Series> {
    let sink = MemorySink::default();
    let p = Pipeline::parse(pipeline).unwrap();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(matmul_2d(64, 128, 16));
        c.set_param("w", &randn(128 * 16, 1));
        for x in runs {
            c.run(&[("x", x)]);
        }
    })
    .unwrap();
    opscope::mine::series_from_rows(&sink.rows())
}

/// Rows of nothing but NaN are summed as rows of energy 0 by the sketch: the row rules
/// (adjacent-row ratio, row-energy spread, per-token int8) leave runs holding non-finite values
/// out, so every other row NaN in Gaussian data gives no `delta_compute` (its adjacent ratio
/// would read 0) and no `low_rank_probe`, while the health verdict names the NaNs. The same
/// data without NaN mines to neither either (the control).
#[test]
fn rows_of_nan_give_no_row_verdict() {
    use opscope::mine::kinds::{DELTA_COMPUTE, LOW_RANK_PROBE};
    let runs: Vec<Vec<f32>> = (0..6).map(|r| randn(64 * 128, 300 + r)).collect();
    let with_nan: Vec<Vec<f32>> = runs
        .iter()
        .map(|x| x.iter().enumerate().map(|(i, v)| if (i / 128) % 2 == 1 { f32::NAN } else { *v }).collect())
        .collect();
    for (what, data) in [("every other row NaN", &with_nan), ("no NaN", &runs)] {
        let v = opscope::mine::mine(&record_runs("matmul{roles=[lhs]}", data));
        let k = kinds(&v);
        assert!(!k.contains(&DELTA_COMPUTE.name) && !k.contains(&LOW_RANK_PROBE.name), "{what}: {k:?}");
        // The NaNs are named by the health verdict, and only there.
        assert_eq!(k.contains(&opscope::mine::HEALTH.name), what != "no NaN", "{what}: {k:?}");
    }
}

/// A memoized weight is recorded once per compile while the activation is recorded every run:
/// the across-run rules do not list the weight as short of runs (it is a constant), while a
/// tensor that really ran once is listed. Also: a verdict kind prints as its name.
#[test]
fn a_weight_recorded_once_per_compile_is_not_short_of_runs() {
    use opscope::mine::kinds::STATIONARY;
    let runs: Vec<Vec<f32>> = (0..opscope::mine::MIN_STEPS as u64 + 2).map(|i| randn(64 * 128, 200 + i)).collect();
    let series = record_runs("matmul{roles=[lhs,rhs]}", &runs);
    let runs = |role: &str| series.iter().find(|(k, _)| k.1 == role).map(|(_, s)| s.runs.len()).unwrap();
    // The premise: the weight has one run, the activation every run.
    assert_eq!((runs("rhs"), runs("lhs")), (1, opscope::mine::MIN_STEPS + 2));
    let cannot = opscope::mine::cannot_run(&series);
    assert!(cannot.iter().all(|c| c.runs_needed == 0), "{cannot:?}");
    // The same weight alone (no series ran more often): it is short of runs.
    let weight_only: std::collections::BTreeMap<_, _> = series.into_iter().filter(|(k, _)| k.1 == "rhs").collect();
    let cannot = opscope::mine::cannot_run(&weight_only);
    assert!(cannot.iter().any(|c| c.kind == STATIONARY && c.runs_needed == opscope::mine::MIN_STEPS), "{cannot:?}");
    assert_eq!(STATIONARY.to_string(), STATIONARY.name);
    assert_eq!(format!("{}", opscope::mine::kinds::CHANNEL_OUTLIERS), "channel_outliers");
}

/// `untimed_sites`: the recorded sites a time-share file does not list, by name.
#[test]
fn untimed_sites_are_the_recorded_sites_without_a_time_share() {
    let series = record_runs("matmul{roles=[lhs]}", &[randn(64 * 128, 9)]);
    let shares = |site: &str| opscope::mine::TimeShares::from_sites([(site.to_string(), 1.0)], "test").unwrap();
    assert_eq!(opscope::mine::untimed_sites(&series, &shares("matmul.0")), Vec::<String>::new());
    assert_eq!(opscope::mine::untimed_sites(&series, &shares("elsewhere")), vec!["matmul.0".to_string()]);
    // The same through the JSON `opscope time --json` writes.
    let json = opscope::mine::TimeShares::from_json(r#"{"sites": [{"site": "matmul.0", "share": 1.0}]}"#, "test").unwrap();
    assert_eq!(json.get("matmul.0"), Some(1.0));
    assert_eq!(opscope::mine::untimed_sites(&series, &json), Vec::<String>::new());
}

/// The merged histogram's total is the recorded element count (every value of a finite tensor
/// falls in the per-run absmax range).
#[test]
fn merged_histogram_total_is_the_element_count() {
    let runs: Vec<Vec<f32>> = (0..3).map(|i| randn(64 * 128, 300 + i)).collect();
    let series = record_runs("matmul{roles=[lhs],hist_bins=16}", &runs);
    let s = series.values().next().unwrap();
    let h = opscope::mine::merged_histogram(s, None).unwrap();
    assert_eq!((h.runs, h.counts.len()), (3, 16));
    // Runs with different ranges are re-binned proportionally (`exact` false): equal up to rounding.
    assert!(close(h.total(), (3 * 64 * 128) as f64, 1e-12), "{}", h.total());
}

/// The sparse-GEMM payoff is the zero fraction (`1 - density`), on a tensor with exactly 85%
/// zeros, and the payoff is share x fraction (one site: share 1).
#[test]
fn the_sparse_gemm_payoff_is_one_minus_the_density() {
    use opscope::mine::kinds::SPARSE_GEMM;
    // 64 x 128 = 8192 values; every value whose index mod 20 is below 17 is zero: 85% zeros.
    let x: Vec<f32> = randn(64 * 128, 5).iter().enumerate().map(|(i, v)| if i % 20 < 17 { 0.0 } else { v + 3.0 }).collect();
    let nnz = x.iter().filter(|v| **v != 0.0).count();
    let density = nnz as f64 / x.len() as f64;
    let v = mine_once(&x);
    let s = v.iter().find(|v| v.kind == SPARSE_GEMM).unwrap_or_else(|| panic!("{:?}", kinds(&v)));
    assert!(close(s.fraction, 1.0 - density, 1e-12), "fraction {} vs 1 - {density}", s.fraction);
    assert!(close(s.payoff, s.fraction, 1e-12), "one site: payoff {} = fraction {}", s.payoff, s.fraction);
    assert!(close(opscope::mine::payoff_fraction(SPARSE_GEMM, 0.25), 0.75, 0.0));
}

/// The scale-drift rule's run boundary: a clean 4x ramp over exactly `MIN_STEPS` runs fires; the
/// same ramp over one run fewer does not (too few runs for a trend).
#[test]
fn scale_drift_needs_min_steps_runs_and_fires_at_exactly_that_many() {
    use opscope::mine::kinds::SCALE_DRIFT;
    let base = randn(64 * 128, 77);
    let ramp = [1.0f32, 2.0, 3.1, 4.0, 5.0];
    let runs = |n: usize| -> Vec<Vec<f32>> { ramp[..n].iter().map(|s| base.iter().map(|v| v * s).collect()).collect() };
    let n = opscope::mine::MIN_STEPS;
    assert_eq!(n, 4, "the ramp is written for MIN_STEPS = 4");
    let at = opscope::mine::mine(&record_runs("matmul{roles=[lhs]}", &runs(n)));
    assert!(kinds(&at).contains(&SCALE_DRIFT.name), "{:?}", kinds(&at));
    let below = opscope::mine::mine(&record_runs("matmul{roles=[lhs]}", &runs(n - 1)));
    assert!(!kinds(&below).contains(&SCALE_DRIFT.name), "{:?}", kinds(&below));
}

/// A ramp that starts at zero (the first run all zeros: absmax 0, 1, 2, 3 exactly, so the fitted
/// start is exactly 0) has no scale-drift ratio (end / start is undefined): no verdict, and no
/// verdict carries an infinite ratio as evidence.
#[test]
fn a_scale_ramp_from_zero_has_no_drift_ratio() {
    use opscope::mine::kinds::SCALE_DRIFT;
    let raw = randn(64 * 128, 78);
    let m = raw.iter().fold(0f32, |a, v| a.max(v.abs()));
    let base: Vec<f32> = raw.iter().map(|v| v / m).collect();
    assert_eq!(base.iter().fold(0f32, |a, v| a.max(v.abs())), 1.0);
    let runs: Vec<Vec<f32>> = [0.0f32, 1.0, 2.0, 3.0].iter().map(|s| base.iter().map(|v| v * s).collect()).collect();
    let v = opscope::mine::mine(&record_runs("matmul{roles=[lhs]}", &runs));
    assert!(!kinds(&v).contains(&SCALE_DRIFT.name), "{:?}", kinds(&v));
    assert!(v.iter().all(|v| v.evidence.iter().all(|(_, x)| x.is_finite())), "{v:?}");
}

/// Calibration notes every non-finite value the recording counted: NaN, +Inf and -Inf alike
/// (2 + 3 + 4 = 9), and leaves them out of the range (a mutation survivor subtracted -Inf).
#[test]
fn calibration_counts_nan_and_both_infinities() {
    let mut x = randn(64 * 128, 79);
    for (i, v) in [f32::NAN, f32::NAN, f32::INFINITY, f32::INFINITY, f32::INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY]
        .into_iter()
        .enumerate()
    {
        x[i * 37] = v;
    }
    let finite_max = x.iter().filter(|v| v.is_finite()).fold(f32::MIN, |a, &v| a.max(v));
    let series = record_runs("matmul{roles=[lhs]}", &[x]);
    let t = opscope::mine::calibrate_all(&series, &opscope::mine::CalibrationOptions::new(opscope::mine::CalibrationMethod::MinMax));
    let c = &t.tensors[0];
    assert!(c.notes.contains(&opscope::mine::CalibrationNote::NonFinite(9.0)), "{:?}", c.notes);
    assert_eq!(c.highest, finite_max);
}

/// The subnormals rule on recorded sketches: a non-negative activation holding subnormal values
/// (a masked softmax's underflow) is flagged with its `min` as evidence, at the boundary too (the
/// largest subnormal); exact zeros and f32's smallest normal are not subnormal.
#[test]
fn a_non_negative_tensor_with_subnormal_values_is_flagged() {
    use opscope::mine::kinds::SUBNORMALS;
    let base: Vec<f32> = randn(64 * 128, 9).iter().map(|v| v.abs() + 0.01).collect();
    // Every 16th value set to `tiny`; the rest at least 0.01.
    let with = |tiny: f32| -> Vec<f32> { base.iter().enumerate().map(|(i, &v)| if i % 16 == 0 { tiny } else { v }).collect() };
    for tiny in [f32::from_bits(1), 1e-39, f32::from_bits(0x007f_ffff)] {
        assert!(tiny.is_subnormal());
        let v = mine_once(&with(tiny));
        let s = v.iter().find(|v| v.kind == SUBNORMALS).unwrap_or_else(|| panic!("{tiny:e}: {:?}", kinds(&v)));
        assert_eq!((s.role.as_str(), evidence(s, "subnormal_extreme")), ("lhs", tiny as f64), "{tiny:e}");
        assert_eq!((evidence(s, "runs_with_subnormal"), evidence(s, "runs")), (1.0, 1.0));
        // `nnz` counts them: the density is the host's count of x != 0.
        assert_eq!(evidence(s, "density"), 1.0, "{tiny:e}");
        assert_eq!(s.payoff, 0.0, "a warning, not a kernel");
    }
    for not_subnormal in [0.0, -0.0, f32::MIN_POSITIVE] {
        let v = mine_once(&with(not_subnormal));
        assert!(!kinds(&v).contains(&SUBNORMALS.name), "{not_subnormal:e}: {:?}", kinds(&v));
    }
    // A non-positive tensor's smallest |x| is its max.
    let neg: Vec<f32> = with(1e-40).iter().map(|v| -v).collect();
    let v = mine_once(&neg);
    let s = v.iter().find(|v| v.kind == SUBNORMALS).unwrap_or_else(|| panic!("{:?}", kinds(&v)));
    assert_eq!(evidence(s, "subnormal_extreme"), -1e-40f32 as f64);
}

/// Where NaN/Inf arise: the chain MLP with layer 2's weight scaled so that its product overflows
/// f32 (|x @ w| ~ 1e39 > 3.4e38) gives +-Inf in layer 2's output, and NaN (Inf - Inf) from layer 3
/// on. The health verdict names every tensor holding them, and only layer 2's output as the first
/// in execution order in every run: its inputs (the activation and the finite weight) hold none.
#[test]
fn the_health_verdict_names_the_first_tensor_to_hold_nan_or_inf() {
    let (g, mut params) = chain_mlp(16, 64, 5);
    params[2].1.iter_mut().for_each(|v| *v *= 1e38);
    let sink = MemorySink::default();
    let runs = 3;
    opscope::scope(&Pipeline::parse("matmul").unwrap(), Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        for (n, w) in &params {
            c.set_param(n, w);
        }
        for r in 0..runs {
            c.run(&[("x", &randn(16 * 64, 50 + r).iter().map(|v| v.abs() + 0.5).collect::<Vec<f32>>())]);
        }
    })
    .unwrap();
    let v = opscope::mine::mine(&opscope::mine::series_from_rows(&sink.rows()));
    let health: Vec<&opscope::mine::Verdict> = v.iter().filter(|v| v.kind == opscope::mine::HEALTH).collect();
    let ev = |v: &opscope::mine::Verdict, k: &str| v.evidence.iter().find(|(n, _)| n == k).map(|(_, x)| *x).unwrap();
    let firsts: Vec<(&str, &str)> = health.iter().filter(|v| ev(v, "first_in_runs") > 0.0).map(|v| (v.site.as_str(), v.role.as_str())).collect();
    assert_eq!(firsts, vec![("matmul.2", "out")], "{health:#?}");
    let first = health.iter().find(|v| v.site == "matmul.2" && v.role == "out").unwrap();
    assert_eq!((ev(first, "first_in_runs"), ev(first, "runs_nonfinite")), (runs as f64, runs as f64));
    // Downstream: layer 3's and 4's activations and outputs hold them too; the weights and the
    // tensors before layer 2's output hold none.
    let named: Vec<(&str, &str)> = health.iter().map(|v| (v.site.as_str(), v.role.as_str())).collect();
    for t in [("matmul.3", "lhs"), ("matmul.3", "out"), ("matmul.4", "lhs"), ("matmul.4", "out")] {
        assert!(named.contains(&t), "{t:?} in {named:?}");
    }
    let clean = |(s, r): &(&str, &str)| *r == "rhs" || ["matmul.0", "matmul.1"].contains(s) || (*s, *r) == ("matmul.2", "lhs");
    assert!(!named.iter().any(clean), "{named:?}");
}
