#!/usr/bin/env bash
# Builds the bundle that runs SGLang 0.5.23 + GraniKV on the offline GPU host (one H200, Python
# 3.12, torch 2.11.0+cu130, triton 3.6.0, nvcc 13.0, no network). Run on a machine with network:
#
#   bash scripts/gpu_host_bundle.sh [OUT]       # OUT defaults to .gpu-host-0.5.23 (git-ignored)
#
# then send the checkout with OUT to the host and run there, from the repo root:
#
#   bash .gpu-host-0.5.23/setup.sh python3 -m pytest -m gpu test/
#
# A separate script, not an airgap_bundle.sh subcommand: airgap_bundle.sh carries the stock stack
# pip resolves for granikv[serve] (torch 2.14.1, sglang-kernel 0.4.10, FlashInfer 0.7.2) to a host
# that can take it; this one hand-assembles a substitute stack for a host that cannot (torch 2.11
# fixed, at most 64 MiB in all), slimming wheels and reusing prebuilt kernels.
#
# What goes in (docs/sglang_versions.md has the matrix):
# - sglang 0.5.23 (cp312 manylinux_2_34) without multimodal_gen/, test/ and every Rust extension
#   .so (the Rust server is off by default; SGLang's UnifiedRadixCache falls back to its Python
#   TreeCore): 37.2 -> 13.2 MiB.
# - sglang-kernel 0.4.5, sm90-only (only sm90/common_ops and spatial_ops kept), instead of the
#   0.4.10 that 0.5.23 pins: 0.4.10 is built for torch 2.14.1 and misses torch symbols on 2.11;
#   0.4.5 loads there (it is what the 0.5.17 recipe runs).
# - FlashInfer 0.6.15.post1, slim (data/cutlass, cccl, include, spdlog removed; 3.8 MiB), with
#   its attention / cascade / norm modules prebuilt for sm_90a (fi_aot/), instead of 0.7.2.
#   Measured: 0.7.2 slimmed the same way is 48.6 MiB as a wheel (0.6.15.post1: 3.8) and 10.6 MiB
#   inside the xz payload, so by size alone it would fit here (about 49 MiB in all). It is not
#   taken because it has no sm_90a modules: the fi_aot/ ones are 0.6.15.post1 builds (their
#   plan/run signatures follow that release), 0.7.2's would have to be compiled off the host
#   (~17 min of nvcc for FA2 + FA3 prefill, and FA3 needs curand_kernel.h, which the nvcc wheel
#   lacks), and nothing built that way has run on the host; 0.6.15.post1 with this fi_aot has.
#   With 0.6.15.post1 the imports GraniKV's triton and flashinfer paths need all succeed (the
#   import check below); the flashinfer names 0.5.23 imports that 0.6.15.post1 lacks are on
#   other paths (cutedsl split-K, sm107, MoE autotune). SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
#   skips 0.5.23's flashinfer >= 0.7.2 and sglang-kernel >= 0.4.9 start-up checks.
# - The pins 0.5.23 changed that its import path reaches: transformers 5.19.0, tokenizers
#   0.23.2, compressed-tensors 0.18.0, openai 2.8.0, plus huggingface-hub 1.33.0 and safetensors
#   0.8.0 (transformers 5.19 checks hub >= 1.31 and safetensors >= 0.8.0 at import). xgrammar
#   stays stubbed (grammar_backend="none"), as do IPython, gguf, jsonschema and soundfile.
# - Everything else at the version the 0.5.17 recipe carries (REUSED below), taken from its
#   wheels/ folder when there, else downloaded.
# - SGLang's tvm-ffi JIT kernels prebuilt for 0.5.17 (jit/; a kernel whose source changed in
#   0.5.23 is compiled on the host in ~10 s, never wrong).
#
# Layout of OUT: setup.sh, gpu_host_bundle.py (stubs), README, CONTENTS (sizes) and
# payload.tar.xz = wheels/ (each a valid wheel, members stored uncompressed so that xz compresses
# all the Python sources together: 63.6 MiB as plain wheels, about 40 MiB this way), fi_aot/, jit/.
#
# Inputs: GRANIKV_OFFLINE_SRC (default .offline-gpu, else ../shared/offline-gpu): the 0.5.17
# recipe folder, for fi_aot/ (required: modules are built on a GPU-less machine with nvcc by its
# precompile_flashinfer.py, ~20 min) and, when present, its slim kernel / flashinfer wheels and
# jit/. Downloads go to GRANIKV_BUNDLE_CACHE (default /tmp/granikv-gpu-bundle-cache), kept for
# re-runs; big intermediates (the full sglang-kernel wheel, staging, checks) are deleted. PY runs
# pip download (default: a python3.12 if found, else python3); CHECK_PY runs the import check
# (default .venv/bin/python: it needs torch; skipped with a message when it has none).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
helper=$repo/scripts/gpu_host_bundle.py
OUT=${1:-$repo/.gpu-host-0.5.23}
CACHE=${GRANIKV_BUNDLE_CACHE:-/tmp/granikv-gpu-bundle-cache}
SRC=${GRANIKV_OFFLINE_SRC:-}
if [ -z "$SRC" ]; then
  for d in "$repo/.offline-gpu" "$repo/../shared/offline-gpu"; do
    [ -d "$d/fi_aot" ] && { SRC=$d; break; }
  done
