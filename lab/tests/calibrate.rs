//! `opscope calibrate` and `opscope::mine::calibrate` against an independent reference
//! (`scripts/calib_reference.py`): onnxruntime's own `HistogramCollector.compute_percentile` /
//! `get_entropy_threshold` and `compute_scale_zp`, and a numpy float64 reimplementation of the
//! same math, on the histograms the recording holds (read by Python's csv module); min-max
//! against the raw data that was fed. The tables written are loaded back with onnxruntime's
//! `load_tensors_data` and by parsing the TensorRT cache.
//!
//! Needs the Python packages of `scripts/requirements-test.txt`; the MiniLM test needs the
//! assets of `scripts/fetch-assets.sh`.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use opscope::mine::{calibrate_all, CalibrationError, CalibrationMethod, CalibrationOptions, TensorCalibration};
use opscope::recording::Tee;
use opscope::{MemorySink, Pipeline, Sink};
use serde_json::Value;

/// `x[m,k] @ w[k,n]`.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    k: usize,
    n: usize,
}

/// 16k activations a run: dense histograms (counts in the thousands near 0).
const LARGE: Dims = Dims { m: 64, k: 256, n: 32 };
/// 128 activations a run: sparse histograms (counts 0, 1, 2 in most bins), where ORT's integer
/// truncation of `q` and its smoothing of zero bins decide the entropy threshold.
const SMALL: Dims = Dims { m: 8, k: 16, n: 8 };

fn opscope_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

/// Heavy-tailed, asymmetric activations for `runs` runs of `x[m,k]`: Student-t with 5
/// degrees of freedom, halved and shifted by 1, two planted outliers in run 0 (21.5, -7.5), inside
/// [-7.9, 23.9].
fn heavy_tailed(d: Dims, runs: usize) -> Vec<Vec<f32>> {
    (0..runs)
        .map(|r| {
            let z = common::randn(6 * d.m * d.k, 100 + r as u64);
            let mut x: Vec<f32> = (0..d.m * d.k)
                .map(|i| {
                    let chi2 = z[6 * i + 1..6 * i + 6].iter().map(|v| v * v).sum::<f32>() / 5.0;
                    (0.5 * z[6 * i] / chi2.sqrt() + 1.0).clamp(-7.9, 23.9)
                })
                .collect();
            if r == 0 {
                (x[3], x[100]) = (21.5, -7.5);
            }
            x
        })
        .collect()
}

/// `w[k,n]`, Gaussian with standard deviation 0.05.
fn weight(d: Dims) -> Vec<f32> {
    common::randn(d.k * d.n, 7).iter().map(|v| v * 0.05).collect()
}

/// Record `x @ w` over `runs` with `pipeline` (into `csv` too, when given); the rows.
fn record(pipeline: &str, d: Dims, runs: &[Vec<f32>], w: &[f32], csv: Option<&Path>) -> Vec<opscope::Row> {
    let g = common::matmul_2d(d.m, d.k, d.n);
    let p = Pipeline::parse(pipeline).unwrap();
    let mem = MemorySink::default();
    let sink: Box<dyn Sink> = match csv {
        Some(path) => Box::new(Tee(vec![opscope::open_sink(path).unwrap(), Box::new(mem.clone())])),
        None => Box::new(mem.clone()),
    };
    opscope::scope(&p, sink, || {
        let mut c = rlx_runtime::Session::new(rlx_runtime::Device::Cpu).compile(g.clone());
        c.set_param("w", w);
        for x in runs {
            c.run(&[("x", x)]);
        }
    })
    .unwrap();
    mem.rows()
}

