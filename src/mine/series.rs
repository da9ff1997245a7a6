//! Series: what one (site, role, pass) looked like over a recording, execution by execution.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::Error;
use crate::recording::{read_rows, read_sidecar, Row, RowRef};
use crate::sketch::{tensor, Stat};

/// One execution (step) of one tensor: its statistics.
#[derive(Debug, Clone)]
pub struct StepStats {
    /// Compile the step belongs to.
    pub compile: u32,
    /// Execution index within the compile.
    pub step: u64,
    scalars: Vec<(Stat, f32)>,
    vectors: Vec<(Stat, Vec<f32>)>,
    /// Set by a compact load ([`load_compact`]) in place of the per-row vectors.
    rows: Option<RowSummary>,
    /// Set by a compact load in place of the `chan_maxabs` vector.
    chans: Option<ChanSummary>,
    /// The rows of this run of this tensor ended (a later row for it means the recording does
    /// not keep a run's rows together: see [`load_compact`]).
    ended: bool,
    /// This run's tensor shape and FLOPs when they differ from its series' [`Series::shape`]
    /// and [`Series::flops`] (one site in two compiles: a decoder's prefill `[B, S, C]` and
    /// decode step `[B, 1, C]`).
    own: Option<Box<RunShape>>,
    /// A sampled load ([`load_sampled`]) left this run out of its series' sample: its rows are
    /// read into the series' running sums, then the run is dropped when they end.
    sampled_out: bool,
}

/// A run's own shape (text and dims) and FLOPs ([`StepStats::dims`], [`StepStats::flops`]).
#[derive(Debug, Clone, PartialEq)]
struct RunShape {
    text: String,
    dims: Vec<usize>,
    flops: Option<u64>,
}

/// What a compact load ([`load_compact`]) keeps of one run's `chan_maxabs` vector (one value
/// per channel: on MiniLM 22 000 of the 25 000 values a run left after [`RowSummary`]): the two
/// per-run numbers the tensor rules read from it, computed by the same code as from the vector,
/// and an XXH3-64 of its bits (exact-repeat fingerprints, `opscope report`'s identical-runs
/// check). The mean and maximum over runs per channel are kept on the [`Series`]
/// ([`Series::chan_maxabs_mean`], [`Series::chan_maxabs_max`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ChanSummary {
    /// Fraction of channels above [`super::OUTLIER_CHANNEL_RATIO`] x the median channel.
    pub elevated: Option<f64>,
    /// Per-channel int8 quantization noise power: the mean over channels of
    /// `(chan_maxabs / 127)^2 / 12`.
    pub noise: Option<f64>,
    /// XXH3-64 over the vector's length and value bits.
    pub hash: u64,
}

/// The per-row statistics (one value per row of the tensor) a compact load reduces when a
/// run's rows end. On MiniLM they are 80% of a run's values (the attention tensors have
/// batch x heads x tokens rows).
const PER_ROW: [Stat; 2] = [tensor::POS_SUMSQ, tensor::ROW_ABSMAX];

/// What a compact load ([`load_compact`]) keeps of one run's per-row vectors (`pos_sumsq`,
/// `row_absmax`): the three per-run numbers the tensor rules read from them, computed by the
/// same code as from the vectors, and an XXH3-64 of the vectors' bits for the exact-repeat
/// fingerprint ([`fingerprints`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowSummary {
    /// Per-token int8 SQNR (dB), as [`super::sqnr8_per_token`] gives it.
    pub sqnr8_token: Option<f64>,
    /// adj_sumsq / sum over adjacent row pairs of (pos_sumsq[r] + pos_sumsq[r-1]).
    pub adj_ratio: Option<f64>,
    /// Coefficient of variation of the per-row energies (`pos_sumsq`).
    pub row_cv: Option<f64>,
    /// Values per recorded row, `C = count / recorded rows` (the row energies' length, which
    /// sets their CV under the i.i.d. null: see [`super::kinds::LOW_RANK_PROBE`]).
    pub row_len: Option<f64>,
    /// XXH3-64 over each per-row statistic's name, length and value bits.
    pub hash: u64,
}

impl StepStats {
    fn new(compile: u32, step: u64) -> StepStats {
        StepStats {
            compile,
            step,
            scalars: Vec::new(),
            vectors: Vec::new(),
            rows: None,
            chans: None,
            ended: false,
            own: None,
            sampled_out: false,
        }
    }

    /// The dims of this run's tensor: its own when its compile gave the site another shape,
    /// else `series` (the series' [`Series::shape`], parsed). Per-run metrics that depend on the
    /// geometry (rows, adjacent-row pairs, channels) use these.
    pub fn dims<'a>(&'a self, series: &'a [usize]) -> &'a [usize] {
        self.own.as_ref().map_or(series, |o| o.dims.as_slice())
    }

    /// The FLOPs of this run's execution of the site: its own when its compile differs, else
    /// `series` (the series' [`Series::flops`]).
    pub fn flops(&self, series: Option<u64>) -> Option<u64> {
        self.own.as_ref().map_or(series, |o| o.flops)
    }

    /// Set value `idx` of `stat`. Returns the value it held, when it held one: a row that
    /// appears twice (a recording never writes a value twice, nor a NaN, so a slot holding a
    /// number was filled by an earlier row).
    fn push(&mut self, stat: Stat, idx: usize, value: f32) -> Option<f32> {
        let mut held = None;
        if idx == 0 {
            match self.scalars.iter_mut().find(|(s, _)| *s == stat) {
                Some(slot) => held = Some(std::mem::replace(&mut slot.1, value)),
                None => self.scalars.push((stat, value)),
            }
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
            let was = std::mem::replace(&mut v[idx], value);
            held = (!was.is_nan()).then_some(was);
        }
        held
    }

    /// Give back the growth slack of the vectors (a vector grows one value at a time as its rows
    /// arrive, so up to half its capacity is unused): called when the rows of this run of this
    /// tensor end. Measured on 400 MiniLM runs: the miner's peak heap 575 -> 404 MB.
    fn shrink(&mut self) {
        for (_, v) in &mut self.vectors {
            v.shrink_to_fit();
        }
    }

