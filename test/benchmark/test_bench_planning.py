"""bench_planning.py's serving rows run the backend's real planning path: on CPU here, and with
the workspace on a CUDA device (pinned uploads, events) on the GPU host; ``fresh`` host arrays
every step defeat the identity-based reuse of the staged rows and the seq_lens view."""

import numpy as np
import pytest
import torch
from bench_scripts import load  # noqa: E402  (test/benchmark, on the path)

bench = load("kernels", "bench_planning.py")


@pytest.mark.parametrize("fresh", [False, True])
def test_serving_rows_plan_every_step(fresh):
    snap, wall, cpu = bench.serving_run(64, "homog", 40, np.random.default_rng(0), fresh=fresh)
    assert snap["planned_steps"] == 40 and snap["steps_per_path"].get("cascade") == 40
    assert sum(snap["plan_us_hist"].values()) == 40 and len(wall) == len(cpu) == 40
    assert snap["work_list_reuses"] >= 35  # the work list advances either way (seq_lens compared by value)
    if fresh:  # new rows every step: the table lookup and the grouping memo key run every step
        assert snap["grouping_reuses"] >= 35
    else:
        assert snap["choice_reuses"] >= 38


@pytest.mark.parametrize("batch,path", [("homog", "cascade"), ("forest64", "paged")])
def test_steady_ab_sides_differ_only_in_the_replay(batch, path):
    """``--steady-ab``'s two sides: the same paths and step counts; the replay plans the steady
    steps on one side and none on the other (fresh arrays every step: none either)."""
    on, _, _ = bench.serving_run(64, batch, 40, np.random.default_rng(0))
    off, _, _ = bench.serving_run(64, batch, 40, np.random.default_rng(0), steady=False)
    fresh, _, _ = bench.serving_run(64, batch, 40, np.random.default_rng(0), fresh=True)
    assert on["steps_per_path"] == off["steps_per_path"] == {path: 40}
    assert on["steady_replays"] >= 37 and off["steady_replays"] == 0 and fresh["steady_replays"] == 0


@pytest.mark.gpu
def test_serving_rows_on_cuda_upload_through_events():
    """GPU host: the CUDA rows of ``bench_planning.py --device cuda`` (a second or two)."""
    snap, wall, _ = bench.serving_run(128, "homog", 200, np.random.default_rng(0), device="cuda")
    assert snap["steps_per_path"].get("cascade") == 200 and snap["work_list_reuses"] >= 190
    assert snap["upload_us_total"] > 0 and snap["plan_sections_us_total"]["upload"] > 0
    torch.cuda.synchronize()


def test_clock_windows_are_planned_from_the_replay():
    """``--clock-windows``: paged for a window of every cycle; the windows' steps and the return
    to cascade after them are steady replays (a paged excursion and its resume), so only the
    builds take the full plan, the step after each build included."""
    steps = 2 * 268 + 20  # two cycles and the third's paged window
    snap, _, _ = bench.serving_run(64, "homog", steps, np.random.default_rng(0), windows=True)
    assert snap["steps_per_path"] == {"cascade": steps - 18, "paged": 18}
    assert snap["planned_steps"] - snap["steady_replays"] == snap["work_list_builds"] >= 1


def test_idle_rows_sleep_outside_the_timing():
    """``--idle-ms``: the host sleeps before every step, outside the timed hook + metadata call."""
    snap, wall, _ = bench.serving_run(24, "homog", 20, np.random.default_rng(0), idle_s=0.002)
    assert snap["steps_per_path"] == {"cascade": 20} and (wall < 2000).all()


def test_step_hooks_compare_the_same_no_hot_step_on_both_engines():
    """``bench_step_hooks``: SGLang's real allocator, radix cache, WAR barrier and hook wrapper
    around one no-HOT decode step on each engine; GraniKV's backend records each of its steps
    as a no-HOT paged step (it plans nothing)."""
    pytest.importorskip("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
    hooks = load("kernels", "bench_step_hooks.py")
    stock_step, granikv_step, reset, backend = hooks.build_steps()
    reset()
    for _ in range(3):
        stock_step()
        granikv_step()
    snap = backend.stats_snapshot()
    assert snap["no_hot_steps"] == 3 and snap["steps_per_path"] == {"paged": 3}
    s, g = hooks.composite(5)
    assert len(s) == len(g) == 5 and (s > 0).all() and (g > 0).all()
