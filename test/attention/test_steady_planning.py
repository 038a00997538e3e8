"""The steady-step shortcuts of decode planning are exact: the O(1) path choice, the reused
plan while rows and HOT table are unchanged, the staged rows view, and the planning-time
percentiles (the partial upload of an advanced work list: test/kernels/test_work_list_reuse.py)."""

import copy
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from granikv.attention.dispatcher import Path, SteadyChooser
from granikv.attention.grouping import BatchDescription, GroupingMemo
from granikv.attention.step_stats import RecentTimes
from granikv.scheduler_step import batch_rows
from test_backend import ATOL, LAYER, RTOL, _backend, _batch, _expected, _qkv, _runner  # noqa: E402
from test_dispatcher import batch, make  # noqa: E402


@pytest.mark.parametrize("forced", ["auto", "cascade"])
@pytest.mark.parametrize("graph", [True, False])
def test_steady_chooser_matches_the_dispatcher_every_step(forced, graph):
    d = make(forced)
    chooser, memo = SteadyChooser(d), GroupingMemo()
    # a batch whose best path flips as the suffixes grow: short prefix, growing suffixes
    _, desc0 = batch([(2048, 6), (512, 3)], suffix=64, ungrouped=2)
    flips = set()
    for step in range(0, 40000, 997):
        desc = BatchDescription(desc0.req_pool_indices, desc0.seq_lens + step, desc0.hot_start, desc0.hot_len)
        g = memo.group(desc, min_group_size=2)
        got, want = chooser.choose(g, desc, graph_safe_only=graph), d.choose(g, desc, graph_safe_only=graph)
        assert got.path is want.path, step
        flips.add(got.path)
        if forced == "auto":
            for a, b in zip(got.times, want.times):
                assert (math.isinf(a) and math.isinf(b)) or a == pytest.approx(b, rel=1e-9)
    assert chooser.hits > 30 and chooser.misses == 1
    if forced == "auto":
        assert flips == {Path.PAGED, Path.CASCADE} or len(flips) >= 1  # the fit holds across a flip too


def test_steady_chooser_refits_on_a_new_grouping():
    d = make()
    chooser = SteadyChooser(d)
    g1, desc1 = batch([(16384, 8)])
    g2, desc2 = batch([(16384, 2)], ungrouped=6)
    for g, desc in ((g1, desc1), (g1, desc1), (g2, desc2), (g1, desc1)):
        assert chooser.choose(g, desc).times == pytest.approx(d.choose(g, desc).times)
    assert chooser.misses == 3 and chooser.hits == 1


def test_reused_plan_follows_hot_table_changes():
    """Same staged rows array, but the HOT table changed between steps (a promotion): the plan
    must see it (the table's version), and outputs stay exact."""
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2})
    for hot, want in (({0, 2}, 2), ({0, 2}, 2), ({0, 1, 2, 3}, 4)):
        fb, _ = _batch(runner, hot=hot)  # rewrites the table (a no-op when unchanged)
        be.stage_batch(rows)  # the same array object every step
        be.init_forward_metadata(fb)
        assert be.decode.path is Path.CASCADE and be.decode.filled_grouping.num_grouped == want
        q, k, v = _qkv(fb.batch_size, 5)
        o = be.forward_decode(q, k, v, LAYER, fb)
        torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    assert be.decode.grouping_memo.hits >= 1