    /// Replace the per-row vectors by their [`RowSummary`] (`shape`: the tensor's dims). Called
    /// when the rows of this run of this tensor end; a recording lists them together, so the
    /// vectors are complete then. Per-row values arriving after that (a recording that splits a
    /// run's rows, which opscope does not write) void the summary's numbers rather than leave
    /// numbers computed from part of the rows.
    fn compact(&mut self, shape: &[usize]) {
        self.compact_chans();
        if !self.vectors.iter().any(|(s, _)| PER_ROW.contains(s)) {
            return;
        }
        use std::hash::Hasher;
        let late = self.rows.is_some();
        let mut summary = if late { RowSummary::default() } else { super::tensor::row_metrics(self, shape) };
        let mut h = twox_hash::XxHash3_64::default();
        h.write_u64(self.rows.map_or(0, |r| r.hash));
        let mut per_row: Vec<&(Stat, Vec<f32>)> = self.vectors.iter().filter(|(s, _)| PER_ROW.contains(s)).collect();
        per_row.sort_by_key(|(s, _)| s.as_str());
        for (stat, v) in per_row {
            h.write(stat.as_str().as_bytes());
            h.write_u64(v.len() as u64);
            for x in v {
                h.write_u32(x.to_bits());
            }
        }
        summary.hash = h.finish();
        self.vectors.retain(|(s, _)| !PER_ROW.contains(s));
        self.rows = Some(summary);
    }

    /// Replace the `chan_maxabs` vector by its [`ChanSummary`] (see [`StepStats::compact`]; a
    /// vector arriving after a summary voids the summary's numbers, as for the per-row ones).
    fn compact_chans(&mut self) {
        use std::hash::Hasher;
        let Some(i) = self.vectors.iter().position(|(s, _)| *s == tensor::CHAN_MAXABS) else { return };
        let (_, v) = self.vectors.swap_remove(i);
        // Late values (the run's vector split in two) void the numbers, as for the per-row ones.
        let (elevated, noise) = match (self.chans.is_some(), super::tensor::chan_metrics(&v)) {
            (false, Some((elevated, noise))) => (Some(elevated), noise),
            _ => (None, None),
        };
        let mut h = twox_hash::XxHash3_64::default();
        h.write_u64(self.chans.map_or(0, |c| c.hash));
        h.write_u64(v.len() as u64);
        for x in &v {
            h.write_u32(x.to_bits());
        }
        self.chans = Some(ChanSummary { elevated, noise, hash: h.finish() });
    }

    /// The per-row summary a compact load left in place of `pos_sumsq` and `row_absmax`
    /// (`None` after a full load: the vectors are there).
    pub fn row_summary(&self) -> Option<&RowSummary> {
        self.rows.as_ref()
    }

    /// The summary a compact load left in place of `chan_maxabs` (`None` after a full load).
    pub fn chan_summary(&self) -> Option<&ChanSummary> {
        self.chans.as_ref()
    }

    /// A scalar statistic (the first value of a vector one), if recorded.
    pub fn scalar(&self, stat: Stat) -> Option<f64> {
        let v = self.scalars.iter().find(|(s, _)| *s == stat)?.1;
        (!v.is_nan()).then_some(v as f64)
    }

    /// True if any value of `stat` was recorded.
    pub fn has(&self, stat: Stat) -> bool {
        self.scalars.iter().any(|(s, _)| *s == stat)
    }

    /// A vector statistic (`hist`, `elemsig`, `chan_maxabs`, `pos_sumsq`, the per-head and
    /// per-expert probe statistics), if recorded. After a compact load ([`load_compact`]),
    /// `pos_sumsq`, `row_absmax` and `chan_maxabs` are `None`: see [`StepStats::row_summary`],
    /// [`StepStats::chan_summary`] and the [`Series`] methods.
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
    /// Executions in (compile, step) order.
    pub runs: Vec<StepStats>,
    /// Execution order: the rank of this series' first row among the series of the recording
    /// (0 = the first to appear). A recording lists each run's sketches in graph order, so this
    /// is the order in which the sites executed (later compiles' new sites come after).
    pub order: usize,
    /// Per [`row_layout`], per row, the running [`Over`] of `pos_sumsq`: what a compact load
    /// ([`load_compact`]) keeps of the per-row energies for [`Series::mean_row_energy`] (empty
    /// after a full load, which keeps the vectors). Apart by layout: row `i` of a decoder's
    /// prefill `[B, S, C]` is token `i` of the first sequence, of its decode step `[B, 1, C]`
    /// the new token of sequence `i`.
    row_energy: Vec<(Vec<usize>, Vec<Over>)>,
    /// Per channel, the running [`Over`] of `chan_maxabs`: what a compact load keeps for
    /// [`Series::chan_maxabs_mean`] and [`Series::chan_maxabs_max`].
    chan_acc: Vec<Over>,
    /// Runs of this series in the recording, kept in [`Series::runs`] or not
    /// ([`Series::runs_seen`]).
    seen: usize,
    /// Over every run read, kept or not: the smallest `min` and largest `max`
    /// ([`Series::range`]), the FLOPs ([`Series::flops_over_runs`]), the NaN and Inf counts
    /// ([`Series::nonfinite_over_runs`]), and the compiles ([`Series::ran_in`]).
    exact: Exact,
}

/// What a load adds up over every run of a series as each run's rows end (see [`Series`]).
#[derive(Debug, Clone, Default)]
struct Exact {
    extremes: (Option<f64>, Option<f64>),
    flops: f64,
    nonfinite: f64,
    /// The runs (compile, step) holding a NaN or an Inf ([`Series::nonfinite_runs`]): few, as
    /// such runs are, and kept whatever a sampled load leaves out.
    nonfinite_runs: Vec<(u32, u64)>,
    /// Runs with a subnormal `min` or `max`, and the first such value ([`Series::subnormal_over_runs`]).
    subnormal: (usize, Option<f64>),
    compiles: std::collections::BTreeSet<u32>,
}

