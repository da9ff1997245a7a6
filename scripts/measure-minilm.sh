#!/usr/bin/env bash
# The issue-4 measurements end to end: fetch MiniLM-L3 (ONNX), its tokenizer and the fortunes
# text, then run `opscope measure`: attention concentration and sinks (attn tap), W8A8 per-token
# vs per-channel (fakequant), block influence (residual tap) vs layer skip (skip). Prints
# Markdown; extra arguments go to `opscope measure` (e.g. --limit 64, --json measure.json).
#
#   OPSCOPE_CACHE  cache folder (default: $HOME/.cache/opscope)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
bash "$here/fetch-assets.sh"
cargo run --release --manifest-path "$here/../Cargo.toml" -p opscope-lab --bin opscope -- measure \
  --onnx "$cache/paraphrase-MiniLM-L3-v2.onnx" \
  --tokenizer "$cache/tokenizer.json" \
  --text "$cache/fortunes.txt" "$@"
