//! The HTML report: one self-contained document, the verdict table, SVG plots per site and
//! role, names escaped. (Rendering in a real browser: scripts/report-screenshot.sh.)

mod common;
use opscope::{MemorySink, Pipeline};

#[test]
fn report_holds_the_verdicts_and_a_plot_per_statistic() {
    let sink = MemorySink::default();
    let _truth = opscope::sweep::run(&Pipeline::parse("matmul{roles=[lhs,rhs]}").unwrap(), &[0], Box::new(sink.clone())).unwrap();
    let mut rows = sink.rows();
    // A site whose name needs escaping.
    for r in rows.iter_mut().filter(|r| r.site.starts_with("sweep/gaussian/64x256")) {
        r.site = "odd<site>&\"name\"".into();
    }
    let series = opscope::mine::series_from_rows(&rows);
    let verdicts = opscope::mine::mine(&series);
    let html = opscope::report::render("t", &series, &verdicts, &["a note".into()]).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(!html.contains("<script"), "self-contained, static");
    // Every series has a histogram, a per-channel and a per-row plot; sequences add a trend.
    let multi = series.values().filter(|s| s.runs.len() >= 2).count();
    assert_eq!(html.matches("<svg").count(), 3 * series.len() + multi);
    assert_eq!(html.matches("<tr>").count(), verdicts.len() + 1, "one row per verdict plus the header");
    assert!(html.contains("odd&lt;site&gt;&amp;&quot;name&quot;") && !html.contains("odd<site>"), "names are escaped");
    assert!(html.contains("a note"));
}
