"""Where a new HOT extent of ``n`` contiguous slots can go in a token-granular slot space.

A slot is free (on the allocator's free list), movable (its KV belongs to an unlocked COLD
radix-tree node: no live row reads it, so it can be copied elsewhere and the node's value
rewritten), or blocked (a request's private KV, a locked node, a HOT extent, slot 0). A
window ``[w, w + n)`` is usable when it holds no blocked slot; making it an extent costs one
KV move per movable slot in it (to a free slot outside it):

    slot:   0  1  2  3  4  5  6  7  8  9 10 11
    state:  B  F  F  M  F  B  F  F  M  M  F  F        n = 4
    w=1:    [F  F  M  F]          1 move    <- chosen (fewest moves, then lowest start)
    w=6:                   [F  F  M  M]     2 moves
    w=2..5: hold the blocked slot 5

Pure torch on the slots' device: a few passes over ``size`` elements and one host sync for
the answer. Deterministic (lowest start among the cheapest windows), so TP ranks with the
same free lists and trees choose the same window.
"""

from typing import NamedTuple, Optional

import torch


class Window(NamedTuple):
    """The extent ``[start, start + n)``; ``moves`` of its slots hold movable KV."""

    start: int
    moves: int


def find_window(free: torch.Tensor, movable: torch.Tensor, n: int) -> Optional[Window]:
    """The cheapest usable window of ``n`` slots, or ``None`` if none exists or the free
    slots outside it could not take its movable KV.

    Args:
        free, movable: bool ``[num_slots]``, disjoint (slot ``i`` is entry ``i``).
        n: window length, >= 1.
    """
    if n <= 0:
        raise ValueError(f"find_window needs n >= 1, got {n}")
    num = free.numel()
    total_free = int(free.sum())
    if n > num or total_free < n:  # the moves need n - free_in_window free slots outside
        return None
    zero = torch.zeros(1, dtype=torch.int64, device=free.device)
    blocked = torch.cat([zero, torch.cumsum((~(free | movable)).to(torch.int64), 0)])
    frees = torch.cat([zero, torch.cumsum(free.to(torch.int64), 0)])
    blocked_in = blocked[n:] - blocked[:-n]  # [num - n + 1]: window w = [w, w + n)
    moves = n - (frees[n:] - frees[:-n])
    score = torch.where(blocked_in == 0, moves, torch.full_like(moves, n + 1))
    best = int(torch.argmin(score))  # first minimum: the lowest start
    best_moves = int(score[best])
    if best_moves > n:
        return None
    return Window(best, best_moves)


def find_window_reference(free: torch.Tensor, movable: torch.Tensor, n: int) -> Optional[Window]:
    """Slot-by-slot Python version of ``find_window`` (tests)."""
    f, m = free.tolist(), movable.tolist()
    if n > len(f) or sum(f) < n:
        return None
    best = None
    for w in range(len(f) - n + 1):
        if all(f[i] or m[i] for i in range(w, w + n)):
            cost = sum(1 for i in range(w, w + n) if not f[i])
            if best is None or cost < best.moves:
                best = Window(w, cost)
    return best
