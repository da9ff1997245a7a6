//! The text form of `opscope mine`: verdicts by payoff with short site names, a tensor shared by
//! several sites (the Q/K/V projections' common input) listed once, each verdict's rule and source
//! in a numbered legend, and the verdict kinds that could not be decided for want of statistics
//! or runs.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use opscope::mine::{kinds, CannotRun, Series, SeriesKey, Verdict, NOT_OBSERVABLE};

use crate::summary::common_prefix;

/// A number as it reads best: integers (counts, runs) without decimals, others to 4 significant
/// digits (scientific outside 1e-3..1e6).
pub fn number(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    if x.fract() == 0.0 && x.abs() < 1e15 {
        return format!("{}", x as i64);
    }
    let a = x.abs();
    if (1e-3..1e6).contains(&a) {
        let decimals = (3 - a.log10().floor() as i32).max(0) as usize;
        format!("{x:.decimals$}")
    } else {
        format!("{x:.3e}")
    }
}

/// `names` written once: their common prefix and suffix (at `/` boundaries) around the differing
/// middles in braces, e.g. `layer.0/attention/self/{query,key,value}/MatMul`.
pub fn brace(names: &[&str]) -> String {
    if names.len() == 1 {
        return names[0].to_string();
    }
    let prefix = common_prefix(names);
    let rev: Vec<String> = names.iter().map(|n| n[prefix.len()..].chars().rev().collect()).collect();
    let rev_refs: Vec<&str> = rev.iter().map(|s| s.as_str()).collect();
    // The common suffix starting at a '/': the reversed names' common prefix ending at '/'.
    let suffix_len = common_prefix(&rev_refs).len();
    let middles: Vec<&str> = names.iter().map(|n| &n[prefix.len()..n.len() - suffix_len]).collect();
    format!("{prefix}{{{}}}{}", middles.join(","), &names[0][names[0].len() - suffix_len..])
}

/// True when the verdicts `a` and `b` are about one tensor read at two sites: the same shape,
/// runs and, run by run, the same count, min, max and sum of squares (a tensor several ops read
/// is sketched once per use, with the same numbers). Series not found: false.
fn same_tensor(series: &BTreeMap<SeriesKey, Series>, a: &Verdict, b: &Verdict) -> bool {
    use opscope::sketch::tensor::{COUNT, MAX, MIN, SUMSQ};
    let get = |v: &Verdict| series.get(&(v.site.clone(), v.role.clone(), v.pass_idx));
    let (Some(x), Some(y)) = (get(a), get(b)) else { return false };
    x.shape == y.shape
        && x.runs.len() == y.runs.len()
        && x.runs.iter().zip(&y.runs).all(|(p, q)| {
            let stats = [COUNT, MIN, MAX, SUMSQ].map(|st| (p.scalar(st), q.scalar(st)));
            stats.iter().any(|(u, _)| u.is_some()) && stats.iter().all(|(u, w)| u.map(f64::to_bits) == w.map(f64::to_bits))
        })
}

