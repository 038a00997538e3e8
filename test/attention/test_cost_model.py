"""Cost model: JSON loading and validation, workload accounting, estimate sanity (CPU)."""

import dataclasses
import json
import math
import os

import pytest

from granikv.attention.cost import cost_model as cm_mod
from granikv.attention.cost.cost_model import (
    CostModel,
    HeadGeometry,
    Workload,
    gpu_slug,
)

LLAMA = HeadGeometry(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)


def default_model() -> CostModel:
    return CostModel.load(None, None)


def write(tmp_path, values, name="cm.json"):
    path = tmp_path / name
    path.write_text(values if isinstance(values, str) else json.dumps(values))
    return str(path)


def valid_mapping():
    return default_model().to_mapping("Test GPU")


def test_default_file_loads_and_is_checked_in():
    model = default_model()
    assert all(getattr(model, n) > 0 for n in CostModel.coefficient_names())
    assert os.path.exists(cm_mod.default_path(None))
    # An unknown GPU falls back to the default file.
    assert CostModel.load(None, "Imaginary GPU 9000") == model
    assert cm_mod.default_path("Imaginary GPU 9000") == cm_mod.default_path(None)


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert cm_mod.calibrated_path("NVIDIA H200").endswith("data/cost_model_nvidia-h200.json")


def test_round_trip_and_explicit_path(tmp_path):
    values = valid_mapping()
    values["coefficients"]["plan_us"] = 12.5
    values["calibration"] = {"anything": [1, 2]}
    model = CostModel.load(write(tmp_path, values), "ignored when a path is given")
    assert model.plan_us == 12.5
    assert CostModel.from_mapping(model.to_mapping("x")) == model


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda v: v["coefficients"].pop("prefix_gbps"), "coefficients.prefix_gbps"),
        (lambda v: v["coefficients"].update(prefix_gpbs=1.0), "coefficients.prefix_gpbs"),
        (lambda v: v["coefficients"].update(launch_us=-3), "coefficients.launch_us"),
        (lambda v: v["coefficients"].update(launch_us=0), "coefficients.launch_us"),
        (lambda v: v["coefficients"].update(suffix_gbps="fast"), "coefficients.suffix_gbps"),
        (lambda v: v["coefficients"].update(suffix_gbps=True), "coefficients.suffix_gbps"),
        (lambda v: v["coefficients"].update(bgemm_tflops=None), "coefficients.bgemm_tflops"),
        (lambda v: v.update(format=2), "'format'"),
        (lambda v: v.pop("coefficients"), "'coefficients'"),
    ],
)
def test_invalid_fields_name_the_file_and_the_field(tmp_path, mutate, field):
    values = valid_mapping()
    mutate(values)
    path = write(tmp_path, values)
    with pytest.raises(ValueError) as e:
        CostModel.load(path, None)
    assert path in str(e.value) and field in str(e.value)


def test_non_finite_values_are_rejected(tmp_path):
    values = valid_mapping()
    values["coefficients"]["plan_us"] = float("nan")
    path = write(tmp_path, json.dumps(values))  # json writes the non-standard token NaN
    with pytest.raises(ValueError, match="coefficients.plan_us.*positive finite"):
        CostModel.load(path, None)