/// Each run's `x` (`x<i>.f32`) and the weight (`w.f32`) as little-endian f32 files in `dir`,
/// for the reference script: their paths.
fn raw_files(dir: &Path, runs: &[Vec<f32>], w: &[f32]) -> (Vec<PathBuf>, PathBuf) {
    let write = |name: String, v: &[f32]| {
        let p = dir.join(name);
        std::fs::write(&p, v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        p
    };
    (runs.iter().enumerate().map(|(i, x)| write(format!("x{i}.f32"), x)).collect(), write("w.f32".into(), w))
}

/// One calibration setting, its CLI flags and output files.
struct Case {
    key: &'static str,
    method: CalibrationMethod,
    symmetric: bool,
}

impl Case {
    fn options(&self) -> CalibrationOptions {
        CalibrationOptions { symmetric: self.symmetric, ..CalibrationOptions::new(self.method) }
    }
    fn args(&self) -> Vec<String> {
        let mut a = vec!["--method".to_string(), self.method.name().to_string()];
        if let CalibrationMethod::Percentile(p) = self.method {
            a.extend(["--percentile".to_string(), p.to_string()]);
        }
        if self.symmetric {
            a.push("--symmetric".into());
        }
        a
    }
    fn request(&self, dir: &Path) -> Value {
        let p = match self.method {
            CalibrationMethod::Percentile(p) => Value::from(p),
            _ => Value::Null,
        };
        serde_json::json!({
            "key": self.key, "method": self.method.name(), "percentile": p, "symmetric": self.symmetric,
            "json": dir.join(format!("{}.json", self.key)), "cache": dir.join(format!("{}.cache", self.key)),
        })
    }
}

/// Write each case's `.json` and `.cache` with the CLI.
fn write_tables(recording: &Path, dir: &Path, cases: &[Case]) {
    for c in cases {
        for ext in ["json", "cache"] {
            let out = opscope_cli()
                .arg("calibrate")
                .arg(recording)
                .args(c.args())
                .arg("--out")
                .arg(dir.join(format!("{}.{ext}", c.key)))
                .output()
                .unwrap();
            assert!(out.status.success(), "calibrate {}: {}", c.key, String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8(out.stdout).unwrap();
            assert!(text.contains("keys are site/role, not ONNX tensor names"), "{text}");
        }
    }
}

/// Run the Python reference on `request`.
fn reference(dir: &Path, request: Value) -> Value {
    let req = dir.join("req.json");
    let res = dir.join("ref.json");
    std::fs::write(&req, serde_json::to_vec(&request).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/calib_reference.py");
    let out = Command::new("python3").arg(&script).arg(&req).arg(&res).output().expect("python3 runs");
    assert!(
        out.status.success(),
        "{} failed (pip install -r scripts/requirements-test.txt): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&res).unwrap()).unwrap()
}

fn pair(v: &Value) -> (f32, f32) {
    (v[0].as_f64().unwrap() as f32, v[1].as_f64().unwrap() as f32)
}

/// Every tensor of every case against the reference; returns (tensors checked against ORT's own
/// entropy, near-ties among them).
fn check_cases(cases: &[Case], ours: &BTreeMap<&str, Vec<TensorCalibration>>, r: &Value) -> (usize, usize) {
    let (mut ort_entropy, mut ties) = (0, 0);
    for c in cases {
        let rc = &r["cases"][c.key];
        let tensors = &ours[c.key];
        assert_eq!(rc["refs"].as_object().unwrap().len(), tensors.len(), "{}: every tensor has a reference", c.key);
        for t in tensors {
            let rf = &rc["refs"][&t.name];
            let got = (t.lowest, t.highest);
            // The float64 numpy reimplementation: the same numbers, to the bit.
            assert_eq!(got, pair(&rf["np"]), "{} {}: opscope vs numpy reimplementation", c.key, t.name);
            // onnxruntime's own functions.
            if !rf["ort"].is_null() {
                let ort = pair(&rf["ort"]);
                if c.method == CalibrationMethod::Entropy {
                    ort_entropy += 1;
                    assert_eq!(rf["ort_curve_agrees"], true, "{}: the reference's copy of ORT's KL curve gives ORT's threshold", t.name);
                    if got != ort {
                        eprintln!("near-tie {}: opscope {got:?}, onnxruntime {ort:?}", t.name);
                        assert_eq!(rf["ort_tie"], true, "{} {}: {got:?} vs onnxruntime {ort:?}, not a float32 near-tie", c.key, t.name);
                        ties += 1;
                    }
                } else {
                    assert_eq!(got, ort, "{} {}: opscope vs onnxruntime", c.key, t.name);
                }
            }
            // The JSON loads in onnxruntime with the same range, and ORT's compute_scale_zp of it
            // is our scale and zero point.
            let lj = &rc["files"]["json"][&t.name];
            assert_eq!(pair(&lj["range"]), got, "{}: range loaded by load_tensors_data", t.name);
            assert_eq!(lj["scale"].as_f64().unwrap() as f32, t.quant.scale, "{} {}: scale vs ORT compute_scale_zp", c.key, t.name);
            assert_eq!(lj["zero_point"].as_i64().unwrap(), t.quant.zero_point as i64, "{} {}: zero point", c.key, t.name);
            let has_hist = c.method != CalibrationMethod::MinMax;
            assert_eq!(lj["hist_len"].is_null(), !has_hist, "{}: histogram methods store hist and bins as ORT does", t.name);
            if has_hist {
                assert_eq!(lj["bins_len"].as_u64().unwrap(), lj["hist_len"].as_u64().unwrap() + 1);
            }
            // The TensorRT cache parses back to amax / 127, ORT's symmetric int8 scale.
            let cache = &rc["files"]["cache"];
            let s = cache["scales"][&t.name].as_f64().unwrap() as f32;
            assert_eq!(s, t.trt_scale(), "{}: cache scale", t.name);
            assert_eq!(s, lj["sym_scale"].as_f64().unwrap() as f32, "{}: cache scale vs ORT symmetric scale", t.name);
        }
        assert_eq!(rc["files"]["json"].as_object().unwrap().len(), tensors.len());
        assert_eq!(rc["files"]["cache"]["header"], "TRT-8601-EntropyCalibration2");
        assert_eq!(rc["files"]["cache"]["lines"].as_u64().unwrap() as usize, tensors.len() + 1);
    }
    (ort_entropy, ties)
}

fn six_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (key, method) in [("minmax", CalibrationMethod::MinMax), ("p9999", CalibrationMethod::Percentile(99.99)), ("entropy", CalibrationMethod::Entropy)] {
        v.push(Case { key, method, symmetric: false });
        let key: &'static str = Box::leak(format!("{key}_sym").into_boxed_str());
        v.push(Case { key, method, symmetric: true });
    }
    v
}

/// Record `x @ w` for `d` over `runs`, calibrate it by the six cases (library and CLI) and check
/// everything against the reference; the calibrations and the reference's answer.
fn calibrate_and_check(d: Dims, runs: &[Vec<f32>], w: &[f32]) -> (BTreeMap<&'static str, Vec<TensorCalibration>>, Value) {
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv");
    // The activation on an asymmetric fixed range (padded to [-24, 24] for entropy), the output
    // on a symmetric one.
    record(
        "matmul{roles=[lhs],stats=[min,max,hist],hist_bins=2048,hist_range=-8:24},matmul{roles=[out],stats=[min,max,hist],hist_bins=1024,hist_range=-32:32}",
        d,
        runs,
        w,
        Some(&rec),
    );
    let cases = six_cases();
    write_tables(&rec, dir.path(), &cases);
    let series = opscope::mine::load(&rec).unwrap();
    let mut ours = BTreeMap::new();
    for c in &cases {
        let t = calibrate_all(&series, &c.options());
        assert!(t.failed.is_empty(), "{}: {:?}", c.key, t.failed);
        assert_eq!(t.tensors.len(), 2, "lhs and out");
        ours.insert(c.key, t.tensors);
    }
    let (files, wfile) = raw_files(dir.path(), runs, w);
    let lhs = ours["minmax"].iter().find(|t| t.role == "lhs").unwrap().name.clone();
    let out = ours["minmax"].iter().find(|t| t.role == "out").unwrap().name.clone();
    let r = reference(
        dir.path(),
        serde_json::json!({
            "recording": rec,
            "cases": cases.iter().map(|c| c.request(dir.path())).collect::<Vec<_>>(),
            "ort_entropy": Value::Null,
            "raw": {
                lhs.clone(): {"files": files, "hist": [-8.0, 24.0, 2048]},
                out.clone(): {"files": files, "weight": {"file": wfile, "shape": [d.k, d.n]}},
            },
            "quantize": {"case": "entropy", "lhs": lhs, "out": out, "k": d.k, "n": d.n},
        }),
    );
    let (ort_entropy, ties) = check_cases(&cases, &ours, &r);
    assert_eq!(ort_entropy, 4, "onnxruntime's own entropy search ran on both tensors, both cases");
    // onnxruntime's quantize_static, given the table as its calibration cache, quantizes x and y
    // with our scales; its default activation type is int8 [-128, 127], so its zero point is
    // ours (uint8) - 128.
    let q = &r["quantize"];
    for (name, key) in [(&lhs, "x"), (&out, "y")] {
        let t = ours["entropy"].iter().find(|t| &t.name == name).unwrap();
        assert_eq!(q[format!("{key}_scale")].as_f64().unwrap() as f32, t.quant.scale, "{key}: quantize_static scale");
        assert_eq!(q[format!("{key}_zero_point")].as_i64().unwrap(), t.quant.zero_point as i64 - 128, "{key}: quantize_static zero point");
    }
    assert_eq!(q["x_dtype"], "int8");
    assert!(ties <= 2, "{ties} near-ties");

    // Min-max against the data fed: exact for the activation, to float32 rounding of the GEMM
    // for the output.
    let raw = &r["raw"];
    let mm = &ours["minmax"];
    let l = mm.iter().find(|t| t.name == lhs).unwrap();
    assert_eq!((l.data_min as f64, l.data_max as f64), (raw[&lhs]["min"].as_f64().unwrap(), raw[&lhs]["max"].as_f64().unwrap()));
    assert_eq!((l.lowest, l.highest), (l.data_min, l.data_max));
    let o = mm.iter().find(|t| t.name == out).unwrap();
    for (got, want) in [(o.lowest, &raw[&out]["min"]), (o.highest, &raw[&out]["max"])] {
        let want = want.as_f64().unwrap();
        assert!((got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "out: {got} vs numpy {want}");
    }
    let absmax = runs.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    let sym = ours["minmax_sym"].iter().find(|t| t.name == lhs).unwrap();
    assert_eq!((sym.lowest, sym.highest), (-absmax, absmax), "symmetric min-max is +-absmax");
    assert_eq!((sym.quant.scale, sym.quant.zero_point), ((absmax as f64 / 127.0) as f32, 0));
    // The activation histogram the methods read is numpy.histogram of the fed data.
    let merged = opscope::mine::merged_histogram(series.iter().find(|(k, _)| k.1 == "lhs").unwrap().1, None).unwrap();
    let want: Vec<f64> = serde_json::from_value(raw[&lhs]["hist"].clone()).unwrap();
    assert_eq!(merged.counts, want, "merged lhs histogram vs numpy.histogram of every x fed");
    assert_eq!(merged.counts.iter().sum::<f64>(), (runs.len() * d.m * d.k) as f64);
    (ours, r)
}

#[test]
fn heavy_tailed_activations_calibrate_as_onnxruntime_on_the_same_histograms() {
    let runs = heavy_tailed(LARGE, 6);
    let (ours, _) = calibrate_and_check(LARGE, &runs, &weight(LARGE));
    // Heavy tails: percentile and entropy clip the upper tail min-max keeps (to 7.6 and 6.1 of 21.5).
    let lhs = |key: &str| ours[key].iter().find(|t| t.role == "lhs").unwrap().clone();
    let l = lhs("minmax");
    for key in ["p9999", "entropy"] {
        let t = lhs(key);
        assert!(t.highest < 0.5 * l.highest && t.lowest >= l.lowest, "{key}: {:?} vs min-max {:?}", (t.lowest, t.highest), (l.lowest, l.highest));
    }
}

#[test]
fn sparse_histograms_calibrate_as_onnxruntime() {
    let runs = heavy_tailed(SMALL, 4);
    let (ours, r) = calibrate_and_check(SMALL, &runs, &weight(SMALL));
    // 512 activations over 2048 bins: no bin holds 30 (the large case's hold thousands).
    let lhs = &ours["entropy"].iter().find(|t| t.role == "lhs").unwrap().name;
    assert_eq!(r["tensors"][lhs]["bins"], 2048);
    let h = ours["p9999"].iter().find(|t| t.role == "lhs").unwrap().histogram.clone().unwrap();
    assert_eq!(h.counts.iter().sum::<f64>(), 512.0);
    let fullest = h.counts.iter().cloned().fold(0.0, f64::max);
    assert!(fullest < 30.0, "sparse: fullest bin {fullest}");
}

/// Min-max with the runs' ranges averaged (`--average mean`, `--average ema`) against
/// onnxruntime's own `MinMaxCalibrater(moving_average=True)` on a one-MatMul ONNX model fed the
/// same batches: its mean in one `collect_data` pass (as `quantize_static` runs it) and its
/// moving average across one `collect_data` call a batch; the symmetric moving average against
/// PyTorch's `MovingAverageMinMaxObserver` recurrence (ORT makes each batch's range symmetric
/// before averaging, PyTorch after; opscope follows PyTorch). Run 0 holds the planted outliers
/// (21.5, -7.5), which set the extremes and move an average by a fraction.
#[test]
fn averaged_min_max_matches_onnxruntime_moving_average() {
    let d = LARGE;
    let runs = heavy_tailed(d, 8);
    let w = weight(d);
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("rec.csv");
    record("matmul{roles=[lhs,out],stats=[min,max]}", d, &runs, &w, Some(&rec));
    let (files, wfile) = raw_files(dir.path(), &runs, &w);
    let c = 0.3;
    let r = reference(
        dir.path(),
        serde_json::json!({
            "recording": rec, "cases": [], "ort_entropy": Value::Null,
            "moving_average": {"runs": files, "weight": wfile, "k": d.k, "n": d.n, "constant": c},
        }),
    );
    let ma = &r["moving_average"];
    let series = opscope::mine::load(&rec).unwrap();
    let extremes = calibrate_all(&series, &CalibrationOptions::new(CalibrationMethod::MinMax));
    let c_text = c.to_string();
    for (key, args, want_key) in [
        ("mean", vec!["--average", "mean"], "mean"),
        ("mean_sym", vec!["--average", "mean", "--symmetric"], "mean_sym"),
        ("ema", vec!["--average", "ema", "--averaging-constant", &c_text], "ema"),
        ("ema_sym", vec!["--average", "ema", "--averaging-constant", &c_text, "--symmetric"], "ema_pytorch_sym"),
    ] {
        let table = dir.path().join(format!("{key}.json"));
        let out = opscope_cli().arg("calibrate").arg(&rec).args(["--method", "minmax"]).args(&args).arg("--out").arg(&table).output().unwrap();
        assert!(out.status.success(), "{key}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("minmax averaged"), "{key}: the summary says how the runs were combined");
        let t: Value = serde_json::from_slice(&std::fs::read(&table).unwrap()).unwrap();
        assert_eq!(t["opscope"]["average"], if key.starts_with("mean") { "mean" } else { "ema" });
        assert_eq!(t["calibration_method"]["value"], "CalibrationMethod.MinMax");
        // The library gives the CLI's ranges.
        let averaging = if key.starts_with("mean") { opscope::mine::RangeAveraging::Mean } else { opscope::mine::RangeAveraging::Ema(c) };
        let lib = calibrate_all(&series, &CalibrationOptions { averaging, symmetric: key.ends_with("sym"), ..CalibrationOptions::new(CalibrationMethod::MinMax) });
        assert!(lib.failed.is_empty());
        for (role, ort_name, tol) in [("lhs", "x", 1e-6), ("out", "y", 1e-5)] {
            let name = &extremes.tensors.iter().find(|t| t.role == role).unwrap().name;
            let got = (t["data"][name]["lowest"].as_f64().unwrap(), t["data"][name]["highest"].as_f64().unwrap());
            let want = (ma[want_key][ort_name][0].as_f64().unwrap(), ma[want_key][ort_name][1].as_f64().unwrap());
            // The activation: f64 averaging of the recorded per-run extremes against ORT's float32
            // nanmean and merge_range; the output also through RLX's GEMM against ORT's MatMul.
            for (g, w) in [(got.0, want.0), (got.1, want.1)] {
                assert!((g - w).abs() <= tol * w.abs().max(1.0), "{key} {role}: opscope {got:?} vs reference {want:?}");
            }
            let l = lib.tensors.iter().find(|t| &t.name == name).unwrap();
            assert_eq!((l.lowest as f64, l.highest as f64), got, "{key} {role}: library vs CLI");
            let e = extremes.tensors.iter().find(|t| &t.name == name).unwrap();
            // An average lies inside the extremes (symmetric: within +-absmax, centred on 0).
            let (lo, hi) = if key.ends_with("sym") {
                let a = e.amax() as f64;
                assert_eq!(got.0, -got.1, "{key} {role}: symmetric");
                (-a, a)
            } else {
                (e.lowest as f64, e.highest as f64)
            };
            assert!(got.0 >= lo && got.1 <= hi, "{key} {role}: {got:?} inside {:?}", (lo, hi));
        }
    }
    let lhs = &extremes.tensors.iter().find(|t| t.role == "lhs").unwrap().name;
    let mean_hi = ma["mean"]["x"][1].as_f64().unwrap();
    eprintln!("lhs upper end: min-max 21.5, mean {mean_hi}, ema(0.3) {}", ma["ema"]["x"][1]);
    assert!(mean_hi < 0.75 * 21.5, "the planted 21.5 in one of 8 runs sets min-max ({}), not the mean ({mean_hi})", extremes.tensors.iter().find(|t| &t.name == lhs).unwrap().highest);
}

/// MiniLM-L3 over 20 sentences: activations and weights at 2048 bins over [-32, 32], outputs
/// (attention scores reach -75, the layer-0 FFN output 202) at 4096 over [-256, 256].
#[test]
fn minilm_calibration_tables_match_onnxruntime() {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("minilm.csv");
    let st = opscope_cli()
        .arg("record")
        .args(["--onnx".as_ref(), a.onnx.as_os_str(), "--tokenizer".as_ref(), a.tokenizer.as_os_str(), "--text".as_ref(), a.text.as_os_str()])
        .args(["--limit", "20", "--batch", "8", "--seq", "64", "--pipeline"])
        .arg("matmul{roles=[lhs,rhs],stats=[min,max,hist],hist_bins=2048,hist_range=-32:32},matmul{roles=[out],stats=[min,max,hist],hist_bins=4096,hist_range=-256:256}")
        .arg("--out")
        .arg(&rec)
        .output()
        .unwrap();
    assert!(st.status.success(), "record: {}", String::from_utf8_lossy(&st.stderr));
    let cases = vec![
        Case { key: "entropy", method: CalibrationMethod::Entropy, symmetric: false },
        Case { key: "p99999", method: CalibrationMethod::Percentile(99.999), symmetric: false },
        Case { key: "p9999_sym", method: CalibrationMethod::Percentile(99.99), symmetric: true },
        Case { key: "minmax_sym", method: CalibrationMethod::MinMax, symmetric: true },
    ];
    write_tables(&rec, dir.path(), &cases);
    let series = opscope::mine::load(&rec).unwrap();
    let mut ours = BTreeMap::new();
    for c in &cases {
        let t = calibrate_all(&series, &c.options());
        assert!(t.failed.is_empty(), "{}: {:?}", c.key, t.failed);
        assert_eq!(t.tensors.len(), 72, "24 MatMuls x 3 roles");
        ours.insert(c.key, t.tensors);
    }
    // onnxruntime's own entropy search is slow (about 1 s per 2048-bin histogram): it runs on
    // layer 0's activations; the numpy reimplementation checks all 72.
    let layer0: Vec<&str> = ours["entropy"].iter().filter(|t| t.role == "lhs" && t.site.contains("layer.0/")).map(|t| t.name.as_str()).collect();
    assert_eq!(layer0.len(), 8, "8 MatMuls a layer");
    let r = reference(
        dir.path(),
        serde_json::json!({
            "recording": rec,
            "cases": cases.iter().map(|c| c.request(dir.path())).collect::<Vec<_>>(),
            "ort_entropy": layer0,
        }),
    );
    let (ort_entropy, ties) = check_cases(&cases, &ours, &r);
    assert_eq!(ort_entropy, 8);
    eprintln!("{ties} of 8 near-ties");
    // Measured: 4 of the 8 names, 2 of the 6 distinct tensors (Q, K and V read one input;
    // README, `opscope calibrate`). Each tie is also bit-equal to the float64 numpy search
    // above; the count is bounded so that more ties with ORT's float32 search do not pass
    // unnoticed.
    assert!(ties <= 4, "{ties} of 8 layer-0 activations are near-ties with onnxruntime's pick (measured 4)");
    // The recording covers the data (no value outside a range), and entropy clips the FFN input
    // of layer 0 (GELU output, max 28) well inside min-max.
    let ffn = ours["entropy"].iter().find(|t| t.role == "lhs" && t.site.ends_with("layer.0/output/dense/MatMul")).unwrap();
    assert!(ffn.highest < 0.6 * ffn.data_max, "{:?}", (ffn.highest, ffn.data_max));
}

#[test]
fn calibration_errors_name_the_problem_and_the_fix() {
    let runs = heavy_tailed(LARGE, 3);
    let w = weight(LARGE);
    let series = |pipeline: &str| opscope::mine::series_from_rows(&record(pipeline, LARGE, &runs, &w, None));
    let first = |pipeline: &str, method: CalibrationMethod| {
        let t = calibrate_all(&series(pipeline), &CalibrationOptions::new(method));
        t.failed.into_iter().next().map(|(_, e)| e)
    };

    // No histogram: min-max works, the histogram methods say what to record.
    let s = series("matmul{roles=[lhs],stats=[min,max]}");
    assert!(calibrate_all(&s, &CalibrationOptions::new(CalibrationMethod::MinMax)).failed.is_empty());
    let e = calibrate_all(&s, &CalibrationOptions::new(CalibrationMethod::Entropy)).failed.remove(0).1;
    assert!(matches!(e, CalibrationError::NoHistogram { .. }));
    assert!(e.to_string().contains("stats=[min,max,hist]") && e.to_string().contains("hist_bins=2048"), "{e}");

    // No min/max.
    let e = first("matmul{roles=[lhs],stats=[hist]}", CalibrationMethod::Percentile(99.99)).unwrap();
    assert_eq!(e, CalibrationError::NoMinMax);

    // 32 bins (the default) are too few for the entropy search.
    let e = first("matmul{roles=[lhs],stats=[min,max,hist]}", CalibrationMethod::Entropy).unwrap();
    assert_eq!(e, CalibrationError::TooFewBins { bins: 32, quantized: 128, need: 256, half: 64 });
    assert!(e.to_string().contains("hist_bins=2048"), "{e}");

    // Values outside a fixed range: counted exactly, and the suggested range covers the data.
    let outside = runs.iter().flatten().filter(|v| v.abs() > 4.0).count() as f64;
    let absmax = runs.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    match first("matmul{roles=[lhs],stats=[min,max,hist],hist_bins=2048,hist_range=-4:4}", CalibrationMethod::Percentile(99.99)).unwrap() {
        CalibrationError::Outside { outside: o, a, .. } => {
            assert_eq!(o, outside);
            assert_eq!(a, (absmax as f64).ceil(), "the data's absmax rounded up");
        }
        e => panic!("{e}"),
    }

    // An odd bin count over a symmetric range has no edge at 0: entropy refuses, percentile
    // (asymmetric) does not need one.
    let p = "matmul{roles=[lhs],stats=[min,max,hist],hist_bins=2049,hist_range=-24:24}";
    assert!(matches!(first(p, CalibrationMethod::Entropy), Some(CalibrationError::NotCentred { .. })));
    assert!(first(p, CalibrationMethod::Percentile(99.99)).is_none());

    // The default per-run absmax range: runs merge by re-binning, and the table says so.
    let t = calibrate_all(&series("matmul{roles=[lhs],stats=[min,max,hist],hist_bins=2048}"), &CalibrationOptions::new(CalibrationMethod::Percentile(99.99)));
    assert!(t.failed.is_empty());
    assert_eq!(t.tensors[0].notes, vec![opscope::mine::CalibrationNote::Rebinned]);

    // A percentile outside [0, 100].
    assert!(matches!(first(p, CalibrationMethod::Percentile(100.5)), Some(CalibrationError::Options(_))));

    // The CLI: a clear message, a failure status and no file.
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("r.csv");
    record("matmul{roles=[lhs],stats=[min,max]}", LARGE, &runs, &w, Some(&rec));
    let table = dir.path().join("t.json");
    let out = opscope_cli().arg("calibrate").arg(&rec).args(["--method", "entropy", "--out"]).arg(&table).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("cannot be calibrated by entropy") && err.contains("no histogram recorded") && err.contains("nothing written"), "{err}");
    assert!(!table.exists() && !dir.path().join("t.json.partial").exists());
    // One that succeeds prints how finely the entropy search could move: bins from 0 to the
    // data's absmax (host) at the recorded width (48 / 2048).
    let rec = dir.path().join("h.csv");
    record("matmul{roles=[lhs],stats=[min,max,hist],hist_bins=2048,hist_range=-24:24}", LARGE, &runs, &w, Some(&rec));
    let out = opscope_cli().arg("calibrate").arg(&rec).args(["--method", "entropy", "--out"]).arg(dir.path().join("h.json")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let absmax = runs.iter().flatten().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let n = (absmax / (48.0 / 2048.0)).ceil() as usize;
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains(&format!("the entropy search read {n}..{n} bins (median {n})")), "{n}: {stdout}");
    for (args, want) in [
        (vec!["--method", "minmax", "--out", "t.txt"], "writes .json (ONNX Runtime calibration table) or .cache"),
        (vec!["--method", "entropy", "--percentile", "99", "--out", "t.json"], "--percentile applies to --method percentile only"),
        (vec!["--method", "entropy", "--average", "mean", "--out", "t.json"], "--average mean applies to --method minmax only"),
        (vec!["--method", "minmax", "--average", "mean", "--averaging-constant", "0.1", "--out", "t.json"], "--averaging-constant applies to --average ema only"),
        (vec!["--method", "minmax", "--average", "ema", "--averaging-constant", "0", "--out", "t.json"], "--averaging-constant: the averaging constant must be in (0, 1]"),
        (vec!["--method", "minmax", "--average", "ema", "--averaging-constant", "1.5", "--out", "t.json"], "must be in (0, 1] (got 1.5"),
        (vec!["--method", "minmax", "--out", "r.csv.manifest.json"], "recording's manifest sidecar"),
        // Never a part of a recording, even with --force (a dataset's partition sidecar is
        // no input of a CSV calibration, and was overwritten before this check).
        (vec!["--method", "minmax", "--force", "--out", "d.parquet/recording=x/_manifest.json"], "recording's manifest sidecar"),
        (vec!["--method", "minmax", "--force", "--out", "d.parquet/recording=x/t.json"], "inside the Parquet dataset"),
        (vec!["--method", "minmax", "--force", "--out", "s.parquet.truth.json"], "sweep's ground truth"),
        (vec!["--method", "minmax", "--force", "--out", "g.parquet.model.json"], "GGUF recording's model description"),
        (vec!["--method", "minmax", "--force", "--out", "c.csv.capture/manifest.json"], "inside the capture directory"),
    ] {
        std::fs::create_dir_all(dir.path().join("c.csv.capture")).unwrap();
        std::fs::write(dir.path().join("c.csv.capture/manifest.json"), "{}").unwrap();
        std::fs::create_dir_all(dir.path().join("d.parquet/recording=x")).unwrap();
        let sidecar = dir.path().join("d.parquet/recording=x/_manifest.json");
        std::fs::write(&sidecar, "{\"format\": 1}").unwrap();
        let out = opscope_cli().current_dir(dir.path()).arg("calibrate").arg(&rec).args(&args).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains(want), "{err}");
        assert_eq!(std::fs::read_to_string(&sidecar).unwrap(), "{\"format\": 1}", "the sidecar is left alone");
        assert!(!dir.path().join("d.parquet/recording=x/t.json").exists());
        assert_eq!(std::fs::read_to_string(dir.path().join("c.csv.capture/manifest.json")).unwrap(), "{}", "the capture manifest too");
    }
}
