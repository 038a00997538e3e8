"""The soak's report: figures, markdown and the JSON / markdown files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

from benchmark.harness.results import write_json, write_text
from benchmark.reliability.soak_load import ABORT_KINDS


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.2f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,d}"
    return str(x)


def figures(result: Dict[str, Any]) -> List[Tuple[str, Any]]:
    soak = result.get("soak") or {}
    g = (result.get("servers") or {}).get("granikv") or {}
    base = (result.get("servers") or {}).get("baseline") or {}
    gd = g.get("granikv_delta") or {}
    ev = g.get("evictions") or {}
    peaks = g.get("peaks") or {}
    ident = result.get("identity") or {}
    ab = soak.get("aborted_by_kind") or {}
    return [
        ("requests planned", (result.get("plan") or {}).get("requests")),
        ("requests sent", soak.get("sent")),
        ("requests served (complete output)", soak.get("served")),
        ("requests aborted", soak.get("aborted")),
        *[(f"  aborted: {k}", ab.get(k)) for k in ABORT_KINDS],
        ("  planned aborts that came after the end (counted served)", soak.get("abort_late")),
        ("errors (non-aborted requests)", soak.get("errors")),
        ("errors of aborted requests (failed /abort_request, unclean end)", soak.get("abort_errors")),
        ("server-side aborted requests (sglang:num_aborted_requests_total)",
         g.get("metrics_delta", {}).get("aborted_requests")),
        ("retracted requests (sglang:num_retracted_requests_total)",
         g.get("metrics_delta", {}).get("retracted_requests")),
        ("promotions", gd.get("promotions")),
        ("promotions skipped", gd.get("promotions_skipped")),
        ("HOT evictions (nodes)", ev.get("hot_evictions")),
        ("HOT evicted tokens", ev.get("hot_evicted_tokens")),
        ("COLD evicted tokens (sglang:evicted_tokens_total)", ev.get("cold_evicted_tokens")),
        ("HOT splits / compactions", f"{_fmt(gd.get('hot_splits'))} / {_fmt(gd.get('compactions'))}"),
        ("HOT peak occupancy (tokens / capacity)",
         f"{_fmt(peaks.get('hot_used_tokens'))} / {_fmt(g.get('hot_capacity'))}"),
        ("COLD peak occupancy incl. cache (tokens / capacity)",
         f"{_fmt(peaks.get('cold_used_tokens'))} / {_fmt(g.get('cold_capacity'))}"),
        ("KV used by requests, peak (/v1/loads num_used_tokens)", peaks.get("num_used_tokens")),
        ("peak running / waiting requests",
         f"{_fmt(peaks.get('num_running_reqs'))} / {_fmt(peaks.get('num_waiting_reqs'))}"),
        ("HOT hit rate (decode requests served from a HOT prefix)",
         ((g.get("granikv_after") or {}).get("attention") or {}).get("hot_hit_rate")),
        ("slots leaked (KV used at idle, after - before)", g.get("slots_leaked")),
        ("server log error lines", (g.get("log") or {}).get("errors")),
        ("identical outputs, GraniKV vs baseline (%)",
         (ident.get("granikv_post_vs_baseline") or {}).get("identical_pct")),
        ("identical outputs, baseline vs itself (%)",
         (ident.get("baseline_self") or {}).get("identical_pct")),
        ("identical outputs, GraniKV before vs after the soak (%)",
         (ident.get("granikv_pre_vs_post") or {}).get("identical_pct")),
        ("soak outputs (under load) vs baseline, common prefix identical (%)",
         (ident.get("soak_vs_baseline") or {}).get("identical_pct")),
        ("soak duration (s)", soak.get("seconds")),
        ("throughput (requests/s, output tok/s)",
         f"{_fmt(soak.get('requests_per_s'))}, {_fmt(soak.get('out_tok_per_s'))}"),
        ("TTFT p50 / p99 (ms), served", f"{_fmt(soak.get('ttft_p50_ms'))} / {_fmt(soak.get('ttft_p99_ms'))}"),
        ("server start GraniKV / baseline (s)",
         f"{_fmt(g.get('ready_s'))} / {_fmt(base.get('ready_s'))}"),
        ("total wall time (s)", (result.get("durations") or {}).get("total_s")),
    ]


def markdown(result: Dict[str, Any]) -> str:
    meta = result.get("meta") or {}
    checks = result.get("checks") or []
    g = (result.get("servers") or {}).get("granikv") or {}
    ok = result.get("ok")
    lines = [
        f"# GraniKV soak: {'PASS' if ok else 'FAIL'}",
        "",
        f"Date {meta.get('date', '?')}, {meta.get('gpu') or 'GPU ?'}, SGLang {meta.get('sglang') or '?'}, "
        f"model {meta.get('model')} (dummy weights), backend {meta.get('backend')}. "
        f"KV budget {_fmt((meta.get('kv_budget') or {}).get('slots'))} slots = HOT "
        f"{_fmt((meta.get('kv_budget') or {}).get('hot'))} + COLD "
        f"{_fmt((meta.get('kv_budget') or {}).get('cold'))}; concurrency {meta.get('concurrency')}, "
        f"abort fraction {meta.get('abort_frac')}, seed {meta.get('seed')}.",
        "",
        f"    {meta.get('command', '')}",
        "",
        "| figure | value |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {_fmt(value)} |" for name, value in figures(result)]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'pass' if c['ok'] else '**FAIL**'} | {c['detail']} |" for c in checks]
    if result.get("failure"):
        lines += ["", "Run failure:", ""] + [f"    {s}" for s in str(result["failure"]).splitlines()]
    errs = (result.get("soak") or {}).get("error_examples") or []
    if errs:
        lines += ["", "Failed requests (first 20):", ""] + [f"- `{e}`" for e in errs[:20]]
    for title, key in (("while serving", "error_lines"), ("while starting (not counted)",
                                                         "startup_error_lines")):
        log_lines = (g.get("log") or {}).get(key) or []
        if log_lines:
            lines += ["", f"GraniKV server log, error lines {title} (first 30):", ""]
            lines += [f"    {s}" for s in log_lines[:30]]
    lines += ["", "Server commands:", ""]
    for name, cmd in (meta.get("server_commands") or {}).items():
        lines.append(f"- {name}: `{cmd}`")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str, result: Dict[str, Any], *, stem: str = "soak") -> List[Path]:
    out = Path(out_dir)
    return [write_json(out / f"{stem}.json", result), write_text(out / f"{stem}.md", markdown(result))]


def summary_lines(result: Dict[str, Any]) -> List[str]:
    lines = [f"{name:62s} {_fmt(value)}" for name, value in figures(result)]
    lines.append("")
    for c in result.get("checks") or []:
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    lines.append(f"RESULT: {'PASS' if result.get('ok') else 'FAIL'}")
    return lines
