"""End-to-end multi-agent benchmark: SGLang alone vs SGLang + GraniKV, same workloads, one run.

    python3 benchmark/multi_agent/run.py --quick --out docs/results
    python3 benchmark/multi_agent/run.py --backends flashinfer,triton \
        --workloads homogeneous,heterogeneous,agent_loop,no_sharing,ceiling --agents 16,32,64,128

For every attention backend it runs two engine configurations, ``baseline`` (``sglang.Engine``
with ``attention_backend=X``) and ``granikv`` (the same + ``enable_granikv=True``), each in its
own subprocess so GPU memory is freed between engines. A child builds the workloads from their
seeded specs (identical token ids in every configuration), and per workload row:

1. flushes the radix cache, then caches every shared prefix with one warm-up request;
2. submits every agent at once (``async_generate``, stream with a large stream_interval: one
   message at the first token, then one per interval, like a non-streamed request), agent-loop
   turns as soon as that agent's previous turn completes;
3. measures output tok/s = output tokens / wall time of the batch, TTFT (first token - submit)
   and TPOT ((last - first token) / (tokens - 1)) per request, p50 and p99; the KV pool's peak
   used tokens (SGLang's load snapshot), and GraniKV's counters when the engine exposes them;
4. prints ``ROW {json}``.

The parent collects the rows, pairs baseline with granikv, divides by the 256-token-prefix
ceiling measured in the same run (see workloads.short_prefix_ceiling) and writes
multi_agent.json / .md / .png into --out after every configuration (a run cut short keeps what
it measured). Model: a shipped HF config with dummy weights, token ids sent directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import agreement  # noqa: E402
import report  # noqa: E402
import workloads as wl  # noqa: E402
from harness.engine_proc import ERROR_TAG, INFO_TAG, ROW_TAG, emit, engine_env, exit_after, run_tagged  # noqa: E402,F401

CONFIG_DIR = HERE / "configs"
CONFIGS = ("baseline", "granikv")

# Engine arguments of every published run: pytorch sampling (greedy never reaches
# FlashInfer's sampling kernels, so an install without them works),
# no grammar backend, decode CUDA graphs up to 256, no prefill CUDA graph (faster start).
BASE_ENGINE_KWARGS: Dict[str, Any] = dict(
    load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
    grammar_backend="none", mem_fraction_static=0.85, log_level="warning",
    max_running_requests=256, disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=256,
)
STREAM_INTERVAL = 64  # messages per request: first token, then every 64 tokens (cf. non-stream's 50)
LOAD_POLL_S = 0.25


# ------------------------------------------------------------------------------------------
# plan (parent side, no GPU, no sglang import)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """One engine = one child process: a backend, GraniKV on or off, the engine kwargs."""

    backend: str
    config: str  # "baseline" | "granikv"
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.config}"


def parse_value(text: str) -> Any:
    """``--engine-arg`` value: JSON literal when it parses (8, 0.8, true, null, [..]), else str."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_engine_args(items: Sequence[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg {item!r} is not key=value")
        out[key.strip().replace("-", "_")] = parse_value(value)
    return out


def is_granikv_key(key: str) -> bool:
    return key == "enable_granikv" or key.startswith("granikv_")


