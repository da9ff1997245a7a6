//! The overview the report opens on: where the time goes (per op kind and top sites, with FLOPs,
//! bytes, arithmetic intensity and roofline class from `opscope cost`), the roofline points, the
//! GEMM-shape histogram, a per-layer heatmap of key statistics of the recording, and one row per
//! recorded site with the kernels its data supports and their payoff. Built from the recording,
//! its verdicts, an optional cost report ([`CostView`]) and optional measured time shares
//! ([`TimeShares`]); serialised as the `--json` of `opscope report` and embedded in the page.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use opscope::mine::{median, Series, SeriesKey, Verdict};
use opscope::sketch::tensor;

use super::data::SeriesData;

/// Bytes moved by tensor class, as `opscope cost --json` writes them.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct BytesView {
    /// Weights read.
    pub weights: u64,
    /// Graph inputs read.
    pub inputs: u64,
    /// Graph outputs written.
    pub outputs: u64,
    /// Intermediate activations read and written.
    pub activations: u64,
}

impl BytesView {
    /// All bytes moved.
    pub fn total(&self) -> u64 {
        self.weights + self.inputs + self.outputs + self.activations
    }
}

/// The two roofs and the ridge point (`opscope cost`'s `machine`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Roofs {
    /// Peak FLOP/s (measured with a large GEMM).
    pub peak_flops: f64,
    /// Memory bandwidth, bytes/s (measured with streaming kernels).
    pub bandwidth: f64,
}

#[derive(Debug, Clone, Deserialize)]
struct MachineView {
    machine: Roofs,
    ridge: f64,
    /// The bandwidth-by-working-set curve (absent in cost files written before it).
    #[serde(default)]
    curve: Vec<CurvePointView>,
}

#[derive(Debug, Clone, Deserialize)]
struct CurvePointView {
    bandwidth: f64,
}

/// One op kind of the cost report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KindCost {
    /// Op kind as RLX prints it.
    pub op: String,
    /// Nodes of this kind.
    pub count: usize,
    /// FLOPs of one forward pass.
    pub flops: u64,
    /// Some node of this kind has FLOPs the cost model does not know.
    pub flops_unknown: bool,
    /// Bytes moved in one forward pass.
    pub bytes: BytesView,
    /// FLOP/byte.
    pub intensity: Option<f64>,
    /// `compute` or `memory` against the measured ridge point.
    pub bound: Option<String>,
    /// Roofline time lower bound, seconds.
    pub min_seconds: f64,
}

/// One node of the deployed graph, costed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SiteCost {
    /// Node id in the deployed graph.
    pub node: u32,
    /// Site name (RLX's merged Q/K/V projection: the three names joined with `+`).
    pub site: String,
    /// Op kind.
    pub op: String,
    /// Output shape.
    pub shape: Vec<usize>,
    /// FLOPs of one execution, `None` when not modelled.
    pub flops: Option<u64>,
    /// Bytes moved by one execution.
    pub bytes: BytesView,
    /// FLOP/byte.
    pub intensity: Option<f64>,
    /// `compute` or `memory`.
    pub bound: Option<String>,
    /// Roofline time lower bound, seconds.
    pub min_seconds: f64,
}

/// A GEMM shape `batch x [M,K] x [K,N]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GemmShapeView {
    /// Rows.
    pub m: u64,
    /// Reduction length.
    pub k: u64,
    /// Columns.
    pub n: u64,
    /// Independent products.
    pub batch: u64,
    /// Dtype of the right operand.
    pub dtype: String,
    /// The right operand is a weight.
    pub weight: bool,
}

/// One bin of the GEMM-shape histogram.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShapeBinView {
    /// The shape.
    pub shape: GemmShapeView,
    /// GEMMs of this shape per forward pass.
    pub count: usize,
    /// Their FLOPs.
    pub flops: u64,
    /// Share of the GEMM FLOPs (0..1).
    pub share: f64,
}

