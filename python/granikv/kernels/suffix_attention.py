"""Paged (page size 1) decode attention over each request's suffix, with LSE.

A suffix item (req, t_lo, t_hi, row) and kv head h: the ratio q-heads of h of batch position
``req`` (padded to BLOCK_H >= 16 rows for tl.dot) attend to the tokens t_lo..t_hi-1 of the
request, whose slots are gathered from SGLang's table ``req_to_token[req_pool_indices[req], t]``:

    req_to_token row:  | prefix (served by the prefix kernel) | t_lo ... t_hi | ... | seq_len
                                                                  \\ one item  /
"""

import torch
import triton
import triton.language as tl

from .prefix_attention import LOG2E, _softmax_step, _store_partial, input_precision

__all__ = ["suffix_attention"]


@triton.jit
def _suffix_item(w, h, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                 stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                 RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """Attention of suffix item ``w`` for kv head ``h``; returns per-row (batch pos, q-head, valid)."""
    b = tl.load(SfxItems + w)
    t_lo = tl.load(SfxItems + sfx_cap + w)
    t_hi = tl.load(SfxItems + 2 * sfx_cap + w)
    row = tl.load(SfxItems + 3 * sfx_cap + w).to(tl.int64)
    b64 = b.to(tl.int64)

    r = tl.arange(0, BLOCK_H)
    row_ok = r < RATIO
    qh = h * RATIO + r
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b64 * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)

    tok_ptr = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rt + t_lo
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    n_kv = t_hi - t_lo
    for start in range(0, n_kv, BLOCK_N):
        ok = offs_n < n_kv - start
        slots = tl.load(tok_ptr + offs_n, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kb + h * stride_kh + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vb + h * stride_vh + d[None, :], mask=ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, n_kv - start, True, BLOCK_N, INPUT_PRECISION)
        tok_ptr += BLOCK_N

    rows_part = tl.zeros([BLOCK_H], tl.int64) + row
    _store_partial(PartO, PartLse, rows_part, qh, row_ok, m_i, l_i, acc, stride_pr, stride_ph, stride_lr, HEAD_DIM)
    return tl.zeros([BLOCK_H], tl.int64) + b64, qh, row_ok


@triton.jit
def _suffix_kernel(Q, K, V, PartO, PartLse, Counts, SfxItems, ReqPoolIdx, ReqToToken,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                   stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                   RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    h = tl.program_id(1)
    n_items = tl.load(Counts + 2)
    w = tl.program_id(0)
    if w < n_items:  # grid fixed at capacity; the live count is read from device memory
        _suffix_item(w, h, Q, K, V, PartO, PartLse, SfxItems, ReqPoolIdx, ReqToToken,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rt,
                     stride_pr, stride_ph, stride_lr, sfx_cap, qk_scale,
                     RATIO, HEAD_DIM, BLOCK_H, BLOCK_N, INPUT_PRECISION)


def block_h(ratio: int) -> int:
    """Rows of a suffix tile: the ratio q-heads of one kv head, padded for tl.dot (>= 16)."""
    return max(16, triton.next_power_of_2(ratio))


def suffix_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     workspace, *, sm_scale: float) -> None:
    """Paged suffix attention of a filled ``CascadeWorkspace``'s suffix items (one launch).

    q:            [bs, Hq, D] fp16/bf16/fp32
    k_buffer:     [slots, Hkv, D] one layer (page size 1); v_buffer likewise
    req_to_token: int32 [rows, max_ctx], slot of token t of request-pool row r at [r, t]
    workspace:    CascadeWorkspace after ``fill`` (its ``req_pool_indices`` select the rows);
                  writes ``part_o`` / ``part_lse`` at each suffix item's partial row.
    Grid: (suffix capacity, Hkv), fixed per workspace (CUDA-graph safe).
    """
    ws = workspace
    ws.check_shapes(q, k_buffer)
    if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be int32 with unit column stride, got {req_to_token.dtype} "
                         f"strides {req_to_token.stride()}")
    cfg = ws.config
    grid = (ws.grid_items("suffix"), ws.num_kv_heads)
    _suffix_kernel[grid](
        q, k_buffer, v_buffer, ws.part_o, ws.part_lse, ws.counts, ws.sfx_items, ws.req_pool_indices, req_to_token,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), ws.suffix_cap,
        sm_scale * LOG2E,
        RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_H=block_h(ws.ratio), BLOCK_N=cfg.suffix_block_n,
        INPUT_PRECISION=input_precision(q.dtype), num_warps=cfg.suffix_warps, num_stages=cfg.suffix_stages,
    )  # fmt: skip
