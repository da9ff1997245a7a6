//! `opscope diff`: a recording against itself shows no shift (exactly 0); a planted scaling and
//! a planted change of distribution give the shifts an independent numpy computation gives
//! (`scripts/diff_reference.py`), the moved site first; sites in one recording only are listed;
//! real recordings (the sweep, MiniLM fp32 vs int4 fake-quant) through the CLI.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::randn;
use opscope::mine::series_from_rows;
use opscope::{MemorySink, Pipeline, Row};
use opscope_lab::diff::{diff, Diff, SiteDiff};
use rlx_ir::{DType, Graph, Shape};
use rlx_runtime::{Device, Session};
use serde_json::Value;

fn opscope() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/diff_reference.py")
}

/// Run the numpy reference; its JSON.
fn reference(args: &[&std::ffi::OsStr]) -> Value {
    let out = Command::new("python3").arg(script()).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "{}: {} (pip install -r scripts/requirements-test.txt)", script().display(), String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `got` equals `want` to `tol` relative (absolute below 1); `None` only where the reference has null.
fn assert_close(ctx: &str, got: Option<f64>, want: &Value, tol: f64) {
    match (got, want.as_f64()) {
        (Some(g), Some(w)) => assert!((g - w).abs() <= tol * w.abs().max(1.0), "{ctx}: got {g}, numpy {w}"),
        (None, None) => {}
        (g, _) => panic!("{ctx}: got {g:?}, numpy {want}"),
    }
}

/// Every measure of `s` against the reference entry (`scalars`, `js`, `w1`, `w1_norm`, `chan`).
fn assert_matches(s: &SiteDiff, r: &Value, tol: f64) {
    let ctx = format!("{} {}", s.site_a, s.role);
    let stats = r["scalars"].as_object().unwrap();
    for (name, want) in stats {
        let got = s.scalar(name).unwrap_or_else(|| panic!("{ctx}: {name} compared"));
        assert_close(&format!("{ctx} {name} median A"), got.median_a, &want["median_a"], tol);
        assert_close(&format!("{ctx} {name} median B"), got.median_b, &want["median_b"], tol);
        assert_close(&format!("{ctx} {name} relative change"), got.rel_change, &want["rel_change"], tol);
        assert_eq!(got.ks, want["ks"].as_f64(), "{ctx} {name} KS (a rank statistic: exact)");
    }
    assert_eq!(s.scalars.len(), stats.len(), "{ctx}: the statistics compared");
    let h = s.hist.as_ref().unwrap_or_else(|| panic!("{ctx}: histogram compared"));
    assert_close(&format!("{ctx} js"), Some(h.js), &r["js"], tol);
    assert_close(&format!("{ctx} w1"), Some(h.w1), &r["w1"], tol);
    assert_close(&format!("{ctx} w1_norm"), h.w1_norm, &r["w1_norm"], tol);
    assert_eq!(s.score, Some(h.js), "{ctx}: the score is js");
    let c = s.channels.as_ref().unwrap_or_else(|| panic!("{ctx}: channels compared"));
    assert_close(&format!("{ctx} chan rel_l2"), c.rel_l2, &r["chan"]["rel_l2"], tol);
    assert_close(&format!("{ctx} chan spearman"), c.spearman, &r["chan"]["spearman"], tol);
    let moved: Vec<(usize, f64, f64)> = c.moved.iter().map(|m| (m.channel, m.rank_a, m.rank_b)).collect();
    let want: Vec<(usize, f64, f64)> = serde_json::from_value(r["chan"]["moved"].clone()).unwrap();
    assert_eq!(moved, want, "{ctx}: top channels whose rank moved");
}

/// Nothing moved: every measure exactly 0 (Spearman exactly 1), no note, nothing unmatched.
fn assert_no_shift(d: &Diff, series: usize) {
    assert_eq!(d.sites.len(), series, "every series matched");
    assert!(d.only_a.is_empty() && d.only_b.is_empty(), "{:?} {:?}", d.only_a, d.only_b);
    for s in &d.sites {
        let ctx = format!("{} {}", s.site_a, s.role);
        assert_eq!(s.site_a, s.site_b, "{ctx}");
        assert_eq!(s.score, Some(0.0), "{ctx}: score");
        let h = s.hist.as_ref().unwrap();
        assert_eq!((h.js, h.w1), (0.0, 0.0), "{ctx}");
        assert!(h.w1_norm.is_none_or(|x| x == 0.0), "{ctx}");
        assert!(!s.scalars.is_empty(), "{ctx}");
        for x in &s.scalars {
            assert_eq!((x.change, x.rel_change, x.ks), (Some(0.0), Some(0.0), Some(0.0)), "{ctx} {}", x.stat);
            assert_eq!(x.median_a, x.median_b, "{ctx} {}", x.stat);
        }
        if let Some(c) = &s.channels {
            assert_eq!(c.rel_l2, Some(0.0), "{ctx}");
            assert!(c.spearman.is_none_or(|r| r == 1.0) && c.moved.is_empty(), "{ctx}: {c:?}");
        }
        assert!(s.notes.is_empty(), "{ctx}: {:?}", s.notes);
    }
}

#[test]
fn measures_on_analytic_cases() {
    use opscope_lab::diff::{js_divergence_bits, ks_statistic, median, wasserstein1};
    // KS: identical samples 0, disjoint 1, {1,2,3,4} vs {3,4,5,6}: F_a(2) - F_b(2) = 1/2.
    assert_eq!(ks_statistic(&[1.0, 2.0], &[2.0, 1.0]), Some(0.0));
    assert_eq!(ks_statistic(&[1.0, 2.0], &[3.0]), Some(1.0));
    assert_eq!(ks_statistic(&[1.0, 2.0, 3.0, 4.0], &[3.0, 4.0, 5.0, 6.0]), Some(0.5));
    assert_eq!(ks_statistic(&[f64::NAN], &[1.0]), None, "no finite value: no statistic");
    // JS: proportional histograms 0; disjoint ones 1 bit; p = (1, 0), q = (1/2, 1/2):
    // KL(p||m) = log2(4/3), KL(q||m) = (1/2) log2(2/3) + (1/2) log2(2).
    assert_eq!(js_divergence_bits(&[1.0, 3.0], &[2.0, 6.0]), Some(0.0));
    assert_eq!(js_divergence_bits(&[5.0, 0.0], &[0.0, 2.0]), Some(1.0));
    let want = 0.5 * (4.0f64 / 3.0).log2() + 0.5 * (0.5 * (2.0f64 / 3.0).log2() + 0.5);
    assert!((js_divergence_bits(&[1.0, 0.0], &[1.0, 1.0]).unwrap() - want).abs() < 1e-15);
    assert_eq!(js_divergence_bits(&[0.0, 0.0], &[1.0, 1.0]), None, "an empty histogram: no divergence");
    // W1: all mass moved from the first to the last of 4 unit bins is 3; pooled sd of two
    // point masses is 0, of (1,0,0,1) vs itself 1.5.
    assert_eq!(wasserstein1(&[2.0, 0.0, 0.0, 0.0], &[0.0, 0.0, 0.0, 7.0], 0.0, 4.0), Some((3.0, 0.0)));
    assert_eq!(wasserstein1(&[1.0, 0.0, 0.0, 1.0], &[1.0, 0.0, 0.0, 1.0], 0.0, 4.0), Some((0.0, 1.5)));
    assert_eq!(median(&[3.0, 1.0, 2.0, 10.0]), Some(2.5));
    assert_eq!(median(&[]), None);
}

// ---- a planted shift on a hand-built graph, against numpy -------------------------------------

const RUNS: usize = 6;
const LO: f64 = -12.0;
const HI: f64 = 12.0;
const BINS: usize = 48;

/// Two independent matmuls: `x1[64,32] @ w1[32,16]` and `x2[48,24] @ w2[24,8]`.
fn two_matmuls() -> Graph {
    let f = |d: &[usize]| Shape::new(d, DType::F32);
    let mut g = Graph::new("two_matmuls");
    let x1 = g.input("x1", f(&[64, 32]));
    let w1 = g.param("w1", f(&[32, 16]));
    let x2 = g.input("x2", f(&[48, 24]));
    let w2 = g.param("w2", f(&[24, 8]));
    let y1 = g.matmul(x1, w1, f(&[64, 16]));
    g.node_mut(y1).name = Some("enc/fc1/MatMul".into());
    let y2 = g.matmul(x2, w2, f(&[48, 8]));
    g.node_mut(y2).name = Some("enc/fc2/MatMul".into());
    g.set_outputs(vec![y1, y2]);
    g
}

/// One recording: the rows, and per (site, role) the tensor of every run as the sketch saw it.
struct Rec {
    rows: Vec<Row>,
    tensors: BTreeMap<(String, String), Vec<Vec<f32>>>,
}

/// Record `RUNS` runs of [`two_matmuls`] with `x2(run)`; `x1` and the weights are the same in
/// every recording.
fn record(x2: impl Fn(usize) -> Vec<f32>) -> Rec {
    record_with(&format!("matmul{{hist_bins={BINS},hist_range={LO}:{HI}}}"), x2)
}

/// [`record`] with the pipeline `pipeline`.
fn record_with(pipeline: &str, x2: impl Fn(usize) -> Vec<f32>) -> Rec {
    let g = two_matmuls();
    let scale = |v: Vec<f32>, s: f32| v.into_iter().map(|x| x * s).collect::<Vec<f32>>();
    let w1 = scale(randn(32 * 16, 1), 32f32.powf(-0.5));
    let w2 = scale(randn(24 * 8, 2), 24f32.powf(-0.5));
    let p = Pipeline::parse(pipeline).unwrap();
    let sink = MemorySink::default();
    let mut runs = Vec::new();
    opscope::scope(&p, Box::new(sink.clone()), || {
        let mut c = Session::new(Device::Cpu).compile(g.clone());
        c.set_param("w1", &w1);
        c.set_param("w2", &w2);
        for r in 0..RUNS {
            let x1 = randn(64 * 32, 10 + r as u64);
            let x2 = x2(r);
            let out = c.run(&[("x1", &x1[..]), ("x2", &x2[..])]);
            runs.push([x1, w1.clone(), out[0].clone(), x2, w2.clone(), out[1].clone()]);
        }
    })
    .unwrap();
    let rows = sink.rows();
    let mut tensors: BTreeMap<(String, String), Vec<Vec<f32>>> = BTreeMap::new();
    for (i, (site, role)) in [("fc1", "lhs"), ("fc1", "rhs"), ("fc1", "out"), ("fc2", "lhs"), ("fc2", "rhs"), ("fc2", "out")].into_iter().enumerate() {
        let full = rows.iter().find(|r| r.site.contains(site)).map(|r| r.site.to_string()).unwrap_or_else(|| panic!("site {site} recorded"));
        // A weight is recorded once (it does not change between runs).
        let n = if role == "rhs" { 1 } else { RUNS };
        tensors.insert((full, role.to_string()), runs.iter().take(n).map(|r| r[i].clone()).collect());
    }
    Rec { rows, tensors }
}

/// x2 of run r: Gaussian, seed `seed0 + r`, times `scales[r]`.
fn x2_of(seed0: u64, scales: [f32; RUNS]) -> impl Fn(usize) -> Vec<f32> {
    move |r| randn(48 * 24, seed0 + r as u64).into_iter().map(|x| x * scales[r]).collect()
}

const SCALES_A: [f32; RUNS] = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5];

