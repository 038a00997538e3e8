"""GPU soak of a launched SGLang server with GraniKV on, then a baseline server.

    python benchmark/reliability/soak.py --out $OUT
    python3 benchmark/reliability/soak.py --dry-run          # the plan, nothing launched

Method. One process, stdlib only on the client side (no aiohttp, no sglang import):

1. Plan (seeded, pure): ``--requests`` requests built from the multi-agent workloads
   (benchmark/multi_agent/workloads.py): *shared* requests (``workloads.homogeneous``
   families with 2K/4K/8K shared prefixes and private suffixes of 64-512 tokens), *agent_loop*
   sessions (``workloads.agent_loop``, 3-4 turns each, a turn's prompt = the previous context +
   its output + a tool result) and *no_sharing* prompts (``workloads.no_sharing``, 1K/2K).
   Families are used in a sliding window over the run (5 of 18 shared families, 2 of 6 agent
   families at a time), so prefixes come, are promoted to HOT while shared, and go cold again;
   their total size exceeds the COLD pool, which forces COLD (radix LRU) and HOT evictions.
   Outputs are 16-64 tokens (greedy, ignore_eos). ``--abort-frac`` of the requests (exactly,
   none of the sample) are aborted, a third each: ``before_first_token`` (the connection is
   closed right after the request is sent), ``mid_stream`` (closed after k streamed chunks) and
   ``endpoint`` (``POST /abort_request {"rid": ...}`` after k chunks, the stream then read to
   its end).
2. GraniKV server: ``python -m sglang.launch_server --enable-granikv --max-total-tokens N``
   (dummy weights, token ids, flashinfer, ``--enable-metrics``, log to a file). Warm-up, a
   quiet run of the identity sample (``pre``), the idle KV level (``/v1/loads``
   ``num_used_tokens``: slots held by requests, i.e. neither free nor evictable cache), then the
   soak: ``--concurrency`` client threads take jobs in plan order (an agent session's turns run
   back to back) until all are sent or ``--budget-s`` is spent. A monitor polls ``/v1/loads``
   and ``/server_info`` for the peaks (KV used, HOT / COLD occupancy).
3. Checks once the server is idle again: ``/health`` and ``/health_generate`` answer 200, KV
   usage is back to the idle level (slots leaked = used now - used at idle before; SGLang's own
   idle invariant check also raises on any COLD mismatch, which would kill the scheduler), no
   error line in the server log since it became ready (Traceback, Exception, ``*Error``, leak,
   CUDA error, ...; start-up lines are listed apart, not counted), no
   failed non-aborted request (HTTP error, missing or short output, an abort finish reason).
   GraniKV counters (promotions, HOT evictions, ...) come from ``/server_info``
   ``internal_states[0]["granikv"]``, COLD evictions from ``/metrics``
   (``sglang:evicted_tokens_total``). Then ``/flush_cache`` and the ``post`` sample run.
4. Baseline server (the same flags without ``--enable-granikv``, and GraniKV's COLD capacity as
   its ``--max-total-tokens``: the same scheduler token budget): the same sample twice.
   A sample run flushes the cache, caches each shared prefix of the sample with one request,
   then sends the whole sample as ONE batched ``/generate`` (fixed order, greedy, 32 tokens),
   the same way on both servers. Identity: GraniKV ``post`` vs baseline ``A`` must be at least
   as identical as baseline ``A`` vs ``B`` (bf16 batch effects). Also reported: GraniKV ``pre``
   vs ``post`` and the soak's own outputs of the sample prompts (under load) vs baseline.

Writes soak.json, soak.md and both server logs into ``--out`` (default docs/results/runs);
exit status 0 only if every check passes. Every server runs in its own process group, killed
on exit, on exceptions, on SIGTERM and at the hard ``--timeout-s`` (which writes what was
measured so far first). The load phase stops early enough to leave ``RESERVE_S`` for the checks
and the baseline server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "benchmark" / "multi_agent"))

import workloads as wl  # noqa: E402
from run import (  # noqa: E402  (benchmark/multi_agent/run.py)
    BASE_ENGINE_KWARGS,
    counter_delta,
    engine_env,
    latency_stats,
    model_config_path,
    server_flags,
    write_model_dir,
)

from granikv.config import GraniKVConfig  # noqa: E402

# ------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------

SHARED_PREFIXES = (2048, 4096, 8192)  # cycled over the shared families
SHARED_SUFFIXES = (64, 256, 512, 128)  # private suffix per shared family, cycled
SHARED_FAMILIES, SHARED_WINDOW = 18, 5
AGENT_PREFIXES = (4096, 2048, 8192)
AGENT_FAMILIES, AGENT_WINDOW = 6, 2
AGENT_TURNS = (3, 4)
AGENT_SUFFIX, AGENT_TOOL, AGENT_MAX_TURNS = 256, 64, 4
NO_SHARING_LENS = (1024, 2048)
OUT_CHOICES = (16, 32, 48, 64)
MIX = {"shared": 0.60, "agent_loop": 0.25, "no_sharing": 0.15}  # share of requests
ABORT_KINDS = ("before_first_token", "mid_stream", "endpoint")
SAMPLE_OUT = 32  # tokens per sample request (identity check)
SAMPLE_SHARE = {"shared": (0.625, 6), "agent_loop": (0.21, 5)}  # (share of sample, per family)

# Engine settings of the offline GPU host recipe (run.py's BASE_ENGINE_KWARGS), as launch_server
# flags; the log level is the soak's own (--log-level).
BASE_SERVER_FLAGS = server_flags({k: v for k, v in BASE_ENGINE_KWARGS.items() if k != "log_level"})
GRANIKV_DEFAULT_HOT_FRACTION = GraniKVConfig().hot_fraction

RESERVE_S = 160.0  # kept after the load phase: drain, checks, baseline start + sample, stops
READY_TIMEOUT_S = 240.0
READ_TIMEOUT_S = 90.0  # per socket read of a soak request (queueing included)
DRAIN_S = 100.0  # in-flight requests after the load deadline
IDLE_TIMEOUT_S = 60.0
DISCONNECT_ABORT_S = 3.0  # SGLang aborts a disconnected stream 2 s after the disconnect
LOAD_POLL_S, INFO_POLL_S, PROGRESS_S = 1.0, 5.0, 15.0

# Server log lines that count as errors (SGLang prints no level name: match the message).
LOG_ERROR_RE = re.compile(
    r"Traceback|Exception|[A-Za-z]Error\b|\bERROR\b|Error:|memory leak|leak detected|"
    r"CUDA error|out of memory|Health check failed|IntegrityError|Segmentation fault|core dumped")
LOG_WARNING_RE = re.compile(r"\bWARNING\b|[Ww]arning")
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests")
GRANIKV_LOG_RE = re.compile(r"GraniKV: hot (\d+)/(\d+) .*?cold (\d+)/(\d+)")
TOKEN_USAGE_RE = re.compile(r"Decode batch.*?token usage: ([0-9.]+)")


# ------------------------------------------------------------------------------------------
# plan (pure: no server, no network)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """Requests that share one prefix (shared, agent_loop) or one prompt length (no_sharing)."""

    name: str
    kind: str  # shared | agent_loop | no_sharing
    prefix_len: int  # 0 for no_sharing
    workload: wl.Workload


@dataclass(frozen=True)
class SoakRequest:
    idx: int
    job: int
    turn: int  # agent_loop: turn number in its session; 0 otherwise
    kind: str
    family: str
    agent: int  # row of the family workload's prompts
    max_new_tokens: int
    abort: Optional[str] = None  # one of ABORT_KINDS, None = must be served
    abort_after: int = 0  # streamed chunks read before aborting (mid_stream, endpoint)
    sample: bool = False  # first-turn prompt of the identity sample


@dataclass
class Plan:
    seed: int
    requests: List[SoakRequest]
    jobs: List[List[int]]  # request idx per job, in dispatch order (agent turns in order)
    families: Dict[str, Family]
    sample: List[int]  # request idx of the identity sample (first turns, never aborted)

    def first_prompt(self, req: SoakRequest) -> List[int]:
        return list(self.families[req.family].workload.prompts[req.agent])

    def prompt(self, req: SoakRequest, context: Optional[Sequence[int]] = None,
               output_ids: Sequence[int] = ()) -> List[int]:
        """Turn 0: the family prompt; agent turn t: the previous context + output + tool."""
        if req.turn == 0 or context is None:
            return self.first_prompt(req)
        w = self.families[req.family].workload
        return w.next_prompt(req.agent, context, output_ids, req.turn - 1)

    def prefix_of(self, req: SoakRequest) -> List[int]:
        w = self.families[req.family].workload
        return list(w.prefixes[0]) if w.prefixes else []

    def counts(self) -> Dict[str, Any]:
        by_kind: Dict[str, int] = {}
        aborts: Dict[str, int] = {k: 0 for k in ABORT_KINDS}
        for r in self.requests:
            by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
            if r.abort:
                aborts[r.abort] += 1
        return dict(requests=len(self.requests), jobs=len(self.jobs), by_kind=by_kind,
                    aborts=aborts, aborted=sum(aborts.values()), sample=len(self.sample),
                    families=len(self.families))

    def kv_tokens_distinct(self) -> Dict[str, int]:
        """KV tokens the whole plan writes, each shared prefix counted once: prefixes +
        private suffixes + outputs + tool results + no-sharing prompts (abort-free upper bound)."""
        prefixes = sum(f.prefix_len for f in self.families.values())
        private = 0
        for r in self.requests:
            w = self.families[r.family].workload
            if r.turn == 0:
                private += len(w.prompts[r.agent]) - self.families[r.family].prefix_len
            else:
                private += len(w.tool_results[r.agent][r.turn - 1])
            private += r.max_new_tokens
        return dict(shared_prefix_tokens=prefixes, private_tokens=private,
                    total=prefixes + private)


def kv_budget(max_total_tokens: int, hot_fraction: float, granikv: bool = True) -> Dict[str, int]:
    """KV slots split as GraniKVAllocator does (granikv/mem_cache/allocator.py hot_layout):
    HOT = int(slots * hot_fraction), COLD = the rest = SGLang's scheduler token budget."""
    hot = int(max_total_tokens * hot_fraction) if granikv else 0
    return dict(slots=max_total_tokens, hot=hot, cold=max_total_tokens - hot)


