"""GPU host: the extend prefix part over HOT extents (``HotExtendAttention`` with
``FlashInferDense``: FlashInfer ragged prefill per extent, FA3 on the H200, plus one paged call
for the COLD remainder, merged by LSE) against FlashInfer's paged prefill wrapper over each
request's whole cached prefix, which is what SGLang's flashinfer backend runs for that part;
same KV, bf16, Llama-3.1-8B heads (32q/8kv/128). Batch: two extents (4K and 1K tokens),
requests interleaved, one with a HOT head then 500 COLD tokens (an earlier turn), one with a
COLD prefix, one with none. Skipped on CPU/CI.

Tolerance: both are bf16 flash attention over the same data with fp32 accumulation; they differ
by bf16 rounding of the output (|diff| <= 2^-6 for |o| < 2; one more rounding where the COLD
remainder is merged) and float32 summation order in the LSE (|diff| < 1e-3).
"""

import numpy as np
import pytest
import torch

from granikv.layers.attention.cascade.extend_plan import plan_extend
from granikv.layers.attention.cascade.hot_extend import FlashInferDense, HotExtendAttention

pytestmark = pytest.mark.gpu
HQ, HKV, D = 32, 8, 128


def test_flashinfer_dense_prefix_part_matches_paged_prefill():
    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    slots = 16384
    k_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    v_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    ext = {"A": (1000, 4096), "B": (6000, 1024)}
    kinds = ["A", "B", "none", "A", "A+", "cold", "A", "B"]
    new = np.array([130, 64, 77, 1, 40, 33, 256, 19], dtype=np.int64)
    rows = np.arange(1, len(kinds) + 1, dtype=np.int64)
    start, length = np.zeros(len(kinds) + 1, np.int64), np.zeros(len(kinds) + 1, np.int64)
    req_to_token = torch.zeros(len(kinds) + 1, 8192, dtype=torch.int32, device=dev)
    prefix, nxt = [], 9000  # COLD slots from 9000 on
    for r, k in zip(rows, kinds):
        pre = []
        if k in ("A", "B", "A+"):
            s, n = ext[k[0]]
            pre = list(range(s, s + n))
            start[r], length[r] = s, n
        if k == "A+":
            pre += list(range(nxt, nxt + 500))
            nxt += 500
        if k == "cold":
            pre = list(range(nxt, nxt + 700))
            nxt += 700
        req_to_token[r, : len(pre)] = torch.tensor(pre, dtype=torch.int32)
        prefix.append(len(pre))
    prefix = np.array(prefix, dtype=np.int64)
    plan, reason = plan_extend(rows, prefix, new, start, length)
    assert reason == "" and len(plan.groups) == 2 and plan.paged.num_requests == 2
    n_tok = int(new.sum())
    q = torch.randn(n_tok, HQ, D, device=dev, dtype=dt, generator=g) * 2
    scale = D ** -0.5

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    attn = HotExtendAttention(FlashInferDense(ws), dev)
    attn.begin(plan, req_to_token)
    o, lse = attn.prefix_part(q, k_buf, v_buf, scale)

    # SGLang's way: the paged prefill wrapper, per request, kv = its cached prefix (page size 1)
    i32 = dict(dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(new)]), **i32)
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(prefix)]), **i32)
    kv_idx = torch.cat([req_to_token[r, :p] for r, p in zip(rows, prefix)])
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    paged.plan(qo_indptr, kv_indptr, kv_idx, torch.ones(len(kinds), **i32), HQ, HKV, D, 1, causal=False,
               sm_scale=scale, q_data_type=dt, kv_data_type=dt)
    ro, rl = paged.run(q, (k_buf.view(-1, 1, HKV, D), v_buf.view(-1, 1, HKV, D)), return_lse=True)

    with_prefix = torch.from_numpy(np.repeat(prefix > 0, new)).to(dev)
    assert not torch.isnan(o).any()
    assert (o[with_prefix].float() - ro[with_prefix].float()).abs().max() <= 2 ** -5
    assert (lse[with_prefix] - rl[with_prefix]).abs().max() < 1e-3
    none = ~with_prefix  # the request with no cached prefix
    assert (o[none] == 0).all() and torch.isneginf(lse[none]).all()
