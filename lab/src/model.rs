//! The real-model job: an ONNX sentence encoder imported with rlx-onnx-import, real text split
//! into entries and tokenized exactly as Hugging Face `tokenizers` does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use rlx_ir::{DType, Graph};
use rlx_onnx_import::{build_hir_from_onnx_file, ImportOptions};
use rlx_runtime::{CompileOptions, CompiledGraph, Session};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};

/// The text file at `path` as UTF-8.
///
/// Errors: the file cannot be read, or is not UTF-8 (the error gives the line and byte offset
/// of the first bad byte, so the file can be fixed or re-encoded, e.g. `iconv -t UTF-8`).
pub fn read_text(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count() + 1;
        anyhow::anyhow!(
            "{}: not UTF-8 text: byte {at} (line {line}) is not valid UTF-8; re-encode the file as UTF-8 (e.g. iconv -t UTF-8)",
            path.display()
        )
    })
}

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
/// `seq` with its own pad token (attention mask 0 on padding), as `tokenizer(texts,
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
    /// Texts of the batch longer than `seq` tokens (with special tokens), cut to `seq`: their
    /// tail was not run.
    pub truncated: usize,
}

/// Pad tokens of the common tokenizer families, tried in this order when `tokenizer.json` has
/// no padding configuration: BERT/WordPiece `[PAD]`, RoBERTa/XLM-R/MPNet/T5 `<pad>`, and the
/// `<|pad|>` / `<|padding|>` of some BPE chat tokenizers.
pub const PAD_TOKENS: [&str; 4] = ["[PAD]", "<pad>", "<|pad|>", "<|padding|>"];

