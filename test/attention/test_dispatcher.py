"""Per-step path choice on synthetic batches (CPU): monotonic sanity, forced paths, eligibility."""

import dataclasses
import math

import numpy as np
import pytest

from granikv.attention.cost.cost_model import CostModel
from granikv.attention.dispatcher import Decision, Dispatcher, Path, PathTimes
from granikv.attention.grouping import BatchDescription, group_requests

HOT = 1_000_000


def batch(groups, *, suffix=256, ungrouped=0, ungrouped_len=4096):
    """groups: list of (prefix_len, n_requests), each at its own HOT start."""
    starts, lens = [], []
    for k, (plen, n) in enumerate(groups):
        starts += [HOT + k * 100_000] * n
        lens += [plen] * n
    starts += [0] * ungrouped
    lens += [0] * ungrouped
    hot_len = np.asarray(lens, dtype=np.int64)
    seq = np.where(hot_len > 0, hot_len + suffix, ungrouped_len)
    bs = len(lens)
    desc = BatchDescription(
        req_pool_indices=np.arange(1, bs + 1, dtype=np.int64),
        seq_lens=seq.astype(np.int64),
        hot_start=np.asarray(starts, dtype=np.int64),
        hot_len=hot_len,
    )
    return group_requests(desc, min_group_size=2), desc


def make(forced="auto", model=None, num_layers=32):
    return Dispatcher(
        model or CostModel.load(None, None),
        num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2,
        forced_path=forced, num_layers=num_layers,
    )  # fmt: skip


def test_many_requests_on_a_long_prefix_leave_paged():
    d = make().choose(*batch([(16384, 64)]))
    assert isinstance(d, Decision)
    assert d.path in (Path.CASCADE, Path.FUSED)
    assert d.times.of(d.path) < d.times.paged
    assert d.path.value in d.reason and "paged" in d.reason


def test_one_request_is_paged():
    d = make().choose(*batch([(16384, 1)]))
    assert d.path is Path.PAGED and d.reason == "no group"
    assert math.isinf(d.times.cascade) and math.isfinite(d.times.paged)


def test_short_prefixes_are_paged():
    for n in (2, 8, 64, 256):
        d = make().choose(*batch([(64, n)]))
        assert d.path is Path.PAGED, (n, d)


def test_the_design_small_case_is_paged():
    """4K prefix, 8 requests: FlashInfer's cascade measured slower than its paged decode on an
    H200 (docs/results/kernels.md: 0.076 vs 0.034 ms), and the default model stays paged."""
    assert make().choose(*batch([(4096, 8)])).path is Path.PAGED


@pytest.mark.parametrize("prefix", [4096, 16384, 32768])
def test_monotonic_in_fan_out(prefix):
    """Once sharing pays off, adding requests to the group keeps it paying off (and it does
    pay off at some fan-out for these prefixes; at 1K the default model never leaves paged)."""
    dispatcher = make()
    left_paged = False
    for n in (2, 3, 5, 8, 17, 32, 37, 64, 128, 256):
        path = dispatcher.choose(*batch([(prefix, n)])).path
        if left_paged:
            assert path is not Path.PAGED, (prefix, n)
        left_paged |= path is not Path.PAGED
    assert left_paged, prefix


def _assert_monotonic_in_prefix_length(dispatcher):
    """Once a longer prefix makes sharing pay off, every longer one does too; and some prefix
    of these does pay off at 32 requests."""
    left_paged = False
    for prefix in (64, 256, 1024, 2048, 4096, 8192, 16384, 32768):
        path = dispatcher.choose(*batch([(prefix, 32)])).path
        if left_paged:
            assert path is not Path.PAGED, prefix
        left_paged |= path is not Path.PAGED
    assert left_paged, "paged at every prefix length"


def test_monotonic_in_prefix_length():
    _assert_monotonic_in_prefix_length(make())


def test_monotonic_check_fails_for_a_dispatcher_that_never_leaves_paged(monkeypatch):
    dispatcher = make()
    always_paged = dispatcher.choose(*batch([(64, 32)]))
    assert always_paged.path is Path.PAGED
    monkeypatch.setattr(dispatcher, "choose", lambda *a, **kw: always_paged)
    with pytest.raises(AssertionError, match="paged at every prefix length"):
        _assert_monotonic_in_prefix_length(dispatcher)


def test_forest_with_ungrouped_requests():
    """The calibrated H200 model serves this forest with cascade. The conservative default
    model's kernels save ~0.3 ms of a 7.8 ms step, less than its per-step overheads (the host
    planning prior and 32 x 3 launch floors): paged, for that reason."""
    grouping, desc = batch([(16384, 8), (8192, 16), (4096, 24), (2048, 16)], ungrouped=5)
    assert grouping.num_groups == 4
    assert make(model=CostModel.load(None, "NVIDIA H200")).choose(grouping, desc).path is Path.CASCADE
    d = make().choose(grouping, desc)
    assert d.path is Path.PAGED and d.host_bound and "host_overhead" in d.reason
    assert all(math.isfinite(t) for t in d.times[:2])  # paged, cascade
    assert math.isinf(d.times.fused) and math.isinf(d.times.bgemm)  # graph step: not captured
    eager = make().choose(grouping, desc, graph_safe_only=False)
    assert all(math.isfinite(t) for t in eager.times)


