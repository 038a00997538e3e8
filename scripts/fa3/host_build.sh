#!/usr/bin/env bash
# Builds the minimal FA3 library on a GPU machine against its own torch, installs it into the
# sgl_kernel package that SGLang imports, and runs the smoke test (scripts/fa3/README.md).
#   bash scripts/fa3/host_build.sh SRC OUT [MAX_JOBS]
# SRC: hopper/ (sgl-project/sgl-flash-attn) and cutlass/ as build_fa3.py expects; OUT: build
# folder (kernel objects already there, e.g. compiled on another machine with the same nvcc,
# are reused).
set -u
here=$(cd "$(dirname "$0")" && pwd)
SRC=${1:?SRC}; OUT=${2:?OUT}; JOBS=${3:-12}
python3 -c "import torch,sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); "$NVCC" --version | tail -1
# no Python.h needed: the library registers its ops at load; a two-line flash_ops.py loads it
export FA3_HOST_FLAGS="-DFLASH_OPS_NO_PYTHON"
T=$(date +%s)
python3 "$here/build_fa3.py" --max-jobs "$JOBS" --no-nice --nvcc "$NVCC" --src "$SRC" --out "$OUT" || exit $?
echo "built in $(( $(date +%s) - T )) s"
SK=$(python3 -c "import importlib.util,os; print(os.path.dirname(importlib.util.find_spec('sgl_kernel').origin))")
cp "$OUT/flash_ops.abi3.so" "$SK/libflash_ops_min.so"
printf 'import os as _os\nimport torch as _torch\n_torch.ops.load_library(_os.path.join(_os.path.dirname(__file__), "libflash_ops_min.so"))\n' > "$SK/flash_ops.py"
echo "installed into $SK"
python3 "$here/fa3_smoke.py"
