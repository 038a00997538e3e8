"""Scenario tests: real SGLang pools + GraniKV cache, KV checked bit-exact through every row."""

import random

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from granikv.mem_cache.hot_pool import IntegrityError
from granikv.mem_cache.radix_cache import GraniKVRadixCache
from support.scheduler_sim import Sim, SimConfig


def _tokens(seed, n, vocab=61):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


P = _tokens(1, 41)  # the shared prefix (odd length on purpose)


def _share(sim, prefix, k, first_suffix=100):
    return [sim.admit(prefix + [(first_suffix + i) % 61, i % 61]) for i in range(k)]


def test_promotion_rewrites_rows_and_frees_cold_slots():
    sim = Sim(SimConfig(shuffle_free=True))  # scattered slots: the prefix is copied
    reqs = _share(sim, P, 3)
    views = [sim.request_view(r).clone() for r in reqs]
    free_before = sim.allocator.available_size()
    assert sim.promote() == 1
    sim.check()
    node = reqs[0].last_node.parent
    ext = sim.cache.hot_extent_of(node)
    start, n = ext.start, ext.length
    assert ext.head == 0 and n == len(P)  # a root child
    # the extent came off the free list and the old COLD slots went back to it
    assert sim.allocator.available_size() == free_before
    for r, v in zip(reqs, views):
        assert torch.equal(sim.request_view(r), v)
        assert sim.cache.hot_prefix_table.get(r.req_pool_idx) == (start, len(P))
        assert torch.equal(r.prefix_indices[: len(P)], torch.arange(start, start + len(P)))
    m = sim.cache.metrics
    assert (m.promotions, m.adopted, m.rows_rewritten) == (1, 0, 3)
    assert m.bytes_copied == len(P) * 2 * 2 * 2 * 4 * 2  # layers * K/V * heads * dim * bf16


def test_contiguous_prefix_is_adopted_without_a_copy():
    sim = Sim()  # fresh free list: the prefill's slots are contiguous
    reqs = _share(sim, P, 3)
    node = reqs[0].last_node.parent
    own = node.value.clone()
    free_before = sim.allocator.available_size()
    assert sim.promote() == 1
    sim.check()
    ext = sim.cache.hot_extent_of(node)
    assert torch.equal(own, torch.arange(ext.start, ext.start + len(P))) and ext.head == 0
    m = sim.cache.metrics
    assert (m.adopted, m.bytes_copied) == (1, 0)
    assert sim.allocator.available_size() == free_before  # nothing taken, nothing freed
    for r in reqs:
        assert sim.cache.hot_prefix_table.get(r.req_pool_idx) == (ext.start, len(P))


def test_new_requests_match_hot_slots_and_decode_continues():
    sim = Sim()
    reqs = _share(sim, P, 2)
    sim.promote()
    late = sim.admit(P + [7, 8, 9])
    assert sim.cache.hot_run(late)[1] == len(P)
    for step in range(5):
        for r in reqs + [late]:
            assert sim.decode(r, (step * 7) % 61)
        sim.check()
    for r in reqs:
        sim.finish(r)
        sim.check()
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_split_of_a_hot_node_keeps_both_halves_hot_and_contiguous():
    sim = Sim()
    reqs = _share(sim, P, 2)
    sim.promote()
    start, _ = sim.cache.hot_run(reqs[0])
    partial = sim.admit(P[:17] + [3, 3, 3])  # shares only 17 tokens: splits the HOT node
    sim.check()
    assert sim.cache.metrics.hot_splits == 1
    assert sim.cache.hot_run(partial) == (start, 17)
    assert sim.cache.hot_run(reqs[0]) == (start, len(P))  # two contiguous halves
    assert sim.allocator.hot_pool.extents() == {start: 17, start + 17: len(P) - 17}
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_eviction_frees_hot_and_cold_leaves_into_one_pool():
    sim = Sim(SimConfig(shuffle_free=True))
    reqs = _share(sim, P, 2)
    sim.promote()
    for r in reqs:
        sim.finish(r)
    assert sim.cache.hot_evictable_size() == len(P)
    assert sim.cache.evictable_size() == len(P) + 4  # SGLang's admission sees HOT slots too
    assert sim.evict(4) == 4  # LRU leaves: the two COLD suffixes first
    assert sim.allocator.hot_pool.used_size == len(P)
    assert sim.evict(1) == len(P)  # then the HOT node, its whole extent
    sim.check()
    sim.assert_all_free()
    assert sim.cache.metrics.hot_evictions == 1


def test_hot_eviction_takes_the_cold_leaves_below():
    sim = Sim(SimConfig(shuffle_free=True))
    reqs = _share(sim, P, 2)
    sim.promote()
    for r in reqs:
        sim.finish(r)
    assert sim.cache.evict_hot(1) == len(P)  # counts HOT slots; the suffixes went first
    sim.check()
    sim.assert_all_free()


def test_locked_hot_nodes_are_never_evicted():
    sim = Sim()
    reqs = _share(sim, P, 2)
    sim.promote()
    assert sim.cache.evict_hot(1 << 20) == 0
    assert sim.cache.hot_protected_size() == len(P)
    sim.check()
    del reqs


def _promote_groups(sim, seqs):
    groups = []
    for s in seqs:
        groups.append(_share(sim, s, 2))
        assert sim.promote() == 1
    return groups


