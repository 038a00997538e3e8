"""GraniKV around SGLang's real ``TritonAttnBackend`` (built on CPU from a real ``ServerArgs`` and
``ModelConfig``; its Triton kernels run under the interpreter): a decode step over a shared HOT
prefix gives the stock backend's output on the same KV, so the wrapper's contract holds for the
real class, not only for stand-ins. The GPU versions (flashinfer too, eager and graph replay)
are in test/kernels/test_gpu_real_backends.py."""

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from support.sglang_context import bind_kv_loc_plan

import test_backend as tb  # noqa: E402  (beside this file)

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=tb.HQ * tb.D,
             intermediate_size=256, num_hidden_layers=1, num_attention_heads=tb.HQ,
             num_key_value_heads=tb.HKV, head_dim=tb.D, vocab_size=256, max_position_embeddings=128,
             rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float16", bos_token_id=1, eos_token_id=2)


@contextlib.contextmanager
def triton_runner(tmp_path, config, *, prepare=None):
    """test_backend's CPU runner with the real ServerArgs / ModelConfig of ``config`` (an HF
    config dict written into ``tmp_path``) published for SGLang's triton backend, under a
    TP-1 parallel state; ``prepare(runner)`` runs first (e.g. a pool with more layers)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs
    from support.sglang_context import add_newer_runner_fields, published_server_args

    (tmp_path / "config.json").write_text(json.dumps(config))
    sa = ServerArgs(model_path=str(tmp_path), skip_tokenizer_init=True, attention_backend="triton",
                    device="cpu", load_format="dummy")
    with published_server_args(sa):
        with get_parallel().override(attn_tp_size=1, attn_tp_rank=0, attn_dcp_size=1, attn_dcp_rank=0,
                                     tp_size=1):
            runner = tb._runner()
            if prepare is not None:
                prepare(runner)
            runner.model_config = ModelConfig.from_server_args(sa)
            runner.server_args = sa
            runner.gpu_id, runner.is_draft_worker, runner.sliding_window_size, runner.page_size = 0, False, None, 1
            add_newer_runner_fields(runner)
            yield runner


@pytest.fixture
def real_runner(tmp_path):
    with triton_runner(tmp_path, LLAMA) as runner:
        yield runner


def _layer():
    return RadixAttention(num_heads=tb.HQ, head_dim=tb.D, scaling=tb.D ** -0.5, num_kv_heads=tb.HKV, layer_id=0)


def _decode(backend, fb, q, k, v, layer):
    backend.init_forward_metadata(fb)
    return backend.forward_decode(q, k, v, layer, fb, save_kv_cache=True)


def test_wrapped_real_triton_decode_equals_stock(real_runner):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    runner = real_runner
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info = None
    bind_kv_loc_plan(runner, fb)  # 0.5.23: a forward gets its KV location plan as ForwardBatch does
    q, k, v = tb._qkv(fb.batch_size, 3)
    k, v = k.view(-1, tb.HKV, tb.D), v.view(-1, tb.HKV, tb.D)  # as RadixAttention.forward passes them
    layer = _layer()
    stock = _decode(TritonAttnBackend(runner), fb, q, k, v, layer)
    torch.testing.assert_close(stock, tb._expected(runner, fb, q), atol=tb.ATOL, rtol=tb.RTOL)  # sanity
    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton")
    assert isinstance(ours, GraniKVAttnBackend)
    ours.stage_batch(rows)
    out = _decode(ours, fb, q, k, v, layer)
    assert ours.stats.paths == {"cascade": 1} and ours.stats.grouped_requests == 3
    # the real backend was planned with seq_len = 1: GraniKV's kernels produced every row
    torch.testing.assert_close(out, stock, atol=tb.ATOL, rtol=tb.RTOL)


def test_wrapped_real_triton_steady_steps_equal_stock(real_runner):
    """Decode steps of one batch as serving runs them: each request one token longer per step
    (its KV written by the step itself). After the first step GraniKV advances its plan in place
    (no metadata upload: the suffix kernels read the step's device seq_lens), and every step
    equals SGLang's real triton backend on the same KV."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    runner = real_runner
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info = None
    layer = _layer()
    stock_be = TritonAttnBackend(runner)
    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton")
    rt = runner.req_to_token_pool.req_to_token
    free = iter(range(tb.HOT_BASE + 40, tb.SLOTS))  # slots no request holds yet
    for step in range(4):
        if step:  # every request appends the token this step decodes
            seq = fb.seq_lens_cpu + 1
            new = torch.tensor([next(free) for _ in rows], dtype=torch.int64)
            rt[torch.as_tensor(rows), seq - 1] = new.to(torch.int32)
            fb.seq_lens, fb.seq_lens_cpu, fb.seq_lens_sum, fb.out_cache_loc = seq.clone(), seq, int(seq.sum()), new
        bind_kv_loc_plan(runner, fb)
        q, k, v = tb._qkv(fb.batch_size, 10 + step)
        k, v = k.view(-1, tb.HKV, tb.D), v.view(-1, tb.HKV, tb.D)
        stock = _decode(stock_be, fb, q, k, v, layer)
        ours.stage_batch(rows)
        out = _decode(ours, fb, q, k, v, layer)
        torch.testing.assert_close(out, stock, atol=tb.ATOL, rtol=tb.RTOL, msg=f"step {step}")
    ws = ours.decode.workspace
    assert ours.stats.paths == {"cascade": 4}
    assert ws.advances_in_place == 3 and ws.fills_built == 1, (ws.advances_in_place, ws.fills_built)
