"""Per-step counters of the attention dispatcher (what ran, and why)."""

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PLAN_WINDOW = 4096  # decode steps the planning-time percentiles cover (the most recent ones)


class RecentTimes:
    """The last ``capacity`` samples (seconds) in a ring buffer; percentiles in microseconds.

    ``add`` is one store into a preallocated list (no allocation, no numpy call on the step's
    path); ``percentiles`` sorts a copy, at snapshot time only."""

    def __init__(self, capacity: int = PLAN_WINDOW):
        self._buf = [0.0] * capacity
        self._cap = capacity
        self._n = 0

    def add(self, seconds: float) -> None:
        n = self._n
        self._buf[n % self._cap] = seconds
        self._n = n + 1

    def __len__(self) -> int:
        return min(self._n, self._cap)

    def percentiles_us(self, *qs: float):
        n = len(self)
        if n == 0:
            return tuple(0.0 for _ in qs)
        return tuple(float(v) * 1e6 for v in np.percentile(np.asarray(self._buf[:n]), qs))


@dataclass
class StepStats:
    """Counts decode steps per chosen path, grouped requests and steps the planner skipped."""

    paths: Counter = field(default_factory=Counter)
    steps: int = 0
    grouped_requests: int = 0
    requests: int = 0
    groups: int = 0
    unplanned: int = 0  # decode steps with no staged batch (fell back to paged)
    last_reason: str = ""
    max_compare_diff: float = 0.0  # debug compare mode: worst |chosen - paged| seen
    plan_seconds: float = 0.0  # host time of decode-step planning (group, choose, workspace fill)
    plan_max_seconds: float = 0.0
    choose_seconds: float = 0.0  # part of plan_seconds: description, grouping, path choice
    fill_seconds: float = 0.0  # part of plan_seconds: workspace fill + upload
    stage_seconds: float = 0.0  # part of plan_seconds: the scheduler hook's staging of the batch rows
    recent_plan: RecentTimes = field(default_factory=RecentTimes)  # per-step plan time, last PLAN_WINDOW
    extend_batches: int = 0  # extend batches planned (prefill with a cached prefix considered)
    extend_hot_batches: int = 0  # ... whose prefix part ran as dense calls over HOT extents
    extend_hot_tokens: int = 0  # new tokens served that way
    extend_fallbacks: Counter = field(default_factory=Counter)  # reason -> extend batches left stock
    max_extend_compare_diff: float = 0.0  # debug compare mode: worst |dense - paged| prefix output

    def record(self, decision, grouping) -> None:
        self.steps += 1
        self.paths[decision.path._value_] += 1  # the enum's value without its descriptor
        self.requests += grouping.batch_size
        if decision.path._value_ != "paged":
            self.grouped_requests += grouping.num_grouped
            self.groups += grouping.num_groups
        self.last_reason = decision.reason

    def record_paged(self, batch_size: int, reason: str) -> None:
        """A decode step sent to paged without a grouping (e.g. no cascade graph of its size)."""
        self.steps += 1
        self.paths["paged"] += 1
        self.requests += batch_size
        self.last_reason = reason

    def record_plan_time(self, seconds: float, *, choose: float = 0.0, fill: float = 0.0,
                         stage: float = 0.0) -> None:
        """A decode step's host time, and its parts (staging the rows in the scheduler hook,
        plan + path choice, workspace fill + the wrapped backend's view)."""
        self.plan_seconds += seconds
        self.choose_seconds += choose
        self.fill_seconds += fill
        self.stage_seconds += stage
        if seconds > self.plan_max_seconds:
            self.plan_max_seconds = seconds
        self.recent_plan.add(seconds)

    def record_extend(self, plan, reason: str) -> None:
        self.extend_batches += 1
        if plan is None:
            self.extend_fallbacks[reason] += 1
        else:
            self.extend_hot_batches += 1
            self.extend_hot_tokens += plan.hot_tokens

    @property
    def planned(self) -> int:
        """Decode steps planned (and timed): each either recorded a path or went unplanned."""
        return self.steps + self.unplanned

    def snapshot(self) -> dict:
        return {
            "decode_steps": self.steps,
            "steps_per_path": dict(self.paths),
            "hot_hit_rate": self.grouped_requests / self.requests if self.requests else 0.0,
            "groups_per_step": self.groups / self.steps if self.steps else 0.0,
            "unplanned_steps": self.unplanned,
            "last_reason": self.last_reason,
            "max_compare_diff": self.max_compare_diff,
            "plan_us_mean": 1e6 * self.plan_seconds / self.planned if self.planned else 0.0,
            "plan_us_max": 1e6 * self.plan_max_seconds,
            **dict(zip(("plan_us_p50", "plan_us_p99"), self.recent_plan.percentiles_us(50, 99))),
            "plan_window_steps": len(self.recent_plan),
            "plan_us_total": 1e6 * self.plan_seconds,  # totals: deltas between snapshots give exact means
            "planned_steps": self.planned,
            "plan_choose_us_total": 1e6 * self.choose_seconds,
            "plan_fill_us_total": 1e6 * self.fill_seconds,
            "plan_stage_us_total": 1e6 * self.stage_seconds,
            "extend_batches": self.extend_batches,
            "extend_hot_batches": self.extend_hot_batches,
            "extend_hot_tokens": self.extend_hot_tokens,
            "extend_fallbacks": dict(self.extend_fallbacks),
            "max_extend_compare_diff": self.max_extend_compare_diff,
        }
