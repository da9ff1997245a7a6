//! Model inputs are fed in the dtype the model declares (issue: int32 ids and masks were fed
//! int64 bytes, interleaving zeros into the ids and reading past the buffer).

use std::path::PathBuf;
use std::process::Command;

fn opscope() -> Command {
    Command::new(env!("CARGO_BIN_EXE_opscope"))
}

#[test]
fn int32_and_int64_inputs_record_the_same_numbers_as_numpy() {
    let assets = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let texts = ["Beware of a tall black man with one blond shoe.", "Hi."];
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/dtype_models.py");
    let st = Command::new("python3")
        .arg(&script)
        .arg("--tokenizer")
        .arg(&assets.tokenizer)
        .args(["--seq", "8", "--out"])
        .arg(dir.path())
        .args(texts)
        .status()
        .expect("python3 runs");
    assert!(st.success(), "{} failed: pip install -r scripts/requirements-test.txt", script.display());
    let reference: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("ref.json")).unwrap()).unwrap();
    let want = reference["lhs_nnz"].as_f64().unwrap();
    assert_eq!(want, 4.0 * reference["tokens"].as_f64().unwrap(), "the reference counts real tokens x width");
    let text = dir.path().join("texts.txt");
    std::fs::write(&text, texts.join("\n%\n")).unwrap();
    for model in ["model_int32.onnx", "model_int64.onnx"] {
        let out = dir.path().join(format!("{model}.csv"));
        let run = opscope()
            .args(["record", "--batch", "2", "--seq", "8", "--pipeline", "matmul{roles=[lhs],stats=[nnz]}"])
            .arg("--onnx")
            .arg(dir.path().join(model))
            .arg("--tokenizer")
            .arg(&assets.tokenizer)
            .arg("--text")
            .arg(&text)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(run.status.success(), "{model}: {}", String::from_utf8_lossy(&run.stderr));
        let mut reader = csv::Reader::from_path(&out).unwrap();
        let rows: Vec<opscope::Row> = reader.deserialize().collect::<Result<_, _>>().unwrap();
        let nnz: Vec<f32> = rows.iter().filter(|r| &*r.stat == "nnz" && r.site.contains("proj")).map(|r| r.value).collect();
        assert_eq!(nnz, vec![want as f32], "{model}: lhs nnz of /proj/MatMul");
    }
    // The same inputs from a numpy .npz (two batches along axis 0), no tokenizer involved.
    let record_npz = |pipeline: &str, out: &std::path::Path| {
        let run = opscope()
            .args(["record", "--pipeline", pipeline, "--onnx"])
            .arg(dir.path().join("model_int32.onnx"))
            .arg("--inputs")
            .arg(dir.path().join("inputs.npz"))
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(run.status.success(), "npz {pipeline}: {}", String::from_utf8_lossy(&run.stderr));
    };
    let out = dir.path().join("npz.csv");
    record_npz("matmul{roles=[lhs],stats=[nnz]}", &out);
    let mut reader = csv::Reader::from_path(&out).unwrap();
    let rows: Vec<opscope::Row> = reader.deserialize().collect::<Result<_, _>>().unwrap();
    let nnz: Vec<f32> = rows.iter().filter(|r| &*r.stat == "nnz" && r.site.contains("proj")).map(|r| r.value).collect();
    assert_eq!(nnz, vec![want as f32; 2], "npz: one row per batch");
    // With `online`, the .npz path writes the online state beside the recording, as the text
    // path does (it wrote none, without a word, until 2026-12-07).
    let out = dir.path().join("online.csv");
    record_npz("online,matmul{roles=[lhs],stats=[nnz]}", &out);
    let state = opscope::online::OnlineState::read(&opscope::online::state_path(&out)).expect("the online state is written");
    assert!(state.sites.keys().any(|k| k.contains("proj") && k.ends_with("/lhs")), "{:?}", state.sites.keys().collect::<Vec<_>>());
    // An input the model declares and the file lacks: the error lists both.
    let run = opscope()
        .args(["record", "--onnx"])
        .arg(dir.path().join("model_int32.onnx"))
        .arg("--inputs")
        .arg(dir.path().join("no_mask.npz"))
        .arg("--out")
        .arg(dir.path().join("x.csv"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && err.contains("'attention_mask' is not in") && err.contains("the file holds [input_ids]"), "{err}");
    // Values the declared dtype cannot hold (an int32 input given 101.5): named, no panic.
    let run = opscope()
        .args(["record", "--onnx"])
        .arg(dir.path().join("model_int32.onnx"))
        .arg("--inputs")
        .arg(dir.path().join("float_ids.npz"))
        .arg("--out")
        .arg(dir.path().join("f.csv"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && err.contains("input 'input_ids' is I32 and the array holds") && !err.contains("panicked"), "{err}");
    let bad = dir.path().join("bad.npz");
    std::fs::write(&bad, "not a zip").unwrap();
    let run = opscope().args(["record", "--onnx"]).arg(dir.path().join("model_int32.onnx")).arg("--inputs").arg(&bad).arg("--out").arg(dir.path().join("y.csv")).output().unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && err.contains("not a readable .npz archive") && !err.contains("panicked"), "{err}");
}

