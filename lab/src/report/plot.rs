//! The report's SVG plots, drawn with `plotters`: a log-count histogram, a histogram over runs
//! (heatmap), lines with gaps, and bars on a zero baseline. Each returns the SVG text, or `None`
//! when there is nothing finite to draw (an empty range would give plotters an infinite axis).

use std::fmt::Write as _;

use plotters::coord::CoordTranslate;
use plotters::prelude::*;
use plotters::style::colors::colormaps::ViridisRGB;

use opscope::Error;

/// Plot width and height, in pixels.
pub const W: u32 = 430;
/// Plot height, in pixels.
pub const H: u32 = 230;
/// Longest vector drawn point by point; longer ones are max-pooled to at most this many points.
pub const MAX_POINTS: usize = 512;
/// Most columns of a histogram-over-runs view; more runs are grouped, consecutive runs summed.
pub const MAX_COLUMNS: usize = 64;
/// Colour levels of the histogram-over-runs view (cells of one level in one column merge).
const LEVELS: usize = 16;

/// The colours of the lines of one plot, in order (matplotlib's first tab10 colours).
pub const LINE_COLOURS: [RGBColor; 3] = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44)];
/// Colour of a threshold rule (dashed).
pub const RULE: RGBColor = RGBColor(120, 120, 120);
/// Bar fill colour of histograms and per-head bars.
pub const BAR: RGBColor = RGBColor(31, 119, 180);

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("plotting: {e}"))
}

fn font(px: u32) -> TextStyle<'static> {
    ("sans-serif", px).into_font().color(&BLACK)
}

/// Short axis numbers: 4 significant digits, scientific outside [1e-3, 1e5).
pub fn num(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let a = x.abs();
    if (1e-3..1e5).contains(&a) {
        let decimals = (3 - a.log10().floor() as i32).max(0) as usize;
        let s = format!("{x:.decimals$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    } else {
        // 1.500e5 -> 1.5e5, 1.000e-4 -> 1e-4
        let s = format!("{x:.3e}");
        match s.split_once('e') {
            Some((m, e)) if m.contains('.') => format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.')),
            _ => s,
        }
    }
}

/// Max-pool `v` to at most [`MAX_POINTS`] points `(first index of the chunk, largest finite
/// value in it)`, NaN where a chunk holds no finite value; and the chunk length (1 = not pooled).
/// Peaks, the point of a per-row or per-channel plot, survive; gaps stay gaps.
pub fn pool(v: &[f64]) -> (Vec<(f64, f64)>, usize) {
    let step = v.len().div_ceil(MAX_POINTS).max(1);
    let points = v
        .chunks(step)
        .enumerate()
        .map(|(i, c)| {
            let y = c.iter().copied().filter(|x| x.is_finite()).fold(f64::NAN, f64::max);
            ((i * step) as f64, y)
        })
        .collect();
    (points, step)
}

/// Split `points` into runs of consecutive points with finite coordinates: a line is drawn
/// through each run and never across a non-finite value (a gap, e.g. an omitted padding row).
pub fn segments(points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut cur = Vec::new();
    for &p in points {
        if p.0.is_finite() && p.1.is_finite() {
            cur.push(p);
        } else if !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The first and last index of a positive count (0, 0 when there is none).
fn occupied<'a>(counts: impl Iterator<Item = &'a f64>) -> (usize, usize) {
    let idx: Vec<usize> = counts.enumerate().filter(|(_, c)| c.is_finite() && **c > 0.0).map(|(i, _)| i).collect();
    (idx.first().copied().unwrap_or(0), idx.last().copied().unwrap_or(0))
}

/// A value histogram with a log count axis: `counts` over equal bins of `[lo, hi]`. Only
/// non-zero bins get a bar, and the axis starts below the smallest non-zero count (at most 0.5),
/// so a bin holding a single value is a visible bar. The x axis spans the occupied bins.
/// `None` if no count is positive.
pub fn log_histogram(counts: &[f64], lo: f64, hi: f64) -> Result<Option<String>, Error> {
    let positive = counts.iter().copied().filter(|c| c.is_finite() && *c > 0.0);
    let (least, top) = positive.fold((f64::INFINITY, 0.0f64), |(a, b), c| (a.min(c), b.max(c)));
    if top <= 0.0 {
        return Ok(None);
    }
    let floor = (least / 2.0).min(0.5);
    let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 0.5, lo + 0.5) };
    let width = (hi - lo) / counts.len() as f64;
    // The x axis spans the occupied bins (an absmax range is symmetric; most tensors fill one
    // side or the middle).
    let (first, last) = occupied(counts.iter());
    let (x0, x1) = (lo + width * first as f64, lo + width * (last + 1) as f64);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(52)
            .build_cartesian_2d(x0..x1, (floor..top * 2.0).log_scale())
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .x_desc("value")
            .y_desc("count")
            .x_labels(6)
            .y_labels(6)
            .x_label_formatter(&|x| num(*x))
            .y_label_formatter(&|y| num(*y))
            .label_style(font(11))
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(counts.iter().enumerate().filter(|(_, c)| c.is_finite() && **c > 0.0).map(|(i, &c)| {
                let x = lo + i as f64 * width;
                Rectangle::new([(x, floor), (x + width, c)], BAR.filled())
            }))
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(Some(svg))
}

