"""The GPU suite: everything GraniKV proves on a GPU, from one entry point.

    python3 -m benchmark.gpu_suite --parts all --out /tmp/granikv-suite
    python3 -m benchmark.gpu_suite --parts tests,smoke,correctness --out OUT   # first half of all (~6 min, H100)
    python3 -m benchmark.gpu_suite --parts grid --out OUT2                     # second half (GRID_BUDGET_S)
    python3 -m benchmark.gpu_suite --parts grid --grid-backends flashinfer --out OUT
    python3 -m benchmark.gpu_suite --merge OUT1/gpu_suite.json OUT2/gpu_suite.json --out docs/results

From the repository root; every part's command runs from there too.

On a host without network, run it inside the environment installed from the air-gapped bundle
(docs/gpu_quickstart.md, "Air-gapped host").

Parts (run in this order; ``all`` = every one):

- ``tests``: ``pytest -m gpu test/`` (the GPU tests; a junit XML in ``--out``; split over
  ``--tests-workers N`` pytest processes at once, harness/pytest_workers.py: by default 4 on a
  GPU of 64 GiB or more, one pytest elsewhere);
- ``smoke``: the quickstart as written: ``python -m sglang.launch_server`` with
  ``--enable-granikv --enable-metrics`` on the shipped Llama-3.1-8B config (dummy weights, a
  word-level tokenizer so text prompts work), ``/generate`` calls whose texts share a long
  prefix, a ``/metrics`` scrape that must show a HOT extent and cascade decode steps, and a clean
  shutdown (SIGTERM, exit within the grace);
- ``correctness``: ``python -m benchmark.correctness.check`` (GraniKV vs stock on a
  context-sensitive model, the planted fault must be caught);
- ``grid``: ``python -m benchmark.multi_agent.regimes`` per ``--grid-backends`` (stock and
  GraniKV engines side by side, taking turns per repeat).

Every part prints its wall time; ``--out`` gets one folder per part and ``gpu_suite.json``:
``{"commit", "date", "sglang_version", "gpu", "parts": [{"name", "wall_s", "passed", ...}]}``.
Exit status 1 when a part fails. SIGTERM or SIGHUP (e.g. ``timeout``) stops the suite: the
running part's processes are killed (engines included), the part is recorded as stopped and no
later part runs. ``--merge`` combines summaries of several runs (and machines: every part keeps
its GPU) into one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmark.harness import pytest_workers

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "smoke", "correctness", "grid")
SUMMARY = "gpu_suite.json"
GPU_TESTS_ARGS = ("-m", "gpu", "-q")  # the tests part's pytest selection
# what makes ``all`` fit two invocations of at most 9 minutes on one H200: tests, smoke and
# correctness (170-205 + 57 + 136-297 s, measured 2026-12-01..06; 136 s with --parallel 3), then the grid (its row
# estimates, regime_grid.estimate_s, came within 6% of a measured grid: 329 s estimated, 312 s run)
GRID_BUDGET_S = 480.0
GRID_MODELS = "llama-3.1-8b"  # the default grid (every model's rows do not fit GRID_BUDGET_S: --grid-models)
# 32-48 requests per row (the check's own default, 4, takes twice as long), three engines at a time
# on the one GPU (136 s on an H100 against about 385 s one after another, docs/results/gpu_suite.md)
CORRECTNESS_ARGS = "--scale 2 --parallel 3"
# the tests part's pytest processes on a large GPU: 164 GPU tests took 177 s over four on an H100 80GB
# (370 s in one process; docs/results/gpu_suite.md), so tests, smoke and correctness take about 345 s
TESTS_WORKERS = 4
TESTS_WORKERS_MIN_GIB = 64.0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    csv = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=csv, default=["all"], help=f"Comma-separated subset of {','.join(PARTS)} or all.")
    p.add_argument("--out", default="/tmp/granikv-suite", help="Output folder.")
    p.add_argument("--commit", default=None, help="Commit recorded in gpu_suite.json (default: git rev-parse HEAD).")
    p.add_argument("--grid-backends", type=csv, default=["flashinfer", "triton"])
    p.add_argument("--grid-models", default=GRID_MODELS,
                   help=f"regimes --models (default {GRID_MODELS}: the rows the targets are judged on, in the "
                        "suite's budget; 'all': every model).")
    p.add_argument("--grid-rows", default=None, help="regimes --rows (default: every row).")
    p.add_argument("--grid-budget-s", type=float, default=None,
                   help=f"The grid's time budget, split into regimes --time-budget-s per backend: two thirds "
                        f"to the first backend, the rest shared by the others (default GRID_BUDGET_S = "
                        f"{GRID_BUDGET_S:g} s).")
    p.add_argument("--grid-repeats", type=int, default=3)
    p.add_argument("--grid-also-stock", type=csv, default=[],
                   help="regimes --also-stock: a stock engine of each of these backends beside every grid "
                        "backend's pair (skipped for the backend itself), e.g. fa3.")
    p.add_argument("--grid-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="regimes --engine-arg (repeatable; granikv_* keys go to the GraniKV engines), "
                        "e.g. granikv_view_plan=reuse.")
    p.add_argument("--grid-also-granikv", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="regimes --also-granikv (repeatable): a GraniKV engine with other GraniKV flags beside "
                        "every grid backend's pair, e.g. probe:granikv_clock_probe=paged_too (an A/B in one run).")
    p.add_argument("--grid-idle-probe-steps", type=int, default=32,
                   help="regimes --idle-probe-steps (GPU idle time per decode step; 0: off).")
    p.add_argument("--grid-host-probe-steps", type=int, default=0,
                   help="regimes --host-probe-steps (the host's time per CUDA call and ATen op per decode "
                        "step, profiled on one more run per engine, with Python frames; each trace kept "
                        "under <out>/grid/traces/; 0: off).")
    p.add_argument("--correctness-args", default=CORRECTNESS_ARGS,
                   help=f"Arguments of benchmark.correctness.check (one shell string; default {CORRECTNESS_ARGS!r}).")
    p.add_argument("--tests-args", default="", help="Extra pytest arguments (one shell string).")
    p.add_argument("--tests-workers", type=int, default=None,
                   help="Run the GPU tests in this many pytest processes at once on the one GPU "
                        "(benchmark/harness/pytest_workers.py: Triton's compiles, most of their time, "
                        f"on as many cores); 1: one pytest. Default: {TESTS_WORKERS} on a GPU of at least "
                        f"{TESTS_WORKERS_MIN_GIB} GiB, else 1.")
    p.add_argument("--smoke-backend", default="flashinfer")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="Combine gpu_suite.json files into --out and exit.")
    p.add_argument("--dry-run", action="store_true", help="Print each part's command and exit.")
    args = p.parse_args(argv)
    if args.parts == ["all"]:
        args.parts = list(PARTS)
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; known: {', '.join(PARTS)}, all")
    if args.tests_workers is None:  # the GPU is asked only where the tests part will run
        runs_tests = "tests" in args.parts and not args.merge
        args.tests_workers = default_tests_workers(gpu_memory_gib()) if runs_tests else 1
    if args.tests_workers < 1:
        p.error(f"--tests-workers {args.tests_workers}: at least 1")
    return args


def default_tests_workers(memory_gib: Optional[float]) -> int:
    """``TESTS_WORKERS`` pytest processes on a GPU of ``TESTS_WORKERS_MIN_GIB`` or more (four
    processes' tests fit beside each other there), one elsewhere or when the memory is unknown."""
    return TESTS_WORKERS if memory_gib is not None and memory_gib >= TESTS_WORKERS_MIN_GIB else 1


def gpu_memory_gib() -> Optional[float]:
    """The first GPU's total memory, or None without one."""
    mib = _query_gpu("memory.total", "--format=csv,noheader,nounits")
    try:
        return float(mib) / 1024 if mib else None
    except ValueError:
        return None


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse HEAD`` of ``root``, with ``+modified`` when tracked files differ from it
    (a copied tree whose git metadata lags its files records no commit it did not run);
    "unknown" without git."""
    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD").stdout.strip()
        if not head:
            return "unknown"
        return head + ("+modified" if git("diff", "--quiet", "HEAD", "--").returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sglang_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def gpu_name() -> Optional[str]:
    return _query_gpu("name", "--format=csv,noheader")


def _query_gpu(field: str, fmt: str) -> Optional[str]:
    """``nvidia-smi --query-gpu=field`` of the first GPU, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", fmt], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()
        return out[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- parts -----------------------------------------------------------------------------------


def python_cmd(module: str, *args: str) -> List[str]:
    """``python -m module args`` (a benchmark module; run_commands runs it from ROOT)."""
    return [sys.executable, "-m", module, *args]


def grid_budgets(args: argparse.Namespace) -> List[float]:
    """Each grid backend's time budget: the grid's whole budget (``--grid-budget-s``, default
    ``GRID_BUDGET_S``) split: two thirds to the first backend (flashinfer, the baseline that
    counts), the rest shared by the others (all of it when there is one), so that the grid part
    fits the budget it is given whatever the number of backends."""
    n = len(args.grid_backends)
    total = GRID_BUDGET_S if args.grid_budget_s is None else float(args.grid_budget_s)
    if n <= 1:
        return [total] * n
    first = round(total * 2 / 3)
    return [float(first)] + [float(round((total - first) / (n - 1)))] * (n - 1)


def part_commands(args: argparse.Namespace, out: Path) -> Dict[str, List[List[str]]]:
    """The subprocess commands of each command-line part (smoke runs in-process)."""
    grid = []
    for backend, budget in zip(args.grid_backends, grid_budgets(args), strict=True):
        cmd = python_cmd("benchmark.multi_agent.regimes", "--backend", backend, "--out", str(out / "grid"),
                         "--time-budget-s", f"{budget:g}", "--repeats", str(args.grid_repeats),
                         "--idle-probe-steps", str(args.grid_idle_probe_steps))
        if args.grid_host_probe_steps:
            cmd += ["--host-probe-steps", str(args.grid_host_probe_steps), "--keep-host-traces"]
        models = grid_scope(args)["models"]
        if models:
            cmd += ["--models", models]
        if args.grid_rows:
            cmd += ["--rows", args.grid_rows]
        for item in args.grid_engine_arg:
            cmd += ["--engine-arg", item]
        also = [b for b in args.grid_also_stock if b != backend]
        if also:
            cmd += ["--also-stock", ",".join(also)]
        for item in args.grid_also_granikv:
            cmd += ["--also-granikv", item]
        grid.append(cmd)
    return dict(
        tests=[[sys.executable, "-m", "pytest", *GPU_TESTS_ARGS, "-p", "no:cacheprovider", "test/",
                f"--junitxml={out / 'tests' / 'gpu_tests.xml'}", *shlex.split(args.tests_args)]],
        correctness=[python_cmd("benchmark.correctness.check", "--out", str(out / "correctness"),
                                *shlex.split(args.correctness_args))],
        grid=grid,
    )


def run_tests_in_workers(args: argparse.Namespace, out: Path) -> Dict[str, Any]:
    """The tests part over ``--tests-workers`` pytest processes (pytest_workers): the GPU tests
    collected once, split round robin, run at once; a junit XML per process in ``out``."""
    extra = shlex.split(args.tests_args)
    ids = pytest_workers.collect([*GPU_TESTS_ARGS, "test/", *extra], ROOT)
    if not ids:
        return dict(passed=False, error="no GPU tests collected")
    groups = pytest_workers.split(ids, args.tests_workers)
    return dict(pytest_workers.run(groups, [*GPU_TESTS_ARGS, *extra], out, ROOT), tests=len(ids))


def run_commands(cmds: Sequence[Sequence[str]]) -> Dict[str, Any]:
    """Runs each command from the repository root in turn (output streamed); passed = every one
    exited 0."""
    codes = []
    for cmd in cmds:
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        proc = subprocess.Popen(list(cmd), cwd=ROOT, start_new_session=True)
        try:
            codes.append(proc.wait())
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return dict(passed=all(c == 0 for c in codes), exit_codes=codes)


class Stopped(BaseException):
    """The suite got SIGTERM or SIGHUP (a timeout, a closed session): raised in the running part,
    so that its ``finally`` blocks kill the part's process group (``run_commands`` starts each
    command in a session of its own, which no signal to the suite reaches) and the summary
    records the part as stopped. Without it the part's engines would outlive the suite and keep
    the GPU."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def run_part(name: str, fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    print(f"=== part {name}", flush=True)
    t0 = time.time()
    try:
        res = fn()
    except Stopped as e:  # the suite is stopping: this part failed, no later part runs (main)
        res = dict(passed=False, error=f"stopped by {e.args[0]}", stopped=True)
    except Exception as e:  # a part that breaks is a failed part, the others still run
        import traceback

        traceback.print_exc()
        res = dict(passed=False, error=f"{type(e).__name__}: {e}")
    res = dict(name=name, wall_s=round(time.time() - t0, 1), **res)
    print(f"=== part {name}: {'passed' if res['passed'] else 'FAILED'} in {res['wall_s']:.0f} s", flush=True)
    return res


def write_summary(out: Path, doc: Dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / SUMMARY
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def grid_rows_not_run(grid_out: Path, backends: Sequence[str]) -> List[List[str]]:
    """The grid rows a backend's run did not measure, with why (``[backend, row key, why]``:
    the time budget, before or during the run, a model not served on that backend, an engine
    gone), from each backend's regimes JSON (``meta.skipped``). The part passes on its commands'
    exit status (rows the budget leaves out are not errors) and says which rows it left out. A
    backend whose JSON is missing or unreadable adds nothing (its failure is the part's)."""
    out: List[List[str]] = []
    for backend in backends:
        try:
            doc = json.loads((grid_out / f"regimes_{backend}.json").read_text())
        except (OSError, ValueError):
            continue
        out += [[backend, str(key), str(why)] for key, why in (doc.get("meta") or {}).get("skipped") or []]
    return out


def grid_scope(args: argparse.Namespace) -> Dict[str, Any]:
    """What a grid part measured (its backends, models and rows): grid runs of different
    scopes complement each other in a merge, one of the same scope replaces the earlier."""
    models = None if args.grid_models in (None, "", "all") else args.grid_models
    scope = dict(backends=list(args.grid_backends), models=models, rows=args.grid_rows)
    if args.grid_engine_arg:  # engines started otherwise measure another grid
        scope["engine_args"] = list(args.grid_engine_arg)
    if args.grid_also_granikv:
        scope["also_granikv"] = list(args.grid_also_granikv)
    return scope


def _part_scope(part: Dict[str, Any], doc: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A grid part's scope: recorded, or read back from the run's command line for summaries
    written before scopes were recorded; None where neither tells (an earlier merge of such)."""
    scope = part.get("scope")
    if scope is None and doc.get("command"):
        argv = shlex.split(doc["command"])
        if "benchmark.gpu_suite" in argv:
            try:
                scope = grid_scope(parse_args(argv[argv.index("benchmark.gpu_suite") + 1:]))
            except SystemExit:  # not a command this version parses: one scope per run
                scope = dict(command=doc["command"])
    return scope


def _part_key(part: Dict[str, Any], doc: Dict[str, Any], scope: Optional[Dict[str, Any]]) -> Tuple[str, str]:
    """A part's identity in a merge: its name, and for a grid part its ``scope`` (``_part_scope``;
    a part of an earlier merge whose scope nothing tells is itself: its run's commit, date and
    wall time)."""
    if part["name"] != "grid":
        return part["name"], ""
    if scope is None and doc.get("runs"):
        scope = dict(commit=part.get("commit", doc.get("commit")), date=part.get("date", doc.get("date")),
                     wall_s=part.get("wall_s"))
    return "grid", json.dumps(scope, sort_keys=True)


def merge(docs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Several suite runs (or earlier merges) as one summary. Every part keeps its own commit,
    date and GPU; a later run's part replaces an earlier one of the same name, except that grid
    parts of different scopes (``grid_scope``) are all kept. The top-level commit and date are the
    latest run's; ``gpu`` names every GPU the kept parts ran on; ``runs`` lists every run."""
    parts: Dict[Tuple[str, str], Dict[str, Any]] = {}
    runs: List[Dict[str, Any]] = []
    for d in docs:
        for p in d.get("parts", []):
            kept = dict(p, commit=p.get("commit", d.get("commit")), date=p.get("date", d.get("date")),
                        gpu=p.get("gpu", d.get("gpu")))
            scope = _part_scope(p, d) if p["name"] == "grid" else None
            if scope is not None:
                kept["scope"] = scope  # recorded, so that a later merge of this one reads it
            key = _part_key(p, d, scope)
            parts.pop(key, None)  # re-inserted last: a replacement sorts as the latest
            parts[key] = kept
        runs += d.get("runs") or [dict(commit=d.get("commit"), date=d.get("date"), gpu=d.get("gpu"),
                                       command=d.get("command"), wall_s=d.get("wall_s"))]
    last = docs[-1] if docs else {}
    ordered = [p for n in PARTS for k, p in parts.items() if k[0] == n]
    gpus = list(dict.fromkeys(p["gpu"] for p in ordered if p.get("gpu")))
    return dict(commit=last.get("commit"), date=last.get("date"), sglang_version=last.get("sglang_version"),
                gpu=" + ".join(gpus) if gpus else last.get("gpu"), runs=runs, parts=ordered,
                passed=all(p.get("passed") for p in ordered))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    if args.merge:
        doc = merge([json.loads(Path(p).read_text()) for p in args.merge])
        print("wrote", write_summary(out, doc))
        return 0 if doc["passed"] else 1
    cmds = part_commands(args, out)
    if args.dry_run:
        for name in args.parts:
            for cmd in cmds.get(name, [["(in-process) smoke", args.smoke_backend]]):
                if name == "tests" and args.tests_workers > 1:  # run_tests_in_workers
                    cmd = [*cmd, f"(its tests split over {args.tests_workers} pytest processes)"]
                print(f"{name}: {' '.join(shlex.quote(c) for c in cmd)}")
        return 0
    from benchmark.smoke import run_smoke  # deferred: a dry run or a merge needs none of it

    doc = dict(commit=args.commit or git_commit(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               sglang_version=sglang_version(), gpu=gpu_name(),
               command=" ".join(shlex.quote(a) for a in ["python3", "-m", "benchmark.gpu_suite", *argv]), parts=[])
    t0 = time.time()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    for name in args.parts:
        if name == "smoke":
            fn = lambda: run_smoke(out / "smoke", backend=args.smoke_backend)  # noqa: E731
        elif name == "tests" and args.tests_workers > 1:
            fn = lambda: run_tests_in_workers(args, out / "tests")  # noqa: E731
        else:
            (out / name).mkdir(parents=True, exist_ok=True)
            fn = (lambda c: lambda: run_commands(c))(cmds[name])
        part = run_part(name, fn)
        if name == "grid":
            part["scope"] = grid_scope(args)
            part["rows_not_run"] = grid_rows_not_run(out / "grid", args.grid_backends)
        doc["parts"].append(part)
        doc["wall_s"] = round(time.time() - t0, 1)
        write_summary(out, doc)
        if part.get("stopped"):
            break
    for p in doc["parts"]:
        left = p.get("rows_not_run") or []
        note = f"  ({len(left)} grid rows not run: {', '.join(f'{b}:{k}' for b, k, _ in left)})" if left else ""
        print(f"{p['name']:12s} {p['wall_s']:7.1f} s  {'passed' if p['passed'] else 'FAILED'}{note}")
    return 0 if all(p["passed"] for p in doc["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
