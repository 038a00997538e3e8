"""``StepClock``: the end-to-end time of served decode steps, measured per path, overruling the
cost model where a shared-prefix path is measured slower than paged, or faster than a close
paged choice.

The cost model prices the kernels, launch floors and the planner's own host time. What it does
not see is everything else a path changes on the host: when a model's decode step is short (few
layers), the scheduler's own per-step work already exceeds the GPU's and any extra host work of
a non-paged step (beyond the planning the model counts) lengthens the step one for one, while
the attention it saves is a small part of the step. So, where the predicted saving is a small
part of the measured step (``saving < TRUST * step``), the clock measures both paths on the
batch in turn and keeps the faster:

    steps of one batch size:  [path A x WINDOW] [path B x WINDOW] -> hold the faster for HOLD steps,
                              then measure again

A window that finds paged faster is confirmed by a second pair of windows before paged is held
(the path's own choice is held after one): a verdict against the model rests on twice the
samples, so that one noisy window (a collection pause, a burst of output work in the
scheduler) does not turn HOLD steps of a cheaper path paged.

A step's end-to-end time is the host time between two consecutive decode plans (SGLang plans
each decode step once, when it launches it; in the steady state the interval between two
launches is the step's period, host and GPU together). Only intervals between two steps of the
same batch size and path, with no other forward pass in between (``interrupt``), are samples;
the first ``SETTLE`` of each window are dropped (the pipeline still holds the other path's
step). A choice the cost model trusts (the saving dominates the step) is never probed.

The other way round, where the model chose paged for a grouped batch by a small margin (the
runner-up priced less than ``PROBE_LOSS`` of the step slower: a wrong guess costs little while
it is measured), the clock measures that runner-up against paged the same way and holds it
where it is measured faster (confirmed by a second pair of windows, as any verdict against the
model); a host-bound model's step is where the cost model's host and launch terms miss most.
On with ``probe_paged`` (``--granikv-clock-probe paged_too``, the default since a grid A/B on
the host-bound 4-layer model measured it 2-8% faster on all three sharing rows; ``model_paths``
turns it off).
Reasons: ``measured_slower`` (paged instead of the model's path), ``measured_faster`` (the
runner-up instead of the model's paged).
Paths can differ between tensor-parallel ranks (wall-clock input): attention is local to a rank,
both graphs run the same collectives, so outputs stay correct; only bitwise run-to-run equality
is lost where the clock decides.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Hashable, List, Optional, Tuple

from granikv.attention.dispatcher import PATH_ORDER, Decision, Path, PathTimes

MEASURED_SLOWER = "measured_slower"
MEASURED_FASTER = "measured_faster"


#: (field index, path) of every non-paged path, in ``PathTimes`` order (a held probe verdict
#: asks for the runner-up every step: tuple indexing, no ``Enum`` attribute lookups)
_NON_PAGED = tuple(enumerate(PATH_ORDER))[1:]


def _runner_up(times: PathTimes) -> Optional[Path]:
    """The cheapest non-paged path with a finite estimate (the first in ``PathTimes`` order on
    ties), or None."""
    best: Optional[Path] = None
    t = math.inf
    for i, path in _NON_PAGED:
        x = times[i]
        if x < t:
            best, t = path, x
    return best


@dataclass
class _SizeState:
    """The measurement of one batch shape: ``phase`` 'A' (the measured non-paged path), 'B' (paged),
    'hold' (decided); samples per phase; the held verdict and its remaining steps."""

    measured: Path = Path.CASCADE  # the non-paged path measured against paged (phase A)
    model_paged: bool = False  # the cost model chose paged when this measurement began
    phase: str = "A"
    samples: Dict[str, List[float]] = field(default_factory=lambda: {"A": [], "B": []})
    paged_wins: bool = False
    hold_left: int = 0
    verdicts: int = 0
    last_a: float = 0.0  # medians of the last verdict (seconds per step)
    last_b: float = 0.0
    confirming: bool = False  # the windows now measured confirm a first "paged is faster"
    held_reason: Optional[Tuple[Path, str]] = None  # (the model's path, the held verdict's reason), per verdict


class StepClock:
    """Per decode step: ``tick`` (at the step's plan, every decode step), then, for a step the
    dispatcher decided, ``adjust(decision, key)``; ``record(path, key)`` once its path is final;
    ``interrupt()`` on any other forward pass. ``key``: the batch's shape (the planner passes
    (batch size, groups)); each key is measured and decided on its own. O(1) per step; no
    device work."""

    WINDOW = 6  # steps per measured path: SETTLE transitional ones, then WINDOW - SETTLE samples
    SETTLE = 2  # a step's interval is a sample once SETTLE steps of its path ran before it
    HOLD = 256  # steps a verdict holds before that batch shape is measured again
    TRUST = 0.5  # predicted saving >= TRUST x the measured step: the cost model decides alone
    PROBE_LOSS = 0.1  # a paged choice is probed only where the runner-up is priced < this x the step slower
    MARGIN = 0.01  # paged must be this much faster (relative) to overrule the model
    RECENT = 8  # verdicts kept for the snapshot

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, probe_paged: bool = False):
        self.clock = clock
        self.probe_paged = probe_paged  # also measure the runner-up where the model chose paged
        self._last_t: Optional[float] = None
        self._last: Optional[tuple] = None  # (bs, path) of the previous decode step
        self._run = 0  # consecutive decode steps of that (bs, path), the previous one included
        self._interval: Optional[float] = None  # seconds since the previous decode step (a sample)
        self._sizes: Dict[Hashable, _SizeState] = {}
        self.overruled_steps = 0  # steps whose path the clock changed (a verdict, or to measure a path)
        self.verdicts_paged = self.verdicts_model = 0
        self.verdicts_faster = 0  # the measured non-paged path beat the model's paged choice
        self.confirmations = 0  # windows against the model measured again before a verdict
        # the latest verdicts, newest last: (shape key, path median µs, paged median µs,
        # relative spread of the path's samples, of paged's, paged won)
        self.recent: Deque[tuple] = deque(maxlen=self.RECENT)

    # ---- per step --------------------------------------------------------------------------

    def tick(self) -> None:
        """A decode step is being planned now: the interval since the previous one is a sample
        of the previous step's path when the two before it ran the same batch size and path."""
        now = self.clock()
        t, self._last_t = self._last_t, now
        self._interval = None if t is None else now - t

    def interrupt(self) -> None:
        """A forward pass that is not a decode step (prefill, extend): the next interval spans
        it and is not a sample."""
        self._last_t = None
        self._last, self._run = None, 0
        self._interval = None

    def adjust(self, decision: Decision, bs: Hashable, *, step_s: Optional[float] = None) -> Decision:
        """``decision`` itself, or the other path of a close call where the clock measures (or has
        measured) it faster for this batch shape: paged instead of the model's non-paged path,
        or (``probe_paged``) the cheapest non-paged path instead of the model's paged choice.
        ``step_s``: the current step's measured time if known (defaults to the last sample's
        interval)."""
        times = decision.times
        step = step_s if step_s is not None else self._interval
        if step is None or step <= 0:
            return decision
        model_paged = decision.path is Path.PAGED
        if model_paged:
            if not self.probe_paged:
                return decision
            measured = _runner_up(times)
            if measured is None or (times.of(measured) - times.paged) * 1e-6 >= self.PROBE_LOSS * step:
                return decision  # no other path, or a margin a probe would pay for too dearly
        else:
            measured = decision.path
            if (times.paged - times.of(measured)) * 1e-6 >= self.TRUST * step:
                return decision
        st = self._sizes.get(bs)
        if st is None or st.measured is not measured:  # a new pair of paths: measured afresh
            st = self._sizes[bs] = _SizeState(measured=measured, model_paged=model_paged)
        self._sample(st, bs, measured)
        if st.phase == "hold":
            st.hold_left -= 1
            if st.hold_left <= 0:
                st.phase, st.samples = "A", {"A": [], "B": []}
                st.model_paged = model_paged
                want = measured
            else:
                want = Path.PAGED if st.paged_wins else measured
        else:
            want = measured if st.phase == "A" else Path.PAGED
        return decision if want is decision.path else self._overrule(decision, want, st)

    def keeps(self, bs: Hashable, path: Path, saving_us: float) -> bool:
        """Whether ``adjust`` would return unchanged a decision for the non-paged ``path`` priced
        ``saving_us`` below paged, at no cost beyond what ``adjust`` changes then: the model is
        trusted at this step's interval (nothing changes), or a verdict held for ``path`` has
        steps left (one is counted, as ``adjust`` counts it). False: nothing changed, the caller
        runs ``adjust``."""
        step = self._interval
        if step is None or step <= 0 or saving_us * 1e-6 >= self.TRUST * step:
            return True
        st = self._sizes.get(bs)
        if st is None or st.measured is not path or st.phase != "hold" or st.paged_wins or st.hold_left <= 1:
            return False
        st.hold_left -= 1
        return True

    def record(self, path: Path, bs: Hashable) -> None:
        """The path the step just planned finally runs (after every other check)."""
        key = (bs, path)
        self._run = self._run + 1 if key == self._last else 1
        self._last = key

    # ---- measurement -----------------------------------------------------------------------

    def _sample(self, st: _SizeState, bs: Hashable, path: Path) -> None:
        """Takes the interval of the previous step into its window (phase A: the measured
        non-paged ``path``, B: paged) and moves the phase on when a window is full."""
        iv, last = self._interval, self._last
        if st.phase == "hold" or iv is None or last is None or last[0] != bs or self._run <= self.SETTLE:
            return
        want = path if st.phase == "A" else Path.PAGED
        if last[1] is not want:
            return
        st.samples[st.phase].append(iv)
        if len(st.samples[st.phase]) < self.WINDOW - self.SETTLE:
            return
        if st.phase == "A":
            st.phase = "B"
            return
        a, b = statistics.median(st.samples["A"]), statistics.median(st.samples["B"])
        if st.model_paged:  # the other path must beat the model's paged by the margin
            paged_wins = not a < b * (1.0 - self.MARGIN)
        else:
            paged_wins = b < a * (1.0 - self.MARGIN)
        against = paged_wins is not st.model_paged  # the verdict overrules the cost model
        if against and not st.confirming:  # measure both paths once more before holding it
            st.confirming, st.phase, st.samples = True, "A", {"A": [], "B": []}
            self.confirmations += 1
            return
        st.confirming = False
        st.paged_wins = paged_wins
        st.phase, st.hold_left, st.verdicts = "hold", self.HOLD, st.verdicts + 1
        st.last_a, st.last_b, st.held_reason = a, b, None
        self.recent.append((bs, round(1e6 * a, 1), round(1e6 * b, 1), _spread(st.samples["A"]),
                            _spread(st.samples["B"]), st.paged_wins))
        if not against:
            self.verdicts_model += 1
        elif paged_wins:
            self.verdicts_paged += 1
        else:
            self.verdicts_faster += 1

    def _overrule(self, decision: Decision, want: Path, st: _SizeState) -> Decision:
        """The step runs ``want`` where the model chose ``decision.path``: measuring it, or a
        held verdict (paged: ``measured_slower``; the runner-up: ``measured_faster``)."""
        self.overruled_steps += 1
        paged = want is Path.PAGED
        tag = MEASURED_SLOWER if paged else MEASURED_FASTER
        if st.phase == ("B" if paged else "A"):
            why = f"{tag}: measuring {want.value} ({decision.reason})"
        else:  # a held verdict: its reason is made once (every held step of a probe verdict comes here)
            held = st.held_reason
            if held is not None and held[0] is decision.path:
                why = held[1]
            else:
                won, lost = (st.last_b, st.last_a) if paged else (st.last_a, st.last_b)
                why = (f"{tag}: {want.value} {1e6 * won:.0f}us < {decision.path.value} {1e6 * lost:.0f}us "
                       "per step, measured")
                st.held_reason = (decision.path, why)
        return Decision(want, decision.times, why)

    def check_integrity(self) -> None:
        """Every measured batch shape is in a known phase with at most a window of samples per
        path, a held verdict has steps left within ``HOLD``, and the counters add up."""
        need = self.WINDOW - self.SETTLE
        for key, st in self._sizes.items():
            if st.phase not in ("A", "B", "hold"):
                raise AssertionError(f"step clock {key}: unknown phase {st.phase!r}")
            for ph, xs in st.samples.items():
                if len(xs) > need or any(x <= 0 for x in xs):
                    raise AssertionError(f"step clock {key}: {len(xs)} samples of phase {ph} (at most {need}, "
                                         "each > 0)")
            if st.confirming and st.phase == "hold":
                raise AssertionError(f"step clock {key}: holds a verdict while confirming one")
            if st.phase == "hold" and not 0 < st.hold_left <= self.HOLD:
                raise AssertionError(f"step clock {key}: held with {st.hold_left} steps left (1..{self.HOLD})")
            if st.measured is Path.PAGED:
                raise AssertionError(f"step clock {key}: measures paged against itself")
        verdicts = sum(st.verdicts for st in self._sizes.values())
        if verdicts != self.verdicts_paged + self.verdicts_model + self.verdicts_faster:
            raise AssertionError(f"step clock: {verdicts} verdicts per shape != {self.verdicts_paged} paged + "
                                 f"{self.verdicts_faster} faster + {self.verdicts_model} kept")

    def snapshot(self) -> dict:
        """Counters for server info: overruled steps and verdicts (paged faster / model kept), and
        the latest verdicts: [shape, path µs, paged µs (medians), the two windows' spreads,
        paged won]."""
        return {"clock_overruled_steps": self.overruled_steps, "clock_verdicts_paged": self.verdicts_paged,
                "clock_verdicts_faster": self.verdicts_faster,
                "clock_verdicts_model": self.verdicts_model, "clock_confirmations": self.confirmations,
                "clock_recent_verdicts": [[str(k), a, b, sa, sb, won] for k, a, b, sa, sb, won in self.recent]}


def _spread(xs: List[float]) -> float:
    """(max - min) / median of a window's samples (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    return round((max(xs) - min(xs)) / statistics.median(xs), 3)
