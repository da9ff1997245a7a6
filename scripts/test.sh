#!/usr/bin/env bash
# The test command: install what the tests need (the real model, tokenizer and text; the
# Python reference packages), then run every test of the workspace (plugin and lab) in the
# release profile (the one profile this project builds: debug RLX kernels are slow).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bash "$here/fetch-assets.sh"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -r "$here/requirements-test.txt"
cd "$here/.."
# The benchmarks are not run here (they take minutes), but they must keep compiling.
cargo build --release --workspace --benches
cargo test --release --workspace "$@"
