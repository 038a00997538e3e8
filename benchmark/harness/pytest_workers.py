"""The GPU tests over several pytest processes on one GPU (``gpu_suite --tests-workers N``).

Most of the GPU tests' wall time is Triton compiling kernels (one specialization per GQA
shape, head_dim and variant; on an H100 at ``adb2de5`` two kernel files took 273 of the 322 s
the 164 tests ran), which is host work on one core per process. N processes compile on N
cores while the GPU, idle most of the time, runs whichever test is ready; Triton's on-disk
cache is shared between them.

    ids = collect(pytest_args)                         # pytest --collect-only -q
    groups = split(ids, n)                             # round robin over (file, test) order
    res = run(groups, pytest_args, out)                # n processes at once, one junit XML each

``run``: passed = every process exited 0; each process's output goes to its own log (the tail
of a failing one is printed). On any exception (the suite's ``Stopped`` included) every
process group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

#: pytest's "no tests collected" exit status: a collection that finds none is no error here
#: (the caller decides; ``split`` never makes an empty group of a non-empty collection)
NO_TESTS = 5
TAIL_LINES = 40


def pytest_cmd(args: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def collect(args: Sequence[str], cwd: Path) -> List[str]:
    """The node ids ``pytest args`` would run (``--collect-only -q``, at exactly that verbosity:
    ``-qq`` would print counts per file), in pytest's order."""
    quiet = [a for a in args if a not in ("-q", "-qq", "-v", "-vv", "--quiet", "--verbose")]
    res = subprocess.run(pytest_cmd([*quiet, "--collect-only", "-q"]), cwd=cwd, capture_output=True, text=True)
    ids = [line.strip() for line in res.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if res.returncode not in (0, NO_TESTS):
        raise RuntimeError(f"pytest --collect-only exited {res.returncode}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return ids


def split(ids: Sequence[str], n: int) -> List[List[str]]:
    """``ids`` in ``min(n, len(ids))`` groups, round robin in (file, test) order: each group gets a
    share of every file's tests (a file's parametrizations compile different kernels), every id
    in exactly one group, group sizes differing by at most one."""
    if n < 1:
        raise ValueError(f"--tests-workers {n}: at least 1")
    order = sorted(ids, key=lambda i: (i.split("::", 1)[0], i))
    k = max(1, min(n, len(order)))
    return [order[j::k] for j in range(k)]


def run(groups: Sequence[Sequence[str]], args: Sequence[str], out: Path, cwd: Path,
        popen: Callable[..., Any] = subprocess.Popen) -> Dict[str, Any]:
    """Every group's tests in a pytest process of its own, all at once (``args``: the pytest
    arguments other than the test paths, e.g. ``-m gpu -q``); junit XML and log per process
    under ``out``. Returns ``passed``, ``exit_codes`` and ``workers``."""
    out.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    try:
        for i, ids in enumerate(groups):
            log = out / f"worker_{i}.log"
            logs.append(log)
            cmd = pytest_cmd([*args, f"--junitxml={out / f'gpu_tests_{i}.xml'}", *ids])
            print(f"$ worker {i}: pytest {' '.join(args)} ({len(ids)} tests) > {log}", flush=True)
            with open(log, "w") as f:
                procs.append(popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        shown = lines[-TAIL_LINES:] if code else lines[-1:]
        print(f"--- worker {i}: exit {code}", *shown, sep="\n", flush=True)
    return dict(passed=bool(codes) and all(c == 0 for c in codes), exit_codes=codes, workers=len(groups))
