"""GPU: GraniKV around SGLang's real FlashInferAttnBackend and TritonAttnBackend (the smallest
real construction: real ServerArgs / ModelConfig / pools, runtime context published, no model),
decode over a shared HOT prefix against the stock backend on the same KV, eager and under
CUDA-graph replay. bf16, head_dim 128, GQA 4 (the FlashInfer modules SGLang's recipe carries).
Also SGLang's FlashAttentionBackend (fa3) where sgl_kernel's FA3 library loads (e.g. the one
scripts/fa3 builds); skipped where it does not.

    python3 -m pytest -m gpu test/kernels/test_gpu_real_backends.py
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.mem_cache.hot_prefix_table import HotPrefixTable

pytestmark = pytest.mark.gpu

HQ, HKV, D = 8, 2, 128
SLOTS, HOT_BASE, PREFIX = 4096, 3000, 517
DTYPE = torch.bfloat16
ATOL = RTOL = 2e-2  # bf16 outputs of two different kernels (split-KV vs cascade + LSE merge)


@pytest.fixture
def runner(tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.runtime_context import get_parallel
    from support.sglang_context import add_newer_runner_fields, published_server_args
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HQ * D, intermediate_size=512,
               num_hidden_layers=1, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, vocab_size=512,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sa = ServerArgs(model_path=str(tmp_path), skip_tokenizer_init=True, attention_backend="triton",
                    load_format="dummy", page_size=1)
    with published_server_args(sa):
        with get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, tp_size=1,
                                     attn_cp_size=1, attn_cp_rank=0):
            r = SimpleNamespace(model_config=ModelConfig.from_server_args(sa), server_args=sa, device="cuda", gpu_id=0,
                                is_draft_worker=False, sliding_window_size=None, page_size=1, kv_cache_dtype=DTYPE,
                                kv_cache_dtype_str="auto",
                                dtype=DTYPE, init_new_workspace=False, spec_algorithm=SpeculativeAlgorithm.NONE,
                                ps=SimpleNamespace(attn_tp_size=1, attn_cp_size=1, tp_size=1), decode_attention_backend_str="flashinfer",
                                prefill_attention_backend_str="flashinfer")  # what 0.5.23 reads
            r.req_to_token_pool = ReqToTokenPool(size=16, max_context_len=2048, device="cuda", enable_memory_saver=False)
            r.token_to_kv_pool = MHATokenToKVPool(SLOTS, page_size=1, dtype=DTYPE, head_num=HKV, head_dim=D,
                                                  layer_num=1, device="cuda", enable_memory_saver=False)
            r.token_to_kv_pool_allocator = SimpleNamespace(hot_prefix_table=HotPrefixTable(17),
                                                           get_kvcache=lambda: r.token_to_kv_pool)
            add_newer_runner_fields(r, "cuda")  # 0.5.23's backends read its KV index translator
            g = torch.Generator(device="cuda").manual_seed(0)
            for buf in (r.token_to_kv_pool.k_buffer[0], r.token_to_kv_pool.v_buffer[0]):
                buf.copy_(torch.randn(buf.shape, generator=g, device="cuda").to(DTYPE))
            yield r


def _fa3_missing():
    """Why SGLang's fa3 backend cannot run here (None: it can)."""
    try:
        import sgl_kernel.flash_ops  # noqa: F401  (the FA3 library)
    except Exception as e:  # noqa: BLE001 - any load failure: not installed or not built
        return f"sgl_kernel's FA3 library does not load: {type(e).__name__}: {e}"
    return None


BACKENDS = ["triton", "flashinfer", pytest.param("fa3", marks=pytest.mark.skipif(
    _fa3_missing() is not None, reason=str(_fa3_missing())))]


def _build(runner, name):
    if name == "fa3":
        from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

        return FlashAttentionBackend(runner)
    if name == "triton":
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(runner)
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(runner)


