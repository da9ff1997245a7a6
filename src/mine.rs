//! The miner: from a recording to per-site verdicts with evidence, each rule's threshold and
//! its source, and an estimated payoff weighted by the site's share of the recorded FLOPs.
//!
//! Metrics are computed per run (step) from the sketches and summarized by their median over
//! runs; across-run verdicts need at least [`MIN_STEPS`] runs. Conventions: `P = sumsq / count`
//! (mean square), `absmax = max(|min|, |max|)`, SQNR estimates use the uniform quantizer noise
//! model `Δ²/12` (Widrow & Kollár, *Quantization Noise*, 2008) with symmetric scales
//! `Δ = absmax / (2^(b-1) - 1)` (127 for int8, 7 for int4).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Serialize;

use crate::error::Error;
use crate::sink::Row;
use crate::sketch::Stat;

/// Runs needed before across-run verdicts (stationary, drifting, exact repeat) are made.
pub const MIN_STEPS: usize = 4;

/// One run of one tensor: its statistics by [`Stat`].
#[derive(Debug, Clone)]
pub struct Run {
    /// Compile the run belongs to.
    pub compile: u32,
    /// Run index within the compile.
    pub step: u64,
    scalars: [f32; Stat::ALL.len()],
    vectors: Vec<(Stat, Vec<f32>)>,
}

impl Run {
    fn new(compile: u32, step: u64) -> Run {
        Run {
            compile,
            step,
            scalars: [f32::NAN; Stat::ALL.len()],
            vectors: Vec::new(),
        }
    }

    fn push(&mut self, stat: Stat, idx: usize, value: f32) {
        if idx == 0 {
            self.scalars[stat as usize] = value;
        }
        if stat.is_vector() {
            let v = match self.vectors.iter().position(|(s, _)| *s == stat) {
                Some(i) => &mut self.vectors[i].1,
                None => {
                    self.vectors.push((stat, Vec::new()));
                    &mut self.vectors.last_mut().expect("just pushed").1
                }
            };
            if v.len() <= idx {
                v.resize(idx + 1, f32::NAN);
            }
            v[idx] = value;
        }
    }

    /// A scalar statistic (the first value of a vector one), if recorded.
    pub fn scalar(&self, stat: Stat) -> Option<f64> {
        let v = self.scalars[stat as usize];
        (!v.is_nan()).then_some(v as f64)
    }

    /// A vector statistic (`hist`, `elemsig`, `chan_maxabs`, `pos_sumsq`, the per-head and
    /// per-expert probe statistics), if recorded.
    pub fn vector(&self, stat: Stat) -> Option<&[f32]> {
        self.vectors.iter().find(|(s, _)| *s == stat).map(|(_, v)| v.as_slice())
    }
}

/// What one (site, role, pass) looked like over a recording.
#[derive(Debug, Clone, Default)]
pub struct Series {
    /// Op at the site.
    pub op: String,
    /// Tensor shape (`[64,256]`).
    pub shape: String,
    /// FLOPs of one execution of the site.
    pub flops: Option<u64>,
    /// Runs in (compile, step) order.
    pub runs: Vec<Run>,
}

/// Key of a series: site, role, pass index.
pub type SeriesKey = (String, String, u32);

/// One row's fields, borrowed.
struct Cells<'a> {
    site: &'a str,
    role: &'a str,
    pass: u32,
    op: &'a str,
    shape: &'a str,
    flops: Option<u64>,
    compile: u32,
    step: u64,
    stat: Stat,
    idx: u64,
    value: f32,
}

/// Builds series from rows arriving in recording order (the rows of one run of one tensor
/// are contiguous, so the maps are consulted once per group, not once per row).
#[derive(Default)]
struct Builder {
    series: Vec<(SeriesKey, Series, std::collections::HashMap<(u32, u64), usize>)>,
    index: std::collections::HashMap<SeriesKey, usize>,
    /// (series, run) of the current group, and the fields that identify it.
    last: Option<((usize, usize), (String, String, u32, u32, u64))>,
}

impl Builder {
    /// The (series, run) a row belongs to, created if new.
    fn group(&mut self, c: &Cells<'_>) -> (usize, usize) {
        let key: SeriesKey = (c.site.to_string(), c.role.to_string(), c.pass);
        let si = match self.index.get(&key) {
            Some(&i) => i,
            None => {
                self.series.push((
                    key.clone(),
                    Series {
                        op: c.op.to_string(),
                        shape: c.shape.to_string(),
                        flops: c.flops,
                        runs: Vec::new(),
                    },
                    Default::default(),
                ));
                self.index.insert(key, self.series.len() - 1);
                self.series.len() - 1
            }
        };
        let (_, s, runs) = &mut self.series[si];
        let ri = *runs.entry((c.compile, c.step)).or_insert_with(|| {
            s.runs.push(Run::new(c.compile, c.step));
            s.runs.len() - 1
        });
        (si, ri)
    }

    fn add(&mut self, (si, ri): (usize, usize), stat: Stat, idx: u64, value: f32) {
        self.series[si].1.runs[ri].push(stat, idx as usize, value);
    }

