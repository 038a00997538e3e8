"""TP consistency (CPU part): simulated TP ranks take identical storage decisions.

Each ``Sim`` is one TP rank: its own pools with its share of the KV heads (and, for one rank,
other KV values), fed the same scheduler events (``ChurnWorkload`` applies each event to every
rank and asserts the same admissions, retractions and COLD evictions). After every event the
ranks must agree on: the order of executed promotions (node path, extent, adopted or
copied), HOT evictions and relocations of COLD KV out of a new extent's window, every HOT
node's extent (start, head, length), the promotion queue in order, the hot pool's gaps, the
free slot count, every HotPrefixTable row, and every metrics counter (bytes
copied per slot, since a slot's bytes differ per rank).
"""

from collections import Counter
from dataclasses import replace

import pytest
from churn_workload import ChurnWorkload

from support.scheduler_sim import Sim, SimConfig

CFG = SimConfig(kv_size=400, hot_fraction=0.5, max_reqs=16)
SEEDS = (0, 1, 2)
EVENTS = 1500


def record_decisions(sim: Sim) -> list:
    """Log, in order, every promotion, HOT eviction and relocation ``sim`` executes
    (wraps the instance's methods; behaviour unchanged)."""
    cache, log = sim.cache, []
    path = lambda n: tuple(t for m in cache._path(n) for t in m.key.token_ids)  # noqa: E731

    def materialize(node, placement, holders, _orig=cache._materialize):
        log.append(("promote", path(node), tuple(placement.ext), placement.adopted,
                    sorted(r.req_pool_idx for r in holders)))
        _orig(node, placement, holders)

    def release(node, _orig=cache._release_value):
        ext = cache.hot_extent_of(node)
        if ext is not None:
            log.append(("evict_hot", path(node), tuple(ext)))
        _orig(node)

    def relocate(start, n, dst, _orig=cache._relocate):
        log.append(("move", start, n, tuple(dst.tolist())))
        _orig(start, n, dst)

    cache._materialize, cache._release_value, cache._relocate = materialize, release, relocate
    return log


def run_ranks(ranks, seed: int = 0, events: int = EVENTS) -> list:
    logs = [record_decisions(sim) for sim in ranks]

    def same_decisions(event: str) -> None:
        states = [sim.hot_state() for sim in ranks]
        for r in range(1, len(ranks)):
            assert logs[r] == logs[0], f"after {event}: rank {r}'s decision log differs"
            for key in states[0]:
                assert states[r][key] == states[0][key], f"after {event}: rank {r}'s {key} differs"

    work = ChurnWorkload(ranks, seed, check=False)  # the soak checks integrity; here: decisions
    work.run(events, on_step=same_decisions)
    work.drain()
    same_decisions("drain")
    for sim in ranks:
        sim.assert_all_free()
    return logs[0]


def test_ranks_with_different_head_shares_and_kv_decide_identically():
    kinds = Counter()
    for seed in SEEDS:
        ranks = [Sim(replace(CFG, kv_heads=2)),  # rank 0: 2 KV heads
                 Sim(replace(CFG, kv_heads=1)),  # rank 1: 1 KV head (another head split)
                 Sim(replace(CFG, kv_heads=2, seed=9))]  # rank 2: same shape, other KV values
        assert not ranks[0].kv_table.equal(ranks[2].kv_table)
        kinds.update(entry[0] for entry in run_ranks(ranks, seed))
    print(f"\nTP consistency: {len(SEEDS)} seeds x {EVENTS} events x 3 ranks, identical "
          f"decisions: {dict(kinds)}")
    assert all(kinds[k] > 0 for k in ("promote", "evict_hot")), kinds  # all compared


def test_a_diverging_rank_is_caught():
    """The comparison has teeth: a rank with another promotion threshold diverges."""
    ranks = [Sim(CFG), Sim(replace(CFG, min_tokens=40))]
    with pytest.raises(AssertionError, match="differs|disagree"):
        run_ranks(ranks, events=300)
