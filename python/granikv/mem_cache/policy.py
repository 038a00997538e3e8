"""Promotion policies: which radix-tree node becomes HOT.

Deterministic by contract: a decision may depend only on tree state (lengths, lock counts,
hit counts), never on wall time or randomness, because each TP rank runs its own scheduler
and every rank must promote the same nodes at the same step.
"""


class PromotionPolicy:
    """Base class. ``should_promote`` is asked for a COLD child of the root."""

    def should_promote(self, node_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        raise NotImplementedError


class NeverPromote(PromotionPolicy):
    """Null policy: GraniKV storage without promotions (everything stays COLD)."""

    def should_promote(self, node_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        return False


class SharedLongPrefixPolicy(PromotionPolicy):
    """Promote a prefix of at least ``min_tokens`` held by at least ``min_sharers`` live
    requests (``num_sharers`` is the node's lock count: one per request whose path holds it)."""

    def __init__(self, *, min_tokens: int, min_sharers: int):
        if min_tokens < 1 or min_sharers < 1:
            raise ValueError(f"min_tokens={min_tokens} and min_sharers={min_sharers} must be >= 1")
        self.min_tokens = min_tokens
        self.min_sharers = min_sharers

    @classmethod
    def from_config(cls, config) -> "SharedLongPrefixPolicy":
        return cls(min_tokens=config.hot_min_tokens, min_sharers=config.hot_min_sharers)

    def should_promote(self, node_len: int, num_sharers: int, *, hit_count: int = 0) -> bool:
        return node_len >= self.min_tokens and num_sharers >= self.min_sharers

    def __repr__(self) -> str:
        return f"SharedLongPrefixPolicy(min_tokens={self.min_tokens}, min_sharers={self.min_sharers})"
