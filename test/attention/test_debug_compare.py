"""DebugCompare's every-layer decode compare on CPU: the deviation measure and its tolerance, the
wrapped backend planned with the real batch on a compared step (its output is the reference),
SGLang's real ``TritonAttnBackend`` around two layers (small deviation; large under the planted
fault ``GRANIKV_DEBUG_FAULT=half_prefix``), the float64 fallback, and the server-info merge."""


import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from granikv import envs
from granikv.config import GraniKVConfig
from granikv.kernels.reference import decode_attention_ref
from granikv.attention.debug import compare as dc
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.step_stats import MAXIMA
from support.sglang_context import bind_kv_loc_plan

import test_backend as tb  # noqa: E402  (beside this file)
import test_real_triton_backend as rtb  # noqa: E402

LAYERS = 2
FP16_FLOOR = dc.FLOOR_EPS * torch.finfo(torch.float16).eps


def test_rel_dev_and_tolerance():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    o = ref.clone()
    o[1, 1] += 0.2
    assert dc.rel_dev(o, ref) == pytest.approx(0.2 / 4.0)  # max |diff| / max |ref|, over the batch
    assert dc.rel_dev(ref, ref) == 0.0
    assert dc.rel_dev(torch.zeros(2), torch.zeros(2)) == 0.0
    assert dc.rel_dev(torch.ones(2), torch.zeros(2)) == float("inf")
    with pytest.raises(ValueError, match=r"\(2, 2\) vs reference \(4,\)"):
        dc.rel_dev(ref, ref.view(-1))
    assert dc.layer_tolerance(None, torch.bfloat16) == dc.FLOOR_EPS * 2.0 ** -7  # bf16 eps
    assert dc.layer_tolerance(1e-6, torch.float16) == FP16_FLOOR  # the floor
    assert dc.layer_tolerance(0.01, torch.float16) == pytest.approx(dc.TOLERANCE_FACTOR * 0.01)


def _compared_backend(every: int):
    runner = tb._runner()
    be = tb._backend(runner, "cascade")
    be.cfg = GraniKVConfig(enable=True, attention_path="cascade", debug_compare_every=every)
    return runner, be


def test_compared_step_plans_the_wrapped_backend_with_the_real_batch():
    """Every 2nd step is compared: step 1 plans the stand-in with seq_len = 1 and compares
    nothing; step 2 plans it with the real seq_lens, so its output is the stock output, and the
    step's output is still GraniKV's (equal to paged attention)."""
    runner, be = _compared_backend(2)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    for step, seq_lens in ((1, [1] * fb.batch_size), (2, fb.seq_lens.tolist())):
        q, k, v = tb._qkv(fb.batch_size, 20 + step)
        be.stage_batch(rows)
        be.init_forward_metadata(fb)
        assert be.inner.seq_lens.tolist() == seq_lens, step
        o = be.forward_decode(q, k, v, tb.LAYER, fb)
        torch.testing.assert_close(o, tb._expected(runner, fb, q), atol=tb.ATOL, rtol=tb.RTOL)
        assert be.stats.layer_output_compares == step - 1
    s = be.stats_snapshot()
    assert s["layer_output_over_tolerance"] == 0 and s["layer_output_f64_references"] == 0
    assert 0 < s["layer_output_max_rel_dev"] <= s["layer_output_tolerance"] == pytest.approx(FP16_FLOOR)
    assert 0 < s["layer_output_stock_max_rel_dev"] < FP16_FLOOR  # the stand-in is fp16-rounded float64


def test_without_a_stock_output_the_reference_is_float64():
    runner, be = _compared_backend(1)
    fb, rows = tb._batch(runner, hot={0, 1, 2, 3})
    q, k, v = tb._qkv(fb.batch_size, 5)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, tb.LAYER, fb)
    dev = be.compare.compare_decode(q, tb.LAYER, fb, o, be.decode.path, stock=None)
    pool = runner.token_to_kv_pool
    ref = decode_attention_ref(q.view(-1, tb.HQ, tb.D), pool.k_buffer[0], pool.v_buffer[0],
                               runner.req_to_token_pool.req_to_token, fb.req_pool_indices,
                               fb.seq_lens, tb.LAYER.scaling).o.reshape(o.shape)
    assert dev == dc.rel_dev(o, ref) > 0
    st = be.stats
    assert st.layer_output_compares == 2 and st.layer_output_f64_references == 1
    assert st.layer_output_tolerance == pytest.approx(FP16_FLOOR) and st.layer_output_over_tolerance == 0


def test_graph_metadata_cancels_the_compare():
    """A replay runs no Python: planning out of the graph leaves no compare due."""
    runner, be = _compared_backend(1)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert be.compare.decode_due(tb.LAYER)
    be.init_forward_metadata_out_graph(fb)
    assert not be.compare.decode_due(tb.LAYER) and be.compare.stock_output(torch.ones(1)) is None


