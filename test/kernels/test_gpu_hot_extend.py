"""GPU host: the extend prefix part over HOT extents with FlashInfer's ragged prefill
(``FlashInferDense``, FA3 on the H200) against FlashInfer's paged prefill wrapper, which is what
SGLang's flashinfer backend runs for that part (per request, page size 1), on the same KV,
bf16, Llama-3.1-8B heads (32q/8kv/128): two extents (4K and 1K tokens), requests interleaved in
the batch, a request without a cached prefix. Skipped on CPU/CI.

Tolerance: both are bf16 flash attention over the same data with fp32 accumulation; they differ
by bf16 rounding of the output (|diff| <= 2^-6 for |o| < 2) and float32 summation order in the
LSE (|diff| < 1e-3).
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
    slots = 8192
    k_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    v_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    ext = {"A": (1000, 4096), "B": (6000, 1024)}
    kinds = ["A", "B", "none", "A", "A", "B"]
    new = np.array([130, 64, 77, 1, 256, 19], dtype=np.int64)
    prefix = np.array([ext[k][1] if k in ext else 0 for k in kinds], dtype=np.int64)
    rows = np.arange(1, len(kinds) + 1, dtype=np.int64)
    start, length = np.zeros(len(kinds) + 1, np.int64), np.zeros(len(kinds) + 1, np.int64)
    for r, k in zip(rows, kinds):
        if k in ext:
            start[r], length[r] = ext[k]
    plan, reason = plan_extend(rows, prefix, new, start, length)
    assert reason == "" and len(plan.groups) == 2
    n_tok = int(new.sum())
    q = torch.randn(n_tok, HQ, D, device=dev, dtype=dt, generator=g) * 2
    scale = D ** -0.5

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    attn = HotExtendAttention(FlashInferDense(ws), dev)
    attn.begin(plan)
    o, lse = attn.prefix_part(q, k_buf, v_buf, scale)

    # SGLang's way: the paged prefill wrapper, per request, kv = its prefix slots (page size 1)
    i32 = dict(dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(new)]), **i32)
    kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(prefix)]), **i32)
    kv_idx = torch.cat([torch.arange(ext[k][0], ext[k][0] + ext[k][1], **i32) for k in kinds if k in ext])
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    paged.plan(qo_indptr, kv_indptr, kv_idx, torch.ones(len(kinds), **i32), HQ, HKV, D, 1, causal=False,
               sm_scale=scale, q_data_type=dt, kv_data_type=dt)
    ro, rl = paged.run(q, (k_buf.view(-1, 1, HKV, D), v_buf.view(-1, 1, HKV, D)), return_lse=True)

    hot = torch.from_numpy(np.concatenate([gr.token_idx for gr in plan.groups])).to(dev)
    assert not torch.isnan(o).any()
    assert (o.index_select(0, hot).float() - ro.index_select(0, hot).float()).abs().max() <= 2 ** -6
    assert (lse.index_select(0, hot) - rl.index_select(0, hot)).abs().max() < 1e-3
    cold = torch.arange(130 + 64, 130 + 64 + 77, device=dev)  # the request with no cached prefix
    assert (o[cold] == 0).all() and torch.isneginf(lse[cold]).all()