def _window_pick(rng: random.Random, x: float, n: int, window: int) -> int:
    """A family index from the window of ``window`` families that slides over [0, n) as the
    run position ``x`` goes from 0 to 1."""
    window = min(window, n)
    lo = min(int(x * (n - window + 1)), n - window)
    return lo + rng.randrange(window)


def _split_agent_turns(rng: random.Random, total: int) -> List[int]:
    """Session lengths (3 or 4 turns) summing to ``total`` (a last session may be shorter)."""
    turns: List[int] = []
    while sum(turns) < total:
        turns.append(min(rng.choice(AGENT_TURNS), total - sum(turns)))
    return turns


def build_plan(requests: int = 2000, *, seed: int = 0, abort_frac: float = 0.1,
               sample_size: int = 48, mix: Optional[Dict[str, float]] = None) -> Plan:
    """The soak's requests, jobs, families, aborts and identity sample; deterministic in seed."""
    if requests < 1:
        raise ValueError(f"requests={requests} must be >= 1")
    if not 0.0 <= abort_frac < 1.0:
        raise ValueError(f"abort_frac={abort_frac} must be in [0, 1)")
    mix = dict(mix or MIX)
    rng = random.Random(f"soak:{seed}")
    n_agent = round(requests * mix.get("agent_loop", 0.0))
    n_ns = round(requests * mix.get("no_sharing", 0.0))
    n_shared = requests - n_agent - n_ns
    if n_shared < 0:
        raise ValueError(f"mix {mix} leaves no room for shared requests")
    # jobs: ("shared", 1) / ("no_sharing", 1) / ("agent_loop", turns), shuffled
    job_kinds: List[Tuple[str, int]] = ([("shared", 1)] * n_shared + [("no_sharing", 1)] * n_ns
                                        + [("agent_loop", t) for t in _split_agent_turns(rng, n_agent)])
    rng.shuffle(job_kinds)
    # families by run position (sliding windows), agent rows counted per family
    assigned: List[Tuple[str, str, int]] = []  # (kind, family name, turns)
    rows: Dict[str, int] = {}
    for j, (kind, turns) in enumerate(job_kinds):
        x = j / max(len(job_kinds) - 1, 1)
        if kind == "shared":
            fam = f"shared{_window_pick(rng, x, SHARED_FAMILIES, SHARED_WINDOW)}"
        elif kind == "agent_loop":
            fam = f"agent{_window_pick(rng, x, AGENT_FAMILIES, AGENT_WINDOW)}"
        else:
            fam = f"no_sharing{rng.choice(NO_SHARING_LENS)}"
        assigned.append((kind, fam, turns))
        rows[fam] = rows.get(fam, 0) + 1
    families = _build_families(rows, seed)
    # requests, in job order; each job takes the next row of its family
    next_row: Dict[str, int] = {}
    reqs: List[SoakRequest] = []
    jobs: List[List[int]] = []
    for j, (kind, fam, turns) in enumerate(assigned):
        row = next_row.get(fam, 0)
        next_row[fam] = row + 1
        ids = []
        for t in range(turns):
            ids.append(len(reqs))
            reqs.append(SoakRequest(idx=len(reqs), job=j, turn=t, kind=kind, family=fam, agent=row,
                                    max_new_tokens=rng.choice(OUT_CHOICES)))
        jobs.append(ids)
    sample = _choose_sample(reqs, sample_size)
    reqs = _mark(reqs, sample, _choose_aborts(rng, reqs, set(sample), abort_frac))
    return Plan(seed=seed, requests=reqs, jobs=jobs, families=families, sample=sample)


