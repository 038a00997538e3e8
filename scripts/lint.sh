#!/usr/bin/env bash
# Static checks, as CI runs them (scripts/test.sh calls this once): `ruff check python/granikv`
# and `mypy` (pyproject.toml's [tool.ruff] / [tool.mypy]: the whole package, every function
# annotated), in the base release's CPU venv (.venv, built by scripts/setup_cpu_env.sh). The
# pinned tools (requirements/lint.txt) are installed into it when missing. Both checks run;
# exits non-zero if either reports a finding.
#   bash scripts/lint.sh
#   bash scripts/lint.sh --install     # only install the pinned tools (scripts/test.sh, before the
#                                      # checks run beside the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sglang_versions.sh
VENV=$(venv_for "$SGLANG_BASE")
if [ ! -x "$VENV/bin/python" ]; then
  echo "lint.sh: no $VENV; build it first: bash scripts/setup_cpu_env.sh $SGLANG_BASE" >&2
  exit 2
fi

pinned() { sed -n "s/^$1==//p" requirements/lint.txt; }
installed() { "$VENV/bin/$1" --version 2>/dev/null | awk '{ print $2 }'; }
if [ "$(installed ruff)" != "$(pinned ruff)" ] || [ "$(installed mypy)" != "$(pinned mypy)" ]; then
  echo "lint.sh: installing requirements/lint.txt into $VENV" >&2
  "$VENV/bin/python" -m pip install -q -r requirements/lint.txt
fi
if [ "${1:-}" = "--install" ]; then
  exit 0
fi

rc=0
echo "=== ruff check python/granikv" >&2
"$VENV/bin/ruff" check python/granikv || rc=1
echo "=== mypy" >&2
"$VENV/bin/mypy" || rc=1
if [ "$rc" -ne 0 ]; then
  echo "lint.sh: ruff or mypy reported findings (above)" >&2
fi
exit "$rc"
