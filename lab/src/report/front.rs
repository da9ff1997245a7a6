//! The HTML of the overview the report opens on ([`Overview`]): the cost's source, where the
//! time goes (per op kind) beside the roofline, the top sites beside the GEMM-shape histogram,
//! the per-layer heatmaps and one row per site with its kernels and payoff. Every site name
//! links to its drill-down section, every kernel to its verdict group.

use std::collections::BTreeMap;

use maud::{html, Markup, PreEscaped};

use opscope::mine::OUTLIER_CHANNEL_RATIO;
use opscope::Error;

use super::overview::{CostSource, HeatCell, Overview, ShareBasis};
use super::plot::{self, num};

/// Op kinds listed in "where the time goes" before the rest are summed into one row.
const KINDS_SHOWN: usize = 10;

fn pct(x: f64) -> String {
    if x > 0.0 && x < 0.001 {
        "<0.1%".to_string()
    } else {
        format!("{:.1}%", 100.0 * x)
    }
}

fn gflop(f: f64) -> String {
    format!("{:.3}", f / 1e9)
}

fn mb(b: f64) -> String {
    format!("{:.2}", b / 1e6)
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), num)
}

/// A share with a bar behind it (the bar's width is the share).
fn share_cell(x: f64) -> Markup {
    html! { td.share { span.bar style=(format!("width:{:.1}%", (100.0 * x).clamp(0.0, 100.0))) {} span.v { (pct(x)) } } }
}

fn bound_cell(b: Option<&str>) -> Markup {
    html! { td { @match b { Some("memory") => { span.mem { "memory" } } Some("compute") => { span.cmp { "compute" } } Some(x) => { (x) } None => { "-" } } } }
}

/// A name split after each `/` so that long names wrap there.
fn wrap(name: &str) -> Markup {
    html! { @for (i, part) in name.split('/').enumerate() { @if i > 0 { "/" wbr; } (part) } }
}

/// White to dark red (ColorBrewer RdBu's red end) for `t` in 0..1, and a text colour that reads on it.
fn heat(t: f64) -> String {
    let t = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 };
    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
    let (r, g, b) = (mix(255.0, 178.0), mix(255.0, 24.0), mix(255.0, 43.0));
    let text = if t > 0.55 { "#fff" } else { "#222" };
    format!("background:#{r:02x}{g:02x}{b:02x};color:{text}")
}

/// The heatmap statistics: name, caption, value of a cell, colour position of a value given
/// the finite values of the map.
type Scale = fn(f64, &[f64]) -> f64;
const HEAT_STATS: [(&str, &str, fn(&HeatCell) -> Option<f64>, Scale); 4] = [
    ("absmax", "max |x| over all runs; colour: log scale, smallest to largest of the map", |c| c.absmax, |v, all| {
        let lo = all.iter().copied().filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
        let hi = all.iter().copied().fold(0.0f64, f64::max);
        if v > 0.0 && hi > lo { (v / lo).ln() / (hi / lo).ln() } else { 0.0 }
    }),
    ("kurtosis", "median over runs of the per-run kurtosis (3 for a Gaussian); colour: log scale from 3 to the largest", |c| c.kurtosis, |v, all| {
        let hi = all.iter().copied().fold(3.0f64, f64::max);
        if hi > 3.0 { (v.max(3.0) / 3.0).ln() / (hi / 3.0).ln() } else { 0.0 }
    }),
    ("outlier channels", "channels whose max|x| over all runs exceeds the outlier line (see above); colour: 0 to the largest count", |c| {
        c.outlier_channels.map(|n| n as f64)
    }, |v, all| {
        let hi = all.iter().copied().fold(0.0f64, f64::max);
        if hi > 0.0 { v / hi } else { 0.0 }
    }),
    ("density", "median over runs of nnz / count; colour: sparsity (1 - density), 0 white to 1 dark", |c| c.density, |v, _| 1.0 - v),
];

