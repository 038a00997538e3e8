"""An engine subprocess that stays up and measures rows on request, so two engines (stock and
GraniKV) can share one GPU and take turns row by row: drift of the machine then lands on both.

Protocol (one JSON object per line):

- parent -> child, on the child's stdin: ``{"op": "row", "id": N, ...}`` (whatever the child's
  handler needs) or ``{"op": "shutdown"}``;
- child -> parent, on stdout, tagged as in engine_proc: ``INFO {...}`` once the engine is up
  (the parent's :meth:`ResidentEngine.wait_ready` returns it), then per request exactly one
  ``ROW {..., "id": N}`` or ``ERROR {..., "id": N}``. Untagged lines are echoed with the child's
  name. An ``ERROR`` without an id before ``INFO`` means the engine did not start.

The child runs in its own process group (engine_proc.kill_group kills the scheduler and
detokenizer processes with it). Stdlib only.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from benchmark.harness import engine_proc


class EngineGone(RuntimeError):
    """The child exited, or did not answer in time (its group is killed)."""


class ResidentEngine:
    """Parent side of one resident engine child.

    ``cmd`` starts the child (in ``cwd``); it must print ``INFO`` when ready and then serve
    requests from stdin (:func:`serve`). Every tagged record also goes to ``on_record`` (with
    ``extra`` merged in), INFO and ERROR included, as engine_proc.run_tagged does.
    """

    def __init__(self, cmd: Sequence[str], *, name: str, env: Optional[Mapping[str, str]] = None,
                 extra: Optional[Mapping[str, Any]] = None,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None, echo: bool = True,
                 cwd: Optional[Path] = None):
        self.name, self.extra, self.echo = name, dict(extra or {}), echo
        self.on_record = on_record or (lambda rec: None)
        self._records: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue()
        self._next_id = 0
        self.t0 = time.time()
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=dict(env) if env is not None else None, start_new_session=True,
                                     cwd=cwd)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.echo:
                sys.stdout.write(f"[{self.name}] {line}")
            rec = engine_proc.parse_line(line)
            if rec is not None:
                rec.update(self.extra)
                self._records.put(rec)
        self._records.put(None)  # EOF: the child is gone

    def _next(self, deadline: float) -> Dict[str, Any]:
        try:
            rec = self._records.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            self.close()
            raise EngineGone(f"{self.name}: no answer before the deadline (killed)") from None
        if rec is None:
            self.close()
            raise EngineGone(f"{self.name}: exited with status {self.proc.poll()}")
        return rec

    def wait_ready(self, timeout: float) -> Dict[str, Any]:
        """The child's INFO record once its engine is up; EngineGone if it fails or is late."""
        deadline = time.time() + timeout
        while True:
            rec = self._next(deadline)
            self.on_record(rec)
            if rec["kind"] == "info":
                return rec
            if rec["kind"] == "error" and "id" not in rec:
                self.close()
                raise EngineGone(f"{self.name}: {rec.get('error')}")

    def request(self, payload: Mapping[str, Any], timeout: float) -> Dict[str, Any]:
        """Sends one request; returns its ROW or ERROR record (``kind`` tells which). Records
        without this request's id (late INFO lines) go to ``on_record`` only."""
        rid = self._next_id
        self._next_id += 1
        self._send(dict(payload, op="row", id=rid))
        deadline = time.time() + timeout
        while True:
            rec = self._next(deadline)
            if rec.get("id") == rid:
                return rec
            self.on_record(rec)

    def _send(self, obj: Mapping[str, Any]) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self.close()
            raise EngineGone(f"{self.name}: cannot write to the child: {e}") from None

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Asks the child to shut its engine down, waits ``grace_s``, then kills the group."""
        if self.proc.poll() is None:
            try:
                self._send(dict(op="shutdown"))
                self.proc.wait(timeout=grace_s)
            except (EngineGone, subprocess.TimeoutExpired):
                pass
        self.close()

    def close(self) -> None:
        engine_proc.kill_group(self.proc)


def serve(handle: Callable[[Dict[str, Any]], Dict[str, Any]], stream=None) -> int:
    """Child side: answers every ``row`` request on ``stream`` (stdin) with ``ROW`` (what
    ``handle`` returns) or ``ERROR`` (its exception), each carrying the request's id, until
    ``shutdown`` or EOF. Returns 1 when any request failed, else 0."""
    import traceback

    status = 0
    for line in stream or sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "shutdown":
            break
        rid = req.get("id")
        try:
            engine_proc.emit(engine_proc.ROW_TAG, dict(handle(req), id=rid))
        except Exception as e:
            traceback.print_exc()
            engine_proc.emit(engine_proc.ERROR_TAG, dict(error=f"{type(e).__name__}: {e}", id=rid))
            status = 1
    return status
