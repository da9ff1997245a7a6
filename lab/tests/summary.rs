//! The per-site summary `opscope record` prints.

#[path = "../../tests/common/mod.rs"]
mod common;
use common::*;
use opscope::Pipeline;

#[test]
fn the_summary_shows_nothing_it_did_not_measure() {
    use opscope_lab::summary::SummarySink;
    let g = matmul_2d(4, 6, 3);
    let p = Pipeline::parse("matmul{stats=[max]}").unwrap();
    let summary = SummarySink::default();
    opscope::scope(&p, Box::new(summary.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &randn(18, 1));
        c.run(&[("x", &randn(24, 2))]);
    })
    .unwrap();
    for (key, s) in summary.sites() {
        assert!(s.max.is_some(), "{key:?}");
        assert_eq!((s.absmax(), s.density(), s.kurtosis_median(), s.nonfinite), (None, None, None, None), "{key:?}");
    }
    assert!(summary.table().lines().nth(1).unwrap().ends_with("-"), "{}", summary.table());
}


/// Every column of the table against the host: absmax and density over all runs, the median of
/// the runs' kurtosis (as `opscope mine` takes it), the largest run's chan_outlier, the non-finite count (a helper's
/// mutation of `absmax` was caught only because it turned a `None` into a value).
#[test]
fn the_summary_columns_equal_the_host_aggregates_over_runs() {
    use opscope_lab::summary::SummarySink;
    let g = matmul_2d(4, 6, 3);
    let p = Pipeline::parse("matmul").unwrap();
    let summary = SummarySink::default();
    // Two runs of different scale, with zeros (density below 1) and a large negative value (the
    // absmax is a min in one run).
    let mut x1 = randn(24, 2);
    x1[..5].fill(0.0);
    let mut x2: Vec<f32> = randn(24, 3).iter().map(|v| 3.0 * v).collect();
    x2[7] = -40.0;
    x2[10..12].fill(0.0);
    let xs = [x1, x2];
    opscope::scope(&p, Box::new(summary.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", &randn(18, 1));
        for x in &xs {
            c.run(&[("x", x)]);
        }
    })
    .unwrap();
    let sites = summary.sites();
    let lhs = &sites.iter().find(|((_, r, _), _)| r == "lhs").expect("lhs summarized").1;
    let refs: Vec<Reference> = xs.iter().map(|x| reference(x, &[4, 6], 8, 0)).collect();
    let all: Vec<f64> = xs.iter().flatten().map(|&v| v as f64).collect();
    assert_eq!(lhs.absmax(), Some(40.0));
    assert_eq!(lhs.absmax(), Some(all.iter().fold(0.0f64, |m, v| m.max(v.abs()))));
    assert_eq!(lhs.density(), Some(all.iter().filter(|v| **v != 0.0).count() as f64 / 48.0));
    // The median as `opscope mine` takes it: of two runs the upper (not their mean).
    let kurt = refs.iter().map(|r| r.kurtosis.unwrap()).fold(f64::MIN, f64::max);
    assert!(close_rel(lhs.kurtosis_median().unwrap(), kurt, 1e-5), "kurtosis {:?} vs {kurt}", lhs.kurtosis_median());
    let mined = opscope::mine::median(refs.iter().map(|r| r.kurtosis.unwrap()).collect()).unwrap();
    assert_eq!(kurt, mined);
    let outlier = refs.iter().map(|r| r.chan_outlier.unwrap()).fold(0.0, f64::max);
    assert!(close_rel(lhs.chan_outlier.unwrap(), outlier, 1e-5), "chan_outlier {:?} vs {outlier}", lhs.chan_outlier);
    assert_eq!(lhs.nonfinite, Some(0.0));
    assert_eq!(lhs.count, 48.0);
    assert_eq!(lhs.shape, "[4,6]");
}

/// `opscope mine`'s text folds verdicts with identical evidence on several sites into one line
/// only when they are one tensor (the input two matmuls read), not two tensors that happen to
/// share a one-number evidence (two different weights): a helper's `lut rhs {matmul.1,matmul.0}
/// central_empty_bins=17` summed two weights' payoffs into one line.
#[test]
fn mine_text_folds_one_tensor_read_twice_but_not_two_weights_with_equal_evidence() {
    use rlx_ir::{DType, Graph, GraphExt, Shape};
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    let mut g = Graph::new("two_reads");
    let x = g.input("x", f(&[8, 16]));
    let (wa, wb) = (g.param("wa", f(&[16, 4])), g.param("wb", f(&[16, 4])));
    let (ya, yb) = (g.matmul(x, wa, f(&[8, 4])), g.matmul(x, wb, f(&[8, 4])));
    let y = g.add(ya, yb);
    g.set_outputs(vec![y]);
    let sink = opscope::MemorySink::default();
    opscope::scope(&Pipeline::parse("matmul{roles=[lhs,rhs],stats=[count,min,max,sumsq]}").unwrap(), Box::new(sink.clone()), || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("wa", &randn(64, 1));
        c.set_param("wb", &randn(64, 2));
        c.run(&[("x", &randn(128, 3))]);
    })
    .unwrap();
    let series = opscope::mine::series_from_rows(&sink.rows());
    let keys: Vec<&opscope::mine::SeriesKey> = series.keys().collect();
    assert_eq!(keys.len(), 4, "two sites, lhs and rhs each: {keys:?}");
    let verdict = |k: &opscope::mine::SeriesKey| opscope::mine::Verdict {
        site: k.0.clone(),
        role: k.1.clone(),
        pass_idx: k.2,
        kind: opscope::mine::kinds::LUT,
        evidence: vec![("central_empty_bins".into(), 17.0)],
        rule: "r",
        source: "s",
        payoff: 0.25,
        basis: None,
        fraction: 0.5,
    };
    let verdicts: Vec<opscope::mine::Verdict> = series.keys().map(verdict).collect();
    let text = opscope_lab::verdicts::text(&verdicts, &[], &[], &series);
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("central_empty_bins=17")).collect();
    // The shared input: one line, both sites, payoffs summed; the two weights: a line each.
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines.iter().filter(|l| l.contains(" lhs ") && l.contains('{')).count(), 1, "{text}");
    assert_eq!(lines.iter().filter(|l| l.contains(" rhs ") && !l.contains('{')).count(), 2, "{text}");
    assert!(lines[0].trim_start().starts_with("0.5000") && lines[0].contains(" lhs "), "{text}");
}