def test_bgemm_only_when_eager():
    cheap_bgemm = dataclasses.replace(
        CostModel.load(None, None), bgemm_tflops=1e6, bgemm_group_us=1e-3
    )
    dispatcher = make(model=cheap_bgemm)
    args = batch([(16384, 128)])
    graph = dispatcher.choose(*args)  # default: graph_safe_only=True
    assert graph.path is not Path.BGEMM and math.isinf(graph.times.bgemm)
    eager = dispatcher.choose(*args, graph_safe_only=False)
    assert eager.path is Path.BGEMM and math.isfinite(eager.times.bgemm)


@pytest.mark.parametrize("forced", ["paged", "cascade", "fused", "bgemm"])
def test_forced_paths(forced):
    dispatcher = make(forced)
    short = batch([(64, 2)])  # auto would pick paged
    d = dispatcher.choose(*short, graph_safe_only=False)
    assert d.path is Path(forced) and forced in d.reason
    # No group: always paged.
    assert dispatcher.choose(*batch([], ungrouped=3), graph_safe_only=False).path is Path.PAGED
    assert dispatcher.choose(*batch([(16384, 1)]), graph_safe_only=False).path is Path.PAGED


def test_forced_bgemm_under_cuda_graph_falls_back_to_paged():
    d = make("bgemm").choose(*batch([(16384, 64)]), graph_safe_only=True)
    assert d.path is Path.PAGED and "eager" in d.reason


def test_paged_wins_ties(monkeypatch):
    dispatcher = make()
    tie = PathTimes(paged=5.0, cascade=5.0, fused=5.0, bgemm=math.inf)
    monkeypatch.setattr(dispatcher, "estimate", lambda *a, **k: tie)
    d = dispatcher.choose(*batch([(4096, 8)]))
    assert d.path is Path.PAGED and d.times == tie


def test_invalid_configuration():
    with pytest.raises(ValueError, match="forced_path='fast'"):
        make("fast")
    with pytest.raises(ValueError, match="num_q_heads=30 is not a multiple of num_kv_heads=8"):
        Dispatcher(CostModel.load(None, None), num_q_heads=30, num_kv_heads=8, head_dim=128,
                   kv_dtype_bytes=2)  # fmt: skip
    with pytest.raises(ValueError, match="num_layers=0"):
        make(num_layers=0)


def test_disabled_paths_are_never_chosen():
    import dataclasses as dc

    from granikv.attention.cost.cost_model import CostModel

    model = dc.replace(CostModel.load(None, None), disabled_paths=("cascade", "fused", "bgemm"))
    d = Dispatcher(model, num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)
    n = 64
    desc = BatchDescription(np.arange(1, n + 1), np.full(n, 16640), np.full(n, 1000),
                            np.full(n, 16384))
    g = group_requests(desc, min_group_size=2)
    assert d.choose(g, desc, graph_safe_only=False).path is Path.PAGED


@pytest.mark.parametrize("hq,hkv,layers", [(32, 8, 32), (20, 4, 48), (10, 2, 64)])
def test_h200_model_at_per_rank_heads_of_the_multi_gpu_runs(hq, hkv, layers):
    """The checked-in H200 model (calibrated at 32q/8kv) at the per-rank heads of the planned
    multi-GPU runs (Llama-3.1-8B TP=1, Qwen2.5-14B TP=2, Qwen2.5-32B TP=4; docs/multi_gpu.md):
    a 16K prefix shared by 64 requests goes to cascade, a batch without a group stays paged."""
    d = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                   kv_dtype_bytes=2, num_layers=layers)
    bs = 64
    rpi = np.arange(1, bs + 1, dtype=np.int64)
    seq = np.full(bs, 16384 + 256, dtype=np.int64)
    shared = BatchDescription(rpi, seq, np.full(bs, 1000, np.int64), np.full(bs, 16384, np.int64))
    assert d.choose(group_requests(shared, min_group_size=2), shared).path is Path.CASCADE
    alone = BatchDescription(rpi, seq, np.zeros(bs, np.int64), np.zeros(bs, np.int64))
    assert d.choose(group_requests(alone, min_group_size=2), alone).path is Path.PAGED


def test_a_gpu_without_calibrated_coefficients_is_warned_about_once(caplog, monkeypatch):
    """No ``--granikv-cost-model`` and no shipped file for the GPU (an A100 here): one warning
    naming the GPU, the file it looked for and the flag; none for the H200 or the H100 80GB
    (their files ship), none with an explicit file, none a second time."""
    from granikv.attention import dispatcher as dmod

    monkeypatch.setattr(dmod, "_WARNED_GPUS", set())
    with caplog.at_level("WARNING", logger="granikv"):
        assert dmod.warn_if_uncalibrated(None, "NVIDIA A100-SXM4-80GB")
        assert not dmod.warn_if_uncalibrated(None, "NVIDIA A100-SXM4-80GB")
        assert not dmod.warn_if_uncalibrated(None, "NVIDIA H200")
        assert not dmod.warn_if_uncalibrated(None, "NVIDIA H100 80GB HBM3")
        assert not dmod.warn_if_uncalibrated("/some/file.json", "NVIDIA L40S")
        assert not dmod.warn_if_uncalibrated(None, None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "NVIDIA A100-SXM4-80GB" in lines[0]
    assert "cost_model_nvidia-a100-sxm4-80gb.json" in lines[0] and "--granikv-cost-model" in lines[0]
