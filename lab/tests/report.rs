//! The HTML report: one self-contained document, the verdict table, SVG plots per site and
//! role, names escaped. (Rendering in a real browser: scripts/report-screenshot.sh.)

#[path = "../../tests/common/mod.rs"]
mod common;
use opscope::{MemorySink, Pipeline};

#[test]
fn report_holds_the_verdicts_and_a_plot_per_statistic() {
    let sink = MemorySink::default();
    let _truth = opscope_lab::sweep::run(&Pipeline::parse("matmul{roles=[lhs,rhs]}").unwrap(), &[0], Box::new(sink.clone())).unwrap();
    let mut rows = sink.rows();
    // A site whose name needs escaping.
    for r in rows.iter_mut().filter(|r| r.site.starts_with("sweep/gaussian/64x256")) {
        r.site = "odd<site>&\"name\"".into();
    }
    let series = opscope::mine::series_from_rows(&rows);
    let verdicts = opscope::mine::mine(&series);
    let html = opscope_lab::report::render("t", &series, &verdicts, &["a note".into()]).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(!html.contains("<script"), "self-contained, static");
    // Every series has a histogram, a per-channel and a per-row plot; sequences add a trend.
    let multi = series.values().filter(|s| s.runs.len() >= 2).count();
    assert_eq!(html.matches("<svg").count(), 3 * series.len() + multi);
    assert_eq!(html.matches("<tr>").count(), verdicts.len() + 1, "one row per verdict plus the header");
    assert!(html.contains("odd&lt;site&gt;&amp;&quot;name&quot;") && !html.contains("odd<site>"), "names are escaped");
    assert!(html.contains("a note"));
}

#[test]
fn report_plots_probe_series_and_survives_series_without_data() {
    // Probe statistics have no histogram or rms: the report plots their per-head / per-row
    // vectors, and a series with nothing to plot gets none (an empty axis once hung plotters).
    use opscope::Row;
    use std::sync::Arc;
    let row = |site: &str, role: &str, stat: &str, idx: u64, value: f32, step: u64| Row {
        run_id: Arc::from("r"),
        compile: 1,
        step,
        graph: Arc::from("g"),
        pass: Arc::from("p"),
        pass_idx: 0,
        site: Arc::from(site),
        op: Arc::from("softmax"),
        role: Arc::from(role),
        stat: Arc::from(stat),
        idx,
        value,
        numel: Some(16),
        shape: Arc::from("[1,2,4,4]"),
        flops: None,
    };
    let mut rows = Vec::new();
    for step in 0..3 {
        rows.push(row("attn.0", "probs", "queries", 0, 4.0, step));
        rows.extend((0..2).map(|h| row("attn.0", "probs", "peak", h, 0.5 + 0.1 * h as f32, step)));
        rows.push(row("block.0", "block", "rows", 0, 4.0, step));
        rows.push(row("block.0", "block", "cos", 0, 0.9, step));
    }
    let series = opscope::mine::series_from_rows(&rows);
    let html = opscope_lab::report::render("t", &series, &[], &[]).unwrap();
    // attn.0: one per-head peak plot; block.0: nothing to plot (cos_row absent).
    assert_eq!(html.matches("<svg").count(), 1, "{html}");
    assert!(html.contains("peak probability per head"));
}
