//! The multiple-choice knapsack solver of `opscope plan` against brute force: random instances
//! of 1..=6 sites x 1..=4 options, with tied costs and errors and with budgets below the
//! cheapest plan (infeasible), for a byte budget (small integer costs) and a time budget (costs in
//! microseconds, up to 10^9).

use opscope_lab::plan::mckp::{brute_force, solve, Choice, SolveError};
use proptest::prelude::*;

/// An independent exhaustive search (not the crate's `brute_force`): every combination, keep the
/// smallest error, then the smallest cost. Returns (error, cost) or the smallest cost when none fits.
fn enumerate(sites: &[Vec<Choice>], budget: u64) -> Result<(f64, u64), u64> {
    let mut combos: Vec<(f64, u64)> = vec![(0.0, 0)];
    for options in sites {
        combos = combos.iter().flat_map(|&(e, c)| options.iter().map(move |o| (e + o.error, c + o.cost))).collect();
    }
    let fit: Vec<(f64, u64)> = combos.iter().copied().filter(|&(_, c)| c <= budget).collect();
    if fit.is_empty() {
        return Err(combos.iter().map(|&(_, c)| c).min().unwrap());
    }
    Ok(fit.into_iter().fold((f64::INFINITY, u64::MAX), |b, x| if x.0 < b.0 || (x.0 == b.0 && x.1 < b.1) { x } else { b }))
}

fn check(sites: &[Vec<Choice>], budget: u64) -> Result<(), TestCaseError> {
    let got = solve(sites, budget);
    let want = enumerate(sites, budget);
    match (&got, want) {
        (Ok(s), Ok((e, c))) => {
            prop_assert_eq!(s.error, e, "optimal error");
            prop_assert_eq!(s.cost, c, "cost of the optimum (smallest among equal errors)");
            prop_assert!(s.cost <= budget);
            // The picks are what the solution claims.
            prop_assert_eq!(s.picks.len(), sites.len());
            let cost: u64 = s.picks.iter().zip(sites).map(|(&p, o)| o[p].cost).sum();
            let err: f64 = s.picks.iter().zip(sites).fold(0.0, |a, (&p, o)| a + o[p].error);
            prop_assert_eq!((cost, err), (s.cost, s.error));
            let b = brute_force(sites, budget).unwrap();
            prop_assert_eq!((b.error, b.cost), (s.error, s.cost), "the crate's brute force agrees");
        }
        (Err(SolveError::Infeasible { budget: b, min_cost }), Err(min)) => {
            prop_assert_eq!(*b, budget);
            prop_assert_eq!(*min_cost, min, "the smallest achievable cost is named");
            let infeasible = matches!(brute_force(sites, budget), Err(SolveError::Infeasible { .. }));
            prop_assert!(infeasible, "the crate's brute force agrees");
        }
        _ => prop_assert!(false, "solver {:?} vs enumeration {:?}", got, want),
    }
    Ok(())
}

/// Errors: quarters (many exact ties) or arbitrary values in [0, 1).
fn error() -> impl Strategy<Value = f64> {
    prop_oneof![(0u32..8).prop_map(|q| q as f64 / 4.0), 0.0f64..1.0]
}

fn instance(max_cost: u64) -> impl Strategy<Value = Vec<Vec<Choice>>> {
    prop::collection::vec(prop::collection::vec((0..=max_cost, error()).prop_map(|(cost, error)| Choice { cost, error }), 1..=4), 1..=6)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn byte_budget_optimum_equals_brute_force(sites in instance(20), budget in 0u64..=130) {
        check(&sites, budget)?;
    }

    #[test]
    fn time_budget_optimum_equals_brute_force(sites in instance(1_000_000_000), frac in 0.0f64..1.1) {
        // Budgets spread from below the cheapest plan to above the dearest.
        let max: u64 = sites.iter().map(|o| o.iter().map(|c| c.cost).max().unwrap()).sum();
        check(&sites, (frac * max as f64) as u64)?;
    }
}

#[test]
fn infeasible_names_the_smallest_cost() {
    let sites = vec![vec![Choice { cost: 10, error: 0.0 }, Choice { cost: 4, error: 1.0 }], vec![Choice { cost: 7, error: 0.0 }]];
    let e = solve(&sites, 10).unwrap_err();
    assert_eq!(e, SolveError::Infeasible { budget: 10, min_cost: 11 });
    assert!(e.to_string().contains("11"), "{e}");
    assert_eq!(solve(&sites, 11).unwrap().picks, vec![1, 0]);
}

// ---- Two budgets at once (bytes and time): `mckp::solve2` and `Plan::choose_both` / `choose_time`.

use opscope_lab::plan::mckp::{brute_force2, solve2, Choice2, Solve2Error};
use opscope_lab::plan::{Cell, Plan, SitePlan, WeightSite};

/// Independent exhaustive search under two budgets: (error, cost, cost2) of the best plan, or None.
fn enumerate2(sites: &[Vec<Choice2>], budget: u64, budget2: u64) -> Option<(f64, u64, u64)> {
    let mut combos: Vec<(f64, u64, u64)> = vec![(0.0, 0, 0)];
    for options in sites {
        combos = combos.iter().flat_map(|&(e, c, d)| options.iter().map(move |o| (e + o.error, c + o.cost, d + o.cost2))).collect();
    }
    combos.into_iter().filter(|&(_, c, d)| c <= budget && d <= budget2).fold(None, |b: Option<(f64, u64, u64)>, x| match b {
        Some(b) if !(x.0 < b.0 || (x.0 == b.0 && (x.1, x.2) < (b.1, b.2))) => Some(b),
        _ => Some(x),
    })
}

