"""Top-level cascade attention entry points (what the attention backend calls per layer).

Plan once per step (the decode planner fills its workspace and hands over the step's
``CascadePlan``, kernels/plan.py), then per layer:

    cascade_attention        prefix launch + suffix launch + merge launch   (memory-optimal;
                             with KernelConfig.overlap_suffix the first two run concurrently;
                             with KernelConfig.merge_in_kernels they merge, no third launch)
    fused_cascade_attention  the same work in one launch                     (small fan-out)
    bgemm_cascade_attention  torch flash attention per group for the prefix  (large fan-out, eager)
                             + suffix launch + merge launch

All write ``out`` [bs, Hq, D] in q's dtype and are equal to plain decode attention over each
request's whole sequence (up to rounding). The first two are CUDA-graph capturable: they only
read the plan's fixed buffers, so a replay after a new fill serves the new batch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from granikv.kernels.fused_cascade import fused_cascade
from granikv.kernels.merge_state import MergeTarget, merge_state
from granikv.kernels.plan import CascadePlan, Grouping
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.suffix_attention import suffix_attention

__all__ = [
    "CascadePlan",
    "PrefixState",
    "cascade_attention",
    "fused_cascade_attention",
    "bgemm_prefix_attention",
    "bgemm_cascade_attention",
]


def _out(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.dtype != q.dtype or out.shape[1:] != q.shape[1:] or out.shape[0] < q.shape[0] or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} strides {out.stride()} does not fit q "
                         f"{tuple(q.shape)} {q.dtype} (the last dim must be contiguous)")
    return out


def cascade_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                      plan: CascadePlan, *, sm_scale: float, out: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Shared-prefix decode attention in three launches (prefix, suffix, merge).

    q [bs, Hq, D] fp16/bf16/fp32; k_buffer / v_buffer [slots, Hkv, D] (one layer);
    req_to_token int32 [rows, max_ctx]; plan: this step's (buffers filled); out [>= bs, Hq, D]
    (allocated if None); sinks: fp32 [Hq] attention-sink logits, joined in the merge
    (merge_state.py), or None; k_scale / v_scale: the layer's KV scales (an FP8 KV cache, whose
    tiles the kernels widen in registers: scores scaled by k_scale, the merged rows by v_scale,
    as SGLang's backends dequantize the same cache). Returns out.
    """
    out = _out(q, out)
    ws = plan.buffers
    # KernelConfig.merge_in_kernels: the two launches merge the rows they complete themselves
    target = MergeTarget(out, sinks, v_scale) if ws.config.merge_in_kernels else None
    side = ws.side_stream
    if side is None:
        prefix_attention(q, k_buffer, v_buffer, plan, sm_scale=sm_scale, k_scale=k_scale, merge=target)
        suffix_attention(q, k_buffer, v_buffer, req_to_token, plan, sm_scale=sm_scale, k_scale=k_scale, merge=target)
    else:  # fork: suffix on the side stream while the prefix runs here; join before the merge
        cur = torch.cuda.current_stream(q.device)
        side.wait_stream(cur)
        def prefix() -> None:
            prefix_attention(q, k_buffer, v_buffer, plan, sm_scale=sm_scale, k_scale=k_scale, merge=target)

        first = ws.config.suffix_first  # KernelConfig.suffix_first: the suffix launch issued first
        if not first:
            prefix()
        with torch.cuda.stream(side):
            suffix_attention(q, k_buffer, v_buffer, req_to_token, plan, sm_scale=sm_scale, k_scale=k_scale,
                             merge=target)
        if first:
            prefix()
        cur.wait_stream(side)  # also orders any later reuse of q's memory after the side work
    if target is not None:
        return out
    return merge_state(plan, out, sinks, v_scale)


def fused_cascade_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            req_to_token: torch.Tensor, plan: CascadePlan, *, sm_scale: float,
                            out: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """``cascade_attention`` in ONE launch (last writer of a request merges it; see fused_cascade.py).

    Every request of the batch must have at least one token (seq_len >= 1), as in decode.
    """
    out = _out(q, out)
    return fused_cascade(q, k_buffer, v_buffer, req_to_token, plan, out, sm_scale=sm_scale, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale)


