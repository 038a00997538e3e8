"""Per-layer decode paths of a hybrid model (decode/layer_paths.py) around SGLang's real
``TritonAttnBackend`` on CPU (its kernels under the interpreter): a model whose layer 0 is full
attention and layer 1 has an 8-token sliding window, one pool for both. A decode step over a
shared HOT prefix runs layer 0 on GraniKV's cascade path and layer 1 on a second real triton
instance planned with the real batch; both equal SGLang's own triton backend over the same KV.
Planted: the windowed layer through the instance planned with the ``seq_len = 1`` view (what one
instance for every layer would do) differs from stock."""

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

import test_backend as tb
from test_real_triton_backend import LLAMA, triton_runner
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.decode.layer_paths import per_layer_stock
from granikv.attention.dispatcher import Path
from granikv.config import GraniKVConfig
from support.sglang_context import bind_kv_loc_plan

WINDOW = 8


def _layers():
    full = RadixAttention(num_heads=tb.HQ, head_dim=tb.D, scaling=tb.D ** -0.5, num_kv_heads=tb.HKV, layer_id=0)
    windowed = RadixAttention(num_heads=tb.HQ, head_dim=tb.D, scaling=tb.D ** -0.5, num_kv_heads=tb.HKV,
                              layer_id=1, sliding_window_size=WINDOW)
    return full, windowed


def _two_layer_pool(runner):
    runner.token_to_kv_pool = pool = MHATokenToKVPool(tb.SLOTS, page_size=1, dtype=tb.DTYPE, head_num=tb.HKV,
                                                      head_dim=tb.D, layer_num=2, device="cpu",
                                                      enable_memory_saver=False)
    g = torch.Generator().manual_seed(1)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g).to(tb.DTYPE))


@pytest.fixture
def hybrid(tmp_path):
    with triton_runner(tmp_path, dict(LLAMA, num_hidden_layers=2), prepare=_two_layer_pool) as runner:
        runner.sliding_window_size = WINDOW
        runner.model = torch.nn.ModuleList(_layers())
        yield runner


def _step(backend, fb, qkv, layers):
    backend.init_forward_metadata(fb)
    return [backend.forward_decode(q, k, v, layer, fb, save_kv_cache=True) for (q, k, v), layer in zip(qkv, layers)]


def _qkv(fb, seed):
    out = []
    for i in range(2):
        q, k, v = tb._qkv(fb.batch_size, seed + i)
        out.append((q, k.view(-1, tb.HKV, tb.D), v.view(-1, tb.HKV, tb.D)))
    return out


def test_full_layers_take_the_cascade_path_and_windowed_layers_the_real_batch(hybrid):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    runner = hybrid
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info = None
    bind_kv_loc_plan(runner, fb)
    layers = _layers()
    qkv = _qkv(fb, 5)
    stock = _step(TritonAttnBackend(runner), fb, qkv, layers)
    built = []
    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton",
                                   build_inner=lambda: built.append(TritonAttnBackend(runner)) or built[-1])
    assert isinstance(ours, GraniKVAttnBackend) and len(built) == 1
    assert ours.dispatcher.forced is Path.CASCADE  # not paged: the full layer keeps GraniKV's path
    ours.stage_batch(rows)
    out = _step(ours, fb, qkv, layers)
    for i in range(2):
        torch.testing.assert_close(out[i], stock[i], atol=tb.ATOL, rtol=tb.RTOL, msg=f"layer {i}")
    snap = ours.stats_snapshot()
    assert ours.stats.paths == {"cascade": 1}
    assert snap["per_layer_steps"] == 1 and snap["per_layer_calls"] == {"granikv": 1, "stock": 1}
    assert snap["per_layer_layers"] == {"granikv": 1, "stock": 1}
    ours.layer_paths.check_integrity()
    # planted: the windowed layer through the instance planned with the seq_len = 1 view
    wrong = ours.inner.forward_decode(*qkv[1], layers[1], fb, save_kv_cache=False)
    assert (wrong - stock[1]).abs().max() > 10 * tb.ATOL
    # the decode graphs of such a model stay stock (the second instance has no graph state)
    assert not ours.graphs.wants_cascade(fb.batch_size)


def test_a_paged_step_calls_the_wrapped_backend_alone(hybrid):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    runner = hybrid
    fb, rows = tb._batch(runner, hot=set())  # nothing to group: the step is paged
    fb.spec_info = None
    bind_kv_loc_plan(runner, fb)
    layers = _layers()
    qkv = _qkv(fb, 9)
    stock = _step(TritonAttnBackend(runner), fb, qkv, layers)
    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton",
                                   build_inner=lambda: TritonAttnBackend(runner))
    ours.stage_batch(rows)
    out = _step(ours, fb, qkv, layers)
    for i in range(2):
        torch.testing.assert_close(out[i], stock[i], atol=tb.ATOL, rtol=tb.RTOL)
    assert ours.stats.paths == {"paged": 1} and ours.stats_snapshot()["per_layer_steps"] == 0


def test_without_a_builder_or_with_another_refusal_decode_stays_stock(hybrid):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(hybrid), model_runner=hybrid, cfg=cfg, backend_name="triton")
    assert ours.dispatcher.forced is Path.PAGED and ours.layer_paths is None
    assert per_layer_stock({1: "sliding window 8"}, 2) == {1: "sliding window 8"}
    assert per_layer_stock({1: "sliding window 8", 2: "logit cap 30.0"}, 3) is None  # another refusal
    assert per_layer_stock({0: "sliding window 8", 1: "sliding window 8"}, 2) is None  # no layer left
    assert per_layer_stock({}, 2) is None
