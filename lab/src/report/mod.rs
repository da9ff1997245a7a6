//! A self-contained HTML report of a mined recording: the verdict table and, per site and
//! role, SVG plots (made with `plotters`) of the value histogram, per-channel max|x|, per-row
//! energy and the trend across runs. HTML is generated with `maud`, which escapes every name.

use std::collections::BTreeMap;

use maud::{html, Markup, PreEscaped, DOCTYPE};
use plotters::prelude::*;

use opscope::Error;
use opscope::mine::{Series, SeriesKey, StepStats, Verdict};
use opscope::sketch::{tensor, Stat};

const W: u32 = 360;
const H: u32 = 200;
/// Longest series drawn point by point; longer ones are max-pooled to this many points.
const MAX_POINTS: usize = 512;

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("plotting: {e}"))
}

/// Max-pool `v` to at most [`MAX_POINTS`] points: peaks (the point of a per-row or
/// per-channel plot) survive.
fn pool(v: &[f32]) -> Vec<(f32, f32)> {
    let step = v.len().div_ceil(MAX_POINTS).max(1);
    v.chunks(step)
        .enumerate()
        .map(|(i, c)| ((i * step) as f32, c.iter().copied().fold(f32::NEG_INFINITY, f32::max)))
        .collect()
}

/// A line plot of `points` (x, y) as an SVG string; `None` when no point is finite (an empty
/// range would give plotters an infinite axis).
fn line_svg(title: &str, x_label: &str, points: &[(f32, f32)]) -> Result<Option<String>, Error> {
    let finite: Vec<(f32, f32)> = points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
    if finite.is_empty() {
        return Ok(None);
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (x0, x1) = finite.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |a, p| (a.0.min(p.0), a.1.max(p.0)));
        let (y0, y1) = finite.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |a, p| (a.0.min(p.1), a.1.max(p.1)));
        let (x0, x1) = if x0 < x1 { (x0, x1) } else { (x0 - 1.0, x0 + 1.0) };
        let (y0, y1) = if y0 < y1 { (y0, y1) } else { (y0 - 1.0, y0 + 1.0) };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 14))
            .margin(6)
            .x_label_area_size(28)
            .y_label_area_size(48)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .x_labels(5)
            .y_labels(5)
            .label_style(("sans-serif", 10))
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(LineSeries::new(finite, &BLUE))
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(Some(svg))
}

/// A histogram (bar) plot of `counts` over `[lo, hi]`.
fn hist_svg(counts: &[f32], lo: f32, hi: f32) -> Result<String, Error> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let top = counts.iter().copied().fold(1.0f32, f32::max);
        let width = (hi - lo) / counts.len().max(1) as f32;
        // Log counts: heavy-tailed tensors put almost everything in one or two bins.
        let mut chart = ChartBuilder::on(&root)
            .caption("value histogram (log count)", ("sans-serif", 14))
            .margin(6)
            .x_label_area_size(28)
            .y_label_area_size(48)
            .build_cartesian_2d(lo..hi, (1f32..top * 1.5).log_scale())
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_labels(5)
            .y_labels(4)
            .label_style(("sans-serif", 10))
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(counts.iter().enumerate().map(|(i, &c)| {
                let x = lo + i as f32 * width;
                Rectangle::new([(x, 1.0), (x + width, c.max(1.0))], BLUE.mix(0.6).filled())
            }))
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// The plots of one series, from its last run (and all runs for the trend).
fn plots(s: &Series) -> Result<Vec<String>, Error> {
    let Some(last) = s.runs.last() else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    if let (Some(h), Some(lo), Some(hi)) = (last.vector(tensor::HIST), last.scalar(tensor::HIST_LO), last.scalar(tensor::HIST_HI)) {
        out.push(hist_svg(h, lo as f32, hi as f32)?);
    }
    let indexed = |v: &[f32]| -> Vec<(f32, f32)> { v.iter().enumerate().map(|(i, &y)| (i as f32, y)).collect() };
    // Vector statistics worth a plot, by name (the probe statistics belong to their passes).
    let vectors: [(&str, &str, &str, bool); 8] = [
        ("chan_maxabs", "per-channel max|x|", "channel", true),
        ("pos_sumsq", "per-row energy (sum x²)", "row", true),
        ("peak", "peak probability per head (last run)", "head", false),
        ("sink_first", "mass on the first key per head (last run)", "head", false),
        ("sink_last", "mass on the last key per head (last run)", "head", false),
        ("topk_mass", "top-k mass per head (last run)", "head", false),
        ("load", "assignments per expert (last run)", "expert", false),
        ("cos_row", "cos(x, x + f(x)) per row (last run)", "row", true),
    ];
    for (name, title, x, pooled) in vectors {
        let Some(stat) = Stat::parse(name) else { continue };
        if let Some(v) = last.vector(stat) {
            let points = if pooled { pool(v) } else { indexed(v) };
            out.extend(line_svg(title, x, &points)?);
        }
    }
    if s.runs.len() >= 2 {
        let rms: Vec<(f32, f32)> = s
            .runs
            .iter()
            .enumerate()
            .filter_map(|(i, r): (usize, &StepStats)| Some((i as f32, (r.scalar(tensor::SUMSQ)? / r.scalar(tensor::COUNT)?).sqrt() as f32)))
            .collect();
        out.extend(line_svg("rms across runs", "run", &rms)?);
    }
    Ok(out)
}