#[derive(Debug, Clone, Deserialize)]
struct TotalsView {
    flops: u64,
    bytes: BytesView,
}

/// What the overview reads of an `opscope cost --json` report (other fields are ignored), the
/// same whether the report computed it ([`CostView::from_report`]) or read it from a file.
#[derive(Debug, Clone, Deserialize)]
pub struct CostView {
    /// Costed graph (the importer names it `<model>_b<batch>_s<seq>`).
    pub graph: String,
    machine: MachineView,
    totals: TotalsView,
    min_seconds: f64,
    by_kind: Vec<KindCost>,
    top_sites: Vec<SiteCost>,
    sites: Vec<SiteCost>,
    gemm_shapes: Vec<ShapeBinView>,
}

impl CostView {
    /// Read `opscope cost --json` output.
    ///
    /// Errors: not JSON, or a field is missing (a file from before per-site costs: rerun
    /// `opscope cost --json`).
    pub fn from_json(bytes: &[u8]) -> Result<CostView, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not an `opscope cost --json` report ({e}); write one with `opscope cost ... --json FILE`"))
    }

    /// The view of a cost report computed in this process.
    pub fn from_report(r: &crate::cost::CostReport) -> Result<CostView, String> {
        let v = serde_json::to_vec(r).map_err(|e| format!("encoding the cost report: {e}"))?;
        CostView::from_json(&v)
    }
}

/// Where the cost came from.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CostSource {
    /// Computed by `opscope report` from the model (`--onnx`), roofs probed in that process.
    Computed {
        /// The ONNX model.
        onnx: String,
    },
    /// Read from an `opscope cost --json` file (`--cost`).
    File {
        /// The file.
        path: String,
    },
}

/// Measured per-site time shares (share of one forward pass's time, 0..1), by recording site
/// name. The overview uses them for its share column and the payoff when given; else the
/// column is the FLOP share and says so.
#[derive(Debug, Clone, Serialize)]
pub struct TimeShares {
    /// How they were measured (shown next to the column).
    pub method: String,
    /// Share per site.
    pub sites: BTreeMap<String, f64>,
}

/// What the share column (and the payoff) is weighted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShareBasis {
    /// Measured time shares ([`TimeShares`]).
    MeasuredTime,
    /// FLOPs of the forward pass (the cost report's total).
    ForwardFlops,
    /// FLOPs of the recorded sites only (no cost input).
    RecordedFlops,
}

impl ShareBasis {
    /// The column heading.
    pub fn label(self) -> &'static str {
        match self {
            ShareBasis::MeasuredTime => "time share (measured)",
            ShareBasis::ForwardFlops => "FLOP share (no measured time)",
            ShareBasis::RecordedFlops => "FLOP share of recorded sites (no cost, no measured time)",
        }
    }
}

/// One op kind in "where the time goes".
#[derive(Debug, Clone, Serialize)]
pub struct KindRow {
    /// The op kind, with its cost (FLOPs and bytes of one forward pass).
    #[serde(flatten)]
    pub cost: KindCost,
    /// Share of the forward pass's FLOPs (0..1).
    pub flop_share: f64,
    /// Share of the forward pass's roofline time bound (0..1).
    pub bound_share: f64,
}

/// One point of the roofline plot: a costed site at its intensity, on the roof.
#[derive(Debug, Clone, Serialize)]
pub struct RooflinePoint {
    /// Site name in the deployed graph.
    pub site: String,
    /// Op kind.
    pub op: String,
    /// FLOPs of one execution.
    pub flops: u64,
    /// Bytes moved by one execution.
    pub bytes: u64,
    /// `flops / bytes`, FLOP/byte.
    pub intensity: f64,
    /// Attainable FLOP/s at that intensity: `min(peak, intensity x bandwidth)`.
    pub attainable: f64,
    /// `compute` or `memory`.
    pub bound: String,
    /// Share of the forward pass's roofline time bound (0..1; the marker's area).
    pub bound_share: f64,
}

