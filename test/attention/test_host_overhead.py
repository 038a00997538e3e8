"""The end-to-end rule of the dispatcher (CPU): a GraniKV path only where the layers' kernel
saving pays the per-step host planning term and the per-layer launch floors.

Geometry: the real model shapes of benchmark/multi_agent/configs (Llama-3.1-8B, and its 4-layer
cut whose decode step is host-bound) and 64-request batches as the multi-agent benchmark
builds them, on the checked-in H200 cost model."""

import dataclasses
import json
import math

import pytest

from benchmark.harness.model_config import CONFIG_DIR as CONFIGS
from benchmark.multi_agent.workloads import HETEROGENEOUS_PREFIXES, HETEROGENEOUS_WEIGHTS, split_agents
from granikv.attention.cost.cost_model import CostModel
from granikv.attention.dispatcher import HOST_OVERHEAD, Dispatcher, HostPlanTime, Path, SteadyChooser
from granikv.attention.promotion_estimate import PromotionEstimate
from granikv.attention.step_stats import StepStats
from test_dispatcher import batch

SHORT, FULL = "llama-3.1-8b-4layers", "llama-3.1-8b"

# 64 requests: workloads.heterogeneous(64) (8 prefixes 2K-16K, the short ones with more agents)
HETEROGENEOUS_64 = list(zip(HETEROGENEOUS_PREFIXES, split_agents(64, HETEROGENEOUS_WEIGHTS)))
# 64 requests: the regime grid's forest16 prefixes (16 of 1.5-6K, regime_grid._forest16), 4 agents each
FOREST_64 = [(1536 + round(i * (6144 - 1536) / 15), 4) for i in range(16)]
HOMOGENEOUS_16K_64 = [(16384, 64)]


