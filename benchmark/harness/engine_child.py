"""The child side of an ``sglang.Engine`` benchmark: one engine in this process, one workload
row measured per call.

:class:`EngineChild` starts the engine from a job (``engine_kwargs``, ``model_config``,
``latency``, ``dp_routing``) and, per row (:meth:`EngineChild.run`):

1. flushes the radix cache, then caches every shared prefix with one warm-up request (on every
   DP rank its agents are routed to);
2. submits every agent at once (``async_generate``, stream with a large stream_interval: one
   message at the first token, then one per interval, like a non-streamed request), agent-loop
   turns as soon as that agent's previous turn completes (``latency="none"``: one batched
   ``generate`` call instead);
3. measures output tok/s = output tokens / wall time of the batch, TTFT (first token - submit)
   and TPOT ((last - first token) / (tokens - 1)) per request, p50 and p99; the KV pool's peak
   used tokens (SGLang's load snapshot), and GraniKV's counters before and after the row when
   the engine exposes them.

:meth:`EngineChild.idle_probe` measures the GPU's idle time between decode steps instead. The
multi-agent runner, the regime grid and the correctness check run it in their children; sglang
is imported only when an engine starts.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmark.harness import replay_gaps
from benchmark.harness.counters import counter_delta, granikv_of
from benchmark.harness.latency import latency_stats
from benchmark.multi_agent import workloads as wl

STREAM_INTERVAL = 64  # messages per request: first token, then every 64 tokens (cf. non-stream's 50)
LOAD_POLL_S = 0.25


def gpu_name() -> Optional[str]:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def probe_start_tokens(max_new_tokens: int, steps: int, interval: int = STREAM_INTERVAL) -> int:
    """Output tokens every agent has before a probe of ``steps`` decode steps starts: the first
    streamed count (1, then every ``interval`` tokens: what the client sees) at or after the
    middle of the decode less half the window, so that the window is centred there; or the
    latest such count that still leaves the window's steps before the end (the first token where
    none does, e.g. 64 output tokens streamed every 64)."""
    want = max(1, (max_new_tokens - steps) // 2)
    k = -(-(want - 1) // interval)  # the first count at or after want: 1 + k * interval
    while k > 0 and 1 + k * interval + steps > max_new_tokens:
        k -= 1
    return 1 + k * interval


class EngineChild:
    """Holds one ``sglang.Engine``; ``run(spec)`` measures one workload row."""

    def __init__(self, job: Dict[str, Any]):
        import sglang  # deferred: the parent never imports sglang

        self.job = job
        self.model_dir = tempfile.mkdtemp(prefix="granikv_model_")
        shutil.copy(job["model_config"], os.path.join(self.model_dir, "config.json"))
        kw = dict(job["engine_kwargs"], model_path=self.model_dir)
        t = time.time()
        self.engine = sglang.Engine(**kw)
        self.engine_up_s = round(time.time() - t, 1)
        self.incremental = bool(getattr(self.engine.server_args, "incremental_streaming_output", False))
        self.loop = self.engine.loop

    # ---- engine facts ------------------------------------------------------------------

    def server_info(self) -> Dict[str, Any]:
        try:
            return self.engine.get_server_info()
        except Exception as e:  # informational only
            return {"error": f"get_server_info: {e}"}

    def info(self) -> Dict[str, Any]:
        si = self.server_info()
        states = si.get("internal_states") or [{}]
        mem = (states[0] or {}).get("memory_usage")
        out = dict(engine_up_s=self.engine_up_s, gpu=gpu_name(), version=si.get("version"),
                   memory_usage=mem)
        for k in ("max_total_num_tokens", "page_size", "max_running_requests",
                  "chunked_prefill_size", "attention_backend", "cuda_graph_max_bs_decode",
                  "disable_cuda_graph", "tp_size", "dp_size"):
            if k in si:
                out[k] = si[k]
        return out

    def granikv_counters(self) -> Optional[Dict[str, Any]]:
        """GraniKV's own counters if the engine exposes them (server info, top level or per
        scheduler); None when it does not (baseline, or an engine without the hook)."""
        return granikv_of(self.server_info())

    async def kv_used_tokens(self) -> Optional[int]:
        """Used KV tokens now (sum over DP ranks), from SGLang's load snapshot; None if absent."""
        try:
            loads = await self.engine.tokenizer_manager.get_loads()
            return int(sum(getattr(x, "num_used_tokens", 0) for x in loads))
        except Exception:
            return None

    # ---- one row -----------------------------------------------------------------------

    def routes(self, w: wl.Workload) -> Optional[Tuple[int, ...]]:
        """Each agent's DP rank (``routed_dp_rank``), or None to let SGLang route. Only streamed
        rows route: the batch mode sends one ``generate`` call, which SGLang routes itself."""
        dp = int(self.job["engine_kwargs"].get("dp_size") or 1)  # what the engine really runs
        streamed = self.job["latency"] == "stream"
        if dp > 1 and streamed and self.job.get("dp_routing", "prefix") == "prefix":
            return wl.dp_routes(w, dp)
        return None

    def warm(self, w: wl.Workload, routes: Optional[Sequence[int]] = None) -> float:
        """Flush the radix cache, then cache every shared prefix with one short request (on
        every DP rank its agents are routed to)."""
        self.loop.run_until_complete(self.engine.tokenizer_manager.flush_cache())
        if not w.prefixes:
            return 0.0
        t = time.time()
        params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}
        if routes is None:
            self.engine.generate(input_ids=[list(p) + [5] for p in w.prefixes], sampling_params=params)
        else:
            for rank in sorted(set(routes)):
                used = sorted({w.group[i] for i in range(w.agents) if routes[i] == rank and w.group[i] >= 0})
                if used:
                    self.engine.generate(input_ids=[list(w.prefixes[g]) + [5] for g in used],
                                         sampling_params=params, routed_dp_rank=rank)
        return time.time() - t

    async def _agent(self, w: wl.Workload, i: int, stats: Dict[str, List],
                     routes: Optional[Sequence[int]] = None,
                     on_tokens: Optional[Callable[[int, int], None]] = None) -> None:
        """One agent's turns, streamed; ``on_tokens(turn, n)``: called with the turn and its
        output token count so far after each chunk (the idle probe starts its window from these)."""
        context = list(w.prompts[i])
        params = dict(w.sampling.to_dict(), stream_interval=STREAM_INTERVAL)
        route = {} if routes is None else {"routed_dp_rank": routes[i]}
        for turn in range(w.turns):
            t_submit = time.perf_counter()
            t_first, ids, meta = None, [], {}
            stream = await self.engine.async_generate(input_ids=context, sampling_params=params,
                                                      stream=True, **route)
            async for chunk in stream:
                if t_first is None:
                    t_first = time.perf_counter()
                ids = ids + list(chunk["output_ids"]) if self.incremental else chunk["output_ids"]
                if on_tokens is not None:
                    on_tokens(turn, len(ids))
                meta = chunk.get("meta_info", {})
            t_end = time.perf_counter()
            n = len(ids)
            stats["out"].append(n)
            stats["cached"].append(meta.get("cached_tokens", 0))
            stats["ttft"].append(t_first - t_submit)
            if n > 1:
                stats["tpot"].append((t_end - t_first) / (n - 1))
            if turn + 1 < w.turns:
                context = w.next_prompt(i, context, ids, turn)

    async def _poll_kv(self, done: asyncio.Event, peak: List[int]) -> None:
        while not done.is_set():
            used = await self.kv_used_tokens()
            if used is not None:
                peak[0] = max(peak[0], used)
            try:
                await asyncio.wait_for(done.wait(), LOAD_POLL_S)
            except asyncio.TimeoutError:
                pass

    async def _timed_stream(self, w: wl.Workload, routes: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        stats: Dict[str, List] = {"out": [], "cached": [], "ttft": [], "tpot": []}
        done, peak = asyncio.Event(), [0]
        poller = asyncio.ensure_future(self._poll_kv(done, peak))
        t = time.perf_counter()
        await asyncio.gather(*(self._agent(w, i, stats, routes) for i in range(w.agents)))
        wall = time.perf_counter() - t
        done.set()
        await poller
        return dict(seconds=wall, out_tokens=sum(stats["out"]), cached_tokens=sum(stats["cached"]),
                    kv_used_tokens_peak=peak[0] or None, **latency_stats("ttft", stats["ttft"]),
                    **latency_stats("tpot", stats["tpot"]))

    def _timed_batch(self, w: wl.Workload) -> Dict[str, Any]:
        """baseline_bench.py's method: one generate call with every prompt (one turn only;
        SGLang routes it across DP ranks)."""
        if w.turns != 1:
            return self.loop.run_until_complete(self._timed_stream(w))
        t = time.perf_counter()
        res = self.engine.generate(input_ids=[list(p) for p in w.prompts],
                                   sampling_params=w.sampling.to_dict())
        wall = time.perf_counter() - t
        return dict(seconds=wall, out_tokens=sum(len(r["output_ids"]) for r in res),
                    cached_tokens=sum(r["meta_info"].get("cached_tokens", 0) for r in res),
                    kv_used_tokens_peak=None, ttft_p50_ms=None, ttft_p99_ms=None,
                    tpot_p50_ms=None, tpot_p99_ms=None)

    def run(self, spec: wl.WorkloadSpec) -> Dict[str, Any]:
        w = spec.build()
        routes = self.routes(w)
        warm_s = self.warm(w, routes)
        before = self.granikv_counters()
        if self.job["latency"] == "stream":
            m = self.loop.run_until_complete(self._timed_stream(w, routes))
        else:
            m = self._timed_batch(w)
        if m["out_tokens"] != w.out_tokens:
            raise RuntimeError(f"{spec.label}: {m['out_tokens']} output tokens, expected "
                               f"{w.out_tokens} (ignore_eos)")
        seconds = m.pop("seconds")
        return dict(workload=w.name, prefix_len=w.prefix_len, agents=w.agents, turns=w.turns,
                    params=dict(w.params), seconds=round(seconds, 3),
                    out_tok_per_s=round(m["out_tokens"] / seconds, 1),
                    prompt_tokens=w.prompt_tokens_first_turn, kv_tokens_logical=w.kv_tokens_logical(),
                    warm_prefix_s=round(warm_s, 2),
                    dp_routes=None if routes is None else [routes.count(r) for r in range(max(routes) + 1)],
                    **self._counters(before), **m)

    def idle_probe(self, spec: wl.WorkloadSpec, steps: int, trace_dir: str, *, host: bool = False,
                   keep: Optional[str] = None) -> Dict[str, Any]:
        """The GPU's idle time between decode steps on one untimed run of ``spec``: once every
        agent is ``probe_start_tokens`` into its output (prefill done, decode steady; in an agent
        loop, into turn ``turns // 2``, the middle turn, or past it), SGLang's
        profiler records the next ``steps`` forward steps (GPU activity only, no stacks or
        shapes); the trace is reduced by harness.gpu_idle. The window is centred on the middle of
        the decode: a step grows with its requests' contexts over the run, and the middle step's
        busy time is the run's mean, which the row's TPOT p50 is (a window at the first token
        would put a 4-layer forest's GraniKV step at 2.1 ms against its run mean of 2.8 ms, and
        ``regime_report.timed_idle_us`` would read the difference as idle time). The run's tok/s
        is not reported (the profiler slows it). With the replay-gap recorder in the engine
        (``harness.replay_gaps``; not with ``host``), the same run's decode replays are timed
        by CUDA events outside the profiled steps too (``replay_gaps`` in the result).
        ``host``: CPU activity recorded too, reduced to the host's time per call name
        (``gpu_idle.host_calls_of_events``) instead of the idle time (which the CPU profiler
        would distort). ``keep``: a path; with ``host``, Python frames are recorded too and the
        trace is kept there, gzipped (``gpu_idle.python_self_times`` reduces it per function)."""
        from benchmark.harness import gpu_idle
        from sglang.srt.managers.io_struct import ProfileReq

        w = spec.build()
        turn = w.turns // 2
        steps = max(1, min(steps, int(w.sampling.max_new_tokens) // 2))
        start = probe_start_tokens(int(w.sampling.max_new_tokens), steps)
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        self.warm(w)
        control = None if host else os.environ.get(replay_gaps.CONTROL_ENV)
        if control:  # the decode replays' gaps over the same run, outside the profiled steps
            replay_gaps.arm(control, True)
            self.server_info()
        req = ProfileReq(output_dir=trace_dir, num_steps=steps, activities=["CPU", "GPU"] if host else ["GPU"],
                         with_stack=bool(host and keep), record_shapes=False, profile_prefix="host" if host else "idle")

        async def probe() -> None:
            stats: Dict[str, List] = {"out": [], "cached": [], "ttft": [], "tpot": []}
            progress = [(0, 0)] * w.agents  # (turn, output tokens in it) per agent

            def seen(i: int, t: int, n: int) -> None:
                progress[i] = (t, n)

            agents = [asyncio.ensure_future(self._agent(w, i, stats, on_tokens=partial(seen, i)))
                      for i in range(w.agents)]
            while min(progress) < (turn, start) and not all(a.done() for a in agents):
                await asyncio.sleep(0.005)
            await self.engine.tokenizer_manager.start_profile(req)
            await asyncio.gather(*agents)

        self.loop.run_until_complete(probe())
        gaps = None
        if control:
            replay_gaps.arm(control, False)
            gaps = replay_gaps.of_server_info(self.server_info())
        deadline = time.time() + 60
        trace = gpu_idle.newest_trace(Path(trace_dir))
        while trace is None and time.time() < deadline:  # written when the N-th step ends
            time.sleep(0.5)
            trace = gpu_idle.newest_trace(Path(trace_dir))
        if trace is None:
            raise RuntimeError(f"no profiler trace in {trace_dir} after the probe")
        time.sleep(1.0)  # let the writer finish the file
        res = (gpu_idle.host_calls_of_trace(trace, steps) if host else gpu_idle.idle_of_trace(trace, steps)) or {}
        if keep:
            gpu_idle.keep_trace(trace, Path(keep))
            res = dict(res, trace=keep)
        shutil.rmtree(trace_dir, ignore_errors=True)
        if gaps is not None:
            res = dict(res, replay_gaps=gaps)
        return dict(res, workload=w.name, agents=w.agents, probe_start_tokens=start, probe_turn=turn)

    def _counters(self, before: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """GraniKV counters after the row, and their increase over the timed batch."""
        after = self.granikv_counters()
        if after is None:
            return dict(granikv=None, granikv_delta=None)
        return dict(granikv=after, granikv_delta=counter_delta(after, before or {}))