/// One index of a vector statistic over runs: the sum, count and maximum of its finite values.
#[derive(Debug, Clone, Copy)]
struct Over {
    sum: f64,
    n: f64,
    max: f64,
}

impl Over {
    const EMPTY: Over = Over { sum: 0.0, n: 0.0, max: f64::NAN };

    /// The mean of the finite values (NaN for none), as [`weighted_vector`] with weight 1.
    fn mean(&self) -> f64 {
        if self.n > 0.0 {
            self.sum / self.n
        } else {
            f64::NAN
        }
    }
}

/// Add the finite values of one run's vector `v` to the per-index accumulators `acc`.
fn accumulate(acc: &mut Vec<Over>, v: &[f32]) {
    if acc.len() < v.len() {
        acc.resize(v.len(), Over::EMPTY);
    }
    for (a, &x) in acc.iter_mut().zip(v) {
        if x.is_finite() {
            a.sum += x as f64;
            a.n += 1.0;
            a.max = a.max.max(x as f64);
        }
    }
}

impl Series {
    /// Runs of this series the recording holds. Equal to `runs.len()` except after a sampled
    /// load ([`load_sampled`]) that left runs out of [`Series::runs`].
    pub fn runs_seen(&self) -> usize {
        self.seen.max(self.runs.len())
    }

    /// True when [`Series::runs`] holds a sample of the series' runs ([`load_sampled`]).
    pub fn is_sampled(&self) -> bool {
        self.seen > self.runs.len()
    }

    /// The smallest `min` and the largest `max` statistic over every run of the recording (NaN
    /// values skipped; `None` where no run recorded the statistic), after a sampled load too:
    /// kept as runs are read.
    pub fn range(&self) -> (Option<f64>, Option<f64>) {
        if !self.is_sampled() {
            // Read from the runs: a run's scalars may be completed by late rows after its
            // group ended (a recording that does not keep a run's rows together).
            return (
                self.runs.iter().filter_map(|r| r.scalar(tensor::MIN)).reduce(f64::min),
                self.runs.iter().filter_map(|r| r.scalar(tensor::MAX)).reduce(f64::max),
            );
        }
        self.exact.extremes
    }

    /// The FLOPs of every run of the series (each run's own: a prefill and a decode compile
    /// differ), after a sampled load too.
    pub fn flops_over_runs(&self) -> f64 {
        if self.is_sampled() {
            return self.exact.flops;
        }
        self.runs.iter().map(|r| r.flops(self.flops).unwrap_or(0) as f64).sum()
    }

    /// NaN, +Inf and -Inf values over every run of the series (the `nan_count`, `posinf_count`
    /// and `neginf_count` statistics), after a sampled load too.
    pub fn nonfinite_over_runs(&self) -> f64 {
        if self.is_sampled() {
            return self.exact.nonfinite;
        }
        self.runs.iter().map(nonfinite).sum()
    }

    /// The runs (compile, step) holding a NaN or an Inf, over every run of the series, after a
    /// sampled load too, in read order.
    pub fn nonfinite_runs(&self) -> Vec<(u32, u64)> {
        if self.is_sampled() {
            return self.exact.nonfinite_runs.clone();
        }
        self.runs.iter().filter(|r| nonfinite(r) > 0.0).map(|r| (r.compile, r.step)).collect()
    }

    /// The runs whose `min` or `max` statistic is subnormal (non-zero, |x| below f32's smallest
    /// normal, 2^-126), and of those values the smallest in magnitude (of two, the negative),
    /// over every run of the series, after a sampled load too (the same whatever order the
    /// runs were read in). The smallest |x| of a tensor of one sign is its `min`
    /// or `max`, so a run counted here holds subnormal values; a mixed-sign tensor's extremes are
    /// its largest and show none.
    pub fn subnormal_over_runs(&self) -> (usize, Option<f64>) {
        if self.is_sampled() {
            return self.exact.subnormal;
        }
        let tiny: Vec<f64> = self.runs.iter().filter_map(subnormal_extreme).collect();
        (tiny.len(), tiny.iter().copied().reduce(deepest))
    }

    /// True if the series has a run of compile `compile`, after a sampled load too.
    pub fn ran_in(&self, compile: u32) -> bool {
        if self.is_sampled() {
            return self.exact.compiles.contains(&compile);
        }
        self.runs.iter().any(|r| r.compile == compile)
    }

    /// Make the series' shape and FLOPs those of its first run in (compile, step) order, not of
    /// the first row the file happened to list (a re-sorted recording of a site in two compiles
    /// gives the same series), and each run's own only where it differs from them. `first`:
    /// the shape of the first run read when a sampled load may have left it out of `runs`.
    fn first_run_shape(&mut self, first: Option<Option<Box<RunShape>>>) {
        let first = match first {
            Some(own) => own.map(|b| *b),
            None => self.runs.first().and_then(|r| r.own.as_deref().cloned()),
        };
        let Some(first) = first else { return };
        let text = std::mem::take(&mut self.shape);
        let old = RunShape { dims: super::tensor::parse_shape(&text), text, flops: self.flops };
        for r in &mut self.runs {
            let mine = r.own.take().map_or_else(|| old.clone(), |b| *b);
            r.own = (mine != first).then(|| Box::new(mine));
        }
        self.shape = first.text;
        self.flops = first.flops;
    }

