//! A self-contained HTML report of a recording, summarising every run (never the last run
//! alone): a header naming the graphs, pipeline and run count (from the manifest sidecar), the
//! overview a person reads first ([`Overview`]: where the time goes with the cost of the deployed
//! graph when given, a roofline, the GEMM shapes, a per-layer heatmap of key statistics, one row
//! per site with the kernels its data supports), then as drill-down a contents list, a per-site table in execution order, the verdicts grouped by kind with each
//! rule and its source, and per site and role SVG plots (made with `plotters`): the value
//! histogram merged over runs, the histogram per run, per-channel max|x|, per-row energy,
//! per-head probe statistics and per-run absmax / rms. HTML is generated with `maud`, which
//! escapes every name; the numbers behind the table and plots are embedded as JSON
//! (`<script type="application/json" id="opscope-data">`, made with serde_json; not executable).

mod data;
mod front;
mod overview;
mod plot;

use std::collections::{BTreeMap, BTreeSet};

use maud::{html, Markup, PreEscaped, DOCTYPE};
use serde::Serialize;

use opscope::manifest::Manifest;
use opscope::mine::{Series, SeriesKey, Verdict, OUTLIER_CHANNEL_RATIO};
use opscope::Error;

pub use data::{summarize, ChannelData, HistData, Pooled, ProbeKind, SeriesData, PROBE_VECTORS};
pub use overview::{
    build as build_overview, layer_of, CostSource, CostView, HeatCell, Heatmap, Kernel, KernelTotal, KindRow, Overview, OverviewInput, Roofline, RooflinePoint,
    ShareBasis, SiteCostShare, SiteRow, TimeShares, LAYER_WORDS, TOP_SITES,
};
pub use plot::{num, pool, segments, MAX_COLUMNS, MAX_POINTS};

/// What a report is made of.
pub struct Input<'a> {
    /// Page title (the recording's path, say).
    pub title: &'a str,
    /// The recording's manifests, one per tapped compile (`recording::read_sidecar(..).graphs`;
    /// from a `MemorySink`, its manifests each in an `Arc`); empty when there is no sidecar.
    pub manifests: &'a [std::sync::Arc<Manifest>],
    /// The recording's series ([`opscope::mine::load_compact`] or [`opscope::mine::load`]).
    pub series: &'a BTreeMap<SeriesKey, Series>,
    /// Verdicts ([`opscope::mine::mine`]), highest payoff first.
    pub verdicts: &'a [Verdict],
    /// Notes shown under the verdicts (sites without data, what sketches cannot see).
    pub notes: &'a [String],
    /// The cost of the recorded graph (`opscope cost --json`, read or computed) and where it
    /// came from; `None`: the overview says the cost is absent.
    pub cost: Option<(&'a CostView, &'a CostSource)>,
    /// Measured per-site time shares; `None`: the share column is the FLOP share, labelled so.
    pub time: Option<&'a TimeShares>,
}

/// The JSON block: the header numbers and every series' summary, in execution order.
#[derive(Serialize)]
struct Embedded<'a> {
    /// Distinct runs (compile, step) in the recording.
    runs: usize,
    /// Compiles in the recording.
    compiles: usize,
    /// The prefix stripped from site names in the tables.
    prefix: &'a str,
    /// The overview ([`Overview`]), as `opscope report --json` writes it.
    overview: &'a Overview,
    series: &'a [SeriesData],
}

/// Series in execution order: by the graph position (node) of their site in the first manifest
/// that lists it (compiles in recording order), then by first appearance in the recording
/// ([`Series::order`]; the Q/K/V projections RLX fuses share a node). Series no manifest lists
/// come last, by first appearance.
fn execution_order<'a>(series: &'a BTreeMap<SeriesKey, Series>, manifests: &[std::sync::Arc<Manifest>]) -> Vec<(&'a SeriesKey, &'a Series)> {
    let mut node: BTreeMap<(&str, u32), (usize, u32)> = BTreeMap::new();
    for (ci, m) in manifests.iter().enumerate() {
        for s in &m.sites {
            node.entry((s.site.as_str(), s.pass_idx as u32)).or_insert((ci, s.node));
        }
    }
    let mut v: Vec<_> = series.iter().collect();
    v.sort_by_key(|(k, s)| (node.get(&(k.0.as_str(), k.2)).copied().unwrap_or((usize::MAX, u32::MAX)), s.order));
    v
}

