"""Regime benchmark: stock SGLang vs SGLang + GraniKV over the regimes that decide whether sharing
pays, each row with its no-long-prefix ceiling and its bounds.py floor, in one invocation.

    python3 -m benchmark.multi_agent.regimes --backend flashinfer --time-budget-s 0 --out OUT   # ~12 min
    python3 -m benchmark.multi_agent.regimes --backend flashinfer --models llama-3.1-8b --tag a --out OUT
                                          # one model per invocation where a call is limited to 10 min
    python3 -m benchmark.multi_agent.regimes --backend triton --out OUT
    python3 -m benchmark.multi_agent.regimes --merge OUT/regimes_flashinfer.json \
        OUT/regimes_triton.json --out docs/results                     # regimes.{json,md,png}
                                          # (--tag T: regimes_T.{json,md,png})
    python3 -m benchmark.multi_agent.regimes --dry-run                 # the grid and its estimate
    python3 -m benchmark.multi_agent.regimes --rows prefix512_2sharers_x64 --repeats 5 --out OUT
                                          # short rows: the median of 5 runs per engine
    python3 -m benchmark.multi_agent.regimes --backend fa3 --also-stock flashinfer --models llama-3.1-8b --out OUT
                                          # GraniKV behind fa3 against stock fa3, stock flashinfer beside
    python3 -m benchmark.multi_agent.regimes --also-granikv probe:granikv_clock_probe=paged_too --out OUT
                                          # a second GraniKV engine with other GraniKV flags: an A/B

The grid, and how it was chosen, is in regime_grid.py. Per model of the grid (in order) the
parent starts both engines at once, side by side on the GPU (harness.resident_engine: each a
subprocess that stays up and measures rows on request; every model's KV pool is capped so two
fit): the stock engine (``attention_backend=X``, dummy weights, the benchmarks' engine
arguments from harness.engine_args) and the GraniKV engine (the same +
``enable_granikv=True``), each capturing decode CUDA graphs only for the batch sizes its rows
use (``graph_sizes``). The rows then run in turn on both engines, taking turns per repeat
(stock first on even repeats, GraniKV first on odd ones), so that drift of the machine lands on
both; each side keeps its median repeat, and the stock repeats' relative spread is recorded per
row (``baseline_spread``). After each row with a prefix longer than 256 tokens the stock engine
runs its ceiling (the same workload with every shared prefix cut to 256 tokens) once. A row is
measured as in run.py (harness.engine_child: flush the radix cache, cache each shared prefix
with one request, submit every agent at once, output tok/s = output tokens / wall time), and
the GraniKV engine's counters are read before and after it (dispatch paths, extend fallbacks,
promotion skips, planning time).

``--also-stock B`` adds a third engine per model: stock SGLang on attention backend B (e.g. the
fa3 backend SGLang picks on Hopper beside a flashinfer grid), taking its turn in every repeat
(config ``stock_B``; the row gets ``also_stock[B]``: its tok/s, spread, ratio to the stock engine
and GraniKV's ratio to it, regime_report.py; the ceiling and the floor stay the ``--backend``
stock engine's). ``--also-granikv NAME:KEY=VALUE[,KEY=VALUE]`` likewise adds a GraniKV engine
whose GraniKV flags differ from the main one's by those keys (config ``granikv_NAME``; the row
gets ``also_granikv[NAME]``: its tok/s, spread, ratio to stock and to the main GraniKV engine,
its plan times and decode paths): an A/B of a GraniKV setting in one run, where the same drift
lands on both sides. With three engines or more on one GPU every pool is capped at
``THREE_ENGINE_POOL_BYTES`` of KV (160K tokens of Llama-3.1-8B).

Time: ``--time-budget-s`` (default 450) covers the whole invocation, engine starts included.
Rows that the estimate says do not fit are dropped before anything starts (lowest priority
first, the dry run lists them); while running, no row starts whose estimate no longer fits, and
a model is not started when its engines' start no longer fits. Rows the budget leaves out, before
or during the run, are listed (``meta.skipped``, the page's "Not run" list) and are not errors:
the exit status is 1 only when an engine or a row failed. The JSON (and md) is rewritten
after every record, so a run killed from outside keeps every row it finished.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmark.harness import engine_child, engine_proc, replay_gaps, resident_engine
from benchmark.harness.engine_args import BASE_ENGINE_KWARGS, apply_extra, parse_engine_args
from benchmark.harness.model_config import kv_dtype_bytes
from benchmark.harness.resident_engine import EngineGone, ResidentEngine
from benchmark.multi_agent import regime_grid as grid
from benchmark.multi_agent import regime_report as report
from benchmark.multi_agent import workloads as wl
from granikv.config import is_granikv_key

DEFAULT_BUDGET_S = 450.0
START_GRACE_S = 90.0  # added to every wait on an engine (its start, one row)
START_TIMEOUT_FACTOR = 4.0  # an engine start is given up after this x its estimate (+ the grace)
REQUEST_TIMEOUT_FACTOR = 4.0  # one row's run, likewise
CONFIGS = ("baseline", "granikv")
BACKENDS = ("flashinfer", "triton", "fa3")  # SGLang attention backends the grid runs (fa3: Hopper)
#: KV pool cap per engine, in bytes, when a model's engines are three or more (--also-stock,
#: --also-granikv): three Llama-3.1-8B engines at 160K tokens (20 GiB of KV each) fit one 141 GB
#: H200 with their weights and graphs; a model with fewer KV bytes a token gets more tokens
#: (the 4-layer model's rows need their own pool, 16 KB a token: at 160K tokens its forest row
#: retracted requests and ran paged).
THREE_ENGINE_POOL_BYTES = 163840 * 131072  # 160K tokens x Llama-3.1-8B's 128 KiB of KV a token


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="flashinfer", choices=BACKENDS,
                   help="SGLang attention backend of both engines (GraniKV wraps it).")
    p.add_argument("--also-stock", type=csv, default=[], metavar="BACKEND[,BACKEND]",
                   help=f"Also measure every row on a stock engine of each of these backends ({', '.join(BACKENDS)}), "
                        "side by side, taking turns with the other two (module docstring).")
    p.add_argument("--also-granikv", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="Also measure every row on a GraniKV engine whose GraniKV flags (granikv_* keys) are "
                        "the main one's with these (repeatable; module docstring), e.g. "
                        "probe:granikv_clock_probe=paged_too.")
    p.add_argument("--models", type=csv, default=None,
                   help=f"Subset of {','.join(grid.MODEL_NAMES)} (default: all).")
    p.add_argument("--rows", type=csv, default=None,
                   help="Subset of row names (e.g. forest16) or model/row keys (default: all).")
    p.add_argument("--time-budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="Wall budget of the invocation incl. engine starts (0: none). Default 450.")
    p.add_argument("--out", default="docs/results", help="Output folder.")
    p.add_argument("--tag", default="", help="Output names regimes_<backend>[_TAG].*")
    p.add_argument("--latency", choices=("stream", "none"), default="stream",
                   help="As run.py: stream (per-request TTFT/TPOT) or none (one batched generate).")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="Extra sglang.Engine keyword (repeatable); granikv_* keys go to the GraniKV engine.")
    p.add_argument("--repeats", type=int, default=3,
                   help="Measure every row this many times on each engine, taking turns, and keep "
                        "the repeat with the median output tok/s (all of them in repeats_out_tok_s; "
                        "the stock ones give baseline_spread). Default 3; ceilings run once.")
    p.add_argument("--idle-probe-steps", type=int, default=0,
                   help="After a row's timed repeats, run it once more on each engine with "
                        "SGLang's profiler over this many decode steps (GPU activity only) and record "
                        "the GPU's idle time per step (gpu_idle_us_baseline / _granikv); the same run's "
                        "decode replays are timed by CUDA events outside the profiled steps "
                        "(harness.replay_gaps: replay_gap_us_baseline / _granikv). 0: off.")
    p.add_argument("--host-probe-steps", type=int, default=0,
                   help="Likewise, one more untimed run per engine with the profiler recording CPU "
                        "activity too over this many decode steps: the host's time per CUDA call and "
                        "ATen op per step (host_calls_baseline / _granikv). 0: off.")
    p.add_argument("--keep-host-traces", action="store_true",
                   help="With --host-probe-steps: record Python frames too and keep each host probe's "
                        "trace, gzipped, under --out/traces/ (for a per-function breakdown of a step).")
    p.add_argument("--dry-run", action="store_true", help="Print the selected grid and its estimate.")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="Combine partial regimes_*.json into --out/regimes.{json,md,png} and exit.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python3", "-m", "benchmark.multi_agent.regimes", *argv])


def engine_kwargs(model: grid.Model, backend: str, config: str, extra: Dict[str, Any],
                  engines: int = 2, variants: Optional[Mapping[str, Mapping[str, Any]]] = None) -> Dict[str, Any]:
    """The benchmarks' engine arguments (harness.engine_args) + the model's (e.g. its KV cap,
    lowered to ``three_engine_pool_tokens`` when ``engines`` > 2 share the GPU) + pass-through
    ``--engine-arg``. ``config``: ``baseline``, ``granikv``, ``stock_<backend>`` (an
    ``--also-stock`` engine: stock SGLang on that backend) or ``granikv_<name>`` (an
    ``--also-granikv`` engine: GraniKV with ``variants[name]`` over ``extra``'s GraniKV keys)."""
    stock_backend = also_stock_backend(config)
    kw = dict(BASE_ENGINE_KWARGS, attention_backend=stock_backend or backend, tp_size=1, dp_size=1)
    kw.update(model.engine_args())
    if engines > 2 and "max_total_tokens" in kw:
        kw["max_total_tokens"] = min(int(kw["max_total_tokens"]), three_engine_pool_tokens(model))
    name = also_granikv_name(config)
    if name is not None:
        extra = dict(extra, **(variants or {})[name])
    return apply_extra(kw, extra, granikv=config == "granikv" or name is not None)


def three_engine_pool_tokens(model: grid.Model) -> int:
    """``THREE_ENGINE_POOL_BYTES`` in ``model``'s KV tokens (whole 1024s)."""
    per_token = grid.model_facts(model.config(), kv_dtype_bytes(model.name))["kv_bytes"]
    return int(THREE_ENGINE_POOL_BYTES // per_token) // 1024 * 1024


STOCK_PREFIX = report.STOCK_PREFIX  # config of an --also-stock engine: stock_<backend>


def also_stock_config(backend: str) -> str:
    """The config name of an ``--also-stock`` engine on ``backend``."""
    return STOCK_PREFIX + backend


def also_stock_backend(config: str) -> Optional[str]:
    """The backend of an ``--also-stock`` config (None: ``baseline`` / ``granikv``)."""
    return config[len(STOCK_PREFIX):] if config.startswith(STOCK_PREFIX) else None


GRANIKV_PREFIX = report.GRANIKV_PREFIX  # config of an --also-granikv engine: granikv_<name>


def also_granikv_name(config: str) -> Optional[str]:
    """The name of an ``--also-granikv`` config (None: any other engine)."""
    return config[len(GRANIKV_PREFIX):] if config.startswith(GRANIKV_PREFIX) else None


def parse_variants(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``--also-granikv`` values, ``NAME:KEY=VALUE[,KEY=VALUE]``, as {name: GraniKV keys}; a
    variant that names no key, a key that is not GraniKV's (the stock engine must stay the
    same for both GraniKV engines) or a name given twice is refused."""
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        name = name.strip()
        if not sep or not name or not name.replace("_", "").isalnum() or not rest.strip():
            raise ValueError(f"--also-granikv {item!r}: expected NAME:KEY=VALUE[,KEY=VALUE] (NAME: letters, "
                             "digits, _)")
        if name in out:
            raise ValueError(f"--also-granikv {name}: given twice")
        try:
            keys = parse_engine_args([x for x in rest.split(",") if x.strip()])
        except ValueError as e:
            raise ValueError(f"--also-granikv {item!r}: {e}") from e
        bad = sorted(k for k in keys if not is_granikv_key(k) or k == "enable_granikv")
        if bad:
            raise ValueError(f"--also-granikv {name}: {', '.join(bad)} not a GraniKV flag (granikv_*); "
                             "engine arguments for every engine go in --engine-arg")
        out[name] = keys
    return out


def configs_of(args) -> Tuple[str, ...]:
    """The engines of every model, in turn order: stock, GraniKV, then each ``--also-stock`` and
    each ``--also-granikv`` one."""
    bad = [b for b in args.also_stock if b not in BACKENDS]
    if bad:
        raise ValueError(f"--also-stock: unknown {bad}; known: {', '.join(BACKENDS)}")
    if args.backend in args.also_stock:
        raise ValueError(f"--also-stock {args.backend}: that is --backend's own stock engine")
    return (CONFIGS + tuple(also_stock_config(b) for b in dict.fromkeys(args.also_stock))
            + tuple(GRANIKV_PREFIX + name for name in parse_variants(args.also_granikv)))


def job_rows(rows: Sequence[grid.Regime], config: str) -> List[Dict[str, Any]]:
    """What a child measures: each row's spec, and its ceiling's on the stock engine."""
    return [dict(regime=r.name, priority=r.priority, has_ceiling=r.has_ceiling, spec=r.spec_json(),
                 ceiling=r.spec_json(ceiling=True) if (config == "baseline" and r.has_ceiling) else None)
            for r in rows]


def print_plan(sel: grid.Selection, args) -> None:
    by = {m.name: m for m in grid.MODELS}
    engines = len(configs_of(args))
    print(f"backend {args.backend}, budget {args.time_budget_s:g} s, estimate {sel.estimate_s:.0f} s "
          f"(engine starts included), {len(sel.rows)} rows:")
    for r in sel.rows:
        print(f"  {r.key:52s} p{r.priority} agents={r.agents:4d} prefix={r.prefix_len:6d} "
              f"ceiling={'yes' if r.has_ceiling else 'row'} "
              f"est={grid.estimate_s(r, by[r.model], args.repeats, engines):5.1f} s")
    for key, why in sel.skipped:
        print(f"  skipped {key}: {why}")


# ------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------


class Run:
    """The records of one invocation and its output files (rewritten after every record)."""

    def __init__(self, args, argv: Sequence[str], sel: grid.Selection):
        self.args = args
        self.stem = output_stem(args.tag, args.backend)
        self.records: List[Dict[str, Any]] = []
        self.configs = configs_of(args)
        self.meta = dict(command=command_line(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         backend=args.backend, budget_s=args.time_budget_s, estimate_s=round(sel.estimate_s),
                         skipped=[list(s) for s in sel.skipped], engine_kwargs={},
                         also_stock=[also_stock_backend(c) for c in self.configs if also_stock_backend(c)],
                         also_granikv=parse_variants(args.also_granikv))

    def add(self, rec: Dict[str, Any]) -> None:
        self.records.append(rec)
        report.write(self.args.out, self.stem, self.records, self.meta, quiet=True, png=False)

    def error(self, model: str, config: str, text: str) -> None:
        print(f"ERROR {model}/{self.args.backend}/{config}: {text}", flush=True)
        self.add(dict(kind="error", model=model, backend=self.args.backend, config=config, error=text))

    def skip(self, rows: Sequence[grid.Regime], why: str) -> None:
        self.meta["skipped"] += [[r.key, why] for r in rows]

    def over_budget(self, rows: Sequence[grid.Regime], why: str) -> None:
        """Rows the time budget leaves out once the run reached them (as those the plan left out
        before anything started): listed in ``meta.skipped`` and the page's "Not run" list, and
        not an error, so the exit status says whether what ran ran cleanly; the suite's grid part
        records them as ``rows_not_run``."""
        for r in rows:
            print(f"SKIPPED {r.key} ({self.args.backend}): {why}", flush=True)
        self.skip(rows, why)


def graph_sizes(rows: Sequence[grid.Regime]) -> List[int]:
    """Decode CUDA-graph batch sizes for an engine serving ``rows``: every row's agent count and
    the powers of two below the largest (a batch that shrinks as requests finish pads to the
    next of these), never above the benchmarks' 256 (harness.engine_args)."""
    top = min(256, max(r.agents for r in rows))
    sizes = {1 << k for k in range(9) if (1 << k) <= top} | {min(256, r.agents) for r in rows}
    return sorted(sizes)


def start_engines(run: Run, model: grid.Model, rows: Sequence[grid.Regime],
                  extra: Dict[str, Any]) -> Dict[str, ResidentEngine]:
    """Every engine of ``model`` as a resident child, started at once (each caps its KV pool at
    the model's ``max_total_tokens``, so they fit one GPU side by side, or at ``fitted_pool``
    where this GPU cannot hold them all at that cap: ``run.meta["pool_fitted"]``); returns them by config
    once all said INFO, with KV pools of one size: where SGLang lowered a pool below the cap
    (its profiled memory: on a GPU too small for every engine at the cap, the engine that
    profiles last gets what is left), all are restarted once with the pools they held shared out
    evenly (``equal_pool``; ``run.meta["pool_equalized"]``), since engines with unequal pools serve different
    workloads (evictions, re-prefill) and their ratio says nothing about GraniKV. Raises
    EngineGone (all killed) when one fails to start or the pools still differ."""
    extra = fit_pools(run, model, extra)
    engines, caps = _start_engines(run, model, rows, extra)
    if not pools_differ(caps):
        return engines
    small = equal_pool(caps)
    print(f"{model.name}: KV pools differ ({caps}); restarting every engine at {small} tokens", flush=True)
    for e in engines.values():
        e.shutdown()
    run.meta.setdefault("pool_equalized", {})[model.name] = dict(tokens=small, profiled=dict(caps))
    engines, caps = _start_engines(run, model, rows, dict(extra, max_total_tokens=small))
    if pools_differ(caps):
        for e in engines.values():
            e.close()
        raise EngineGone(f"KV pools still differ at max_total_tokens={small}: {caps} (pass a smaller "
                         f"--engine-arg max_total_tokens=N)")
    return engines


pools_differ = report.pools_differ  # engines whose KV pools differ more than POOL_TOLERANCE are not comparable

#: what one engine holds on its GPU beside its weights and KV pool: CUDA context, graphs, activations
ENGINE_RESERVE_BYTES = 2 << 30
#: a fitted pool smaller than this serves no grid row (a 16K prefix and 64 suffixes): the model is skipped
MIN_FITTED_POOL_TOKENS = 32768


def fit_pools(run: Run, model: grid.Model, extra: Dict[str, Any]) -> Dict[str, Any]:
    """``extra`` with ``max_total_tokens`` lowered to ``fitted_pool`` where this GPU (its free
    memory now, ``engine_proc.gpu_free_bytes``) cannot hold every engine of ``model`` at its cap;
    recorded in ``run.meta["pool_fitted"]``. A pool given with ``--engine-arg max_total_tokens``
    is kept as given."""
    if "max_total_tokens" in extra:
        return extra
    n = len(run.configs)
    kw = engine_kwargs(model, run.args.backend, "baseline", extra, engines=n)
    free = engine_proc.gpu_free_bytes()
    tokens = fitted_pool(model, kw, n, free)
    if tokens is None:
        return extra
    cap = int(kw["max_total_tokens"])
    print(f"{model.name}: {n} engines at {cap} KV tokens do not fit this GPU ({free / 2**30:.1f} GiB free); "
          f"each starts at {tokens}", flush=True)
    run.meta.setdefault("pool_fitted", {})[model.name] = dict(tokens=tokens, cap=cap, free_gib=round(free / 2**30, 1))
    return dict(extra, max_total_tokens=tokens)


def fitted_pool(model: grid.Model, kw: Mapping[str, Any], engines: int, free_bytes: Optional[int]) -> Optional[int]:
    """The KV pool (tokens) each of ``engines`` engines of ``model`` started side by side on one
    GPU with ``free_bytes`` free can hold, where they cannot all hold the cap
    ``kw["max_total_tokens"]`` there; None where they can (or the cap or the free memory is
    unknown). SGLang sizes a pool as the free memory after loading its own weights less
    ``(1 - mem_fraction_static)`` x the free memory it saw before loading them
    (``kv_cache_configurator``); engines started at once can see another's weights and pool land
    in between, so the pool that fits every order is ``(fraction x free - engines x (weights +
    ENGINE_RESERVE_BYTES)) / engines`` (weights at 2 bytes a parameter: a smaller pool than fits
    where they are fewer). Raises EngineGone where that leaves less than MIN_FITTED_POOL_TOKENS."""
    cap = kw.get("max_total_tokens")
    if not free_bytes or not cap:
        return None
    facts = grid.model_facts(model.config(), kv_dtype_bytes(model.name))
    weights, per_token = 2 * facts["params"], facts["kv_bytes"]
    fraction = float(kw.get("mem_fraction_static", BASE_ENGINE_KWARGS["mem_fraction_static"]))
    tokens = int((fraction * free_bytes - engines * (weights + ENGINE_RESERVE_BYTES)) / engines / per_token)
    if tokens >= int(cap):
        return None
    tokens = tokens // 1024 * 1024
    if tokens < MIN_FITTED_POOL_TOKENS:
        raise EngineGone(f"{model.name}: {engines} engines do not fit one GPU with {free_bytes / 2**30:.1f} GiB free "
                         f"({weights / 2**30:.1f} GiB of weights each; a KV pool of {max(tokens, 0)} tokens each)")
    return tokens


def equal_pool(caps: Mapping[str, Optional[int]]) -> int:
    """One KV pool size for every engine (tokens) from the pools they got: the tokens they held
    together, shared out evenly with a 5% margin (what each engine allocates beside its pool
    stays as it was), in whole 1024s; never below the smallest pool."""
    known = [int(c) for c in caps.values() if c]
    even = int(0.95 * sum(known) / len(known)) // 1024 * 1024
    return max(min(known), even)


def _start_engines(run: Run, model: grid.Model, rows: Sequence[grid.Regime],
                   extra: Dict[str, Any]) -> Tuple[Dict[str, ResidentEngine], Dict[str, Optional[int]]]:
    """``start_engines``' one attempt: the engines by config and each one's KV pool (tokens)."""
    args = run.args
    sizes = graph_sizes(rows)
    engines: Dict[str, ResidentEngine] = {}
    caps: Dict[str, Optional[int]] = {}
    for config in run.configs:
        kw = engine_kwargs(model, args.backend, config, extra, engines=len(run.configs),
                           variants=run.meta["also_granikv"])
        kw.setdefault("cuda_graph_bs_decode", sizes)
        kw["cuda_graph_max_bs_decode"] = max(kw["cuda_graph_bs_decode"])
        run.meta["engine_kwargs"][f"{model.name}/{args.backend}/{config}"] = kw
        job = dict(engine_kwargs=kw, backend=args.backend, config=config, model=model.name,
                   model_config=str(model.config_path), latency=args.latency,
                   dp_routing="prefix")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job, f)
        env = engine_proc.engine_env(kw["attention_backend"], engine_proc.repo_env())
        if args.idle_probe_steps > 0:  # the probe's run also times its decode replays by events
            env = replay_gaps.plugin_env(env, f.name + ".replay_gaps")
        engines[config] = ResidentEngine(
            engine_proc.module_command("benchmark.multi_agent.regimes", "--child", f.name),
            name=f"{model.name}/{args.backend}/{config}",
            env=env,
            extra=dict(model=model.name, backend=args.backend, config=config),
            on_record=lambda rec: run.add(rec) if rec["kind"] == "info" else None, cwd=engine_proc.REPO_ROOT)
        engines[config].job_path = f.name  # type: ignore[attr-defined]
    try:
        for config, e in engines.items():
            info = e.wait_ready(timeout=START_TIMEOUT_FACTOR * model.start_s + START_GRACE_S)
            caps[config] = info.get("max_total_num_tokens")
    except EngineGone:
        for e in engines.values():
            e.close()
        raise
    finally:
        for e in engines.values():
            os.unlink(e.job_path)  # type: ignore[attr-defined]
    return engines, caps


def measure_row(run: Run, engines: Mapping[str, ResidentEngine], model: grid.Model,
                row: grid.Regime) -> bool:
    """One row on both engines, taking turns: repeat k runs stock then GraniKV for even k and
    the other way round for odd k, so drift and order effects land on both; then its ceiling on
    the stock engine once. Each side's record is its median repeat (``median_repeat``: every
    repeat's tok/s in ``repeats_out_tok_s``, the stock ones give ``baseline_spread``). Returns
    False when an engine is gone (the model's remaining rows are skipped)."""
    args = run.args
    tags = dict(regime=row.name, priority=row.priority, has_ceiling=row.has_ceiling)
    timeout = row_timeout_s(model, row)
    configs = tuple(engines)
    reps: Dict[str, List[Dict[str, Any]]] = {c: [] for c in configs}
    failed: Dict[str, str] = {}
    plan = [("main", c, row.spec_json()) for k in range(args.repeats) for c in turn_order(configs, k)]
    if row.has_ceiling:
        plan.append(("ceiling", "baseline", row.spec_json(ceiling=True)))
    for variant, config, spec in plan:
        if config in failed and variant == "main":
            continue
        try:
            rec = engines[config].request(dict(spec=spec, tags=dict(tags, variant=variant)), timeout)
        except EngineGone as e:
            run.error(model.name, config, f"{row.name} ({variant}): {e}")
            return False
        rec.pop("id", None)
        if rec["kind"] == "error":
            failed[config] = rec["error"]
            rec.update(tags, variant=variant)
            run.add(rec)
        elif variant == "main":
            reps[config].append(rec)
        else:
            run.add(rec)
    for config in configs:
        if reps[config] and config not in failed:
            run.add(median_repeat(reps[config]))
    probes = [(variant, steps) for variant, steps in (("idle", args.idle_probe_steps),
                                                       ("host", args.host_probe_steps)) if steps > 0]
    for variant, steps in probes:
        for config in CONFIGS:  # untimed: the profiler's own cost stays out of the tok/s above
            try:
                keep = (str(Path(args.out) / "traces" / f"{model.name}_{row.name}_{config}_host.trace.json.gz")
                        if variant == "host" and args.keep_host_traces else None)
                rec = engines[config].request(dict(spec=row.spec_json(), tags=dict(tags, variant=variant),
                                                   probe=dict(steps=steps, host=variant == "host", keep=keep)),
                                              timeout)
            except EngineGone as e:
                run.error(model.name, config, f"{row.name} ({variant} probe): {e}")
                return False
            rec.pop("id", None)
            rec.update(tags, variant=variant)
            run.add(rec)
    return True


def turn_order(configs: Sequence[str], k: int) -> Sequence[str]:
    """The engines' order in repeat ``k``: ``configs`` rotated by ``k``, so that over n repeats
    of n engines each runs once in every position (two engines: stock first on even repeats,
    GraniKV first on odd ones)."""
    i = k % len(configs)
    return tuple(configs[i:]) + tuple(configs[:i])


def row_timeout_s(model: grid.Model, row: grid.Regime) -> float:
    """How long one engine may take for one run of ``row`` before it counts as gone."""
    return REQUEST_TIMEOUT_FACTOR * grid.estimate_s(row, model) + START_GRACE_S


def warm_up(run: Run, engines: Mapping[str, ResidentEngine], model: grid.Model, row: grid.Regime) -> bool:
    """The model's first row once on each engine, untimed (the first rows after a start paid
    first-use costs on the H200: 21K against 33K tok/s). False when an engine is gone."""
    timeout = row_timeout_s(model, row)
    for config in engines:
        try:
            rec = engines[config].request(dict(spec=row.spec_json(), tags=dict(regime=row.name, variant="warm_up")),
                                          timeout)
        except EngineGone as e:
            run.error(model.name, config, f"{row.name} (warm-up): {e}")
            return False
        if rec["kind"] == "error":
            print(f"warm-up {model.name}/{config}: {rec.get('error')}", flush=True)
    return True


def run_model(run: Run, model: grid.Model, rows: Sequence[grid.Regime], deadline: float,
              extra: Dict[str, Any]) -> None:
    """Both engines of one model up side by side, every row in turn, then both shut down. A
    row is not started when its estimate no longer fits before ``deadline``."""
    try:
        engines = start_engines(run, model, rows, extra)
    except EngineGone as e:
        run.error(model.name, "both", f"engine start: {e}")
        run.skip(rows, "an engine did not start")
        return
    try:
        if rows and not warm_up(run, engines, model, rows[0]):
            run.skip(rows, "an engine is gone")
            return
        for i, row in enumerate(rows):
            if time.time() + grid.estimate_s(row, model, run.args.repeats, len(run.configs)) > deadline:
                run.over_budget(rows[i:i + 1], "its estimate no longer fits the time budget")
                continue
            if not measure_row(run, engines, model, row):
                run.skip(rows[i + 1:], "an engine is gone")
                break
    finally:
        for e in engines.values():
            e.shutdown()


def main_parent(args, argv: Sequence[str]) -> int:
    engines = len(configs_of(args))
    sel = grid.select(grid.default_grid(), models=args.models, rows=args.rows, budget_s=args.time_budget_s,
                      repeats=args.repeats, backend=args.backend, engines=engines)
    print_plan(sel, args)
    if args.dry_run:
        return 0
    t0 = time.time()
    deadline = t0 + args.time_budget_s if args.time_budget_s > 0 else float("inf")
    run = Run(args, argv, sel)
    extra = parse_engine_args(args.engine_arg)
    by = {m.name: m for m in grid.MODELS}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_model: the engine groups die
    order = grid.models_of(sel.rows)
    for i, name in enumerate(order):
        model, rows = by[name], [r for r in sel.rows if r.model == name]
        later = sum(grid.start_s(by[m]) + sum(grid.estimate_s(r, by[m], args.repeats, engines)
                                              for r in sel.rows if r.model == m)
                    for m in order[i + 1:])
        if deadline - time.time() - later < grid.start_s(model):
            run.over_budget(rows, f"the engine start ({grid.start_s(model):.0f} s) no longer fits the time budget")
            continue
        run_model(run, model, rows, deadline - later, extra)
    paths = report.write(args.out, run.stem, run.records, run.meta)
    print(f"wrote {', '.join(map(str, paths))} in {time.time() - t0:.0f} s", flush=True)
    rows = report.assemble(run.records, run.meta)
    print(report.markdown_table(rows), flush=True)
    return 1 if any(r["kind"] == "error" for r in run.records) else 0


def output_stem(tag: str, backend: Optional[str] = None) -> str:
    """Output names: ``regimes[_BACKEND][_TAG]`` (a run names its backend, a merge does not)."""
    return "_".join(["regimes"] + [x for x in (backend, tag) if x])


def main_merge(args) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.merge]
    records, meta = report.merge_docs(docs)
    paths = report.write(args.out, output_stem(args.tag), records, meta)
    print("wrote", ", ".join(map(str, paths)))
    return 0


