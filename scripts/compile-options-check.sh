#!/usr/bin/env bash
# Build RLX 0.2.19 with upstream/rlx-compile-options-ir-passes.patch (a pass list in
# `CompileOptions`, resolved against a registry of opt-in IR passes) and run opscope's test of it
# (`tests/compile_options.rs`, feature `rlx-ir-pass-list`). The crates.io sources of rlx-fusion,
# rlx-compile and rlx-runtime are copied out of cargo's registry, patched, and swapped in with
# `--config patch.crates-io...`, so Cargo.toml is not touched. The patched RLX builds into its
# own target dir (default target/rlx-patched; RLX rebuilds: about 5 minutes on 2 cores).
#
# Usage: scripts/compile-options-check.sh [cargo test args...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/.."
work="${RLX_PATCHED_DIR:-$PWD/target/rlx-patched-src}"
export CARGO_TARGET_DIR="${RLX_PATCHED_TARGET:-$PWD/target/rlx-patched}"

# Where cargo keeps each crate's sources (the versions Cargo.lock pins).
meta="$(cargo metadata --format-version 1 --locked)"
case "$(realpath -m "$work")" in
  / | "$HOME" | "$PWD") echo "compile-options-check: RLX_PATCHED_DIR=$work would delete too much; pick an empty folder" >&2; exit 2 ;;
esac
rm -rf "$work"
mkdir -p "$work"
config=()
for crate in rlx-fusion rlx-compile rlx-runtime; do
  manifest="$(printf '%s' "$meta" | python3 -c "import json,sys; print(next(p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name'] == '$crate'))")"
  cp -a "$(dirname "$manifest")" "$work/$crate"
  config+=(--config "patch.crates-io.$crate.path=\"$work/$crate\"")
done
patch -p1 -d "$work" < upstream/rlx-compile-options-ir-passes.patch
# Cargo records the patched crates in Cargo.lock: put the project's lock back afterwards.
cp Cargo.lock "$work/Cargo.lock.orig"
trap 'cp "$work/Cargo.lock.orig" Cargo.lock' EXIT
cargo test --release -p opscope --features rlx-ir-pass-list --test compile_options "${config[@]}" "$@"