fi
if [ -z "${PY:-}" ]; then   # a Python 3.12 with pip (also installs the wheels as a check), else python3
  PY=python3
  for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$cand" -c 'import sys, pip; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY=$cand; break
    fi
  done
fi
CHECK_PY=${CHECK_PY:-$repo/.venv/bin/python}
log() { echo "gpu_host_bundle: $*"; }
die() { echo "gpu_host_bundle: $*" >&2; exit 1; }

SGLANG=sglang==0.5.23
KERNEL=sglang-kernel==0.4.5
FLASHINFER=flashinfer-python==0.6.15.post1
CHANGED="transformers==5.19.0 tokenizers==0.23.2 compressed-tensors==0.18.0 openai==2.8.0
  huggingface-hub==1.33.0 safetensors==0.8.0"
REUSED="annotated-types==0.8.0 apache-tvm-ffi==0.1.11 dill==0.4.1 distro==1.9.0 fastapi==0.115.12
  interegular==0.3.3 jiter==0.19.0 loguru==0.7.3 msgspec==0.22.0 orjson==3.13.0
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
  python-multipart==0.0.34 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==0.46.2
  typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.54.0"

[ -n "$SRC" ] && [ -d "$SRC/fi_aot" ] || die "no 0.5.17 recipe folder with fi_aot/ (set GRANIKV_OFFLINE_SRC)"
command -v xz >/dev/null || die "xz not found (apt-get install xz-utils)"
log "recipe folder $SRC; cache $CACHE; pip from $PY"

dl=$CACHE/downloads
stage=$CACHE/stage
mkdir -p "$dl"
rm -rf "$stage" && mkdir -p "$stage/wheels"
trap 'rm -rf "$stage" "$CACHE/verify"' EXIT

download() {   # PIN...: cp312 manylinux x86-64 wheels into $dl (no dependencies)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$dl" --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@" 2>&1 \
    | grep -v -E "^WARNING: Location '.*' is ignored" || true
  local pin
  for pin in "$@"; do python3 "$helper" find "$dl" "$pin" >/dev/null || die "download of $pin failed"; done
}
have() { python3 "$helper" find "$1" "$2" 2>/dev/null; }   # DIR PIN -> path

# 1. SGLang 0.5.23, slimmed.
have "$dl" "$SGLANG" >/dev/null || download "$SGLANG"
python3 "$helper" slim-stored sglang "$(have "$dl" "$SGLANG")" "$stage/wheels"

# 2. sglang-kernel 0.4.5 sm90-only: the recipe's slim wheel (re-zipped stored; the rule removes
#    nothing from it), else the full 383 MB wheel slimmed the same way and deleted.
if w=$(have "$SRC/wheels" "$KERNEL"); then
  python3 "$helper" slim-stored sglang-kernel "$w" "$stage/wheels"
else
  have "$dl" "$KERNEL" >/dev/null || download "$KERNEL"
  python3 "$helper" slim-stored sglang-kernel "$(have "$dl" "$KERNEL")" "$stage/wheels"
  rm -f "$(have "$dl" "$KERNEL")"
fi

# 3. FlashInfer 0.6.15.post1 slim (same: the recipe's, else downloaded and slimmed).
if w=$(have "$SRC/wheels" "$FLASHINFER"); then
  python3 "$helper" slim-stored flashinfer "$w" "$stage/wheels"
else
  have "$dl" "$FLASHINFER" >/dev/null || download "$FLASHINFER"
  python3 "$helper" slim-stored flashinfer "$(have "$dl" "$FLASHINFER")" "$stage/wheels"
fi

# 4. The changed pins, then the rest (the recipe's wheel when it is the same version).
for pin in $CHANGED $REUSED; do
  w=$(have "$SRC/wheels" "$pin") || w=$(have "$dl" "$pin") || { download "$pin"; w=$(have "$dl" "$pin"); }
  python3 "$helper" slim-stored none "$w" "$stage/wheels" >/dev/null
done

# 5. Prebuilt kernels.
cp -r "$SRC/fi_aot" "$stage/fi_aot"
[ -d "$SRC/jit" ] && cp -r "$SRC/jit" "$stage/jit"
chmod -R u+w "$stage"

