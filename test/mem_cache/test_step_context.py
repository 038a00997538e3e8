"""StepContext (the step a promotion is priced in, from tree state) and the radix cache
handing it to a policy that prices promotions in their step."""

import random
import pytest

from granikv.mem_cache.policy import PaysOffPolicy
from granikv.mem_cache.step_context import StepContext
from support.scheduler_sim import Sim


class _Node:  # what StepContext reads of SGLang's TreeNode (hashed by identity, like it)
    def __init__(self, parent, length, lock):
        self.parent, self.key, self.lock_ref = parent, [0] * length, lock


_node = _Node


def test_nested_groups_count_each_request_once():
    root = _node(None, 0, 1)
    h = _node(root, 4, 12)  # COLD head, in no group
    a = _node(h, 100, 10)  # HOT: 10 holders, 4 of them go on through b
    b = _node(a, 50, 4)  # candidate
    d = _node(b, 30, 2)  # deeper candidate below b
    e = _node(root, 200, 3)  # another root child
    ctx = StepContext([a, b, d, e], root=root)
    assert ctx.groups() == [(104, 6), (154, 2), (184, 2), (200, 3)]
    # b's holders (d's included) are b's: d goes; a, which serves them without b, apart
    assert ctx.context_for(b) == ((200, 3),) and ctx.within(b) == (104, 6)
    assert ctx.context_for(d) == ((104, 6), (200, 3)) and ctx.within(d) == (154, 2)
    assert ctx.context_for(e) == ((104, 6), (154, 2), (184, 2)) and ctx.within(e) is None
    assert ctx.context_for(a) == ((200, 3),) and ctx.within(a) is None  # all below a is a's
    with pytest.raises(KeyError):
        ctx.context_for(h)


def test_a_group_whose_holders_all_go_deeper_is_no_group():
    root = _node(None, 0, 1)
    a = _node(root, 64, 3)
    b = _node(a, 64, 3)
    e = _node(root, 32, 2)
    ctx = StepContext([a, b, e], root=root)
    assert ctx.context_for(e) == ((128, 3),)
    assert ctx.context_for(b) == ((32, 2),) and ctx.within(b) == (64, 0)  # b extends a's run


class _StepEstimate:
    """A step pays once the groups' benefit exceeds a fixed cost charged once per step:
    ``T(X) = paged - max(0, sum_X (sharers - 1) * prefix_len / 100 - FIXED)``; the saving of a
    candidate is ``T(context) - T(context + candidate)``. With 40-token prefixes: one group of
    2 saves 0 (0.4 < 0.6), two groups of 2 save 0.2 each, a group of 3 pays alone."""

    FIXED = 0.6

    def __init__(self):
        self.contexts = []

    def serves(self, num_sharers):
        return num_sharers >= 2

    def _gain(self, groups):
        return max(0.0, sum((s - 1) * p / 100 for p, s in groups if s >= 2) - self.FIXED)

    def saving_us(self, prefix_len, num_sharers, context=(), within=None):
        ctx = list(context)
        assert within is None  # these tests' groups are distinct root children
        self.contexts.append(((prefix_len, num_sharers), sorted(ctx)))
        return self._gain(ctx + [(prefix_len, num_sharers)]) - self._gain(ctx)

    def copy_us(self, num_tokens):
        return num_tokens / 100


def _sim():
    sim = Sim()
    sim.cache.policy = PaysOffPolicy(_StepEstimate(), min_tokens=16, min_sharers=2, default_steps=200)
    return sim


def _prefix(first):
    rng = random.Random(first)
    return [first] + [rng.randrange(61) for _ in range(39)]  # 40 tokens, first token distinct


def _group(sim, first, sharers):
    p = _prefix(first)
    return [sim.admit(p + [50 + i, i]) for i in range(sharers)]


def test_two_shared_paths_that_do_not_pay_alone_are_promoted_together():
    sim = _sim()
    _group(sim, 1, 2)
    assert sim.promote() == 0  # one group of 2 alone: the step's fixed cost eats the saving
    assert sim.cache.metrics.skip_reasons["does_not_pay"] == 1
    sim.check()

    sim = _sim()
    _group(sim, 1, 2)
    _group(sim, 2, 2)
    assert sim.cache.pending_promotions() == 2
    assert sim.promote() == 2  # queued together: each counts the other
    est = sim.cache.policy.estimate
    assert [c for _, c in est.contexts] == [[(40, 2)], [(40, 2)]]
    assert len(sim.cache._hot_start) == 2 and not sim.cache._candidates  # nothing held after
    sim.check()


