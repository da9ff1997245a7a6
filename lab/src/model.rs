//! The real-model job: an ONNX sentence encoder imported with rlx-onnx-import, real text split
//! into entries and tokenized exactly as Hugging Face `tokenizers` does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rlx_ir::{DType, Graph};
use rlx_onnx_import::{build_hir_from_onnx_file, ImportOptions};
use rlx_runtime::{CompileOptions, CompiledGraph, Session};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// Split text into entries: on lines holding only `%` (the fortune format) if there are any,
/// else on blank lines. Entries are trimmed; empty ones are dropped.
pub fn split_entries(text: &str) -> Vec<String> {
    let fortune = text.lines().any(|l| l.trim_end() == "%");
    let mut entries = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let sep = if fortune { line.trim_end() == "%" } else { line.trim().is_empty() };
        if sep {
            if !cur.trim().is_empty() {
                entries.push(cur.trim().to_string());
            }
            cur.clear();
        } else {
            if !cur.is_empty() {
                cur.push('\n');
            }
            cur.push_str(line);
        }
    }
    if !cur.trim().is_empty() {
        entries.push(cur.trim().to_string());
    }
    entries
}

/// A Hugging Face tokenizer set to add special tokens, truncate to `seq` and pad to exactly
/// `seq` with its own `[PAD]` id (attention mask 0 on padding), as `tokenizer(texts,
/// padding="max_length", truncation=True, max_length=seq)` does.
pub struct TextEncoder {
    tok: Tokenizer,
    seq: usize,
}

/// One batch of encoded text: row-major `[batch, seq]` ids and attention mask.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<i64>,
    /// 1 on real tokens, 0 on padding.
    pub mask: Vec<i64>,
}

impl TextEncoder {
    /// Load `tokenizer.json`. Errors if it does not load or has no `[PAD]` token.
    pub fn load(path: &Path, seq: usize) -> Result<TextEncoder> {
        if seq < 2 {
            bail!("--seq {seq} is too short: [CLS] and [SEP] alone need 2 tokens");
        }
        if !path.is_file() {
            bail!("{}: no such tokenizer file (run scripts/fetch-assets.sh to fetch MiniLM's)", path.display());
        }
        let mut tok = Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!("{} is not a Hugging Face tokenizer.json ({e})", path.display())
        })?;
        let pad_id = tok
            .token_to_id("[PAD]")
            .with_context(|| format!("{} has no [PAD] token", path.display()))?;
        tok.with_truncation(Some(TruncationParams {
            max_length: seq,
            ..Default::default()
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        tok.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(seq),
            pad_id,
            pad_token: "[PAD]".into(),
            ..Default::default()
        }));
        Ok(TextEncoder { tok, seq })
    }

    /// Encode texts (with special tokens) into `[texts.len(), seq]` ids and mask.
    pub fn encode(&self, texts: &[String]) -> Result<Encoded> {
        let encs = self
            .tok
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        let mut ids = Vec::with_capacity(texts.len() * self.seq);
        let mut mask = Vec::with_capacity(texts.len() * self.seq);
        for e in &encs {
            if e.get_ids().len() != self.seq {
                bail!("tokenizer produced {} tokens, expected {}", e.get_ids().len(), self.seq);
            }
            ids.extend(e.get_ids().iter().map(|&i| i as i64));
            mask.extend(e.get_attention_mask().iter().map(|&m| m as i64));
        }
        Ok(Encoded { ids, mask })
    }
}

/// An ONNX encoder imported for a fixed `[batch, seq]`.
pub struct OnnxEncoder {
    /// The imported MIR graph (what a tap sees).
    pub graph: Graph,
    params: HashMap<String, Vec<f32>>,
    /// Batch size the graph was imported for.
    pub batch: usize,
    /// Sequence length the graph was imported for.
    pub seq: usize,
}