/// An evidence value: an integer when it is one (counts, heads, runs), else 4 significant digits.
fn evidence_value(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e12 {
        format!("{x:.0}")
    } else {
        num(x)
    }
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), num)
}

/// One plot and its caption; `data-plot` names the kind, `data-series` the anchor.
fn figure(kind: &str, anchor: &str, svg: String, caption: Markup) -> Markup {
    html! {
        figure.plot data-plot=(kind) data-series=(anchor) {
            (PreEscaped(svg))
            figcaption { (caption) }
        }
    }
}

/// The legend key of line `k` of a line plot: a short bar in its colour.
fn key(k: usize) -> Markup {
    let plotters::style::RGBColor(r, g, b) = plot::LINE_COLOURS[k % plot::LINE_COLOURS.len()];
    html! { span.key style=(format!("background:#{r:02x}{g:02x}{b:02x}")) {} }
}

/// The legend key of a threshold rule: a dashed grey bar.
fn rule_key() -> Markup {
    html! { span.key.rule {} " dashed:" }
}

/// The plots of one series.
fn plots(d: &SeriesData) -> Result<Vec<Markup>, Error> {
    let mut out = Vec::new();
    let a = d.anchor.as_str();
    if let Some(h) = &d.hist {
        if let Some(svg) = plot::log_histogram(&h.merged.counts, h.merged.lo, h.merged.hi)? {
            let caption = html! {
                "Value histogram over all " (h.merged.runs) " run(s), log count (a bin holding one value is a visible bar). "
                @if h.merged.exact { "Range [" (num(h.merged.lo)) ", " (num(h.merged.hi)) "] shared by every run: counts are exact sums." }
                @else { b { "Re-binned: " } "the runs had different ranges (per-run absmax); each run's counts were spread onto the common range ["
                    (num(h.merged.lo)) ", " (num(h.merged.hi)) "] assuming values uniform within a bin." }
                @if h.merged.outside > 0.0 { " " (evidence_value(h.merged.outside)) " value(s) fell outside the fixed range." }
            };
            out.push(figure("hist", a, svg, caption));
        }
        if h.runs.len() >= 2 && !d.runs_identical {
            let runs = d.runs;
            let group = runs.div_ceil(MAX_COLUMNS).max(1);
            let mut columns: Vec<(usize, usize, Vec<f64>)> = Vec::new();
            for (i, c) in &h.runs {
                let col = i / group;
                match columns.last_mut() {
                    Some(last) if last.0 / group == col => {
                        last.1 = *i;
                        for (o, x) in last.2.iter_mut().zip(c) {
                            *o += x;
                        }
                    }
                    _ => columns.push((*i, *i, c.clone())),
                }
            }
            for c in &mut columns {
                c.0 = c.0 / group * group;
                c.1 = (c.0 + group - 1).min(runs - 1);
            }
            if let Some(svg) = plot::runs_heatmap(&columns, runs, h.merged.lo, h.merged.hi)? {
                let caption = html! {
                    "Histogram per run on the common range: x run, y value, colour log count (white: empty)."
                    @if group > 1 { " Each column sums " (group) " consecutive runs." }
                };
                out.push(figure("runs_hist", a, svg, caption));
            }
        }
    }
    let points = |p: &Pooled| -> Vec<(f64, f64)> { p.values.iter().enumerate().map(|(i, &y)| ((i * p.step) as f64, y as f64)).collect() };
    if let Some(c) = &d.chan_maxabs {
        if let Some(svg) = plot::lines("channel", "max|x|", &[points(&c.max), points(&c.mean)], true, c.outlier_line)? {
            let k = d.outlier_channels.as_ref().map_or(0, |o| o.len());
            let caption = html! {
                "Per-channel max|x| over all " (d.runs) " run(s), " (c.max.len) " channels: " (key(0)) " the largest over runs, " (key(1)) " the mean over runs, "
                (rule_key()) " " (OUTLIER_CHANNEL_RATIO) "x the median channel (" (k) " outlier channel(s) above it)."
                @if c.max.step > 1 { " Max-pooled: each point is the largest of " (c.max.step) " channels." }
            };
            out.push(figure("chan_maxabs", a, svg, caption));
        }
    }
    if let Some(p) = &d.pos_sumsq_mean {
        let gaps = p.values.iter().filter(|x| !x.is_finite()).count();
        if let Some(svg) = plot::lines("row", "sum x²", &[points(p)], true, None)? {
            let caption = html! {
                "Per-row energy (sum of x² over a row), mean over the runs that recorded the row (of " (d.runs - d.runs_other_rows) " run(s) whose rows are these tokens), " (p.len) " rows of " (d.shape) "."
                @if d.runs_other_rows > 0 { " The " (d.runs_other_rows) " run(s) whose rows are other tokens (another sequence length, a decoder's decode steps) are left out." }
                @if gaps > 0 { " Rows recorded in no run (padding) are gaps (" (gaps) " point(s))." }
                @if p.step > 1 { " Max-pooled: each point is the largest of " (p.step) " rows." }
            };
            out.push(figure("pos_sumsq", a, svg, caption));
        }
    }
    for (name, caption, x, kind) in PROBE_VECTORS {
        let Some(v) = d.probes.get(name) else { continue };
        let svg = match kind {
            ProbeKind::Bars => plot::bars(x, name, v)?,
            ProbeKind::Rows => plot::lines(x, name, &[pool(v).0], false, None)?,
        };
        if let Some(svg) = svg {
            let weighting = if kind == ProbeKind::Bars && x == "head" { "over every non-padding query of all runs" } else { "over all runs" };
            let text = html! { (name) ": " (caption) ", per " (x) ", mean " (weighting) " (" (d.runs) ")." };
            out.push(figure(&format!("probe:{name}"), a, svg, text));
        }
    }
    if d.runs >= 2 && !d.runs_identical {
        // Each divided by its mean over runs: absmax and rms differ by orders of magnitude, and
        // a scale that drifts (the scale_drift rule's 1.5x) shows as a slope away from 1.
        let relative = |v: &[f64]| -> Vec<(f64, f64)> {
            let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
            let mean = finite.iter().sum::<f64>() / finite.len().max(1) as f64;
            v.iter().enumerate().map(|(i, &y)| (i as f64, if mean > 0.0 { y / mean } else { f64::NAN })).collect()
        };
        if let Some(svg) = plot::lines("run", "/ mean over runs", &[relative(&d.run_absmax), relative(&d.run_rms)], true, None)? {
            let caption = html! {
                "Per run, in (compile, step) order, each divided by its mean over runs: " (key(0)) " max|x|, " (key(1))
                " rms (1 = the mean; the table gives absmax and rms over all runs)."
            };
            out.push(figure("trend", a, svg, caption));
        }
    }
    Ok(out)
}

