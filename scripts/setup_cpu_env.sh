#!/usr/bin/env bash
# Creates the CPU environment for one supported SGLang release (default 0.5.17; the releases and
# their venvs are in scripts/sglang_versions.sh: .venv for 0.5.17, .venv-sglang-0.5.23, ...):
#   torch/torchvision (from this machine's disk when present), SGLang --no-deps plus the
#   packages it needs to import on CPU (requirements/cpu-import-deps.txt), flashinfer --no-deps,
#   pytest + hypothesis, and GraniKV itself (editable), so SGLang discovers its entry point.
#     bash scripts/setup_cpu_env.sh [0.5.17|0.5.23]
# The base release's venv (.venv) holds everything, torch's ~5.5 GB CUDA build included. Every
# other release gets a small venv layered on it: only its own sglang and flashinfer-python
# (~0.8 GB), with the base venv's site-packages after its own on sys.path (a .pth file), since
# the releases differ in nothing else they import on CPU. Both releases together need ~7 GB.
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

# One line of warning, not pip's "No space left on device" half-way through a 5 GB install.
need_gb=7; [ "$SGLANG" = "$SGLANG_BASE" ] || need_gb=1
free_gb=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "${free_gb:-0}" -lt "$need_gb" ] && [ ! -x "$VENV/bin/python" ]; then
  echo "setup_cpu_env.sh: warning: ${free_gb} GB free here; building $VENV needs about ${need_gb} GB" >&2
fi

if [ "$SGLANG" != "$SGLANG_BASE" ]; then
  # A layered venv: the base release's environment first (built if missing), then this
  # release's sglang + flashinfer-python in its own site-packages, which shadow the base's.
  BASE_VENV=$(venv_for "$SGLANG_BASE")
  bash scripts/setup_cpu_env.sh "$SGLANG_BASE"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  base_site=$("$BASE_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  own_site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # addsitedir (not a bare path line) so the base's own .pth files, GraniKV's editable
  # install among them, take effect here too.
  echo "import site; site.addsitedir('$base_site')" >"$own_site/granikv-base-env.pth"
  . "$VENV/bin/activate"
  if [ "$(python -c 'import sglang; print(sglang.__version__)' 2>/dev/null)" != "$SGLANG" ] \
      || [ "$(python -c 'import flashinfer; print(flashinfer.__version__)' 2>/dev/null)" != "$FLASHINFER" ]; then
    echo "setup_cpu_env.sh: building $VENV (SGLang $SGLANG, flashinfer $FLASHINFER) on $BASE_VENV" >&2
    # --ignore-installed: the base's sglang/flashinfer stay where they are, shadowed.
    pip_install --no-deps --ignore-installed "sglang==$SGLANG" "flashinfer-python==$FLASHINFER"
  fi
  python -c "import sglang, torch, triton, pytest, hypothesis, granikv" \
    || { echo "setup_cpu_env.sh: $VENV does not import its packages; remove it and re-run" >&2; exit 1; }
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import sglang, torch, triton, pytest, hypothesis, charset_normalizer" 2>/dev/null \
    || [ "$(python -c 'import sglang; print(sglang.__version__)' 2>/dev/null)" != "$SGLANG" ]; then
  echo "setup_cpu_env.sh: building $VENV (SGLang $SGLANG, flashinfer $FLASHINFER, torch 2.14.1)" >&2
  echo "setup_cpu_env.sh: SGLang and flashinfer are installed with --no-deps (their pins are the CUDA serving stack); requirements/cpu-import-deps.txt is what they import on CPU" >&2
  pip_install --upgrade pip
  pip_install torch==2.14.1 torchvision==0.29.1
  # SGLang's own dependency pins are its GPU serving stack (CUDA builds, sglang-kernel), which
  # neither installs nor runs here: --no-deps, plus the packages its modules need to import.
  pip_install --no-deps -r requirements/cpu-import-deps.txt
  pip_install --no-deps "sglang==$SGLANG" "flashinfer-python==$FLASHINFER"
  pip_install -r requirements/cpu-test.txt
fi
pip_install --no-deps --no-build-isolation -e . 2>/dev/null || pip_install --no-deps -e .
