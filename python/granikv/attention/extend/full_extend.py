"""Extend attention computed by GraniKV itself, for wrapped backends without a ragged + paged split.

SGLang's flashinfer backend computes an extend batch with a cached prefix as two calls merged by
LSE, so GraniKV swaps only the prefix call (``hot_extend.PrefixPartProxy``). SGLang's triton
backend computes it in ONE kernel over each request's whole ``req_to_token`` row and returns no
LSE: there is no prefix part to swap. For an extend batch with HOT prefixes under such a backend,
GraniKV computes each layer's whole extend attention instead, the way the flashinfer backend
does::

    K/V of the new tokens -> pool        pool.set_kv_buffer (SGLang's pool API, as every backend)
    causal part   (new tokens)           runner.run_causal: one ragged causal call, base-2 LSE
    prefix part   (cached prefix)        HotExtendAttention.prefix_part: one dense call per HOT
                                         extent + one paged call for the COLD remainder
    out = merge(causal, prefix)          runner.merge (tokens without a cached prefix: lse -inf)
    out *= sigmoid(lse - sink)           attention sinks (gpt-oss): the sink's logit joins each
                                         q-head's softmax denominator once (``apply_sinks``)

Over an FP8 cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) every part attends to what the
cache holds, as GraniKV's decode does: the new tokens' K/V are read back from the pool after the
write (the values later steps read), the prefix parts widen the FP8 tiles exactly, and the
layer's scales apply as SGLang's backends apply them (``kv_scales``): the query times
``k_scale`` (scores times it), the output times ``v_scale``.

On the GPU the runner is ``FlashInferDense`` (FlashInfer ships with SGLang; ``backend="auto"``
is FA3 on Hopper). A layer this module does not serve (``eligibility.layer_reason`` /
``call_reason``) goes to the wrapped backend's ``forward_extend``, which SGLang planned for the
same batch, so falling back is always possible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from granikv import sglang_compat as compat
from granikv.attention.extend.hot_extend import HotExtendAttention
from granikv.attention.kv_scales import kv_scales
from granikv.kernels.kernel_config import FP8_KV_DTYPES

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVCache
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

__all__ = ["FullExtend", "apply_sinks", "backend_reason", "graph_reason"]

LN2 = 0.6931471805599453


def apply_sinks(o: torch.Tensor, lse2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``o`` [n, Hq, D] with base-2 log-sum-exp ``lse2`` [n, Hq] (the runner's merged
    state), re-normalised as if each q-head's softmax denominator also held ``exp(sinks[h])``
    (natural-log logits, a key that attends to nothing, as gpt-oss learns them and SGLang's triton
    extend kernel applies them): ``o * e^lse / (e^lse + e^sink) = o * sigmoid(lse - sink)``."""
    scale = torch.sigmoid(lse2.float() * LN2 - sinks.to(device=lse2.device, dtype=torch.float32))
    return (o.float() * scale[..., None]).to(o.dtype)


try:  # SGLang's flag for torch.compile's piecewise prefill graph (looked up once, not per layer)
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        is_in_tc_piecewise_cuda_graph,
    )
except ImportError:  # pragma: no cover - no SGLang, or another layout: nothing to detect
    def is_in_tc_piecewise_cuda_graph() -> bool:
        return False


def graph_reason() -> Optional[str]:
    """Why this call goes to the wrapped backend because of a prefill CUDA graph (None: it is
    served). SGLang's breakable graph (its CUDA default) runs attention eagerly between graph
    segments, on inputs padded to its bucket: served (``FullExtend.forward`` handles the
    padding). Under torch.compile's piecewise graph the call may be traced: left to the backend."""
    return "torch.compile piecewise prefill graph" if is_in_tc_piecewise_cuda_graph() else None


def backend_reason(inner: AttentionBackend, pool: KVCache) -> Optional[str]:
    """Why a wrapped backend's extend batches cannot be computed here (None: they can)."""
    if getattr(inner, "enable_deterministic", False):
        return "deterministic inference (the wrapped backend's own kernel)"
    if getattr(inner, "dcp_size", 1) > 1:
        return "decode context parallelism"
    if compat.backend_translates_kv_slots(inner) or not hasattr(pool, "set_kv_buffer"):
        return "KV pool with translated slots"
    if getattr(pool, "is_quantized_kv_cache", False):
        return "quantised KV cache (block-scaled)"
    dtype, store = getattr(pool, "dtype", None), getattr(pool, "store_dtype", None)
    fp8_in_bytes = dtype in FP8_KV_DTYPES and store == torch.uint8
    if store != dtype and not fp8_in_bytes:  # an FP8 cache stored as bytes is served (widened per tile)
        return f"KV cache stored as {store} for {dtype}"
    return None