/// The verdicts of `opscope mine` as text (see the module doc). `series` gives the site names
/// whose common prefix is dropped; `no_data` lines are printed as they are, except that
/// [`group_not_sketched`] folds the sites one reason leaves unsketched into one line.
pub fn text(verdicts: &[Verdict], cannot: &[CannotRun], no_data: &[String], series: &BTreeMap<SeriesKey, Series>) -> String {
    let names: Vec<&str> = series.keys().map(|k| k.0.as_str()).collect();
    let prefix = common_prefix(&names);
    let short = |s: &str| s.strip_prefix(prefix).unwrap_or(s).to_string();

    // One line per (kind, role, pass, rule, evidence) and tensor: identical evidence on several
    // sites is one tensor read by several ops (the recorder writes a shared input once per use)
    // only when the series say so too ([`same_tensor`]); two weights whose verdict reads one
    // small number (`central_empty_bins=17`) stay two lines.
    struct Line<'a> {
        v: &'a Verdict,
        sites: Vec<String>,
        payoff: f64,
    }
    let mut lines: Vec<Line> = Vec::new();
    for v in verdicts {
        let same = |l: &&mut Line| {
            l.v.kind == v.kind
                && l.v.role == v.role
                && l.v.pass_idx == v.pass_idx
                && l.v.rule == v.rule
                && l.v.evidence == v.evidence
                && l.v.basis == v.basis
                && same_tensor(series, l.v, v)
        };
        match lines.iter_mut().find(|l| same(l)) {
            Some(l) => {
                l.sites.push(short(&v.site));
                l.payoff += v.payoff;
            }
            None => lines.push(Line { v, sites: vec![short(&v.site)], payoff: v.payoff }),
        }
    }
    lines.sort_by(|a, b| b.payoff.total_cmp(&a.payoff));

    // Rules in order of first use.
    let mut legend: Vec<(&str, &str, &str)> = Vec::new();
    let mut rule_no = |v: &Verdict| -> usize {
        let key = (v.kind.name, v.rule, v.source);
        match legend.iter().position(|k| *k == key) {
            Some(i) => i + 1,
            None => {
                legend.push(key);
                legend.len()
            }
        }
    };
    // A basis column only when the verdicts were mined with time shares (`mine_with`): without
    // them the table is as it always was.
    let with_basis = verdicts.iter().any(|v| v.basis.is_some());
    let rows: Vec<[String; 7]> = lines
        .iter()
        .map(|l| {
            let sites: Vec<&str> = l.sites.iter().map(|s| s.as_str()).collect();
            let ev: Vec<String> = l.v.evidence.iter().map(|(k, x)| format!("{k}={}", number(*x))).collect();
            [
                format!("{:.4}", l.payoff),
                l.v.kind.to_string(),
                l.v.role.clone(),
                brace(&sites),
                ev.join(" "),
                format!("[{}]", rule_no(l.v)),
                l.v.basis.map_or("", |b| b.as_str()).to_string(),
            ]
        })
        .collect();

    let mut out = String::new();
    if !prefix.is_empty() {
        let _ = writeln!(out, "sites below are named without their common prefix '{prefix}'");
    }
    let site_w = rows.iter().map(|r| r[3].chars().count()).max().unwrap_or(4).clamp(4, 72);
    if with_basis {
        let _ = writeln!(out, "{:>8}  {:<5}  {:<18}  {:<5}  {:<site_w$}  {:<5} evidence", "payoff", "basis", "verdict", "role", "site", "rule");
        for r in &rows {
            let _ = writeln!(out, "{:>8}  {:<5}  {:<18}  {:<5}  {:<site_w$}  {:<5} {}", r[0], r[6], r[1], r[2], r[3], r[5], r[4]);
        }
    } else {
        let _ = writeln!(out, "{:>8}  {:<18}  {:<5}  {:<site_w$}  {:<5} evidence", "payoff", "verdict", "role", "site", "rule");
        for r in &rows {
            let _ = writeln!(out, "{:>8}  {:<18}  {:<5}  {:<site_w$}  {:<5} {}", r[0], r[1], r[2], r[3], r[5], r[4]);
        }
    }
    if rows.is_empty() {
        if cannot.is_empty() {
            let _ = writeln!(out, "(no verdict: nothing in these sketches justifies a specialized kernel)");
        } else {
            let _ = writeln!(out, "(no verdict from the rules that could run; the rules below could not)");
        }
    }
    if !legend.is_empty() {
        let _ = writeln!(out, "\nrules:");
        for (i, (kind, rule, source)) in legend.iter().enumerate() {
            let _ = writeln!(out, "  [{}] {kind}: {rule}. Source: {source}.", i + 1);
        }
    }
    if !cannot.is_empty() {
        let _ = writeln!(out, "\nrules that could not run:");
        for c in cannot {
            let mut why = Vec::new();
            if !c.missing.is_empty() {
                why.push(format!("needs {}", c.missing.join(", ")));
            }
            if c.runs_needed > 0 {
                why.push(format!("needs {} runs", c.runs_needed));
            }
            let _ = writeln!(out, "  {}: {} at {} site/role(s)", c.kind, why.join("; "), c.series);
        }
        if cannot.iter().any(|c| !c.missing.is_empty()) {
            let _ = writeln!(
                out,
                "  (a statistic is missing when the pipeline did not record it, which a tap's default stats=[all] does, or \
                 when it is undefined for the data and was not written: kurtosis and chan_outlier of an all-zero tensor, \
                 sumsq beyond f32's range; runs come from more text or steps)"
            );
        }
    }
    for line in group_not_sketched(no_data) {
        let _ = writeln!(out, "{line}");
    }
    if verdicts.iter().any(|v| v.kind == kinds::LOW_RANK_PROBE || v.kind == kinds::TWO_FOUR_PROBE) {
        let _ = writeln!(out, "note: {NOT_OBSERVABLE}");
    }
    out
}

