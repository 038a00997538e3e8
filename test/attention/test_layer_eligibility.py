"""Per-layer eligibility (eligibility.layer_reason / call_reason / scan_layers), shared by decode and
extend: real RadixAttention layers scanned at wrap time; an ineligible layer keeps decode stock
and runs its extend on the wrapped backend's own wrappers; a feature only a call shows turns
decode stock from the next step."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention

from granikv.config import GraniKVConfig
from granikv.attention import eligibility
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.dispatcher import Path
from granikv.attention.eligibility import LayerEligibility
from granikv.kernels.reference import decode_attention_ref

import test_backend as tb  # noqa: E402  (beside this file)
import test_hot_extend as th  # noqa: E402


def _attn(layer_id, **kw):
    return RadixAttention(num_heads=8, head_dim=64, scaling=0.125, num_kv_heads=2, layer_id=layer_id, **kw)


class _Block(torch.nn.Module):
    def __init__(self, attn, sinks=False):
        super().__init__()
        self.attn = attn
        self.sinks = torch.nn.Parameter(torch.zeros(8)) if sinks else None


def _model():
    capped = _attn(1, logit_cap=30.0)
    grok = _attn(2)
    grok.xai_temperature_len = 1024  # set after construction, as SGLang's Grok does
    return torch.nn.Sequential(_Block(_attn(0)), _Block(capped), _Block(grok),
                               _Block(_attn(3, sliding_window_size=4096)), _Block(_attn(4), sinks=True),
                               _Block(_attn(5, v_head_dim=32)), _Block(_attn(6)))


def test_scan_finds_every_feature_the_kernels_lack():
    reasons = eligibility.scan_layers(_model(), num_q_heads=8, head_dim=64)
    assert reasons == {1: "logit cap 30.0", 2: "xai temperature scaling (len 1024)",
                       3: "sliding window 4096", 4: "attention sinks",
                       5: "qk head dim 64 != v head dim 32"}
    assert eligibility.layer_reason(_attn(0), num_q_heads=8, head_dim=64) is None
    assert "query heads" in eligibility.layer_reason(_attn(0), num_q_heads=16)
    assert "head_dim 64" in eligibility.layer_reason(_attn(0), head_dim=128)
    assert eligibility.scan_layers(None) == {} and eligibility.scan_layers(object()) == {}
    plain = _attn(0)
    for attr, val, word in (("k_scale", torch.ones(1), "without k_scale_float"), ("is_cross_attention", True, "cross"),
                            ("use_irope", True, "irope"), ("pos_encoding_mode", "ROPE_LLAMA", "position")):
        setattr(plain, attr, val)
        assert word in eligibility.layer_reason(plain)
        plain = _attn(0)
    assert eligibility.layer_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"


def test_an_ineligible_layer_keeps_decode_stock(caplog):
    runner = tb._runner()
    runner.model = torch.nn.Sequential(_Block(_attn(0)), _Block(_attn(1, logit_cap=30.0)))
    cfg = GraniKVConfig(enable=True, attention_path="cascade")
    with caplog.at_level("WARNING", logger="granikv"):
        be = GraniKVAttnBackend(None, model_runner=runner, cfg=cfg, backend_name="stand-in")
    assert "attention layers 1 run the stock stand-in backend (logit cap 30.0)" in caplog.text
    assert be.dispatcher.forced is Path.PAGED
    be.inner = tb.PagedStandIn(runner)
    fb, rows = tb._batch(runner, hot={0, 2, 3})  # a batch the cascade path would group
    q, k, v = tb._qkv(fb.batch_size, 1)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert be.inner.seq_lens.tolist() == fb.seq_lens.tolist()  # the stock backend reads it all
    o = be.forward_decode(q, k, v, tb.LAYER, fb)
    torch.testing.assert_close(o, tb._expected(runner, fb, q), atol=tb.ATOL, rtol=tb.RTOL)
    assert be.stats.paths == {"paged": 1}
    # the same model without the capped layer: decode takes the forced path
    runner.model = torch.nn.Sequential(_Block(_attn(0)))
    assert GraniKVAttnBackend(None, model_runner=runner, cfg=cfg, backend_name="s").dispatcher.forced is Path.CASCADE


class _KwargsStandIn(tb.PagedStandIn):
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True, **kwargs):
        return super().forward_decode(q, k, v, layer, fb, save_kv_cache)


def test_a_decode_argument_the_scan_missed_turns_decode_stock(caplog):
    runner = tb._runner()
    be = tb._backend(runner, "cascade")
    be.inner = _KwargsStandIn(runner)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    q, k, v = tb._qkv(fb.batch_size, 1)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    with caplog.at_level("ERROR", logger="granikv"):
        be.forward_decode(q, k, v, tb.LAYER, fb, k_descale=torch.ones(1))
    assert "carries extra arguments ['k_descale']" in caplog.text
    be.stage_batch(rows)
    be.init_forward_metadata(fb)  # the next step: stock
    o = be.forward_decode(q, k, v, tb.LAYER, fb, k_descale=torch.ones(1))
    torch.testing.assert_close(o, tb._expected(runner, fb, q), atol=tb.ATOL, rtol=tb.RTOL)
    assert be.stats.paths == {"cascade": 1, "paged": 1}


def _sinks_model():
    return torch.nn.Sequential(_Block(RadixAttention(num_heads=tb.HQ, head_dim=tb.D, scaling=tb.D ** -0.5,
                                                     num_kv_heads=tb.HKV, layer_id=0), sinks=True))


def test_a_decode_call_with_sinks_is_served_with_the_sink_in_the_merge(caplog):
    """A model whose attention holds sinks (gpt-oss's learned ``sinks``, bf16): the scan keeps
    decode on GraniKV (extend stock for those layers), and a decode step with ``sinks=``
    matches the float64 reference with the sinks; the same step without them would not."""
    runner = tb._runner()
    runner.model = _sinks_model()
    with caplog.at_level("INFO", logger="granikv"):
        be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, attention_path="cascade"),
                                backend_name="stand-in")
    assert be.dispatcher.forced is not Path.PAGED and "served in decode" in caplog.text
    be.inner = _KwargsStandIn(runner)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    q, k, v = tb._qkv(fb.batch_size, 1)
    sinks = (torch.arange(tb.HQ, dtype=torch.float32) * 0.5 + 1.0).to(torch.bfloat16)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, tb.LAYER, fb, sinks=sinks)
    assert be.stats.paths == {"cascade": 1}
    pool = runner.token_to_kv_pool
    ref = decode_attention_ref(q.view(-1, tb.HQ, tb.D), pool.k_buffer[0], pool.v_buffer[0],
                               runner.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               tb.LAYER.scaling, sinks=sinks.float()).o
    got = o.view(-1, tb.HQ, tb.D).double()
    torch.testing.assert_close(got, ref, atol=tb.ATOL, rtol=tb.RTOL)
    assert (got - tb._expected(runner, fb, q).view(-1, tb.HQ, tb.D).double()).abs().max() > 10 * tb.ATOL
    assert be.extend.eligibility.reason(tb.LAYER, k, v, {"sinks": sinks}) is not None  # extend: stock


def test_sinks_of_the_wrong_shape_turn_decode_stock():
    el = LayerEligibility(num_q_heads=tb.HQ, head_dim=tb.D, backend_name="stand-in")
    k = v = torch.zeros(1)
    assert el.decode_reason(tb.LAYER, k, v, {"sinks": torch.zeros(tb.HQ)}) is None
    assert "sinks of shape (16,)" in el.decode_reason(tb.LAYER, k, v, {"sinks": torch.zeros(2 * tb.HQ)})
    assert el.decode_reason(tb.LAYER, k, v, {"sinks": torch.zeros(tb.HQ), "k_descale": k}) == \
        "extra arguments ['k_descale']"


def test_proxied_extend_runs_an_ineligible_layer_on_the_stock_wrappers(caplog):
    runner, fb, rows, q, k, v = th._setup(["A", "A", "A"], [5, 7, 3])
    be = th._backend(runner)
    capped = SimpleNamespace(**{**vars(th.LAYER), "layer_id": 1, "logit_cap": 30.0})
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    with caplog.at_level("INFO", logger="granikv"):
        out = be.forward_extend(q, k, v, capped, fb)  # the stand-in ignores the cap: same numbers
    torch.testing.assert_close(out, th._expected(runner, fb, q, k, v), atol=th.ATOL, rtol=th.RTOL)
    assert be.inner.paged.calls == 1  # the stock paged wrapper served the capped layer
    assert "extend of layer 1 goes to the stand-in backend (logit cap 30.0)" in caplog.text
    proxies = be.inner.forward_metadata.prefill_wrappers
    assert proxies != [be.inner.paged]  # the batch keeps its proxies for the other layers
    be.forward_extend(q, k, v, th.LAYER, fb)
    assert be.inner.paged.calls == 1  # layer 0: served by the dense calls


def test_decode_and_extend_ask_the_same_eligibility():
    """One ``LayerEligibility`` per backend, used by both paths; its verdict: the scan (and
    what decode recorded), else the layer object (memoised per object), else the call."""
    be = tb._backend(tb._runner(), "cascade")
    assert be.extend.eligibility is be.eligibility
    el = LayerEligibility(num_q_heads=tb.HQ, head_dim=tb.D, backend_name="stand-in")
    k = v = torch.zeros(1)
    assert el.reason(tb.LAYER, k, v, {}) is None
    capped = SimpleNamespace(**{**vars(tb.LAYER), "logit_cap": 30.0})
    assert el.reason(capped, k, v, {}) == "logit cap 30.0"
    assert el.reason(tb.LAYER, k, v, {"sinks": k}) == "extra arguments ['sinks']"
    assert el.reason(tb.LAYER, None, v, {}) == "no new K/V given"
    wide = SimpleNamespace(**{**vars(tb.LAYER), "layer_id": 3, "tp_q_head_num": 2 * tb.HQ})
    assert el.reason(wide, k, v, {}) == f"{2 * tb.HQ} query heads (kernels built for {tb.HQ})"
    el.record(4, "attention sinks")
    later = SimpleNamespace(**{**vars(tb.LAYER), "layer_id": 4})
    assert el.reason(later, k, v, {}) == "attention sinks"
