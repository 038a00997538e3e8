"""Prefill attention of new tokens over their HOT prefixes: one dense call per ``ExtendCall``.

Mechanism for an ``extend_plan.ExtendPlan``. SGLang's flashinfer backend computes an extend
batch with a cached prefix as ``ragged (new tokens, causal)`` + ``paged (prefix, per
request)``, merged by LSE (``FlashInferAttnBackend.forward_extend``). ``PrefixPartProxy``
stands in for the paged prefill wrapper in that batch's forward metadata: its
``forward_return_lse`` returns the prefix part computed by ``HotExtendAttention`` (stacked new
tokens of each group against its contiguous extent, no mask; the groups of non-overlapping
extents batched into one ragged call, ``extend_plan.ExtendCall``). SGLang's own code
still writes the new K/V, runs the ragged part and merges; only the prefix part changes kernel.

Runners: ``FlashInferDense`` (FlashInfer's ragged prefill wrapper, ``backend="auto"``: FA3 on
Hopper; benchmark/kernels/bench_extend.py measured it 1.6-1.8x faster than the paged FA2 call it
replaces) and ``TorchDense`` (float32 reference, CPU tests). Both return FlashInfer's base-2 LSE.
The paged remainder (cached prefix tokens outside HOT runs) is one paged call (FlashInfer's
paged prefill wrapper, ``backend="auto"``) over ``req_to_token`` slots, merged by LSE into its
tokens' dense part. Tokens of requests without a cached prefix get ``o = 0`` and
``lse = -inf`` (no contribution to SGLang's merge).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from granikv.attention.extend.plan import ExtendCall, ExtendGroup, ExtendPlan

if TYPE_CHECKING:
    import flashinfer

logger = logging.getLogger("granikv")

LOG2E = 1.0 / math.log(2.0)

Attended = Tuple[torch.Tensor, torch.Tensor]  # (o [n, Hq, D], lse [n, Hq] fp32, base 2)
Indptr = Union[np.ndarray, Sequence[int]]  # int64 CSR offsets


class TorchDense:
    """Reference runner: float32 softmax attention, base-2 LSE (as FlashInfer returns)."""

    def plan(self, calls: Sequence[Tuple[Indptr, Indptr]], num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, sm_scale: float, logits_soft_cap: float) -> None:
        """``calls``: ``(qo_indptr, kv_indptr)`` int64 numpy per dense call (``ExtendCall``)."""
        self.calls = [(np.asarray(qo).tolist(), np.asarray(kv).tolist()) for qo, kv in calls]
        self.ratio = num_q_heads // num_kv_heads
        self.sm_scale, self.cap = sm_scale, logits_soft_cap

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> Attended:
        """q [n, Hq, D] over k, v [L, Hkv, D] (causal: n == L, token j sees keys [0, j]):
        ``(o [n, Hq, D] in q's dtype, lse [n, Hq] base 2)``."""
        qf = q.float()
        kf = k.float().repeat_interleave(self.ratio, dim=1)  # [L, Hq, D]
        vf = v.float().repeat_interleave(self.ratio, dim=1)
        s = torch.einsum("nhd,lhd->hnl", qf, kf) * self.sm_scale
        if self.cap:
            s = self.cap * torch.tanh(s / self.cap)
        if causal:
            s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # [Hq, n], natural log
        o = torch.einsum("hnl,lhd->nhd", torch.exp(s - m[..., None]), vf).to(q.dtype)
        return o, (m * LOG2E).transpose(0, 1).contiguous()

    def run(self, ci: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None) -> Attended:
        """Dense call ``ci``: entry e's queries ``q[qo[e]:qo[e+1]]`` over ``k[kv[e]:kv[e+1]]``
        (entries without queries are skipped, as FlashInfer's scheduler gives them no tile)."""
        qo, kv = self.calls[ci]
        o = torch.empty_like(q) if out is None else out
        lse2 = torch.empty(q.shape[:2], dtype=torch.float32) if lse is None else lse
        for e in range(len(qo) - 1):
            if qo[e + 1] > qo[e]:
                oe, le = self._attend(q[qo[e]: qo[e + 1]], k[kv[e]: kv[e + 1]], v[kv[e]: kv[e + 1]])
                o[qo[e]: qo[e + 1]] = oe
                lse2[qo[e]: qo[e + 1]] = le
        return o, lse2

    def plan_paged(self, qo_indptr: Indptr, kv_indptr: Indptr, kv_indices: torch.Tensor, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, dtype: torch.dtype, sm_scale: float,
                   logits_soft_cap: float) -> None:
        self.paged = (qo_indptr, kv_indptr, kv_indices.long())

    def run_paged(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Attended:
        qo, kv, idx = self.paged
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for j in range(len(qo) - 1):
            slots = idx[kv[j]: kv[j + 1]]
            o[qo[j]: qo[j + 1]], lse[qo[j]: qo[j + 1]] = self._attend(q[qo[j]: qo[j + 1]], k_buf[slots], v_buf[slots])
        return o, lse

    def plan_causal(self, qo_indptr: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, sm_scale: float, logits_soft_cap: float) -> None:
        self.causal_indptr = list(qo_indptr)
        self.ratio = num_q_heads // num_kv_heads
        self.sm_scale, self.cap = sm_scale, logits_soft_cap

    def run_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
        """Each request's new tokens among themselves (``causal_indptr``), causal."""
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        ptr = self.causal_indptr
        for a, b in zip(ptr[:-1], ptr[1:], strict=True):
            if b > a:
                o[a:b], lse[a:b] = self._attend(q[a:b], k[a:b], v[a:b], causal=True)
        return o, lse

    @staticmethod
    def merge(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> Attended:
        m = torch.maximum(s_a, s_b)
        w_a, w_b = torch.exp2(s_a - m), torch.exp2(s_b - m)
        v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
        return v.to(v_a.dtype), m + torch.log2(w_a + w_b)


class FlashInferDense:
    """FlashInfer ragged prefill wrappers, one per dense call (plans live in each wrapper's int
    workspace); they share the float workspace they are given (calls are stream-ordered)."""

    def __init__(self, float_workspace: torch.Tensor):
        self.float_workspace = float_workspace
        self.wrappers: List[flashinfer.BatchPrefillWithRaggedKVCacheWrapper] = []
        self.paged: Optional[flashinfer.BatchPrefillWithPagedKVCacheWrapper] = None
        # ragged causal wrapper (full_extend.py: wrapped backends without ragged + paged)
        self.causal: Optional[flashinfer.BatchPrefillWithRaggedKVCacheWrapper] = None

    def plan(self, calls: Sequence[Tuple[Indptr, Indptr]], num_q_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, sm_scale: float, logits_soft_cap: float) -> None:
        """``calls``: ``(qo_indptr, kv_indptr)`` per dense call (``ExtendCall``); query-less gap
        entries get no work tile from FlashInfer's schedulers (FA2 and FA3 count tiles per
        entry from its query length)."""
        import flashinfer

        while len(self.wrappers) < len(calls):
            self.wrappers.append(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.float_workspace, "NHD", backend="auto"))
        for w, (qo_indptr, kv_indptr) in zip(self.wrappers, calls, strict=False):  # spare wrappers stay
            w.plan(torch.from_numpy(np.asarray(qo_indptr, dtype=np.int32)),
                   torch.from_numpy(np.asarray(kv_indptr, dtype=np.int32)),
                   num_q_heads, num_kv_heads, head_dim, causal=False, sm_scale=sm_scale,
                   logits_soft_cap=logits_soft_cap or None, q_data_type=dtype, kv_data_type=dtype)

    def run(self, ci: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None) -> Attended:
        return self.wrappers[ci].run(q, k, v, out=out, lse=lse, return_lse=True)

    def plan_paged(self, qo_indptr: Indptr, kv_indptr: Indptr, kv_indices: torch.Tensor, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, dtype: torch.dtype, sm_scale: float,
                   logits_soft_cap: float) -> None:
        import flashinfer

        if self.paged is None:
            self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.float_workspace, "NHD",
                                                                        backend="auto")
        i32 = torch.int32
        self.paged.plan(torch.tensor(qo_indptr, dtype=i32), torch.tensor(kv_indptr, dtype=i32), kv_indices,
                        torch.ones(len(qo_indptr) - 1, dtype=i32), num_q_heads, num_kv_heads, head_dim, 1,
                        causal=False, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap or None,
                        q_data_type=dtype, kv_data_type=dtype)

    def plan_causal(self, qo_indptr: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, sm_scale: float, logits_soft_cap: float) -> None:
        import flashinfer

        if self.causal is None:
            self.causal = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.float_workspace, "NHD",
                                                                          backend="auto")
        ptr = torch.tensor(qo_indptr, dtype=torch.int32)
        self.causal.plan(ptr, ptr, num_q_heads, num_kv_heads, head_dim, causal=True, sm_scale=sm_scale,
                         logits_soft_cap=logits_soft_cap or None, q_data_type=dtype, kv_data_type=dtype)

    def run_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
        assert self.causal is not None, "run_causal before plan_causal"
        return self.causal.run(q, k, v, return_lse=True)

    def run_paged(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Attended:
        assert self.paged is not None, "run_paged before plan_paged"
        hkv, d = k_buf.shape[-2:]
        return self.paged.run(q, (k_buf.view(-1, 1, hkv, d), v_buf.view(-1, 1, hkv, d)), return_lse=True)

    @staticmethod
    def merge(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> Attended:
        import flashinfer

        return flashinfer.merge_state(v_a, s_a, v_b, s_b)


DenseRunner = Union[TorchDense, FlashInferDense]  # what computes HotExtendAttention's calls


class HotExtendAttention:
    """The prefix part of one extend batch: ``begin(plan)`` per batch, ``prefix_part`` per layer."""

    def __init__(self, runner: DenseRunner, device: Union[str, torch.device]):
        self.runner = runner
        self.device = torch.device(device)
        self.plan: Optional[ExtendPlan] = None
        # (sm_scale, logits_soft_cap, dtype, Hq, Hkv, D) the runner was planned for
        self._planned_key: Optional[Tuple[float, float, torch.dtype, int, int, int]] = None
        self._token_idx: List[Optional[torch.Tensor]] = []
        self._paged_idx: Optional[torch.Tensor] = None  # the paged remainder's stacked token positions
        self._paged_kv: Optional[torch.Tensor] = None  # ... and its KV slots (int32)
        self._paged_rows: Optional[torch.Tensor] = None  # 0..n-1: its slots gathered and widened (FP8)

    def begin(self, plan: ExtendPlan, req_to_token: torch.Tensor) -> None:
        """Per batch. The paged remainder's slots are gathered from ``req_to_token`` (SGLang's
        table) here, once per batch (no sync)."""
        self.plan = plan
        self._planned_key = None
        self._token_idx = [None if c.contiguous else self._h2d(c.token_idx) for c in plan.calls]
        self._paged_idx = self._paged_kv = None
        if plan.paged is not None:
            rows, cols = plan.paged.slot_coords()
            self._paged_kv = req_to_token[self._h2d(rows), self._h2d(cols)].to(torch.int32)
            self._paged_idx = self._h2d(plan.paged.token_idx)
            self._paged_rows = torch.arange(self._paged_kv.numel(), dtype=torch.int32, device=self.device)

    def end(self) -> None:
        self.plan = None
        self._token_idx = []
        self._paged_idx = self._paged_kv = self._paged_rows = None

    def check_integrity(self) -> None:
        """The batch's device state matches its plan (debug mode and tests; reads device
        tensors): every new token is served by at most one dense group, all within the batch;
        each gathered token list and the paged remainder's slot list is the plan's; every group
        is in one call, whose entries put its tokens against its extent's slots."""
        plan = self.plan
        if plan is None:
            assert not self._token_idx and self._paged_idx is None and self._paged_kv is None, "state without a plan"
            return
        assert len(self._token_idx) == len(plan.calls), "one token list per call"
        assert bool(plan.groups) == bool(plan.calls), "dense groups without calls or calls without groups"
        seen = np.concatenate([g.token_idx for g in plan.groups] or [np.zeros(0, np.int64)])
        assert len(np.unique(seen)) == len(seen), "a token in two dense groups"
        assert not len(seen) or (seen.min() >= 0 and seen.max() < plan.num_tokens), "a group token outside the batch"
        assert sorted(i for c in plan.calls for i in c.groups) == list(range(len(plan.groups))), \
            "a group in no call or in two"
        for c, idx in zip(plan.calls, self._token_idx, strict=True):
            check_call(c, plan.groups)
            assert (idx is None) == c.contiguous, "gathered list vs contiguous call"
            if idx is not None:
                assert np.array_equal(idx.cpu().numpy(), c.token_idx), "stale gathered token list"
        rem = plan.paged
        assert (rem is None) == (self._paged_kv is None), "paged remainder state vs plan"
        if rem is not None:
            paged_kv, paged_idx = self._paged_kv, self._paged_idx
            assert paged_kv is not None and paged_idx is not None, "paged remainder state vs plan"
            assert (rem.hi > rem.lo).all() and (rem.lo >= 0).all(), "empty remainder range"
            assert paged_kv.numel() == int(rem.kv_indptr[-1]), "remainder slot count"
            assert np.array_equal(paged_idx.cpu().numpy(), rem.token_idx), "stale remainder tokens"

    def _h2d(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prefix_part(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                    sm_scale: float, logits_soft_cap: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(o [T, Hq, D], lse [T, Hq] fp32, base 2)`` of the stacked new tokens ``q`` against
        their HOT prefixes in ``k_buf`` / ``v_buf`` (``[slots, Hkv, D]``).

        Buffers of another dtype than ``q`` (an FP8 cache) are widened to it per call: each dense
        call's extent slice, and the COLD remainder's slots gathered into rows of their own (its
        paged call then indexes those rows). The cast is exact (every e4m3 / e5m2 value is a bf16
        / fp16 value); the layer's scales are the caller's (``FullExtend``).

        ``q`` may have more rows than the batch has tokens: SGLang's breakable prefill CUDA graph
        pads the model's inputs to its bucket size while the metadata is planned from the real
        batch. The rows past the batch get no prefix part (o = 0, lse = -inf); SGLang drops them.
        """
        plan = self.plan
        if plan is None:
            raise RuntimeError("GraniKV extend: prefix part of a batch without a plan")
        n_tok, hq, d = q.shape
        if n_tok < plan.num_tokens:
            raise RuntimeError(f"GraniKV extend: {n_tok} query tokens, the plan has {plan.num_tokens}")
        if n_tok > plan.num_tokens:
            return pad_rows(*self.prefix_part(q[: plan.num_tokens], k_buf, v_buf, sm_scale, logits_soft_cap), n_tok)
        widen = k_buf.dtype != q.dtype  # an FP8 cache under a bf16 / fp16 query
        key = (sm_scale, logits_soft_cap, q.dtype, hq, k_buf.shape[1], d)
        if key != self._planned_key:  # once per batch (every layer has the same shapes)
            if plan.calls:
                self.runner.plan([(c.qo_indptr, c.kv_indptr) for c in plan.calls], hq, k_buf.shape[1],
                                 d, q.dtype, sm_scale, logits_soft_cap)
            if plan.paged is not None:
                assert self._paged_kv is not None, "paged remainder without its slots (begin)"
                indices = self._paged_rows if widen else self._paged_kv
                assert indices is not None
                self.runner.plan_paged(plan.paged.qo_indptr, plan.paged.kv_indptr, indices, hq,
                                       k_buf.shape[1], d, q.dtype, sm_scale, logits_soft_cap)
            self._planned_key = key
        if plan.covers_all_tokens:
            o = torch.empty_like(q)
            lse = torch.empty(n_tok, hq, dtype=torch.float32, device=q.device)
        else:
            o = torch.zeros_like(q)
            lse = torch.full((n_tok, hq), float("-inf"), dtype=torch.float32, device=q.device)
        for ci, c in enumerate(plan.calls):
            k = k_buf[c.kv_lo: c.kv_hi]
            v = v_buf[c.kv_lo: c.kv_hi]
            if widen:
                k, v = k.to(q.dtype), v.to(q.dtype)
            idx = self._token_idx[ci]
            if idx is None:
                a, b = c.token_range
                self.runner.run(ci, q[a:b], k, v, out=o[a:b], lse=lse[a:b])
            else:
                og, lg = self.runner.run(ci, q.index_select(0, idx), k, v)
                o.index_copy_(0, idx, og)
                lse.index_copy_(0, idx, lg)
        if plan.paged is not None:  # the COLD remainder, merged into what the dense calls wrote
            idx = self._paged_idx
            assert idx is not None, "paged remainder without its tokens (begin)"
            if widen:  # the remainder's slots as rows of their own (planned with 0..n-1)
                slots = self._paged_kv
                assert slots is not None
                op, lp = self.runner.run_paged(q.index_select(0, idx), k_buf[slots].to(q.dtype),
                                               v_buf[slots].to(q.dtype))
            else:
                op, lp = self.runner.run_paged(q.index_select(0, idx), k_buf, v_buf)
            om, lm = self.runner.merge(o.index_select(0, idx), lse.index_select(0, idx), op, lp)
            o.index_copy_(0, idx, om)
            lse.index_copy_(0, idx, lm)
        return o, lse


def check_call(call: ExtendCall, groups: Sequence[ExtendGroup]) -> None:
    """Assert a dense call's entries put each of its groups' tokens against exactly that group's
    extent, and that everything else is a query-less gap entry."""
    qo, kv = call.qo_indptr, call.kv_indptr
    assert qo[0] == 0 and kv[0] == 0 and (np.diff(qo) >= 0).all() and (np.diff(kv) >= 0).all(), "indptr not CSR"
    assert qo[-1] == call.num_tokens and kv[-1] == call.kv_hi - call.kv_lo, "indptr totals vs call"
    served = [e for e in range(call.num_entries) if qo[e + 1] > qo[e]]
    assert len(served) == len(call.groups), "one entry with queries per group"
    for e, i in zip(served, call.groups, strict=True):
        g = groups[i]
        assert call.kv_lo + kv[e] == g.start and kv[e + 1] - kv[e] == g.length, "entry keys are not its extent"
        assert np.array_equal(call.token_idx[qo[e]: qo[e + 1]], g.token_idx), "entry queries are not its tokens"


def pad_rows(o: torch.Tensor, lse: torch.Tensor, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) extended to ``rows`` rows with empty states (o = 0, lse = -inf)."""
    extra = rows - o.shape[0]
    return (torch.cat([o, o.new_zeros((extra,) + tuple(o.shape[1:]))]),
            torch.cat([lse, lse.new_full((extra,) + tuple(lse.shape[1:]), float("-inf"))]))


class PrefixPartProxy:
    """Stands in for SGLang's paged prefill wrapper for one extend batch.

    ``forward_return_lse(q, kv_cache, causal=False, ...)`` (the prefix part SGLang asks for,
    with or without ``k_scale`` / ``v_scale``) is served by ``HotExtendAttention``; any other
    call, or arguments it does not serve (causal, a sliding window, a KV cache that is not a
    ``(k, v)`` pair, an unknown keyword), goes to the original
    wrapper, which SGLang planned for the same batch. ``on_compare`` (debug): called once with
    ``(ours, original)`` results on the first call. If the dense path raises (a FlashInfer
    module missing for this shape, say), the original wrapper serves the call and
    ``on_failure(exc)`` is told, so the backend can turn the path off instead of failing the
    forward.
    """

    def __init__(self, attn: HotExtendAttention, original: flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                 on_compare: Optional[Callable[[Attended, Attended], None]] = None,
                 on_failure: Optional[Callable[[Exception], None]] = None):
        self._attn = attn
        self._original = original
        self._on_compare = on_compare
        self._on_failure = on_failure

    def forward_return_lse(self, q: torch.Tensor, kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                           causal: bool = False, sm_scale: Optional[float] = None, window_left: int = -1,
                           logits_soft_cap: Optional[float] = None, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, **kwargs: Any) -> Attended:
        """``k_scale`` / ``v_scale`` (SGLang 0.5.23 passes ``layer.k_scale_float`` /
        ``v_scale_float``, ``None`` without quantized-KV scales): FlashInfer's meaning, the
        logits scale by ``k_scale`` and the output by ``v_scale``; served the same way (the
        LSE follows the scaled logits). Any other keyword goes to the original wrapper."""
        scaled = k_scale not in (None, 1.0) or v_scale not in (None, 1.0)
        served = (self._attn.plan is not None and not causal and window_left in (None, -1) and not kwargs
                  and isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2
                  and not (scaled and logits_soft_cap))  # soft cap + scales: leave to FlashInfer
        stock = dict(causal=causal, sm_scale=sm_scale, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, **kwargs)
        if k_scale is not None or v_scale is not None:  # 0.5.17's call has neither keyword
            stock.update(k_scale=k_scale, v_scale=v_scale)
        if not served:
            return self._original.forward_return_lse(q, kv_cache, **stock)
        k_buf, v_buf = kv_cache
        scale = (sm_scale if sm_scale is not None else q.shape[-1] ** -0.5) * (k_scale or 1.0)
        try:
            o, lse = self._attn.prefix_part(q, k_buf, v_buf, scale, logits_soft_cap or 0.0)
            ours = (o * v_scale if v_scale is not None and v_scale != 1.0 else o), lse
        except Exception as e:  # noqa: BLE001 - serve the stock way, never fail the forward
            if self._on_failure is None:
                raise
            self._on_failure(e)
            return self._original.forward_return_lse(q, kv_cache, **stock)
        if self._on_compare is not None:
            cb, self._on_compare = self._on_compare, None
            cb(ours, self._original.forward_return_lse(q, kv_cache, **stock))
        return ours

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._original, name)
