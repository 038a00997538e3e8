"""GraniKV's counters as an engine or server reports them, and their increase over a row."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

NON_ADDITIVE = ("_mean", "_max", "_rate", "_per_step", "_p50", "_p99", "_window_steps")  # ratios, extremes,
# percentiles and window sizes: their difference means nothing


def granikv_of(server_info: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """GraniKV's counters in a server info (``Engine.get_server_info()`` or ``/server_info``):
    top level, else the first scheduler's ``internal_states[i]["granikv"]``; None without them
    (a stock engine)."""
    if isinstance(server_info.get("granikv"), dict):
        return server_info["granikv"]
    for state in server_info.get("internal_states") or []:
        if isinstance(state, dict) and isinstance(state.get("granikv"), dict):
            return state["granikv"]
    return None


def counter_delta(after: Mapping[str, Any], before: Mapping[str, Any]) -> Dict[str, Any]:
    """after - before for every numeric leaf (nested dicts recursed); other leaves dropped, and
    so are means, maxima and rates (``NON_ADDITIVE``, ``max_*``): a row's mean comes from the
    totals' deltas, e.g. ``attention.plan_us_total / attention.planned_steps``."""
    out: Dict[str, Any] = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = counter_delta(v, b if isinstance(b, dict) else {})
        elif k.endswith(NON_ADDITIVE) or k.startswith("max_"):
            continue
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v - (b if isinstance(b, (int, float)) and not isinstance(b, bool) else 0)
    return out