def test_batch_rows_is_a_stable_view_of_sglangs_host_rows():
    reqs = [SimpleNamespace(req_pool_idx=i, kv=SimpleNamespace(req_pool_idx=i)) for i in (4, 2, 9)]  # 0.5.17, 0.5.23
    t = torch.tensor([4, 2, 9], dtype=torch.int64)
    b = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=t)
    r1, r2 = batch_rows(b), batch_rows(b)
    assert r1 is r2 and r1.tolist() == [4, 2, 9] and np.shares_memory(r1, t.numpy())
    b2 = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=t.clone())  # filtered / merged: a new tensor
    assert batch_rows(b2) is not r1 and batch_rows(b2).tolist() == [4, 2, 9]
    stale = SimpleNamespace(reqs=reqs[:2], req_pool_indices_cpu=t)  # length mismatch: from the requests
    assert batch_rows(stale).tolist() == [4, 2]
    assert batch_rows(b) is not r1 and batch_rows(b) is batch_rows(b)  # t seen again: checked, then held
    assert batch_rows(stale).tolist() == [4, 2]  # the held tensor with fewer requests: still from them
    i32 = SimpleNamespace(reqs=reqs, req_pool_indices_cpu=t.to(torch.int32))  # not int64: from the requests
    assert batch_rows(i32).dtype == np.int64 and batch_rows(i32).tolist() == [4, 2, 9]


def test_recent_times_percentiles():
    rt = RecentTimes(capacity=100)
    assert rt.percentiles_us(50, 99) == (0.0, 0.0)
    for i in range(1, 251):  # the window keeps the last 100: 151..250 us
        rt.add(i * 1e-6)
    p50, p99 = rt.percentiles_us(50, 99)
    assert len(rt) == 100 and p50 == pytest.approx(200.5) and p99 == pytest.approx(249.01)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4095, 4096, 9000])
def test_recent_times_percentiles_are_numpys(n):
    """The partition-based percentiles give np.percentile's floats exactly, over the window."""
    rng = np.random.default_rng(n)
    rt = RecentTimes()
    xs = rng.exponential(3e-5, n)
    for x in xs:
        rt.add(float(x))
    window = xs[-4096:]
    qs = (0, 1, 25, 50, 90, 99, 99.9, 100)
    want = tuple(float(v) * 1e6 for v in np.percentile(window, qs))
    assert rt.percentiles_us(*qs) == want and len(rt) == len(window)


def test_build_dispatcher_uses_the_wrapped_backends_paged_coefficients():
    from granikv.config import GraniKVConfig
    from granikv.attention.cost.cost_model import CostModel
    from granikv.attention.dispatcher import build_dispatcher

    runner, cfg = _runner(), GraniKVConfig(enable=True)
    loaded = CostModel.load(None, None)
    tri = build_dispatcher(runner, cfg, "triton").cost_model
    assert tri.paged_launch_us == loaded.served.paged_by_backend["triton"]["paged_launch_us"]
    assert build_dispatcher(runner, cfg, "flashinfer").cost_model.paged_gbps == loaded.paged_gbps
    assert build_dispatcher(runner, cfg, "fa3").cost_model is not None


def _graph_backend(runner):
    from test_backend import _capture, _replay_view

    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fb, _ = _batch(runner, hot={0, 1, 3})
    _capture(be, _replay_view(fb, 8))
    return be


