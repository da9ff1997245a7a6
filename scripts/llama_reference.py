#!/usr/bin/env python3
"""Independent reference for opscope's GGUF Llama (lab/src/llama/): tokenization and forward pass.

Written on PyPI `gguf`'s reader and dequantizer and numpy only (no RLX, no Hugging Face
`tokenizers`):

* Tokenization: a pure-Python byte-level BPE (GPT-2, Radford et al. 2019) over the GGUF file's
  `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`; control tokens are split off first; the
  `smollm` pre-tokenizer isolates every numeric character, then GPT-2's split pattern runs on each
  piece (written out by hand with `unicodedata`, as `regex` is not a test dependency).
* Forward pass in float64 on the dequantized weights, the way Hugging Face `transformers`'
  LlamaModel computes it: RMSNorm, Q/K/V, rotate-half RoPE on Q/K weights UN-permuted back to
  Hugging Face's row order (llama.cpp's converter permutes them for its adjacent-pair RoPE; this
  script undoes that, so agreement with RLX's adjacent-pair `Op::Rope` on the file's weights
  checks the permutation independently), grouped-query causal softmax attention, SwiGLU, tied
  output head.

Usage: llama_reference.py --gguf MODEL --input REQ.json --out OUT.npz
REQ: {"texts": [...], "seq": S, "sites": ["blk.0.attn_q", ...]}
OUT.npz: ids_<i> (token ids of text i), logits ([N*S, vocab] float32 for the N texts, each
right-padded with EOS to S tokens), and per site <site>.max, <site>.min, <site>.sumsq (float64
scalars over the rows of the [N*S, n] projection output that hold real tokens, padding left out
as opscope's taps leave it out), and <site>.adj_sumsq (the sum of ||y[b,t] - y[b,t-1]||^2 over
adjacent real-token positions of one sequence).
"""
import argparse
import json
import unicodedata

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(r, key):
    return r.fields[key].contents()


# ---------------------------------------------------------------- tokenizer
def bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def is_letter(c):
    return unicodedata.category(c).startswith("L")


def is_number(c):
    return unicodedata.category(c).startswith("N")


def is_other(c):
    return not c.isspace() and not is_letter(c) and not is_number(c)


def gpt2_split(s):
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out, i, n = [], 0, len(s)
    while i < n:
        if s[i] == "'":
            hit = next((suf for suf in ("s", "t", "re", "ve", "m", "ll", "d") if s.startswith(suf, i + 1)), None)
            if hit:
                out.append("'" + hit)
                i += 1 + len(hit)
                continue
        j = i + 1 if (s[i] == " " and i + 1 < n) else i
        for cls in (is_letter, is_number, is_other):
            if cls(s[j]):
                k = j
                while k < n and cls(s[k]):
                    k += 1
                out.append(s[i:k])
                i = k
                break
        else:
            # whitespace run: \s+(?!\S) leaves the last space to the next piece when one follows
            k = i
            while k < n and s[k].isspace():
                k += 1
            if k < n and k - i > 1:
                k -= 1
            out.append(s[i:k])
            i = k
    return out


def digits_split(s):
    """Hugging Face Digits(individual_digits=True): every numeric character is its own piece."""
    out, cur = [], ""
    for ch in s:
        if ch.isnumeric():
            if cur:
                out.append(cur)
                cur = ""
            out.append(ch)
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


class Bpe:
    def __init__(self, r):
        self.tokens = [str(t) for t in field(r, "tokenizer.ggml.tokens")]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [str(m) for m in field(r, "tokenizer.ggml.merges")]
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        types = list(field(r, "tokenizer.ggml.token_type"))
        self.control = sorted((t for t, ty in zip(self.tokens, types) if ty == 3), key=len, reverse=True)
        self.pre = str(field(r, "tokenizer.ggml.pre"))
        self.byte = bytes_to_unicode()

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            a, b = parts[i], parts[i + 1]
            merged, j = [], 0
            while j < len(parts):
                if j + 1 < len(parts) and parts[j] == a and parts[j + 1] == b:
                    merged.append(a + b)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        return [self.vocab[p] for p in parts]

    def encode(self, text):
        ids = []
        for chunk, special in self.split_control(text):
            if special:
                ids.append(self.vocab[chunk])
                continue
            pieces = digits_split(chunk) if self.pre == "smollm" else [chunk]
            for piece in pieces:
                for word in gpt2_split(piece):
                    ids.extend(self.bpe("".join(self.byte[b] for b in word.encode("utf-8"))))
        return ids

    def split_control(self, text):
        out, i, start = [], 0, 0
        while i < len(text):
            hit = next((c for c in self.control if text.startswith(c, i)), None)
            if hit:
                if start < i:
                    out.append((text[start:i], False))
                out.append((hit, True))
                i += len(hit)
                start = i
            else:
                i += 1
        if start < len(text):
            out.append((text[start:], False))
        return out