class PrefixState(NamedTuple):
    """Prefix attention of each group member, in ``group_req_idx`` order."""

    o: torch.Tensor  # fp32 [nnz, Hq, D]
    lse: torch.Tensor  # fp32 [nnz, Hq], natural log


def bgemm_prefix_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, grouping: Grouping, *,
                           sm_scale: float, idx: Optional[torch.Tensor] = None) -> PrefixState:
    """Compute-optimal prefix path: per group, [Hkv, n*ratio, D] stacked queries against the dense
    extent view [Hkv, len, D] through torch flash attention (CUDA) or fp32 matmul/softmax (CPU).

    ``grouping``: the step's groups (host numpy, docs/contracts.md). One torch call per group;
    eager only (the number of calls and their shapes depend on the batch).
    """
    bs, hq, d = q.shape
    hkv = k_buffer.shape[1]
    ratio = hq // hkv
    group_start, group_len = grouping.group_start, grouping.group_len
    group_req_indptr, group_req_idx = grouping.group_req_indptr, grouping.group_req_idx
    nnz = len(group_req_idx)
    o_all = torch.empty(nnz, hq, d, dtype=torch.float32, device=q.device)
    lse_all = torch.empty(nnz, hq, dtype=torch.float32, device=q.device)
    if idx is None:  # group_req_idx as an int64 device tensor (the workspace keeps one per fill)
        idx = torch.as_tensor(np.asarray(group_req_idx, dtype=np.int64)).to(q.device, non_blocking=True)
    for g in range(len(group_start)):
        lo, hi = int(group_req_indptr[g]), int(group_req_indptr[g + 1])
        s, n = int(group_start[g]), int(group_len[g])
        if hi == lo:
            continue
        # [m, Hq, D] -> [1, Hkv, m*ratio, D]; row = member * ratio + r
        qs = q.index_select(0, idx[lo:hi]).view(hi - lo, hkv, ratio, d).permute(1, 0, 2, 3)
        qs = qs.reshape(1, hkv, (hi - lo) * ratio, d)
        k = k_buffer[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D] strided view, no copy
        v = v_buffer[s : s + n].transpose(0, 1).unsqueeze(0)
        if k.dtype != q.dtype:  # an FP8 KV cache: widened per group (a copy; the scales are the caller's)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if q.is_cuda and q.dtype != torch.float32:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention(qs, k, v, scale=sm_scale)[:2]
        else:
            sc = torch.matmul(qs.float(), k.float().transpose(-1, -2)) * sm_scale
            lse = torch.logsumexp(sc, dim=-1)
            o = torch.matmul(torch.exp(sc - lse[..., None]), v.float())
        o = o.float().view(hkv, hi - lo, ratio, d).permute(1, 0, 2, 3).reshape(hi - lo, hq, d)
        lse = lse.float().view(hkv, hi - lo, ratio).permute(1, 0, 2).reshape(hi - lo, hq)
        o_all[lo:hi] = o
        lse_all[lo:hi] = lse
    return PrefixState(o_all, lse_all)


def bgemm_cascade_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                            req_to_token: torch.Tensor, plan: CascadePlan, *, sm_scale: float,
                            out: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """bgemm prefix + suffix kernel + merge. The plan must come from a fill with
    ``single_prefix_chunk=True`` (``plan.bgemm``: one prefix partial row per member, written
    here). Eager only.
    """
    members = plan.bgemm
    if members is None:
        raise ValueError("bgemm_cascade_attention needs a plan filled with single_prefix_chunk=True")
    out = _out(q, out)
    if members.grouping.num_grouped:
        st = bgemm_prefix_attention(q, k_buffer, v_buffer, members.grouping, sm_scale=sm_scale * k_scale,
                                    idx=members.idx)
        plan.buffers.part_o.index_copy_(0, members.rows, st.o)  # no per-layer host-to-device copy
        plan.buffers.part_lse.index_copy_(0, members.rows, st.lse)
    suffix_attention(q, k_buffer, v_buffer, req_to_token, plan, sm_scale=sm_scale, k_scale=k_scale)
    return merge_state(plan, out, sinks, v_scale)
