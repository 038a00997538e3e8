"""Percentiles of per-request latencies (TTFT, TPOT), as sglang.bench_serving reports them."""

from __future__ import annotations

from typing import Dict, Optional, Sequence


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default, as sglang.bench_serving
    reports); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = q / 100.0 * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_stats(prefix: str, values_s: Sequence[float]) -> Dict[str, Optional[float]]:
    """``{prefix}_p50_ms`` and ``{prefix}_p99_ms`` of latencies given in seconds."""
    ms = [v * 1e3 for v in values_s]
    return {f"{prefix}_p50_ms": _round(percentile(ms, 50)), f"{prefix}_p99_ms": _round(percentile(ms, 99))}


def _round(x: Optional[float], nd: int = 2) -> Optional[float]:
    return None if x is None else round(x, nd)