/// The report as one self-contained HTML document.
///
/// Errors: a plot cannot be drawn.
pub fn render(title: &str, series: &BTreeMap<SeriesKey, Series>, verdicts: &[Verdict], notes: &[String]) -> Result<String, Error> {
    let mut sections: Vec<Markup> = Vec::new();
    for ((site, role, pass), s) in series {
        let svgs = plots(s)?;
        let here: Vec<&Verdict> = verdicts.iter().filter(|v| &v.site == site && &v.role == role && v.pass_idx == *pass).collect();
        sections.push(html! {
            section.site {
                h3 { (site) " · " (role) @if *pass > 0 { " · pass " (pass) } }
                p.meta { (s.op) " " (s.shape) " · " (s.runs.len()) " run(s)" @if let Some(f) = s.flops { " · " (f) " FLOPs/run" } }
                @if !here.is_empty() {
                    ul { @for v in &here { li { b { (v.kind.to_string()) } " — " (v.rule) } } }
                }
                div.plots { @for svg in &svgs { (PreEscaped(svg)) } }
            }
        });
    }
    let doc = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="generator" content="opscope";
                title { (title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                h1 { (title) }
                h2 { "Verdicts by payoff" }
                @if verdicts.is_empty() { p { "No verdict: nothing in these sketches justifies a specialized kernel." } }
                table {
                    thead { tr { th { "payoff" } th { "verdict" } th { "site" } th { "role" } th { "evidence" } th { "source" } } }
                    tbody {
                        @for v in verdicts {
                            tr {
                                td.num { (format!("{:.4}", v.payoff)) }
                                td { (v.kind.to_string()) }
                                td.site { (v.site) }
                                td { (v.role) }
                                td { @for (k, x) in &v.evidence { (k) "=" (format!("{x:.3}")) " " } }
                                td.src { (v.source) }
                            }
                        }
                    }
                }
                @for n in notes { p.note { (n) } }
                h2 { "Sites" }
                @for s in &sections { (s) }
            }
        }
    };
    Ok(doc.into_string())
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222}\
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}\
td.num{text-align:right}td.site{font-family:monospace}td.src{color:#555;max-width:420px}\
section.site{border-top:1px solid #ddd;margin-top:16px}p.meta{color:#555;font-size:12px}\
div.plots{display:flex;flex-wrap:wrap;gap:8px}p.note{color:#555;font-size:12px}";
