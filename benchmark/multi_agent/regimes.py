"""Regime benchmark: stock SGLang vs SGLang + GraniKV over the regimes that decide whether sharing
pays, each row with its no-long-prefix ceiling and its bounds.py floor, in one invocation.

    python3 benchmark/multi_agent/regimes.py --backend flashinfer --time-budget-s 0 --out OUT   # ~12 min
    python3 benchmark/multi_agent/regimes.py --backend flashinfer --models llama-3.1-8b --tag a --out OUT
                                          # one model per invocation where a call is limited to 10 min
    python3 benchmark/multi_agent/regimes.py --backend triton --out OUT
    python3 benchmark/multi_agent/regimes.py --merge OUT/regimes_flashinfer.json \
        OUT/regimes_triton.json --out docs/results                     # regimes.{json,md,png}
    python3 benchmark/multi_agent/regimes.py --dry-run                 # the grid and its estimate
    python3 benchmark/multi_agent/regimes.py --rows prefix512_2sharers_x64 --repeats 5 --out OUT
                                          # short rows: the median of 5 runs per engine

The grid, and how it was chosen, is in regime_grid.py. Per model of the grid (in order) the
parent starts two engines, one after the other, each in its own subprocess (GPU memory is freed
in between): the stock engine (``attention_backend=X``, dummy weights, run.py's engine
arguments) runs every row of the model and, after each row with a prefix longer than 256 tokens,
its ceiling (the same workload with every shared prefix cut to 256 tokens); then the GraniKV
engine (the same + ``enable_granikv=True``) runs the rows the stock engine completed. A row is
measured as in run.py (flush the radix cache, cache each shared prefix with one request, submit
every agent at once, output tok/s = output tokens / wall time), and the GraniKV engine's
counters are read before and after it (dispatch paths, extend fallbacks, promotion skips,
planning time).

Time: ``--time-budget-s`` (default 450) covers the whole invocation, engine starts included.
Rows that the estimate says do not fit are dropped before anything starts (lowest priority
first, the dry run lists them); while running, each engine starts no row past its share of what
is left, and a model is not started when its two engine starts no longer fit. The JSON (and md)
is rewritten after every record, so a run killed from outside keeps every row it finished.
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
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import regime_grid as grid  # noqa: E402
import regime_report as report  # noqa: E402
from harness import engine_proc  # noqa: E402

DEFAULT_BUDGET_S = 450.0
START_GRACE_S = 90.0  # the hard kill of an engine: its share of the budget + this
NO_BUDGET_TIMEOUT_S = 3600.0  # an engine's hard kill without a time budget


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="flashinfer", choices=("flashinfer", "triton"),
                   help="SGLang attention backend of both engines (GraniKV wraps it).")
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
    p.add_argument("--repeats", type=int, default=1,
                   help="Measure every row (and ceiling) this many times in its engine and keep the "
                        "repeat with the median output tok/s (all of them in repeats_out_tok_s).")
    p.add_argument("--dry-run", action="store_true", help="Print the selected grid and its estimate.")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="Combine partial regimes_*.json into --out/regimes.{json,md,png} and exit.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python3", "benchmark/multi_agent/regimes.py", *argv])


def engine_kwargs(model: grid.Model, backend: str, config: str, extra: Dict[str, Any]) -> Dict[str, Any]:
    """run.py's engine arguments + the model's (e.g. its KV cap) + pass-through ``--engine-arg``."""
    import run

    kw = dict(run.BASE_ENGINE_KWARGS, attention_backend=backend, tp_size=1, dp_size=1)
    kw.update(model.engine_kwargs)
    kw.update({k: v for k, v in extra.items() if not run.is_granikv_key(k)})
    if config == "granikv":
        kw.update(enable_granikv=True, **{k: v for k, v in extra.items() if run.is_granikv_key(k)})
    return kw


def job_rows(rows: Sequence[grid.Regime], config: str) -> List[Dict[str, Any]]:
    """What a child measures: each row's spec, and its ceiling's on the stock engine."""
    return [dict(regime=r.name, priority=r.priority, has_ceiling=r.has_ceiling, spec=r.spec_json(),
                 ceiling=r.spec_json(ceiling=True) if (config == "baseline" and r.has_ceiling) else None)
            for r in rows]


def print_plan(sel: grid.Selection, args) -> None:
    by = {m.name: m for m in grid.MODELS}
    print(f"backend {args.backend}, budget {args.time_budget_s:g} s, estimate {sel.estimate_s:.0f} s "
          f"(engine starts included), {len(sel.rows)} rows:")
    for r in sel.rows:
        print(f"  {r.key:52s} p{r.priority} agents={r.agents:4d} prefix={r.prefix_len:6d} "
              f"ceiling={'yes' if r.has_ceiling else 'row'} est={grid.estimate_s(r, by[r.model]):5.1f} s")
    for key, why in sel.skipped:
        print(f"  skipped {key}: {why}")


# ------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------


class Run:
    """The records of one invocation and its output files (rewritten after every record)."""

    def __init__(self, args, argv: Sequence[str], sel: grid.Selection):
        self.args = args
        self.stem = f"regimes_{args.backend}" + (f"_{args.tag}" if args.tag else "")
        self.records: List[Dict[str, Any]] = []
        self.meta = dict(command=command_line(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                         backend=args.backend, budget_s=args.time_budget_s, estimate_s=round(sel.estimate_s),
                         skipped=[list(s) for s in sel.skipped], engine_kwargs={})

    def add(self, rec: Dict[str, Any]) -> None:
        self.records.append(rec)
        report.write(self.args.out, self.stem, self.records, self.meta, quiet=True, png=False)

    def error(self, model: str, config: str, text: str) -> None:
        print(f"ERROR {model}/{self.args.backend}/{config}: {text}", flush=True)
        self.add(dict(kind="error", model=model, backend=self.args.backend, config=config, error=text))

    def skip(self, rows: Sequence[grid.Regime], why: str) -> None:
        self.meta["skipped"] += [[r.key, why] for r in rows]


def run_engine(run: Run, model: grid.Model, config: str, rows: Sequence[grid.Regime],
               deadline: float, extra: Dict[str, Any]) -> List[str]:
    """One engine over ``rows``; returns the regimes it measured (main variant)."""
    args = run.args
    kw = engine_kwargs(model, args.backend, config, extra)
    run.meta["engine_kwargs"][f"{model.name}/{args.backend}/{config}"] = kw
    finite = deadline != float("inf")
    job = dict(engine_kwargs=kw, backend=args.backend, config=config, model=model.name,
               model_config=str(grid.CONFIG_DIR / model.name / "config.json"), latency=args.latency,
               dp_routing="prefix", rows=job_rows(rows, config), deadline=deadline if finite else None,
               repeats=args.repeats)
    done: List[str] = []

    def on_record(rec: Dict[str, Any]) -> None:
        if rec["kind"] == "row" and rec.get("variant") == "main":
            done.append(rec["regime"])
        run.add(rec)

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    timeout = (max(30.0, deadline - time.time()) if finite else NO_BUDGET_TIMEOUT_S) + START_GRACE_S
    try:
        res = engine_proc.run_tagged([sys.executable, str(Path(__file__).resolve()), "--child", f.name],
                                     name=f"{model.name}/{args.backend}/{config}", on_record=on_record,
                                     timeout=timeout, env=engine_proc.engine_env(args.backend),
                                     extra=dict(model=model.name, backend=args.backend, config=config))
    finally:
        os.unlink(f.name)
    if res.timed_out:
        run.error(model.name, config, f"killed after {timeout:.0f} s (its share of --time-budget-s + "
                                      f"{START_GRACE_S:g} s)")
    elif res.returncode != 0 and not res.errors:
        run.error(model.name, config, f"child exited with status {res.returncode}")
    return done


def main_parent(args, argv: Sequence[str]) -> int:
    from run import parse_engine_args

    sel = grid.select(grid.default_grid(), models=args.models, rows=args.rows, budget_s=args.time_budget_s,
                      repeats=args.repeats)
    print_plan(sel, args)
    if args.dry_run:
        return 0
    t0 = time.time()
    deadline = t0 + args.time_budget_s if args.time_budget_s > 0 else float("inf")
    run = Run(args, argv, sel)
    extra = parse_engine_args(args.engine_arg)
    by = {m.name: m for m in grid.MODELS}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_tagged: the engine group dies
    order = grid.models_of(sel.rows)
    for i, name in enumerate(order):
        model, rows = by[name], [r for r in sel.rows if r.model == name]
        later = sum(by[m].start_s * 2 + sum(grid.estimate_s(r, by[m], args.repeats)
                                            for r in sel.rows if r.model == m)
                    for m in order[i + 1:])
        free = deadline - time.time() - later  # what this model may use
        if free < 2 * model.start_s:
            run.skip(rows, f"the two engine starts ({2 * model.start_s:.0f} s) no longer fit the time budget")
            run.error(name, "both", "skipped: time budget")
            continue
        est_rows = sum(grid.estimate_s(r, model, args.repeats) for r in rows)
        share_b = model.start_s + est_rows * 0.6  # the stock engine runs the ceilings too
        share = share_b / (2 * model.start_s + est_rows)
        done = run_engine(run, model, "baseline", rows, time.time() + free * share, extra)
        kept = [r for r in rows if r.name in done]
        if len(kept) < len(rows):
            run.skip([r for r in rows if r.name not in done], "stock engine ran out of its share of the budget")
        if kept:
            run_engine(run, model, "granikv", kept, deadline - later, extra)
    paths = report.write(args.out, run.stem, run.records, run.meta)
    print(f"wrote {', '.join(map(str, paths))} in {time.time() - t0:.0f} s", flush=True)
    rows = report.assemble(run.records, run.meta)
    print(report.markdown_table(rows), flush=True)
    return 1 if any(r["kind"] == "error" for r in run.records) else 0


def main_merge(args) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.merge]
    records, meta = report.merge_docs(docs)
    paths = report.write(args.out, "regimes", records, meta)
    print("wrote", ", ".join(map(str, paths)))
    return 0


# ------------------------------------------------------------------------------------------
# child: one engine, every row of one model
# ------------------------------------------------------------------------------------------


def main_child(job_path: str) -> int:
    import run
    import workloads as wl

    job = json.loads(Path(job_path).read_text())
    emit = engine_proc.emit
    try:
        child = run.Child(job)
    except Exception as e:
        traceback.print_exc()
        emit(engine_proc.ERROR_TAG, dict(error=f"engine start: {type(e).__name__}: {e}"))
        return 1
    child.engine.generate(input_ids=[[1000 + i] * 64 for i in range(4)],  # lazy init, not timed
                          sampling_params={"max_new_tokens": 16, "ignore_eos": True, "temperature": 0})
    emit(engine_proc.INFO_TAG, child.info())
    status = 0
    for row in job["rows"]:
        for variant in ("main", "ceiling"):
            spec_json = row["spec"] if variant == "main" else row["ceiling"]
            if spec_json is None:
                continue
            tags = dict(regime=row["regime"], variant=variant, priority=row["priority"],
                        has_ceiling=row["has_ceiling"])
            if job.get("deadline") and time.time() > job["deadline"]:
                emit(engine_proc.ERROR_TAG, dict(error=f"{row['regime']} ({variant}): skipped, time budget", **tags))
                status = 1
                continue
            try:
                spec = wl.WorkloadSpec.from_json(spec_json)
                emit(engine_proc.ROW_TAG, dict(median_repeat([child.run(spec) for _ in range(job.get("repeats", 1))]),
                                               **tags))
            except Exception as e:
                traceback.print_exc()
                emit(engine_proc.ERROR_TAG, dict(error=f"{row['regime']} ({variant}): {type(e).__name__}: {e}", **tags))
                status = 1
    child.engine.shutdown()
    return status


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