def test_unreadable_and_malformed_files(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="nope.json: cannot read"):
        CostModel.load(missing, None)
    bad = write(tmp_path, "{not json", "bad.json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        CostModel.load(bad, None)
    arr = write(tmp_path, "[1, 2]", "arr.json")
    with pytest.raises(ValueError, match="arr.json: expected a JSON object"):
        CostModel.load(arr, None)


def test_workload_accounting_by_hand():
    # 3 requests: two share a 100-token prefix, seq_lens 130 / 120 / 50 (third ungrouped).
    w = Workload.from_sums(
        LLAMA, batch_size=3, seq_tokens=300, prefix_tokens=100,
        stacked_prefix_tokens=200, num_grouped=2, num_groups=1,
    )  # fmt: skip
    bpt = 2 * 8 * 128 * 2
    assert w.seq_bytes == 300 * bpt
    assert w.prefix_bytes == 100 * bpt
    assert w.reread_bytes == 100 * bpt  # the second member re-reads the prefix
    assert w.suffix_bytes == 100 * bpt  # 30 + 20 + 50
    assert w.prefix_flops == 200 * 4 * 32 * 128
    assert w.state_bytes == (2 + 3) * 2 * 4 * 32 * 129 + 3 * 32 * 128 * 2
    assert w.num_groups == 1


def one_group(n, prefix, suffix=256):
    return Workload.from_sums(
        LLAMA, batch_size=n, seq_tokens=n * (prefix + suffix), prefix_tokens=prefix,
        stacked_prefix_tokens=n * prefix, num_grouped=n, num_groups=1,
    )  # fmt: skip


def test_estimates_grow_with_work_and_layers():
    model = default_model()
    for fn in (model.paged_time, model.cascade_time, model.fused_time, model.bgemm_time):
        assert fn(one_group(64, 16384)) > fn(one_group(32, 16384)) > 0
        assert fn(one_group(64, 16384)) > fn(one_group(64, 4096))
        one, many = fn(one_group(8, 4096)), fn(one_group(8, 4096), num_layers=32)
        assert many > one and math.isfinite(many)
    # Planning is charged once per step, the kernels once per layer.
    w = one_group(8, 4096)
    assert model.cascade_time(w, num_layers=2) - 2 * model.cascade_time(w) == pytest.approx(
        -model.plan_us
    )
    assert model.paged_time(w, num_layers=2) == pytest.approx(2 * model.paged_time(w))


def test_default_model_matches_the_design_anchors():
    """The conservative default reproduces the orderings measured on one H200 (FlashInfer's
    cascade vs its paged decode, docs/results/kernels.md key points): at 16K x 64 a cascade is
    several times faster than paged; at 4K x 8 paged wins."""
    model = default_model()
    big = one_group(64, 16384)
    assert model.paged_time(big) > 1.5 * model.cascade_time(big)
    small = one_group(8, 4096)
    assert model.paged_time(small, num_layers=32) < model.cascade_time(small, num_layers=32)


# ---- calibration fit ---------------------------------------------------------------------------

PATHS = ("paged", "cascade", "fused", "bgemm")


def sample_workloads():
    out = []
    for prefix in (1024, 4096, 16384):
        for n in (2, 8, 32, 128):
            for suffix in (64, 1024):
                out.append(one_group(n, prefix, suffix))
    for sizes in ((1, 2, 5), (3,) * 16, (8, 16, 24, 16)):
        lens = [16384 >> k % 4 for k in range(len(sizes))]
        stacked = sum(n * p for n, p in zip(sizes, lens))
        bs = sum(sizes) + 5
        out.append(Workload.from_sums(
            LLAMA, batch_size=bs, seq_tokens=stacked + bs * 256 + 5 * 2048,
            prefix_tokens=sum(lens), stacked_prefix_tokens=stacked,
            num_grouped=sum(sizes), num_groups=len(sizes),
        ))  # fmt: skip
    return out


def test_features_mirror_the_time_methods():
    model = default_model()
    u = model.unknowns()
    for w in sample_workloads():
        for path in PATHS:
            row = CostModel.features(path, w)
            direct = getattr(model, f"{path}_time")(w)
            plan = 0.0 if path == "paged" else model.plan_us
            assert sum(f * x for f, x in zip(row, u)) + plan == pytest.approx(direct, rel=1e-12)


def test_fit_recovers_a_known_model():
    truth = dataclasses.replace(
        default_model(), paged_gbps=4300.0, paged_reuse_gbps=8100.0, launch_us=3.5,
        prefix_tflops=180.0, fused_tflops=95.0, bgemm_tflops=410.0, suffix_gbps=3100.0,
    )  # fmt: skip
    samples = [
        (p, w, getattr(truth, f"{p}_time")(w) - (0.0 if p == "paged" else truth.plan_us))
        for w in sample_workloads()
        for p in PATHS
    ]
    fitted, rel_err = CostModel.fit(samples, plan_us=truth.plan_us, fallback=default_model())
    assert abs(rel_err).max() < 1e-6
    for name in CostModel.coefficient_names():
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4), name


def test_fit_takes_the_cascades_shared_terms_from_its_own_samples():
    """The cascade's bandwidths come from its own samples: fused and bgemm samples measured far
    slower than the model that made the cascade's do not move them (a joint fit would split
    the difference), and only their own throughputs absorb it."""
    truth = dataclasses.replace(default_model(), prefix_gbps=2900.0, suffix_gbps=2600.0)
    slow = dataclasses.replace(truth, prefix_gbps=1200.0, suffix_gbps=1100.0)
    samples = [(p, w, getattr(truth if p in ("paged", "cascade") else slow, f"{p}_time")(w)
                - (0.0 if p == "paged" else truth.plan_us))
               for w in sample_workloads() for p in PATHS]  # fmt: skip
    fitted, rel_err = CostModel.fit(samples, plan_us=truth.plan_us, fallback=default_model())
    assert fitted.prefix_gbps == pytest.approx(2900.0, rel=1e-4)
    assert fitted.suffix_gbps == pytest.approx(2600.0, rel=1e-4)
    for (p, w, t), e in zip(samples, rel_err):
        if p == "cascade":
            assert abs(e) < 1e-6


