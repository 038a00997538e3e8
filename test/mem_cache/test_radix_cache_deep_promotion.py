"""Deepest-shared-node promotion with shadow heads: chunked prompts, short common heads,
extension of an earlier promotion, eviction and splits. KV checked bit-exact through every row,
every ``prefix_indices``, every node and every shadow head (``Sim.check``)."""

import random

import torch

from support.scheduler_sim import Sim, SimConfig


def _tokens(seed, n, vocab=61):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


H = _tokens(1, 4)  # a chat template's first tokens, shared by every prompt
P1 = _tokens(2, 37)
P2 = _tokens(3, 29)


def _assert_runs(sim, reqs, run):
    start, n = run
    for r in reqs:
        assert sim.cache.hot_run(r) == run
        assert sim.cache.hot_prefix_table.get(r.req_pool_idx) == run
        assert torch.equal(r.prefix_indices[:n], torch.arange(start, start + n))
        row = sim.req_pool.req_to_token[r.req_pool_idx, :n].to(torch.int64)
        assert torch.equal(row, torch.arange(start, start + n))


def _finish_all(sim, reqs):
    for r in reqs:
        sim.finish(r)
        sim.check()


def test_chunked_shared_prompt_is_hot_over_its_whole_length():
    sim = Sim()
    shared = _tokens(10, 53)  # inserted in chunks of 20: root -> [0,20) -> [20,40) -> ...
    agents = []
    for i in range(4):
        agents.append(sim.admit_chunked(shared + [i, 2 * i + 1, 5], 20, promote=True))
        sim.check()
    assert sim.cache.metrics.promotions == 1
    node = agents[0].last_node.parent  # [40, 53): the deepest node every agent shares
    ext = sim.cache.hot_extent_of(node)
    assert (ext.head, ext.length) == (40, 13)
    assert sim.cache.hot_extent_of(node.parent) is None  # the chunks above stay COLD
    assert sim.allocator.hot_pool.extents() == {ext.start: 53}
    assert sim.cache.metrics.shadow_head_tokens == 40
    _assert_runs(sim, agents, (ext.start, 53))
    for step in range(3):
        for r in agents:
            assert sim.decode(r, (7 * step + r.rid) % 61)
        sim.check()
    _finish_all(sim, agents)
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_short_common_head_does_not_hide_long_shared_prompts():
    sim = Sim()
    order = [H + P1 + [1], H + P2 + [2], H + P1 + [3], H + P2 + [4], H + P1 + [5]]
    reqs = [sim.admit(p) for p in order]
    other = sim.admit(H + _tokens(20, 9))  # shares only the 4-token head
    assert sim.promote() == 2
    sim.check()
    head = reqs[0].last_node.parent.parent
    assert len(head.key) == 4 and sim.cache.hot_extent_of(head) is None  # below min_tokens
    e1 = sim.cache.hot_extent_of(reqs[0].last_node.parent)
    e2 = sim.cache.hot_extent_of(reqs[1].last_node.parent)
    assert (e1.head, e1.length, e2.head, e2.length) == (4, len(P1), 4, len(P2))
    _assert_runs(sim, reqs[0::2], (e1.start, 4 + len(P1)))
    _assert_runs(sim, reqs[1::2], (e2.start, 4 + len(P2)))
    assert sim.cache.hot_run(other) == (0, 0)
    late = sim.admit(H + P2 + [6, 6])  # matched after the promotion: row repointed to the head
    sim.check()
    _assert_runs(sim, [late], (e2.start, 4 + len(P2)))
    cut = sim.admit(H[:2] + [0, 0, 0])  # splits the COLD head ABOVE both shadow heads
    sim.check()
    _assert_runs(sim, reqs[1::2] + [late], (e2.start, 4 + len(P2)))
    _finish_all(sim, reqs + [other, late, cut])
    sim.drain()
    sim.assert_all_free()


def _free_last(sim, start, n):
    """Reorder the free list so that ``[start, start + n)`` is handed out last (the other
    free slots first, scattered): the next prefills leave that range free."""
    fp = sim.allocator.free_pages
    keep = (fp >= start) & (fp < start + n)
    others = fp[~keep]
    others = others[torch.randperm(len(others), generator=torch.Generator().manual_seed(0))]
    sim.allocator.free_pages = torch.cat([others, fp[keep]])


