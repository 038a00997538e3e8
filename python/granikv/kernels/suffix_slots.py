"""The step's suffix slots, copied out of ``req_to_token`` before a decode-graph replay.

The suffix kernels gather each suffix item's KV slots from SGLang's ``req_to_token``. Read
during a CUDA-graph replay, that table keeps SGLang's scheduler from writing it again until the
whole forward has run (its write-after-read barrier, ``granikv/war_barrier.py``). This kernel
runs once per step BEFORE the replay, next to SGLang's own pre-replay metadata copy, and copies
every live suffix item's slots into the workspace's ``slot_copy`` table; the replayed suffix
kernels then read the copy, never ``req_to_token``::

    req_to_token[req_pool_indices[req], t_lo : t_lo + sfx_max]  ->  slot_copy[item, 0 : sfx_max]

``sfx_max`` (device) bounds every item's tokens, a device end included (``suffix_attention``), so
the copy covers whatever the replay reads; positions past the table's width are not copied
(never read: an item ends inside its request's row). The copy is only made where the build's
``sfx_max`` fits the table (``slot_copy_on``, written with the build); otherwise the kernels
read ``req_to_token`` as before and SGLang's barrier waits for the whole forward.
"""

import torch
import triton
import triton.language as tl

from granikv.kernels.plan import CascadeBuffers

__all__ = ["copy_suffix_slots", "copy_suffix_slots_reference"]

_BLOCK = 256


@triton.jit
def _copy_slots_kernel(Counts, SfxItems, ReqPoolIdx, SfxMax, On, ReqToToken, Out, sfx_cap, stride_rt, row_len,
                       stride_out, BLOCK: tl.constexpr):
    w = tl.program_id(0)
    on = tl.load(On)
    n_items = tl.load(Counts + 2)
    if (on != 0) & (w < n_items):
        b = tl.load(SfxItems + w)
        t_lo = tl.load(SfxItems + sfx_cap + w)
        n = tl.minimum(tl.load(SfxMax), stride_out)
        src = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rt
        dst = Out + w.to(tl.int64) * stride_out
        for j in range(0, n, BLOCK):
            k = j + tl.arange(0, BLOCK)
            ok = (k < n) & (t_lo + k < row_len)
            tl.store(dst + k, tl.load(src + t_lo + k, mask=ok, other=0), mask=k < n)


def copy_suffix_slots(buffers: CascadeBuffers, req_to_token: torch.Tensor) -> None:
    """One launch, grid fixed at the suffix capacity (CUDA-graph safe): fills
    ``buffers.slot_copy`` for the live suffix items when ``buffers.slot_copy_on`` is set."""
    out = buffers.slot_copy
    if out is None:
        raise ValueError("copy_suffix_slots: the workspace has no slot_copy table")
    if req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be int32 with unit column stride, got {req_to_token.dtype} "
                         f"strides {req_to_token.stride()}")
    _copy_slots_kernel[(buffers.suffix_cap,)](
        buffers.counts, buffers.sfx_items, buffers.req_pool_indices, buffers.sfx_max, buffers.slot_copy_on,
        req_to_token, out, buffers.suffix_cap, req_to_token.stride(0), req_to_token.shape[1], out.stride(0),
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def copy_suffix_slots_reference(buffers: CascadeBuffers, req_to_token: torch.Tensor) -> torch.Tensor:
    """What ``copy_suffix_slots`` writes, in torch (rows of dead items and entries past each
    item's ``sfx_max`` as the table holds them): a new [suffix_cap, width] tensor."""
    out = buffers.slot_copy
    assert out is not None
    ref = out.clone()
    if int(buffers.slot_copy_on[0]) == 0:
        return ref
    n_items, sfx_cap = int(buffers.counts[2]), buffers.suffix_cap
    n = min(int(buffers.sfx_max[0]), out.shape[1])
    for w in range(n_items):
        b = int(buffers.sfx_items[w])
        t_lo = int(buffers.sfx_items[sfx_cap + w])
        row = req_to_token[int(buffers.req_pool_indices[b])]
        hi = min(t_lo + n, row.shape[0])
        ref[w, :n] = 0
        ref[w, : hi - t_lo] = row[t_lo:hi]
    return ref
