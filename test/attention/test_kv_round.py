"""The FP8 check's reference engines (attention/debug/kv_round.py): K/V rounded through an FP8
format in GraniKV's backend hold exactly the values SGLang's real FP8 pool stores and its
backends dequantize (``set_kv_buffer`` divides by the layer's scale and casts; the kernels
multiply back), and the wrapped backend receives them in decode and extend."""

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

import test_backend as tb
from test_fp8_serving import FP8, _layer
from granikv import envs
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.debug import kv_round
from granikv.config import GraniKVConfig


def _sglang_fp8_values(k, v, layer, dtype):
    """What SGLang's real FP8 pool holds for ``k`` / ``v``, dequantized as its backends do."""
    pool = MHATokenToKVPool(8, page_size=1, dtype=dtype, head_num=tb.HKV, head_dim=tb.D, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    loc = torch.arange(1, 1 + k.shape[0])
    pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), layer.k_scale, layer.v_scale)
    return (pool.get_key_buffer(0)[loc].float() * layer.k_scale_float,
            pool.get_value_buffer(0)[loc].float() * layer.v_scale_float)


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("scales", [(0.02, 0.015), (1.0, 1.0)])
def test_rounding_holds_the_values_sglangs_fp8_pool_holds(fmt, scales):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, tb.HKV, tb.D, generator=g).to(torch.bfloat16) * s * 50 for s in scales)
    layer = _layer(*scales)
    rk, rv = kv_round.from_name(f"fp8_{fmt}")(k, v, layer)
    assert rk.dtype == torch.bfloat16 and rv.dtype == torch.bfloat16
    sk, sv = _sglang_fp8_values(k, v, layer, FP8[fmt])
    # SGLang's division runs in bf16 before the cast, as here; the product back rounds to bf16
    torch.testing.assert_close(rk.float(), sk, rtol=2 ** -8, atol=0)
    torch.testing.assert_close(rv.float(), sv, rtol=2 ** -8, atol=0)
    assert not torch.equal(rk, k)  # planted: the unrounded values differ from the pool's
    with pytest.raises(AssertionError):
        torch.testing.assert_close(k.float(), sk, rtol=2 ** -8, atol=0)


def test_no_rounding_and_bad_names():
    k = torch.randn(3, tb.HKV, tb.D)
    assert kv_round.from_name("") is kv_round.NO_ROUND and kv_round.NO_ROUND(k, None, _layer())[0] is k
    with pytest.raises(ValueError, match="GRANIKV_DEBUG_KV_ROUND='fp4'"):
        kv_round.from_name("fp4")
    assert kv_round.from_name("fp8_e4m3")(None, None, _layer()) == (None, None)


class _Recording(tb.PagedStandIn):
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        self.seen = (k, v)
        return torch.zeros_like(q)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
        self.seen = (k, v)
        return torch.zeros_like(q)


def test_the_wrapped_backend_receives_the_rounded_kv(monkeypatch):
    monkeypatch.setenv(envs.DEBUG_KV_ROUND, "fp8_e4m3")
    runner = tb._runner()
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, attention_path="paged"),
                            backend_name="stand-in")
    be.inner = _Recording(runner)
    fb, rows = tb._batch(runner, hot=set())
    q, k, v = tb._qkv(fb.batch_size, 1)
    layer = _layer(1.0, 1.0)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    be.forward_decode(q, k, v, layer, fb)
    seen_k, seen_v = be.inner.seen
    assert torch.equal(seen_k, k.to(torch.float8_e4m3fn).to(k.dtype))
    assert torch.equal(seen_v, v.to(torch.float8_e4m3fn).to(v.dtype)) and not torch.equal(seen_k, k)
    monkeypatch.delenv(envs.DEBUG_KV_ROUND)
    plain = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, attention_path="paged"),
                               backend_name="stand-in")
    plain.inner = _Recording(runner)
    plain.stage_batch(rows)
    plain.init_forward_metadata(fb)
    plain.forward_decode(q, k, v, layer, fb)
    assert plain.inner.seen[0] is k


def test_with_granikv_attention_off_the_stock_backend_still_gets_the_rounded_kv(monkeypatch):
    """``--granikv-attention-path paged`` (the check's reference engines) turns GraniKV's own
    backend off: ``wrap`` then returns the stock backend under ``RoundingBackend``, or the stock
    backend itself without the variable (planted: the reference would be unrounded)."""
    runner = tb._runner()
    cfg = GraniKVConfig(enable=True, attention_path="paged")
    inner = _Recording(runner)
    assert GraniKVAttnBackend.wrap(inner, model_runner=runner, cfg=cfg, backend_name="stand-in") is inner
    monkeypatch.setenv(envs.DEBUG_KV_ROUND, "fp8_e5m2")
    be = GraniKVAttnBackend.wrap(inner, model_runner=runner, cfg=cfg, backend_name="stand-in")
    assert isinstance(be, kv_round.RoundingBackend)
    fb, _ = tb._batch(runner, hot=set())
    q, k, v = tb._qkv(fb.batch_size, 1)
    for call in (be.forward_decode, be.forward_extend):
        call(q, k, v, _layer(1.0, 1.0), fb)
        assert torch.equal(inner.seen[0], k.to(torch.float8_e5m2).to(k.dtype))
        assert torch.equal(inner.seen[1], v.to(torch.float8_e5m2).to(v.dtype))
    assert be.get_cuda_graph_seq_len_fill_value() == inner.get_cuda_graph_seq_len_fill_value()