/// A histogram over runs: x = run (`runs` total), y = value bin over `[lo, hi]`, colour =
/// log10(1 + count) on the viridis scale (dark: few, yellow: many), empty cells white; the y axis
/// spans the occupied bins. `columns`
/// are `(first run, last run, counts per bin)`: one run each, or consecutive runs summed when
/// there are more than [`MAX_COLUMNS`]. `None` if no count is positive.
pub fn runs_heatmap(columns: &[(usize, usize, Vec<f64>)], runs: usize, lo: f64, hi: f64) -> Result<Option<String>, Error> {
    let top = columns.iter().flat_map(|c| c.2.iter().copied()).filter(|c| c.is_finite()).fold(0.0f64, f64::max);
    if top <= 0.0 {
        return Ok(None);
    }
    let scale = (1.0 + top).log10();
    let level = |c: f64| -> Option<usize> {
        (c.is_finite() && c > 0.0).then(|| (((1.0 + c).log10() / scale) * (LEVELS - 1) as f64).round() as usize)
    };
    let colour = |l: usize| ViridisRGB::get_color(l as f32 / (LEVELS - 1) as f32);
    let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 0.5, lo + 0.5) };
    let bins = columns.iter().map(|c| c.2.len()).max().unwrap_or(1).max(1);
    let bin = (hi - lo) / bins as f64;
    let (first, last) = columns.iter().map(|c| occupied(c.2.iter())).fold((usize::MAX, 0), |a, b| (a.0.min(b.0), a.1.max(b.1)));
    let (y0, y1) = (lo + bin * first as f64, lo + bin * (last + 1) as f64);
    let mut paths = vec![String::new(); LEVELS];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (left, bar) = root.split_horizontally(W - 62);
        let mut chart = ChartBuilder::on(&left)
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(52)
            .build_cartesian_2d(0f64..runs.max(1) as f64, y0..y1)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .disable_mesh()
            .x_desc("run")
            .y_desc("value")
            .x_labels(runs.clamp(2, 8))
            .y_labels(6)
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-9 { format!("{x:.0}") } else { String::new() })
            .y_label_formatter(&|y| num(*y))
            .label_style(font(11))
            .draw()
            .map_err(plot_err)?;
        // Cells, one SVG path per colour level (a rect element each would make the report
        // several times larger); consecutive bins of one level in a column are one rectangle.
        let spec = chart.as_coord_spec();
        for (first, last, counts) in columns {
            let mut i = 0;
            while i < counts.len() {
                let Some(l) = level(counts[i]) else {
                    i += 1;
                    continue;
                };
                let mut j = i + 1;
                while j < counts.len() && level(counts[j]) == Some(l) {
                    j += 1;
                }
                let a = spec.translate(&(*first as f64, lo + bin * i as f64));
                let b = spec.translate(&((*last + 1) as f64, lo + bin * j as f64));
                let (x, y, w, h) = (a.0.min(b.0), a.1.min(b.1), (a.0 - b.0).abs().max(1), (a.1 - b.1).abs().max(1));
                let _ = write!(paths[l], "M{x} {y}h{w}v{h}h-{w}z");
                i = j;
            }
        }
        // Colour bar: LEVELS steps from 1 count (bottom) to `top` (top).
        let (y0, y1) = (14i32, H as i32 - 44);
        let step = (y1 - y0) as f64 / LEVELS as f64;
        for l in 0..LEVELS {
            let ya = y1 - ((l + 1) as f64 * step).round() as i32;
            let yb = y1 - (l as f64 * step).round() as i32;
            bar.draw(&Rectangle::new([(6, ya), (18, yb)], colour(l).filled())).map_err(plot_err)?;
        }
        bar.draw(&Text::new(num(top), (21, y0 - 2), font(10))).map_err(plot_err)?;
        bar.draw(&Text::new("1", (21, y1 - 10), font(10))).map_err(plot_err)?;
        bar.draw(&Text::new("count", (4, y1 + 6), font(10))).map_err(plot_err)?;
        bar.draw(&Text::new("(log)", (4, y1 + 18), font(10))).map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    let cells: String = paths
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.is_empty())
        .map(|(l, d)| {
            let RGBColor(r, g, b) = colour(l);
            format!("<path class=\"cell\" fill=\"#{r:02X}{g:02X}{b:02X}\" stroke=\"none\" d=\"{d}\"/>\n")
        })
        .collect();
    let end = svg.rfind("</svg>").ok_or_else(|| plot_err("the SVG backend wrote no </svg>"))?;
    svg.insert_str(end, &cells);
    Ok(Some(svg))
}

