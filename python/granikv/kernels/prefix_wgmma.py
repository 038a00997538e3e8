"""The prefix kernel for sm90 (Hopper), written in Gluon: explicit TMA loads into a ring of
shared-memory stages, warp-group MMAs (wgmma) issued asynchronously, and the next tile's
scores computed while the previous tile's P @ V is still running.

Same work items, inputs and outputs as ``prefix_attention`` (one program per (prefix item,
kv head); it writes each row's normalised partial output and natural-log LSE into the partial
table), same math (base-2 online softmax, fp32 accumulation). What differs is the schedule
within a program, which a ``tl.dot`` loop does not let Triton express:

    load    K0 V0 | K1 V1 | K2 V2 | ...          TMA, STAGES - 1 tiles ahead (mbarrier per stage)
    wgmma        S0 = Q K0^T
    softmax      P0
    wgmma             S1 = Q K1^T   O += P0 V0   (both in flight)
    softmax           P1            (while P0 V0 runs on the tensor cores)
    wgmma                   S2 = Q K2^T   O += P1 V1
    ...

(``OVERLAP``; without it every wgmma is waited for at once, as a ``tl.dot`` loop does). A
group's last, shorter tile (fewer than ``BLOCK_N`` keys) is read with masked pointer loads, so
no key outside the extent enters a score, as in the descriptor kernel.

Gluon kernels compile for sm90 only and do not run in Triton's CPU interpreter. The CPU tests
check the launch's contract (``wgmma_fits``, the descriptors' shapes) and compile the kernel for
sm90 where Triton can (``compile_for_sm90``); the GPU tests compare it with the float64
reference and with the Triton prefix kernels on the same work lists.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from granikv.kernels.merge_state import MergeTarget, arrival_args
from granikv.kernels.plan import CascadePlan
from granikv.kernels.prefix_attention import descriptor_fits, kv_descriptor

try:  # Gluon ships with Triton >= 3.5; older Triton: the launch is unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # a barrier of the program's threads: ``thread_barrier`` in Triton 3.5-3.6, ``barrier`` later
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    GLUON_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure only disables this kernel
    gluon = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["prefix_wgmma_attention", "wgmma_fits", "wgmma_unfit_reason", "wgmma_unfit_for", "GLUON_ERROR",
           "WGMMA_DTYPES"]

WGMMA_DTYPES = (torch.float16, torch.bfloat16)
WGMMA_HEAD_DIMS = (64, 128)
LN2 = 0.6931471805599453


if gluon is not None:

    @gluon.jit
    def _scores(q_op, k_tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, qk_layout: gl.constexpr):
        """Issues S = Q K^T (asynchronous); the caller waits for it. ``q_op``: the query tile in
        shared memory, or in registers (``Q_REGS``: the MMA then reads only K from shared memory)."""
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=qk_layout)
        return warpgroup_mma(q_op, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, n_valid, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
                 qk_layout: gl.constexpr):
        """The online-softmax step of one score tile: (new max, new sum, P, rescale factor)."""
        s = s * qk_scale
        if MASKED:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
            s = gl.where(cols[None, :] < n_valid, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return m_new, l_new, p, alpha

    @gluon.jit
    def _rescale(acc, alpha, o_layout: gl.constexpr):
        return acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    @gluon.jit
    def _store_partials(acc, m_i, l_i, row_lo, row_hi, h, split, GroupReqIdx, PartIndptr, PartO, PartLse,
                        stride_pr, stride_ph, stride_lr, RATIO: gl.constexpr, HEAD_DIM: gl.constexpr,
                        ROWS: gl.constexpr, o_layout: gl.constexpr):
        """Rows [row_lo, row_lo + ROWS) of an item (those below ``row_hi``): normalised output and
        natural-log LSE into each member's partial row ``part_indptr[member] + split``."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        l_o = gl.convert_layout(l_i, row_o)
        m_o = gl.convert_layout(m_i, row_o)
        o = acc / l_o[:, None]
        lse = (m_o + gl.log2(l_o)) * 0.6931471805599453
        rows_o = row_lo + gl.arange(0, ROWS, layout=row_o)
        ok_o = rows_o < row_hi
        b_o = gl.load(GroupReqIdx + rows_o // RATIO, mask=ok_o, other=0).to(gl.int64)
        qh_o = h * RATIO + rows_o % RATIO
        part = gl.load(PartIndptr + b_o, mask=ok_o, other=0).to(gl.int64) + split
        d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        gl.store(PartO + part[:, None] * stride_pr + qh_o[:, None] * stride_ph + d_o[None, :], o, mask=ok_o[:, None])
        gl.store(PartLse + part * stride_lr + qh_o, lse, mask=ok_o)

    @gluon.jit
    def _arrive_and_merge(row_lo, row_hi, h, GroupReqIdx, PartIndptr, PartO, PartLse, Out, Counter, Sinks, v_scale,
                          num_q_heads, stride_pr, stride_ph, stride_lr, stride_ob, stride_oh, RATIO: gl.constexpr,
                          HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, HAS_SINKS: gl.constexpr,
                          layout: gl.constexpr):
        """``merge_state._arrive_and_merge`` for an item's rows [row_lo, row_hi): one arrival on
        each row's (request, q-head) counter; the rows whose arrival completes their request's
        partial rows are merged into ``Out`` together (masked), and their counters reset."""
        _cta_barrier()  # every thread's partial stores precede the releases below
        row_l: gl.constexpr = gl.SliceLayout(1, layout)
        rows = row_lo + gl.arange(0, ROWS, layout=row_l)
        ok = rows < row_hi
        b = gl.load(GroupReqIdx + rows // RATIO, mask=ok, other=0).to(gl.int64)
        qh = h * RATIO + rows % RATIO
        cnt = Counter + b * num_q_heads + qh
        old = gl.atomic_add(cnt, gl.full([ROWS], 1, gl.int32, layout=row_l), mask=ok, sem="acq_rel")
        p_lo = gl.load(PartIndptr + b, mask=ok, other=0)
        n = gl.load(PartIndptr + b + 1, mask=ok, other=0) - p_lo
        last = ok & (old == n - 1)
        _cta_barrier()  # the acquiring threads' view reaches every thread that loads below
        n_max = gl.max(gl.where(last, n, 0), axis=0)
        if n_max > 0:
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
            m = gl.where(last, float("-inf"), 0.0)
            for j in range(0, n_max):
                okj = last & (j < n)
                lse = gl.load(PartLse + (p_lo + j).to(gl.int64) * stride_lr + qh, mask=okj, other=float("-inf"),
                              cache_modifier=".cg")  # other programs' rows: past this SM's L1
                m = gl.maximum(m, lse)
            if HAS_SINKS:  # merge_state.py: the sink joins the denominator once per head
                sink = gl.load(Sinks + qh, mask=last, other=float("-inf")).to(gl.float32)
                m = gl.maximum(m, sink)
            m = gl.where(m == float("-inf"), 0.0, m) * 1.4426950408889634
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=layout)
            s = gl.zeros([ROWS], gl.float32, layout=row_l)
            if HAS_SINKS:
                s += gl.where(last, gl.exp2(sink * 1.4426950408889634 - m), 0.0)
            for j in range(0, n_max):
                okj = last & (j < n)
                p = (p_lo + j).to(gl.int64)
                lse = gl.load(PartLse + p * stride_lr + qh, mask=okj, other=float("-inf"), cache_modifier=".cg")
                wgt = gl.exp2(lse * 1.4426950408889634 - m)
                o = gl.load(PartO + p[:, None] * stride_pr + qh[:, None] * stride_ph + d[None, :],
                            mask=okj[:, None], other=0.0, cache_modifier=".cg")
                acc += wgt[:, None] * o
                s += wgt
            out = acc / gl.where(s == 0.0, 1.0, s)[:, None] * v_scale
            gl.store(Out + b[:, None] * stride_ob + qh[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=last[:, None])
            gl.store(cnt, gl.zeros([ROWS], gl.int32, layout=row_l), mask=last)

    @gluon.jit
    def _load_tile(k_desc, v_desc, k_bufs, v_bufs, bars, t, slot_lo, col, ok,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of full tile ``t`` (keys [slot_lo + t * BLOCK_N, +BLOCK_N)) into stage t % STAGES."""
        st = t % STAGES
        bar = bars.index(st)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=ok)
        row = slot_lo + t * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_bufs.index(st), pred=ok)
        tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_bufs.index(st), pred=ok)

    @gluon.jit
    def _prefix_wgmma_kernel(Q, K, V, k_desc, v_desc, PartO, PartLse, Counts, PfxItems, GroupReqIdx, PartIndptr,
                             Out, Counter, Sinks, v_scale, num_q_heads, stride_ob, stride_oh,
                             stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                             stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                             RATIO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                             Q_REGS: gl.constexpr, ARRIVE: gl.constexpr, HAS_SINKS: gl.constexpr,
                             num_warps: gl.constexpr):
        h = gl.program_id(1)
        w = gl.program_id(0)
        if w < gl.load(Counts + 1):  # the live item count (the grid is the capacity: graph-safe)
            dtype: gl.constexpr = k_desc.dtype
            qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                instr_shape=[16, BLOCK_N, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # 16-byte row pieces

            row_lo = gl.load(PfxItems + w)
            row_hi = gl.load(PfxItems + pfx_cap + w)
            slot_lo = gl.load(PfxItems + 2 * pfx_cap + w)
            n_kv = gl.load(PfxItems + 3 * pfx_cap + w)
            split = gl.load(PfxItems + 4 * pfx_cap + w)
            col = h * HEAD_DIM
            n_full = n_kv // BLOCK_N

            # K/V stages and their barriers; the first STAGES - 1 full tiles start loading now
            k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            for i in gl.static_range(STAGES - 1):
                _load_tile(k_desc, v_desc, k_bufs, v_bufs, bars, i, slot_lo, col, i < n_full, BLOCK_N, STAGES)

            # the item's query rows (gathered: flat row f is q-head h * RATIO + f % RATIO of member f // RATIO)
            rows = row_lo + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
            row_ok = rows < row_hi
            b = gl.load(GroupReqIdx + rows // RATIO, mask=row_ok, other=0).to(gl.int64)
            qh = h * RATIO + rows % RATIO
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
            q = gl.load(Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            if Q_REGS:  # the A operand of every S = Q K^T from registers: no query tile in shared memory
                q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=qk_layout, k_width=2))
            else:
                q_op = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], k_desc.layout)
                q_op.store(q)
                fence_async_shared()
                _cta_barrier()

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, qk_layout))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            if OVERLAP:
                if n_full > 0:
                    mbarrier.wait(bars.index(0), 0)
                    s = _scores(q_op, k_bufs.index(0), BLOCK_M, BLOCK_N, qk_layout)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    _load_tile(k_desc, v_desc, k_bufs, v_bufs, bars, STAGES - 1, slot_lo, col,
                               STAGES - 1 < n_full, BLOCK_N, STAGES)
                    m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, BLOCK_N, False, BLOCK_N, qk_layout)
                    p16 = gl.convert_layout(p.to(dtype), p_layout)
                    for j in range(1, n_full):
                        st = j % STAGES
                        mbarrier.wait(bars.index(st), (j // STAGES) & 1)
                        s = _scores(q_op, k_bufs.index(st), BLOCK_M, BLOCK_N, qk_layout)
                        acc = warpgroup_mma(p16, v_bufs.index((j - 1) % STAGES), acc, is_async=True)
                        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j done, P_{j-1} V_{j-1} may run
                        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, BLOCK_N, False, BLOCK_N, qk_layout)
                        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
                        acc = _rescale(acc, alpha, o_layout)
                        p16 = gl.convert_layout(p.to(dtype), p_layout)
                        # stage (j - 1) % STAGES is free now: the tile STAGES - 1 ahead goes there
                        _load_tile(k_desc, v_desc, k_bufs, v_bufs, bars, j + STAGES - 1, slot_lo, col,
                                   j + STAGES - 1 < n_full, BLOCK_N, STAGES)
                    acc = warpgroup_mma(p16, v_bufs.index((n_full - 1) % STAGES), acc, is_async=True)
                    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            else:
                for j in range(n_full):
                    st = j % STAGES
                    mbarrier.wait(bars.index(st), (j // STAGES) & 1)
                    s = _scores(q_op, k_bufs.index(st), BLOCK_M, BLOCK_N, qk_layout)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, BLOCK_N, False, BLOCK_N, qk_layout)
                    acc = _rescale(acc, alpha, o_layout)
                    p16 = gl.convert_layout(p.to(dtype), p_layout)
                    acc = warpgroup_mma(p16, v_bufs.index(st), acc, is_async=True)
                    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
                    _load_tile(k_desc, v_desc, k_bufs, v_bufs, bars, j + STAGES - 1, slot_lo, col,
                               j + STAGES - 1 < n_full, BLOCK_N, STAGES)

            n_left = n_kv - n_full * BLOCK_N
            if n_left > 0:  # the group's last, shorter tile: masked pointer loads into stage 0 (idle now)
                offs = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
                tail = (slot_lo + n_full * BLOCK_N).to(gl.int64) + offs
                kv_ok = offs[:, None] < n_left
                kt = gl.load(K + tail[:, None] * stride_kb + h * stride_kh + d[None, :], mask=kv_ok, other=0.0)
                vt = gl.load(V + tail[:, None] * stride_vb + h * stride_vh + d[None, :], mask=kv_ok, other=0.0)
                k_bufs.index(0).store(kt)
                v_bufs.index(0).store(vt)
                fence_async_shared()
                _cta_barrier()
                s = _scores(q_op, k_bufs.index(0), BLOCK_M, BLOCK_N, qk_layout)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, n_left, True, BLOCK_N, qk_layout)
                acc = _rescale(acc, alpha, o_layout)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p16, v_bufs.index(0), acc, is_async=True)
                acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(i))

            _store_partials(acc, m_i, l_i, row_lo, row_hi, h, split, GroupReqIdx, PartIndptr, PartO, PartLse,
                            stride_pr, stride_ph, stride_lr, RATIO, HEAD_DIM, BLOCK_M, o_layout)
            if ARRIVE:  # merge_state.MergeTarget: the rows this program completes are merged here
                _arrive_and_merge(row_lo, row_hi, h, GroupReqIdx, PartIndptr, PartO, PartLse, Out, Counter, Sinks,
                                  v_scale, num_q_heads, stride_pr, stride_ph, stride_lr, stride_ob, stride_oh,
                                  RATIO, HEAD_DIM, BLOCK_M, HAS_SINKS, ld)


def wgmma_unfit_for(device: Any, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int,
                    block_m: int = 64) -> str:
    """Why the wgmma kernel cannot serve a model of this device, dtypes and head_dim ("" if it
    can): what a server checks at startup (``--granikv-prefix-kernel wgmma``)."""
    if kv_dtype not in WGMMA_DTYPES or q_dtype != kv_dtype:
        return f"dtypes q {q_dtype}, KV {kv_dtype} (needs fp16 or bf16 throughout)"
    if head_dim not in WGMMA_HEAD_DIMS:
        return f"head_dim {head_dim} (needs one of {WGMMA_HEAD_DIMS})"
    if block_m not in (64, 128):
        return f"block_m {block_m} (needs 64 or 128: one or two warp groups of 64 rows)"
    if gluon is None:
        return f"Gluon is unavailable ({GLUON_ERROR})"
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] != 9:
        return "not an sm90 device"
    return ""


def wgmma_unfit_reason(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, block_m: int) -> str:
    """Why the wgmma kernel cannot run this launch ("" if it can)."""
    if v_buffer.dtype != k_buffer.dtype:
        return f"K {k_buffer.dtype} and V {v_buffer.dtype} differ"
    why = wgmma_unfit_for(q.device, q.dtype, k_buffer.dtype, k_buffer.shape[2], block_m)
    if why:
        return why
    for buf in (k_buffer, v_buffer):  # fp16 / bf16 by now: only the layout can fail
        if not descriptor_fits(buf):
            return f"KV buffer strides {buf.stride()} (needs a contiguous [slots, Hkv, D] buffer)"
    return ""


def wgmma_fits(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, block_m: int) -> bool:
    return not wgmma_unfit_reason(q, k_buffer, v_buffer, block_m)


def _gluon_descriptor(flat: torch.Tensor, block: List[int]) -> Any:
    """A Gluon tensor descriptor of ``block`` tiles with the 128-byte swizzle wgmma reads."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    elem = gl.float16 if flat.dtype == torch.float16 else gl.bfloat16
    layout = gl.NVMMASharedLayout.get_default_for(block, elem)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def _descriptor(buf: torch.Tensor, block_n: int) -> Any:
    """The wgmma kernels' ``kv_descriptor`` over one layer's K or V buffer."""
    return kv_descriptor(buf, block_n, _gluon_descriptor, kind="wgmma")


def prefix_wgmma_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, plan: CascadePlan, *,
                           scale: float, block_m: int, block_n: int, stages: int, overlap: bool,
                           warp_specialize: bool = False, maxnreg: int = 0, q_registers: bool = False,
                           merge: Optional[MergeTarget] = None) -> None:
    """``prefix_attention``'s launch on the wgmma kernel (``KernelConfig.prefix_kernel`` "wgmma");
    ``scale``: the base-2 score scale (``prefix_attention.qk_scale``); ``warp_specialize``: the
    kernel with a producer warp and two consumer warpgroups (``prefix_wgmma_ws``; ``block_m``
    128; the consumers always overlap scores with P @ V); ``maxnreg``: a cap on
    the other kernel's registers per thread (``KernelConfig.prefix_maxnreg``, 0: none);
    ``q_registers``: the query tile held in registers (``KernelConfig.prefix_q_registers``);
    ``merge``: as ``prefix_attention``'s (the warp-specialized kernel has no such epilogue:
    ValueError). ValueError where it cannot run (``wgmma_unfit_reason``)."""
    why = wgmma_unfit_reason(q, k_buffer, v_buffer, block_m)
    if not why and warp_specialize and block_m != 128:
        why = f"block_m {block_m} (the warp-specialized kernel's items are two warpgroups of 64 rows: 128)"
    if not why and stages < 2:
        why = f"prefix_stages {stages} (needs 2 or more: a tile loads while the last one is computed)"
    if not why and warp_specialize and merge is not None:
        why = "merge_in_kernels with the warp-specialized kernel (its epilogue writes partial rows only)"
    if why:
        raise ValueError(f"prefix_kernel='wgmma' cannot run here: {why}")
    ws = plan.buffers
    grid = (ws.grid_items("prefix"), ws.num_kv_heads)
    if warp_specialize:
        from granikv.kernels.prefix_wgmma_ws import (
            WS_CONSUMER_REGS,
            WS_MAXNREG,
            WS_PRODUCER_REGS,
            _prefix_wgmma_ws_kernel,
        )

        _prefix_wgmma_ws_kernel[grid](
            q, k_buffer, v_buffer, _descriptor(k_buffer, block_n), _descriptor(v_buffer, block_n),
            ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.group_req_idx, ws.part_indptr,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
            ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), ws.prefix_cap, scale,
            RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_N=block_n, STAGES=stages,
            CONSUMER_REGS=WS_CONSUMER_REGS, PRODUCER_REGS=WS_PRODUCER_REGS, num_warps=4, maxnreg=WS_MAXNREG,
        )  # fmt: skip
        return
    arrive, on, sinks = arrival_args(plan, merge)
    _prefix_wgmma_kernel[grid](
        q, k_buffer, v_buffer, _descriptor(k_buffer, block_n), _descriptor(v_buffer, block_n),
        ws.part_o, ws.part_lse, ws.counts, ws.pfx_items, ws.group_req_idx, ws.part_indptr, *arrive,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        ws.part_o.stride(0), ws.part_o.stride(1), ws.part_lse.stride(0), ws.prefix_cap, scale,
        RATIO=ws.ratio, HEAD_DIM=ws.head_dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, OVERLAP=overlap,
        Q_REGS=q_registers, ARRIVE=on, HAS_SINKS=sinks, num_warps=block_m // 16,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
