"""Single-launch cascade: prefix items, suffix items and the merge in one kernel.

Grid (prefix capacity + suffix capacity, Hkv). Program (w, h) with w < n_prefix runs prefix
item w for kv head h, else suffix item w - n_prefix for kv-head group h (same code as the
two-launch path; programs h >= Hkv / suffix_heads of a suffix item exit). After writing its
partial rows, every row (request b, q-head j) it computed "arrives" on its own counter:

    partials of b = part_indptr[b+1] - part_indptr[b]            (prefix chunks + suffix chunks)
    old = atomic_add(counter[b, j], 1)       acq_rel, after a CTA barrier (all its stores done)
    old == partials - 1  ->  this program wrote the last partial of (b, j): it merges all such
                             rows of its tile together (masked), then resets counter[b, j] = 0

No program ever waits on another, so there is no deadlock whatever the scheduling order, and the
counters are all zero again when the launch ends (CUDA-graph safe). Used for small fan-out,
where the three launches of the cascade path cost more than the work.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from granikv.kernels.merge_state import _arrive_and_merge, check_sinks
from granikv.kernels.plan import CascadePlan
from granikv.kernels.prefix_attention import PREFIX_SOFTMAX, _prefix_item, input_precision, launch_limits, score_math
from granikv.kernels.suffix_attention import _suffix_item, slot_copy_args

__all__ = ["fused_cascade"]


@triton.jit
def _fused_kernel(Q, K, V, Out, PartO, PartLse, Counts, PfxItems, SfxItems, GroupReqIdx, PartIndptr, ReqPoolIdx,
                  ReqToToken, SeqLens, SfxMax, Counter, SlotCopy, SlotCopyOn, Sinks,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt, stride_sc,
                  stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, pfx_cap, sfx_cap, num_q_heads, qk_scale,
                  v_scale,
                  RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_H: tl.constexpr, SFX_HEADS: tl.constexpr, NUM_SFX_GROUPS: tl.constexpr,
                  SFX_BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  EVEN_SPLIT: tl.constexpr, DEVICE_ENDS: tl.constexpr, SLOT_COPY: tl.constexpr,
                  HAS_SINKS: tl.constexpr, MATH_F16: tl.constexpr, SOFTMAX: tl.constexpr):
    h = tl.program_id(1)
    n_pfx = tl.load(Counts + 1)
    n_sfx = tl.load(Counts + 2)
    n_all = n_pfx + n_sfx
    w = tl.program_id(0)
    if w < n_pfx:
        b, qh, row_ok = _prefix_item(w, h, Q, K, V, PartO, PartLse, PfxItems, GroupReqIdx, PartIndptr,
                                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                                     stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                                     RATIO, HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION, EVEN_SPLIT, MATH_F16,
                                     SOFTMAX)
        _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                          stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS)
    elif (w < n_all) & (h < NUM_SFX_GROUPS):  # a suffix program serves SFX_HEADS kv heads
        b, qh, row_ok = _suffix_item(w - n_pfx, h, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken,
                                     SeqLens, SfxMax, n_sfx, SlotCopy, SlotCopyOn,
                                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                                     stride_sc, stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                                     RATIO, SFX_HEADS, HEAD_DIM, BLOCK_H, SFX_BLOCK_N, INPUT_PRECISION,
                                     DEVICE_ENDS, SLOT_COPY, MATH_F16)
        _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                          stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS)


def fused_cascade(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                  plan: CascadePlan, out: torch.Tensor, *, sm_scale: float,
                  sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """Prefix + suffix + merge of a step's ``CascadePlan`` in one launch.

    Shapes as ``prefix_attention`` / ``suffix_attention`` / ``merge_state``; ``out`` [>= bs, Hq, D]
    in q's dtype; ``sinks``: fp32 [Hq] attention-sink logits or None (``merge_state``);
    ``k_scale`` / ``v_scale``: the layer's KV scales (an FP8 KV cache: ``kv_scales``).
    Requires ``plan.buffers.counters`` all zero on entry (left zero on exit).
    A request with no partial rows is not written: the caller's ``fill`` never plans one
    (every request has seq_len - prefix_len >= 1 in decode), see ``cascade.fused_cascade_attention``.
    """
    ws = plan.buffers
    ws.check_shapes(q, k_buffer)
    check_sinks(sinks, ws.num_q_heads)
    cfg = ws.config
    grid = (ws.grid_items("fused"), ws.num_kv_heads)
    ends = plan.ends  # see suffix_attention: device ends of each request's last suffix item
    slots, slots_stride = slot_copy_args(plan)
    scale, f16 = score_math(q, k_buffer, cfg, sm_scale, k_scale)
    _fused_kernel[grid](
        q, k_buffer, v_buffer, out, ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.sfx_items, ws.group_req_idx,
        ws.part_indptr, ws.req_pool_indices, req_to_token, ws.counts if ends is None else ends, ws.sfx_max,
        ws.counters, slots, ws.slot_copy_on, ws.part_lse if sinks is None else sinks,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), slots_stride, ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0),
        out.stride(0), out.stride(1), ws.prefix_cap, ws.suffix_cap, ws.num_q_heads, scale, v_scale,
        RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_H=ws.suffix_block_h,
        SFX_HEADS=ws.suffix_heads, NUM_SFX_GROUPS=ws.suffix_groups, SFX_BLOCK_N=cfg.suffix_block_n,
        INPUT_PRECISION=input_precision(q.dtype), EVEN_SPLIT=cfg.even_split, DEVICE_ENDS=ends is not None,
        SLOT_COPY=plan.slot_copy, HAS_SINKS=sinks is not None, MATH_F16=f16,
        SOFTMAX=PREFIX_SOFTMAX[cfg.prefix_softmax],
        num_warps=cfg.prefix_warps, num_stages=cfg.prefix_stages, **launch_limits(cfg),
    )  # fmt: skip
    return out
