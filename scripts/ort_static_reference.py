"""Independent reference for `staticquant` (lab/tests/staticquant_ort.rs): ONNX Runtime's own
static and dynamic quantization of an ONNX BERT encoder, run on the same token ids.

- ``fp32``: the model as exported.
- ``static``: ``onnxruntime.quantization.quantize_static`` in QDQ format, MinMax calibration
  (ORT's ``MinMaxCalibrater``: the smallest min and largest max of each tensor over the
  calibration batches, padding positions included), activations asymmetric uint8
  (``QuantType.QUInt8``), weights symmetric int8 per output channel (``per_channel=True``),
  only the MatMuls whose second input is an initializer (a weight): attention's two
  activation x activation MatMuls are excluded (``nodes_to_exclude``), as ``staticquant``'s
  default ``bmm=false`` leaves them in float.
- ``static_default``: the same ``quantize_static`` call without the two settings below. ORT's
  QDQ quantizer then also quantizes each MatMul's output (a QDQ pair before the bias Add), and
  a quantized tensor is quantized for every consumer: the LayerNorm output that feeds Q/K/V or
  the FFN also reaches the residual Add through its QDQ pair.
- ``static`` (the scheme of ``staticquant``): with ``extra_options={"OpTypesToExcludeOutputQuantization":
  ["MatMul"], "DedicatedQDQPair": True}``, and every non-MatMul consumer of an activation's
  DequantizeLinear rewired here to the float tensor (ORT keeps the residual Add on the QDQ'd
  LayerNorm output even with dedicated pairs): QDQ on the weight MatMuls' inputs only.
- ``dynamic``: ``onnxruntime.quantization.quantize_dynamic`` on the same MatMuls: activations
  uint8 with a scale from each run (DynamicQuantizeLinear), weights int8 per output channel
  (falling back to per tensor if this ORT refuses per-channel; ``dynamic_per_channel`` says).

Every model runs in an ``InferenceSession`` with ORT's default optimizations on the CPU provider
(the quantized models with ORT's integer kernels, as deployed). ``static_qdq`` is the ``static``
model run with graph optimizations off: each QuantizeLinear -> DequantizeLinear pair runs as
written and the MatMul in float, the QDQ format's defined arithmetic, the same on every CPU. The
deployed integer kernels are not: on x86-64 without VNNI, ORT's u8 x s8 GEMM multiplies through
16-bit sums that can saturate (ORT's quantization docs). Measured on MiniLM on an AVX2-only AMD
EPYC (2026-12-04): the deployed ``static`` at 15.21 dB SQNR against fp32, ``static_qdq`` at
22.56 dB, the deployed one at 22.55 dB on the project's earlier machine (2026-12-01).

Input JSON: ``{"calibration": [{"ids": [[...]], "mask": [[...]]}, ...], "evaluation": [...]}``
(the lab's tokenization: fixed ``seq``, right padding, attention mask 0 on padding).
Output JSON: ``{"fp32": [[...], ...], "static": [...], "static_qdq": [...], "dynamic": [...]}``: one embedding (the
model's last output) per evaluation sentence; ``"static_scales": {MatMul node name: {"scale",
"zero_point"}}`` of each quantized MatMul's activation input as ``quantize_static`` wrote it;
``"excluded"``: the MatMul nodes left in float; ``"versions"``.
"""

import argparse
import json
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)


def feeds(batch):
    return {
        "input_ids": np.array(batch["ids"], dtype=np.int64),
        "attention_mask": np.array(batch["mask"], dtype=np.int64),
    }


class Reader(CalibrationDataReader):
    def __init__(self, batches):
        self.it = iter([feeds(b) for b in batches])

    def get_next(self):
        return next(self.it, None)


def embed(path, batches, optimize=True):
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    last = sess.get_outputs()[-1].name
    rows = []
    for b in batches:
        f = {k: v for k, v in feeds(b).items() if k in names}
        (e,) = sess.run([last], f)
        rows += np.asarray(e, dtype=np.float64).tolist()
    return rows


def activation_matmuls(model):
    inits = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] not in inits]


def static_scales(path):
    m = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    out = {}
    for n in m.graph.node:
        if n.op_type != "MatMul":
            continue
        dq = producer.get(n.input[0])
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        out[n.name] = {"scale": float(inits[dq.input[1]]), "zero_point": int(inits[dq.input[2]])}
    return out


def matmul_inputs_only(path):
    """Rewire every non-MatMul consumer of an activation DequantizeLinear to the float tensor
    its QuantizeLinear read (see the module docs); returns the number rewired."""
    m = onnx.load(path)
    producer = {o: n for n in m.graph.node for o in n.output}
    rewired = 0
    for dq in [n for n in m.graph.node if n.op_type == "DequantizeLinear"]:
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue  # a weight: its codes are an initializer
        for n in m.graph.node:
            if n.op_type == "MatMul":
                continue
            for i, name in enumerate(n.input):
                if name == dq.output[0]:
                    n.input[i] = q.input[0]
                    rewired += 1
    onnx.save(m, path)
    return rewired


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    req = json.load(open(a.input))
    model = onnx.load(a.onnx)
    excluded = activation_matmuls(model)
    res = {"excluded": excluded, "versions": {"onnxruntime": ort.__version__, "onnx": onnx.__version__}}
    with tempfile.TemporaryDirectory() as d:
        scheme = dict(
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=excluded,
            calibrate_method=CalibrationMethod.MinMax,
        )
        sd = os.path.join(d, "static_default.onnx")
        quantize_static(a.onnx, sd, Reader(req["calibration"]), **scheme)
        res["static_default"] = embed(sd, req["evaluation"])
        st = os.path.join(d, "static.onnx")
        extra = {"OpTypesToExcludeOutputQuantization": ["MatMul"], "DedicatedQDQPair": True}
        quantize_static(a.onnx, st, Reader(req["calibration"]), extra_options=extra, **scheme)
        res["static_rewired"] = matmul_inputs_only(st)
        dy = os.path.join(d, "dynamic.onnx")
        try:
            quantize_dynamic(a.onnx, dy, op_types_to_quantize=["MatMul"], per_channel=True, weight_type=QuantType.QInt8, nodes_to_exclude=excluded)
            res["dynamic"] = embed(dy, req["evaluation"])
            res["dynamic_per_channel"] = True
        except Exception as e:  # noqa: BLE001 - fall back and say so
            res["dynamic_per_channel_error"] = str(e)
            quantize_dynamic(a.onnx, dy, op_types_to_quantize=["MatMul"], per_channel=False, weight_type=QuantType.QInt8, nodes_to_exclude=excluded)
            res["dynamic"] = embed(dy, req["evaluation"])
            res["dynamic_per_channel"] = False
        res["fp32"] = embed(a.onnx, req["evaluation"])
        res["static"] = embed(st, req["evaluation"])
        res["static_qdq"] = embed(st, req["evaluation"], optimize=False)
        res["static_scales"] = static_scales(st)
    json.dump(res, open(a.out, "w"))


if __name__ == "__main__":
    main()