    /// Per index of `stat`'s vector, its [`Over`] the runs `take` selects: `kept` (what a
    /// compact load accumulated), else accumulated here from the runs' vectors in (compile,
    /// step) order. Empty when no such run holds the vector.
    fn over<'a>(&self, stat: Stat, kept: &'a [Over], take: impl Fn(&StepStats) -> bool) -> std::borrow::Cow<'a, [Over]> {
        if !kept.is_empty() {
            return std::borrow::Cow::Borrowed(kept);
        }
        let mut acc = Vec::new();
        for v in self.runs.iter().filter(|r| take(r)).filter_map(|r| r.vector(stat)) {
            accumulate(&mut acc, v);
        }
        std::borrow::Cow::Owned(acc)
    }

    /// Per row of the tensor, the mean over runs of its energy (`pos_sumsq`, the sum of x^2 over
    /// the row), over the runs whose rows are the series' rows ([`row_layout`]: the series'
    /// shape, [`Series::shape`], up to its batch) where it is finite (NaN for a row with none: a
    /// padding row in every run); `None` when no such run recorded `pos_sumsq`. Other runs are
    /// left out: a row index means another token there (a decoder's decode steps `[B, 1, C]`
    /// beside its prefill `[B, S, C]`). The same after a full load (the values
    /// [`weighted_vector`] gives with weight 1) and a compact one (running sums kept per row
    /// layout as each run's rows end), up to the order of the f64 additions when a recording's
    /// runs arrive out of (compile, step) order.
    pub fn mean_row_energy(&self) -> Option<Vec<f64>> {
        let layout = row_layout(&super::tensor::parse_shape(&self.shape));
        let kept = self.row_energy.iter().find(|(d, _)| *d == layout).map_or(&[][..], |(_, o)| o.as_slice());
        if kept.is_empty() && !self.row_energy.is_empty() {
            return None; // a compact load kept other layouts' sums only
        }
        let dims = super::tensor::parse_shape(&self.shape);
        let o = self.over(tensor::POS_SUMSQ, kept, |r| row_layout(r.dims(&dims)) == layout);
        (!o.is_empty()).then(|| o.iter().map(Over::mean).collect())
    }

    /// Runs whose rows are not the series' rows ([`row_layout`]; a decoder's decode steps beside
    /// its prefill): left out of [`Series::mean_row_energy`].
    pub fn runs_of_other_rows(&self) -> usize {
        let dims = super::tensor::parse_shape(&self.shape);
        let layout = row_layout(&dims);
        self.runs.iter().filter(|r| row_layout(r.dims(&dims)) != layout).count()
    }

    /// True if some run recorded a non-empty `chan_maxabs`.
    pub fn has_chan_maxabs(&self) -> bool {
        !self.chan_acc.is_empty() || self.runs.iter().any(|r| r.vector(tensor::CHAN_MAXABS).is_some_and(|v| !v.is_empty()))
    }

    /// Per channel, the mean over runs of `chan_maxabs` over the runs where it is finite (NaN
    /// for a channel with none); `None` without `chan_maxabs`. Either load gives it (see
    /// [`Series::mean_row_energy`] for the order of the additions).
    pub fn chan_maxabs_mean(&self) -> Option<Vec<f64>> {
        let o = self.over(tensor::CHAN_MAXABS, &self.chan_acc, |_| true);
        (!o.is_empty()).then(|| o.iter().map(Over::mean).collect())
    }

    /// Per channel, the largest finite `chan_maxabs` over runs (NaN for a channel with none);
    /// `None` without `chan_maxabs`. Either load gives it, exactly.
    pub fn chan_maxabs_max(&self) -> Option<Vec<f64>> {
        let o = self.over(tensor::CHAN_MAXABS, &self.chan_acc, |_| true);
        (!o.is_empty()).then(|| o.iter().map(|a| a.max).collect())
    }
}

/// What a row index of a tensor of shape `dims` stands for, as a key: runs with one key have
/// the same rows. Rank 3 and up (`[B, S, .., C]`): row `b * S.. + s` is token `s` of sequence
/// `b` whatever the batch, so the first dim is left out (a last, partial batch lines up with
/// the full ones). Rank 2 and below: the whole shape (a flattened `[B * S, C]` prefill and a
/// `[B, C]` decode step cannot be told from a change of batch, so only equal shapes line up).
pub fn row_layout(dims: &[usize]) -> Vec<usize> {
    match dims {
        [_, rest @ ..] if dims.len() >= 3 => std::iter::once(0).chain(rest.iter().copied()).collect(),
        _ => dims.to_vec(),
    }
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

/// The sampling priority of the run `(compile, step)` in a sampled load ([`load_sampled`]): the
/// XXH3-64 of its compile and step (little-endian, 12 bytes). A series keeps the runs of least
/// priority, so every series keeps the same runs of those it has (bottom-k sampling).
pub fn run_priority(compile: u32, step: u64) -> u64 {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&compile.to_le_bytes());
    b[4..].copy_from_slice(&step.to_le_bytes());
    twox_hash::XxHash3_64::oneshot(&b)
}

/// Remove the run `key` from `s` and from its index `runs` (run key -> position in
/// `s.runs`), keeping the index of the run moved into its place.
fn remove_run(s: &mut Series, runs: &mut std::collections::HashMap<(u32, u64), usize>, key: (u32, u64)) {
    let Some(i) = runs.remove(&key) else { return };
    s.runs.swap_remove(i);
    if let Some(moved) = s.runs.get(i) {
        runs.insert((moved.compile, moved.step), i);
    }
}

/// NaN, +Inf and -Inf values of one run (0 where not recorded).
fn nonfinite(r: &StepStats) -> f64 {
    [tensor::NAN_COUNT, tensor::POSINF_COUNT, tensor::NEGINF_COUNT].iter().filter_map(|k| r.scalar(*k)).sum()
}

/// The run's `min` or `max` when it is subnormal (non-zero and below [`f32::MIN_POSITIVE`] in
/// magnitude); of both, the smaller in magnitude ([`deepest`]).
fn subnormal_extreme(r: &StepStats) -> Option<f64> {
    [r.scalar(tensor::MIN), r.scalar(tensor::MAX)].into_iter().flatten().filter(|&x| x != 0.0 && x.abs() < f32::MIN_POSITIVE as f64).reduce(deepest)
}

/// Of two subnormal values, the smaller in magnitude; of equal magnitudes, the negative: an
/// order-independent choice, so a sampled and a full load report the same value.
fn deepest(a: f64, b: f64) -> f64 {
    match a.abs().total_cmp(&b.abs()) {
        std::cmp::Ordering::Less => a,
        std::cmp::Ordering::Greater => b,
        std::cmp::Ordering::Equal => a.min(b),
    }
}