def _build_families(rows: Dict[str, int], seed: int) -> Dict[str, Family]:
    """One multi-agent workload per family, with as many rows (agents) as the plan needs."""
    out: Dict[str, Family] = {}
    for name in sorted(rows, key=_family_order):
        n = rows[name]
        if name.startswith("shared"):
            i = int(name[len("shared"):])
            plen = SHARED_PREFIXES[i % len(SHARED_PREFIXES)]
            w = wl.homogeneous(plen, n, suffix=SHARED_SUFFIXES[i % len(SHARED_SUFFIXES)],
                               out=max(OUT_CHOICES), seed=seed, name=f"soak_{name}")
            out[name] = Family(name, "shared", plen, w)
        elif name.startswith("agent"):
            i = int(name[len("agent"):])
            plen = AGENT_PREFIXES[i % len(AGENT_PREFIXES)]
            w = wl.agent_loop(plen, n, turns=AGENT_MAX_TURNS, suffix=AGENT_SUFFIX,
                              out=max(OUT_CHOICES), tool=AGENT_TOOL, seed=seed * 1000 + i)
            out[name] = Family(name, "agent_loop", plen, w)
        else:
            plen = int(name[len("no_sharing"):])
            out[name] = Family(name, "no_sharing", 0,
                               wl.no_sharing(n, prompt_len=plen, out=max(OUT_CHOICES), seed=seed))
    return out


def _family_order(name: str) -> Tuple[int, int]:
    kind = next(i for i, k in enumerate(("shared", "agent", "no_sharing")) if name.startswith(k))
    return kind, int(re.sub(r"\D", "", name) or 0)


def _choose_sample(reqs: Sequence[SoakRequest], size: int) -> List[int]:
    """First-turn requests for the identity sample: ``per family`` rows of the first shared and
    agent families (so each sample family has sharers and gets promoted), no_sharing for the
    rest. Deterministic: families in order, rows in plan order."""
    if size <= 0:
        return []
    groups: Dict[str, List[int]] = {}
    for r in reqs:
        if r.turn == 0:
            groups.setdefault(r.family, []).append(r.idx)
    chosen: List[int] = []
    for kind, (share, per) in SAMPLE_SHARE.items():
        quota = round(size * share)
        prefix = "shared" if kind == "shared" else "agent"
        for fam in sorted((f for f in groups if f.startswith(prefix)), key=_family_order):
            if quota <= 0:
                break
            take = groups[fam][: min(per, quota)]
            if len(take) >= 2:
                chosen += take
                quota -= len(take)
    ns = sorted((i for f, g in groups.items() if f.startswith("no_sharing") for i in g))
    chosen += ns[: max(0, size - len(chosen))]
    return sorted(chosen)