/// The roofline: roofs, ridge point and one point per costed site with FLOPs and bytes.
#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    /// Measured roofs.
    pub roofs: Roofs,
    /// Ridge point, FLOP/byte.
    pub ridge: f64,
    /// Points, in graph order.
    pub points: Vec<RooflinePoint>,
    /// Sites with 0 FLOPs (data movement) or unknown FLOPs, not drawn on the log axes.
    pub not_drawn: usize,
    /// The fastest point of the bandwidth-by-working-set curve (bytes/s): the roof of a
    /// cache-resident op (hierarchical roofline); `None` without a curve.
    pub cache_bandwidth: Option<f64>,
}

/// A recorded site's share of a costed node: the node, divided among the logical sites RLX
/// merged into it (`parts`: 3 for a Q/K/V projection, whose three GEMMs have the same shape).
#[derive(Debug, Clone, Serialize)]
pub struct SiteCostShare {
    /// The costed node's site name.
    pub node_site: String,
    /// Logical sites sharing the node.
    pub parts: usize,
    /// FLOPs of one execution of this site (`node / parts`).
    pub flops: Option<f64>,
    /// Bytes moved (`node / parts`).
    pub bytes: f64,
    /// FLOP/byte of the node.
    pub intensity: Option<f64>,
    /// `compute` or `memory`.
    pub bound: Option<String>,
    /// Roofline time bound (`node / parts`), seconds.
    pub min_seconds: f64,
}

/// One kernel a site's data supports: the verdicts of one kind at the site (over its roles),
/// with the payoff in the overview's basis.
#[derive(Debug, Clone, Serialize)]
pub struct Kernel {
    /// Verdict kind (`per_channel_int8`, `sparse_gemm`).
    pub kind: String,
    /// Roles of the tensors it was found on, in the order of their payoff.
    pub roles: Vec<String>,
    /// The largest over roles of: share (in [`Overview::share_basis`]) times the fraction of
    /// the site's cost the kernel could remove ([`opscope::mine::payoff_fraction`]); the miner's
    /// payoff rescaled from the recorded FLOP share to the overview's share.
    pub payoff: f64,
}

/// A kernel over every site whose data supports it.
#[derive(Debug, Clone, Serialize)]
pub struct KernelTotal {
    /// Verdict kind.
    pub kind: String,
    /// Sites.
    pub sites: usize,
    /// Sum over those sites of the kind's payoff there (sites are disjoint, so payoffs add).
    pub payoff: f64,
}

/// One recorded site (all its roles and passes), in execution order.
#[derive(Debug, Clone, Serialize)]
pub struct SiteRow {
    /// Site name (full).
    pub site: String,
    /// Without the recording's common prefix.
    pub short: String,
    /// Anchor of the site's first series section (the drill-down).
    pub anchor: String,
    /// Op at the site.
    pub op: String,
    /// Output shape (the `out` role's, else the first series').
    pub shape: String,
    /// Layer index parsed from the name ([`layer_of`]).
    pub layer: Option<usize>,
    /// Recorded FLOPs of one execution.
    pub flops: Option<u64>,
    /// Share of the recorded sites' FLOPs over all runs (0..1; the miner's payoff weight).
    pub recorded_flop_share: f64,
    /// The site's part of a costed node, when a cost is given and names it.
    pub cost: Option<SiteCostShare>,
    /// The share in [`Overview::share_basis`] (0..1).
    pub share: f64,
    /// Kernels the data supports, highest payoff first.
    pub kernels: Vec<Kernel>,
    /// The highest payoff (kernels are alternatives: payoffs do not add).
    pub payoff: f64,
}

