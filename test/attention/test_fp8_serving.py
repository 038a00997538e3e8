"""GraniKV over SGLang's FP8 KV cache on CPU: SGLang's real ``MHATokenToKVPool`` with
``dtype=torch.float8_e4m3fn`` / ``float8_e5m2`` (uint8 storage, an fp8 view from
``get_key_buffer``), the real ``RadixAttention`` scale fields, the backend's decode planner
and the Triton kernels under the interpreter.

What is pinned: an FP8 model runner is eligible (fp4 stays off, the reason names the dtype);
a layer's scales are read as SGLang's backends read them (``kv_scales``: ``k_scale_float`` /
``v_scale_float``, 1.0 where unset); a cascade decode step over the FP8 cache matches the
float64 reference over the same bytes dequantized, per request, and misses it with the scales
left out (the planted fault); HOT extents copy the FP8 bytes exactly; the HOT prefill path
stays stock on FP8 with its reason.
"""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

import test_backend as tb
from support.per_request import assert_per_request
from granikv.attention import eligibility
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.extend.paths import fp8_reason
from granikv.attention.kv_scales import kv_scales, scale_reason
from granikv.config import GraniKVConfig
from granikv.kernels.reference import decode_attention_ref
from granikv.mem_cache.kv_copy import copy_kv_slots

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
K_SCALE, V_SCALE = 0.02, 0.015


def _fp8_runner(dtype):
    """test_backend's runner with an FP8 pool whose K/V are N(0, 1) values stored the way
    SGLang stores them (divided by the scale, cast, kept as uint8)."""
    r = tb._runner()
    r.kv_cache_dtype = dtype
    r.token_to_kv_pool = MHATokenToKVPool(tb.SLOTS, page_size=1, dtype=dtype, head_num=tb.HKV, head_dim=tb.D,
                                          layer_num=1, device="cpu", enable_memory_saver=False)
    g = torch.Generator().manual_seed(0)
    for buf, scale in ((r.token_to_kv_pool.k_buffer[0], K_SCALE), (r.token_to_kv_pool.v_buffer[0], V_SCALE)):
        buf.copy_((torch.randn(buf.shape, generator=g) / scale).to(dtype).view(torch.uint8))
    return r


def _layer(k_scale=K_SCALE, v_scale=V_SCALE):
    layer = RadixAttention(tb.HQ, tb.D, tb.D ** -0.5, tb.HKV, layer_id=0)
    layer.k_scale_float, layer.v_scale_float = k_scale, v_scale
    layer.k_scale = torch.tensor(k_scale) if k_scale is not None else None
    layer.v_scale = torch.tensor(v_scale) if v_scale is not None else None
    return layer


def test_fp8_runners_are_eligible_and_fp4_stays_off():
    cfg = GraniKVConfig(enable=True)
    for dtype in FP8.values():
        assert eligibility.unsupported_reason(_fp8_runner(dtype), cfg) is None
    r = tb._runner()
    r.kv_cache_dtype = torch.float4_e2m1fn_x2
    reason = eligibility.unsupported_reason(r, cfg)
    assert "float4_e2m1fn_x2" in reason and "fp8_e4m3" in reason


def test_scales_are_read_as_sglangs_backends_read_them():
    assert kv_scales(RadixAttention(tb.HQ, tb.D, 1.0, tb.HKV, layer_id=0)) == (1.0, 1.0)  # SGLang's defaults
    assert kv_scales(_layer()) == (K_SCALE, V_SCALE)
    assert eligibility.layer_reason(_layer()) is None and scale_reason(_layer()) is None
    only_tensor = _layer()
    only_tensor.k_scale_float = None  # a scale GraniKV could only read with a device sync
    assert "k_scale without k_scale_float" in eligibility.layer_reason(only_tensor)


def _decode(dtype, layer):
    runner = _fp8_runner(dtype)
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, attention_path="cascade"),
                            backend_name="stand-in")
    be.inner = _FP8StandIn(runner)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    q, k, v = tb._qkv(fb.batch_size, 1)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, layer, fb)
    assert be.stats.paths["cascade"] == 1
    pool = runner.token_to_kv_pool
    ref = decode_attention_ref(q.view(-1, tb.HQ, tb.D), pool.get_key_buffer(0), pool.get_value_buffer(0),
                               runner.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               layer.scaling, k_scale=K_SCALE, v_scale=V_SCALE).o
    return o.view(-1, tb.HQ, tb.D), ref


class _FP8StandIn(tb.PagedStandIn):
    """The stand-in writing the new token's K/V through SGLang's pool (quantized with the
    layer's scales, as SGLang's backends do); its own output is overwritten on cascade steps."""

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        if save_kv_cache:
            self.runner.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k.view(-1, tb.HKV, tb.D),
                                                       v.view(-1, tb.HKV, tb.D), layer.k_scale, layer.v_scale)
        return torch.zeros_like(q)


