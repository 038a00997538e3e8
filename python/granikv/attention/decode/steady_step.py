"""``SteadyReplay``: what a steady cascade graph step keeps so that the next step of the same
batch is planned in a handful of calls.

A decode batch that keeps its requests replays the same cascade graph step after step: the
grouping, the work list and the wrapped backend's view plan are reused, the graph copies the
new suffix ends itself and appends each request's newest KV slot to the slot copy
(kernels/suffix_slots.py), and the only host work left is the path choice and the bookkeeping
(plus the pre-replay slot copy where the graph does not append). The full plan
(``DecodePlanner._plan``) still spends most of a step proving that nothing changed (the HOT
runs, the grouping, the device ends, the workspace's reuse bound), about sixty Python calls;
in serving, where the scheduler's own work between two plans leaves the host's caches cold,
those calls cost 75-130 µs per step.

After such a step (a full build too, where its suffix ends are bound to the device:
``CascadeWorkspace.build_in_place`` counts it as an in-place advance to its own lengths, so
the step after a build is a replay as well), and after a step whose path the dispatcher chose
paged for a grouping (rows that share HOT prefixes, where sharing does not pay), the planner
arms a ``SteadyReplay``. The next step takes it when:

- it is planned the same way (graph or eager) at the same padded size, for the same rows array (SGLang replaces
  ``req_pool_indices_cpu`` whenever the batch is filtered or merged, never writes it in place),
  under the same HOT-prefix table version, with the device ``seq_lens`` at the same address
  (a cascade graph copies its suffix ends from there);
- the batch's sequence total grew by exactly its number of requests, and the armed
  ``headroom`` has steps left. A decode step appends one token to every request of its batch
  (SGLang's ``prepare_for_decode``; speculative decoding, which appends several, is off under
  GraniKV), and a request stays in the batch only while the rows array does (a retraction or
  an abort filters the batch, which makes a new array): each request is one token longer, and
  after ``headroom`` such steps its last suffix item would outgrow the build's reuse bound
  (``CascadeWorkspace.advance``), so the full plan runs then (a paged step has no build: no
  such bound);
- the dispatcher and the step clock still choose the armed path.

A cascade replay whose path choice turns paged (the step clock measuring paged for a window,
or holding it) takes that paged step from the replay too (``paged_excursion``): paged steps
need nothing GraniKV builds, and the cascade build stays in its workspace untouched. The paged
replay keeps the cascade one as ``resume``; when the choice returns to that path and the
build's headroom covers the steps taken since (``resume_steps``), the step resumes it in
place, with the slot copy made again before the replay (the stock graph of the paged steps did
not append their slots), instead of planning in full::

    cascade replay (headroom h) -> paged x k (the build untouched) -> cascade, resumed if h >= k + 1

Anything else (a paged step, an extend, a capture, new graph state, ``--granikv-debug-integrity``,
whose checks need the full plan) disarms it and the full plan runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Tuple

import numpy as np

from granikv.attention.decode.step_plan import StepPlan
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.attention.dispatcher import Path
from granikv.attention.step_stats import grouping_counts

#: ``SteadyReplay.headroom`` of a paged step: no build, so no reuse bound.
PAGED_HEADROOM = 1 << 62


@dataclass(eq=False)
class SteadyReplay:
    """The armed step: what the next one must match, and what it reuses."""

    bs: int  # padded batch size (the cascade graph's)
    rows: np.ndarray  # the staged rows array (matched by identity)
    version: Any  # the HOT-prefix table's version
    ends_ptr: int  # address of the device seq_lens the graph copies its suffix ends from
    seq_total: int  # the real requests' sequence total at the last step
    headroom: int  # steps of one token per request left before the build must be advanced in full
    plan: StepPlan  # grouping, description and decision of the armed step
    path: Path
    graph: bool  # a graph replay (else an eager step)
    ws: Optional[CascadeWorkspace]  # the workspace advanced in place (None: a paged step)
    n: int  # real requests (the in-place advance's positions)
    clock_key: Hashable  # the step clock's batch-shape key
    copy_slots: bool  # the replay reads the slot copy (suffix_slots.py), not req_to_token
    appends: bool = False  # ... which its graph keeps current (append_suffix_slots): no copy before it
    replays: int = 0  # steps planned from it
    resume: Optional["SteadyReplay"] = None  # a paged excursion's cascade replay (paged_excursion)
    ws_revision: Optional[Tuple[int, int, int, int]] = None  # that workspace's revision when it left
    counts: Tuple[int, int, int] = field(init=False)  # the grouping's StepStats counts (grouping_counts)

    def __post_init__(self) -> None:
        self.counts = grouping_counts(self.plan.grouping)

    def paged_excursion(self, plan: StepPlan, seq_total: int) -> "SteadyReplay":
        """The paged replay of a step (at ``seq_total``) whose choice left this cascade replay
        for paged (``plan``: this one's grouping and description with the paged decision); it
        keeps this one, unchanged, to resume."""
        assert self.ws is not None and self.path is not Path.PAGED, "only a cascade replay makes a paged excursion"
        return SteadyReplay(self.bs, self.rows, self.version, self.ends_ptr, seq_total, PAGED_HEADROOM, plan,
                            Path.PAGED, self.graph, None, self.n, self.clock_key, False, resume=self,
                            ws_revision=self.ws.revision)

    def resume_steps(self, path: Path, ends_ptr: int, seq_total: int) -> int:
        """Steps of one token per request since the cascade replay this paged one keeps
        (``resume``) last ran, when the step (already ``matches``) may resume it on ``path``:
        the same path, the same device seq_lens, its workspace untouched, headroom for every
        one of those steps; 0 when it may not."""
        r = self.resume
        if r is None or path is not r.path or ends_ptr != r.ends_ptr:
            return 0
        assert r.ws is not None
        steps = r.steps_since(seq_total)
        if steps is None or r.headroom < steps or r.ws.revision != self.ws_revision:
            return 0
        return steps

    def steps_since(self, seq_total: int) -> Optional[int]:
        """Steps of one token per request from this replay's last step to a batch at
        ``seq_total`` (None unless a whole number of them, at least one)."""
        steps, rest = divmod(seq_total - self.seq_total, self.n)
        return steps if not rest and steps >= 1 else None

    def matches(self, bs: int, rows: Optional[np.ndarray], version: Any, graph: bool, ends_ptr: int,
                seq_total: int) -> bool:
        """A step with these values may replay: the same batch, grown by one token per request
        since the last step, with headroom left."""
        if (rows is not self.rows or bs != self.bs or version != self.version or graph is not self.graph
                or (self.ws is not None and ends_ptr != self.ends_ptr)):
            return False
        return self.headroom >= 1 and seq_total - self.seq_total == self.n

    def advance(self, seq_total: int, steps: int = 1) -> None:
        """The step that matched is planned from this one (``steps``: the steps of one token per
        request since this one last ran; more than one where a resumed build skipped paged ones,
        none for the first step of a paged excursion, made at this step's total)."""
        self.seq_total = seq_total
        self.headroom -= steps
        self.replays += 1

    def check_integrity(self, seq_lens: np.ndarray) -> None:
        """The armed state against the batch's host ``seq_lens`` (tests and debug): the sequence
        total and a headroom no larger than the workspace's own bound gives (in steps of one
        token per request)."""
        total = int(np.add.reduce(seq_lens))
        assert total == self.seq_total, f"steady replay: armed sequence total {self.seq_total}, batch {total}"
        assert len(seq_lens) == self.n, f"steady replay armed for {self.n} requests, batch has {len(seq_lens)}"
        if self.ws is None:
            assert self.path is Path.PAGED and self.headroom > 0, "steady replay: a cascade step without a workspace"
            r = self.resume
            if r is not None:  # the kept cascade replay: its headroom less the steps taken since it ran
                assert r.ws is not None
                steps = r.steps_since(total)
                assert steps is not None, f"paged excursion: {total - r.seq_total} tokens since the cascade step"
                room = r.ws.in_place_headroom(seq_lens)
                assert room is not None, "paged excursion: the kept build is no longer in place"
                assert r.headroom - steps <= room, f"paged excursion: headroom {r.headroom} - {steps} > {room}"
            return
        room = self.ws.in_place_headroom(seq_lens)
        assert room is not None, "steady replay armed but the workspace's last advance was not in place"
        assert 0 <= self.headroom <= room, f"steady replay: headroom {self.headroom} outside [0, {room}]"
