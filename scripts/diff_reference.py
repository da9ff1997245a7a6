#!/usr/bin/env python3
"""Independent reference for `opscope diff` (lab/tests/diff.rs): numpy and the standard library
only, no code shared with opscope.

    diff_reference.py raw SPEC.json      per-run tensors the test wrote as little-endian f32
                                         files; every statistic computed here from the values
                                         (SPEC: range, bins, pairs [[A, B]], series {"site|role":
                                         {shape [rows, channels], files {A: [run files], ..}}})
    diff_reference.py recording A B      two CSV recordings (.csv or .csv.gz); the per-run
                                         statistics as recorded, histograms merged over runs

Prints JSON: {"site|role": {"scalars": {stat: {median_a, median_b, rel_change, ks}},
"js", "w1", "w1_norm", "chan": {rel_l2, spearman, moved}}} for every series in both A and B
(recording mode: matched by site and role; the pass index may differ).
"""
import csv
import gzip
import json
import sys

import numpy as np

STATS = ["mean", "rms", "absmax", "kurtosis", "density", "chan_outlier", "nan_count", "posinf_count", "neginf_count"]
TOP = 5


def ks_2samp_statistic(a, b):
    """sup |F_a - F_b| over the pooled values (scipy.stats.ks_2samp's statistic)."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / len(a)
    fb = np.searchsorted(b, x, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def rel_change(ma, mb):
    if ma == mb:
        return 0.0
    return None if ma == 0 else (mb - ma) / abs(ma)


def js_bits(p, q):
    p, q = np.asarray(p, float) / np.sum(p), np.asarray(q, float) / np.sum(q)
    m = (p + q) / 2
    kl = lambda x: float(np.sum(x[x > 0] * np.log2(x[x > 0] / m[x > 0])))
    return 0.5 * kl(p) + 0.5 * kl(q)


def wasserstein_1(centres, p, q):
    """scipy.stats.wasserstein_distance(centres, centres, p, q), its CDF algorithm in numpy."""
    u, v = np.asarray(centres, float), np.asarray(centres, float)
    all_values = np.sort(np.concatenate([u, v]))
    deltas = np.diff(all_values)
    pu = np.concatenate([[0.0], np.cumsum(p / np.sum(p))])
    pv = np.concatenate([[0.0], np.cumsum(q / np.sum(q))])
    cu = pu[np.searchsorted(u, all_values[:-1], side="right")]
    cv = pv[np.searchsorted(v, all_values[:-1], side="right")]
    return float(np.sum(np.abs(cu - cv) * deltas))


def weighted_var(centres, h):
    w = h / np.sum(h)
    mean = np.sum(w * centres)
    return float(np.sum(w * (centres - mean) ** 2))


def hist_measures(lo, hi, ha, hb):
    n = len(ha)
    edges = np.linspace(lo, hi, n + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    w1 = wasserstein_1(centres, ha, hb)
    sd = np.sqrt((weighted_var(centres, ha) + weighted_var(centres, hb)) / 2)
    return {"js": js_bits(ha, hb), "w1": w1, "w1_norm": w1 / sd if sd > 0 else None}


def average_ranks_desc(v):
    """Rank 1 = largest; ties get the mean of their ranks (scipy.stats.rankdata('average') of -v)."""
    v = np.asarray(v, float)
    order = np.argsort(-v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    for val in np.unique(v):
        tie = v == val
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def chan_measures(ma, mb):
    ma, mb = np.asarray(ma, float), np.asarray(mb, float)
    ra, rb = average_ranks_desc(ma), average_ranks_desc(mb)
    moved = [(int(c), float(ra[c]), float(rb[c])) for c in range(len(ma)) if (ra[c] <= TOP or rb[c] <= TOP) and ra[c] != rb[c]]
    moved.sort(key=lambda m: (min(m[1], m[2]), m[0]))
    sp = None
    if np.std(ra) > 0 and np.std(rb) > 0:
        sp = float(np.corrcoef(ra, rb)[0, 1])
    return {"rel_l2": float(np.linalg.norm(mb - ma) / np.linalg.norm(ma)), "spearman": sp, "moved": moved}


def scalar_measures(runs_a, runs_b):
    """runs_x: list of dicts stat -> value (a stat missing where not recorded)."""
    out = {}
    for s in STATS:
        va = [r[s] for r in runs_a if s in r and np.isfinite(r[s])]
        vb = [r[s] for r in runs_b if s in r and np.isfinite(r[s])]
        if not va or not vb:
            continue
        ma, mb = float(np.median(va)), float(np.median(vb))
        out[s] = {"median_a": ma, "median_b": mb, "rel_change": rel_change(ma, mb), "ks": ks_2samp_statistic(va, vb)}
    return out


# ---- raw mode: statistics from the tensors -------------------------------------------------

def tensor_stats(x):
    """x: [rows, channels] float64 (finite)."""
    mean = x.mean()
    d = x - mean
    m2, m4 = np.mean(d**2), np.mean(d**4)
    chan = np.abs(x).max(axis=0)
    return {
        "mean": float(mean),
        "rms": float(np.sqrt(np.mean(x**2))),
        "absmax": float(np.abs(x).max()),
        "kurtosis": float(m4 / m2**2),
        "density": float(np.count_nonzero(x) / x.size),
        "chan_outlier": float(chan.max() / chan.mean()),
        "nan_count": 0.0,
        "posinf_count": 0.0,
        "neginf_count": 0.0,
    }, chan


def raw(spec_path):
    spec = json.load(open(spec_path))
    lo, hi, bins = spec["range"][0], spec["range"][1], spec["bins"]
    out = {}
    for a, b in spec["pairs"]:
        res = {}
        for key, ser in spec["series"].items():
            runs, hists, chans = {}, {}, {}
            for side in (a, b):
                runs[side], chans[side] = [], []
                hists[side] = np.zeros(bins)
                for path in ser["files"][side]:
                    x = np.fromfile(path, dtype="<f4").astype(np.float64).reshape(ser["shape"])
                    st, ch = tensor_stats(x)
                    runs[side].append(st)
                    chans[side].append(ch)
                    hists[side] += np.histogram(x, bins=bins, range=(lo, hi))[0]
            res[key] = {
                "scalars": scalar_measures(runs[a], runs[b]),
                **hist_measures(lo, hi, hists[a], hists[b]),
                "chan": chan_measures(np.mean(chans[a], axis=0), np.mean(chans[b], axis=0)),
            }
        out[f"{a}|{b}"] = res
    json.dump(out, sys.stdout)


# ---- recording mode: statistics as recorded ------------------------------------------------

def read_recording(path):
    """(site, role) -> {(compile, step): {stat: value or {idx: value}}}; also the pass index."""
    opener = gzip.open if path.endswith(".gz") else open
    series = {}
    with opener(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            key = (row["site"], row["role"])
            run = series.setdefault(key, {}).setdefault((int(row["compile"]), int(row["step"])), {})
            stat, idx, value = row["stat"], int(row["idx"]), float(np.float32(row["value"]))
            if stat in ("hist", "chan_maxabs"):
                run.setdefault(stat, {})[idx] = value
            else:
                run[stat] = value
    return series


def derived(run):
    d = {}
    c = run.get("count", 0.0)
    for s in ("mean", "kurtosis", "chan_outlier", "nan_count", "posinf_count", "neginf_count"):
        if s in run:
            d[s] = run[s]
    if c > 0 and "sumsq" in run:
        d["rms"] = np.sqrt(run["sumsq"] / c)
    if "min" in run and "max" in run:
        d["absmax"] = max(abs(run["min"]), abs(run["max"]))
    if c > 0 and "nnz" in run:
        d["density"] = run["nnz"] / c
    return d


def rebin(counts, lo, hi, out_lo, out_hi, n):
    """Spread each source bin's count over the destination bins by overlap (uniform within a bin)."""
    counts = np.asarray(counts, float)
    src = lo + (hi - lo) * np.arange(len(counts) + 1) / len(counts)
    dst = out_lo + (out_hi - out_lo) * np.arange(n + 1) / n
    if hi == lo:
        j = min(max(int(np.floor((lo - out_lo) / ((out_hi - out_lo) / n))), 0), n - 1)
        out = np.zeros(n)
        out[j] = counts.sum()
        return out
    overlap = np.clip(np.minimum(src[1:, None], dst[None, 1:]) - np.maximum(src[:-1, None], dst[None, :-1]), 0, None)
    return counts @ (overlap / (src[1:] - src[:-1])[:, None])


