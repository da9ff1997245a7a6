//! The exact multiple-choice knapsack problem (MCKP): pick exactly one option per site so that
//! the summed error is smallest while the summed cost stays within a budget.
//!
//! MCKP is the knapsack variant whose items come in disjoint classes of which exactly one item
//! is taken (Sinha & Zoltners, "The multiple-choice knapsack problem", Operations Research 27(3),
//! 1979; Kellerer, Pferschy & Pisinger, *Knapsack Problems*, Springer 2004, ch. 11). It is
//! NP-hard in general; this solver is the textbook exact dynamic programme over **Pareto
//! frontiers** (Kellerer et al. 2004, §11.3, "dynamic programming by profits/weights" with
//! dominance): after site `i` it keeps every reachable `(cost, error)` state that no other state
//! beats on both (lower or equal cost AND lower error), merging one site at a time. Costs are
//! integers (bytes, or microseconds for a time budget) and never discretized, so the result is
//! exact; the frontier is at most `budget + 1` states long, and on real instances (a few options
//! per site) far shorter.
//!
//! Ties: among plans with the same smallest error the solver returns one with the smallest cost;
//! among those, the one whose picks are lexicographically smallest in site order is not promised.

use std::fmt;

/// One option of one site.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Cost of taking this option (an integer: bytes, or microseconds for a time budget).
    pub cost: u64,
    /// Error it adds (finite and >= 0; errors add over sites).
    pub error: f64,
}

/// An optimal plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution {
    /// Per site, the index of the option taken.
    pub picks: Vec<usize>,
    /// Summed cost of the picks (<= the budget).
    pub cost: u64,
    /// Summed error of the picks, summed in site order.
    pub error: f64,
}

/// Why no plan was returned.
#[derive(Debug, Clone, PartialEq)]
pub enum SolveError {
    /// A site offers no option.
    NoOptions {
        /// Index of the site.
        site: usize,
    },
    /// An error is NaN, infinite or negative.
    BadError {
        /// Index of the site.
        site: usize,
        /// Index of the option.
        option: usize,
        /// The value.
        error: f64,
    },
    /// Even the cheapest option of every site exceeds the budget.
    Infeasible {
        /// The budget asked for.
        budget: u64,
        /// The smallest achievable cost (the cheapest option of each site), saturated at u64::MAX.
        min_cost: u64,
    },
}

impl fmt::Display for SolveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SolveError::NoOptions { site } => write!(f, "site {site} has no option: give every site at least one"),
            SolveError::BadError { site, option, error } => {
                write!(f, "site {site}, option {option}: error {error} is not a finite number >= 0")
            }
            SolveError::Infeasible { budget, min_cost } => write!(
                f,
                "no plan fits the budget of {budget}: the smallest achievable cost (the cheapest option at every site) is {min_cost}; raise the budget to at least that"
            ),
        }
    }
}

impl std::error::Error for SolveError {}

/// Check the instance and return the cheapest total cost (saturating).
fn validate(sites: &[Vec<Choice>]) -> Result<u64, SolveError> {
    let mut min_cost = 0u64;
    for (s, options) in sites.iter().enumerate() {
        if options.is_empty() {
            return Err(SolveError::NoOptions { site: s });
        }
        for (o, c) in options.iter().enumerate() {
            if !c.error.is_finite() || c.error < 0.0 {
                return Err(SolveError::BadError { site: s, option: o, error: c.error });
            }
        }
        min_cost = min_cost.saturating_add(options.iter().map(|c| c.cost).min().unwrap_or(0));
    }
    Ok(min_cost)
}

