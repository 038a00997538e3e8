"""Host cost of GraniKV's per-step hooks on a decode step with no HOT run, against stock SGLang.

A decode step of 64 requests while no request holds a HOT run (a server whose prefixes never
paid for a promotion): GraniKV plans nothing there (``DecodePlanner._no_hot_step``), but its
hooks still run around SGLang's own per-step work. This script times, on the CPU, one such
step's host work as SGLang runs it, stock and with GraniKV, with SGLang's real
allocator, radix cache, ``Scheduler._apply_war_barrier`` and hook wrapper
(``hook_registry._wrap_fn``), taking turns step by step:

- the decode allocation (``evict_from_tree_cache`` + ``alloc_token_slots`` of 64 slots;
  GraniKV: ``GraniKVAllocator`` under ``GraniKVRadixCache``);
- ``Scheduler.run_batch``'s BEFORE hook (``scheduler_step.on_run_batch``; SGLang's own
  ``run_batch`` is a no-op stand-in on both sides);
- the decode graph runner's ``load_batch`` AROUND hook and the backend's
  ``init_forward_metadata_out_graph`` (GraniKV's backend wrapping a no-op backend; stock: the
  no-op backend alone);
- ``Scheduler._apply_war_barrier`` and its AROUND hook (stub streams).

``warm``: steps back to back; ``cold``: ``bench_planning.Thrash`` before every step, outside
the timing (the host's caches hold other data, as in serving). The GraniKV engine runs
``GraniKVConfig()`` defaults (log line every 40 decode steps, at the WARNING level the
benchmark engines run). Figures in docs/results/kernels.md, "Planning cost".

    python -m benchmark.kernels.bench_step_hooks [--steps 3000]
"""

import argparse
import gc
import logging
import platform
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

BS = 64  # requests per decode step
KV = 200_000  # slots of each engine's pool


def _storage(granikv: bool, cfg):
    """A pool, request table, allocator and radix cache as each engine builds them (page size 1)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from granikv.mem_cache.allocator import GraniKVAllocator
    from granikv.mem_cache.radix_cache import GraniKVRadixCache

    pool = MHATokenToKVPool(size=KV, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    req_pool = ReqToTokenPool(BS + 8, 4096, "cpu", False)
    if granikv:
        alloc = GraniKVAllocator(KV, torch.bfloat16, "cpu", pool, False, hot_fraction=cfg.hot_fraction)
    else:
        alloc = TokenToKVPoolAllocator(KV, torch.bfloat16, "cpu", pool, False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
                             page_size=1)
    cache = GraniKVRadixCache.create(params, cfg, pool) if granikv else RadixCache(params)
    return alloc, cache


class _Stream:
    """The schedule stream ``_apply_war_barrier`` waits on (no CUDA here)."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def build_steps() -> Tuple[Callable[[], None], Callable[[], None], Callable[[], None], Any]:
    """``(stock_step, granikv_step, reset, backend)``: one no-HOT decode step's host work on each
    engine, a reset of both allocators (call before a run of steps), and GraniKV's backend."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.allocation import alloc_token_slots
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from benchmark.kernels.bench_planning import serving_setup
    from granikv import plugin
    from granikv import sglang_compat as compat
    from granikv.config import GraniKVConfig

    cfg = GraniKVConfig(enable=True)
    stock_alloc, stock_cache = _storage(False, cfg)
    g_alloc, g_cache = _storage(True, cfg)
    be, _, batch, view, _, _ = serving_setup(BS, "paged", np.random.default_rng(0))  # no HOT run held
    assert be.ctx.hot_prefix_table.rows_held == 0
    inner = be.inner
    batch.forward_mode = view.forward_mode = ForwardMode.DECODE

    runner = ModelRunner.__new__(ModelRunner)
    runner.__dict__.update(attn_backend=be, _granikv_backends=[be])
    setattr(runner, compat.WAR_EVENT_ATTR, None)  # the read-done event, named per release
    worker = TpModelWorker.__new__(TpModelWorker)
    worker._model_runner = runner
    worker.__dict__[compat.WAR_RUNNER_ATTR] = runner  # the runner _apply_war_barrier reads it from
    sched = Scheduler.__new__(Scheduler)
    sched.__dict__.update(server_args=SimpleNamespace(_granikv=cfg), tree_cache=g_cache, tp_worker=worker,
                          model_worker=worker, tp_rank=0, attn_tp_cpu_group=None, tp_cpu_group=None,
                          enable_overlap=True, _war_barrier_enabled=True, forward_stream=None,
                          schedule_stream=_Stream())
    stock_sched = Scheduler.__new__(Scheduler)
    stock_sched.__dict__.update(sched.__dict__, tree_cache=stock_cache, server_args=SimpleNamespace())
    key = SimpleNamespace(size=BS, variant_label=None)
    graph_runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    graph_runner.__dict__.update(attn_backend=be, enable_pdmux=False, ragged_verify_mode=False)
    stock_graph_runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    stock_graph_runner.__dict__.update(attn_backend=inner, enable_pdmux=False)

    def run_batch(self, batch, *args, **kwargs) -> None:  # SGLang's run_batch: the same on both sides
        return None

    def load_batch(self, fb, *args, **kwargs) -> None:  # SGLang's load_batch, reduced to the backend call
        self.attn_backend.init_forward_metadata_out_graph(fb)
        self._replay_graph_key = key

    g_run_batch = _wrap_fn(run_batch, plugin._before_run_batch, HookType.BEFORE)
    g_load_batch = _wrap_fn(load_batch, plugin._around_load_batch, HookType.AROUND)
    g_war = _wrap_fn(Scheduler._apply_war_barrier, plugin._around_apply_war_barrier, HookType.AROUND)
    event = object()  # the graph runner's pre-replay read-done event, set on every graph decode step

    def step(cache, run_batch_fn, scheduler, load_batch_fn, graph_runner_, war_fn) -> Callable[[], None]:
        """One engine's no-HOT decode step: allocation, run_batch, load_batch, the WAR barrier."""
        def one() -> None:
            evict_from_tree_cache(cache, BS)
            alloc_token_slots(cache, BS)
            run_batch_fn(scheduler, batch)
            load_batch_fn(graph_runner_, view)
            setattr(runner, compat.WAR_EVENT_ATTR, event)
            war_fn(scheduler)
        return one

    stock_step = step(stock_cache, run_batch, stock_sched, load_batch, stock_graph_runner, Scheduler._apply_war_barrier)
    granikv_step = step(g_cache, g_run_batch, sched, g_load_batch, graph_runner, g_war)

    def reset() -> None:
        stock_alloc.clear()
        g_alloc.clear()

    return stock_step, granikv_step, reset, be