def _extend_scenario(sim):
    """A promoted (adopted at [1, 31)), its holders gone, A+B about to be shared."""
    a = _tokens(30, 30)
    first = [sim.admit(a + [1]), sim.admit(a + [2])]
    assert sim.promote() == 1
    ea = sim.cache.hot_extent_of(first[0].last_node.parent)
    assert (ea.start, ea.head, ea.length) == (1, 0, 30) and sim.cache.metrics.adopted == 1
    _finish_all(sim, first)
    assert sim.evict(2) == 2  # the two 1-token suffixes at 31, 32; A stays HOT
    return a, ea


def test_deeper_shared_node_adopts_its_slots_right_after_the_parents_run():
    sim = Sim()
    a, ea = _extend_scenario(sim)
    sim.allocator.free_pages = sim.allocator.free_pages.sort().values  # B gets [31, 54)
    b = _tokens(31, 23)
    agents = [sim.admit(a + b + [3]), sim.admit(a + b + [4])]
    copied = sim.cache.metrics.bytes_copied
    assert sim.promote() == 1
    sim.check()
    eb = sim.cache.hot_extent_of(agents[0].last_node.parent)
    assert (eb.start, eb.head, eb.length) == (31, 0, 23)  # continues A's extent, no copy
    assert sim.cache.metrics.bytes_copied == copied and sim.cache.metrics.adopted == 2
    _assert_runs(sim, agents, (1, 53))
    _finish_all(sim, agents)
    sim.drain()
    sim.assert_all_free()


def test_deeper_shared_node_extends_an_earlier_promotion_in_place():
    """A, then A+B shared: B's KV is copied right after A's extent (no shadow head, A's KV
    not copied again), one run covers A+B; A's own holders keep their run."""
    sim = Sim()
    a, ea = _extend_scenario(sim)
    _free_last(sim, 31, 23)  # the next prefills get scattered slots; [31, 54) stays free
    held = [sim.admit(a + [1])]  # an A-only holder
    b = _tokens(31, 23)
    agents = [sim.admit(a + b + [3]), sim.admit(a + b + [4])]
    copied = sim.cache.metrics.bytes_copied
    assert sim.promote() == 1
    sim.check()
    eb = sim.cache.hot_extent_of(agents[0].last_node.parent)
    assert (eb.start, eb.head, eb.length) == (31, 0, 23)  # continues A's extent
    assert sim.allocator.hot_pool.extents() == {1: 30, 31: 23}  # nothing duplicated
    assert sim.cache.metrics.extended_in_place == 1 and sim.cache.metrics.shadow_head_tokens == 0
    assert sim.cache.metrics.bytes_copied - copied == 23 * 64  # only B's KV moved
    _assert_runs(sim, held, (1, 30))
    _assert_runs(sim, agents, (1, 53))
    late = sim.admit(a + b + [5, 5])
    _assert_runs(sim, [late], (1, 53))
    assert sim.promote() == 0  # nothing deeper is shared: no re-promotion
    for step in range(3):
        for r in agents + [late]:
            assert sim.decode(r, (5 * step + r.rid) % 61)
        sim.check()
    _finish_all(sim, held)
    assert sim.cache.evict_hot(1 << 20) == 0  # A and B stay locked by B's holders
    sim.check()
    _finish_all(sim, agents + [late])
    assert sim.cache.evict_hot(1 << 20) == 53  # B (the leaf), then A
    sim.check()
    sim.drain()
    sim.assert_all_free()


def test_deeper_shared_node_gets_a_shadow_head_when_the_slots_after_its_parent_are_taken():
    sim = Sim()
    a, b, c = _tokens(30, 30), _tokens(31, 23), _tokens(32, 25)
    first = [sim.admit(a + [1]), sim.admit(a + [2])]
    assert sim.promote() == 1
    ea = sim.cache.hot_extent_of(first[0].last_node.parent)
    others = [sim.admit(c + [1]), sim.admit(c + [2])]
    assert sim.promote() == 1
    ec = sim.cache.hot_extent_of(others[0].last_node.parent)
    assert ec.start > ea.start + 30  # C adopted its own slots; A's suffixes sit in between
    agents = [sim.admit(a + b + [3]), sim.admit(a + b + [4])]
    assert sim.promote() == 1  # B: shadow head = a copy of A's HOT KV
    sim.check()
    eb = sim.cache.hot_extent_of(agents[0].last_node.parent)
    assert (eb.head, eb.length) == (30, 23)
    assert sim.allocator.hot_pool.extents() == {ea.start: 30, ec.start: 25, eb.start: 53}  # A duplicated
    assert sim.cache.metrics.extended_in_place == 0
    _assert_runs(sim, first, (ea.start, 30))
    _assert_runs(sim, agents, (eb.start, 53))
    _finish_all(sim, first + others + agents)
    sim.drain()
    sim.assert_all_free()