    /// Add a row identified by text (CSV and in-memory rows).
    fn push(&mut self, c: Cells<'_>) {
        let at = match &self.last {
            Some((at, (site, role, pass, comp, step)))
                if site == c.site && role == c.role && *pass == c.pass && *comp == c.compile && *step == c.step =>
            {
                *at
            }
            _ => {
                let at = self.group(&c);
                self.last = Some((at, (c.site.to_string(), c.role.to_string(), c.pass, c.compile, c.step)));
                at
            }
        };
        self.add(at, c.stat, c.idx, c.value);
    }

    fn finish(self) -> BTreeMap<SeriesKey, Series> {
        self.series
            .into_iter()
            .map(|(k, mut s, _)| {
                s.runs.sort_by_key(|r| (r.compile, r.step));
                (k, s)
            })
            .collect()
    }
}

/// Group in-memory rows into series.
pub fn series_from_rows(rows: &[Row]) -> BTreeMap<SeriesKey, Series> {
    let mut b = Builder::default();
    for r in rows {
        let Some(stat) = Stat::parse(&r.stat) else { continue };
        b.push(Cells {
            site: &r.site,
            role: &r.role,
            pass: r.pass_idx,
            op: &r.op,
            shape: &r.shape,
            flops: r.flops,
            compile: r.compile,
            step: r.step,
            stat,
            idx: r.idx,
            value: r.value,
        });
    }
    b.finish()
}

/// Read a recording (CSV, or gzip CSV when the path ends in `.gz`) into series, streaming:
/// memory holds the values, not the rows.
///
/// Errors: the file cannot be opened, lacks a recording column, or holds a malformed row
/// (the error names the line).
pub fn load(path: &Path) -> Result<BTreeMap<SeriesKey, Series>, Error> {
    if path.extension().is_some_and(|e| e == "parquet") {
        return load_parquet(path);
    }
    let file = std::fs::File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::GzDecoder::new(std::io::BufReader::with_capacity(1 << 20, file)))
    } else {
        Box::new(std::io::BufReader::with_capacity(1 << 20, file))
    };
    let mut csv = csv::Reader::from_reader(reader);
    let csv_err = |e| Error::Csv { path: path.to_path_buf(), error: e };
    let header = csv.byte_headers().map_err(csv_err)?.clone();
    let col = |name: &str| {
        header.iter().position(|h| h == name.as_bytes()).ok_or_else(|| Error::BadPath {
            path: path.to_path_buf(),
            why: format!("no '{name}' column: not an opscope recording"),
        })
    };
    let (site, role, pass, op, shape) = (col("site")?, col("role")?, col("pass_idx")?, col("op")?, col("shape")?);
    let (flops, compile, step, stat, idx, value) = (col("flops")?, col("compile")?, col("step")?, col("stat")?, col("idx")?, col("value")?);
    let mut b = Builder::default();
    let mut rec = csv::ByteRecord::new();
    let mut line = 1u64;
    while csv.read_byte_record(&mut rec).map_err(csv_err)? {
        line += 1;
        let bad = |what: &str| Error::BadPath { path: path.to_path_buf(), why: format!("line {line}: bad {what}") };
        let text = |i: usize| std::str::from_utf8(&rec[i]).map_err(|_| bad("UTF-8"));
        let num = |i: usize, what: &str| text(i)?.parse::<u64>().map_err(|_| bad(what));
        let fl = text(flops)?;
        let Some(stat) = Stat::parse(text(stat)?) else { continue };
        b.push(Cells {
            site: text(site)?,
            role: text(role)?,
            pass: num(pass, "pass_idx")? as u32,
            op: text(op)?,
            shape: text(shape)?,
            flops: if fl.is_empty() { None } else { Some(fl.parse().map_err(|_| bad("flops"))?) },
            compile: num(compile, "compile")? as u32,
            step: num(step, "step")?,
            stat,
            idx: num(idx, "idx")?,
            value: text(value)?.parse::<f32>().map_err(|_| bad("value"))?,
        });
    }
    Ok(b.finish())
}

