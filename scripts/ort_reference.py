#!/usr/bin/env python3
"""Independent reference for opscope's sketches and probes: run an ONNX model in onnxruntime
with every MatMul's operands and result, every attention Softmax and every residual Add's inputs
exposed as graph outputs, and compute the same statistics with numpy (float64), padding taken
from Hugging Face's attention mask. Also tokenizes the text with Python's `tokenizers`, so the
Rust side can check its token ids against Hugging Face's.

Input JSON:  {"texts": [...], "seq": S, "ids": [[...]], "mask": [[...]], "topk": k}
Output JSON: {"ids": [[...]], "mask": [[...]], "outputs": {name: [...]},
              "sites": {site: {role: {stat: value or [values]}}},
              "attn": {site: {stat: [values]}}, "blocks": [{stat: value or [values]}]}
"""
import argparse
import json

import numpy as np
import onnx
import onnxruntime as ort
from tokenizers import Tokenizer


HIST_BINS = 32   # the matmul tap's default `hist_bins`
ELEMSIG_K = 16   # its default `elemsig`


def stats(x):
    raw = np.asarray(x)
    x = np.asarray(x, dtype=np.float64)
    dims = x.shape
    c = dims[-1] if x.ndim else 1
    rows = x.size // c if c else 0
    f = x[np.isfinite(x)]
    out = {"count": float(f.size), "l1": float(np.abs(f).sum()), "sumsq": float((f * f).sum()),
           "nnz": float(np.count_nonzero(f)),
           # zero or subnormal in f32: where two runtimes may legitimately disagree on nnz
           # (one flushes a masked softmax probability to 0, another keeps ~1e-39).
           "tiny": float(np.count_nonzero(np.abs(f) < np.finfo(np.float32).tiny))}
    if f.size:
        mu = f.mean()
        m2 = ((f - mu) ** 2).mean()
        out.update(min=float(f.min()), max=float(f.max()), mean=float(mu))
        if m2 > 0:
            out["kurtosis"] = float(((f - mu) ** 4).mean() / m2 ** 2)
    out["nan_count"] = float(np.isnan(x).sum())
    out["posinf_count"] = float(np.isposinf(x).sum())
    out["neginf_count"] = float(np.isneginf(x).sum())
    if f.size:
        # The default `hist_range=absmax`: HIST_BINS bins over [-max|x|, max|x|], numpy's edges
        # and assignment. `hist_edge_slack` counts the values within 1e-6 of the range of an
        # interior edge: two runtimes' last-bit differences can move exactly those across one.
        m = float(np.abs(f).max())
        counts, _ = np.histogram(f, bins=HIST_BINS, range=(-m, m))
        out.update(hist=counts.astype(float).tolist(), hist_lo=-m, hist_hi=m, hist_outside=0.0)
        if m > 0:
            t = (f + m) / (2 * m) * HIST_BINS  # position in bins; interior edges at 1..HIST_BINS-1
            k = np.clip(np.rint(t), 1, HIST_BINS - 1)
            out["hist_edge_slack"] = float((np.abs(t - k) <= 1e-6 * HIST_BINS).sum())
        else:
            out["hist_edge_slack"] = 0.0
    flat = raw.reshape(-1)
    out["elemsig"] = [float(flat[j * flat.size // ELEMSIG_K]) for j in range(min(ELEMSIG_K, flat.size))]
    r = x.reshape(rows, c)
    out["chan_maxabs"] = np.abs(np.where(np.isfinite(r), r, 0)).max(axis=0).tolist()
    cm = np.array(out["chan_maxabs"])
    if cm.size and cm.mean() > 0:
        out["chan_outlier"] = float(cm.max() / cm.mean())
    out["row_absmax"] = np.abs(np.where(np.isfinite(r), r, 0)).max(axis=1).tolist()
    out["pos_sumsq"] = (np.where(np.isfinite(r), r, 0) ** 2).sum(axis=1).tolist()
    block = dims[-2] if x.ndim >= 2 else 1
    b = r.reshape(rows // block, block, c)
    d = b[:, 1:, :] - b[:, :-1, :]
    out["adj_sumsq"] = float((d[np.isfinite(d)] ** 2).sum())
    return out


def attn_stats(p, mask, topk):
    """Attention statistics of probabilities p [B,H,S,S] with the key/query padding of mask
    [B,S] (1 = token), as opscope defines them (src/probes.rs)."""
    p = np.asarray(p, dtype=np.float64)
    b_, h_, sq, sk = p.shape
    acc = {k: np.zeros(h_) for k in ("peak", "entropy", "entropy_norm", "topk_mass", "pad_mass")}
    recv_max, seqs = np.zeros(h_), 0
    peak_pos, peak_n = np.zeros((h_, sq)), np.zeros(sq)
    recv_pos, recv_n = np.zeros((h_, sk)), np.zeros(sk)
    queries, keys = 0, 0
    topk_n = np.zeros(h_)
    # Sinks: the query at the key's own position is left out (a sink is mass other tokens give
    # it); the lift multiplies each query's mass by the keys it may see (n valid keys here).
    sink = {k: np.zeros(h_) for k in ("sink_first", "sink_last", "sink_first_lift", "sink_last_lift")}
    sink_n = 0
    for b in range(b_):
        valid = np.asarray(mask[b]) == 1
        q = p[b][:, valid, :]                                  # [H, nq, Sk]
        n = int(valid.sum())
        queries += n
        keys += n
        last = int(np.nonzero(valid)[0].max())
        acc["peak"] += q.max(axis=2).sum(axis=1)
        ent = -(np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0)).sum(axis=2)
        acc["entropy"] += ent.sum(axis=1)
        acc["entropy_norm"] += (ent / np.log(n)).sum(axis=1) if n >= 2 else 0
        if n > topk:  # a query allowed topk keys or fewer is left out of topk_mass
            acc["topk_mass"] += np.sort(q, axis=2)[:, :, ::-1][:, :, :topk].sum(axis=2).sum(axis=1)
            topk_n += n
        first = int(np.nonzero(valid)[0].min())
        # q's query axis runs over the valid positions in order: index 0 is `first`, n-1 `last`.
        sink["sink_first"] += q[:, 1:, first].sum(axis=1)
        sink["sink_last"] += q[:, :-1, last].sum(axis=1)
        sink["sink_first_lift"] += n * q[:, 1:, first].sum(axis=1)
        sink["sink_last_lift"] += n * q[:, :-1, last].sum(axis=1)
        sink_n += n - 1
        acc["pad_mass"] += q[:, :, ~valid].sum(axis=2).sum(axis=1)
        peak_pos[:, valid] += q.max(axis=2)
        peak_n[valid] += 1
        recv = q.sum(axis=1) / n                               # [H, Sk]
        recv_max += recv[:, valid].max(axis=1)
        seqs += 1
        recv_pos[:, valid] += recv[:, valid]
        recv_n[valid] += 1
    out = {k: (v / queries).tolist() for k, v in acc.items()}
    out.update({k: (v / sink_n).tolist() for k, v in sink.items()})
    with np.errstate(invalid="ignore", divide="ignore"):
        out["topk_mass"] = np.where(topk_n > 0, acc["topk_mass"] / np.maximum(topk_n, 1), np.nan).tolist()
    out["queries"] = [float(queries)]
    out["keys"] = [keys / b_]
    out["topk"] = [float(topk)]
    out["recv_max"] = (recv_max / seqs).tolist()
    with np.errstate(invalid="ignore", divide="ignore"):
        out["peak_pos"] = np.where(peak_n > 0, peak_pos / np.maximum(peak_n, 1), np.nan).ravel().tolist()
        out["recv_pos"] = np.where(recv_n > 0, recv_pos / np.maximum(recv_n, 1), np.nan).ravel().tolist()
    return {k: nan_to_none(v) for k, v in out.items()}


def nan_to_none(v):
    """JSON has no NaN: an undefined entry (a position that is padding everywhere) is null."""
    return [None if isinstance(x, float) and np.isnan(x) else x for x in v]


def block_stats(x, f, mask):
    """Residual statistics over the non-padding rows of x, f [B,S,D]."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
    f = np.asarray(f, dtype=np.float64).reshape(x.shape)
    keep = np.asarray(mask).ravel() == 1
    xv, fv = x[keep], f[keep]
    y = xv + fv
    cos = (xv * y).sum(1) / (np.linalg.norm(xv, axis=1) * np.linalg.norm(y, axis=1))
    cos_row = np.full(x.shape[0], np.nan)
    cos_row[keep] = cos
    return {"rows": [float(keep.sum())], "ratio": [float(np.sqrt((fv ** 2).sum() / (xv ** 2).sum()))],
            "cos": [float(cos.mean())], "cos_row": nan_to_none(cos_row.tolist())}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    req = json.load(open(a.input))
    tok = Tokenizer.from_file(a.tokenizer)
    tok.enable_truncation(max_length=req["seq"])
    tok.enable_padding(length=req["seq"], pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    enc = tok.encode_batch(req["texts"], add_special_tokens=True)
    hf_ids = [e.ids for e in enc]
    hf_mask = [e.attention_mask for e in enc]

    model = onnx.load(a.onnx)
    g = model.graph
    known = {o.name for o in g.output}
    tensors = {}
    for node in g.node:
        if node.op_type != "MatMul":
            continue
        site = node.name.lstrip("/")
        tensors[site] = {"lhs": node.input[0], "rhs": node.input[1], "out": node.output[0]}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer}
    # Attention: Softmax nodes whose output feeds a MatMul (the probabilities @ V).
    consumers = {}
    for node in g.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    producer = {o: node for node in g.node for o in node.output}
    softmax = {node.name.lstrip("/"): node.output[0] for node in g.node
               if node.op_type == "Softmax" and any(c.op_type == "MatMul" for c in consumers.get(node.output[0], []))}
    # Residual blocks: an Add feeding a LayerNormalization whose other input is a LayerNormalization
    # output (the stream x; post-LN BERT), in node order.
    blocks = []
    for node in g.node:
        if node.op_type != "Add" or not any(c.op_type == "LayerNormalization" for c in consumers.get(node.output[0], [])):
            continue
        ins = list(node.input)
        streams = [i for i in ins if i in producer and producer[i].op_type == "LayerNormalization"]
        if len(streams) == 1:
            blocks.append((streams[0], [i for i in ins if i != streams[0]][0]))
    extra = list(softmax.values()) + [t for pair in blocks for t in pair]
    for t in extra:
        if t not in known and t not in inits:
            g.output.append(onnx.helper.make_empty_tensor_value_info(t))
            known.add(t)
    for roles in tensors.values():
        for t in roles.values():
            if t not in known and t not in inits:
                g.output.append(onnx.helper.make_empty_tensor_value_info(t))
                known.add(t)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array(req["ids"], dtype=np.int64),
             "attention_mask": np.array(req["mask"], dtype=np.int64)}
    names = [o.name for o in sess.get_outputs()]
    values = dict(zip(names, sess.run(names, feeds)))
    values.update(inits)
    sites = {site: {role: stats(values[t]) for role, t in roles.items()} for site, roles in tensors.items()}
    mask = np.array(req["mask"])
    attn = {site: attn_stats(values[t], mask, req.get("topk", 8)) for site, t in softmax.items()}
    blocks_out = [block_stats(values[x], values[f], mask) for x, f in blocks]
    first = [o.name for o in onnx.load(a.onnx).graph.output]
    json.dump({"ids": hf_ids, "mask": hf_mask,
               "outputs": {n: np.asarray(values[n], dtype=np.float64).ravel().tolist() for n in first},
               "output_order": first,
               "sites": sites, "attn": attn, "blocks": blocks_out}, open(a.out, "w"))


if __name__ == "__main__":
    main()
