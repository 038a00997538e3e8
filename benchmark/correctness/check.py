"""End-to-end correctness check of GraniKV on a model whose outputs depend on the context.

    python3 -m benchmark.correctness.check --out docs/results
    python3 -m benchmark.correctness.check --backends triton --no-fault --out /tmp/c   # shorter

1. Writes a random-normal Llama checkpoint (checkpoint.py: 4 layers, 32 q / 8 kv heads of 128,
   a 4,096-token vocabulary) into a temporary folder; every engine loads it through SGLang's
   normal safetensors loader.
2. Per attention backend, runs three engines, each in its own subprocess (``python -m
   benchmark.correctness.check --child JOB``): ``baseline`` (stock
   SGLang), ``granikv`` (``enable_granikv=True``, decode path forced to ``cascade`` unless
   ``--attention-path`` says otherwise and prefill path ``hot``, so the shared-prefix kernels
   run on these short prompts) and ``fault`` (the same with ``GRANIKV_DEBUG_FAULT=half_prefix``: every group's
   prefix attention drops the second half of its HOT extent).
3. Every engine runs the project's workloads (benchmark/multi_agent/workloads.py) at a small
   size, greedy with logprobs: homogeneous, heterogeneous, and the agent loop (turns submitted
   asynchronously per agent; the text between turns is fixed, not the engine's output, so every
   engine sees the same prompts in every turn).
4. GraniKV and fault engines run with ``--granikv-debug-compare-every N`` (``--compare-every``,
   default 4): every layer of every N-th eager decode step is compared with the wrapped stock
   backend's output for the same step (attention/debug/compare.py), within a tolerance of
   TOLERANCE_FACTOR (4) x the stock output's own deviation from a float64 paged reference, at
   least FLOOR_EPS (2) x the dtype's eps. A CUDA-graph replay runs no Python, so while the
   compare is on every engine (the baselines too: all engines run the same kind of decode
   step) runs with decode CUDA graphs off (``disable_cuda_graph``); ``--compare-every 0``
   keeps the graphs and drops the layer rule.
5. Compares (metrics.py) granikv and fault against the baseline of the same backend, and the
   flashinfer baseline against the triton baseline (two correct kernels) on the same prompts,
   or, with ``--dequantized-reference`` (an FP8 cache that one backend serves), against the
   two DEQUANTIZED engines: stock flashinfer and stock triton over a bf16 cache holding the K/V
   rounded through the FP8 format (``GRANIKV_DEBUG_KV_ROUND``, attention/debug/kv_round.py;
   GraniKV on with path ``paged``, so stock kernels do all the attention). Those two are the
   bf16 rows' two correct kernels, over exactly the values GraniKV dequantizes: the token rule
   then compares GraniKV (and the fault) with the same backend's dequantized engine, and the
   dequantized pair with each other. SGLang's own FP8 triton decode also rounds the query and
   the probabilities to FP8 (8.7% per request at 16K x 64, test/kernels/test_gpu_fp8_sinks.py),
   a larger change than the fault's on this model, so it is not the token rule's reference; the
   layer rule still compares GraniKV with it (its tolerance grows with that error),
   with bootstrap stderrs and 95% intervals (2,000 resamples of the requests, seed 0).
   With ``--model gpt-oss`` (a hybrid model: sliding-window layers, attention sinks on every
   layer; checkpoint.GptOssShape), SGLang serves it on triton only, so the token rule's second
   correct kernel is the SPLITS engine: stock triton with its decode split over
   ``SPLITS_KV_SPLITS`` KV chunks instead of SGLang's default 8 (the same kernel, another
   summation order); every engine runs with ``--disable-hybrid-swa-memory`` (one KV pool, where
   GraniKV's per-layer decode paths apply). With ``--model qwen3-moe`` (Qwen3-30B-A3B's
   attention: GQA 8 at head_dim 128, RMSNorm on each q and k head, a small MoE;
   checkpoint.Qwen3MoeShape) the engines and references are the Llama check's.

The pass rule of a row (results.py): BOTH

- layer outputs: at least one decode layer-step of the workload compared, and none with
  ``max|GraniKV - stock| / max|stock|`` (over the batch, per layer) above its tolerance;
- tokens: ``granikv agreement >= cross-backend agreement - max(0.05, 3 * diff_stderr)``, with
  ``diff_stderr`` the paired bootstrap stderr of the difference of the two agreements (same
  resampled requests), first-token agreement at least cross-backend's less
  ``max(0.05, 3 * `` its paired bootstrap stderr ``)`` and logprob deviation within 3x theirs
  + 0.02;

with GraniKV's own attention shown to have run (its counters). The planted fault is caught
only when EACH rule rejects the fault engine (``fault_caught_by`` records which did); with
``--compare-every 0`` the token rule decides alone.

Writes ``correctness.json`` (``{"meta", "rows"}``) and ``correctness.md`` into ``--out``. Exit
status 1 when a row fails, a fault goes uncaught, or an engine fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmark.correctness import checkpoint, metrics, results
from benchmark.harness.counters import counter_delta
from benchmark.harness.engine_args import BASE_ENGINE_KWARGS, parse_engine_args
from benchmark.harness.engine_child import EngineChild, gpu_name
from benchmark.harness.engine_proc import REPO_ROOT, engine_env, exit_after, kill_group, module_command, repo_env
from benchmark.multi_agent import workloads as wl
from granikv.config import is_granikv_key

# attention/debug/compare.py's constants without importing its module (this parent runs no engine); a test
# checks they match
TOLERANCE_FACTOR = 4.0
FLOOR_EPS = 2.0
CONFIGS = ("baseline", "granikv", "fault")
FAULT = "half_prefix"
KV_ROUND_FORMATS = ("fp8_e4m3", "fp8_e5m2")  # attention/debug/kv_round.py's FORMATS (a test checks)
KV_ROUND_MARK = "before attention (debug only: a reference for an FP8 KV cache)"  # its LOG_MARK (likewise)
RESULT_TAG = "RESULT "
SPLITS_KV_SPLITS = 16  # the SPLITS reference engine's --triton-attention-num-kv-splits (SGLang's default: 8)
MODEL_BACKENDS = {"gpt-oss": ("triton",)}  # what SGLang serves each check model on (absent: any)
VOCAB_LO = 16  # remapped token ids stay clear of the special ids 0..15

# The benchmarks' engine kwargs (harness.engine_args), for a real checkpoint and a short run.
ENGINE_KWARGS: Dict[str, Any] = dict(
    BASE_ENGINE_KWARGS, load_format="safetensors", mem_fraction_static=0.6,
    max_running_requests=64, cuda_graph_max_bs_decode=64,
)


def specs(out: int, scale: int = 1) -> List[wl.WorkloadSpec]:
    """The three workloads at check size: every shared prefix >= GraniKV's default
    hot_min_tokens (1024), so it is promoted to HOT. ``scale`` multiplies the agents of each
    (16 / 16 / 8 at 1): the agreement up to the first differing token is a per-request 0..1
    figure, so its noise falls as 1/sqrt(requests)."""
    if scale < 1:
        raise ValueError(f"scale={scale} must be >= 1")
    return [
        wl.WorkloadSpec("homogeneous", 16 * scale, 2048, {"suffix": 64, "out": out}),
        wl.WorkloadSpec("heterogeneous", 16 * scale, 3072, {
            "prefixes": [1024, 1536, 2048, 3072], "weights": [4, 3, 2, 1], "suffix": 64,
            "out": out}),
        wl.WorkloadSpec("agent_loop", 8 * scale, 2048, {"turns": 3, "suffix": 64, "out": out // 2,
                                                        "tool": 48}),
    ]


def fit_vocab(w: wl.Workload, vocab: int) -> wl.Workload:
    """``w`` with every token id mapped into ``[VOCAB_LO, vocab)`` (same id -> same id, so
    shared prefixes stay shared)."""
    span = vocab - VOCAB_LO
    if span < 1:
        raise ValueError(f"vocab={vocab} must exceed {VOCAB_LO}")

    def m(ids):
        return tuple(VOCAB_LO + t % span for t in ids)

    return dataclasses.replace(
        w, prompts=tuple(m(p) for p in w.prompts), prefixes=tuple(m(p) for p in w.prefixes),
        tool_results=tuple(tuple(m(t) for t in agent) for agent in w.tool_results))


def between_turns(w: wl.Workload, agent: int, turn: int, vocab: int) -> Tuple[int, ...]:
    """Fixed tokens standing for the agent's output of ``turn`` in its next prompt (seeded, the
    same in every engine), followed by the workload's tool result."""
    rng = random.Random(f"correctness:{w.name}:{agent}:{turn}")
    said = tuple(rng.randrange(VOCAB_LO, vocab) for _ in range(w.sampling.max_new_tokens))
    return said + tuple(w.tool_results[agent][turn])