/// The numpy reference for the pairs of recordings, from the tensors.
fn numpy_reference(dir: &Path, recs: &[(&str, &Rec)], pairs: &[(&str, &str)]) -> Value {
    let mut series = serde_json::Map::new();
    let (_, first) = recs[0];
    for (k, (site, role)) in first.tensors.keys().enumerate() {
        let cols = match (site.contains("fc1"), role.as_str()) {
            (true, "rhs") | (true, "out") => 16,
            (true, _) => 32,
            (false, "rhs") | (false, "out") => 8,
            (false, _) => 24,
        };
        let mut files = serde_json::Map::new();
        for (name, rec) in recs {
            let paths: Vec<String> = rec.tensors[&(site.clone(), role.clone())]
                .iter()
                .enumerate()
                .map(|(r, t)| {
                    let p = dir.join(format!("{name}_{k}_{r}.f32"));
                    std::fs::write(&p, t.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
                    p.display().to_string()
                })
                .collect();
            files.insert(name.to_string(), paths.into());
        }
        series.insert(format!("{site}|{role}"), serde_json::json!({"shape": [-1, cols], "files": files}));
    }
    let spec = serde_json::json!({"range": [LO, HI], "bins": BINS, "pairs": pairs, "series": series});
    let path = dir.join("spec.json");
    std::fs::write(&path, serde_json::to_vec(&spec).unwrap()).unwrap();
    reference(&["raw".as_ref(), path.as_os_str()])
}

#[test]
fn planted_shifts_match_numpy_and_the_moved_site_ranks_first() {
    let a = record(x2_of(100, SCALES_A));
    // B: A's x2 times 2 (a planted scaling); C: other draws, scales overlapping A's.
    let b = record(x2_of(100, SCALES_A.map(|s| 2.0 * s)));
    let c = record(x2_of(200, [1.25, 1.35, 1.45, 1.55, 1.65, 1.75]));
    let (sa, sb, sc) = (series_from_rows(&a.rows), series_from_rows(&b.rows), series_from_rows(&c.rows));
    assert_eq!(sa.len(), 6, "{:?}", sa.keys().collect::<Vec<_>>());

    // A against itself: exactly no shift.
    assert_no_shift(&diff(&sa, &sa).unwrap(), 6);

    let dir = tempfile::tempdir().unwrap();
    let want = numpy_reference(dir.path(), &[("A", &a), ("B", &b), ("C", &c)], &[("A", "B"), ("A", "C")]);
    for (pair, other) in [("A|B", &sb), ("A|C", &sc)] {
        let d = diff(&sa, other).unwrap();
        assert_eq!(d.sites.len(), 6, "{pair}");
        for s in &d.sites {
            assert!(s.hist.as_ref().unwrap().exact, "a fixed hist_range merges exactly");
            assert_matches(s, &want[pair][format!("{}|{}", s.site_a, s.role)], 1e-6);
        }
        // The moved site (fc2's input and output) first; the rest did not move at all.
        let moved: Vec<(&str, &str)> = d.sites[..2].iter().map(|s| (s.site.as_str(), s.role.as_str())).collect();
        assert!(moved.iter().all(|(site, role)| site.contains("fc2") && *role != "rhs"), "{pair}: {moved:?}");
        assert!(d.sites[1].score.unwrap() > 0.01, "{pair}");
        for s in &d.sites[2..] {
            assert_eq!(s.score, Some(0.0), "{pair} {} {}", s.site, s.role);
        }
        assert_eq!(d.sites.iter().map(|s| s.rank).collect::<Vec<_>>(), (1..=6).map(Some).collect::<Vec<_>>());
    }

    // The planted scaling, analytically: every scale statistic doubles, shape statistics and
    // channel ranks do not change, and the per-run values no longer overlap (KS D = 1).
    let d = diff(&sa, &sb).unwrap();
    for s in d.sites.iter().filter(|s| s.site.contains("fc2") && s.role != "rhs") {
        for (stat, rel) in [("rms", 1.0), ("absmax", 1.0), ("kurtosis", 0.0), ("density", 0.0)] {
            let x = s.scalar(stat).unwrap();
            assert!((x.rel_change.unwrap() - rel).abs() < 1e-6, "{} {} {stat}: {x:?}", s.site, s.role);
        }
        let mean = s.scalar("mean").unwrap();
        assert!((mean.median_b.unwrap() - 2.0 * mean.median_a.unwrap()).abs() < 1e-9, "{mean:?}");
        assert_eq!(s.scalar("rms").unwrap().ks, Some(1.0), "{} {}: the per-run rms do not overlap", s.site, s.role);
        let c = s.channels.as_ref().unwrap();
        assert!((c.rel_l2.unwrap() - 1.0).abs() < 1e-6 && c.spearman == Some(1.0) && c.moved.is_empty(), "{c:?}");
    }
    // Between A and C the per-run rms overlap: KS is a fraction, as numpy says (checked above).
    let d = diff(&sa, &sc).unwrap();
    let ks = d.sites.iter().find(|s| s.site.contains("fc2") && s.role == "lhs").unwrap().scalar("rms").unwrap().ks.unwrap();
    assert!(ks > 0.0 && ks < 1.0, "rms KS {ks}");
}

/// Values outside a side's fixed histogram range are named with that side's own range (not the
/// range both sides were merged onto), and counted as that side's recording counted them.
#[test]
fn values_outside_a_fixed_range_are_named_with_that_sides_range() {
    let a = record(x2_of(100, SCALES_A));
    let b = record_with(&format!("matmul{{hist_bins={BINS},hist_range=-1:1}}"), x2_of(100, SCALES_A));
    let d = diff(&series_from_rows(&a.rows), &series_from_rows(&b.rows)).unwrap();
    let s = d.sites.iter().find(|s| s.site.contains("fc2") && s.role == "lhs").expect("fc2 lhs");
    // The host count: x2's values outside [-1, 1] over every run.
    let outside: usize = b.tensors[&(s.site_a.clone(), "lhs".to_string())].iter().map(|t| t.iter().filter(|x| !(-1.0..=1.0).contains(*x)).count()).sum();
    assert!(outside > 0);
    let want = format!("hist: {outside} values of B");
    assert!(
        s.notes.iter().any(|n| n.starts_with(&want) && n.contains("outside its fixed range [-1, 1]")),
        "{:?}",
        s.notes
    );
    assert!(!s.notes.iter().any(|n| n.contains("values of A")), "{:?}", s.notes);
    assert!(s.notes.iter().any(|n| n.contains("binned differently (A 48 bins over [-12, 12], B 48 bins over [-1, 1])")), "{:?}", s.notes);
    // Binned alike: no such note.
    let d = diff(&series_from_rows(&a.rows), &series_from_rows(&a.rows)).unwrap();
    assert!(d.sites.iter().all(|s| !s.notes.iter().any(|n| n.contains("binned differently"))));
}

#[test]
fn sites_in_one_recording_only_prefixes_and_pass_indices() {
    let a = record(x2_of(100, SCALES_A));
    let sa = series_from_rows(&a.rows);
    let fc1 = sa.keys().find(|k| k.0.contains("fc1")).unwrap().0.clone();

    // B lacks fc1: fc2 is compared, fc1 listed as only in A.
    let b_rows: Vec<Row> = a.rows.iter().filter(|r| !r.site.contains("fc1")).cloned().collect();
    let d = diff(&sa, &series_from_rows(&b_rows)).unwrap();
    assert_eq!(d.sites.len(), 3);
    assert!(d.sites.iter().all(|s| s.site_a.contains("fc2") && s.site_a == s.site_b && s.score == Some(0.0)));
    assert_eq!(d.only_a, ["lhs", "out", "rhs"].map(|r| format!("{fc1}/{r} [pass 0]")));
    assert!(d.only_b.is_empty() && !d.short_names);
    let text = d.text("a", "b", 10, 1);
    assert!(text.contains("3 site/roles in both") && text.contains("3 only in A") && text.contains("only in A (3):"), "{text}");

    // B's sites under another prefix ("other/" + A's names) and its tap at pass index 1:
    // every series matched by its name under the prefix, and the output says so.
    let b_rows: Vec<Row> = a.rows.iter().map(|r| Row { site: format!("other/{}", r.site).into(), pass_idx: 1, ..r.clone() }).collect();
    let d = diff(&sa, &series_from_rows(&b_rows)).unwrap();
    assert_eq!(d.sites.len(), 6);
    assert!(d.short_names && d.only_a.is_empty() && d.only_b.is_empty());
    for s in &d.sites {
        assert!(s.site_b == format!("other/{}", s.site_a) && (s.pass_a, s.pass_b) == (0, 1) && s.score == Some(0.0), "{s:?}");
    }
    let text = d.text("a", "b", 10, 0);
    assert!(text.contains("series matched by their names under") && text.contains("6 matched across pass indices"), "{text}");

    // Nothing in common: an error naming what each recording has and the closest names.
    let renamed: Vec<Row> = a.rows.iter().map(|r| Row { site: r.site.replace("enc/fc", "dec/proj").into(), ..r.clone() }).collect();
    let err = diff(&sa, &series_from_rows(&renamed)).unwrap_err().to_string();
    assert!(err.contains("no site/role is in both") && err.contains("A (6 site/roles") && err.contains("B (6 site/roles"), "{err}");
    assert!(err.contains("fc1/MatMul/lhs") && err.contains("proj1/MatMul/lhs") && err.contains("closest in B to A's 'fc1/MatMul': proj1/MatMul"), "{err}");

    // A statistic recorded on one side only is said, not taken as 0.
    let no_kurt: Vec<Row> = a.rows.iter().filter(|r| &*r.stat != "kurtosis" && &*r.stat != "hist").cloned().collect();
    let d = diff(&sa, &series_from_rows(&no_kurt)).unwrap();
    for s in &d.sites {
        let k = s.scalar("kurtosis").unwrap();
        assert!(k.runs_b == 0 && k.median_b.is_none() && k.rel_change.is_none() && k.ks.is_none(), "{k:?}");
        assert!(s.notes.iter().any(|n| n.starts_with("kurtosis: not recorded in B")), "{:?}", s.notes);
        assert!(s.score.is_none() && s.rank.is_none() && s.notes.iter().any(|n| n.starts_with("hist: not recorded in B")), "{:?}", s.notes);
    }
}

// ---- real recordings through the CLI ----------------------------------------------------------

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{:?}: {}", cmd, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn diff_json(a: &Path, b: &Path) -> Diff {
    let v: Value = serde_json::from_str(&run(opscope().arg("diff").arg(a).arg(b).arg("--json"))).unwrap();
    assert_eq!((v["a"].as_str().unwrap(), v["b"].as_str().unwrap()), (a.to_str().unwrap(), b.to_str().unwrap()));
    serde_json::from_value(v["diff"].clone()).unwrap()
}

