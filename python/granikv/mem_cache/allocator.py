"""GraniKVAllocator: SGLang's page-size-1 token allocator whose free slots also make HOT extents.

One slot space, one free list, no carve-out:

    slot:  0 | 1 ........................................................... size |
           padding   | COLD | ext A | COLD  free  COLD | ext B |  free   COLD ...  |
           (never      free list = SGLang's free_pages / release_pages / free group:
            allocated) every slot that is neither COLD-owned nor in a HOT extent

- COLD allocation is exactly SGLang's ``TokenToKVPoolAllocator`` (``alloc`` / ``free`` / free
  groups / ``need_sort`` inherited); a fresh allocator's free list is ``arange(1, size + 1)``,
  as stock, so ``available_size()`` is the true number of slots a new request can take and a
  workload that never promotes gets exactly stock's token budget.
- A HOT extent is a contiguous range taken off the free list (``take_range`` /
  ``take_window``) or adopted from slots a tree node already owns (``adopt_extent``), and
  recorded in ``hot_pool``; ``free_extent`` gives its slots back to the free list. Which
  range to take and what to move out of it is the radix cache's decision.
- ``hot_capacity`` caps the slots extents may hold (``hot_fraction`` of the pool); it
  reserves nothing.

Owners (``check_integrity`` here: free slots unique, in ``[1, size]``, never inside an
extent; the radix cache's check adds the tree and the requests for exact accounting):
every slot of ``[1, size]`` is exactly one of free, a COLD node's, a request's private, or
an extent's. ``free(tensor)`` only ever receives COLD slots; ``debug_checks=True`` asserts it
(that check syncs the device, so it is off by default).
"""

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from granikv import sglang_compat as compat
from granikv.config import HOT_FRACTION_RANGE
from granikv.mem_cache.hot_pool import HotPool, IntegrityError
from granikv.mem_cache.hot_prefix_table import HotPrefixTable
from granikv.mem_cache.slot_window import Window, find_window

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache


def hot_cap(size: int, hot_fraction: float) -> int:
    """The most slots HOT extents may hold in a pool of ``size`` slots."""
    lo, hi = HOT_FRACTION_RANGE
    if not lo <= hot_fraction <= hi:
        raise ValueError(f"hot_fraction={hot_fraction} is outside [{lo:g}, {hi:g}]")
    return int(size * hot_fraction)