/// Solve the MCKP exactly: minimise the summed error over one option per site subject to the
/// summed cost `<= budget`. An instance with no sites has the empty plan (cost 0, error 0).
///
/// Errors: [`SolveError::NoOptions`], [`SolveError::BadError`], and [`SolveError::Infeasible`]
/// naming the smallest achievable cost.
pub fn solve(sites: &[Vec<Choice>], budget: u64) -> Result<Solution, SolveError> {
    let min_cost = validate(sites)?;
    if min_cost > budget {
        return Err(SolveError::Infeasible { budget, min_cost });
    }
    // A state: (cost, error, index of its parent state in the previous frontier, option taken).
    // frontiers[i] is the Pareto frontier after sites 0..=i, sorted by cost, errors strictly
    // decreasing.
    let mut frontiers: Vec<Vec<(u64, f64, usize, usize)>> = Vec::with_capacity(sites.len());
    let mut prev: Vec<(u64, f64, usize, usize)> = vec![(0, 0.0, usize::MAX, usize::MAX)];
    for options in sites {
        let mut next: Vec<(u64, f64, usize, usize)> = Vec::with_capacity(prev.len() * options.len());
        for (p, &(c0, e0, _, _)) in prev.iter().enumerate() {
            for (o, ch) in options.iter().enumerate() {
                // Cheapest-first feasibility: any state over the budget can never come back.
                if let Some(c) = c0.checked_add(ch.cost).filter(|&c| c <= budget) {
                    next.push((c, e0 + ch.error, p, o));
                }
            }
        }
        // Sort by cost, then error; keep a state only if its error is strictly below every
        // cheaper-or-equal state's (dominance).
        next.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let mut kept: Vec<(u64, f64, usize, usize)> = Vec::with_capacity(next.len());
        for s in next {
            if kept.last().is_none_or(|k: &(u64, f64, usize, usize)| s.1 < k.1) {
                kept.push(s);
            }
        }
        frontiers.push(kept.clone());
        prev = kept;
    }
    // The last state has the smallest error (errors decrease along the frontier) and, among
    // equal errors, the smallest cost (a later state with the same error was dropped).
    let last = prev.len() - 1; // non-empty: the cheapest plan is feasible
    let (cost, error) = (prev[last].0, prev[last].1);
    let mut picks = vec![0; sites.len()];
    let mut at = last;
    for i in (0..sites.len()).rev() {
        let (_, _, parent, option) = frontiers[i][at];
        picks[i] = option;
        at = parent;
    }
    Ok(Solution { picks, cost, error })
}

/// The reference: try every combination (prod of option counts; exponential, for tests and small
/// instances only). Same contract and tie rule (smallest error, then smallest cost) as [`solve`].
///
/// Errors: as [`solve`].
pub fn brute_force(sites: &[Vec<Choice>], budget: u64) -> Result<Solution, SolveError> {
    let min_cost = validate(sites)?;
    if min_cost > budget {
        return Err(SolveError::Infeasible { budget, min_cost });
    }
    let mut best: Option<Solution> = None;
    let mut picks = vec![0usize; sites.len()];
    loop {
        let (mut cost, mut error) = (0u64, 0.0f64);
        for (s, &p) in picks.iter().enumerate() {
            cost = cost.saturating_add(sites[s][p].cost);
            error += sites[s][p].error;
        }
        let better = match &best {
            None => true,
            Some(b) => error < b.error || (error == b.error && cost < b.cost),
        };
        if cost <= budget && better {
            best = Some(Solution { picks: picks.clone(), cost, error });
        }
        if !odometer_step(&mut picks, sites) {
            break;
        }
    }
    Ok(best.expect("the cheapest plan fits the budget"))
}

/// Advance `picks` (one option index per site) to the next combination of `sites`' options,
/// in odometer order (site 0 fastest); false after the last combination.
fn odometer_step<T>(picks: &mut [usize], sites: &[Vec<T>]) -> bool {
    for (p, options) in picks.iter_mut().zip(sites) {
        *p += 1;
        if *p < options.len() {
            return true;
        }
        *p = 0;
    }
    false
}

/// One option of one site under TWO budgets (bytes and time at once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice2 {
    /// First cost (bytes).
    pub cost: u64,
    /// Second cost (microseconds).
    pub cost2: u64,
    /// Error it adds (finite and >= 0).
    pub error: f64,
}

/// An optimal plan under two budgets.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution2 {
    /// Per site, the index of the option taken.
    pub picks: Vec<usize>,
    /// Summed first cost (<= its budget).
    pub cost: u64,
    /// Summed second cost (<= its budget).
    pub cost2: u64,
    /// Summed error, in site order.
    pub error: f64,
}

