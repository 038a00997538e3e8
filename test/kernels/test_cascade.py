"""End-to-end cascade paths against plain float64 paged decode over each request's whole sequence.

Tolerances as test_attention_kernels.py (fp16: softmax probabilities rounded to fp16 before the
P.V dot, plus one fp16 rounding of the output; fp32: full fp32 math).
"""

import dataclasses

import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.kernels.cascade import (
    bgemm_cascade_attention,
    bgemm_prefix_attention,
    cascade_attention,
    fused_cascade_attention,
)
from granikv.kernels.reference import decode_attention_ref, prefix_attention_ref
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.plan import Grouping

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
PATHS = {"cascade": cascade_attention, "fused": fused_cascade_attention, "bgemm": bgemm_cascade_attention}


def _ref(b):
    return decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o


def _run(path, ws, b, extra_rows=0):
    fill(ws, b, single_prefix_chunk=path == "bgemm")
    ws.part_o.fill_(float("nan"))  # a stale or skipped partial row would show
    ws.part_lse.fill_(float("nan"))
    out = torch.full((b.bs + extra_rows, *b.q.shape[1:]), float("nan"), dtype=b.q.dtype)
    PATHS[path](b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv", [(4, 2), (1, 2), (5, 1), (4, 4)])
def test_cascade_matches_decode(path, dtype, ratio, hkv):
    b = make_batch(num_q_heads=ratio * hkv, num_kv_heads=hkv, dtype=dtype, seed=100 + ratio)
    ws = CascadeWorkspace(b.bs + 3, ratio * hkv, hkv, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    out = _run(path, ws, b, extra_rows=2)
    torch.testing.assert_close(out[: b.bs].double(), _ref(b), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.isnan(out[b.bs :]).all(), "rows past the batch were written"
    assert (ws.counters == 0).all(), "fused arrival counters not reset"


@pytest.mark.parametrize("block_p", [1, 4])
@pytest.mark.parametrize("merge_rows", ["workspace", "batch"])
@pytest.mark.parametrize("extra_rows", [0, 2])
def test_merge_variants_write_every_request_and_nothing_past_the_batch(block_p, merge_rows, extra_rows):
    """The merge's kernels and grids (KernelConfig.merge_block_p / merge_rows) on a workspace
    larger than the batch: every request matches the reference, rows past it stay untouched."""
    b = make_batch(num_q_heads=8, num_kv_heads=2, dtype=torch.float32, seed=7)
    cfg = dataclasses.replace(SMALL_CONFIG, merge_block_p=block_p, merge_rows=merge_rows)
    ws = CascadeWorkspace(b.bs + 5, 8, 2, 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    out = _run("cascade", ws, b, extra_rows=extra_rows)
    torch.testing.assert_close(out[: b.bs].double(), _ref(b), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.isnan(out[b.bs :]).all(), "rows past the batch were written"


@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_refill_with_different_grouping(path):
    """One workspace, three batches in a row: stale metadata or counters must not leak."""
    ws = CascadeWorkspace(12, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    batches = [
        make_batch(dtype=torch.float32, seed=1),
        make_batch(groups=((53, 3), (21, 4)), n_ungrouped=1, suffix=9, dtype=torch.float32, seed=2),
        make_batch(groups=(), n_ungrouped=5, ungrouped_len=41, dtype=torch.float32, seed=3),  # all paged
    ]
    for b in batches:
        out = _run(path, ws, b)
        torch.testing.assert_close(out.double(), _ref(b), atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bgemm_prefix_attention(dtype):
    b = make_batch(num_q_heads=8, num_kv_heads=2, dtype=dtype, seed=7)
    grouping = Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len)
    st = bgemm_prefix_attention(b.q, b.k, b.v, grouping, sm_scale=b.sm_scale)
    ref = prefix_attention_ref(b.q, b.k, b.v, b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx,
                               b.sm_scale)  # fmt: skip
    idx = torch.as_tensor(b.group_req_idx)
    # CPU path computes in fp32 from the given inputs: fp32 rounding only.
    torch.testing.assert_close(st.o.double(), ref.o[idx], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.lse.double(), ref.lse[idx], atol=1e-5, rtol=1e-5)


IN_KERNELS = dataclasses.replace(SMALL_CONFIG, merge_in_kernels=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv", [(4, 2), (1, 2), (5, 1)])
@pytest.mark.parametrize("extra_rows", [0, 2])
def test_merge_in_kernels_matches_decode_and_leaves_counters_zero(dtype, ratio, hkv, extra_rows):
    """KernelConfig.merge_in_kernels: the prefix and suffix launches merge the rows whose last
    partial row they write (no merge launch); every request matches the float64 decode, rows
    past the batch stay untouched, every arrival counter is zero again, and a second batch of
    another grouping on the same workspace is right too (no count leaks from the first)."""
    ws = CascadeWorkspace(16, ratio * hkv, hkv, 64, "cpu", config=IN_KERNELS, sm_count=32, max_splits=4)
    for seed, kw in ((200 + ratio, {}), (300 + ratio, dict(groups=((53, 3), (21, 4)), n_ungrouped=1, suffix=9))):
        b = make_batch(num_q_heads=ratio * hkv, num_kv_heads=hkv, dtype=dtype, seed=seed, **kw)
        out = _run("cascade", ws, b, extra_rows=extra_rows)
        torch.testing.assert_close(out[: b.bs].double(), _ref(b), atol=TOL[dtype], rtol=TOL[dtype])
        assert torch.isnan(out[b.bs :]).all(), "rows past the batch were written"
        assert (ws.counters == 0).all(), "arrival counters not reset"
        ws.check_integrity()


def test_merge_in_kernels_needs_zero_counters():
    """The check above can fail: a counter left one arrival ahead (a launch that did not finish
    its count) makes the request's row complete one arrival early, so it is merged from a
    partial row not yet written (NaN here) or never merged at all."""
    b = make_batch(num_q_heads=8, num_kv_heads=2, dtype=torch.float32, seed=5)
    ws = CascadeWorkspace(b.bs, 8, 2, 64, "cpu", config=IN_KERNELS, sm_count=32, max_splits=4)
    ws.counters[0, :].fill_(1)
    out = _run("cascade", ws, b)
    assert not torch.isfinite(out[0]).all() or not torch.allclose(out[0].double(), _ref(b)[0], atol=1e-3)
    assert torch.isfinite(out[1:]).all()
    with pytest.raises(AssertionError, match="arrival counters non-zero between launches"):
        ws.check_integrity()  # the request's count ended one past its rows: not reset


@pytest.mark.parametrize("ratio,hkv", [(4, 2), (1, 2)])
def test_merge_in_kernels_with_the_descriptor_prefix_kernel(ratio, hkv):
    """The descriptor (TMA) prefix kernel's arrival epilogue (the interpreter runs its loads)."""
    cfg = dataclasses.replace(IN_KERNELS, prefix_kernel="descriptor")
    b = make_batch(num_q_heads=ratio * hkv, num_kv_heads=hkv, dtype=torch.float32, seed=11)
    ws = CascadeWorkspace(b.bs + 2, ratio * hkv, hkv, 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    out = _run("cascade", ws, b, extra_rows=2)
    torch.testing.assert_close(out[: b.bs].double(), _ref(b), atol=TOL[torch.float32], rtol=TOL[torch.float32])
    assert torch.isnan(out[b.bs :]).all() and (ws.counters == 0).all()


@pytest.mark.parametrize("first", [False, True])
def test_overlapped_launch_order_and_join(monkeypatch, first):
    """With a side stream: the suffix launch runs on it, issued after the prefix launch or, with
    ``suffix_first``, before it; the side stream waits for the current one before any launch,
    and the current one waits for the side stream before the merge (the order a CUDA graph
    captures)."""
    from types import SimpleNamespace

    import granikv.kernels.cascade as cascade
    from granikv.attention.decode.work_list import KernelConfig

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    cur, side = FakeStream("current"), FakeStream("side")
    active = [cur]

    class OnStream:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            active.append(self.s)

        def __exit__(self, *exc):
            active.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur)
    monkeypatch.setattr(torch.cuda, "stream", OnStream)
    monkeypatch.setattr(cascade, "prefix_attention", lambda *a, **k: log.append(f"prefix on {active[-1].name}"))
    monkeypatch.setattr(cascade, "suffix_attention", lambda *a, **k: log.append(f"suffix on {active[-1].name}"))
    monkeypatch.setattr(cascade, "merge_state", lambda plan, out, *a: log.append(f"merge on {active[-1].name}") or out)
    plan = SimpleNamespace(buffers=SimpleNamespace(side_stream=side, config=KernelConfig(suffix_first=first)))
    q = torch.zeros(2, 4, 16)
    cascade.cascade_attention(q, q, q, torch.zeros(2, 4, dtype=torch.int32), plan, sm_scale=1.0)
    launches = ["suffix on side", "prefix on current"] if first else ["prefix on current", "suffix on side"]
    assert log == ["side waits current", *launches, "current waits side", "merge on current"]