def test_shallower_promotion_superseded_by_a_deeper_one():
    sim = Sim()
    a, b = _tokens(40, 30), _tokens(41, 20)
    r1 = sim.admit(a + b + [1])
    r2 = sim.admit(a + [7, 7])  # A shared by 2: queued
    r3 = sim.admit(a + b + [2])  # A+B shared by r1, r3: queued
    sim.finish(r2)  # A's remaining holders all share A+B
    assert sim.promote() == 1
    assert sim.cache.metrics.skip_reasons["superseded"] == 1
    sim.check()
    ext = sim.cache.hot_extent_of(r1.last_node.parent)
    assert (ext.head, ext.length) == (30, 20)
    assert sim.allocator.hot_pool.extents() == {ext.start: 50}
    _assert_runs(sim, [r1, r3], (ext.start, 50))
    sim.drain()
    sim.assert_all_free()


def test_eviction_of_a_node_with_a_shadow_head_frees_exactly_its_extent():
    sim = Sim()
    g1 = [sim.admit(H + P1 + [i]) for i in range(2)]
    g2 = [sim.admit(H + P2 + [i]) for i in range(2)]
    assert sim.promote() == 2
    e1 = sim.cache.hot_extent_of(g1[0].last_node.parent)
    e2 = sim.cache.hot_extent_of(g2[0].last_node.parent)
    _finish_all(sim, g2)
    assert sim.cache.hot_evictable_size() == 4 + len(P2)
    assert sim.cache.evict_hot(1) == 4 + len(P2)  # the whole extent, shadow head included
    sim.check()
    assert sim.allocator.hot_pool.extents() == {e1.start: e1.size}
    _finish_all(sim, g1)
    # memory pressure: evict() takes HOT and COLD leaves alike, shadow heads included
    evictable = sim.cache.evictable_size()
    assert evictable == 4 + 2 + e1.size  # H, the two 1-token suffixes, P1's whole extent
    assert sim.evict(evictable) == evictable
    sim.check()
    sim.assert_all_free()
    assert sim.cache.metrics.hot_evicted_tokens == 4 + len(P2) + 4 + len(P1)


def test_split_of_a_node_with_a_shadow_head():
    sim = Sim()
    agents = [sim.admit(H + P2 + [i]) for i in range(3)]
    sim.admit(H + [9] * 20)  # H becomes its own node, shared by everyone
    assert sim.promote() == 1
    ext = sim.cache.hot_extent_of(agents[0].last_node.parent)
    assert (ext.head, ext.length) == (4, len(P2))
    partial = sim.admit(H + P2[:10] + [60, 60])  # splits P2: the upper half keeps the head
    sim.check()
    assert sim.cache.metrics.hot_splits == 1
    assert sim.allocator.hot_pool.extents() == {ext.start: 14, ext.start + 14: len(P2) - 10}
    upper = partial.last_node.parent
    assert sim.cache.hot_extent_of(upper) == (ext.start, 4, 10)
    _assert_runs(sim, [partial], (ext.start, 14))
    _assert_runs(sim, agents, (ext.start, 4 + len(P2)))  # both halves, one run
    sim.drain()
    sim.check()
    sim.assert_all_free()


def test_shadow_head_takes_the_free_slots_before_the_node():
    sim = Sim()
    other = sim.admit(H + _tokens(9, 20))  # slots 1..24
    sim.allocator.free_pages = torch.cat([torch.arange(29, 385), torch.arange(25, 29)])
    agents = [sim.admit(H + P2 + [i]) for i in range(2)]  # P2 at [29, 58), [25, 29) free
    assert sim.promote() == 1
    sim.check()
    ext = sim.cache.hot_extent_of(agents[0].last_node.parent)
    assert tuple(ext) == (25, 4, len(P2))  # head in the free slots, the node's own slots kept
    m = sim.cache.metrics
    assert (m.adopted, m.shadow_head_tokens, m.bytes_copied) == (1, 4, 4 * 64)  # only the head
    _assert_runs(sim, agents, (25, 4 + len(P2)))
    _finish_all(sim, agents + [other])
    sim.drain()
    sim.assert_all_free()