# ------------------------------------------------------------------------------------------
# child: one engine, every workload
# ------------------------------------------------------------------------------------------


def _outputs_of(results_: Sequence[Dict[str, Any]]) -> metrics.Outputs:
    return metrics.Outputs(
        ids=[list(r["output_ids"]) for r in results_],
        logprobs=[[t[0] for t in r["meta_info"].get("output_token_logprobs") or []]
                  for r in results_])


class CheckChild(EngineChild):
    """The benchmarks' engine child (warm-up, counters) over a real checkpoint."""

    def __init__(self, job: Dict[str, Any]):  # noqa: D107 - replaces EngineChild's dummy-weight start
        import sglang

        self.job = job
        self.model_dir = job["model_dir"]
        t = time.time()
        self.engine = sglang.Engine(model_path=self.model_dir, **job["engine_kwargs"])
        self.engine_up_s = round(time.time() - t, 1)
        self.incremental = False
        self.loop = self.engine.loop

    def outputs(self, w: wl.Workload) -> metrics.Outputs:
        """Greedy outputs with logprobs; agent loop: one entry per (agent, turn), agent-major."""
        self.warm(w)
        params = w.sampling.to_dict()
        if w.turns == 1:
            res = self.engine.generate(input_ids=[list(p) for p in w.prompts],
                                       sampling_params=params, return_logprob=True)
            return _outputs_of(res)
        return self.loop.run_until_complete(self._agent_loop(w, params))

    async def _agent_loop(self, w: wl.Workload, params) -> metrics.Outputs:
        vocab = self.job["vocab"]

        async def agent(i: int) -> List[Dict[str, Any]]:
            context, turns = list(w.prompts[i]), []
            for t in range(w.turns):
                r = await self.engine.async_generate(input_ids=context, sampling_params=params,
                                                     return_logprob=True)
                turns.append(r)
                if t + 1 < w.turns:
                    context += between_turns(w, i, t, vocab)
            return turns

        per_agent = await asyncio.gather(*(agent(i) for i in range(w.agents)))
        return _outputs_of([r for turns in per_agent for r in turns])

    def run_all(self, spec_list: Sequence[wl.WorkloadSpec]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for spec in spec_list:
            w = fit_vocab(spec.build(), self.job["vocab"])
            before = self.granikv_counters()
            o = self.outputs(w)
            after = self.granikv_counters()
            delta = None if after is None else counter_delta(after, before or {})
            out[w.name] = dict(outputs=o.to_json(), granikv_delta=delta,
                               granikv_state=layer_state(after))
        return out


def layer_state(counters: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The debug compare's ``attention.layer_output_*`` figures as they stand (absolute: the
    maxima cannot be differenced), None without GraniKV counters."""
    if counters is None:
        return None
    att = counters.get("attention") or {}
    return {"attention": {k: v for k, v in att.items() if k.startswith("layer_output_")}}


def main_child(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    child = CheckChild(job)
    try:
        res = dict(engine_up_s=child.engine_up_s, gpu=gpu_name(),
                   workloads=child.run_all([wl.WorkloadSpec.from_json(s) for s in job["specs"]]))
        print(RESULT_TAG + json.dumps(res), flush=True)  # before shutdown: a slow one loses nothing
    finally:
        child.engine.shutdown()
    return 0


# ------------------------------------------------------------------------------------------
# parent: one subprocess per engine, then the comparison
# ------------------------------------------------------------------------------------------


def engine_kwargs(backend: str, config: str, attention_path: str, compare_every: int = 0,
                  kv_cache_dtype: Optional[str] = None, model: str = "llama",
                  base: Optional[Dict[str, Any]] = None,
                  granikv_extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The engine of ``config`` under ``backend``. ``compare_every`` > 0: decode CUDA graphs off
    on every engine (a replay runs no Python, so the layer compare needs eager steps, and all
    engines then decode alike) and the GraniKV engines compare every layer of every
    ``compare_every``-th decode step. ``kv_cache_dtype``: every engine's (e.g. ``fp8_e4m3``:
    GraniKV against stock over the same FP8 cache). ``model`` "gpt-oss": every engine without
    SGLang's hybrid SWA pool; the SPLITS engine is stock with another KV split count. ``base``:
    the kwargs every engine starts from (default ``ENGINE_KWARGS``; ``memory_kwargs``).
    ``granikv_extra``: more GraniKV keys (``--granikv-arg``) for every engine GraniKV computes
    (its planted-fault engines too)."""
    kw = dict(ENGINE_KWARGS if base is None else base, attention_backend=backend)
    if kv_cache_dtype:
        kw.update(kv_cache_dtype=kv_cache_dtype)
    if model == "gpt-oss":
        kw.update(disable_hybrid_swa_memory=True)
    if config == results.SPLITS:
        kw.update(triton_attention_num_kv_splits=SPLITS_KV_SPLITS)
    if compare_every:
        kw.update(disable_cuda_graph=True)
    if config == results.DEQUANTIZED:  # GraniKV's backend only rounds the K/V: stock kernels attend
        kw.update(enable_granikv=True, granikv_attention_path="paged", granikv_extend_path="paged")
    elif config != "baseline":
        # the prefill path over HOT prefixes forced too: "auto" may keep these short prefixes stock
        kw.update(enable_granikv=True, granikv_attention_path=attention_path, granikv_extend_path="hot")
        if compare_every:
            kw.update(granikv_debug_compare_every=compare_every)
        kw.update(granikv_extra or {})
    return kw


def granikv_args(items: Sequence[str]) -> Dict[str, Any]:
    """``--granikv-arg KEY=VALUE`` items as engine kwargs; every key must be GraniKV's."""
    extra = parse_engine_args(items)
    bad = [k for k in extra if not is_granikv_key(k)]
    if bad:
        raise SystemExit(f"--granikv-arg takes GraniKV keys only (granikv_...), got {', '.join(bad)}")
    return extra


def run_engine(backend: str, config: str, job: Dict[str, Any], timeout: float,
               kv_round: Optional[str] = None) -> Dict[str, Any]:
    """One engine in a subprocess of its own session (killed whole on timeout); its RESULT.
    ``kv_round``: the FP8 format its K/V are rounded through (a dequantized engine)."""
    env = engine_env(backend, repo_env())
    env.pop("GRANIKV_DEBUG_FAULT", None)
    env.pop("GRANIKV_DEBUG_KV_ROUND", None)
    if config == "fault":
        env["GRANIKV_DEBUG_FAULT"] = FAULT
    if kv_round:
        env["GRANIKV_DEBUG_KV_ROUND"] = kv_round
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    name = f"{backend}/{config}"
    proc = subprocess.Popen(module_command("benchmark.correctness.check", "--child", f.name),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            bufsize=1, start_new_session=True, cwd=REPO_ROOT)
    result, t0, rounded = None, time.time(), False
    watchdog = threading.Timer(timeout, kill_group, (proc,))
    watchdog.start()
    try:
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
            else:
                rounded = rounded or KV_ROUND_MARK in line
                sys.stdout.write(f"[{name}] {line}")
        proc.wait()
    finally:
        watchdog.cancel()
        kill_group(proc)  # the engine's scheduler processes hold GPU memory
        os.unlink(f.name)
    if result is None and time.time() - t0 >= timeout:
        raise TimeoutError(f"{name}: killed after --child-timeout {timeout:.0f} s")
    if result is None:
        raise RuntimeError(f"{name}: exited with status {proc.returncode} and no result")
    print(f"{name}: engine up in {result['engine_up_s']} s, done in {time.time() - t0:.0f} s",
          flush=True)
    result["kv_rounded"] = rounded
    return result


PARALLEL_MEMORY = dict(mem_fraction_static=0.9, max_total_tokens=262144)
"""``--parallel`` above 1: the memory flags' defaults, those two checks ran with side by side on
one H200 (docs/results/fp8_kv.md): each engine caps its KV pool (262,144 tokens of the check's
4-layer model: 4.3 GB; its workloads need well under 100K) and SGLang's memory profile sees
the others' use."""


def memory_kwargs(mem_fraction_static: Optional[float], max_total_tokens: Optional[int]) -> Dict[str, Any]:
    """``ENGINE_KWARGS`` with the engines' memory settings: two checks can share one GPU when
    each caps its KV pool (``max_total_tokens``; the workloads need well under 100K tokens) and
    lets SGLang's memory profile see the other's use (``mem_fraction_static`` near 1)."""
    kw = dict(ENGINE_KWARGS)
    if mem_fraction_static is not None:
        if not 0.0 < mem_fraction_static < 1.0:
            raise SystemExit(f"--mem-fraction-static {mem_fraction_static} must be in (0, 1)")
        kw.update(mem_fraction_static=mem_fraction_static)
    if max_total_tokens is not None:
        if max_total_tokens < 1:
            raise SystemExit(f"--max-total-tokens {max_total_tokens} must be >= 1")
        kw.update(max_total_tokens=max_total_tokens)
    return kw


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p.add_argument("--out", default="docs/results")
    p.add_argument("--backends", type=csv, default=["flashinfer", "triton"],
                   help="Attention backends (both: the cross-backend reference needs two).")
    p.add_argument("--out-tokens", type=int, default=48, help="Greedy tokens per request.")
    p.add_argument("--scale", type=int, default=4,
                   help="Agents per workload x this (16 / 16 / 8 at 1; the agreement's noise "
                        "falls as 1/sqrt(requests)).")
    p.add_argument("--attention-path", default="cascade",
                   help="granikv_attention_path of the GraniKV engines (auto picks paged on "
                        "prompts this short).")
    p.add_argument("--compare-every", type=int, default=4,
                   help="GraniKV engines compare every layer of every N-th decode step with the "
                        "stock backend's output (--granikv-debug-compare-every; decode CUDA "
                        "graphs off on every engine). 0: graphs on, no layer rule.")
    p.add_argument("--granikv-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="A GraniKV engine keyword for every engine GraniKV computes (repeatable), "
                        "e.g. granikv_view_plan=reuse.")
    p.add_argument("--no-fault", action="store_true", help="Skip the planted-fault engines.")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="SGLang --kv-cache-dtype of every engine (e.g. fp8_e4m3); default: the model's (bf16).")
    p.add_argument("--dequantized-reference", action="store_true",
                   help="With --kv-cache-dtype fp8_* and one backend: the token rule's reference is "
                        "stock flashinfer and triton over a bf16 cache holding the K/V rounded "
                        "through that FP8 format (GRANIKV_DEBUG_KV_ROUND).")
    p.add_argument("--model", choices=sorted(checkpoint.SHAPES), default="llama",
                   help="Check model: llama (checkpoint.LlamaShape), qwen3-moe (Qwen3MoeShape: GQA 8, "
                        "q/k norms, MoE) or gpt-oss (GptOssShape: "
                        "sliding-window layers and attention sinks; triton only, SPLITS reference).")
    p.add_argument("--model-dir", help="Use this checkpoint folder instead of writing one.")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help=f"Every engine's (default {ENGINE_KWARGS['mem_fraction_static']}); see memory_kwargs.")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="Every engine's KV pool cap in tokens (default: what the memory fraction gives).")
    p.add_argument("--parallel", type=int, default=1,
                   help="Engines run at once (default 1: one after another). Above 1 the engines share "
                        f"the GPU under the memory flags' defaults for sharing ({PARALLEL_MEMORY}, "
                        "overridable): their start-ups (imports, weights, graph capture), most of an "
                        "engine's time here, overlap on the host's cores.")
    p.add_argument("--child-timeout", type=float, default=400.0)  # eager decode + the layer compare
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        return main_child(args.child)
    if args.compare_every < 0:
        raise SystemExit(f"--compare-every {args.compare_every} must be >= 0")
    if args.dequantized_reference:
        if len(args.backends) != 1 or args.kv_cache_dtype not in KV_ROUND_FORMATS:
            raise SystemExit(f"--dequantized-reference needs one backend and --kv-cache-dtype one of "
                             f"{', '.join(KV_ROUND_FORMATS)} (got --backends {','.join(args.backends)}, "
                             f"--kv-cache-dtype {args.kv_cache_dtype})")
    allowed = MODEL_BACKENDS.get(args.model)
    if allowed is not None and not set(args.backends) <= set(allowed):
        raise SystemExit(f"--model {args.model} is served on --backends {','.join(allowed)} only "
                         f"(got {','.join(args.backends)})")
    if args.model != "llama" and args.dequantized_reference:
        raise SystemExit(f"--dequantized-reference is for --model llama (got --model {args.model})")
    if len(set(args.backends)) < 2 and allowed is None and not args.dequantized_reference:
        # the token rule's bar is a second correct kernel's agreement with stock: without one
        # every row would end undecided after minutes of engines
        raise SystemExit(f"--backends {','.join(args.backends)}: the token rule needs a second correct "
                         f"reference: two backends (e.g. --backends flashinfer,triton), or one backend "
                         f"with --kv-cache-dtype fp8_* --dequantized-reference")
    if args.parallel < 1:
        raise SystemExit(f"--parallel {args.parallel} must be >= 1")
    mem, tokens = args.mem_fraction_static, args.max_total_tokens
    if args.parallel > 1:  # engines share the GPU: the sharing defaults where a flag is not given
        mem = PARALLEL_MEMORY["mem_fraction_static"] if mem is None else mem
        tokens = PARALLEL_MEMORY["max_total_tokens"] if tokens is None else tokens
    base = memory_kwargs(mem, tokens)
    t0 = time.time()
    shape = checkpoint.SHAPES[args.model]()
    model_dir = args.model_dir or checkpoint.write_checkpoint(
        tempfile.mkdtemp(prefix="granikv_check_model_"), shape)
    print(f"checkpoint {model_dir} ({time.time() - t0:.0f} s)", flush=True)
    spec_list = specs(args.out_tokens, args.scale)
    configs = [c for c in CONFIGS if not (args.no_fault and c == "fault")]
    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command="python3 -m benchmark.correctness.check " + " ".join(argv or sys.argv[1:]),
                model=dict(dataclasses.asdict(shape), architecture=shape.hf_config()["architectures"][0],
                           std=checkpoint.DEFAULT_STD, dtype="bfloat16"),
                fault=FAULT, attention_path=args.attention_path,
                workloads=[s.to_json() for s in spec_list],
                engine_kwargs=base, margin=metrics.AGREEMENT_MARGIN, agreement_z=metrics.AGREEMENT_Z,
                logprob_factor=metrics.LOGPROB_FACTOR, logprob_slack=metrics.LOGPROB_SLACK,
                bootstrap_resamples=metrics.BOOTSTRAP_RESAMPLES, bootstrap_seed=metrics.BOOTSTRAP_SEED,
                compare_every=args.compare_every, tolerance_factor=TOLERANCE_FACTOR,
                kv_cache_dtype=args.kv_cache_dtype or "auto",
                floor_eps=FLOOR_EPS, errors=[])
    extra = granikv_args(args.granikv_arg)
    if extra:
        meta["granikv_args"] = extra
    runs = [(b, c) for b in args.backends for c in configs]
    if args.dequantized_reference:
        meta["dequantized_reference"] = list(results.DEQUANTIZED_BACKENDS)
        runs += [(b, results.DEQUANTIZED) for b in results.DEQUANTIZED_BACKENDS]
    if allowed is not None:  # one backend serves this model: the second correct kernel is SPLITS
        meta["splits_reference"] = dict(triton_attention_num_kv_splits=SPLITS_KV_SPLITS)
        runs += [(b, results.SPLITS) for b in args.backends]
    meta["parallel"] = args.parallel

    def one(run: Tuple[str, str]) -> Dict[str, Any]:
        backend, config = run
        dequantized = config == results.DEQUANTIZED
        job = dict(model_dir=str(model_dir), vocab=shape.vocab, specs=meta["workloads"],
                   engine_kwargs=engine_kwargs(backend, config, args.attention_path, args.compare_every,
                                               None if dequantized else args.kv_cache_dtype, args.model,
                                               base=base, granikv_extra=extra))
        return run_engine(backend, config, job, args.child_timeout,
                          kv_round=args.kv_cache_dtype if dequantized else None)

    engines: Dict[Tuple[str, str], Dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:  # 1: one after another, in order
        futures = [(run, pool.submit(one, run)) for run in runs]
        for (backend, config), fut in futures:  # results and errors in the runs' order
            try:
                engines[(backend, config)] = fut.result()
            except Exception as e:  # the other engines still run; the report says what failed
                traceback.print_exception(e)
                meta["errors"].append(f"{backend}/{config}: {type(e).__name__}: {e}")
                continue
            if config == results.DEQUANTIZED and not engines[(backend, config)]["kv_rounded"]:
                meta["errors"].append(f"{backend}/{config}: its log never said the K/V are rounded "
                                      f"({KV_ROUND_MARK!r}): the reference would be the unrounded bf16 cache")
    meta["gpu"] = next((e.get("gpu") for e in engines.values() if e.get("gpu")), None)
    meta["seconds"] = round(time.time() - t0, 1)
    rows = results.rows(engines, [s.name for s in spec_list], args.backends, layer_rule=args.compare_every > 0)
    paths = results.write(args.out, meta, rows)
    print(results.markdown(meta, rows), flush=True)
    print(f"wrote {', '.join(map(str, paths))}", flush=True)
    if not args.no_fault:
        print(results.fault_summary(rows), flush=True)
    return 0 if results.all_ok(meta, rows, fault=not args.no_fault) else 1


if __name__ == "__main__":
    exit_after(main)
