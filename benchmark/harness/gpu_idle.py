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
either end adds at most one step's gap. Stdlib only.
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


def idle_of_trace(path: Path, steps: int) -> Optional[Dict[str, Any]]:
    return idle_of_events(load_trace(path), steps)


def newest_trace(folder: Path) -> Optional[Path]:
    traces = sorted(Path(folder).glob("*.trace.json*"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None