fn heatmaps(o: &Overview) -> Markup {
    let h = &o.heatmap;
    let cell: BTreeMap<(&str, &str, &str), &HeatCell> = h.cells.iter().map(|c| ((c.row.as_str(), c.column.as_str(), c.role.as_str()), c)).collect();
    html! {
        @for (name, caption, get, scale) in HEAT_STATS {
            @let all: Vec<f64> = h.cells.iter().filter_map(get).filter(|x| x.is_finite()).collect();
            div.heat {
                h4 { (name) " " span.cap { "— " (caption) @if all.is_empty() { ". Not recorded (add it to the pipeline's stats)." } } }
                @if !all.is_empty() {
                    table.heat data-stat=(name) {
                        thead {
                            tr { th rowspan="2" {} @for (col, roles) in &h.columns { th.col colspan=(roles.len()) { (wrap(col)) } } }
                            tr { @for (_, roles) in &h.columns { @for r in roles { th.role { (r) } } } }
                        }
                        tbody {
                            @for row in &h.rows {
                                tr {
                                    th.row { (row) }
                                    @for (col, roles) in &h.columns {
                                        @for r in roles {
                                            @match cell.get(&(row.as_str(), col.as_str(), r.as_str())).and_then(|c| get(c).map(|v| (c, v))) {
                                                Some((c, v)) if v.is_finite() => {
                                                    td style=(heat(scale(v, &all))) title=(format!("{} · {} · {name} {}", c.site, c.role, num(v))) {
                                                        a href={ "#" (c.anchor) } { (if name == "outlier channels" { format!("{v:.0}") } else { num3(v) }) }
                                                    }
                                                }
                                                _ => { td.none {} }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// 3 significant digits, short.
fn num3(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let a = x.abs();
    if (0.01..1e4).contains(&a) {
        let decimals = (2 - a.log10().floor() as i32).max(0) as usize;
        format!("{x:.decimals$}")
    } else {
        let s = format!("{x:.1e}");
        s.replace(".0e", "e")
    }
}

/// The overview section.
///
/// Errors: the roofline cannot be drawn.
pub fn html(o: &Overview) -> Result<Markup, Error> {
    let basis = o.share_basis.label();
    let roofline_svg = match &o.roofline {
        Some(r) => plot::roofline(
            &r.points.iter().map(|p| (p.intensity, p.attainable, p.bound == "memory", p.bound_share)).collect::<Vec<_>>(),
            r.roofs.peak_flops,
            r.roofs.bandwidth,
            r.cache_bandwidth,
        )?,
        None => None,
    };
    // Without a cost: the recorded sites per op (FLOPs of one execution of each).
    let mut recorded_ops: Vec<(String, usize, f64, f64)> = Vec::new();
    for s in &o.sites {
        let f = s.flops.unwrap_or(0) as f64;
        match recorded_ops.iter_mut().find(|r| r.0 == s.op) {
            Some(r) => {
                r.1 += 1;
                r.2 += f;
                r.3 += s.recorded_flop_share;
            }
            None => recorded_ops.push((s.op.clone(), 1, f, s.recorded_flop_share)),
        }
    }
    recorded_ops.sort_by(|a, b| b.2.total_cmp(&a.2));
    let rest = o.by_kind.iter().skip(KINDS_SHOWN);
    let rest_n = o.by_kind.len().saturating_sub(KINDS_SHOWN);
    let (rest_flops, rest_bytes, rest_share, rest_bound): (f64, f64, f64, f64) =
        rest.fold((0.0, 0.0, 0.0, 0.0), |a, k| (a.0 + k.cost.flops as f64, a.1 + k.cost.bytes.total() as f64, a.2 + k.flop_share, a.3 + k.bound_share));
    Ok(html! {
        section #overview {
            h2 { "Overview" }
            p.source {
                @match &o.cost_source {
                    Some(CostSource::Computed { onnx }) => {
                        b { "Cost: computed" } " here from " code { (onnx) } " (graph " code { (o.cost_graph.as_deref().unwrap_or("?")) } ", deployed after RLX's fusion; roofs measured in this process)."
                    }
                    Some(CostSource::File { path }) => {
                        b { "Cost: read" } " from " code { (path) } " (" code { "opscope cost --json" } " of graph " code { (o.cost_graph.as_deref().unwrap_or("?")) } ")."
                    }
                    None => {
                        b { "Cost: absent." } " No FLOPs per op kind, bytes, roofline or GEMM shapes: pass " code { "--cost FILE" } " (from " code { "opscope cost --json" }
                        ") or " code { "--onnx MODEL" } ". Shares below are of the recorded sites' FLOPs."
                    }
                }
                " "
                @match o.share_basis {
                    ShareBasis::MeasuredTime => { "Shares are measured time shares (" (o.time_method.as_deref().unwrap_or("")) ")." }
                    _ => { b { "No measured time:" } " the share column is the FLOP share, and the roofline bound (max(FLOPs/peak, bytes/bandwidth)) stands for time." }
                }
            }
            @if !o.kernels.is_empty() {
                p.headline {
                    b { "Kernels the data supports" } " (payoff summed over sites; " a href="#overview-sites" { "per site" } "): "
                    @for (i, k) in o.kernels.iter().filter(|k| k.payoff > 0.0).take(6).enumerate() {
                        @if i > 0 { " · " }
                        a href={ "#v-" (k.kind) } { (k.kind) } " " b { (format!("{:.3}", k.payoff)) } span.idx { " (" (k.sites) " sites)" }
                    }
                }
            }
            div.row {
                div.col {
                    h3 { "Where the time goes" }
                    @if o.by_kind.is_empty() {
                        p.meta { "Recorded sites by op (" (o.sites.len()) " sites, FLOPs of one execution each)." }
                        table.kinds {
                            thead { tr { th { "op" } th { "sites" } th { "GFLOP" } th { "FLOP share of recorded sites" } } }
                            tbody { @for (op, n, f, share) in &recorded_ops { tr { td { (op) } td.num { (n) } td.num { (gflop(*f)) } (share_cell(*share)) } } }
                        }
                    } @else {
                        p.meta {
                            "One forward pass: " (gflop(o.total_flops)) " GFLOP, " (mb(o.total_bytes.unwrap_or(0) as f64)) " MB moved, roofline time bound "
                            (format!("{:.2}", o.min_seconds.unwrap_or(0.0) * 1e3)) " ms. Per op kind, by FLOPs."
                        }
                        table.kinds {
                            thead { tr { th { "op kind" } th { "nodes" } th { "GFLOP" } th { "FLOP share" } th { "MB" } th { "FLOP/byte" } th { "bound" } th { "share of time bound" } } }
                            tbody {
                                @for k in o.by_kind.iter().take(KINDS_SHOWN) {
                                    tr {
                                        td { (k.cost.op) } td.num { (k.cost.count) }
                                        td.num { (gflop(k.cost.flops as f64)) @if k.cost.flops_unknown { "+?" } }
                                        (share_cell(k.flop_share))
                                        td.num { (mb(k.cost.bytes.total() as f64)) } td.num { (opt(k.cost.intensity)) }
                                        (bound_cell(k.cost.bound.as_deref())) (share_cell(k.bound_share))
                                    }
                                }
                                @if rest_n > 0 {
                                    tr.rest { td { (rest_n) " other kinds" } td {} td.num { (gflop(rest_flops)) } (share_cell(rest_share)) td.num { (mb(rest_bytes)) } td {} td {} (share_cell(rest_bound)) }
                                }
                            }
                        }
                    }
                }
                div.col {
                    h3 { "Roofline" }
                    @match (&o.roofline, roofline_svg) {
                        (Some(r), Some(svg)) => {
                            figure.plot.roofline data-plot="roofline" data-points=(r.points.len()) {
                                (PreEscaped(svg))
                                figcaption {
                                    "One point per costed site of the deployed graph (" (r.points.len()) "), at its arithmetic intensity (FLOPs / bytes moved), on the roof: "
                                    "the height is the attainable rate min(peak, intensity × bandwidth), not a measured one. Area: share of the time bound. "
                                    span.dot style="background:#ff7f0e" {} " memory-bound, " span.dot style="background:#1f77b4" {} " compute-bound (against the measured ridge point). "
                                    @if r.not_drawn > 0 { (r.not_drawn) " data-movement site(s) with 0 or unknown FLOPs are not drawn (log axes). " }
                                    @if r.cache_bandwidth.is_some() {
                                        "Dashed: the fastest cache level's bandwidth (the cost's bandwidth-by-working-set curve); an op whose working set fits in cache "
                                        "can run above the DRAM roof, up to its level's (" code { "opscope cost" } " lists the roof at each site's bytes)."
                                    }
                                }
                            }
                        }
                        _ => { p.meta { "No roofline without a cost (" code { "--cost" } " or " code { "--onnx" } ")." } }
                    }
                }
            }
            @if !o.top_sites.is_empty() || !o.gemm_shapes.is_empty() {
                div.row {
                    div.col {
                        h3 { "Top sites by roofline time bound" }
                        table.top {
                            thead { tr { th { "site" } th { "op" } th { "shape" } th { "GFLOP" } th { "MB" } th { "FLOP/byte" } th { "bound" } th { "bound ms" } } }
                            tbody {
                                @for t in &o.top_sites {
                                    tr {
                                        td.site { (merged_name(&t.site.split('+').map(|p| short_of(o, p)).collect::<Vec<_>>())) }
                                        td { (t.op) } td.mono { (format!("{:?}", t.shape)) }
                                        td.num { (t.flops.map_or("?".to_string(), |f| gflop(f as f64))) } td.num { (mb(t.bytes.total() as f64)) }
                                        td.num { (opt(t.intensity)) } (bound_cell(t.bound.as_deref())) td.num { (format!("{:.3}", t.min_seconds * 1e3)) }
                                    }
                                }
                            }
                        }
                    }
                    div.col {
                        h3 { "GEMM shapes RLX runs" }
                        table.gemm {
                            thead { tr { th { "M × K × N" } th { "batch" } th { "dtype" } th { "B operand" } th { "count" } th { "GFLOP" } th { "share of GEMM FLOPs" } } }
                            tbody {
                                @for g in &o.gemm_shapes {
                                    tr {
                                        td.mono { (g.shape.m) " × " (g.shape.k) " × " (g.shape.n) } td.num { (g.shape.batch) } td { (g.shape.dtype) }
                                        td { (if g.shape.weight { "weight" } else { "activation" }) } td.num { (g.count) } td.num { (gflop(g.flops as f64)) }
                                        (share_cell(g.share))
                                    }
                                }
                            }
                        }
                        p.meta { "The shapes of the deployed graph, after RLX's fusion (which may merge projections that share an input, such as Q/K/V, into one GEMM)." }
                    }
                }
            }
            h3 { "Per layer: key statistics" }
            p.meta { "Rows: layers (from the site names); columns: the site within a layer and the tensor's role. Each cell links to its plots. Empty: not recorded. Outlier line: "
                (OUTLIER_CHANNEL_RATIO) "x the median channel's max|x| (LLM.int8(), SmoothQuant)." }
            (heatmaps(o))
            h3 #overview-sites { "Per site: the kernel its data supports" }
            p.meta {
                "One row per recorded site, in execution order. Share: " (basis) ". Payoff: share × the fraction of the site's cost the kernel could remove (per verdict kind; kernels are alternatives, so the best one is shown as the site's payoff). "
                "Kernels link to their verdict evidence; the site to its plots."
            }
            table.overview-sites {
                thead { tr { th { "#" } th { "site" } th { "op" } th { "out shape" } th { (basis) } th { "GFLOP / exec" } th { "FLOP/byte" } th { "bound" } th { "kernels the data supports (payoff)" } th { "best payoff" } } }
                tbody {
                    @for (i, s) in o.sites.iter().enumerate() {
                        tr data-site=(s.site) {
                            td.num { (i) }
                            td.site { a href={ "#" (s.anchor) } { (s.short) } }
                            td { (s.op) } td.mono { (s.shape) }
                            (share_cell(s.share))
                            td.num { (s.cost.as_ref().and_then(|c| c.flops).or(s.flops.map(|f| f as f64)).map_or("-".to_string(), gflop)) }
                            td.num { (opt(s.cost.as_ref().and_then(|c| c.intensity))) }
                            (bound_cell(s.cost.as_ref().and_then(|c| c.bound.as_deref())))
                            td.kernels {
                                @if s.kernels.is_empty() { span.none { "none" } }
                                @for (j, k) in s.kernels.iter().enumerate() {
                                    @if j > 0 { " · " }
                                    span class=(if k.payoff > 0.0 { "kernel" } else { "kernel zero" }) {
                                        a href={ "#v-" (k.kind) } { (k.kind) } " " (format!("{:.4}", k.payoff)) span.idx { " (" (k.roles.join(", ")) ")" }
                                    }
                                }
                            }
                            td.num { @if s.payoff > 0.0 { b { (format!("{:.4}", s.payoff)) } } @else { "0" } }
                        }
                    }
                }
            }
        }
    })
}

/// A cost site name without the recording's prefix, when a recorded site shares it.
fn short_of(o: &Overview, site: &str) -> String {
    o.sites.iter().find(|s| s.site == site).map_or_else(|| site.to_string(), |s| s.short.clone())
}

/// The names of the logical sites of one merged node, written once:
/// `layer.0/attention/self/{query,key,value}/MatMul` (common prefix and suffix at `/`).
fn merged_name(parts: &[String]) -> String {
    let [first, rest @ ..] = parts else { return String::new() };
    if rest.is_empty() {
        return first.clone();
    }
    let mut pre = first.len();
    for p in rest {
        pre = pre.min(first.bytes().zip(p.bytes()).take_while(|(a, b)| a == b).count());
    }
    let pre = first[..pre].rfind('/').map_or(0, |i| i + 1);
    let mut suf = first.len() - pre;
    for p in rest {
        suf = suf.min(first[pre..].bytes().rev().zip(p[pre.min(p.len())..].bytes().rev()).take_while(|(a, b)| a == b).count());
    }
    let suf = first[first.len() - suf..].find('/').map_or(0, |i| suf - i);
    let middles: Vec<&str> = parts.iter().map(|p| &p[pre..p.len() - suf]).collect();
    format!("{}{{{}}}{}", &first[..pre], middles.join(","), &first[first.len() - suf..])
}

#[cfg(test)]
mod tests {
    use super::merged_name;

    #[test]
    fn merged_names_are_written_once() {
        let p = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(merged_name(&p(&["l.0/a/query/MatMul", "l.0/a/key/MatMul", "l.0/a/value/MatMul"])), "l.0/a/{query,key,value}/MatMul");
        assert_eq!(merged_name(&p(&["x/q", "x/k"])), "x/{q,k}");
        assert_eq!(merged_name(&p(&["q", "k"])), "{q,k}");
        assert_eq!(merged_name(&p(&["only/one"])), "only/one");
    }
}
