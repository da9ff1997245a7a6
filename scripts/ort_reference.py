#!/usr/bin/env python3
"""Independent reference for opscope's matmul sketches: run an ONNX model in onnxruntime with
every MatMul's operands and result exposed as graph outputs, and compute the same statistics
with numpy (float64). Also tokenizes the text with Python's `tokenizers`, so the Rust side can
check its token ids against Hugging Face's.

Input JSON:  {"texts": [...], "seq": S, "ids": [[...]], "mask": [[...]]}
Output JSON: {"ids": [[...]], "mask": [[...]], "outputs": {name: [...]},
              "sites": {site: {role: {stat: value or [values]}}}}
"""
import argparse
import json

import numpy as np
import onnx
import onnxruntime as ort
from tokenizers import Tokenizer


def stats(x):
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
    r = x.reshape(rows, c)
    out["chan_maxabs"] = np.abs(np.where(np.isfinite(r), r, 0)).max(axis=0).tolist()
    out["pos_sumsq"] = (np.where(np.isfinite(r), r, 0) ** 2).sum(axis=1).tolist()
    block = dims[-2] if x.ndim >= 2 else 1
    b = r.reshape(rows // block, block, c)
    d = b[:, 1:, :] - b[:, :-1, :]
    out["adj_sumsq"] = float((d[np.isfinite(d)] ** 2).sum())
    return out


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
    first = [o.name for o in onnx.load(a.onnx).graph.output]
    json.dump({"ids": hf_ids, "mask": hf_mask,
               "outputs": {n: np.asarray(values[n], dtype=np.float64).ravel().tolist() for n in first},
               "output_order": first,
               "sites": sites}, open(a.out, "w"))


if __name__ == "__main__":
    main()
