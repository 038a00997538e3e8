"""PromotionEstimate: what making a shared prefix HOT is worth, from the dispatcher's cost model.

The storage layer's ``PaysOffPolicy`` (mem_cache/policy.py) asks three questions; this class
answers them with the same ``CostModel`` and geometry the dispatcher decides with, so the
policy never promotes a prefix the dispatcher would not serve with the shared-prefix path.

``saving_us(P, g, context, within)``: the MARGINAL saving of one more HOT group in the step it
will be served in. ``context`` lists the step's other groups as ``(prefix_len, sharers)`` (HOT
groups with live holders, other candidates); ``within = (Pa, ga)``, if given, is the group
above the candidate on its path (``Pa < P`` tokens, ``ga`` sharers besides the candidate's),
which serves the candidate's requests without it. With ``T(X)`` the served time of that
batch when the groups ``X`` are HOT::

    T(X) = min(paged, step_time("cascade", X))      the dispatcher takes the cheaper, per step
    saving_us = T(context + [(Pa, ga + g)]) - T(context + [(Pa, ga), (P, g)])   all layers, one step
                (no ``within``: T(context) - T(context + [(P, g)]))

    batch: every sharer of every group (the candidate's too) reads its prefix and a typical
           ``suffix_tokens`` private suffix (not known at promotion); a context group with
           fewer than ``min_group_size`` sharers is never grouped, its requests count as
           ungrouped ones
    paged: the whole batch, each group's re-reads of its shared prefix included: a COLD
           shared prefix is one set of slots too (the radix tree shares it), so the paged
           kernel's L2 reuse does not depend on which groups are HOT
    T([]) = paged (no group: the stock step)

``step_time`` is the dispatcher's end-to-end step (``dispatcher`` module docstring): the same net
saving, with the host planning term at the cost model's prior ``served.host_plan_us`` and the
launch floors, so a prefix is not promoted where no step would pay them (e.g. a forest on a
model of few layers). The prior, not ``Dispatcher.host_plan``'s measurement: that is wall time,
different on every TP rank, and promotions must be decided alike on all of them.

So a cascade step's fixed costs (the wrapped backend's ``seq_len = 1`` call, the launches,
the merge, the host planning) are charged once per step, not once per group: in a forest of small groups each
member's marginal is positive once the others count, while a lone group that cannot beat the
paged step alone saves 0. Every input is an integer token count summed in any order, so the
answer does not depend on the context's order.

Forced paths: 0 when ``g < min_group_size`` or the forced path is paged, ``inf`` when a
shared-prefix path is forced (it serves every group it can).

``serves(g)``: whether some step could serve a group of ``g`` sharers with the shared-prefix
path at all (the policy's queue-time filter).

``copy_us(n)``: ``n`` tokens of KV read and written once per layer at the suffix kernels'
achieved bandwidth (a gather / scatter, like the paged suffix pass).

Only the CUDA-graph-safe ``cascade`` path is counted (the eager-only paths can only add).
Inputs are the model geometry per attention-TP rank, identical on every rank of a TP group
(heads split evenly), and the cost-model file: every rank gets the same answers.
"""

import math
from typing import Iterable, List, Optional, Sequence

from granikv.attention.cost.cost_model import Workload
from granikv.attention.dispatcher import Dispatcher, Path
from granikv.config import GraniKVConfig
from granikv.mem_cache.policy import Group


class PromotionEstimate:
    def __init__(self, dispatcher: Dispatcher, *, min_group_size: int, suffix_tokens: int = 256):
        if min_group_size < 1 or suffix_tokens < 0:
            raise ValueError(f"min_group_size={min_group_size} must be >= 1 and "
                             f"suffix_tokens={suffix_tokens} >= 0")
        self.dispatcher = dispatcher
        self.min_group_size = min_group_size
        self.suffix_tokens = suffix_tokens

    @classmethod
    def from_config(cls, dispatcher: Dispatcher, cfg: GraniKVConfig) -> "PromotionEstimate":
        return cls(dispatcher, min_group_size=cfg.min_group_size)

    def serves(self, num_sharers: int) -> bool:
        d = self.dispatcher
        if num_sharers < self.min_group_size or d.forced is Path.PAGED:
            return False
        return d.forced is not None or "cascade" not in d.cost_model.disabled_paths

    def saving_us(self, prefix_len: int, num_sharers: int, context: Iterable[Group] = (),
                  within: Optional[Group] = None) -> float:
        if not self.serves(num_sharers):
            return 0.0
        if self.dispatcher.forced is not None:
            return math.inf
        cand = (int(prefix_len), int(num_sharers))
        others = [(int(p), int(s)) for p, s in context if p > 0 and s > 0]
        up = [] if within is None else [(int(within[0]), int(within[1]))]
        batch = [x for x in others + up if x[1] > 0] + [cand]
        grouped = self._grouped(others)
        paged = self._paged_us(batch)
        without = grouped + self._grouped([(p, s + cand[1]) for p, s in up])
        with_it = grouped + self._grouped(up) + [cand]
        return self._served_us(batch, without, paged) - self._served_us(batch, with_it, paged)

    def copy_us(self, num_tokens: int) -> float:
        d = self.dispatcher
        nbytes = 2 * num_tokens * d.geometry.kv_bytes_per_token * d.num_layers  # read + write
        return nbytes / (d.cost_model.suffix_gbps * 1e3)

    # ---- the served step of a batch ------------------------------------------------------

    def _workload(self, batch: Sequence[Group], grouped: Sequence[Group]) -> Workload:
        return Workload.from_sums(
            self.dispatcher.geometry,
            batch_size=sum(s for _, s in batch),
            seq_tokens=sum(s * (p + self.suffix_tokens) for p, s in batch),
            prefix_tokens=sum(p for p, _ in grouped),
            stacked_prefix_tokens=sum(p * s for p, s in grouped),
            num_grouped=sum(s for _, s in grouped),
            num_groups=len(grouped),
        )

    def _grouped(self, groups: Sequence[Group]) -> List[Group]:
        return [(p, s) for p, s in groups if p > 0 and s >= self.min_group_size]

    def _served_us(self, batch: Sequence[Group], grouped: Sequence[Group], paged: float) -> float:
        return min(paged, self._cascade_us(batch, grouped)) if grouped else paged

    def _paged_us(self, batch: Sequence[Group]) -> float:
        d = self.dispatcher
        return d.cost_model.paged_time(self._workload(batch, batch), num_layers=d.num_layers)

    def _cascade_us(self, batch: Sequence[Group], grouped: Sequence[Group]) -> float:
        d = self.dispatcher
        return d.cost_model.step_time("cascade", self._workload(batch, grouped), num_layers=d.num_layers,
                                      host_plan_us=d.cost_model.served.host_plan_us)  # the prior (TP ranks alike)