#[test]
fn a_sweep_recording_against_itself_and_a_re_recording_shows_no_shift() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.parquet");
    let b = dir.path().join("b.csv.gz");
    run(opscope().args(["sweep", "--seeds", "1", "--out"]).arg(&a));
    run(opscope().args(["sweep", "--seeds", "1", "--out"]).arg(&b));
    let series = opscope::mine::load(&a).unwrap().len();
    assert!(series >= 72, "{series}");
    assert_no_shift(&diff_json(&a, &a), series);
    // The same seeds recorded again, as csv.gz: the same numbers, so no shift either.
    assert_no_shift(&diff_json(&a, &b), series);
    let text = run(opscope().arg("diff").arg(&a).arg(&b).args(["--top", "5"]));
    assert!(text.contains(&format!("{series} site/roles in both (0 with a histogram shift > 0), 0 only in A, 0 only in B")), "{text}");
    assert!(text.contains("ranked by js: Jensen-Shannon divergence") && text.contains(&format!("({} more site/roles; --top 0 prints all)", series - 5)), "{text}");
}

#[test]
fn unreadable_recordings_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("a.parquet");
    run(opscope().args(["sweep", "--seeds", "1", "--out"]).arg(&good));
    let junk = dir.path().join("junk.csv");
    std::fs::write(&junk, "not,a,recording\n1,2,3\n").unwrap();
    let missing = dir.path().join("missing.parquet");
    for (a, b, side, path) in [(&good, &missing, "B", &missing), (&junk, &good, "A", &junk)] {
        let out = opscope().arg("diff").arg(a).arg(b).output().unwrap();
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success() && !err.contains("panicked"), "{err}");
        assert!(err.contains(&format!("reading recording {side} ({})", path.display())), "{err}");
    }
}