class FullExtend:
    """One extend batch's whole attention: ``begin`` per batch (after ``attn.begin(plan, ...)``),
    ``forward`` per layer. The causal part's request boundaries are the plan's ``token_indptr``."""

    def __init__(self, attn: HotExtendAttention):
        self.attn = attn
        self._begun = False
        # (sm_scale, dtype, Hq, Hkv, D) the causal part was planned for
        self._planned_key: Optional[Tuple[float, torch.dtype, int, int, int]] = None

    @property
    def active(self) -> bool:
        return self._begun and self.attn.plan is not None

    def begin(self) -> None:
        self._begun = True
        self._planned_key = None

    def end(self) -> None:
        self._begun = False
        self._planned_key = None

    def check_integrity(self) -> None:
        """Debug mode and tests: a begun batch has a plan, and its device state matches it."""
        assert not self._begun or self.attn.plan is not None, "full extend begun without a plan"
        self.attn.check_integrity()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch,
                pool: KVCache, save_kv_cache: bool, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's extend output ``[T, Hq * D]`` in q's dtype (and the KV write); ``sinks``
        [Hq]: the layer's attention-sink logits, or None.

        ``T`` may exceed the batch's token count: SGLang's breakable prefill CUDA graph pads
        the model's inputs to its bucket and plans the metadata from the real batch. The K/V of
        every row is written as the stock backend writes it (padding rows go where SGLang's
        padded ``out_cache_loc`` points); attention covers the real tokens, padding rows get 0.
        """
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3, k3, v3 = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        plan = self.attn.plan
        if plan is None:
            raise RuntimeError("GraniKV extend: forward of a batch without a plan")
        n, rows = plan.num_tokens, q3.shape[0]
        if rows < n:
            raise RuntimeError(f"GraniKV extend: {rows} query tokens, the batch has {n}")
        key = (layer.scaling, q.dtype, hq, hkv, d)
        runner = self.attn.runner
        if key != self._planned_key:  # once per batch: every layer has the same shapes
            runner.plan_causal(plan.token_indptr.tolist(), hq, hkv, d, q.dtype, layer.scaling, 0.0)
            self._planned_key = key
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        quantized = k_buf.dtype != q.dtype  # an FP8 cache
        if save_kv_cache:  # as the stock triton backend writes it (an FP8 cache: divided by the scales)
            if quantized and getattr(layer, "k_scale", None) is not None:  # the pool divides in place
                pool.set_kv_buffer(layer, fb.out_cache_loc, k3.clone(), v3.clone(), layer.k_scale, layer.v_scale)
            else:
                pool.set_kv_buffer(layer, fb.out_cache_loc, k3, v3)
        qn, kn, vn = q3[:n], k3[:n], v3[:n]
        k_scale, v_scale = kv_scales(layer) if quantized else (1.0, 1.0)
        if quantized:
            kn, vn = self._cached_new_kv(fb, k_buf, v_buf, kn, vn, k_scale, v_scale, n, q.dtype, save_kv_cache)
            if k_scale != 1.0:
                qn = (qn.float() * k_scale).to(q.dtype)
        o, lse = runner.run_causal(qn, kn, vn)
        if plan.has_prefix_part:  # else a batch without cached prefixes (an FP8 cache's)
            o2, s2 = self.attn.prefix_part(qn, k_buf, v_buf, layer.scaling)
            o, lse = runner.merge(o, lse, o2, s2)
        if v_scale != 1.0:
            o = (o.float() * v_scale).to(o.dtype)
        if sinks is not None:
            o = apply_sinks(o, lse, sinks)
        out = getattr(fb, "_attn_output", None)
        if out is not None:  # some models hand the backend the output buffer
            out3 = out.view(-1, hq, d)
            out3[:n].copy_(o)
            out3[n:].zero_()
            return out
        if rows > n:
            o = torch.cat([o, o.new_zeros(rows - n, hq, d)])
        return o.reshape(-1, hq * d)

    @staticmethod
    def _cached_new_kv(fb: ForwardBatch, k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_scale: float, v_scale: float, n: int, dtype: torch.dtype,
                       written: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V as an FP8 cache holds them, widened to ``dtype`` (unscaled: the
        scales apply to the query and the output): read back from their slots when this call
        wrote them, else rounded the way the pool writes them (divided by the scale, cast)."""
        if written:
            loc = fb.out_cache_loc[:n]
            return k_buf[loc].to(dtype), v_buf[loc].to(dtype)
        return ((k.float() / k_scale).to(k_buf.dtype).to(dtype),
                (v.float() / v_scale).to(v_buf.dtype).to(dtype))
