"""Cascade decode over an FP8 KV cache (fp8 e4m3 / e5m2, SGLang's ``--kv-cache-dtype
fp8_e4m3`` / ``fp8_e5m2``): the kernels read the stored bytes, widen them in registers (to fp16
under a bf16 query: ``fp8_math``; to the query's dtype otherwise) and apply the layer's K / V
scales as SGLang's backends do (scores times ``k_scale``, outputs times ``v_scale``).

Every path against the float64 reference over the same bytes dequantized (``dequantize_ref``),
per request, at odd shapes (GQA 1 / 3 / 8, head_dim 64 and 128, lengths off every tile);
planted faults: a K scale 10% off, the V scale left out, and the cache read as if it held the
unscaled values: each fails the same check.
"""

import dataclasses

import pytest
import torch
import triton
from conftest import SMALL_CONFIG, fill, make_batch

from support.per_request import assert_per_request
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels import prefix_attention
from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
from granikv.kernels.prefix_attention import math_f16
from granikv.kernels.reference import decode_attention_ref, dequantize_ref

PATHS = {"cascade": cascade_attention, "fused": fused_cascade_attention, "bgemm": bgemm_cascade_attention}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SHAPES = [(8, 8, 64), (12, 4, 64), (16, 2, 128)]  # (Hq, Hkv, D): GQA 1, 3, 8


def _quantized(hq, hkv, d, fmt, seed):
    """A batch whose K/V live in an FP8 cache the way SGLang writes one (``set_kv_buffer``:
    divided by the layer's scale, then cast)."""
    b = make_batch(groups=((37, 2), (29, 5)), n_ungrouped=2, suffix=23, ungrouped_len=41, num_q_heads=hq,
                   num_kv_heads=hkv, head_dim=d, seed=seed)
    b.q = b.q * 2  # peakier scores, so that a wrong K scale shows
    fmax = torch.finfo(FP8[fmt]).max
    b.k_scale = float(b.k.float().abs().max()) / (0.5 * fmax)
    b.v_scale = float(b.v.float().abs().max()) / (0.5 * fmax)
    b.k8 = (b.k.float() / b.k_scale).to(FP8[fmt])
    b.v8 = (b.v.float() / b.v_scale).to(FP8[fmt])
    return b


def _ref(b, k_scale=None, v_scale=None):
    ks = b.k_scale if k_scale is None else k_scale
    vs = b.v_scale if v_scale is None else v_scale
    return decode_attention_ref(b.q, dequantize_ref(b.k8, ks), dequantize_ref(b.v8, vs), b.req_to_token,
                                b.req_pool_indices, b.seq_lens, b.sm_scale).o


def _run(path, b, config=SMALL_CONFIG, **scales):
    ws = CascadeWorkspace(b.bs + 1, b.q.shape[1], b.k.shape[1], b.q.shape[2], "cpu", config=config,
                          sm_count=32, max_splits=4)
    fill(ws, b, single_prefix_chunk=path == "bgemm")
    out = torch.full_like(b.q, float("nan"))
    kw = dict(k_scale=b.k_scale, v_scale=b.v_scale)
    kw.update(scales)
    return PATHS[path](b.q, b.k8, b.v8, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out, **kw)


def _assert_per_request(out, ref):
    assert_per_request(out, ref, atol_floor=1.0)  # FP8-scaled outputs: atol relative to each request's scale


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("hq, hkv, d", SHAPES)
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_over_an_fp8_cache_matches_the_dequantized_reference(path, hq, hkv, d, fmt):
    b = _quantized(hq, hkv, d, fmt, seed=hq + d)
    _assert_per_request(_run(path, b), _ref(b))


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("hq, hkv, d", SHAPES)
def test_descriptor_prefix_loads_over_an_fp8_cache_match_the_dequantized_reference(hq, hkv, d, fmt):
    """``prefix_kernel="descriptor"`` reads FP8 tiles through tensor descriptors (one byte per
    element) and widens them in registers as the pointer kernel does; "auto" keeps pointer loads
    on an FP8 cache (``descriptor_fits``) until a GPU sweep (``bench_attention.py --kv-dtype``)
    says which is faster there."""
    b = _quantized(hq, hkv, d, fmt, seed=hq + d + 1)
    cfg = dataclasses.replace(SMALL_CONFIG, prefix_kernel="descriptor")
    _assert_per_request(_run("cascade", b, cfg), _ref(b))
    with pytest.raises(AssertionError, match="^request "):  # planted: the K scale 10% off
        _assert_per_request(_run("cascade", b, cfg, k_scale=b.k_scale * 1.1), _ref(b))


