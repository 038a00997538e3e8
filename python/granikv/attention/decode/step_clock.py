"""``StepClock``: the end-to-end time of served decode steps, measured per path, overruling the
cost model where a shared-prefix path is measured slower than paged.

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

The clock only ever turns a non-paged choice into paged; its reason is ``measured_slower``.
Paths can differ between tensor-parallel ranks (wall-clock input): attention is local to a rank,
both graphs run the same collectives, so outputs stay correct; only bitwise run-to-run equality
is lost where the clock decides.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Hashable, List, Optional

from granikv.attention.dispatcher import Decision, Path

MEASURED_SLOWER = "measured_slower"


@dataclass
class _SizeState:
    """The measurement of one batch size: ``phase`` 'A' (the model's path), 'B' (paged),
    'hold' (decided); samples per phase; the held verdict and its remaining steps."""

    phase: str = "A"
    samples: Dict[str, List[float]] = field(default_factory=lambda: {"A": [], "B": []})
    paged_wins: bool = False
    hold_left: int = 0
    verdicts: int = 0
    last_a: float = 0.0  # medians of the last verdict (seconds per step)
    last_b: float = 0.0
    confirming: bool = False  # the windows now measured confirm a first "paged is faster"


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
    MARGIN = 0.01  # paged must be this much faster (relative) to overrule the model
    RECENT = 8  # verdicts kept for the snapshot

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._last_t: Optional[float] = None
        self._last: Optional[tuple] = None  # (bs, path) of the previous decode step
        self._run = 0  # consecutive decode steps of that (bs, path), the previous one included
        self._interval: Optional[float] = None  # seconds since the previous decode step (a sample)
        self._sizes: Dict[Hashable, _SizeState] = {}
        self.overruled_steps = 0  # steps turned paged by a measurement (or to measure paged)
        self.verdicts_paged = self.verdicts_model = 0
        self.confirmations = 0  # "paged is faster" windows measured again before a verdict
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
        """``decision`` itself, or paged where the clock measures (or has measured) paged
        faster for this batch size. ``step_s``: the current step's measured time if known
        (defaults to the last sample's interval)."""
        if decision.path is Path.PAGED:
            return decision
        times = decision.times
        saving_s = (times.paged - times.of(decision.path)) * 1e-6
        step = step_s if step_s is not None else self._interval
        if step is None or step <= 0 or saving_s >= self.TRUST * step:
            return decision
        st = self._sizes.get(bs)
        if st is None:
            st = self._sizes[bs] = _SizeState()
        self._sample(st, bs, decision.path)
        if st.phase == "hold":
            st.hold_left -= 1
            if st.hold_left <= 0:
                st.phase, st.samples = "A", {"A": [], "B": []}
            elif st.paged_wins:
                return self._paged(decision, st)
            return decision
        if st.phase == "B":
            return self._paged(decision, st)
        return decision

    def record(self, path: Path, bs: Hashable) -> None:
        """The path the step just planned finally runs (after every other check)."""
        key = (bs, path)
        self._run = self._run + 1 if key == self._last else 1
        self._last = key

    # ---- measurement -----------------------------------------------------------------------

    def _sample(self, st: _SizeState, bs: Hashable, path: Path) -> None:
        """Takes the interval of the previous step into its window (phase A: the model's
        path, B: paged) and moves the phase on when a window is full."""
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
        paged_wins = b < a * (1.0 - self.MARGIN)
        if paged_wins and not st.confirming:  # measure both paths once more before holding paged
            st.confirming, st.phase, st.samples = True, "A", {"A": [], "B": []}
            self.confirmations += 1
            return
        st.confirming = False
        st.paged_wins = paged_wins
        st.phase, st.hold_left, st.verdicts = "hold", self.HOLD, st.verdicts + 1
        st.last_a, st.last_b = a, b
        self.recent.append((bs, round(1e6 * a, 1), round(1e6 * b, 1), _spread(st.samples["A"]),
                            _spread(st.samples["B"]), st.paged_wins))
        if st.paged_wins:
            self.verdicts_paged += 1
        else:
            self.verdicts_model += 1

    def _paged(self, decision: Decision, st: _SizeState) -> Decision:
        self.overruled_steps += 1
        if st.phase == "B":
            why = f"{MEASURED_SLOWER}: measuring paged ({decision.reason})"
        else:
            why = (f"{MEASURED_SLOWER}: paged {1e6 * st.last_b:.0f}us < "
                   f"{decision.path.value} {1e6 * st.last_a:.0f}us per step, measured")
        return Decision(Path.PAGED, decision.times, why)

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
        verdicts = sum(st.verdicts for st in self._sizes.values())
        if verdicts != self.verdicts_paged + self.verdicts_model:
            raise AssertionError(f"step clock: {verdicts} verdicts per shape != {self.verdicts_paged} paged + "
                                 f"{self.verdicts_model} kept")

    def snapshot(self) -> dict:
        """Counters for server info: overruled steps and verdicts (paged faster / model kept), and
        the latest verdicts: [shape, path µs, paged µs (medians), the two windows' spreads,
        paged won]."""
        return {"clock_overruled_steps": self.overruled_steps, "clock_verdicts_paged": self.verdicts_paged,
                "clock_verdicts_model": self.verdicts_model, "clock_confirmations": self.confirmations,
                "clock_recent_verdicts": [[str(k), a, b, sa, sb, won] for k, a, b, sa, sb, won in self.recent]}


def _spread(xs: List[float]) -> float:
    """(max - min) / median of a window's samples (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    return round((max(xs) - min(xs)) / statistics.median(xs), 3)