def engine_configs(args: argparse.Namespace) -> List[EngineConfig]:
    """Backends x configs; ``granikv_*`` pass-through keys go to the granikv engines only."""
    extra = parse_engine_args(args.engine_arg)
    common = {k: v for k, v in extra.items() if not is_granikv_key(k)}
    gkv = {k: v for k, v in extra.items() if is_granikv_key(k)}
    out = []
    for backend in args.backends:
        for config in args.configs:
            kw = dict(BASE_ENGINE_KWARGS, attention_backend=backend, tp_size=args.tp,
                      dp_size=args.dp)
            kw.update(common)
            if config == "granikv":
                kw.update(enable_granikv=True, **gkv)
            out.append(EngineConfig(backend, config, kw))
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    ints = lambda s: [int(x) for x in csv(s)]  # noqa: E731
    p.add_argument("--backends", type=csv, default=["flashinfer", "triton"],
                   help="SGLang attention backends to compare under (default flashinfer,triton).")
    p.add_argument("--configs", type=csv, default=list(CONFIGS),
                   help="Engine configurations per backend (default baseline,granikv).")
    p.add_argument("--workloads", type=csv, default=list(wl.WORKLOAD_NAMES),
                   help=f"Subset of {','.join(wl.WORKLOAD_NAMES)}.")
    p.add_argument("--agents", type=ints, default=[16, 32, 64, 128])
    p.add_argument("--prefix", type=int, default=16384, help="Shared prefix (homogeneous, agent_loop).")
    p.add_argument("--no-sharing-len", type=int, default=2048, help="Prompt length of no_sharing.")
    p.add_argument("--turns", type=int, default=4, help="Turns per agent in agent_loop.")
    p.add_argument("--quick", action="store_true",
                   help="~3 min: flashinfer only; homogeneous 16K x 64, ceiling 256 x 64, "
                        "no_sharing 1024 x 64. Overrides --backends/--workloads/--agents.")
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"A folder of {CONFIG_DIR.relative_to(HERE.parent.parent)} "
                        f"({', '.join(sorted(d.name for d in CONFIG_DIR.iterdir() if d.is_dir()))}) "
                        "or a path to a model folder.")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dp-routing", choices=("prefix", "balance"), default="prefix",
                   help="With --dp > 1: 'prefix' sends each agent's requests with SGLang's "
                        "routed_dp_rank from workloads.dp_routes (prefix-affine, balanced); "
                        "'balance' leaves routing to SGLang's --load-balance-method.")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--tag", default="", help="Suffix of the output names: multi_agent[_TAG].*")
    p.add_argument("--latency", choices=("stream", "none"), default="stream",
                   help="stream: per-request TTFT/TPOT (default); none: one batched generate "
                        "call per row, no TTFT/TPOT.")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="Extra sglang.Engine keyword (repeatable); granikv_* keys apply only to "
                        "the granikv engines.")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="Seconds per engine.")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="Time budget of the whole run (0 = none): each engine gets an equal "
                        "share of what is left and starts no row past it (a running row "
                        "finishes).")
    p.add_argument("--dry-run", action="store_true", help="Print the plan and exit.")
    p.add_argument("--no-agreement", action="store_true",
                   help="Skip the output-agreement probe (greedy ids and logprobs vs baseline).")
    p.add_argument("--write-model-dir", metavar="DIR",
                   help="Write --model's config.json and a word-level tokenizer into DIR (for "
                        "bench_serving.sh) and exit.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.backends, args.workloads, args.agents = ["flashinfer"], ["homogeneous", "ceiling",
                                                                      "no_sharing"], [64]
        args.no_sharing_len = 1024
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"--configs: {c!r} is not one of {', '.join(CONFIGS)}")
    return args


def model_config_path(model: str) -> Path:
    shipped = CONFIG_DIR / model / "config.json"
    if shipped.is_file():
        return shipped
    given = Path(model) / "config.json"
    if given.is_file():
        return given
    raise ValueError(f"--model {model!r}: no {shipped} and no {given}")


def write_model_dir(model: str, dest: str, *, tokenizer: bool = False) -> Path:
    """A model folder for ``--load-format dummy``: the shipped config.json and, optionally, a
    word-level tokenizer (token i <-> the word ``t<i>``, whitespace-separated) covering the
    whole vocabulary, for clients that send text (sglang.bench_serving). decode then encode
    round-trips exactly, so a prompt of N generated tokens is N tokens on the server too.
    """
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = model_config_path(model)
    shutil.copy(cfg_path, out / "config.json")
    if tokenizer:
        cfg = json.loads(cfg_path.read_text())
        vocab = {f"t{i}": i for i in range(int(cfg["vocab_size"]))}
        tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
               "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
               "post_processor": None, "decoder": None,
               "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
        (out / "tokenizer.json").write_text(json.dumps(tok))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
            "bos_token": f"t{cfg.get('bos_token_id', 1)}", "eos_token": f"t{cfg.get('eos_token_id', 2)}",
            "unk_token": "t0", "clean_up_tokenization_spaces": False}))
    return out


def specs_of(args: argparse.Namespace) -> List[wl.WorkloadSpec]:
    return wl.plan(args.workloads, args.agents, args.prefix, no_sharing_len=args.no_sharing_len,
                   turns=args.turns)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python3", "benchmark/multi_agent/run.py", *argv])


def print_plan(args, configs: Sequence[EngineConfig], specs: Sequence[wl.WorkloadSpec]) -> None:
    print(f"model {args.model} ({model_config_path(args.model)}), tp={args.tp} dp={args.dp}, "
          f"latency={args.latency}, out={args.out}")
    for c in configs:
        print(f"engine {c.name}: {json.dumps(c.engine_kwargs, sort_keys=True)}")
    print(f"{len(specs)} rows per engine, {len(specs) * len(configs)} in all:")
    for s in specs:
        w = s.build()
        print(f"  {s.label:44s} turns={w.turns} prompt_tokens={w.prompt_tokens_first_turn:>9,d} "
              f"out_tokens={w.out_tokens:>7,d} kv_tokens_logical={w.kv_tokens_logical():>9,d}")


# ------------------------------------------------------------------------------------------
# parent: one child per engine configuration
# ------------------------------------------------------------------------------------------


