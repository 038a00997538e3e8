"""Per-step choice of the decode attention path, from the cost model only.

The dispatcher turns a ``Grouping`` into a ``Workload`` (O(G) sums), asks the ``CostModel`` for
each eligible path's served step time (``CostModel.step_time``: kernels, the wrapped backend's
``seq_len = 1`` call, eager launch overheads) and takes the cheapest, ``PAGED`` on ties. There are no thresholds of
its own: when a path wins, it is because the measured coefficients say so.

Eligibility:

- ``PAGED``: always (the stock backend is correct on any batch).
- ``CASCADE``, ``FUSED``: the batch has at least one group.
- any path the calibration never measured fastest (``CostModel.disabled_paths``) is out.
- ``FUSED``, ``BGEMM``: also need an eager step (``graph_safe_only=False``). The backend's
  decode CUDA graphs capture the cascade kernels only (bgemm's launches depend on the grouping
  and cannot be captured; fused could be, but capturing both would cost every replay the
  empty launches of the one not chosen).

A forced path (``forced_path != "auto"``) is returned whenever it is eligible, else ``PAGED``.
Grouping is by physical slot, so a correct ``HotPrefixTable`` makes "grouped requests read the
same slots" hold by construction; ``plan.verify_same_slots`` checks it (tests, and the
backend under ``--granikv-debug-integrity``).
"""

import enum
import math
from typing import NamedTuple, Optional, get_args

import numpy as np

from granikv.config import AttentionPath
from granikv.layers.attention.cascade.cost_model import CostModel, HeadGeometry, Workload
from granikv.layers.attention.cascade.plan import BatchDescription, Grouping

FORCED_PATHS = get_args(AttentionPath)


class Path(enum.Enum):
    PAGED = "paged"
    CASCADE = "cascade"
    FUSED = "fused"
    BGEMM = "bgemm"


class PathTimes(NamedTuple):
    """Estimated microseconds per decode step of each path; ``inf`` = not eligible."""

    paged: float
    cascade: float
    fused: float
    bgemm: float

    def of(self, path: Path) -> float:
        return getattr(self, path.value)


class Decision(NamedTuple):
    path: Path
    times: PathTimes
    reason: str


_INF = math.inf
_ORDER = (Path.PAGED, Path.CASCADE, Path.FUSED, Path.BGEMM)  # field order of PathTimes


class Dispatcher:
    """Chooses a path per decode step. Stateless after construction; ``choose`` is O(G).

    ``num_layers`` spreads the per-step planning cost (``CostModel.plan_us``) over the layers
    that share one plan; leaving it at 1 charges the whole plan to one layer (conservative).
    """

    def __init__(
        self,
        cost_model: CostModel,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype_bytes: int,
        forced_path: str = "auto",
        num_layers: int = 1,
    ):
        if forced_path not in FORCED_PATHS:
            raise ValueError(
                f"forced_path={forced_path!r} is not one of {', '.join(FORCED_PATHS)}"
            )
        for name, v in (
            ("num_q_heads", num_q_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("kv_dtype_bytes", kv_dtype_bytes),
            ("num_layers", num_layers),
        ):
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}"
            )
        self.cost_model = cost_model
        self.geometry = HeadGeometry(num_q_heads, num_kv_heads, head_dim, kv_dtype_bytes)
        self.forced = None if forced_path == "auto" else Path(forced_path)
        self.num_layers = num_layers

    def workload(self, grouping: Grouping, desc: BatchDescription) -> Workload:
        """Bytes and FLOPs of one layer of this batch (O(G) plus one sum over seq_lens)."""
        return Workload.from_sums(
            self.geometry,
            batch_size=grouping.batch_size,
            seq_tokens=int(np.add.reduce(desc.seq_lens)),
            prefix_tokens=grouping.prefix_tokens,
            stacked_prefix_tokens=grouping.stacked_prefix_tokens,
            num_grouped=grouping.num_grouped,
            num_groups=grouping.num_groups,
        )

    def estimate(
        self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True
    ) -> PathTimes:
        """Estimated time of every eligible path (``inf`` for the others)."""
        w = self.workload(grouping, desc)
        cm, n = self.cost_model, self.num_layers
        paged = cm.paged_time(w, num_layers=n)
        if grouping.num_groups == 0:
            return PathTimes(paged, _INF, _INF, _INF)
        off = cm.disabled_paths
        eager = not graph_safe_only
        return PathTimes(
            paged=paged,
            cascade=_INF if "cascade" in off else cm.step_time("cascade", w, num_layers=n, eager=eager),
            fused=_INF if graph_safe_only or "fused" in off else cm.step_time("fused", w, num_layers=n, eager=True),
            bgemm=_INF if graph_safe_only or "bgemm" in off else cm.step_time("bgemm", w, num_layers=n, eager=True),
        )

    def choose(
        self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True
    ) -> Decision:
        """The path for this step. ``graph_safe_only=True`` (a CUDA-graph step): paged or cascade."""
        times = self.estimate(grouping, desc, graph_safe_only=graph_safe_only)
        if grouping.num_groups == 0:
            return Decision(Path.PAGED, times, "no group")
        if self.forced is not None:
            if math.isinf(times.of(self.forced)):
                return Decision(
                    Path.PAGED, times, f"forced {self.forced.value} not eligible (eager-only or disabled by calibration): paged"
                )
            return Decision(self.forced, times, f"forced {self.forced.value}")
        k = min(range(4), key=times.__getitem__)  # PathTimes order = _ORDER: PAGED wins ties
        if k == 0:
            j = min(range(1, 4), key=times.__getitem__)
            reason = f"paged {times[0]:.1f}us <= {_ORDER[j].value} {times[j]:.1f}us"
        else:
            reason = (
                f"{_ORDER[k].value} {times[k]:.1f}us < paged {times[0]:.1f}us "
                f"({times[0] / times[k]:.2f}x)"
            )
        return Decision(_ORDER[k], times, reason)