def test_steady_graph_steps_match_the_full_fill_every_step():
    """Graph replays of a padded batch (5 requests in the graph of 8) over many decode steps,
    as SGLang drives them: the same staged rows array, seq_lens_cpu sliced from one persistent
    host buffer refilled in place. The backend's steady path (``CascadeWorkspace.advance``, the
    cached seq_lens view and description) leaves, every step, the host work list and the device
    metadata of a twin backend that fills the workspace from the padded arrays (but the suffix
    ends, which the fast one's kernels read from the device seq_lens copied to ``CascadeWorkspace.ends``),
    and the path of a fresh ``Dispatcher.choose``; outputs match the paged reference on the
    first and last step."""
    from test_backend import _replay_view

    runner = _runner()
    fast, slow = _graph_backend(runner), _graph_backend(runner)
    slow.decode.workspace_for(8).advance = lambda *a, **k: False  # always the full fill path
    advanced = []
    real_advance = fast.decode.workspace.advance
    fast.decode.workspace.advance = lambda *a, **k: advanced.append(real_advance(*a, **k)) or advanced[-1]
    fb, rows = _batch(runner, hot={0, 1, 3})
    host = torch.ones(16, dtype=torch.int64)  # SGLang's persistent seq_lens_cpu buffer
    steps = 30
    for step in range(steps):
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1 if step else fb.seq_lens_cpu
        fb.seq_lens = fb.seq_lens_cpu.clone()
        view = _replay_view(fb, 8)
        host[:8] = view.seq_lens_cpu
        for be in (fast, slow):
            v = copy.copy(view)
            v.seq_lens_cpu = host[:8]  # a new slice of the same memory every step
            be.stage_batch(rows)
            be.init_forward_metadata_out_graph(v)
        assert fast.decode.path is slow.decode.path is Path.CASCADE and fast.graphs.planned_cascade
        fw, sw = fast.decode.workspace, slow.decode.workspace
        hi = slice(fw._offs["sfx"] + 2 * fw.suffix_cap, fw._offs["sfx"] + 3 * fw.suffix_cap)
        outside = torch.ones_like(fw.meta, dtype=torch.bool)
        outside[hi] = False
        assert torch.equal(fw.meta[outside], sw.meta[outside]), f"step {step}"
        for f in fw.work_list._fields:
            a, b = getattr(fw.work_list, f), getattr(sw.work_list, f)
            assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), (step, f)
        assert fw.ends.buffer[:8].tolist() == view.seq_lens.tolist() and fw.ends.bound is fw.ends.buffer
        grouping, desc = fast.decode.filled_grouping, fast.decode.last_desc
        want = fast.dispatcher.choose(grouping, BatchDescription(rows, fb.seq_lens_cpu.numpy().copy(),
                                                                 desc.hot_start, desc.hot_len))
        assert want.path is fast.decode.path
        fast.decode.workspace.check_integrity()
        if step in (0, steps - 1):
            q, k, v = _qkv(8, step)
            o = fast.forward_decode(q, k, v, LAYER, view)
            torch.testing.assert_close(o[:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)
    ws = fast.decode.workspace
    assert ws.fills_reused >= steps - 5 and slow.decode.workspace.fills_reused == ws.fills_reused
    assert sum(advanced) == ws.fills_reused == ws.advances_in_place  # every reuse: an advance, no upload
    assert fast.decode.grouping_memo.hits >= steps - 2


def test_seq_lens_view_follows_the_memory():
    """The cached seq_lens view is SGLang's memory itself: refilled in place it reads the new
    lengths; another buffer, another batch size or another dtype gives another array."""
    be = _backend(_runner(), "cascade")
    host = torch.arange(10, 26, dtype=torch.int64)
    a = be.decode._seq_lens_view(host[:8], 8)
    assert be.decode._seq_lens_view(host[:8], 8) is a and a.tolist() == list(range(10, 18))
    host[:8] += 100
    assert a.tolist() == list(range(110, 118))
    assert be.decode._seq_lens_view(host[:8], 5).tolist() == list(range(110, 115))
    other = host.clone()
    assert be.decode._seq_lens_view(other[:8], 8) is not a
    i32 = be.decode._seq_lens_view(host[:8].to(torch.int32), 8)
    assert i32.dtype == np.int64 and i32.tolist() == list(range(110, 118))
    assert be.decode._seq_lens_view(host[:3], 5) is None  # fewer lengths than requests


# ---- planning-time diagnostics ----------------------------------------------------------------


def test_plan_time_histogram_quantiles_from_bucket_deltas():
    """Bucket counts are cumulative; the difference of two snapshots is the histogram of the
    steps in between, and its quantiles are those steps' percentiles within a bucket's width."""
    from granikv.attention.step_stats import PlanTimeHistogram

    h = PlanTimeHistogram()
    rng = np.random.default_rng(3)
    early = rng.uniform(200e-6, 900e-6, 500)  # an earlier row: slow steps
    for s in early:
        h.add(float(s))
    before = h.snapshot()
    row = rng.lognormal(np.log(20e-6), 0.4, 2000)
    for s in row:
        h.add(float(s))
    after = h.snapshot()
    delta = {k: n - before.get(k, 0) for k, n in after.items()}
    assert sum(delta.values()) == 2000 and sum(after.values()) == 2500
    for q in (50, 90, 99):
        want = float(np.percentile(row * 1e6, q))
        got = PlanTimeHistogram.quantile_us(delta, q)
        assert want / 1.19 <= got <= want * 1.19, (q, got, want)  # one bucket is 2^(1/4) wide
    whole = PlanTimeHistogram.quantile_us(after, 99)
    assert whole > 200  # the earlier row's steps would dominate a whole-life p99
    assert PlanTimeHistogram.quantile_us({}, 50) is None
    assert PlanTimeHistogram.quantile_us({"1": 0}, 50) is None
    h2 = PlanTimeHistogram()
    h2.add(0.5)  # 500 ms: the overflow bucket, reported at its lower edge
    assert h2.snapshot() == {"inf": 1} and PlanTimeHistogram.quantile_us(h2.snapshot(), 50) == 16384.0
    h2.add(0.5e-6)
    assert h2.snapshot()["1"] == 1 and 0 < PlanTimeHistogram.quantile_us({"1": 1}, 50) <= 1.0


def test_plan_sections_add_up_and_the_histogram_counts_every_step():
    """Every planned step lands in the histogram once; the sections add up to the planning
    time (stage included), and thread CPU time is counted beside wall time."""
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2, 3})
    for step in range(6):
        if step:
            fb.seq_lens_cpu = fb.seq_lens_cpu + 1
            fb.seq_lens = fb.seq_lens_cpu.clone()
        be.stage_batch(rows, seconds=2e-6)
        be.init_forward_metadata(fb)
        assert be.decode.path is Path.CASCADE
    snap = be.stats_snapshot()
    assert snap["planned_steps"] == 6 and sum(snap["plan_us_hist"].values()) == 6
    sec = snap["plan_sections_us_total"]
    assert set(sec) == {"stage", "lookup", "choose", "fill", "upload", "slot_copy", "view"}
    assert sec["slot_copy"] == 0.0  # an eager step makes no pre-replay slot copy
    assert sec["stage"] == pytest.approx(12.0)
    assert all(v >= 0 for v in sec.values()) and sec["lookup"] > 0 and sec["choose"] > 0 and sec["fill"] > 0
    assert sum(sec.values()) == pytest.approx(snap["plan_us_total"], rel=1e-6)
    assert sec["upload"] == pytest.approx(snap["upload_us_total"], rel=1e-6) and sec["upload"] > 0
    assert 0 < snap["plan_cpu_us_total"] <= snap["plan_us_total"] * 1.5  # CPU time: the same work
    assert snap["plan_us_p50"] <= snap["plan_us_max"]


