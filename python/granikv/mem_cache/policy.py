"""Promotion policies: which radix-tree node becomes HOT.

Deterministic by contract: a decision may depend only on tree state (lengths, lock counts,
hit counts, HOT flags), the holders' requests (their remaining decode budget) and
rank-independent configuration (the cost model), never on wall time or randomness, because
each TP rank runs its own scheduler and every rank must promote the same nodes at the same step.

The radix cache asks the policy about the nodes of a locked path, deepest first, and queues
the deepest node ``may_promote`` accepts (the holders and the rest of the step are not known
yet):

    root ── h (4) ── A (chunk 1) ── B (chunk 2) ── s1 (agent suffix)
                                                └─ s2
    may_promote(prefix_len = 4 + |A| + |B|, num_sharers = lock_ref(B)) -> B is the candidate

Before executing the queued promotions it asks ``should_promote`` once per candidate, with the
holders' expected remaining decode steps and the ``context``: the step's other groups as
``(prefix_len, sharers)`` pairs (HOT groups with live holders, the other queued candidates
that pass ``may_promote`` and fit the HOT cap beside it; mem_cache/step_context.py builds it
from the tree) and ``within``:
the group above the candidate on its path that serves its holders without it, if any. A
policy that prices a promotion in its step (``uses_context``) sees what the candidate adds to
a step that already serves the others.
"""

import math
from typing import TYPE_CHECKING, Iterable, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from granikv.config import GraniKVConfig

Group = Tuple[int, int]  # (prefix_len, sharers) of one group of a step


class PromotionPolicy:
    """Base class. ``should_promote`` is asked for a node of a locked path.

    ``prefix_len``: tokens from the root through the node (the shared prefix the promotion
    would make HOT, its ancestors included); ``num_sharers``: the node's lock count (one per
    live request whose path holds it); ``hit_count``: SGLang's per-node hit counter;
    ``remaining_steps``: the decode steps the holders are still expected to run (mean over
    them), ``None`` when not known; ``context`` / ``within``: the step's other groups and the
    group above the candidate (module docstring), only built for a policy with ``uses_context``.
    """

    uses_context = False

    def may_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        """Queue-time filter (holders and step unknown). Default: ``should_promote`` alone."""
        return self.should_promote(prefix_len, num_sharers, hit_count=hit_count)

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None,
                       context: Iterable[Group] = (), within: Optional[Group] = None) -> bool:
        raise NotImplementedError


class NeverPromote(PromotionPolicy):
    """Null policy: GraniKV storage without promotions (everything stays COLD)."""

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None,
                       context: Iterable[Group] = (), within: Optional[Group] = None) -> bool:
        return False


class SharedLongPrefixPolicy(PromotionPolicy):
    """Promote a prefix of at least ``min_tokens`` (from the root) held by at least
    ``min_sharers`` live requests."""

    def __init__(self, *, min_tokens: int, min_sharers: int) -> None:
        if min_tokens < 1 or min_sharers < 1:
            raise ValueError(f"min_tokens={min_tokens} and min_sharers={min_sharers} must be >= 1")
        self.min_tokens = min_tokens
        self.min_sharers = min_sharers

    @classmethod
    def from_config(cls, config: "GraniKVConfig") -> "SharedLongPrefixPolicy":
        return cls(min_tokens=config.hot_min_tokens, min_sharers=config.hot_min_sharers)

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None,
                       context: Iterable[Group] = (), within: Optional[Group] = None) -> bool:
        return prefix_len >= self.min_tokens and num_sharers >= self.min_sharers

    def __repr__(self) -> str:
        return f"SharedLongPrefixPolicy(min_tokens={self.min_tokens}, min_sharers={self.min_sharers})"


class DecodeSavingEstimate(Protocol):
    """What a promotion is worth, from the attention layer's cost model (passed in by the
    plugin wiring: the storage layer does not import the dispatcher). Microseconds."""

    def serves(self, num_sharers: int) -> bool:
        """Whether some step could serve a group of ``num_sharers`` requests with the
        shared-prefix path (not: too few to group, a forced paged path, calibration disabled it)."""

    def saving_us(self, prefix_len: int, num_sharers: int, context: Iterable[Group] = (),
                  within: Optional[Group] = None) -> float:
        """Decode time saved per step (all layers) by ``num_sharers`` requests reading a HOT
        prefix of ``prefix_len`` tokens through the shared-prefix path, in a step whose other
        groups are ``context`` (the marginal: the step with the group HOT against without;
        ``within``: the group that serves the requests without it, with its other sharers);
        ``<= 0`` when the dispatcher would not serve such a step with it. Independent of the
        context's order."""

    def copy_us(self, num_tokens: int) -> float:
        """Time to copy ``num_tokens`` tokens of KV (all layers) into an extent."""


class PaysOffPolicy(PromotionPolicy):
    """Promote when the estimated decode-time saving, in the step the prefix will be served
    in, pays for the promotion.

        saving_us(prefix_len, sharers, context, within) * steps  >  copy_us(prefix_len) + slot_us * prefix_len

    ``steps`` = the holders' expected remaining decode steps (``default_steps`` when not
    known); ``copy_us`` is the worst case (a promotion that adopts the node's own slots copies
    less); ``slot_us`` charges each slot the extent holds (0: HOT slots are evictable like
    any cached KV). ``min_tokens`` / ``min_sharers`` stay hard floors. A prefix the
    dispatcher would never serve with the shared-prefix path (``saving_us <= 0``: too short,
    too few sharers, a forced paged path) is never promoted; ``may_promote`` (queue time)
    checks the floors and ``serves`` only, since whether a small group pays depends on the
    groups it will be served with.
    """

    uses_context = True

    def __init__(self, estimate: DecodeSavingEstimate, *, min_tokens: int, min_sharers: int,
                 default_steps: float, slot_us: float = 0.0) -> None:
        if default_steps <= 0 or slot_us < 0:
            raise ValueError(f"default_steps={default_steps} must be > 0 and slot_us={slot_us} >= 0")
        self.floor = SharedLongPrefixPolicy(min_tokens=min_tokens, min_sharers=min_sharers)
        self.estimate = estimate
        self.default_steps = default_steps
        self.slot_us = slot_us

    @classmethod
    def from_config(cls, config: "GraniKVConfig", estimate: DecodeSavingEstimate) -> "PaysOffPolicy":
        return cls(estimate, min_tokens=config.hot_min_tokens, min_sharers=config.hot_min_sharers,
                   default_steps=config.hot_expected_decode_steps)

    def may_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        return self.floor.should_promote(prefix_len, num_sharers) and self.estimate.serves(num_sharers)

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None,
                       context: Iterable[Group] = (), within: Optional[Group] = None) -> bool:
        if not self.floor.should_promote(prefix_len, num_sharers):
            return False
        saving = self.estimate.saving_us(prefix_len, num_sharers, context=context, within=within)
        if not saving > 0:
            return False
        if math.isinf(saving):
            return True
        steps = self.default_steps if remaining_steps is None else remaining_steps
        cost = self.estimate.copy_us(prefix_len) + self.slot_us * prefix_len
        return saving * steps > cost

    def __repr__(self) -> str:
        return (f"PaysOffPolicy(min_tokens={self.floor.min_tokens}, "
                f"min_sharers={self.floor.min_sharers}, default_steps={self.default_steps})")
