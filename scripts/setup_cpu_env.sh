#!/usr/bin/env bash
# Creates the CPU environment for one supported SGLang release (default 0.5.17; the releases and
# their venvs are in scripts/sglang_versions.sh: .venv for 0.5.17, .venv-sglang-0.5.23, ...):
#   torch/torchvision (from this machine's disk when present), SGLang --no-deps plus the
#   packages it needs to import on CPU (requirements/cpu-import-deps.txt), flashinfer --no-deps,
#   pytest + hypothesis, and GraniKV itself (editable), so SGLang discovers its entry point.
#     bash scripts/setup_cpu_env.sh [0.5.17|0.5.23]
# Idempotent: re-running on a ready venv only re-installs GraniKV.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/sglang_versions.sh
SGLANG=${1:-0.5.17}
case " $SGLANG_VERSIONS " in *" $SGLANG "*) ;; *)
  echo "setup_cpu_env.sh: SGLang $SGLANG is not a supported release ($SGLANG_VERSIONS)" >&2; exit 2 ;;
esac
FLASHINFER=$(flashinfer_for "$SGLANG")
PY=${PYTHON:-python3}
VENV=$(venv_for "$SGLANG")

# pip with the noise these installs are expected to print filtered out (the resolver's complaint
# about the --no-deps installs below, the local mirror's missing-index warnings); anything else
# pip prints is shown, and a failing pip still fails the script.
pip_install() {
  local log rc=0
  log=$(mktemp)
  python -m pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v -E \
    -e "^ERROR: pip's dependency resolver does not currently take into account all the packages" \
    -e "^[A-Za-z0-9_.-]+ [^ ]+ requires .*(, which is not installed|, but you have .* which is incompatible)\.$" \
    -e "^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.$" \
    "$log" >&2 || true
  rm -f "$log"
  return "$rc"
}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import sglang, torch, triton, pytest, hypothesis, charset_normalizer" 2>/dev/null \
    || [ "$(python -c 'import sglang; print(sglang.__version__)' 2>/dev/null)" != "$SGLANG" ]; then
  echo "setup_cpu_env.sh: building $VENV (SGLang $SGLANG, flashinfer $FLASHINFER, torch 2.14.1)" >&2
  pip_install --upgrade pip
  pip_install torch==2.14.1 torchvision==0.29.1
  # SGLang's own dependency pins are its GPU serving stack (CUDA builds, sglang-kernel), which
  # neither installs nor runs here: --no-deps, plus the packages its modules need to import.
  pip_install --no-deps -r requirements/cpu-import-deps.txt
  pip_install --no-deps "sglang==$SGLANG" "flashinfer-python==$FLASHINFER"
  pip_install -r requirements/cpu-test.txt
fi
pip_install --no-deps --no-build-isolation -e . 2>/dev/null || pip_install --no-deps -e .
