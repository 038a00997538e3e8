"""The soak's load: the seeded request plan and the driver that sends it to a launched server.

Plan (pure: no server, no network): requests built from the multi-agent workloads (shared
families, agent-loop sessions, no-sharing prompts) in sliding family windows, the aborted
requests and the identity sample (see soak.py's docstring for the method). Driver: client
threads that take jobs in plan order until a deadline, a monitor that polls the server for
peaks, and the sample run that both servers answer the same way.
"""

from __future__ import annotations

import http.client
import random
import re
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmark.harness.latency import latency_stats
from benchmark.harness.server_proc import Server, http_call
from benchmark.multi_agent import workloads as wl
from benchmark.reliability.soak_client import Outcome, generate_batch, stream_generate


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
DRAIN_S = 100.0  # in-flight requests after the load deadline
IDLE_TIMEOUT_S = 60.0
LOAD_POLL_S, INFO_POLL_S, PROGRESS_S = 1.0, 5.0, 15.0


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
