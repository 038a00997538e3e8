"""GPU host: the extend prefix part over HOT extents (``HotExtendAttention`` with
``FlashInferDense``: FlashInfer ragged prefill calls over the extents (batched, ``ExtendCall``), FA3 on the H200, plus one paged call
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

from granikv.attention.extend.plan import plan_extend
from granikv.attention.extend.hot_extend import FlashInferDense, HotExtendAttention

pytestmark = pytest.mark.gpu
HQ, HKV, D = 32, 8, 128
EXT = {"A": (1000, 4096), "B": (6000, 1024)}
KINDS = ["A", "B", "none", "A", "A+", "cold", "A", "B"]
NEW = np.array([130, 64, 77, 1, 40, 33, 256, 19], dtype=np.int64)


def _batch(dev, with_new_slots: bool):
    """The batch of both tests: request r's cached prefix is extent A or B, A then 500 COLD
    tokens (an earlier turn), 700 COLD tokens, or none; COLD slots from 9000 on. With
    ``with_new_slots`` each row also gets its new tokens' slots after its prefix (``out_loc``).
    Returns rows, prefix lengths, hot run start / length per row, req_to_token, out_loc."""
    rows = np.arange(1, len(KINDS) + 1, dtype=np.int64)
    start, length = np.zeros(len(KINDS) + 1, np.int64), np.zeros(len(KINDS) + 1, np.int64)
    req_to_token = torch.zeros(len(KINDS) + 1, 8192, dtype=torch.int32, device=dev)
    prefix, out_loc, nxt = [], [], 9000
    for r, kd, n in zip(rows, KINDS, NEW):
        pre = []
        if kd in ("A", "B", "A+"):
            s, m = EXT[kd[0]]
            pre = list(range(s, s + m))
            start[r], length[r] = s, m
        if kd == "A+":
            pre, nxt = pre + list(range(nxt, nxt + 500)), nxt + 500
        if kd == "cold":
            pre, nxt = list(range(nxt, nxt + 700)), nxt + 700
        loc = []
        if with_new_slots:
            loc, nxt = list(range(nxt, nxt + int(n))), nxt + int(n)
        req_to_token[r, : len(pre) + len(loc)] = torch.tensor(pre + loc, dtype=torch.int32)
        prefix.append(len(pre))
        out_loc += loc
    return rows, np.array(prefix, dtype=np.int64), start, length, req_to_token, out_loc


def test_flashinfer_dense_prefix_part_matches_paged_prefill():
    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    slots = 16384
    k_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    v_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    kinds, new = KINDS, NEW
    rows, prefix, start, length, req_to_token, _ = _batch(dev, with_new_slots=False)
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


def _full_extend_batch(dev, dt, g, hot=True):
    """The batch of the FullExtend tests, new-token slots included: its plan, rows, prefix
    lengths, req_to_token, the new tokens' slots and their q / k / v (drawn from ``g``).
    ``hot=False``: no HOT run anywhere, planned with ``cover_all`` (every cached prefix token in
    the COLD remainder, as GraniKV plans an FP8 cache's batch without a HOT run)."""
    rows, prefix, start, length, req_to_token, out_loc = _batch(dev, with_new_slots=True)
    plan, reason = plan_extend(rows, prefix, NEW, start, length if hot else 0 * length, cover_all=not hot)
    assert reason == "" and bool(plan.groups) == hot
    n_tok = int(NEW.sum())
    q = torch.randn(n_tok, HQ * D, device=dev, dtype=dt, generator=g) * 2
    k = torch.randn(n_tok, HKV * D, device=dev, dtype=dt, generator=g)
    v = torch.randn(n_tok, HKV * D, device=dev, dtype=dt, generator=g)
    return plan, rows, prefix, req_to_token, out_loc, q, k, v


def test_full_extend_matches_causal_paged_prefill_over_the_rows():
    """``FullExtend`` (wrapped backends without ragged + paged calls, e.g. triton): KV write
    through SGLang's real pool, ragged causal call, prefix part, merge; against FlashInfer's
    paged prefill, causal, over each request's whole row (cached prefix + new tokens) after the
    same KV write. Same batch shapes and tolerances as above."""
    from types import SimpleNamespace

    import flashinfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from granikv.attention.extend.full_extend import FullExtend

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    pool = MHATokenToKVPool(20000, page_size=1, dtype=dt, head_num=HKV, head_dim=D, layer_num=1, device=dev,
                            enable_memory_saver=False)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, device=dev, dtype=dt, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, device=dev, dtype=dt, generator=g))
    kinds, new = KINDS, NEW
    plan, rows, prefix, req_to_token, out_loc, q, k, v = _full_extend_batch(dev, dt, g)
    n_tok = int(new.sum())
    scale = D ** -0.5
    layer = SimpleNamespace(layer_id=0, scaling=scale, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                            k_scale=None, v_scale=None, sliding_window_size=-1, logit_cap=0.0,
                            is_cross_attention=False)
    fb = SimpleNamespace(out_cache_loc=torch.tensor(out_loc, device=dev))

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    attn = HotExtendAttention(FlashInferDense(ws), dev)
    attn.begin(plan, req_to_token)
    full = FullExtend(attn)
    full.begin()
    o = full.forward(q, k, v, layer, fb, pool, True)
    assert torch.equal(pool.k_buffer[0][fb.out_cache_loc], k.view(-1, HKV, D))
    assert torch.equal(pool.v_buffer[0][fb.out_cache_loc], v.view(-1, HKV, D))

    i32 = dict(dtype=torch.int32, device=dev)
    seq = prefix + new
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    paged.plan(torch.tensor(np.concatenate([[0], np.cumsum(new)]), **i32),
               torch.tensor(np.concatenate([[0], np.cumsum(seq)]), **i32),
               torch.cat([req_to_token[r, :s] for r, s in zip(rows, seq)]), torch.ones(len(kinds), **i32),
               HQ, HKV, D, 1, causal=True, sm_scale=scale, q_data_type=dt, kv_data_type=dt)
    ref = paged.run(q.view(-1, HQ, D), (pool.k_buffer[0].view(-1, 1, HKV, D), pool.v_buffer[0].view(-1, 1, HKV, D)))
    assert o.shape == (n_tok, HQ * D) and not torch.isnan(o).any()
    assert (o.view(-1, HQ, D).float() - ref.float()).abs().max() <= 2 ** -5
    # inputs padded as SGLang's breakable prefill CUDA graph pads them (padding K/V to slot 0)
    pad = 37
    padded = SimpleNamespace(out_cache_loc=torch.cat([fb.out_cache_loc, fb.out_cache_loc.new_zeros(pad)]))
    qp, kp, vp = (torch.cat([t, t[:pad]]) for t in (q, k, v))
    op = full.forward(qp, kp, vp, layer, padded, pool, True)
    assert op.shape == (n_tok + pad, HQ * D) and (op[n_tok:] == 0).all()
    assert (op[:n_tok].float() - o.float()).abs().max() <= 2 ** -6  # same inputs; the plan is reused


