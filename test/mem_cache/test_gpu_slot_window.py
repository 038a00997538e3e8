"""GPU host: extent placement on a pool of real size (845,617 slots, the Llama-3.1-8B pool of
an H200 at SGLang's defaults): ``find_window`` on the device equals the same function on the
CPU, and the allocator's window take / free keep exact accounting on CUDA tensors. Prints the
time of one window search (the host sync included). Skipped on CPU/CI."""

import time

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.slot_window import find_window

pytestmark = pytest.mark.gpu
SIZE = 845_617


def test_window_search_on_a_full_size_pool():
    g = torch.Generator().manual_seed(0)
    state = torch.randint(0, 10, (SIZE + 1,), generator=g)  # 60% free, 30% movable, 10% blocked
    free, movable = state < 6, (state >= 6) & (state < 9)
    free[0] = movable[0] = False
    for n in (1024, 16384):
        want = find_window(free, movable, n)
        dev = find_window(free.cuda(), movable.cuda(), n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dev = find_window(free.cuda(), movable.cuda(), n)
        ms = (time.perf_counter() - t0) / 10 * 1e3
        print(f"find_window n={n}: {dev} in {ms:.2f} ms (host copy of the masks included)")
        assert dev == want


def test_allocator_window_take_and_free_on_cuda():
    kv = MHATokenToKVPool(size=SIZE, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                          layer_num=1, device="cuda", enable_memory_saver=False)
    a = GraniKVAllocator(SIZE, torch.bfloat16, "cuda", kv, False, hot_fraction=0.5)
    held = a.alloc(SIZE - 1000)
    perm = torch.randperm(held.numel(), device="cuda")
    a.free(held[perm[: held.numel() // 2]])  # a scattered free list, as after long serving
    movable = torch.zeros(SIZE + 1, dtype=torch.bool, device="cuda")
    movable[held[perm[held.numel() // 2 :]]] = True  # pretend the rest is unlocked COLD KV
    free_before = a.available_size()
    w = a.find_window(16384, movable, torch.zeros_like(movable))
    assert w is not None
    dst = a.take_window(w, 16384)
    # the window's free slots and ``moves`` targets outside it left the free list
    assert dst.numel() == w.moves and a.available_size() == free_before - 16384
    a.check_integrity()
    a.free_extent(w.start, 16384)  # the targets keep the moved KV
    # the moved KV's owners hold the targets instead of window slots: the held count is what it
    # was, so every slot the take removed is back (the window's ``moves`` formerly held slots
    # are free now, the same number of targets are held)
    assert a.available_size() == free_before
    a.check_integrity()
