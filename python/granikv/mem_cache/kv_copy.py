"""Copy K and V of every layer between slots of SGLang's KV buffers.

Works on SGLang's ``MHATokenToKVPool`` in its default NHD layout: ``k_buffer`` and
``v_buffer`` are python lists with one tensor per local layer, each of shape
``(size + page_size, kv_heads, head_dim)`` (dtype ``store_dtype``; fp8 pools store uint8,
which a copy does not care about). A slot is a row of every one of those tensors.

Torch index ops only: runs on CPU and GPU, stream-ordered on the current stream (no host
sync). One gather + one scatter per layer per buffer; a fused Triton kernel that walks all
layers in one launch is future work (promotions are rare, the copy is bandwidth bound).
"""

from typing import TYPE_CHECKING, List

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache, MHATokenToKVPool


def kv_layer_buffers(kv_pool: "MHATokenToKVPool") -> List[torch.Tensor]:
    """Every per-layer tensor whose dim 0 is the slot index (K then V)."""
    return list(kv_pool.k_buffer) + list(kv_pool.v_buffer)


def check_kv_layout(kv_pool: "KVCache") -> None:
    """Raise ``ValueError`` unless ``kv_pool`` has the slot-major layout GraniKV copies."""
    for name in ("k_buffer", "v_buffer"):
        bufs = getattr(kv_pool, name, None)
        if not isinstance(bufs, (list, tuple)) or not bufs:
            raise ValueError(
                f"GraniKV needs an MHA KV pool with per-layer {name} lists "
                f"(got {type(kv_pool).__name__}.{name}={type(bufs).__name__})")
    rows = kv_pool.size + kv_pool.page_size
    for buf in kv_layer_buffers(kv_pool):
        if buf.dim() != 3 or buf.shape[0] != rows:
            raise ValueError(
                f"GraniKV needs NHD KV buffers of shape (size + page_size = {rows}, heads, dim); "
                f"got {tuple(buf.shape)} (HND / paged layouts are not supported)")


def slot_bytes(kv_pool: "MHATokenToKVPool") -> int:
    """Bytes one slot occupies across all layers, K and V."""
    return sum(buf[0].numel() * buf.element_size() for buf in kv_layer_buffers(kv_pool))


def copy_kv_slots(kv_pool: "MHATokenToKVPool", src_slots: torch.Tensor, dst_start: int) -> int:
    """Copy the KV of ``src_slots`` into the dense range ``[dst_start, dst_start + n)``.

    Args:
        kv_pool: an ``MHATokenToKVPool`` (see module docstring for the layout).
        src_slots: int64 (or int32) ``[n]`` on the KV device; any order, may be scattered.
            May intersect the destination range (the gather completes before the write).
        dst_start: first destination slot (host int).

        src_slots:  [ 7, 3, 12, 4 ]              dst: [dst_start .. dst_start+4)
        buf[l]:     ... 3 4 . . 7 . . . . 12 ...  ->  | kv(7) kv(3) kv(12) kv(4) |

    Returns the number of bytes written (all layers, K and V).
    """
    n = src_slots.numel()
    if n == 0:
        return 0
    src = src_slots.to(torch.int64)
    for buf in kv_layer_buffers(kv_pool):
        buf[dst_start : dst_start + n] = buf.index_select(0, src)
    return n * slot_bytes(kv_pool)


def move_kv_slots(kv_pool: "MHATokenToKVPool", src_slots: torch.Tensor, dst_slots: torch.Tensor) -> int:
    """Copy the KV of ``src_slots[i]`` into ``dst_slots[i]`` (both scattered, same length,
    disjoint sets). Used to move COLD KV out of the window a new HOT extent takes.

        src_slots:  [ 9, 4, 6 ]     dst_slots: [ 1, 2, 12 ]
        buf[l]:     kv(9) -> slot 1,  kv(4) -> slot 2,  kv(6) -> slot 12

    Returns the number of bytes written (all layers, K and V).
    """
    n = src_slots.numel()
    assert dst_slots.numel() == n, f"move_kv_slots: {n} sources, {dst_slots.numel()} destinations"
    if n == 0:
        return 0
    src, dst = src_slots.to(torch.int64), dst_slots.to(torch.int64)
    for buf in kv_layer_buffers(kv_pool):
        buf.index_copy_(0, dst, buf.index_select(0, src))
    return n * slot_bytes(kv_pool)
