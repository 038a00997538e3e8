"""The warp-specialized form of the sm90 prefix kernel (``prefix_wgmma``), in Gluon: per program
(an item of 128 query rows x one kv head) a producer warp and two consumer warpgroups that
meet only at mbarriers.

    producer (1 warp)    TMA K/V tiles into a ring of STAGES stages (``ready``: bytes landed),
                         the item's gathered query rows (``q_ready``), the masked last tile
    consumer 0 (4 warps) rows 0-63: scores of tile j under P @ V of tile j - 1, then releases
    consumer 1 (4 warps) rows 64-127   the stage of tile j - 1 (``empty`` counts both)

The consumers' math is ``prefix_wgmma``'s (same helpers); registers are split per partition
(``setmaxnreg``): ``WS_CONSUMER_REGS`` each, ``WS_PRODUCER_REGS`` for the producer's warpgroup.
Launched by ``prefix_wgmma.prefix_wgmma_attention(..., warp_specialize=True)``.
"""

from granikv.kernels.prefix_wgmma import gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from granikv.kernels.prefix_wgmma import _load_tile, _rescale, _scores, _softmax, _store_partials

__all__ = ["WS_MAXNREG", "WS_CONSUMER_REGS", "WS_PRODUCER_REGS"]

WS_MAXNREG = 168  # registers per thread at launch: 3 warpgroups (two consumers, the producer's) fit 64K
WS_CONSUMER_REGS = 192  # each consumer warpgroup after the split (setmaxnreg); the producer keeps the rest
WS_PRODUCER_REGS = 120  # 3 x 168 = 192 + 192 + 120: with fewer the producer's gathers spill (ptxas: 16-32 bytes here)


