//! The HTML report summarises the whole recording. Its numbers (embedded as JSON next to the
//! plots they are drawn from) are checked against an independent computation from the raw rows
//! of real MiniLM recordings (`opscope::recording::read_rows`, plain loops here; numpy for the
//! re-binned histogram), the site table against the graph order of the manifest, and the plots'
//! SVG against what they must show: gaps for omitted rows, a visible bar for a single value.
//! The overview the page opens on: one row per site in execution order, heatmap cells against
//! the rows, roofline points against the `opscope cost --json` they were drawn from, and the
//! page with and without a cost.
//! (Rendering in a real browser: scripts/report-screenshot.sh.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use opscope::Row;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Recordings and the report, through the CLI as a user runs them.

/// A MiniLM recording of 18 sentences in batches of 4 (4 full batches and a last one of 2, its
/// own compile: 5 runs, 2 compiles) with `pipeline`, and its report.
struct Recorded {
    _dir: tempfile::TempDir,
    recording: PathBuf,
    html: String,
}

fn record_and_report(pipeline: &str) -> Recorded {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("r.csv.gz");
    let out = Command::new(env!("CARGO_BIN_EXE_opscope"))
        .arg("record")
        .args(["--onnx".as_ref(), a.onnx.as_os_str(), "--tokenizer".as_ref(), a.tokenizer.as_os_str(), "--text".as_ref(), a.text.as_os_str()])
        .args(["--limit", "18", "--batch", "4", "--seq", "32", "--pipeline", pipeline, "--out"])
        .arg(&recording)
        .output()
        .unwrap();
    assert!(out.status.success(), "record: {}", String::from_utf8_lossy(&out.stderr));
    let html_path = dir.path().join("r.html");
    let out = Command::new(env!("CARGO_BIN_EXE_opscope")).arg("report").arg(&recording).arg("-o").arg(&html_path).output().unwrap();
    assert!(out.status.success(), "report: {}", String::from_utf8_lossy(&out.stderr));
    let html = std::fs::read_to_string(&html_path).unwrap();
    Recorded { _dir: dir, recording, html }
}

/// Fixed histogram range (runs merge exactly), matmul and attention probe.
fn fixed() -> &'static Recorded {
    static R: OnceLock<Recorded> = OnceLock::new();
    R.get_or_init(|| record_and_report("matmul{hist_bins=64,hist_range=-256:256},attn"))
}

/// Default per-run absmax range (runs are re-binned onto a common range).
fn absmax_range() -> &'static Recorded {
    static R: OnceLock<Recorded> = OnceLock::new();
    R.get_or_init(|| record_and_report("matmul{roles=[lhs,out]}"))
}

/// The JSON block the report embeds.
fn embedded(html: &str) -> Value {
    let open = r#"<script type="application/json" id="opscope-data">"#;
    let start = html.find(open).expect("the report embeds its data") + open.len();
    let end = start + html[start..].find("</script>").unwrap();
    serde_json::from_str(&html[start..end]).unwrap()
}

/// The `<figure>` of plot `kind` of the series at `anchor`, if drawn.
fn figure<'a>(html: &'a str, kind: &str, anchor: &str) -> Option<&'a str> {
    let open = format!(r#"<figure class="plot" data-plot="{kind}" data-series="{anchor}">"#);
    let start = html.find(&open)?;
    let end = start + html[start..].find("</figure>").unwrap();
    Some(&html[start..end])
}

/// Values of attribute `name` of every `<tag ...>` element in `svg` whose attributes contain
/// `with` (e.g. a fill colour).
fn elements<'a>(svg: &'a str, tag: &str, with: &str) -> Vec<&'a str> {
    svg.match_indices(&format!("<{tag} "))
        .map(|(i, _)| &svg[i..i + svg[i..].find('>').unwrap()])
        .filter(|e| e.contains(with))
        .collect()
}

/// Points of a `<polyline>` element.
fn points(polyline: &str) -> usize {
    let i = polyline.find(" points=\"").unwrap() + " points=\"".len();
    polyline[i..i + polyline[i..].find('"').unwrap()].split_whitespace().count()
}

fn attr(element: &str, name: &str) -> f64 {
    let key = format!(" {name}=\"");
    let i = element.find(&key).unwrap_or_else(|| panic!("{name} in {element}")) + key.len();
    element[i..i + element[i..].find('"').unwrap()].parse().unwrap()
}

// ---------------------------------------------------------------------------------------------
// The independent reference: every statistic of every run, straight from the rows.

type Key = (String, String, u32);

#[derive(Default)]
struct RunRef {
    scalars: BTreeMap<String, f64>,
    vectors: BTreeMap<String, BTreeMap<u64, f64>>,
}

#[derive(Default)]
struct SeriesRef {
    first_row: usize,
    shape: String,
    runs: BTreeMap<(u32, u64), RunRef>,
}

const VECTORS: [&str; 10] = ["hist", "chan_maxabs", "pos_sumsq", "peak", "entropy_norm", "topk_mass", "sink_first", "sink_last", "recv_max", "cos_row"];

fn reference(path: &Path) -> BTreeMap<Key, SeriesRef> {
    let mut out: BTreeMap<Key, SeriesRef> = BTreeMap::new();
    let mut n = 0usize;
    opscope::recording::read_rows(path, |r| {
        let key = (r.site.to_string(), r.role.to_string(), r.pass_idx);
        let s = out.entry(key).or_insert_with(|| SeriesRef { first_row: n, shape: r.shape.to_string(), ..Default::default() });
        let run = s.runs.entry((r.compile, r.step)).or_default();
        if VECTORS.contains(&r.stat) {
            run.vectors.entry(r.stat.to_string()).or_default().insert(r.idx, r.value as f64);
        } else if r.idx == 0 {
            run.scalars.insert(r.stat.to_string(), r.value as f64);
        }
        n += 1;
    })
    .unwrap();
    out
}