class SteadyChooser:
    """``Dispatcher.choose`` for successive decode steps of one grouping, in O(1) per step.

    With the grouping fixed (same ``Grouping`` object: ``GroupingMemo`` returns the previous
    one while the batch's HOT runs are unchanged), every path's estimate is an affine function
    of ``seq_tokens = sum(seq_lens)`` alone (``Workload``: ``seq_bytes`` and ``suffix_bytes``
    grow with it, nothing else does). So the times of two sequence totals, computed once per
    grouping, give every later step's times exactly (up to float rounding) with two multiply-
    adds per path. The decision's reason is rebuilt only when the chosen path changes.

    ``seq_total``: the caller's ``sum(desc.seq_lens)`` when it has it for free (SGLang's
    ``seq_lens_sum``): a steady step then does no array work at all. It is checked against the
    arrays at every refit; once it disagrees it is ignored from then on (``hint_mismatches``).
    """

    _PROBE = 1 << 20  # second sequence total of the affine fit (any distinct value is exact)

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self._key = None  # (grouping, graph_safe_only): the grouping is held, so `is` is safe
        self._base = self._slope = None
        self._seq0 = 0
        self._decision = None  # last decision (its reason is reused while the path stays)
        self.hits = self.misses = 0
        self.hint_ok = True  # seq_total hints agree with the arrays (checked at every refit)
        self.hint_mismatches = 0

    def choose(self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True,
               seq_total: Optional[int] = None) -> Decision:
        key = self._key
        if key is None or key[0] is not grouping or key[1] != graph_safe_only or grouping.num_groups == 0:
            return self._refit(grouping, desc, graph_safe_only, seq_total)
        self.hits += 1
        if self.dispatcher.forced is not None:  # depends on the grouping only (eligibility)
            return self._decision
        if seq_total is None or not self.hint_ok:
            seq_total = np.add.reduce(desc.seq_lens)
        dt = float(seq_total) - self._seq0
        (b0, b1, b2, b3), (s0, s1, s2, s3) = self._base, self._slope
        times = PathTimes(b0 + s0 * dt, b1 + s1 * dt, b2 + s2 * dt, b3 + s3 * dt)
        k, t = 0, times[0]  # the first minimum, as min(range(4), key=...): PAGED wins ties
        if times[1] < t:
            k, t = 1, times[1]
        if times[2] < t:
            k, t = 2, times[2]
        if times[3] < t:
            k = 3
        prev = self._decision
        if _ORDER[k] is prev.path:
            return Decision(prev.path, times, prev.reason)
        return self._decide(times)

    def _refit(self, grouping, desc, graph_safe_only, seq_total=None) -> Decision:
        self.misses += 1
        if seq_total is not None and self.hint_ok and seq_total != int(np.add.reduce(desc.seq_lens)):
            self.hint_ok = False  # the caller's totals are not the arrays' sums: use the arrays
            self.hint_mismatches += 1
        d = self.dispatcher.choose(grouping, desc, graph_safe_only=graph_safe_only)
        self._key, self._decision = (grouping, graph_safe_only), d
        if grouping.num_groups == 0:
            self._key = None
            return d
        if self.dispatcher.forced is not None:
            return d
        probe = BatchDescription(desc.req_pool_indices, desc.seq_lens + self._PROBE // max(1, desc.batch_size),
                                 desc.hot_start, desc.hot_len)
        far = self.dispatcher.estimate(grouping, probe, graph_safe_only=graph_safe_only)
        self._seq0 = float(np.add.reduce(desc.seq_lens))
        span = float(np.add.reduce(probe.seq_lens)) - self._seq0
        self._base = tuple(d.times)
        self._slope = tuple(0.0 if math.isinf(a) else (b - a) / span for a, b in zip(d.times, far))
        return d

    def _decide(self, times: PathTimes) -> Decision:
        k = min(range(4), key=times.__getitem__)
        if k == 0:
            j = min(range(1, 4), key=times.__getitem__)
            reason = f"paged {times[0]:.1f}us <= {_ORDER[j].value} {times[j]:.1f}us"
        else:
            reason = (f"{_ORDER[k].value} {times[k]:.1f}us < paged {times[0]:.1f}us "
                      f"({times[0] / times[k]:.2f}x)")
        self._decision = Decision(_ORDER[k], times, reason)
        return self._decision
