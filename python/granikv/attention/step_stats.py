"""Per-step counters of the attention dispatcher (what ran, and why), and the host time of
decode planning: totals per section, thread CPU time beside wall time, a cumulative histogram."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    from granikv.attention.dispatcher import Decision
    from granikv.attention.extend.plan import ExtendPlan
    from granikv.attention.grouping import Grouping

PLAN_WINDOW = 4096  # decode steps the planning-time percentiles cover (the most recent ones)

# Sections of a decode step's planning, in order (``StepStats.record_plan_time``):
#   stage   the scheduler hook's staging of the batch rows
#   lookup  HOT runs of the staged rows, grouping (or its reuse), seq_lens view, description
#   choose  the path choice (SteadyChooser)
#   fill    the workspace's advance / full fill, less its upload
#   upload  waiting for a staging buffer + the device copy of the metadata (+ its event)
#   slot_copy  the pre-replay copy of the step's suffix slots (a graph replay, slot_copy.py)
#   view    the wrapped backend's ``seq_len = 1`` view of the batch
PLAN_SECTIONS = ("stage", "lookup", "choose", "fill", "upload", "slot_copy", "view")

NO_HOT_PREFIX = "no HOT prefix in the batch"  # the reason of a decode step none of whose requests holds a HOT run

# Snapshot keys that are maxima over the backend's life (merged across backends by max, never
# summed or differenced): the debug compare's per-layer output deviations (debug/compare.py).
MAXIMA = ("layer_output_max_rel_dev", "layer_output_stock_max_rel_dev", "layer_output_tolerance")


class RecentTimes:
    """The last ``capacity`` samples (seconds) in a ring buffer; percentiles in microseconds.

    ``add`` is one store into a preallocated float64 array (no allocation on the step's path);
    ``percentiles_us`` partitions a copy around the ranks it needs, at snapshot time only (the
    scheduler's periodic log and /metrics refresh): a list buffer cost a conversion of the whole
    window there, ~3x the partition on 4,096 samples (docs/results/kernels.md, "Planning cost")."""

    def __init__(self, capacity: int = PLAN_WINDOW):
        self._buf = np.zeros(capacity, np.float64)
        self._cap = capacity
        self._n = 0

    def add(self, seconds: float) -> None:
        n = self._n
        self._buf[n % self._cap] = seconds
        self._n = n + 1

    def __len__(self) -> int:
        return min(self._n, self._cap)

    def percentiles_us(self, *qs: float) -> Tuple[float, ...]:
        """``np.percentile(window, qs)`` (its default "linear" method, the same floats) in µs."""
        n = len(self)
        if n == 0:
            return tuple(0.0 for _ in qs)
        pos = [q / 100.0 * (n - 1) for q in qs]
        lo = [min(int(p), n - 1) for p in pos]
        hi = [min(i + 1, n - 1) for i in lo]
        part = np.partition(self._buf[:n], sorted(set(lo + hi)))
        return tuple(_lerp(float(part[i]), float(part[j]), p - i) * 1e6 for p, i, j in zip(pos, lo, hi, strict=True))


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's linear interpolation between two order statistics (``numpy.lib._function_base_impl
    ._lerp``: from the upper one where ``t >= 0.5``), so percentiles match ``np.percentile``'s."""
    d = b - a
    return b - d * (1.0 - t) if t >= 0.5 else a + d * t


class PlanTimeHistogram:
    """Counts of per-step planning times in fixed log buckets (4 per octave, 1 us .. 16 ms,
    then one overflow bucket), cumulative over the backend's life.

    ``add`` is one ``bisect`` and one list increment. ``snapshot`` maps each non-empty bucket's
    upper edge in microseconds (``"%.4g"``; the overflow bucket ``"inf"``) to its count, so that
    the difference of two snapshots (key by key) is the histogram of the steps between them and
    ``quantile_us`` gives their percentiles (within one bucket's width, ~19%)."""

    EDGES_US = tuple(2.0 ** (k / 4) for k in range(57))  # 1 us .. 16384 us

    def __init__(self) -> None:
        self._edges = [e * 1e-6 for e in self.EDGES_US]
        self._keys = [f"{e:.4g}" for e in self.EDGES_US] + ["inf"]
        self.counts = [0] * (len(self._edges) + 1)

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self._edges, seconds)] += 1

    def snapshot(self) -> Dict[str, int]:
        return {k: n for k, n in zip(self._keys, self.counts, strict=True) if n}

    @staticmethod
    def quantile_us(buckets: Mapping[str, float], q: float) -> Optional[float]:
        """The ``q``-quantile (0..100) of the steps counted in ``buckets`` (upper edge in us ->
        count, e.g. a difference of two ``snapshot``s; a bucket's lower edge is the one before it
        in ``EDGES_US``, 0 for the first), interpolated linearly inside its bucket; the overflow bucket gives its lower
        edge. None when no step is counted."""
        counted = sorted((float(k), float(n)) for k, n in buckets.items() if n and n > 0)
        total = sum(n for _, n in counted)
        if not total:
            return None
        want, seen = total * q / 100.0, 0.0
        edges = PlanTimeHistogram.EDGES_US
        for hi, n in counted:
            i = bisect.bisect_left(edges, hi * (1 - 1e-3))  # hi's index (keys keep 4 digits)
            lo = edges[i - 1] if i > 0 else 0.0
            if seen + n >= want or hi == counted[-1][0]:
                return lo if math.isinf(hi) else lo + (hi - lo) * min(1.0, max(0.0, want - seen) / n)
            seen += n
        return None  # not reached


