"""What a served step runs beyond GraniKV's kernels, as cost-model terms.

``ServedTerms``: the host launch cost of eager steps, the GPU-side floor of each GraniKV launch in
a served step, the prior of the host planning term and the paged coefficients of each wrapped
backend (``cost_model.CostModel.step_time`` and ``for_backend`` use them). ``ExtendTerms``:
the prefill prefix part (stock paged call vs dense calls over HOT extents) for the extend gate.
Both are read from the ``served`` field of the cost-model JSON.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

PAGED_NAMES = ("paged_launch_us", "paged_gbps", "paged_reuse_gbps")
EXTEND_STOCK_NAMES = ("paged_call_us", "paged_tflops")  # a wrapped backend's own stock prefill


@dataclass(frozen=True)
class ExtendTerms:
    """Prefill prefix part (per layer): SGLang's paged call vs one dense call per HOT extent.

    stock = paged_call_us + F_all / paged_tflops
    hot   = G * dense_call_us + F_hot / dense_tflops
            (+ paged_call_us + F_cold / paged_tflops + merge_us, when a COLD remainder exists)

    F = 4 * Hq * D * sum(new tokens x prefix tokens they attend), over the batch (F_all), the HOT
    extents (F_hot) or the COLD remainder (F_cold).

    Under a wrapped backend whose extend is one call over prefix and new tokens (triton, fa3),
    GraniKV computes the whole extend (``full_extend``): its new tokens' causal part is one more
    dense call and one more merge, where the stock call covers them in the same pass::

    stock_full = paged_call_us + (F_all + F_causal) / paged_tflops
    hot_full   = hot + dense_call_us + F_causal / dense_tflops + merge_us

    The stock terms (``paged_*``) are those of flashinfer's paged prefill unless the cost-model
    file holds the wrapped backend's own (``ServedTerms.extend_stock_by_backend``).
    """

    paged_call_us: float = 12.0
    paged_tflops: float = 350.0
    dense_call_us: float = 20.0
    dense_tflops: float = 620.0
    merge_us: float = 6.0

    def stock_us(self, flops_all: float) -> float:
        return self.paged_call_us + flops_all / (self.paged_tflops * 1e6)

    def hot_us(self, num_dense_calls: int, flops_hot: float, flops_cold: Optional[float]) -> float:
        t = num_dense_calls * self.dense_call_us + flops_hot / (self.dense_tflops * 1e6)
        if flops_cold is not None:
            t += self.paged_call_us + flops_cold / (self.paged_tflops * 1e6) + self.merge_us
        return t

    def stock_full_us(self, flops_all: float, flops_causal: float) -> float:
        return self.stock_us(flops_all + flops_causal)

    def hot_full_us(self, num_dense_calls: int, flops_hot: float, flops_cold: Optional[float],
                    flops_causal: float) -> float:
        return (self.hot_us(num_dense_calls, flops_hot, flops_cold) + self.dense_call_us
                + flops_causal / (self.dense_tflops * 1e6) + self.merge_us)


@dataclass(frozen=True)
class ServedTerms:
    """What a served step runs beyond the kernels (see the module docstring).

    - ``eager_launch_us``: host cost of one GraniKV launch on an eager step (per layer).
    - ``launch_floor_us``: GPU-side fixed cost of one GraniKV launch in a served step, per layer
      (``cost_model.LAUNCHES`` of them per path), beyond what calibrate.py's per-case graphs
      measure: the served cascade graph's launches are sized for the graph workspace and read
      live counts, and each follows the model's previous kernel. Default 3 us: the H200's floor
      of a dependent kernel launch inside a CUDA graph (2-4 us); not yet measured in serving.
    - ``extend_stock_by_backend``: per wrapped backend, its own stock prefill terms
      (``EXTEND_STOCK_NAMES`` of ``ExtendTerms``) where measured; ``extend`` holds flashinfer's.
    - ``host_plan_us``: prior of the host planning term of a step that plans a GraniKV path
      (staging, grouping, choice, work-list fill, upload, the wrapped backend's view), until
      the planner has measured its own (``dispatcher.HostPlanTime``). Default 250 us: above
      every p50 of the cascade steps measured in serving on the H200 host (117-212 us,
      docs/results/regimes.md), below their p99 (250-582 us): conservative.
    """

    eager_launch_us: float = 15.0
    paged_by_backend: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    extend: ExtendTerms = dataclasses.field(default_factory=ExtendTerms)
    launch_floor_us: float = 3.0
    host_plan_us: float = 250.0
    extend_stock_by_backend: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)

    def to_mapping(self) -> Dict[str, Any]:
        out = {"eager_launch_us": self.eager_launch_us,
               "launch_floor_us": self.launch_floor_us,
               "host_plan_us": self.host_plan_us,
               "paged_by_backend": {k: dict(v) for k, v in self.paged_by_backend.items()},
               "extend": dataclasses.asdict(self.extend)}
        if self.extend_stock_by_backend:
            out["extend_stock_by_backend"] = {k: dict(v) for k, v in self.extend_stock_by_backend.items()}
        return out

    def extend_for(self, backend: Optional[str]) -> ExtendTerms:
        """The extend terms under ``backend``: its own stock prefill terms where the file has them."""
        own = self.extend_stock_by_backend.get(backend or "")
        return self.extend if own is None else dataclasses.replace(self.extend, **own)

    @classmethod
    def from_mapping(cls, values: Any, source: str) -> "ServedTerms":
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: field 'served' must be an object, got {values!r}")
        unknown = sorted(set(values) - {"eager_launch_us", "launch_floor_us", "host_plan_us",
                                        "paged_by_backend", "extend", "extend_stock_by_backend", "note"})
        if unknown:
            raise ValueError(f"{source}: unknown field 'served.{unknown[0]}'")
        eager = _positive(values.get("eager_launch_us", cls.eager_launch_us),
                          f"{source}: field 'served.eager_launch_us'")
        floor = _positive(values.get("launch_floor_us", cls.launch_floor_us),
                          f"{source}: field 'served.launch_floor_us'")
        host = _positive(values.get("host_plan_us", cls.host_plan_us), f"{source}: field 'served.host_plan_us'")
        by_backend: Dict[str, Dict[str, float]] = {}
        for name, coefs in (values.get("paged_by_backend") or {}).items():
            if not isinstance(coefs, Mapping) or set(coefs) != set(PAGED_NAMES):
                raise ValueError(f"{source}: field 'served.paged_by_backend.{name}' must hold exactly "
                                 f"{', '.join(PAGED_NAMES)}")
            by_backend[name] = {k: _positive(v, f"{source}: field 'served.paged_by_backend.{name}.{k}'")
                                for k, v in coefs.items()}
        ext = values.get("extend") or {}
        names = [f.name for f in dataclasses.fields(ExtendTerms)]
        if not isinstance(ext, Mapping) or not set(ext) <= set(names):
            raise ValueError(f"{source}: field 'served.extend' must be an object with keys from {', '.join(names)}")
        extend = ExtendTerms(**{k: _positive(v, f"{source}: field 'served.extend.{k}'") for k, v in ext.items()})
        stock_by_backend: Dict[str, Dict[str, float]] = {}
        for name, coefs in (values.get("extend_stock_by_backend") or {}).items():
            if not isinstance(coefs, Mapping) or not coefs or not set(coefs) <= set(EXTEND_STOCK_NAMES):
                raise ValueError(f"{source}: field 'served.extend_stock_by_backend.{name}' must hold some of "
                                 f"{', '.join(EXTEND_STOCK_NAMES)}")
            field = f"{source}: field 'served.extend_stock_by_backend.{name}"
            stock_by_backend[name] = {k: _positive(v, f"{field}.{k}'") for k, v in coefs.items()}
        return cls(eager, by_backend, extend, floor, host, stock_by_backend)


def _positive(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what} must be a positive finite number, got {v!r}")
    return float(v)
