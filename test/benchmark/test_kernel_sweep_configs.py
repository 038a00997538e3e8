"""Every tuning variant that bench_attention.py --sweep will run on the GPU host is a valid
KernelConfig and plans the sweep's cases (CPU), so a device call is never lost to a typo."""

import dataclasses

import numpy as np
import pytest
from bench_scripts import load  # noqa: E402  (test/benchmark, on the path)

from granikv.attention.decode.work_list import default_config
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.plan import Grouping

bench = load("kernels", "bench_attention.py")


@pytest.mark.parametrize("name", list(bench.SWEEP))
def test_sweep_variant_plans_every_case(name):
    cfg = dataclasses.replace(default_config(bench.D), **bench.SWEEP[name])
    for groups, sfx in bench.SWEEP_CASES:
        n_req = sum(n for _, n in groups)
        ws = CascadeWorkspace(max(n_req, 8), bench.HQ, bench.HKV, bench.D, "cpu", config=cfg, sm_count=132)
        starts = 1 + np.cumsum([0] + [lp for lp, _ in groups[:-1]])
        prefix_len = np.repeat([lp for lp, _ in groups], [n for _, n in groups])
        grouping = Grouping.of(starts, [lp for lp, _ in groups], np.cumsum([0] + [n for _, n in groups]),
                               np.arange(n_req), prefix_len)
        wl = ws.fill(grouping, prefix_len + sfx, np.arange(n_req) + 1)
        ws.check_integrity()
        assert wl.num_prefix_items > 0 and wl.num_suffix_items >= n_req


@pytest.mark.parametrize("shape", list(bench.SHAPES))
def test_every_shape_plans_the_forest_cases(shape):
    """--shape NAME: the config GraniKV picks for those heads plans the forest sweep cases."""
    bench.set_shape(shape)
    try:
        for groups, sfx in (bench.FOREST_16, 256), (bench.FOREST_64, 256):
            n_req = sum(n for _, n in groups)
            ws = CascadeWorkspace(max(n_req, 8), bench.HQ, bench.HKV, bench.D, "cpu", config=bench.base_config(),
                                  sm_count=132)
            starts = 1 + np.cumsum([0] + [lp for lp, _ in groups[:-1]])
            prefix_len = np.repeat([lp for lp, _ in groups], [n for _, n in groups])
            grouping = Grouping.of(starts, [lp for lp, _ in groups], np.cumsum([0] + [n for _, n in groups]),
                                   np.arange(n_req), prefix_len)
            ws.fill(grouping, prefix_len + sfx, np.arange(n_req) + 1)
            ws.check_integrity()
    finally:
        bench.set_shape("llama-3.1-8b")


def test_sweep_selection_restricts_variants_and_cases():
    names, cases = bench.sweep_selection("bm128_w8,default", "0,5")
    assert names == ["default", "bm128_w8"]
    assert cases == [bench.SWEEP_CASES[0], bench.SWEEP_CASES[5]]
    assert bench.sweep_selection("", "") == (list(bench.SWEEP), bench.SWEEP_CASES)


def test_prefix_flops_counts_both_products():
    bench.set_shape("gpt-oss-20b")
    try:  # 64 q-heads x 64 requests x 16K keys x head_dim 64, QK^T and PV: 17.2 GFLOP
        assert bench.prefix_flops([(16384, 64)]) == 4 * 64 * 64 * 16384 * 64
        # its K/V: 16K keys x 8 kv heads x 64 x 2 tensors x 2 bytes (bf16), read once however many share it
        assert bench.prefix_kv_bytes([(16384, 64)]) == bench.prefix_kv_bytes([(16384, 1)]) == 16384 * 8 * 64 * 2 * 2
    finally:
        bench.set_shape("llama-3.1-8b")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_sweep_runs_its_kernel_calls_on_cpu(monkeypatch, tmp_path, kv_dtype):
    """The sweep's own calls (cascade, prefix, suffix, merge on a filled workspace) run under the
    Triton interpreter on a tiny case, so a launcher signature the sweep calls wrongly fails here,
    not on the GPU host; every timed call is made once (the timer replaced)."""
    import json
    import types

    import torch

    mod = load("kernels", "bench_attention.py")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "DT", torch.float16)
    monkeypatch.setattr(mod, "SWEEP_CASES", [([(40, 3)], 6)])
    monkeypatch.setattr(mod, "bench", lambda fn: (fn(), (1e-3, "eager"))[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    mod.set_shape("gqa3-d64")  # small heads: 24 q / 8 kv of 64
    mod.HQ, mod.HKV, mod.D, mod.SCALE = 6, 2, 16, 0.25
    monkeypatch.setattr(mod, "KV_DT", None)
    mod.set_kv_dtype(kv_dtype)
    seen = {}  # the scales each kernel call got: an FP8 sweep must pass the case's, not 1.0

    def recording(name, fn):
        def call(*a, **kw):
            seen.setdefault(name, set()).add((kw.get("k_scale", 1.0), kw.get("v_scale", 1.0)))
            return fn(*a, **kw)
        return call

    for name in ("cascade_attention", "prefix_attention", "suffix_attention", "merge_state"):
        monkeypatch.setattr(mod, name, recording(name, getattr(mod, name)))
    cases = []

    class RecordedCase(mod.Case):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            cases.append(self)

    monkeypatch.setattr(mod, "Case", RecordedCase)
    args = types.SimpleNamespace(variants="bm32,descriptor", sweep_cases="", max_bs=0, out=str(tmp_path))
    mod.sweep(args)
    (case,) = cases
    ks, vs = case.k_scale, case.v_scale
    assert (ks != 1.0 and vs != 1.0) == (kv_dtype != "bf16")
    assert seen == {"cascade_attention": {(ks, vs)}, "prefix_attention": {(ks, 1.0)},
                    "suffix_attention": {(ks, 1.0)}, "merge_state": {(1.0, vs)}}
    doc = json.loads((tmp_path / "kernels_sweep.json").read_text())
    rows = doc["rows"]
    assert [r["config"] for r in rows] == ["default", "bm32", "descriptor"]
    want = {"bf16": "float16", "fp8_e4m3": "float8_e4m3fn"}[kv_dtype]  # DT is fp16 here
    assert doc["kv_dtype"] == want and all(r["kv_dtype"] == want for r in rows)
    for r in rows:
        assert "error" not in r, r
        assert r["maxdiff"] <= 2e-3 and r["prefix_tflops"] >= 0
        item = {"bf16": 2, "fp8_e4m3": 1}[kv_dtype]  # bytes per K/V element as stored
        assert mod.prefix_kv_bytes(r["groups"]) == sum(2 * lp * mod.HKV * mod.D * item for lp, _ in r["groups"])
        assert r["prefix_tbs"] == round(mod.prefix_kv_bytes(r["groups"]) / (r["prefix_us"] * 1e-6) / 1e12, 2)
        assert r["prefix_rows_per_kv_head"] == max(n for _, n in r["groups"]) * (mod.HQ // mod.HKV)
