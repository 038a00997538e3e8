"""GraniKV around SGLang's real ``FlashAttentionBackend`` (fa3, SGLang's default on Hopper), on CPU.

The backend's own metadata code runs (``init_forward_metadata``, ``init_cuda_graph_state``, the
capture and replay metadata of its decode graphs); only the FA3 kernel is a torch stand-in
that honours the page table and ``cache_seqlens`` it is handed, and records them (sgl_kernel,
whose library holds the kernel, does not import on a CPU machine). So a test fails if
GraniKV hands FA3 anything but a one-token view on a cascade step, the real lengths on a paged
step, or if the two graphs of one size leave each other's metadata behind. The GPU versions
(the real kernels, real graph capture) are in test/kernels/test_gpu_real_backends.py.
"""

import importlib
import sys
import types
from typing import Any, Dict, List

import pytest
import torch

from granikv.attention.backend import GraniKVAttnBackend
from granikv.config import GraniKVConfig
from support.sglang_context import bind_kv_loc_plan

import test_backend as tb  # noqa: E402  (beside this file)
from test_real_triton_backend import LLAMA, _layer, triton_runner  # noqa: E402

FA3_MODULE = "sglang.srt.layers.attention.flashattention_backend"


class KernelStandIn:
    """``flash_attn_with_kvcache`` for one decode token per request: softmax attention over
    ``page_table[b, :cache_seqlens[b]]`` (page size 1), in fp32; every call's lengths kept."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, q, k_cache, v_cache, page_table=None, cache_seqlens=None, softmax_scale=None,
                 causal=False, out=None, **kwargs):
        assert not kwargs.get("return_softmax_lse"), "decode without cascade attention"
        lens = [int(x) for x in cache_seqlens]
        self.calls.append(dict(width=page_table.shape[1], lens=lens, first=page_table[:, 0].tolist()))
        hq, hkv = q.shape[1], k_cache.shape[-2]
        kc, vc = k_cache.reshape(-1, hkv, k_cache.shape[-1]), v_cache.reshape(-1, hkv, v_cache.shape[-1])
        o = torch.empty_like(q) if out is None else out
        for b, n in enumerate(lens):
            idx = page_table[b, :n].long()
            key = kc[idx].float().repeat_interleave(hq // hkv, 1)
            val = vc[idx].float().repeat_interleave(hq // hkv, 1)
            p = (torch.einsum("hd,nhd->hn", q[b].float(), key) * softmax_scale).softmax(-1)
            o[b] = torch.einsum("hn,nhd->hd", p, val).to(q.dtype)
        return o


@pytest.fixture
def fa3(monkeypatch):
    """SGLang's FlashAttentionBackend module with the kernel stand-in (and, where sgl_kernel is
    not installed, stub sgl_kernel modules for its imports; removed again afterwards)."""
    kernel = KernelStandIn()
    stubbed = importlib.util.find_spec("sgl_kernel") is None
    if stubbed:
        sk = types.ModuleType("sgl_kernel")
        sk.merge_state_v2 = None  # cascade attention (speculative top-k) only
        fa = types.ModuleType("sgl_kernel.flash_attn")
        fa.flash_attn_with_kvcache = fa.flash_attn_varlen_func = kernel
        fa.get_scheduler_metadata = lambda **kw: None  # FA3's precomputed split plan: not used here
        sk.flash_attn = fa
        monkeypatch.setitem(sys.modules, "sgl_kernel", sk)
        monkeypatch.setitem(sys.modules, "sgl_kernel.flash_attn", fa)
        monkeypatch.delitem(sys.modules, FA3_MODULE, raising=False)  # imported against the stubs
    module = importlib.import_module(FA3_MODULE)
    monkeypatch.setattr(module, "flash_attn_with_kvcache", kernel)
    yield module, kernel
    if stubbed:
        sys.modules.pop(FA3_MODULE, None)  # never left bound to the stubs


@pytest.fixture
def runner(tmp_path):
    with triton_runner(tmp_path, LLAMA) as r:
        r.kv_cache_dtype_str = "auto"  # what FlashAttentionBackend reads beyond the triton backend
        r.ps.attn_cp_size, r.ps.tp_size = 1, 1
        yield r


def _batch(runner):
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info, fb.encoder_lens, fb.num_padding = None, None, 0
    fb.positions = fb.seq_lens - 1  # the graph capture sizes its buffers by it
    bind_kv_loc_plan(runner, fb)
    return fb, rows


def _qkv(fb, seed):
    q, k, v = tb._qkv(fb.batch_size, seed)
    return q, k.view(-1, tb.HKV, tb.D), v.view(-1, tb.HKV, tb.D)


def _wrap(module, runner, **cfg):
    ours = GraniKVAttnBackend.wrap(module.FlashAttentionBackend(runner), model_runner=runner,
                                   cfg=GraniKVConfig(enable=True, attention_path="cascade", **cfg), backend_name="fa3")
    assert isinstance(ours, GraniKVAttnBackend)
    return ours


def _stock(module, runner, fb, q, k, v, layer):
    be = module.FlashAttentionBackend(runner)
    be.init_forward_metadata(fb)
    return be.forward_decode(q, k, v, layer, fb, save_kv_cache=True)


def test_eager_cascade_step_hands_fa3_one_token_and_equals_stock(fa3, runner):
    module, kernel = fa3
    fb, rows = _batch(runner)
    q, k, v = _qkv(fb, 3)
    layer = _layer()
    stock = _stock(module, runner, fb, q, k, v, layer)
    assert kernel.calls[-1]["lens"] == fb.seq_lens_cpu.tolist()
    ours = _wrap(module, runner)
    ours.stage_batch(rows)
    ours.init_forward_metadata(fb)
    out = ours.forward_decode(q, k, v, layer, fb, save_kv_cache=True)
    assert ours.stats.paths == {"cascade": 1} and ours.stats.grouped_requests == 3
    # FA3 was planned with seq_len = 1 (each request's first slot): GraniKV produced every row
    call = kernel.calls[-1]
    rt = runner.req_to_token_pool.req_to_token
    assert call["lens"] == [1] * fb.batch_size and call["first"] == rt[fb.req_pool_indices, 0].tolist()
    torch.testing.assert_close(out, stock, atol=tb.ATOL, rtol=tb.RTOL)


def test_steady_steps_equal_stock(fa3, runner):
    """Decode steps of one batch, each request one token longer per step (its K/V written by
    the step itself): every step equals the real FA3 backend on the same KV."""
    module, kernel = fa3
    fb, rows = _batch(runner)
    layer = _layer()
    stock_be = module.FlashAttentionBackend(runner)
    ours = _wrap(module, runner)
    rt = runner.req_to_token_pool.req_to_token
    free = iter(range(tb.HOT_BASE + 40, tb.SLOTS))
    for step in range(3):
        if step:
            seq = fb.seq_lens_cpu + 1
            new = torch.tensor([next(free) for _ in rows], dtype=torch.int64)
            rt[torch.as_tensor(rows), seq - 1] = new.to(torch.int32)
            fb.seq_lens, fb.seq_lens_cpu, fb.seq_lens_sum, fb.out_cache_loc = seq.clone(), seq, int(seq.sum()), new
            fb.positions = seq - 1
            bind_kv_loc_plan(runner, fb)
        q, k, v = _qkv(fb, 20 + step)
        stock_be.init_forward_metadata(fb)
        stock = stock_be.forward_decode(q, k, v, layer, fb, save_kv_cache=True)
        ours.stage_batch(rows)
        ours.init_forward_metadata(fb)
        out = ours.forward_decode(q, k, v, layer, fb, save_kv_cache=True)
        torch.testing.assert_close(out, stock, atol=tb.ATOL, rtol=tb.RTOL, msg=f"step {step}")
    assert ours.stats.paths == {"cascade": 3}


def test_graph_metadata_of_both_graphs_of_a_size(fa3, runner):
    """FA3's decode-graph metadata through GraniKV's hooks: the stock graph and the cascade
    graph of one batch size are captured over the same FA3 buffers; before each replay the
    plan refills them: the real lengths and page table for a paged step, the one-token view
    (each request's first slot) for a cascade step. (Outputs under a real replay: the GPU test.)"""
    module, _ = fa3
    fb, rows = _batch(runner)
    bs = fb.batch_size
    layer = _layer()
    ours = _wrap(module, runner)
    ours.init_cuda_graph_state(bs, bs)
    q, k, v = _qkv(fb, 0)
    for cascade in (False, True):  # plugin.py's capture order: the stock graph, then the cascade one
        if cascade:
            ours.graphs.begin_capture(bs)
        try:
            ours.init_forward_metadata_out_graph(fb, in_capture=True)
            ours.forward_decode(q, k, v, layer, fb, save_kv_cache=False)
        finally:
            if cascade:
                ours.graphs.end_capture(True)
    assert ours.graphs.has_cascade_graph(bs)
    md = ours.inner.decode_cuda_graph_metadata[bs]
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    rt = runner.req_to_token_pool.req_to_token
    real = fb.seq_lens_cpu.tolist()
    for shared in (True, False, True):
        if shared:
            _batch(runner)  # the HOT runs recorded again
        else:
            for r in rows:
                table.set(int(r), 0, 0)
        ours.stage_batch(rows)
        ours.init_forward_metadata_out_graph(fb)
        assert ours.graphs.planned_cascade is shared
        lens = md.cache_seqlens_int32[:bs].tolist()
        assert lens == ([1] * bs if shared else real), (shared, lens)
        for b, (row, n) in enumerate(zip(rows, [1] * bs if shared else real)):
            assert md.page_table[b, :n].tolist() == rt[int(row), :n].tolist(), (shared, b)
    assert ours.stats_snapshot()["steps_per_path"] == {"cascade": 2, "paged": 1}