if gluon is not None:

    @gluon.jit
    def _ws_consume(c, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, row_lo, row_hi, n_kv, split, h, qk_scale,
                    GroupReqIdx, PartIndptr, PartO, PartLse, stride_pr, stride_ph, stride_lr,
                    RATIO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Consumer warpgroup ``c`` (4 warps): rows [c * 64, c * 64 + 64) of the item against every
        tile the producer stages, scores of tile j under P @ V of tile j - 1; each stage is
        released (``empty``) once this warpgroup's P @ V over it retired. Runs the whole loop
        even without valid rows (the producer waits for both warpgroups on every stage)."""
        if n_kv > 0:
            ROWS: gl.constexpr = 64
            qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, BLOCK_N, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            dtype: gl.constexpr = k_bufs.dtype
            q = q_bufs.index(c)
            n_tiles = gl.cdiv(n_kv, BLOCK_N)
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, qk_layout))
            l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, qk_layout))
            acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            mbarrier.wait(q_ready, 0)
            mbarrier.wait(ready.index(0), 0)
            s = _scores(q, k_bufs.index(0), ROWS, BLOCK_N, qk_layout)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, n_kv, True, BLOCK_N, qk_layout)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_tiles):
                st = j % STAGES
                mbarrier.wait(ready.index(st), (j // STAGES) & 1)
                s = _scores(q, k_bufs.index(st), ROWS, BLOCK_N, qk_layout)
                acc = warpgroup_mma(p16, v_bufs.index((j - 1) % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
                m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, n_kv - j * BLOCK_N, True, BLOCK_N, qk_layout)
                acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
                mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
                acc = _rescale(acc, alpha, o_layout)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p16, v_bufs.index((n_tiles - 1) % STAGES), acc, is_async=True)
            acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p16))
            mbarrier.arrive(empty.index((n_tiles - 1) % STAGES), count=1)
            _store_partials(acc, m_i, l_i, row_lo + c * ROWS, row_hi, h, split, GroupReqIdx, PartIndptr, PartO,
                            PartLse, stride_pr, stride_ph, stride_lr, RATIO, HEAD_DIM, ROWS, o_layout)

    @gluon.jit
    def _ws_produce(Q, K, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, GroupReqIdx,
                    row_lo, row_hi, slot_lo, n_kv, h, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                    RATIO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: the first STAGES full tiles by TMA, the item's 128 query rows
        (gathered: pointer loads into both warpgroups' Q buffers), every later full tile by TMA
        once both warpgroups released its stage, and a last shorter tile by masked pointer
        loads (keys past the extent read as zeros, masked in the scores)."""
        if n_kv > 0:
            ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])  # one warp, 16-byte pieces
            col = h * HEAD_DIM
            n_full = n_kv // BLOCK_N
            for t in gl.static_range(STAGES):  # a fresh ring: every stage is free
                _load_tile(k_desc, v_desc, k_bufs, v_bufs, ready, t, slot_lo, col, t < n_full, BLOCK_N, STAGES)
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
            for c in gl.static_range(2):  # 8 rows at a time: a warp of few registers
                for r0 in gl.static_range(0, 64, 8):
                    rows = row_lo + c * 64 + r0 + gl.arange(0, 8, layout=gl.SliceLayout(1, ld))
                    row_ok = rows < row_hi
                    b = gl.load(GroupReqIdx + rows // RATIO, mask=row_ok, other=0).to(gl.int64)
                    qh = h * RATIO + rows % RATIO
                    q = gl.load(Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + d[None, :],
                                mask=row_ok[:, None], other=0.0)
                    q_bufs.index(c).slice(r0, 8).store(q)
            fence_async_shared()
            mbarrier.arrive(q_ready, count=1)
            for t in range(STAGES, n_full):
                st = t % STAGES
                mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
                _load_tile(k_desc, v_desc, k_bufs, v_bufs, ready, t, slot_lo, col, True, BLOCK_N, STAGES)
            n_left = n_kv - n_full * BLOCK_N
            if n_left > 0:
                st = n_full % STAGES
                mbarrier.wait(empty.index(st), ((n_full // STAGES) & 1) ^ 1)
                for r0 in gl.static_range(0, BLOCK_N, 8):
                    offs = r0 + gl.arange(0, 8, layout=gl.SliceLayout(1, ld))
                    tail = (slot_lo + n_full * BLOCK_N).to(gl.int64) + offs
                    kv_ok = offs[:, None] < n_left
                    kt = gl.load(K + tail[:, None] * stride_kb + h * stride_kh + d[None, :], mask=kv_ok, other=0.0)
                    vt = gl.load(V + tail[:, None] * stride_vb + h * stride_vh + d[None, :], mask=kv_ok, other=0.0)
                    k_bufs.index(st).slice(r0, 8).store(kt)
                    v_bufs.index(st).slice(r0, 8).store(vt)
                fence_async_shared()
                mbarrier.arrive(ready.index(st), count=1)

    # the partitions: one signature for every worker (constexprs as their own arguments); C is
    # the consumer warpgroup (the producer ignores it)
    @gluon.jit
    def _ws_consumer(cargs, pargs, C: gl.constexpr, RATIO: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, row_lo, row_hi, n_kv, split, h, qk_scale, GroupReqIdx,
         PartIndptr, PartO, PartLse, stride_pr, stride_ph, stride_lr) = cargs
        _ws_consume(C, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, row_lo, row_hi, n_kv, split, h, qk_scale,
                    GroupReqIdx, PartIndptr, PartO, PartLse, stride_pr, stride_ph, stride_lr,
                    RATIO, HEAD_DIM, BLOCK_N, STAGES)

    @gluon.jit
    def _ws_producer(cargs, pargs, C: gl.constexpr, RATIO: gl.constexpr, HEAD_DIM: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        (Q, K, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, GroupReqIdx, row_lo, row_hi,
         slot_lo, n_kv, h, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh) = pargs
        _ws_produce(Q, K, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, GroupReqIdx,
                    row_lo, row_hi, slot_lo, n_kv, h, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                    RATIO, HEAD_DIM, BLOCK_N, STAGES)

    @gluon.jit
    def _prefix_wgmma_ws_kernel(Q, K, V, k_desc, v_desc, PartO, PartLse, Counts, PfxItems, GroupReqIdx, PartIndptr,
                                stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                                stride_pr, stride_ph, stride_lr, pfx_cap, qk_scale,
                                RATIO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                num_warps: gl.constexpr):
        """Items of 128 query rows: the default partition and a 4-warp worker are the two consumer
        warpgroups (64 rows each), a 1-warp worker the producer; they meet at mbarriers only
        (``ready`` / ``empty`` per K/V stage, counting both consumers, and ``q_ready``)."""
        h = gl.program_id(1)
        w = gl.program_id(0)
        live = (w < gl.load(Counts + 1)).to(gl.int32)  # programs past the live count run nothing
        row_lo = gl.load(PfxItems + w)
        row_hi = gl.load(PfxItems + pfx_cap + w)
        slot_lo = gl.load(PfxItems + 2 * pfx_cap + w)
        n_kv = gl.load(PfxItems + 3 * pfx_cap + w) * live
        split = gl.load(PfxItems + 4 * pfx_cap + w)
        dtype: gl.constexpr = k_desc.dtype
        q_bufs = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], k_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a stage
        mbarrier.init(q_ready, count=1)
        cargs = (q_bufs, k_bufs, v_bufs, ready, empty, q_ready, row_lo, row_hi, n_kv, split, h, qk_scale,
                 GroupReqIdx, PartIndptr, PartO, PartLse, stride_pr, stride_ph, stride_lr)
        pargs = (Q, K, V, k_desc, v_desc, q_bufs, k_bufs, v_bufs, ready, empty, q_ready, GroupReqIdx, row_lo,
                 row_hi, slot_lo, n_kv, h, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh)
        # the argument tuples written out in the call: a tuple assigned to a name first would turn
        # its constexprs into tensors
        gl.warp_specialize([
            (_ws_consumer, (cargs, pargs, 0, RATIO, HEAD_DIM, BLOCK_N, STAGES)),
            (_ws_consumer, (cargs, pargs, 1, RATIO, HEAD_DIM, BLOCK_N, STAGES)),
            (_ws_producer, (cargs, pargs, 0, RATIO, HEAD_DIM, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
