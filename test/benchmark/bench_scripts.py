"""Loading a benchmark script (benchmark/... is not a package) as a module, for the tests here."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(*parts: str) -> ModuleType:
    """``load("kernels", "bench_extend.py")``: benchmark/kernels/bench_extend.py, executed once
    per call as a fresh module named after the file."""
    path = ROOT.joinpath("benchmark", *parts)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
