"""bench_extend.py (GPU-only) imports on CPU and its cases are well formed, so a device call is
never lost to a typo in the script."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_extend_imports_and_cases_are_valid():
    spec = importlib.util.spec_from_file_location("bench_extend", ROOT / "benchmark" / "kernels" / "bench_extend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.HQ % mod.HKV == 0
    for prefix, agents, new in mod.CASES:
        assert prefix > 0 and agents > 0 and new > 0
    assert (16384, 64, 256) in mod.CASES  # the end-to-end row it is meant to explain


def test_bench_extend_has_decode_cases_for_the_split_variants():
    spec = importlib.util.spec_from_file_location("bench_extend", ROOT / "benchmark" / "kernels" / "bench_extend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    few = [c for c in mod.CASES if c[1] * c[2] <= mod.FEW_TOKENS]
    assert few and all(new == 1 for _, _, new in few)  # decode-shaped cases get the split variants
    assert all(s >= 2 for s in mod.SPLITS)
