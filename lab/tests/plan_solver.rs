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