impl OnnxEncoder {
    /// Import `path` for `[batch, seq]` inputs `input_ids` and `attention_mask` (I64).
    pub fn load(path: &Path, batch: usize, seq: usize) -> Result<OnnxEncoder> {
        if !path.is_file() {
            bail!("{}: no such ONNX file (run scripts/fetch-assets.sh to fetch MiniLM)", path.display());
        }
        let opts = ImportOptions {
            sequence_length: seq,
            named_lengths: HashMap::from([("batch_size".to_string(), batch)]),
            ..Default::default()
        };
        let (hir, params, _report, _manifest) = build_hir_from_onnx_file(path, opts)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("importing {}", path.display()))?;
        let mut graph = hir
            .lower_to_mir()
            .map_err(|e| anyhow::anyhow!("{e:?}"))
            .context("lowering the imported model to MIR")?
            .into_graph();
        graph.name = format!("{}_b{batch}_s{seq}", stem(path));
        for input in ["input_ids", "attention_mask"] {
            if graph.input_id(input).is_none() {
                bail!("{}: the model has no '{input}' input; expected a BERT-style encoder", path.display());
            }
        }
        Ok(OnnxEncoder {
            graph,
            params,
            batch,
            seq,
        })
    }

    /// Compile (through `Session::compile_with`, so taps see it) and bind the weights.
    ///
    /// Options: ONNX Level 3 (`CompileOptions::default()`, as `rlx_onnx` uses). Not
    /// `cache_param_invariant`: under `run_typed` (I64 token ids) RLX 0.2.19 hands a custom op
    /// reading a hoisted value zeros (measured), so weight sketches would be lost.
    pub fn compile(&self, session: &Session) -> CompiledGraph {
        let options = CompileOptions::default();
        let mut c = session.compile_with(self.graph.clone(), &options);
        for (name, data) in &self.params {
            c.set_param(name, data);
        }
        let shape = [self.batch as i64, self.seq as i64];
        let bytes: Vec<u8> = shape.iter().flat_map(|v| v.to_le_bytes()).collect();
        c.set_param_typed("__onnx_runtime__/input_ids_shape", &bytes, DType::I64);
        c
    }

    /// Run one batch; returns the model's outputs as (little-endian bytes, dtype), in graph
    /// output order (see [`decode`]).
    pub fn run(&self, compiled: &mut CompiledGraph, enc: &Encoded) -> Result<Vec<(Vec<u8>, DType)>> {
        if enc.ids.len() != self.batch * self.seq {
            bail!("batch holds {} ids, graph expects {}x{}", enc.ids.len(), self.batch, self.seq);
        }
        let ids: Vec<u8> = enc.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mask: Vec<u8> = enc.mask.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(compiled.run_typed(&[("input_ids", &ids, DType::I64), ("attention_mask", &mask, DType::I64)]))
    }
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().replace(|c: char| !c.is_ascii_alphanumeric(), "_"))
        .unwrap_or_else(|| "model".into())
}

/// Decode little-endian output bytes of `dtype` to f64 (F32, F64, I32, I64).
///
/// Errors for any other dtype.
pub fn decode(bytes: &[u8], dtype: DType) -> Result<Vec<f64>> {
    Ok(match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::F64 => bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::I32 => bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::I64 => bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        other => bail!("cannot decode an output of dtype {other:?}"),
    })
}

/// A corpus run through an ONNX encoder in batches of `[batch, seq]`: the model imported once for
/// full batches and once for the last, partial one (its own compile), the text tokenized up
/// front. `opscope record` and `opscope measure` both run through it.
pub struct Job {
    batches: Vec<Vec<String>>,
    full: OnnxEncoder,
    tail: Option<OnnxEncoder>,
    encoded: Vec<Encoded>,
}

