//! `opscope plan --time-budget-us` on the real model (paraphrase-MiniLM-L3-v2, 8 fortunes, one
//! batch): the four weight sites of layer 0 with int8 and int4 fake-quant, a byte budget of 20%
//! and a time budget. Not a timing test: no speed is asserted. It checks that every cell got a
//! measured time (fp32 0, the rest `max(0, round(raw))`, negatives listed), that the plan meets
//! both budgets and is the optimum of its own table by exhaustive search over the 3^4 plans, and
//! that re-solving that measured table under a sweep of time budgets matches exhaustive search
//! each time (alone, a time budget keeps every site fp32: fake-quant only adds time here).
//!
//! Needs the assets of `scripts/fetch-assets.sh`.

use std::process::Command;

use opscope_lab::plan::Plan;

const INT8: &str = "int8=fakequant{sites=[{site}],scope=token,weights=true}";
const INT4: &str = "int4=fakequant{sites=[{site}],bits=4,scope=token,weights=true}";

/// Exhaustive search over every plan of `p`'s table: (error, bytes, time) of the best plan
/// within both budgets (ties: smaller bytes, then smaller time), or None.
fn exhaustive(p: &Plan, bytes: u64, us: u64) -> Option<(f64, u64, u64)> {
    let n = p.sites.len();
    let m = p.sites[0].cells.len();
    let mut best: Option<(f64, u64, u64)> = None;
    for code in 0..m.pow(n as u32) {
        let picks: Vec<usize> = (0..n).map(|i| code / m.pow(i as u32) % m).collect();
        let b: u64 = picks.iter().zip(&p.sites).map(|(&k, s)| s.cells[k].bytes).sum();
        let t: u64 = picks.iter().zip(&p.sites).map(|(&k, s)| s.cells[k].time_us.unwrap()).sum();
        let e: f64 = picks.iter().zip(&p.sites).fold(0.0, |a, (&k, s)| a + s.cells[k].nsr);
        if b <= bytes && t <= us && best.is_none_or(|x| (e, b, t) < x) {
            best = Some((e, b, t));
        }
    }
    best
}

#[test]
fn minilm_plan_under_bytes_and_time_is_the_tables_optimum() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let args = [
        "plan", "--onnx", a.onnx.to_str().unwrap(), "--tokenizer", a.tokenizer.to_str().unwrap(), "--text", a.text.to_str().unwrap(), "--limit", "8",
        "--sites", "layer.0/*", "--option", INT8, "--option", INT4, "--budget-ratio", "0.2", "--time-budget-us", "1000000", "--time-ms", "3000",
        "--out", out.to_str().unwrap(),
    ];
    let o = Command::new(env!("CARGO_BIN_EXE_opscope")).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    eprintln!("{stdout}");
    let plan = Plan::load(&out).unwrap();
    assert_eq!(plan.sites.len(), 4);
    assert!(plan.time_method.as_deref().unwrap().contains("paired difference"));
    for s in &plan.sites {
        assert_eq!((s.cells[0].time_us, s.cells[0].time_raw_us), (Some(0), Some(0.0)), "fp32 is the baseline");
        for c in &s.cells[1..] {
            let raw = c.time_raw_us.unwrap();
            assert!(raw.is_finite());
            assert_eq!(c.time_us.unwrap(), raw.max(0.0).round() as u64, "clamped and rounded: {c:?}");
            if raw < 0.0 {
                assert!(stdout.contains(&format!("note: {} at {}", c.option, s.weight.site)), "a negative time is reported: {c:?}");
            }
        }
    }
    // The plan meets both budgets and is its table's optimum.
    let (bytes, us) = (plan.budget_bytes, plan.time_budget_us.unwrap());
    assert_eq!(us, 1_000_000);
    assert_eq!(bytes, (0.2 * plan.fp32_bytes as f64).floor() as u64);
    let (e, b, t) = exhaustive(&plan, bytes, us).expect("a plan fits");
    assert!(plan.plan_bytes <= bytes && plan.plan_time_us.unwrap() <= us);
    assert_eq!((plan.predicted_nsr, plan.plan_bytes, plan.plan_time_us.unwrap()), (e, b, t));

    // Re-solve the measured table under a sweep of time budgets, from 0 to above the dearest plan.
    let dearest: u64 = plan.sites.iter().map(|s| s.cells.iter().map(|c| c.time_us.unwrap()).max().unwrap()).sum();
    let mut bound = 0;
    for k in 0..=8u64 {
        let us = dearest * k / 6;
        let mut p = plan.clone();
        match (p.choose_both(bytes, us), exhaustive(&plan, bytes, us)) {
            (Ok(()), Some(want)) => {
                assert_eq!((p.predicted_nsr, p.plan_bytes, p.plan_time_us.unwrap()), want, "time budget {us} us");
                bound += (want.2 < t) as usize;
            }
            (Err(e), None) => assert!(e.to_string().contains("us"), "{e}"),
            (got, want) => panic!("time budget {us} us: choose_both {got:?}, exhaustive {want:?}"),
        }
        // Alone, a time budget keeps every site fp32 (0 us and 0 error).
        let mut p = plan.clone();
        p.choose_time(us).unwrap();
        assert!(p.sites.iter().all(|s| s.chosen == "fp32") && p.pipeline.is_empty() && p.predicted_nsr == 0.0);
    }
    eprintln!("time budget sweep 0..{} us: {bound} of 9 budgets cut the byte-only plan's +{t} us", dearest * 8 / 6);
}
