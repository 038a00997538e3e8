"""GraniKVRadixCache under SGLang's own lifecycle calls, on the running release: 0.5.17's
cache_unfinished_req / cache_finished_req, 0.5.23's checkpoint / release_kv_cache (the real
``Req``, ``ReqToTokenPool``, allocator and ``mem_cache.common`` functions), and the overlap
scheduler's order (batch N launched before batch N-1's results are processed)."""

import random

import pytest
import torch
from support.scheduler_sim import Sim, SimConfig, overlap_schedule

from granikv import sglang_compat as compat

CFG = SimConfig(kv_size=600, max_reqs=16, max_context=160, min_tokens=16)
ON_0523 = pytest.mark.skipif(compat.LIFECYCLE != "checkpoint",
                             reason="SGLang 0.5.23's checkpoint / release_kv_cache lifecycle")


def _shared_prompts(rng, n, head=40):
    shared = [rng.randrange(CFG.vocab) for _ in range(head)]
    return [shared + [rng.randrange(CFG.vocab) for _ in range(rng.randrange(3, 30))]
            for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [16, 1000])
def test_overlap_order_keeps_every_invariant_and_the_kv(seed, chunk):
    sim = Sim(CFG)
    rng = random.Random(seed)
    stats = overlap_schedule(sim, _shared_prompts(rng, 14), chunk=chunk, decode_tokens=5,
                             seed=seed)
    assert stats["finished"] == 14 and stats["aborted"] == 0, stats
    assert sim.cache.metrics.promotions >= 1, sim.cache.metrics.snapshot()
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_overlap_order_under_cold_pressure_evicts_and_retracts_cleanly():
    sim = Sim(SimConfig(kv_size=240, max_reqs=16, max_context=120, min_tokens=16))
    rng = random.Random(7)
    prompts = _shared_prompts(rng, 12, head=30) + _shared_prompts(rng, 8, head=24)
    stats = overlap_schedule(sim, prompts, chunk=12, decode_tokens=12, seed=7)
    assert stats["finished"] + stats["aborted"] == 20, stats
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_release_drops_the_request_and_its_table_row():
    sim = Sim(CFG)
    rng = random.Random(3)
    reqs = [sim.admit(p) for p in _shared_prompts(rng, 3)]
    sim.promote()
    sim.check()
    rows = [compat.req_pool_idx(r) for r in reqs]
    assert all(sim.cache.hot_prefix_table.get(i)[1] > 0 for i in rows)
    sim.finish(reqs[0])
    sim.abort(reqs[1])
    assert compat.req_pool_idx(reqs[0]) is None and compat.req_pool_idx(reqs[1]) is None
    for i in rows[:2]:
        assert sim.cache.hot_prefix_table.get(i) == (0, 0) and i not in sim.cache.live_requests()
    assert rows[2] in sim.cache.live_requests()
    sim.check()


def test_a_release_the_cache_never_hears_of_is_an_integrity_error():
    """The check fails when a row is given back without the cache's release callback."""
    sim = Sim(CFG)
    rng = random.Random(4)
    reqs = [sim.admit(p) for p in _shared_prompts(rng, 2)]
    sim.promote()
    idx = compat.req_pool_idx(reqs[0])
    sim.cache._after_release = lambda *a: None  # the callback is lost
    sim.finish(reqs[0])
    assert sim.cache.hot_prefix_table.get(idx)[1] > 0
    from granikv.mem_cache.hot_pool import IntegrityError

    with pytest.raises(IntegrityError):
        sim.cache.check_integrity()


@ON_0523
def test_release_kv_cache_inserts_prompt_and_output_then_frees_the_row():
    """0.5.23's release_kv_cache(checkpoint=True): checkpoint (tree keeps prompt + output, the
    prompt boundary split), free_kv_row, unlock, on_release, ReqToTokenPool.free."""
    from sglang.srt.mem_cache.common import release_kv_cache

    sim = Sim(CFG)
    rng = random.Random(5)
    prompt = _shared_prompts(rng, 1)[0]
    req = sim.admit(prompt)
    for _ in range(4):
        sim.decode(req, rng.randrange(CFG.vocab))
    tokens = list(req.tokens)
    free_before = sim.allocator.available_size()
    release_kv_cache(req, sim.cache, checkpoint=True)
    del sim.live[req.rid]
    assert not req.kv.holds_kv and req.lock is None
    m = sim.match(tokens + [0])
    assert len(m.indices) == len(tokens)  # prompt and output are cached
    assert sim.allocator.available_size() == free_before  # the tree took every slot
    sim.check()


@ON_0523
def test_checkpoint_repoints_a_chunked_request_at_its_hot_run():
    """A later chunk of a request whose prefix went HOT: checkpoint rewrites the row with the
    tree's values, and the cache's callback re-publishes the HOT run over them."""
    sim = Sim(CFG)
    rng = random.Random(6)
    prompts = _shared_prompts(rng, 3, head=48)
    holders = [sim.admit(p) for p in prompts[:2]]
    req = sim.prefill_begin(prompts[2], chunk=20)
    sim.promote()
    sim.prefill_end(req, chunked=True)
    assert sim.prefill_next_chunk(req, 40)
    sim.prefill_end(req, chunked=req.fill_len is not None)
    start, n = sim.cache.hot_run(req)
    assert n >= CFG.min_tokens
    row = sim.req_pool.req_to_token[compat.req_pool_idx(req), :n].to(torch.int64)
    assert torch.equal(row, torch.arange(start, start + n))
    assert req.kv.cache_protected_len >= n
    sim.check()
    for r in holders + [req]:
        sim.finish(r)
    sim.drain()
    sim.assert_all_free()
