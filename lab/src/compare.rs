//! `opscope compare A B`: two recordings of the same program on the same inputs (one device
//! against another, the native sketch kernel against its lowering into RLX ops) compared value
//! by value, one check per `(site, role, statistic)`.
//!
//! Rows are matched by `(site, role, pass_idx, stat)` and, within a series, by
//! `(compile, step, idx)`: the two recordings must have compiled the same graphs in the same
//! order over the same inputs. A check passes when every value of A has a value in B (and the
//! other way round) and
//! - counts (`count`, `nan_count`, `posinf_count`, `neginf_count` and the probes' `queries`,
//!   `keys`, `tokens`, `rows`, `topk`, `bad_ids`, `load`) are equal;
//! - a histogram (`hist`) differs per run by at most `hist_tol` of its total in L1
//!   (`sum |a - b| / sum a`; 0 = equal counts). Two devices whose GEMMs round differently in
//!   the last bits move a value across a bin edge now and then: say how much is allowed;
//! - every other value is within `rtol` relative: `|a - b| <= rtol * max(|a|, |b|, floor)`,
//!   where `floor` is 1e-3 of the largest |value| of the series in A or B, so that a statistic that
//!   cancels to about 0 (a mean) is held relative to its series' scale, not to 0; a `mean` is
//!   also held relative to its run's mean |x| (`l1 / count`, the larger of A's and B's, when
//!   both are recorded): a mean of values of either sign can cancel to about 0 in every run.
//!
//! A series recorded on one side only fails, named with the side that has it, unless the other
//! side's manifest lists it as not computed there (a statistic a device's lowered sketch cannot
//! compute exactly, or a probe without a lowering: the manifest's `skipped`, with the reason):
//! that check is `skip`, with the reason, and does not fail the comparison.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// Statistics that are counts: equal or the check fails.
pub const COUNTS: &[&str] = &["count", "nan_count", "posinf_count", "neginf_count", "queries", "keys", "tokens", "rows", "topk", "bad_ids", "load"];

/// The tolerances of a comparison.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tolerance {
    /// Relative tolerance of every statistic that is neither a count nor a histogram.
    pub rtol: f64,
    /// Allowed L1 difference of a histogram per run, as a fraction of its total (0 = equal).
    pub hist_tol: f64,
}

/// The outcome of one `(site, role, statistic)`.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Not compared: one side's manifest lists the statistic as not computed there.
    pub skipped: bool,
    /// Site name.
    pub site: String,
    /// Role.
    pub role: String,
    /// Pass position in the pipeline.
    pub pass_idx: u32,
    /// Statistic.
    pub stat: String,
    /// Values compared (present in both).
    pub values: usize,
    /// Largest relative difference (for counts and histograms: the largest absolute count
    /// difference, and the largest L1 fraction).
    pub worst: f64,
    /// Passed.
    pub ok: bool,
    /// What failed, or how it was compared.
    pub note: String,
}

type Series = BTreeMap<(u32, u64, u64), f64>;
type Key = (String, String, u32, String);

fn load(path: &Path) -> Result<BTreeMap<Key, Series>> {
    let mut m: BTreeMap<Key, Series> = BTreeMap::new();
    opscope::recording::read_rows(path, |r| {
        m.entry((r.site.to_string(), r.role.to_string(), r.pass_idx, r.stat.to_string()))
            .or_default()
            .insert((r.compile, r.step, r.idx), r.value as f64);
    })
    .with_context(|| format!("reading {}", path.display()))?;
    Ok(m)
}

/// The outcome of a comparison.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// One check per series of either recording, in `(site, role, pass_idx, stat)` order.
    pub checks: Vec<Check>,
    /// When the two recordings hold different runs (`(compile, step)` pairs over all their
    /// rows): what differs, said once. Every series then fails on the values of the runs one
    /// side lacks, and this names the cause (recordings of other inputs, or of another length)
    /// instead of leaving it to a thousand failed checks.
    pub runs: Option<String>,
}

/// The runs (`(compile, step)`) of a recording's series.
fn runs_of(series: &BTreeMap<Key, Series>) -> std::collections::BTreeSet<(u32, u64)> {
    series.values().flat_map(|s| s.keys().map(|&(c, st, _)| (c, st))).collect()
}