# ---- the steady cascade step: one copy, one event, no array work in the choice ---------------


class _CountingEvents:
    """``torch.cuda.Event`` on CPU: counts constructions, records and synchronizations."""

    def __init__(self):
        self.calls = {"new": 0, "record": 0, "synchronize": 0}
        counts = self.calls

        class Event:
            def __init__(self):
                counts["new"] += 1

            def record(self):
                counts["record"] += 1

            def synchronize(self):
                counts["synchronize"] += 1

        self.Event = Event


def _dispatched_ops(fn):
    """The aten ops ``fn`` runs (what reaches torch's dispatcher: device calls on a GPU)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return dict(c.ops)


def test_steady_cascade_step_makes_one_copy_and_no_upload(monkeypatch):
    """Graph replays of one batch as SGLang drives them, with the workspace uploading as on a
    GPU (events): after the first step, a steady step's torch work is one device-to-device copy
    of the seq_lens (the suffix ends the kernels read) and no upload (no event record, no wait);
    the path choice sums no array (``seq_lens_sum`` is used, and checked). The pre-replay copy
    of the suffix slots (``SlotCopier``: one CUDA-graph replay on a GPU, a direct launch here)
    runs once per step and is counted apart."""
    from test_backend import _replay_view

    runner = _runner()
    be = _graph_backend(runner)
    events = _CountingEvents()
    monkeypatch.setattr(torch.cuda, "Event", events.Event)
    ws = be.decode.workspace
    ws._cuda = True
    copies = []
    be.decode.slot_copier.run = lambda: copies.append(1)
    fb, rows = _batch(runner, hot={0, 1, 3})
    host = torch.ones(16, dtype=torch.int64)
    ops, syncs = [], []
    plan_step = be.decode.plan_step
    seen = {}
    be.decode.plan_step = lambda *a, **k: seen.update(ops=_dispatched_ops(
        lambda: seen.update(view=plan_step(*a, **k)))) or seen["view"]  # GraniKV's part only
    for step in range(40):
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1 if step else fb.seq_lens_cpu
        fb.seq_lens = fb.seq_lens_cpu.clone()
        view = _replay_view(fb, 8)
        host[:8] = view.seq_lens_cpu
        view.seq_lens_cpu = host[:8]
        be.stage_batch(rows)
        before = dict(events.calls)
        be.init_forward_metadata_out_graph(view)
        got = seen["ops"]
        assert be.decode.path is Path.CASCADE
        if step >= 2:
            ops.append(got)
            syncs.append(events.calls["synchronize"] - before["synchronize"])
            assert events.calls["record"] - before["record"] == 0, step
    assert ops and all(o == {"aten.copy_.default": 1} for o in ops), ops[:3]
    assert len(copies) == 40  # every cascade replay's slots copied before it
    assert ws.advances_in_place == 39 and ws.fills_built == 2  # the capture's empty list, step 0
    assert events.calls["new"] <= 2 and sum(syncs) == 0  # the capture's and the first step's uploads
    chooser = be.decode.chooser
    assert chooser.hint_ok and chooser.hint_mismatches == 0 and chooser.hits >= 35


def test_choice_with_seq_lens_sum_matches_the_arrays_and_distrusts_a_wrong_total():
    """The O(1) choice reads SGLang's ``seq_lens_sum`` (less the padding rows at the fill
    value): the same path and times as a fresh ``Dispatcher.choose`` every step; a total that
    disagrees with the arrays at a refit is never used again."""
    d = make()
    chooser, memo = SteadyChooser(d), GroupingMemo()
    _, desc0 = batch([(2048, 6), (512, 3)], suffix=64, ungrouped=2)
    for step in range(0, 40000, 997):
        desc = BatchDescription(desc0.req_pool_indices, desc0.seq_lens + step, desc0.hot_start, desc0.hot_len)
        g = memo.group(desc, min_group_size=2)
        got = chooser.choose(g, desc, seq_total=int(desc.seq_lens.sum()))
        want = d.choose(g, desc)
        assert got.path is want.path and got.times == pytest.approx(want.times, rel=1e-9)
    assert chooser.hint_ok and chooser.hits > 30
    off = chooser.choose(g, desc, seq_total=int(desc.seq_lens.sum()) + 100_000)  # a trusted hint is what counts
    assert off.times.paged > want.times.paged
    wrong = SteadyChooser(d)
    g = memo.group(desc, min_group_size=2)
    wrong.choose(g, desc, seq_total=int(desc.seq_lens.sum()) + 5)  # refit: checked, found wrong
    assert not wrong.hint_ok and wrong.hint_mismatches == 1
    far = BatchDescription(desc.req_pool_indices, desc.seq_lens + 5000, desc.hot_start, desc.hot_len)
    got = wrong.choose(g, far, seq_total=0)  # ignored: the arrays decide
    assert got.times == pytest.approx(d.choose(g, far).times, rel=1e-9)


def test_new_rows_array_with_the_same_rows_keeps_the_plan():
    """Staged rows in a NEW array every step (equal values): the HOT lookup and grouping are
    reused (compared by value once identity fails), the work list still advances, and the
    metadata equals a twin backend's that rebuilds every step."""
    from test_backend import _replay_view

    runner = _runner()
    fast, slow = _graph_backend(runner), _graph_backend(runner)
    slow.decode.workspace_for(8).advance = lambda *a, **k: False
    fb, rows = _batch(runner, hot={0, 1, 3})
    for step in range(20):
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1 if step else fb.seq_lens_cpu
        fb.seq_lens = fb.seq_lens_cpu.clone()
        view = _replay_view(fb, 8)
        for be in (fast, slow):
            be.stage_batch(rows.copy())  # a new array, same rows
            be.init_forward_metadata_out_graph(copy.copy(view))
        assert fast.decode.path is slow.decode.path is Path.CASCADE
        assert torch.equal(fast.decode.workspace.meta[:3], slow.decode.workspace.meta[:3])
        assert _same_lists(fast.decode.workspace.work_list, slow.decode.workspace.work_list), f"step {step}"
    assert fast.decode.grouping_memo.hits >= 18 and fast.decode.workspace.fills_reused >= 15
    # a different row set in a new array is not mistaken for the old one
    other = rows.copy()
    other[0], other[1] = other[1], other[0]
    fast.stage_batch(other)
    fast.init_forward_metadata_out_graph(copy.copy(_replay_view(fb, 8)))
    assert fast.decode.last_desc.req_pool_indices is other


