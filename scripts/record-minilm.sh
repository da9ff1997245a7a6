#!/usr/bin/env bash
# The main job end to end: fetch MiniLM-L3 (ONNX), its tokenizer and the fortunes text into a
# cache folder outside the repository, then record every MatMul of the model while it embeds
# the text. Extra arguments go to `opscope record` (e.g. --limit 64, --pipeline 'matmul{...}').
#
#   OPSCOPE_CACHE  cache folder (default: $HOME/.cache/opscope)
#   OUT            recording path (default: the Parquet dataset recording.parquet in the current
#                  directory; an existing recording is refused: remove it, pass --append to add
#                  a recording to a dataset, or --force to replace a CSV file)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
bash "$here/fetch-assets.sh"
cargo run --release --manifest-path "$here/../Cargo.toml" -p opscope-lab --bin opscope -- record \
  --onnx "$cache/paraphrase-MiniLM-L3-v2.onnx" \
  --tokenizer "$cache/tokenizer.json" \
  --text "$cache/fortunes.txt" \
  --out "${OUT:-recording.parquet}" "$@"
