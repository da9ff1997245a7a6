//! The tokenizer of a GGUF model, from its metadata (`tokenizer.ggml.*`), built with Hugging
//! Face `tokenizers`: a byte-level BPE (GPT-2, Radford et al. 2019) over the file's vocabulary and
//! merge list.
//!
//! Pre-tokenization follows `tokenizer.ggml.pre`: `smollm` (SmolLM/SmolLM2) splits every digit on
//! its own, then applies GPT-2's regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_SMOLLM`; Hugging Face's
//! `tokenizer.json` for SmolLM2 has the same `Digits(individual_digits) + ByteLevel` sequence);
//! `gpt2` and `default` apply GPT-2's regex alone. Control tokens (`tokenizer.ggml.token_type`
//! 3, e.g. `<|im_start|>`) are special tokens: matched in the text before BPE, never split.
//! A BOS token is prepended only when `tokenizer.ggml.add_bos_token` is true (SmolLM2: false).


use anyhow::{bail, Context, Result};
use rlx_gguf::{GgufFile, MetaValue};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

/// GGUF `tokenizer.ggml.token_type` of a control token (llama.cpp `LLAMA_TOKEN_TYPE_CONTROL`).
const TOKEN_TYPE_CONTROL: i64 = 3;

/// A byte-level BPE tokenizer read from GGUF metadata.
pub struct GgufTokenizer {
    tok: Tokenizer,
    /// BOS id, prepended when the model asks for it.
    pub bos: Option<u32>,
    /// EOS id (`tokenizer.ggml.eos_token_id`), used as the padding id.
    pub eos: u32,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
}

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>> {
    let arr = f.metadata.get(key).and_then(|v| v.as_array()).with_context(|| format!("GGUF metadata '{key}' is missing or not an array"))?;
    arr.iter()
        .map(|v| v.as_str().map(str::to_string).with_context(|| format!("GGUF metadata '{key}' holds a non-string")))
        .collect()
}

fn int(v: &MetaValue) -> Option<i64> {
    match v {
        MetaValue::I32(x) => Some(*x as i64),
        MetaValue::U32(x) => Some(*x as i64),
        MetaValue::I64(x) => Some(*x),
        MetaValue::U64(x) => Some(*x as i64),
        MetaValue::U8(x) => Some(*x as i64),
        MetaValue::I8(x) => Some(*x as i64),
        MetaValue::U16(x) => Some(*x as i64),
        MetaValue::I16(x) => Some(*x as i64),
        _ => None,
    }
}

impl GgufTokenizer {
    /// Build the tokenizer from `f`'s metadata.
    ///
    /// Errors: `tokenizer.ggml.model` is not `gpt2` (byte-level BPE), `tokenizer.ggml.pre` is not
    /// one this builder knows (`smollm`, `gpt2`, `default`), the vocabulary or merges are
    /// missing or malformed.
    pub fn from_gguf(f: &GgufFile) -> Result<GgufTokenizer> {
        let model = f.metadata.get("tokenizer.ggml.model").and_then(|v| v.as_str()).unwrap_or("");
        if model != "gpt2" {
            bail!("tokenizer.ggml.model is '{model}'; opscope builds byte-level BPE ('gpt2') tokenizers only");
        }
        let pre = f.metadata.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let digits = match pre {
            "smollm" => true,
            "gpt2" | "default" => false,
            other => bail!("tokenizer.ggml.pre is '{other}'; opscope knows the pre-tokenizers 'smollm', 'gpt2' and 'default'"),
        };
        let tokens = strings(f, "tokenizer.ggml.tokens")?;
        let merges = strings(f, "tokenizer.ggml.merges")?;
        let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        if vocab.len() != tokens.len() {
            bail!("tokenizer.ggml.tokens holds duplicate tokens");
        }
        let merges: Vec<(String, String)> = merges
            .iter()
            .map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())).with_context(|| format!("merge '{m}' is not two tokens separated by a space")))
            .collect::<Result<_>>()?;
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| anyhow::anyhow!("building the BPE model: {e}"))?;
        let mut tok = Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tok: PreTokenizerWrapper = if digits {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        } else {
            byte_level.into()
        };
        tok.with_pre_tokenizer(Some(pre_tok));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        let types: Vec<i64> = f
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|v| int(v).unwrap_or(1)).collect())
            .unwrap_or_default();
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        tok.add_special_tokens(&special);
        let id = |key: &str| f.metadata.get(key).and_then(int).map(|v| v as u32);
        let add_bos = matches!(f.metadata.get("tokenizer.ggml.add_bos_token"), Some(MetaValue::Bool(true)));
        let bos = if add_bos { Some(id("tokenizer.ggml.bos_token_id").context("add_bos_token is set but bos_token_id is missing")?) } else { None };
        let eos = id("tokenizer.ggml.eos_token_id").context("GGUF metadata 'tokenizer.ggml.eos_token_id' is missing")?;
        Ok(GgufTokenizer { tok, bos, eos, vocab_size: tokens.len() })
    }

    /// Token ids of `text` (control tokens in the text are matched as such; BOS prepended when
    /// the model asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tok.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(self.bos.into_iter().chain(enc.get_ids().iter().copied()).collect())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok.decode(ids, false).map_err(|e| anyhow::anyhow!("decoding: {e}"))
    }
}