def _same_lists(a, b) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def test_a_graph_step_without_usable_device_seq_lens_runs_the_stock_graph(caplog):
    """The cascade graph's suffix kernels end each request at the step's device seq_lens
    (copied into the workspace's ``ends``); a replay whose seq_lens cannot be copied there
    (here: float) must replay the stock graph, not the cascade graph over stale ends."""
    from test_backend import _replay_view

    runner = _runner()
    be = _graph_backend(runner)
    fb, rows = _batch(runner, hot={0, 1, 3})
    good = _replay_view(fb, 8)
    be.stage_batch(rows)
    be.init_forward_metadata_out_graph(good)
    assert be.graphs.planned_cascade and be.decode.ws.ends.bound is be.decode.ws.ends.buffer
    bad = copy.copy(good)
    bad.seq_lens = good.seq_lens.float()
    paged, steps = be.stats.paths.get("paged", 0), be.stats.steps
    be.stage_batch(rows)
    be.init_forward_metadata_out_graph(bad)
    assert not be.graphs.planned_cascade and be.decode.path is Path.PAGED
    assert be.stats.paths["paged"] == paged + 1 and be.stats.steps == steps + 1  # one step, counted once
    assert be.stats.last_reason == "no device seq_lens for the cascade graph"
    assert "cannot be copied to the cascade workspace" in caplog.text  # said once, with the tensor


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_debug_integrity_names_a_device_end_that_is_not_the_host_length(where):
    """Under ``--granikv-debug-integrity`` each planned step compares the host seq_lens (the
    work list's items and reuse bound) with the device ends the suffix kernels read: a graph
    step whose device seq_lens say one token more than the host ones at one request fails,
    naming that batch position and both lengths; agreeing steps pass."""
    from test_backend import _replay_view

    runner = _runner()
    be = _graph_backend(runner)
    be.cfg = dataclasses.replace(be.cfg, debug_integrity=True)
    fb, rows = _batch(runner, hot={0, 1, 3})
    for step in range(2):  # a fill, then an in-place advance: both checked, both agree
        fb.seq_lens_cpu = fb.seq_lens_cpu + step
        fb.seq_lens = fb.seq_lens_cpu.clone()
        be.stage_batch(rows)
        be.init_forward_metadata_out_graph(_replay_view(fb, 8))
        assert be.decode.path is Path.CASCADE
    assert be.decode.workspace.advances_in_place == 1
    p = {"first": 0, "middle": 2, "last": 4}[where]
    fb.seq_lens_cpu = fb.seq_lens_cpu + 1
    fb.seq_lens = fb.seq_lens_cpu.clone()
    view = _replay_view(fb, 8)
    view.seq_lens = view.seq_lens.clone()
    view.seq_lens[p] += 1  # the device length disagrees with the host one at request p
    host = int(fb.seq_lens_cpu[p])
    be.stage_batch(rows)
    with pytest.raises(AssertionError, match=f"batch position {p} has host seq_len {host} but device end {host + 1}"):
        be.init_forward_metadata_out_graph(view)