/// What a sampled load keeps per series besides its runs: per tensor shape of its runs (the
/// strata: a decoder's prefill `[B, S, C]` and decode `[B, 1, C]` are sampled apart, so a shape
/// few runs have is not left out), the priorities of the kept runs (a max-heap, so the run to
/// drop is on top); the last step whose rows ended per compile (a recording that does not keep
/// each run's rows together shows as a run arriving at or before it); and the shape of the
/// first run in (compile, step) order.
#[derive(Default)]
struct Sample {
    kept: std::collections::HashMap<String, std::collections::BinaryHeap<(u64, (u32, u64))>>,
    last_ended: std::collections::HashMap<u32, u64>,
    first: Option<((u32, u64), Option<Box<RunShape>>)>,
}

/// Builds series from rows arriving in recording order (the rows of one run of one tensor
/// are contiguous, so the maps are consulted once per group, not once per row).
#[derive(Default)]
struct Builder {
    series: Vec<(SeriesKey, Series, std::collections::HashMap<(u32, u64), usize>, Sample)>,
    index: std::collections::HashMap<SeriesKey, usize>,
    /// (series, run) of the current group, and the fields that identify it.
    last: Option<((usize, usize), (String, String, u32, u32, u64))>,
    /// Statistic names seen, resolved once.
    stats: std::collections::HashMap<String, Option<Stat>>,
    /// Reduce each run's per-row vectors when its rows end ([`load_compact`]).
    compact: bool,
    /// Keep at most this many runs per series and run shape ([`load_sampled`]).
    max_runs: Option<usize>,
    /// A sampled load left a run out.
    dropped: bool,
    /// A row arrived for a run of a tensor whose rows had ended: the recording does not keep
    /// each run's rows together (re-sorted or shuffled by another tool).
    scattered: bool,
    /// The first row whose `idx` no statistic of its tensor can have ([`idx_bound`]), described.
    bad_idx: Option<String>,
    /// The last shape text whose [`idx_bound`] was computed, and the bound.
    bound_of: Option<(String, u64)>,
}

/// `idx` at or above which a row is checked against its tensor ([`idx_bound`]): 65536, the
/// largest `hist_bins` a pass accepts, so no histogram row is refused.
const IDX_CHECKED: u64 = 65536;