/// Read a Parquet recording: typed columns, strings through their dictionaries (a row costs no
/// text parsing).
fn load_parquet(path: &Path) -> Result<BTreeMap<SeriesKey, Series>, Error> {
    use arrow_array::types::Int32Type;
    use arrow_array::{Array, DictionaryArray, Float32Array, StringArray, UInt32Array, UInt64Array};
    let bad = |why: String| Error::BadPath { path: path.to_path_buf(), why };
    let file = std::fs::File::open(path).map_err(|e| Error::Io { path: path.to_path_buf(), error: e })?;
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.with_batch_size(1 << 16).build())
        .map_err(|e| bad(format!("not a readable Parquet recording: {e}")))?;
    let mut b = Builder::default();
    for batch in reader {
        let batch = batch.map_err(|e| bad(format!("reading: {e}")))?;
        let column = |name: &str| batch.column_by_name(name).ok_or_else(|| bad(format!("no '{name}' column: not an opscope recording")));
        let dict = |name: &str| -> Result<(Vec<i32>, StringArray), Error> {
            let c = column(name)?;
            let d = c
                .as_any()
                .downcast_ref::<DictionaryArray<Int32Type>>()
                .ok_or_else(|| bad(format!("column '{name}' is not dictionary-encoded text")))?;
            let values = d
                .values()
                .as_any()
                .downcast_ref::<StringArray>()
                .ok_or_else(|| bad(format!("column '{name}' does not hold text")))?
                .clone();
            Ok((d.keys().values().to_vec(), values))
        };
        fn typed<'a, T: 'static>(c: &'a arrow_array::ArrayRef, name: &str, path: &Path) -> Result<&'a T, Error> {
            c.as_any().downcast_ref::<T>().ok_or_else(|| Error::BadPath {
                path: path.to_path_buf(),
                why: format!("column '{name}' has the wrong type"),
            })
        }
        let (site_k, site_v) = dict("site")?;
        let (role_k, role_v) = dict("role")?;
        let (op_k, op_v) = dict("op")?;
        let (shape_k, shape_v) = dict("shape")?;
        let (stat_k, stat_v) = dict("stat")?;
        let stats: Vec<Option<Stat>> = (0..stat_v.len()).map(|i| Stat::parse(stat_v.value(i))).collect();
        let (pass_c, compile_c, step_c, idx_c, value_c, flops_c) =
            (column("pass_idx")?, column("compile")?, column("step")?, column("idx")?, column("value")?, column("flops")?);
        let pass = typed::<UInt32Array>(pass_c, "pass_idx", path)?;
        let compile = typed::<UInt32Array>(compile_c, "compile", path)?;
        let step = typed::<UInt64Array>(step_c, "step", path)?;
        let idx = typed::<UInt64Array>(idx_c, "idx", path)?;
        let value = typed::<Float32Array>(value_c, "value", path)?;
        let flops = typed::<UInt64Array>(flops_c, "flops", path)?;
        // Groups are told apart by dictionary keys and integers; text is read once per group.
        let mut last: Option<((i32, i32, u32, u32, u64), (usize, usize))> = None;
        for i in 0..batch.num_rows() {
            let Some(stat) = stats[stat_k[i] as usize] else { continue };
            let id = (site_k[i], role_k[i], pass.value(i), compile.value(i), step.value(i));
            let at = match last {
                Some((l, at)) if l == id => at,
                _ => {
                    let at = b.group(&Cells {
                        site: site_v.value(site_k[i] as usize),
                        role: role_v.value(role_k[i] as usize),
                        pass: id.2,
                        op: op_v.value(op_k[i] as usize),
                        shape: shape_v.value(shape_k[i] as usize),
                        flops: flops.is_valid(i).then(|| flops.value(i)),
                        compile: id.3,
                        step: id.4,
                        stat,
                        idx: 0,
                        value: 0.0,
                    });
                    last = Some((id, at));
                    at
                }
            };
            b.add(at, stat, idx.value(i), value.value(i));
        }
    }
    Ok(b.finish())
}

