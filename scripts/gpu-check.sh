#!/usr/bin/env bash
# On a machine with a CUDA GPU: build the opscope CLI with RLX's CUDA backend, record MiniLM with
# `matmul,attn` on the CPU and on the GPU over the same text, and compare every statistic of the
# GPU recording with the CPU's (`opscope compare`: one line per site, role and statistic). The
# GPU runs the sketches lowered into RLX primitive ops (opscope has a native kernel on the CPU
# only); what cannot be lowered is printed by the GPU `record` and missing from its recording,
# so the pipeline below uses a fixed histogram range (the absmax-range histogram has no exact
# lowering).
#
# Usage: scripts/gpu-check.sh [DEVICE]   (default cuda; `gpu` checks RLX's wgpu backend, built
# with `--features gpu`). GPU_PIPELINE and GPU_RECORD_ARGS (e.g. "--batch 1 --seq 16") change
# what is recorded. Tolerances: GPU_RTOL (1e-4), GPU_HIST_TOL (1e-3): two devices' GEMMs
# round differently in the last bits, so a statistic differs by a few ULPs and a value near a
# bin edge can change bins. Budget: 10 minutes including the build (a fresh target builds RLX,
# about 5 minutes on 2 cores); the script prints the elapsed time and fails past the budget.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/.."
device="${1:-cuda}"
case "$device" in
  cuda) feature=cuda ;;
  gpu|wgpu) device=gpu; feature=gpu ;;
  *) echo "gpu-check: device '$device': expected cuda or gpu" >&2; exit 2 ;;
esac
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

bash "$here/fetch-assets.sh" >/dev/null
cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
echo "check build: cargo build --release -p opscope-lab --features $feature"
cargo build --release -p opscope-lab --features "$feature" --quiet
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
bin="$target/release/opscope"
echo "ok   build ($(elapsed) s)"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
default_pipeline='matmul{hist_range=-16:16},attn'
pipeline="${GPU_PIPELINE:-$default_pipeline}"
args=(--onnx "$cache/paraphrase-MiniLM-L3-v2.onnx" --tokenizer "$cache/tokenizer.json" --text "$cache/fortunes.txt"
      --limit "${GPU_LIMIT:-64}" --pipeline "$pipeline")
read -r -a extra <<< "${GPU_RECORD_ARGS:-}"
args+=("${extra[@]}")
# What is left of the 10-minute budget bounds each step (`timeout` exits 124 past it).
left() { local l=$(( 600 - $(elapsed) )); echo $(( l > 1 ? l : 1 )); }
timeout "$(left)" "$bin" record "${args[@]}" --device cpu --out "$out/cpu.parquet" >/dev/null
echo "ok   record on cpu ($(elapsed) s)"
timeout "$(left)" "$bin" record "${args[@]}" --device "$device" --out "$out/$device.parquet" >/dev/null
echo "ok   record on $device ($(elapsed) s)"

status=0
"$bin" compare "$out/cpu.parquet" "$out/$device.parquet" \
  --rtol "${GPU_RTOL:-1e-4}" --hist-tol "${GPU_HIST_TOL:-1e-3}" || status=$?
t=$(elapsed)
if (( t > 600 )); then
  echo "FAIL time: $t s, over the 10-minute budget"
  status=1
else
  echo "ok   time: $t s of the 600 s budget"
fi
exit "$status"
