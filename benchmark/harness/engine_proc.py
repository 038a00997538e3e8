"""One engine per subprocess: its own process group, tagged records on stdout, a hard timeout.

A child prints one record per line as ``TAG {json}`` (:func:`emit`); the parent
(:func:`run_tagged`) echoes every line with the child's name, parses the tagged ones and hands
them to a callback as they arrive, so the caller can write its results after every record.
The child runs in a new session: killing its group also kills the scheduler and detokenizer
processes an ``sglang.Engine`` (or ``launch_server``) spawns, which would otherwise keep the
GPU's memory.

A benchmark that starts a child of itself or of another benchmark runs it as a module,
:func:`module_command` (``python -m benchmark.…``), from :data:`REPO_ROOT` and with
:func:`repo_env` (the repository root first on ``PYTHONPATH``), so the child imports the
``benchmark`` package whatever the parent's working directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]  # holds the benchmark package

ROW_TAG, INFO_TAG, ERROR_TAG = "ROW ", "INFO ", "ERROR "
TAGS: Mapping[str, str] = {ROW_TAG: "row", INFO_TAG: "info", ERROR_TAG: "error"}


def emit(tag: str, obj: Mapping[str, Any]) -> None:
    """Child side: one tagged record on stdout, flushed (the parent reads it at once)."""
    print(tag + json.dumps(obj, default=str), flush=True)


def parse_line(line: str, tags: Mapping[str, str] = TAGS) -> Optional[Dict[str, Any]]:
    """The record of a tagged line, with ``kind`` set; None for any other line (or bad JSON)."""
    for tag, kind in tags.items():
        if line.startswith(tag):
            try:
                rec = json.loads(line[len(tag):])
            except ValueError:
                return None
            if isinstance(rec, dict):
                rec["kind"] = kind
                return rec
    return None


def kill_group(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Kills the child's whole process group: SIGTERM, then SIGKILL after ``grace_s`` (at once
    when 0); the group is SIGKILLed even when its leader exits in time, for the children it
    leaves. A group already gone is fine."""
    sigs = ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)) if grace_s > 0 else ((signal.SIGKILL, 10.0),)
    for sig, wait in sigs:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # leader gone: make sure its children are too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return


@dataclass
class ChildResult:
    returncode: Optional[int]
    timed_out: bool
    errors: int  # error records the child sent itself
    seconds: float


def module_command(module: str, *args: str) -> List[str]:
    """``python -m module args`` with this interpreter: how a benchmark starts a child of itself
    or of another benchmark module (``module_command("benchmark.multi_agent.run", "--child",
    job)``); run it with ``cwd=REPO_ROOT`` and an environment from :func:`repo_env`."""
    return [sys.executable, "-m", module, *args]


def run_tagged(cmd: Sequence[str], *, name: str, on_record: Callable[[Dict[str, Any]], None],
               timeout: float, env: Optional[Mapping[str, str]] = None,
               extra: Optional[Mapping[str, Any]] = None, tags: Mapping[str, str] = TAGS,
               echo: bool = True, cwd: Optional[Path] = None) -> ChildResult:
    """Runs ``cmd`` in its own process group (in ``cwd``) until it exits or ``timeout`` seconds pass.

    Every tagged stdout line becomes a record (``kind`` + ``extra`` merged in) passed to
    ``on_record`` at once; other lines are echoed as ``[name] line``. The group is killed at the
    end whatever happened (a crashed engine's leftovers would hold GPU memory). The caller turns
    ``timed_out`` / a non-zero ``returncode`` without error records into its own error record.
    """
    t0 = time.time()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env) if env is not None else None, bufsize=1, start_new_session=True,
                            cwd=cwd)
    fired = threading.Event()
    watchdog = threading.Timer(timeout, lambda: (fired.set(), kill_group(proc)))
    watchdog.start()
    errors = 0
    try:
        for line in proc.stdout:
            if echo:
                sys.stdout.write(f"[{name}] {line}")
            rec = parse_line(line, tags)
            if rec is not None:
                rec.update(extra or {})
                errors += rec["kind"] == "error"
                on_record(rec)
        proc.wait()
    finally:
        watchdog.cancel()
        kill_group(proc)
    return ChildResult(proc.returncode, fired.is_set(), errors, time.time() - t0)


def repo_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``base`` (default: this process's environment) with :data:`REPO_ROOT` first on
    ``PYTHONPATH``: a ``python -m benchmark.…`` child finds the package from any directory."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    return env


def engine_env(backend: str, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment of an engine / server process for an SGLang attention ``backend``; a child
    that runs a benchmark module passes ``base=repo_env()``."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    if backend == "flashinfer":
        env["SGLANG_IS_FLASHINFER_AVAILABLE"] = "true"  # the flashinfer backend's imports need it
    return env


def gpu_free_bytes() -> Optional[int]:
    """Free memory of the GPU a single-GPU engine runs on (the first of ``CUDA_VISIBLE_DEVICES``,
    else GPU 0), from ``nvidia-smi`` (this process creates no CUDA context, which would itself
    hold memory beside the engines); None where it cannot tell."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", first],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0]) << 20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def exit_after(main: Callable[[], int]) -> None:
    """Run a benchmark script's ``main`` and leave with its status through ``os._exit``:
    SGLang's engine leaves non-daemon threads behind, which a normal exit would wait for.
    ``SystemExit`` (``--help``, an argparse error) leaves with its own status, no traceback;
    any other exception prints its traceback and exits 1."""
    try:
        code = main()
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # what the interpreter prints for SystemExit("message")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(code)
