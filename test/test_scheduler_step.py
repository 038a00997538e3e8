"""scheduler_step.on_run_batch over the real pools + cache (scheduler_sim), fake scheduler."""

from types import SimpleNamespace

import numpy as np
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.extend.plan import plan_extend
from support.scheduler_sim import Sim, SimConfig
from granikv.scheduler_step import metrics_snapshot, on_run_batch

CFG = GraniKVConfig(enable=True, hot_min_tokens=16, debug_integrity=True, log_interval=1)


def _scheduler(sim):
    backend = object.__new__(GraniKVAttnBackend)  # only stage_batch / stats_snapshot are used here
    backend._staged = None
    from granikv.attention.decode.planner import DecodePlanner
    from granikv.attention.dispatcher import SteadyChooser
    from granikv.attention.grouping import GroupingMemo
    from granikv.attention.decode.step_clock import StepClock
    from granikv.attention.step_stats import StepStats

    backend.ctx = SimpleNamespace(stats=StepStats(),  # what stats_snapshot reads ...
                                  hot_prefix_table=sim.cache.hot_prefix_table)  # ... and plans_decode
    backend.decode = object.__new__(DecodePlanner)
    backend.decode.workspace = backend.decode.eager_workspace = None
    backend.decode.grouping_memo = GroupingMemo()
    backend.decode.chooser = SteadyChooser(None)
    backend.decode.clock = StepClock()
    backend.decode.ends_in_graph_steps = 0
    backend.decode.steady_replays = 0
    from granikv.attention.decode.view_memo import ViewPlanMemo

    backend.decode.view_memo = ViewPlanMemo()
    runner = SimpleNamespace(attn_backend=backend)
    return SimpleNamespace(tree_cache=sim.cache, token_to_kv_pool_allocator=sim.allocator,
                           tp_worker=SimpleNamespace(model_runner=runner),
                           enable_overlap=False), backend


def test_extend_batch_registers_then_promotes_in_the_same_step(caplog):
    sim = Sim(SimConfig(min_tokens=16))
    prefix = list(range(1, 33))
    sim.finish(sim.admit(prefix + [40]))  # the shared prefix is cached
    reqs = [sim.prefill_begin(prefix + [41 + i, 50]) for i in range(3)]
    sched, backend = _scheduler(sim)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs)
    on_run_batch(sched, batch, CFG)
    # registered first, so the three fresh locks count as sharers: promoted now, not next step
    assert sim.cache.metrics.promotions == 1
    for r in reqs:
        assert sim.cache.hot_prefix_table.get(r.req_pool_idx)[1] == len(prefix)
    # staged for the prefix part over HOT extents, after the promotion: the whole cached prefix
    # of every request is one HOT extent, so the extend batch is one dense call
    assert list(backend._staged) == [r.req_pool_idx for r in reqs]
    table = sim.cache.hot_prefix_table
    plan, reason = plan_extend(backend._staged, np.full(3, len(prefix)), np.full(3, 2), table.start_np,
                               table.length_np)
    assert reason == "" and len(plan.groups) == 1 and plan.covers_all_tokens
    backend._staged = None
    for r in reqs:
        sim.prefill_end(r)
        sim.decode(r, 7)
    with caplog.at_level("INFO", logger="granikv"):
        on_run_batch(sched, SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs), CFG)
    assert list(backend._staged) == [r.req_pool_idx for r in reqs]
    assert "promotions 1" in caplog.text  # metrics line at log_interval=1
    snap = metrics_snapshot(sched)
    assert snap["promotions"] == 1 and snap["hot_used_tokens"] >= len(prefix)
    sim.check()


def test_non_granikv_cache_is_left_alone():
    sched = SimpleNamespace(tree_cache=object())
    on_run_batch(sched, SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[]), CFG)
    assert metrics_snapshot(sched) == {}


def test_the_log_lines_snapshot_is_built_only_when_the_line_is_logged(caplog, monkeypatch):
    """``_report`` every ``log_interval`` decode steps: the attention snapshot (about 30 µs on the
    scheduler's step) only for a line the logger keeps."""
    import granikv.scheduler_step as step

    built = []
    monkeypatch.setattr(step._AttentionStats, "stats_snapshot", lambda self: built.append(1) or {})
    sim = Sim(SimConfig(min_tokens=16))
    sched, backend = _scheduler(sim)
    with caplog.at_level("WARNING", logger="granikv"):
        step._report(sched, sim.cache, [backend], log_interval=1)
    assert built == [] and "attention" not in caplog.text
    with caplog.at_level("INFO", logger="granikv"):
        step._report(sched, sim.cache, [backend], log_interval=1)
    assert built == [1] and "attention" in caplog.text


def test_a_decode_step_without_hot_runs_stages_nothing_and_clears_what_was_staged():
    """No request holds a HOT run: the decode step plans nothing (``DecodePlanner.plan_step``),
    so the hook reads no rows; a row list staged earlier and never taken is cleared, never left
    for a later step."""
    sim = Sim(SimConfig(min_tokens=16))
    reqs = [sim.prefill_begin(list(range(10 * i + 1, 10 * i + 9))) for i in range(3)]
    for r in reqs:
        sim.prefill_end(r)
        sim.decode(r, 2)
    sched, backend = _scheduler(sim)
    assert sim.cache.hot_prefix_table.rows_held == 0
    backend._staged = np.array([7, 8, 9])  # a stale staging
    on_run_batch(sched, SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs),
                 GraniKVConfig(enable=True, hot_min_tokens=16, log_interval=0))
    assert backend._staged is None and backend._stage_seconds == 0.0
    sim.check()
