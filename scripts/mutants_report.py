#!/usr/bin/env python3
"""Mutation score per module from a cargo-mutants run (issue 11).

Usage: scripts/mutants_report.py [MUTANTS_OUT_DIR] [--markdown]

Reads MUTANTS_OUT_DIR/outcomes.json (default ../opscope-mutants/mutants.out) and prints, per
module (source file), the mutants caught, missed, timed out and unviable (did not build), and
the score caught / (caught + missed + timeout), cargo-mutants' own definition of a viable mutant's
outcome. Then every missed mutant by name. A partial run (interrupted) is reported as what it
holds: cargo-mutants shuffles the mutants of a shard, so the mutants tested are a random subset.
"""
import collections
import json
import pathlib
import sys

SUMMARY = {
    "CaughtMutant": "caught",
    "MissedMutant": "missed",
    "Timeout": "timeout",
    "Unviable": "unviable",
}


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = pathlib.Path(args[0] if args else pathlib.Path(__file__).resolve().parent.parent.parent / "opscope-mutants" / "mutants.out")
    path = out / "outcomes.json"
    if not path.is_file():
        print(f"mutants_report: {path} not found: run scripts/mutants.sh first (or name its mutants.out dir)", file=sys.stderr)
        return 2
    doc = json.loads(path.read_text())
    per = collections.defaultdict(collections.Counter)
    missed = []
    for o in doc["outcomes"]:
        m = o["scenario"].get("Mutant") if isinstance(o["scenario"], dict) else None
        if m is None:
            continue  # the baseline
        kind = SUMMARY.get(o["summary"])
        if kind is None:
            print(f"mutants_report: unknown outcome {o['summary']!r} for {m['name']}", file=sys.stderr)
            return 2
        module = m["file"].replace("src/../", "")
        per[module][kind] += 1
        if kind == "missed":
            missed.append(m["name"].replace("src/../", ""))
    total = collections.Counter()
    rows = []
    for module in sorted(per):
        c = per[module]
        total.update(c)
        rows.append((module, c))
    rows.append(("all", total))
    print(f"{sum(total.values())} mutants tested")
    print("| module | caught | missed | timeout | unviable | score |")
    print("|---|---|---|---|---|---|")
    for module, c in rows:
        viable = c["caught"] + c["missed"] + c["timeout"]
        score = f"{100 * c['caught'] / viable:.0f}%" if viable else "-"
        print(f"| {module} | {c['caught']} | {c['missed']} | {c['timeout']} | {c['unviable']} | {score} |")
    print("\nmissed:")
    for name in sorted(missed):
        print(f"- {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
