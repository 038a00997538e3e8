"""Per-step choice of the decode attention path, from the cost model only.

The dispatcher turns a ``Grouping`` into a ``Workload`` (O(G) sums), asks the ``CostModel`` for
each eligible path's served step time (``CostModel.step_time``: kernels, the wrapped backend's
``seq_len = 1`` call, launch floors, eager launch overheads, the host planning term) and takes
the cheapest, ``PAGED`` on ties. There are no thresholds of its own: when a path wins, it is
because the measured coefficients say so.

End-to-end rule. A non-paged path is chosen only when the whole served step is predicted faster::

    layers * (paged_layer - path_layer)  >  host_plan + layers * launches(path) * launch_floor_us

``path_layer`` holds the path's kernels and the wrapped backend's ``seq_len = 1`` call;
``host_plan`` is the planner's own measured planning time of the steps that planned a GraniKV
path (``HostPlanTime``: an EMA, the cost model's ``served.host_plan_us`` before the first such
step). The host term is counted as if on the critical path (conservative): with SGLang's
overlap scheduler it hides behind the previous step's GPU work when that is longer, but on a
short model (a few layers, host-bound steps) every microsecond of it adds to the step, and the
per-layer saving times few layers does not pay it back. A paged step chosen where the kernels
alone would have won carries ``Decision.host_bound`` and the reason ``host_overhead``
(counted in ``StepStats.host_overhead_steps``).

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

from __future__ import annotations

import enum
import logging
import math
import os
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Set, Tuple, get_args

import numpy as np
import torch

from granikv.attention.cost.cost_model import CostModel, HeadGeometry, Workload, calibrated_path
from granikv.attention.eligibility import attention_tp_size
from granikv.attention.grouping import BatchDescription, Grouping
from granikv.config import AttentionPath, GraniKVConfig

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger("granikv")

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
        return self[PATH_ORDER.index(path)]  # by identity in a 4-tuple: no Enum ``value`` lookup (per step)


class Decision(NamedTuple):
    path: Path
    times: PathTimes
    reason: str
    host_bound: bool = False  # paged, though some path's kernels alone beat it (reason: host_overhead)


_INF = math.inf
PATH_ORDER = (Path.PAGED, Path.CASCADE, Path.FUSED, Path.BGEMM)  # field order of PathTimes
assert PathTimes._fields == tuple(p.value for p in PATH_ORDER)
HOST_OVERHEAD = "host_overhead"  # the reason's tag of a paged step the per-step overheads decided


class HostPlanTime:
    """The host planning term of a step that plans a GraniKV path, in microseconds.

    ``us`` starts at the cost model's prior (``served.host_plan_us``) and follows an exponential
    moving average (weight ``ALPHA``) of the planner's measured per-step planning time of the
    steps that planned a non-paged path (``observe``, O(1)). A sample above ``SPIKE`` times the
    current value counts as that (one preempted step does not turn the term into milliseconds:
    while paged runs, nothing is measured, so an outlier would stay). Nothing is observed on
    paged steps; the term keeps its last value while they run.
    """

    ALPHA = 0.125
    SPIKE = 2.0

    def __init__(self, prior_us: float):
        if not (math.isfinite(prior_us) and prior_us >= 0):
            raise ValueError(f"host planning prior {prior_us!r} us must be a finite number >= 0")
        self.prior_us = self.us = float(prior_us)
        self.samples = 0

    def observe(self, seconds: float) -> None:
        """One step's measured planning time (seconds); non-finite or negative values are ignored."""
        us = seconds * 1e6
        if not (0.0 <= us < _INF):
            return
        cur = self.us
        cap = self.SPIKE * cur
        if us > cap and cur > 0.0:
            us = cap
        self.us = cur + self.ALPHA * (us - cur)
        self.samples += 1


