#!/usr/bin/env python3
"""Independent reference for `opscope calibrate` (lab/tests/calibrate.rs).

Reads an opscope CSV recording with the csv module (no opscope code), merges each tensor's
histogram over runs (a fixed range: counts add), and computes every method's range with
  - onnxruntime's own functions (`HistogramCollector.compute_percentile`,
    `HistogramCollector.get_entropy_threshold`) on that histogram, and
  - a numpy reimplementation of the same math in float64 (what opscope computes: ORT's KL is
    float32, so on a near-tie of two candidates ORT and a float64 search can pick neighbours;
    `ort_tie` says whether ORT's own KL at the float64 pick is within 1e-5 of its minimum);
min-max from the recorded min/max rows and, when given, from the raw data that was fed.
It also loads the tables opscope wrote: the JSON with onnxruntime's `load_tensors_data` (and,
asked, as `quantize_static`'s calibration cache for a one-MatMul model), the TensorRT cache by
parsing its lines, and gives ORT's `compute_scale_zp` of every loaded range.

Usage: calib_reference.py REQUEST.json OUT.json
REQUEST: {"recording": csv, "cases": [{"key", "method", "percentile", "symmetric", "json",
          "cache"}], "ort_entropy": [names] | null (null: all),
          "moving_average": {"runs": [f32 files], "weight": f32 file, "k", "n", "constant"}?,
          "raw": {name: {"files": [f32 files], "hist": [lo, hi, bins]?, "weight": {"file", "shape"}?}},
          "quantize": {"case", "lhs", "out", "k", "n"}?}
"""
import contextlib
import csv
import gzip
import io
import json
import struct
import sys
from collections import defaultdict

import numpy as np
from onnxruntime.quantization.calibrate import CalibrationMethod, HistogramCollector, load_tensors_data
from onnxruntime.quantization.quant_utils import compute_scale_zp, smooth_distribution
from onnxruntime.quantization.calibrate import entropy as ort_entropy

QUANTIZED_BINS = 128
# ORT's KL is float32 (sums of ~2k terms): its curve differs from a float64 one by up to ~1.4e-5
# relative on MiniLM. A float64 pick counts as ORT's when ORT's own KL there is this close to
# its minimum.
TIE = 5e-5
_ORT_ENTROPY = {}