def composite(steps: int, thrash: Optional[Callable[[], object]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """µs per step of ``steps`` stock and ``steps`` GraniKV no-HOT decode steps, in turns (the
    order alternating), after a warm-up of 200 each; ``thrash`` runs before every step."""
    stock_step, granikv_step, reset, _ = build_steps()
    out = (np.zeros(steps), np.zeros(steps))
    for warm_up in (True, False):
        reset()
        for i in range(200 if warm_up else steps):
            for which in ((0, 1) if i % 2 else (1, 0)):
                if thrash is not None:
                    thrash()
                fn = stock_step if which == 0 else granikv_step
                t0 = time.perf_counter_ns()
                fn()
                if not warm_up:
                    out[which][i] = (time.perf_counter_ns() - t0) / 1e3
    return out


def main() -> None:
    from benchmark.kernels.bench_planning import Thrash, cpu_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000, help="steps per engine, warm (cold: a third)")
    args = ap.parse_args()
    logging.getLogger("granikv").setLevel(logging.WARNING)  # as the benchmark engines run
    gc.disable()  # the steps' own time; collections are the process's, not the step's
    print(f"# {cpu_name()}, python {platform.python_version()}, torch {torch.__version__}; "
          f"a decode step of {BS} requests with no HOT run, µs of host work per step")
    print(f"{'caches':>6} {'stock p50':>10} {'GraniKV p50':>12} {'delta p50':>10} {'stock mean':>11} "
          f"{'GraniKV mean':>13} {'delta mean':>11}")
    for label, thrash, steps in (("warm", None, args.steps), ("cold", Thrash(), max(1, args.steps // 3))):
        s, g = composite(steps, thrash)
        print(f"{label:>6} {np.median(s):>10.2f} {np.median(g):>12.2f} {np.median(g) - np.median(s):>+10.2f} "
              f"{s.mean():>11.2f} {g.mean():>13.2f} {g.mean() - s.mean():>+11.2f}", flush=True)


if __name__ == "__main__":
    main()
