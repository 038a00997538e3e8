"""Churn soak (CPU part): thousands of random scheduler events under a small slot
budget; ``check()`` (integrity + KV oracle) after every event; at the end everything drains
to free: every slot, every row, every lock, the HotPrefixTable, the promotion queue.

The budget (400 slots shared by COLD and HOT, HOT capped at 200, 16 rows, prompts of 20-66
tokens) makes the pool run out (requests refused and retracted), HOT reach its cap
(promotions skipped, HOT evictions) and the slot space fragment (new extents moving unlocked
COLD KV out of their window). One seed starts from a scattered free list, so promotions
copy there instead of adopting. The test fails if any fault class was never exercised.
``GRANIKV_SLOW_TESTS=1`` runs 10x more events.
"""

import os
from collections import Counter
from dataclasses import replace

from churn_workload import ChurnWorkload

from support.scheduler_sim import Sim, SimConfig

SLOW = os.environ.get("GRANIKV_SLOW_TESTS") == "1"
CFG = SimConfig(kv_size=400, hot_fraction=0.5, max_reqs=16)
SEEDS = (0, 1, 2)
EVENTS_PER_SEED = 10_000 if SLOW else 1_000

MUST_HAPPEN = (
    "events", "joins", "chunks", "decode_steps", "finished", "promotions", "hot_evictions",
    "hot_splits", "compactions", "shadow_head_tokens", "extended_in_place", "adopted",
    "skipped_no_space",
    "skipped_unknown_holders", "refused_no_cold_slots", "retracted_decode", "temp_locks",
    "rotations", "cold_evictions", "abort_waiting", "abort_pending",
    "abort_mid_chunked_prefill", "abort_decoding", "abort_after_promotion",
)


def soak(seed: int) -> Counter:
    sim = Sim(replace(CFG, seed=seed, shuffle_free=seed == 1))
    work = ChurnWorkload([sim], seed)
    work.run(EVENTS_PER_SEED)  # sim.check() after every event
    work.drain()
    sim.check()
    sim.assert_all_free()  # every slot free, no node, root lock only, table cleared
    assert not sim.cache.live_requests() and not sim.cache.has_pending_promotions()
    assert sim.req_pool.available_size() == CFG.max_reqs
    figures = Counter(work.figures())
    a = sim.allocator
    figures["leaked_slots"] += (a.size - a.available_size()) + a.hot_pool.used_size
    return figures


def test_churn_soak_drains_to_free_and_exercises_every_fault_class():
    total = Counter()
    for seed in SEEDS:
        total.update(soak(seed))
    print(f"\nchurn soak: {len(SEEDS)} seeds x {EVENTS_PER_SEED} events, {CFG.kv_size} KV slots "
          f"(hot_fraction {CFG.hot_fraction}), {CFG.max_reqs} rows; {dict(sorted(total.items()))}")
    assert total["leaked_slots"] == 0
    missing = [k for k in MUST_HAPPEN if total[k] == 0]
    assert not missing, f"fault classes never exercised: {missing} ({dict(total)})"
