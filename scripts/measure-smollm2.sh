#!/usr/bin/env bash
# Issue 12's study end to end: fetch SmolLM2-135M-Instruct (GGUF, Q4_1) and the fortunes text,
# then run `opscope measure --gguf`: perplexity, attention sinks per layer and head (attn tap),
# massive activations per residual block (residual tap), W4A8 / W8A8 per-tensor vs per-token
# (fakequant), and block influence vs the perplexity change of skipping each of the 60 residual
# blocks (skip). Prints Markdown; extra arguments go to `opscope measure` (defaults below:
# 48 fortunes, 32 tokens; about 40 minutes on 2 cores, --no-skip cuts it to about 3).
#
#   OPSCOPE_CACHE  cache folder (default: $HOME/.cache/opscope)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
bash "$here/fetch-assets.sh"
cargo run --release --manifest-path "$here/../Cargo.toml" -p opscope-lab --bin opscope -- measure \
  --gguf "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --text "$cache/fortunes.txt" --limit 48 --seq 32 "$@"
