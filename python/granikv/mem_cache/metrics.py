"""GraniKVMetrics: counters and gauges of the storage layer (plain data, no behaviour)."""

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict


@dataclass
class GraniKVMetrics:
    # gauges (refreshed by GraniKVRadixCache.refresh_gauges)
    hot_extents: int = 0
    hot_used_tokens: int = 0
    hot_capacity: int = 0
    cold_used_tokens: int = 0
    cold_capacity: int = 0
    # counters
    promotions: int = 0
    promotions_skipped: int = 0
    skip_reasons: Counter = field(default_factory=Counter)
    promoted_tokens: int = 0  # node tokens made HOT (shadow heads not included)
    shadow_head_tokens: int = 0  # ancestor tokens copied in front of promoted nodes
    extended_in_place: int = 0  # promotions placed right after the parent's HOT run (no head)
    adopted: int = 0  # promotions whose node kept its own contiguous slots (no node KV copied)
    hot_evictions: int = 0
    hot_evicted_tokens: int = 0
    hot_splits: int = 0
    compactions: int = 0  # windows cleared of unlocked COLD KV for a new extent
    compaction_moves: int = 0  # slots of KV those moves relocated
    rows_rewritten: int = 0
    bytes_copied: int = 0
    tp_checks: int = 0  # cross-rank fingerprint comparisons (tp_consistency.py)
    tp_divergences: int = 0  # comparisons that found ranks disagreeing (promotions then frozen)

    def skip(self, reason: str) -> None:
        self.promotions_skipped += 1
        self.skip_reasons[reason] += 1

    def snapshot(self) -> Dict[str, object]:
        snap = dataclasses.asdict(self)
        snap["skip_reasons"] = dict(self.skip_reasons)
        return snap

    def format(self) -> str:
        hot_pct = 100.0 * self.hot_used_tokens / max(self.hot_capacity, 1)
        cold_pct = 100.0 * self.cold_used_tokens / max(self.cold_capacity, 1)
        return (
            f"GraniKV: hot {self.hot_used_tokens}/{self.hot_capacity} ({hot_pct:.1f}%) "
            f"in {self.hot_extents} extents, cold {self.cold_used_tokens}/{self.cold_capacity} "
            f"({cold_pct:.1f}%), promotions {self.promotions} (adopted {self.adopted}, "
            f"in place {self.extended_in_place}, "
            f"skipped {self.promotions_skipped}), "
            f"hot evictions {self.hot_evictions}, splits {self.hot_splits}, "
            f"compactions {self.compactions}, copied {self.bytes_copied / 2**20:.1f} MiB"
        )
