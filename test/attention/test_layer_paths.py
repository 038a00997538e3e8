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


def _static_batch(fb, size):
    """What SGLang's decode graph runner captures with: its static buffers (request 0, every
    seq_len the fill value 1, the padding slot 0)."""
    view = tb._replay_view(fb, size)
    view.req_pool_indices = torch.zeros(size, dtype=torch.int64)
    view.seq_lens = torch.ones(size, dtype=torch.int64)
    view.seq_lens_cpu, view.seq_lens_sum = view.seq_lens.clone(), size
    view.out_cache_loc = torch.zeros(size, dtype=torch.int64)
    return view


class _Spy:
    """Records which instance each layer call of a forward reached."""

    def __init__(self, backend, name, log):
        self._backend, self._name, self._log = backend, name, log

    def __getattr__(self, attr):
        return getattr(self._backend, attr)

    def forward_decode(self, q, k, v, layer, fb, **kw):
        self._log.append((self._name, layer.layer_id))
        return self._backend.forward_decode(q, k, v, layer, fb, **kw)

    def init_forward_metadata_in_graph(self, fb):
        self._log.append((self._name, "in_graph"))
        return self._backend.init_forward_metadata_in_graph(fb)


@pytest.mark.parametrize("refill", [True, False])
def test_cascade_graphs_capture_the_second_instance_and_replays_refill_it(hybrid, monkeypatch, refill):
    """A hybrid model's decode graphs: the stock graph of a size is the wrapped backend alone; its
    cascade graph is captured with the second instance's capture metadata (the windowed layer calls
    it inside the capture); a step that replays the cascade graph refills the second instance's
    buffers with its real padded batch. What the graph's layers compute then equals stock triton
    over the real batch (rows past the batch are padding). Planted (``refill`` False): a replay that
    leaves the second instance's buffers as captured (static batch) gives the windowed layer wrong
    outputs."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    from granikv import plugin
    from granikv.attention.decode.graph_variants import CASCADE_LABEL, GraphVariants
    from test_graph_variants import FakeRunner, _load_orig

    runner = hybrid
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info, fb.encoder_lens = None, None
    bind_kv_loc_plan(runner, fb)
    layers = _layers()
    view = tb._replay_view(fb, 8)
    qkv = _qkv(view, 5)
    stock = _step(TritonAttnBackend(runner), fb, [tuple(t[:5] for t in x) for x in qkv], layers)

    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton",
                                   build_inner=lambda: TritonAttnBackend(runner))
    ours.graphs = GraphVariants(frozenset({8}), can_win=None)
    ours.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    paths = ours.layer_paths
    calls = []
    ours.inner, paths.real = _Spy(ours.inner, "inner", calls), _Spy(paths.real, "real", calls)
    static = _static_batch(fb, 8)
    captured = {}

    def capture_one_shape(gr, size, forward, stream_idx=None, variant_label=None):
        del calls[:]
        gr.attn_backend.init_forward_metadata_out_graph(static, in_capture=True)
        gr.attn_backend.init_forward_metadata_in_graph(static)  # inside graph.capture(), as SGLang calls it
        for (q, k, v), layer in zip(_qkv(static, 40), layers):  # the forward the graph records
            gr.attn_backend.forward_decode(q, k, v, layer, static, save_kv_cache=False)
        captured[gr._make_graph_key(size, stream_idx, variant_label)] = list(calls)

    gr = FakeRunner(ours, capture_bs=[8])
    plugin._around_capture_one_shape(capture_one_shape, gr, 8, forward=None)
    assert captured == {ShapeKey(8): [("inner", "in_graph"), ("inner", 0), ("inner", 1)],
                        ShapeKey(8, variant_label=CASCADE_LABEL): [("inner", "in_graph"), ("real", "in_graph"),
                                                                    ("inner", 0), ("real", 1)]}
    assert paths.layer_calls == {"granikv": 0, "stock": 0}  # a capture is not a step

    if not refill:  # planted: the replay does not refill the second instance
        monkeypatch.setattr(paths.real._backend, "init_forward_metadata_out_graph", lambda *a, **k: None)
    static.seq_lens.copy_(view.seq_lens)  # SGLang refills its static seq_lens in place, which the replay
    view.seq_lens = static.seq_lens  # view slices (the cascade graph copies its suffix ends from there)
    ours.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, view)
    assert gr._replay_graph_key == ShapeKey(8, variant_label=CASCADE_LABEL)
    ours.decode.ws.ends.copy_from(static.seq_lens, 8)  # the replay's first node (in-graph copy)
    del calls[:]
    out = [ours.forward_decode(q, k, v, layer, view, save_kv_cache=True) for (q, k, v), layer in zip(qkv, layers)]
    assert calls == [("inner", 0), ("real", 1)]  # the calls the cascade graph replays
    torch.testing.assert_close(out[0][:5], stock[0], atol=tb.ATOL, rtol=tb.RTOL)
    if refill:
        torch.testing.assert_close(out[1][:5], stock[1], atol=tb.ATOL, rtol=tb.RTOL)
    else:
        assert (out[1][:5] - stock[1]).abs().max() > 10 * tb.ATOL
    snap = ours.stats_snapshot()
    assert snap["per_layer_graph_steps"] == 1 and snap["per_layer_steps"] == 1
    # the eager forward above stands in for the replay, which runs no Python: its calls are the replay's
    assert paths.layer_calls == {"granikv": 2, "stock": 2}
    paths.check_integrity()
    ours.graphs.check_integrity()


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
    snap = ours.stats_snapshot()  # no request holds a HOT run: a step that plans nothing
    assert snap["steps_per_path"] == {"paged": 1} and snap["no_hot_steps"] == 1 and snap["per_layer_steps"] == 0


def test_without_a_builder_or_with_another_refusal_decode_stays_stock(hybrid):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(hybrid), model_runner=hybrid, cfg=cfg, backend_name="triton")
    assert ours.dispatcher.forced is Path.PAGED and ours.layer_paths is None
    assert per_layer_stock({1: "sliding window 8"}, 2) == {1: "sliding window 8"}
    assert per_layer_stock({1: "sliding window 8", 2: "logit cap 30.0"}, 3) is None  # another refusal
    assert per_layer_stock({0: "sliding window 8", 1: "sliding window 8"}, 2) is None  # no layer left
    assert per_layer_stock({}, 2) is None
