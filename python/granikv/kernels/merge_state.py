"""LSE merge of each request's partial states (prefix chunks + suffix chunks) into the output.

For request i and q-head j, with partial rows p in [part_indptr[i], part_indptr[i+1]):

    m      = max_p lse[p, j]
    w_p    = exp(lse[p, j] - m)
    out[i, j] = sum_p w_p * o[p, j] / sum_p w_p          (fp32 math, stored in out's dtype)

A request with no partial rows (or only empty ones, lse = -inf) gets zeros.

The same merge also runs inside the launches that write the partial rows
(``_arrive_and_merge``, ``MergeTarget``): the fused kernel's single launch, and the prefix and
suffix launches of the cascade path with ``KernelConfig.merge_in_kernels``. Every program, after
writing its rows, counts one arrival on each row's (request, q-head) counter; the arrival that
completes a row's count merges it and resets the counter. Nobody waits on anyone.

Attention sinks (``sinks`` [Hq], natural-log logits, as gpt-oss learns them): the sink's logit
joins the softmax denominator once per head, and contributes no value:

    m      = max(max_p lse[p, j], sink[j])
    out[i, j] = sum_p w_p * o[p, j] / (sum_p w_p + exp(sink[j] - m))

as SGLang's triton decode kernel applies them (``e_sum += exp(sink - e_max)`` after its
split merge): the same result, whichever partial rows the work is cut into.

Two kernels compute it (``KernelConfig.merge_block_p``): ``_merge_kernel``, one program per
(request, kv head), walks the request's partial rows one at a time, twice (the max, then the
weighted sum: two dependent load round trips per row); ``_merge_head_kernel``, one program per
(request, q-head), loads ``BLOCK_P`` rows at once as one [BLOCK_P, head_dim] tile and folds them
in with a running max (one round trip per ``BLOCK_P`` rows), the sink starting the running state
as a row of weight ``exp(sink)`` and no value.
"""

from typing import Any, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from granikv.kernels.plan import CascadePlan

__all__ = ["MergeTarget", "arrival_args", "check_out", "check_sinks", "merge_state", "merge_rows"]


class MergeTarget(NamedTuple):
    """Where the launches that write a step's partial rows merge them themselves
    (``KernelConfig.merge_in_kernels``): each (request, q-head) by the program that writes its
    last partial row (``_arrive_and_merge``), so no merge launch runs."""

    out: torch.Tensor  # [>= bs, Hq, D] in the query dtype (merge_state's ``out``)
    sinks: Optional[torch.Tensor]  # fp32 [Hq] attention-sink logits, or None
    v_scale: float  # the layer's V scale (merge_state's ``v_scale``)