def read_recording(path):
    """{name: {"hist": {(compile, step): counts}, "lo", "hi", "min", "max", "outside"}}"""
    opener = gzip.open if path.endswith(".gz") else open
    t = defaultdict(lambda: {"hist": defaultdict(dict), "range": {}, "min": [], "max": [], "outside": 0.0})
    with opener(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            name = f"{r['site']}/{r['role']}"
            run = (int(r["compile"]), int(r["step"]))
            v = float(r["value"])
            s = r["stat"]
            d = t[name]
            if s == "hist":
                d["hist"][run][int(r["idx"])] = v
            elif s in ("hist_lo", "hist_hi"):
                d["range"].setdefault(run, {})[s] = v
            elif s == "min":
                d["min"].append(v)
            elif s == "max":
                d["max"].append(v)
            elif s == "hist_outside":
                d["outside"] += v
    out = {}
    for name, d in t.items():
        e = {"min": np.float32(min(d["min"])), "max": np.float32(max(d["max"])), "outside": d["outside"]}
        if d["hist"]:
            ranges = {(x["hist_lo"], x["hist_hi"]) for x in d["range"].values()}
            assert len(ranges) == 1, f"{name}: runs have different ranges {ranges}"
            (lo, hi), = ranges
            n = 1 + max(max(h) for h in d["hist"].values())
            counts = np.zeros(n, dtype=np.int64)
            for h in d["hist"].values():
                assert len(h) == n
                counts += np.array([int(h[i]) for i in range(n)], dtype=np.int64)
            e.update(lo=lo, hi=hi, counts=counts, runs=len(d["hist"]))
        out[name] = e
    return out


def centre(counts, lo, hi):
    """Pad with empty bins so that the range is [-H w, H w] (0 must be a bin edge)."""
    n = len(counts)
    w = (hi - lo) / n
    left = -lo / w
    L = int(round(left))
    assert abs(left - L) < 1e-6 * max(1, abs(L)), "0 is not a bin edge"
    R = n - L
    if L == R:
        return counts, lo, hi
    H = max(L, R)
    c = np.zeros(2 * H, dtype=counts.dtype)
    c[H - L:H - L + n] = counts
    return c, -H * w, H * w


def fold(counts, hi):
    """|x| histogram over [0, hi] from a centred one."""
    h = len(counts) // 2
    return counts[h:] + counts[:h][::-1], 0.0, hi


def edges64(lo, hi, n):
    return np.linspace(lo, hi, n + 1)


def np_percentile(counts, e, p, symmetric):
    cdf = np.cumsum(counts / counts.sum())
    if symmetric:
        t = e[np.searchsorted(cdf, p / 100.0)]
        return -t, t
    cut = (100.0 - p) / 200.0
    return e[np.searchsorted(cdf, cut)], e[np.searchsorted(cdf, 1.0 - cut)]


def np_smooth(p, eps=1e-4):
    z = p == 0
    nz = p.size - z.sum()
    if nz == 0:
        return None
    return np.where(z, eps, p - eps * z.sum() / nz)


def np_kl(p, q):
    p = p / p.sum()
    q = q / q.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where((p > 0) & (q > 0), p * np.log(p / q), np.where((p == 0) & (q >= 0), 0.0, np.inf))
    return t.sum()


def np_entropy_curve(counts, qbins):
    """KL per candidate in float64, ORT's algorithm; returns (kl list, [(start, end)])."""
    counts = counts.astype(np.float64)
    n = counts.size
    zero = n // 2
    half = qbins // 2
    kls, idx = [], []
    for i in range(half, zero + 1):
        s, e = zero - i, min(zero + i + 1, n)
        sl = counts[s:e]
        p = sl.copy()
        p[0] += counts[:s].sum()
        p[-1] += counts[e:].sum()
        m = sl.size // qbins
        qb = np.trunc(sl[: qbins * m].reshape(qbins, m).sum(axis=1))
        qb[-1] = np.trunc(qb[-1] + sl[qbins * m:].sum())
        nzg = (p[: qbins * m] != 0).reshape(qbins, m).sum(axis=1)
        q = np.zeros(p.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(nzg > 0, np.trunc(qb / np.maximum(nzg, 1)), 0.0)
        q[: qbins * m] = np.repeat(share, m)
        ps, qs = np_smooth(p), np_smooth(q)
        kls.append(np.inf if ps is None or qs is None else np_kl(ps, qs))
        idx.append((s, e))
    return kls, idx


def ort_entropy_curve(counts, qbins, dtype=np.float32):
    """ORT's own per-candidate KL (its smooth_distribution and entropy, float32), same loop."""
    n = counts.size
    zero = n // 2
    half = qbins // 2
    kls = []
    for i in range(half, zero + 1):
        s, e = zero - i, min(zero + i + 1, n)
        sl = counts[s:e]
        p = sl.copy()
        p[0] += counts[:s].sum()
        p[-1] += counts[e:].sum()
        nonzeros = (p != 0).astype(np.int64)
        qb = np.zeros(qbins, dtype=np.int64)
        m = sl.size // qbins
        for k in range(qbins):
            qb[k] = sl[k * m:(k + 1) * m].sum()
        qb[-1] += sl[qbins * m:].sum()
        q = np.zeros(p.size, dtype=np.int64)
        for k in range(qbins):
            norm = nonzeros[k * m:(k + 1) * m].sum()
            if norm != 0:
                q[k * m:(k + 1) * m] = qb[k] / norm
        ps, qs = smooth_distribution(p), smooth_distribution(q)
        kls.append(np.inf if ps is None or qs is None else float(np.array(ort_entropy(ps, qs), dtype=dtype)))
    return kls


def clip(lo, hi, mn, mx):
    lo, hi = np.float32(lo), np.float32(hi)
    return float(max(lo, mn)), float(min(hi, mx))


def reference(t, method, p, symmetric, run_ort_entropy):
    mn, mx = t["min"], t["max"]
    if method == "minmax":
        if symmetric:
            a = max(abs(mn), abs(mx))
            return {"np": [float(-a), float(a)], "ort": [float(-a), float(a)]}
        return {"np": [float(mn), float(mx)], "ort": [float(mn), float(mx)]}
    counts, lo, hi = t["counts"], t["lo"], t["hi"]
    if method == "percentile":
        if symmetric:
            c, clo, chi = centre(counts, lo, hi)
            counts, lo, hi = fold(c, chi)
        e = edges64(lo, hi, counts.size)
        ours = clip(*np_percentile(counts, e, p, symmetric), mn, mx)
        col = HistogramCollector("percentile", symmetric, counts.size, QUANTIZED_BINS, p, "same")
        h = (counts, e.astype(np.float32), mn, mx) if symmetric else (counts, e.astype(np.float32), mn, mx, np.float32(max(-lo, hi)))
        col.histogram_dict = {"t": h}
        with contextlib.redirect_stdout(io.StringIO()):
            r = col.compute_percentile()["t"]
        return {"np": list(ours), "ort": [float(r[0]), float(r[1])]}
    # entropy
    counts, lo, hi = centre(counts, lo, hi)
    e = edges64(lo, hi, counts.size)
    kls, idx = np_entropy_curve(counts, QUANTIZED_BINS)
    k = int(np.argmin(kls))
    ours = clip(e[idx[k][0]], e[idx[k][1]], mn, mx)
    out = {"np": list(ours), "ort": None, "ort_tie": None}
    if run_ort_entropy:
        memo = (counts.tobytes(), lo, hi, float(mn), float(mx))
        if memo not in _ORT_ENTROPY:
            col = HistogramCollector("entropy", symmetric, counts.size, QUANTIZED_BINS, 99.999, "same")
            with contextlib.redirect_stdout(io.StringIO()):
                r = col.get_entropy_threshold((counts, e.astype(np.float32), mn, mx, np.float32(hi)), QUANTIZED_BINS)
            _ORT_ENTROPY[memo] = (r, ort_entropy_curve(counts, QUANTIZED_BINS))
        r, okl = _ORT_ENTROPY[memo]
        out["ort"] = [float(r[0]), float(r[1])]
        best = min(okl)
        out["ort_tie"] = bool(okl[k] <= best + TIE * abs(best))
        # The curve above is ORT's: its argmin gives ORT's own threshold.
        e32 = e.astype(np.float32)
        s, t = idx[int(np.argmin(okl))]
        out["ort_curve_agrees"] = clip(e32[s], e32[t], mn, mx) == (out["ort"][0], out["ort"][1])
    return out


def load_outputs(case):
    """What ORT and a TensorRT-cache reader get from the files opscope wrote."""
    out = {}
    if case.get("json"):
        td = load_tensors_data(case["json"])
        want = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy}[case["method"]]
        assert td.calibration_method == want, f"{td.calibration_method} != {want}"
        sym = case["symmetric"]
        qmin, qmax = (np.array(-127, dtype=np.int8), np.array(127, dtype=np.int8)) if sym else (np.array(0, dtype=np.uint8), np.array(255, dtype=np.uint8))
        loaded = {}
        for name, d in td.items():
            lo, hi = d.range_value
            lo, hi = np.array(lo, dtype=np.float32), np.array(hi, dtype=np.float32)
            zp, scale = compute_scale_zp(lo, hi, qmin, qmax, symmetric=sym)
            _, sym_scale = compute_scale_zp(lo, hi, np.array(-127, dtype=np.int8), np.array(127, dtype=np.int8), symmetric=True)
            loaded[name] = {"range": [float(lo), float(hi)], "scale": float(scale), "zero_point": int(zp), "sym_scale": float(sym_scale),
                            "hist_len": (len(d.hist) if hasattr(d, "hist") else None),
                            "bins_len": (len(d.bins) if hasattr(d, "bins") else None)}
        out["json"] = loaded
    if case.get("cache"):
        with open(case["cache"]) as f:
            lines = f.read().splitlines()
        head = lines[0]
        parsed = {}
        for ln in lines[1:]:
            name, h = ln.rsplit(": ", 1)
            assert len(h) == 8, ln
            parsed[name] = struct.unpack(">f", bytes.fromhex(h))[0]
        out["cache"] = {"header": head, "scales": parsed, "lines": len(lines)}
    return out


def quantize(spec, case):
    """Quantize a one-MatMul ONNX model x[?,k] @ W -> y with onnxruntime's quantize_static, the
    table opscope wrote serving as its calibration cache (keys renamed to x and y)."""
    import os
    import tempfile

    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantFormat, quantize_static

    d = tempfile.mkdtemp()
    k, n = spec["k"], spec["n"]
    w = numpy_helper.from_array(np.linspace(-1, 1, k * n, dtype=np.float32).reshape(k, n), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, os.path.join(d, "m.onnx"))
    t = json.load(open(case["json"]))
    t["data"] = {"x": t["data"][spec["lhs"]], "y": t["data"][spec["out"]]}
    json.dump(t, open(os.path.join(d, "cache.json"), "w"))
    method = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile, "entropy": CalibrationMethod.Entropy}[case["method"]]
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(os.path.join(d, "m.onnx"), os.path.join(d, "q.onnx"), None,
                        calibration_cache_path=os.path.join(d, "cache.json"), calibrate_method=method,
                        quant_format=QuantFormat.QDQ)
    q = {i.name: numpy_helper.to_array(i) for i in onnx.load(os.path.join(d, "q.onnx")).graph.initializer}
    return {"x_scale": float(q["x_scale"]), "x_zero_point": int(q["x_zero_point"]), "x_dtype": str(q["x_zero_point"].dtype),
            "y_scale": float(q["y_scale"]), "y_zero_point": int(q["y_zero_point"])}


