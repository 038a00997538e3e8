#!/usr/bin/env bash
# The test suite, as CI runs it: for every supported SGLang release (scripts/sglang_versions.sh)
# set up its CPU environment (scripts/setup_cpu_env.sh) and run pytest in it. Fails if the suite
# fails on any release or collects no tests there (pytest exits 5 then); every release runs
# even after one fails. Once, beside the first release's tests, the static checks
# (scripts/lint.sh: ruff and mypy, in the base release's venv; printed at the end); a finding
# fails the run too, but the tests still run.
# Extra arguments go to pytest. One release only:
#   GRANIKV_SGLANG_VERSIONS=0.5.23 bash scripts/test.sh test/mem_cache
# GPU tests (marked `gpu`) are skipped without CUDA; Triton kernels run in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sglang_versions.sh
failed=""
lint_failed=0
bash scripts/setup_cpu_env.sh "$SGLANG_BASE"  # the venv the lint step runs in
bash scripts/lint.sh --install  # before any test runs in that venv
# the checks run beside the tests (pytest keeps one core busy; ruff and mypy take the other)
lint_log=$(mktemp)
bash scripts/lint.sh >"$lint_log" 2>&1 &
lint_pid=$!
for v in ${GRANIKV_SGLANG_VERSIONS:-$SGLANG_VERSIONS}; do
  echo "=== SGLang $v: $(venv_for "$v")" >&2
  if [ "$v" != "$SGLANG_BASE" ]; then  # the base venv is set up above
    bash scripts/setup_cpu_env.sh "$v"
  fi
  rc=0
  "$(venv_for "$v")/bin/python" -m pytest -q -p no:cacheprovider "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== SGLang $v: pytest exited $rc" >&2
    failed="$failed $v"
  fi
done
if ! wait "$lint_pid"; then
  lint_failed=1
fi
echo "=== static checks (scripts/lint.sh)" >&2
cat "$lint_log" >&2
rm -f "$lint_log"
status=0
if [ -n "$failed" ]; then
  echo "test.sh: the suite failed on SGLang$failed" >&2
  status=1
fi
if [ "$lint_failed" -ne 0 ]; then
  echo "test.sh: the static checks failed (scripts/lint.sh)" >&2
  status=1
fi
exit "$status"
