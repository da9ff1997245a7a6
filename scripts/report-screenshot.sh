#!/usr/bin/env bash
# Render an opscope HTML report in headless Debian Chromium and save a screenshot, to look at
# what a person sees. Installs chromium with apt-get if it is missing.
#
#   bash scripts/report-screenshot.sh RECORDING [OUT_PREFIX [REPORT_ARGS...]]
#   -> OUT_PREFIX.html and OUT_PREFIX.png (default: report); REPORT_ARGS go to `opscope report`
#      (e.g. --cost cost.json, or --onnx model.onnx).
set -euo pipefail
rec="${1:?usage: report-screenshot.sh RECORDING [OUT_PREFIX]}"
out="${2:-report}"
shift $(( $# < 2 ? $# : 2 ))
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v chromium >/dev/null 2>&1; then
  apt-get install -y chromium >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; }
fi
cargo run --quiet --release --manifest-path "$here/../Cargo.toml" -p opscope-lab --bin opscope -- report "$rec" -o "$out.html" "$@"
profile="$(mktemp -d)"
# Flags as this workplace's machines need them: no sandbox as root, no background networking.
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --window-size=1400,1300 --screenshot="$out.png" "file://$(realpath "$out.html")" \
  >/dev/null 2>&1
rm -rf "$profile"
test -s "$out.png" || { echo "report-screenshot: chromium wrote no screenshot" >&2; exit 1; }
echo "report-screenshot: $out.html rendered to $out.png"
