"""scripts/airgap_bundle.sh with a stand-in Python (no network, no GPU): what pack collects and
where install puts FlashInfer's modules."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "airgap_bundle.sh"

FAKE_PY = """#!/usr/bin/env bash
# Stand-in for python: logs pip calls, answers the FlashInfer location query.
if [ "$1" = "-m" ]; then echo "$*" >> "$PIP_LOG"; exit 0; fi
if [ "$1" = "-c" ]; then echo "$FAKE_AOT"; exit 0; fi
exit 1
"""


def _run(tmp_path, *args):
    py = tmp_path / "py"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    env = dict(os.environ, PY=str(py), PIP_LOG=str(tmp_path / "pip.log"),
               FAKE_AOT=str(tmp_path / "site" / "flashinfer" / "data" / "aot"),
               FLASHINFER_WORKSPACE_BASE=str(tmp_path / "base"))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_pack_collects_wheels_and_compiled_modules_then_install_places_them(tmp_path):
    ops = tmp_path / "base" / ".cache" / "flashinfer" / "0.6.15" / "90a" / "cached_ops"
    (ops / "batch_decode_x").mkdir(parents=True)
    (ops / "batch_decode_x" / "batch_decode_x.so").write_bytes(b"so")
    (ops / "half_built").mkdir()  # no .so yet: a build that did not finish is left out
    bundle = tmp_path / "bundle"
    p = _run(tmp_path, "pack", str(bundle), "--", "--python-version", "3.12")
    assert p.returncode == 0, p.stderr
    assert "1 FlashInfer modules" in p.stdout
    assert (bundle / "flashinfer_aot" / "batch_decode_x" / "batch_decode_x.so").read_bytes() == b"so"
    assert not (bundle / "flashinfer_aot" / "half_built").exists()
    pip = (tmp_path / "pip.log").read_text().splitlines()
    assert pip[0].startswith("-m pip wheel --no-deps")
    assert pip[1].startswith("-m pip download") and "--python-version 3.12" in pip[1]
    assert pip[1].endswith("granikv[serve]")
    (bundle / "wheels" / "granikv-0.1.0-py3-none-any.whl").write_text("")
    p = _run(tmp_path, "install", str(bundle))
    assert p.returncode == 0, p.stderr
    assert "--no-index --find-links" in (tmp_path / "pip.log").read_text().splitlines()[-1]
    aot = tmp_path / "site" / "flashinfer" / "data" / "aot"
    assert (aot / "batch_decode_x" / "batch_decode_x.so").read_bytes() == b"so"


def test_usage_errors_exit_2(tmp_path):
    assert _run(tmp_path).returncode == 2
    assert _run(tmp_path, "unpack", str(tmp_path)).returncode == 2
    p = _run(tmp_path, "install", str(tmp_path / "missing"))
    assert p.returncode == 2 and "run pack first" in p.stderr