# 6. Every wheel is a valid zip with its .dist-info, before packing.
python3 "$helper" check-wheels "$stage"/wheels/*.whl

# 7. The bundle.
rm -rf "$OUT" && mkdir -p "$OUT"
log "packing $(ls "$stage/wheels" | wc -l) wheels + fi_aot + jit (xz -9, a few minutes)"
tar -C "$stage" --sort=name --owner=0 --group=0 --numeric-owner -cf - wheels fi_aot $( [ -d "$stage/jit" ] && echo jit ) \
  | xz -9 -T2 >"$OUT/payload.tar.xz"
cp "$repo/scripts/gpu_host_bundle_setup.sh" "$OUT/setup.sh"
cp "$helper" "$OUT/gpu_host_bundle.py"
chmod +x "$OUT/setup.sh"
{
  echo "SGLang 0.5.23 + GraniKV for the offline GPU host (torch 2.11). Built by scripts/gpu_host_bundle.sh."
  echo "Run from the project root: bash .gpu-host-0.5.23/setup.sh python3 -m pytest -m gpu test/"
  echo "payload.tar.xz: wheels/, fi_aot/ (FlashInfer 0.6.15.post1 sm_90a modules), jit/. See CONTENTS."
} >"$OUT/README"
(cd "$stage" && for f in wheels/*.whl; do
   printf '%s\t%s\n' "$(du -b "$f" | cut -f1)" "$f"; done
 printf '%s\t%s\n' "$(du -sb fi_aot | cut -f1)" "fi_aot/"
 [ -d jit ] && printf '%s\t%s\n' "$(du -sb jit | cut -f1)" "jit/"
 true) >"$OUT/CONTENTS"
rm -rf "$stage"

# 8. Verify what ships: unpack the payload, check every wheel again, install them all with the
#    host's Python version (pip --no-deps), then the size.
verify=$CACHE/verify
rm -rf "$verify" && mkdir -p "$verify"
tar -C "$verify" -xJf "$OUT/payload.tar.xz"
python3 "$helper" check-wheels "$verify"/wheels/*.whl
n_aot=$(find "$verify/fi_aot" -name '*.so' | wc -l)
[ "$n_aot" -gt 0 ] || die "no FlashInfer module in the payload"
if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$verify/site312" "$verify"/wheels/*.whl \
    || die "pip (Python 3.12) could not install the bundle's wheels"
  log "pip (Python 3.12) installs all $(ls "$verify/wheels" | wc -l) wheels with --no-deps"
  rm -rf "$verify/site312"
else
  log "no Python 3.12 here: the pip install check of the cp312 wheels is skipped"
fi
tracked=$(cd "$repo" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || echo 0)
python3 "$helper" size "$OUT" bundle "${tracked:-0}"

# 9. Import check on CPU: the bundle's wheels (those this Python can load: all but the cp312
#    compiled ones, whose same versions come from CHECK_PY's own site-packages) and the stubs
#    first on the path, CUDA faked as an H200 (sgl_kernel's compiled library, which needs
#    libcuda, is not loaded; its Python API is). Then the same check with the 0.5.17 recipe's
#    wheels, to list any third-party package 0.5.23 loads that 0.5.17 did not (the host has only
#    what 0.5.17 needed and the bundle carries).
if [ -x "$CHECK_PY" ] && "$CHECK_PY" -c 'import torch' 2>/dev/null; then
  "$CHECK_PY" "$helper" unpack-for-check "$verify/site" "$verify"/wheels/*.whl
  python3 "$helper" stubs "$verify/stubs" >/dev/null
  log "import check with $("$CHECK_PY" -c 'import sys, torch; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}")')"
  (cd "$repo" && PYTHONPATH="$verify/site:$verify/stubs" "$CHECK_PY" "$helper" import-check --fake-sm90 \
     >"$verify/imports-0.5.23.txt" 2>"$verify/imports-0.5.23.err") \
    || { grep -v '^loaded-packages' "$verify/imports-0.5.23.txt"; tail -20 "$verify/imports-0.5.23.err"; die "import check failed"; }
  grep -v '^loaded-packages' "$verify/imports-0.5.23.txt"
  if have "$SRC/wheels" sglang==0.5.17 >/dev/null; then
    "$CHECK_PY" "$helper" unpack-for-check "$verify/site17" "$SRC"/wheels/*.whl >/dev/null
    (cd "$repo" && PYTHONPATH="$verify/site17:$verify/stubs" "$CHECK_PY" "$helper" import-check --fake-sm90 \
       >"$verify/imports-0.5.17.txt" 2>/dev/null) || log "the 0.5.17 comparison run failed (see above)"
    python3 "$helper" import-diff "$verify/imports-0.5.17.txt" "$verify/imports-0.5.23.txt" "$verify/site" \
      || die "SGLang 0.5.23 loads packages the host may not have (carry or stub them)"
  fi
else
  log "SKIPPED the import check: $CHECK_PY has no torch (set CHECK_PY to a Python with torch;" \
    "Python 3.12 with torch 2.11 needs several GB of CUDA wheels)"
fi
rm -rf "$verify"
log "done: $OUT ($(du -sb "$OUT" | cut -f1) bytes)"
column -t "$OUT/CONTENTS" 2>/dev/null || cat "$OUT/CONTENTS"