/// The largest `idx` + 1 a row of a tensor of shape `shape` (text) can carry: a vector
/// statistic has at most one value per element (rows, channels, heads, sampled elements) or per
/// histogram bin ([`IDX_CHECKED`]). With a dim that is not a number, 2^28. A row above it would
/// make the loader allocate a vector that long (a crafted `idx` of 2^40 aborted the process).
fn idx_bound(shape: &str) -> u64 {
    let dims: Vec<&str> = shape.trim_matches(|c| c == '[' || c == ']').split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    let numel = dims.iter().try_fold(1u64, |n, d| d.parse::<u64>().ok().and_then(|d| n.checked_mul(d)));
    numel.unwrap_or(1 << 28).max(IDX_CHECKED)
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
                        order: self.series.len(),
                        row_energy: Vec::new(),
                        chan_acc: Vec::new(),
                        seen: 0,
                        exact: Exact::default(),
                    },
                    Default::default(),
                    Sample::default(),
                ));
                self.index.insert(key, self.series.len() - 1);
                self.series.len() - 1
            }
        };
        let (_, s, runs, sample) = &mut self.series[si];
        let key = (c.compile, c.step);
        if let Some(&ri) = runs.get(&key) {
            return (si, ri);
        }
        let mut r = StepStats::new(c.compile, c.step);
        if c.shape != s.shape || c.flops != s.flops {
            r.own = Some(Box::new(RunShape { text: c.shape.to_string(), dims: super::tensor::parse_shape(c.shape), flops: c.flops }));
        }
        s.seen += 1;
        if let Some(cap) = self.max_runs {
            // A run of a compile at or before one whose rows ended: the rows are not in
            // opscope's order (each run's rows together, runs in step order per compile).
            self.scattered |= sample.last_ended.get(&c.compile).is_some_and(|&last| c.step <= last);
            if sample.first.as_ref().is_none_or(|(k, _)| key < *k) {
                sample.first = Some((key, r.own.clone()));
            }
            let p = run_priority(c.compile, c.step);
            let kept = match sample.kept.get_mut(c.shape) {
                Some(k) => k,
                None => sample.kept.entry(c.shape.to_string()).or_default(),
            };
            if kept.len() < cap {
                kept.push((p, key));
            } else if kept.peek().is_some_and(|&(top, _)| p < top) {
                // Drop the kept run of greatest priority (its rows have ended: a series' runs
                // arrive one after another).
                let (_, out) = kept.pop().expect("a full sample");
                kept.push((p, key));
                self.dropped = true;
                remove_run(s, runs, out);
            } else {
                r.sampled_out = true;
                self.dropped = true;
            }
        }
        s.runs.push(r);
        runs.insert(key, s.runs.len() - 1);
        (si, s.runs.len() - 1)
    }

    fn add(&mut self, (si, ri): (usize, usize), stat: Stat, idx: u64, value: f32) {
        let run = &mut self.series[si].1.runs[ri];
        if let Some(was) = run.push(stat, idx as usize, value) {
            let (compile, step) = (run.compile, run.step);
            let (site, role) = (&self.series[si].0 .0, &self.series[si].0 .1);
            self.bad_idx.get_or_insert_with(|| {
                format!(
                    "{site}/{role} (compile {compile}, step {step}) has two rows for stat '{}' idx {idx} ({was} and {value}): a \
                     recording writes each value once, so the file was concatenated with itself or edited; remove the \
                     duplicate rows (or re-record)",
                    stat.as_str()
                )
            });
        }
    }

    /// Add a row.
    fn row(&mut self, r: RowRef<'_>) {
        // A compact read found the recording out of order: its caller reads it again, so
        // nothing more is kept (its memory would add to the second read's). A full read (not
        // compact) takes rows in any order and goes on.
        if self.scattered && self.compact {
            return;
        }
        let stat = match self.stats.get(r.stat) {
            Some(s) => *s,
            None => {
                let s = Stat::parse(r.stat);
                self.stats.insert(r.stat.to_string(), s);
                s
            }
        };
        let Some(stat) = stat else { return };
        if r.idx >= IDX_CHECKED {
            let bound = match &self.bound_of {
                Some((shape, b)) if shape == r.shape => *b,
                _ => {
                    let b = idx_bound(r.shape);
                    self.bound_of = Some((r.shape.to_string(), b));
                    b
                }
            };
            if r.idx >= bound {
                self.bad_idx.get_or_insert_with(|| {
                    format!(
                        "a row of {}/{} (compile {}, step {}) has idx {} for stat '{}'; a statistic of a tensor of shape {} has at \
                         most {bound} values (its element count, or 65536 histogram bins): the file is not an opscope recording as \
                         written (edited or corrupted)",
                        r.site, r.role, r.compile, r.step, r.idx, r.stat, r.shape
                    )
                });
                return;
            }
        }
        self.push(Cells {
            site: r.site,
            role: r.role,
            pass: r.pass_idx,
            op: r.op,
            shape: r.shape,
            flops: r.flops,
            compile: r.compile,
            step: r.step,
            stat,
            idx: r.idx,
            value: r.value,
        });
    }

    /// Add a row identified by text.
    fn push(&mut self, c: Cells<'_>) {
        let at = match &self.last {
            Some((at, (site, role, pass, comp, step)))
                if site == c.site && role == c.role && *pass == c.pass && *comp == c.compile && *step == c.step =>
            {
                *at
            }
            _ => {
                if let Some(((si, ri), _)) = self.last {
                    self.end_group(si, ri);
                }
                let at = self.group(&c);
                self.scattered |= self.series[at.0].1.runs[at.1].ended;
                self.last = Some((at, (c.site.to_string(), c.role.to_string(), c.pass, c.compile, c.step)));
                at
            }
        };
        self.add(at, c.stat, c.idx, c.value);
    }

    /// The rows of run `ri` of series `si` ended.
    fn end_group(&mut self, si: usize, ri: usize) {
        let (_, s, runs, sample) = &mut self.series[si];
        let r = &s.runs[ri];
        let e = &mut s.exact.extremes;
        if let Some(v) = r.scalar(tensor::MIN) {
            e.0 = Some(e.0.map_or(v, |m| m.min(v)));
        }
        if let Some(v) = r.scalar(tensor::MAX) {
            e.1 = Some(e.1.map_or(v, |m| m.max(v)));
        }
        s.exact.flops += r.flops(s.flops).unwrap_or(0) as f64;
        s.exact.nonfinite += nonfinite(r);
        if nonfinite(r) > 0.0 {
            s.exact.nonfinite_runs.push((r.compile, r.step));
        }
        if let Some(x) = subnormal_extreme(r) {
            s.exact.subnormal = (s.exact.subnormal.0 + 1, Some(s.exact.subnormal.1.map_or(x, |y| deepest(x, y))));
        }
        s.exact.compiles.insert(r.compile);
        if self.max_runs.is_some() {
            let last = sample.last_ended.entry(r.compile).or_insert(r.step);
            *last = (*last).max(r.step);
        }
        if self.compact {
            // Running sums for `Series::mean_row_energy` and the `chan_maxabs` mean and max.
            let series = super::tensor::parse_shape(&s.shape);
            let shape = s.runs[ri].dims(&series).to_vec();
            if let Some(v) = s.runs[ri].vector(tensor::POS_SUMSQ) {
                let layout = row_layout(&shape);
                let at = match s.row_energy.iter().position(|(d, _)| *d == layout) {
                    Some(at) => at,
                    None => {
                        s.row_energy.push((layout, Vec::new()));
                        s.row_energy.len() - 1
                    }
                };
                accumulate(&mut s.row_energy[at].1, v);
            }
            if let Some(v) = s.runs[ri].vector(tensor::CHAN_MAXABS) {
                accumulate(&mut s.chan_acc, v);
            }
            s.runs[ri].compact(&shape);
        }
        s.runs[ri].ended = true;
        s.runs[ri].shrink();
        if s.runs[ri].sampled_out {
            // Read into the running sums above; not kept. It is the series' last run (a run
            // enters the series when its first row arrives and every row of it comes before
            // the next run's).
            let key = (s.runs[ri].compile, s.runs[ri].step);
            remove_run(s, runs, key);
        }
    }

    /// The error for a row [`Builder::row`] refused (its `idx` out of bound), if any.
    fn check(&self, path: &Path) -> Result<(), Error> {
        match &self.bad_idx {
            Some(reason) => Err(crate::recording::RecordingError { path: path.to_path_buf(), line: None, reason: reason.clone() }.into()),
            None => Ok(()),
        }
    }

    fn finish(mut self) -> BTreeMap<SeriesKey, Series> {
        if let Some(((si, ri), _)) = self.last {
            self.end_group(si, ri);
        }
        self.series
            .into_iter()
            .map(|(k, mut s, _, sample)| {
                s.runs.sort_by_key(|r| (r.compile, r.step));
                s.first_run_shape(sample.first.map(|(_, own)| own));
                (k, s)
            })
            .collect()
    }
}

/// Group in-memory rows into series (rows of statistics no linked pass declares are left out).
pub fn series_from_rows(rows: &[Row]) -> BTreeMap<SeriesKey, Series> {
    let mut b = Builder::default();
    for r in rows {
        b.row(RowRef {
            site: &r.site,
            role: &r.role,
            pass_idx: r.pass_idx,
            op: &r.op,
            shape: &r.shape,
            flops: r.flops,
            compile: r.compile,
            step: r.step,
            stat: &r.stat,
            idx: r.idx,
            value: r.value,
        });
    }
    b.finish()
}

/// Read a recording (CSV, `.csv.gz`, or Parquet with the `parquet` feature) into series,
/// streaming: memory holds the values, not the rows. Rows of statistics no linked pass declares
/// are left out.
///
/// Errors: as [`crate::recording::read_rows`]; a row whose `idx` no statistic of its tensor can
/// have (more than its element count and 65536, the most histogram bins) is a
/// [`crate::recording::RecordingError`] naming it, rather than a vector allocated that long.
pub fn load(path: &Path) -> Result<BTreeMap<SeriesKey, Series>, Error> {
    let mut b = Builder::default();
    read_rows(path, |r| b.row(r))?;
    b.check(path)?;
    Ok(b.finish())
}