/// Verdicts grouped by (kind, rule, source), groups in order of their highest payoff.
fn verdict_groups(verdicts: &[Verdict]) -> Vec<((String, &'static str, &'static str), Vec<&Verdict>)> {
    let mut groups: Vec<((String, &'static str, &'static str), Vec<&Verdict>)> = Vec::new();
    for v in verdicts {
        let key = (v.kind.to_string(), v.rule, v.source);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(v),
            None => groups.push((key, vec![v])),
        }
    }
    groups
}

/// The report as one self-contained HTML document (no network, no executable script).
///
/// Errors: a plot cannot be drawn, or the embedded data cannot be encoded.
pub fn render(input: &Input<'_>) -> Result<String, Error> {
    Ok(render_with_overview(input)?.0)
}

/// [`render`], and the overview the page opens on (what `opscope report --json` writes).
///
/// Errors: those of [`render`].
pub fn render_with_overview(input: &Input<'_>) -> Result<(String, Overview), Error> {
    let ordered = execution_order(input.series, input.manifests);
    let names: Vec<&str> = ordered.iter().map(|(k, _)| k.0.as_str()).collect();
    let prefix = crate::summary::common_prefix(&names);
    let short = |site: &str| -> String { site.strip_prefix(prefix).unwrap_or(site).to_string() };
    // A pass index is shown only where one site and role was tapped by several passes.
    let passes: BTreeMap<(&str, &str), BTreeSet<u32>> = ordered.iter().fold(BTreeMap::new(), |mut m, (k, _)| {
        m.entry((k.0.as_str(), k.1.as_str())).or_insert_with(BTreeSet::new).insert(k.2);
        m
    });
    let label = |k: &SeriesKey| -> String {
        match passes.get(&(k.0.as_str(), k.1.as_str())) {
            Some(p) if p.len() > 1 => format!("{} [pass {}]", short(&k.0), k.2),
            _ => short(&k.0),
        }
    };
    let data: Vec<SeriesData> = ordered.iter().enumerate().map(|(i, (k, s))| summarize(k, s, i, &short(&k.0))).collect();
    let anchor: BTreeMap<&SeriesKey, &str> = ordered.iter().zip(&data).map(|((k, _), d)| (*k, d.anchor.as_str())).collect();

    // Header: runs and compiles from the rows, graphs and pipelines from the manifests.
    let runs: BTreeSet<(u32, u64)> = input.series.values().flat_map(|s| s.runs.iter().map(|r| (r.compile, r.step))).collect();
    let compiles: BTreeSet<u32> = runs.iter().map(|r| r.0).collect();
    let runs_in = |c: u32| runs.iter().filter(|r| r.0 == c).count();
    let compile_of = |m: &Manifest| if m.compile == 0 { m.tag } else { m.compile };
    let pipelines: BTreeSet<&str> = input.manifests.iter().map(|m| m.pipeline.as_str()).collect();
    let padding: BTreeSet<&str> = input.manifests.iter().filter_map(|m| m.padding.as_deref()).collect();
    let by_site: BTreeMap<&SeriesKey, Vec<&Verdict>> = input.verdicts.iter().fold(BTreeMap::new(), |mut m, v| {
        if let Some((k, _)) = input.series.get_key_value(&(v.site.clone(), v.role.clone(), v.pass_idx)) {
            m.entry(k).or_insert_with(Vec::new).push(v);
        }
        m
    });
    let mut groups = verdict_groups(input.verdicts);
    // Within a kind: by payoff, then in execution order.
    let rank: BTreeMap<&SeriesKey, usize> = ordered.iter().enumerate().map(|(i, (k, _))| (*k, i)).collect();
    let rank_of = |v: &Verdict| rank.get(&(v.site.clone(), v.role.clone(), v.pass_idx)).copied().unwrap_or(usize::MAX);
    for g in &mut groups {
        g.1.sort_by(|a, b| b.payoff.total_cmp(&a.payoff).then(rank_of(a).cmp(&rank_of(b))));
    }

    let mut sections: Vec<Markup> = Vec::new();
    for ((k, s), d) in ordered.iter().zip(&data) {
        let figures = plots(d)?;
        let here = by_site.get(k).cloned().unwrap_or_default();
        sections.push(html! {
            section.site id=(d.anchor) {
                h3 { (label(k)) " · " (k.1) }
                p.meta {
                    span.full { (k.0) } " · " (s.op) " " (s.shape) " · " (s.runs.len()) " run(s)"
                    @if d.runs_identical { " (identical: no per-run plots)" }
                    @if let Some(f) = s.flops { " · " (evidence_value(f as f64)) " FLOPs per run" }
                    " · " a href="#sites" { "back to the table" }
                }
                @if !here.is_empty() {
                    ul.verdicts {
                        @for v in &here {
                            li {
                                b { (v.kind.to_string()) } " "
                                @for (k, x) in &v.evidence { (k) "=" (evidence_value(*x)) " " }
                                span.rule { "— " (v.rule) }
                            }
                        }
                    }
                }
                @if figures.is_empty() { p.meta { "Nothing to plot: no histogram, channel, row or per-head statistic was recorded." } }
                div.plots { @for f in &figures { (f) } }
            }
        });
    }

    let ov = overview::build(&OverviewInput { ordered: &ordered, data: &data, prefix, verdicts: input.verdicts, cost: input.cost, time: input.time });
    let overview_html = front::html(&ov)?;
    let json = serde_json::to_string(&Embedded { runs: runs.len(), compiles: compiles.len(), prefix, overview: &ov, series: &data })
        .map_err(|e| Error::Internal(format!("report data: {e}")))?
        // Inside <script>, '<' could close the element: escape it (and '>' '&') as JSON does.
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");

    let doc = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="generator" content="opscope";
                title { (input.title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    h1 { (input.title) }
                    dl.facts {
                        dt { "graph" } dd {
                            @if input.manifests.is_empty() { "unknown: the recording has no manifest sidecar (<recording>.manifest.json)" }
                            @for (i, m) in input.manifests.iter().enumerate() {
                                @if i > 0 { ", " }
                                code { (m.graph) } " (compile " (compile_of(m)) ", " (runs_in(compile_of(m))) " run(s), " (m.sites.len()) " sites)"
                            }
                        }
                        dt { "pipeline" } dd {
                            @if pipelines.is_empty() { "unknown" }
                            @for (i, p) in pipelines.iter().enumerate() { @if i > 0 { ", " } code { (p) } }
                        }
                        dt { "runs" } dd { (runs.len()) " run(s) (executions) in " (compiles.len()) " compile(s); every table and plot summarises all of them" }
                        @if !padding.is_empty() { dt { "padding" } dd { @for p in &padding { (p) " " } } }
                        dt { "series" } dd { (data.len()) " site/role(s)" @if !prefix.is_empty() { " under " code { (prefix) } } }
                        dt { "verdicts" } dd { (input.verdicts.len()) " in " (groups.len()) " kind(s)" }
                    }
                }
                (overview_html)
                nav {
                    h2 { "Contents" }
                    ol {
                        li { a href="#overview" { "Overview" } }
                        li { a href="#sites" { "Sites in execution order" } }
                        li { a href="#verdicts" { "Verdicts" } " (" (input.verdicts.len()) ")"
                            ol { @for ((kind, ..), vs) in &groups { li { a href={ "#v-" (kind) } { (kind) } " (" (vs.len()) ")" } } }
                        }
                        li { a href="#notes" { "Notes" } }
                        li { a href="#plots" { "Plots per site and role" } }
                    }
                }
                section #sites {
                    h2 { "Sites in execution order" }
                    p.meta {
                        "Over all " (runs.len()) " run(s). absmax: max |x|; rms: sqrt(Σ sum x² / Σ count); kurtosis: median of the per-run values (3 for a Gaussian); "
                        "outlier channels: channels whose max|x| over all runs exceeds " (OUTLIER_CHANNEL_RATIO) "x the median channel's (the channel_outliers rule's line; LLM.int8(), SmoothQuant), first indices shown; "
                        "NaN/Inf: non-finite elements. - : not recorded. Names under " code { (if prefix.is_empty() { "/" } else { prefix }) } "."
                    }
                    table.sites {
                        thead { tr { th { "#" } th { "site" } th { "role" } th { "op" } th { "shape" } th { "runs" } th { "absmax" } th { "rms" } th { "kurtosis" } th { "outlier ch." } th { "NaN/Inf" } th { "verdicts" } } }
                        tbody {
                            @for (i, ((k, s), d)) in ordered.iter().zip(&data).enumerate() {
                                tr data-series=(d.anchor) {
                                    td.num { (i) }
                                    td.site { a href={ "#" (d.anchor) } { (label(k)) } }
                                    td { (k.1) }
                                    td { (s.op) }
                                    td.mono { (s.shape) }
                                    td.num { (d.runs) }
                                    td.num { (opt(d.absmax)) }
                                    td.num { (opt(d.rms)) }
                                    td.num { (opt(d.kurtosis)) }
                                    td.num {
                                        @match (&d.outlier_channels, d.channels) {
                                            (Some(o), Some(c)) => {
                                                span class=(if o.is_empty() { "" } else { "hot" }) { (o.len()) " / " (c) }
                                                @if !o.is_empty() {
                                                    " " span.idx { "(" (o.iter().take(4).map(|x| x.to_string()).collect::<Vec<_>>().join(", ")) @if o.len() > 4 { ", …" } ")" }
                                                }
                                            }
                                            _ => { "-" }
                                        }
                                    }
                                    td.num { @match d.nonfinite { Some(x) if x > 0.0 => { span.hot { (evidence_value(x)) } } Some(x) => { (evidence_value(x)) } None => { "-" } } }
                                    td { @for (j, v) in by_site.get(k).cloned().unwrap_or_default().iter().enumerate() { @if j > 0 { ", " } (v.kind.to_string()) } }
                                }
                            }
                        }
                    }
                }
                section #verdicts {
                    h2 { "Verdicts" }
                    @if input.verdicts.is_empty() { p { "No verdict: nothing in these sketches justifies a specialized kernel." } }
                    p.meta { "Grouped by kind, kinds by their highest payoff (share of the recorded FLOPs times the fraction of the site's cost the kernel could remove)." }
                    @for ((kind, rule, source), vs) in &groups {
                        div.kind id={ "v-" (kind) } {
                            h3 { (kind) " (" (vs.len()) ")" }
                            p.rule { b { "rule: " } (rule) br; b { "source: " } (source) }
                            table {
                                thead { tr { th { "payoff" } th { "site" } th { "role" } th { "evidence" } } }
                                tbody {
                                    @for v in vs {
                                        @let key = (v.site.clone(), v.role.clone(), v.pass_idx);
                                        tr {
                                            td.num { (format!("{:.4}", v.payoff)) }
                                            td.site {
                                                @match anchor.get(&key) {
                                                    Some(a) => { a href={ "#" (a) } { (label(&key)) } }
                                                    None => { (v.site) }
                                                }
                                            }
                                            td { (v.role) }
                                            td { @for (k, x) in &v.evidence { (k) "=" (evidence_value(*x)) " " } }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                section #notes {
                    h2 { "Notes" }
                    @for n in input.notes { p.note { (n) } }
                }
                section #plots {
                    h2 { "Plots per site and role" }
                    @for s in &sections { (s) }
                }
                script type="application/json" id="opscope-data" { (PreEscaped(json)) }
            }
        }
    };
    Ok((doc.into_string(), ov))
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#222;max-width:1400px}\
h1{font-size:22px;margin-bottom:6px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ccc}h3{font-size:15px;margin:14px 0 4px}\
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px;font-size:13px;margin:8px 0}dl.facts dt{font-weight:bold;color:#555}dl.facts dd{margin:0}\
nav ol{font-size:13px;margin:4px 0}nav ol ol{columns:3;margin-left:8px}\
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}th{background:#f3f3f3}\
td.num{text-align:right;font-variant-numeric:tabular-nums}td.site,td.mono,code,span.full{font-family:monospace}span.full{color:#555}\
span.hot{color:#b00;font-weight:bold}span.idx{color:#777}\
p.rule{font-size:12px;color:#333;margin:2px 0 6px;max-width:1100px}\
section.site{border-top:1px solid #ddd;margin-top:18px}p.meta{color:#555;font-size:12px;max-width:1100px}ul.verdicts{font-size:12px;margin:4px 0}span.rule{color:#666}\
div.plots{display:flex;flex-wrap:wrap;gap:10px}figure.plot{margin:0;width:430px}figure.plot svg{display:block}\
figcaption{font-size:11px;color:#444;margin-top:2px}\
section#overview h3{font-size:16px;margin:18px 0 4px}div.row{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}div.col{flex:0 1 auto;min-width:0;max-width:100%;overflow-x:auto}\
p.source{font-size:13px;background:#f7f7f2;border:1px solid #ddd;padding:6px 10px;max-width:1300px}\
td.share{position:relative;min-width:64px;text-align:right;font-variant-numeric:tabular-nums}td.share span.bar{position:absolute;left:0;top:2px;bottom:2px;background:#cfe0f0}td.share span.v{position:relative}\
span.mem{color:#c05a00}span.cmp{color:#1f5f9f}tr.rest td{color:#666}figure.roofline{width:620px}td.kernels{max-width:460px}span.none{color:#999}span.kernel.zero,span.kernel.zero a{color:#999}p.headline{font-size:14px;margin:8px 0}td.mono,table.gemm td,table.top td.num{white-space:nowrap}span.dot{display:inline-block;width:9px;height:9px;border-radius:50%;vertical-align:middle;margin:0 2px}\
div.heat h4{font-size:13px;margin:10px 0 3px}span.cap{font-weight:normal;color:#555;font-size:12px}\
table.heat{font-size:11px}table.heat td{text-align:center;min-width:40px;padding:2px 3px;font-variant-numeric:tabular-nums}table.heat td a{color:inherit;text-decoration:none}\
table.heat th.col{font-weight:normal;font-size:11px;max-width:140px}table.heat th.role{font-weight:normal;color:#555}table.heat th.row{text-align:left;white-space:nowrap}table.heat td.none{background:#fafafa}\
span.key{display:inline-block;width:14px;height:3px;vertical-align:middle;margin:0 2px}span.key.rule{border-top:2px dashed #787878;height:0}p.note{color:#555;font-size:12px}";