impl Job {
    /// Load the model for `[batch, seq]` (and the last partial batch; fewer entries than one
    /// batch make one smaller batch) and tokenize `entries`.
    ///
    /// Errors: no entries, or the model or tokenizer does not load.
    pub fn new(onnx: &Path, tokenizer: &Path, entries: Vec<String>, batch: usize, seq: usize) -> Result<Job> {
        if entries.is_empty() {
            bail!("no text entries to embed");
        }
        let text = TextEncoder::load(tokenizer, seq)?;
        let batches: Vec<Vec<String>> = entries.chunks(batch).map(|c| c.to_vec()).collect();
        let full = OnnxEncoder::load(onnx, batch.min(entries.len()), seq)?;
        let rest = entries.len() % batch;
        let tail = if rest > 0 && entries.len() > batch { Some(OnnxEncoder::load(onnx, rest, seq)?) } else { None };
        let encoded = batches.iter().map(|b| text.encode(b)).collect::<Result<Vec<_>>>()?;
        Ok(Job { batches, full, tail, encoded })
    }

    /// The imported graph of a full batch (what a tap sees).
    pub fn graph(&self) -> &Graph {
        &self.full.graph
    }

    /// Sentences in the corpus.
    pub fn sentences(&self) -> usize {
        self.batches.iter().map(|b| b.len()).sum()
    }

    /// The tokenized batches, in run order.
    pub fn encoded(&self) -> &[Encoded] {
        &self.encoded
    }

    /// Run every batch with `pipeline` active at `stage`, recording to `sink`; `each` gets the
    /// batch's sentence count and the model's outputs (see [`OnnxEncoder::run`]).
    ///
    /// Errors: the first error of `each`, of a run, or of the recording.
    pub fn run(
        &self,
        pipeline: &opscope::Pipeline,
        stage: opscope::activate::Stage,
        sink: Box<dyn opscope::Sink>,
        mut each: impl FnMut(usize, Vec<(Vec<u8>, DType)>) -> Result<()>,
    ) -> Result<()> {
        let session = Session::new(rlx_runtime::Device::Cpu);
        let (res, recorded) = opscope::Scope::new(pipeline, sink).stage(stage).run(|| -> Result<()> {
            let mut full = self.full.compile(&session);
            let mut tail = self.tail.as_ref().map(|m| (m, m.compile(&session)));
            for (chunk, enc) in self.batches.iter().zip(&self.encoded) {
                let outs = match (&mut tail, chunk.len() == self.full.batch) {
                    (_, true) => self.full.run(&mut full, enc)?,
                    (Some((m, c)), false) => m.run(c, enc)?,
                    (None, false) => bail!("batch of {} has no compiled graph", chunk.len()),
                };
                each(chunk.len(), outs)?;
            }
            Ok(())
        });
        res?;
        recorded.context("recording")?;
        Ok(())
    }
}

/// The MiniLM-L3 assets `scripts/fetch-assets.sh` fetches, in its cache folder:
/// `$OPSCOPE_CACHE`, else `$HOME/.cache/opscope` (the script's default).
pub struct MiniLmAssets {
    /// `paraphrase-MiniLM-L3-v2.onnx`.
    pub onnx: PathBuf,
    /// Its `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// `fortunes.txt` (Debian `fortunes-min`).
    pub text: PathBuf,
}

impl MiniLmAssets {
    /// The assets in the cache folder.
    ///
    /// Errors: a file is missing (named, with the script that fetches it).
    pub fn from_cache() -> Result<MiniLmAssets> {
        let dir = std::env::var_os("OPSCOPE_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/opscope")))
            .context("neither OPSCOPE_CACHE nor HOME is set: no asset cache folder")?;
        let a = MiniLmAssets {
            onnx: dir.join("paraphrase-MiniLM-L3-v2.onnx"),
            tokenizer: dir.join("tokenizer.json"),
            text: dir.join("fortunes.txt"),
        };
        for p in [&a.onnx, &a.tokenizer, &a.text] {
            if !p.is_file() {
                bail!("{} is missing: run scripts/fetch-assets.sh first", p.display());
            }
        }
        Ok(a)
    }
}