def run_hists(runs):
    out = []
    for run in runs.values():
        if "hist" in run and "hist_lo" in run and "hist_hi" in run:
            h = run["hist"]
            out.append((run["hist_lo"], run["hist_hi"], np.array([h[i] for i in range(len(h))])))
    return out


def recording(path_a, path_b):
    A, B = read_recording(path_a), read_recording(path_b)
    res = {}
    for key in sorted(set(A) & set(B)):
        ra, rb = A[key], B[key]
        entry = {"scalars": scalar_measures([derived(r) for r in ra.values()], [derived(r) for r in rb.values()])}
        ha, hb = run_hists(ra), run_hists(rb)
        if ha and hb:
            n = max(len(h[2]) for h in ha + hb)
            lo = min(h[0] for h in ha + hb)
            hi = max(h[1] for h in ha + hb)
            exact = all(h[0] == lo and h[1] == hi and len(h[2]) == n for h in ha + hb)
            merge = lambda hs: sum(h[2] if exact else rebin(h[2], h[0], h[1], lo, hi, n) for h in hs)
            entry.update(hist_measures(lo, hi, merge(ha), merge(hb)))
        ca = [np.array([r["chan_maxabs"][i] for i in range(len(r["chan_maxabs"]))]) for r in ra.values() if "chan_maxabs" in r]
        cb = [np.array([r["chan_maxabs"][i] for i in range(len(r["chan_maxabs"]))]) for r in rb.values() if "chan_maxabs" in r]
        if ca and cb and len(ca[0]) == len(cb[0]):
            entry["chan"] = chan_measures(np.mean(ca, axis=0), np.mean(cb, axis=0))
        res[f"{key[0]}|{key[1]}"] = entry
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    if sys.argv[1] == "raw":
        raw(sys.argv[2])
    elif sys.argv[1] == "recording":
        recording(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown mode {sys.argv[1]}: raw SPEC.json | recording A B")
