#!/usr/bin/env bash
# Mutation testing of the plugin with cargo-mutants (issue 11). Not part of CI: a run over the
# miner, the sketch kernel, the probes, the rewrite and the passes takes hours on 2 cores.
#
# cargo-mutants copies the tree into its own scratch directory and builds there with its own
# target directory, so the main build is never overwritten. Extra arguments go to cargo-mutants
# (e.g. `-f src/mine/tensor.rs` for one file, `--list` to see the mutants without running them).
# The report is written to mutants.out/ (outcomes.json, caught.txt, missed.txt, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

# A target-dir set in .cargo/config.toml or the environment would be copied along and shared
# by every scratch build: exactly the overwrite this script must avoid.
if [ -n "${CARGO_TARGET_DIR:-}" ] || grep -qs 'target-dir' .cargo/config.toml; then
  echo "mutants.sh: unset CARGO_TARGET_DIR and remove target-dir from .cargo/config.toml first (cargo-mutants needs its own target dir)" >&2
  exit 2
fi
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
bash scripts/fetch-assets.sh >/dev/null

exec cargo mutants \
  --package opscope \
  --cargo-arg=--release \
  --timeout 600 \
  -f 'src/mine/**' -f 'src/sketch/**' -f 'src/rewrite.rs' -f 'passes/**' \
  "$@"
