"""The soak's checks: the server log scan, output comparisons, counter deltas and the verdicts.

Pure (no server): ``evaluate`` turns a soak result into one pass/fail line per check.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from benchmark.harness.server_proc import read_log
from benchmark.reliability.soak_client import EDGE_CASES


# Server log lines that count as errors (SGLang prints no level name: match the message).
LOG_ERROR_RE = re.compile(
    r"Traceback|Exception|[A-Za-z]Error\b|\bERROR\b|Error:|memory leak|leak detected|"
    r"CUDA error|out of memory|Health check failed|IntegrityError|Segmentation fault|core dumped")
LOG_WARNING_RE = re.compile(r"\bWARNING\b|[Ww]arning")
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests")
GRANIKV_LOG_RE = re.compile(r"GraniKV: hot (\d+)/(\d+) .*?cold (\d+)/(\d+)")
TOKEN_USAGE_RE = re.compile(r"Decode batch.*?token usage: ([0-9.]+)")


def scan_log(lines: Iterable[str], ignore: Sequence[str] = (), *, first_line: int = 1) -> Dict[str, Any]:
    """Error lines (LOG_ERROR_RE, minus ``ignore`` regexes), warnings, retractions, and the
    peaks GraniKV's periodic metrics line and SGLang's decode line report. ``first_line``: the
    file line number of the first line given (for the listing)."""
    ignore_re = [re.compile(p) for p in ignore]
    errors: List[Tuple[int, str]] = []
    ignored = warnings = retractions = 0
    hot_peak = cold_peak = hot_cap = cold_cap = 0
    usage_peak = 0.0
    for n, line in enumerate(lines, first_line):
        line = line.rstrip("\n")
        if LOG_ERROR_RE.search(line):
            if any(p.search(line) for p in ignore_re):
                ignored += 1
            else:
                errors.append((n, line[:400]))
        elif LOG_WARNING_RE.search(line):
            warnings += 1
        if RETRACT_RE.search(line):
            retractions += 1
        m = GRANIKV_LOG_RE.search(line)
        if m:
            hot_peak, hot_cap = max(hot_peak, int(m[1])), int(m[2])
            cold_peak, cold_cap = max(cold_peak, int(m[3])), int(m[4])
        m = TOKEN_USAGE_RE.search(line)
        if m:
            usage_peak = max(usage_peak, float(m[1]))
    return dict(error_lines=[f"{n}: {s}" for n, s in errors], errors=len(errors),
                ignored=ignored, warnings=warnings, retractions=retractions,
                granikv_hot_peak=hot_peak, granikv_hot_capacity=hot_cap,
                granikv_cold_peak=cold_peak, granikv_cold_capacity=cold_cap,
                decode_token_usage_peak=usage_peak)


def compare_outputs(a: Sequence[Optional[Sequence[int]]], b: Sequence[Optional[Sequence[int]]],
                    *, prefix: bool = False) -> Dict[str, Any]:
    """Identical sequences (``prefix``: on the first min(len) tokens) and token agreement (the
    share of tokens before each pair's first divergence). Missing outputs count as different."""
    n = identical = same_tok = total_tok = 0
    for x, y in zip(a, b):
        n += 1
        if x is None or y is None:
            total_tok += max(len(x or ()), len(y or ()), 1)
            continue
        if prefix:
            k = min(len(x), len(y))
            x, y = list(x)[:k], list(y)[:k]
        i = 0
        while i < min(len(x), len(y)) and x[i] == y[i]:
            i += 1
        same_tok += i
        total_tok += max(len(x), len(y))
        identical += list(x) == list(y)
    return dict(n=n, identical=identical,
                identical_pct=round(100.0 * identical / n, 2) if n else None,
                token_agreement_pct=round(100.0 * same_tok / total_tok, 2) if total_tok else None)


def evaluate(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Pass/fail of each requirement of the soak from the collected result."""
    soak = result.get("soak") or {}
    g = (result.get("servers") or {}).get("granikv") or {}
    ident = result.get("identity") or {}
    checks = []

    def add(name: str, ok: bool, detail: str) -> None:
        checks.append(dict(name=name, ok=bool(ok), detail=detail))

    planned = (result.get("plan") or {}).get("requests", 0)
    add("all planned requests sent", soak.get("sent", 0) >= planned > 0,
        f"{soak.get('sent', 0):,d} of {planned:,d}")
    add("no failed request", soak.get("sent", 0) > 0 and soak.get("errors", 1) == 0,
        f"{soak.get('errors', 'n/a')} errors among non-aborted requests")
    add("aborts handled cleanly", soak.get("sent", 0) > 0 and soak.get("abort_errors", 1) == 0,
        f"{soak.get('abort_errors', 'n/a')} aborted requests with a failed /abort_request or an "
        f"unclean stream end")
    h = g.get("health") or {}
    add("server healthy after the soak",
        h.get("alive") and h.get("health") == 200 and h.get("health_generate") == 200,
        f"alive={h.get('alive')} /health={h.get('health')} "
        f"/health_generate={h.get('health_generate')}")
    leak = g.get("slots_leaked")
    add("KV back to the idle level (slots leaked = 0)", leak == 0,
        f"used at idle {g.get('idle_before', {}).get('num_used_tokens')} before, "
        f"{g.get('idle_after', {}).get('num_used_tokens')} after: leaked {leak}")
    pf = g.get("post_flush") or {}
    add("flush_cache frees every slot", pf.get("flushed") and pf.get("num_used_tokens") == 0
        and pf.get("hot_used_tokens") in (0, None) and pf.get("cold_used_tokens") in (0, None),
        f"flushed={pf.get('flushed')} used={pf.get('num_used_tokens')} "
        f"hot={pf.get('hot_used_tokens')} cold={pf.get('cold_used_tokens')}")
    log = g.get("log") or {}
    add("no error in the server log", log.get("errors", 1) == 0 and log.get("scanned"),
        f"{log.get('errors', 'n/a')} error lines while serving ({log.get('ignored', 0)} ignored; "
        f"{log.get('startup_errors', 'n/a')} more while starting, not counted)")
    ev = g.get("evictions") or {}
    add("eviction forced", (ev.get("cold_evicted_tokens") or 0) > 0 or (ev.get("hot_evictions") or 0) > 0,
        f"COLD evicted tokens {ev.get('cold_evicted_tokens')}, HOT evictions {ev.get('hot_evictions')}")
    add("GraniKV promoted shared prefixes", (g.get("granikv_delta") or {}).get("promotions", 0) > 0,
        f"promotions {(g.get('granikv_delta') or {}).get('promotions')}")
    cross, base = ident.get("granikv_post_vs_baseline") or {}, ident.get("baseline_self") or {}
    add("sample outputs identical to the baseline",
        cross.get("identical_pct") is not None and base.get("identical_pct") is not None
        and cross["identical_pct"] >= base["identical_pct"],
        f"GraniKV vs baseline {cross.get('identical_pct')}% identical, baseline vs itself "
        f"{base.get('identical_pct')}%")
    b = (result.get("servers") or {}).get("baseline") or {}
    if "edge_inputs" in g or "edge_inputs" in b:
        add("edge inputs handled as plain SGLang", *compare_edge(g.get("edge_inputs"), b.get("edge_inputs")))
    return checks


def compare_edge(granikv: Optional[Dict[str, Any]], baseline: Optional[Dict[str, Any]]) -> Tuple[bool, str]:
    """GraniKV handled every edge input as the baseline did: same HTTP status, refused (an
    error) in the same cases, the same output ids where both served, and still healthy."""
    if not granikv or not baseline:
        return False, "not run on both servers"
    bad = []
    for case in EDGE_CASES:
        g, b = granikv.get(case) or {}, baseline.get(case) or {}
        if g.get("http_status") != b.get("http_status") or ("error" in g) != ("error" in b):
            bad.append(f"{case}: GraniKV {g.get('http_status')}/{g.get('error', 'ok')!r:.60} vs "
                       f"baseline {b.get('http_status')}/{b.get('error', 'ok')!r:.60}")
        elif g.get("output_ids") != b.get("output_ids") or g.get("finish") != b.get("finish"):
            bad.append(f"{case}: outputs or finish reason differ")
    h = granikv.get("_health_after") or {}
    if not (h.get("alive") and h.get("health") == 200):
        bad.append(f"GraniKV server after the edge inputs: {h}")
    summary = ", ".join(f"{c} -> {(granikv.get(c) or {}).get('http_status')}"
                        f"{' refused' if 'error' in (granikv.get(c) or {}) else ''}" for c in EDGE_CASES)
    return not bad, "; ".join(bad) if bad else f"as plain SGLang: {summary}"


LOG_LIMIT = 15 << 20  # bytes of a log file that come back from the GPU host (16 MiB a file)


def trim_log(path: Path, limit: int = LOG_LIMIT) -> None:
    """Keep a log under ``limit``: its first quarter, the error lines, its last half."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= limit:
        return
    data = path.read_bytes()
    head, rest = data[: limit // 4], data[limit // 4: -(limit // 2)]
    errors = [ln for ln in rest.decode(errors="replace").splitlines() if LOG_ERROR_RE.search(ln)]
    middle = "\n".join(errors[:2000]).encode()[: limit // 8]
    path.write_bytes(head + f"\n... [{len(rest):,d} bytes cut; their error lines:]\n".encode()
                     + middle + b"\n... [end of the cut]\n" + data[-(limit // 2):])


def scan_server_log(path: Path, ready_at: int, upto: int, ignore: Sequence[str]) -> Dict[str, Any]:
    """Scans what the server logged while serving, [ready_at, upto): the gating part. What it
    logged while starting is scanned too, for information (``startup_error_lines``)."""
    startup = read_log(path, 0, ready_at)
    scan = scan_log(read_log(path, ready_at, upto), ignore, first_line=len(startup) + 1)
    boot = scan_log(startup, ignore)
    return dict(scan, scanned=True, bytes_scanned=upto - ready_at,
                startup_errors=boot["errors"], startup_error_lines=boot["error_lines"][:20])


METRIC_KEYS = {"cold_evicted_tokens": "sglang:evicted_tokens_total",
               "aborted_requests": "sglang:num_aborted_requests_total",
               "retracted_requests": "sglang:num_retracted_requests_total",
               "requests": "sglang:num_requests_total"}


def metric_delta(after: Dict[str, float], before: Dict[str, float]) -> Dict[str, Optional[float]]:
    """Increase of the METRIC_KEYS counters (ints when whole); None for a missing metric."""
    out: Dict[str, Optional[float]] = {}
    for key, name in METRIC_KEYS.items():
        d = after[name] - before.get(name, 0.0) if name in after else None
        out[key] = int(d) if d is not None and float(d).is_integer() else d
    return out


def identity(samples: Dict[str, List]) -> Dict[str, Any]:
    def cmp(a: str, b: str, prefix: bool = False) -> Optional[Dict[str, Any]]:
        if samples.get(a) is None or samples.get(b) is None:
            return None
        return compare_outputs(samples[a], samples[b], prefix=prefix)

    return dict(granikv_post_vs_baseline=cmp("granikv_post", "baseline_a"),
                baseline_self=cmp("baseline_a", "baseline_b"),
                granikv_pre_vs_post=cmp("granikv_pre", "granikv_post"),
                granikv_pre_vs_baseline=cmp("granikv_pre", "baseline_a"),
                soak_vs_baseline=cmp("soak", "baseline_a", prefix=True))
