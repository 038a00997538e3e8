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

``append_suffix_slots`` keeps the copy current inside the cascade graph itself: a decode step
appends one token per request, whose slot SGLang writes both to ``req_to_token[row, seq_len - 1]``
and to the step's ``out_cache_loc`` (a graph input, refilled before every replay), so the graph
writes ``out_cache_loc[req]`` at position ``seq_len - 1 - t_lo`` of each request's last item.
A steady step of the same build (attention/decode/steady_step.py) then needs no copy before its
replay: the copy made by the step that started the run, plus one append per replay since, hold
every slot the replay reads::

    out_cache_loc[req]  ->  slot_copy[last item of req, seq_len[req] - 1 - t_lo]
"""

from typing import List, Tuple

import torch
import triton
import triton.language as tl

from granikv.kernels.plan import CascadeBuffers

__all__ = ["append_suffix_slots", "append_suffix_slots_reference", "copy_suffix_slots",
           "copy_suffix_slots_reference"]

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


@triton.jit
def _append_slots_kernel(Counts, SfxItems, SfxMax, On, OutCacheLoc, Ends, Out, sfx_cap, stride_out):
    w = tl.program_id(0)
    on = tl.load(On)
    n_items = tl.load(Counts + 2)
    if (on != 0) & (w < n_items):
        b = tl.load(SfxItems + w)
        nxt = tl.load(SfxItems + w + 1, mask=w + 1 < n_items, other=-1)
        if nxt != b:  # items are in request order: w is b's last
            pos = tl.load(Ends + b) - 1 - tl.load(SfxItems + sfx_cap + w)
            n = tl.minimum(tl.load(SfxMax), stride_out)
            if (pos >= 0) & (pos < n):
                tl.store(Out + w.to(tl.int64) * stride_out + pos, tl.load(OutCacheLoc + b).to(tl.int32))


def append_suffix_slots(buffers: CascadeBuffers, out_cache_loc: torch.Tensor, ends: torch.Tensor) -> None:
    """One launch, grid fixed at the suffix capacity (CUDA-graph safe): where ``slot_copy_on``
    is set, the slot of each request's newest token (``out_cache_loc[req]``, at position
    ``ends[req] - 1``) into the copy row of its last suffix item. ``ends``: the suffix ends the
    kernels read (``SuffixEnds.buffer``)."""
    out = buffers.slot_copy
    if out is None:
        raise ValueError("append_suffix_slots: the workspace has no slot_copy table")
    if out_cache_loc.dim() != 1 or out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_cache_loc must be an int32/int64 vector, got {tuple(out_cache_loc.shape)} "
                         f"{out_cache_loc.dtype}")
    _append_slots_kernel[(buffers.suffix_cap,)](
        buffers.counts, buffers.sfx_items, buffers.sfx_max, buffers.slot_copy_on, out_cache_loc, ends, out,
        buffers.suffix_cap, out.stride(0), num_warps=1,
    )  # fmt: skip


def _live_items(buffers: CascadeBuffers) -> Tuple[torch.Tensor, List[Tuple[int, int]], int]:
    """The references' common part: a copy of the table, the live items' (request position,
    first token) where the device's ``slot_copy_on`` is set (none otherwise), and the tokens per
    item either kernel writes at most."""
    out = buffers.slot_copy
    assert out is not None
    ref = out.clone()
    if int(buffers.slot_copy_on[0]) == 0:
        return ref, [], 0
    n_items, sfx_cap = int(buffers.counts[2]), buffers.suffix_cap
    items = [(int(buffers.sfx_items[w]), int(buffers.sfx_items[sfx_cap + w])) for w in range(n_items)]
    return ref, items, min(int(buffers.sfx_max[0]), out.shape[1])


def append_suffix_slots_reference(buffers: CascadeBuffers, out_cache_loc: torch.Tensor,
                                  ends: torch.Tensor) -> torch.Tensor:
    """What ``append_suffix_slots`` leaves in the table, in torch: a new [suffix_cap, width] tensor."""
    ref, items, n = _live_items(buffers)
    for w, (b, t_lo) in enumerate(items):
        if w + 1 < len(items) and items[w + 1][0] == b:
            continue
        pos = int(ends[b]) - 1 - t_lo
        if 0 <= pos < n:
            ref[w, pos] = int(out_cache_loc[b])
    return ref


def copy_suffix_slots_reference(buffers: CascadeBuffers, req_to_token: torch.Tensor) -> torch.Tensor:
    """What ``copy_suffix_slots`` writes, in torch (rows of dead items and entries past each
    item's ``sfx_max`` as the table holds them): a new [suffix_cap, width] tensor."""
    ref, items, n = _live_items(buffers)
    for w, (b, t_lo) in enumerate(items):
        row = req_to_token[int(buffers.req_pool_indices[b])]
        hi = min(t_lo + n, row.shape[0])
        ref[w, :n] = 0
        ref[w, : hi - t_lo] = row[t_lo:hi]
    return ref