# ------------------------------------------------------------------------------------------
# child: one engine, every row of one model
# ------------------------------------------------------------------------------------------


def main_child(job_path: str) -> int:
    """One resident engine (harness.resident_engine): up, warmed, INFO, then every requested
    row (``{"spec": WorkloadSpec json, "tags": {...}}``) measured and answered with its record."""
    job = json.loads(Path(job_path).read_text())
    emit = engine_proc.emit
    try:
        child = engine_child.EngineChild(job)
    except Exception as e:
        traceback.print_exc()
        emit(engine_proc.ERROR_TAG, dict(error=f"engine start: {type(e).__name__}: {e}"))
        return 1
    child.engine.generate(input_ids=[[1000 + i] * 64 for i in range(4)],  # lazy init, not timed
                          sampling_params={"max_new_tokens": 16, "ignore_eos": True, "temperature": 0})
    emit(engine_proc.INFO_TAG, child.info())

    def handle(req: Dict[str, Any]) -> Dict[str, Any]:
        spec = wl.WorkloadSpec.from_json(req["spec"])
        if req.get("probe"):
            trace_dir = tempfile.mkdtemp(prefix="granikv_idle_")
            probe = req["probe"]
            return dict(child.idle_probe(spec, int(probe["steps"]), trace_dir, host=bool(probe.get("host")),
                                         keep=probe.get("keep")),
                        **req.get("tags", {}))
        return dict(child.run(spec), **req.get("tags", {}))

    try:
        return resident_engine.serve(handle)
    finally:
        child.engine.shutdown()


def median_repeat(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The repeat with the median output tok/s (the lower middle one of an even count), whole,
    so its counters and latencies stay those of one run; with ``repeats_out_tok_s`` (every
    repeat, in run order) when there was more than one."""
    if not records:
        raise ValueError("no repeat to choose from")
    if len(records) == 1:
        return records[0]
    order = sorted(range(len(records)), key=lambda i: records[i]["out_tok_per_s"])
    chosen = dict(records[order[(len(records) - 1) // 2]])
    chosen["repeats_out_tok_s"] = [r["out_tok_per_s"] for r in records]
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return main_child(args.child)
    if args.merge:
        return main_merge(args)
    try:
        return main_parent(args, argv)
    except ValueError as e:  # an unknown --models / --rows name
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    engine_proc.exit_after(main)
