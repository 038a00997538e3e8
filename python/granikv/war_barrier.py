"""SGLang's write-after-read barrier, kept correct when GraniKV's kernels are in the decode graph.

After launching a batch, SGLang's scheduler orders its next writes to shared buffers
(``req_to_token``, ...) behind the forward's reads (``Scheduler._apply_war_barrier``). Its fast
path waits only on a read-done event the decode graph runner records *before* the replay
(the stock kernels read ``req_to_token`` in the pre-replay metadata copy). GraniKV's planner
copies the step's suffix slots out of ``req_to_token`` in that same pre-replay window
(``attention/decode/slot_copy.py``), so a cascade replay reads the copy and the event stays
valid: SGLang's fast path holds, and the scheduler prepares the next batch while the replay runs.

    forward stream:  [metadata copy + GraniKV slot copy] ^read-done  [graph replay: reads the copy]
    schedule stream:                                      ^ fast path waits here

Where a cascade replay still reads ``req_to_token`` (``--granikv-replay-slots table``, or a
build whose suffix items are wider than the copy), the event is too early: the hook drops it,
and SGLang takes its coarse path (the schedule stream waits for the whole forward stream).
GraniKV's own KV writes on the schedule stream (promotion copies) wait for the forward stream
in any case (``scheduler_step``).
"""

from typing import TYPE_CHECKING

from granikv import sglang_compat as compat
from granikv.scheduler_step import granikv_backends

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler


def reads_during_replay(scheduler: "Scheduler") -> bool:
    """Whether a decode-graph replay of this scheduler's model may run GraniKV's kernels
    (asked on every step: a loop, no generator)."""
    for b in granikv_backends(scheduler):
        if b.reads_req_to_token_during_replay():
            return True
    return False


def drop_early_read_done(scheduler: "Scheduler") -> bool:
    """Before ``Scheduler._apply_war_barrier``: clears the pre-replay read-done event when GraniKV's
    kernels may read ``req_to_token`` during the replay. Returns True if it cleared one. The
    runner and its event are named per release (``sglang_compat.war_read_done_runner``). The
    backends are asked first: on most steps no replay reads it, and the runner is not looked up."""
    if not reads_during_replay(scheduler):
        return False
    runner = compat.war_read_done_runner(getattr(scheduler, "model_worker", None))
    if getattr(runner, compat.WAR_EVENT_ATTR, None) is None:
        return False
    setattr(runner, compat.WAR_EVENT_ATTR, None)
    return True
