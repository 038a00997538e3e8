"""Promotion policies: which radix-tree node becomes HOT.

Deterministic by contract: a decision may depend only on tree state (lengths, lock counts,
hit counts), never on wall time or randomness, because each TP rank runs its own scheduler
and every rank must promote the same nodes at the same step.

The radix cache asks the policy about the nodes of a locked path, deepest first, and promotes
the deepest node it accepts:

    root ── h (4) ── A (chunk 1) ── B (chunk 2) ── s1 (agent suffix)
                                                └─ s2
    should_promote(prefix_len = 4 + |A| + |B|, num_sharers = lock_ref(B)) -> B is the candidate
"""


class PromotionPolicy:
    """Base class. ``should_promote`` is asked for a node of a locked path.

    ``prefix_len``: tokens from the root through the node (the shared prefix the promotion
    would make HOT, its ancestors included); ``num_sharers``: the node's lock count (one per
    live request whose path holds it); ``hit_count``: SGLang's per-node hit counter.
    """

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        raise NotImplementedError


class NeverPromote(PromotionPolicy):
    """Null policy: GraniKV storage without promotions (everything stays COLD)."""

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
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

    def should_promote(self, prefix_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        return prefix_len >= self.min_tokens and num_sharers >= self.min_sharers

    def __repr__(self) -> str:
        return f"SharedLongPrefixPolicy(min_tokens={self.min_tokens}, min_sharers={self.min_sharers})"
