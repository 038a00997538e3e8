"""Prefix, suffix and merge kernels against the float64 reference (Triton interpreter on CPU).

Tolerances: fp32 inputs run full-precision fp32 dots ("ieee"), so 2e-5 covers fp32 accumulation
over <= 100 keys; fp16 inputs round the softmax probabilities to fp16 before the P.V dot (as every
flash kernel does), about 1e-3 relative on o, so 4e-3; the LSE only sees fp32-accumulated q.k
products of exact fp16 values, so 1e-4.
"""

import dataclasses

import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.kernels.merge_state import merge_rows
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.reference import merge_state_ref, partials_ref
from granikv.kernels.suffix_attention import suffix_attention
from granikv.attention.decode.workspace import CascadeWorkspace

O_TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
LSE_TOL = {torch.float32: 2e-5, torch.float16: 1e-4}
SUFFIX_HEADS = {(4, 2): 2, (1, 2): 2, (5, 2): 2, (4, 4): 4}  # (GQA ratio, kv heads) -> kv heads per suffix program
SHAPES = list(SUFFIX_HEADS)


def _setup(dtype, ratio, hkv, seed, suffix_head_group=True, even_split=False, **kw):
    b = make_batch(num_q_heads=ratio * hkv, num_kv_heads=hkv, dtype=dtype, seed=seed, **kw)
    cfg = dataclasses.replace(SMALL_CONFIG, suffix_head_group=suffix_head_group, even_split=even_split)
    ws = CascadeWorkspace(b.bs + 2, ratio * hkv, hkv, 64, "cpu", config=cfg, sm_count=32, max_splits=4)
    wl = fill(ws, b)
    ws.part_o.fill_(float("nan"))
    ws.part_lse.fill_(float("nan"))
    return b, ws, wl


def _check_rows(ws, expected, rows, dtype):
    for r in rows:
        e = expected[r]
        torch.testing.assert_close(ws.part_o[r].double(), e.o, atol=O_TOL[dtype], rtol=O_TOL[dtype])
        torch.testing.assert_close(ws.part_lse[r].double(), e.lse, atol=LSE_TOL[dtype], rtol=LSE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv", SHAPES)
@pytest.mark.parametrize("loads", ["pointers", "even_split"])
def test_prefix_attention(dtype, ratio, hkv, loads):
    b, ws, wl = _setup(dtype, ratio, hkv, seed=ratio, even_split=loads == "even_split")
    assert wl.pfx_split.max() >= 1 and wl.prefix_chunk % SMALL_CONFIG.block_n == 0  # several kv chunks
    assert (wl.pfx_n_kv % SMALL_CONFIG.block_n != 0).any()  # a masked tail
    prefix_attention(b.q, b.k, b.v, ws.plan, sm_scale=b.sm_scale)
    exp = partials_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, wl, b.sm_scale)
    pfx_rows = sorted(set(exp) - set(wl.sfx_row.tolist()))
    _check_rows(ws, exp, pfx_rows, dtype)
    assert torch.isnan(ws.part_o[wl.sfx_row]).all(), "prefix kernel wrote a suffix row"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio,hkv", SHAPES)
@pytest.mark.parametrize("head_group", [True, False])
def test_suffix_attention(dtype, ratio, hkv, head_group):
    b, ws, wl = _setup(dtype, ratio, hkv, seed=10 + ratio, ungrouped_len=70, suffix_head_group=head_group)
    assert ws.suffix_heads == (SUFFIX_HEADS[ratio, hkv] if head_group else 1)
    assert (wl.sfx_req[1:] == wl.sfx_req[:-1]).any()  # a request with several suffix chunks
    suffix_attention(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale)
    exp = partials_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, wl, b.sm_scale)
    _check_rows(ws, exp, wl.sfx_row.tolist(), dtype)
    n_written = torch.isfinite(ws.part_lse[: wl.num_partials]).all(1).sum().item()
    assert n_written == wl.num_suffix_items, "suffix kernel wrote rows outside its items"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio", [1, 4, 5])
@pytest.mark.parametrize("block_p", [1, 2, 4])
def test_merge_rows(dtype, ratio, block_p):
    """Random partial states, CSR with 0..9 rows per request, some rows empty (lse = -inf),
    including a request whose first rows are all empty before finite ones; the tile merge
    (``block_p`` > 1) over requests of fewer, as many and more rows than a tile."""
    g = torch.Generator().manual_seed(ratio)
    counts = torch.tensor([3, 1, 0, 4, 2, 1, 9])
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    rows, hkv, d = int(counts.sum()), 2, 64
    hq = ratio * hkv
    o = torch.randn(rows, hq, d, generator=g)
    lse = torch.randn(rows, hq, generator=g) * 4
    lse[2, : hq // 2] = float("-inf")  # an empty chunk
    lse[3] = float("-inf")  # request 1's only row is empty -> zeros
    lse[4:6, :] = float("-inf")  # request 3: its first two rows empty, then finite rows
    out = torch.full((len(counts), hq, d), float("nan"), dtype=dtype)
    merge_rows(o, lse, indptr, out, hkv, block_p=block_p)
    for i in range(len(counts)):
        lo, hi = int(indptr[i]), int(indptr[i + 1])
        exp = merge_state_ref(o[lo:hi], lse[lo:hi]).o if hi > lo else torch.zeros(hq, d, dtype=torch.float64)
        # fp16 output: one rounding of an fp32 result, half an ulp of 2^-10 relative.
        tol = {torch.float32: 1e-5, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(out[i].double(), exp, atol=tol, rtol=tol)