/// [`Comparison::runs`] of recordings `a` and `b` holding `sa` and `sb`.
fn runs_note(a: &Path, b: &Path, sa: &BTreeMap<Key, Series>, sb: &BTreeMap<Key, Series>) -> Option<String> {
    let (ra, rb) = (runs_of(sa), runs_of(sb));
    if ra == rb {
        return None;
    }
    let compiles = |r: &std::collections::BTreeSet<(u32, u64)>| r.iter().map(|x| x.0).collect::<std::collections::BTreeSet<_>>().len();
    let (only_a, only_b) = (ra.difference(&rb).count(), rb.difference(&ra).count());
    Some(format!(
        "the recordings hold different runs: {} has {} run(s) in {} compile(s), {} has {} in {}; {only_a} run(s) only in A, \
         {only_b} only in B. `compare` matches values run by run: record both on the same inputs (the same text, --limit, \
         --batch and --seq) to compare them",
        a.display(),
        ra.len(),
        compiles(&ra),
        b.display(),
        rb.len(),
        compiles(&rb)
    ))
}

/// Compare recordings `a` and `b` (paths of any format `opscope mine` reads): one [`Check`] per
/// series of either, and a note when their runs differ.
///
/// Errors: a recording cannot be read, or neither holds a row.
pub fn compare(a: &Path, b: &Path, tol: Tolerance) -> Result<Comparison> {
    let (sa, sb) = (load(a)?, load(b)?);
    anyhow::ensure!(!sa.is_empty() || !sb.is_empty(), "neither {} nor {} holds a row", a.display(), b.display());
    let runs = runs_note(a, b, &sa, &sb);
    let (na, nb) = (not_computed(a)?, not_computed(b)?);
    let mut keys: Vec<&Key> = sa.keys().chain(sb.keys()).collect();
    keys.sort();
    keys.dedup();
    // Per run, mean |x| of a tensor (l1 / count), the larger of A's and B's: a mean's yardstick.
    let mean_abs = |k: &Key| -> BTreeMap<(u32, u64), f64> {
        let mut m: BTreeMap<(u32, u64), f64> = BTreeMap::new();
        for side in [&sa, &sb] {
            let at = |stat: &str| side.get(&(k.0.clone(), k.1.clone(), k.2, stat.to_string()));
            let (Some(l1), Some(count)) = (at("l1"), at("count")) else { continue };
            for (&(c, st, _), &l) in l1 {
                if let Some(&n) = count.get(&(c, st, 0)).filter(|n| **n > 0.0) {
                    let e = m.entry((c, st)).or_default();
                    *e = e.max((l / n).abs());
                }
            }
        }
        m
    };
    let checks = keys
        .into_iter()
        .map(|k| {
            let yard = if k.3 == "mean" { mean_abs(k) } else { BTreeMap::new() };
            let mut c = check(k, sa.get(k), sb.get(k), tol, &yard);
            let (side, listed) = match (sa.contains_key(k), sb.contains_key(k)) {
                (true, false) => ("B", &nb),
                (false, true) => ("A", &na),
                _ => return c,
            };
            // The statistic at this role, the whole tensor at this role, or the whole site.
            let why = [(k.1.as_str(), k.3.as_str()), (k.1.as_str(), "*"), ("", "*")]
                .iter()
                .find_map(|(role, stat)| listed.get(&(k.0.clone(), role.to_string(), stat.to_string())));
            if let Some(why) = why {
                c.skipped = true;
                c.ok = true;
                c.note = format!("not computed in {side}: {why}");
            }
            c
        })
        .collect();
    Ok(Comparison { checks, runs })
}

/// `(site, role, stat)` -> reason, for every statistic the recording's manifests list as not
/// computed (`skipped` entries with their `stat`, or a whole tensor or probe the device could
/// not sketch: stat `*`).
fn not_computed(path: &Path) -> Result<BTreeMap<(String, String, String), String>> {
    let mut m = BTreeMap::new();
    let Some(side) = opscope::recording::read_sidecar(path).with_context(|| format!("reading the manifest of {}", path.display()))? else {
        return Ok(m);
    };
    for g in &side.graphs {
        for s in &g.skipped {
            let role = s.role.as_ref().map(|r| r.as_str().to_string()).unwrap_or_default();
            let stat = s.stat.clone().unwrap_or_else(|| "*".into());
            m.insert((s.site.clone(), role, stat), s.reason.clone());
        }
    }
    Ok(m)
}