@pytest.mark.parametrize("fp8, hot", [(torch.float8_e4m3fn, True), (torch.float8_e5m2, True),
                                     (torch.float8_e4m3fn, False)])
def test_full_extend_over_an_fp8_cache_matches_paged_prefill_over_the_dequantized_cache(fp8, hot):
    """``FullExtend`` over SGLang's real FP8 pool (uint8 storage): the new K/V written as the
    stock backend writes them (divided by the layer's scales, cast), then every part over the
    cache's values widened exactly, the query times ``k_scale``, the output times ``v_scale``;
    against FlashInfer's bf16 paged prefill, causal, over each request's whole row of the same
    cache widened to bf16 (exact) with the scales applied the same way. Scales are powers of two
    (the scaled query is exact in bf16), so the tolerance is the bf16 one above. Planted: the
    scales left out miss it. ``hot=False``: the same batch without a HOT run (the COLD remainder
    and the causal part only)."""
    from types import SimpleNamespace

    import flashinfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from granikv.attention.extend.full_extend import FullExtend

    dev, dt, ks, vs = "cuda", torch.bfloat16, 0.5, 0.25
    g = torch.Generator(device=dev).manual_seed(2)
    pool = MHATokenToKVPool(20000, page_size=1, dtype=fp8, head_num=HKV, head_dim=D, layer_num=1, device=dev,
                            enable_memory_saver=False)
    for buf, sc in ((pool.k_buffer[0], ks), (pool.v_buffer[0], vs)):
        buf.copy_((torch.randn(buf.shape, device=dev, generator=g) / sc).to(fp8).view(torch.uint8))
    plan, rows, prefix, req_to_token, out_loc, q, k, v = _full_extend_batch(dev, dt, g, hot=hot)
    n_tok = int(NEW.sum())
    scale = D ** -0.5
    layer = SimpleNamespace(layer_id=0, scaling=scale, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                            k_scale=torch.tensor(ks, device=dev), v_scale=torch.tensor(vs, device=dev),
                            k_scale_float=ks, v_scale_float=vs, sliding_window_size=-1, logit_cap=0.0,
                            is_cross_attention=False)
    fb = SimpleNamespace(out_cache_loc=torch.tensor(out_loc, device=dev))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    attn = HotExtendAttention(FlashInferDense(ws), dev)
    attn.begin(plan, req_to_token)
    full = FullExtend(attn)
    full.begin()
    o = full.forward(q, k, v, layer, fb, pool, True)
    stored = pool.get_key_buffer(0)[fb.out_cache_loc].to(torch.float32)
    assert torch.equal(stored, (k.view(-1, HKV, D).clone().div_(ks)).to(fp8).to(torch.float32))

    i32 = dict(dtype=torch.int32, device=dev)
    seq = prefix + NEW
    kb, vb = pool.get_key_buffer(0).to(dt), pool.get_value_buffer(0).to(dt)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    paged.plan(torch.tensor(np.concatenate([[0], np.cumsum(NEW)]), **i32),
               torch.tensor(np.concatenate([[0], np.cumsum(seq)]), **i32),
               torch.cat([req_to_token[r, :s] for r, s in zip(rows, seq)]), torch.ones(len(KINDS), **i32),
               HQ, HKV, D, 1, causal=True, sm_scale=scale * ks, q_data_type=dt, kv_data_type=dt)
    ref = paged.run(q.view(-1, HQ, D), (kb.view(-1, 1, HKV, D), vb.view(-1, 1, HKV, D))).float() * vs
    assert o.shape == (n_tok, HQ * D) and not torch.isnan(o).any()
    assert (o.view(-1, HQ, D).float() - ref).abs().max() <= 2 ** -5
    unscaled = SimpleNamespace(**{**vars(layer), "k_scale_float": None, "v_scale_float": None})
    wrong = full.forward(q, k, v, unscaled, fb, pool, False)
    assert (wrong.view(-1, HQ, D).float() - ref).abs().max() > 2 ** -2