/// Lines over a shared integer x axis (channel, row, run), in [`LINE_COLOURS`] order (the
/// caption names them; the first is drawn on top). Each line is drawn as its finite [`segments`] (a one-point segment as a
/// dot), never across a gap. The y axis starts at 0 when `zero` (magnitudes), else at the
/// smallest value. An optional dashed grey horizontal `rule` at y marks a threshold. `None` if no
/// point is finite.
pub fn lines(x_desc: &str, y_desc: &str, lines: &[Vec<(f64, f64)>], zero: bool, rule: Option<f64>) -> Result<Option<String>, Error> {
    let finite: Vec<(f64, f64)> = lines.iter().flat_map(|l| l.iter().copied()).filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
    if finite.is_empty() {
        return Ok(None);
    }
    let (x0, x1) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let (mut y0, mut y1) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    if let Some(y) = rule.filter(|y| y.is_finite()) {
        y1 = y1.max(y);
    }
    if zero {
        y0 = y0.min(0.0);
    }
    let (x0, x1) = if x0 < x1 { (x0, x1) } else { (x0 - 1.0, x0 + 1.0) };
    let pad = (y1 - y0) * 0.05;
    let (y0, y1) = if y0 < y1 { (if zero && y0 == 0.0 { 0.0 } else { y0 - pad }, y1 + pad) } else { (y0 - 1.0, y0 + 1.0) };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(52)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_labels(6)
            .y_labels(6)
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-9 { format!("{x:.0}") } else { String::new() })
            .y_label_formatter(&|y| num(*y))
            .label_style(font(11))
            .draw()
            .map_err(plot_err)?;
        if let Some(y) = rule.filter(|y| y.is_finite()) {
            // 20 dashes: every other fortieth of the x range.
            let dashes: Vec<f64> = (0..=40).map(|i| x0 + (x1 - x0) * i as f64 / 40.0).collect();
            chart
                .draw_series(dashes.chunks(2).filter(|d| d.len() == 2).map(|d| PathElement::new(vec![(d[0], y), (d[1], y)], RULE)))
                .map_err(plot_err)?;
        }
        // The first line is drawn last, on top.
        for (k, line) in lines.iter().enumerate().rev() {
            let colour = LINE_COLOURS[k % LINE_COLOURS.len()];
            for seg in segments(line) {
                if seg.len() == 1 {
                    chart.draw_series(seg.into_iter().map(|p| Circle::new(p, 2, colour.filled()))).map_err(plot_err)?;
                } else {
                    chart.draw_series(LineSeries::new(seg, colour.stroke_width(1))).map_err(plot_err)?;
                }
            }
        }
        root.present().map_err(plot_err)?;
    }
    Ok(Some(svg))
}

/// Bars at x = 0, 1, ... (`x_desc`: head, expert) on a zero baseline: a bar per finite value,
/// the y axis from min(0, smallest) to the largest value. `None` if no value is finite.
pub fn bars(x_desc: &str, y_desc: &str, values: &[f64]) -> Result<Option<String>, Error> {
    let finite: Vec<(usize, f64)> = values.iter().copied().enumerate().filter(|(_, v)| v.is_finite()).collect();
    if finite.is_empty() {
        return Ok(None);
    }
    let top = finite.iter().map(|v| v.1).fold(0.0f64, f64::max);
    let bottom = finite.iter().map(|v| v.1).fold(0.0f64, f64::min);
    let (bottom, top) = if top > bottom { (bottom, top) } else { (0.0, 1.0) };
    let n = values.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(52)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, bottom..top * 1.08)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .disable_x_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_labels(n.min(16))
            .y_labels(6)
            .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() })
            .y_label_formatter(&|y| num(*y))
            .label_style(font(11))
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(finite.iter().map(|&(i, v)| Rectangle::new([(i as f64 - 0.38, 0.0), (i as f64 + 0.38, v)], BAR.filled())))
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(Some(svg))
}

/// Roofline plot width and height, in pixels.
pub const ROOFLINE_W: u32 = 620;
/// See [`ROOFLINE_W`].
pub const ROOFLINE_H: u32 = 340;
/// Marker colour of memory-bound points (tab10 orange) and compute-bound points (tab10 blue).
pub const MEMORY_BOUND: RGBColor = RGBColor(255, 127, 14);
/// See [`MEMORY_BOUND`].
pub const COMPUTE_BOUND: RGBColor = RGBColor(31, 119, 180);

