"""A fresh copy of a benchmark module, for the tests here that change its module state (e.g.
bench_attention.set_shape); others import ``benchmark.…`` directly."""

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
