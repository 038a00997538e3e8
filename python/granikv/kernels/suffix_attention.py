"""Paged (page size 1) decode attention over each request's suffix, with LSE.

A suffix item (req, t_lo, t_hi, row) and a group of ``HEADS`` kv heads (``work_list.suffix_heads``:
as many as fill the 16 rows tl.dot needs anyway, so GQA ratio 4 serves 4 kv heads per program
and reads 4 contiguous heads per slot): the q-heads of those kv heads of batch position
``req`` (padded to BLOCK_H >= 16 rows) attend to the tokens t_lo..t_hi-1 of the
request, whose slots are gathered from SGLang's table ``req_to_token[req_pool_indices[req], t]``:

    req_to_token row:  | prefix (served by the prefix kernel) | t_lo ... t_hi | ... | seq_len
                                                                  \\ one item  /

Device ends (``CascadePlan.ends`` set, ``DEVICE_ENDS``): a request's last item
(the next item belongs to another request) ends at ``seq_lens[req]``, read from the batch's
own device tensor, not at its ``t_hi`` in the workspace. A steady decode step (same grouping,
each request one token longer) then needs no upload at all. Graph padding rows, whose
``seq_lens`` hold the wrapped backend's fill value, keep at least one token (``t_lo + 1``); an
end past what the work list was planned for is cut at ``t_lo + sfx_max`` (the workspace's
``sfx_max``: the most tokens a last item holds in the build and its steady steps), so a wrong
device length never reads further than the host plan allows.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from granikv.kernels.merge_state import MergeTarget, _arrive_and_merge, arrival_args
from granikv.kernels.plan import CascadePlan
from granikv.kernels.prefix_attention import (
    _math_query,
    _softmax_step,
    _store_partial,
    input_precision,
    score_math,
)

__all__ = ["slot_copy_args", "suffix_attention"]


@triton.jit
def _suffix_item(w, hg, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken, SeqLens, SfxMax, n_items,
                 SlotCopy, SlotCopyOn, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                 stride_sc, stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                 RATIO: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, DEVICE_ENDS: tl.constexpr,
                 SLOT_COPY: tl.constexpr, MATH_F16: tl.constexpr):
    """Attention of suffix item ``w`` for kv heads ``hg*HEADS .. hg*HEADS+HEADS-1``.

    Rows r < HEADS*RATIO are q-heads ``hg*HEADS*RATIO + r`` (local kv head r // RATIO); the key
    tile holds BLOCK_N gathered slots x HEADS kv heads (key j = slot j // HEADS, head j % HEADS),
    so each slot's HEADS heads are one contiguous read. Scores of a row against another head's
    keys are masked out. Writes the item's partial row; returns per-row (batch pos, q-head, valid).
    """
    b = tl.load(SfxItems + w)
    t_lo = tl.load(SfxItems + sfx_cap + w)
    t_hi = tl.load(SfxItems + 2 * sfx_cap + w)
    if DEVICE_ENDS:  # items are in request order: the last one of b is followed by another request's
        nxt = tl.load(SfxItems + w + 1, mask=w + 1 < n_items, other=-1)
        dev_hi = tl.maximum(tl.load(SeqLens + b).to(tl.int32), t_lo + 1)
        dev_hi = tl.minimum(dev_hi, t_lo + tl.load(SfxMax))  # never past the host-planned bound
        t_hi = tl.where(nxt != b, dev_hi, t_hi)
    row = tl.load(SfxItems + 3 * sfx_cap + w).to(tl.int64)
    b64 = b.to(tl.int64)

    r = tl.arange(0, BLOCK_H)
    row_ok = r < HEADS * RATIO
    h0 = hg * HEADS
    qh = h0 * RATIO + r
    row_head = r // RATIO
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = _math_query(q, MATH_F16)

    tok_ptr = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rt + t_lo
    if SLOT_COPY:  # a graph built to read the step's slot copy, where the build made one
        if tl.load(SlotCopyOn) != 0:
            tok_ptr = SlotCopy + w.to(tl.int64) * stride_sc
    j = tl.arange(0, BLOCK_N * HEADS)
    jn = j // HEADS
    jg = j % HEADS
    # padded rows (r >= HEADS*RATIO, q = 0) see every valid key, so no row is ever all -inf
    same_head = (jg[None, :] == row_head[:, None]) | (r[:, None] >= HEADS * RATIO)
    kv_off = (h0 + jg)[:, None] * stride_kh + d[None, :]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    n_kv = t_hi - t_lo
    for start in range(0, n_kv, BLOCK_N):
        ok = jn < n_kv - start
        slots = tl.load(tok_ptr + jn, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kb + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vb + kv_off, mask=ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, same_head & ok[None, :], True, INPUT_PRECISION)
        tok_ptr += BLOCK_N

    rows_part = tl.zeros([BLOCK_H], tl.int64) + row
    _store_partial(PartO, PartLse, rows_part, qh, row_ok, m_i, l_i, acc, stride_pr, stride_ph, stride_lr, HEAD_DIM)
    return tl.zeros([BLOCK_H], tl.int64) + b64, qh, row_ok


@triton.jit
def _suffix_kernel(Q, K, V, PartO, PartLse, Counts, SfxItems, ReqPoolIdx, ReqToToken, SeqLens, SfxMax,
                   SlotCopy, SlotCopyOn, PartIndptr, Out, Counter, Sinks, v_scale, num_q_heads, stride_ob, stride_oh,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                   stride_sc, stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                   RATIO: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, DEVICE_ENDS: tl.constexpr,
                   SLOT_COPY: tl.constexpr, MATH_F16: tl.constexpr, ARRIVE: tl.constexpr, HAS_SINKS: tl.constexpr):
    hg = tl.program_id(1)
    n_items = tl.load(Counts + 2)  # the live count, from device memory (the grid is fixed)
    w = tl.program_id(0)  # one program per item of the capacity; those past the live count exit
    if w < n_items:
        b, qh, row_ok = _suffix_item(w, hg, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken, SeqLens,
                                     SfxMax, n_items, SlotCopy, SlotCopyOn, stride_qb, stride_qh, stride_kb,
                                     stride_kh, stride_vb, stride_vh, stride_rt, stride_sc, stride_pr, stride_ph,
                                     stride_lr, sfx_cap, qk_scale, RATIO, HEADS, HEAD_DIM, BLOCK_H, BLOCK_N,
                                     INPUT_PRECISION, DEVICE_ENDS, SLOT_COPY, MATH_F16)
        if ARRIVE:  # merge_state.MergeTarget: the rows this program completes are merged here
            _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                              stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS)


def slot_copy_args(plan: CascadePlan) -> Tuple[torch.Tensor, int]:
    """The slot-copy table and its row stride the kernels take (a placeholder when the plan
    does not read one: the argument is then never dereferenced)."""
    ws = plan.buffers
    if plan.slot_copy:
        if ws.slot_copy is None:
            raise ValueError("the plan reads a slot copy its buffers do not have")
        return ws.slot_copy, ws.slot_copy.stride(0)
    return ws.counts, 0


def suffix_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     plan: CascadePlan, *, sm_scale: float, k_scale: float = 1.0,
                     merge: Optional[MergeTarget] = None) -> None:
    """Paged suffix attention of a step's ``CascadePlan`` (its buffers filled), suffix items (one launch).

    q:            [bs, Hq, D] fp16/bf16/fp32
    k_buffer:     [slots, Hkv, D] one layer (page size 1), q's dtype or fp8 (``prefix_attention``);
                  v_buffer likewise; ``k_scale`` as ``prefix_attention``
    req_to_token: int32 [rows, max_ctx], slot of token t of request-pool row r at [r, t]
    plan:         the step's CascadePlan (its buffers' ``req_pool_indices`` select the rows;
                  its ``ends``, when set, ends each request's last item, within
                  ``t_lo + sfx_max``; with ``slot_copy`` the slots come from the buffers'
                  ``slot_copy`` table wherever ``slot_copy_on`` is set: ``suffix_slots``);
                  writes ``part_o`` / ``part_lse`` at each suffix item's partial row.
    merge:        where the rows this launch completes are merged (``merge_state.MergeTarget``:
                  the prefix launch of the same step takes the same one), or None (a merge
                  launch follows). The buffers' ``counters`` must be zero on entry to the pair.
    Grid: (``ws.grid_items("suffix")``, Hkv / suffix_heads), fixed per set of buffers (CUDA-graph safe).
    """
    ws = plan.buffers
    ws.check_shapes(q, k_buffer)
    if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be int32 with unit column stride, got {req_to_token.dtype} "
                         f"strides {req_to_token.stride()}")
    cfg = ws.config
    grid = (ws.grid_items("suffix"), ws.suffix_groups)
    ends = plan.ends
    slots, slots_stride = slot_copy_args(plan)
    scale, f16 = score_math(q, k_buffer, cfg, sm_scale, k_scale)
    arrive, on, sinks = arrival_args(plan, merge)
    _suffix_kernel[grid](
        q, k_buffer, v_buffer, ws.part_o, ws.part_lse, ws.counts, ws.sfx_items, ws.req_pool_indices, req_to_token,
        ws.counts if ends is None else ends, ws.sfx_max, slots, ws.slot_copy_on, ws.part_indptr, *arrive,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), slots_stride, ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0),
        ws.suffix_cap, scale,
        RATIO=ws.ratio, HEADS=ws.suffix_heads, HEAD_DIM=ws.head_dim, BLOCK_H=ws.suffix_block_h,
        BLOCK_N=cfg.suffix_block_n, INPUT_PRECISION=input_precision(q.dtype), DEVICE_ENDS=ends is not None,
        SLOT_COPY=plan.slot_copy, MATH_F16=f16, ARRIVE=on, HAS_SINKS=sinks,
        num_warps=cfg.suffix_warps, num_stages=cfg.suffix_stages,
    )  # fmt: skip
