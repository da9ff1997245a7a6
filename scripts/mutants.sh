#!/usr/bin/env bash
# Mutation testing of the plugin with cargo-mutants (issue 11). Not part of CI: the whole scope
# (the miner, the sketch kernel and probes, the rewrite, the passes: about 2,500 mutants) takes
# about 20 hours on 2 cores; a round-robin shard is a systematic sample (`--shard 0/16`).
#
# The run never touches the main tree or its build: it works in a git worktree of HEAD
# (`$MUTANTS_TREE`, default ../opscope-mutants) with cargo-mutants' --in-place, and builds in that
# worktree's own target dir (`$MUTANTS_TARGET`, default $MUTANTS_TREE/target). Set
# `MUTANTS_SEED_TARGET` to an existing release target dir to copy it there first (skips the
# 5-minute RLX build). Release builds are incremental in that target only, so a mutant rebuilds
# in about 10-30 s instead of a minute and a half.
#
# The `parquet` feature is on, so the Parquet recording code (`src/recording/dataset.rs`, ...)
# is built and tested rather than compiled out.
#
# Extra arguments go to cargo-mutants (e.g. `--shard 0/16 --sharding round-robin`, `-f
# src/mine/tensor.rs` instead of the default scope, `--list` to see the mutants without running
# them). The report is written to $MUTANTS_TREE/mutants.out/ (outcomes.json, caught.txt,
# missed.txt, timeout.txt, unviable.txt). Each mutant runs the `opscope` package's tests (unit and
# tests/); the lab's tests (MiniLM end to end) are not run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tree="${MUTANTS_TREE:-$repo/../opscope-mutants}"
command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants
bash "$repo/scripts/fetch-assets.sh" >/dev/null

if [ ! -d "$tree" ]; then
  git -C "$repo" worktree add --detach "$tree" HEAD
elif [ -n "$(git -C "$tree" status --porcelain)" ]; then
  echo "mutants.sh: $tree has uncommitted changes (an interrupted run?): inspect, then 'git -C $tree checkout -- .'" >&2
  exit 2
fi
tree="$(cd "$tree" && pwd)"
target="${MUTANTS_TARGET:-$tree/target}"
if [ -n "${MUTANTS_SEED_TARGET:-}" ] && [ ! -d "$target" ]; then
  cp -a "$MUTANTS_SEED_TARGET" "$target"
fi
export CARGO_TARGET_DIR="$target"
export CARGO_PROFILE_RELEASE_INCREMENTAL=true

cd "$tree"
scope=(-f 'src/mine/**' -f 'src/sketch/**' -f 'src/rewrite.rs' -f 'src/../passes/**')
for a in "$@"; do
  case "$a" in -f|--file|-f*|--file=*) scope=() ;; esac
done
exec cargo mutants \
  --in-place \
  --package opscope \
  --features parquet \
  --cargo-arg=--release \
  --timeout 300 \
  "${scope[@]}" \
  "$@"