@triton.jit
def _arrive_and_merge(b, qh, row_ok, Counter, PartIndptr, PartO, PartLse, Out, Sinks, v_scale, num_q_heads,
                      stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                      HAS_SINKS: tl.constexpr):
    """Count this item's arrival on every row's (b, q-head) counter; merge the rows it completes.

    Rows are merged together as one tile (per-row partial ranges, masked), so a prefix item that
    completes many requests merges them in parallel, not one after another.
    """
    tl.debug_barrier()  # every thread's partial stores precede the release below
    cnt = Counter + b * num_q_heads + qh
    old = tl.atomic_add(cnt, 1, mask=row_ok, sem="acq_rel")
    p_lo = tl.load(PartIndptr + b, mask=row_ok, other=0)
    n = tl.load(PartIndptr + b + 1, mask=row_ok, other=0) - p_lo
    last = row_ok & (old == n - 1)
    tl.debug_barrier()  # the acquiring threads' view reaches every thread that loads below
    n_max = tl.max(tl.where(last, n, 0), 0)
    if n_max > 0:
        d = tl.arange(0, HEAD_DIM)
        m = tl.where(last, float("-inf"), 0.0)
        for j in range(0, n_max):
            ok = last & (j < n)
            lse = tl.load(PartLse + (p_lo + j) * stride_lr + qh, mask=ok, other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, lse)
        if HAS_SINKS:  # merge_state.py: the sink joins the denominator once per head
            sink = tl.load(Sinks + qh, mask=last, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m) * 1.4426950408889634
        acc = tl.zeros([b.shape[0], HEAD_DIM], tl.float32)
        s = tl.zeros([b.shape[0]], tl.float32)
        if HAS_SINKS:
            s += tl.where(last, tl.exp2(sink * 1.4426950408889634 - m), 0.0)
        for j in range(0, n_max):
            ok = last & (j < n)
            lse = tl.load(PartLse + (p_lo + j) * stride_lr + qh, mask=ok, other=float("-inf"), cache_modifier=".cg")
            wgt = tl.exp2(lse * 1.4426950408889634 - m)
            o = tl.load(PartO + (p_lo + j)[:, None] * stride_pr + qh[:, None] * stride_ph + d[None, :],
                        mask=ok[:, None], other=0.0, cache_modifier=".cg")
            acc += wgt[:, None] * o
            s += wgt
        out = acc / tl.where(s == 0.0, 1.0, s)[:, None] * v_scale
        tl.store(Out + b[:, None] * stride_ob + qh[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=last[:, None])
        tl.store(cnt, 0, mask=last)


@triton.jit
def _merge_rows(PartO, PartLse, Out, Sinks, v_scale, p_lo, p_hi, b, h, stride_pr, stride_ph, stride_lr, stride_ob,
                stride_oh, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                HAS_SINKS: tl.constexpr):
    """Merge partial rows [p_lo, p_hi) of the RATIO q-heads of kv head h into Out[b]."""
    r = tl.arange(0, BLOCK_R)
    ok = r < RATIO
    qh = h * RATIO + r
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for p in range(p_lo, p_hi):
        lse = tl.load(PartLse + p * stride_lr + qh, mask=ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, lse)
    if HAS_SINKS:
        sink = tl.load(Sinks + qh, mask=ok, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m) * 1.4426950408889634
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    if HAS_SINKS:
        s += tl.exp2(sink * 1.4426950408889634 - m)
    for p in range(p_lo, p_hi):
        lse = tl.load(PartLse + p * stride_lr + qh, mask=ok, other=float("-inf"), cache_modifier=".cg")
        wgt = tl.exp2(lse * 1.4426950408889634 - m)
        o = tl.load(PartO + p * stride_pr + qh[:, None] * stride_ph + d[None, :], mask=ok[:, None], other=0.0,
                    cache_modifier=".cg")
        acc += wgt[:, None] * o
        s += wgt
    out = acc / tl.where(s == 0.0, 1.0, s)[:, None] * v_scale
    b64 = b.to(tl.int64)
    tl.store(Out + b64 * stride_ob + qh[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _merge_kernel(PartO, PartLse, Out, Sinks, v_scale, Counts, PartIndptr, stride_pr, stride_ph, stride_lr,
                  stride_ob, stride_oh, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if b < tl.load(Counts):
        p_lo = tl.load(PartIndptr + b)
        p_hi = tl.load(PartIndptr + b + 1)
        _merge_rows(PartO, PartLse, Out, Sinks, v_scale, p_lo, p_hi, b, h, stride_pr, stride_ph, stride_lr, stride_ob,
                    stride_oh, RATIO, BLOCK_R, HEAD_DIM, HAS_SINKS)


@triton.jit
def _merge_head_kernel(PartO, PartLse, Out, Sinks, v_scale, Counts, PartIndptr, stride_pr, stride_ph, stride_lr,
                       stride_ob, stride_oh, HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    """Out[b, j] for one (request b, q-head j): BLOCK_P partial rows per load as one
    [BLOCK_P, HEAD_DIM] tile, folded in with a running max (log2 units)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    if b < tl.load(Counts):
        p_lo = tl.load(PartIndptr + b)
        p_hi = tl.load(PartIndptr + b + 1)
        d = tl.arange(0, HEAD_DIM)
        pp = tl.arange(0, BLOCK_P)
        m = float("-inf")
        s = 0.0
        if HAS_SINKS:  # the sink: a row of weight exp(sink) and no value
            m = tl.load(Sinks + j).to(tl.float32) * 1.4426950408889634
            s = 1.0
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for p0 in range(p_lo, p_hi, BLOCK_P):
            p = p0 + pp
            okp = p < p_hi
            lse = tl.load(PartLse + p * stride_lr + j, mask=okp, other=float("-inf"),
                          cache_modifier=".cg") * 1.4426950408889634
            o = tl.load(PartO + p[:, None] * stride_pr + j * stride_ph + d[None, :], mask=okp[:, None], other=0.0,
                        cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - base)  # 0 while m is -inf
            wgt = tl.exp2(lse - base)  # 0 for empty rows
            acc = acc * alpha + tl.sum(wgt[:, None] * o, 0)
            s = s * alpha + tl.sum(wgt, 0)
            m = m_new
        out = acc / tl.where(s == 0.0, 1.0, s) * v_scale
        tl.store(Out + b.to(tl.int64) * stride_ob + j * stride_oh + d, out.to(Out.dtype.element_ty))


def _launch(rows: int, num_kv_heads: int, part_o, part_lse, out, sinks, v_scale, counts, part_indptr,
            block_p: int) -> None:
    """One merge launch over ``rows`` batch rows (programs past ``counts[0]`` exit): the loop
    kernel per (row, kv head) where ``block_p`` is 1, the tile kernel per (row, q-head) else."""
    if block_p < 1 or block_p & (block_p - 1):
        raise ValueError(f"merge block_p={block_p} must be a power of two >= 1")
    hq = out.shape[1]
    args = (part_o, part_lse, out, part_lse if sinks is None else sinks, v_scale, counts, part_indptr,
            part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0), out.stride(1))
    if block_p == 1:
        ratio = hq // num_kv_heads
        _merge_kernel[(rows, num_kv_heads)](*args, RATIO=ratio, BLOCK_R=triton.next_power_of_2(ratio),
                                            HEAD_DIM=out.shape[2], HAS_SINKS=sinks is not None, num_warps=4)
    else:
        _merge_head_kernel[(rows, hq)](*args, HEAD_DIM=out.shape[2], HAS_SINKS=sinks is not None,
                                       BLOCK_P=block_p, num_warps=4)


def arrival_args(plan: CascadePlan, target: Optional[MergeTarget]) -> Tuple[Tuple[Any, ...], bool, bool]:
    """The arrival arguments of a partial-row launch (``Out, Counter, Sinks, v_scale,
    num_q_heads, stride_ob, stride_oh``), ARRIVE and HAS_SINKS: placeholders and False where
    ``target`` is None (the launch only writes partial rows; a merge launch follows)."""
    ws = plan.buffers
    if target is None:
        return (ws.part_lse, ws.counters, ws.part_lse, 1.0, ws.num_q_heads, 0, 0), False, False
    out, sinks = target.out, target.sinks
    check_out(out, ws.num_q_heads, ws.head_dim)
    check_sinks(sinks, ws.num_q_heads)
    return ((out, ws.counters, ws.part_lse if sinks is None else sinks, float(target.v_scale), ws.num_q_heads,
             out.stride(0), out.stride(1)), True, sinks is not None)


def check_out(out: torch.Tensor, num_q_heads: int, head_dim: int) -> None:
    """``out``: [bs, Hq, D] with a contiguous last dim (what a merge writes)."""
    if out.shape[1:] != (num_q_heads, head_dim) or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} strides {out.stride()} must be [bs, {num_q_heads}, "
                         f"{head_dim}] with a contiguous last dim")


def check_sinks(sinks: Optional[torch.Tensor], num_q_heads: int) -> None:
    """``sinks``: None, or one fp32 logit per q-head of this rank, contiguous."""
    if sinks is not None and (sinks.shape != (num_q_heads,) or sinks.dtype != torch.float32
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be fp32 [{num_q_heads}] contiguous, got {sinks.dtype} {tuple(sinks.shape)}")


def merge_state(plan: CascadePlan, out: torch.Tensor, sinks: Optional[torch.Tensor] = None,
                v_scale: float = 1.0) -> torch.Tensor:
    """Merge a step's partial states into ``out`` (one launch).

    plan:      CascadePlan whose buffers' ``part_o`` [rows, Hq, D] fp32 / ``part_lse`` [rows, Hq] fp32
               hold every request's partial rows (CSR ``part_indptr``).
    out:       [>= bs, Hq, D] in the query dtype; rows [0, bs) are written, others untouched.
    sinks:     fp32 [Hq] attention-sink logits (module docstring), or None.
    v_scale:   the layer's V scale (an FP8 KV cache), applied to the merged rows: the partial
               rows hold the unscaled V average, and the merge is linear in V.
    Grid: (rows, Hkv), or (rows, Hq) for the tile kernel; rows = max_bs (fixed per set of buffers)
    or, with ``KernelConfig.merge_rows`` "batch", the rows of ``out`` (fixed per captured graph: its
    padded batch). Programs past the live batch exit.
    """
    ws = plan.buffers
    check_out(out, ws.num_q_heads, ws.head_dim)
    check_sinks(sinks, ws.num_q_heads)
    rows = ws.max_bs if ws.config.merge_rows == "workspace" else min(out.shape[0], ws.max_bs)
    _launch(rows, ws.num_kv_heads, ws.part_o, ws.part_lse, out, sinks, v_scale, ws.counts, ws.part_indptr,
            ws.config.merge_block_p)
    return out


def merge_rows(part_o: torch.Tensor, part_lse: torch.Tensor, part_indptr: torch.Tensor, out: torch.Tensor,
               num_kv_heads: int, sinks: Optional[torch.Tensor] = None, block_p: int = 1) -> torch.Tensor:
    """Stand-alone merge of a CSR of partial states (no workspace), for tests.

    part_o [rows, Hq, D] fp32, part_lse [rows, Hq] fp32, part_indptr int32 [bs+1] (device),
    out [bs, Hq, D], sinks as ``merge_state``, ``block_p`` as ``KernelConfig.merge_block_p``.
    Every request's rows are merged; grid (bs, num_kv_heads).
    """
    bs, hq, d = out.shape
    check_sinks(sinks, hq)
    counts = torch.tensor([bs], dtype=torch.int32, device=out.device)
    _launch(bs, num_kv_heads, part_o, part_lse, out, sinks, 1.0, counts, part_indptr, block_p)
    return out
