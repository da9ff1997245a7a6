"""Independent reference for `opscope plan` / `opscope measure --plan` (lab/tests/plan.rs): the
sentence embeddings of an ONNX BERT encoder computed by onnxruntime on the model as exported and
on a copy in which the listed MatMuls are fake-quantized, built here with the `onnx` package and
numpy, never with opscope.

A listed MatMul (its ONNX node name, with its code width ``bits``) gets passes/fakequant's
documented formula with ``scope=token,weights=true``, narrow range, ties to even, in float32,
``Q = 2^(bits-1) - 1``, ``s = absmax / Q``, ``s' = s if s > 0 else 1``,
``y = clip(round(x / s'), -Q, Q) * s'``: the weight (an initializer) per output column (absmax
over K, numpy), the activation per token (absmax over the last axis, ONNX ops inserted before
the MatMul). Unlisted MatMuls stay in float.

Input JSON: ``{"batches": [{"ids": [[...]], "mask": [[...]]}, ...], "sites": {"<node name>": bits}}``.
Output JSON: ``{"quantized": n, "nsr": sum (e - e_fp32)^2 / sum e_fp32^2, "sqnr_db": ..., "cos_mean": ...}``.
"""

import argparse
import copy
import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from measure_reference import embed


def fake_quant_columns(w, q):
    w = w.astype(np.float32)
    s = np.max(np.abs(w), axis=-2, keepdims=True) / q
    s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    return (np.clip(np.rint(w / s), -q, q) * s).astype(np.float32)


def quantize(model, sites):
    m = copy.deepcopy(model)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    nodes, done = [], 0
    for node in g.node:
        bits = sites.get(node.name)
        if node.op_type == "MatMul" and bits is not None:
            assert node.input[1] in inits, f"{node.name}: rhs is not an initializer"
            q = np.float32(2 ** (bits - 1) - 1)
            p = f"fq{done}/"
            g.initializer.extend([numpy_helper.from_array(np.array(q, np.float32), p + "Q"),
                                  numpy_helper.from_array(np.array(-q, np.float32), p + "negQ"),
                                  numpy_helper.from_array(np.array(0.0, np.float32), p + "zero"),
                                  numpy_helper.from_array(np.array(1.0, np.float32), p + "one")])
            w = inits[node.input[1]]
            w.CopyFrom(numpy_helper.from_array(fake_quant_columns(numpy_helper.to_array(w), q), w.name))
            x = node.input[0]
            nodes += [
                helper.make_node("Abs", [x], [p + "abs"]),
                helper.make_node("ReduceMax", [p + "abs"], [p + "absmax"], axes=[-1], keepdims=1),
                helper.make_node("Div", [p + "absmax", p + "Q"], [p + "s"]),
                helper.make_node("Greater", [p + "s", p + "zero"], [p + "pos"]),
                helper.make_node("Where", [p + "pos", p + "s", p + "one"], [p + "s1"]),
                helper.make_node("Div", [x, p + "s1"], [p + "r"]),
                helper.make_node("Round", [p + "r"], [p + "rr"]),
                helper.make_node("Clip", [p + "rr", p + "negQ", p + "Q"], [p + "q"]),
                helper.make_node("Mul", [p + "q", p + "s1"], [p + "y"]),
            ]
            node.input[0] = p + "y"
            done += 1
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return m, done


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    req = json.load(open(a.input))
    model = onnx.load(a.onnx)
    fp32 = np.array(embed(model, req["batches"]))
    q, n = quantize(model, req["sites"])
    got = np.array(embed(q, req["batches"]))
    nsr = float(np.sum((fp32 - got) ** 2) / np.sum(fp32 ** 2))
    cos = np.sum(fp32 * got, axis=1) / (np.linalg.norm(fp32, axis=1) * np.linalg.norm(got, axis=1))
    json.dump({"quantized": n, "nsr": nsr, "sqnr_db": -10 * np.log10(nsr), "cos_mean": float(cos.mean())}, open(a.out, "w"))


if __name__ == "__main__":
    main()