def test_new_extent_moves_unlocked_cold_kv_out_of_its_window():
    sim = Sim(SimConfig(kv_size=200, max_reqs=10, shuffle_free=True, hot_fraction=1.0))
    for i in range(6):  # 126 slots of unlocked cached KV, scattered over the pool
        sim.finish(sim.admit(_tokens(60 + i, 21)))
    big = _tokens(70, 45)
    reqs = _share(sim, big, 2)  # no free run of 45 slots is left
    assert sim.promote() == 1
    sim.check()  # every node's KV, moved or not, is checked against the oracle
    m = sim.cache.metrics
    assert m.compactions == 1 and m.compaction_moves > 0
    assert sim.cache.hot_run(reqs[0])[1] == 45
    sim.drain()
    sim.assert_all_free()


def test_no_space_when_live_requests_hold_the_slots():
    sim = Sim(SimConfig(kv_size=150, max_reqs=12, shuffle_free=True, hot_fraction=1.0))
    _share(sim, P, 2)
    while sim.allocator.available_size() >= 20:
        assert sim.admit(_tokens(80 + sim.allocator.available_size(), 19)) is not None
    assert sim.promote() == 0
    assert sim.cache.metrics.skip_reasons["no_space"] == 1
    sim.check()
    sim.drain()
    sim.assert_all_free()


def test_hot_cap_evicts_unlocked_extents_then_skips():
    sim = Sim(SimConfig(kv_size=300, hot_fraction=0.15, min_tokens=16, shuffle_free=True))  # cap 45
    a = _share(sim, _tokens(40, 30), 2)
    assert sim.promote() == 1
    b = _share(sim, _tokens(41, 30), 2)
    assert sim.promote() == 0  # a is locked: over the cap
    assert sim.cache.metrics.skip_reasons["hot_cap"] == 1
    for r in a:
        sim.finish(r)
    sim.lock(_tokens(41, 30) + [0])  # re-queue b's promotion (a new admission lock)
    sim.unlock()
    assert sim.promote() == 1  # a (unlocked) is LRU-evicted to make room under the cap
    m = sim.cache.metrics
    assert (m.hot_evictions, sim.allocator.hot_used) == (1, 30)
    sim.check()
    del b
    sim.drain()
    sim.assert_all_free()


def test_too_large_for_the_cap():
    sim = Sim(SimConfig(hot_fraction=0.1))  # cap 38 < len(P)
    _share(sim, P, 2)
    assert sim.promote() == 0
    assert sim.cache.metrics.skip_reasons["too_large"] == 1
    sim.check()



def test_temporary_lock_blocks_promotion_safely():
    sim = Sim()
    reqs = _share(sim, P, 2)
    sim.lock(P + [0])
    assert sim.promote() == 0
    assert sim.cache.metrics.skip_reasons["unknown_holders"] == 1
    sim.check()
    sim.unlock()
    sim.admit(P + [5, 5])  # re-queues: now 3 registered holders, no stray lock
    assert sim.promote() == 1
    sim.check()
    del reqs


def test_unregistered_request_blocks_promotion():
    sim = Sim()
    _share(sim, P, 2)
    late = sim.prefill_begin(P + [2, 2], register=False)  # the plugin never saw its row
    assert sim.promote() == 0 and sim.cache.has_pending_promotions()  # deferred, not dropped
    assert sim.cache.metrics.skip_reasons["unknown_holders"] == 1
    assert sim.cache.apply_pending_promotions(register=[late]) == 1  # registered first
    sim.prefill_end(late)
    sim.check()


def test_promotion_between_allocation_and_forward():
    """The plugin's order: alloc_for_extend -> update_request_hot_prefix -> promote -> forward."""
    sim = Sim()
    first = sim.admit(P + [1, 1])
    late = sim.prefill_begin(P + [2, 2, 2])  # matched P's node (COLD), its row points at it
    assert sim.promote() == 1  # rewrites late's row and prefix_indices before its forward
    sim.prefill_end(late)
    sim.check()
    start, n = sim.cache.hot_run(late)
    assert n == len(P) and sim.cache.hot_run(first) == (start, n)
    assert torch.equal(late.prefix_indices[:n], torch.arange(start, start + n))


def test_prefix_larger_than_hot_region_is_skipped():
    sim = Sim(SimConfig(kv_size=200, hot_fraction=0.1, min_tokens=16))  # HOT capacity 20
    _share(sim, P, 2)
    assert sim.promote() == 0
    assert sim.cache.metrics.skip_reasons["too_large"] == 1
    sim.check()
    sim.drain()
    sim.assert_all_free()


def test_abort_and_retract_release_everything():
    sim = Sim(SimConfig(kv_size=160, hot_fraction=0.5))  # 80 COLD slots
    reqs = _share(sim, P, 2)
    sim.promote()
    r = reqs[0]
    while sim.decode(r, 5):  # runs COLD dry: the request is retracted
        pass
    assert r.req_pool_idx is None
    sim.check()
    sim.abort(reqs[1])
    sim.check()
    sim.drain()
    sim.assert_all_free()


def test_reset_releases_hot_extents():
    sim = Sim()
    _share(sim, P, 2)
    sim.promote()
    sim.cache.reset()
    assert sim.allocator.hot_pool.used_size == 0 and not sim.cache.live_requests()


def test_integrity_reports_a_leaked_slot():
    sim = Sim()
    _share(sim, P, 2)
    sim.allocator.alloc(1)  # nobody owns it
    with pytest.raises(IntegrityError, match="leaked"):
        sim.cache.check_integrity()


def test_constructor_rejects_stock_allocator():
    sim = Sim()
    stock = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", sim.kv_pool, False)
    params = CacheInitParams(disable=False, req_to_token_pool=sim.req_pool,
                             token_to_kv_pool_allocator=stock, page_size=1)
    with pytest.raises(ValueError, match="GraniKVAllocator"):
        GraniKVRadixCache.create(params, sim.config, sim.kv_pool)
