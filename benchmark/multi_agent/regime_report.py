"""Regime benchmark report: rows from the engines' records, merge of partial runs, md and png.

Pure (no GPU): regimes.py calls :func:`write` after every record; ``regimes --merge`` calls
:func:`merge_docs` on the partial JSONs of several invocations (one per backend or model
subset) and writes docs/results/regimes.{json,md,png}.

Records (the children's output, see regimes.py)::

    {"kind": "row", "model": ..., "backend": ..., "config": "baseline" | "granikv",
     "regime": ..., "variant": "main" | "ceiling", "out_tok_per_s": ..., "params": {...},
     "granikv": {...} | null, "granikv_delta": {...} | null, ...}
    {"kind": "info", "model": ..., "backend": ..., "config": ..., "max_total_num_tokens": ...}
    {"kind": "error", "model": ..., "backend": ..., "config": ..., "error": "..."}

One row per (model, backend, regime): ``baseline_out_tok_s`` / ``granikv_out_tok_s`` and their
``speedup``; ``also_stock`` (``regimes --also-stock``): per other backend B, its stock engine's
``out_tok_s``, ``spread``, ``vs_stock`` (÷ the row's stock engine) and ``granikv_speedup``
(GraniKV ÷ stock B); ``also_granikv`` (``regimes --also-granikv``): per variant NAME, its
GraniKV engine's ``out_tok_s``, ``spread``, ``speedup`` (÷ the stock engine), ``vs_granikv`` (÷
the main GraniKV engine), plan times, steady replays and decode paths; ``ceiling_out_tok_s`` (the same workload with its prefixes cut to 256 tokens, stock
engine; the row's own stock figure where it has no prefix longer than that); ``floor_speedup``
/ ``floor_fraction`` (bounds.py); ``plan_us_p50`` / ``plan_us_p99`` as the GraniKV engine's
snapshot reports them after the row (None when it does not) with the exact mean of the row's
own decode steps beside them; the dispatch paths the row's decode steps took, the extend
batches left stock and the skipped promotions, each with its reason and count.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmark.harness.records import commands_of, merge_records
from benchmark.harness.results import pyplot, write_json, write_text
from benchmark.multi_agent import bounds
from granikv.attention.step_stats import PlanTimeHistogram

quantile_us = PlanTimeHistogram.quantile_us

SIDE_KEYS = ("seconds", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "kv_used_tokens_peak",
             "repeats_out_tok_s")
SPEEDUP_MIN, NO_PAY_MIN, NO_PAY_FLOOR, FLOOR_FRACTION_MIN = 0.97, 0.99, 1.05, 0.90
PLAN_P50_MAX_US, PLAN_P99_MAX_US = 30.0, 80.0
IDLE_SLACK_US = 5.0  # GraniKV's GPU idle per decode step may exceed stock's by this much
MIN_REPLAY_GAPS = 16  # replay gaps per engine for idle_basis to judge a row by them
TIMED_SPAN_MAX = 1.15  # an engine's TPOT p50 over its probed step above this: prefill shares the decode's steps
SPREAD_MAX = 0.01  # the stock engine's own spread a no-pay row's verdict can rest on
POOL_TOLERANCE = 0.01  # stock and GraniKV KV pools differing more than this: the row compares nothing
STOCK_PREFIX = "stock_"  # config of an --also-stock engine: stock_<backend> (regimes.also_stock_config)
GRANIKV_PREFIX = "granikv_"  # config of an --also-granikv engine: granikv_<name> (regimes.also_granikv_name)


def find_key(d: Any, key: str) -> Optional[Any]:
    """The first value of ``key`` in a nested dict (depth first: top level, then children)."""
    if not isinstance(d, Mapping):
        return None
    if key in d:
        return d[key]
    for v in d.values():
        found = find_key(v, key)
        if found is not None:
            return found
    return None


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _ratio(a: Optional[float], b: Optional[float], nd: int = 4) -> Optional[float]:
    return round(a / b, nd) if a and b else None


def granikv_facts(rec: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """What the GraniKV engine said about a row (read defensively: any key may be missing)."""
    after = (rec or {}).get("granikv") or {}
    delta = (rec or {}).get("granikv_delta") or {}
    att = delta.get("attention") if isinstance(delta.get("attention"), Mapping) else {}
    steps, total = _num(att.get("planned_steps")), _num(att.get("plan_us_total"))
    window = _num(find_key(after, "plan_window_steps"))
    hist = att.get("plan_us_hist") if isinstance(att.get("plan_us_hist"), Mapping) else None
    p50, p99 = (quantile_us(hist, 50), quantile_us(hist, 99)) if hist else (None, None)
    per_step = (lambda us: round(us / steps, 2) if steps and _num(us) is not None else None)
    sections = att.get("plan_sections_us_total") if isinstance(att.get("plan_sections_us_total"), Mapping) else {}
    return dict(
        # the row's own decode steps (bucket deltas of the cumulative histogram) where the engine
        # exports one; else the engine's recent-steps window, which may span earlier rows
        plan_us_p50=round(p50, 2) if p50 is not None else _num(find_key(after, "plan_us_p50")),
        plan_us_p99=round(p99, 2) if p99 is not None else _num(find_key(after, "plan_us_p99")),
        plan_us_mean_row=per_step(total),
        plan_cpu_us_mean_row=per_step(att.get("plan_cpu_us_total")),
        plan_sections_us_mean_row={k: per_step(v) for k, v in sections.items()},
        plan_percentiles_of="row" if p50 is not None else "engine window",
        plan_window_steps=window,
        plan_window_only_this_row=(True if p50 is not None else
                                   None if window is None or steps is None else steps >= window),
        decode_steps=att.get("decode_steps"),
        steady_replays=att.get("steady_replays"),  # decode steps planned from the previous one (steady_step)
        dispatch_paths={k: v for k, v in (att.get("steps_per_path") or {}).items() if v},
        extend_fallbacks={k: v for k, v in (att.get("extend_fallbacks") or {}).items() if v},
        decode_paged_reasons={k: v for k, v in (att.get("decode_paged_reasons") or {}).items() if v},
        extend_hot_batches=att.get("extend_hot_batches"),
        promotions=delta.get("promotions"),
        promotion_skips={k: v for k, v in (delta.get("skip_reasons") or {}).items() if v},
    )


def _rec_key(r: Mapping[str, Any]) -> Tuple:
    return (r.get("model"), r.get("backend"), r.get("regime"))


def assemble(records: Sequence[Mapping[str, Any]], meta: Optional[Mapping[str, Any]] = None) -> List[Dict[str, Any]]:
    """One row per (model, backend, regime) that has a stock or a GraniKV measurement, in the
    records' order, with the floor (bounds.annotate)."""
    sides: Dict[Tuple, Dict[Tuple[str, str], Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "row":
            sides.setdefault(_rec_key(r), {})[(r.get("config"), r.get("variant", "main"))] = r
    infos = {(r.get("model"), r.get("backend"), r.get("config")): r for r in records if r.get("kind") == "info"}
    rows = []
    for (model, backend, regime), by in sides.items():
        b, g = by.get(("baseline", "main")), by.get(("granikv", "main"))
        c = by.get(("baseline", "ceiling"))
        any_side = b or g or c
        if not (b or g):
            continue
        params = (b or g)["params"]
        b_tps = b["out_tok_per_s"] if b else None
        g_tps = g["out_tok_per_s"] if g else None
        own_ceiling = not any_side.get("has_ceiling", True)
        ceiling = c["out_tok_per_s"] if c else (b_tps if own_ceiling else None)
        row = dict(model=model, backend=backend, workload=regime, workload_kind=any_side.get("workload"),
                   priority=any_side.get("priority"), agents=any_side.get("agents"),
                   prefix_len=any_side.get("prefix_len"), turns=any_side.get("turns", 1), params=params,
                   baseline_out_tok_s=b_tps, granikv_out_tok_s=g_tps, speedup=_ratio(g_tps, b_tps),
                   ceiling_out_tok_s=ceiling, ceiling_is_row=own_ceiling,
                   ceiling_params=c.get("params") if c else None)
        for side in ("baseline", "granikv"):
            idle = by.get((side, "idle")) or {}
            row[f"gpu_idle_us_{side}"] = _num(idle.get("gpu_idle_us_per_step"))
            row[f"gpu_busy_us_{side}"] = _num(idle.get("gpu_busy_us_per_step"))
            gaps = idle.get("replay_gaps") or {}  # harness.replay_gaps: the probe run, by events
            row[f"replay_gap_us_{side}"] = _num(gaps.get("gap_us_p50"))
            row[f"replay_us_{side}"] = _num(gaps.get("replay_us_p50"))
            row[f"replay_gaps_{side}"] = gaps.get("gaps")
            host = by.get((side, "host"))
            if host is not None:  # --host-probe-steps: name -> [calls, µs] per decode step
                row[f"host_calls_{side}"] = host.get("host_calls")
        row["baseline_spread"] = spread(b)
        row["granikv_spread"] = spread(g)
        row["also_stock"] = {
            config[len(STOCK_PREFIX):]: dict(out_tok_s=r["out_tok_per_s"], spread=spread(r),
                                             vs_stock=_ratio(r["out_tok_per_s"], b_tps),
                                             granikv_speedup=_ratio(g_tps, r["out_tok_per_s"]))
            for (config, variant), r in by.items() if variant == "main" and config.startswith(STOCK_PREFIX)}
        row["also_granikv"] = {
            config[len(GRANIKV_PREFIX):]: variant_side(r, b_tps, g_tps)
            for (config, variant), r in by.items() if variant == "main" and config.startswith(GRANIKV_PREFIX)}
        row.update(granikv_facts(g))
        for side, r in (("baseline", b), ("granikv", g)):
            for k in SIDE_KEYS:
                row[f"{side}_{k}"] = r.get(k) if r else None
            row[f"{side}_kv_capacity_tokens"] = infos.get((model, backend, side), {}).get("max_total_num_tokens")
            row[f"gpu_idle_us_{side}_timed"] = timed_idle_us(row, side)
        row["gpu_idle_basis"] = idle_basis(row)
        rows.append(row)
    return bounds.annotate(dict(meta=dict(meta or {}, tp=1), rows=rows))


def variant_side(rec: Mapping[str, Any], b_tps: Optional[float], g_tps: Optional[float]) -> Dict[str, Any]:
    """An ``--also-granikv`` engine's figures on a row: tok/s, spread, its ratio to the stock and
    to the main GraniKV engine, and what it said of its decode steps (``granikv_facts``)."""
    facts = granikv_facts(rec)
    tps = rec["out_tok_per_s"]
    return dict(out_tok_s=tps, spread=spread(rec), speedup=_ratio(tps, b_tps), vs_granikv=_ratio(tps, g_tps),
                **{k: facts[k] for k in ("plan_us_p50", "plan_us_p99", "plan_us_mean_row", "steady_replays",
                                         "dispatch_paths", "decode_paged_reasons")})


def spread(rec: Optional[Mapping[str, Any]]) -> Optional[float]:
    """Relative spread of one engine's repeats of a row, (max - min) / median of their tok/s;
    None with fewer than two repeats."""
    reps = [x for x in ((rec or {}).get("repeats_out_tok_s") or []) if _num(x)]
    if len(reps) < 2:
        return None
    median = statistics.median(reps)
    return round((max(reps) - min(reps)) / median, 4) if median else None


def timed_idle_us(row: Mapping[str, Any], side: str) -> Optional[float]:
    """The GPU's idle time per decode step of the TIMED run, estimated: the engine's TPOT p50
    there (the run's mean step) less the GPU busy time per step of its idle probe (kernel time,
    which the profiler does not stretch), whose window sits at the middle of the decode, where
    the step is the run's mean (``EngineChild.idle_probe``). The probe's own idle time comes from
    a profiled run, whose host work the profiler can slow by more than the difference being
    measured (a 4-layer forest on an H100: GraniKV's probed step 4.1 ms against its timed
    2.9 ms); None without both figures. Rows probed at the first token (before the window
    moved to the middle) understate the busy time by the step's growth over the run, by more
    for GraniKV, whose step grows faster in proportion (its prefix reads do not grow)."""
    tpot, busy = _num(row.get(f"{side}_tpot_p50_ms")), _num(row.get(f"gpu_busy_us_{side}"))
    return None if tpot is None or busy is None else round(tpot * 1000.0 - busy, 1)


def pools_differ(caps: Mapping[str, Any]) -> bool:
    """Whether engines' KV pools (tokens; None: unknown) differ by more than POOL_TOLERANCE."""
    known = [int(c) for c in caps.values() if _num(c)]
    return len(known) > 1 and min(known) < (1.0 - POOL_TOLERANCE) * max(known)


def idle_basis(row: Mapping[str, Any]) -> Optional[str]:
    """Which idle figures a row is judged by: "replay" (``replay_gap_us``: the stream's time
    between two consecutive decode replays, p50, timed by CUDA events over the probe run outside
    its profiled steps) where both engines have at least MIN_REPLAY_GAPS of them: nothing
    stretches either engine's host there and no prefill chunk is counted, so it is preferred
    to both estimates below; a gap also holds the GPU work between replays, so it bounds the
    idle time from above. Else "timed" (``timed_idle_us``) where both engines have
    one and the timed run's step is the step the probe saw, "probe" (the profiled run's own
    idle time) otherwise, None without figures. The profiler can stretch one engine's host work
    and not the other's, which the timed estimate does not see. But the timed estimate reads
    TPOT p50, which holds prefill chunks where they share the decode's steps (rows with few
    output tokens behind long prompts: stock's TPOT p50 then exceeds its probed step, busy plus
    idle, by more than TIMED_SPAN_MAX; 1.5x on 32-layer short1k_3sharers, where the estimate
    reads 6-7 ms of idle time per step). The same holds for GraniKV's side: its decode step is
    the shorter one on a sharing row, so the same prefill chunks weigh more in its TPOT (1.16-1.23x
    on sharing rows of three models, where its estimate read 1.9-3.0 ms of idle time per step
    against its probe's 0.25-0.49 ms). Either side above TIMED_SPAN_MAX sets the estimate aside."""
    if all((row.get(f"replay_gaps_{side}") or 0) >= MIN_REPLAY_GAPS
           and row.get(f"replay_gap_us_{side}") is not None for side in ("baseline", "granikv")):
        return "replay"
    gb, gg = row.get("gpu_idle_us_baseline_timed"), row.get("gpu_idle_us_granikv_timed")
    if gb is not None and gg is not None:
        if all(_within_probed_span(row, side) for side in ("baseline", "granikv")):
            return "timed"
    if row.get("gpu_idle_us_baseline") is not None and row.get("gpu_idle_us_granikv") is not None:
        return "probe"
    return None


def _within_probed_span(row: Mapping[str, Any], side: str) -> bool:
    """Whether ``side``'s TPOT p50 is at most TIMED_SPAN_MAX times its probed step (busy plus
    idle): its TPOT holds little besides decode steps (True when a figure is missing)."""
    tpot, busy, idle = (_num(row.get(f"{side}_tpot_p50_ms")), _num(row.get(f"gpu_busy_us_{side}")),
                        _num(row.get(f"gpu_idle_us_{side}")))
    return tpot is None or busy is None or idle is None or tpot * 1000.0 <= TIMED_SPAN_MAX * (busy + idle)


def gpu_waits_not(row: Mapping[str, Any]) -> bool:
    """Measured evidence that the GPU does not wait on GraniKV's planning: its idle time per
    decode step is within the stock engine's + IDLE_SLACK_US on the same row, by the figures
    ``idle_basis`` picks."""
    basis = idle_basis(row)
    if basis is None:
        return False
    key = {"replay": "replay_gap_us_{}", "timed": "gpu_idle_us_{}_timed", "probe": "gpu_idle_us_{}"}[basis]
    return row[key.format("granikv")] <= row[key.format("baseline")] + IDLE_SLACK_US


def verdicts(row: Mapping[str, Any]) -> List[str]:
    """The targets a row misses (empty when it meets every one it can be judged on)."""
    out = []
    s, fs, ff = row.get("speedup"), row.get("floor_speedup"), row.get("floor_fraction")
    if s is not None and s < SPEEDUP_MIN:
        out.append(f"speedup < {SPEEDUP_MIN}")
    if s is not None and fs is not None and fs <= NO_PAY_FLOOR and s < NO_PAY_MIN:
        out.append(f"no-pay row < {NO_PAY_MIN}")
    if ff is not None and fs is not None and fs > NO_PAY_FLOOR and ff < FLOOR_FRACTION_MIN:
        out.append(f"floor_fraction < {FLOOR_FRACTION_MIN}")
    sp = row.get("baseline_spread")
    if sp is not None and fs is not None and fs <= NO_PAY_FLOOR and sp > SPREAD_MAX:
        out.append(f"baseline_spread > {SPREAD_MAX:g}")
    cb, cg = row.get("baseline_kv_capacity_tokens"), row.get("granikv_kv_capacity_tokens")
    if pools_differ(dict(baseline=cb, granikv=cg)):  # not the same workload
        out.append(f"KV pools differ ({int(cb)} / {int(cg)} tokens)")
    p50, p99 = row.get("plan_us_p50"), row.get("plan_us_p99")
    if not gpu_waits_not(row):  # planning counts only where the GPU may be waiting on it
        if p50 is not None and p50 > PLAN_P50_MAX_US:
            out.append(f"plan p50 > {PLAN_P50_MAX_US:g} us")
        if p99 is not None and p99 > PLAN_P99_MAX_US:
            out.append(f"plan p99 > {PLAN_P99_MAX_US:g} us")
    return out


def summary(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Worst speedup, the no-pay rows' worst and median, worst floor fraction of sharing rows."""
    sp = [r for r in rows if r.get("speedup") is not None]
    no_pay = sorted(r["speedup"] for r in sp if r.get("floor_speedup") is not None
                    and r["floor_speedup"] <= NO_PAY_FLOOR)
    frac = [r for r in sp if r.get("floor_fraction") is not None and (r.get("floor_speedup") or 0) > NO_PAY_FLOOR]

    def worst(sel, key):
        r = min(sel, key=lambda r: r[key], default=None)
        return None if r is None else dict(row=f"{r['model']}/{r['backend']}/{r['workload']}", value=r[key])

    median = None
    if no_pay:
        m = len(no_pay) // 2
        median = no_pay[m] if len(no_pay) % 2 else (no_pay[m - 1] + no_pay[m]) / 2
    return dict(rows=len(rows), measured=len(sp), worst_speedup=worst(sp, "speedup"),
                no_pay_rows=len(no_pay), no_pay_median_speedup=median,
                worst_floor_fraction=worst(frac, "floor_fraction"),
                rows_missing_a_target=sum(1 for r in sp if verdicts(r)))


# ---- markdown ------------------------------------------------------------------------------


def _f(x: Any, fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _counts(d: Optional[Mapping[str, Any]]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items(), key=lambda kv: -kv[1])) or "–"


def also_stock_backends(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """The ``--also-stock`` backends any row was measured on, in first-appearance order."""
    return list(dict.fromkeys(b for r in rows for b in (r.get("also_stock") or {})))


def also_granikv_names(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    """The ``--also-granikv`` variants any row was measured on, in first-appearance order."""
    return list(dict.fromkeys(n for r in rows for n in (r.get("also_granikv") or {})))


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    others, variants = also_stock_backends(rows), also_granikv_names(rows)
    extra = "".join(f"| stock {b} tok/s (÷ stock) | GraniKV ÷ stock {b} " for b in others)
    extra += "".join(f"| GraniKV {n} tok/s (÷ stock) | {n} ÷ GraniKV | {n} spread | {n} plan µs p50 / p99 "
                     f"| {n} decode paths " for n in variants)
    head = ("| model | backend | workload | agents | stock tok/s | GraniKV tok/s | speedup | stock spread " + extra +
            "| ceiling tok/s "
            "| floor_speedup | floor_fraction | plan µs p50 / p99 (row mean) | GPU idle µs/step stock / GraniKV "
            "(timed: TPOT p50 - GPU busy; replay gap: between decode replays, by events) "
            "| decode paths | extend left stock "
            "| targets missed |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        plan = f"{_f(r.get('plan_us_p50'), '{:.0f}')} / {_f(r.get('plan_us_p99'), '{:.0f}')} " \
               f"({_f(r.get('plan_us_mean_row'), '{:.0f}')})"
        reason = f" ({r['floor_reason']})" if r.get("floor_reason") else ""
        lines.append("| " + " | ".join([
            r["model"], r["backend"], r["workload"], _f(r.get("agents")), _f(r.get("baseline_out_tok_s")),
            _f(r.get("granikv_out_tok_s")), _f(r.get("speedup"), "{:.3f}x"),
            _f(r.get("baseline_spread"), "{:.1%}"),
            *[cell for b in others for cell in _also_stock_cells((r.get("also_stock") or {}).get(b))],
            *[cell for n in variants for cell in _also_granikv_cells((r.get("also_granikv") or {}).get(n))],
            _f(r.get("ceiling_out_tok_s")) + (" (row)" if r.get("ceiling_is_row") else ""),
            _f(r.get("floor_speedup"), "{:.2f}x") + reason, _f(r.get("floor_fraction"), "{:.0%}"), plan,
            f"{_f(r.get('gpu_idle_us_baseline'), '{:.0f}')} / {_f(r.get('gpu_idle_us_granikv'), '{:.0f}')}"
            + _timed_idle_cell(r) + _replay_gap_cell(r),
            _counts(r.get("dispatch_paths")), _counts(r.get("extend_fallbacks")),
            "; ".join(verdicts(r)) or "–",
        ]) + " |")
    return "\n".join(lines)


def _timed_idle_cell(r: Mapping[str, Any]) -> str:
    """`` (timed B / G)``: ``timed_idle_us`` of both engines, where the row has them; with
    ``, judged by the probe`` where ``idle_basis`` sets them aside."""
    b, g = r.get("gpu_idle_us_baseline_timed"), r.get("gpu_idle_us_granikv_timed")
    if b is None and g is None:
        return ""
    aside = ", judged by the probe" if idle_basis(r) == "probe" else ""
    return f" (timed {_f(b, '{:.0f}')} / {_f(g, '{:.0f}')}{aside})"


def _replay_gap_cell(r: Mapping[str, Any]) -> str:
    """`` [replay gap B / G]``: ``replay_gap_us`` p50 of both engines, where the row has them."""
    b, g = r.get("replay_gap_us_baseline"), r.get("replay_gap_us_granikv")
    if b is None and g is None:
        return ""
    judged = ", judged by it" if idle_basis(r) == "replay" else ""
    return f" [replay gap {_f(b, '{:.0f}')} / {_f(g, '{:.0f}')}{judged}]"


def _also_stock_cells(side: Optional[Mapping[str, Any]]) -> List[str]:
    side = side or {}
    return [f"{_f(side.get('out_tok_s'))} ({_f(side.get('vs_stock'), '{:.3f}x')})",
            _f(side.get("granikv_speedup"), "{:.3f}x")]


def _also_granikv_cells(side: Optional[Mapping[str, Any]]) -> List[str]:
    side = side or {}
    return [f"{_f(side.get('out_tok_s'))} ({_f(side.get('speedup'), '{:.3f}x')})",
            _f(side.get("vs_granikv"), "{:.3f}x"), _f(side.get("spread"), "{:.1%}"),
            f"{_f(side.get('plan_us_p50'), '{:.0f}')} / {_f(side.get('plan_us_p99'), '{:.0f}')}",
            _counts(side.get("dispatch_paths"))]


def markdown(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
             meta: Mapping[str, Any], png: Optional[str]) -> str:
    infos = [r for r in records if r.get("kind") == "info"]
    errors = [r for r in records if r.get("kind") == "error"]
    gpus = sorted({str(i.get("gpu")) for i in infos if i.get("gpu")})
    version = next((i.get("version") for i in infos if i.get("version")), "?")
    s = summary(rows)
    out = ["# Regime benchmark: where sharing pays and where it must cost nothing", "",
           f"GPU: {', '.join(gpus) or 'unknown'}; SGLang {version}; dummy bf16 weights; "
           f"dates: {', '.join(meta.get('dates') or [str(meta.get('date'))])}.", "",
           "Each row runs its workload on the stock engine and on the GraniKV engine of the same "
           "(model, backend), and its ceiling (the same workload with every shared prefix cut to "
           "256 tokens) on the stock engine; both engines are up side by side and take turns per "
           "repeat; `stock spread` = (max - min) / median of the stock engine's repeats of the row; "
           "`floor_speedup` = the `bounds.py` floor's tok/s ÷ "
           "stock tok/s, `floor_fraction` = GraniKV tok/s ÷ the floor's. Targets: every row "
           f"≥ {SPEEDUP_MIN}x; rows with floor_speedup ≤ {NO_PAY_FLOOR} ≥ {NO_PAY_MIN}x (median ≥ 1.00x); "
           f"sharing rows ≥ {FLOOR_FRACTION_MIN:.0%} of their floor; planning ≤ {PLAN_P50_MAX_US:g} µs "
           f"p50 and ≤ {PLAN_P99_MAX_US:g} µs p99 (the row's own decode steps, from the engine's "
           "plan-time histogram; the row's mean beside it). How the grid was chosen: benchmark/multi_agent/regime_grid.py.",
           "", "Commands:", ""]
    out += [f"    {c}" for c in meta.get("commands") or [meta.get("command")] if c]
    out += ["", markdown_table(rows), ""]
    ws, wf = s["worst_speedup"], s["worst_floor_fraction"]
    out.append(f"Summary: {s['measured']} of {s['rows']} rows measured on both engines; worst speedup "
               f"{_f(ws and ws['value'], '{:.3f}x')} ({ws and ws['row']}); rows where sharing cannot pay: "
               f"{s['no_pay_rows']}, median {_f(s['no_pay_median_speedup'], '{:.3f}x')}; worst floor fraction of "
               f"a sharing row {_f(wf and wf['value'], '{:.0%}')} ({wf and wf['row']}); rows missing a target: "
               f"{s['rows_missing_a_target']}.")
    if png:
        out += ["", f"![speedup against floor_speedup]({png})"]
    pools = [f"- {m}: {p['tokens']} KV tokens per engine (the grid's cap, {p['cap']}, does not fit the "
             f"model's engines side by side with {p['free_gib']} GiB free)"
             for m, p in (meta.get("pool_fitted") or {}).items()]
    pools += [f"- {m}: restarted at {p['tokens']} KV tokens per engine (SGLang gave {p['profiled']})"
              for m, p in (meta.get("pool_equalized") or {}).items()]
    if pools:
        out += ["", "KV pools lowered to fit this GPU (every engine of a model at the same size):", ""] + pools
    skipped = meta.get("skipped") or []
    if skipped:
        out += ["", "Not run (time budget):", ""] + [f"- {k}: {why}" for k, why in skipped]
    if errors:
        out += ["", "Errors:", ""] + [f"- {e.get('model')}/{e.get('backend')}/{e.get('config')}: {e.get('error')}"
                                      for e in errors]
    return "\n".join(out) + "\n"


# ---- plot ----------------------------------------------------------------------------------


def plot(rows: Sequence[Mapping[str, Any]], path: Path, *, quiet: bool = False) -> bool:
    """Speedup against floor_speedup, one point per row (marker per backend, colour per model),
    the y = x line (the floor) and y = 1 (stock). False when matplotlib is missing."""
    pts = [r for r in rows if r.get("speedup") is not None and r.get("floor_speedup") is not None]
    plt = pyplot(quiet, str(path))
    if plt is None or not pts:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 6))
    models = list(dict.fromkeys(r["model"] for r in pts))
    markers = {"flashinfer": "o", "triton": "s", "fa3": "^"}
    for i, m in enumerate(models):
        for backend, mk in markers.items():
            sel = [r for r in pts if r["model"] == m and r["backend"] == backend]
            if sel:
                ax.scatter([r["floor_speedup"] for r in sel], [r["speedup"] for r in sel], marker=mk,
                           color=f"C{i}", label=f"{m}, {backend}", alpha=0.85)
    top = max(max(r["floor_speedup"] for r in pts), max(r["speedup"] for r in pts)) * 1.05
    ax.plot([1, top], [1, top], "k--", lw=1, label="at the floor")
    ax.axhline(1.0, color="grey", lw=1)
    ax.axhline(SPEEDUP_MIN, color="red", lw=0.8, ls=":", label=f"{SPEEDUP_MIN}x stock")
    ax.set_xlabel("floor_speedup (bounds.py floor ÷ stock)")
    ax.set_ylabel("speedup (GraniKV ÷ stock)")
    ax.set_title("Regime grid: GraniKV against its floor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- files ---------------------------------------------------------------------------------


def write(out_dir: str, stem: str, records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], *,
          quiet: bool = False, png: bool = True) -> List[Path]:
    """Writes ``stem``.json (meta, summary, rows, measurements) and .md; with ``png``, the plot
    too when matplotlib is there (the run leaves it to its final write)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = assemble(records, meta)
    png_path = out / f"{stem}.png"
    have_png = plot(rows, png_path, quiet=quiet) if rows and png else False
    paths = [write_json(out / f"{stem}.json", dict(meta=dict(meta), summary=summary(rows), rows=rows,
                                                   measurements=list(records))),
             write_text(out / f"{stem}.md", markdown(rows, records, meta, png_path.name if have_png else None))]
    return paths + ([png_path] if have_png else [])


def merge_docs(docs: Sequence[Mapping[str, Any]]) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Measurements and meta of several partial runs (a later file wins for the same row)."""
    records = merge_records((d.get("measurements", []) for d in docs),
                            row_key=lambda r: (r.get("config"), r.get("variant")) + _rec_key(r),
                            info_key=lambda r: (r.get("model"), r.get("backend"), r.get("config")))
    metas = [d.get("meta", {}) for d in docs]
    dates = [d for m in metas for d in (m.get("dates") or [m.get("date")]) if d]
    skipped = [s for m in metas for s in (m.get("skipped") or [])]
    done = {(r.get("model"), r.get("regime")) for r in records if r.get("kind") == "row"}
    skipped = [s for s in skipped if tuple(s[0].split("/", 1)) not in done]
    meta = dict(commands=commands_of(metas), dates=list(dict.fromkeys(dates)),
                backends=sorted({b for m in metas for b in (m.get("backends") or [m.get("backend")]) if b}),
                skipped=skipped, **{key: {k: v for m in metas for k, v in (m.get(key) or {}).items()}
                                    for key in ("engine_kwargs", "pool_fitted", "pool_equalized", "also_granikv")})
    return records, meta
