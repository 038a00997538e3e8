import pytest

from granikv.config import GraniKVConfig
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import NeverPromote, SharedLongPrefixPolicy


def test_shared_long_prefix_policy():
    p = SharedLongPrefixPolicy.from_config(GraniKVConfig(hot_min_tokens=64, hot_min_sharers=3))
    assert p.should_promote(64, 3)
    assert not p.should_promote(63, 10)
    assert not p.should_promote(1000, 2)
    assert not NeverPromote().should_promote(10**6, 10**3)
    with pytest.raises(ValueError):
        SharedLongPrefixPolicy(min_tokens=0, min_sharers=1)


def test_metrics_snapshot_and_format():
    m = GraniKVMetrics(hot_capacity=100, hot_used_tokens=25, cold_capacity=50)
    m.skip("no_space")
    m.skip("no_space")
    snap = m.snapshot()
    assert snap["promotions_skipped"] == 2 and snap["skip_reasons"] == {"no_space": 2}
    line = m.format()
    assert "\n" not in line and "25/100 (25.0%)" in line


class _Estimate:
    """saving = (sharers - 1) * prefix_len / 1000 us per step; copy = prefix_len / 10 us."""

    def __init__(self):
        self.calls = []

    def serves(self, num_sharers):
        return num_sharers >= 2

    def saving_us(self, prefix_len, num_sharers, context=(), within=None):
        self.calls.append((prefix_len, num_sharers))
        return (num_sharers - 1) * prefix_len / 1000

    def copy_us(self, num_tokens):
        return num_tokens / 10


def test_pays_off_policy_weighs_saving_over_steps_against_copy():
    from granikv.mem_cache.policy import PaysOffPolicy

    p = PaysOffPolicy(_Estimate(), min_tokens=16, min_sharers=2, default_steps=200)
    # 2 sharers, 1000 tokens: 1 us/step * 200 steps = 200 > copy 100
    assert p.should_promote(1000, 2)
    assert not p.should_promote(1000, 2, remaining_steps=50)  # 50 < 100
    assert p.should_promote(1000, 3, remaining_steps=51)  # 2 us/step * 51 = 102 > 100
    assert not p.should_promote(1000, 1)  # the floors stay: never asks the estimate
    assert not p.should_promote(15, 50)
    assert p.estimate.calls == [(1000, 2), (1000, 2), (1000, 3)]
    slots = PaysOffPolicy(_Estimate(), min_tokens=16, min_sharers=2, default_steps=200, slot_us=0.2)
    assert not slots.should_promote(1000, 2)  # 200 < 100 + 0.2 * 1000
    with pytest.raises(ValueError, match="default_steps"):
        PaysOffPolicy(_Estimate(), min_tokens=16, min_sharers=2, default_steps=0)


def test_pays_off_policy_in_the_cache_skips_what_does_not_pay():
    """Queued once it passes the floors; executed only if the holders' remaining decode budget
    still pays (``does_not_pay``); decisions depend only on tree and request state."""
    import random
    from types import SimpleNamespace

    from granikv.mem_cache.policy import PaysOffPolicy
    from support.scheduler_sim import Sim

    sim = Sim()
    sim.cache.policy = PaysOffPolicy(_Estimate(), min_tokens=16, min_sharers=2, default_steps=200)
    rng = random.Random(0)
    prefix = [rng.randrange(61) for _ in range(40)]
    reqs = []
    for i, budget in enumerate((1, 2)):  # 0.04 us/step * 1.5 steps < copy 4 us
        r = sim.admit(prefix + [i, i])
        r.sampling_params = SimpleNamespace(max_new_tokens=budget)
        reqs.append(r)
    assert sim.promote() == 0 and sim.cache.metrics.skip_reasons["does_not_pay"] == 1
    for r in reqs:
        r.sampling_params.max_new_tokens = 1000  # 0.04 * 1000 = 40 > 4
    sim.lock(prefix + [0])  # an admission re-queues it
    sim.unlock()
    assert sim.promote() == 1
    sim.check()