def _kept_run(batch, bs, steps, *, kept, interval_s):
    """``steps`` graph decode steps of the planning bench's ``batch`` under a step clock whose
    every interval is ``interval_s`` (1 s: the model's saving never dominates the step, so the
    clock measures cascade against paged and holds its verdict; 1 µs: the model is trusted);
    ``kept=False``: ``DecodePlanner._kept`` never answers (``choose`` + ``adjust`` every step).
    Returns each step's path and reason, the stats snapshot, the clock's state and how many
    steps the kept decision planned."""
    from benchmark.kernels import bench_planning as bench
    from granikv.attention.decode.step_clock import StepClock
    from granikv.scheduler_step import on_run_batch

    be, sched, sbatch, view, cfg, host_buf = bench.serving_setup(bs, batch, np.random.default_rng(0))
    now = [0.0]

    def fake_time():
        now[0] += interval_s
        return now[0]

    d = be.decode
    d.clock = StepClock(fake_time, probe_paged=d.clock.probe_paged)
    taken, real = [0], d._kept

    def counted(s, total):
        out = real(s, total) if kept else None
        taken[0] += out is not None
        return out

    d._kept = counted
    trace = []
    for _ in range(steps):
        host_buf[:bs] += 1
        view.seq_lens_cpu = host_buf[:bs]
        view.seq_lens_sum += bs
        on_run_batch(sched, sbatch, cfg)
        be.init_forward_metadata_out_graph(view)
        trace.append((d.path, be.ctx.stats.last_reason))
    snap = be.stats_snapshot()
    for k in [k for k in snap if k.startswith(("plan_", "dispatch_host")) or k.endswith("_us_total")]:
        del snap[k]  # host times differ run to run
    clock = {k: dataclasses.astuple(v) for k, v in d.clock._sizes.items()}
    counts = (d.clock.overruled_steps, d.clock.verdicts_paged, d.clock.verdicts_model, d.chooser.hits,
              d.chooser.misses, d.steady_replays)
    return trace, snap, clock, counts, taken[0]


@pytest.mark.parametrize("batch,bs", [("homog", 24), ("forest16", 130)])
@pytest.mark.parametrize("interval_s", [1.0, 1e-6])
def test_a_kept_cascade_decides_what_choose_and_adjust_decide(batch, bs, interval_s):
    """``DecodePlanner._kept`` (``SteadyChooser.kept_saving`` + ``StepClock.keeps``) plans a
    steady cascade replay without this step's times: every step's path and reason, the stats,
    the chooser's and the clock's state are those of ``choose`` + ``adjust`` on every step,
    through the clock's windows (cascade, then paged), its held verdicts and their expiry."""
    steps = 700  # two of the clock's cycles of 2 x WINDOW + HOLD steps
    on = _kept_run(batch, bs, steps, kept=True, interval_s=interval_s)
    off = _kept_run(batch, bs, steps, kept=False, interval_s=interval_s)
    assert on[:4] == off[:4]
    paths = {p for p, _ in on[0]}
    if interval_s == 1.0:  # the clock measured paged in its windows and held cascade in between
        assert paths == {Path.CASCADE, Path.PAGED} and on[2]
    else:
        assert paths == {Path.CASCADE}
    assert on[4] > steps // 2 and off[4] == 0