/// MiniLM recorded fp32 and with int4 fake-quant of every matmul input (`fakequant{bits=4}` before
/// the `matmul` tap): every measure as numpy computes it from the two CSV recordings; the weights
/// (not quantized) do not move; the quantized inputs move most.
#[test]
fn minilm_fp32_against_int4_fake_quant_matches_numpy() {
    let assets = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let rec = |name: &str, pipeline: &str| {
        let out = dir.path().join(name);
        run(opscope()
            .args(["record", "--limit", "16", "--seq", "32", "--pipeline", pipeline, "--onnx"])
            .arg(&assets.onnx)
            .arg("--tokenizer")
            .arg(&assets.tokenizer)
            .arg("--text")
            .arg(&assets.text)
            .arg("--out")
            .arg(&out));
        out
    };
    let a = rec("fp32.csv.gz", "matmul");
    let b = rec("int4.csv.gz", "fakequant{bits=4},matmul");
    let series = opscope::mine::load(&a).unwrap().len();
    assert_eq!(series, 72, "24 matmuls x 3 roles");
    assert_no_shift(&diff_json(&a, &a), series);

    let d = diff_json(&a, &b);
    assert_eq!(d.sites.len(), series, "every site matched (the tap is pass 0 in A, pass 1 in B)");
    assert!(d.sites.iter().all(|s| (s.pass_a, s.pass_b) == (0, 1)));
    let want = reference(&["recording".as_ref(), a.as_os_str(), b.as_os_str()]);
    for s in &d.sites {
        assert_matches(s, &want[format!("{}|{}", s.site_a, s.role)], 1e-6);
    }
    // Ranked by the score, highest first; the weights did not change.
    assert!(d.sites.windows(2).all(|w| w[0].score >= w[1].score));
    for s in d.sites.iter().filter(|s| s.role == "rhs" && !s.site.ends_with("self/MatMul") && !s.site.ends_with("MatMul_1")) {
        assert_eq!(s.score, Some(0.0), "weight {} did not move", s.site);
    }
    assert_eq!(d.sites[0].role, "lhs", "a quantized input moved most: {}", d.sites[0].site);
    assert!(d.sites[0].score.unwrap() > 0.1);
}