def server_flags(kwargs: Dict[str, Any]) -> List[str]:
    """Engine kwargs as ``launch_server`` flags: ``True`` -> ``--key``, other values ``--key value``."""
    flags: List[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def run_child(cfg: EngineConfig, args, specs, timeout: float,
              on_record: Callable[[Dict[str, Any]], None], *,
              deadline: Optional[float] = None) -> None:
    """Runs one engine in a subprocess; passes each ROW / INFO / ERROR record to on_record.

    The child starts no row after ``deadline`` (epoch seconds); it is killed after ``timeout``.
    """
    job = dict(engine_kwargs=cfg.engine_kwargs, backend=cfg.backend, config=cfg.config,
               model_config=str(model_config_path(args.model)), latency=args.latency,
               specs=[s.to_json() for s in specs], deadline=deadline,
               agreement=not args.no_agreement, dp_routing=args.dp_routing)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        res = run_tagged([sys.executable, str(Path(__file__).resolve()), "--child", f.name], name=cfg.name,
                         on_record=on_record, timeout=timeout, env=engine_env(cfg.backend),
                         extra=dict(backend=cfg.backend, config=cfg.config))
    finally:
        os.unlink(f.name)
    if res.timed_out:
        on_record(dict(kind="error", backend=cfg.backend, config=cfg.config,
                       error=f"killed after --child-timeout {timeout:.0f} s"))
    elif res.returncode != 0 and not res.errors:
        on_record(dict(kind="error", backend=cfg.backend, config=cfg.config,
                       error=f"child exited with status {res.returncode}"))


def agreement_summaries(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per backend: GraniKV's output agreement with the baseline vs the baseline's own."""
    probes = {(r["backend"], r["config"]): r for r in records
              if r["kind"] == "info" and "agreement_runs" in r}
    out = {}
    for (backend, config), rec in probes.items():
        base = probes.get((backend, "baseline"))
        if config == "granikv" and base is not None:
            out[backend] = agreement.summarize(base, rec)
            print(f"agreement {backend}: {json.dumps(out[backend])}", flush=True)
    return out


def main_parent(args, argv: Sequence[str]) -> int:
    configs = engine_configs(args)
    specs = specs_of(args)
    print_plan(args, configs, specs)
    if args.dry_run:
        return 0
    meta = dict(command=command_line(argv), date=datetime.now(timezone.utc).isoformat(
        timespec="seconds"), model=args.model, tp=args.tp, dp=args.dp, latency=args.latency,
        engine_kwargs={c.name: c.engine_kwargs for c in configs})
    records: List[Dict[str, Any]] = []

    def on_record(rec: Dict[str, Any]) -> None:  # outputs rewritten per record: a cut run keeps rows
        records.append(rec)
        if rec["kind"] != "info":
            report.write(args.out, records, meta, tag=args.tag, quiet=True)

    # SIGTERM (a timeout around the run) unwinds run_child, which kills the engine's group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.time() + args.budget_s if args.budget_s else None
    for i, cfg in enumerate(configs):
        child_deadline = None
        if deadline:  # an equal share of what is left for each engine still to run
            now = time.time()
            if now > deadline:
                print(f"budget of {args.budget_s:.0f} s spent: skipping {cfg.name}", flush=True)
                on_record(dict(kind="error", backend=cfg.backend, config=cfg.config,
                               error="skipped: --budget-s spent"))
                continue
            child_deadline = now + (deadline - now) / (len(configs) - i)
        run_child(cfg, args, specs, args.child_timeout, on_record, deadline=child_deadline)
    meta["agreement"] = agreement_summaries(records)
    paths = report.write(args.out, records, meta, tag=args.tag)
    print(f"wrote {', '.join(str(p) for p in paths)}", flush=True)
    errors = [r for r in records if r["kind"] == "error"]
    for e in errors:
        print(f"ERROR {e['backend']}/{e['config']}: {e['error']}", flush=True)
    print(report.markdown_table(report.combine(records)), flush=True)
    return 1 if errors else 0


# ------------------------------------------------------------------------------------------
# child: one engine, every row
# ------------------------------------------------------------------------------------------


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
    ms = [v * 1e3 for v in values_s]
    return {f"{prefix}_p50_ms": _round(percentile(ms, 50)), f"{prefix}_p99_ms": _round(percentile(ms, 99))}


def _round(x: Optional[float], nd: int = 2) -> Optional[float]:
    return None if x is None else round(x, nd)


class Child:
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
        si = self.server_info()
        if isinstance(si.get("granikv"), dict):
            return si["granikv"]
        for state in si.get("internal_states") or []:
            if isinstance(state, dict) and isinstance(state.get("granikv"), dict):
                return state["granikv"]
        return None

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
                     on_first: Optional[Callable[[], None]] = None) -> None:
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
                    if on_first is not None and turn == 0:
                        on_first()
                ids = ids + list(chunk["output_ids"]) if self.incremental else chunk["output_ids"]
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

    def idle_probe(self, spec: wl.WorkloadSpec, steps: int, trace_dir: str) -> Dict[str, Any]:
        """The GPU's idle time between decode steps on one untimed run of ``spec``: once every
        agent has its first token (prefill done, decode steady), SGLang's profiler records the
        next ``steps`` forward steps (GPU activity only, no stacks or shapes); the trace is
        reduced by harness.gpu_idle. The run's tok/s is not reported (the profiler slows it)."""
        from harness import gpu_idle
        from sglang.srt.managers.io_struct import ProfileReq

        w = spec.build()
        if w.turns != 1:
            raise ValueError(f"{spec.label}: the idle probe needs a one-turn workload (has {w.turns})")
        steps = max(1, min(steps, int(w.sampling.max_new_tokens) // 2))
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        self.warm(w)
        req = ProfileReq(output_dir=trace_dir, num_steps=steps, activities=["GPU"], with_stack=False,
                         record_shapes=False, profile_prefix="idle")

        async def probe() -> None:
            stats: Dict[str, List] = {"out": [], "cached": [], "ttft": [], "tpot": []}
            first: List[int] = []
            agents = [asyncio.ensure_future(self._agent(w, i, stats, on_first=lambda: first.append(1)))
                      for i in range(w.agents)]
            while len(first) < w.agents and not all(a.done() for a in agents):
                await asyncio.sleep(0.005)
            await self.engine.tokenizer_manager.start_profile(req)
            await asyncio.gather(*agents)

        self.loop.run_until_complete(probe())
        deadline = time.time() + 60
        trace = gpu_idle.newest_trace(Path(trace_dir))
        while trace is None and time.time() < deadline:  # written when the N-th step ends
            time.sleep(0.5)
            trace = gpu_idle.newest_trace(Path(trace_dir))
        if trace is None:
            raise RuntimeError(f"no profiler trace in {trace_dir} after the probe")
        time.sleep(1.0)  # let the writer finish the file
        res = gpu_idle.idle_of_trace(trace, steps) or {}
        shutil.rmtree(trace_dir, ignore_errors=True)
        return dict(res, workload=w.name, agents=w.agents)

    def _counters(self, before: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """GraniKV counters after the row, and their increase over the timed batch."""
        after = self.granikv_counters()
        if after is None:
            return dict(granikv=None, granikv_delta=None)
        return dict(granikv=after, granikv_delta=counter_delta(after, before or {}))


NON_ADDITIVE = ("_mean", "_max", "_rate", "_per_step", "_p50", "_p99", "_window_steps")  # ratios, extremes,
# percentiles and window sizes: their difference means nothing


def counter_delta(after: Dict[str, Any], before: Dict[str, Any]) -> Dict[str, Any]:
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


def gpu_name() -> Optional[str]:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def main_child(job_path: str) -> int:
    job = json.load(open(job_path))
    try:
        child = Child(job)
    except Exception as e:
        traceback.print_exc()
        emit(ERROR_TAG, dict(error=f"engine start: {type(e).__name__}: {e}"))
        return 1
    # First requests pay lazy initialisation (JIT modules, allocator growth): not timed.
    child.engine.generate(input_ids=[[1000 + i] * 64 for i in range(4)],
                          sampling_params={"max_new_tokens": 16, "ignore_eos": True, "temperature": 0})
    status, info = 0, child.info()
    if job.get("agreement"):
        try:
            info.update(agreement.probe(child.engine))
        except Exception as e:
            traceback.print_exc()
            emit(ERROR_TAG, dict(error=f"agreement probe: {type(e).__name__}: {e}"))
            status = 1
    emit(INFO_TAG, info)
    for s in job["specs"]:
        spec = wl.WorkloadSpec.from_json(s)
        if job.get("deadline") and time.time() > job["deadline"]:
            emit(ERROR_TAG, dict(error=f"{spec.label}: skipped, --budget-s spent",
                                 workload=spec.name, agents=spec.agents))
            status = 1
            continue
        try:
            emit(ROW_TAG, child.run(spec))
        except Exception as e:
            traceback.print_exc()
            emit(ERROR_TAG, dict(error=f"{spec.label}: {type(e).__name__}: {e}",
                                 workload=spec.name, agents=spec.agents))
            status = 1
    child.engine.shutdown()
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return main_child(args.child)
    if args.write_model_dir:
        print(write_model_dir(args.model, args.write_model_dir, tokenizer=True))
        return 0
    return main_parent(args, argv)


if __name__ == "__main__":
    exit_after(main)
