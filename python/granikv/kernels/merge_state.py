"""LSE merge of each request's partial states (prefix chunks + suffix chunks) into the output.

For request i and q-head j, with partial rows p in [part_indptr[i], part_indptr[i+1]):

    m      = max_p lse[p, j]
    w_p    = exp(lse[p, j] - m)
    out[i, j] = sum_p w_p * o[p, j] / sum_p w_p          (fp32 math, stored in out's dtype)

A request with no partial rows (or only empty ones, lse = -inf) gets zeros.
"""

import torch
import triton
import triton.language as tl

__all__ = ["merge_state", "merge_rows"]


@triton.jit
def _fold_partials(PartO, PartLse, p_lo, p_hi, qh, q_ok, m, s, acc, stride_pr, stride_ph, stride_lr,
                   HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr):
    """Fold partial rows [p_lo, p_hi) of q-heads ``qh`` into a running state.

    State per q-head: m (running max of base-2 lse), s (sum of weights exp2(lse - m)), acc
    ([rows, D], sum of weight x o). BLOCK_P rows are loaded at once ([P, rows] lse,
    [P, rows, D] o: independent loads), so the latency is ceil(rows / BLOCK_P) dependent loads.
    """
    d = tl.arange(0, HEAD_DIM)
    for p0 in range(p_lo, p_hi, BLOCK_P):
        p = (p0 + tl.arange(0, BLOCK_P)).to(tl.int64)
        ok = (p < p_hi)[:, None] & q_ok[None, :]
        lse = tl.load(PartLse + p[:, None] * stride_lr + qh[None, :], mask=ok, other=float("-inf"),
                      cache_modifier=".cg") * 1.4426950408889634
        o = tl.load(PartO + p[:, None, None] * stride_pr + qh[None, :, None] * stride_ph + d[None, None, :],
                    mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all rows so far empty: weights 0
        alpha = tl.exp2(m - m_use)
        wgt = tl.exp2(lse - m_use[None, :])
        acc = acc * alpha[:, None] + tl.sum(wgt[:, :, None] * o, 0)
        s = s * alpha + tl.sum(wgt, 0)
        m = m_new
    return m, s, acc


@triton.jit
def _store_merged(Out, b64, qh, q_ok, s, acc, stride_ob, stride_oh, HEAD_DIM: tl.constexpr):
    """out[b, qh] = acc / s (zeros where nothing was folded), in Out's dtype."""
    d = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(s == 0.0, 1.0, s)[:, None]
    tl.store(Out + b64 * stride_ob + qh[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=q_ok[:, None])


@triton.jit
def _merge_kernel(PartO, PartLse, Out, Counts, PartIndptr, stride_pr, stride_ph, stride_lr, stride_ob,
                  stride_oh, RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """Program (b, h): the RATIO q-heads of kv head h of request b."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if b < tl.load(Counts):
        r = tl.arange(0, BLOCK_R)
        r_ok = r < RATIO
        qh = h * RATIO + r
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
        m, s, acc = _fold_partials(PartO, PartLse, tl.load(PartIndptr + b), tl.load(PartIndptr + b + 1), qh, r_ok,
                                   m, s, acc, stride_pr, stride_ph, stride_lr, HEAD_DIM, BLOCK_P)
        _store_merged(Out, b.to(tl.int64), qh, r_ok, s, acc, stride_ob, stride_oh, HEAD_DIM)


def _merge_meta(ratio: int, head_dim: int, block_p: int) -> dict:
    return dict(RATIO=ratio, HEAD_DIM=head_dim, BLOCK_P=block_p, BLOCK_R=triton.next_power_of_2(ratio),
                num_warps=4)


def merge_state(workspace, out: torch.Tensor) -> torch.Tensor:
    """Merge a filled workspace's partial states into ``out`` (one launch).

    workspace: CascadeWorkspace whose ``part_o`` [rows, Hq, D] fp32 / ``part_lse`` [rows, Hq] fp32
               hold every request's partial rows (CSR ``part_indptr``).
    out:       [>= bs, Hq, D] in the query dtype; rows [0, bs) are written, others untouched.
    Grid: (max_bs, Hkv), fixed per workspace; programs past the live batch exit.
    """
    ws = workspace
    if out.shape[1:] != (ws.num_q_heads, ws.head_dim) or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} strides {out.stride()} must be [bs, {ws.num_q_heads}, "
                         f"{ws.head_dim}] with a contiguous last dim")
    grid = (ws.max_bs, ws.num_kv_heads)
    _merge_kernel[grid](
        ws.part_o, ws.part_lse, out, ws.counts, ws.part_indptr,
        ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), out.stride(0), out.stride(1),
        **_merge_meta(ws.ratio, ws.head_dim, ws.config.merge_block_p),
    )  # fmt: skip
    return out


def merge_rows(part_o: torch.Tensor, part_lse: torch.Tensor, part_indptr: torch.Tensor, out: torch.Tensor,
               num_kv_heads: int, block_p: int = 8) -> torch.Tensor:
    """Stand-alone merge of a CSR of partial states (no workspace), for tests.

    part_o [rows, Hq, D] fp32, part_lse [rows, Hq] fp32, part_indptr int32 [bs+1] (device),
    out [bs, Hq, D]. Every request's rows are merged; grid (bs, num_kv_heads).
    """
    bs, hq, d = out.shape
    ratio = hq // num_kv_heads
    counts = torch.tensor([bs], dtype=torch.int32, device=out.device)
    _merge_kernel[(bs, num_kv_heads)](
        part_o, part_lse, out, counts, part_indptr,
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
        **_merge_meta(ratio, d, block_p),
    )  # fmt: skip
    return out
