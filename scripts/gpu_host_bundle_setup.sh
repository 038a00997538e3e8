#!/usr/bin/env bash
# setup.sh of the SGLang 0.5.23 GPU-host bundle (scripts/gpu_host_bundle.sh copies this file into
# the bundle). Prepares the offline GPU host (no network; torch 2.11 + CUDA 13 + triton 3.6 + nvcc
# preinstalled, Python 3.12) to run SGLang 0.5.23 and this project, then runs the given command:
#
#   bash .gpu-host-0.5.23/setup.sh python3 -m pytest -m gpu test/
#
# Run from the project's root. Unpacks payload.tar.xz (the wheels, FlashInfer's prebuilt sm_90a
# modules, SGLang's prebuilt JIT kernels) under /tmp, installs the wheels into $SITE, copies the
# modules into FlashInfer's AOT folder (loaded without nvcc), seeds the tvm-ffi JIT cache, writes
# import stubs, installs the project with --no-deps (so SGLang finds its plugin entry point), sets
# the environment and execs the command. A few seconds on a warm host.
set -eo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONUNBUFFERED=1
# The flashinfer attention backend's imports sit behind this (false: SGLang keeps off flashinfer;
# sgl_kernel's rmsnorm still goes through flashinfer.norm, prebuilt in the payload).
export SGLANG_IS_FLASHINFER_AVAILABLE=${SGLANG_IS_FLASHINFER_AVAILABLE:-true}
# sglang-kernel is 0.4.5 built for torch 2.11 (0.5.23 asks for >= 0.4.9) and flashinfer is
# 0.6.15.post1 (0.5.23 asks for >= 0.7.2): this skips both start-up checks.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# The Rust extensions are not carried: never try to build one, and use the Python TreeCore for
# SGLang's own UnifiedRadixCache (what stock SGLang serves; GraniKV's cache does not use it).
export SGLANG_RUST_BUILD_MODE=${SGLANG_RUST_BUILD_MODE:-never}
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvmcache}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
SITE=${GRANIKV_OFFLINE_SITE:-/tmp/site-sglang-0.5.23}
UNPACKED=${GRANIKV_OFFLINE_UNPACKED:-/tmp/granikv-bundle-0.5.23}

python3 -c 'import lzma' 2>/dev/null || { echo "setup.sh: this Python has no lzma module; payload.tar.xz cannot be unpacked" >&2; exit 1; }
stamp=$(stat -c '%s %Y' "$here/payload.tar.xz")
if [ "$(cat "$UNPACKED/.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$UNPACKED" && mkdir -p "$UNPACKED"
  python3 - "$here/payload.tar.xz" "$UNPACKED" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    try:
        t.extractall(sys.argv[2], filter="data")
    except TypeError:  # a Python without extraction filters
        t.extractall(sys.argv[2])
EOF
  echo "$stamp" >"$UNPACKED/.stamp"
fi
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
  "$UNPACKED"/wheels/*.whl 2>&1 | grep -v WARNING || true
[ -f "$SITE/sglang-0.5.23.dist-info/METADATA" ] \
  || { echo "setup.sh: SGLang 0.5.23 did not install into $SITE" >&2; exit 1; }
if [ -d "$UNPACKED/fi_aot" ] && [ -d "$SITE/flashinfer" ]; then
  mkdir -p "$SITE/flashinfer/data/aot" && cp -r "$UNPACKED"/fi_aot/. "$SITE/flashinfer/data/aot/"
fi
if [ -d "$UNPACKED/jit" ]; then
  mkdir -p "$TVM_FFI_CACHE_DIR" && cp -r "$UNPACKED"/jit/. "$TVM_FFI_CACHE_DIR"/
fi
python3 "$here"/gpu_host_bundle.py stubs /tmp/stubs-sglang-0.5.23 >/dev/null
export PYTHONPATH="$SITE:/tmp/stubs-sglang-0.5.23${PYTHONPATH:+:$PYTHONPATH}"
if [ -f pyproject.toml ] || [ -f setup.py ]; then
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" . 2>&1 | grep -v WARNING || true
  ls -d "$SITE"/granikv-*.dist-info >/dev/null 2>&1 \
    || { echo "setup.sh: the project did not install into $SITE (its build needs setuptools on this Python)" >&2; exit 1; }
fi
exec "$@"