def test_fit_keeps_fallback_for_unmeasured_paths():
    samples = [("paged", w, default_model().paged_time(w) * 1.1) for w in sample_workloads()]
    fallback = default_model()
    fitted, _ = CostModel.fit(samples, plan_us=5.0, fallback=fallback)
    assert fitted.plan_us == 5.0
    assert fitted.bgemm_tflops == fallback.bgemm_tflops and fitted.launch_us == fallback.launch_us
    assert fitted.paged_gbps == pytest.approx(fallback.paged_gbps / 1.1, rel=1e-6)


def test_nnls_clamps_negative_solutions():
    import numpy as np

    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = cm_mod.nnls(a, np.array([2.0, -1.0, 1.0]))
    assert (x >= 0).all() and x[1] == 0.0
    assert x[0] == pytest.approx(1.5)


def test_disabled_paths_come_from_measurements_and_are_never_picked(tmp_path):
    from granikv.attention.cost.cost_model import never_fastest

    cases = [{"paged": 10.0, "cascade": 12.0, "fused": 11.0},
             {"paged": 50.0, "cascade": 9.0, "fused": 10.0}]
    assert never_fastest(cases) == ("fused", "bgemm")
    doc = default_model().to_mapping("GPU", )
    doc["disabled_paths"] = ["cascade", "fused", "bgemm"]
    model = CostModel.from_mapping(doc, source="x.json")
    assert model.disabled_paths == ("cascade", "fused", "bgemm")
    doc["disabled_paths"] = ["paged"]
    with pytest.raises(ValueError, match="x.json: field 'disabled_paths'"):
        CostModel.from_mapping(doc, source="x.json")


# ---- served-step terms --------------------------------------------------------------------------


def test_step_time_adds_the_inner_call_and_eager_launches():
    model = default_model()
    w = one_group(64, 16384)
    assert model.step_time("paged", w, num_layers=32) == model.paged_time(w, num_layers=32)
    inner = model.paged_launch_us + w.batch_bytes / (model.paged_gbps * 1e3)
    assert w.batch_bytes == 64 * LLAMA.kv_bytes_per_token
    graph = model.step_time("cascade", w, num_layers=32)
    # the kernels, the inner call, the launch floors; the served host planning term replaces plan_us
    floors = 32 * 3 * model.served.launch_floor_us
    assert graph == pytest.approx(model.cascade_time(w, num_layers=32) - model.plan_us + 32 * inner + floors
                                  + model.served.host_plan_us)
    eager = model.step_time("cascade", w, num_layers=32, eager=True)
    assert eager - graph == pytest.approx(32 * 3 * model.served.eager_launch_us)
    measured = model.step_time("cascade", w, num_layers=32, host_plan_us=40.0)
    assert graph - measured == pytest.approx(model.served.host_plan_us - 40.0)
    assert model.step_time("paged", w, num_layers=32, host_plan_us=1e6) == model.paged_time(w, num_layers=32)


def test_checked_in_h200_file_has_per_backend_paged_coefficients():
    h200 = CostModel.load(None, "NVIDIA H200")
    assert set(h200.served.paged_by_backend) >= {"flashinfer", "triton"}
    tri = h200.for_backend("triton")
    assert tri.paged_launch_us == h200.served.paged_by_backend["triton"]["paged_launch_us"] != h200.paged_launch_us
    assert h200.for_backend("flashinfer").paged_gbps == h200.paged_gbps
    fa3 = h200.for_backend("fa3")  # no own decode coefficients: the calibrated ones; its own prefill rate
    assert (fa3.paged_launch_us, fa3.paged_gbps) == (h200.paged_launch_us, h200.paged_gbps)
    assert fa3.served.extend.paged_tflops == h200.served.extend_stock_by_backend["fa3"]["paged_tflops"]
    assert fa3.served.extend.paged_tflops != h200.served.extend.paged_tflops
    w = one_group(64, 16384)
    assert tri.paged_time(w) != h200.paged_time(w)


