"""Single-launch cascade: prefix items, suffix items and the merge in one kernel.

Grid (prefix capacity + suffix capacity, Hkv). Program (w, h) with w < n_prefix runs prefix
item w, else suffix item w - n_prefix (same code as the two-launch path). After writing its
partial rows, it "arrives" once per request it covered, on that request's counter for kv head h:

    partials of (b, h) = part_indptr[b+1] - part_indptr[b]      (prefix chunks + suffix chunks)
    old = atomic_add(counter[b, h], 1)       acq_rel, after a CTA barrier (all its stores done)
    old == partials - 1  ->  this program is the last writer: merge (b, h) into out,
                             then reset counter[b, h] = 0 for the next launch

No program ever waits on another, so there is no deadlock whatever the scheduling order, and the
counters are all zero again when the launch ends (CUDA-graph safe). Used for small fan-out,
where the three launches of the cascade path cost more than the work.
"""

import torch
import triton
import triton.language as tl

from .merge_state import _merge_rows
from .prefix_attention import LOG2E, _prefix_item, input_precision
from .suffix_attention import _suffix_item, block_h

__all__ = ["fused_cascade"]


@triton.jit
def _arrive(b, h, Counter, PartIndptr, PartO, PartLse, Out, num_kv_heads, stride_pr, stride_ph, stride_lr,
            stride_ob, stride_oh, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr):
    p_lo = tl.load(PartIndptr + b)
    p_hi = tl.load(PartIndptr + b + 1)
    cnt = Counter + b * num_kv_heads + h
    old = tl.atomic_add(cnt, 1, sem="acq_rel")
    if old == p_hi - p_lo - 1:
        _merge_rows(PartO, PartLse, Out, p_lo, p_hi, b, h, stride_pr, stride_ph, stride_lr, stride_ob, stride_oh,
                    RATIO, BLOCK_R, HEAD_DIM)
        tl.atomic_xchg(cnt, 0, sem="relaxed")


@triton.jit
def _fused_kernel(Q, K, V, Out, PartO, PartLse, Counts, PfxItems, SfxItems, GroupReqIdx, PartIndptr, ReqPoolIdx,
                  ReqToToken, Counter,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                  stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, pfx_cap, sfx_cap, num_kv_heads, qk_scale,
                  RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_H: tl.constexpr, SFX_BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    h = tl.program_id(1)
    n_pfx = tl.load(Counts + 1)
    n_all = n_pfx + tl.load(Counts + 2)
    for w in range(tl.program_id(0), n_all, tl.num_programs(0)):
        if w < n_pfx:
            m_lo, m_hi = _prefix_item(w, h, Q, K, V, PartO, PartLse, PfxItems, GroupReqIdx, PartIndptr,
                                      stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                                      stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                                      RATIO, HEAD_DIM, BLOCK_M, BLOCK_N, INPUT_PRECISION)
            tl.debug_barrier()
            for m in range(m_lo, m_hi):
                _arrive(tl.load(GroupReqIdx + m), h, Counter, PartIndptr, PartO, PartLse, Out, num_kv_heads,
                        stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, RATIO, BLOCK_R, HEAD_DIM)
        else:
            b = _suffix_item(w - n_pfx, h, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken,
                             stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                             stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                             RATIO, HEAD_DIM, BLOCK_H, SFX_BLOCK_N, INPUT_PRECISION)
            tl.debug_barrier()
            _arrive(b, h, Counter, PartIndptr, PartO, PartLse, Out, num_kv_heads,
                    stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, RATIO, BLOCK_R, HEAD_DIM)


def fused_cascade(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                  workspace, out: torch.Tensor, *, sm_scale: float) -> torch.Tensor:
    """Prefix + suffix + merge of a filled ``CascadeWorkspace`` in one launch.

    Shapes as ``prefix_attention`` / ``suffix_attention`` / ``merge_state``; ``out`` [>= bs, Hq, D]
    in q's dtype. Requires ``workspace.counters`` all zero on entry (left zero on exit).
    A request with no partial rows is not written: the caller's ``fill`` never plans one
    (every request has seq_len - prefix_len >= 1 in decode), see ``cascade.fused_cascade_attention``.
    """
    ws = workspace
    ws.check_shapes(q, k_buffer)
    cfg = ws.config
    grid = (ws.grid_items("fused"), ws.num_kv_heads)
    _fused_kernel[grid](
        q, k_buffer, v_buffer, out, ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.sfx_items, ws.group_req_idx,
        ws.part_indptr, ws.req_pool_indices, req_to_token, ws.counters,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0),
        out.stride(0), out.stride(1), ws.prefix_cap, ws.suffix_cap, ws.num_kv_heads, sm_scale * LOG2E,
        RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_H=block_h(ws.ratio),
        SFX_BLOCK_N=cfg.suffix_block_n, BLOCK_R=triton.next_power_of_2(ws.ratio),
        INPUT_PRECISION=input_precision(q.dtype), num_warps=cfg.prefix_warps, num_stages=cfg.prefix_stages,
    )  # fmt: skip
    return out