def _assert_per_request(out, ref):
    assert_per_request(out, ref, atol_floor=1.0)  # FP8-scaled outputs: atol relative to each request's scale


@pytest.mark.parametrize("fmt", list(FP8))
def test_a_cascade_step_over_the_fp8_cache_matches_the_dequantized_reference(fmt):
    out, ref = _decode(FP8[fmt], _layer())
    _assert_per_request(out, ref)


def test_planted_fault_scales_left_out_fail_the_check():
    layer = _layer()
    out, ref = _decode(FP8["e4m3"], layer)
    _assert_per_request(out, ref)
    bad = _layer()  # the same cache (the pool quantizes with the scale tensors), scales not read:
    bad.k_scale_float = bad.v_scale_float = None  # the kernels take the stored numbers as the values
    out_bad, _ = _decode(FP8["e4m3"], bad)
    with pytest.raises(AssertionError, match="^request "):
        _assert_per_request(out_bad, ref)


def test_hot_extents_copy_the_fp8_bytes_exactly():
    pool = _fp8_runner(FP8["e4m3"]).token_to_kv_pool
    src = torch.tensor([7, 3, 12, 4, 40])
    before = [b.clone() for b in (pool.k_buffer[0], pool.v_buffer[0])]
    copy_kv_slots(pool, src, 200)
    for buf, old in zip((pool.k_buffer[0], pool.v_buffer[0]), before, strict=True):
        assert buf.dtype == torch.uint8 and torch.equal(buf[200:205], old[src])


def test_flashinfers_prefix_part_proxy_stays_stock_on_fp8_with_its_reason():
    assert "not verified on FP8 KV" in fp8_reason(SimpleNamespace(kv_cache_dtype=FP8["e5m2"]))
    assert fp8_reason(SimpleNamespace(kv_cache_dtype=torch.bfloat16)) is None


def _fp8_extend_setup(kinds, new, dtype, seed=0):
    """test_hot_extend's batch over an FP8 pool: the same cached K/V stored as SGLang stores
    them (divided by the layer's scale, cast to FP8, uint8 storage)."""
    from test_hot_extend import D, HKV, SLOTS, _setup

    runner, fb, rows, q, k, v = _setup(kinds, new, seed=seed)
    half = runner.token_to_kv_pool
    pool = MHATokenToKVPool(SLOTS, page_size=1, dtype=dtype, head_num=HKV, head_dim=D, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    for src, dst, scale in ((half.k_buffer[0], pool.k_buffer[0], K_SCALE), (half.v_buffer[0], pool.v_buffer[0], V_SCALE)):
        dst.copy_((src.float() / scale).to(dtype).view(torch.uint8))
    runner.token_to_kv_pool, runner.kv_cache_dtype = pool, dtype
    return runner, fb, rows, q, k, v


def _fp8_expected(runner, fb, q):
    """Float64 causal attention of each new token over its row of the FP8 cache as it stands
    (after the extend's write), every slot dequantized: stored value x the layer's scale."""
    from granikv.kernels.reference import attend_ref
    from test_hot_extend import D, HQ, SCALE

    pool = runner.token_to_kv_pool
    kb = pool.get_key_buffer(0).double() * K_SCALE
    vb = pool.get_value_buffer(0).double() * V_SCALE
    rt = runner.req_to_token_pool.req_to_token
    q3, outs, t = q.view(-1, HQ, D), [], 0
    for row, p, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = rt[row, : p + n].long()
        for j in range(n):
            outs.append(attend_ref(q3[t + j], kb[slots[: p + j + 1]], vb[slots[: p + j + 1]], SCALE).o)
        t += n
    return torch.stack(outs).view(-1, HQ * D)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_whole_extend_over_an_fp8_cache_attends_to_what_the_cache_holds(fmt):
    """Under triton (the whole extend), prefill over HOT prefixes serves an FP8 cache: it writes
    the new K/V as the stock backend does (divided by the scales, cast), and every part (causal
    over the new tokens, the HOT extents, the COLD remainder) attends to the cache's values
    dequantized with the layer's scales, as GraniKV's decode does: equal to the float64
    reference over the same bytes. Planted: the scales left out miss it by far."""
    from extend_standin import TritonExtendStandIn
    from test_hot_extend import D, HKV, HQ, SCALE

    runner, fb, rows, q, k, v = _fp8_extend_setup(["A", "cold", "A+", "none", "B"], [3, 4, 5, 2, 3], FP8[fmt])
    layer = SimpleNamespace(layer_id=0, scaling=SCALE, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                            k_scale=torch.tensor(K_SCALE), v_scale=torch.tensor(V_SCALE), k_scale_float=K_SCALE,
                            v_scale_float=V_SCALE, sliding_window_size=-1, logit_cap=0.0, is_cross_attention=False)
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, extend_path="hot"),
                            backend_name="triton")
    be.inner = TritonExtendStandIn(runner)
    assert be.extend.off_reason is None
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    k0, v0 = k.clone(), v.clone()
    out = be.forward_extend(q, k, v, layer, fb)
    assert be.inner.calls == 0 and be.stats_snapshot()["extend_hot_batches"] == 1
    assert torch.equal(k, k0) and torch.equal(v, v0)  # the caller's K/V are not divided in place
    stock = _fp8_extend_setup(["A", "cold", "A+", "none", "B"], [3, 4, 5, 2, 3], FP8[fmt])[0].token_to_kv_pool
    stock.set_kv_buffer(layer, fb.out_cache_loc, k0.view(-1, HKV, D).clone(), v0.view(-1, HKV, D).clone(),
                        layer.k_scale, layer.v_scale)  # what SGLang's pool writes for the stock backend
    for ours, theirs in ((runner.token_to_kv_pool.k_buffer[0], stock.k_buffer[0]),
                         (runner.token_to_kv_pool.v_buffer[0], stock.v_buffer[0])):
        assert torch.equal(ours, theirs)  # every byte of the cache, the new tokens' slots included
    expected = _fp8_expected(runner, fb, q)
    per_request = (out.double() - expected).abs().max() / expected.abs().max()
    assert per_request < 1e-2, per_request
    unscaled = SimpleNamespace(**{**vars(layer), "k_scale_float": None, "v_scale_float": None})
    wrong = be.extend.full_extend.forward(q, k, v, unscaled, fb, runner.token_to_kv_pool, False)
    assert (wrong.double() - expected).abs().max() / expected.abs().max() > 0.5