/// `no_data` lines for the text output: the `site/role: not sketched: reason` lines of more
/// than three sites sharing a role and a reason become one line naming how many sites and the
/// first and last few (in natural order: `blk.2` before `blk.10`), so a packed-weight decoder's
/// 211 weights read as one line; other lines are kept as they are, in their order.
pub fn group_not_sketched(no_data: &[String]) -> Vec<String> {
    const SEP: &str = ": not sketched: ";
    let mut groups: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut first_at: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut out: Vec<Vec<String>> = Vec::new();
    for line in no_data {
        let parsed = line.split_once(SEP).and_then(|(head, reason)| head.rsplit_once('/').map(|(site, role)| (site, role, reason)));
        match parsed {
            Some((site, role, reason)) => {
                let key = (role.to_string(), reason.to_string());
                first_at.entry(key.clone()).or_insert_with(|| {
                    out.push(Vec::new());
                    out.len() - 1
                });
                groups.entry(key).or_default().push(site.to_string());
            }
            None => out.push(vec![line.clone()]),
        }
    }
    for (key, mut sites) in groups {
        let at = first_at[&key];
        let (role, reason) = key;
        out[at] = if sites.len() <= 3 {
            sites.iter().map(|s| format!("{s}/{role}{SEP}{reason}")).collect()
        } else {
            sites.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
            let n = sites.len();
            vec![format!("{role} of {n} sites ({}, {}, {}, ..., {}){SEP}{reason}", sites[0], sites[1], sites[2], sites[n - 1])]
        };
    }
    out.into_iter().flatten().collect()
}

/// Sort key that orders runs of digits by value (`blk.2` before `blk.10`).
fn natural_key(s: &str) -> Vec<(u8, u64, String)> {
    let mut key = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits > 0 {
            key.push((0, rest[..digits].parse().unwrap_or(u64::MAX), String::new()));
            rest = &rest[digits..];
        } else {
            let text = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
            key.push((1, 0, rest[..text].to_string()));
            rest = &rest[text..];
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_braces() {
        assert_eq!(number(20.0), "20");
        assert_eq!(number(0.28149), "0.2815");
        assert_eq!(number(145.27), "145.3");
        assert_eq!(number(1.5e-7), "1.500e-7");
        assert_eq!(
            brace(&["l0/attention/self/query/MatMul", "l0/attention/self/key/MatMul", "l0/attention/self/value/MatMul"]),
            "l0/attention/self/{query,key,value}/MatMul"
        );
        assert_eq!(brace(&["a/x", "a/y"]), "a/{x,y}");
    }

    /// Many sites unsketched for one reason: one line, sites in natural order; a reason of at
    /// most three sites and other lines as they were, in place.
    #[test]
    fn not_sketched_lines_of_one_reason_fold_into_one() {
        let mut lines = vec!["g (compile 1) x/lhs: no data".to_string()];
        for b in [10, 2, 0, 1] {
            lines.push(format!("blk.{b}.attn_q/rhs: not sketched: dtype U8 is not F32"));
        }
        lines.push("a/out: not sketched: other".into());
        let folded = group_not_sketched(&lines);
        assert_eq!(
            folded,
            vec![
                "g (compile 1) x/lhs: no data".to_string(),
                "rhs of 4 sites (blk.0.attn_q, blk.1.attn_q, blk.2.attn_q, ..., blk.10.attn_q): not sketched: dtype U8 is not F32".into(),
                "a/out: not sketched: other".into(),
            ]
        );
        assert_eq!(group_not_sketched(&lines[..4]), lines[..4].to_vec(), "three sites stay one line each");
    }
}

/// Per-series aggregates of a recording, as `opscope mine --json` prints them under `series`:
/// what a SQL engine computes from the same rows (README, "Mining with SQL"), so either can be
/// checked against the other.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SeriesSummary {
    /// Site name.
    pub site: String,
    /// Role of the tensor.
    pub role: String,
    /// Pass index.
    pub pass_idx: u32,
    /// Op at the site.
    pub op: String,
    /// Tensor shape text.
    pub shape: String,
    /// Recorded runs: distinct (recording, compile, step).
    pub runs: usize,
    /// Runs the verdicts were read from when `opscope mine` sampled this series (more runs of
    /// one shape than `--max-runs`, 1000 by default; absent when every run was read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs_sampled: Option<usize>,
    /// Smallest `min` over the runs (null if not recorded); over every run, sampled or not.
    pub min: Option<f64>,
    /// Largest `max` over the runs (null if not recorded); over every run, sampled or not.
    pub max: Option<f64>,
}

/// [`SeriesSummary`] of every series, in key order (site, role, pass).
pub fn series_summary(series: &BTreeMap<SeriesKey, Series>) -> Vec<SeriesSummary> {
    series
        .iter()
        .map(|((site, role, pass_idx), s)| {
            let (min, max) = s.range();
            SeriesSummary {
                site: site.clone(),
                role: role.clone(),
                pass_idx: *pass_idx,
                op: s.op.clone(),
                shape: s.shape.clone(),
                runs: s.runs_seen(),
                runs_sampled: s.is_sampled().then_some(s.runs.len()),
                min,
                max,
            }
        })
        .collect()
}

