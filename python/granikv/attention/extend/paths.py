"""``ExtendPaths``: extend (prefill) batches whose cached prefix starts with a HOT run.

``plan`` runs after the wrapped backend planned the batch and picks one of two strategies:

- the wrapped backend is flashinfer (ragged + paged prefill): the paged prefill wrappers in the
  batch's metadata are replaced by ``hot_extend.PrefixPartProxy`` objects; the prefix part runs
  as one dense call per HOT extent plus one paged call for the COLD remainder, SGLang's code
  does the rest of the extend;
- other backends (triton: one kernel per row, no LSE): ``full_extend.FullExtend`` computes each
  layer's whole extend in ``forward``.

Over an FP8 cache under the whole-extend strategy GraniKV computes EVERY extend batch (also one
without a HOT run or without a cached prefix: ``plan_extend(cover_all=True)``), so that a
prompt's prefill attends to the same FP8 values, read exactly, as its decode steps do; SGLang's
triton extend would attend to the new tokens' unrounded K/V and round the query and the
probabilities to FP8. Such a batch counts in ``StepStats.extend_exact_batches``.

Anything else (``--granikv-extend-path paged``, no HOT prefix, a backend or batch feature the
dense path does not implement, the cost model under ``auto``) leaves the batch stock, with its
reason counted in ``StepStats.extend_fallbacks``. A layer the kernels cannot serve
(``LayerEligibility.reason``) goes to the wrapped backend layer by layer. If the dense path
raises, the batch finishes stock and every later extend batch stays stock.

``ctx`` (``AttentionContext``): ``inner``, ``cfg``, ``stats``, ``dispatcher`` and ``model_runner``
are read from it at each call (the backend may replace them while serving).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, List, Mapping, Optional

import numpy as np
import torch

from granikv.attention.context import AttentionContext
from granikv.attention.debug.compare import DebugCompare
from granikv.attention.eligibility import FP8_KV_DTYPES, LayerEligibility
from granikv.attention.extend import workspace as extend_workspace
from granikv.attention.extend.full_extend import FullExtend, backend_reason, graph_reason
from granikv.attention.extend.hot_extend import (
    DenseRunner,
    FlashInferDense,
    HotExtendAttention,
    PrefixPartProxy,
    TorchDense,
)
from granikv.attention.extend.plan import ExtendPlan, plan_extend

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

logger = logging.getLogger("granikv")


class ExtendPaths:
    def __init__(self, ctx: AttentionContext, eligibility: LayerEligibility, compare: DebugCompare):
        self.ctx = ctx
        self.eligibility = eligibility  # LayerEligibility (shared with decode)
        self.compare = compare  # DebugCompare
        self.hot_extend: Optional[HotExtendAttention] = None  # created on the first eligible extend batch
        self.full_extend: Optional[FullExtend] = None  # around it (wrapped backends without ragged + paged)
        self.full_compare = False  # debug compare due on this batch's layer 0 (full extend)
        self.stock_prefill_wrappers: Optional[List[Any]] = None  # the batch's wrappers the proxies stand in for
        # set when the dense prefill path has no workspace or failed: stock from then on
        self.off_reason = self.workspace_reason()
        if self.off_reason is not None and ctx.cfg.extend_path != "paged":
            logger.warning("GraniKV: prefill over HOT prefixes is off under %s (%s)", ctx.backend_name,
                           self.off_reason)
        # an FP8 cache: the whole extend (triton) widens the tiles itself; the prefix-part proxy
        # (flashinfer) would hand FlashInfer FP8 K/V, which no GPU run has checked
        self.proxy_off_reason = fp8_reason(ctx.model_runner)
        if self.proxy_off_reason is not None and ctx.cfg.extend_path != "paged" and ctx.backend_name == "flashinfer":
            logger.warning("GraniKV: prefill over HOT prefixes is off under flashinfer (%s)", self.proxy_off_reason)

    # ---- planning (host side, once per extend batch) ---------------------------------------

    @property
    def fp8_cache(self) -> bool:
        """An FP8 cache (``fp8_reason``): the whole extend serves every extend batch (module docstring)."""
        return self.proxy_off_reason is not None

    def plan(self, fb: Any, staged: Optional[np.ndarray]) -> None:
        """After the wrapped backend planned an extend batch: if its prefix part can run over
        HOT extents, swap the batch's paged prefill wrappers for proxies (flashinfer) or plan
        the whole extend here (other backends)."""
        if self.hot_extend is not None:
            self.hot_extend.end()
        if self.full_extend is not None:
            self.full_extend.end()
        self.full_compare = False
        ctx = self.ctx
        if ctx.cfg.extend_path == "paged" or getattr(fb.forward_mode, "name", "") != "EXTEND":
            return
        md: Any = getattr(ctx.inner, "forward_metadata", None)
        full = not hasattr(md, "prefill_wrappers")  # not flashinfer: GraniKV computes the whole extend
        unservable = backend_reason(ctx.inner, ctx.model_runner.token_to_kv_pool) if full else None
        reason: Optional[str]
        if self.off_reason is not None:
            reason = self.off_reason
        elif full and getattr(fb, "extend_prefix_lens_cpu", None) is None:
            reason = "no host-side prefix lengths in the batch"
        elif full and not any(fb.extend_prefix_lens_cpu) and not self.fp8_cache:
            return  # no cached prefix anywhere: the stock extend has nothing to share
        elif unservable is not None:
            reason = unservable
        elif not full and self.proxy_off_reason is not None:
            reason = self.proxy_off_reason
        elif not full and not getattr(md, "use_ragged", False):
            reason = "flashinfer prefill without its ragged call"
        elif not full and getattr(md, "extend_no_prefix", True):
            return  # no cached prefix anywhere: the stock ragged call is the whole attention
        elif not full and (getattr(ctx.inner, "prefill_uses_dequant_workspace", False) or (
                getattr(md, "multi_item_params", None) is not None and md.multi_item_params.is_enabled())):
            reason = "dequantising or multi-item prefill"
        elif staged is None or len(staged) != fb.batch_size:
            reason = "batch not staged"
        else:
            reason = self._plan_hot(fb, staged, md, full)
            if reason is None:
                return
        ctx.stats.record_extend(None, reason)

    def _plan_hot(self, fb: Any, staged: np.ndarray, md: Any, full: bool) -> Optional[str]:
        """Plans the batch over its HOT runs; returns why it stays stock (None: planned)."""
        ctx = self.ctx
        table = ctx.hot_prefix_table
        prefix_lens = np.asarray(fb.extend_prefix_lens_cpu, dtype=np.int64)
        extend_lens = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
        exact = full and self.fp8_cache  # every batch: the FP8 values as decode reads them
        plan, reason = plan_extend(staged, prefix_lens, extend_lens, table.start_np, table.length_np,
                                   cover_all=exact)
        if plan is not None and not exact and ctx.cfg.extend_path == "auto" and not self.hot_extend_pays(
                plan, prefix_lens, extend_lens, full=full):
            plan, reason = None, "the cost model puts the stock prefill first for this shape"
        if plan is None:
            return reason
        ctx.stats.record_extend(plan, "")
        attn = self.attention()
        attn.begin(plan, ctx.model_runner.req_to_token_pool.req_to_token)
        if ctx.cfg.debug_integrity:
            attn.check_integrity()
        if full:
            full_extend = self.full_extend
            assert full_extend is not None  # made by attention()
            full_extend.begin()
            if ctx.cfg.debug_integrity:
                full_extend.check_integrity()
            self.full_compare = bool(plan.groups) and self.compare.extend_due()
            return None
        compare = self.compare.prefix_part_callback(plan) if self.compare.extend_due() else None
        self.stock_prefill_wrappers = md.prefill_wrappers  # for layers GraniKV does not serve
        md.prefill_wrappers = [PrefixPartProxy(attn, w, on_compare=compare, on_failure=self.failed)
                               for w in md.prefill_wrappers]  # a new list: SGLang's stays
        return None

    def hot_extend_pays(self, plan: ExtendPlan, prefix_lens: np.ndarray, extend_lens: np.ndarray, *,
                        full: bool = False) -> bool:
        """The extend gate: True iff ``ExtendTerms`` puts the prefix part over HOT extents (one
        dense call per group, plus the COLD remainder's paged call and a merge) below the stock
        paged call for this batch's shape; with ``full`` (a backend whose stock extend is one
        call, GraniKV computing the whole extend), the new tokens' causal part on both sides
        (``ExtendTerms.hot_full_us``, ``stock_full_us``). The stock terms are the wrapped
        backend's where the cost model has them (``CostModel.for_backend``). Runs under
        ``--granikv-extend-path auto`` only."""
        dispatcher = self.ctx.dispatcher
        terms = dispatcher.cost_model.served.extend
        per_pair = dispatcher.geometry.flops_per_query_token
        flops_all = per_pair * float(np.dot(prefix_lens, extend_lens))
        flops_hot = per_pair * float(sum(g.length * g.num_tokens for g in plan.groups))
        rem = plan.paged
        flops_cold = None if rem is None else per_pair * float(np.dot(rem.hi - rem.lo, rem.qo_lens))
        if full:  # each new token attends to the new tokens up to itself: n (n + 1) / 2 pairs a request
            flops_causal = per_pair * float(np.dot(extend_lens, extend_lens + 1)) / 2
            return (terms.hot_full_us(len(plan.groups), flops_hot, flops_cold, flops_causal)
                    < terms.stock_full_us(flops_all, flops_causal))
        return terms.hot_us(len(plan.groups), flops_hot, flops_cold) < terms.stock_us(flops_all)

    def failed(self, exc: Exception) -> None:
        """The dense prefill path raised: this call and the rest of the batch are served by the
        stock wrapper; every later extend batch stays stock (logged once; the failed batch counts
        as HOT and as a fallback)."""
        assert self.hot_extend is not None  # only its calls fail
        self.hot_extend.end()  # the batch's remaining layers: stock (the proxy sees no plan)
        if self.off_reason is None:
            self.off_reason = f"dense prefill path off after an error ({type(exc).__name__})"
            logger.error("GraniKV: the prefill path over HOT prefixes failed (%r); extend batches use "
                         "the stock prefill from now on (--granikv-extend-path paged silences this)",
                         exc)
        self.ctx.stats.extend_fallbacks[self.off_reason] += 1

    def attention(self) -> HotExtendAttention:
        """The dense prefix-part attention (created once), and the ``FullExtend`` around it."""
        device = self.ctx.device
        if self.hot_extend is None:
            runner: DenseRunner
            if device.type == "cuda":
                # the flashinfer backend's float workspace (calls are stream-ordered); other
                # backends have none: the one reserved at startup (extend_workspace)
                runner = FlashInferDense(self.workspace_buffer())
            else:
                runner = TorchDense()  # CPU (tests): the float32 reference
            self.hot_extend = HotExtendAttention(runner, device)
        if self.full_extend is None or self.full_extend.attn is not self.hot_extend:
            self.full_extend = FullExtend(self.hot_extend)
        return self.hot_extend

    def workspace_buffer(self) -> torch.Tensor:
        buf = getattr(self.ctx.inner, "workspace_buffer", None)
        if buf is not None:
            return buf
        reservation = extend_workspace.reservation_of(self.ctx.model_runner)
        # a workspace_reason of None (checked before any extend is planned) guarantees a buffer
        assert reservation is not None and reservation.buffer is not None, "no FlashInfer workspace"
        return reservation.buffer

    def workspace_reason(self) -> Optional[str]:
        """Why the HOT prefill path has no FlashInfer workspace (None: it has one, or runs on
        CPU). Checked at construction: no workspace is ever allocated mid-serving."""
        ctx = self.ctx
        if ctx.device.type != "cuda" or getattr(ctx.inner, "workspace_buffer", None) is not None:
            return None
        reservation = extend_workspace.reservation_of(ctx.model_runner)
        if reservation is None:
            return "no FlashInfer workspace reserved at startup"
        return reservation.off_reason

    # ---- compute (per layer) -----------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: Any,
                save_kv_cache: bool, kwargs: Mapping[str, Any]) -> torch.Tensor:
        ctx = self.ctx
        full = self.full_extend
        if full is not None and full.active:  # planned for a backend without ragged + paged calls
            reason = self.eligibility.sinks_reason(layer, k, v, kwargs) or graph_reason()
            if reason is None:
                try:
                    o = full.forward(q, k, v, layer, fb, ctx.model_runner.token_to_kv_pool, save_kv_cache,
                                     sinks=kwargs.get("sinks"))
                except Exception as e:  # noqa: BLE001 - serve the stock way, never fail the forward
                    self.failed(e)
                else:
                    if self.full_compare and layer.layer_id == 0:
                        self.full_compare = False
                        hot = self.hot_extend
                        assert hot is not None and hot.plan is not None  # full.active: its attention is planned
                        self.compare.compare_full_extend(o, q, k, v, layer, fb, kwargs, hot_tokens=hot.plan.hot_tokens)
                    return o
            else:
                self.eligibility.log_stock_extend(layer, reason)
        elif self.hot_extend is not None and self.hot_extend.plan is not None:  # flashinfer proxies
            reason = self.eligibility.reason(layer, k, v, kwargs)
            if reason is not None:
                return self._stock_layer(q, k, v, layer, fb, save_kv_cache, kwargs, reason)
        return ctx.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)

    def _stock_layer(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: Any,
                     save_kv_cache: bool, kwargs: Mapping[str, Any], reason: str) -> torch.Tensor:
        """One layer of a proxied (flashinfer) extend batch, computed wholly by the wrapped
        backend: its stock paged prefill wrappers are put back for the call."""
        self.eligibility.log_stock_extend(layer, reason)
        inner = self.ctx.inner
        md = inner.forward_metadata
        proxies, md.prefill_wrappers = md.prefill_wrappers, self.stock_prefill_wrappers
        try:
            return inner.forward_extend(q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)
        finally:
            md.prefill_wrappers = proxies


def fp8_reason(model_runner: Any) -> Optional[str]:
    """Why the prefix-part proxy (flashinfer's extend) is off for this KV cache (None: it is not):
    over an FP8 cache it would run FlashInfer's dense prefill on FP8 K/V, which no GPU run has
    checked yet, so that prefill stays SGLang's (decode still shares the prefix). The whole
    extend (triton) serves FP8 caches: it widens the tiles itself (full_extend.py)."""
    dtype = getattr(model_runner, "kv_cache_dtype", None)
    if dtype in FP8_KV_DTYPES:
        return (f"KV cache dtype {dtype}: flashinfer's prefill over HOT prefixes is not verified on FP8 KV "
                "(the triton backend's is served)")
    return None
