"""Promotion policies: which radix-tree node becomes HOT.

Deterministic by contract: a decision may depend only on tree state (lengths, lock counts,
hit counts), the holders' requests (their remaining decode budget) and rank-independent
configuration (the cost model), never on wall time or randomness, because each TP rank runs
its own scheduler and every rank must promote the same nodes at the same step.

The radix cache asks the policy about the nodes of a locked path, deepest first, and promotes
the deepest node it accepts:

    root ── h (4) ── A (chunk 1) ── B (chunk 2) ── s1 (agent suffix)
                                                └─ s2
    should_promote(prefix_len = 4 + |A| + |B|, num_sharers = lock_ref(B)) -> B is the candidate

It asks once when queueing (``remaining_steps=None``: the holders are not known yet) and once
more before executing, with the holders' expected remaining decode steps.
"""

import math
from typing import Optional, Protocol


class PromotionPolicy:
    """Base class. ``should_promote`` is asked for a node of a locked path.

    ``prefix_len``: tokens from the root through the node (the shared prefix the promotion
    would make HOT, its ancestors included); ``num_sharers``: the node's lock count (one per
    live request whose path holds it); ``hit_count``: SGLang's per-node hit counter;
    ``remaining_steps``: the decode steps the holders are still expected to run (mean over
    them), ``None`` when not known.
    """

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None) -> bool:
        raise NotImplementedError


class NeverPromote(PromotionPolicy):
    """Null policy: GraniKV storage without promotions (everything stays COLD)."""

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None) -> bool:
        return False


class SharedLongPrefixPolicy(PromotionPolicy):
    """Promote a prefix of at least ``min_tokens`` (from the root) held by at least
    ``min_sharers`` live requests."""

    def __init__(self, *, min_tokens: int, min_sharers: int):
        if min_tokens < 1 or min_sharers < 1:
            raise ValueError(f"min_tokens={min_tokens} and min_sharers={min_sharers} must be >= 1")
        self.min_tokens = min_tokens
        self.min_sharers = min_sharers

    @classmethod
    def from_config(cls, config) -> "SharedLongPrefixPolicy":
        return cls(min_tokens=config.hot_min_tokens, min_sharers=config.hot_min_sharers)

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None) -> bool:
        return prefix_len >= self.min_tokens and num_sharers >= self.min_sharers

    def __repr__(self) -> str:
        return f"SharedLongPrefixPolicy(min_tokens={self.min_tokens}, min_sharers={self.min_sharers})"


class PromotionEstimate(Protocol):
    """What a promotion is worth, from the attention layer's cost model (passed in by the
    plugin wiring: the storage layer does not import the dispatcher). Microseconds."""

    def saving_us(self, prefix_len: int, num_sharers: int) -> float:
        """Decode time saved per step (all layers) when ``num_sharers`` requests read a HOT
        prefix of ``prefix_len`` tokens through the shared-prefix path instead of paged;
        ``<= 0`` when the dispatcher would not serve such a group with it."""

    def copy_us(self, num_tokens: int) -> float:
        """Time to copy ``num_tokens`` tokens of KV (all layers) into an extent."""


class PaysOffPolicy(PromotionPolicy):
    """Promote when the estimated decode-time saving pays for the promotion.

        saving_us(prefix_len, sharers) * steps  >  copy_us(prefix_len) + slot_us * prefix_len

    ``steps`` = the holders' expected remaining decode steps (``default_steps`` when not
    known); ``copy_us`` is the worst case (a promotion that adopts the node's own slots copies
    less); ``slot_us`` charges each slot the extent holds (0: HOT slots are evictable like
    any cached KV). ``min_tokens`` / ``min_sharers`` stay hard floors. A prefix the
    dispatcher would never serve with the shared-prefix path (``saving_us <= 0``: too short,
    too few sharers, a forced paged path) is never promoted.
    """

    def __init__(self, estimate: PromotionEstimate, *, min_tokens: int, min_sharers: int,
                 default_steps: float, slot_us: float = 0.0):
        if default_steps <= 0 or slot_us < 0:
            raise ValueError(f"default_steps={default_steps} must be > 0 and slot_us={slot_us} >= 0")
        self.floor = SharedLongPrefixPolicy(min_tokens=min_tokens, min_sharers=min_sharers)
        self.estimate = estimate
        self.default_steps = default_steps
        self.slot_us = slot_us

    @classmethod
    def from_config(cls, config, estimate: PromotionEstimate) -> "PaysOffPolicy":
        return cls(estimate, min_tokens=config.hot_min_tokens, min_sharers=config.hot_min_sharers,
                   default_steps=config.hot_expected_decode_steps)

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0,
                       remaining_steps: Optional[float] = None) -> bool:
        if not self.floor.should_promote(prefix_len, num_sharers):
            return False
        saving = self.estimate.saving_us(prefix_len, num_sharers)
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
