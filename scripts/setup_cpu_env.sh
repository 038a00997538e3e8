#!/usr/bin/env bash
# Creates .venv with everything the CPU test suite and the CPU demo need:
#   torch/torchvision (from this machine's disk when present), SGLang 0.5.17 --no-deps plus the
#   packages it needs to import on CPU (requirements/cpu-import-deps.txt), flashinfer --no-deps,
#   pytest + hypothesis, and GraniKV itself (editable), so SGLang discovers its entry point.
# Idempotent: re-running on a ready .venv only re-installs GraniKV.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GRANIKV_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import sglang, torch, triton, pytest, hypothesis" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.14.1 torchvision==0.29.1
  python -m pip install -q --no-deps -r requirements/cpu-import-deps.txt
  python -m pip install -q --no-deps sglang==0.5.17 flashinfer-python==0.6.15.post1
  python -m pip install -q -r requirements/cpu-test.txt
fi
python -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || python -m pip install -q --no-deps -e .
