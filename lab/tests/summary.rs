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
        assert_eq!((s.absmax(), s.density(), s.kurtosis_mean(), s.nonfinite), (None, None, None, None), "{key:?}");
    }
    assert!(summary.table().lines().nth(1).unwrap().ends_with("-"), "{}", summary.table());
}

