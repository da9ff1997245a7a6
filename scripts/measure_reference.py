"""Independent reference for `opscope measure` (lab/tests/minilm_reference.rs): the sentence
embeddings of an ONNX BERT encoder computed by onnxruntime on three kinds of model, each built
here with the `onnx` package, never with opscope:

- ``fp32``: the model as exported.
- ``w8a8``: every MatMul whose rhs is an initializer (a weight) computes with
  (a) the weight fake-quantized per output column in numpy (absmax over K, the axis before last)
  and (b) its activation fake-quantized per token by ONNX ops inserted before it
  (Abs, ReduceMax over the last axis, Div, Where, Div, Round, Clip, Mul). Both follow
  passes/fakequant's documented formula with bits=8, narrow range, ties to even (ONNX Round),
  all in float32: ``s = absmax / 127``, ``s' = s if s > 0 else 1``,
  ``y = clip(round(x / s'), -127, 127) * s'``. Attention's MatMuls (rhs an activation) are left
  in float, as fakequant's default ``bmm=false`` does.
- ``skip.K``: the K-th residual Add (execution order: an Add feeding a LayerNormalization whose
  other input is a LayerNormalization output, the residual stream x of post-LN BERT) replaced by
  ``Identity(x)``: the block ``x + f(x)`` becomes ``x``.

Input JSON: ``{"batches": [{"ids": [[...]], "mask": [[...]]}, ...], "blocks": N}``.
Output JSON: ``{"fp32": [[...], ...], "w8a8": [...], "skip.0": [...], ...}``: one embedding
(the model's last output) per sentence, in batch order.
"""

import argparse
import copy
import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

Q = np.float32(127.0)


def fake_quant_columns(w):
    """Per-output-column symmetric int8 fake-quant of a [K, N] (or [..., K, N]) weight."""
    w = w.astype(np.float32)
    s = np.max(np.abs(w), axis=-2, keepdims=True) / Q
    s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    return (np.clip(np.rint(w / s), -Q, Q) * s).astype(np.float32)


def w8a8(model):
    m = copy.deepcopy(model)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    consts = [numpy_helper.from_array(np.array(Q, np.float32), "fq/Q"),
              numpy_helper.from_array(np.array(-Q, np.float32), "fq/negQ"),
              numpy_helper.from_array(np.array(0.0, np.float32), "fq/zero"),
              numpy_helper.from_array(np.array(1.0, np.float32), "fq/one")]
    g.initializer.extend(consts)
    nodes = []
    done = 0
    for node in g.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            w = inits[node.input[1]]
            q = fake_quant_columns(numpy_helper.to_array(w))
            w.CopyFrom(numpy_helper.from_array(q, w.name))
            x = node.input[0]
            p = f"fq{done}/"
            nodes += [
                helper.make_node("Abs", [x], [p + "abs"]),
                helper.make_node("ReduceMax", [p + "abs"], [p + "absmax"], axes=[-1], keepdims=1),
                helper.make_node("Div", [p + "absmax", "fq/Q"], [p + "s"]),
                helper.make_node("Greater", [p + "s", "fq/zero"], [p + "pos"]),
                helper.make_node("Where", [p + "pos", p + "s", "fq/one"], [p + "s1"]),
                helper.make_node("Div", [x, p + "s1"], [p + "r"]),
                helper.make_node("Round", [p + "r"], [p + "rr"]),
                helper.make_node("Clip", [p + "rr", "fq/negQ", "fq/Q"], [p + "q"]),
                helper.make_node("Mul", [p + "q", p + "s1"], [p + "y"]),
            ]
            node.input[0] = p + "y"
            done += 1
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return m, done


def residual_adds(model):
    g = model.graph
    consumers, producer = {}, {}
    for node in g.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
        for o in node.output:
            producer[o] = node
    out = []
    for node in g.node:
        if node.op_type != "Add" or not any(c.op_type == "LayerNormalization" for c in consumers.get(node.output[0], [])):
            continue
        streams = [i for i in node.input if i in producer and producer[i].op_type == "LayerNormalization"]
        if len(streams) == 1:
            out.append((node.name, streams[0]))
    return out


def skip(model, k):
    m = copy.deepcopy(model)
    name, stream = residual_adds(m)[k]
    for node in m.graph.node:
        if node.name == name:
            node.op_type = "Identity"
            del node.input[:]
            node.input.append(stream)
    return m


def embed(model, batches):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    last = sess.get_outputs()[-1].name
    rows = []
    for b in batches:
        feeds = {"input_ids": np.array(b["ids"], dtype=np.int64), "attention_mask": np.array(b["mask"], dtype=np.int64)}
        (e,) = sess.run([last], feeds)
        rows += np.asarray(e, dtype=np.float64).tolist()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    req = json.load(open(a.input))
    model = onnx.load(a.onnx)
    res = {"fp32": embed(model, req["batches"])}
    q, n = w8a8(model)
    res["w8a8_matmuls"] = n
    res["w8a8"] = embed(q, req["batches"])
    adds = residual_adds(model)
    res["blocks"] = [name for name, _ in adds]
    for k in range(len(adds)):
        res[f"skip.{k}"] = embed(skip(model, k), req["batches"])
    json.dump(res, open(a.out, "w"))


if __name__ == "__main__":
    main()