def grouping_counts(grouping: Grouping) -> Tuple[int, int, int]:
    """What ``StepStats.record`` counts of a step's grouping: (requests, grouped requests, groups)."""
    return grouping.batch_size, grouping.num_grouped, grouping.num_groups


@dataclass
class StepStats:
    """Counts decode steps per chosen path, grouped requests and steps the planner skipped.
    ``steps``, ``paths``, ``requests`` and ``decode_paged_reasons`` hold the steps that went
    through the planner; ``snapshot`` adds the ``no_hot_*`` ones to them."""

    paths: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    grouped_requests: int = 0
    requests: int = 0
    groups: int = 0
    unplanned: int = 0  # decode steps with no staged batch (fell back to paged)
    # decode steps taken while no request held a HOT run (record_no_hot), their requests and host
    # time: counted apart and folded into the snapshot's totals (such a step touches little)
    no_hot_steps: int = 0
    no_hot_requests: int = 0
    no_hot_seconds: float = 0.0
    host_overhead_steps: int = 0  # paged steps whose kernels alone would have lost to a GraniKV path
    #   (Decision.host_bound: the host planning term and launch floors decided, reason host_overhead)
    last_reason: str = ""
    max_compare_diff: float = 0.0  # debug compare mode: worst |chosen - paged| seen
    plan_seconds: float = 0.0  # host time of decode-step planning (group, choose, workspace fill)
    plan_max_seconds: float = 0.0
    choose_seconds: float = 0.0  # part of plan_seconds: description, grouping, path choice
    fill_seconds: float = 0.0  # part of plan_seconds: workspace fill + upload + view
    stage_seconds: float = 0.0  # part of plan_seconds: the scheduler hook's staging of the batch rows
    plan_cpu_seconds: float = 0.0  # thread CPU time of the backend's part (all but stage)
    section_seconds: List[float] = field(default_factory=lambda: [0.0] * len(PLAN_SECTIONS))  # PLAN_SECTIONS order
    recent_plan: RecentTimes = field(default_factory=RecentTimes)  # per-step plan time, last PLAN_WINDOW
    plan_hist: PlanTimeHistogram = field(default_factory=PlanTimeHistogram)  # per-step plan time, all steps
    extend_batches: int = 0  # extend batches planned (prefill with a cached prefix considered)
    extend_hot_batches: int = 0  # ... whose prefix part ran as dense calls over HOT extents
    extend_exact_batches: int = 0  # ... computed by GraniKV without a HOT run (an FP8 cache: paths.py)
    extend_hot_tokens: int = 0  # new tokens served that way
    extend_fallbacks: Counter[str] = field(default_factory=Counter)  # reason -> extend batches left stock
    decode_paged_reasons: Counter[str] = field(default_factory=Counter)  # reason -> decode steps sent paged unplanned
    max_extend_compare_diff: float = 0.0  # debug compare mode: worst |dense - paged| prefix output
    # debug compare mode, every layer of a compared decode step (DebugCompare.compare_decode):
    layer_output_compares: int = 0  # layer-steps compared
    layer_output_over_tolerance: int = 0  # ... whose deviation exceeded their own tolerance
    layer_output_f64_references: int = 0  # ... compared with the float64 reference (no stock output)
    layer_output_max_rel_dev: float = 0.0  # worst GraniKV output vs its reference (debug_compare.rel_dev)
    layer_output_stock_max_rel_dev: float = 0.0  # worst stock output vs float64, same layer-steps
    layer_output_tolerance: float = 0.0  # largest per-layer-step tolerance (debug_compare.layer_tolerance)

    def record(self, decision: Decision, grouping: Grouping) -> None:
        self.record_counts(decision, grouping_counts(grouping))

    def record_counts(self, decision: Decision, counts: Tuple[int, int, int]) -> None:
        """``record`` of a grouping's ``grouping_counts`` (a steady replay keeps them)."""
        self.steps += 1
        self.paths[decision.path._value_] += 1  # the enum's value without its descriptor
        requests, grouped, groups = counts
        self.requests += requests
        if decision.path._value_ != "paged":
            self.grouped_requests += grouped
            self.groups += groups
        elif decision.host_bound:
            self.host_overhead_steps += 1
        self.last_reason = decision.reason

    def record_paged(self, batch_size: int, reason: str) -> None:
        """A decode step sent to paged without a grouping (e.g. no cascade graph of its size)."""
        self.steps += 1
        self.paths["paged"] += 1
        self.requests += batch_size
        self.last_reason = reason
        self.decode_paged_reasons[reason] += 1  # one of a few fixed strings (planner, graph_variants)

    def record_no_hot(self, batch_size: int, seconds: float) -> None:
        """A decode step taken while no request held a HOT run (``DecodePlanner._no_hot_step``):
        a paged step for ``NO_HOT_PREFIX``, and its host time in the planning percentiles. Its
        counts go to the ``no_hot_*`` fields, which ``snapshot`` adds to the step, path, request,
        reason and planning totals (a step of a server with nothing HOT touches a few fields,
        not the counters every planned step updates)."""
        self.no_hot_steps += 1
        self.no_hot_requests += batch_size
        self.no_hot_seconds += seconds
        self.last_reason = NO_HOT_PREFIX
        self.recent_plan.add(seconds)
        self.plan_hist.add(seconds)

    def record_plan_time(self, seconds: float, *, choose: float = 0.0, fill: float = 0.0,
                         stage: float = 0.0, cpu: float = 0.0, sections: Optional[Sequence[float]] = None) -> None:
        """A decode step's host time, and its parts (staging the rows in the scheduler hook,
        plan + path choice, workspace fill + the wrapped backend's view); ``cpu``: the thread
        CPU time of the backend's part; ``sections``: seconds per ``PLAN_SECTIONS`` entry."""
        self.plan_seconds += seconds
        self.choose_seconds += choose
        self.fill_seconds += fill
        self.stage_seconds += stage
        self.plan_cpu_seconds += cpu
        if sections is not None:
            acc, (a0, a1, a2, a3, a4, a5, a6) = self.section_seconds, sections
            acc[0] += a0
            acc[1] += a1
            acc[2] += a2
            acc[3] += a3
            acc[4] += a4
            acc[5] += a5
            acc[6] += a6
        if seconds > self.plan_max_seconds:
            self.plan_max_seconds = seconds
        self.recent_plan.add(seconds)
        self.plan_hist.add(seconds)

    def record_extend(self, plan: Optional[ExtendPlan], reason: str) -> None:
        self.extend_batches += 1
        if plan is None:
            self.extend_fallbacks[reason] += 1
        elif not plan.groups:  # no HOT run (an FP8 cache: GraniKV computes every extend batch)
            self.extend_exact_batches += 1
        else:
            self.extend_hot_batches += 1
            self.extend_hot_tokens += plan.hot_tokens

    def record_layer_compare(self, dev: float, stock_dev: Optional[float], tolerance: float) -> None:
        """One compared layer of a decode step: GraniKV's deviation from its reference, the
        stock output's from the float64 one (None: no stock output, the reference was float64)
        and that layer-step's tolerance. Every layer-step within its own tolerance implies
        ``layer_output_max_rel_dev <= layer_output_tolerance`` (maxima over the same steps)."""
        self.layer_output_compares += 1
        self.layer_output_over_tolerance += dev > tolerance
        self.layer_output_f64_references += stock_dev is None
        self.layer_output_max_rel_dev = max(self.layer_output_max_rel_dev, dev)
        if stock_dev is not None:
            self.layer_output_stock_max_rel_dev = max(self.layer_output_stock_max_rel_dev, stock_dev)
        self.layer_output_tolerance = max(self.layer_output_tolerance, tolerance)

    @property
    def planned(self) -> int:
        """Decode steps planned (and timed): each recorded a path, went unplanned or found no
        HOT run."""
        return self.steps + self.unplanned + self.no_hot_steps

    def snapshot(self) -> Dict[str, Any]:
        no_hot = self.no_hot_steps
        steps, requests = self.steps + no_hot, self.requests + self.no_hot_requests
        paths, reasons = Counter(self.paths), Counter(self.decode_paged_reasons)
        if no_hot:
            paths["paged"] += no_hot
            reasons[NO_HOT_PREFIX] += no_hot
        plan_seconds = self.plan_seconds + self.no_hot_seconds
        return {
            "decode_steps": steps,
            "steps_per_path": dict(paths),
            "hot_hit_rate": self.grouped_requests / requests if requests else 0.0,
            "groups_per_step": self.groups / steps if steps else 0.0,
            "unplanned_steps": self.unplanned,
            "no_hot_steps": no_hot,  # paged with nothing planned: no request held a HOT run
            "host_overhead_steps": self.host_overhead_steps,  # paged for the host term (dispatcher.py)
            "last_reason": self.last_reason,
            "max_compare_diff": self.max_compare_diff,
            "plan_us_mean": 1e6 * plan_seconds / self.planned if self.planned else 0.0,
            "plan_us_max": 1e6 * self.plan_max_seconds,  # over the steps that ran the planner (no no-HOT step)
            **dict(zip(("plan_us_p50", "plan_us_p99"), self.recent_plan.percentiles_us(50, 99), strict=True)),
            "plan_window_steps": len(self.recent_plan),
            "plan_us_total": 1e6 * plan_seconds,  # totals: deltas between snapshots give exact means
            "planned_steps": self.planned,
            "plan_choose_us_total": 1e6 * self.choose_seconds,
            "plan_fill_us_total": 1e6 * self.fill_seconds,
            "plan_stage_us_total": 1e6 * self.stage_seconds,
            "plan_cpu_us_total": 1e6 * self.plan_cpu_seconds,  # thread CPU time: work, not waiting
            "plan_sections_us_total": {k: 1e6 * v for k, v in zip(PLAN_SECTIONS, self.section_seconds, strict=True)},
            "plan_us_hist": self.plan_hist.snapshot(),  # bucket upper edge (us) -> steps, cumulative
            "extend_batches": self.extend_batches,
            "extend_hot_batches": self.extend_hot_batches,
            "extend_exact_batches": self.extend_exact_batches,
            "extend_hot_tokens": self.extend_hot_tokens,
            "extend_fallbacks": dict(self.extend_fallbacks),
            "decode_paged_reasons": dict(reasons),
            "max_extend_compare_diff": self.max_extend_compare_diff,
            "layer_output_compares": self.layer_output_compares,
            "layer_output_over_tolerance": self.layer_output_over_tolerance,
            "layer_output_f64_references": self.layer_output_f64_references,
            "layer_output_max_rel_dev": self.layer_output_max_rel_dev,
            "layer_output_stock_max_rel_dev": self.layer_output_stock_max_rel_dev,
            "layer_output_tolerance": self.layer_output_tolerance,
        }