/// MiniLM's tokenizer.json with `[PAD]` renamed `pad_name` everywhere and `padding` set to
/// `padding` (JSON), written to `dir`.
fn variant_tokenizer(dir: &std::path::Path, pad_name: &str, padding: serde_json::Value) -> PathBuf {
    let assets = opscope_lab::model::MiniLmAssets::from_cache().unwrap_or_else(|e| panic!("{e}"));
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(&assets.tokenizer).unwrap()).unwrap();
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let id = vocab.remove("[PAD]").unwrap();
    vocab.insert(pad_name.to_string(), id);
    for a in t["added_tokens"].as_array_mut().unwrap() {
        if a["content"] == "[PAD]" {
            a["content"] = pad_name.into();
        }
    }
    t["padding"] = padding;
    let path = dir.join(format!("tok-{}.json", pad_name.len()));
    std::fs::write(&path, serde_json::to_vec(&t).unwrap()).unwrap();
    path
}

/// Hugging Face `tokenizers` (Python) on the same file: ids and mask padded to `seq`, keeping
/// the file's own padding side and token when it has a padding configuration; and how many
/// texts truncation cut (their overflowing encodings).
fn python_encode(tok: &std::path::Path, pad: &str, seq: usize, texts: &[&str]) -> (Vec<i64>, Vec<i64>, usize) {
    let code = format!(
        "import json,sys\nfrom tokenizers import Tokenizer\nt=Tokenizer.from_file(sys.argv[1])\np=t.padding\nt.enable_truncation({seq})\n\
         d=p['direction'] if p else 'right'\npid=t.token_to_id('{pad}')\nt.enable_padding(length={seq},direction=d,pad_id=pid,pad_token='{pad}')\n\
         e=t.encode_batch(json.loads(sys.argv[2]))\nprint(json.dumps([sum((x.ids for x in e),[]),sum((x.attention_mask for x in e),[]),sum(1 for x in e if x.overflowing)]))"
    );
    let out = Command::new("python3").args(["-c", &code]).arg(tok).arg(serde_json::to_string(texts).unwrap()).output().unwrap();
    assert!(out.status.success(), "python tokenizers: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_tokenizer_padding_with_angle_bracket_pad_encodes_as_hugging_face_does() {
    let dir = tempfile::tempdir().unwrap();
    let texts = ["Hi.", "Beware of a tall black man with one blond shoe."];
    let owned: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
    // No padding configuration: the pad token is found in the vocabulary (<pad>, RoBERTa's).
    let plain = variant_tokenizer(dir.path(), "<pad>", serde_json::Value::Null);
    let enc = opscope_lab::model::TextEncoder::load(&plain, 8).unwrap().encode(&owned).unwrap();
    assert_eq!((enc.ids.clone(), enc.mask.clone(), enc.truncated), python_encode(&plain, "<pad>", 8, &texts));
    assert_eq!(enc.mask.iter().filter(|&&m| m == 0).count(), 4, "'Hi.' is [CLS] hi . [SEP]: 4 pads of 8");
    assert_eq!(enc.truncated, 1, "the shoe sentence is longer than 8 tokens");
    // A padding configuration on the left: its side and token are used.
    let left = variant_tokenizer(
        dir.path(),
        "<|pad|>",
        serde_json::json!({"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|pad|>"}),
    );
    let enc = opscope_lab::model::TextEncoder::load(&left, 8).unwrap().encode(&owned).unwrap();
    assert_eq!((enc.ids.clone(), enc.mask.clone(), enc.truncated), python_encode(&left, "<|pad|>", 8, &texts));
    assert_eq!(&enc.mask[..4], &[0, 0, 0, 0], "left padding");
}

#[test]
fn a_tokenizer_without_a_pad_token_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let none = variant_tokenizer(dir.path(), "[NOTPAD]", serde_json::Value::Null);
    let err = opscope_lab::model::TextEncoder::load(&none, 8).err().expect("refused").to_string();
    assert!(err.contains("has no pad token") && err.contains("enable_padding"), "{err}");
}
