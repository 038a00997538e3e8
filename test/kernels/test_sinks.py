"""Attention sinks in the cascade merge (merge_state.py, fused_cascade.py): the sink's logit joins
the softmax denominator once per q-head, whichever partial rows the work is cut into.

Every path (cascade, fused, bgemm) against the float64 reference (``with_sinks_ref``) at odd
shapes, head_dim 64 (gpt-oss's), GQA 1 / 3 / 8, fp16 tolerances of test_cascade.py, per
request; the convention pinned against SGLang's own triton decode kernel with sinks (the
kernel gpt-oss runs on); planted faults: a sink applied once per partial row, and the sink
scaled like a score, both fail the same check.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from support.per_request import assert_per_request
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
from granikv.kernels.merge_state import merge_rows
from granikv.kernels.reference import decode_attention_ref, merge_state_ref, with_sinks_ref

PATHS = {"cascade": cascade_attention, "fused": fused_cascade_attention, "bgemm": bgemm_cascade_attention,
         "cascade_merge_in_kernels": cascade_attention}  # the last: KernelConfig.merge_in_kernels
SHAPES = [(8, 8), (12, 4), (16, 2)]  # (Hq, Hkv): GQA 1, 3, 8


def _batch(hq, hkv, seed):
    return make_batch(groups=((37, 2), (29, 5)), n_ungrouped=2, suffix=23, ungrouped_len=41, num_q_heads=hq,
                      num_kv_heads=hkv, head_dim=64, seed=seed)


def _sinks(hq, seed):
    """Sink logits of the order of a row's log-sum-exp (the range where they matter)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=g) * 1.5 + 3.0).float()


def _run(path, b, sinks):
    cfg = dataclasses.replace(SMALL_CONFIG, merge_in_kernels=path.endswith("merge_in_kernels"))
    ws = CascadeWorkspace(b.bs + 1, b.q.shape[1], b.k.shape[1], 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    fill(ws, b, single_prefix_chunk=path == "bgemm")
    out = torch.full_like(b.q, float("nan"))
    return PATHS[path](b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out, sinks=sinks)


@pytest.mark.parametrize("hq, hkv", SHAPES)
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_with_sinks_matches_the_reference(path, hq, hkv):
    b = _batch(hq, hkv, seed=hq + hkv)
    sinks = _sinks(hq, 1)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale, sinks).o
    plain = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    assert (ref - plain).abs().max() > 0.05  # the sinks move the output well past the tolerance
    assert_per_request(_run(path, b, sinks), ref)


@pytest.mark.parametrize("fault", ["once_per_partial_row", "scaled_like_a_score"])
def test_planted_faults_fail_the_same_check(fault):
    """What a wrong sink convention gives, computed from the kernel's own partial rows: the
    per-request check above rejects it."""
    b = _batch(12, 4, seed=5)
    sinks = _sinks(12, 2)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale, sinks).o
    ws = CascadeWorkspace(b.bs + 1, 12, 4, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    cascade_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)  # fills the partial rows
    ptr = wl.part_indptr
    assert (np.diff(ptr) > 1).any()  # some requests have several partial rows
    outs = []
    for i in range(b.bs):
        o, lse = ws.part_o[ptr[i] : ptr[i + 1]], ws.part_lse[ptr[i] : ptr[i + 1]]
        if fault == "once_per_partial_row":  # each row's own softmax with the sink, then merged
            st = with_sinks_ref(type(merge_state_ref(o, lse))(o.double(), lse.double()), sinks)
            outs.append(merge_state_ref(st.o, st.lse).o)
        else:  # the sink multiplied by the softmax scale, as a score would be
            outs.append(with_sinks_ref(merge_state_ref(o, lse), sinks * b.sm_scale).o)
    bad = torch.stack(outs)
    if fault == "once_per_partial_row":
        several = [i for i in range(b.bs) if ptr[i + 1] - ptr[i] > 1]
        bad, ref = bad[several], ref[several]
    with pytest.raises(AssertionError, match="^request "):
        assert_per_request(bad, ref)


@pytest.mark.parametrize("block_p", [1, 2])
def test_merge_rows_with_sinks_matches_the_reference_and_empty_rows_stay_zero(block_p):
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = 6, 2, 64
    counts = [3, 1, 0, 2, 5]
    rows = sum(counts)
    part_o = torch.randn(rows, hq, d, generator=g)
    part_lse = torch.randn(rows, hq, generator=g) * 2
    part_lse[4, 1] = float("-inf")  # an empty partial row for one head
    ptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    sinks = _sinks(hq, 4)
    out = merge_rows(part_o, part_lse, ptr, torch.empty(len(counts), hq, d), hkv, sinks=sinks, block_p=block_p)
    for i, n in enumerate(counts):
        lo = int(ptr[i])
        if n == 0:
            assert (out[i] == 0).all()
            continue
        want = with_sinks_ref(merge_state_ref(part_o[lo : lo + n], part_lse[lo : lo + n]), sinks).o
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


def test_the_convention_is_sglangs_triton_decode_with_sinks():
    """SGLang's own triton decode kernel (the one it runs gpt-oss's sinks on) on the same KV:
    GraniKV's cascade output with the same sinks matches it per request."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    b = _batch(8, 2, seed=9)
    sinks = _sinks(8, 5)
    bs, hq, d = b.q.shape
    rows = torch.as_tensor(b.req_pool_indices)
    lens = torch.as_tensor(b.seq_lens)
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = lens.cumsum(0)
    idx = torch.cat([b.req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist(), strict=True)]).long()
    splits = 4
    sgl = torch.empty_like(b.q)
    logits = torch.empty(bs, hq, splits, d, dtype=torch.float32)
    lse = torch.empty(bs, hq, splits, dtype=torch.float32)
    nsp = torch.full((bs,), splits, dtype=torch.int32)
    decode_attention_fwd(b.q, b.k, b.v, sgl, indptr, idx, logits, lse, nsp, splits, b.sm_scale, 1.0, 1.0,
                         sinks=sinks)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale, sinks).o
    assert_per_request(sgl, ref)  # SGLang's kernel is the float64 convention
    assert_per_request(_run("cascade", b, sinks), sgl.double())