def ort_moving_average(spec):
    """onnxruntime's own MinMaxCalibrater(moving_average=True) on a one-MatMul ONNX model x[?,k] @ W
    (the test's weight) fed the test's batches, for x and y: `mean` in one `collect_data` pass over
    every batch (as quantize_static runs it: np.nanmean of the batches' ReduceMin/ReduceMax), `ema`
    one `collect_data` call a batch (merge_range: m + c (x - m) from the first batch's value),
    both asymmetric and symmetric; and `ema_pytorch_sym`, the symmetric range PyTorch's
    MovingAverageMinMaxObserver gives (its documented recurrence on the batches' min and max,
    then +-max(|min|, |max|); torch is not a test dependency)."""
    import os
    import tempfile

    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.calibrate import create_calibrator

    d = tempfile.mkdtemp()
    k, n = spec["k"], spec["n"]
    w = np.fromfile(spec["weight"], dtype="<f4").reshape(k, n)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, os.path.join(d, "m.onnx"))
    batches = [np.fromfile(f, dtype="<f4").reshape(-1, k) for f in spec["runs"]]
    c = spec["constant"]

    class Reader:
        def __init__(self, xs):
            self.it = iter(xs)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {"x": x}

    def ranges(sym, per_batch):
        cal = create_calibrator(os.path.join(d, "m.onnx"), ["MatMul"], augmented_model_path=os.path.join(d, f"aug{sym}{per_batch}.onnx"),
                                extra_options={"moving_average": True, "averaging_constant": c if per_batch else 0.01, "symmetric": sym})
        for chunk in ([[b] for b in batches] if per_batch else [batches]):
            cal.collect_data(Reader(chunk))
        t = cal.compute_data()
        return {name: [float(np.asarray(t[name].range_value[0]).reshape(-1)[0]), float(np.asarray(t[name].range_value[1]).reshape(-1)[0])] for name in ("x", "y")}

    out = {"mean": ranges(False, False), "mean_sym": ranges(True, False), "ema": ranges(False, True)}
    ys = [(b.astype(np.float32) @ w) for b in batches]
    pt = {}
    for name, arrs in (("x", batches), ("y", ys)):
        lo, hi = float(arrs[0].min()), float(arrs[0].max())
        for a in arrs[1:]:
            lo, hi = lo + c * (float(a.min()) - lo), hi + c * (float(a.max()) - hi)
        amax = max(abs(lo), abs(hi))
        pt[name] = [-amax, amax]
    out["ema_pytorch_sym"] = pt
    return out