/// Sites and roles a recording's manifest lists that have no rows: they never ran (or were
/// skipped, with the manifest's reason). Reads `<recording>.manifest.json` if it exists.
pub fn no_data(recording: &Path, series: &BTreeMap<SeriesKey, Series>) -> Result<Vec<String>, Error> {
    let side = crate::sink::sidecar_path(recording);
    if !side.exists() {
        return Ok(Vec::new());
    }
    let bytes = std::fs::read(&side).map_err(|e| Error::Io { path: side.clone(), error: e })?;
    let sidecar: crate::sink::Sidecar =
        serde_json::from_slice(&bytes).map_err(|e| Error::Internal(format!("{}: {e}", side.display())))?;
    let mut out = Vec::new();
    for m in &sidecar.graphs {
        for o in &m.outputs {
            for u in &o.uses {
                let key = (u.site.clone(), u.role.as_str().to_string(), u.pass_idx as u32);
                let ran = series.get(&key).is_some_and(|s| s.runs.iter().any(|r| r.compile == m.tag));
                if !ran {
                    out.push(format!("{} (compile {}) {}/{}: no data", m.graph, m.tag, u.site, u.role.as_str()));
                }
            }
        }
        for k in &m.skipped {
            let role = k.role.map(|r| r.as_str()).unwrap_or("*");
            out.push(format!("{}/{role}: not sketched: {}", k.site, k.reason));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Roles whose series hold probe statistics (attention, routing, residual), mined by
/// [`probe_verdicts`] rather than by the tensor rules.
pub const PROBE_ROLES: [&str; 4] = ["probs", "router", "dispatch", "block"];

/// Sum over runs of `weight(run) * v[i]` / sum of weights, per index, for a vector statistic.
fn weighted_vector(s: &Series, stat: Stat, weight: impl Fn(&Run) -> f64) -> Vec<f64> {
    let mut sum: Vec<f64> = Vec::new();
    let mut w: Vec<f64> = Vec::new();
    for r in &s.runs {
        let Some(v) = r.vector(stat) else { continue };
        let wr = weight(r);
        if sum.len() < v.len() {
            sum.resize(v.len(), 0.0);
            w.resize(v.len(), 0.0);
        }
        for (i, &x) in v.iter().enumerate() {
            if x.is_finite() {
                sum[i] += wr * x as f64;
                w[i] += wr;
            }
        }
    }
    sum.iter().zip(&w).map(|(s, w)| if *w > 0.0 { s / w } else { f64::NAN }).collect()
}

/// Verdicts from the attention, routing and residual probes.
fn probe_verdicts(series: &BTreeMap<SeriesKey, Series>, out: &mut Vec<Verdict>) {
    let mut verdict = |key: &SeriesKey, kind: Kind, evidence: Vec<(&str, f64)>, rule: &'static str, source: &'static str| {
        out.push(Verdict {
            site: key.0.clone(),
            role: key.1.clone(),
            pass_idx: key.2,
            kind,
            evidence: evidence.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            rule,
            source,
            payoff: 0.0,
        });
    };
    let mut blocks: Vec<(&SeriesKey, f64)> = Vec::new();
    for (key, s) in series {
        match key.1.as_str() {
            "probs" => {
                let q = |r: &Run| r.scalar(Stat::Queries).unwrap_or(0.0);
                // Mean non-padding keys per sequence, over runs (weighted by queries).
                let (kw, kn) = s.runs.iter().fold((0.0, 0.0), |(a, n), r| match r.scalar(Stat::Keys) {
                    Some(k) => (a + q(r) * k, n + q(r)),
                    None => (a, n),
                });
                let valid_keys = if kn > 0.0 { (kw / kn).max(1.0) } else { continue };
                let topk = s.runs.iter().find_map(|r| r.scalar(Stat::Topk));
                let mass = weighted_vector(s, Stat::TopkMass, q);
                if let (Some(k), false) = (topk, mass.is_empty()) {
                    let mean = mass.iter().sum::<f64>() / mass.len() as f64;
                    let worst = mass.iter().copied().fold(f64::INFINITY, f64::min);
                    if mean >= 0.9 && k * 4.0 <= valid_keys {
                        verdict(
                            key,
                            Kind::SparseAttention,
                            vec![("topk", k), ("topk_mass_mean", mean), ("topk_mass_worst_head", worst), ("keys_per_sequence", valid_keys)],
                            "top-k keeps >= 90% of the attention mass (mean over heads) with k <= keys/4",
                            "Gupta et al., Memory-efficient Transformers via Top-k Attention (2021); 90%: opscope's line",
                        );
                    }
                }
                let uniform = 1.0 / valid_keys;
                for (stat, which) in [(Stat::SinkFirst, "first key"), (Stat::SinkLast, "last key")] {
                    let v = weighted_vector(s, stat, q);
                    let (h, m) = v.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b });
                    if m >= 0.2 && m >= 5.0 * uniform {
                        let heads = v.iter().filter(|&&x| x >= 0.2 && x >= 5.0 * uniform).count() as f64;
                        verdict(
                            key,
                            Kind::AttentionSink,
                            vec![(if which == "first key" { "sink_first_max" } else { "sink_last_max" }, m), ("head", h as f64), ("sink_heads", heads), ("uniform_share", uniform)],
                            "a head gives one key (first, or last non-padding) >= 0.2 of its mass and >= 5x the uniform share",
                            "Xiao et al., StreamingLLM (2024); Clark et al., What Does BERT Look At? (2019); 0.2 and 5x: opscope's lines",
                        );
                    }
                }
                let pad = weighted_vector(s, Stat::PadMass, q);
                let pad_max = pad.iter().copied().fold(0.0, f64::max);
                if pad_max > 1e-3 {
                    verdict(key, Kind::Health, vec![("pad_mass_max_head", pad_max)], "attention mass on padding keys > 1e-3: the mask leaks", "health check");
                }
            }
            "router" | "dispatch" => {
                let load = weighted_vector(s, Stat::Load, |_| 1.0);
                let runs = s.runs.iter().filter(|r| r.vector(Stat::Load).is_some()).count() as f64;
                let total: Vec<f64> = load.iter().map(|l| l * runs).collect();
                let assignments: f64 = total.iter().sum();
                if total.is_empty() || assignments <= 0.0 {
                    continue;
                }
                let e = total.len() as f64;
                let mean = assignments / e;
                let dead = total.iter().filter(|&&l| l == 0.0).count() as f64;
                if dead > 0.0 && mean >= 10.0 {
                    verdict(
                        key,
                        Kind::DeadExpert,
                        vec![("dead_experts", dead), ("experts", e), ("assignments", assignments)],
                        "an expert got no token while a uniform router would have sent it >= 10",
                        "Lu et al., Not All Experts are Equal (2024): expert pruning",
                    );
                }
                let max = total.iter().copied().fold(0.0, f64::max);
                if max >= 2.0 * mean {
                    let hot = total.iter().position(|&l| l == max).unwrap_or(0) as f64;
                    verdict(
                        key,
                        Kind::ExpertImbalance,
                        vec![("max_over_mean_load", max / mean), ("expert", hot)],
                        "busiest expert's load >= 2x the mean (overflows capacity factor 2)",
                        "Fedus et al., Switch Transformers (2021): capacity factors 1.0-2.0",
                    );
                }
            }
            "block" => {
                // Mean over runs weighted by each run's (non-padding) rows.
                let (mut sum, mut w) = (0.0, 0.0);
                for r in &s.runs {
                    if let (Some(c), Some(n)) = (r.scalar(Stat::Cos), r.scalar(Stat::Rows)) {
                        sum += n * c;
                        w += n;
                    }
                }
                if w > 0.0 {
                    blocks.push((key, 1.0 - sum / w));
                }
            }
            _ => {}
        }
    }
    if blocks.len() >= 3 {
        let med = median(blocks.iter().map(|b| b.1).collect()).unwrap_or(0.0);
        for (key, bi) in &blocks {
            if *bi <= 0.5 * med {
                verdict(
                    key,
                    Kind::LayerSkipProbe,
                    vec![("block_influence", *bi), ("median_block_influence", med)],
                    "1 - cos(x, x + f(x)) <= half the median block's; confirm with the skip actuation",
                    "Men et al., ShortGPT (2024): remove the lowest block-influence layers",
                );
            }
        }
    }
}

/// What sketches cannot see, said once per report.
pub const NOT_OBSERVABLE: &str = "low rank is not observable from these sketches (a LowRankProbe verdict is a suspicion from row energies); \
a randomized range finder (Halko, Martinsson, Tropp 2011) on sampled activations would confirm it. \
2:4 structure likewise needs a per-group-of-4 non-zero count.";

/// A kind of verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Few non-zeros: a sparse GEMM pays. density <= 0.3 (Gale et al., Sparse GPU Kernels for
    /// Deep Learning, SC 2020: sparse kernels beat dense from ~70% sparsity).
    SparseGemm,
    /// Half the values are zero (0.45 <= density <= 0.55): consistent with 2:4 structured
    /// sparsity (Mishra et al. 2021, NVIDIA Ampere), which sketches cannot confirm; a probe
    /// counting non-zeros per group of 4 along K would.
    TwoFourProbe,
    /// A few channels carry outliers (chan_outlier >= 4, 0 < fraction of channels above 8x the
    /// median channel max|x| <= 4%): per-channel scaling or mixed precision (Dettmers et al.,
    /// LLM.int8(), 2022; Xiao et al., SmoothQuant, 2023).
    ChannelOutliers,
    /// Outliers scattered over elements (kurtosis >= 20, no channel structure): keep them
    /// apart, sparse outliers + low-bit dense (Dettmers et al., SpQR, 2023).
    ScatteredOutliers,
    /// Per-channel int8 SQNR >= 8 dB above per-tensor (noise model Δ²/12, Widrow & Kollár,
    /// Quantization Noise, 2008; 8 dB is opscope's line: a Gaussian null gains 2-4 dB).
    PerChannelInt8,
    /// Per-tensor int4 SQNR >= 22 dB in every run and kurtosis <= 2.4 (Δ²/12 model; the ideal
    /// for a uniform distribution is 22.9 dB, a Gaussian gives 14.6-20 dB).
    Int4,
    /// >= 2 empty bins between the 10% and 90% quantile bins: values on few levels, a LUT /
    /// codebook kernel (Han et al., Deep Compression, 2016).
    Lut,
    /// Adjacent-row difference energy <= 0.25 x the pairs' energy (1.0 for independent rows):
    /// delta compute (Neil et al., Delta Networks, ICML 2017).
    DeltaCompute,
    /// Per-run rms varies <= 5% and the mean does not trend: calibrate once (static
    /// quantization, as PyTorch observers and ONNX Runtime calibrators do).
    Stationary,
    /// The mean moves by >= 0.5 rms over the runs: scales must be dynamic.
    Drifting,
    /// elemsig and sumsq identical in every run: memoize.
    ExactRepeat,
    /// Row-energy CV >= 0.35 (a Gaussian gives sqrt(2/C)): low rank is suspected but not
    /// observable from sketches; a randomized range finder (Halko, Martinsson, Tropp 2011)
    /// would confirm it.
    LowRankProbe,
    /// NaN or Inf values, or attention mass leaking to padding keys (pad_mass > 1e-3).
    Health,
    /// Top-k attention keeps >= 90% of the probability mass with k <= keys/4, averaged over
    /// heads: sparse / top-k attention (Gupta et al., Memory-efficient Transformers via Top-k
    /// Attention, 2021); 90% is opscope's line.
    SparseAttention,
    /// A head gives one key (the first, or the last non-padding one) >= 5x the uniform share
    /// and >= 0.2 of its mass: an attention sink that KV eviction and windowed attention must
    /// keep (Xiao et al., StreamingLLM, 2024; Clark et al. 2019 on BERT's [CLS]/[SEP]); 5x and
    /// 0.2 are opscope's lines.
    AttentionSink,
    /// A residual block's influence 1 - cos(x, x + f(x)) is <= half the median block's: a layer
    /// skip candidate (Men et al., ShortGPT, 2024, removes the lowest-influence layers). A probe:
    /// confirm with the `skip` actuation (on MiniLM-L3 the ranks did not agree, see README).
    LayerSkipProbe,
    /// An expert received no token over the recording while a uniform router would have sent it
    /// >= 10: prune it (expert pruning; Lu et al., Not All Experts are Equal, 2024).
    DeadExpert,
    /// The busiest expert's load is >= 2x the mean: tokens overflow a capacity factor of 2
    /// (Fedus et al., Switch Transformers, 2021: capacity factors 1.0-2.0).
    ExpertImbalance,
}

