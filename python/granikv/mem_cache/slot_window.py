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


def find_window(free: torch.Tensor, movable: torch.Tensor, n: int,
                own: Optional[torch.Tensor] = None) -> Optional[Window]:
    """The cheapest usable window of ``n`` slots, or ``None`` if none exists or the free
    slots outside it could not take its movable KV.

    Args:
        free, movable: bool ``[num_slots]``, disjoint (slot ``i`` is entry ``i``).
        n: window length, >= 1.
        own: bool ``[num_slots]`` or None: slots whose KV is the source of the new extent
            itself (the node being promoted): usable without a move, but not free.
    """
    if n <= 0:
        raise ValueError(f"find_window needs n >= 1, got {n}")
    own = torch.zeros_like(free) if own is None else own
    num = free.numel()
    total_free = int(free.sum())
    if n > num:
        return None
    zero = torch.zeros(1, dtype=torch.int64, device=free.device)

    def per_window(mask: torch.Tensor) -> torch.Tensor:  # [num - n + 1]: count of ``mask`` in window w = [w, w + n)
        c = torch.cat([zero, torch.cumsum(mask.to(torch.int64), 0)])
        return c[n:] - c[:-n]

    blocked_in = per_window(~(free | movable | own))
    free_in = per_window(free)
    moves = n - free_in - per_window(own)
    feasible = (blocked_in == 0) & (moves <= total_free - free_in)  # room for the moves
    score = torch.where(feasible, moves, torch.full_like(moves, n + 1))
    best = int(torch.argmin(score))  # first minimum: the lowest start
    best_moves = int(score[best])
    if best_moves > n:
        return None
    return Window(best, best_moves)


def find_window_reference(free: torch.Tensor, movable: torch.Tensor, n: int,
                          own: Optional[torch.Tensor] = None) -> Optional[Window]:
    """Slot-by-slot Python version of ``find_window`` (tests)."""
    f, m = free.tolist(), movable.tolist()
    o = [False] * len(f) if own is None else own.tolist()
    best = None
    for w in range(len(f) - n + 1):
        span = range(w, w + n)
        if all(f[i] or m[i] or o[i] for i in span):
            cost = sum(1 for i in span if m[i] and not f[i])
            room = sum(f) - sum(1 for i in span if f[i])
            if cost <= room and (best is None or cost < best.moves):
                best = Window(w, cost)
    return best
