"""The kernel benchmarks' timers: GPU time of a call (triton's do_bench or CUDA events, eager or
as CUDA-graph replays) and host wall time of a call.

GPU timers synchronise before they start and return medians in the unit their name says:

- :func:`gpu_ms`: ``triton.testing.do_bench`` median of ``fn`` (L2 flushed between runs), as
  CUDA-graph replays when ``graph`` and ``fn`` can be captured, else eagerly; ``(ms, mode)``;
- :func:`graph_us` / :func:`eager_us`: median CUDA-event time of one pass over ``calls`` (one
  call per layer, say), captured as one CUDA graph / run eagerly, per call, in µs.

Host timers (``time.perf_counter``):

- :func:`host_ms`: median wall time of ``fn`` after a warm-up, the GPU synchronised before and
  after (a call that launches work is timed for its host part only);
- :func:`per_call_us`: median over ``repeats`` of the mean wall time of ``iters`` calls, µs;
- :class:`HostClock`: wall and thread CPU time of the code between ``start`` and ``stop``;
- :func:`run_for`: call ``fn`` for a while (a CPU warm-up before host timings).

torch, triton and granikv are imported when a GPU timer runs, so the module imports anywhere.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence, Tuple


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def gpu_ms(fn: Callable[[], Any], graph: bool = True, *, warmup: int = 25, rep: int = 100) -> Tuple[float, str]:
    """Median ms of ``fn`` (``triton.testing.do_bench``, ``warmup`` / ``rep`` in ms), as
    CUDA-graph replays when ``graph`` and capturable, else eager (a failed capture is printed and
    falls back to eager); returns ``(ms, "graph" | "eager")``."""
    import triton

    fn()
    _sync()
    if graph:
        from granikv.kernels.graph_capture import capture_graph

        try:
            g = capture_graph(fn)
            return triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median"), "graph"
        except Exception as e:  # noqa: BLE001 - fall back to eager timing, reported
            print("  graph capture failed, eager:", repr(e)[:120], flush=True)
            _sync()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"), "eager"


def graph_us(calls: Sequence[Callable[[], Any]], reps: int = 7) -> float:
    """Median µs of one call, from a CUDA graph holding every call once (CUDA events)."""
    from granikv.kernels.graph_capture import capture_graph

    return _event_median_us(capture_graph(_call_all(calls)).replay, reps) / len(calls)


def eager_us(calls: Sequence[Callable[[], Any]], reps: int = 7) -> float:
    """Median µs of one call, every call run eagerly in turn (CUDA events)."""
    run = _call_all(calls)
    run()
    return _event_median_us(run, reps) / len(calls)


def _call_all(calls: Sequence[Callable[[], Any]]) -> Callable[[], None]:
    def run() -> None:
        for f in calls:
            f()

    return run


def _event_median_us(fn: Callable[[], Any], reps: int) -> float:
    import torch

    fn()
    _sync()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def host_ms(fn: Callable[[], Any], n: int = 50, *, warmup: int = 5, sync: bool = True) -> float:
    """Median host wall ms of ``fn`` over ``n`` calls after ``warmup`` untimed ones; with
    ``sync``, the GPU is synchronised after the warm-up and after the timed calls."""
    for _ in range(warmup):
        fn()
    if sync:
        _sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    if sync:
        _sync()
    return statistics.median(ts)


def per_call_us(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean host wall µs of ``iters`` back-to-back calls (no GPU
    synchronisation: host-only work)."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return statistics.median(runs)


class HostClock:
    """Wall and thread CPU time of the code between :meth:`start` and :meth:`stop` (seconds):
    the CPU time leaves out what a shared host's preemption adds to the wall time."""

    def __init__(self) -> None:
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._cpu, self._wall = time.thread_time(), time.perf_counter()

    def stop(self) -> Tuple[float, float]:
        """``(wall_s, cpu_s)`` since :meth:`start`."""
        return time.perf_counter() - self._wall, time.thread_time() - self._cpu


def run_for(seconds: float, fn: Callable[[], Any]) -> None:
    """Calls ``fn`` until ``seconds`` have passed (lets the CPU clock and caches settle before a
    host timing)."""
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()