/// One heatmap cell: the key statistics of one series, over all runs.
#[derive(Debug, Clone, Serialize)]
pub struct HeatCell {
    /// Row: layer label (`layer.0`; `no layer` for sites outside the layers).
    pub row: String,
    /// Column: the site name without the prefix and layer (`attention/self/query/MatMul`).
    pub column: String,
    /// Role.
    pub role: String,
    /// Site name (full).
    pub site: String,
    /// Anchor of the series' section.
    pub anchor: String,
    /// max |x| over all runs.
    pub absmax: Option<f64>,
    /// Median over runs of the per-run kurtosis.
    pub kurtosis: Option<f64>,
    /// Outlier channels of the per-channel max|x| over all runs (above
    /// [`opscope::mine::OUTLIER_CHANNEL_RATIO`] x the median channel).
    pub outlier_channels: Option<usize>,
    /// Median over runs of nnz / count (the miner's density).
    pub density: Option<f64>,
}

/// The per-layer heatmap: rows (layers, ascending, then `no layer`), columns (site kinds in
/// execution order) with the roles seen per column, and the cells.
#[derive(Debug, Clone, Serialize)]
pub struct Heatmap {
    /// Row labels.
    pub rows: Vec<String>,
    /// Column labels and their roles.
    pub columns: Vec<(String, Vec<String>)>,
    /// Cells (one per series; several passes of one site and role: the first).
    pub cells: Vec<HeatCell>,
}

/// The overview, as `opscope report --json` writes it.
#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    /// Where the cost came from; `None`: no cost given (FLOPs are the recorded sites').
    pub cost_source: Option<CostSource>,
    /// The costed graph.
    pub cost_graph: Option<String>,
    /// What the share column is.
    pub share_basis: ShareBasis,
    /// How time shares were measured, when given.
    pub time_method: Option<String>,
    /// FLOPs of one forward pass (cost), or of one execution of every recorded site.
    pub total_flops: f64,
    /// Bytes of one forward pass (cost).
    pub total_bytes: Option<u64>,
    /// Roofline time bound of one forward pass, seconds (cost).
    pub min_seconds: Option<f64>,
    /// Per op kind, by FLOPs (cost; empty without).
    pub by_kind: Vec<KindRow>,
    /// The sites with the largest roofline time bound (cost; at most [`TOP_SITES`]).
    pub top_sites: Vec<SiteCost>,
    /// The roofline (cost).
    pub roofline: Option<Roofline>,
    /// The GEMM-shape histogram (cost; empty without).
    pub gemm_shapes: Vec<ShapeBinView>,
    /// Per-layer heatmap of the recording's key statistics.
    pub heatmap: Heatmap,
    /// Kernels by their payoff summed over sites, largest first.
    pub kernels: Vec<KernelTotal>,
    /// One row per recorded site, in execution order.
    pub sites: Vec<SiteRow>,
}

/// Sites listed in "top sites".
pub const TOP_SITES: usize = 10;

/// Path components that name a layer when followed by an index: `layer.3` (BERT), `layers.3`
/// (Llama), `h.3` (GPT-2), `blk.3` (GGUF), `block.3` / `blocks.3`.
pub const LAYER_WORDS: [&str; 6] = ["layer", "layers", "h", "blk", "block", "blocks"];