impl TextEncoder {
    /// Load `tokenizer.json`. The pad token, id and side come from its own padding
    /// configuration when it has one (as `tokenizers` uses it); else from the first of
    /// [`PAD_TOKENS`] the vocabulary holds, padding on the right.
    ///
    /// Errors: `seq < 2`, the file is missing or is not a tokenizer, or it has no pad token.
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
        let padding = match tok.get_padding() {
            Some(p) => PaddingParams { strategy: PaddingStrategy::Fixed(seq), ..p.clone() },
            None => {
                let (pad_token, pad_id) = PAD_TOKENS
                    .iter()
                    .find_map(|t| tok.token_to_id(t).map(|id| (t.to_string(), id)))
                    .with_context(|| {
                        format!(
                            "{} has no pad token: its padding configuration is empty and its vocabulary holds none of {}; \
                             set one with tokenizer.enable_padding(pad_token=...) and save it",
                            path.display(),
                            PAD_TOKENS.join(", ")
                        )
                    })?;
                PaddingParams { strategy: PaddingStrategy::Fixed(seq), pad_id, pad_token, ..Default::default() }
            }
        };
        tok.with_truncation(Some(TruncationParams {
            max_length: seq,
            ..Default::default()
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        tok.with_padding(Some(padding));
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
        // `tokenizers` keeps what truncation cut off as overflowing encodings.
        let truncated = encs.iter().filter(|e| !e.get_overflowing().is_empty()).count();
        for e in &encs {
            if e.get_ids().len() != self.seq {
                bail!("tokenizer produced {} tokens, expected {}", e.get_ids().len(), self.seq);
            }
            ids.extend(e.get_ids().iter().map(|&i| i as i64));
            mask.extend(e.get_attention_mask().iter().map(|&m| m as i64));
        }
        Ok(Encoded { ids, mask, truncated })
    }
}

/// What a text model's graph input holds, by its Hugging Face export name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextInput {
    /// `input_ids`: token ids.
    Ids,
    /// `attention_mask`: 1 on real tokens, 0 on padding.
    Mask,
    /// `token_type_ids`: segment ids (0: one segment per sentence).
    TokenTypes,
    /// `position_ids`: 0..seq in every row.
    Positions,
}

/// One graph input as the job feeds it: what it holds, its declared dtype, its element count.
#[derive(Debug, Clone)]
struct Feed {
    name: String,
    what: TextInput,
    dtype: DType,
    numel: usize,
}

impl Feed {
    /// The input's bytes for `enc`, in its declared dtype (little-endian), `batch` rows of `seq`
    /// (or one row when the model declares a single row, as position ids often are).
    fn bytes(&self, enc: &Encoded, seq: usize) -> Result<Vec<u8>> {
        let rows = self.numel / seq.max(1);
        let values: Vec<i64> = match self.what {
            TextInput::Ids => enc.ids[..rows * seq].to_vec(),
            TextInput::Mask => enc.mask[..rows * seq].to_vec(),
            TextInput::TokenTypes => vec![0; rows * seq],
            TextInput::Positions => (0..rows * seq).map(|i| (i % seq) as i64).collect(),
        };
        // The dtypes `text_feeds` admits (int32, int64, float32), encoded as `--inputs` arrays are.
        let values: Vec<f64> = values.iter().map(|&v| v as f64).collect();
        let out = crate::npz::encode(&values, self.dtype, &self.name)?;
        let want = self.numel * self.dtype.size_bytes();
        if out.len() != want {
            bail!("input '{}' needs {want} bytes ({} x {:?}), the batch gives {}", self.name, self.numel, self.dtype, out.len());
        }
        Ok(out)
    }
}

/// The inputs of `graph` as text inputs the job can feed, each in its declared dtype.
///
/// Errors: an input that is not one of `input_ids`, `attention_mask`, `token_type_ids`,
/// `position_ids` (named, with its dtype and shape), one of another dtype than int32, int64 or
/// float32, a symbolic shape, a size that is neither `batch x seq` nor `seq`, or no `input_ids`.
fn text_feeds(graph: &Graph, path: &Path, batch: usize, seq: usize) -> Result<Vec<Feed>> {
    let mut feeds = Vec::new();
    for n in graph.nodes() {
        let rlx_ir::Op::Input { name } = &n.op else { continue };
        let what = match name.as_str() {
            "input_ids" => TextInput::Ids,
            "attention_mask" => TextInput::Mask,
            "token_type_ids" => TextInput::TokenTypes,
            "position_ids" => TextInput::Positions,
            other => bail!(
                "{}: input '{other}' ({:?} {}) is not a text input opscope can feed; it feeds input_ids, attention_mask, token_type_ids and position_ids",
                path.display(),
                n.shape.dtype(),
                opscope::sketch::shape_text(&n.shape)
            ),
        };
        let dtype = n.shape.dtype();
        if !matches!(dtype, DType::I32 | DType::I64 | DType::F32) {
            bail!("{}: input '{name}' is {dtype:?}; opscope feeds text inputs as int32, int64 or float32", path.display());
        }
        let numel = opscope::sketch::static_dims(&n.shape)
            .map(|d| d.iter().product::<usize>())
            .with_context(|| format!("{}: input '{name}' has a symbolic shape after import", path.display()))?;
        if numel != batch * seq && numel != seq {
            bail!("{}: input '{name}' holds {numel} values, expected {batch} x {seq}", path.display());
        }
        feeds.push(Feed { name: name.clone(), what, dtype, numel });
    }
    if !feeds.iter().any(|f| f.what == TextInput::Ids) {
        bail!("{}: the model has no 'input_ids' input; expected a text model", path.display());
    }
    Ok(feeds)
}

/// An ONNX encoder imported for a fixed `[batch, seq]`.
pub struct OnnxEncoder {
    /// The imported MIR graph (what a tap sees).
    pub graph: Graph,
    params: HashMap<String, Vec<f32>>,
    feeds: Vec<Feed>,
    /// Batch size the graph was imported for.
    pub batch: usize,
    /// Sequence length the graph was imported for.
    pub seq: usize,
}

impl OnnxEncoder {
    /// Import `path` for `[batch, seq]` text inputs (`input_ids`, and any of `attention_mask`,
    /// `token_type_ids`, `position_ids`), each fed in the dtype the model declares.
    ///
    /// Errors: the file is missing or does not import, or an input cannot be fed
    /// ([`text_feeds`]).
    pub fn load(path: &Path, batch: usize, seq: usize) -> Result<OnnxEncoder> {
        if !path.is_file() {
            bail!("{}: no such ONNX file (run scripts/fetch-assets.sh to fetch MiniLM)", path.display());
        }
        let mut magic = [0u8; 4];
        let gguf = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok() && &magic == b"GGUF";
        if gguf {
            bail!("{}: a GGUF file, not ONNX: pass it as --gguf (a Llama-architecture decoder; its tokenizer is read from the file)", path.display());
        }
        let opts = ImportOptions {
            sequence_length: seq,
            named_lengths: HashMap::from([("batch_size".to_string(), batch)]),
            ..Default::default()
        };
        let (hir, params, _report, _manifest) = build_hir_from_onnx_file(path, opts)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("importing {} (is it an ONNX model? --onnx takes a .onnx file)", path.display()))?;
        let mut graph = hir
            .lower_to_mir()
            .map_err(|e| anyhow::anyhow!("{e:?}"))
            .context("lowering the imported model to MIR")?
            .into_graph();
        graph.name = format!("{}_b{batch}_s{seq}", stem(path));
        let feeds = text_feeds(&graph, path, batch, seq)?;
        Ok(OnnxEncoder {
            graph,
            params,
            feeds,
            batch,
            seq,
        })
    }