def main():
    req = json.load(open(sys.argv[1]))
    tensors = read_recording(req["recording"])
    only = req.get("ort_entropy")
    res = {"tensors": {n: {"min": float(t["min"]), "max": float(t["max"]), "outside": t["outside"],
                           "bins": (int(t["counts"].size) if "counts" in t else None),
                           "runs": t.get("runs")} for n, t in tensors.items()},
           "cases": {}}
    for case in req["cases"]:
        refs = {}
        for name, t in tensors.items():
            if case["method"] != "minmax" and ("counts" not in t or t["outside"] > 0):
                continue
            refs[name] = reference(t, case["method"], case.get("percentile"), case["symmetric"], only is None or name in only)
        res["cases"][case["key"]] = {"refs": refs, "files": load_outputs(case)}
    raw = {}
    for name, spec in (req.get("raw") or {}).items():
        x = np.concatenate([np.fromfile(f, dtype="<f4") for f in spec["files"]])
        if "weight" in spec:  # the matmul's output, x @ w, in float64
            k, n = spec["weight"]["shape"]
            w = np.fromfile(spec["weight"]["file"], dtype="<f4").astype(np.float64).reshape(k, n)
            x = (x.astype(np.float64).reshape(-1, k) @ w).ravel()
        raw[name] = {"min": float(x.min()), "max": float(x.max()), "n": int(x.size)}
        if "hist" in spec:
            lo, hi, n = spec["hist"]
            raw[name]["hist"] = np.histogram(x.astype(np.float64), n, range=(lo, hi))[0].tolist()
    res["raw"] = raw
    if req.get("moving_average"):
        res["moving_average"] = ort_moving_average(req["moving_average"])
    if req.get("quantize"):
        spec = req["quantize"]
        case = next(c for c in req["cases"] if c["key"] == spec["case"])
        res["quantize"] = quantize(spec, case)
    json.dump(res, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