fn instance2() -> impl Strategy<Value = Vec<Vec<Choice2>>> {
    prop::collection::vec(
        prop::collection::vec((0u64..=20, 0u64..=20, error()).prop_map(|(cost, cost2, error)| Choice2 { cost, cost2, error }), 1..=4),
        1..=6,
    )
}

/// A plan table from a two-cost instance: option 0 is fp32, the others o1, o2, ...
fn table(sites: &[Vec<Choice2>]) -> Plan {
    let sites: Vec<SitePlan> = sites
        .iter()
        .enumerate()
        .map(|(i, o)| SitePlan {
            weight: WeightSite { site: format!("s{i}"), k: 1, n: 1 },
            cells: o
                .iter()
                .enumerate()
                .map(|(j, c)| Cell { option: if j == 0 { "fp32".into() } else { format!("o{j}") }, bytes: c.cost, nsr: c.error, time_us: Some(c.cost2), time_raw_us: Some(c.cost2 as f64) })
                .collect(),
            chosen: "fp32".into(),
        })
        .collect();
    let options = (1..4).map(|j| opscope_lab::plan::OptionSpec::parse(&format!("o{j}=fakequant{{sites=[{{site}}]}}")).unwrap()).collect();
    Plan {
        metric: String::new(),
        sentences: 1,
        options,
        budget_bytes: 0,
        fp32_bytes: 0,
        plan_bytes: 0,
        predicted_nsr: 0.0,
        pipeline: String::new(),
        time_budget_us: None,
        plan_time_us: None,
        time_method: None,
        sites,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn two_budget_optimum_equals_brute_force(sites in instance2(), budget in 0u64..=130, budget2 in 0u64..=130) {
        let want = enumerate2(&sites, budget, budget2);
        match (solve2(&sites, budget, budget2), want) {
            (Ok(s), Some((e, c, d))) => {
                prop_assert_eq!((s.error, s.cost, s.cost2), (e, c, d));
                let cost: u64 = s.picks.iter().zip(&sites).map(|(&p, o)| o[p].cost).sum();
                let cost2: u64 = s.picks.iter().zip(&sites).map(|(&p, o)| o[p].cost2).sum();
                prop_assert_eq!((cost, cost2), (s.cost, s.cost2), "the picks are what the solution claims");
                let b = brute_force2(&sites, budget, budget2).unwrap();
                prop_assert_eq!((b.error, b.cost, b.cost2), (e, c, d), "the crate's brute force agrees");
            }
            (Err(err), None) => {
                let min1: u64 = sites.iter().map(|o| o.iter().map(|c| c.cost).min().unwrap()).sum();
                let min2: u64 = sites.iter().map(|o| o.iter().map(|c| c.cost2).min().unwrap()).sum();
                let ok = match &err {
                    Solve2Error::Instance(SolveError::Infeasible { min_cost, .. }) => *min_cost == min1 && min1 > budget,
                    Solve2Error::Infeasible2 { min_cost2, .. } => *min_cost2 == min2 && min2 > budget2 && min1 <= budget,
                    Solve2Error::Jointly { .. } => min1 <= budget && min2 <= budget2,
                    _ => false,
                };
                prop_assert!(ok, "{:?} (cheapest {} / {})", err, min1, min2);
            }
            (got, want) => prop_assert!(false, "solver {:?} vs enumeration {:?}", got, want),
        }
    }

    /// `Plan::choose_both` (what `opscope plan --budget-bytes B --time-budget-us T` runs) and
    /// `choose_time` (`--time-budget-us` alone) on a table: within both budgets, the table's
    /// optimum, and the plan's bytes, time and prediction are those of its chosen cells.
    #[test]
    fn plan_under_a_time_budget_is_the_tables_optimum(sites in instance2(), budget in 0u64..=130, budget2 in 0u64..=130) {
        let mut p = table(&sites);
        let want = enumerate2(&sites, budget, budget2);
        match (p.choose_both(budget, budget2), want) {
            (Ok(()), Some((e, c, d))) => {
                prop_assert_eq!((p.predicted_nsr, p.plan_bytes, p.plan_time_us), (e, c, Some(d)));
                prop_assert!(p.plan_bytes <= budget && d <= budget2);
                prop_assert_eq!(p.time_budget_us, Some(budget2));
                let chosen: Vec<&Cell> = p.sites.iter().map(|s| s.cells.iter().find(|c| c.option == s.chosen).unwrap()).collect();
                prop_assert_eq!(chosen.iter().map(|c| c.time_us.unwrap()).sum::<u64>(), d);
                prop_assert_eq!(chosen.iter().map(|c| c.bytes).sum::<u64>(), c);
            }
            (Err(_), None) => {}
            (got, want) => prop_assert!(false, "choose_both {:?} vs enumeration {:?}", got, want),
        }
        let mut p = table(&sites);
        let time_only: Vec<Vec<Choice>> = sites.iter().map(|o| o.iter().map(|c| Choice { cost: c.cost2, error: c.error }).collect()).collect();
        match (p.choose_time(budget2), enumerate(&time_only, budget2)) {
            (Ok(()), Ok((e, d))) => {
                prop_assert_eq!((p.predicted_nsr, p.plan_time_us), (e, Some(d)));
                prop_assert!(d <= budget2);
            }
            (Err(_), Err(_)) => {}
            (got, want) => prop_assert!(false, "choose_time {:?} vs enumeration {:?}", got, want),
        }
    }
}

#[test]
fn a_table_without_times_refuses_a_time_budget() {
    let mut p = table(&[vec![Choice2 { cost: 4, cost2: 0, error: 0.0 }]]);
    p.sites[0].cells[0].time_us = None;
    let e = p.choose_time(10).unwrap_err().to_string();
    assert!(e.contains("no measured time"), "{e}");
}