impl SeriesRef {
    fn scalars<'a>(&'a self, stat: &'a str) -> impl Iterator<Item = f64> + 'a {
        self.runs.values().filter_map(move |r| r.scalars.get(stat).copied())
    }
    fn absmax_of(r: &RunRef) -> Option<f64> {
        Some(r.scalars.get("min")?.abs().max(r.scalars.get("max")?.abs()))
    }
    fn absmax(&self) -> Option<f64> {
        self.runs.values().filter_map(Self::absmax_of).reduce(f64::max)
    }
    fn rms(&self) -> Option<f64> {
        let (mut q, mut c) = (0.0, 0.0);
        for r in self.runs.values() {
            if let (Some(a), Some(b)) = (r.scalars.get("sumsq"), r.scalars.get("count")) {
                q += a;
                c += b;
            }
        }
        (c > 0.0).then(|| (q / c).sqrt())
    }
    /// The upper median of the per-run kurtosis (the miner's median).
    fn kurtosis(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.scalars("kurtosis").collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied()
    }
    fn nonfinite(&self) -> Option<f64> {
        ["nan_count", "posinf_count", "neginf_count"].iter().flat_map(|k| self.scalars(k)).reduce(|a, b| a + b)
    }
    /// Per index: the values of `stat` over the runs that recorded it.
    fn by_index(&self, stat: &str) -> BTreeMap<u64, Vec<(f64, &RunRef)>> {
        let mut m: BTreeMap<u64, Vec<(f64, &RunRef)>> = BTreeMap::new();
        for r in self.runs.values() {
            for (&i, &x) in r.vectors.get(stat).into_iter().flatten() {
                m.entry(i).or_default().push((x, r));
            }
        }
        m
    }
    /// Per index 0..len: weighted mean over the runs that recorded it (NaN where none did).
    fn mean(&self, stat: &str, len: usize, weight: impl Fn(&RunRef) -> f64) -> Vec<f64> {
        let m = self.by_index(stat);
        (0..len as u64)
            .map(|i| match m.get(&i) {
                Some(v) => v.iter().map(|(x, r)| weight(r) * x).sum::<f64>() / v.iter().map(|(_, r)| weight(r)).sum::<f64>(),
                None => f64::NAN,
            })
            .collect()
    }
    fn len(&self, stat: &str) -> usize {
        self.by_index(stat).keys().last().map_or(0, |i| *i as usize + 1)
    }
    fn rows_of_shape(&self) -> usize {
        let d: Vec<usize> = self.shape.trim_matches(|c| c == '[' || c == ']').split(',').map(|x| x.parse().unwrap()).collect();
        d[..d.len() - 1].iter().product()
    }
}

/// Max-pool to at most 512 points: point i is the largest finite value of elements i*step ..
/// (i+1)*step, NaN when none is finite.
fn pooled(v: &[f64]) -> Vec<f64> {
    let step = v.len().div_ceil(512).max(1);
    v.chunks(step).map(|c| c.iter().copied().filter(|x| x.is_finite()).fold(f64::NAN, f64::max)).collect()
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got.is_nan() && want.is_nan()) || (got - want).abs() <= tol * want.abs().max(1e-30)
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn nums(v: &Value) -> Vec<f64> {
    v.as_array().unwrap_or_else(|| panic!("array: {v}")).iter().map(num).collect()
}

fn assert_all_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(close(*g, *w, tol), "{what}[{i}]: report {g}, rows {w}");
    }
}

fn key_of(s: &Value) -> Key {
    (s["site"].as_str().unwrap().to_string(), s["role"].as_str().unwrap().to_string(), s["pass_idx"].as_u64().unwrap() as u32)
}

// ---------------------------------------------------------------------------------------------