    /// Compile (through `Session::compile_with`, so taps see it) and bind the weights.
    ///
    /// Options: ONNX Level 3 ([`compile_options`]: `CompileOptions::default()`, as `rlx_onnx`
    /// uses, without `cache_param_invariant`).
    ///
    /// Weights are bound with `opscope::params::bind`, so params an actuation derives from them
    /// (the `lowrank` factors) are computed and set too.
    ///
    /// Errors: a derived param cannot be computed, or one the graph declares was never set.
    pub fn compile(&self, session: &Session) -> Result<CompiledGraph> {
        let mut c = session.compile_with(self.graph.clone(), &compile_options());
        self.bind(&mut c)?;
        Ok(c)
    }

    /// Bind the weights (and the params an actuation derives from them) and the input-shape
    /// param of `c`, compiled from [`OnnxEncoder::graph`] with [`compile_options`]: what
    /// [`OnnxEncoder::compile`] does after the compile itself.
    ///
    /// Errors: as [`OnnxEncoder::compile`].
    pub fn bind(&self, c: &mut CompiledGraph) -> Result<()> {
        for (name, data) in &self.params {
            opscope::params::bind(c, name, data)?;
        }
        opscope::params::check(c)?;
        let shape = [self.batch as i64, self.seq as i64];
        let bytes: Vec<u8> = shape.iter().flat_map(|v| v.to_le_bytes()).collect();
        c.set_param_typed("__onnx_runtime__/input_ids_shape", &bytes, DType::I64);
        Ok(())
    }

    /// The graph, its weights and one batch's inputs as typed buffers, for a node-by-node
    /// parity check compiled with the options [`OnnxEncoder::compile`] uses.
    ///
    /// Errors: the batch does not fit the graph's `[batch, seq]`.
    pub fn parity_input(&self, enc: &Encoded) -> Result<crate::parity::ParityInput> {
        if enc.ids.len() != self.batch * self.seq {
            bail!("batch holds {} ids, graph expects {}x{}", enc.ids.len(), self.batch, self.seq);
        }
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let mut params: Vec<(String, (Vec<u8>, DType))> = self.params.iter().map(|(n, d)| (n.clone(), (f32_bytes(d), DType::F32))).collect();
        let shape: Vec<u8> = [self.batch as i64, self.seq as i64].iter().flat_map(|v| v.to_le_bytes()).collect();
        params.push(("__onnx_runtime__/input_ids_shape".into(), (shape, DType::I64)));
        let inputs = self
            .feeds
            .iter()
            .map(|f| Ok((f.name.clone(), (f.bytes(enc, self.seq)?, f.dtype))))
            .collect::<Result<Vec<_>>>()?;
        Ok(crate::parity::ParityInput { graph: self.graph.clone(), params, inputs, options: compile_options(), device: rlx_runtime::Device::Cpu })
    }

    /// One batch's inputs as `run_typed` takes them: (name, little-endian bytes, dtype), in the
    /// model's input order.
    ///
    /// Errors: the batch does not fit the graph's `[batch, seq]`.
    pub fn inputs(&self, enc: &Encoded) -> Result<Vec<(String, Vec<u8>, DType)>> {
        if enc.ids.len() != self.batch * self.seq {
            bail!("batch holds {} ids, graph expects {}x{}", enc.ids.len(), self.batch, self.seq);
        }
        self.feeds.iter().map(|f| Ok((f.name.clone(), f.bytes(enc, self.seq)?, f.dtype))).collect()
    }

    /// Run one batch; returns the model's outputs as (little-endian bytes, dtype), in graph
    /// output order (see [`decode`]).
    pub fn run(&self, compiled: &mut CompiledGraph, enc: &Encoded) -> Result<Vec<(Vec<u8>, DType)>> {
        if enc.ids.len() != self.batch * self.seq {
            bail!("batch holds {} ids, graph expects {}x{}", enc.ids.len(), self.batch, self.seq);
        }
        // Every byte length is checked before RLX sees the inputs (a short buffer would be read
        // past its end).
        let bytes = self.feeds.iter().map(|f| f.bytes(enc, self.seq)).collect::<Result<Vec<_>>>()?;
        let inputs: Vec<(&str, &[u8], DType)> =
            self.feeds.iter().zip(&bytes).map(|(f, b)| (f.name.as_str(), b.as_slice(), f.dtype)).collect();
        Ok(compiled.run_typed(&inputs))
    }
}

