"""Promotion priced in the step it is served in: the checked-in H200 cost model, the regime
grid's workloads (benchmark/multi_agent/regime_grid.py) and real model geometries."""

import random

import pytest

from benchmark.multi_agent import regime_grid
from granikv.config import GraniKVConfig
from granikv.attention.cost.cost_model import CostModel, Workload
from granikv.attention.dispatcher import Dispatcher
from granikv.attention.promotion_estimate import PromotionEstimate
from granikv.mem_cache.policy import PaysOffPolicy

MODELS = ("llama-3.1-8b", "qwen2.5-7b")
CFG = GraniKVConfig()  # the serving defaults: hot_min_tokens 1024, 2 sharers, groups of 2


def _estimate(model: str, path: str = "auto") -> PromotionEstimate:
    c = next(m for m in regime_grid.MODELS if m.name == model).config()
    d = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=c["num_attention_heads"],
                   num_kv_heads=c["num_key_value_heads"],
                   head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
                   kv_dtype_bytes=2, forced_path=path, num_layers=c["num_hidden_layers"])
    return PromotionEstimate.from_config(d, CFG)


def _policy(model: str, path: str = "auto") -> PaysOffPolicy:
    return PaysOffPolicy.from_config(CFG, _estimate(model, path))


def _row(model: str, name: str):
    row = next(r for r in regime_grid.default_grid() if r.model == model and r.name == name)
    return list(zip(row.kwargs["prefixes"], row.kwargs["agents_per_prefix"])), row.kwargs["out"]


def _promoted(policy, groups, steps):
    """What the storage layer decides for every group queued at once: each candidate in the
    context of the others that pass the floors (a leave-one-out marginal)."""
    queued = [g for g in groups if policy.may_promote(*g)]
    return [policy.should_promote(p, s, remaining_steps=steps,
                                  context=queued[:i] + queued[i + 1:]) if (p, s) in queued else False
            for i, (p, s) in enumerate(groups)]


@pytest.mark.parametrize("model", MODELS)
def test_every_forest_member_is_promoted(model):
    policy = _policy(model)
    groups, steps = _row(model, "forest16")
    assert len(groups) == 16
    assert all(_promoted(policy, groups, steps))
    # each alone (the pre-context pricing), most do not pay: the context is what promotes them
    alone = [policy.should_promote(p, s, remaining_steps=steps) for p, s in groups]
    assert sum(alone) <= 3


@pytest.mark.parametrize("model", MODELS)
def test_a_lone_small_group_is_not_promoted(model):
    policy, est = _policy(model), _estimate(model)
    assert est.saving_us(1536, 4) == 0.0  # the dispatcher serves it paged: nothing to save
    assert not policy.should_promote(1536, 4, remaining_steps=128)
    assert not policy.should_promote(1536, 4, remaining_steps=128, context=[(2048, 1)] * 8)


@pytest.mark.parametrize("model", MODELS)
def test_the_homogeneous_16k_prefix_is_still_promoted(model):
    groups, steps = _row(model, "hom16k_x64")
    assert groups == [(16384, 64)]
    assert _promoted(_policy(model), groups, steps) == [True]


@pytest.mark.parametrize("model,row", [(m, "short1k_3sharers") for m in MODELS]
                         + [("llama-3.1-8b", "prefix512_2sharers_x64")])
def test_rows_where_sharing_cannot_pay_stay_unpromoted(model, row):
    groups, steps = _row(model, row)
    assert not any(_promoted(_policy(model), groups, steps))
    # not only the length floor: the cost model says no too, with every other group counted
    est = _estimate(model)
    assert all(est.saving_us(p, s, groups[:i] + groups[i + 1:]) <= 0 for i, (p, s) in enumerate(groups))


@pytest.mark.parametrize("model", MODELS)
def test_decisions_do_not_depend_on_the_context_order(model):
    policy, est = _policy(model), _estimate(model)
    forest, _ = _row(model, "forest16")
    mixed = forest + [(1024, 3)] * 5 + [(16384, 1), (4096, 64), (2048, 2)]
    rng = random.Random(0)
    for p, s in [(1536, 4), (1843, 11), (6144, 10), (1100, 3), (512, 2)]:
        for ctx in (forest[:3], forest, mixed):
            want = (est.saving_us(p, s, ctx), policy.should_promote(p, s, context=ctx))
            for _ in range(5):
                perm = rng.sample(ctx, len(ctx))
                assert (est.saving_us(p, s, perm), policy.should_promote(p, s, context=perm)) == want


def test_saving_is_the_served_step_without_minus_with_the_group():
    """T(X) = min(paged, cascade step of X HOT); the paged step credits every shared prefix."""
    est = _estimate("llama-3.1-8b")
    d, cm, n = est.dispatcher, est.dispatcher.cost_model, est.dispatcher.num_layers
    forest, _ = _row("llama-3.1-8b", "forest16")
    cand = (2765, 5)
    grouped = [g for g in forest if g != cand]
    ctx = grouped + [(2048, 1)]  # one ungrouped request: in the batch, in no group
    batch = ctx + [cand]

    def work(grouped):
        return Workload.from_sums(d.geometry, batch_size=sum(s for _, s in batch),
                                  seq_tokens=sum(s * (p + 256) for p, s in batch),
                                  prefix_tokens=sum(p for p, _ in grouped),
                                  stacked_prefix_tokens=sum(p * s for p, s in grouped),
                                  num_grouped=sum(s for _, s in grouped), num_groups=len(grouped))

    paged = cm.paged_time(work(batch), num_layers=n)
    with_c = min(paged, cm.step_time("cascade", work(grouped + [cand]), num_layers=n))
    without = min(paged, cm.step_time("cascade", work(grouped), num_layers=n))
    assert est.saving_us(*cand, ctx) == pytest.approx(without - with_c)
    assert without - with_c > 0 and est.saving_us(*cand) == 0.0  # pays in the step, not alone


def test_forced_paths_and_groups_too_small():
    assert _estimate("llama-3.1-8b", "paged").saving_us(16384, 64, [(16384, 64)]) == 0.0
    assert not _policy("llama-3.1-8b", "paged").may_promote(16384, 64)
    assert _estimate("llama-3.1-8b", "cascade").saving_us(1024, 2) == float("inf")
    est = _estimate("llama-3.1-8b")
    assert not est.serves(1) and est.saving_us(4096, 1, [(4096, 12)] * 15) == 0.0


def test_a_group_below_another_is_priced_against_being_served_in_it():
    """``within``: without the candidate, its requests are served in the group above it."""
    est = _estimate("llama-3.1-8b")
    forest, _ = _row("llama-3.1-8b", "forest16")
    others = forest[:-1]
    # two of the 6144 x 10 group's agents share 64 more tokens: a sub-group saves nothing
    assert est.saving_us(6144 + 64, 2, others) > 0  # as if the two were ungrouped without it
    assert est.saving_us(6144 + 64, 2, others, within=(6144, 8)) <= 0
    # a 16K x 64 prefix whose first 12K is HOT already: the rest still pays, less than all
    rest = est.saving_us(16384, 64, within=(12288, 0))
    assert 0 < rest < est.saving_us(16384, 64)
    assert _policy("llama-3.1-8b").should_promote(16384, 64, within=(12288, 0))
