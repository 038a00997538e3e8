"""The stream's time between consecutive decode graph replays, timed by CUDA events, no profiler.

An engine's decode step on the GPU is one graph replay (``DecodeCudaGraphRunner.execute`` loads
the step's inputs, then replays through ``FullCudaGraphBackend.replay``) followed by what runs
between two replays: sampling, the next step's metadata work and input copies, and the GPU's
wait for the host when the host is on the critical path. This module records a timing event on
the forward stream right before and right after every decode graph replay and reports, per
engine::

    replay_us = end(i) - start(i)          the step's graph on the GPU
    gap_us    = start(i + 1) - end(i)      the stream between two decode replays

over the pairs of decode forwards that follow each other with no other forward between them
(a prefill chunk, an extend of an agent loop's next turn) and with the profiler off (the idle
probe's profiled window is left out, as its host work is slowed). Where GraniKV's ``gap_us``
is within the stock engine's plus a few µs on the same row, the GPU does not wait on its host
work, whatever that work costs; it is an upper bound on the idle time, since the gap also
holds the GPU work between replays. Unlike the profiled idle time, nothing stretches the host:
two event records per step, the same on both engines. Unlike ``TPOT p50 - busy``, prefill
chunks inside the decode are left out.

The recorder reaches the scheduler process as an SGLang plugin (``register``, entry point
``replay_gaps`` of the ``replay_gaps_plugin`` folder's metadata, found once the folder is on
``PYTHONPATH``; :func:`plugin_env`). It records only while armed: the benchmark writes ``on``
into the control file named by ``BENCH_REPLAY_GAPS_CONTROL`` (or removes it) and asks for the
server info; ``Scheduler.get_internal_state`` then reads the file, reports the window that ends there
(``internal_states[i]["replay_gaps"]``) and starts a new one. A disarmed step costs one
attribute read.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

CONTROL_ENV = "BENCH_REPLAY_GAPS_CONTROL"
PLUGIN_DIR = Path(__file__).resolve().parent / "replay_gaps_plugin"
MAX_RECORDS = 50_000  # decode replays kept per window (two events each)
STATE_KEY = "replay_gaps"

_TARGETS = {
    "graph_replay": "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend.replay",
    "execute": "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
    "internal_state": "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
}


def plugin_env(env: Mapping[str, str], control: str) -> Dict[str, str]:
    """``env`` with the plugin's folder on ``PYTHONPATH`` and the control file named: an engine
    started with it records its decode replays when armed."""
    out = dict(env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PLUGIN_DIR)]
    out["PYTHONPATH"] = os.pathsep.join([*paths, str(PLUGIN_DIR)])
    out[CONTROL_ENV] = control
    return out


def arm(control: str, on: bool) -> None:
    """Benchmark side: the next server-info call starts (``on``) or ends a recording window.
    Off removes the control file (no file reads as off), so none is left between probes."""
    if on:
        Path(control).write_text("on\n")
    else:
        Path(control).unlink(missing_ok=True)


def armed_in(control: Optional[str]) -> bool:
    try:
        return control is not None and Path(control).read_text().strip() == "on"
    except OSError:
        return False


# ---- reduction ---------------------------------------------------------------------------


def gap_stats(records: Sequence[Tuple[int, bool, float, Optional[float]]]) -> Dict[str, Any]:
    """Per-window figures from ``(forward index, profiled, replay_us, gap_us to the next decode
    replay or None)`` per decode replay, in order. A gap counts when the next record is the very
    next forward (index + 1) and neither replay ran under the profiler."""
    replays = [r for _, prof, r, _ in records if not prof]
    gaps = [g for (fwd, prof, _, g), (nfwd, nprof, _, _) in zip(records, records[1:])
            if g is not None and not prof and not nprof and nfwd == fwd + 1]
    out: Dict[str, Any] = dict(replays=len(records), gaps=len(gaps))
    out["replay_us_p50"] = _round(statistics.median(replays)) if replays else None
    if gaps:
        gaps_sorted = sorted(gaps)
        out["gap_us_p50"] = _round(statistics.median(gaps_sorted))
        out["gap_us_p10"] = _round(gaps_sorted[int(0.1 * (len(gaps_sorted) - 1))])
        out["gap_us_p90"] = _round(gaps_sorted[int(0.9 * (len(gaps_sorted) - 1))])
        out["gap_us_mean"] = _round(statistics.fmean(gaps_sorted))
    else:
        out.update(gap_us_p50=None, gap_us_p10=None, gap_us_p90=None, gap_us_mean=None)
    return out


def _round(x: float) -> float:
    return round(float(x), 1)


# ---- the recorder (scheduler process) ------------------------------------------------------


class ReplayGapRecorder:
    """Events around decode executes while armed; ``window()`` reduces and restarts them.

    ``new_event`` makes a recorded event with ``elapsed_time(other)`` in ms and ``synchronize()``
    (``torch.cuda.Event(enable_timing=True)`` then ``.record()`` in serving); ``profiling``
    says whether the profiler is on."""

    def __init__(self, new_event: Callable[[], Any], profiling: Callable[[], bool], control: Optional[str]):
        self.new_event, self.profiling, self.control = new_event, profiling, control
        self.armed = False
        self._pending: Optional[Tuple[int, bool]] = None  # a decode execute's (forward index, profiled)
        self._records: List[Tuple[int, bool, Any, Any]] = []  # (forward index, profiled, start, end)
        self.dropped = 0

    def around_execute(self, original: Callable, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        """A decode forward's ``execute``: its graph replay (below) is the one to time."""
        if not self.armed or not forward_batch.forward_mode.is_decode():
            return original(runner, forward_batch, *args, **kwargs)
        # ModelRunner.forward numbers its forwards
        self._pending = (int(runner.model_runner.forward_pass_id), self.profiling())
        try:
            return original(runner, forward_batch, *args, **kwargs)
        finally:
            self._pending = None

    def around_graph_replay(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """The graph replay inside a decode ``execute``, after its inputs were loaded (SGLang's
        ``load_batch`` and GraniKV's hook on it stay in the gap, with the plan before them)."""
        pending = self._pending
        if pending is None:
            return original(*args, **kwargs)
        self._pending = None
        start = self.new_event()
        out = original(*args, **kwargs)
        end = self.new_event()
        if len(self._records) < MAX_RECORDS:
            self._records.append((pending[0], pending[1], start, end))
        else:
            self.dropped += 1
        return out

    def window(self) -> Dict[str, Any]:
        """The figures since the last call (None-valued when nothing was recorded), then a new
        window, armed as the control file says."""
        recs = self._records
        if recs:
            recs[-1][3].synchronize()
        rows = []
        for i, (fwd, prof, start, end) in enumerate(recs):
            gap = end.elapsed_time(recs[i + 1][2]) * 1000.0 if i + 1 < len(recs) else None
            rows.append((fwd, prof, start.elapsed_time(end) * 1000.0, gap))
        out = dict(gap_stats(rows), dropped=self.dropped, armed=self.armed)
        self._records, self.dropped = [], 0
        self.armed = armed_in(self.control)
        return out

    def after_internal_state(self, result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        state = getattr(result, "internal_state", result)
        if isinstance(state, dict):
            state[STATE_KEY] = self.window()
        return None


def _cuda_event() -> Any:
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _profiling() -> bool:
    import torch

    return bool(torch.autograd._profiler_enabled())


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): the recorder's hooks, in every process that
    loads plugins, when ``BENCH_REPLAY_GAPS_CONTROL`` names a control file."""
    control = os.environ.get(CONTROL_ENV)
    if not control:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    rec = ReplayGapRecorder(_cuda_event, _profiling, control)
    HookRegistry.register(_TARGETS["execute"], rec.around_execute, HookType.AROUND)
    HookRegistry.register(_TARGETS["graph_replay"], rec.around_graph_replay, HookType.AROUND)
    HookRegistry.register(_TARGETS["internal_state"], rec.after_internal_state, HookType.AFTER)


def of_server_info(server_info: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The first scheduler's window in a server info, None without the recorder."""
    for state in server_info.get("internal_states") or []:
        if isinstance(state, dict) and isinstance(state.get(STATE_KEY), dict):
            return state[STATE_KEY]
    return None
