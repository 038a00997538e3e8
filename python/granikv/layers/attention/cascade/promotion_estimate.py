"""PromotionEstimate: what making a shared prefix HOT is worth, from the dispatcher's cost model.

The storage layer's ``PaysOffPolicy`` (mem_cache/policy.py) asks two questions; this class
answers them with the same ``CostModel`` and geometry the dispatcher decides with, so the
policy never promotes a prefix the dispatcher would not serve with the shared-prefix path:

    saving_us(P, g) = paged_time(w) - step_time("cascade", w)   all layers, one served step
        w: one group of g requests sharing a P-token HOT prefix, each with a
           ``suffix_tokens`` private suffix (a typical agent suffix; not known at promotion)
        0 when g < min_group_size (never grouped) or the forced path is paged;
        inf when a shared-prefix path is forced (it serves every group it can)
    copy_us(n) = n tokens of KV read and written once per layer at the suffix kernels'
        achieved bandwidth (a gather / scatter, like the paged suffix pass)

Only the CUDA-graph-safe ``cascade`` path is counted (the eager-only paths can only add).
Inputs are the model geometry per attention-TP rank, identical on every rank of a TP group
(heads split evenly), and the cost-model file: every rank gets the same answers.
"""

import math

from granikv.layers.attention.cascade.cost_model import Workload
from granikv.layers.attention.cascade.dispatcher import Dispatcher, Path


class PromotionEstimate:
    def __init__(self, dispatcher: Dispatcher, *, min_group_size: int, suffix_tokens: int = 256):
        if min_group_size < 1 or suffix_tokens < 0:
            raise ValueError(f"min_group_size={min_group_size} must be >= 1 and "
                             f"suffix_tokens={suffix_tokens} >= 0")
        self.dispatcher = dispatcher
        self.min_group_size = min_group_size
        self.suffix_tokens = suffix_tokens

    @classmethod
    def from_config(cls, dispatcher: Dispatcher, cfg) -> "PromotionEstimate":
        return cls(dispatcher, min_group_size=cfg.min_group_size)

    def saving_us(self, prefix_len: int, num_sharers: int) -> float:
        d = self.dispatcher
        if num_sharers < self.min_group_size or d.forced is Path.PAGED:
            return 0.0
        if d.forced is not None:
            return math.inf
        if "cascade" in d.cost_model.disabled_paths:
            return 0.0
        g, p = num_sharers, prefix_len
        w = Workload.from_sums(d.geometry, batch_size=g, seq_tokens=g * (p + self.suffix_tokens),
                               prefix_tokens=p, stacked_prefix_tokens=g * p, num_grouped=g,
                               num_groups=1)
        cm, n = d.cost_model, d.num_layers
        return cm.paged_time(w, num_layers=n) - cm.step_time("cascade", w, num_layers=n)

    def copy_us(self, num_tokens: int) -> float:
        d = self.dispatcher
        nbytes = 2 * num_tokens * d.geometry.kv_bytes_per_token * d.num_layers  # read + write
        return nbytes / (d.cost_model.suffix_gbps * 1e3)