def _batch(runner, suffix=(5, 9, 37, 17, 6, 1, 12, 3)):
    """Rows 1..8; even rows share the HOT prefix at HOT_BASE, odd rows have private COLD prompts."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from support.sglang_context import bind_kv_loc_plan

    rt = runner.req_to_token_pool.req_to_token
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    rows, seq_lens, nxt = [], [], 1
    for i, n in enumerate(suffix):
        hot = i % 2 == 0
        prefix = list(range(HOT_BASE, HOT_BASE + PREFIX)) if hot else list(range(nxt, nxt + PREFIX))
        nxt += 0 if hot else PREFIX
        cold = list(range(nxt, nxt + n))
        nxt += n
        rt[i + 1, : PREFIX + n] = torch.tensor(prefix + cold, dtype=torch.int32, device="cuda")
        table.set(i + 1, HOT_BASE if hot else 0, PREFIX if hot else 0)
        rows.append(i + 1)
        seq_lens.append(PREFIX + n)
    assert nxt < HOT_BASE
    seq = torch.tensor(seq_lens, dtype=torch.int64, device="cuda")
    rpi = torch.tensor(rows, device="cuda")
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(rows), req_pool_indices=rpi, seq_lens=seq,
                         seq_lens_cpu=seq.cpu(), seq_lens_sum=int(seq.sum()), out_cache_loc=rt[rpi, seq - 1].long(),
                         positions=(seq - 1).long(),  # FlashInfer's graph capture sizes its buffers by it
                         spec_info=None, encoder_lens=None, num_padding=0)
    bind_kv_loc_plan(runner, fb)
    return fb, np.array(rows, dtype=np.int64)


def _layer():
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=HQ, head_dim=D, scaling=D ** -0.5, num_kv_heads=HKV, layer_id=0)


def _qkv(bs, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(bs, h * D, generator=g, device="cuda").to(DTYPE) for h in (HQ, HKV, HKV)]


def _stock(runner, name, fb, q, k, v, layer):
    be = _build(runner, name)
    be.init_forward_metadata(fb)
    return be.forward_decode(q, k.view(-1, HKV, D), v.view(-1, HKV, D), layer, fb, save_kv_cache=False)


@pytest.mark.parametrize("name", BACKENDS)
def test_eager_decode_over_a_hot_prefix_equals_stock(runner, name):
    fb, rows = _batch(runner)
    q, k, v = _qkv(fb.batch_size, 1)
    layer = _layer()
    ours = GraniKVAttnBackend.wrap(_build(runner, name), model_runner=runner,
                                   cfg=GraniKVConfig(enable=True, attention_path="cascade"), backend_name=name)
    assert isinstance(ours, GraniKVAttnBackend)
    ours.stage_batch(rows)
    ours.init_forward_metadata(fb)
    out = ours.forward_decode(q, k.view(-1, HKV, D), v.view(-1, HKV, D), layer, fb, save_kv_cache=False)
    assert ours.stats.paths == {"cascade": 1} and ours.stats.grouped_requests == 4
    torch.testing.assert_close(out, _stock(runner, name, fb, q, k, v, layer), atol=ATOL, rtol=RTOL)


def _capture(ours, fb, q, k, v, layer, *, cascade: bool):
    """One decode graph of ``fb.batch_size`` as the graph-runner hooks capture it (plugin.py):
    the stock graph, or (``cascade``) the cascade graph of that size right after it."""
    bs = fb.batch_size
    if cascade:
        ours.graphs.begin_capture(bs)
    try:
        ours.init_forward_metadata_out_graph(fb, in_capture=True)
        for _ in range(2):  # warm-up (compiles the kernels) before capture
            ours.forward_decode(q, k.view(-1, HKV, D), v.view(-1, HKV, D), layer, fb, save_kv_cache=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours.forward_decode(q, k.view(-1, HKV, D), v.view(-1, HKV, D), layer, fb, save_kv_cache=False)
    finally:
        if cascade:
            ours.graphs.end_capture(True)
    return graph, out


@pytest.mark.parametrize("view_plan", ["reuse", "every_step"])
@pytest.mark.parametrize("name", BACKENDS)
def test_graph_replay_over_a_hot_prefix_equals_stock(runner, name, view_plan):
    """Both graphs of one size captured (stock, then cascade, sharing the wrapped backend's
    metadata buffers); each step's plan picks the graph that replays: a batch with a shared
    HOT prefix replays the cascade graph, a batch without one the stock graph, and both equal
    the stock backend; then steady cascade steps, whose wrapped-backend plan is reused under
    ``view_plan="reuse"``."""
    fb, rows = _batch(runner)
    bs = fb.batch_size
    layer = _layer()
    ours = GraniKVAttnBackend.wrap(_build(runner, name), model_runner=runner,
                                   cfg=GraniKVConfig(enable=True, attention_path="cascade", view_plan=view_plan),
                                   backend_name=name)
    ours.init_cuda_graph_state(bs, bs)
    q, k, v = (torch.zeros_like(t) for t in _qkv(bs, 0))  # the graphs' static inputs
    stock_graph, stock_out = _capture(ours, fb, q, k, v, layer, cascade=False)
    cascade_graph, cascade_out = _capture(ours, fb, q, k, v, layer, cascade=True)
    assert ours.graphs.has_cascade_graph(bs)
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    for seed, shared in ((1, True), (2, False), (3, True)):  # fresh inputs, planned before replay
        if not shared:  # the same rows and KV, no HOT prefix recorded: nothing to group
            for r in rows:
                table.set(int(r), 0, 0)
        else:
            _batch(runner)
        fresh = _qkv(bs, seed)
        for static, new in zip((q, k, v), fresh):
            static.copy_(new)
        ours.stage_batch(rows)
        ours.init_forward_metadata_out_graph(fb)
        assert ours.graphs.planned_cascade is shared
        # the WAR barrier's question: a cascade replay reads the pre-replay slot copy, never req_to_token
        assert ours.decode.slots_copied is shared and not ours.reads_req_to_token_during_replay()
        graph, out = (cascade_graph, cascade_out) if ours.graphs.planned_cascade else (stock_graph, stock_out)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _stock(runner, name, fb, *fresh, layer), atol=ATOL, rtol=RTOL)
    assert ours.stats_snapshot()["steps_per_path"] == {"cascade": 2, "paged": 1}
    if view_plan == "every_step":
        return
    # steady cascade steps of the same rows, back to back (no sync between them): the wrapped
    # backend's one-token plan of the last step is in place and is not made again
    # (ViewPlanMemo); every output still equals the stock backend
    made = ours.decode.view_memo.planned
    outs, inputs = [], []
    for seed in (4, 5, 6):
        fresh = _qkv(bs, seed)
        for static, new in zip((q, k, v), fresh):
            static.copy_(new)
        ours.stage_batch(rows)
        ours.init_forward_metadata_out_graph(fb)
        assert ours.graphs.planned_cascade
        cascade_graph.replay()
        outs.append(cascade_out.clone())
        inputs.append(fresh)
    torch.cuda.synchronize()
    assert ours.decode.view_memo.reused == 3 and ours.decode.view_memo.planned == made
    for out, fresh in zip(outs, inputs, strict=True):
        torch.testing.assert_close(out, _stock(runner, name, fb, *fresh, layer), atol=ATOL, rtol=RTOL)