/// The options every model job (`record`, `measure`, `time`, the GGUF decoder and `.npz` inputs)
/// compiles its model with: `CompileOptions::default()` (RLX's defaults with the `RLX_*`
/// environment applied) without `cache_param_invariant`, whatever `RLX_CACHE_PARAM_INVARIANT`
/// says. Under `run_typed` (I64 token ids), RLX 0.2.19 hands an op that reads a hoisted value
/// zeros: measured on MiniLM-L3 with `RLX_CACHE_PARAM_INVARIANT=1`, every recorded activation
/// of layer 1 was 0 and the weight sketches came back unfilled (the recorder refused them), so
/// the model computed on zeros. A note on stderr says the variable was ignored (once per
/// process). `lab/tests/cli.rs` records the same rows with and without the variable.
pub fn compile_options() -> CompileOptions {
    static NOTED: std::sync::Once = std::sync::Once::new();
    let mut options = CompileOptions::default();
    if options.cache_param_invariant {
        NOTED.call_once(|| {
            eprintln!(
                "opscope: note: RLX_CACHE_PARAM_INVARIANT ignored: with hoisted params RLX 0.2.19 computes a model run on \
                 typed inputs (token ids) on zeros; the model is compiled without hoisting"
            )
        });
        options.cache_param_invariant = false;
    }
    options
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

/// The activation memory RLX would plan for `enc`'s fused graph (rlx-compile's memory planner
/// on the graph `Session::compile` runs, as `rlx_runtime::plan_arena_bytes` does), against the soft memory budget RLX itself uses
/// (`soft_memory_budget_bytes`: 80% of RAM by default, `RLX_SOFT_MEMORY_FRACTION`).
///
/// Errors: the plan exceeds the budget; the message gives the largest batch that fits (the plan
/// grows linearly with the batch).
fn check_memory(enc: &OnnxEncoder) -> Result<()> {
    let Some(budget) = rlx_runtime::soft_memory_budget_bytes() else { return Ok(()) };
    let fused = opscope::activate::fuse(&enc.graph, rlx_runtime::Device::Cpu, &CompileOptions::default());
    // What `rlx_runtime::plan_arena_bytes` does for the CPU (that function sits behind RLX's
    // `hwprofile` feature): plan the graph's memory with rlx-compile's inference planner.
    let arena = rlx_compile::memory::plan_memory_with_options(&fused, 128, rlx_compile::memory::MemoryPlanOptions::inference()).arena_size;
    let weights: usize = enc.params.values().map(|p| p.len() * 4).sum();
    // Measured on MiniLM-L3 at --seq 64: the plan is 43 MB per sentence and the process's peak
    // RSS is the plan plus about 250 MB (batch 64: 2.77 GB planned, 3.03 GB peak). A 10% margin
    // on the activations, the weights twice (imported and bound) and 256 MB for the rest.
    let margin = |a: usize| a + a / 10;
    let need = margin(arena) + 2 * weights + (256 << 20);
    if need > budget {
        let per = margin(arena).div_ceil(enc.batch.max(1));
        let fits = budget.saturating_sub(2 * weights + (256 << 20)) / per.max(1);
        bail!(
            "a batch of {} sentences at --seq {} needs about {:.1} GB (RLX plans a {:.1} GB activation arena, {:.0} MB per sentence), \
             more than the {:.1} GB memory budget (RLX_SOFT_MEMORY_FRACTION of RAM, or RLX_SOFT_MEMORY_BUDGET_BYTES); \
             the largest --batch that fits is {fits}",
            enc.batch,
            enc.seq,
            need as f64 / 1e9,
            arena as f64 / 1e9,
            per as f64 / 1e6,
            budget as f64 / 1e9
        );
    }
    Ok(())
}

/// Set (by the CLI's Ctrl-C handler) to stop a [`Job`] after the batch in progress; the
/// recording is then closed as partial (readable, left at `<out>.partial`).
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Set by a job's loop when it stopped before its last batch because [`INTERRUPTED`] was set:
/// the scope's interrupt flag, so the recording is closed as partial only when batches were
/// left out. A signal during or after the last batch leaves it unset, and the recording, whole,
/// is finished as usual ([`opscope::activate::Summary::interrupted`] false).
pub static STOPPED_EARLY: AtomicBool = AtomicBool::new(false);

/// True (and [`STOPPED_EARLY`] set) when [`INTERRUPTED`] asks a job's loop to stop before its
/// next batch.
pub fn stop_before_next() -> bool {
    let stop = INTERRUPTED.load(Ordering::SeqCst);
    if stop {
        STOPPED_EARLY.store(true, Ordering::SeqCst);
    }
    stop
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
        check_memory(&full)?;
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

    /// Sentences longer than `seq` tokens, cut to `seq` (their tail is not run).
    pub fn truncated(&self) -> usize {
        self.encoded.iter().map(|e| e.truncated).sum()
    }

    /// Run every batch with `pipeline` active at `stage`, recording to `sink`; `each` gets the
    /// batch's sentence count and the model's outputs (see [`OnnxEncoder::run`]). Stops after the
    /// batch in progress when [`INTERRUPTED`] is set (the recording is then partial).
    ///
    /// Errors: the first error of `each`, of a run, or of the recording.
    pub fn run(
        &self,
        pipeline: &opscope::Pipeline,
        stage: opscope::activate::Stage,
        sink: Box<dyn opscope::Sink>,
        each: impl FnMut(usize, Vec<(Vec<u8>, DType)>) -> Result<()>,
    ) -> Result<()> {
        self.run_on(rlx_runtime::Device::Cpu, pipeline, stage, sink, each).map(|_| ())
    }

    /// [`Job::run`] compiled for and run on `device` (the scope fuses as that device fuses and
    /// lowers the sketches where it has no native kernel: [`opscope::Scope::device`]).
    ///
    /// Errors: as [`Job::run`].
    pub fn run_on(
        &self,
        device: rlx_runtime::Device,
        pipeline: &opscope::Pipeline,
        stage: opscope::activate::Stage,
        sink: Box<dyn opscope::Sink>,
        each: impl FnMut(usize, Vec<(Vec<u8>, DType)>) -> Result<()>,
    ) -> Result<opscope::activate::Summary> {
        let session = Session::new(device);
        STOPPED_EARLY.store(false, Ordering::SeqCst);
        let scope = opscope::Scope::new(pipeline, sink).stage(stage).device(device).interrupt_flag(&STOPPED_EARLY);
        let (res, recorded) = scope.run(|| self.run_batches(&session, each));
        res?;
        recorded.context("recording")
    }

    /// The same loop as [`Job::run`] with no tap: compile and run every batch on the CPU (the
    /// baseline an end-to-end recording cost is measured against).
    ///
    /// Errors: the first error of `each` or of a run.
    pub fn run_untapped(&self, each: impl FnMut(usize, Vec<(Vec<u8>, DType)>) -> Result<()>) -> Result<()> {
        self.run_batches(&Session::new(rlx_runtime::Device::Cpu), each)
    }

    /// Compile the full graph in `session` and run every batch, stopping after the batch in
    /// progress when [`INTERRUPTED`] is set. The tail graph is compiled only when the last,
    /// partial batch is reached, after the full graph's compile is dropped, so the two arenas
    /// are never held together. Measured on MiniLM-L3, `opscope record --limit 100` (peak RSS by
    /// `/usr/bin/time`, two runs each, the same rows recorded): 869 -> 618 MB at the default
    /// `--batch 8` (tail of 4), 4.81 -> 3.11 GB at `--batch 64` (tail of 36), the peak
    /// [`check_memory`] budgets for.
    fn run_batches(&self, session: &Session, mut each: impl FnMut(usize, Vec<(Vec<u8>, DType)>) -> Result<()>) -> Result<()> {
        let mut full = Some(self.full.compile(session)?);
        let mut tail = None;
        for (chunk, enc) in self.batches.iter().zip(&self.encoded) {
            if stop_before_next() {
                break;
            }
            let outs = if chunk.len() == self.full.batch {
                let compiled = full.as_mut().context("a full batch after the partial one: batches are run in order")?;
                self.full.run(compiled, enc)?
            } else {
                let m = self.tail.as_ref().with_context(|| format!("batch of {} has no compiled graph", chunk.len()))?;
                if tail.is_none() {
                    drop(full.take());
                    tail = Some(m.compile(session)?);
                }
                m.run(tail.as_mut().expect("compiled above"), enc)?
            };
            each(chunk.len(), outs)?;
        }
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
    /// `--onnx PATH --tokenizer PATH --text PATH`: the arguments that point an `opscope`
    /// command at these files (for `Command::args`).
    pub fn cli_args(&self) -> [&std::ffi::OsStr; 6] {
        ["--onnx".as_ref(), self.onnx.as_os_str(), "--tokenizer".as_ref(), self.tokenizer.as_os_str(), "--text".as_ref(), self.text.as_os_str()]
    }

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