/// [`load`] for mining: each run's per-row vectors (`pos_sumsq`, `row_absmax`, one value per row
/// of the tensor) are reduced, as the run's rows end, to the [`RowSummary`] the tensor rules
/// read, and its `chan_maxabs` (one value per channel) to a [`ChanSummary`] plus running
/// per-channel sums and maxima on the series, so memory holds per run what the rules use
/// rather than every row and channel. The verdicts,
/// [`cannot_run`](super::cannot_run) and the exact-repeat rates are those of a full load (the
/// fingerprint hashes the per-row vectors instead of comparing them: equal up to a 2^-64
/// collision); a test checks this on a recording. The per-row energies' mean over runs is kept
/// as running sums ([`Series::mean_row_energy`]). Use [`load`] where each run's per-row vectors
/// themselves are read.
/// Measured on a MiniLM recording: per-row vectors are 80% of a run's values.
///
/// The reduction needs each run's rows of a tensor together, as opscope writes them. A
/// recording whose rows are not (re-sorted or shuffled by another tool: the same table under
/// its key) is read again with [`load`], which takes rows in any order, with a note on stderr;
/// its verdicts are then the same as for the recording in opscope's order.
///
/// Errors: as [`load`].
pub fn load_compact(path: &Path) -> Result<BTreeMap<SeriesKey, Series>, Error> {
    let mut b = Builder { compact: true, ..Builder::default() };
    read_rows(path, |r| b.row(r))?;
    b.check(path)?;
    if b.scattered {
        eprintln!(
            "opscope: note: {} does not keep each run's rows of a tensor together (sorted or shuffled by another tool?): \
             reading it again without the per-run reduction (more memory; the same verdicts)",
            path.display()
        );
        drop(b);
        return load(path);
    }
    Ok(b.finish())
}

/// [`load_compact`] in memory bounded by `max_runs` runs per series and tensor shape, whatever
/// the run count: among a series' runs of one shape (strata: a decoder's prefill `[B, S, C]` and
/// decode `[B, 1, C]` runs of a site are sampled apart, so the shape few runs have is not left
/// out) it keeps the `max_runs` of least [`run_priority`] (a hash of the run's compile and step),
/// a uniform sample without replacement, the same for every series holding the same runs
/// (bottom-k sampling: E. Cohen and H. Kaplan, "Summarizing data using bottom-k sketches", PODC
/// 2007). A series with at most `max_runs` runs of each shape keeps every run, and its verdicts
/// are those of [`load_compact`]. The priorities use the compiles as the reader numbers them: a
/// recording mined alone and inside a dataset with other recordings before it can keep
/// different runs.
///
/// What stays exact over every run: [`Series::runs_seen`], [`Series::range`] (smallest `min`,
/// largest `max`), [`Series::flops_over_runs`] (so the FLOP shares of payoffs),
/// [`Series::nonfinite_over_runs`] (so the NaN/Inf health verdict), [`Series::ran_in`] (so
/// [`no_data`]), the per-channel mean and maximum of `chan_maxabs` and the per-row mean energy
/// (running sums, as in a compact load), and the series' shape (its first run's). What is
/// estimated from the sample: the medians over runs the rules read, across-run trends, the
/// exact-repeat rate (a run repeats when an earlier *kept* run has its fingerprint, so repeats
/// are undercounted), and anything else read from [`Series::runs`]. A median over `n` sampled
/// runs is the `q`-quantile of all runs with `|q - 0.5| <= sqrt(ln(2 / δ) / (2n))` with
/// probability `1 - δ` (the Dvoretzky-Kiefer-Wolfowitz inequality with Massart's constant,
/// 1990): 0.030 at n = 4096 and δ = 1e-3.
///
/// Memory: at most `max_runs` runs per series and shape, the running sums, one priority and run
/// key per kept run, and the compiles per series. A recording that does not list each tensor's
/// runs in step order per compile (a run of a compile arriving at or before one whose rows
/// ended) is read again with [`load_compact`], unsampled (a note on stderr when runs had been
/// left out), so never with more memory than without sampling.
///
/// Errors: as [`load`]; `max_runs` below [`super::MIN_STEPS`] (the across-run rules could not
/// run on any series) is [`Error::BadPath`].
pub fn load_sampled(path: &Path, max_runs: usize) -> Result<BTreeMap<SeriesKey, Series>, Error> {
    if max_runs < super::MIN_STEPS {
        return Err(Error::BadPath {
            path: path.to_path_buf(),
            why: format!(
                "a sample of {max_runs} runs per series is too small: the across-run rules need {} runs; sample at least that many",
                super::MIN_STEPS
            ),
        });
    }
    let mut b = Builder { compact: true, max_runs: Some(max_runs), ..Builder::default() };
    read_rows(path, |r| b.row(r))?;
    b.check(path)?;
    if b.scattered {
        // Read again as `load_compact` reads it (which reads it whole in turn if a run's rows
        // are apart): never more memory than without sampling, the same numbers.
        if b.dropped {
            eprintln!(
                "opscope: note: {} does not list each tensor's runs in step order per compile, each run's rows \
                 together (sorted or shuffled by another tool?): reading it again without sampling runs (memory grows \
                 with the runs)",
                path.display()
            );
        }
        drop(b);
        return load_compact(path);
    }
    Ok(b.finish())
}

/// A note for a recording without its manifest sidecar (`None` when it has one): what
/// [`no_data`] would list (sites skipped or never run) is unknown, so a recording whose sidecar
/// was lost does not read as one where every site ran.
///
/// Errors: as [`read_sidecar`] (a sidecar that exists but does not parse).
pub fn sidecar_note(recording: &Path) -> Result<Option<String>, Error> {
    if read_sidecar(recording)?.is_some() {
        return Ok(None);
    }
    let side = if recording.is_dir() {
        format!("{}/recording=<id>/_manifest.json", recording.display())
    } else {
        crate::recording::sidecar_path(recording).display().to_string()
    };
    Ok(Some(format!("no manifest sidecar ({side}): sites the pipeline skipped, or that never ran, cannot be listed")))
}

