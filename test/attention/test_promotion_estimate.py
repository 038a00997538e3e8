"""PromotionEstimate: the storage policy's view of the dispatcher's cost model."""

import math

import pytest

from granikv.config import GraniKVConfig
from granikv.attention.cost.cost_model import CostModel, Workload
from granikv.attention.dispatcher import Dispatcher
from granikv.attention.promotion_estimate import PromotionEstimate
from granikv.mem_cache.policy import PaysOffPolicy


def _estimate(path="auto", min_group_size=2):
    d = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=32, num_kv_heads=8,
                   head_dim=128, kv_dtype_bytes=2, forced_path=path, num_layers=32)
    return PromotionEstimate(d, min_group_size=min_group_size)


def test_saving_is_the_dispatchers_paged_minus_cascade_time():
    est = _estimate()
    d = est.dispatcher
    w = Workload.from_sums(d.geometry, batch_size=64, seq_tokens=64 * (16384 + 256),
                           prefix_tokens=16384, stacked_prefix_tokens=64 * 16384,
                           num_grouped=64, num_groups=1)
    want = (d.cost_model.paged_time(w, num_layers=32)
            - d.cost_model.step_time("cascade", w, num_layers=32))  # what the dispatcher compares
    assert est.saving_us(16384, 64) == pytest.approx(want)
    assert want > 0  # the regime the shared-prefix path exists for


def test_saving_grows_with_sharers_and_prefix_length():
    est = _estimate()
    by_sharers = [est.saving_us(4096, g) for g in (2, 3, 8, 64)]
    by_length = [est.saving_us(p, 8) for p in (512, 2048, 8192, 32768)]
    assert by_sharers == sorted(by_sharers) and by_length == sorted(by_length)


def test_paths_the_dispatcher_never_takes_give_no_saving():
    assert _estimate(min_group_size=4).saving_us(16384, 3) == 0.0  # never grouped
    assert _estimate(path="paged").saving_us(16384, 64) == 0.0
    assert math.isinf(_estimate(path="cascade").saving_us(1024, 2))  # forced: always served


def test_copy_cost_is_the_kv_read_and_written_once():
    est = _estimate()
    per_token = 2 * 8 * 128 * 2 * 32  # K+V, heads, dim, bf16, layers
    assert est.copy_us(1000) == pytest.approx(2 * 1000 * per_token / (est.dispatcher.cost_model.suffix_gbps * 1e3))


def test_policy_on_the_h200_model():
    cfg = GraniKVConfig(hot_min_tokens=256, hot_min_sharers=2)
    policy = PaysOffPolicy.from_config(cfg, _estimate())
    assert policy.should_promote(16384, 64)  # homogeneous 16K, 64 agents
    assert not policy.should_promote(16384, 64, remaining_steps=0)  # nothing left to decode
    assert not PaysOffPolicy.from_config(cfg, _estimate(path="paged")).should_promote(16384, 64)
    short = [g for g in (2, 3, 8, 64) if policy.should_promote(1100, g)]
    # whatever the calibration says about short prefixes, it agrees with the estimate
    assert short == [g for g in (2, 3, 8, 64) if _estimate().saving_us(1100, g) > 0
                     and _estimate().saving_us(1100, g) * 128 > _estimate().copy_us(1100)]
