#!/usr/bin/env bash
# Issue 12's study end to end: fetch SmolLM2-135M-Instruct (GGUF, Q4_1) and the fortunes text,
# then run `opscope measure --gguf`: perplexity, attention sinks per layer and head (attn tap),
# massive activations per residual block (residual tap), W4A8 / W8A8 per-tensor vs per-token
# (fakequant), and block influence vs the perplexity change of skipping each of the 60 residual
# blocks (skip). Prints Markdown; extra arguments go to `opscope measure`. lab/SMOLLM2.md was
# made with
#   bash scripts/measure-smollm2.sh --no-skip                    # 48 fortunes: ~8 min on 2 cores
#   LIMIT=16 bash scripts/measure-smollm2.sh --no-w8a8            # the 60 skips: ~25 min
#
#   OPSCOPE_CACHE  cache folder (default: $HOME/.cache/opscope)
#   LIMIT          fortunes measured (default 48; each skip is one pass over them)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
bash "$here/fetch-assets.sh"
cargo run --release --manifest-path "$here/../Cargo.toml" -p opscope-lab --bin opscope -- measure \
  --gguf "$cache/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --text "$cache/fortunes.txt" --limit "${LIMIT:-48}" --seq 32 "$@"
