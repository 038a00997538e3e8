"""GPU idle time between decode steps, from a torch-profiler trace of an engine's scheduler.

An engine's decode step on the GPU is a graph replay (or eager kernels) followed by a gap while
the host prepares the next step; when the host is on the critical path the gap grows. Given the
Chrome trace that SGLang's profiler writes (``Engine.start_profile(num_steps=N,
activities=["GPU"])``), :func:`idle_of_trace` takes every GPU activity (kernels, memcpy,
memset), merges overlapping intervals (streams run side by side) and reports, per profiled
step::

    span  = last activity end - first activity start
    busy  = length of the union of the activity intervals
    idle  = span - busy          (the GPU had nothing to run)

The window starts at the first GPU activity after the profiler started, so a partial step at
either end adds at most one step's gap. With CPU activity recorded too, :func:`host_calls_of_events`
says where the host's time went per step (CUDA runtime calls, ATen ops). Stdlib only.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_intervals(events: Iterable[Mapping[str, Any]]) -> List[Tuple[float, float]]:
    """(start, end) in µs of every complete GPU event of a Chrome trace, sorted by start."""
    out = []
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in GPU_CATEGORIES:
            ts, dur = e.get("ts"), e.get("dur")
            if isinstance(ts, (int, float)) and isinstance(dur, (int, float)) and dur >= 0:
                out.append((float(ts), float(ts) + float(dur)))
    out.sort()
    return out


def busy_and_gaps(intervals: Sequence[Tuple[float, float]]) -> Tuple[float, List[float]]:
    """Length of the union of sorted ``intervals`` and the idle gaps between its pieces."""
    busy, gaps = 0.0, []
    cur_s, cur_e = None, None
    for s, e in intervals:
        if cur_e is None:
            cur_s, cur_e = s, e
        elif s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, gaps


def idle_of_events(events: Iterable[Mapping[str, Any]], steps: int) -> Optional[Dict[str, Any]]:
    """Idle, busy and span per step (µs) of a trace's GPU activity over ``steps`` decode steps;
    None when the trace holds no GPU activity."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    iv = gpu_intervals(events)
    if not iv:
        return None
    busy, gaps = busy_and_gaps(iv)
    span = max(e for _, e in iv) - iv[0][0]
    gaps.sort()
    return dict(gpu_idle_us_per_step=round((span - busy) / steps, 2), gpu_busy_us_per_step=round(busy / steps, 2),
                gpu_span_us_per_step=round(span / steps, 2), gpu_activities=len(iv), profiled_steps=steps,
                gpu_gap_us_max=round(gaps[-1], 2) if gaps else 0.0)


def load_trace(path: Path) -> List[Mapping[str, Any]]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", []) if isinstance(doc, dict) else list(doc)


HOST_CATEGORIES = ("cuda_runtime", "cuda_driver", "cpu_op")


def host_calls_of_events(events: Iterable[Mapping[str, Any]], steps: int, top: int = 12) -> Dict[str, Any]:
    """Where the host's time went over ``steps`` decode steps of a trace recorded with CPU
    activity (``activities=["CPU", "GPU"]``): per name of a CUDA runtime / driver call or an
    ATen op, its calls and µs per step, the ``top`` names by time (e.g. a ``cudaGraphLaunch``
    that blocks on a full launch queue, a ``cudaStreamSynchronize``, a host-side copy).
    ``host_calls``: name -> [calls per step, µs per step], largest first (nested ATen ops are
    counted inside their callers too). ``graph_launch_interval_us``: the median and mean time
    from one decode graph launch (``cudaGraphLaunch``) to the next, the profiled step's wall time
    (None with fewer than two launches): with the host profiler on, the host's own step."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    acc: Dict[str, List[float]] = {}
    launches: List[float] = []
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() not in HOST_CATEGORIES:
            continue
        dur = e.get("dur")
        if not isinstance(dur, (int, float)) or dur < 0:
            continue
        name = str(e.get("name", "?"))
        a = acc.setdefault(name, [0.0, 0.0])
        a[0] += 1
        a[1] += float(dur)
        if name == "cudaGraphLaunch" and isinstance(e.get("ts"), (int, float)):
            launches.append(float(e["ts"]))
    launches.sort()
    gaps = sorted(b - a for a, b in zip(launches, launches[1:]))
    interval = (dict(p50=round(gaps[len(gaps) // 2], 1), mean=round(sum(gaps) / len(gaps), 1), n=len(gaps))
                if gaps else None)
    return dict(host_calls=_per_step(acc, steps, top), profiled_steps=steps, graph_launch_interval_us=interval)


def python_self_times(events: Iterable[Mapping[str, Any]], steps: int, top: int = 25) -> Dict[str, Any]:
    """Per Python function of a trace recorded ``with_stack`` (category ``python_function``):
    its self time per step (its duration less that of the Python frames nested in it on the
    same thread), the ``top`` names by self time: where a step's host time goes between its
    CUDA calls. ``python_self``: name -> [calls per step, self µs per step], largest first."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    frames: Dict[Tuple[Any, Any], List[Tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() != "python_function":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
            continue
        frames.setdefault((e.get("pid"), e.get("tid")), []).append((float(ts), float(dur), str(e.get("name", "?"))))
    acc: Dict[str, List[float]] = {}
    for evs in frames.values():
        evs.sort(key=lambda f: (f[0], -f[1]))  # a parent before the children it encloses
        stack: List[List[Any]] = []  # [end, name, self µs]
        for ts, dur, name in evs:
            while stack and stack[-1][0] <= ts:
                _close(stack.pop(), acc)
            if stack:
                stack[-1][2] -= min(dur, stack[-1][0] - ts)
            stack.append([ts + dur, name, dur])
        while stack:
            _close(stack.pop(), acc)
    return dict(python_self=_per_step(acc, steps, top))


def _per_step(acc: Dict[str, List[float]], steps: int, top: int) -> Dict[str, List[float]]:
    """name -> [calls, µs] totals as [calls, µs] per step, the ``top`` names by time, largest first."""
    ranked = sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]
    return {k: [round(n / steps, 2), round(us / steps, 2)] for k, (n, us) in ranked}


def _close(frame: List[Any], acc: Dict[str, List[float]]) -> None:
    a = acc.setdefault(frame[1], [0.0, 0.0])
    a[0] += 1
    a[1] += max(0.0, frame[2])


def keep_trace(trace: Path, dest: Path) -> Path:
    """Copies a profiler trace to ``dest``, gzipped unless it is already."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = Path(trace).read_bytes()
    if not str(trace).endswith(".gz"):
        data = gzip.compress(data, compresslevel=6)
    dest.write_bytes(data)
    return dest


def idle_of_trace(path: Path, steps: int) -> Optional[Dict[str, Any]]:
    return idle_of_events(load_trace(path), steps)


def host_calls_of_trace(path: Path, steps: int) -> Dict[str, Any]:
    """``host_calls_of_events``, and ``python_self_times`` where the trace has Python frames."""
    events = load_trace(path)
    res = host_calls_of_events(events, steps)
    py = python_self_times(events, steps)
    if py["python_self"]:
        res.update(py)
    return res


def newest_trace(folder: Path) -> Optional[Path]:
    traces = sorted(Path(folder).glob("*.trace.json*"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None
