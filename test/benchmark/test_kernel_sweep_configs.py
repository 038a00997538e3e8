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


def test_matrix_covers_every_gqa_shape_and_head_dim():
    """--matrix: GQA 1 / 3 / 4 / 7 / 8 at head_dim 128 and 64, 4K-32K prefixes, 16-256 sharers
    (200 points, one shape's points together); the prefix launch reported in TB/s at 128 query
    rows per kv head or fewer, else in TFLOP/s; every shape's config plans its largest point."""
    shapes = {(bench.SHAPES[n][0] // bench.SHAPES[n][1], bench.SHAPES[n][2]) for n in bench.MATRIX_SHAPES}
    assert shapes == {(g, d) for g in (1, 3, 4, 7, 8) for d in (64, 128)}
    points = list(bench.matrix_points())
    assert len(points) == 200 and [p[0] for p in points[:20]] == [bench.MATRIX_SHAPES[0]] * 20
    assert bench.prefix_rate(128, 2e9, 1e9, 1000.0) == ("TB/s", 1.0)
    assert bench.prefix_rate(129, 2e9, 1e9, 1000.0) == ("TFLOP/s", 2.0)
    with pytest.raises(ValueError, match="--matrix shape nope"):
        list(bench.matrix_points(shapes=("nope",)))
    for name in bench.MATRIX_SHAPES:
        bench.set_shape(name)
        try:
            lp, n = max(bench.MATRIX_PREFIXES), max(bench.MATRIX_SHARERS)
            ws = CascadeWorkspace(n, bench.HQ, bench.HKV, bench.D, "cpu", config=bench.base_config(), sm_count=132)
            grouping = Grouping.of([1], [lp], [0, n], np.arange(n), np.full(n, lp))
            ws.fill(grouping, np.full(n, lp + bench.MATRIX_SUFFIX), np.arange(n) + 1)
            ws.check_integrity()
        finally:
            bench.set_shape("llama-3.1-8b")


def test_matrix_runs_its_kernel_calls_on_cpu(monkeypatch, tmp_path):
    """The matrix's GraniKV calls (prefix launch, cascade layer) run under the Triton interpreter
    on tiny points and write one JSON row per point; a library baseline that cannot run is an
    error field of its row, never a lost point."""
    import json
    import types

    import torch

    mod = load("kernels", "bench_attention.py")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "DT", torch.float16)
    monkeypatch.setattr(mod, "bench", lambda fn, graph=True: (fn(), (1e-3, "eager"))[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setitem(mod.SHAPES, "tiny-gqa3", (6, 2, 16))
    monkeypatch.setitem(mod.SHAPES, "tiny-mha", (2, 2, 16))
    monkeypatch.setattr(mod, "MATRIX_PREFIXES", (40,))
    monkeypatch.setattr(mod, "MATRIX_SHARERS", (3, 50))
    monkeypatch.setattr(mod, "MATRIX_SUFFIX", 5)
    monkeypatch.setattr(mod, "matrix_points",
                        lambda shapes: ((s, lp, n) for s in shapes for lp in mod.MATRIX_PREFIXES for n in mod.MATRIX_SHARERS))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(16, dtype=torch.uint8)
                        if a and a[0] == 512 << 20 else real_empty(*a, **kw))
    with pytest.raises(SystemExit, match="not in SWEEP"):
        mod.matrix(types.SimpleNamespace(matrix_shapes="tiny-mha", matrix_variants="pw9", max_bs=0, out=str(tmp_path),
                                         matrix_suffixes="5", matrix_skip_baselines=False))
    mod.matrix(types.SimpleNamespace(matrix_shapes="tiny-gqa3,tiny-mha", matrix_variants="pw1.0,pw2.0", max_bs=0,
                                     matrix_suffixes="5", matrix_skip_baselines=False, out=str(tmp_path)))
    doc = json.loads((tmp_path / "kernels_matrix.json").read_text())
    rows = doc["rows"]
    assert [(r["shape"], r["sharers"]) for r in rows] == [("tiny-gqa3", 3), ("tiny-gqa3", 50), ("tiny-mha", 3),
                                                          ("tiny-mha", 50)]
    for r in rows:
        assert "gkv_error" not in r, r.get("gkv_error")
        assert r["gkv_prefix_us"] == r["gkv_cascade_us"] == r["read_bound_us"] == 1.0
        assert r["variant_cascade_us"] == {"pw1.0": 1.0, "pw2.0": 1.0}
        assert r["variant_prefix_waves"] == {"pw1.0": 1.0, "pw2.0": 2.0}
        assert r["prefix_unit"] == ("TFLOP/s" if r["rows_per_kv_head"] > 128 else "TB/s")
        assert "flashinfer_error" in r or "fi_cascade_fa2_us" in r or "fi_cascade_fa2_error" in r
    try:  # the plot is drawn from the JSON wherever matplotlib imports (--plot-matrix alone too)
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "kernels_matrix.png").stat().st_size > 0
    (tmp_path / "kernels_matrix.png").unlink()
    assert mod.plot_matrix(str(tmp_path / "kernels_matrix.json"), str(tmp_path)) == str(tmp_path / "kernels_matrix.png")
    assert (tmp_path / "kernels_matrix.png").stat().st_size > 0
