"""Memory pressure: GraniKV never refuses a request plain SGLang would serve, stops promoting
(not serving) when HOT is full, and compaction moves only unlocked extents, KV bit-identical.

How GraniKV is compared with plain SGLang: the HOT region is carved out of the KV pool by
design (``hot_capacity = size * hot_fraction`` slots can never hold a request's private KV),
so a GraniKV pool of ``size`` slots is compared with a plain SGLang pool of its COLD capacity
(``size - hot_capacity``): the same slots for requests' private KV, and GraniKV additionally
moves shared prefixes out of COLD. With ``hot_fraction = 0`` the two pools are the same size
and every admission decision and free count must be identical.
"""

import random
from dataclasses import replace

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from scheduler_sim import Sim, SimConfig

CFG = SimConfig(kv_size=400, max_reqs=40, max_context=120, hot_fraction=0.3, min_tokens=16)


def plain_sglang(cfg: SimConfig) -> Sim:
    """A Sim whose allocator and cache are SGLang's own (``TokenToKVPoolAllocator``,
    ``RadixCache``) over ``cfg.kv_size`` slots: drive it with ``register=False`` and never
    ``promote`` (nothing GraniKV runs)."""
    sim = Sim(replace(cfg, hot_fraction=0.0))
    sim.allocator = TokenToKVPoolAllocator(cfg.kv_size, cfg.dtype, "cpu", sim.kv_pool, False)
    sim.cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=sim.req_pool,
                                           token_to_kv_pool_allocator=sim.allocator, page_size=1))
    return sim


def _fill(granikv: Sim, plain: Sim, seed: int) -> int:
    """Agents join (three shared prefixes and private prompts) and decode, none finish, until
    plain SGLang refuses one. Up to there both hold the same requests, so GraniKV must have
    admitted and decoded everything, with no more COLD slots in use. Returns the agents."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(CFG.vocab) for _ in range(n)]  # noqa: E731
    prefixes = [tok(40), tok(28), tok(20)]
    agents = []
    while True:
        prompt = (rng.choice(prefixes) if rng.random() < 0.8 else []) + tok(rng.randrange(2, 8))
        p = plain.admit(prompt, register=False)
        if p is None:
            return len(agents)
        g = granikv.prefill_begin(prompt)
        assert g is not None, f"GraniKV refused agent {len(agents)} that plain SGLang served"
        granikv.promote()  # the plugin's hook before run_batch
        granikv.prefill_end(g)
        agents.append((p, g))
        for p, g in rng.sample(agents, min(3, len(agents))):
            tok_id = rng.randrange(CFG.vocab)
            if not plain.decode(p, tok_id):
                return len(agents)
            granikv.promote()
            assert granikv.decode(g, tok_id), "GraniKV retracted a request plain SGLang kept"
        granikv.check()
        g_used = granikv.allocator.cold_capacity - granikv.allocator.available_size()
        p_used = plain.cfg.kv_size - plain.allocator.available_size()
        assert g_used <= p_used, f"GraniKV uses {g_used} COLD slots, plain SGLang {p_used}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_never_refuses_what_plain_sglang_serves(seed):
    granikv = Sim(replace(CFG, seed=seed))
    plain = plain_sglang(replace(CFG, kv_size=granikv.allocator.cold_capacity, seed=seed))
    served = _fill(granikv, plain, seed)
    assert served >= 4 and granikv.cache.metrics.promotions >= 2, granikv.cache.metrics.snapshot()
    granikv.drain()
    granikv.assert_all_free()


def test_without_a_hot_region_decisions_equal_plain_sglang():
    granikv = Sim(replace(CFG, hot_fraction=0.0))
    plain = plain_sglang(CFG)
    rng = random.Random(3)
    prefix = [rng.randrange(CFG.vocab) for _ in range(30)]
    pairs = []
    for i in range(60):
        prompt = prefix[: rng.randrange(10, 31)] + [rng.randrange(CFG.vocab) for _ in range(5)]
        p, g = plain.admit(prompt, register=False), granikv.admit(prompt)
        granikv.promote()
        assert (p is None) == (g is None), f"step {i}: plain {p is not None}, GraniKV {g is not None}"
        if p is not None:
            pairs.append((p, g))
        if pairs and rng.random() < 0.4:
            p, g = pairs.pop(rng.randrange(len(pairs)))
            plain.finish(p)
            granikv.finish(g)
        assert granikv.allocator.available_size() == plain.allocator.available_size()
        assert granikv.cache.evictable_size() == plain.cache.evictable_size()
        granikv.check()


def test_promotion_stops_when_hot_is_full_and_requests_still_run():
    """HOT full of locked extents: a new shared prefix is not promoted (``no_space``), its
    requests are admitted, decode and finish from COLD, and nothing leaks."""
    sim = Sim(replace(CFG, kv_size=300, hot_fraction=0.2))  # 60 HOT slots
    rng = random.Random(4)
    a, b = [rng.randrange(CFG.vocab) for _ in range(50)], [rng.randrange(CFG.vocab) for _ in range(30)]
    holders = [sim.admit(a + [i]) for i in range(2)]
    sim.promote()
    assert sim.cache.metrics.promotions == 1 and sim.allocator.hot_pool.free_size == 10
    agents = [sim.admit(b + [i]) for i in range(3)]
    assert sim.promote() == 0 and sim.cache.metrics.skip_reasons["no_space"] >= 1
    assert all(r is not None for r in agents)
    for r in agents:
        assert sim.cache.hot_run(r) == (0, 0) and sim.decode(r, 7)
    sim.check()
    for r in agents + holders:
        sim.finish(r)
    sim.drain()
    sim.assert_all_free()


def test_compaction_moves_only_unlocked_extents_and_keeps_their_kv():
    """HOT (120 slots): | A locked 30 | B 30 | C 30 | free 30 |. B's and C's agents finish
    (B first: LRU). D (50) needs room: B is evicted, then C slides down next to A:
    | A 30 | C 30 | D 50 | free 10 |; A never moves, C's KV is the same bits at its new slots."""
    sim = Sim(replace(CFG, kv_size=400, hot_fraction=0.3))
    rng = random.Random(5)
    prompts = [[p] + [rng.randrange(CFG.vocab) for _ in range(n - 1)]
               for p, n in ((1, 30), (2, 30), (3, 30), (4, 50))]  # distinct first tokens
    groups = []
    for prompt in prompts[:3]:
        groups.append([sim.admit(prompt + [i]) for i in range(2)])
        sim.promote()
    node = {i: sim.match(prompts[i] + [0]).node for i in range(3)}
    ext = {i: sim.cache.hot_extent_of(node[i]) for i in range(3)}
    assert [e.start for e in ext.values()] == [ext[0].start, ext[0].start + 30, ext[0].start + 60]
    for r in groups[1] + groups[2]:  # B's agents first: B is the least recently used
        sim.finish(r)
    kv_c = sim.gather_kv(node[2].value).clone()
    [sim.admit(prompts[3] + [i]) for i in range(2)]
    assert sim.promote() == 1
    m = sim.cache.metrics
    assert (m.hot_evictions, m.compactions, m.compaction_moves) == (1, 1, 1), m.snapshot()
    assert sim.cache.hot_extent_of(node[0]) == ext[0]  # locked: never moves
    moved = sim.cache.hot_extent_of(node[2])
    assert moved.start == ext[0].start + 30 and moved.start != ext[2].start
    assert torch.equal(sim.gather_kv(node[2].value), kv_c)  # bit-identical after the move
    sim.check()  # every row, node and head against the oracle
    sim.drain()
    sim.assert_all_free()
