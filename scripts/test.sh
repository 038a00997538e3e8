#!/usr/bin/env bash
# The test suite, as CI runs it: sets up .venv (scripts/setup_cpu_env.sh), then runs pytest.
# Fails on any failing test and on zero collected tests (pytest exits 5 then).
# GPU tests (marked `gpu`) are skipped without CUDA; Triton kernels run in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
