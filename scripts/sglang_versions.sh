# The SGLang releases GraniKV supports, and each one's CPU test environment (sourced by
# scripts/setup_cpu_env.sh and scripts/test.sh; keep in step with python/granikv/sglang_compat.py).
SGLANG_VERSIONS="0.5.17 0.5.23"
# The release whose venv (.venv) holds torch and the shared imports; the others layer on it.
SGLANG_BASE=0.5.17

venv_for() {  # the per-release venv directory (git-ignored)
  if [ "$1" = "$SGLANG_BASE" ]; then echo .venv; else echo ".venv-sglang-$1"; fi
}

flashinfer_for() {  # the flashinfer-python release that SGLang release pins
  case "$1" in
    0.5.17) echo 0.6.15.post1 ;;
    0.5.23) echo 0.7.2 ;;
    *) echo "no flashinfer pin for SGLang $1 in scripts/sglang_versions.sh" >&2; return 1 ;;
  esac
}
