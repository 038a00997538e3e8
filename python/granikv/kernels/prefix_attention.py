"""Grouped shared-prefix attention: every group's stacked decode queries against its HOT extent.

For one kv head h, a prefix work item stacks q-heads of h of one group's requests (flat rows
[row_lo, row_hi) of the group, flat row f = member f // ratio, q-head h * ratio + f % ratio; at
most block_m rows, every tile full but a group's last: work_list.py) and streams the group's contiguous K/V chunk
``[slot_lo, slot_lo + n_kv)`` once through tensor-core tiles with an online softmax, writing one
partial state (o, lse) per row into the workspace's partial table (see work_list.py):

            kv chunk 0          kv chunk 1          ...      (items of one group, tile fastest)
    tile 0  item(0,0) -> split 0  item(1,0) -> split 1
    tile 1  item(0,1) -> split 0  item(1,1) -> split 1
"""

import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from granikv.kernels.kernel_config import FP8_KV_DTYPES, PREFIX_SOFTMAX_MODES, KernelConfig, PrefixKernel
from granikv.kernels.merge_state import MergeTarget, _arrive_and_merge, arrival_args
from granikv.kernels.plan import CascadePlan

logger = logging.getLogger("granikv")

__all__ = ["prefix_attention", "descriptor_fits", "kv_descriptor", "math_f16", "launch_limits"]

LOG2E = 1.4426950408889634


Q16_SCALE = tl.constexpr(0.0625)
"""What ``_math_query`` multiplies a bf16 query by before rounding it to fp16 (a power of two:
exact). It moves fp16's range [6.1e-5, 65504] to [9.8e-4, 1.05e6] in query units, so that a
bf16 query keeps every one of its 8 significant bits there (fp16 has 11); the score scale
carries the inverse (``qk_scale``)."""


@triton.jit
def _math_query(q, MATH_F16: tl.constexpr):
    """The query as the dots take it. With MATH_F16 (``math_f16``: a bf16 query over an FP8
    cache) it is multiplied by ``Q16_SCALE``, clamped to fp16's range and rounded to fp16, so
    that the FP8 K/V tiles widen to fp16 (one ``cvt`` per two values on sm89+; to bf16 it takes
    three) and the dots run in fp16 with fp32 accumulation."""
    if MATH_F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32) * Q16_SCALE, -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One online-softmax step over a [N, D] key/value tile (base-2 exponentials); with MASKED,
    scores where ``keep`` (broadcast to [rows, N]) is False are dropped. An FP8 tile (an FP8 KV
    cache) is widened to the query's dtype here, in registers (exact: every fp8 e4m3 / e5m2
    value is a bf16 / fp16 value; fp16 for a bf16 query under ``_math_query``); its scales are
    the caller's (``kv_scales``)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


PREFIX_SOFTMAX = {mode: code for code, mode in enumerate(PREFIX_SOFTMAX_MODES)}
"""``KernelConfig.prefix_softmax`` -> the prefix kernels' ``SOFTMAX`` (``_prefix_softmax_step``)."""

LAZY_RESCALE_LOG2 = tl.constexpr(8.0)
"""``prefix_softmax="lazy"``: a row's running max moves only when a tile's max exceeds it by
more than this (base 2), so probabilities stay below 2**8 and the rescale of the accumulator
is skipped on every tile where no row's max moved that far."""


@triton.jit
def _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, SOFTMAX: tl.constexpr):
    """The prefix kernels' online-softmax step. SOFTMAX 0 is ``_softmax_step`` (scores scaled,
    then shifted); 1 takes the row max of the unscaled scores (``qk_scale`` > 0, so it scales
    exactly) and shifts each score in one fused multiply-add; 2 is 1 with a lazy running max
    (``LAZY_RESCALE_LOG2``): the accumulator and the sum are rescaled only on tiles where some
    row's max moved, a branch taken by the whole program. All three give the same (o, lse) up to
    fp32 rounding: o = acc / l and lse = m + log2(l) hold for any m the terms were shifted by."""
    if SOFTMAX == 0:
        return _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, keep, MASKED, INPUT_PRECISION)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_tile = tl.max(s, 1) * qk_scale
    if SOFTMAX == 1:
        m_new = tl.maximum(m_i, m_tile)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc
    grow = m_tile > m_i + LAZY_RESCALE_LOG2
    m_new = tl.where(grow, m_tile, m_i)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    if tl.max(grow.to(tl.int32), 0) > 0:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
    acc = acc + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_partial(PartO, PartLse, rows_part, qh, row_ok, m_i, l_i, acc, stride_pr, stride_ph, stride_lr,
                   HEAD_DIM: tl.constexpr):
    """Normalise and write rows' (o, natural-log lse) to partial rows ``rows_part`` (int64)."""
    d = tl.arange(0, HEAD_DIM)
    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(PartO + rows_part[:, None] * stride_pr + qh[:, None] * stride_ph + d[None, :], o, mask=row_ok[:, None])
    tl.store(PartLse + rows_part * stride_lr + qh, lse, mask=row_ok)