/// Why no plan was returned under two budgets.
#[derive(Debug, Clone, PartialEq)]
pub enum Solve2Error {
    /// As [`SolveError`] for the instance itself (no options, a bad error), or the first budget
    /// alone is infeasible.
    Instance(SolveError),
    /// The second budget alone is below the sum of each site's cheapest second cost.
    Infeasible2 {
        /// The second budget.
        budget2: u64,
        /// The smallest achievable second cost.
        min_cost2: u64,
    },
    /// Each budget can be met alone, but no plan meets both.
    Jointly {
        /// The first budget.
        budget: u64,
        /// The second budget.
        budget2: u64,
    },
}

impl fmt::Display for Solve2Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Solve2Error::Instance(e) => e.fmt(f),
            Solve2Error::Infeasible2 { budget2, min_cost2 } => write!(
                f,
                "no plan fits the second budget of {budget2}: the smallest achievable (the cheapest option at every site) is {min_cost2}; raise it to at least that"
            ),
            Solve2Error::Jointly { budget, budget2 } => write!(
                f,
                "each budget can be met alone, but no plan meets both {budget} and {budget2} at once: the plans small enough for the first cost too much of the second; raise either"
            ),
        }
    }
}

impl std::error::Error for Solve2Error {}

/// Solve the two-constraint MCKP exactly: minimise the summed error over one option per site
/// subject to summed `cost <= budget` AND summed `cost2 <= budget2`. The same dynamic programme
/// as [`solve`] with dominance in three dimensions (Kellerer et al. 2004, §9.7 on the
/// multidimensional knapsack): a state is kept unless another has cost, cost2 and error all
/// lower or equal. Pruning per site: states sorted by (cost, cost2, error); a staircase of
/// (cost2 -> least error) over the states already kept answers "is there a kept state with
/// cost2 <= mine and error <= mine" in O(log n). Exact; ties: smallest error, then smallest
/// cost, then smallest cost2.
///
/// Errors: [`Solve2Error`].
pub fn solve2(sites: &[Vec<Choice2>], budget: u64, budget2: u64) -> Result<Solution2, Solve2Error> {
    let (min_cost, min_cost2) = validate2(sites)?;
    if min_cost > budget {
        return Err(Solve2Error::Instance(SolveError::Infeasible { budget, min_cost }));
    }
    if min_cost2 > budget2 {
        return Err(Solve2Error::Infeasible2 { budget2, min_cost2 });
    }
    type State = (u64, u64, f64, usize, usize);
    let mut frontiers: Vec<Vec<State>> = Vec::with_capacity(sites.len());
    let mut prev: Vec<State> = vec![(0, 0, 0.0, usize::MAX, usize::MAX)];
    for options in sites {
        let mut next: Vec<State> = Vec::with_capacity(prev.len() * options.len());
        for (p, &(c0, d0, e0, _, _)) in prev.iter().enumerate() {
            for (o, ch) in options.iter().enumerate() {
                let c = c0.checked_add(ch.cost).filter(|&c| c <= budget);
                let d = d0.checked_add(ch.cost2).filter(|&d| d <= budget2);
                if let (Some(c), Some(d)) = (c, d) {
                    next.push((c, d, e0 + ch.error, p, o));
                }
            }
        }
        next.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.total_cmp(&b.2)));
        let mut stair: std::collections::BTreeMap<u64, f64> = std::collections::BTreeMap::new();
        let mut kept: Vec<State> = Vec::with_capacity(next.len());
        for s in next {
            // Every state in `stair` has cost <= s.0; dominated if one has cost2 <= s.1 and error <= s.2.
            if stair.range(..=s.1).next_back().is_some_and(|(_, &e)| e <= s.2) {
                continue;
            }
            let drop: Vec<u64> = stair.range(s.1..).take_while(|(_, &e)| e >= s.2).map(|(&k, _)| k).collect();
            for k in drop {
                stair.remove(&k);
            }
            stair.insert(s.1, s.2);
            kept.push(s);
        }
        if kept.is_empty() {
            return Err(Solve2Error::Jointly { budget, budget2 });
        }
        frontiers.push(kept.clone());
        prev = kept;
    }
    let best = (0..prev.len())
        .min_by(|&i, &j| prev[i].2.total_cmp(&prev[j].2).then(prev[i].0.cmp(&prev[j].0)).then(prev[i].1.cmp(&prev[j].1)))
        .expect("non-empty frontier");
    let (cost, cost2, error) = (prev[best].0, prev[best].1, prev[best].2);
    let mut picks = vec![0; sites.len()];
    let mut at = best;
    for i in (0..sites.len()).rev() {
        let (_, _, _, parent, option) = frontiers[i][at];
        picks[i] = option;
        at = parent;
    }
    Ok(Solution2 { picks, cost, cost2, error })
}

