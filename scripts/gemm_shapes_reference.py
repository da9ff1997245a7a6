#!/usr/bin/env python3
"""Reference GEMM-shape histogram of a BERT-style ONNX encoder, from the `onnx` package alone.

Usage: gemm_shapes_reference.py MODEL.onnx BATCH SEQ

Prints JSON: a list of {"m", "k", "n", "batch", "weight", "count"}, one per distinct GEMM.
- Weight GEMMs: every MatMul whose right operand is an initializer [K, N]; its left operand is
  [BATCH, SEQ, K], so M = BATCH*SEQ (the activation flattened), batch 1. MatMuls that share one
  left operand and have weights of the same K are merged into one GEMM with N = the sum of their
  N (RLX's Q/K/V merge: one [K, 3*hidden] weight GEMM per attention block).
- Activation GEMMs (attention's Q K^T and P V): MatMuls without an initializer, their operand
  shapes from ONNX shape inference with the inputs fixed to [BATCH, SEQ] (data propagation on);
  [.., M, K] x [.., K, N] with batch = product of the leading dims.
"""
import collections
import json
import sys

import onnx
from onnx import shape_inference


def main():
    path, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = onnx.load(path)
    g = model.graph
    for inp in g.input:
        dims = inp.type.tensor_type.shape.dim
        if len(dims) == 2:
            dims[0].dim_value = batch
            dims[1].dim_value = seq
    model = shape_inference.infer_shapes(model, data_prop=True)
    g = model.graph
    inits = {i.name: list(i.dims) for i in g.initializer}
    shapes = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        d = vi.type.tensor_type.shape.dim
        if all(x.HasField("dim_value") for x in d):
            shapes[vi.name] = [x.dim_value for x in d]
    hist = collections.Counter()
    by_lhs = collections.defaultdict(list)
    for node in g.node:
        if node.op_type != "MatMul":
            continue
        a, b = node.input
        if b in inits:
            k, n = inits[b]
            by_lhs[(a, k)].append(n)
        else:
            sa, sb = shapes.get(a), shapes.get(b)
            if sa is None or sb is None:
                sys.exit(f"shape inference left MatMul {node.name} operands unknown")
            m, k = sa[-2], sa[-1]
            n = sb[-1]
            nb = 1
            for x in sa[:-2]:
                nb *= x
            hist[(m, k, n, nb, False)] += 1
    for (a, k), ns in by_lhs.items():
        hist[(batch * seq, k, sum(ns), 1, True)] += 1
    out = [dict(m=m, k=k, n=n, batch=b, weight=w, count=c) for (m, k, n, b, w), c in sorted(hist.items())]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