@triton.jit
def _prefix_item(w, h, Q, K, V, PartO, PartLse, PfxItems, GroupReqIdx, PartIndptr,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                 stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                 RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, EVEN_SPLIT: tl.constexpr, MATH_F16: tl.constexpr,
                 SOFTMAX: tl.constexpr):
    """Attention of prefix item ``w`` for kv head ``h``; returns per-row (batch pos, q-head, valid)."""
    row_lo = tl.load(PfxItems + w)
    row_hi = tl.load(PfxItems + pfx_cap + w)
    slot_lo = tl.load(PfxItems + 2 * pfx_cap + w).to(tl.int64)
    n_kv = tl.load(PfxItems + 3 * pfx_cap + w)
    split = tl.load(PfxItems + 4 * pfx_cap + w)

    rows = row_lo + tl.arange(0, BLOCK_M)
    member = rows // RATIO
    qh = h * RATIO + rows % RATIO
    row_ok = rows < row_hi
    b = tl.load(GroupReqIdx + member, mask=row_ok, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = _math_query(q, MATH_F16)

    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = K + (slot_lo + offs_n)[:, None] * stride_kb + h * stride_kh + d[None, :]
    v_ptrs = V + (slot_lo + offs_n)[:, None] * stride_vb + h * stride_vh + d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if EVEN_SPLIT:  # unmasked full tiles, then one masked tail
        n_full = n_kv // BLOCK_N
        for _ in range(0, n_full):
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            m_i, l_i, acc = _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, 0, False, INPUT_PRECISION,
                                                   SOFTMAX)
            k_ptrs += BLOCK_N * stride_kb
            v_ptrs += BLOCK_N * stride_vb
        n_left = n_kv - n_full * BLOCK_N
        if n_left > 0:
            kv_ok = offs_n[:, None] < n_left
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
            m_i, l_i, acc = _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, (offs_n < n_left)[None, :], True,
                                                 INPUT_PRECISION, SOFTMAX)
    else:  # every tile masked (one code path, fewer registers)
        for start in range(0, n_kv, BLOCK_N):
            kv_ok = offs_n[:, None] < n_kv - start
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
            v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
            m_i, l_i, acc = _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, (offs_n < n_kv - start)[None, :],
                                                 True, INPUT_PRECISION, SOFTMAX)
            k_ptrs += BLOCK_N * stride_kb
            v_ptrs += BLOCK_N * stride_vb

    rows_part = tl.load(PartIndptr + b, mask=row_ok, other=0).to(tl.int64) + split
    _store_partial(PartO, PartLse, rows_part, qh, row_ok, m_i, l_i, acc, stride_pr, stride_ph, stride_lr, HEAD_DIM)
    return b, qh, row_ok


@triton.jit
def _prefix_kernel(Q, K, V, PartO, PartLse, Counts, PfxItems, GroupReqIdx, PartIndptr,
                   Out, Counter, Sinks, v_scale, num_q_heads, stride_ob, stride_oh,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                   stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                   RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, EVEN_SPLIT: tl.constexpr, MATH_F16: tl.constexpr,
                   SOFTMAX: tl.constexpr, ARRIVE: tl.constexpr, HAS_SINKS: tl.constexpr):
    h = tl.program_id(1)
    n_items = tl.load(Counts + 1)  # the live count, from device memory (the grid is fixed)
    w = tl.program_id(0)  # one program per item of the capacity; those past the live count exit
    if w < n_items:
        b, qh, row_ok = _prefix_item(w, h, Q, K, V, PartO, PartLse, PfxItems, GroupReqIdx, PartIndptr,
                                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                                     stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                                     RATIO, HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION, EVEN_SPLIT, MATH_F16,
                                     SOFTMAX)
        if ARRIVE:  # merge_state.MergeTarget: the rows this program completes are merged here
            _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                              stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS)


