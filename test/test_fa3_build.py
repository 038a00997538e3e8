"""The minimal FA3 build's file selection (scripts/fa3): CPU only, no compiler needed."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fa3" / "build_fa3.py"


def test_the_build_lists_the_bf16_sm90_instantiations_sglang_calls_and_its_switches():
    out = subprocess.run([sys.executable, str(SCRIPT), "--list", "--src", "/nowhere"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    files = [Path(line).name for line in out if not line.startswith("defines:")]
    inst = sorted(f for f in files if f.startswith("flash_fwd_hdim"))
    assert inst == sorted(f"flash_fwd_hdim{h}_bf16{p}{s}_sm90.cu" for h in (64, 128)
                          for p in ("", "_paged") for s in ("", "_split"))
    assert {"flash_fwd_combine.cu", "flash_prepare_scheduler.cu", "flash_api.cpp",
            "flash_extension_min.cc"} <= set(files)
    defines = next(line for line in out if line.startswith("defines:")).split()[1:]
    for off in ("BACKWARD", "FP8", "FP16", "HDIM256", "SOFTCAP", "LOCAL"):
        assert f"-DFLASHATTENTION_DISABLE_{off}" in defines
    ext = [line for line in out if line.endswith("flash_extension_min.cc")][0]
    assert Path(ext).is_file()  # the registration is beside the script


def test_the_registration_declares_the_ops_sgl_kernels_wrapper_calls():
    """The schemas registered under ``sgl_kernel``: ``fwd`` ends in the three arguments 0.4.5's
    wrapper passes last, ``get_scheduler_metadata`` exists; both have a CUDA implementation."""
    import re

    src = (SCRIPT.parent / "flash_extension_min.cc").read_text()
    assert "TORCH_LIBRARY_FRAGMENT(sgl_kernel, m)" in src
    defs = ["".join(re.findall(r'"([^"]*)"', m.group(1))) for m in re.finditer(r"m\.def\((.*?)\);", src, re.S)]
    schemas = {d.split("(", 1)[0]: d.split("(", 1)[1] for d in defs}
    assert set(schemas) == {"fwd", "get_scheduler_metadata"}
    fwd_args = [a.strip() for a in schemas["fwd"].split("->")[0].strip().rstrip(")").split(",")]
    assert [a.split()[-1] for a in fwd_args[-3:]] == ["sinks=None", "sparse_mask_fine=None", "only_qv=False"]
    for op in schemas:
        assert f'm.impl("{op}", torch::kCUDA' in src