# ---------------------------------------------------------------- model
def load_weights(r):
    w = {}
    for t in r.tensors:
        w[t.name] = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
    return w


def unpermute(w, n_head):
    """Inverse of llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rows [out, in])."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def rms_norm(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def fake_quant(x, scope):
    """int8 fake-quant of x [rows, K] as opscope's fakequant (narrow range, ties to even):
    s = absmax / 127 per row (token) or over the tensor, codes clip(rint(x / s), -127, 127)."""
    if scope is None:
        return x
    a = np.abs(x).max(axis=1, keepdims=True) if scope == "token" else np.abs(x).max()
    s = np.where(a > 0, a / 127.0, 1.0)
    return np.clip(np.rint(x / s), -127, 127) * s


def forward(r, w, ids, sites, valid, blocks=(), attn_layers=(), fq=None):
    """ids [B, S] -> logits [B*S, vocab] (float64), and the projection outputs named in `sites`,
    their rows restricted to `valid` (a boolean [B*S]: real tokens, not padding). `blocks`:
    residual block indices K (2l after layer l's attention, 2l+1 after its FFN) whose output
    h = x + f(x) is summarized over valid rows; `attn_layers`: layers whose first-token attention
    mass and lift (mass x keys the query sees) are averaged per head over valid queries other
    than the first; `fq`:
    int8 fake-quant of every projection's input ("token" or "tensor"; None = off)."""
    L = int(field(r, "llama.block_count"))
    H = int(field(r, "llama.attention.head_count"))
    KV = int(field(r, "llama.attention.head_count_kv"))
    eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
    base = float(field(r, "llama.rope.freq_base"))
    emb = w["token_embd.weight"].astype(np.float64)
    D = emb.shape[1]
    hd = D // H
    B, S = ids.shape
    x = emb[ids.reshape(-1)]
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(S, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))  # [S, hd]
    sin = np.sin(np.concatenate([ang, ang], -1))
    causal = np.triu(np.full((S, S), -np.inf), 1)
    taps = {}
    summary = {}

    def residual(K, x):
        if K not in blocks:
            return
        a = np.abs(x)
        summary[f"block{K}.median_abs"] = np.float64(np.median(a[valid]))
        a = np.where(valid[:, None], a, -1.0)
        row, ch = np.unravel_index(np.argmax(a), a.shape)
        summary[f"block{K}.top"] = np.array([x[row, ch], row // S, row % S, ch], dtype=np.float64)

    def lin(x, name, site):
        x = fake_quant(x, fq)
        y = x @ w[name + ".weight"].astype(np.float64).T
        if site in sites:
            taps[site] = y
        return y

    for l in range(L):
        p = f"blk.{l}"
        h = rms_norm(x, w[p + ".attn_norm.weight"], eps)
        wq = unpermute(w[p + ".attn_q.weight"], H).astype(np.float64)
        wk = unpermute(w[p + ".attn_k.weight"], KV).astype(np.float64)
        hq = fake_quant(h, fq)
        q = hq @ wq.T
        k = hq @ wk.T
        for name, y in ((p + ".attn_q", q), (p + ".attn_k", k)):
            if name in sites:
                # The graph's projection output is in the FILE's (permuted) row order.
                perm_w = w[name + ".weight"].astype(np.float64)
                taps[name] = h @ perm_w.T
        v = lin(h, p + ".attn_v", p + ".attn_v")
        q = q.reshape(B, S, H, hd).transpose(0, 2, 1, 3)
        k = k.reshape(B, S, KV, hd).transpose(0, 2, 1, 3)
        v = v.reshape(B, S, KV, hd).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, H // KV, axis=1)
        v = np.repeat(v, H // KV, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        if l in attn_layers:
            # Query 0 is the first key's own position: a sink is mass other queries give it.
            vq = valid.reshape(B, S) & (np.arange(S) > 0)[None, :]
            first = s[:, :, :, 0]  # [B, H, S]
            keys = np.arange(1, S + 1, dtype=np.float64)
            summary[f"attn{l}.sink_first"] = np.array([first[:, hh][vq].mean() for hh in range(H)])
            summary[f"attn{l}.lift"] = np.array([(first[:, hh] * keys)[vq].mean() for hh in range(H)])
        a = (s @ v).transpose(0, 2, 1, 3).reshape(B * S, D)
        x = x + lin(a, p + ".attn_output", p + ".attn_output")
        residual(2 * l, x)
        h = rms_norm(x, w[p + ".ffn_norm.weight"], eps)
        g = lin(h, p + ".ffn_gate", p + ".ffn_gate")
        u = lin(h, p + ".ffn_up", p + ".ffn_up")
        x = x + lin(g / (1 + np.exp(-g)) * u, p + ".ffn_down", p + ".ffn_down")
        residual(2 * l + 1, x)
    h = rms_norm(x, w["output_norm.weight"], eps)
    head = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
    logits = fake_quant(h, fq) @ head.astype(np.float64).T
    if "output" in sites:
        taps["output"] = logits
    # adj_sumsq: sum of ||y[b, t] - y[b, t-1]||^2 over adjacent positions of one sequence that
    # are both real tokens (never across two sequences of the batch, never with padding).
    both = valid.reshape(B, S)[:, 1:] & valid.reshape(B, S)[:, :-1]
    for k, v in taps.items():
        y = v.reshape(B, S, -1)
        d = y[:, 1:] - y[:, :-1]
        summary[f"adj.{k}"] = np.float64(((d * d).sum(-1) * both).sum())
    taps = {k: v[valid] for k, v in taps.items()}
    taps.update(summary)
    return logits, taps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    req = json.load(open(a.input))
    r = GGUFReader(a.gguf)
    tok = Bpe(r)
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    seq = req["seq"]
    out = {}
    rows, valid = [], []
    for i, t in enumerate(req["texts"]):
        ids = tok.encode(t)
        out[f"ids_{i}"] = np.array(ids, dtype=np.int64)
        ids = ids[:seq]
        rows.append(ids + [eos] * (seq - len(ids)))
        valid += [True] * len(ids) + [False] * (seq - len(ids))
    if req.get("forward", True):
        w = load_weights(r)
        logits, taps = forward(
            r, w, np.array(rows, dtype=np.int64), set(req.get("sites", [])), np.array(valid),
            blocks=set(req.get("blocks", [])), attn_layers=set(req.get("attn_layers", [])), fq=req.get("fakequant"))
        summary = {k: v for k, v in taps.items() if k.startswith(("block", "attn", "adj."))}
        taps = {k: v for k, v in taps.items() if k not in summary}
        out.update({k: v for k, v in summary.items() if not k.startswith("adj.")})
        out.update({f"{k[4:]}.adj_sumsq": v for k, v in summary.items() if k.startswith("adj.")})
        out["logits"] = logits.astype(np.float32)
        # Perplexity: exp(mean NLL) of every next-token prediction inside a text (position t
        # predicts token t+1; padding never predicts nor is predicted), in float64.
        nll, n = 0.0, 0
        for b, ids in enumerate(rows):
            m = int(sum(valid[b * seq:(b + 1) * seq]))
            z = logits[b * seq:b * seq + m - 1]
            lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
            nll += float((lse - z[np.arange(m - 1), ids[1:m]]).sum())
            n += m - 1
        out["perplexity"] = np.float64(np.exp(nll / n))
        for site, y in taps.items():
            out[site + ".max"] = np.float64(y.max())
            out[site + ".min"] = np.float64(y.min())
            out[site + ".sumsq"] = np.float64((y * y).sum())
    np.savez(a.out, **out)


if __name__ == "__main__":
    main()