@triton.jit
def _prefix_desc_kernel(Q, K, V, k_desc, v_desc, PartO, PartLse, Counts, PfxItems, GroupReqIdx, PartIndptr,
                        Out, Counter, Sinks, v_scale, num_q_heads, stride_ob, stride_oh,
                        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                        stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                        RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                        MATH_F16: tl.constexpr, SOFTMAX: tl.constexpr, ARRIVE: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
    """``_prefix_kernel`` with the full K/V tiles loaded through tensor descriptors over the
    layer's buffers viewed ``[slots, Hkv * D]`` (TMA on sm90+): tile j of item w is the block
    at ``(slot_lo + j * BLOCK_N, h * D)``. The masked tail (< BLOCK_N keys) is a pointer load,
    so no key outside the extent is ever read into a score."""
    h = tl.program_id(1)
    w = tl.program_id(0)
    if w < tl.load(Counts + 1):
        row_lo = tl.load(PfxItems + w)
        row_hi = tl.load(PfxItems + pfx_cap + w)
        slot_lo = tl.load(PfxItems + 2 * pfx_cap + w)
        n_kv = tl.load(PfxItems + 3 * pfx_cap + w)
        split = tl.load(PfxItems + 4 * pfx_cap + w)
        rows = row_lo + tl.arange(0, BLOCK_M)
        qh = h * RATIO + rows % RATIO
        row_ok = rows < row_hi
        b = tl.load(GroupReqIdx + rows // RATIO, mask=row_ok, other=0).to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        q = _math_query(q, MATH_F16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        col = h * HEAD_DIM
        n_full = n_kv // BLOCK_N
        for j in tl.range(0, n_full, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
            k = k_desc.load([slot_lo + j * BLOCK_N, col])
            v = v_desc.load([slot_lo + j * BLOCK_N, col])
            m_i, l_i, acc = _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, 0, False, INPUT_PRECISION,
                                                   SOFTMAX)
        n_left = n_kv - n_full * BLOCK_N
        if n_left > 0:
            offs_n = tl.arange(0, BLOCK_N)
            tail = (slot_lo + n_full * BLOCK_N).to(tl.int64) + offs_n
            kv_ok = offs_n[:, None] < n_left
            k = tl.load(K + tail[:, None] * stride_kb + h * stride_kh + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(V + tail[:, None] * stride_vb + h * stride_vh + d[None, :], mask=kv_ok, other=0.0)
            m_i, l_i, acc = _prefix_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, (offs_n < n_left)[None, :], True,
                                                 INPUT_PRECISION, SOFTMAX)
        rows_part = tl.load(PartIndptr + b, mask=row_ok, other=0).to(tl.int64) + split
        _store_partial(PartO, PartLse, rows_part, qh, row_ok, m_i, l_i, acc, stride_pr, stride_ph, stride_lr,
                       HEAD_DIM)
        if ARRIVE:  # merge_state.MergeTarget: the rows this program completes are merged here
            _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                              stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS)


_DESCRIBED = (torch.float16, torch.bfloat16, torch.float32)
_DESCRIPTORS: Dict[Tuple[Any, ...], Any] = {}
_MAX_DESCRIPTORS = 512  # K and V of every layer of a few models; cleared past it


def descriptor_fits(buf: torch.Tensor) -> bool:
    """"auto" takes the descriptor kernel over ``buf``: a contiguous ``[slots, Hkv, D]`` fp16 /
    bf16 / fp32 buffer. An FP8 cache keeps pointer loads under "auto" (no GPU measurement of
    descriptor loads of FP8 tiles yet); ``prefix_kernel="descriptor"`` reads it too (CPU-tested
    against the dequantized reference; ``bench_attention.py --kv-dtype fp8_e4m3`` times it)."""
    slots, hkv, d = buf.shape
    return buf.stride() == (hkv * d, d, 1) and buf.dtype in _DESCRIBED


def auto_prefix_kernel(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                       cfg: KernelConfig) -> PrefixKernel:
    """What ``prefix_kernel="auto"`` launches: "wgmma" where that kernel can run the launch (sm90,
    fp16 / bf16 throughout, head_dim 64 / 128, contiguous buffers: the fastest prefix launch
    measured on every sweep case, docs/results/kernels.md), else "descriptor" where
    ``descriptor_fits`` both buffers, else "pointer" (e.g. an FP8 cache)."""
    if not (descriptor_fits(k_buffer) and descriptor_fits(v_buffer)):
        return "pointer"
    serves = _wgmma_serves(q.device, q.dtype, k_buffer.dtype, v_buffer.dtype, k_buffer.shape[2], cfg.block_m,
                           cfg.prefix_stages, cfg.prefix_warp_specialize)
    return "wgmma" if serves else "descriptor"


def _wgmma_failed(error: Exception) -> None:
    """The wgmma kernel failed to build or launch under "auto" (a Triton whose Gluon differs from
    the one it is written for): logged once, and "auto" takes the descriptor kernel from then on."""
    if _WGMMA_FAILED:
        return
    _WGMMA_FAILED.append(f"{type(error).__name__}: {error}")
    _wgmma_serves.cache_clear()
    logger.warning("GraniKV: the wgmma prefix kernel could not run with Triton %s (%s: %s); the cascade's "
                   "prefix part uses the descriptor kernel instead (--granikv-prefix-kernel descriptor "
                   "silences this)", triton.__version__, type(error).__name__, str(error)[:300])


_WGMMA_FAILED: List[str] = []  # the error that turned "auto" away from the wgmma kernel, once it happened


@functools.lru_cache(maxsize=64)
def _wgmma_serves(device: torch.device, q_dtype: torch.dtype, k_dtype: torch.dtype, v_dtype: torch.dtype,
                  head_dim: int, block_m: int, stages: int, warp_specialize: bool) -> bool:
    """The wgmma kernel's launch checks (``prefix_wgmma_attention``) for contiguous buffers, once
    per device, dtypes and tile (a decode step launches the prefix once per layer)."""
    from granikv.kernels.prefix_wgmma import wgmma_unfit_for

    if _WGMMA_FAILED or k_dtype != v_dtype or stages < 2 or (warp_specialize and block_m != 128):
        return False
    return not wgmma_unfit_for(device, q_dtype, k_dtype, head_dim, block_m)


def kv_descriptor(buf: torch.Tensor, block_n: int, make: Callable[[torch.Tensor, List[int]], Any],
                  kind: str = "descriptor") -> Any:
    """Host-side tensor descriptor over one layer's K or V buffer as ``[slots, Hkv * D]``, tile
    ``[block_n, D]``, made by ``make(flat, block)`` once per buffer, tile and maker (a decode step
    launches one per layer); ValueError naming ``prefix_kernel=kind`` unless the buffer is a
    contiguous ``[slots, Hkv, D]``."""
    if buf.stride() != (buf.shape[1] * buf.shape[2], buf.shape[2], 1):
        raise ValueError(f"prefix_kernel={kind!r} needs a contiguous [slots, Hkv, D] KV buffer, got strides "
                         f"{buf.stride()} for shape {tuple(buf.shape)}")
    key = (buf.data_ptr(), tuple(buf.shape), buf.dtype, block_n, make)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        slots, hkv, d = buf.shape
        if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
            _DESCRIPTORS.clear()
        desc = _DESCRIPTORS[key] = make(buf.view(slots, hkv * d), [block_n, d])
    return desc


def _tl_descriptor(flat: torch.Tensor, block: List[int]) -> Any:  # triton's TensorDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block)


def _kv_descriptor(buf: torch.Tensor, block_n: int) -> Any:
    """The descriptor kernel's ``kv_descriptor``."""
    return kv_descriptor(buf, block_n, _tl_descriptor)


def qk_scale(sm_scale: float, k_scale: float, f16: bool = False) -> float:
    """The kernels' score scale (base 2): ``sm_scale`` times the layer's K scale, the factor
    SGLang's backends dequantize an FP8 K cache by (``kv_scales``); with ``f16`` (the launch's
    ``math_f16``) also the inverse of the query's ``Q16_SCALE``."""
    return sm_scale * k_scale * LOG2E / (Q16_SCALE.value if f16 else 1.0)


def math_f16(q: torch.Tensor, k_buffer: torch.Tensor, fp8_math: str) -> bool:
    """The kernels' ``MATH_F16``: a bf16 query over an FP8 cache with ``KernelConfig.fp8_math``
    "fp16" (``_math_query``). An fp16 query is fp16 math already; an fp32 one stays fp32."""
    return fp8_math == "fp16" and q.dtype == torch.bfloat16 and k_buffer.dtype in FP8_KV_DTYPES


def score_math(q: torch.Tensor, k_buffer: torch.Tensor, cfg: KernelConfig, sm_scale: float,
               k_scale: float) -> Tuple[float, bool]:
    """One launch's (score scale, ``MATH_F16``): ``qk_scale`` of ``math_f16``, so that the
    query's ``Q16_SCALE`` and its inverse in the scale always come together."""
    f16 = math_f16(q, k_buffer, cfg.fp8_math)
    return qk_scale(sm_scale, k_scale, f16), f16


def launch_limits(cfg: KernelConfig) -> Dict[str, int]:
    """The prefix launches' resource caps: ``maxnreg`` where ``KernelConfig.prefix_maxnreg`` sets one."""
    return {"maxnreg": cfg.prefix_maxnreg} if cfg.prefix_maxnreg else {}


def input_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in full fp32 ("ieee"), never tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def prefix_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, plan: CascadePlan, *,
                     sm_scale: float, k_scale: float = 1.0, merge: Optional[MergeTarget] = None) -> None:
    """Grouped prefix attention of a step's ``CascadePlan`` (its buffers filled), prefix items (one launch).

    q:         [bs, Hq, D] fp16/bf16/fp32, batch order (rows read through group_req_idx)
    k_buffer:  [slots, Hkv, D] q's dtype, or fp8 e4m3 / e5m2 (an FP8 KV cache, widened in
               registers); one layer; the extents [slot_lo, slot_lo+n_kv) are read
    v_buffer:  [slots, Hkv, D], k_buffer's dtype
    k_scale:   the layer's K scale (scores are ``sm_scale * k_scale * q.k``); the V scale is
               the merge's (partial rows hold the unscaled V average)
    plan:      the step's CascadePlan (buffers filled); writes ``part_o`` [rows, Hq, D] fp32 and
               ``part_lse`` [rows, Hq] fp32 (natural log) at each member's prefix partial rows.
    merge:     where the rows this launch completes are merged (``merge_state.MergeTarget``, as
               ``suffix_attention`` takes it), or None (a merge launch follows).
    Grid: (``ws.grid_items("prefix")``, Hkv), fixed per set of buffers (CUDA-graph safe). The kernel is
    ``KernelConfig.prefix_kernel``'s: pointer loads; tensor-descriptor (TMA) loads, which need
    contiguous ``[slots, Hkv, D]`` buffers (ValueError otherwise); the sm90 Gluon kernel
    (``prefix_wgmma``, "wgmma"; ValueError where it cannot run); or "auto" (``auto_prefix_kernel``).
    """
    ws = plan.buffers
    ws.check_shapes(q, k_buffer)
    cfg = ws.config
    grid = (ws.grid_items("prefix"), ws.num_kv_heads)
    scale, f16 = score_math(q, k_buffer, cfg, sm_scale, k_scale)
    softmax = PREFIX_SOFTMAX[cfg.prefix_softmax]
    kind = cfg.prefix_kernel
    chosen = kind == "auto"
    if chosen:
        kind = auto_prefix_kernel(q, k_buffer, v_buffer, cfg)
    if kind == "wgmma":
        from granikv.kernels.prefix_wgmma import prefix_wgmma_attention

        try:
            prefix_wgmma_attention(q, k_buffer, v_buffer, plan, scale=scale, block_m=cfg.block_m,
                                   block_n=cfg.block_n, stages=cfg.prefix_stages, overlap=cfg.prefix_mma_overlap,
                                   warp_specialize=cfg.prefix_warp_specialize, maxnreg=cfg.prefix_maxnreg,
                                   q_registers=cfg.prefix_q_registers, merge=merge)
            return
        except Exception as e:  # noqa: BLE001 - "auto" only: a kernel this Triton cannot build is not fatal
            if not chosen:
                raise
            _wgmma_failed(e)
            kind = "descriptor"
    arrive, on, sinks = arrival_args(plan, merge)
    if kind == "descriptor":
        _prefix_desc_kernel[grid](
            q, k_buffer, v_buffer, _kv_descriptor(k_buffer, cfg.block_n), _kv_descriptor(v_buffer, cfg.block_n),
            ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.group_req_idx, ws.part_indptr, *arrive,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
            ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), ws.prefix_cap,
            scale,
            RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            INPUT_PRECISION=input_precision(q.dtype), NUM_STAGES=cfg.prefix_stages,
            WARP_SPECIALIZE=cfg.prefix_warp_specialize, MATH_F16=f16, SOFTMAX=softmax, ARRIVE=on, HAS_SINKS=sinks,
            num_warps=cfg.prefix_warps, **launch_limits(cfg),
        )  # fmt: skip
        return
    _prefix_kernel[grid](
        q, k_buffer, v_buffer, ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.group_req_idx, ws.part_indptr,
        *arrive,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), ws.prefix_cap,
        scale,
        RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        INPUT_PRECISION=input_precision(q.dtype), EVEN_SPLIT=cfg.even_split,
        MATH_F16=f16, SOFTMAX=softmax, ARRIVE=on, HAS_SINKS=sinks, num_warps=cfg.prefix_warps,
        num_stages=cfg.prefix_stages, **launch_limits(cfg),
    )  # fmt: skip