def test_served_terms_round_trip_and_validation(tmp_path):
    m = valid_mapping()
    m["served"]["paged_by_backend"]["triton"] = {"paged_launch_us": 40.0, "paged_gbps": 3000.0,
                                                 "paged_reuse_gbps": 5000.0}
    m["served"]["extend"]["dense_tflops"] = 600.0
    loaded = CostModel.load(write(tmp_path, m))
    assert loaded.served.paged_by_backend["triton"]["paged_launch_us"] == 40.0
    assert loaded.served.extend.dense_tflops == 600.0
    old = valid_mapping()
    del old["served"]  # files written before the served terms still load, with the defaults
    assert CostModel.load(write(tmp_path, old, "old.json")).served == cm_mod.ServedTerms()
    for bad, field in ((dict(m["served"], eager_launch_us=-1), "served.eager_launch_us"),
                       (dict(m["served"], paged_by_backend={"triton": {"paged_gbps": 1.0}}),
                        "served.paged_by_backend.triton"),
                       (dict(m["served"], extend={"warp_speed": 1.0}), "served.extend"),
                       (dict(m["served"], bogus=1), "served.bogus")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            CostModel.load(write(tmp_path, dict(m, served=bad), "bad.json"))


def test_a_backends_own_stock_prefill_terms_round_trip_and_apply_under_it(tmp_path):
    """served.extend_stock_by_backend: fa3's own stock prefill rate replaces flashinfer's in the
    extend gate's terms under fa3 only (CostModel.for_backend); bad entries name their field."""
    m = valid_mapping()
    m["served"]["extend_stock_by_backend"] = {"fa3": {"paged_tflops": 500.0}}
    loaded = CostModel.load(write(tmp_path, m))
    assert loaded.served.to_mapping()["extend_stock_by_backend"] == {"fa3": {"paged_tflops": 500.0}}
    fa3, fi = loaded.for_backend("fa3"), loaded.for_backend("flashinfer")
    assert fa3.served.extend.paged_tflops == 500.0 and fa3.served.extend.dense_tflops == loaded.served.extend.dense_tflops
    assert fi.served.extend == loaded.served.extend and loaded.for_backend("triton").served.extend == loaded.served.extend
    big = 4 * 32 * 128 * 16384 * (64 * 256)
    assert fa3.served.extend.stock_us(big) < fi.served.extend.stock_us(big)  # a faster stock prefill
    assert "extend_stock_by_backend" not in valid_mapping()["served"]  # files without it: unchanged
    for bad in ({"fa3": {"dense_tflops": 1.0}}, {"fa3": {}}, {"fa3": {"paged_tflops": -2.0}}):
        with pytest.raises(ValueError, match=r"served\.extend_stock_by_backend\.fa3"):
            CostModel.load(write(tmp_path, dict(m, served=dict(m["served"], extend_stock_by_backend=bad)), "b.json"))


def test_full_extend_charges_the_causal_call_and_its_merge():
    """A backend whose stock extend is one call (triton, fa3): GraniKV's whole extend adds one
    dense causal call and one merge; the causal FLOPs count on both sides at their rates."""
    t = cm_mod.ExtendTerms()
    hot, causal = 1e9, 2e8
    extra = t.hot_full_us(2, hot, None, causal) - t.hot_us(2, hot, None)
    assert extra == pytest.approx(t.dense_call_us + t.merge_us + causal / (t.dense_tflops * 1e6))
    assert t.stock_full_us(hot, causal) == pytest.approx(t.stock_us(hot + causal))
    # a prefix part that pays by less than the extra call and merge no longer pays in full
    flops = (t.dense_call_us + 0.5 * (t.dense_call_us + t.merge_us)) / (1 / (t.paged_tflops * 1e6) - 1 / (t.dense_tflops * 1e6))
    assert t.hot_us(1, flops, None) < t.stock_us(flops) and t.hot_full_us(1, flops, None, 0.0) > t.stock_full_us(flops, 0.0)


def test_extend_terms_price_dense_calls_per_group():
    t = cm_mod.ExtendTerms()
    big = 4 * 32 * 128 * 16384 * (64 * 256)  # 16K prefix x 64 agents x 256 new tokens
    assert t.hot_us(1, big, None) < t.stock_us(big) / 1.5  # measured 1.8x on the H200
    small = 4 * 32 * 128 * 1100 * 3 * 64  # 1.1K prefix, 3 sharers, 64 new tokens, 8 groups
    assert t.hot_us(8, small, small * 0.1) > t.stock_us(small * 1.1)