/// One verdict at one site.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// Site name.
    pub site: String,
    /// Role of the tensor.
    pub role: String,
    /// Pass index.
    pub pass_idx: u32,
    /// What the data justifies.
    pub kind: Kind,
    /// The numbers the rule read.
    pub evidence: Vec<(String, f64)>,
    /// The rule, with its threshold.
    pub rule: &'static str,
    /// Where the threshold comes from.
    pub source: &'static str,
    /// Share of the recorded FLOPs at this site (0..1) times the fraction of the site's cost
    /// the kernel could remove (an estimate, stated per kind in [`payoff_fraction`]).
    pub payoff: f64,
}

/// Fraction of a site's cost a kernel of this kind could remove (rough, for ranking only):
/// sparse GEMM `1 - density`; int8 / int4 GEMM 0.5 / 0.75 of a f32 GEMM; memoization 1.0;
/// delta compute 0.5; LUT 0.5; the others 0 (they are warnings or probes).
pub fn payoff_fraction(kind: Kind, density: f64) -> f64 {
    match kind {
        Kind::SparseGemm => 1.0 - density,
        Kind::PerChannelInt8 | Kind::ChannelOutliers | Kind::ScatteredOutliers => 0.5,
        Kind::Int4 => 0.75,
        Kind::ExactRepeat => 1.0,
        Kind::DeltaCompute | Kind::Lut => 0.5,
        Kind::Stationary => 0.1,
        _ => 0.0,
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(v[v.len() / 2])
}


fn db(x: f64) -> f64 {
    10.0 * x.log10()
}

/// Per-run metrics of one tensor.
#[derive(Debug, Clone, Default)]
struct Metrics {
    density: Option<f64>,
    kurtosis: Option<f64>,
    chan_outlier: Option<f64>,
    /// Fraction of channels whose max|x| exceeds 8x the median channel's.
    elevated: Option<f64>,
    sqnr8_tensor: Option<f64>,
    sqnr8_channel: Option<f64>,
    sqnr4_tensor: Option<f64>,
    /// Empty histogram bins between the bins holding the 10% and 90% quantiles.
    central_holes: Option<f64>,
    /// adj_sumsq / sum over adjacent pairs of (pos_sumsq[r] + pos_sumsq[r-1]).
    adj_ratio: Option<f64>,
    /// Coefficient of variation of the per-row energies.
    row_cv: Option<f64>,
    nonfinite: f64,
    mean: Option<f64>,
    rms: Option<f64>,
}

fn metrics(run: &Run, shape: &[usize]) -> Metrics {
    let count = run.scalar(Stat::Count).unwrap_or(0.0);
    let mut m = Metrics {
        nonfinite: [Stat::NanCount, Stat::PosinfCount, Stat::NeginfCount].iter().filter_map(|k| run.scalar(*k)).sum(),
        ..Default::default()
    };
    if count <= 0.0 {
        return m;
    }
    m.density = run.scalar(Stat::Nnz).map(|n| n / count);
    m.kurtosis = run.scalar(Stat::Kurtosis);
    m.chan_outlier = run.scalar(Stat::ChanOutlier);
    m.mean = run.scalar(Stat::Mean);
    let p = run.scalar(Stat::Sumsq).map(|s| s / count);
    m.rms = p.map(f64::sqrt);
    let absmax = match (run.scalar(Stat::Min), run.scalar(Stat::Max)) {
        (Some(lo), Some(hi)) => Some(lo.abs().max(hi.abs())),
        _ => None,
    };
    if let (Some(p), Some(a)) = (p, absmax) {
        if a > 0.0 && p > 0.0 {
            m.sqnr8_tensor = Some(db(12.0 * p * 127.0 * 127.0 / (a * a)));
            m.sqnr4_tensor = Some(db(12.0 * p * 49.0 / (a * a)));
        }
    }
    if let Some(ch) = run.vector(Stat::ChanMaxabs).filter(|c| !c.is_empty()) {
        let mut sorted: Vec<f64> = ch.iter().map(|&x| x as f64).collect();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let med = sorted[sorted.len() / 2];
        m.elevated = Some(sorted.iter().filter(|&&x| x > 8.0 * med).count() as f64 / sorted.len() as f64);
        let noise: f64 = sorted.iter().map(|c| (c / 127.0).powi(2) / 12.0).sum::<f64>() / sorted.len() as f64;
        if let (Some(p), true) = (p, noise > 0.0) {
            m.sqnr8_channel = Some(db(p / noise));
        }
    }
    if let Some(h) = run.vector(Stat::Hist).filter(|h| h.len() >= 8) {
        // The bins holding the central 80% of the values: a continuous distribution fills
        // them, values on a few levels leave gaps between them.
        let total: f64 = h.iter().map(|&x| x as f64).sum();
        let mut acc = 0.0;
        let (mut a, mut b) = (None, 0);
        for (i, &x) in h.iter().enumerate() {
            acc += x as f64;
            if a.is_none() && acc >= 0.1 * total {
                a = Some(i);
            }
            if acc <= 0.9 * total {
                b = i;
            }
        }
        let a = a.unwrap_or(0);
        m.central_holes = Some(if b > a { h[a..=b].iter().filter(|&&x| x == 0.0).count() as f64 } else { 0.0 });
    }
    if let Some(pos) = run.vector(Stat::PosSumsq).filter(|p| p.len() >= 2) {
        let block = if shape.len() >= 2 { shape[shape.len() - 2].max(1) } else { 1 };
        let pairs: f64 = (1..pos.len()).filter(|r| r % block != 0).map(|r| (pos[r] + pos[r - 1]) as f64).sum();
        if let (Some(adj), true) = (run.scalar(Stat::AdjSumsq), pairs > 0.0) {
            m.adj_ratio = Some(adj / pairs);
        }
        let n = pos.len() as f64;
        let mean = pos.iter().map(|&x| x as f64).sum::<f64>() / n;
        if mean > 0.0 {
            let var = pos.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
            m.row_cv = Some(var.sqrt() / mean);
        }
    }
    m
}

fn parse_shape(s: &str) -> Vec<usize> {
    s.trim_matches(|c| c == '[' || c == ']').split(',').filter_map(|d| d.trim().parse().ok()).collect()
}

/// Mine every series: the verdicts it supports, sorted by payoff (highest first).
pub fn mine(series: &BTreeMap<SeriesKey, Series>) -> Vec<Verdict> {
    let total_flops: f64 = {
        // FLOPs once per site (roles share them).
        let mut per_site: BTreeMap<(&str, u32), f64> = BTreeMap::new();
        for ((site, _, pass), s) in series {
            let f = s.flops.unwrap_or(0) as f64 * s.runs.len().max(1) as f64;
            let e = per_site.entry((site.as_str(), *pass)).or_default();
            *e = e.max(f);
        }
        per_site.values().sum::<f64>().max(1.0)
    };
    let mut out = Vec::new();
    probe_verdicts(series, &mut out);
    for ((site, role, pass_idx), s) in series {
        if PROBE_ROLES.contains(&role.as_str()) {
            continue;
        }
        let shape = parse_shape(&s.shape);
        let ms: Vec<Metrics> = s.runs.iter().map(|r| metrics(r, &shape)).collect();
        let med = |f: fn(&Metrics) -> Option<f64>| median(ms.iter().filter_map(f).collect());
        let density = med(|m| m.density);
        let kurt = med(|m| m.kurtosis);
        let chan = med(|m| m.chan_outlier);
        let elevated = med(|m| m.elevated);
        let s8t = med(|m| m.sqnr8_tensor);
        let s8c = med(|m| m.sqnr8_channel);
        let holes = med(|m| m.central_holes);
        let adj = med(|m| m.adj_ratio);
        let row_cv = med(|m| m.row_cv);
        // The site's executions: the most runs any of its roles recorded (a weight is recorded
        // once, its activation every run).
        let executions = series
            .iter()
            .filter(|((st, _, p), _)| st == site && p == pass_idx)
            .map(|(_, x)| x.runs.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let share = s.flops.unwrap_or(0) as f64 * executions as f64 / total_flops;
        let mut push = |kind: Kind, evidence: Vec<(&str, Option<f64>)>, rule: &'static str, source: &'static str| {
            out.push(Verdict {
                site: site.clone(),
                role: role.clone(),
                pass_idx: *pass_idx,
                kind,
                evidence: evidence.into_iter().filter_map(|(k, v)| v.map(|v| (k.to_string(), v))).collect(),
                rule,
                source,
                payoff: share * payoff_fraction(kind, density.unwrap_or(1.0)),
            });
        };
        let nonfinite: f64 = ms.iter().map(|m| m.nonfinite).sum();
        if nonfinite > 0.0 {
            push(Kind::Health, vec![("nonfinite", Some(nonfinite))], "any NaN or Inf", "health check");
        }
        let d = density.unwrap_or(1.0);
        if d <= 0.3 {
            push(
                Kind::SparseGemm,
                vec![("density", density)],
                "density <= 0.3 (>= 70% zeros)",
                "Gale et al., Sparse GPU Kernels for Deep Learning (SC 2020): sparse kernels beat dense from ~70% sparsity",
            );
        } else if (0.45..=0.55).contains(&d) {
            push(
                Kind::TwoFourProbe,
                vec![("density", density)],
                "0.45 <= density <= 0.55: consistent with 2:4, not provable from sketches; confirm with a probe counting non-zeros per group of 4 along K",
                "Mishra et al., Accelerating Sparse Deep Neural Networks (2021): 2:4 structured sparsity on Ampere",
            );
        }
        let channel = chan.is_some_and(|c| c >= 4.0) && elevated.is_some_and(|e| e > 0.0 && e <= 0.04);
        if channel {
            push(
                Kind::ChannelOutliers,
                vec![("chan_outlier", chan), ("elevated_channels", elevated), ("kurtosis", kurt)],
                "chan_outlier >= 4 with 1..4% of channels above 8x the median channel max|x| (a half-normal spread of channel maxima reaches ~5x)",
                "Dettmers et al., LLM.int8() (2022): systematic outlier features; Xiao et al., SmoothQuant (2023)",
            );
        }
        if !channel && d > 0.6 && kurt.is_some_and(|k| k >= 20.0) {
            push(
                Kind::ScatteredOutliers,
                vec![("kurtosis", kurt), ("elevated_channels", elevated)],
                "kurtosis >= 20 (Gaussian 3) without channel structure",
                "Dettmers et al., SpQR (2023): isolate sparse outliers, quantize the rest",
            );
        }
        if let (Some(t), Some(c)) = (s8t, s8c) {
            if c >= t + 8.0 {
                push(
                    Kind::PerChannelInt8,
                    vec![("sqnr_int8_per_tensor_db", s8t), ("sqnr_int8_per_channel_db", s8c)],
                    "per-channel int8 SQNR >= 8 dB above per-tensor (a Gaussian null gains ~2-4 dB)",
                    "uniform quantizer noise Δ²/12 (Widrow & Kollár 2008); 8 dB: opscope's line, calibrated on the sweep's Gaussian nulls",
                );
            }
        }
        // Int4 must hold in every run (the worst run decides), not only typically.
        let s4_worst = ms.iter().map(|m| m.sqnr4_tensor).collect::<Option<Vec<f64>>>().and_then(|v| v.into_iter().reduce(f64::min));
        if s4_worst.is_some_and(|v| v >= 22.0) && kurt.is_some_and(|k| k <= 2.4) {
            push(
                Kind::Int4,
                vec![("sqnr_int4_per_tensor_db_worst_run", s4_worst), ("kurtosis", kurt)],
                "per-tensor int4 SQNR >= 22 dB in every run (the ideal for a uniform is 22.9 dB, a Gaussian gives 14.6-20 dB) and light tails (kurtosis <= 2.4; uniform 1.8, Gaussian 3)",
                "uniform quantizer noise Δ²/12 (Widrow & Kollár 2008)",
            );
        }
        if d > 0.6 && holes.is_some_and(|h| h >= 2.0) {
            push(
                Kind::Lut,
                vec![("central_empty_bins", holes)],
                ">= 2 empty bins between the 10% and 90% quantile bins (each expects >= ~15 values for a continuous distribution of >= 1k values): values on a few levels",
                "Han et al., Deep Compression (2016): shared levels as a codebook",
            );
        }
        let coherent = adj.is_some_and(|a| a <= 0.25);
        if coherent {
            push(
                Kind::DeltaCompute,
                vec![("adjacent_row_ratio", adj)],
                "sum ||x_r - x_(r-1)||^2 <= 0.25 x sum (||x_r||^2 + ||x_(r-1)||^2) (1.0 for independent rows)",
                "Neil et al., Delta Networks for Optimized Recurrent Network Computation (ICML 2017)",
            );
        }
        if !channel && !coherent && d > 0.6 && kurt.is_some_and(|k| k < 20.0) && row_cv.is_some_and(|c| c >= 0.35) {
            push(
                Kind::LowRankProbe,
                vec![("row_energy_cv", row_cv)],
                "row-energy CV >= 0.35 (a Gaussian gives sqrt(2/C)); rank is not observable from sketches: confirm with a randomized range finder",
                "Halko, Martinsson, Tropp, Finding structure with randomness (2011)",
            );
        }
        if s.runs.len() >= MIN_STEPS {
            let sig: Vec<Option<&[f32]>> = s.runs.iter().map(|r| r.vector(Stat::Elemsig)).collect();
            let sumsq: Vec<Option<f64>> = s.runs.iter().map(|r| r.scalar(Stat::Sumsq)).collect();
            let repeat = sig.iter().all(|x| x.is_some() && *x == sig[0]) && sumsq.iter().all(|x| *x == sumsq[0]);
            let means: Vec<f64> = ms.iter().filter_map(|m| m.mean).collect();
            let rms = med(|m| m.rms).unwrap_or(0.0);
            let drift = if means.len() >= MIN_STEPS {
                // Least-squares slope of the mean over runs, times the window.
                let n = means.len() as f64;
                let xm = (n - 1.0) / 2.0;
                let ym = means.iter().sum::<f64>() / n;
                let cov: f64 = means.iter().enumerate().map(|(i, y)| (i as f64 - xm) * (y - ym)).sum();
                let var: f64 = (0..means.len()).map(|i| (i as f64 - xm).powi(2)).sum();
                Some((cov / var * (n - 1.0)).abs())
            } else {
                None
            };
            let rms_cv = {
                let v: Vec<f64> = ms.iter().filter_map(|m| m.rms).collect();
                let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
                (mean > 0.0).then(|| (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt() / mean)
            };
            if repeat {
                push(
                    Kind::ExactRepeat,
                    vec![("runs", Some(s.runs.len() as f64))],
                    "elemsig and sumsq identical in every run",
                    "memoization: an identical input gives an identical output",
                );
            } else if drift.is_some_and(|dv| rms > 0.0 && dv >= 0.5 * rms) {
                push(
                    Kind::Drifting,
                    vec![("mean_shift_over_window", drift), ("rms", Some(rms))],
                    "the mean moves by >= 0.5 rms over the recorded runs (least-squares trend)",
                    "dynamic vs static quantization (PyTorch quantization docs): moving ranges need dynamic scales",
                );
            } else if rms_cv.is_some_and(|c| c <= 0.05) {
                push(
                    Kind::Stationary,
                    vec![("rms_cv", rms_cv), ("mean_shift_over_window", drift)],
                    "per-run rms varies by <= 5% and the mean does not trend",
                    "static quantization calibration (PyTorch observers, ONNX Runtime calibrators): calibrate once",
                );
            }
        }
    }
    out.sort_by(|a, b| b.payoff.total_cmp(&a.payoff).then(a.site.cmp(&b.site)));
    out
}