def test_flashinfer_forest_prefix_part_is_one_call_and_matches_paged_prefill():
    """A forest prefill: 16 extents of 1.5-6K tokens (gaps between them, two adjacent), 4-12
    requests each in shuffled batch order, a few matching only the first 1K of their extent
    (a second, overlapping call). One ragged FA3 call with query-less gap entries serves the 16
    extents; against the paged FA2 prefill per request. Same tolerances as above."""
    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    rng = np.random.default_rng(0)
    g = torch.Generator(device=dev).manual_seed(2)
    lens = rng.integers(1536, 6144, 16)
    gaps = rng.integers(0, 4096, 16)
    gaps[5] = 0
    starts = np.cumsum(lens + gaps) - lens
    slots = int(starts[-1] + lens[-1]) + 1
    k_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    v_buf = torch.randn(slots, HKV, D, device=dev, dtype=dt, generator=g)
    ext_of = rng.permutation(np.repeat(np.arange(16), rng.integers(4, 13, 16)))
    bs = len(ext_of)
    rows = np.arange(1, bs + 1, dtype=np.int64)
    start, length = np.zeros(bs + 1, np.int64), np.zeros(bs + 1, np.int64)
    head = rng.random(bs) < 0.1
    start[rows] = starts[ext_of]
    length[rows] = np.where(head, 1024, lens[ext_of])
    prefix = length[rows].copy()
    new = rng.integers(1, 300, bs).astype(np.int64)
    plan, reason = plan_extend(rows, prefix, new, start, length)
    assert reason == "" and len(plan.groups) > 16 and len(plan.calls) == 2
    req_to_token = torch.zeros(bs + 1, int(lens.max()), dtype=torch.int32, device=dev)
    for r in rows:
        req_to_token[r, : prefix[r - 1]] = torch.arange(start[r], start[r] + prefix[r - 1], dtype=torch.int32)
    q = torch.randn(int(new.sum()), HQ, D, device=dev, dtype=dt, generator=g) * 2
    scale = D ** -0.5
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    attn = HotExtendAttention(FlashInferDense(ws), dev)
    attn.begin(plan, req_to_token)
    attn.check_integrity()
    o, lse = attn.prefix_part(q, k_buf, v_buf, scale)

    i32 = dict(dtype=torch.int32, device=dev)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    paged.plan(torch.tensor(np.concatenate([[0], np.cumsum(new)]), **i32),
               torch.tensor(np.concatenate([[0], np.cumsum(prefix)]), **i32),
               torch.cat([req_to_token[r, :p] for r, p in zip(rows, prefix)]), torch.ones(bs, **i32),
               HQ, HKV, D, 1, causal=False, sm_scale=scale, q_data_type=dt, kv_data_type=dt)
    ro, rl = paged.run(q, (k_buf.view(-1, 1, HKV, D), v_buf.view(-1, 1, HKV, D)), return_lse=True)
    assert not torch.isnan(o).any()
    assert (o.float() - ro.float()).abs().max() <= 2 ** -5
    # FA3 (the batched ragged calls) and FA2 (the paged reference) accumulate the bf16 scores in
    # different orders: measured 1.2e-3 at |lse| ~ 14 on the H200 (1e-4 relative); a wrong key
    # range moves the LSE by O(1).
    assert (lse - rl).abs().max() < 4e-3