/// One check; `yard` is a per-run scale a value is also held relative to (a mean's mean |x|).
fn check(key: &Key, a: Option<&Series>, b: Option<&Series>, tol: Tolerance, yard: &BTreeMap<(u32, u64), f64>) -> Check {
    let (site, role, pass_idx, stat) = key.clone();
    let mut c = Check { skipped: false, site, role, pass_idx, stat, values: 0, worst: 0.0, ok: false, note: String::new() };
    let (a, b) = match (a, b) {
        (Some(a), Some(b)) => (a, b),
        (Some(_), None) => {
            c.note = "recorded in A only".into();
            return c;
        }
        _ => {
            c.note = "recorded in B only".into();
            return c;
        }
    };
    let missing = a.keys().filter(|k| !b.contains_key(k)).count() + b.keys().filter(|k| !a.contains_key(k)).count();
    c.values = a.keys().filter(|k| b.contains_key(k)).count();
    if c.stat == "hist" {
        // Per run: L1 of the count difference over every bin either side has, over A's total.
        let mut runs: BTreeMap<(u32, u64), (f64, f64)> = BTreeMap::new();
        for (k, va) in a {
            let vb = b.get(k).copied().unwrap_or(0.0);
            let e = runs.entry((k.0, k.1)).or_default();
            e.0 += (va - vb).abs();
            e.1 += va;
        }
        for (k, vb) in b.iter().filter(|(k, _)| !a.contains_key(k)) {
            runs.entry((k.0, k.1)).or_default().0 += vb.abs();
        }
        c.worst = runs.values().map(|(d, t)| if *t > 0.0 { d / t } else { *d }).fold(0.0, f64::max);
        c.ok = missing == 0 && c.worst <= tol.hist_tol;
        c.note = format!("L1 fraction per run <= {}", tol.hist_tol);
        // Bins are matched by index: histograms of different bin counts are not the same bins.
        let bins = |s: &Series| s.keys().map(|k| k.2 + 1).max().unwrap_or(0);
        let (ba, bb) = (bins(a), bins(b));
        if ba != bb {
            c.ok = false;
            c.note = format!(
                "{ba} bins in A, {bb} in B: not the same bins, so not comparable bin by bin (record both with the same \
                 hist_bins and hist_range; `opscope diff` compares histograms of different bins by overlap)"
            );
            return c;
        }
    } else if COUNTS.contains(&c.stat.as_str()) {
        c.worst = a.iter().filter_map(|(k, va)| b.get(k).map(|vb| (va - vb).abs())).fold(0.0, f64::max);
        c.ok = missing == 0 && c.worst == 0.0;
        c.note = "counts equal".into();
    } else {
        let floor = 1e-3 * a.values().chain(b.values()).map(|v| v.abs()).filter(|v| v.is_finite()).fold(0.0, f64::max);
        let mut worst = 0.0f64;
        let mut unequal_special = 0;
        for (k, va) in a {
            let Some(vb) = b.get(k) else { continue };
            if !va.is_finite() || !vb.is_finite() {
                if !(va == vb || va.is_nan() && vb.is_nan()) {
                    unequal_special += 1;
                }
                continue;
            }
            let scale = va.abs().max(vb.abs()).max(floor).max(yard.get(&(k.0, k.1)).copied().unwrap_or(0.0));
            if scale > 0.0 {
                worst = worst.max((va - vb).abs() / scale);
            }
        }
        c.worst = worst;
        c.ok = missing == 0 && unequal_special == 0 && worst <= tol.rtol;
        c.note = if unequal_special > 0 { format!("{unequal_special} non-finite value(s) differ") } else { format!("relative <= {:e}", tol.rtol) };
    }
    if missing > 0 {
        c.note = format!("{missing} value(s) on one side only; {}", c.note);
    }
    c
}

