"""``LayerEligibility``: the one verdict decode and extend share on whether GraniKV computes a
layer's attention call.

``reason(layer, k, v, kwargs)`` is what both paths ask: the wrap-time scan of the loaded model
(``support.scan_layers``), else ``support.layer_reason`` of this layer object (checked once per
object), else ``support.call_reason`` of the call's own arguments. What each path does with a
reason differs only because of when it can still act:

- decode: the wrapped backend is planned once per step for every layer, so one layer cannot
  opt out of the ``seq_len = 1`` plan. Any ineligible layer found by the scan keeps decode
  stock for the whole model; one found only at call time (``record``) makes decode stock from
  the next step on;
- extend: the layer's call goes to the wrapped backend (logged once per reason).
"""

import logging
from typing import Dict, Optional

from granikv.layers.attention.cascade.support import call_reason, layer_ranges, layer_reason, scan_layers

logger = logging.getLogger("granikv")
_UNSEEN = object()


class LayerEligibility:
    """Per-layer verdicts for one model: ``layer_id -> reason`` from the scan, plus a memo per
    layer object. ``num_q_heads`` / ``head_dim``: the geometry the kernels were built for."""

    def __init__(self, *, num_q_heads: int, head_dim: int, backend_name: str):
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.backend_name = backend_name
        self.scanned: Dict[int, str] = {}  # layer_id -> why it runs stock (scan and ``record``)
        self._memo = {}  # id(layer) -> its layer_reason (None: served)
        self._logged = set()

    def scan(self, model) -> Dict[int, str]:
        """Scans ``model``'s attention layers (logged once per reason); returns the verdicts."""
        self.scanned = scan_layers(model, num_q_heads=self.num_q_heads, head_dim=self.head_dim)
        by_reason = {}
        for layer_id, reason in sorted(self.scanned.items()):
            by_reason.setdefault(reason, []).append(layer_id)
        for reason, ids in by_reason.items():
            logger.warning("GraniKV: attention layers %s run the stock %s backend (%s); decode "
                           "stays stock for the whole model", layer_ranges(ids), self.backend_name, reason)
        return self.scanned

    def reason(self, layer, k, v, kwargs) -> Optional[str]:
        """Why this call runs the wrapped backend's attention (None: GraniKV serves it)."""
        reason = self._memo.get(id(layer), _UNSEEN)
        if reason is _UNSEEN:
            reason = self.scanned.get(layer.layer_id) or layer_reason(
                layer, num_q_heads=self.num_q_heads, head_dim=self.head_dim)
            self._memo[id(layer)] = reason
        return reason or call_reason(k, v, kwargs)

    def record(self, layer_id: int, reason: str) -> None:
        """A decode call showed a feature the scan did not see (kept beside the scan's verdicts)."""
        self.scanned.setdefault(layer_id, reason)

    def log_stock_extend(self, layer, reason: str) -> None:
        """One info line per reason: this extend call goes to the wrapped backend."""
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("GraniKV: extend of layer %d goes to the %s backend (%s)", layer.layer_id,
                        self.backend_name, reason)