@pytest.mark.parametrize("kinds, new", [
    (["cold", "none", "cold"], [4, 4, 4]),  # cached prefixes, none of them HOT: the COLD remainder only
    (["none", "none"], [3, 5]),  # no cached prefix at all (a prompt's first prefill): the causal part only
])
def test_every_extend_batch_over_an_fp8_cache_attends_to_what_the_cache_holds(kinds, new):
    """Over an FP8 cache under triton GraniKV computes also the extend batches it cannot share
    (no HOT run, or no cached prefix), so that every prompt's prefill reads the same FP8 values
    as its decode: equal to the float64 reference over the cache's bytes, counted as 'exact'.
    Over a bf16 cache the same batches stay on the wrapped backend
    (test_full_extend.test_batches_without_hot_runs_or_cached_prefix_stay_on_the_wrapped_backend).
    Planted: the wrapped (stock) extend, which attends to the new tokens' unrounded K/V."""
    from extend_standin import TritonExtendStandIn
    from test_hot_extend import D, HKV, HQ, SCALE

    runner, fb, rows, q, k, v = _fp8_extend_setup(kinds, new, FP8["e4m3"])
    layer = SimpleNamespace(layer_id=0, scaling=SCALE, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                            k_scale=torch.tensor(K_SCALE), v_scale=torch.tensor(V_SCALE), k_scale_float=K_SCALE,
                            v_scale_float=V_SCALE, sliding_window_size=-1, logit_cap=0.0, is_cross_attention=False)
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, extend_path="auto",
                                                                         debug_integrity=True),
                            backend_name="triton")
    be.inner = TritonExtendStandIn(runner)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    out = be.forward_extend(q, k, v, layer, fb)
    snap = be.stats_snapshot()
    assert be.inner.calls == 0
    assert snap["extend_exact_batches"] == snap["extend_batches"] == 1 and snap["extend_hot_batches"] == 0
    assert snap["extend_fallbacks"] == {}
    be.extend.full_extend.check_integrity()
    expected = _fp8_expected(runner, fb, q)
    scale = expected.abs().max()
    assert (out.double() - expected).abs().max() / scale < 1e-2
    # planted: what SGLang's triton extend attends to, the new tokens' K/V as given (unrounded)
    from granikv.kernels.reference import attend_ref

    pool, rt = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    kb, vb = pool.get_key_buffer(0).double() * K_SCALE, pool.get_value_buffer(0).double() * V_SCALE
    k3, v3, q3, outs, t = k.view(-1, HKV, D).double(), v.view(-1, HKV, D).double(), q.view(-1, HQ, D), [], 0
    for row, p, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = rt[row, :p].long()
        for j in range(n):
            kk, vv = torch.cat([kb[slots], k3[t: t + j + 1]]), torch.cat([vb[slots], v3[t: t + j + 1]])
            outs.append(attend_ref(q3[t + j], kk, vv, SCALE).o)
        t += n
    unrounded = torch.stack(outs).view(-1, HQ * D)
    assert (unrounded - expected).abs().max() / scale > 2e-2