def test_a_hot_group_with_live_holders_is_context_a_finished_one_is_not():
    sim = _sim()
    big = _group(sim, 1, 3)  # pays alone
    assert sim.promote() == 1
    second = _group(sim, 2, 2)  # alone it would not pay; beside the live HOT group it does
    assert sim.promote() == 1
    assert sim.cache.policy.estimate.contexts[-1] == ((40, 2), [(40, 3)])
    for r in big:
        sim.finish(r)  # the HOT node stays (cached) but serves nobody
    third = _group(sim, 3, 2)
    assert sim.promote() == 1
    assert sim.cache.policy.estimate.contexts[-1] == ((40, 2), [(40, 2)])  # group 2 only
    for r in second + third:
        sim.finish(r)
    _group(sim, 4, 2)  # three HOT extents cached, none serving anybody: alone again
    assert sim.promote() == 0
    assert sim.cache.policy.estimate.contexts[-1] == ((40, 2), [])
    sim.check()


def test_candidates_past_the_hot_cap_are_not_counted_in_the_step():
    """Three groups of 2 that pay only together, and a HOT cap that holds one 40-token extent:
    the candidates after the first do not fit, so they are not context for it, and nothing is
    promoted (a lone group does not pay). Counted, they would promote the first alone."""
    from support.scheduler_sim import SimConfig

    sim = Sim(SimConfig(hot_fraction=60 / 384))
    sim.cache.policy = PaysOffPolicy(_StepEstimate(), min_tokens=16, min_sharers=2, default_steps=200)
    for first in (1, 2, 3):
        _group(sim, first, 2)
    assert sim.promote() == 0
    assert [c for _, c in sim.cache.policy.estimate.contexts] == [[], [], []]
    assert sim.cache.metrics.skip_reasons["does_not_pay"] == 3
    sim.check()

    sim = Sim(SimConfig(hot_fraction=100 / 384))  # room for two: the first two pay together
    sim.cache.policy = PaysOffPolicy(_StepEstimate(), min_tokens=16, min_sharers=2, default_steps=200)
    for first in (1, 2, 3):
        _group(sim, first, 2)
    assert sim.promote() == 2
    assert [c for _, c in sim.cache.policy.estimate.contexts][:2] == [[(40, 2)], [(40, 2)]]
    sim.check()


def test_the_same_calls_give_the_same_decisions():
    """Two ranks fed the same calls: equal storage state (the context is tree state only)."""
    states = []
    for _ in range(2):
        sim = _sim()
        for first, n in ((4, 2), (5, 2), (6, 1)):
            _group(sim, first, n)
        sim.promote()
        states.append(sim.hot_state())
        sim.check()
    assert states[0] == states[1] and len(states[0]["extents"]) == 2


def test_the_regime_grids_forest_is_promoted_through_the_cache():
    """forest16 at its real prefix lengths (1.5-6K, 4-12 sharers), the checked-in H200 cost
    model and the Llama-3.1-8B geometry: every prefix is promoted in one call, though few
    pay alone (test_promotion_in_step.py prices them). Then two agents sharing 64 more
    tokens below a HOT prefix: served in that prefix's group already, they are not promoted
    apart (``within``)."""
    import torch

    from benchmark.multi_agent import regime_grid
    from granikv.config import GraniKVConfig
    from granikv.attention.cost.cost_model import CostModel
    from granikv.attention.dispatcher import Dispatcher
    from granikv.attention.promotion_estimate import PromotionEstimate
    from support.scheduler_sim import SimConfig

    forest = regime_grid._forest16()
    cfg = GraniKVConfig()
    d = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=32, num_kv_heads=8,
                   head_dim=128, kv_dtype_bytes=2, num_layers=32)
    sim = Sim(SimConfig(kv_size=160_000, layers=1, kv_heads=1, head_dim=4, max_reqs=160,
                        max_context=6300, min_tokens=cfg.hot_min_tokens, dtype=torch.float16),
              debug_checks=False)
    sim.cache.policy = PaysOffPolicy.from_config(cfg, PromotionEstimate.from_config(d, cfg))
    prefixes = []
    for g, n in enumerate(forest["prefixes"]):
        rng = random.Random(g)
        prefixes.append([g] + [rng.randrange(61) for _ in range(n - 1)])
        sim.finish(sim.admit(prefixes[-1] + [60]))  # cached by one request, as the benchmark does
    agents = [(g, i) for g, n in enumerate(forest["agents_per_prefix"]) for i in range(n)]
    random.Random(0).shuffle(agents)  # interleaved, as workloads.grouped submits them
    for g, i in agents:
        assert sim.admit(prefixes[g] + [40 + i, i]) is not None  # suffixes share nothing
    assert sim.promote() == 16
    lengths = sorted(len(n.key) + sim.cache._depth(n) for n in sim.cache._hot_start)
    assert lengths == sorted(forest["prefixes"]) and not sim.cache.metrics.skip_reasons
    for i in range(2):
        sim.admit(prefixes[15] + [55] * 64 + [i])
    assert sim.cache.pending_promotions() == 1 and sim.promote() == 0
    assert sim.cache.metrics.skip_reasons == {"does_not_pay": 1}
    sim.check()