@pytest.mark.parametrize("fault", ["k_scale_off", "no_v_scale", "unscaled"])
@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_planted_scale_faults_fail_the_check(path, fault):
    b = _quantized(12, 4, 64, "e4m3", seed=3)
    scales = {"k_scale_off": dict(k_scale=b.k_scale * 1.1), "no_v_scale": dict(v_scale=1.0),
              "unscaled": dict(k_scale=1.0, v_scale=1.0)}[fault]
    with pytest.raises(AssertionError, match="^request "):
        _assert_per_request(_run(path, b, **scales), _ref(b))


def test_the_fp8_bytes_are_what_the_kernels_read():
    """The reference over the bytes differs from the one over the unquantized K/V by more than
    the check's tolerance (e5m2 keeps 2 mantissa bits): the check above sees the quantization,
    so it compares against the cache's own numbers, not the model's."""
    b = _quantized(8, 2, 64, "e5m2", seed=11)
    exact = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    with pytest.raises(AssertionError):
        _assert_per_request(_run("cascade", b), exact)


def _bf16_query(b):
    b.q = b.q.to(torch.bfloat16)
    return b


@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("hq, hkv, d", [SHAPES[0], SHAPES[2]])
@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_a_bf16_query_over_an_fp8_cache_runs_fp16_math_within_the_reference(path, hq, hkv, d, fmt):
    """A bf16 query (the serving dtype) over an FP8 cache takes fp16 math (``math_f16``): the
    FP8 tiles widen to fp16, the query is scaled by ``Q16_SCALE`` and rounded to fp16, the score
    scale carries the inverse. Per request within the FP8 check's tolerance of the float64
    reference over the same bytes (the output itself is bf16)."""
    b = _bf16_query(_quantized(hq, hkv, d, fmt, seed=hq + d + 2))
    assert math_f16(b.q, b.k8, SMALL_CONFIG.fp8_math)
    _assert_per_request(_run(path, b).float(), _ref(b))
    with pytest.raises(AssertionError, match="^request "):  # planted: the K scale 10% off
        _assert_per_request(_run(path, b, k_scale=b.k_scale * 1.1).float(), _ref(b))


def _query_beyond_fp16(seed):
    """A bf16 query with one component at 1e5 (past fp16's 65504), whose keys in that component
    are small enough that it moves the scores by about one unit: rounding that component to
    fp16 unscaled (clamped or inf) changes the output."""
    b = _bf16_query(_quantized(12, 4, 64, "e4m3", seed=seed))
    g = torch.Generator().manual_seed(seed)
    q0 = 1e5
    k0 = torch.randn(b.k8.shape[0], b.k8.shape[1], generator=g) / (q0 * b.sm_scale)  # score units ~ 1
    b.k8[:, :, 0] = (k0 / b.k_scale).to(b.k8.dtype)
    b.q[:, :, 0] = q0 * torch.sign(torch.randn(b.q.shape[0], b.q.shape[1], generator=g))
    return b


def test_a_query_past_fp16s_range_keeps_its_value_under_fp16_math(monkeypatch):
    """``Q16_SCALE`` keeps a bf16 query of up to ~1e6 exact in fp16; with the scale planted at 1
    (the query rounded to fp16 as it is) the component at 1e5 is clamped to 65504 and the same
    check fails."""
    b = _query_beyond_fp16(seed=5)
    _assert_per_request(_run("cascade", b).float(), _ref(b))
    monkeypatch.setattr(prefix_attention, "Q16_SCALE", triton.language.constexpr(1.0))
    with pytest.raises(AssertionError, match="^request "):
        _assert_per_request(_run("cascade", b).float(), _ref(b))


def test_fp8_math_query_keeps_the_bf16_widening():
    """``fp8_math="query"`` widens FP8 tiles to bf16 (no fp16 math); an fp16 or fp32 query and a
    bf16 cache never take fp16 math."""
    b = _bf16_query(_quantized(8, 8, 64, "e4m3", seed=1))
    assert not math_f16(b.q, b.k8, "query")
    assert not math_f16(b.q.half(), b.k8, "fp16") and not math_f16(b.q.float(), b.k8, "fp16")
    assert not math_f16(b.q, b.k.to(torch.bfloat16), "fp16")
    with pytest.raises(ValueError, match="fp8_math"):
        dataclasses.replace(SMALL_CONFIG, fp8_math="bf16")
