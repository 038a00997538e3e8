"""Per-layer decode paths of a hybrid model: full-attention layers on GraniKV's path, sliding-window
layers on the wrapped backend planned with the real batch, in the same step.

gpt-oss alternates 128-token sliding-window layers with full-attention layers. On a step that
plans a GraniKV path, the wrapped backend is planned with the ``seq_len = 1`` view (its output
is overwritten, so it only writes the step's K/V cheaply), and a windowed layer cannot use that
view. ``LayerPaths`` holds a SECOND instance of the wrapped backend, built by the same SGLang
builder, planned with the real batch on such steps; each layer calls exactly one instance::

    step planned cascade/fused/bgemm        step planned paged
    ------------------------------------    -------------------------------
    full-attention layer:  inner (1-token view: K/V write) + GraniKV kernels  inner (real batch)
    windowed layer:        second instance (real batch: K/V write + attention)  inner (real batch)

so every layer's K/V is written once, by SGLang's own backend code. Only layers whose one
refusal is a sliding window (``PER_LAYER_REASONS``) run this way; any other refusal keeps decode
stock for the whole model.

CUDA graphs: the second instance gets its own graph state (``init_graph_state``, SGLang's
``init_cuda_graph_state`` of that backend). A size's stock graph is the wrapped backend alone, as
stock SGLang captures it; its cascade graph is captured with the second instance's capture
metadata over the runner's static batch (``capture``), so the windowed layers' kernels in that
graph read the second instance's fixed buffers; a step that replays the cascade graph refills
them with its real (padded) batch (``replay``), as the graph runner refills the wrapped
backend's::

    capture (per size)                       replay (a step that planned cascade)
    stock graph:   inner only                 inner.out_graph(1-token view)
    cascade graph: inner (1-token view)       real.out_graph(padded batch)   <- refill
                   + real.out_graph(in_capture=True)

The SWA pool of SGLang's hybrid models (windowed layers in a smaller pool of their own) is not a
pool GraniKV's allocator replaces: start-up refuses it, naming ``--disable-hybrid-swa-memory``
(``eligibility.unsupported_reason``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional

from granikv.attention.eligibility import PER_LAYER_REASONS, layer_ranges

if TYPE_CHECKING:
    import torch
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

logger = logging.getLogger("granikv")


def per_layer_stock(blocked: Mapping[int, str], num_layers: int) -> Optional[Dict[int, str]]:
    """``blocked`` (the scan's layers that keep decode stock) when every reason is one of
    ``PER_LAYER_REASONS`` and some of the model's ``num_layers`` attention layers remain for
    GraniKV; else None (decode stays stock for the whole model)."""
    if not blocked or len(blocked) >= num_layers:
        return None
    if not all(r.startswith(PER_LAYER_REASONS) for r in blocked.values()):
        return None
    return dict(blocked)


class LayerPaths:
    """The second wrapped-backend instance and the per-layer choice (mechanism only: which path a
    step takes is the planner's)."""

    def __init__(self, stock: Mapping[int, str], build: Callable[[], AttentionBackend], *, num_layers: int,
                 backend_name: str):
        self.stock_ids = frozenset(stock)
        self.num_layers = num_layers
        self.real = build()  # planned with the real batch on GraniKV-path steps
        self.planned = False  # the current step planned ``real``
        self._capturing = False  # a cascade graph capture (its layer calls are not steps)
        self.graph_state = False  # ``real`` has CUDA-graph state (init_graph_state)
        self.steps = 0  # decode steps that ran per-layer paths (eager and graph replays)
        self.graph_steps = 0  # of those, cascade graph replays
        self.layer_calls = {"granikv": 0, "stock": 0}  # decode layer calls of those steps
        logger.info("GraniKV: per-layer decode paths: %d of %d attention layers on GraniKV's path, "
                    "layers %s on the %s backend planned with the real batch (%s)", num_layers - len(stock), num_layers,
                    layer_ranges(self.stock_ids), backend_name, "; ".join(sorted(set(stock.values()))))

    def runs_stock(self, layer_id: int) -> bool:
        return layer_id in self.stock_ids

    def plan(self, fb: Any) -> None:
        """A step that planned a GraniKV path: the second instance over the real batch."""
        self.real.init_forward_metadata(fb)
        self.planned = True
        self.steps += 1

    def unplan(self) -> None:
        """A paged, extend or stock-graph step: every layer calls the wrapped backend itself."""
        self.planned = False
        self._capturing = False

    # ---- CUDA graphs -----------------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The second instance's graph buffers (beside the wrapped backend's)."""
        self.real.init_cuda_graph_state(max_bs, max_num_tokens)
        self.graph_state = True

    def capture(self, fb: Any) -> None:
        """The capture of a size's cascade graph: the second instance's capture metadata over the
        runner's static batch ``fb``; the windowed layers of the forward being captured call it."""
        if not self.graph_state:
            raise RuntimeError("per-layer paths: a cascade graph capture before init_graph_state")
        self.real.init_forward_metadata_out_graph(fb, in_capture=True)
        self.planned = True
        self._capturing = True

    def replay(self, fb: Any) -> None:
        """A step that replays its size's cascade graph: the second instance's buffers refilled
        with the real padded batch ``fb`` (the graph's windowed layers read them). A replay runs no
        Python: its layer calls are counted here, one per layer."""
        self.real.init_forward_metadata_out_graph(fb)
        self.planned = True
        self.steps += 1
        self.graph_steps += 1
        self.layer_calls["granikv"] += self.num_layers - len(self.stock_ids)
        self.layer_calls["stock"] += len(self.stock_ids)

    # ---- per layer -------------------------------------------------------------------------

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, fb: Any,
                       save_kv_cache: bool, kwargs: Mapping[str, Any]) -> torch.Tensor:
        if not self._capturing:
            self.layer_calls["stock"] += 1
        return self.real.forward_decode(q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)

    def served(self) -> None:
        """A layer call of a per-layer step that took GraniKV's path."""
        if not self._capturing:
            self.layer_calls["granikv"] += 1

    def snapshot(self) -> Dict[str, Any]:
        return {"per_layer_steps": self.steps, "per_layer_graph_steps": self.graph_steps, "per_layer_layers": {
            "granikv": self.num_layers - len(self.stock_ids), "stock": len(self.stock_ids)},
            "per_layer_calls": dict(self.layer_calls)}

    def check_integrity(self) -> None:
        """Every layer call of a per-layer step went to exactly one instance: the calls split as
        the layers do."""
        g, s = self.layer_calls["granikv"], self.layer_calls["stock"]
        want_g, want_s = self.num_layers - len(self.stock_ids), len(self.stock_ids)
        assert g * want_s == s * want_g, f"per-layer calls {g} GraniKV / {s} stock, layers {want_g} / {want_s}"
