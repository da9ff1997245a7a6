//! The real model: paraphrase-MiniLM-L3-v2 over real text. Token ids equal Hugging Face's
//! (Python `tokenizers`), the model's outputs are bit-identical with taps on, and every recorded
//! sketch of the 24 MatMul sites x 3 roles, every attention statistic of the 3 Softmax sites and
//! every residual statistic of the 6 blocks agrees with statistics computed by numpy on
//! onnxruntime's intermediate tensors for the same token ids, padding taken from Hugging Face's
//! attention mask.
//!
//! Needs the assets of `scripts/fetch-assets.sh` and the Python packages of
//! `scripts/requirements-test.txt` (README's test command installs both).

#[path = "../../tests/common/mod.rs"]
mod common;
use common::*;
use opscope_lab::model::{decode, split_entries, OnnxEncoder, TextEncoder};
use opscope::{MemorySink, Pipeline};
use std::path::PathBuf;

fn assets() -> (PathBuf, PathBuf, PathBuf) {
    let a = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    (a.onnx, a.tokenizer, a.text)
}

#[test]
fn minilm_sketches_match_onnxruntime_and_outputs_are_bit_identical() {
    let (onnx, tok, text) = assets();
    let (batch, seq) = (4usize, 32usize);
    let texts: Vec<String> = split_entries(&std::fs::read_to_string(&text).unwrap()).into_iter().take(batch).collect();
    let enc = TextEncoder::load(&tok, seq).unwrap().encode(&texts).unwrap();
    let model = OnnxEncoder::load(&onnx, batch, seq).unwrap();
    let session = rlx_runtime::Session::new(rlx_runtime::Device::Cpu);

    let plain = model.run(&mut model.compile(&session), &enc).unwrap();
    let sink = MemorySink::default();
    // The onnxruntime reference sketches whole tensors: padding rows included here (the
    // exclusion of padding is checked against a host reference in tests/padding.rs and for
    // padding invariance in padding_invariance.rs).
    let p = Pipeline::parse("matmul{padding=include},attn,residual").unwrap();
    let tapped = opscope::scope(&p, Box::new(sink.clone()), || model.run(&mut model.compile(&session), &enc).unwrap()).unwrap();
    assert_eq!(plain.len(), tapped.len());
    assert_eq!(plain, tapped, "model outputs must be bit-identical with taps on (bytes and dtypes)");

    // The independent reference.
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    let res = dir.path().join("ref.json");
    let rows2d = |v: &[i64]| -> Vec<Vec<i64>> { v.chunks(seq).map(|c| c.to_vec()).collect() };
    std::fs::write(
        &req,
        serde_json::to_vec(&serde_json::json!({"texts": texts, "seq": seq, "ids": rows2d(&enc.ids), "mask": rows2d(&enc.mask), "topk": 8})).unwrap(),
    )
    .unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/ort_reference.py");
    let st = std::process::Command::new("python3")
        .arg(&script)
        .args(["--onnx".as_ref(), onnx.as_os_str(), "--tokenizer".as_ref(), tok.as_os_str()])
        .args(["--input".as_ref(), req.as_os_str(), "--out".as_ref(), res.as_os_str()])
        .status()
        .expect("python3 runs");
    assert!(st.success(), "{} failed: pip install -r scripts/requirements-test.txt", script.display());
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&res).unwrap()).unwrap();

    assert_eq!(r["ids"], serde_json::json!(rows2d(&enc.ids)), "token ids equal Hugging Face tokenizers'");
    assert_eq!(r["mask"], serde_json::json!(rows2d(&enc.mask)), "attention mask equals Hugging Face's");

    // The model's outputs agree with onnxruntime.
    let order = r["output_order"].as_array().unwrap();
    assert_eq!(order.len(), plain.len());
    for (i, name) in order.iter().enumerate() {
        let want: Vec<f64> = serde_json::from_value(r["outputs"][name.as_str().unwrap()].clone()).unwrap();
        let got = decode(&plain[i].0, plain[i].1).unwrap();
        assert_eq!(want.len(), got.len(), "output {name}");
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-4, "output {name}: max |rlx - onnxruntime| = {worst}");
    }

    let rows = sink.rows();
    let sites = r["sites"].as_object().unwrap();
    assert_eq!(sites.len(), 24, "MiniLM-L3 has 24 MatMuls");
    let mut checked = 0;
    for (site, roles) in sites {
        for role in ["lhs", "rhs", "out"] {
            let got = stats_of(&rows, site, role, 0);
            assert!(!got.is_empty(), "{site}/{role} was not recorded");
            let want = roles[role].as_object().unwrap();
            for (stat, w) in want {
                if stat == "tiny" {
                    continue;
                }
                if stat == "nnz" {
                    // Values that are 0 or subnormal in onnxruntime's tensor may be subnormal
                    // (non-zero) in RLX's, or the reverse: nnz may differ by at most their count.
                    let (g, w, tiny) = (got["nnz"][0], w.as_f64().unwrap(), want["tiny"].as_f64().unwrap());
                    assert!((g - w).abs() <= tiny, "{site}/{role} nnz: opscope {g}, onnxruntime {w} (+/- {tiny} tiny)");
                    continue;
                }
                let g = got.get(stat.as_str()).unwrap_or_else(|| panic!("{site}/{role}: {stat} missing"));
                let w: Vec<f64> = match w {
                    serde_json::Value::Array(a) => a.iter().map(|v| v.as_f64().unwrap()).collect(),
                    v => vec![v.as_f64().unwrap()],
                };
                assert_eq!(g.len(), w.len(), "{site}/{role} {stat} length");
                for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                    // 1e-4 relative, with an absolute floor of 1e-7 (a masked attention
                    // probability is ~1e-39 in RLX and 0 in onnxruntime): both sides hold f32
                    // tensors computed by different kernels, so last-bit differences are expected.
                    assert!((a - b).abs() <= 1e-4 * b.abs().max(1e-3), "{site}/{role} {stat}[{i}]: opscope {a}, onnxruntime {b}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 50_000, "compared {checked} values");

    // Attention probes against numpy on onnxruntime's Softmax outputs. Entries that are null in
    // the reference (a position that is padding in every sentence) must be absent here.
    let compare = |what: &str, got: &std::collections::BTreeMap<String, Vec<(u64, f64)>>, want: &serde_json::Map<String, serde_json::Value>| {
        let mut n = 0;
        for (stat, w) in want {
            let w: Vec<Option<f64>> = serde_json::from_value(w.clone()).unwrap();
            let g: std::collections::BTreeMap<u64, f64> = got.get(stat).unwrap_or_else(|| panic!("{what}: {stat} missing")).iter().copied().collect();
            assert_eq!(g.len(), w.iter().filter(|x| x.is_some()).count(), "{what} {stat}: recorded entries");
            for (i, w) in w.iter().enumerate() {
                if let Some(w) = w {
                    let a = g[&(i as u64)];
                    assert!((a - w).abs() <= 1e-4 * w.abs().max(1e-2), "{what} {stat}[{i}]: opscope {a}, onnxruntime {w}");
                    n += 1;
                }
            }
        }
        n
    };
    let with_idx = |site: &str, role: &str| {
        let mut m: std::collections::BTreeMap<String, Vec<(u64, f64)>> = Default::default();
        for r in rows.iter().filter(|r| &*r.site == site && &*r.role == role && r.step == 0) {
            m.entry(r.stat.to_string()).or_default().push((r.idx, r.value as f64));
        }
        m
    };
    let attn = r["attn"].as_object().unwrap();
    assert_eq!(attn.len(), 3, "3 attention Softmax sites");
    let mut probes = 0;
    for (site, want) in attn {
        probes += compare(site, &with_idx(site, "probs"), want.as_object().unwrap());
    }
    let blocks = r["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 6, "6 residual blocks (attention + FFN per layer)");
    for (k, want) in blocks.iter().enumerate() {
        let site = format!("block.{k}");
        probes += compare(&site, &with_idx(&site, "block"), want.as_object().unwrap());
    }
    assert!(probes > 2_000, "compared {probes} probe values");
}

#[test]
fn measure_on_minilm_holds_together() {
    let (onnx, tok, text) = assets();
    let entries: Vec<String> = split_entries(&std::fs::read_to_string(&text).unwrap()).into_iter().take(20).collect();
    // 20 entries in batches of 8: two full batches and a tail of 4 (its own compile).
    let job = opscope_lab::model::Job::new(&onnx, &tok, entries, 8, 32).unwrap();
    let m = opscope_lab::measure::measure(&job, |_| {}).unwrap();
    assert_eq!(m.sentences, 20);
    assert_eq!(m.attention.len(), 3);
    for a in &m.attention {
        for v in [&a.peak, &a.entropy_norm, &a.topk_mass, &a.sink_first, &a.sink_last, &a.recv_max] {
            assert_eq!(v.len(), 12, "{}: one value per head", a.site);
            assert!(v.iter().all(|x| (0.0..=1.0).contains(x)), "{}: {v:?}", a.site);
        }
        assert!(a.pad_mass.iter().all(|x| *x < 1e-6), "padding keys get no mass: {:?}", a.pad_mass);
        // A head's peak probability is at least its mass on any single key.
        for h in 0..12 {
            assert!(a.peak[h] + 1e-6 >= a.sink_first[h] && a.peak[h] + 1e-6 >= a.sink_last[h]);
        }
    }
    assert_eq!(m.w8a8.len(), 3);
    for q in &m.w8a8 {
        assert!(q.cos_mean < 1.0 && q.cos_mean > 0.9 && q.sqnr_db.is_finite(), "{q:?}: the actuation took effect");
    }
    // The [SEP] rows' massive activations make one scale per tensor clearly worse than per token.
    assert!(m.w8a8[0].sqnr_db + 6.0 < m.w8a8[1].sqnr_db, "{:?}", m.w8a8);
    assert_eq!(m.blocks.len(), 6);
    for b in &m.blocks {
        assert!(b.influence > 0.0 && b.influence < 1.0 && b.skip_change > 0.0, "{b:?}");
    }
    let rho = opscope_lab::measure::spearman(
        &m.blocks.iter().map(|b| b.influence).collect::<Vec<_>>(),
        &m.blocks.iter().map(|b| b.skip_change).collect::<Vec<_>>(),
    );
    assert_eq!(rho, m.spearman);
    assert!(m.markdown().contains("| block.5 |"));
}
