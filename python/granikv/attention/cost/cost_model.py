"""Time estimates of each decode attention path from bytes moved, FLOPs and launches.

Three parts:

- ``workload.Workload``: what one decode layer of a batch moves and computes on each path
  (bytes of KV, FLOPs of the stacked prefix pass, groups). Pure accounting, no hardware numbers.
- ``served_terms.ServedTerms`` / ``ExtendTerms``: what a served step runs beyond the kernels,
  and the prefill prefix part.
- ``CostModel`` (here): a small set of per-GPU coefficients (achieved bandwidths, throughputs and
  fixed overheads) measured by benchmark/kernels/calibrate.py and stored as JSON, turning a
  ``Workload`` into microseconds per decode step.

Every path's time is a sum of terms (no overlap assumed, which over-estimates rather than
under-estimates)::

    paged   = paged_launch_us + seq_unique_bytes / paged_gbps + reread_bytes / paged_reuse_gbps
    cascade = plan_us/layers + 3 launch_us + G work_item_us          (prefix, suffix, merge)
              + prefix_bytes / prefix_gbps + prefix_flops / prefix_tflops
              + (suffix_bytes + state_bytes) / suffix_gbps
    fused   = plan_us/layers + 1 launch_us + G work_item_us
              + prefix_bytes / prefix_gbps + prefix_flops / fused_tflops
              + suffix_bytes / suffix_gbps
    bgemm   = plan_us/layers + 2 launch_us + G (work_item_us + bgemm_group_us)
              + prefix_bytes / prefix_gbps + prefix_flops / bgemm_tflops
              + (suffix_bytes + state_bytes) / suffix_gbps

``reread_bytes`` are the paged kernel's repeated reads of a shared prefix (one per extra group
member); they are mostly served from L2, hence their own (higher) bandwidth. Units: ``*_us``
microseconds, ``*_gbps`` 1e9 bytes/s, ``*_tflops`` 1e12 FLOP/s.

Those are the KERNEL times (what calibrate.py fits; ``plan_us`` is its bench measurement of
the host planning). A served decode step runs more, and ``step_time`` (what the dispatcher
compares) adds it, from ``ServedTerms``::

    step(paged)  = paged                                       (the stock work, nothing else)
    step(path)   = path - plan_us                              (the kernels of every layer)
                 + layers * inner_call                         (the wrapped backend still runs,
                   inner_call = paged_launch_us + bs * kv_bytes_per_token / paged_gbps   seq_len 1)
                 + layers * launches(path) * launch_floor_us   (GPU-side floor of each launch)
                 + layers * launches(path) * eager_launch_us   (eager steps only: host launch cost)
                 + host_plan                                   (once per step, on the critical path)

``host_plan`` is the planner's measured planning time of the steps that planned a GraniKV path
(``dispatcher.HostPlanTime``) when the caller passes it, else the prior ``served.host_plan_us``.
So a GraniKV path wins only where ``layers * kernel_saving > host_plan + layers * (inner_call +
launches * launch_floor_us)``: on a short model (few layers) the per-step host term is not paid
back by the per-layer saving (``docs/operations.md``, "When it helps").

The paged coefficients are the wrapped backend's: ``ServedTerms.paged_by_backend`` holds them
per backend (``for_backend``; the top-level ones are those calibrate.py measured, FlashInfer's
tensor-core decode). ``ExtendTerms`` prices the prefill prefix part (stock paged call vs dense
calls over HOT extents) for the extend gate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

# HeadGeometry, ExtendTerms and nnls are imported from here too (the cost model's vocabulary)
from granikv.attention.cost.nnls import nnls
from granikv.attention.cost.served_terms import PAGED_NAMES, ExtendTerms, ServedTerms  # noqa: F401
from granikv.attention.cost.workload import HeadGeometry, Workload  # noqa: F401

if TYPE_CHECKING:
    import numpy as np

FORMAT_VERSION = 1
DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "data")  # granikv/data
DEFAULT_FILE = "cost_model_default.json"


def _coef(help: str) -> Any:
    return dataclasses.field(metadata={"help": help})


LAUNCHES = {"cascade": 3, "fused": 1, "bgemm": 2}  # GraniKV kernel launches per layer (beyond the wrapped call)
FIT_STAGES = (("paged", "cascade"), ("fused", "bgemm"))  # CostModel.fit: each stage fixes what it uses


@dataclass(frozen=True)
class CostModel:
    """Per-GPU coefficients; ``load`` reads them from JSON. All strictly positive."""

    paged_launch_us: float = _coef("fixed time of one stock paged decode call (launch, reduce)")
    paged_gbps: float = _coef("bandwidth of the paged kernel on KV read once (HBM)")
    paged_reuse_gbps: float = _coef(
        "bandwidth of the paged kernel re-reading a prefix other requests read (mostly L2)"
    )
    launch_us: float = _coef("fixed time of one GraniKV kernel launch")
    work_item_us: float = _coef("per group overhead of GraniKV's prefix pass (scheduling, tail)")
    prefix_gbps: float = _coef("bandwidth of the prefix pass reading a contiguous HOT extent")
    prefix_tflops: float = _coef("throughput of the cascade prefix kernel on stacked queries")
    fused_tflops: float = _coef("throughput of the fused single-launch kernel's prefix part")
    bgemm_tflops: float = _coef("tensor-core throughput of the batched-GEMM prefix path")
    bgemm_group_us: float = _coef("per group host and launch overhead of the eager bgemm path")
    suffix_gbps: float = _coef("bandwidth of GraniKV's paged suffix and merge kernels")
    plan_us: float = _coef("host planning and metadata upload per decode step (all layers), "
                           "calibrate.py's bench; served steps charge served.host_plan_us or the "
                           "planner's measurement instead (step_time)")
    disabled_paths: Tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={"help": "paths calibration never measured fastest on any case: the "
                          "dispatcher does not pick them (evidence over a poor fit)",
                  "coefficient": False},
    )
    served: ServedTerms = dataclasses.field(
        default_factory=ServedTerms,
        metadata={"help": "terms of a served step beyond the kernels (ServedTerms)", "coefficient": False},
    )

    # ---- a served decode step (what the dispatcher compares) ---------------------------------

    def step_time(self, path: str, w: Workload, *, num_layers: int = 1, eager: bool = False,
                  host_plan_us: Optional[float] = None) -> float:
        """Microseconds of a served decode step of ``path`` (see the module docstring).

        ``host_plan_us``: the host planning term of a non-paged step (>= 0; the planner's
        measurement); None: the prior ``served.host_plan_us``. Ignored for ``paged``."""
        kernels = getattr(self, f"{path}_time")(w, num_layers=num_layers)
        if path == "paged":
            return kernels
        return kernels - self.plan_us + num_layers * self.served_layer_us(path, w, eager=eager) + (
            self.served.host_plan_us if host_plan_us is None else host_plan_us)

    def served_layer_us(self, path: str, w: Workload, *, eager: bool = False) -> float:
        """Per layer, what a served step of the non-paged ``path`` runs beyond its kernels: the
        wrapped backend's ``seq_len = 1`` call and each launch's floor (+ its host cost, eager)."""
        inner = self.paged_launch_us + w.batch_bytes / (self.paged_gbps * 1e3)
        per_launch = self.served.launch_floor_us + (self.served.eager_launch_us if eager else 0.0)
        return inner + LAUNCHES[path] * per_launch

    def launch_floors_us(self, path: str, *, num_layers: int = 1) -> float:
        """The launch floors of a served step of ``path`` (0 for paged: the stock launch is in
        its coefficients), all layers."""
        return 0.0 if path == "paged" else num_layers * LAUNCHES[path] * self.served.launch_floor_us

    def for_backend(self, backend: Optional[str]) -> "CostModel":
        """This model with ``backend``'s own paged coefficients and stock prefill terms
        (``served.extend``), where the file has them."""
        model = self
        extend = self.served.extend_for(backend)
        if extend is not self.served.extend:
            model = dataclasses.replace(model, served=dataclasses.replace(self.served, extend=extend))
        coefs = self.served.paged_by_backend.get(backend or "")
        # its keys are PAGED_NAMES (float fields; ServedTerms.from_mapping checks them)
        return model if coefs is None else dataclasses.replace(model, **cast(Dict[str, Any], coefs))

    # ---- estimates (microseconds per decode step of `num_layers` layers) --------------------

    def paged_time(self, w: Workload, *, num_layers: int = 1) -> float:
        unique = w.seq_bytes - w.reread_bytes
        layer = (
            self.paged_launch_us
            + unique / (self.paged_gbps * 1e3)
            + w.reread_bytes / (self.paged_reuse_gbps * 1e3)
        )
        return num_layers * layer

    def cascade_time(self, w: Workload, *, num_layers: int = 1) -> float:
        layer = (
            3 * self.launch_us
            + self._prefix(w, self.prefix_tflops)
            + (w.suffix_bytes + w.state_bytes) / (self.suffix_gbps * 1e3)
        )
        return num_layers * layer + self.plan_us

    def fused_time(self, w: Workload, *, num_layers: int = 1) -> float:
        layer = (
            self.launch_us
            + self._prefix(w, self.fused_tflops)
            + w.suffix_bytes / (self.suffix_gbps * 1e3)
        )
        return num_layers * layer + self.plan_us

    def bgemm_time(self, w: Workload, *, num_layers: int = 1) -> float:
        layer = (
            2 * self.launch_us
            + w.num_groups * self.bgemm_group_us
            + self._prefix(w, self.bgemm_tflops)
            + (w.suffix_bytes + w.state_bytes) / (self.suffix_gbps * 1e3)
        )
        return num_layers * layer + self.plan_us

    def _prefix(self, w: Workload, tflops: float) -> float:
        return (
            w.num_groups * self.work_item_us
            + w.prefix_bytes / (self.prefix_gbps * 1e3)
            + w.prefix_flops / (tflops * 1e6)
        )

    # ---- calibration: the same formulas as a linear model ------------------------------------

    @classmethod
    def fit_names(cls) -> List[str]:
        """Coefficients a per-layer kernel time depends on (all but ``plan_us``)."""
        return [n for n in cls.coefficient_names() if n != "plan_us"]

    @classmethod
    def features(cls, path: str, w: Workload) -> List[float]:
        """Row ``f`` with ``layer time = sum(f * u)``, where ``u`` holds each ``*_us``
        coefficient as is and each rate as its inverse (``1/gbps``, ``1/tflops``).

        Mirrors ``paged_time`` ... ``bgemm_time`` at ``num_layers=1`` without ``plan_us``
        (test_cost_model checks they agree); calibrate.py fits ``u`` to measured times.
        """
        kb, mf = 1e-3, 1e-6  # bytes / (GB/s) -> us, FLOPs / (TFLOP/s) -> us
        f = dict.fromkeys(cls.fit_names(), 0.0)
        if path == "paged":
            f.update(
                paged_launch_us=1.0,
                paged_gbps=(w.seq_bytes - w.reread_bytes) * kb,
                paged_reuse_gbps=w.reread_bytes * kb,
            )
            return [f[n] for n in cls.fit_names()]
        launches, tflops, state = {
            "cascade": (3, "prefix_tflops", w.state_bytes),
            "fused": (1, "fused_tflops", 0.0),
            "bgemm": (2, "bgemm_tflops", w.state_bytes),
        }[path]
        f.update(launch_us=launches, work_item_us=w.num_groups, prefix_gbps=w.prefix_bytes * kb)
        f.update(suffix_gbps=(w.suffix_bytes + state) * kb)
        f[tflops] = w.prefix_flops * mf
        if path == "bgemm":
            f["bgemm_group_us"] = w.num_groups
        return [f[n] for n in cls.fit_names()]

    def unknowns(self) -> List[float]:
        """This model's ``u`` (see ``features``)."""
        return [v if n.endswith("_us") else 1.0 / v for n, v in self._fit_items()]

    def _fit_items(self) -> List[Tuple[str, float]]:
        return [(n, getattr(self, n)) for n in self.fit_names()]

    @classmethod
    def fit(cls, samples: Sequence[Tuple[str, Workload, float]], *, plan_us: float,
            fallback: CostModel) -> Tuple[CostModel, np.ndarray]:
        """Least-squares coefficients from measured ``(path, Workload, layer_us)`` samples.

        Non-negative least squares on relative error (rows weighted by 1/measured), in two
        stages (``FIT_STAGES``): the paged and cascade samples first, which fix every
        coefficient they use, the cascade's launch, per-group, bandwidth and throughput terms
        included; then the fused and bgemm samples, for what only they use (their throughputs,
        bgemm's per-group overhead). The cascade is the path the dispatcher and the promotion
        estimate price; fitted jointly, the terms it shares with the other two paths served all
        three and overpriced it by 1.3-1.5x on forest batches (docs/results/kernels.md). A
        coefficient no stage determines (its column is zero, or the fit puts it at 0 = an
        infinite rate) keeps ``fallback``'s value; a fitted 0 overhead becomes 1e-3 us.
        Returns ``(model, relative_errors)`` with one error per sample.
        """
        import numpy as np

        names = cls.fit_names()
        a = np.array([cls.features(p, w) for p, w, _ in samples], dtype=np.float64).reshape(len(samples), len(names))
        t = np.array([m for _, _, m in samples], dtype=np.float64)
        u = np.zeros(len(names))
        fixed = np.zeros(len(names), dtype=bool)
        for stage in FIT_STAGES:
            rows = np.array([p in stage for p, _, _ in samples], dtype=bool)
            if not rows.any():
                continue
            rest = t[rows] - a[rows][:, fixed] @ u[fixed]  # what the terms fixed earlier leave
            weighted = a[rows] / t[rows, None]
            scale = np.linalg.norm(weighted, axis=0)
            free = (scale > 0) & ~fixed
            if not free.any():
                continue
            u[free] = nnls(weighted[:, free] / scale[free], rest / t[rows]) / scale[free]
            fixed |= free
        values: Dict[str, Any] = {}  # the float coefficients, by name (cls's keyword arguments)
        for j, name in enumerate(names):
            if name.endswith("_us"):
                values[name] = max(u[j], 1e-3) if fixed[j] else getattr(fallback, name)
            else:
                values[name] = 1.0 / u[j] if fixed[j] and u[j] > 0 else getattr(fallback, name)
        model = cls(plan_us=plan_us, **values)
        pred = a @ np.array(model.unknowns())
        return model, (pred - t) / t

    # ---- persistence -------------------------------------------------------------------------

    @classmethod
    def coefficient_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("coefficient", True)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "<mapping>") -> "CostModel":
        """Validates ``{"format": 1, "gpu_name": ..., "coefficients": {...}}`` (extra top-level
        keys, e.g. ``"calibration"``, are kept out of the model). Raises ``ValueError`` naming
        ``source`` and the offending field."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(values).__name__}")
        if values.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"{source}: field 'format' must be {FORMAT_VERSION}, got {values.get('format')!r}"
            )
        coefs = values.get("coefficients")
        if not isinstance(coefs, Mapping):
            raise ValueError(f"{source}: field 'coefficients' must be an object, got {coefs!r}")
        names = cls.coefficient_names()
        unknown = sorted(set(coefs) - set(names))
        if unknown:
            raise ValueError(
                f"{source}: unknown field 'coefficients.{unknown[0]}' (known: {', '.join(names)})"
            )
        kwargs: Dict[str, float] = {}
        for name in names:
            if name not in coefs:
                raise ValueError(f"{source}: missing field 'coefficients.{name}'")
            v = coefs[name]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or not (math.isfinite(v) and v > 0):
                raise ValueError(
                    f"{source}: field 'coefficients.{name}' must be a positive finite number, "
                    f"got {v!r}"
                )
            kwargs[name] = float(v)
        disabled = values.get("disabled_paths", [])
        if not isinstance(disabled, list) or not set(disabled) <= set(DISABLEABLE_PATHS):
            raise ValueError(
                f"{source}: field 'disabled_paths' must be a list of {', '.join(DISABLEABLE_PATHS)}, "
                f"got {disabled!r}"
            )
        served = ServedTerms.from_mapping(values.get("served"), source)
        return cls(**kwargs, disabled_paths=tuple(disabled), served=served)

    def to_mapping(self, gpu_name: str, **extra: Any) -> Dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "gpu_name": gpu_name,
            "coefficients": {n: getattr(self, n) for n in self.coefficient_names()},
            "disabled_paths": list(self.disabled_paths),
            "served": self.served.to_mapping(),
            **extra,
        }

    @classmethod
    def load(cls, path: Optional[str], gpu_name: Optional[str] = None) -> "CostModel":
        """Loads ``path`` if given, else the checked-in file for ``gpu_name``
        (``data/cost_model_<slug>.json``, e.g. ``cost_model_nvidia-h200.json``), else the
        conservative default (``data/cost_model_default.json``)."""
        if path is None:
            path = default_path(gpu_name)
        try:
            with open(path) as f:
                values = json.load(f)
        except OSError as e:
            raise ValueError(f"{path}: cannot read the cost model ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_mapping(values, source=path)


DISABLEABLE_PATHS = ("cascade", "fused", "bgemm")  # paged always stays eligible


def never_fastest(cases: Iterable[Mapping[str, float]]) -> Tuple[str, ...]:
    """GraniKV paths that were not the fastest measured path on any calibration case.

    ``cases``: iterable of ``{path: measured_us}`` dicts.
    """
    won = {min(m, key=m.__getitem__) for m in cases if m}
    return tuple(p for p in DISABLEABLE_PATHS if p not in won)


def gpu_slug(gpu_name: str) -> str:
    """A GPU name as a file-name-safe slug: ``"NVIDIA A100-SXM4-80GB"`` -> ``"nvidia-a100-sxm4-80gb"``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def calibrated_path(gpu_name: str) -> str:
    return os.path.normpath(os.path.join(DATA_DIR, f"cost_model_{gpu_slug(gpu_name)}.json"))


def default_path(gpu_name: Optional[str]) -> str:
    """The calibrated file for ``gpu_name`` when one is checked in, else the default."""
    if gpu_name:
        path = calibrated_path(gpu_name)
        if os.path.exists(path):
            return path
    return os.path.normpath(os.path.join(DATA_DIR, DEFAULT_FILE))
