"""Memory pressure: GraniKV never refuses a request plain SGLang would serve on the same
pool, stops promoting (not serving) at the HOT cap or when no window can be made, and a new
extent moves only unlocked COLD KV, bit-identical.

How GraniKV is compared with plain SGLang: HOT extents come out of the same free slots as
requests' KV and nothing is reserved, so a GraniKV pool of ``size`` slots is compared with a
plain SGLang pool of the same ``size``. A promotion that copies takes ``len`` free slots and
frees the node's ``len`` old ones, one that adopts takes none: only a shadow head (a copy of
the ancestors' KV) costs slots, and the workload below has none. With ``hot_fraction = 0`` (no promotion) every admission
decision and free count must be identical.
"""

import random
from dataclasses import replace

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from support.scheduler_sim import Sim, SimConfig

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
    admitted and decoded everything, with no more slots in use. Returns the agents."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(CFG.vocab) for _ in range(n)]  # noqa: E731
    # distinct first tokens: every shared prefix is a root child (no shadow head, whose copy
    # of the ancestors' KV is the one slot cost a promotion can have)
    prefixes = [[1] + tok(39), [2] + tok(27), [3] + tok(19)]
    agents = []
    while True:
        prompt = (rng.choice(prefixes) if rng.random() < 0.8 else [0]) + tok(rng.randrange(2, 8))
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
        g_used = granikv.cfg.kv_size - granikv.allocator.available_size()
        p_used = plain.cfg.kv_size - plain.allocator.available_size()
        assert g_used <= p_used, f"GraniKV uses {g_used} slots, plain SGLang {p_used}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_never_refuses_what_plain_sglang_serves(seed):
    granikv = Sim(replace(CFG, seed=seed, shuffle_free=seed == 1))
    plain = plain_sglang(replace(CFG, seed=seed))  # the same pool size: nothing reserved
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


def test_promotion_stops_at_the_hot_cap_and_requests_still_run():
    """HOT at its cap with locked extents: a new shared prefix is not promoted (``hot_cap``),
    its requests are admitted, decode and finish from COLD, and nothing leaks."""
    sim = Sim(replace(CFG, kv_size=300, hot_fraction=0.2))  # cap 60
    rng = random.Random(4)
    a, b = [rng.randrange(CFG.vocab) for _ in range(50)], [rng.randrange(CFG.vocab) for _ in range(30)]
    holders = [sim.admit(a + [i]) for i in range(2)]
    sim.promote()
    assert sim.cache.metrics.promotions == 1 and sim.allocator.hot_room() == 10
    agents = [sim.admit(b + [i]) for i in range(3)]
    assert sim.promote() == 0 and sim.cache.metrics.skip_reasons["hot_cap"] >= 1
    assert all(r is not None for r in agents)
    for r in agents:
        assert sim.cache.hot_run(r) == (0, 0) and sim.decode(r, 7)
    sim.check()
    for r in agents + holders:
        sim.finish(r)
    sim.drain()
    sim.assert_all_free()


def test_a_new_extent_moves_only_unlocked_cold_kv_and_keeps_it():
    """A scattered pool full of cached (unlocked) prompts and a live promoted group: a new
    shared prefix needs a window; only unlocked COLD KV moves out of it, every locked node
    (HOT or COLD) keeps its slots, and the moved KV is the same bits at its new slots."""
    sim = Sim(replace(CFG, kv_size=200, hot_fraction=1.0, shuffle_free=True))
    rng = random.Random(5)
    tok = lambda n: [rng.randrange(CFG.vocab) for _ in range(n)]  # noqa: E731
    live = [sim.admit(p + [i]) for p in [tok(24)] for i in range(2)]
    assert sim.promote() == 1
    for _ in range(8):
        sim.finish(sim.admit(tok(20)))  # cached, unlocked
    cached = {n: sim.gather_kv(n.value).clone() for n in sim.cache._movable_nodes()}
    big = tok(45)
    agents = [sim.admit(big + [i]) for i in range(2)]
    locked = {}
    stack = list(sim.cache.root_node.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.lock_ref > 0 and n is not agents[0].last_node.parent:
            locked[n] = n.value.clone()
    assert sim.promote() == 1
    m = sim.cache.metrics
    assert m.compactions == 1 and m.compaction_moves > 0, m.snapshot()
    for n, v in locked.items():
        assert torch.equal(n.value, v), f"locked node {n.id} moved"
    moved = [n for n in cached if n.value is not None and sim.cache._attached(n)]
    assert moved and all(torch.equal(sim.gather_kv(n.value), cached[n]) for n in moved)
    sim.check()  # every row, node and head against the oracle
    del live
    sim.drain()
    sim.assert_all_free()