/// Check a two-cost instance; the cheapest totals of each cost (saturating).
fn validate2(sites: &[Vec<Choice2>]) -> Result<(u64, u64), Solve2Error> {
    let one: Vec<Vec<Choice>> = sites.iter().map(|o| o.iter().map(|c| Choice { cost: c.cost, error: c.error }).collect()).collect();
    let min_cost = validate(&one).map_err(Solve2Error::Instance)?;
    let min_cost2 = sites.iter().fold(0u64, |a, o| a.saturating_add(o.iter().map(|c| c.cost2).min().unwrap_or(0)));
    Ok((min_cost, min_cost2))
}

/// The reference for [`solve2`]: every combination (exponential; tests and small instances).
/// Same contract and tie rule.
///
/// Errors: as [`solve2`].
pub fn brute_force2(sites: &[Vec<Choice2>], budget: u64, budget2: u64) -> Result<Solution2, Solve2Error> {
    let (min_cost, min_cost2) = validate2(sites)?;
    if min_cost > budget {
        return Err(Solve2Error::Instance(SolveError::Infeasible { budget, min_cost }));
    }
    if min_cost2 > budget2 {
        return Err(Solve2Error::Infeasible2 { budget2, min_cost2 });
    }
    let mut best: Option<Solution2> = None;
    let mut picks = vec![0usize; sites.len()];
    loop {
        let (mut c, mut d, mut e) = (0u64, 0u64, 0.0f64);
        for (s, &p) in picks.iter().enumerate() {
            c = c.saturating_add(sites[s][p].cost);
            d = d.saturating_add(sites[s][p].cost2);
            e += sites[s][p].error;
        }
        let better = best.as_ref().is_none_or(|b| (e, c, d) < (b.error, b.cost, b.cost2));
        if c <= budget && d <= budget2 && better {
            best = Some(Solution2 { picks: picks.clone(), cost: c, cost2: d, error: e });
        }
        if !odometer_step(&mut picks, sites) {
            break;
        }
    }
    best.ok_or(Solve2Error::Jointly { budget, budget2 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(cost: u64, error: f64) -> Choice {
        Choice { cost, error }
    }

    #[test]
    fn hand_instance() {
        // fp32 / int8 / int4 at two sites of 100 and 400 bytes.
        let sites = vec![vec![c(100, 0.0), c(25, 0.01), c(13, 0.2)], vec![c(400, 0.0), c(100, 0.05), c(50, 0.3)]];
        // Budget 200: site 1 must shrink to 100 or 50; best is (fp32, int8) = 200 B, 0.05.
        let s = solve(&sites, 200).unwrap();
        assert_eq!(s.picks, vec![0, 1]);
        assert_eq!(s.cost, 200);
        assert!((s.error - 0.05).abs() < 1e-15);
        // Budget 199: (int8, int8) = 125 B, 0.06.
        assert_eq!(solve(&sites, 199).unwrap().picks, vec![1, 1]);
        // Budget 500: fp32 everywhere.
        assert_eq!(solve(&sites, 500).unwrap().picks, vec![0, 0]);
        // Budget 62: only int4+int4 (63) is too much, so no plan; cheapest is 63.
        assert_eq!(solve(&sites, 62), Err(SolveError::Infeasible { budget: 62, min_cost: 63 }));
    }

    #[test]
    fn bad_inputs() {
        assert_eq!(solve(&[vec![]], 10), Err(SolveError::NoOptions { site: 0 }));
        assert!(matches!(solve(&[vec![c(1, f64::NAN)]], 10), Err(SolveError::BadError { .. })));
        assert!(matches!(solve(&[vec![c(1, -1.0)]], 10), Err(SolveError::BadError { .. })));
        assert_eq!(solve(&[], 0).unwrap(), Solution { picks: vec![], cost: 0, error: 0.0 });
    }
}
