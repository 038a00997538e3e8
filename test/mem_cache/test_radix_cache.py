"""Scenario tests: real SGLang pools + GraniKV cache, KV checked bit-exact through every row."""

import random

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from granikv.mem_cache.hot_pool import IntegrityError
from granikv.mem_cache.radix_cache import GraniKVRadixCache
from scheduler_sim import Sim, SimConfig


def _tokens(seed, n, vocab=61):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


P = _tokens(1, 41)  # the shared prefix (odd length on purpose)


def _share(sim, prefix, k, first_suffix=100):
    return [sim.admit(prefix + [(first_suffix + i) % 61, i % 61]) for i in range(k)]


def test_promotion_rewrites_rows_and_frees_cold_slots():
    sim = Sim()
    reqs = _share(sim, P, 3)
    views = [sim.request_view(r).clone() for r in reqs]
    cold_before = sim.allocator.available_size()
    assert sim.promote() == 1
    sim.check()
    node = reqs[0].last_node.parent
    ext = sim.cache.hot_extent_of(node)
    start, n = ext.start, ext.length
    assert ext.head == 0 and n == len(P) and start >= sim.allocator.hot_base  # a root child
    assert sim.allocator.available_size() == cold_before + len(P)
    for r, v in zip(reqs, views):
        assert torch.equal(sim.request_view(r), v)
        assert sim.cache.hot_prefix_table.get(r.req_pool_idx) == (start, len(P))
        assert torch.equal(r.prefix_indices[: len(P)], torch.arange(start, start + len(P)))
    m = sim.cache.metrics
    assert (m.promotions, m.rows_rewritten) == (1, 3)
    assert m.bytes_copied == len(P) * 2 * 2 * 2 * 4 * 2  # layers * K/V * heads * dim * bf16


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


def test_cold_eviction_spares_hot_nodes_and_hot_eviction_frees_extents():
    sim = Sim()
    reqs = _share(sim, P, 2)
    sim.promote()
    for r in reqs:
        sim.finish(r)
    assert sim.cache.hot_evictable_size() == len(P)
    assert sim.cache.evictable_size() == 4  # the two 2-token COLD suffixes
    assert sim.evict(1 << 20) == 4
    sim.check()
    assert sim.allocator.hot_pool.used_size == len(P)
    assert sim.cache.evict_hot(1) == len(P)
    sim.check()
    sim.assert_all_free()
    assert sim.cache.metrics.hot_evictions == 1


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


def test_compaction_moves_unlocked_extents_and_keeps_their_kv():
    sim = Sim(SimConfig(kv_size=300, hot_fraction=0.4, min_tokens=16))  # HOT capacity 120
    a, b, c = _promote_groups(sim, [_tokens(11, 30), _tokens(12, 50), _tokens(13, 30)])
    h = sim.allocator.hot_base
    for r in a + c:
        sim.finish(r)  # a@h and c@h+80 unlocked but cached; b@h+30 locked
    sim.evict(1 << 20)  # COLD suffixes only
    assert sim.allocator.hot_pool.extents() == {h: 30, h + 30: 50, h + 80: 30}
    for r in b:
        sim.finish(r)
    sim.admit(_tokens(12, 50) + [1, 2])  # b locked again; a, c stay unlocked
    sim.evict(1 << 20)
    sim.cache.evict_hot(1)  # LRU: a goes (c was used later) -> holes 30 @h, 10 @h+110
    assert sim.allocator.hot_pool.extents() == {h + 30: 50, h + 80: 30}
    d = _share(sim, _tokens(14, 35), 2)  # 35 contiguous: compaction cannot (b is locked)
    assert sim.promote() == 1  # so c (LRU, unlocked) is evicted, then it fits
    sim.check()
    assert sim.cache.hot_run(d[0])[1] == 35
    assert sim.cache.metrics.hot_evictions == 2
    sim.drain()
    sim.assert_all_free()


def test_compaction_when_holes_are_fragmented():
    sim = Sim(SimConfig(kv_size=300, hot_fraction=0.4, min_tokens=16))  # HOT capacity 120
    groups = _promote_groups(sim, [_tokens(20 + i, 30) for i in range(4)])
    h = sim.allocator.hot_base
    for i in (0, 2, 1):  # unlock extents 0, 2, then 1 (1 is the most recently used)
        for r in groups[i]:
            sim.finish(r)
    sim.evict(1 << 20)
    assert sim.cache.evict_hot(60) == 60  # LRU: extents 0 and 2
    assert sim.allocator.hot_pool.holes() == [(h, 30), (h + 60, 30)]
    big = _share(sim, _tokens(30, 45), 2)  # 60 free, largest hole 30
    assert sim.promote() == 1
    sim.check()  # extent 1 moved h+30 -> h (overlapping move); tree walk checks its KV
    m = sim.cache.metrics
    assert (m.compactions, m.compaction_moves, m.hot_evictions) == (1, 1, 2)
    assert sim.allocator.hot_pool.extents() == {h: 30, h + 30: 45, h + 90: 30}
    assert sim.cache.hot_run(big[0]) == (h + 30, 45)
    sim.drain()
    sim.assert_all_free()


def test_no_room_when_every_extent_is_locked():
    sim = Sim(SimConfig(kv_size=300, hot_fraction=0.4, min_tokens=16))  # HOT capacity 120
    groups = _promote_groups(sim, [_tokens(40 + i, 30) for i in range(4)])
    for r in groups[0] + groups[2]:
        sim.finish(r)
    sim.evict(1 << 20)
    sim.cache.evict_hot(60)
    _share(sim, _tokens(50, 45), 2)
    assert sim.promote() == 0
    assert sim.cache.metrics.skip_reasons["no_space"] == 1
    sim.check()
    sim.drain()
    sim.assert_all_free()


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
