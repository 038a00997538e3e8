"""The extend (prefill) prefix part over HOT extents, on CPU.

``HotExtendAttention`` with the float32 ``TorchDense`` runner against a float64 reference, and
``GraniKVAttnBackend`` around a stand-in of SGLang's flashinfer extend (ragged causal part +
paged prefix part + LSE merge, as ``FlashInferAttnBackend.forward_extend`` does it) with real
SGLang pools and the real HotPrefixTable: the whole extend output must equal full causal
attention over each request's ``req_to_token`` row, with the paged prefix wrapper bypassed.
FlashInfer's runner (``FlashInferDense``) is checked on the GPU host (test/kernels/test_gpu_hot_extend.py).

Tolerances: fp16 operands, float32 math; outputs are softmax-weighted means of N(0, 1) values,
compared in fp16: atol = rtol = 2e-3; LSE (float32, base 2): atol 1e-4.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.extend.plan import plan_extend
from granikv.attention.extend.hot_extend import HotExtendAttention, PrefixPartProxy, TorchDense
from granikv.mem_cache.hot_prefix_table import HotPrefixTable

from extend_standin import FlashInferExtendStandIn, attend  # noqa: E402  (beside this file)

HQ, HKV, D = 8, 2, 64
SLOTS, HOT_A, HOT_B = 600, 400, 500
DTYPE = torch.float16
ATOL = RTOL = 2e-3
SCALE = D ** -0.5


# ---- a batch: requests over two HOT extents, one private prompt, one fresh request ----------

PREFIX = {"A": (HOT_A, 37), "B": (HOT_B, 23)}


def _setup(kinds, new, seed=0):
    """``kinds[i]``: "A"/"B" (cached prefix = that HOT extent), "A+" (extent A then 6 COLD cached
    tokens, like an agent's earlier turn), "cold" (a private cached prompt of 11 COLD tokens),
    "none" (no cached prefix). Returns runner, fb, rows, q, k, v."""
    g = torch.Generator().manual_seed(seed)
    rt_pool = ReqToTokenPool(size=len(kinds) + 1, max_context_len=128, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(SLOTS, page_size=1, dtype=DTYPE, head_num=HKV, head_dim=D, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    for buf in (kv.k_buffer[0], kv.v_buffer[0]):
        buf.copy_(torch.randn(buf.shape, generator=g).to(DTYPE))
    table = HotPrefixTable(len(kinds) + 2)
    rt = rt_pool.req_to_token
    rows, prefix_lens, out_loc, nxt = [], [], [], 1
    for i, (kind, n) in enumerate(zip(kinds, new)):
        row = i + 1
        if kind in PREFIX:
            s, p = PREFIX[kind]
            pre = list(range(s, s + p))
            table.set(row, s, p)
        elif kind == "A+":
            s, p = PREFIX["A"]
            pre, nxt = list(range(s, s + p)) + list(range(nxt, nxt + 6)), nxt + 6
            table.set(row, s, p)
        elif kind == "cold":
            pre, nxt = list(range(nxt, nxt + 11)), nxt + 11
        else:
            pre = []
        loc = list(range(nxt, nxt + n))
        nxt += n
        rt[row, : len(pre) + n] = torch.tensor(pre + loc, dtype=torch.int32)
        rows.append(row)
        prefix_lens.append(len(pre))
        out_loc += loc
    assert nxt < HOT_A
    n_tok = sum(new)
    q = torch.randn(n_tok, HQ * D, generator=g).to(DTYPE)
    k = torch.randn(n_tok, HKV * D, generator=g).to(DTYPE)
    v = torch.randn(n_tok, HKV * D, generator=g).to(DTYPE)
    seq = torch.tensor([p + n for p, n in zip(prefix_lens, new)])
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(rows),
                         req_pool_indices=torch.tensor(rows), seq_lens=seq, seq_lens_cpu=seq.clone(),
                         extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=list(new),
                         out_cache_loc=torch.tensor(out_loc))
    mc = SimpleNamespace(num_attention_heads=HQ, head_dim=D, num_hidden_layers=1,
                         get_num_kv_heads=lambda tp: HKV, hf_config=SimpleNamespace())
    runner = SimpleNamespace(model_config=mc, ps=SimpleNamespace(attn_tp_size=1), device="cpu",
                             kv_cache_dtype=DTYPE, server_args=SimpleNamespace(speculative_algorithm=None),
                             req_to_token_pool=rt_pool, token_to_kv_pool=kv,
                             token_to_kv_pool_allocator=SimpleNamespace(hot_prefix_table=table))
    return runner, fb, np.array(rows, dtype=np.int64), q, k, v


def _expected(runner, fb, q, k, v):
    """Full causal attention of each request's new tokens over its row (after the KV write)."""
    kb, vb = runner.token_to_kv_pool.k_buffer[0].clone(), runner.token_to_kv_pool.v_buffer[0].clone()
    kb[fb.out_cache_loc] = k.view(-1, HKV, D)
    vb[fb.out_cache_loc] = v.view(-1, HKV, D)
    rt = runner.req_to_token_pool.req_to_token
    outs, t = [], 0
    for row, p, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = rt[row, : p + n].long()
        o, _ = attend(q.view(-1, HQ, D)[t: t + n], kb[slots], vb[slots], SCALE, first_pos=p)
        outs.append(o)
        t += n
    return torch.cat(outs).to(DTYPE).view(-1, HQ * D)


LAYER = SimpleNamespace(layer_id=0, scaling=SCALE, tp_q_head_num=HQ, head_dim=D)


def _backend(runner, **cfg):
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, **{"extend_path": "hot", **cfg}), backend_name="stand-in")
    be.inner = FlashInferExtendStandIn(runner)
    return be