def model_dispatcher(name: str, model: CostModel = None) -> Dispatcher:
    """The dispatcher of a benchmark model config on one GPU (bf16 KV), H200 cost model."""
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return Dispatcher(model or CostModel.load(None, "NVIDIA H200"), num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=cfg.get("head_dim", cfg["hidden_size"] // hq), kv_dtype_bytes=2,
                      num_layers=cfg["num_hidden_layers"])


def test_the_configs_differ_only_in_layers():
    short, full = model_dispatcher(SHORT), model_dispatcher(FULL)
    assert (short.num_layers, full.num_layers) == (4, 32)
    assert short.geometry == full.geometry
    assert sum(n for _, n in HETEROGENEOUS_64) == sum(n for _, n in FOREST_64) == 64


def assert_short_model_paged_full_model_cascade(short: Dispatcher, full: Dispatcher, groups) -> None:
    """The 4-layer model stays paged for the host term; the 32-layer one takes cascade."""
    args = batch(groups)
    d = short.choose(*args)
    assert d.path is Path.PAGED, d.reason
    assert d.host_bound and HOST_OVERHEAD in d.reason, d.reason
    assert full.choose(*args).path is Path.CASCADE


def test_forest_is_paged_on_the_4_layer_model_and_cascade_on_32_layers():
    assert_short_model_paged_full_model_cascade(model_dispatcher(SHORT), model_dispatcher(FULL), FOREST_64)


def test_without_the_host_term_the_4_layer_forest_would_run_cascade():
    """Planted fault: the host planning term zeroed. The kernels (with their launch floors) do
    save on the 4-layer forest, so the check above must fail."""
    zero = dataclasses.replace(CostModel.load(None, "NVIDIA H200"), served=dataclasses.replace(
        CostModel.load(None, "NVIDIA H200").served, host_plan_us=0.0))
    short = model_dispatcher(SHORT, zero)
    assert short.choose(*batch(FOREST_64)).path is Path.CASCADE
    with pytest.raises(AssertionError):
        assert_short_model_paged_full_model_cascade(short, model_dispatcher(FULL, zero), FOREST_64)


def test_heterogeneous_and_homogeneous_16k_are_cascade_on_32_layers():
    full = model_dispatcher(FULL)
    for groups in (HETEROGENEOUS_64, HOMOGENEOUS_16K_64):
        d = full.choose(*batch(groups))
        assert d.path is Path.CASCADE and not d.host_bound, (groups, d.reason)


def test_the_rule_is_kernel_saving_against_host_plus_launch_floors():
    """paged - cascade = layers * kernel saving - host_plan - layers * 3 * launch_floor_us."""
    for name in (SHORT, FULL):
        d = model_dispatcher(name)
        cm, n = d.cost_model, d.num_layers
        for groups in (HETEROGENEOUS_64, FOREST_64, HOMOGENEOUS_16K_64):
            g, desc = batch(groups)
            w = d.workload(g, desc)
            t = d.estimate(g, desc)
            kernel_saving = cm.paged_time(w, num_layers=n) - (
                cm.cascade_time(w, num_layers=n) - cm.plan_us + n * cm.served_layer_us("cascade", w)
                - n * 3 * cm.served.launch_floor_us)
            overheads = cm.served.host_plan_us + n * 3 * cm.served.launch_floor_us
            assert t.paged - t.cascade == pytest.approx(kernel_saving - overheads)
            assert d.floors[1] == n * 3 * cm.served.launch_floor_us


def test_a_larger_measured_planning_time_flips_a_marginal_case_to_paged():
    """The 4-layer heterogeneous batch saves more than the prior charges (cascade); the planner
    measuring its planning at 800 us per step moves the host term above that saving, and the
    next choice, by the dispatcher and by the O(1) steady chooser alike, is paged."""
    d = model_dispatcher(SHORT)
    chooser = SteadyChooser(d)
    g, desc = batch(HETEROGENEOUS_64)
    first = chooser.choose(g, desc)
    assert first.path is Path.CASCADE and d.host_plan.us == d.cost_model.served.host_plan_us
    margin = first.times.paged - first.times.cascade  # what the host term may still grow by
    assert 0 < margin < 800.0 - d.host_plan.us
    flipped_at = None
    for step in range(60):
        d.host_plan.observe(800e-6)  # what plan_step feeds after a step that planned cascade
        got, want = chooser.choose(g, desc), d.choose(g, desc)
        assert got.path is want.path and got.host_bound is want.host_bound
        assert got.times == pytest.approx(want.times, rel=1e-9)
        if got.path is Path.PAGED and flipped_at is None:
            flipped_at = step
            assert got.host_bound and HOST_OVERHEAD in got.reason
    assert flipped_at is not None and d.host_plan.us > first.times.paged - first.times.cascade + 250.0
    assert chooser.misses == 1  # fed without a refit
    # a cheaper measured planning time brings cascade back
    for _ in range(60):
        d.host_plan.observe(100e-6)
    assert chooser.choose(g, desc).path is Path.CASCADE


def test_host_plan_time_follows_measurements_and_caps_spikes():
    h = HostPlanTime(250.0)
    assert (h.us, h.samples) == (250.0, 0)
    h.observe(math.nan)
    h.observe(-1.0)
    assert (h.us, h.samples) == (250.0, 0)
    h.observe(1.0)  # a one-second stall counts as 2 x the current value
    assert h.us == pytest.approx(250.0 + HostPlanTime.ALPHA * 250.0) and h.samples == 1
    for _ in range(200):
        h.observe(120e-6)
    assert h.us == pytest.approx(120.0, rel=1e-6)
    with pytest.raises(ValueError, match="host planning prior -1.0 us"):
        HostPlanTime(-1.0)


def test_step_stats_count_host_overhead_steps():
    d = model_dispatcher(SHORT)
    stats = StepStats()
    g, desc = batch(FOREST_64)
    stats.record(d.choose(g, desc), g)
    g2, desc2 = batch(HOMOGENEOUS_16K_64)
    stats.record(d.choose(g2, desc2), g2)
    snap = stats.snapshot()
    assert snap["host_overhead_steps"] == 1 and snap["steps_per_path"] == {"paged": 1, "cascade": 1}


def test_exporter_publishes_host_overhead_steps():
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from granikv.prometheus import PrometheusExporter

    reg = CollectorRegistry()
    exp = PrometheusExporter({"tp_rank": "0"}, registry=reg)
    exp.update({"attention": {"host_overhead_steps": 5, "dispatch_host_us_mean": 180.5}})
    text = generate_latest(reg).decode()
    assert 'granikv:host_overhead_steps_total{tp_rank="0"} 5.0' in text
    assert 'granikv:dispatch_host_us{tp_rank="0"} 180.5' in text


def test_promotion_uses_the_same_net_saving():
    """A forest member on the 4-layer model saves nothing in its step (no step with it would
    pay the host term), on the 32-layer model it does; the prior prices it, not the per-rank
    measurement (TP ranks decide promotions alike)."""
    for name, pays in ((SHORT, False), (FULL, True)):
        d = model_dispatcher(name)
        est = PromotionEstimate(d, min_group_size=2)
        (p, s), others = FOREST_64[0], FOREST_64[1:]
        saving = est.saving_us(p, s, others)
        assert (saving > 0) is pays, (name, saving)
        d.host_plan.observe(10e-6)
        assert est.saving_us(p, s, others) == saving


def test_decode_planner_feeds_measured_planning_time(monkeypatch):
    """plan_step hands each step that planned a GraniKV path to the dispatcher's host term;
    server info reports it."""
    from test_backend import _backend, _batch, _runner

    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2, 3})
    prior = be.dispatcher.host_plan.us
    for step in range(3):
        if step:
            fb.seq_lens_cpu = fb.seq_lens_cpu + 1
            fb.seq_lens = fb.seq_lens_cpu.clone()
        be.stage_batch(rows, seconds=0.5)  # a slow staging: the step's planning time is >= 0.5 s
        be.init_forward_metadata(fb)
        assert be.decode.path is Path.CASCADE
    snap = be.stats_snapshot()
    assert snap["dispatch_host_samples"] == 3
    assert snap["dispatch_host_us_mean"] == be.dispatcher.host_plan.us > prior  # grew (capped at 2x per sample)
    be2 = _backend(_runner(), "paged")  # paged steps measure nothing
    fb2, rows2 = _batch(be2.model_runner, hot={0, 2, 3})
    be2.stage_batch(rows2, seconds=0.5)
    be2.init_forward_metadata(fb2)
    assert be2.stats_snapshot()["dispatch_host_samples"] == 0