/// The layer index of a site name and the name without it: the first `word.N` or `word_N`
/// (`word` in [`LAYER_WORDS`], as a whole component between `/` or `.`) is taken out with one
/// adjacent separator. `layer.0/attention/self/query/MatMul` gives
/// `(0, "attention/self/query/MatMul")`; `blk.2.attn_q` gives `(2, "attn_q")`. `None` when the
/// name has none.
pub fn layer_of(name: &str) -> Option<(usize, String)> {
    let is_sep = |c: char| c == '/' || c == '.';
    let mut start = 0;
    let bytes: Vec<(usize, char)> = name.char_indices().collect();
    let mut i = 0;
    while i <= bytes.len() {
        let at_end = i == bytes.len();
        if at_end || is_sep(bytes[i].1) {
            let end = if at_end { name.len() } else { bytes[i].0 };
            let word = &name[start..end];
            if LAYER_WORDS.contains(&word) && !at_end {
                // The index: digits up to the next separator (or the end).
                let rest = &name[end + 1..];
                let len = rest.find(is_sep).unwrap_or(rest.len());
                let digits = &rest[..len];
                if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                    let n: usize = digits.parse().ok()?;
                    let stop = end + 1 + len;
                    let (before, after) = (&name[..start], &name[stop..]);
                    let rest = if after.is_empty() { before.trim_end_matches(is_sep).to_string() } else { format!("{before}{}", &after[1..]) };
                    return Some((n, rest));
                }
            }
            start = end + 1;
        }
        i += 1;
    }
    None
}

/// Everything the overview is built from.
pub struct OverviewInput<'a> {
    /// Series in execution order, with their summaries.
    pub ordered: &'a [(&'a SeriesKey, &'a Series)],
    /// The summaries, in the same order.
    pub data: &'a [SeriesData],
    /// The recording's common site prefix.
    pub prefix: &'a str,
    /// Verdicts.
    pub verdicts: &'a [Verdict],
    /// The cost and where it came from.
    pub cost: Option<(&'a CostView, &'a CostSource)>,
    /// Measured time shares.
    pub time: Option<&'a TimeShares>,
}

fn density(s: &Series) -> Option<f64> {
    median(
        s.runs
            .iter()
            .filter_map(|r| {
                let c = r.scalar(tensor::COUNT)?;
                (c > 0.0).then(|| Some(r.scalar(tensor::NNZ)? / c)).flatten()
            })
            .collect(),
    )
}