def _run_extend(be, fb, rows, q, k, v):
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    return be.forward_extend(q, k, v, LAYER, fb)


# ---- HotExtendAttention -------------------------------------------------------------------


def test_prefix_part_matches_reference_and_leaves_unprefixed_tokens_out():
    kinds, new = ["A", "none", "B", "A", "A"], [5, 4, 3, 6, 2]
    runner, fb, rows, q, _, _ = _setup(kinds, new)
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    plan, reason = plan_extend(rows, np.array(fb.extend_prefix_lens_cpu), np.array(new), table.start_np,
                               table.length_np)
    assert reason == "" and len(plan.groups) == 2 and not plan.groups[0].contiguous
    attn = HotExtendAttention(TorchDense(), "cpu")
    attn.begin(plan, runner.req_to_token_pool.req_to_token)
    attn.check_integrity()
    q3 = q.view(-1, HQ, D)
    kb, vb = runner.token_to_kv_pool.k_buffer[0], runner.token_to_kv_pool.v_buffer[0]
    o, lse = attn.prefix_part(q3, kb, vb, SCALE)
    t = 0
    for kind, n in zip(kinds, new):
        if kind == "none":
            assert (o[t: t + n] == 0).all() and torch.isneginf(lse[t: t + n]).all()
        else:
            s, p = PREFIX[kind]
            ro, rl = attend(q3[t: t + n], kb[s: s + p], vb[s: s + p], SCALE)
            torch.testing.assert_close(o[t: t + n], ro.to(DTYPE), atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(lse[t: t + n], rl.float(), atol=1e-4, rtol=0)
        t += n
    with pytest.raises(RuntimeError, match="query tokens"):
        attn.prefix_part(q3[:-1], kb, vb, SCALE)
    # padded rows (SGLang's breakable prefill CUDA graph pads q to its bucket): empty states
    po, pl = attn.prefix_part(torch.cat([q3, q3[:3]]), kb, vb, SCALE)
    assert torch.equal(po[: len(q3)], o) and torch.equal(pl[: len(q3)], lse)
    assert (po[len(q3):] == 0).all() and torch.isneginf(pl[len(q3):]).all()


def test_proxy_sends_what_it_does_not_serve_to_the_original_wrapper():
    runner, fb, rows, _, _, _ = _setup(["A"], [1])
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    plan, _ = plan_extend(rows, np.array(fb.extend_prefix_lens_cpu), np.array([1]), table.start_np, table.length_np)
    attn = HotExtendAttention(TorchDense(), "cpu")
    attn.begin(plan, runner.req_to_token_pool.req_to_token)  # a planned batch: only the arguments decide
    calls = []
    orig = SimpleNamespace(forward_return_lse=lambda *a, **kw: calls.append(kw) or "orig", some_attr=7)
    proxy = PrefixPartProxy(attn, orig)
    assert proxy.forward_return_lse(torch.zeros(1, HQ, D), (None, None), causal=True) == "orig"
    assert proxy.forward_return_lse(torch.zeros(1, HQ, D), (None, None), window_left=128) == "orig"
    assert proxy.forward_return_lse(torch.zeros(1, HQ, D), torch.zeros(3)) == "orig"
    assert len(calls) == 3 and proxy.some_attr == 7


# ---- the backend around a flashinfer-like extend ----------------------------------------------


@pytest.mark.parametrize("kinds, new", [
    (["A", "A", "A"], [5, 7, 3]),  # agents joining one shared prefix: one contiguous call
    (["A", "none", "B", "A", "A"], [5, 4, 3, 6, 2]),  # two extents, a fresh request in between
    (["A", "cold", "A+", "none", "B", "A+"], [3, 4, 5, 2, 3, 1]),  # + COLD remainders (paged call)
])
def test_hot_extend_equals_full_causal_attention_and_skips_the_paged_wrapper(kinds, new):
    runner, fb, rows, q, k, v = _setup(kinds, new)
    be = _backend(runner)
    out = _run_extend(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 0  # the dense calls served the whole prefix part
    assert be.inner.prefill_wrappers_paged == [be.inner.paged]  # SGLang's own list untouched
    snap = be.stats_snapshot()
    assert snap["extend_hot_batches"] == snap["extend_batches"] == 1
    assert snap["extend_hot_tokens"] == sum(n for kd, n in zip(kinds, new) if kd in ("A", "A+", "B"))
    assert snap["decode_steps"] == 0


@pytest.mark.parametrize("kinds, reason", [
    (["cold", "none", "cold"], "no HOT prefix in the batch"),
])
def test_a_batch_without_hot_runs_stays_on_the_stock_path(kinds, reason):
    runner, fb, rows, q, k, v = _setup(kinds, [4, 4, 4])
    be = _backend(runner)
    out = _run_extend(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 1
    assert be.stats_snapshot()["extend_fallbacks"] == {reason: 1}


def test_extend_path_paged_and_unstaged_batches_stay_stock():
    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 3])
    be = _backend(runner, extend_path="paged")
    _run_extend(be, fb, rows, q, k, v)
    assert be.inner.paged.calls == 1 and be.stats.extend_batches == 0
    be = _backend(runner)
    be.init_forward_metadata(fb)  # nothing staged
    be.forward_extend(q, k, v, LAYER, fb)
    assert be.inner.paged.calls == 1 and be.stats.extend_fallbacks == {"batch not staged": 1}


def test_auto_extend_path_follows_the_extend_cost_model():
    """--granikv-extend-path auto: the HOT prefix path only where ExtendTerms puts it below the
    stock paged call. Tiny shapes (37-token prefixes) are call-overhead bound: stock; with the
    per-call overheads made negligible the same batch takes the HOT path, and both are exact."""
    import dataclasses

    runner, fb, rows, q, k, v = _setup(["A", "A", "B"], [3, 5, 4])
    be = _backend(runner, extend_path="auto")
    out = _run_extend(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 1 and be.stats.extend_hot_batches == 0
    assert list(be.stats.extend_fallbacks) == ["the cost model puts the stock prefill first for this shape"]
    cm = be.dispatcher.cost_model
    ext = dataclasses.replace(cm.served.extend, dense_call_us=1e-6, merge_us=1e-6)
    be.dispatcher.cost_model = dataclasses.replace(cm, served=dataclasses.replace(cm.served, extend=ext))
    runner, fb, rows, q, k, v = _setup(["A", "A", "B"], [3, 5, 4])
    be.model_runner, be.inner = runner, type(be.inner)(runner)
    out = _run_extend(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 0 and be.stats.extend_hot_batches == 1


def test_no_cached_prefix_is_left_to_the_ragged_call():
    runner, fb, rows, q, k, v = _setup(["none", "none"], [3, 5])
    be = _backend(runner)
    out = _run_extend(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.stats.extend_batches == 0 and be.inner.paged.calls == 0


def test_next_batch_gets_fresh_metadata_and_debug_compare_logs(caplog):
    runner, fb, rows, q, k, v = _setup(["A", "B", "A"], [4, 4, 4])
    be = _backend(runner, debug_compare_every=1)
    with caplog.at_level("INFO", logger="granikv"):
        _run_extend(be, fb, rows, q, k, v)
    assert "vs paged prefill" in caplog.text and be.inner.paged.calls == 1  # the compare's stock call
    assert 0 < be.stats.max_extend_compare_diff < 5e-3
    runner2, fb2, rows2, q2, k2, v2 = _setup(["cold", "cold"], [2, 2], seed=1)
    be.model_runner = runner2
    be.inner = FlashInferExtendStandIn(runner2)
    out = _run_extend(be, fb2, rows2, q2, k2, v2)  # falls back: no proxy left from the last batch
    torch.testing.assert_close(out, _expected(runner2, fb2, q2, k2, v2), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 1 and be.extend.hot_extend.plan is None


def test_a_failing_dense_path_falls_back_to_stock_and_stays_off(caplog):
    """A FlashInfer module missing for some shape must not fail the forward: the stock wrapper
    serves that call, and later batches stay stock."""
    runner, fb, rows, q, k, v = _setup(["A", "A", "B"], [3, 4, 2])
    be = _backend(runner)

    class Broken(TorchDense):
        def plan(self, *a, **kw):
            raise RuntimeError("no prebuilt module for this shape")

    be.extend.hot_extend = HotExtendAttention(Broken(), "cpu")
    with caplog.at_level("ERROR", logger="granikv"):
        out = _run_extend(be, fb, rows, q, k, v)
        out_layer2 = be.forward_extend(q, k, v, LAYER, fb)  # the batch's next layer: stock, no retry
    for o in (out, out_layer2):
        torch.testing.assert_close(o, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 2 and caplog.text.count("stock prefill from now on") == 1
    runner2, fb2, rows2, q2, k2, v2 = _setup(["A", "A"], [2, 2], seed=3)
    be.model_runner, be.inner = runner2, FlashInferExtendStandIn(runner2)
    out = _run_extend(be, fb2, rows2, q2, k2, v2)
    torch.testing.assert_close(out, _expected(runner2, fb2, q2, k2, v2), atol=ATOL, rtol=RTOL)
    assert be.inner.paged.calls == 1  # the next batch was planned stock
    fallbacks = be.stats_snapshot()["extend_fallbacks"]  # the failed batch once, the next batch once
    assert sum(fallbacks.values()) == 2 and all("after an error (RuntimeError)" in r for r in fallbacks)


def test_check_integrity_catches_stale_batch_state():
    runner, fb, rows, _, _, _ = _setup(["A", "none", "cold", "A+", "A"], [2, 3, 2, 2, 1])
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    plan, _ = plan_extend(rows, np.array(fb.extend_prefix_lens_cpu), np.array([2, 3, 2, 2, 1]), table.start_np,
                          table.length_np)
    attn = HotExtendAttention(TorchDense(), "cpu")
    attn.begin(plan, runner.req_to_token_pool.req_to_token)
    attn.check_integrity()
    assert plan.paged is not None and any(idx is not None for idx in attn._token_idx)
    gathered = next(i for i, idx in enumerate(attn._token_idx) if idx is not None)
    attn._token_idx[gathered] = attn._token_idx[gathered] + 1  # a stale list from another batch
    with pytest.raises(AssertionError, match="stale gathered token list"):
        attn.check_integrity()
    attn.begin(plan, runner.req_to_token_pool.req_to_token)
    attn._paged_kv = attn._paged_kv[:-1]
    with pytest.raises(AssertionError, match="remainder slot count"):
        attn.check_integrity()
    attn.end()
    attn.check_integrity()


# ---- a forest: many HOT extents in one extend batch ------------------------------------------


@pytest.mark.parametrize("n_ext, seed", [(12, 0), (17, 1)])
def test_a_forest_prefill_is_batched_into_few_calls_and_matches_reference(n_ext, seed):
    """``n_ext`` disjoint extents of odd lengths (more than the old 8-extent limit), requests in
    random batch order, some matching only the head of their extent (overlapping groups: a
    second call), some with a COLD tail (the paged remainder): every token's prefix part equals
    float64 attention over its request's cached prefix."""
    rng = np.random.default_rng(seed)
    slots = 4000
    g = torch.Generator().manual_seed(seed)
    kb = torch.randn(slots, HKV, D, generator=g).to(DTYPE)
    vb = torch.randn(slots, HKV, D, generator=g).to(DTYPE)
    lens = rng.integers(17, 90, n_ext)
    starts = 200 + np.cumsum(lens + rng.integers(0, 40, n_ext)) - lens  # gaps 0..39 slots
    assert starts[-1] + lens[-1] < 3000
    bs = 2 * n_ext + 3
    rows = np.arange(1, bs + 1, dtype=np.int64)
    ext_of = rng.permutation(np.concatenate([np.arange(n_ext), rng.integers(0, n_ext, bs - n_ext)]))
    head = rng.random(bs) < 0.2  # matches only the first half of its extent
    cold_tail = rng.random(bs) < 0.2  # + 5 COLD tokens after its HOT run
    table = HotPrefixTable(bs + 2)
    rt = torch.zeros(bs + 1, 256, dtype=torch.int32)
    prefix, nxt = [], 3000
    for r, e, h, c in zip(rows, ext_of, head, cold_tail):
        s, n = int(starts[e]), int(lens[e]) // (2 if h else 1)
        table.set(int(r), s, n)
        pre = list(range(s, s + n)) + (list(range(nxt, nxt + 5)) if c else [])
        nxt += 5 if c else 0
        rt[r, : len(pre)] = torch.tensor(pre, dtype=torch.int32)
        prefix.append(len(pre))
    new = rng.integers(1, 5, bs)
    plan, reason = plan_extend(rows, np.array(prefix, dtype=np.int64), new.astype(np.int64), table.start_np,
                               table.length_np)
    assert reason == "" and len(plan.groups) > 8
    assert len(plan.calls) == (2 if head.any() else 1)  # the head groups overlap their full extents
    attn = HotExtendAttention(TorchDense(), "cpu")
    attn.begin(plan, rt)
    attn.check_integrity()
    q = torch.randn(int(new.sum()), HQ, D, generator=g).to(DTYPE)
    o, lse = attn.prefix_part(q, kb, vb, SCALE)
    t = 0
    for r, p, n in zip(rows, prefix, new):
        slots_r = rt[r, :p].long()
        ro, rl = attend(q[t: t + n], kb[slots_r], vb[slots_r], SCALE)
        torch.testing.assert_close(o[t: t + n], ro.to(DTYPE), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(lse[t: t + n], rl.float(), atol=1e-4, rtol=0)
        t += n


@pytest.mark.parametrize("k_scale, v_scale", [(None, None), (1.0, 1.0), (0.5, 2.0)])
def test_proxy_serves_the_scaled_paged_prefix_call(k_scale, v_scale):
    """SGLang 0.5.23's flashinfer extend passes ``k_scale=`` / ``v_scale=`` to the paged prefix
    call: served (logits scaled by k_scale, output by v_scale), not sent back to the wrapper."""
    kinds, new = ["A", "A"], [3, 4]
    runner, fb, rows, q, _, _ = _setup(kinds, new)
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    plan, _ = plan_extend(rows, np.array(fb.extend_prefix_lens_cpu), np.array(new), table.start_np,
                          table.length_np)
    attn = HotExtendAttention(TorchDense(), "cpu")
    attn.begin(plan, runner.req_to_token_pool.req_to_token)
    calls = []
    orig = SimpleNamespace(forward_return_lse=lambda *a, **kw: calls.append(kw) or "orig")
    proxy = PrefixPartProxy(attn, orig)
    q3 = q.view(-1, HQ, D)
    kb, vb = runner.token_to_kv_pool.k_buffer[0], runner.token_to_kv_pool.v_buffer[0]
    o, lse = proxy.forward_return_lse(q3, (kb, vb), causal=False, sm_scale=SCALE,
                                      k_scale=k_scale, v_scale=v_scale)
    assert not calls
    s, p = PREFIX["A"]
    ro, rl = attend(q3, kb[s: s + p], vb[s: s + p], SCALE * (k_scale or 1.0))
    torch.testing.assert_close(o, (ro * (v_scale or 1.0)).to(DTYPE), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, rl.float(), atol=1e-4, rtol=0)
    # an unknown keyword, or scales with a soft cap, still go to the original wrapper
    assert proxy.forward_return_lse(q3, (kb, vb), k_scale=k_scale, q_scale=2.0) == "orig"
    assert calls[-1].get("k_scale") == k_scale and calls[-1]["q_scale"] == 2.0
    if k_scale not in (None, 1.0):
        assert proxy.forward_return_lse(q3, (kb, vb), logits_soft_cap=30.0, k_scale=k_scale,
                                        v_scale=v_scale) == "orig"