#[test]
fn report_numbers_are_those_of_all_runs() {
    let rec = fixed();
    let data = embedded(&rec.html);
    let refs = reference(&rec.recording);
    assert_eq!(data["runs"], 5, "4 full batches and the last partial one");
    assert_eq!(data["compiles"], 2);
    let series = data["series"].as_array().unwrap();
    assert_eq!(series.len(), refs.len(), "every series of the recording is reported");
    let (mut last_differs, mut probes, mut hist_checked) = (0, 0, 0);
    for s in series {
        let key = key_of(s);
        let r = &refs[&key];
        let what = format!("{key:?}");
        assert_eq!(s["runs"].as_u64().unwrap() as usize, r.runs.len(), "{what}");
        if r.runs.values().any(|x| x.scalars.contains_key("count")) {
            assert!(close(num(&s["absmax"]), r.absmax().unwrap(), 1e-12), "{what}: absmax {} vs {:?}", s["absmax"], r.absmax());
            assert!(close(num(&s["rms"]), r.rms().unwrap(), 1e-9), "{what}: rms {} vs {:?}", s["rms"], r.rms());
            assert!(close(num(&s["kurtosis"]), r.kurtosis().unwrap(), 1e-12), "{what}: kurtosis");
            assert_eq!(s["nonfinite"].as_f64(), r.nonfinite(), "{what}: NaN/Inf");
            // Runs that recorded the same statistics (weights, once per compile) get no per-run
            // plots; every activation here varies.
            let runs: Vec<&RunRef> = r.runs.values().collect();
            let identical = runs.len() >= 2
                && runs.windows(2).all(|w| {
                    ["min", "max", "sumsq", "count", "nan_count", "posinf_count", "neginf_count"].iter().all(|k| w[0].scalars.get(*k) == w[1].scalars.get(*k))
                        && ["hist", "chan_maxabs"].iter().all(|k| w[0].vectors.get(*k) == w[1].vectors.get(*k))
                });
            assert_eq!(s["runs_identical"], identical, "{what}");
            assert_eq!(identical, key.1 == "rhs" && !key.0.contains("attention/self/MatMul"), "{what}: weights only");
            assert_eq!(figure(&rec.html, "trend", s["anchor"].as_str().unwrap()).is_none(), identical, "{what}");
            // The last run alone would give other numbers (so this test can tell).
            let last = r.runs.values().last().unwrap();
            if r.runs.len() > 1 && SeriesRef::absmax_of(last) != r.absmax() {
                last_differs += 1;
            }

            // Histogram: one fixed range, so the runs merge exactly by summing counts.
            let h = &s["hist"];
            assert_eq!(h["exact"], true, "{what}");
            assert_eq!((num(&h["lo"]), num(&h["hi"])), (-256.0, 256.0), "{what}");
            let mut want = vec![0.0; 64];
            for (i, v) in r.by_index("hist") {
                want[i as usize] = v.iter().map(|x| x.0).sum();
            }
            assert_eq!(nums(&h["counts"]), want, "{what}: merged histogram");
            assert_eq!(num(&h["outside"]), r.scalars("hist_outside").sum::<f64>(), "{what}");
            assert_eq!(h["runs"].as_u64().unwrap() as usize, r.runs.len(), "{what}");
            hist_checked += 1;

            // Per channel: max and mean over runs; outlier channels above 8x the (upper) median
            // channel of the max.
            let c = r.len("chan_maxabs");
            let by = r.by_index("chan_maxabs");
            let max: Vec<f64> = (0..c as u64).map(|i| by[&i].iter().map(|x| x.0).fold(f64::NAN, f64::max)).collect();
            let mean = r.mean("chan_maxabs", c, |_| 1.0);
            let ch = &s["chan_maxabs"];
            assert_eq!(ch["max"]["len"].as_u64().unwrap() as usize, c, "{what}");
            assert_all_close(&format!("{what} chan max"), &nums(&ch["max"]["values"]), &pooled(&max), 1e-6);
            assert_all_close(&format!("{what} chan mean"), &nums(&ch["mean"]["values"]), &pooled(&mean), 1e-6);
            let mut sorted = max.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let line = 8.0 * sorted[sorted.len() / 2];
            let outliers: Vec<u64> = (0..c as u64).filter(|&i| max[i as usize] > line).collect();
            let got: Vec<u64> = s["outlier_channels"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
            assert_eq!(got, outliers, "{what}: outlier channels");
            assert_eq!(s["channels"].as_u64().unwrap() as usize, c);

            // Per row: the mean over the runs that recorded the row; rows no run recorded
            // (padding) are null.
            let rows = r.len("pos_sumsq").max(r.rows_of_shape());
            let want = r.mean("pos_sumsq", rows, |_| 1.0);
            assert_all_close(&format!("{what} per-row energy"), &nums(&s["pos_sumsq_mean"]["values"]), &pooled(&want), 1e-6);
        } else {
            // Attention probe: per head, the mean over every non-padding query of all runs.
            probes += 1;
            assert_eq!(s["runs_identical"], false, "{what}: a probe has no per-run tensor statistics to compare");
            let q = |x: &RunRef| x.scalars["queries"];
            for stat in ["peak", "entropy_norm", "topk_mass", "sink_first", "sink_last", "recv_max"] {
                let h = r.len(stat);
                assert_eq!(h, 12, "{what} {stat}: MiniLM has 12 heads");
                let want = r.mean(stat, h, q);
                assert_all_close(&format!("{what} {stat}"), &nums(&s["probes"][stat]), &want, 1e-9);
                let last = r.runs.values().last().unwrap();
                let last_only: Vec<f64> = (0..h as u64).map(|i| last.vectors[stat][&i]).collect();
                assert!(want.iter().zip(&last_only).any(|(a, b)| (a - b).abs() > 1e-4), "{what} {stat}: the last run alone differs");
            }
        }
    }
    assert_eq!(probes, 3, "one attention probe per layer");
    assert!(hist_checked >= 60 && last_differs >= 20, "{hist_checked} histograms, {last_differs} series whose last run differs");
    // What the table shows is what the JSON holds.
    for s in series.iter().filter(|s| !s["absmax"].is_null()) {
        let anchor = s["anchor"].as_str().unwrap();
        let row_start = rec.html.find(&format!(r#"<tr data-series="{anchor}">"#)).unwrap();
        let row = &rec.html[row_start..row_start + rec.html[row_start..].find("</tr>").unwrap()];
        assert!(row.contains(&format!(">{}<", opscope_lab::report::num(num(&s["absmax"])))), "{row}");
    }
}

#[test]
fn histograms_with_per_run_ranges_are_rebinned_as_numpy_does() {
    // Per-run absmax ranges differ: each run's counts are spread onto the common range assuming
    // values uniform within a bin, i.e. its cumulative count interpolated linearly at the new
    // edges (np.interp), independent of the report's overlap arithmetic.
    let rec = absmax_range();
    let data = embedded(&rec.html);
    let refs = reference(&rec.recording);
    let mut runs_json = Vec::new();
    let mut expect = Vec::new();
    for s in data["series"].as_array().unwrap() {
        let r = &refs[&key_of(s)];
        let runs: Vec<Value> = r
            .runs
            .values()
            .map(|x| {
                let h = &x.vectors["hist"];
                serde_json::json!({"lo": x.scalars["hist_lo"], "hi": x.scalars["hist_hi"], "counts": (0..h.len() as u64).map(|i| h[&i]).collect::<Vec<f64>>()})
            })
            .collect();
        runs_json.push(serde_json::json!({"runs": runs, "bins": 32}));
        expect.push(s["hist"].clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("runs.json");
    std::fs::write(&input, serde_json::to_vec(&runs_json).unwrap()).unwrap();
    let code = r#"
import json, sys
import numpy as np
out = []
for s in json.load(open(sys.argv[1])):
    lo = min(r["lo"] for r in s["runs"]); hi = max(r["hi"] for r in s["runs"])
    edges = np.linspace(lo, hi, s["bins"] + 1)
    total = np.zeros(s["bins"])
    for r in s["runs"]:
        c = np.asarray(r["counts"], dtype=np.float64)
        src = np.linspace(r["lo"], r["hi"], len(c) + 1)
        cdf = np.concatenate([[0.0], np.cumsum(c)])
        total += np.diff(np.interp(edges, src, cdf))
    out.append({"lo": lo, "hi": hi, "counts": total.tolist()})
print(json.dumps(out))
"#;
    let out = Command::new("python3").args(["-c", code]).arg(&input).output().expect("python3 runs");
    assert!(out.status.success(), "numpy reference failed (pip install -r scripts/requirements-test.txt): {}", String::from_utf8_lossy(&out.stderr));
    let want: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(want.len(), expect.len());
    let mut rebinned = 0;
    for ((got, want), runs) in expect.iter().zip(&want).zip(&runs_json) {
        let ranges: BTreeSet<String> = runs["runs"].as_array().unwrap().iter().map(|r| format!("{} {}", r["lo"], r["hi"])).collect();
        assert_eq!(got["exact"], ranges.len() == 1, "exact only when every run had the same range");
        rebinned += (ranges.len() > 1) as usize;
        assert_eq!((num(&got["lo"]), num(&got["hi"])), (num(&want["lo"]), num(&want["hi"])));
        let (g, w) = (nums(&got["counts"]), nums(&want["counts"]));
        let total: f64 = w.iter().sum();
        assert_eq!(g.len(), w.len(), "re-binned counts {g:?} vs numpy {w:?}: length");
        for (a, b) in g.iter().zip(&w) {
            assert!((a - b).abs() <= 1e-9 * total, "re-binned counts {g:?} vs numpy {w:?}");
        }
    }
    assert!(rebinned >= 40, "{rebinned} series re-binned");
    assert_eq!(rec.html.matches("<b>Re-binned: </b>").count(), rebinned, "the caption says when a histogram was re-binned");
}

#[test]
fn the_site_table_is_in_execution_order() {
    let rec = fixed();
    let data = embedded(&rec.html);
    let refs = reference(&rec.recording);
    // Expected: by the site's node in the first compile's manifest (graph order), then by first
    // appearance in the recording (RLX fuses Q, K and V into one node).
    let sidecar: Value = serde_json::from_slice(&std::fs::read(opscope::recording::sidecar_path(&rec.recording)).unwrap()).unwrap();
    let mut node: BTreeMap<(String, u32), u64> = BTreeMap::new();
    for site in sidecar["graphs"][0]["sites"].as_array().unwrap() {
        node.insert((site["site"].as_str().unwrap().to_string(), site["pass_idx"].as_u64().unwrap() as u32), site["node"].as_u64().unwrap());
    }
    let mut want: Vec<&Key> = refs.keys().collect();
    want.sort_by_key(|k| (node[&(k.0.clone(), k.2)], refs[*k].first_row));
    let got: Vec<Key> = data["series"].as_array().unwrap().iter().map(key_of).collect();
    assert_eq!(got.iter().collect::<Vec<_>>(), want, "JSON order");
    // The table rows link to the sections in that order, and every link has its target.
    let anchors: Vec<&str> = data["series"].as_array().unwrap().iter().map(|s| s["anchor"].as_str().unwrap()).collect();
    let rows: Vec<&str> = rec.html.match_indices(r#"<tr data-series=""#).map(|(i, m)| &rec.html[i + m.len()..i + m.len() + rec.html[i + m.len()..].find('"').unwrap()]).collect();
    assert_eq!(rows, anchors, "table order");
    for (i, m) in rec.html.match_indices(r##"href="#"##) {
        let target = &rec.html[i + m.len()..i + m.len() + rec.html[i + m.len()..].find('"').unwrap()];
        assert!(rec.html.contains(&format!(r#"id="{target}""#)), "link #{target} has a target");
    }
    // Not alphabetical: layer 0's query projection comes before its key projection, and the
    // attention probe sits between the scores matmul and the context matmul.
    let mut alphabetical = got.clone();
    alphabetical.sort();
    assert_ne!(got, alphabetical);
    let pos = |suffix: &str, role: &str| got.iter().position(|k| k.0.ends_with(suffix) && k.1 == role).unwrap();
    assert!(pos("layer.0/attention/self/query/MatMul", "lhs") < pos("layer.0/attention/self/key/MatMul", "lhs"));
    assert!(pos("layer.0/attention/self/MatMul", "out") < pos("layer.0/attention/self/Softmax", "probs"));
    assert!(pos("layer.0/attention/self/Softmax", "probs") < pos("layer.0/attention/self/MatMul_1", "lhs"));
    assert!(pos("layer.0/output/dense/MatMul", "out") < pos("layer.1/attention/self/query/MatMul", "lhs"));
}

#[test]
fn the_report_opens_with_header_contents_and_grouped_verdicts() {
    let rec = fixed();
    let html = &rec.html;
    let sidecar = opscope::recording::read_sidecar(&rec.recording).unwrap().unwrap();
    let header = &html[..html.find("<nav>").expect("a contents list")];
    for m in &sidecar.graphs {
        assert!(header.contains(&m.graph), "graph {} named in the header", m.graph);
    }
    assert!(header.contains("matmul{hist_bins=64,hist_range=-256:256},attn"), "pipeline in the header");
    assert!(header.contains("5 run(s) (executions) in 2 compile(s)"), "{header}");
    // Order of the page: header, overview, contents, site table, verdicts, notes, plots.
    let at = |s: &str| html.find(s).unwrap_or_else(|| panic!("{s}"));
    assert!(at("</header>") < at(r#"id="overview""#) && at(r#"id="overview""#) < at("<nav>"));
    assert!(at("<nav>") < at(r#"id="sites""#) && at(r#"id="sites""#) < at(r#"id="verdicts""#));
    assert!(at(r#"id="verdicts""#) < at(r#"id="notes""#) && at(r#"id="notes""#) < at(r#"id="plots""#));
    // Verdicts: short site names (no common prefix), each kind's rule and source once.
    let series = opscope::mine::load(&rec.recording).unwrap();
    let verdicts = opscope::mine::mine(&series);
    let prefix = embedded(html)["prefix"].as_str().unwrap().to_string();
    assert!(prefix.ends_with('/') && prefix.len() > 10, "{prefix}");
    let section = &html[at(r#"id="verdicts""#)..at(r#"id="notes""#)];
    assert!(!section.contains(&format!(">{prefix}")), "verdict sites are shown without the prefix");
    let kinds: BTreeSet<String> = verdicts.iter().map(|v| v.kind.to_string()).collect();
    assert!(kinds.len() >= 3);
    for v in &verdicts {
        assert!(section.contains(&maud::html! { (v.rule) }.into_string()), "rule of {}", v.kind);
        assert!(section.contains(&maud::html! { (v.source) }.into_string()), "source of {}", v.kind);
    }
    assert_eq!(section.matches("<b>rule: </b>").count(), verdicts.iter().map(|v| (v.kind.name, v.rule, v.source)).collect::<BTreeSet<_>>().len());
    assert!(!html.contains("last run"), "nothing is summarised from the last run");
}

/// Rows of one synthetic series (site `s`, role `out`).
fn row(step: u64, stat: &str, idx: u64, value: f32) -> Row {
    Row {
        run_id: Arc::from("r"),
        compile: 1,
        step,
        graph: Arc::from("g"),
        pass: Arc::from("matmul"),
        pass_idx: 0,
        site: Arc::from("s"),
        op: Arc::from("matmul"),
        role: Arc::from("out"),
        stat: Arc::from(stat),
        idx,
        value,
        numel: Some(8),
        shape: Arc::from("[8,1]"),
        flops: None,
    }
}

fn render(rows: &[Row]) -> String {
    let series = opscope::mine::series_from_rows(rows);
    opscope_lab::report::render(&opscope_lab::report::Input { title: "t", manifests: &[], series: &series, verdicts: &[], notes: &[], cost: None, time: None }).unwrap()
}

const LINE: &str = r##"stroke="#1F77B4""##;
const BAR: &str = r##"fill="#1F77B4""##;

#[test]
fn omitted_rows_are_gaps_in_the_per_row_plot() {
    // Rows 2, 3 and 5 are never recorded (padding), row 7 is the last of the shape [8,1]: the
    // line has segments [0, 1] and [4], and [6]; the lone rows are dots, no line crosses a gap.
    let mut rows = Vec::new();
    for step in 0..2 {
        rows.push(row(step, "count", 0, 5.0));
        for (i, v) in [(0, 1.0), (1, 2.0), (4, 3.0), (6, 4.0)] {
            rows.push(row(step, "pos_sumsq", i, v + step as f32));
        }
    }
    let html = render(&rows);
    let data = embedded(&html);
    let s = &data["series"][0];
    assert_eq!(nums(&s["pos_sumsq_mean"]["values"]).iter().map(|x| x.is_finite()).collect::<Vec<_>>(), [true, true, false, false, true, false, true, false]);
    let fig = figure(&html, "pos_sumsq", s["anchor"].as_str().unwrap()).expect("a per-row plot");
    let lines = elements(fig, "polyline", LINE);
    assert_eq!(lines.len(), 1, "one two-point segment: {fig}");
    assert_eq!(points(lines[0]), 2);
    assert_eq!(elements(fig, "circle", BAR).len(), 2, "rows 4 and 6 alone are dots");
    assert!(fig.contains("are gaps"), "the caption says so");

    // On MiniLM: every per-row plot has as many line pieces as the mean has finite runs.
    let rec = fixed();
    let data = embedded(&rec.html);
    let mut with_gaps = 0;
    for s in data["series"].as_array().unwrap().iter().filter(|s| !s["pos_sumsq_mean"].is_null()) {
        let v = nums(&s["pos_sumsq_mean"]["values"]);
        let runs: Vec<usize> = v.split(|x| !x.is_finite()).map(|r| r.len()).filter(|&n| n > 0).collect();
        let fig = figure(&rec.html, "pos_sumsq", s["anchor"].as_str().unwrap()).unwrap();
        let pieces: Vec<usize> = elements(fig, "polyline", LINE).iter().map(|l| points(l)).collect();
        let dots = elements(fig, "circle", BAR).len();
        assert_eq!(pieces.len() + dots, runs.len(), "{}: one piece per run of finite rows", s["anchor"]);
        assert_eq!(pieces.iter().sum::<usize>() + dots, runs.iter().sum::<usize>(), "{}", s["anchor"]);
        with_gaps += (runs.len() > 1) as usize;
    }
    assert!(with_gaps >= 20, "padding rows make gaps in the activations' plots ({with_gaps})");
}

#[test]
fn a_single_value_in_a_bin_is_a_visible_bar() {
    // 10^6 values in one bin and a single outlier at the far end: on the log axis the outlier's
    // bar must be drawn and tall enough to see; empty bins draw nothing.
    let mut rows = Vec::new();
    rows.push(row(0, "count", 0, 1e6 + 1.0));
    rows.extend([row(0, "hist_lo", 0, -1.0), row(0, "hist_hi", 0, 1.0)]);
    for i in 0..16 {
        rows.push(row(0, "hist", i, match i {
            7 => 1e6,
            15 => 1.0,
            _ => 0.0,
        }));
    }
    let html = render(&rows);
    let data = embedded(&html);
    let fig = figure(&html, "hist", data["series"][0]["anchor"].as_str().unwrap()).expect("a histogram");
    let bars = elements(fig, "rect", BAR);
    assert_eq!(bars.len(), 2, "{fig}");
    let (big, one) = (attr(bars[0], "height"), attr(bars[1], "height"));
    assert!(one >= 5.0 && big > one, "the bar of count 1 is {one}px (the other {big}px)");
    assert!(attr(bars[1], "x") > attr(bars[0], "x"));

    // On MiniLM: every non-empty bin of every merged histogram has a bar.
    let rec = fixed();
    let data = embedded(&rec.html);
    let mut singles = 0;
    for s in data["series"].as_array().unwrap().iter().filter(|s| !s["hist"].is_null()) {
        let counts = nums(&s["hist"]["counts"]);
        let fig = figure(&rec.html, "hist", s["anchor"].as_str().unwrap()).unwrap();
        let bars = elements(fig, "rect", BAR);
        assert_eq!(bars.len(), counts.iter().filter(|&&c| c > 0.0).count(), "{}", s["anchor"]);
        assert!(bars.iter().all(|b| attr(b, "height") >= 5.0), "{}", s["anchor"]);
        singles += counts.iter().filter(|&&c| c == 1.0).count();
    }
    assert!(singles > 0, "the recording has bins holding one value");
}

#[test]
fn per_head_plots_are_bars_on_a_zero_baseline() {
    let rec = fixed();
    let data = embedded(&rec.html);
    let s = data["series"].as_array().unwrap().iter().find(|s| s["role"] == "probs").unwrap();
    let anchor = s["anchor"].as_str().unwrap();
    for stat in ["peak", "sink_first", "topk_mass"] {
        let fig = figure(&rec.html, &format!("probe:{stat}"), anchor).unwrap();
        let bars = elements(fig, "rect", BAR);
        assert_eq!(bars.len(), 12, "a bar per head");
        // Every bar starts at the same baseline, and the values are proportional to the
        // heights (the baseline is 0, not the smallest value).
        let bottom = |b: &&str| attr(b, "y") + attr(b, "height");
        assert!(bars.iter().all(|b| (bottom(b) - bottom(&bars[0])).abs() <= 1.0));
        let v = nums(&s["probes"][stat]);
        assert_eq!(v.len(), bars.len(), "{stat}: a value per bar");
        let (hmax, vmax) = (bars.iter().map(|b| attr(b, "height")).fold(0.0, f64::max), v.iter().copied().fold(0.0, f64::max));
        for (b, x) in bars.iter().zip(&v) {
            assert!((attr(b, "height") - x / vmax * hmax).abs() <= 2.0, "{stat}: height {} for {x}", attr(b, "height"));
        }
    }
}

#[test]
fn names_are_escaped_and_the_page_is_self_contained() {
    let mut rows: Vec<Row> = (0..3).flat_map(|s| [row(s, "count", 0, 8.0), row(s, "min", 0, -1.0), row(s, "max", 0, 2.0)]).collect();
    for r in &mut rows {
        r.site = Arc::from("odd<site>&\"name\"</script>");
    }
    let html = render(&rows);
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.contains("odd&lt;site&gt;&amp;&quot;name&quot;") && !html.contains("odd<site>"), "names are escaped in HTML");
    assert_eq!(html.matches("<script").count(), 1, "only the data block");
    assert_eq!(html.matches("</script>").count(), 1, "a name cannot close the data block");
    assert_eq!(embedded(&html)["series"][0]["site"], "odd<site>&\"name\"</script>", "and round-trips through JSON");
    assert!(!html.contains("src=") && !html.contains("href=\"http") && !html.contains("url("), "nothing is fetched");
}

#[test]
fn probe_series_without_plottable_data_get_none() {
    // A residual probe series with only scalars has nothing to plot (an empty axis once hung
    // plotters); the attention series gets its per-head bars.
    let probe = |site: &str, role: &str, stat: &str, idx: u64, value: f32, step: u64| Row {
        site: Arc::from(site),
        role: Arc::from(role),
        op: Arc::from("softmax"),
        stat: Arc::from(stat),
        shape: Arc::from("[1,2,4,4]"),
        ..row(step, stat, idx, value)
    };
    let mut rows = Vec::new();
    for step in 0..3 {
        rows.push(probe("attn.0", "probs", "queries", 0, 4.0, step));
        rows.extend((0..2).map(|h| probe("attn.0", "probs", "peak", h, 0.5 + 0.1 * h as f32, step)));
        rows.push(probe("block.0", "block", "rows", 0, 4.0, step));
        rows.push(probe("block.0", "block", "cos", 0, 0.9, step));
    }
    let html = render(&rows);
    assert_eq!(html.matches("<svg").count(), 1, "{html}");
    assert!(html.contains(r#"data-plot="probe:peak""#) && html.contains("Nothing to plot"));
}

// ---------------------------------------------------------------------------------------------
// The overview.

/// The `fixed()` recording's report again, with the cost of its model (`opscope cost --json`,
/// small probes), and the overview written with `--json`.
struct Costed {
    dir: tempfile::TempDir,
    cost_path: PathBuf,
    cost: Value,
    html: String,
    overview: Value,
}

fn opscope(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_opscope")).args(args).output().unwrap()
}

fn costed() -> &'static Costed {
    static C: OnceLock<Costed> = OnceLock::new();
    C.get_or_init(|| {
        let rec = fixed();
        let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::tempdir().unwrap();
        let cost_path = dir.path().join("cost.json");
        let out = Command::new(env!("CARGO_BIN_EXE_opscope"))
            .arg("cost")
            .args(["--onnx".as_ref(), a.onnx.as_os_str(), "--tokenizer".as_ref(), a.tokenizer.as_os_str(), "--text".as_ref(), a.text.as_os_str()])
            .args(["--limit", "18", "--batch", "4", "--seq", "32", "--probe-mib", "16", "--probe-gemm", "256", "--json"])
            .arg(&cost_path)
            .output()
            .unwrap();
        assert!(out.status.success(), "cost: {}", String::from_utf8_lossy(&out.stderr));
        let (html_path, json_path) = (dir.path().join("c.html"), dir.path().join("overview.json"));
        let out = opscope(&["report".as_ref(), rec.recording.as_os_str(), "--cost".as_ref(), cost_path.as_os_str(), "-o".as_ref(), html_path.as_os_str(), "--json".as_ref(), json_path.as_os_str()]);
        assert!(out.status.success(), "report --cost: {}", String::from_utf8_lossy(&out.stderr));
        Costed {
            cost: serde_json::from_slice(&std::fs::read(&cost_path).unwrap()).unwrap(),
            html: std::fs::read_to_string(&html_path).unwrap(),
            overview: serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap(),
            cost_path,
            dir,
        }
    })
}

/// The sites of a recording in execution order, from the rows and the manifest alone: by the
/// site's node in the first compile's manifest, then by the first row of any of its series.
fn sites_in_execution_order(recording: &Path) -> Vec<String> {
    let refs = reference(recording);
    let sidecar: Value = serde_json::from_slice(&std::fs::read(opscope::recording::sidecar_path(recording)).unwrap()).unwrap();
    let mut node: BTreeMap<String, u64> = BTreeMap::new();
    for site in sidecar["graphs"][0]["sites"].as_array().unwrap() {
        node.entry(site["site"].as_str().unwrap().to_string()).or_insert(site["node"].as_u64().unwrap());
    }
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    for (k, s) in &refs {
        let e = first.entry(k.0.as_str()).or_insert(usize::MAX);
        *e = (*e).min(s.first_row);
    }
    let mut sites: Vec<&str> = first.keys().copied().collect();
    sites.sort_by_key(|s| (node[*s], first[s]));
    sites.into_iter().map(String::from).collect()
}

/// Values of attribute `attr` of every `<tr>` in `html` that has it, in document order.
fn row_attrs<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let open = format!(r#"<tr {attr}=""#);
    html.match_indices(&open).map(|(i, m)| &html[i + m.len()..i + m.len() + html[i + m.len()..].find('"').unwrap()]).collect()
}

#[test]
fn the_overview_has_one_row_per_site_in_execution_order() {
    let want = sites_in_execution_order(&fixed().recording);
    assert!(want.len() >= 24 + 3, "24 matmul sites and 3 attention probes: {}", want.len());
    for (name, html) in [("no cost", &fixed().html), ("with cost", &costed().html)] {
        let ov = &embedded(html)["overview"];
        let got: Vec<&str> = ov["sites"].as_array().unwrap().iter().map(|s| s["site"].as_str().unwrap()).collect();
        assert_eq!(got, want, "{name}: overview JSON");
        let rows = row_attrs(html, "data-site");
        assert_eq!(rows, want, "{name}: overview table rows");
        // Each row links to the first series of its site (the drill-down).
        for s in ov["sites"].as_array().unwrap() {
            let anchor = s["anchor"].as_str().unwrap();
            assert!(html.contains(&format!(r#"id="{anchor}""#)), "{anchor} has a section");
        }
    }
    // `--json` writes what the page embeds.
    let c = costed();
    assert_eq!(c.overview, embedded(&c.html)["overview"], "--json == embedded overview");
}

/// The layer index in a MiniLM site name (`.../layer.2/...`), parsed here on its own.
fn layer_in(site: &str) -> Option<usize> {
    let i = site.find("/layer.")? + "/layer.".len();
    site[i..].split('/').next()?.parse().ok()
}

#[test]
fn heatmap_cells_are_the_statistics_of_the_rows() {
    let rec = fixed();
    let refs = reference(&rec.recording);
    let ov = &embedded(&rec.html)["overview"];
    let cells = ov["heatmap"]["cells"].as_array().unwrap();
    assert_eq!(cells.len(), refs.len(), "one cell per series (one pass per site here)");
    let (mut outliers_seen, mut sparse_seen) = (0, 0);
    for c in cells {
        let key = (c["site"].as_str().unwrap().to_string(), c["role"].as_str().unwrap().to_string(), 0);
        let key = if refs.contains_key(&key) { key } else { (key.0, key.1, 1) };
        let r = &refs[&key];
        let opt = |v: &Value| v.as_f64();
        let eq = |what: &str, got: Option<f64>, want: Option<f64>| match (got, want) {
            (Some(g), Some(w)) => assert!(close(g, w, 1e-9), "{what} of {key:?}: overview {g}, rows {w}"),
            (g, w) => assert_eq!(g, w, "{what} of {key:?}"),
        };
        eq("absmax", opt(&c["absmax"]), r.absmax());
        eq("kurtosis", opt(&c["kurtosis"]), r.kurtosis());
        // Density: the upper median over runs of nnz / count.
        let mut d: Vec<f64> = r.runs.values().filter_map(|x| Some(x.scalars.get("nnz")? / x.scalars.get("count").filter(|c| **c > 0.0)?)).collect();
        d.sort_by(|a, b| a.total_cmp(b));
        eq("density", opt(&c["density"]), d.get(d.len() / 2).copied());
        sparse_seen += d.iter().any(|x| *x < 1.0) as usize;
        // Outlier channels: per channel the largest max|x| over runs, against 8x the upper median.
        let by_ch = r.by_index("chan_maxabs");
        let want = (!by_ch.is_empty()).then(|| {
            let m: Vec<f64> = by_ch.values().map(|v| v.iter().map(|x| x.0).fold(f64::NAN, f64::max)).collect();
            let mut sorted = m.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let line = 8.0 * sorted[sorted.len() / 2];
            m.iter().filter(|x| **x > line).count() as f64
        });
        eq("outlier channels", opt(&c["outlier_channels"]), want);
        outliers_seen += want.is_some_and(|n| n > 0.0) as usize;
        // Row: the layer of the name; column: the name without prefix and layer.
        let site = key.0.as_str();
        let row = layer_in(site).map_or("no layer".to_string(), |l| format!("layer {l}"));
        assert_eq!(c["row"], row.as_str(), "{site}");
        let col = c["column"].as_str().unwrap();
        assert!(site.ends_with(col) && !col.contains("layer."), "{site}: column {col}");
    }
    assert!(outliers_seen > 0 && sparse_seen > 0, "the check saw outlier channels ({outliers_seen}) and zeros ({sparse_seen})");
    let rows: Vec<&str> = ov["heatmap"]["rows"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    assert_eq!(rows, ["layer 0", "layer 1", "layer 2"]);
    // Every cell is drawn in each heatmap of a recorded statistic, with its value.
    let table = |stat: &str| {
        let i = rec.html.find(&format!(r#"<table class="heat" data-stat="{stat}">"#)).unwrap_or_else(|| panic!("heatmap {stat}"));
        &rec.html[i..i + rec.html[i..].find("</table>").unwrap()]
    };
    let absmax_cells = cells.iter().filter(|c| c["absmax"].is_number()).count();
    assert_eq!(table("absmax").matches("<td style=").count(), absmax_cells);
    assert_eq!(table("kurtosis").matches("<td style=").count(), cells.iter().filter(|c| c["kurtosis"].is_number()).count());
}

#[test]
fn roofline_points_are_flops_over_bytes_of_the_cost() {
    let c = costed();
    let ov = &c.overview;
    let roof = &ov["roofline"];
    let (peak, bw) = (num(&c.cost["machine"]["machine"]["peak_flops"]), num(&c.cost["machine"]["machine"]["bandwidth"]));
    let mut want = Vec::new();
    let mut skipped = 0;
    for s in c.cost["sites"].as_array().unwrap() {
        let b = ["weights", "inputs", "outputs", "activations"].iter().map(|k| s["bytes"][k].as_u64().unwrap()).sum::<u64>();
        match s["flops"].as_u64() {
            Some(f) if f > 0 && b > 0 => want.push((s["site"].as_str().unwrap().to_string(), f as f64 / b as f64)),
            _ => skipped += 1,
        }
    }
    let points = roof["points"].as_array().unwrap();
    assert_eq!(points.len(), want.len(), "one point per site with FLOPs and bytes");
    assert_eq!(roof["not_drawn"], skipped);
    assert!(want.len() > 50, "{} points", want.len());
    for (p, (site, i)) in points.iter().zip(&want) {
        assert_eq!(p["site"], site.as_str());
        assert!(close(num(&p["intensity"]), *i, 1e-12), "{site}: intensity {} vs FLOPs/bytes {i}", p["intensity"]);
        assert!(close(num(&p["attainable"]), peak.min(i * bw), 1e-12), "{site}: attainable");
        assert_eq!(p["bound"], if *i >= peak / bw { "compute" } else { "memory" }, "{site}");
    }
    // The plot draws them all (one circle each).
    let fig = &c.html[c.html.find(r#"data-plot="roofline""#).expect("a roofline figure")..];
    let svg = &fig[..fig.find("</svg>").unwrap()];
    assert_eq!(svg.matches("<circle").count(), want.len());
    // The dashed cache roof is the fastest point of the cost's bandwidth curve, when it beats DRAM.
    let fastest = c.cost["machine"]["curve"].as_array().unwrap().iter().map(|p| num(&p["bandwidth"])).fold(0.0, f64::max);
    if fastest > bw {
        assert_eq!(num(&roof["cache_bandwidth"]), fastest);
        assert!(svg.lines().any(|l| l.trim_start().starts_with("cache ") && l.trim_end().ends_with(" GB/s")), "the cache roof is labelled");
    } else {
        assert!(roof["cache_bandwidth"].is_null());
    }
    // The GEMM histogram and FLOP totals are the cost's.
    assert_eq!(ov["gemm_shapes"], c.cost["gemm_shapes"]);
    assert_eq!(num(&ov["total_flops"]), num(&c.cost["totals"]["flops"]));
}

#[test]
fn the_overview_says_whether_the_cost_is_absent_read_or_computed() {
    // Absent: said, and the shares are of the recorded FLOPs.
    let html = &fixed().html;
    let ov = &embedded(html)["overview"];
    assert!(ov["cost_source"].is_null() && ov["roofline"].is_null());
    assert_eq!(ov["share_basis"], "recorded_flops");
    let overview = &html[html.find(r#"id="overview""#).unwrap()..html.find("<nav>").unwrap()];
    assert!(overview.contains("<b>Cost: absent.</b>"), "says the cost is absent");
    assert!(overview.contains("FLOP share of recorded sites"));
    assert!(!overview.contains(r#"data-plot="roofline""#));
    // The share column is the miner's FLOP weight: shares of sites with FLOPs sum to 1.
    let total: f64 = ov["sites"].as_array().unwrap().iter().map(|s| num(&s["share"])).sum();
    assert!(close(total, 1.0, 1e-9), "{total}");

    // Read from a file: said, with the file; shares are of the forward pass's FLOPs.
    let c = costed();
    assert_eq!(c.overview["cost_source"]["kind"], "file");
    assert_eq!(c.overview["share_basis"], "forward_flops");
    assert!(c.html.contains("<b>Cost: read</b>") && c.html.contains(&c.cost_path.display().to_string()));
    assert!(c.html.contains("FLOP share (no measured time)"), "the share column says it is not time");
    let flops = num(&c.cost["totals"]["flops"]);
    let nodes = c.cost["sites"].as_array().unwrap();
    for s in c.overview["sites"].as_array().unwrap() {
        let name = s["site"].as_str().unwrap();
        let Some(node) = nodes.iter().find(|n| n["site"].as_str().unwrap().split('+').any(|p| p == name)) else {
            assert!(s["cost"].is_null(), "{name}: no cost node, no cost");
            continue;
        };
        let parts = node["site"].as_str().unwrap().split('+').count() as f64;
        let f = num(&node["flops"]) / parts;
        assert!(close(num(&s["cost"]["flops"]), f, 1e-12), "{name}");
        assert!(close(num(&s["share"]), f / flops, 1e-12), "{name}: share");
    }
    assert!(c.overview["sites"].as_array().unwrap().iter().any(|s| s["cost"]["parts"] == 3), "the merged Q/K/V GEMM is split in three");

    // Computed from the model (small probes): said, and the same FLOPs as the file's.
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap();
    let (h, j) = (c.dir.path().join("m.html"), c.dir.path().join("m.json"));
    let rec = &fixed().recording;
    let out = opscope(&[
        "report".as_ref(), rec.as_os_str(), "--onnx".as_ref(), a.onnx.as_os_str(), "--probe-mib".as_ref(), "16".as_ref(), "--probe-gemm".as_ref(), "256".as_ref(),
        "-o".as_ref(), h.as_os_str(), "--json".as_ref(), j.as_os_str(),
    ]);
    assert!(out.status.success(), "report --onnx: {}", String::from_utf8_lossy(&out.stderr));
    let m: Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    assert_eq!(m["cost_source"]["kind"], "computed");
    assert_eq!(m["cost_graph"], c.cost["graph"], "batch and seq taken from the recording's graph");
    assert_eq!(m["total_flops"], c.overview["total_flops"]);
    assert!(std::fs::read_to_string(&h).unwrap().contains("<b>Cost: computed</b>"));
}

#[test]
fn a_cost_of_another_graph_or_an_old_cost_file_is_refused_clearly() {
    let c = costed();
    let rec = &fixed().recording;
    let mut other = c.cost.clone();
    other["graph"] = Value::from("paraphrase_MiniLM_L3_v2_b8_s64");
    let p = c.dir.path().join("other.json");
    std::fs::write(&p, serde_json::to_vec(&other).unwrap()).unwrap();
    let o = c.dir.path().join("x.html");
    let out = opscope(&["report".as_ref(), rec.as_os_str(), "--cost".as_ref(), p.as_os_str(), "-o".as_ref(), o.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("the cost is of graph 'paraphrase_MiniLM_L3_v2_b8_s64'") && err.contains("_b4_s32"), "{err}");
    let mut old = c.cost.clone();
    old.as_object_mut().unwrap().remove("sites");
    std::fs::write(&p, serde_json::to_vec(&old).unwrap()).unwrap();
    let out = opscope(&["report".as_ref(), rec.as_os_str(), "--cost".as_ref(), p.as_os_str(), "-o".as_ref(), o.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("missing field `sites`") && err.contains("opscope cost ... --json FILE"), "{err}");
    assert!(!o.exists(), "nothing written");
}

#[test]
fn measured_time_shares_replace_the_flop_share_and_reweight_the_payoff() {
    // Two sites: `a` has 3/4 of the recorded FLOPs, `b` 1/4; measured time says 40% / 60%.
    let rows: Vec<Row> = [("a", 300u64), ("b", 100)]
        .iter()
        .flat_map(|&(site, flops)| {
            ["count", "min", "max"].into_iter().zip([8.0, -1.0, 2.0]).map(move |(stat, v)| Row { site: Arc::from(site), flops: Some(flops), ..row(0, stat, 0, v) })
        })
        .collect();
    let series = opscope::mine::series_from_rows(&rows);
    let key_a = ("a".to_string(), "out".to_string(), 0);
    let mut v = opscope::mine::Verdict::new(&key_a, opscope::mine::kinds::PER_CHANNEL_INT8, vec![], "rule", "source");
    v.payoff = 0.75 * 0.5; // the miner's: recorded FLOP share x the kernel's fraction
    let time = opscope_lab::report::TimeShares { method: "differential runs".into(), sites: [("a".to_string(), 0.4), ("b".to_string(), 0.6)].into() };
    let input = |time| opscope_lab::report::Input { title: "t", manifests: &[], series: &series, verdicts: std::slice::from_ref(&v), notes: &[], cost: None, time };
    let (html, ov) = opscope_lab::report::render_with_overview(&input(Some(&time))).unwrap();
    assert_eq!(ov.share_basis, opscope_lab::report::ShareBasis::MeasuredTime);
    let shares: Vec<(&str, f64)> = ov.sites.iter().map(|s| (s.site.as_str(), s.share)).collect();
    assert_eq!(shares, [("a", 0.4), ("b", 0.6)]);
    assert!(close(ov.sites[0].payoff, 0.4 * 0.5, 1e-12), "payoff {}", ov.sites[0].payoff);
    assert!(html.contains("time share (measured)") && html.contains("differential runs"));
    // Without them: the recorded FLOP share, and the miner's payoff as it is.
    let (html, ov) = opscope_lab::report::render_with_overview(&input(None)).unwrap();
    let shares: Vec<f64> = ov.sites.iter().map(|s| s.share).collect();
    assert_eq!(shares, [0.75, 0.25]);
    assert!(close(ov.sites[0].payoff, 0.375, 1e-12));
    assert!(html.contains("FLOP share of recorded sites") && !html.contains("time share (measured)"));
}