class GraniKVAllocator(TokenToKVPoolAllocator):
    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: "KVCache", need_sort: bool, *,
                 hot_fraction: float, debug_checks: bool = False) -> None:
        self.hot_fraction = hot_fraction
        self.debug_checks = debug_checks
        self.hot_pool = HotPool(1, size)  # laid out by clear()
        # Per-request HOT runs: written by the radix cache (scheduler), read by the attention
        # backend (model runner); both reach this allocator, so it holds the one table.
        self.hot_prefix_table: Optional[HotPrefixTable] = None
        super().__init__(size, dtype, device, kvcache, need_sort)  # calls clear()

    @classmethod
    def from_stock(cls, stock: TokenToKVPoolAllocator, *, hot_fraction: float,
                   debug_checks: bool = False) -> "GraniKVAllocator":
        """Same pool as SGLang's freshly built page-size-1 allocator, HOT extents enabled."""
        if type(stock) is not TokenToKVPoolAllocator:
            swa = "SWA" in type(stock).__name__
            raise ValueError(
                f"GraniKV replaces only SGLang's page-size-1 TokenToKVPoolAllocator, "
                f"got {type(stock).__name__} (page_size={getattr(stock, 'page_size', '?')}); "
                "hybrid / SWA / NPU / paged pools are not supported"
                + ("; for a sliding-window model pass --disable-hybrid-swa-memory (one KV pool for "
                   "every layer)" if swa else ""))
        return cls(stock.size, stock.dtype, stock.device, stock.get_kvcache(), stock.need_sort,
                   hot_fraction=hot_fraction, debug_checks=debug_checks)

    # ---- SGLang interface ------------------------------------------------------------------

    def clear(self) -> None:
        # also reached through resize(): the cap follows the (new) size; every extent goes
        super().clear()  # free_pages = arange(1, size + 1), free groups, release pages
        self.hot_capacity = hot_cap(self.size, self.hot_fraction)
        self.hot_pool.reset(1, self.size)

    def free(self, free_index: torch.Tensor) -> None:
        if self.debug_checks and free_index.numel():
            inside = self._in_extent(free_index)
            assert not bool(inside.any()), (
                f"GraniKVAllocator.free got {int(inside.sum())} slots of HOT extents; "
                "extents are freed through free_extent")
        super().free(free_index)

    # ---- HOT extents -----------------------------------------------------------------------

    @property
    def hot_used(self) -> int:
        return self.hot_pool.used_size

    def hot_room(self) -> int:
        """Slots a new extent may still take under the cap."""
        return self.hot_capacity - self.hot_pool.used_size

    def take_range(self, start: int, n: int, *, owned_after: int = 0) -> bool:
        """Make ``[start, start + n + owned_after)`` an extent if ``[start, start + n)`` is all
        free (syncs the device) and the ``owned_after`` slots after it are the caller's own
        (``adopt_extent``); ``False`` (nothing changed) otherwise.

            slot:  | start ... free ... | start+n ... the caller's ... |
                     taken off the free list   already owned (not free)
        """
        total = n + owned_after
        if (n <= 0 or start < 1 or start + total > self.size + 1
                or self.hot_pool.overlaps(start, total)):
            return False
        mask = self.free_mask()
        if not bool(mask[start : start + n].all()):
            return False
        self._take(mask, start, n, 0, extent_len=total)
        return True

    def find_window(self, n: int, movable: torch.Tensor, own: torch.Tensor) -> Optional[Window]:
        """The cheapest window for an extent of ``n`` slots (``slot_window.find_window``);
        ``movable``: bool ``[size + 1]``, slots whose KV the caller can move elsewhere;
        ``own``: the slots whose KV the extent will receive (they may lie inside it)."""
        free = self.free_mask()
        return find_window(free, movable & ~free, n, own & ~free)

    def window_at(self, start: int, n: int, movable: torch.Tensor,
                  own: torch.Tensor) -> Optional[Window]:
        """``[start, start + n)`` as a window (``find_window``'s rules) if it is usable there,
        else ``None`` (syncs the device)."""
        if start < 1 or start + n > self.size + 1 or self.hot_pool.overlaps(start, n):
            return None
        free = self.free_mask()
        span = slice(start, start + n)
        usable = free[span] | movable[span] | own[span]
        n_free, n_moves = int(free[span].sum()), int((movable[span] & ~free[span]).sum())
        if not bool(usable.all()) or n_moves > int(free.sum()) - n_free:
            return None
        return Window(start, n_moves)

    def take_window(self, window: Window, n: int) -> torch.Tensor:
        """Make ``[window.start, window.start + n)`` an extent; returns ``window.moves`` free
        slots outside it (lowest first), taken off the free list too: the caller moves the
        window's movable KV into them BEFORE anything is written into the extent."""
        return self._take(self.free_mask(), window.start, n, window.moves)

    def adopt_extent(self, start: int, n: int) -> None:
        """Make ``[start, start + n)``, slots the caller already owns (a node's own KV, never
        on the free list), an extent."""
        ok = self.hot_pool.alloc_at(start, n)
        assert ok, f"adopt_extent({start}, {n}) overlaps an extent"

    def free_extent(self, start: int, n: int) -> None:
        """Give the extent ``[start, start + n)`` back to the free list (no host sync)."""
        self.hot_pool.free(start, n)
        super().free(torch.arange(start, start + n, dtype=torch.int64, device=self.device))

    # ---- GraniKV ---------------------------------------------------------------------------

    def ensure_hot_prefix_table(self, num_rows: int) -> HotPrefixTable:
        """The shared HotPrefixTable (``num_rows`` = ``req_to_token`` rows), created once."""
        if self.hot_prefix_table is None:
            self.hot_prefix_table = HotPrefixTable(num_rows)
        elif self.hot_prefix_table.num_rows != num_rows:
            raise ValueError(f"HotPrefixTable has {self.hot_prefix_table.num_rows} rows, "
                             f"asked for {num_rows}")
        return self.hot_prefix_table

    def free_slots(self) -> torch.Tensor:
        """Every free slot, including pending release / free-group entries."""
        parts = [self.free_pages, self.release_pages] + compat.free_group_parts(self)
        return torch.cat([p.to(torch.int64) for p in parts])

    def free_mask(self) -> torch.Tensor:
        """bool ``[size + 1]``: slot ``i`` is free."""
        mask = torch.zeros(self.size + 1, dtype=torch.bool, device=self.device)
        mask[self.free_slots()] = True
        return mask

    def check_integrity(self) -> None:
        self.hot_pool.check_integrity()
        if self.hot_pool.used_size > self.hot_capacity:
            raise IntegrityError(f"GraniKVAllocator: extents hold {self.hot_pool.used_size} "
                                 f"slots, over the cap of {self.hot_capacity}")
        free = self.free_slots().cpu()
        if not free.numel():
            return
        lo, hi = int(free.min()), int(free.max())
        if lo < 1 or hi > self.size:
            raise IntegrityError(f"GraniKVAllocator: free slot outside [1, {self.size}]: "
                                 f"min {lo}, max {hi}")
        dupes = free.numel() - torch.unique(free).numel()
        if dupes:
            raise IntegrityError(f"GraniKVAllocator: {dupes} slots are free twice")
        inside = int(self._in_extent(free).sum())
        if inside:
            raise IntegrityError(f"GraniKVAllocator: {inside} free slots lie inside HOT extents")

    # ---- internals -------------------------------------------------------------------------

    def _take(self, mask: torch.Tensor, start: int, n: int, extra: int, *,
              extent_len: Optional[int] = None) -> torch.Tensor:
        """Take ``[start, start + n)`` and the ``extra`` lowest free slots outside it off the
        free list (which is rebuilt sorted, release pages merged); record the extent.

            free before:  . F F . F F F F . F F . F    window [4, 8), extra 2
            taken:        extent [4, 8);  extra: slots 1, 2
            free after:   . . . . . . . . . F F . F
        """
        assert compat.outside_free_group(self), "extents are taken outside SGLang's free groups"
        ok = self.hot_pool.alloc_at(start, n if extent_len is None else extent_len)
        assert ok, f"take: [{start}, {start + n}) overlaps an extent"
        mask[start : start + n] = False
        rest = torch.nonzero(mask).flatten()
        self.free_pages = rest[extra:]
        self.release_pages = rest[:0]
        return rest[:extra]

    def _in_extent(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per slot: inside some HOT extent."""
        inside = torch.zeros_like(slots, dtype=torch.bool)
        for s, n in self.hot_pool.extents().items():
            inside |= (slots >= s) & (slots < s + n)
        return inside