# ---- SGLang's real triton backend, two layers ------------------------------------------------


@pytest.fixture
def two_layer_runner(tmp_path, monkeypatch):
    def two_layer_pool(runner):
        runner.token_to_kv_pool = pool = MHATokenToKVPool(
            tb.SLOTS, page_size=1, dtype=tb.DTYPE, head_num=tb.HKV, head_dim=tb.D,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        g = torch.Generator().manual_seed(7)
        for buf in pool.k_buffer + pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g).to(tb.DTYPE))

    with rtb.triton_runner(tmp_path, dict(rtb.LLAMA, num_hidden_layers=LAYERS), prepare=two_layer_pool) as runner:
        yield runner


def _layers():
    from sglang.srt.layers.radix_attention import RadixAttention

    return [RadixAttention(num_heads=tb.HQ, head_dim=tb.D, scaling=tb.D ** -0.5, num_kv_heads=tb.HKV,
                           layer_id=i) for i in range(LAYERS)]


@pytest.mark.parametrize("fault", ["", "half_prefix"])
def test_every_layer_against_the_real_triton_backend(two_layer_runner, monkeypatch, fault):
    """One compared decode step through both layers around SGLang's real triton backend: every
    layer is compared with triton's own output for the step. Correct kernels: a deviation
    within the tolerance (and the step equals a separate stock triton backend's); the planted
    fault: every layer far over it."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    monkeypatch.setenv(envs.DEBUG_FAULT, fault)
    runner = two_layer_runner
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    fb.spec_info = None
    bind_kv_loc_plan(runner, fb)  # 0.5.23: a forward gets its KV location plan as ForwardBatch does
    cfg = GraniKVConfig(enable=True, attention_path="cascade", debug_compare_every=1)
    ours = GraniKVAttnBackend.wrap(TritonAttnBackend(runner), model_runner=runner, cfg=cfg, backend_name="triton")
    assert isinstance(ours, GraniKVAttnBackend)
    stock_be = TritonAttnBackend(runner)
    stock_be.init_forward_metadata(fb)
    ours.stage_batch(rows)
    ours.init_forward_metadata(fb)
    outs, stocks = [], []
    for layer in _layers():
        q, k, v = tb._qkv(fb.batch_size, 30 + layer.layer_id)
        k, v = k.view(-1, tb.HKV, tb.D), v.view(-1, tb.HKV, tb.D)
        outs.append(ours.forward_decode(q, k, v, layer, fb, save_kv_cache=True))
        stocks.append(stock_be.forward_decode(q, k, v, layer, fb, save_kv_cache=False))
    s = ours.stats_snapshot()
    assert s["steps_per_path"] == {"cascade": 1}
    assert s["layer_output_compares"] == LAYERS and s["layer_output_f64_references"] == 0
    # triton planned the real batch: its output is attention over every token, within an ulp of float64
    assert 0 < s["layer_output_stock_max_rel_dev"] < FP16_FLOOR
    assert s["layer_output_tolerance"] == pytest.approx(
        dc.layer_tolerance(s["layer_output_stock_max_rel_dev"], tb.DTYPE))
    if not fault:
        assert s["layer_output_over_tolerance"] == 0
        assert s["layer_output_max_rel_dev"] <= s["layer_output_tolerance"]
        for out, stock in zip(outs, stocks):
            torch.testing.assert_close(out, stock, atol=tb.ATOL, rtol=tb.RTOL)
    else:  # every layer's grouped rows miss half their prefix
        assert s["layer_output_over_tolerance"] == LAYERS
        assert s["layer_output_max_rel_dev"] > 20 * s["layer_output_tolerance"]


def test_server_info_merges_the_maxima_by_max():
    from types import SimpleNamespace

    from granikv.scheduler_step import _AttentionStats

    snaps = [dict(decode_steps=3, layer_output_compares=4, layer_output_max_rel_dev=0.5,
                  layer_output_stock_max_rel_dev=0.001, layer_output_tolerance=0.004),
             dict(decode_steps=1, layer_output_compares=2, layer_output_max_rel_dev=0.002,
                  layer_output_stock_max_rel_dev=0.003, layer_output_tolerance=0.012)]
    backends = [SimpleNamespace(stats_snapshot=lambda s=s: s) for s in snaps]
    out = _AttentionStats(backends).stats_snapshot()
    assert out["layer_output_compares"] == 6
    assert {k: out[k] for k in MAXIMA} == {"layer_output_max_rel_dev": 0.5,
                                           "layer_output_stock_max_rel_dev": 0.003,
                                           "layer_output_tolerance": 0.012}