/// Build the overview.
pub fn build(input: &OverviewInput<'_>) -> Overview {
    let short = |site: &str| site.strip_prefix(input.prefix).unwrap_or(site).to_string();
    // Sites in execution order (first series of each), their series.
    let mut order: Vec<&str> = Vec::new();
    let mut of_site: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, (k, _)) in input.ordered.iter().enumerate() {
        let e = of_site.entry(k.0.as_str()).or_default();
        if e.is_empty() {
            order.push(k.0.as_str());
        }
        e.push(i);
    }
    // Recorded FLOPs over all runs per site (roles share them), as the miner weighs payoffs.
    let recorded: BTreeMap<&str, f64> = order
        .iter()
        .map(|site| {
            let f = of_site[site].iter().map(|&i| input.ordered[i].1).map(|s| s.flops.unwrap_or(0) as f64 * s.runs.len().max(1) as f64).fold(0.0, f64::max);
            (*site, f)
        })
        .collect();
    let recorded_total = recorded.values().sum::<f64>();
    // Cost per recorded site: an exact name, or one part of a merged node `a+b+c`.
    let cost_of: BTreeMap<&str, SiteCostShare> = match input.cost {
        Some((c, _)) => {
            let mut m = BTreeMap::new();
            for n in &c.sites {
                let parts: Vec<&str> = n.site.split('+').collect();
                for p in &parts {
                    if let Some(site) = order.iter().find(|s| **s == *p) {
                        let k = parts.len() as f64;
                        m.entry(*site).or_insert(SiteCostShare {
                            node_site: n.site.clone(),
                            parts: parts.len(),
                            flops: n.flops.map(|f| f as f64 / k),
                            bytes: n.bytes.total() as f64 / k,
                            intensity: n.intensity,
                            bound: n.bound.clone(),
                            min_seconds: n.min_seconds / k,
                        });
                    }
                }
            }
            m
        }
        None => BTreeMap::new(),
    };
    let basis = match (input.time, input.cost) {
        (Some(_), _) => ShareBasis::MeasuredTime,
        (None, Some(_)) => ShareBasis::ForwardFlops,
        (None, None) => ShareBasis::RecordedFlops,
    };
    let forward_flops = input.cost.map(|(c, _)| c.totals.flops as f64);
    let share_of = |site: &str| -> f64 {
        match basis {
            ShareBasis::MeasuredTime => input.time.and_then(|t| t.sites.get(site)).copied().unwrap_or(0.0),
            ShareBasis::ForwardFlops => {
                cost_of.get(site).and_then(|c| c.flops).map_or(0.0, |f| f / forward_flops.unwrap_or(1.0).max(1.0))
            }
            ShareBasis::RecordedFlops => recorded[site] / recorded_total.max(1.0),
        }
    };
    let mut sites = Vec::new();
    for site in &order {
        let idx = &of_site[site];
        let (k0, s0) = input.ordered[idx[0]];
        let out = idx.iter().map(|&i| input.ordered[i]).find(|(k, _)| k.1 == "out").unwrap_or((k0, s0));
        let recorded_share = recorded[site] / recorded_total.max(1.0);
        let share = share_of(site);
        let mut found: Vec<(String, String, f64)> = input
            .verdicts
            .iter()
            .filter(|v| v.site == *site)
            .map(|v| (v.kind.to_string(), v.role.clone(), if recorded_share > 0.0 { v.payoff / recorded_share * share } else { 0.0 }))
            .collect();
        found.sort_by(|a, b| b.2.total_cmp(&a.2));
        let mut kernels: Vec<Kernel> = Vec::new();
        for (kind, role, payoff) in found {
            match kernels.iter_mut().find(|k| k.kind == kind) {
                Some(k) if !k.roles.contains(&role) => k.roles.push(role),
                Some(_) => {}
                None => kernels.push(Kernel { kind, roles: vec![role], payoff }),
            }
        }
        sites.push(SiteRow {
            site: site.to_string(),
            short: short(site),
            anchor: input.data[idx[0]].anchor.clone(),
            op: s0.op.clone(),
            shape: out.1.shape.clone(),
            layer: layer_of(&short(site)).map(|l| l.0),
            flops: s0.flops,
            recorded_flop_share: recorded_share,
            cost: cost_of.get(site).cloned(),
            share,
            payoff: kernels.first().map_or(0.0, |k| k.payoff),
            kernels,
        });
    }

    // Heatmap: rows by layer, columns by site kind in execution order, roles per column.
    let mut rows: Vec<Option<usize>> = Vec::new();
    let mut columns: Vec<(String, Vec<String>)> = Vec::new();
    let mut cells: Vec<HeatCell> = Vec::new();
    for ((k, s), d) in input.ordered.iter().zip(input.data) {
        let name = short(&k.0);
        let (layer, column) = match layer_of(&name) {
            Some((l, rest)) => (Some(l), rest),
            None => (None, name.clone()),
        };
        let row = layer.map_or("no layer".to_string(), |l| format!("layer {l}"));
        if cells.iter().any(|c| c.row == row && c.column == column && c.role == k.1) {
            continue;
        }
        if !rows.contains(&layer) {
            rows.push(layer);
        }
        match columns.iter_mut().find(|c| c.0 == column) {
            Some(c) if !c.1.contains(&k.1) => c.1.push(k.1.clone()),
            Some(_) => {}
            None => columns.push((column.clone(), vec![k.1.clone()])),
        }
        cells.push(HeatCell {
            row,
            column,
            role: k.1.clone(),
            site: k.0.clone(),
            anchor: d.anchor.clone(),
            absmax: d.absmax,
            kurtosis: d.kurtosis,
            outlier_channels: d.outlier_channels.as_ref().map(|o| o.len()),
            density: density(s),
        });
    }
    rows.sort_by_key(|l| l.unwrap_or(usize::MAX));
    let rows: Vec<String> = rows.iter().map(|l| l.map_or("no layer".to_string(), |l| format!("layer {l}"))).collect();

    let (mut by_kind, mut top_sites, mut roofline, mut gemm_shapes) = (Vec::new(), Vec::new(), None, Vec::new());
    let (mut total_bytes, mut min_seconds) = (None, None);
    if let Some((c, _)) = input.cost {
        let flops = (c.totals.flops as f64).max(1.0);
        let bound = c.min_seconds.max(f64::MIN_POSITIVE);
        by_kind = c
            .by_kind
            .iter()
            .map(|k| KindRow { flop_share: k.flops as f64 / flops, bound_share: k.min_seconds / bound, cost: k.clone() })
            .collect();
        top_sites = c.top_sites.iter().take(TOP_SITES).cloned().collect();
        let roofs = c.machine.machine;
        let mut points = Vec::new();
        let mut not_drawn = 0;
        for n in &c.sites {
            let b = n.bytes.total();
            match n.flops {
                Some(f) if f > 0 && b > 0 => {
                    let intensity = f as f64 / b as f64;
                    points.push(RooflinePoint {
                        site: n.site.clone(),
                        op: n.op.clone(),
                        flops: f,
                        bytes: b,
                        intensity,
                        attainable: roofs.peak_flops.min(intensity * roofs.bandwidth),
                        bound: if intensity >= c.machine.ridge { "compute" } else { "memory" }.to_string(),
                        bound_share: n.min_seconds / bound,
                    });
                }
                _ => not_drawn += 1,
            }
        }
        let cache_bandwidth = c.machine.curve.iter().map(|p| p.bandwidth).reduce(f64::max).filter(|&b| b > roofs.bandwidth);
        roofline = Some(Roofline { roofs, ridge: c.machine.ridge, points, not_drawn, cache_bandwidth });
        gemm_shapes = c.gemm_shapes.clone();
        total_bytes = Some(c.totals.bytes.total());
        min_seconds = Some(c.min_seconds);
    }
    Overview {
        cost_source: input.cost.map(|c| c.1.clone()),
        cost_graph: input.cost.map(|c| c.0.graph.clone()),
        share_basis: basis,
        time_method: input.time.map(|t| t.method.clone()),
        total_flops: forward_flops.unwrap_or_else(|| order.iter().map(|s| input.ordered[of_site[s][0]].1.flops.unwrap_or(0) as f64).sum()),
        total_bytes,
        min_seconds,
        by_kind,
        top_sites,
        roofline,
        gemm_shapes,
        heatmap: Heatmap { rows, columns, cells },
        kernels: {
            let mut t: Vec<KernelTotal> = Vec::new();
            for k in sites.iter().flat_map(|s| &s.kernels) {
                match t.iter_mut().find(|t| t.kind == k.kind) {
                    Some(t) => {
                        t.sites += 1;
                        t.payoff += k.payoff;
                    }
                    None => t.push(KernelTotal { kind: k.kind.clone(), sites: 1, payoff: k.payoff }),
                }
            }
            t.sort_by(|a, b| b.payoff.total_cmp(&a.payoff).then(a.kind.cmp(&b.kind)));
            t
        },
        sites,
    }
}

#[cfg(test)]
mod tests {
    use super::layer_of;

    #[test]
    fn layer_indices_come_out_of_names() {
        assert_eq!(layer_of("layer.0/attention/self/query/MatMul"), Some((0, "attention/self/query/MatMul".into())));
        assert_eq!(layer_of("encoder/layer.11/output/dense/MatMul"), Some((11, "encoder/output/dense/MatMul".into())));
        assert_eq!(layer_of("blk.2.attn_q"), Some((2, "attn_q".into())));
        assert_eq!(layer_of("model/layers.3"), Some((3, "model".into())));
        assert_eq!(layer_of("model/model.0/pooler/MatMul"), None);
        assert_eq!(layer_of("player.0/x"), None);
        assert_eq!(layer_of("layer.x/y"), None);
    }
}
