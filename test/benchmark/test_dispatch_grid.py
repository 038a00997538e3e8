"""dispatch_grid.py: the dispatcher's choice on grid rows, looked up in the measured times."""

from bench_scripts import load  # noqa: E402  (test/benchmark, on the path)

from granikv.attention.cost.cost_model import CostModel
from granikv.attention.dispatcher import Dispatcher


def _mod():
    return load("kernels", "dispatch_grid.py")


def _row(groups, suffix, **ms):
    return dict(groups=groups, suffix=suffix, requests=sum(n for _, n in groups), **{k + "_ms": v for k, v in ms.items()})


def test_choices_are_looked_up_in_the_measured_times():
    mod = _mod()
    d = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)
    rows = [
        _row([[16384, 1]], 256, fi_decode_tc=0.04, sgl_triton=0.05, gkv_cascade=0.03),  # 1 request: no group
        _row([[16384, 64]], 256, fi_decode_tc=0.495, sgl_triton=0.92, gkv_cascade=0.0745),  # the H200 model: cascade
        _row([[4096, 8]], 256, fi_decode_tc=0.03, sgl_triton=0.02, gkv_cascade=0.027),
        dict(groups=[[1024, 8]], suffix=64, requests=8, error="boom"),  # failed rows are skipped
    ]
    res = mod.evaluate(rows, d, graph=True)
    assert [x["path"] for x in res][:2] == ["paged", "cascade"] and len(res) == 3
    assert res[0]["ratio"] == 1.0  # paged is the stock flashinfer kernel, the best paged here
    assert abs(res[1]["ratio"] - 0.495 / 0.0745) < 1e-9
    # where SGLang's triton kernel beats FlashInfer's, keeping paged (flashinfer) scores below 1
    third = res[2]
    assert third["best_paged_ms"] == 0.02 and third["ratio"] == 0.02 / third["chosen_ms"]
    desc = mod.describe([(100, 2), (50, 3)], 7)
    assert desc.hot_len.tolist() == [100, 100, 50, 50, 50] and desc.seq_lens.tolist() == [107, 107, 57, 57, 57]
    assert len(set(desc.hot_start[:2])) == 1 and desc.hot_start[0] != desc.hot_start[2]


def test_interleaved_batch_keeps_the_groups_and_spreads_their_members():
    """calibrate.describe(order_seed=...): the same groups and slots, members spread over the batch
    (batch_order.py's interleaved case); the adjacent layout is unchanged without a seed."""
    from granikv.attention.grouping import group_requests

    cal = load("kernels", "calibrate.py")
    groups = [(64, 2), (48, 3), (32, 2), (16, 3)]
    adj, rows_a, label_a = cal.describe(groups, 5, 0)
    mix, rows_m, label_m = cal.describe(groups, 5, 0, order_seed=1)
    assert label_m == label_a + " interleaved"
    ga, gm = group_requests(adj, min_group_size=1), group_requests(mix, min_group_size=1)
    assert sorted(ga.group_len.tolist()) == sorted(gm.group_len.tolist()) and gm.num_grouped == ga.num_grouped
    assert sorted(mix.hot_start.tolist()) == sorted(adj.hot_start.tolist())
    runs = lambda d: sum(int(d.hot_start[i] != d.hot_start[i - 1]) for i in range(1, d.batch_size))  # noqa: E731
    assert runs(adj) == len(groups) - 1 and runs(mix) > runs(adj)  # members no longer adjacent
    for d, rows in ((adj, rows_a), (mix, rows_m)):  # every row holds its prefix's slots, then its own
        for i in range(d.batch_size):
            h, s = int(d.hot_len[i]), int(d.seq_lens[i])
            assert rows[i + 1, :h].tolist() == list(range(int(d.hot_start[i]), int(d.hot_start[i]) + h))
            assert len(set(rows[i + 1, h:s].tolist())) == s - h