/// Sites and roles a recording's manifest lists that have no rows: they never ran (or were
/// skipped, with the manifest's reason). Reads `<recording>.manifest.json` (a dataset: each
/// partition's `_manifest.json`); none without one ([`sidecar_note`] says so).
///
/// Errors: a sidecar that exists but cannot be read or parsed ([`Error::Io`],
/// [`Error::Recording`]), as [`sidecar_note`].
pub fn no_data(recording: &Path, series: &BTreeMap<SeriesKey, Series>) -> Result<Vec<String>, Error> {
    let Some(sidecar) = read_sidecar(recording)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for m in &sidecar.graphs {
        // Recordings made before compiles were numbered per recording carry the tag there.
        let compile = if m.compile == 0 { m.tag } else { m.compile };
        for o in &m.outputs {
            for u in &o.uses {
                let key = (u.site.clone(), u.role.as_str().to_string(), u.pass_idx as u32);
                let ran = series.get(&key).is_some_and(|s| s.ran_in(compile));
                if !ran {
                    out.push(format!("{} (compile {compile}) {}/{}: no data", m.graph, u.site, u.role.as_str()));
                }
            }
        }
        for k in &m.skipped {
            let role = k.role.as_ref().map(|r| r.as_str()).unwrap_or("*");
            out.push(format!("{}/{role}: not sketched: {}", k.site, k.reason));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Sum over runs of `weight(run) * v[i]` / sum of weights, per index, for a vector statistic.
///
/// Returns as many values as the longest run's vector; a non-finite `v[i]` is left out of
/// index `i`'s sums, and an index no run holds a finite value for is NaN. Runs without the
/// statistic are skipped.
pub fn weighted_vector(s: &Series, stat: Stat, weight: impl Fn(&StepStats) -> f64) -> Vec<f64> {
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


/// Runs of a series and how many of them repeat an earlier run exactly, by the values the
/// recording holds for each run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RepeatRate {
    /// Runs of the series.
    pub runs: usize,
    /// Runs whose fingerprint equals an earlier run's (a memo guard with room for every
    /// distinct input would answer these from its cache).
    pub repeats: usize,
    /// Distinct fingerprints.
    pub distinct: usize,
}

impl RepeatRate {
    /// repeats / runs (`None` for a series without runs).
    pub fn rate(&self) -> Option<f64> {
        (self.runs > 0).then(|| self.repeats as f64 / self.runs as f64)
    }
}

/// The exact-repeat rate of a series: a run repeats when every value recorded for it (every
/// scalar and vector statistic, compared as f32 bit patterns) equals those of an earlier run.
/// Over `P` distinct inputs replayed for `T` runs this is `1 - P/T`, the hit rate of a memo
/// guard with room for `P` entries ([`crate::memo::MemoGuard`]).
///
/// What it can see: with `hash` (XXH3-64 of every byte of the tensor) in the recording the
/// rate is exact up to a 2^-64 collision per pair of distinct tensors; with `elemsig` (sampled
/// elements) and `sumsq` two different real tensors almost never share a fingerprint; with
/// `min,max` only, many do, and the rate is an upper bound. `None` when the series holds no statistic that varies with the
/// content: record `matmul{stats=[hash]}`, `matmul{stats=[sumsq,elemsig]}` or the full set.
pub fn repeat_rate(s: &Series) -> Option<RepeatRate> {
    let ids = fingerprints(s)?;
    let distinct = ids.iter().copied().max().map_or(0, |m| m + 1);
    Some(RepeatRate { runs: ids.len(), repeats: ids.len() - distinct, distinct })
}

/// Per run of a series, the id of its fingerprint (ids numbered in order of first appearance;
/// see [`repeat_rate`] for what a fingerprint is). Feeding these ids to a cache simulation
/// ([`crate::memo::predicted_hits`]) predicts a memo guard's hits at any capacity.
/// `None` as for [`repeat_rate`].
pub fn fingerprints(s: &Series) -> Option<Vec<usize>> {
    use std::collections::HashMap;
    let content = [tensor::HASH, tensor::SUMSQ, tensor::ELEMSIG, tensor::L1, tensor::MEAN, tensor::MIN, tensor::MAX];
    if !s.runs.iter().any(|r| content.iter().any(|&c| r.has(c))) {
        return None;
    }
    let mut seen: HashMap<Vec<u32>, usize> = HashMap::new();
    let mut ids = Vec::with_capacity(s.runs.len());
    for r in &s.runs {
        let mut key: Vec<u32> = Vec::new();
        let mut scalars = r.scalars.clone();
        scalars.sort_by_key(|(st, _)| st.as_str());
        for (st, v) in &scalars {
            key.extend(st.as_str().bytes().map(u32::from));
            key.push(v.to_bits());
        }
        let mut vectors: Vec<&(Stat, Vec<f32>)> = r.vectors.iter().collect();
        vectors.sort_by_key(|(st, _)| st.as_str());
        for (st, v) in vectors {
            key.extend(st.as_str().bytes().map(u32::from));
            key.push(v.len() as u32);
            key.extend(v.iter().map(|x| x.to_bits()));
        }
        // A compact load's per-row and per-channel vectors, by their hashes (a run of a series
        // is either all compact or all full, so runs compare like with like).
        if let Some(rows) = &r.rows {
            key.extend(b"rows".iter().map(|&b| u32::from(b)));
            key.extend([rows.hash as u32, (rows.hash >> 32) as u32]);
        }
        if let Some(ch) = &r.chans {
            key.extend(b"chans".iter().map(|&b| u32::from(b)));
            key.extend([ch.hash as u32, (ch.hash >> 32) as u32]);
        }
        let next = seen.len();
        ids.push(*seen.entry(key).or_insert(next));
    }
    Some(ids)
}