/// One line per check: `ok` or `FAIL`, the series, the values compared, the worst difference;
/// first, when the runs differ, the note saying so ([`Comparison::runs`]).
pub fn text(comparison: &Comparison) -> String {
    let checks = &comparison.checks;
    let mut out = String::new();
    if let Some(note) = &comparison.runs {
        out.push_str(&format!("runs differ: {note}\n"));
    }
    for c in checks {
        out.push_str(&format!(
            "{:4} {}/{} [{}] {}: {} values, worst {:.3e} ({})\n",
            if c.skipped {
                "skip"
            } else if c.ok {
                "ok"
            } else {
                "FAIL"
            },
            c.site,
            c.role,
            c.pass_idx,
            c.stat,
            c.values,
            c.worst,
            c.note
        ));
    }
    let failed = checks.iter().filter(|c| !c.ok).count();
    let skipped = checks.iter().filter(|c| c.skipped).count();
    out.push_str(&format!("{} checks, {} failed, {} not computed on one side (skip)\n", checks.len(), failed, skipped));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(vals: &[(u64, f64)]) -> Series {
        vals.iter().map(|&(i, v)| ((0, 0, i), v)).collect()
    }

    fn key(stat: &str) -> Key {
        ("s".into(), "out".into(), 0, stat.into())
    }

    const TOL: Tolerance = Tolerance { rtol: 1e-5, hist_tol: 0.0 };
    const NONE: BTreeMap<(u32, u64), f64> = BTreeMap::new();

    #[test]
    fn a_mean_is_held_relative_to_its_runs_mean_abs() {
        // Means that cancel to ~1e-6 in every run of values of size ~1: 1e-6 apart is 1e-6 of
        // mean |x| (passes at 1e-5), though it is 50% of the means themselves.
        let a = series(&[(0, 1e-6)]);
        let b = series(&[(0, 2e-6)]);
        assert!(!check(&key("mean"), Some(&a), Some(&b), TOL, &NONE).ok);
        let yard: BTreeMap<(u32, u64), f64> = [((0, 0), 1.0)].into_iter().collect();
        let c = check(&key("mean"), Some(&a), Some(&b), TOL, &yard);
        assert!(c.ok && (c.worst - 1e-6).abs() < 1e-12, "{}", c.worst);
    }

    #[test]
    fn relative_difference_against_the_larger_value_or_the_series_floor() {
        let a = series(&[(0, 100.0), (1, 0.0)]);
        // 1e-4 at index 1 is below the floor (1e-3 * 100 = 0.1): 1e-3 relative to the floor.
        let b = series(&[(0, 100.0), (1, 1e-4)]);
        let c = check(&key("mean"), Some(&a), Some(&b), TOL, &NONE);
        assert!((c.worst - 1e-3).abs() < 1e-12, "{}", c.worst);
        assert!(!c.ok);
        let c = check(&key("mean"), Some(&a), Some(&a), TOL, &NONE);
        assert!(c.ok && c.worst == 0.0 && c.values == 2);
    }

    #[test]
    fn counts_must_be_equal_and_histograms_within_their_l1_fraction() {
        let a = series(&[(0, 10.0)]);
        let b = series(&[(0, 11.0)]);
        assert!(!check(&key("count"), Some(&a), Some(&b), Tolerance { rtol: 1.0, hist_tol: 1.0 }, &NONE).ok);
        let ha = series(&[(0, 6.0), (1, 4.0)]);
        let hb = series(&[(0, 5.0), (1, 5.0)]);
        let c = check(&key("hist"), Some(&ha), Some(&hb), TOL, &NONE);
        assert!((c.worst - 0.2).abs() < 1e-12 && !c.ok);
        assert!(check(&key("hist"), Some(&ha), Some(&hb), Tolerance { rtol: 0.0, hist_tol: 0.2 }, &NONE).ok);
        // Different bin counts: the bins B has beyond A's count too (all of A's 10 values sit
        // where B has none: L1 = 10 + 10 = 2x the total), and the check names the bins.
        let hb = series(&[(0, 0.0), (1, 0.0), (2, 10.0)]);
        let c = check(&key("hist"), Some(&ha), Some(&hb), Tolerance { rtol: 0.0, hist_tol: 10.0 }, &NONE);
        assert!((c.worst - 2.0).abs() < 1e-12 && !c.ok && c.note.contains("2 bins in A, 3 in B"), "{} {}", c.worst, c.note);
    }

    #[test]
    fn a_value_or_series_on_one_side_only_fails() {
        let a = series(&[(0, 1.0), (1, 2.0)]);
        let b = series(&[(0, 1.0)]);
        let c = check(&key("max"), Some(&a), Some(&b), TOL, &NONE);
        assert!(!c.ok && c.note.contains("1 value(s) on one side only"));
        assert!(!check(&key("max"), Some(&a), None, TOL, &NONE).ok);
        let nan = series(&[(0, f64::NAN)]);
        let one = series(&[(0, 1.0)]);
        assert!(!check(&key("max"), Some(&nan), Some(&one), TOL, &NONE).ok);
        assert!(check(&key("max"), Some(&nan), Some(&nan), TOL, &NONE).ok);
    }

    #[test]
    fn different_runs_are_said_once_with_their_counts() {
        // One value per run: (compile 0, step, idx 0).
        let per_run = |vals: &[f64]| -> Series { vals.iter().enumerate().map(|(st, &v)| ((0, st as u64, 0), v)).collect() };
        let (pa, pb) = (Path::new("a.parquet"), Path::new("b.parquet"));
        let mut sa: BTreeMap<Key, Series> = BTreeMap::new();
        sa.insert(key("max"), per_run(&[1.0, 2.0, 3.0]));
        sa.insert(key("min"), per_run(&[1.0, 2.0, 3.0]));
        let mut sb = sa.clone();
        assert_eq!(runs_note(pa, pb, &sa, &sb), None, "the same runs: nothing to say");
        // Other values in the same runs are the checks' business, not a runs note.
        sb.insert(key("max"), per_run(&[9.0, 9.0, 9.0]));
        assert_eq!(runs_note(pa, pb, &sa, &sb), None);
        sb.insert(key("max"), per_run(&[1.0]));
        sb.insert(key("min"), per_run(&[1.0]));
        let note = runs_note(pa, pb, &sa, &sb).expect("runs differ");
        assert!(note.contains("a.parquet has 3 run(s) in 1 compile(s), b.parquet has 1 in 1") && note.contains("2 run(s) only in A, 0 only in B"), "{note}");
    }
}
