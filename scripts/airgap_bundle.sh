#!/usr/bin/env bash
# Brings GraniKV and its GPU stack to a host without network access (docs/gpu_quickstart.md).
#
#   bash scripts/airgap_bundle.sh pack DIR [-- PIP_DOWNLOAD_ARGS...]   # machine with network
#   bash scripts/airgap_bundle.sh install DIR                          # the air-gapped host
#
# pack:    DIR/wheels/         granikv[serve] and every dependency as wheels (pip download), plus
#                              the GraniKV wheel built from this checkout;
#          DIR/flashinfer_aot/ FlashInfer's compiled modules from its cache on this machine
#                              ($FLASHINFER_WORKSPACE_BASE or $HOME, .cache/flashinfer/*/*/cached_ops).
#          Extra arguments after -- go to pip download (e.g. --python-version 3.12
#          --platform manylinux_2_28_x86_64 --only-binary=:all: for another host).
# install: pip install --no-index --find-links DIR/wheels "granikv[serve]", then the modules
#          into FlashInfer's AOT folder (flashinfer/data/aot in site-packages).
# PY selects the Python (default python3).
set -euo pipefail

PY=${PY:-python3}
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1 dir=$2
shift 2
[ "${1:-}" = "--" ] && shift

case "$cmd" in
  pack)
    repo=$(cd "$(dirname "$0")/.." && pwd)
    mkdir -p "$dir/wheels" "$dir/flashinfer_aot"
    "$PY" -m pip wheel --no-deps --wheel-dir "$dir/wheels" "$repo"
    # pip resolves granikv's requirements from the wheel just built (same version).
    "$PY" -m pip download --dest "$dir/wheels" --find-links "$dir/wheels" "$@" "granikv[serve]"
    cache=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
    n=0
    for ops in "$cache"/*/*/cached_ops; do
      [ -d "$ops" ] || continue
      for mod in "$ops"/*/; do
        name=$(basename "$mod")
        [ -f "$mod/$name.so" ] || continue     # only modules that finished compiling
        mkdir -p "$dir/flashinfer_aot/$name"
        cp "$mod/$name.so" "$dir/flashinfer_aot/$name/"
        n=$((n + 1))
      done
    done
    echo "airgap_bundle: $(ls "$dir/wheels" | wc -l) wheels, $n FlashInfer modules in $dir"
    [ "$n" -gt 0 ] || echo "airgap_bundle: no compiled FlashInfer module under $cache;" \
      "run the workload once on a GPU here first (see docs/gpu_quickstart.md)"
    ;;
  install)
    [ -d "$dir/wheels" ] || { echo "airgap_bundle: $dir/wheels not found (run pack first)" >&2; exit 2; }
    "$PY" -m pip install --no-index --find-links "$dir/wheels" "granikv[serve]"
    aot=$("$PY" -c 'import importlib.util, os; s = importlib.util.find_spec("flashinfer");
print(os.path.join(os.path.dirname(s.origin), "data", "aot"))')
    mkdir -p "$aot"
    if [ -d "$dir/flashinfer_aot" ] && [ -n "$(ls -A "$dir/flashinfer_aot")" ]; then
      cp -r "$dir/flashinfer_aot/." "$aot/"
    fi
    echo "airgap_bundle: installed; $(ls "$aot" | wc -l) FlashInfer modules in $aot"
    ;;
  *) usage ;;
esac
