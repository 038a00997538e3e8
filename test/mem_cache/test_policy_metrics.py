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