def _choose_aborts(rng: random.Random, reqs: Sequence[SoakRequest], sample: set,
                   abort_frac: float) -> Dict[int, Tuple[str, int]]:
    """Exactly round(abort_frac * len(reqs)) aborts among the non-sample requests; the kinds
    in equal thirds, shuffled; k (chunks before the abort) drawn per request."""
    candidates = [r.idx for r in reqs if r.idx not in sample]
    n = min(round(abort_frac * len(reqs)), len(candidates))
    picked = sorted(rng.sample(candidates, n))
    kinds = [ABORT_KINDS[i % len(ABORT_KINDS)] for i in range(n)]
    rng.shuffle(kinds)
    out = {}
    for idx, kind in zip(picked, kinds):
        half = max(1, reqs[idx].max_new_tokens // 2)
        after = {"before_first_token": 0, "mid_stream": rng.randint(1, half),
                 "endpoint": rng.randint(0, half)}[kind]
        out[idx] = (kind, after)
    return out


def _mark(reqs: List[SoakRequest], sample: Sequence[int],
          aborts: Dict[int, Tuple[str, int]]) -> List[SoakRequest]:
    in_sample = set(sample)
    out = []
    for r in reqs:
        kind, after = aborts.get(r.idx, (None, 0))
        out.append(SoakRequest(**{**asdict(r), "abort": kind, "abort_after": after,
                                  "sample": r.idx in in_sample}))
    return out


def describe_plan(plan: Plan, budget: Dict[str, int], *, shapes: int = 8) -> List[str]:
    c = plan.counts()
    kv = plan.kv_tokens_distinct()
    lines = [
        f"plan: {c['requests']:,d} requests in {c['jobs']:,d} jobs (seed {plan.seed}): "
        + ", ".join(f"{k} {v:,d}" for k, v in sorted(c["by_kind"].items())),
        f"aborts: {c['aborted']:,d} ({c['aborted'] / max(c['requests'], 1):.1%}): "
        + ", ".join(f"{k} {v}" for k, v in c["aborts"].items()),
        f"identity sample: {c['sample']} first-turn prompts, {SAMPLE_OUT} tokens each",
        f"KV budget: {budget['slots']:,d} slots = HOT {budget['hot']:,d} + COLD {budget['cold']:,d}"
        f" (scheduler budget); the plan writes {kv['total']:,d} distinct KV tokens "
        f"({kv['shared_prefix_tokens']:,d} in {c['families']} family prefixes), "
        f"{kv['total'] / max(budget['cold'], 1):.1f}x COLD: eviction "
        f"{'is forced' if kv['total'] > budget['cold'] else 'is NOT forced'}",
        "families: " + ", ".join(f"{f.name}({f.prefix_len or len(f.workload.prompts[0])})"
                                  for f in plan.families.values()),
        f"first {shapes} requests:",
    ]
    for r in plan.requests[:shapes]:
        lines.append(f"  #{r.idx:<5d} job {r.job:<5d} {r.kind:10s} {r.family:14s} turn {r.turn} "
                     f"prompt {len(plan.first_prompt(r)):>5d}{'+' if r.turn else ' '} "
                     f"out {r.max_new_tokens:>2d} abort {r.abort or '-'}"
                     f"{f'@{r.abort_after}' if r.abort else ''}{' sample' if r.sample else ''}")
    return lines


# ------------------------------------------------------------------------------------------
# log, metrics, outputs (pure)
# ------------------------------------------------------------------------------------------


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


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text format -> {metric name: sum over its label sets}."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        out[m[1]] = out.get(m[1], 0.0) + value
    return out


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


# ------------------------------------------------------------------------------------------
# checks and report (pure)
# ------------------------------------------------------------------------------------------


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
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / f"{stem}.json", out / f"{stem}.md"
    j.write_text(json.dumps(result, indent=1, default=str) + "\n")
    m.write_text(markdown(result))
    return [j, m]


def summary_lines(result: Dict[str, Any]) -> List[str]:
    lines = [f"{name:62s} {_fmt(value)}" for name, value in figures(result)]
    lines.append("")
    for c in result.get("checks") or []:
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    lines.append(f"RESULT: {'PASS' if result.get('ok') else 'FAIL'}")
    return lines


# ------------------------------------------------------------------------------------------
# HTTP client (stdlib)
# ------------------------------------------------------------------------------------------


def http_call(host: str, port: int, method: str, path: str, body: Any = None,
              timeout: float = 30.0) -> Tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get_json(host: str, port: int, path: str, timeout: float = 30.0) -> Optional[Any]:
    try:
        status, body = http_call(host, port, "GET", path, timeout=timeout)
        return json.loads(body) if status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None


@dataclass
class Outcome:
    idx: int
    status: str  # served | aborted | error
    abort: Optional[str] = None
    abort_late: bool = False  # the request finished before its planned abort (counted served)
    http_status: Optional[int] = None
    chunks: int = 0
    output_ids: List[int] = field(default_factory=list)
    finish: Optional[str] = None
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    latency_s: float = 0.0


def _hard_close(conn: http.client.HTTPConnection, sock: Optional[socket.socket]) -> None:
    """Close the client side at once (FIN now, not when the GC gets to the response)."""
    for s in (sock, conn.sock):
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    conn.close()


def _finish_type(meta: Optional[Dict[str, Any]]) -> Optional[str]:
    """``meta_info.finish_reason`` as its type string (SGLang sends a dict or a string)."""
    finish = (meta or {}).get("finish_reason")
    return finish.get("type") if isinstance(finish, dict) else finish


def stream_generate(host: str, port: int, req: SoakRequest, prompt: Sequence[int], rid: str, *,
                    incremental: bool, timeout: float = READ_TIMEOUT_S) -> Outcome:
    """One streamed ``/generate``; aborts it as ``req.abort`` says; validates a served one."""
    out = Outcome(idx=req.idx, status="error", abort=req.abort)
    payload = {"input_ids": list(prompt), "rid": rid, "stream": True,
               "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0,
                                   "ignore_eos": True}}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    sock = None
    try:
        conn.request("POST", "/generate", body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
        sock = conn.sock
        if req.abort == "before_first_token":
            _hard_close(conn, sock)
            out.status = "aborted"
            return out
        resp = conn.getresponse()
        out.http_status = resp.status
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return out
        abort_sent = False
        if req.abort == "endpoint" and req.abort_after == 0:
            abort_sent = _abort_endpoint(host, port, rid, out)
        last: Optional[Dict[str, Any]] = None
        done = False
        for raw in iter(resp.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            msg = json.loads(data)
            if "error" in msg:
                out.error = f"error chunk: {json.dumps(msg['error'])[:200]}"
                if req.abort == "endpoint" and abort_sent:
                    out.status = "aborted"
                return out
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
            out.chunks += 1
            ids = list(msg.get("output_ids") or [])
            out.output_ids = out.output_ids + ids if incremental else ids
            last = msg
            if req.abort == "mid_stream" and out.chunks >= req.abort_after:
                _hard_close(conn, sock)
                out.status = "aborted"
                return out
            if req.abort == "endpoint" and not abort_sent and out.chunks >= req.abort_after:
                abort_sent = _abort_endpoint(host, port, rid, out)
        out.latency_s = time.perf_counter() - t0
        out.finish = _finish_type((last or {}).get("meta_info"))
        if req.abort == "endpoint":
            _finish_endpoint_abort(out, last, done, req.max_new_tokens)
        else:  # mid_stream here: the stream ended before its k-th chunk (chunks coalesced)
            out.abort_late = req.abort is not None
            _validate(out, last, done, req.max_new_tokens)
        return out
    except (OSError, ValueError, http.client.HTTPException) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    finally:
        out.latency_s = out.latency_s or (time.perf_counter() - t0)
        conn.close()


def _abort_endpoint(host: str, port: int, rid: str, out: Outcome) -> bool:
    """POST /abort_request for ``rid``; a failure is the outcome's error. Returns True (sent)."""
    try:
        status, body = http_call(host, port, "POST", "/abort_request", {"rid": rid}, timeout=30)
    except (OSError, http.client.HTTPException) as e:
        status, body = None, str(e).encode()
    if status != 200:
        out.error = f"/abort_request -> {status}: {body[:200]!r}"
    return True


def _finish_endpoint_abort(out: Outcome, last: Optional[Dict[str, Any]], done: bool,
                           max_new: int) -> None:
    """An endpoint-aborted stream must end cleanly: with an abort finish reason, or complete
    when the abort came after the end (``abort_late``, counted as served)."""
    if out.error:  # /abort_request failed
        return
    if not done:
        out.error = "stream ended without [DONE] after /abort_request"
    elif out.finish == "abort":
        out.status = "aborted"
    else:
        out.abort_late = True
        _validate(out, last, done, max_new)


def _validate(out: Outcome, last: Optional[Dict[str, Any]], done: bool, max_new: int) -> None:
    meta = (last or {}).get("meta_info") or {}
    n = meta.get("completion_tokens")
    if not done:
        out.error = "stream ended without [DONE]"
    elif out.finish != "length":
        out.error = f"finish_reason {meta.get('finish_reason')!r}, expected length"
    elif len(out.output_ids) != max_new or (n is not None and n != max_new):
        out.error = f"{len(out.output_ids)} output ids (completion_tokens {n}), expected {max_new}"
    else:
        out.status = "served"


def generate_batch(host: str, port: int, prompts: Sequence[Sequence[int]], max_new: int,
                   timeout: float = 180.0) -> List[Optional[List[int]]]:
    """One batched, non-streamed ``/generate`` (input order kept); None where none came back."""
    if not prompts:
        return []
    body = {"input_ids": [list(p) for p in prompts],
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    status, data = http_call(host, port, "POST", "/generate", body, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"/generate batch -> HTTP {status}: {data[:300]!r}")
    res = json.loads(data)
    res = res if isinstance(res, list) else [res]
    return [list(r.get("output_ids") or []) if isinstance(r, dict) else None for r in res]


# ---- edge inputs: what plain SGLang does with them, GraniKV must do too ------------------------

EDGE_CASES = ("empty_prompt", "prompt_longer_than_context", "huge_max_new_tokens")
def context_tokens(model: str) -> int:
    """The model's context (``max_position_embeddings`` of its config)."""
    return int(json.loads(model_config_path(model).read_text())["max_position_embeddings"])


def _edge_request(host: str, port: int, case: str, context: int) -> Dict[str, Any]:
    """One edge-input request; returns what the server did (status, error or outputs)."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    ids = {"empty_prompt": [], "prompt_longer_than_context": [7] * (context + 16)}.get(case, [11] * 64)
    if case != "huge_max_new_tokens":
        try:
            status, data = http_call(host, port, "POST", "/generate", {"input_ids": ids, "sampling_params": params},
                                     timeout=120)
        except (OSError, http.client.HTTPException) as e:
            return dict(http_status=None, error=f"{type(e).__name__}: {e}"[:200])
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        rec: Dict[str, Any] = dict(http_status=status)
        if status != 200 or not isinstance(body, dict) or "output_ids" not in body:
            rec["error"] = data[:200].decode(errors="replace")
        else:
            rec["output_ids"] = list(body.get("output_ids") or [])
            rec["finish"] = _finish_type(body.get("meta_info"))
        return rec
    # 10^9 new tokens: accepted or refused up front? If accepted, abort it after the first chunk.
    rid = f"edge-{case}-{port}"
    payload = {"input_ids": ids, "rid": rid, "stream": True,
               "sampling_params": dict(params, max_new_tokens=10**9)}
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", "/generate", body=json.dumps(payload).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        rec = dict(http_status=resp.status)
        if resp.status != 200:
            rec["error"] = resp.read()[:200].decode(errors="replace")
            return rec
        rec["first_chunk"], aborted = False, False
        for raw in iter(resp.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            msg = json.loads(line[5:].strip())
            if "error" in msg:
                rec["error"] = json.dumps(msg["error"])[:200]
                break
            if not aborted:
                rec["first_chunk"] = True
                http_call(host, port, "POST", "/abort_request", {"rid": rid}, timeout=30)
                aborted = True
            if _finish_type(msg.get("meta_info")):
                rec["finish"] = _finish_type(msg.get("meta_info"))
        return rec
    except (OSError, ValueError, http.client.HTTPException) as e:
        return dict(http_status=None, error=f"{type(e).__name__}: {e}"[:200])
    finally:
        conn.close()


def edge_inputs(server: "Server", context: int) -> Dict[str, Dict[str, Any]]:
    """Every EDGE_CASES request against ``server`` (``context``: the model's context length),
    then whether it is still healthy."""
    out = {case: _edge_request(server.host, server.port, case, context) for case in EDGE_CASES}
    out["_health_after"] = dict(alive=server.alive(), health=server.status("/health"))
    return out


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


# ------------------------------------------------------------------------------------------
# servers (process groups)
# ------------------------------------------------------------------------------------------

_LIVE: List[subprocess.Popen] = []  # every server still to kill


@dataclass
class Server:
    name: str
    cmd: List[str]
    log_path: Path
    host: str
    port: int
    proc: Optional[subprocess.Popen] = None
    ready_s: Optional[float] = None
    ready_at: int = 0  # log size when it became ready: the serving part of the log starts here

    def get(self, path: str, timeout: float = 30.0) -> Optional[Any]:
        return get_json(self.host, self.port, path, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, path: str, timeout: float = 60.0) -> Optional[int]:
        try:
            return http_call(self.host, self.port, "GET", path, timeout=timeout)[0]
        except (OSError, http.client.HTTPException):
            return None

    def loads(self) -> Optional[Dict[str, Any]]:
        """Rank 0's core load snapshot (num_used_tokens, token_usage, running, waiting)."""
        res = self.get("/v1/loads?include=core", timeout=10)
        loads = (res or {}).get("loads") or []
        return loads[0] if loads else None

    def info(self) -> Optional[Dict[str, Any]]:
        return self.get("/server_info", timeout=30)

    def granikv(self) -> Optional[Dict[str, Any]]:
        for state in (self.info() or {}).get("internal_states") or []:
            if isinstance(state, dict) and isinstance(state.get("granikv"), dict):
                return state["granikv"]
        return None

    def metrics(self) -> Dict[str, float]:
        try:
            status, body = http_call(self.host, self.port, "GET", "/metrics", timeout=30)
        except (OSError, http.client.HTTPException):
            return {}
        return parse_metrics(body.decode(errors="replace")) if status == 200 else {}


def free_port(preferred: int) -> int:
    for port in range(preferred, preferred + 50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{preferred}, {preferred + 50})")


def server_command(args: argparse.Namespace, model_dir: str, port: int, *, granikv: bool) -> List[str]:
    """launch_server flags. The baseline's KV budget is GraniKV's COLD capacity: both schedulers
    then budget the same tokens, so they admit and batch the identity sample the same way."""
    cmd = [sys.executable, "-m", "sglang.launch_server"] if not args.launcher else shlex.split(args.launcher)
    budget = kv_budget(args.max_total_tokens, hot_fraction_of(args))
    cmd += ["--model-path", model_dir, *BASE_SERVER_FLAGS, "--attention-backend", args.backend,
            "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens",
            str(budget["slots"] if granikv else budget["cold"]), "--log-level", args.log_level]
    if not args.no_metrics:
        cmd.append("--enable-metrics")
    for extra in args.server_arg:
        cmd += shlex.split(extra)
    if granikv:
        cmd.append("--enable-granikv")
        if args.hot_fraction is not None:
            cmd += ["--granikv-hot-fraction", str(args.hot_fraction)]
        for extra in args.granikv_arg:
            cmd += shlex.split(extra)
    return cmd


def start_server(server: Server, env: Dict[str, str]) -> None:
    log = open(server.log_path, "wb")
    # Own process group: the scheduler / detokenizer children are killed with it.
    server.proc = subprocess.Popen(server.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    log.close()
    _LIVE.append(server.proc)


def wait_ready(server: Server, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not server.alive():
            raise RuntimeError(f"{server.name} server exited with status {server.proc.returncode} "
                               f"before it was ready; log tail:\n{tail(server.log_path, 30)}")
        if server.status("/health_generate", timeout=10) == 200:
            server.ready_s = round(time.time() - t0, 1)
            server.ready_at = log_size(server.log_path)
            return server.ready_s
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} server not ready after {timeout:.0f} s; log tail:\n"
                       f"{tail(server.log_path, 30)}")


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # leader gone: make sure its children are too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        break
    try:
        _LIVE.remove(proc)
    except ValueError:  # already removed (the hard-timeout thread and main both kill)
        pass


def kill_all() -> None:
    for proc in list(_LIVE):
        kill_group(proc, grace_s=2.0)


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


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


def read_log(path: Path, start: int = 0, upto: Optional[int] = None) -> List[str]:
    """Lines of bytes [start, upto) of a log (start: a line start, e.g. the size at a time)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(upto - start) if upto is not None else f.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def scan_server_log(path: Path, ready_at: int, upto: int, ignore: Sequence[str]) -> Dict[str, Any]:
    """Scans what the server logged while serving, [ready_at, upto): the gating part. What it
    logged while starting is scanned too, for information (``startup_error_lines``)."""
    startup = read_log(path, 0, ready_at)
    scan = scan_log(read_log(path, ready_at, upto), ignore, first_line=len(startup) + 1)
    boot = scan_log(startup, ignore)
    return dict(scan, scanned=True, bytes_scanned=upto - ready_at,
                startup_errors=boot["errors"], startup_error_lines=boot["error_lines"][:20])


# ------------------------------------------------------------------------------------------
# the soak
# ------------------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Polls /v1/loads (each LOAD_POLL_S) and /server_info (each INFO_POLL_S) for peaks, and
    prints a progress line each PROGRESS_S."""

    def __init__(self, server: Server, progress: Callable[[], str]):
        super().__init__(daemon=True)
        self.server, self.progress = server, progress
        self.stop_event = threading.Event()
        self.peaks: Dict[str, float] = {}
        self.last: Dict[str, Any] = {}

    def _peak(self, key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.peaks[key] = max(self.peaks.get(key, value), value)

    def run(self) -> None:
        t0 = last_info = last_print = time.time()
        while not self.stop_event.wait(LOAD_POLL_S):
            load = self.server.loads() or {}
            for k in ("num_used_tokens", "token_usage", "num_running_reqs", "num_waiting_reqs"):
                self._peak(k, load.get(k))
            self.last.update(load)
            now = time.time()
            if now - last_info >= INFO_POLL_S:
                last_info = now
                g = self.server.granikv() or {}
                for k in ("hot_used_tokens", "cold_used_tokens", "hot_extents"):
                    self._peak(k, g.get(k))
                self.last.update({k: g.get(k) for k in ("hot_used_tokens", "promotions")})
            if now - last_print >= PROGRESS_S:
                last_print = now
                print(f"[soak {now - t0:5.0f}s] {self.progress()} | running "
                      f"{self.last.get('num_running_reqs')} waiting {self.last.get('num_waiting_reqs')} "
                      f"usage {self.last.get('token_usage')} hot {self.last.get('hot_used_tokens')} "
                      f"promotions {self.last.get('promotions')}", flush=True)


class Soak:
    """``concurrency`` threads take jobs in plan order until all are sent or the deadline."""

    def __init__(self, plan: Plan, server: Server, *, concurrency: int, deadline: float,
                 incremental: bool):
        self.plan, self.server = plan, server
        self.concurrency, self.deadline, self.incremental = concurrency, deadline, incremental
        self.lock = threading.Lock()
        self.next_job = 0
        self.outcomes: Dict[int, Outcome] = {}
        self.last_disconnect = 0.0
        self.stopped_by_deadline = False

    def _take(self) -> Optional[int]:
        with self.lock:
            if self.next_job >= len(self.plan.jobs):
                return None
            if time.time() >= self.deadline:
                self.stopped_by_deadline = True
                return None
            self.next_job += 1
            return self.next_job - 1

    def _worker(self) -> None:
        while True:
            j = self._take()
            if j is None:
                return
            try:
                self._run_job(j)
            except Exception as e:  # a client bug must not hang the soak: record and go on
                traceback.print_exc()
                with self.lock:
                    for idx in self.plan.jobs[j]:
                        self.outcomes.setdefault(idx, Outcome(idx=idx, status="error",
                                                              error=f"client: {type(e).__name__}: {e}"))

    def _run_job(self, j: int) -> None:
        context: Optional[List[int]] = None
        output: List[int] = []
        for k, idx in enumerate(self.plan.jobs[j]):
            if k and time.time() >= self.deadline:
                self.stopped_by_deadline = True
                return  # the session's later turns are not sent
            req = self.plan.requests[idx]
            prompt = self.plan.prompt(req, context, output)
            o = stream_generate(self.server.host, self.server.port, req, prompt,
                                f"soak-{self.plan.seed}-{idx}", incremental=self.incremental)
            with self.lock:
                self.outcomes[idx] = o
                if req.abort in ("before_first_token", "mid_stream"):
                    self.last_disconnect = time.time()
            context, output = prompt, o.output_ids

    def progress(self) -> str:
        with self.lock:
            outs = list(self.outcomes.values())
        served = sum(o.status == "served" for o in outs)
        aborted = sum(o.status == "aborted" for o in outs)
        errors = sum(o.status == "error" for o in outs)
        return (f"done {len(outs)}/{len(self.plan.requests)} served {served} aborted {aborted} "
                f"errors {errors}")

    def run(self) -> float:
        t0 = time.time()
        threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, self.deadline + DRAIN_S - time.time()))
        if any(t.is_alive() for t in threads):  # stuck requests: abort them all, give 10 s
            print("drain time exceeded: POST /abort_request abort_all", flush=True)
            try:
                http_call(self.server.host, self.server.port, "POST", "/abort_request",
                          {"abort_all": True}, timeout=10)
            except (OSError, http.client.HTTPException):
                pass
            for t in threads:
                t.join(timeout=10.0)
        return time.time() - t0

    def summary(self, seconds: float) -> Dict[str, Any]:
        with self.lock:
            outs = dict(self.outcomes)
        served = [o for o in outs.values() if o.status == "served"]
        aborted = [o for o in outs.values() if o.status == "aborted"]
        failed = [o for o in outs.values() if o.status == "error"]
        errors = [o for o in failed if o.abort is None]
        by_kind = {k: sum(o.abort == k for o in aborted) for k in ABORT_KINDS}
        ttft = [o.ttft_s for o in served if o.ttft_s is not None]
        out_tok = sum(len(o.output_ids) for o in served)
        return dict(
            sent=len(outs), served=len(served), aborted=len(aborted), aborted_by_kind=by_kind,
            abort_late=sum(o.abort_late for o in served), errors=len(errors),
            abort_errors=len(failed) - len(errors),
            error_examples=[f"#{o.idx} abort={o.abort} http={o.http_status}: {o.error}"
                            for o in sorted(failed, key=lambda o: o.idx)[:50]],
            not_sent=len(self.plan.requests) - len(outs), stopped_by_budget=self.stopped_by_deadline,
            seconds=round(seconds, 1), requests_per_s=round(len(outs) / seconds, 2) if seconds else None,
            out_tokens=out_tok, out_tok_per_s=round(out_tok / seconds, 1) if seconds else None,
            **latency_stats("ttft", ttft))


def wait_idle(server: Server, timeout: float = IDLE_TIMEOUT_S) -> Optional[Dict[str, Any]]:
    """The load snapshot once no request has run or waited for 4 polls in a row (2 s); None
    after ``timeout`` or as soon as the server process is gone."""
    t0, quiet, load = time.time(), 0, None
    while time.time() - t0 < timeout:
        if not server.alive():
            return None
        load = server.loads()
        busy = load is None or load.get("num_running_reqs") or load.get("num_waiting_reqs")
        quiet = 0 if busy else quiet + 1
        if quiet >= 4:
            return load
        time.sleep(0.5)
    return None


def run_sample(server: Server, plan: Plan) -> Dict[str, Any]:
    """Flush, cache the sample's shared prefixes (one request each), one batched /generate."""
    t0 = time.time()
    if not wait_idle(server):
        raise RuntimeError(f"{server.name}: not idle before the sample run")
    status = http_call(server.host, server.port, "POST", "/flush_cache", timeout=60)[0]
    reqs = [plan.requests[i] for i in plan.sample]
    prefixes = {r.family: plan.prefix_of(r) for r in reqs if plan.prefix_of(r)}
    generate_batch(server.host, server.port, [p + [5] for p in prefixes.values()], 1)
    outputs = generate_batch(server.host, server.port, [plan.first_prompt(r) for r in reqs], SAMPLE_OUT)
    return dict(flush_status=status, outputs=outputs, seconds=round(time.time() - t0, 1))


def snapshot_idle(server: Server) -> Dict[str, Any]:
    load = server.loads() or {}
    g = server.granikv() or {}
    return dict(num_used_tokens=load.get("num_used_tokens"), token_usage=load.get("token_usage"),
                num_running_reqs=load.get("num_running_reqs"),
                num_waiting_reqs=load.get("num_waiting_reqs"),
                hot_used_tokens=g.get("hot_used_tokens"), cold_used_tokens=g.get("cold_used_tokens"),
                hot_extents=g.get("hot_extents"))


def warm_up(server: Server) -> None:
    """First requests pay lazy initialisation (JIT modules, allocator growth)."""
    generate_batch(server.host, server.port, [[1000 + i] * 64 for i in range(4)], 16)


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


# ------------------------------------------------------------------------------------------
# phases
# ------------------------------------------------------------------------------------------


def granikv_phase(args, plan: Plan, server: Server, result: Dict[str, Any], t_end: float) -> None:
    """Start, warm, sample (pre), soak, checks, sample (post), stop. Fills result in place."""
    rec: Dict[str, Any] = result["servers"].setdefault("granikv", {})
    start_server(server, engine_env(args.backend))
    print(f"== granikv: {shlex.join(server.cmd)}", flush=True)
    rec["ready_s"] = wait_ready(server, READY_TIMEOUT_S)
    print(f"== granikv: ready in {rec['ready_s']} s", flush=True)
    warm_up(server)
    info = server.info() or {}
    incremental = bool(info.get("incremental_streaming_output", False))
    result["meta"].update(sglang=info.get("version"), max_total_num_tokens=info.get("max_total_num_tokens"),
                          incremental_streaming_output=incremental)
    g0 = server.granikv() or {}
    rec.update(hot_capacity=g0.get("hot_capacity"), cold_capacity=g0.get("cold_capacity"))
    print(f"== granikv: HOT {g0.get('hot_capacity')} COLD {g0.get('cold_capacity')} slots, "
          f"scheduler budget {info.get('max_total_num_tokens')}", flush=True)
    pre = run_sample(server, plan)
    result["samples"]["granikv_pre"] = pre["outputs"]
    if not wait_idle(server):
        raise RuntimeError("granikv: not idle after warm-up")
    rec["idle_before"] = snapshot_idle(server)
    before_g, before_m = server.granikv() or {}, server.metrics()

    deadline = min(time.time() + args.budget_s, t_end - RESERVE_S)
    print(f"== granikv: soak of {len(plan.requests):,d} requests, concurrency {args.concurrency}, "
          f"load phase at most {deadline - time.time():.0f} s", flush=True)
    soak = Soak(plan, server, concurrency=args.concurrency, deadline=deadline, incremental=incremental)
    result["_soak"] = soak  # the hard timeout writes what is there
    monitor = Monitor(server, soak.progress)
    monitor.start()
    seconds = soak.run()
    monitor.stop_event.set()
    result["soak"] = soak.summary(seconds)
    print(f"== granikv: soak done in {seconds:.0f} s: {soak.progress()}", flush=True)

    time.sleep(max(0.0, soak.last_disconnect + DISCONNECT_ABORT_S - time.time()))
    idle = wait_idle(server)
    if not server.alive():
        rec["health"] = dict(alive=False)
        raise RuntimeError(f"granikv server died (status {server.proc.returncode}); log tail:\n"
                           f"{tail(server.log_path, 20)}")
    rec["health"] = dict(alive=server.alive(), idle=idle is not None,
                         health=server.status("/health"), health_generate=server.status("/health_generate"))
    wait_idle(server, timeout=15)  # the health probe's own request
    rec["idle_after"] = snapshot_idle(server)
    after_g, after_m = server.granikv() or {}, server.metrics()
    rec.update(granikv_before=before_g, granikv_after=after_g,
               granikv_delta=counter_delta(after_g, before_g or {}) if after_g else {},
               metrics_delta=metric_delta(after_m, before_m) if after_m else {})
    ub, ua = rec["idle_before"].get("num_used_tokens"), rec["idle_after"].get("num_used_tokens")
    rec["slots_leaked"] = (ua - ub) if isinstance(ua, int) and isinstance(ub, int) else None
    gd = rec["granikv_delta"]
    rec["evictions"] = dict(cold_evicted_tokens=rec["metrics_delta"].get("cold_evicted_tokens"),
                            hot_evictions=gd.get("hot_evictions"),
                            hot_evicted_tokens=gd.get("hot_evicted_tokens"))

    post = run_sample(server, plan)  # flushes first: the flush check reads the state after it
    result["samples"]["granikv_post"] = post["outputs"]
    result["samples"]["soak"] = [soak.outcomes[i].output_ids if i in soak.outcomes
                                 and soak.outcomes[i].status == "served" else None for i in plan.sample]
    flushed = http_call(server.host, server.port, "POST", "/flush_cache", timeout=60)[0]
    wait_idle(server, timeout=15)
    rec["post_flush"] = dict(flushed=flushed == 200 and pre["flush_status"] == 200
                             and post["flush_status"] == 200, **snapshot_idle(server))
    # scanned before the stop: shutdown noise is not the soak's
    rec["log"] = scan_server_log(server.log_path, server.ready_at, log_size(server.log_path),
                                 args.log_ignore)
    rec["peaks"] = _merge_peaks(monitor.peaks, rec["log"])
    if not args.no_edge_inputs:  # after the log scan: refusing bad input may log an error
        rec["edge_inputs"] = edge_inputs(server, context_tokens(args.model))


def _merge_peaks(polled: Dict[str, float], scan: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(polled)
    out["hot_used_tokens"] = max(polled.get("hot_used_tokens", 0), scan.get("granikv_hot_peak", 0))
    out["cold_used_tokens"] = max(polled.get("cold_used_tokens", 0), scan.get("granikv_cold_peak", 0))
    out["token_usage"] = max(polled.get("token_usage", 0.0), scan.get("decode_token_usage_peak", 0.0))
    return out


def baseline_phase(args, plan: Plan, server: Server, result: Dict[str, Any]) -> None:
    rec: Dict[str, Any] = result["servers"].setdefault("baseline", {})
    start_server(server, engine_env(args.backend))
    print(f"== baseline: {shlex.join(server.cmd)}", flush=True)
    rec["ready_s"] = wait_ready(server, READY_TIMEOUT_S)
    warm_up(server)
    result["samples"]["baseline_a"] = run_sample(server, plan)["outputs"]
    result["samples"]["baseline_b"] = run_sample(server, plan)["outputs"]
    rec["log"] = scan_server_log(server.log_path, server.ready_at, log_size(server.log_path),
                                 args.log_ignore)
    if not args.no_edge_inputs:
        rec["edge_inputs"] = edge_inputs(server, context_tokens(args.model))


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


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="Requests in the plan (default 2000).")
    p.add_argument("--concurrency", type=int, default=64, help="Client threads (default 64).")
    p.add_argument("--abort-frac", type=float, default=0.10,
                   help="Share of the requests aborted by the client (default 0.10).")
    p.add_argument("--max-total-tokens", type=int, default=98304,
                   help="KV slots of the GraniKV server (default 98304 = HOT 24,576 + COLD 73,728 "
                        "with GraniKV's default hot fraction); the baseline gets the COLD part.")
    p.add_argument("--hot-fraction", type=float, default=None,
                   help=f"--granikv-hot-fraction (default: GraniKV's, {GRANIKV_DEFAULT_HOT_FRACTION}).")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="Load phase: no job starts after this many seconds (the checks still run).")
    p.add_argument("--timeout-s", type=float, default=525.0,
                   help="Hard limit of the whole run: servers killed, what was measured written.")
    p.add_argument("--port", type=int, default=30000, help="GraniKV server port (baseline: +2).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=48, help="Identity sample size (default 48).")
    p.add_argument("--backend", default="flashinfer", help="Attention backend (default flashinfer).")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="A folder of benchmark/multi_agent/configs or a model folder (dummy weights).")
    p.add_argument("--log-level", default="info", help="Server --log-level (default info).")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAGS",
                   help="Extra launch_server flags for both servers (repeatable, shell-split).")
    p.add_argument("--granikv-arg", action="append", default=[], metavar="FLAGS",
                   help="Extra flags for the GraniKV server only, e.g. '--granikv-debug-integrity' "
                        "(exact HOT/COLD ownership after every step; slow).")
    p.add_argument("--log-ignore", action="append", default=[], metavar="REGEX",
                   help="Server log lines matching this are not counted as errors (repeatable).")
    p.add_argument("--no-metrics", action="store_true", help="Do not pass --enable-metrics.")
    p.add_argument("--no-edge-inputs", action="store_true",
                   help="Skip the edge inputs (empty prompt, prompt over the context, 10^9 new tokens).")
    p.add_argument("--skip-baseline", action="store_true",
                   help="No baseline server (the identity check then fails).")
    p.add_argument("--out", default="docs/results/runs")
    p.add_argument("--dry-run", action="store_true", help="Print the plan and the commands; launch nothing.")
    # a stand-in for `python -m sglang.launch_server` (checks of the harness without a GPU)
    p.add_argument("--launcher", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.timeout_s < RESERVE_S + 60:
        p.error(f"--timeout-s must be at least {RESERVE_S + 60:.0f}")
    return args


def hot_fraction_of(args: argparse.Namespace) -> float:
    return GRANIKV_DEFAULT_HOT_FRACTION if args.hot_fraction is None else args.hot_fraction


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python3", "benchmark/reliability/soak.py", *argv])


def base_result(args, argv: Sequence[str], plan: Plan, commands: Dict[str, str]) -> Dict[str, Any]:
    hf = hot_fraction_of(args)
    return dict(
        meta=dict(command=command_line(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  model=args.model, backend=args.backend, seed=args.seed,
                  concurrency=args.concurrency, abort_frac=args.abort_frac,
                  max_total_tokens=args.max_total_tokens, hot_fraction=hf,
                  kv_budget=kv_budget(args.max_total_tokens, hf), budget_s=args.budget_s,
                  timeout_s=args.timeout_s, server_commands=commands, gpu=gpu_name()),
        plan=dict(plan.counts(), kv_tokens=plan.kv_tokens_distinct(),
                  sample_requests=plan.sample, settings=dict(
                      shared_prefixes=SHARED_PREFIXES, shared_suffixes=SHARED_SUFFIXES,
                      shared_families=SHARED_FAMILIES, shared_window=SHARED_WINDOW,
                      agent_prefixes=AGENT_PREFIXES, agent_families=AGENT_FAMILIES,
                      agent_window=AGENT_WINDOW, agent_turns=AGENT_TURNS, no_sharing=NO_SHARING_LENS,
                      out_choices=OUT_CHOICES, mix=MIX)),
        servers={}, samples={}, soak={}, identity={}, durations={})


def gpu_name() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def finish(args, result: Dict[str, Any], t0: float) -> int:
    """Checks, report files, summary; returns the exit status."""
    soak = result.pop("_soak", None)
    if soak is not None and not result.get("soak"):
        result["soak"] = soak.summary(time.time() - t0)
    result["identity"] = identity(result.get("samples") or {})
    result["durations"]["total_s"] = round(time.time() - t0, 1)
    result["checks"] = evaluate(result)
    result["ok"] = all(c["ok"] for c in result["checks"]) and not result.get("failure")
    paths = write_report(args.out, result)
    print("\n".join(summary_lines(result)), flush=True)
    print(f"wrote {', '.join(str(p) for p in paths)}", flush=True)
    return 0 if result["ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.time()
    t_end = t0 + args.timeout_s
    plan = build_plan(args.requests, seed=args.seed, abort_frac=args.abort_frac, sample_size=args.sample)
    hf = hot_fraction_of(args)
    port_g = args.port if args.dry_run else free_port(args.port)
    port_b = args.port + 2 if args.dry_run else free_port(args.port + 2)
    model_dir = tempfile.mkdtemp(prefix="granikv_soak_model_") if not args.dry_run else "<model dir>"
    servers = dict(granikv=server_command(args, model_dir, port_g, granikv=True),
                   baseline=server_command(args, model_dir, port_b, granikv=False))
    commands = {k: shlex.join(v) for k, v in servers.items()}
    print("\n".join(describe_plan(plan, kv_budget(args.max_total_tokens, hf))))
    for name, cmd in commands.items():
        print(f"{name} server: {cmd}")
    print(f"load phase <= {args.budget_s:.0f} s, whole run <= {args.timeout_s:.0f} s "
          f"(reserve after the load phase {RESERVE_S:.0f} s), out {args.out}", flush=True)
    if args.dry_run:
        return 0

    write_model_dir(args.model, model_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = base_result(args, argv, plan, commands)
    g = Server("granikv", servers["granikv"], out / "soak_server_granikv.log", "127.0.0.1", port_g)
    b = Server("baseline", servers["baseline"], out / "soak_server_baseline.log", "127.0.0.1", port_b)

    def scan_if_missing(server: Server) -> None:
        """A phase cut short (exception, hard timeout) still gets its log scanned."""
        rec = result["servers"].get(server.name)
        if rec is not None and "log" not in rec and server.proc is not None:
            rec["log"] = scan_server_log(server.log_path, server.ready_at,
                                         log_size(server.log_path), args.log_ignore)

    def hard_timeout() -> None:
        print(f"HARD TIMEOUT after {args.timeout_s:.0f} s: killing the servers", flush=True)
        kill_all()
        result["failure"] = f"hard timeout after {args.timeout_s:.0f} s"
        try:
            for s in (g, b):
                scan_if_missing(s)
                trim_log(s.log_path)
            finish(args, result, t0)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
            os._exit(2)

    watchdog = threading.Timer(max(1.0, t_end - time.time()), hard_timeout)
    watchdog.daemon = True
    watchdog.start()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind to the finally below
        signal.signal(sig, lambda *_: sys.exit(143))
    try:
        t = time.time()
        try:
            granikv_phase(args, plan, g, result, t_end)
        except Exception as e:
            traceback.print_exc()
            result["failure"] = f"granikv phase: {type(e).__name__}: {e}"
        finally:
            if g.proc is not None:
                kill_group(g.proc)
            scan_if_missing(g)
            result["durations"]["granikv_phase_s"] = round(time.time() - t, 1)
        if not args.skip_baseline and result["samples"].get("granikv_post") is not None:
            t = time.time()
            try:
                baseline_phase(args, plan, b, result)
            except Exception as e:
                traceback.print_exc()
                result["failure"] = ((result.get("failure") or "")
                                     + f" baseline phase: {type(e).__name__}: {e}")
            finally:
                if b.proc is not None:
                    kill_group(b.proc)
                scan_if_missing(b)
                result["durations"]["baseline_phase_s"] = round(time.time() - t, 1)
        watchdog.cancel()
        for s in (g, b):
            trim_log(s.log_path)
        return finish(args, result, t0)
    except (KeyboardInterrupt, SystemExit) as e:  # SIGINT / SIGTERM: report what was measured
        watchdog.cancel()
        kill_all()
        result["failure"] = f"interrupted ({type(e).__name__})"
        for s in (g, b):
            scan_if_missing(s)
        finish(args, result, t0)
        raise
    finally:
        watchdog.cancel()
        kill_all()
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:
        kill_all()
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        kill_all()
        code = 1
    sys.stdout.flush()
    os._exit(code)  # client threads are daemons; do not wait for them