/// A roofline (Williams, Waterman and Patterson, CACM 2009) on log-log axes: x arithmetic
/// intensity (FLOP/byte), y FLOP/s; the memory roof `bandwidth x intensity` up to the ridge
/// point and the compute roof `peak` after it (solid, grey), a dashed vertical line at the
/// ridge, and one circle per point `(intensity, flop_per_s, memory_bound, weight)`, area
/// proportional to `weight` (0..1, the share of the time bound), orange when memory-bound, blue
/// when compute-bound. `cache`: the fastest cache level's bandwidth, drawn as a dashed memory
/// roof up to its own ridge (the hierarchical roofline's upper roof; Yang et al. 2020); points
/// keep their DRAM class. `None` when no point has a positive intensity and rate.
pub fn roofline(points: &[(f64, f64, bool, f64)], peak: f64, bandwidth: f64, cache: Option<f64>) -> Result<Option<String>, Error> {
    let ok: Vec<&(f64, f64, bool, f64)> = points.iter().filter(|p| p.0 > 0.0 && p.1 > 0.0 && p.0.is_finite() && p.1.is_finite()).collect();
    if ok.is_empty() || !(peak > 0.0 && bandwidth > 0.0) {
        return Ok(None);
    }
    let ridge = peak / bandwidth;
    let (ilo, ihi) = ok.iter().fold((ridge, ridge), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let (x0, x1) = (ilo / 3.0, ihi * 3.0);
    let ylo = ok.iter().fold(peak.min(x0 * bandwidth), |a, p| a.min(p.1));
    let (y0, y1) = (ylo / 3.0, peak * 3.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (ROOFLINE_W, ROOFLINE_H)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(34)
            .y_label_area_size(60)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .max_light_lines(0)
            .x_desc("arithmetic intensity, FLOP/byte")
            .y_desc("FLOP/s")
            .x_labels(8)
            .y_labels(8)
            .x_label_formatter(&|x| num(*x))
            .y_label_formatter(&|y| num(*y))
            .label_style(font(11))
            .draw()
            .map_err(plot_err)?;
        let roof = RGBColor(90, 90, 90);
        let mem_start = (x0, x0 * bandwidth);
        chart.draw_series(LineSeries::new(vec![mem_start, (ridge, peak), (x1, peak)], roof.stroke_width(2))).map_err(plot_err)?;
        // Dashed ridge line: 20 dashes on a log axis.
        let dashes: Vec<f64> = (0..=40).map(|i| y0 * (peak / y0).powf(i as f64 / 40.0)).collect();
        chart
            .draw_series(dashes.chunks(2).filter(|d| d.len() == 2).map(|d| PathElement::new(vec![(ridge, d[0]), (ridge, d[1])], RULE)))
            .map_err(plot_err)?;
        let label = |text: String, at: (f64, f64)| Text::new(text, at, font(11));
        chart.draw_series(std::iter::once(label(format!("peak {} GFLOP/s", num(peak / 1e9)), (x0 * 1.15, peak * 1.25)))).map_err(plot_err)?;
        chart
            .draw_series(std::iter::once(label(format!("bandwidth {} GB/s", num(bandwidth / 1e9)), (x0 * 1.15, x0 * bandwidth * 8.0))))
            .map_err(plot_err)?;
        chart.draw_series(std::iter::once(label(format!("ridge {} FLOP/B", num(ridge)), (ridge * 1.1, y0 * 1.6)))).map_err(plot_err)?;
        if let Some(c) = cache.filter(|&c| c > bandwidth && c.is_finite()) {
            // Dashed cache roof from x0 to its ridge, 20 dashes on the log axis.
            let cr = (peak / c).max(x0);
            let xs: Vec<f64> = (0..=40).map(|i| x0 * (cr / x0).powf(i as f64 / 40.0)).collect();
            chart
                .draw_series(xs.chunks(2).filter(|d| d.len() == 2).map(|d| PathElement::new(vec![(d[0], d[0] * c), (d[1], d[1] * c)], roof.stroke_width(1))))
                .map_err(plot_err)?;
            chart
                .draw_series(std::iter::once(label(format!("cache {} GB/s", num(c / 1e9)), (x0 * 1.15, x0 * c * 2.2))))
                .map_err(plot_err)?;
        }
        // Largest first, so that small markers stay visible on top.
        let mut sorted = ok.clone();
        sorted.sort_by(|a, b| b.3.total_cmp(&a.3));
        chart
            .draw_series(sorted.iter().map(|p| {
                let colour = if p.2 { MEMORY_BOUND } else { COMPUTE_BOUND };
                let r = (3.0 + 14.0 * p.3.clamp(0.0, 1.0).sqrt()).round() as i32;
                Circle::new((p.0, p.1), r, colour.mix(0.55).filled())
            }))
            .map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(Some(svg))
}
