"""End-to-end multi-agent benchmark: SGLang alone vs SGLang + GraniKV, same workloads, one run.

From the repository root:

    python3 -m benchmark.multi_agent.run --quick --out docs/results
    python3 -m benchmark.multi_agent.run --backends flashinfer,triton \
        --workloads homogeneous,heterogeneous,agent_loop,no_sharing,ceiling --agents 16,32,64,128

For every attention backend it runs two engine configurations, ``baseline`` (``sglang.Engine``
with ``attention_backend=X``) and ``granikv`` (the same + ``enable_granikv=True``), each in its
own subprocess (``python -m benchmark.multi_agent.run --child JOB``) so GPU memory is freed
between engines. A child (benchmark.harness.engine_child) builds the workloads from their
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
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmark.harness.engine_args import BASE_ENGINE_KWARGS, apply_extra, parse_engine_args
from benchmark.harness.engine_child import EngineChild
from benchmark.harness.engine_proc import (
    ERROR_TAG,
    INFO_TAG,
    REPO_ROOT,
    ROW_TAG,
    emit,
    engine_env,
    exit_after,
    module_command,
    repo_env,
    run_tagged,
)
from benchmark.harness.model_config import CONFIG_DIR, model_config_path, write_model_dir
from benchmark.multi_agent import agreement, report
from benchmark.multi_agent import workloads as wl

CONFIGS = ("baseline", "granikv")


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


def engine_configs(args: argparse.Namespace) -> List[EngineConfig]:
    """Backends x configs; ``granikv_*`` pass-through keys go to the granikv engines only."""
    extra = parse_engine_args(args.engine_arg)
    out = []
    for backend in args.backends:
        for config in args.configs:
            kw = dict(BASE_ENGINE_KWARGS, attention_backend=backend, tp_size=args.tp,
                      dp_size=args.dp)
            out.append(EngineConfig(backend, config, apply_extra(kw, extra, granikv=config == "granikv")))
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
                   help=f"A folder of {CONFIG_DIR.relative_to(REPO_ROOT)} "
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


def specs_of(args: argparse.Namespace) -> List[wl.WorkloadSpec]:
    return wl.plan(args.workloads, args.agents, args.prefix, no_sharing_len=args.no_sharing_len,
                   turns=args.turns)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python3", "-m", "benchmark.multi_agent.run", *argv])


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
        res = run_tagged(module_command("benchmark.multi_agent.run", "--child", f.name), name=cfg.name,
                         on_record=on_record, timeout=timeout, env=engine_env(cfg.backend, repo_env()),
                         extra=dict(backend=cfg.backend, config=cfg.config), cwd=REPO_ROOT)
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
# child: one engine (harness.engine_child), every row
# ------------------------------------------------------------------------------------------


def main_child(job_path: str) -> int:
    job = json.load(open(job_path))
    try:
        child = EngineChild(job)
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