class Dispatcher:
    """Chooses a path per decode step; ``choose`` is O(G). Its only state is ``host_plan``
    (``HostPlanTime``), which the planner feeds with measured planning times.

    ``num_layers``: the layers that share one plan (the per-layer terms count that many times,
    the host planning term once per step).
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
        self.host_plan = HostPlanTime(cost_model.served.host_plan_us)
        self.floors = tuple(cost_model.launch_floors_us(p.value, num_layers=num_layers) for p in PATH_ORDER)

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
        self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True,
        host_plan_us: Optional[float] = None,
    ) -> PathTimes:
        """Estimated time of every eligible path (``inf`` for the others). ``host_plan_us``: the
        host planning term of the non-paged paths (None: ``host_plan.us``, measured or prior)."""
        w = self.workload(grouping, desc)
        cm, n = self.cost_model, self.num_layers
        paged = cm.paged_time(w, num_layers=n)
        if grouping.num_groups == 0:
            return PathTimes(paged, _INF, _INF, _INF)
        h = self.host_plan.us if host_plan_us is None else host_plan_us
        off = cm.disabled_paths
        eager = not graph_safe_only
        return PathTimes(
            paged=paged,
            cascade=_INF if "cascade" in off else cm.step_time("cascade", w, num_layers=n, eager=eager,
                                                                host_plan_us=h),
            fused=_INF if graph_safe_only or "fused" in off else cm.step_time("fused", w, num_layers=n, eager=True,
                                                                               host_plan_us=h),
            bgemm=_INF if graph_safe_only or "bgemm" in off else cm.step_time("bgemm", w, num_layers=n, eager=True,
                                                                               host_plan_us=h),
        )

    def choose(
        self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True
    ) -> Decision:
        """The path for this step. ``graph_safe_only=True`` (a CUDA-graph step): paged or cascade."""
        h = self.host_plan.us
        return self.decide(grouping, self.estimate(grouping, desc, graph_safe_only=graph_safe_only, host_plan_us=h), h)

    def decide(self, grouping: Grouping, times: PathTimes, host_plan_us: float) -> Decision:
        """The decision for ``times`` (``estimate``'s, with the host term ``host_plan_us``)."""
        if grouping.num_groups == 0:
            return Decision(Path.PAGED, times, "no group")
        if self.forced is not None:
            if math.isinf(times.of(self.forced)):
                return Decision(
                    Path.PAGED, times,
                    f"forced {self.forced.value} not eligible (eager-only or disabled by calibration): paged",
                )
            return Decision(self.forced, times, f"forced {self.forced.value}")
        return cheapest(times, host_plan_us, self.floors)


def cheapest(times: PathTimes, host_plan_us: float, floors: Sequence[float]) -> Decision:
    """The cheapest path of ``times`` (PAGED on ties) and its reason. A paged choice is
    ``host_bound`` when some path's time less its per-step overheads (``host_plan_us`` and its
    launch floors ``floors[k]``, all layers) is below paged's: then the reason says
    ``host_overhead`` and how much those overheads exceed the saving."""
    k = min(range(4), key=times.__getitem__)  # PathTimes order = PATH_ORDER: PAGED wins ties
    if k:
        return Decision(PATH_ORDER[k], times, f"{PATH_ORDER[k].value} {times[k]:.1f}us < paged {times[0]:.1f}us "
                                          f"({times[0] / times[k]:.2f}x)")
    j = min(range(1, 4), key=times.__getitem__)
    reason = f"paged {times[0]:.1f}us <= {PATH_ORDER[j].value} {times[j]:.1f}us"
    b = min(range(1, 4), key=lambda i: times[i] - floors[i])
    saving = times[0] - (times[b] - host_plan_us - floors[b])  # the kernels' saving, all layers
    if saving > 0.0:
        return Decision(Path.PAGED, times, f"{reason}: {HOST_OVERHEAD} ({PATH_ORDER[b].value} saves "
                                           f"{saving:.1f}us < host planning {host_plan_us:.1f}us "
                                           f"+ launch floors {floors[b]:.1f}us)", True)
    return Decision(Path.PAGED, times, reason)


class SteadyChooser:
    """``Dispatcher.choose`` for successive decode steps of one grouping, in O(1) per step.

    With the grouping fixed (same ``Grouping`` object: ``GroupingMemo`` returns the previous
    one while the batch's HOT runs are unchanged), every path's estimate is an affine function
    of ``seq_tokens = sum(seq_lens)`` alone (``Workload``: ``seq_bytes`` and ``suffix_bytes``
    grow with it, nothing else does), plus, for the non-paged paths, the host planning term.
    So the times of two sequence totals without the host term, computed once per grouping,
    give every later step's times exactly (up to float rounding) with two multiply-adds per
    path and the current ``host_plan.us`` added to the non-paged ones: a measured planning time
    feeds the very next step's choice, as in ``Dispatcher.choose``. The decision's reason is
    rebuilt only when the chosen path or its ``host_bound`` flag changes.

    ``seq_total``: the caller's ``sum(desc.seq_lens)`` when it has it for free (SGLang's
    ``seq_lens_sum``): a steady step then does no array work at all. It is checked against the
    arrays at every refit; once it disagrees it is ignored from then on (``hint_mismatches``).
    """

    _PROBE = 1 << 20  # second sequence total of the affine fit (any distinct value is exact)

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self._key: Optional[Tuple[Grouping, bool]] = None  # (grouping, graph_safe_only): held, so `is` is safe
        self._base: Tuple[float, ...] = ()  # times without the host term at _seq0 (set with _key, unforced)
        self._slope: Tuple[float, ...] = ()  # ... and their change per sequence token
        self._seq0: float = 0
        self._decision: Optional[Decision] = None  # last decision (its reason is reused while the path stays)
        self.hits = self.misses = 0
        self.hint_ok = True  # seq_total hints agree with the arrays (checked at every refit)
        self.hint_mismatches = 0

    def choose(self, grouping: Grouping, desc: BatchDescription, *, graph_safe_only: bool = True,
               seq_total: Optional[int] = None) -> Decision:
        key, prev = self._key, self._decision  # set together (_refit)
        if (key is None or prev is None or key[0] is not grouping or key[1] != graph_safe_only
                or grouping.num_groups == 0):
            return self._refit(grouping, desc, graph_safe_only, seq_total)
        self.hits += 1
        if self.dispatcher.forced is not None:  # depends on the grouping only (eligibility)
            return prev
        if seq_total is None or not self.hint_ok:
            seq_total = np.add.reduce(desc.seq_lens)
        dt = float(seq_total) - self._seq0
        h = self.dispatcher.host_plan.us
        (b0, b1, b2, b3), (s0, s1, s2, s3) = self._base, self._slope
        times = PathTimes(b0 + s0 * dt, b1 + s1 * dt + h, b2 + s2 * dt + h, b3 + s3 * dt + h)
        k, t = 0, times[0]  # the first minimum, as min(range(4), key=...): PAGED wins ties
        if times[1] < t:
            k, t = 1, times[1]
        if times[2] < t:
            k, t = 2, times[2]
        if times[3] < t:
            k = 3
        if k == 0:  # host_bound as in cheapest(): some path's time less its overheads beats paged
            _, f1, f2, f3 = self.dispatcher.floors
            bound = min(times[1] - f1, times[2] - f2, times[3] - f3) - h < times[0]
            if prev.path is Path.PAGED and prev.host_bound is bound:
                return Decision(Path.PAGED, times, prev.reason, bound)
        elif PATH_ORDER[k] is prev.path:
            return Decision(prev.path, times, prev.reason)
        self._decision = cheapest(times, h, self.dispatcher.floors)
        return self._decision

    def kept_saving(self, grouping: Grouping, *, graph_safe_only: bool, seq_total: Optional[int]) -> Optional[float]:
        """For a step whose batch stays on the last decision's CASCADE path (a steady replay):
        the µs by which paged is priced slower (the host term included), from the same times
        ``choose`` would compute, when ``choose`` would return CASCADE with the last decision's
        reason; None where that is not known this cheaply (another grouping, a forced path, no
        sequence total, or another path now cheapest): the caller calls ``choose``. Builds no
        ``PathTimes`` or ``Decision`` and counts nothing (``kept``)."""
        key, prev = self._key, self._decision
        if (key is None or prev is None or key[0] is not grouping or key[1] != graph_safe_only
                or prev.path is not Path.CASCADE or self.dispatcher.forced is not None
                or seq_total is None or not self.hint_ok):
            return None
        dt = float(seq_total) - self._seq0
        h = self.dispatcher.host_plan.us
        (b0, b1, b2, b3), (s0, s1, s2, s3) = self._base, self._slope
        t0, t1 = b0 + s0 * dt, b1 + s1 * dt + h
        if not t1 < t0 or b2 + s2 * dt + h < t1 or b3 + s3 * dt + h < t1:  # choose's k == 1, exactly
            return None
        return t0 - t1

    def kept(self) -> Decision:
        """The last decision, for a step ``kept_saving`` priced on it (counted as a hit): its
        path and reason are those ``choose`` returns for that step; its times are not."""
        assert self._decision is not None
        self.hits += 1
        return self._decision

    def _refit(self, grouping: Grouping, desc: BatchDescription, graph_safe_only: bool,
               seq_total: Optional[int] = None) -> Decision:
        self.misses += 1
        if seq_total is not None and self.hint_ok and seq_total != int(np.add.reduce(desc.seq_lens)):
            self.hint_ok = False  # the caller's totals are not the arrays' sums: use the arrays
            self.hint_mismatches += 1
        d = self.dispatcher
        h = d.host_plan.us
        bare = d.estimate(grouping, desc, graph_safe_only=graph_safe_only, host_plan_us=0.0)
        times = PathTimes(bare[0], bare[1] + h, bare[2] + h, bare[3] + h)
        decision = d.decide(grouping, times, h)
        self._key, self._decision = (grouping, graph_safe_only), decision
        if grouping.num_groups == 0:
            self._key = None
            return decision
        if d.forced is not None:
            return decision
        probe = BatchDescription(desc.req_pool_indices, desc.seq_lens + self._PROBE // max(1, desc.batch_size),
                                 desc.hot_start, desc.hot_len)
        far = d.estimate(grouping, probe, graph_safe_only=graph_safe_only, host_plan_us=0.0)
        self._seq0 = float(np.add.reduce(desc.seq_lens))
        span = float(np.add.reduce(probe.seq_lens)) - self._seq0
        self._base = tuple(bare)
        self._slope = tuple(0.0 if math.isinf(a) else (b - a) / span for a, b in zip(bare, far, strict=True))
        return decision


_WARNED_GPUS: Set[str] = set()  # GPU names warned about (once per process)


def warn_if_uncalibrated(cost_model_path: Optional[str], gpu: Optional[str]) -> bool:
    """Logs once per GPU model when no ``--granikv-cost-model`` is given and no calibrated
    file ships for ``gpu`` (the conservative default then decides: promotions and the
    shared-prefix path only where the saving is clear). Returns True when it warned."""
    if cost_model_path is not None or not gpu or gpu in _WARNED_GPUS:
        return False
    path = calibrated_path(gpu)
    if os.path.exists(path):
        return False
    _WARNED_GPUS.add(gpu)
    logger.warning("GraniKV cost model: no calibrated coefficients for %s (%s); using the conservative "
                   "default, under which many shared prefixes stay on the stock path. Calibrate this GPU "
                   "once (python -m benchmark.kernels.calibrate, docs/operations.md \"A new GPU model\") and "
                   "pass the file with --granikv-cost-model PATH", gpu, os.path.basename(path))
    return True


def build_dispatcher(model_runner: ModelRunner, cfg: GraniKVConfig, backend_name: Optional[str] = None, *,
                     forced_path: Optional[str] = None) -> Dispatcher:
    """The dispatcher for this model runner's head shapes, with the paged coefficients of the
    wrapped backend ``backend_name`` where the cost-model file has them (else its top-level
    ones, calibrated on FlashInfer's decode; logged). ``forced_path`` overrides
    ``cfg.attention_path`` (``"paged"`` when some layer cannot be served)."""
    mc = model_runner.model_config
    tp = attention_tp_size(model_runner)
    on_cuda = torch.cuda.is_available() and torch.device(model_runner.device).type == "cuda"
    gpu = torch.cuda.get_device_name(model_runner.device) if on_cuda else None
    loaded = CostModel.load(cfg.cost_model, gpu)
    warn_if_uncalibrated(cfg.cost_model, gpu)
    cost_model = loaded.for_backend(backend_name)
    if backend_name and cost_model is loaded and backend_name != "flashinfer":
        logger.info("GraniKV cost model: no paged coefficients of the %s backend; using the "
                    "calibrated (flashinfer) ones", backend_name)
    return Dispatcher(
        cost_model,
        num_q_heads=mc.num_attention_heads // tp,
        num_kv_heads=mc.get_num_kv_heads(tp),
        head_dim=mc.head_dim,
        kv_dtype_bytes=model_runner.kv_cache_dtype.itemsize,
        forced_path=forced_path or cfg.attention_path,
        num_layers=mc.num_hidden_layers,
    )
