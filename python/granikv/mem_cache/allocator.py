"""GraniKVAllocator: SGLang's page-size-1 token allocator over COLD, plus the HOT HotPool.

    slot:  0 | 1 ..................... hot_base-1 | hot_base .............. size |
           ^   COLD: SGLang's free_pages logic      HOT: HotPool extents
           padding slot (never allocated)           (hot_capacity = size + 1 - hot_base)

- COLD is exactly SGLang's ``TokenToKVPoolAllocator`` with ``free_pages`` starting as
  ``arange(1, hot_base)``; ``alloc`` / ``free`` / free groups / ``need_sort`` are inherited.
- HOT slots are owned by radix-tree nodes only (a request never allocates them), so
  ``free(tensor)`` only ever receives COLD slots; ``debug_checks=True`` asserts it (that
  check syncs the device, so it is off by default).
- ``available_size()`` counts COLD only: the HOT capacity is reserved for extents and can
  never satisfy a request's allocation. The plugin therefore sets SGLang's
  ``max_total_num_tokens`` to ``cold_capacity``, so its admission budget and its idle leak
  check (``available + evictable + protected == max_total_num_tokens``) stay exact with the
  radix cache's COLD-only evictable / protected sizes.
"""

from typing import Optional

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from granikv import sglang_compat as compat
from granikv.mem_cache.hot_pool import HotPool, IntegrityError
from granikv.mem_cache.hot_prefix_table import HotPrefixTable


def hot_layout(size: int, hot_fraction: float) -> tuple:
    """``(hot_base, hot_capacity)`` for a pool of ``size`` slots (slot 0 excluded)."""
    if not 0.0 <= hot_fraction < 1.0:
        raise ValueError(f"hot_fraction={hot_fraction} is outside [0, 1)")
    hot_capacity = int(size * hot_fraction)
    return size + 1 - hot_capacity, hot_capacity


class GraniKVAllocator(TokenToKVPoolAllocator):
    def __init__(self, size: int, dtype: torch.dtype, device, kvcache, need_sort: bool, *,
                 hot_fraction: float, debug_checks: bool = False):
        self.hot_fraction = hot_fraction
        self.debug_checks = debug_checks
        self.hot_pool = HotPool(size + 1, 0)  # laid out by clear()
        # Per-request HOT runs: written by the radix cache (scheduler), read by the attention
        # backend (model runner); both reach this allocator, so it holds the one table.
        self.hot_prefix_table: Optional[HotPrefixTable] = None
        super().__init__(size, dtype, device, kvcache, need_sort)  # calls clear()

    @classmethod
    def from_stock(cls, stock: TokenToKVPoolAllocator, *, hot_fraction: float,
                   debug_checks: bool = False) -> "GraniKVAllocator":
        """Same pool as SGLang's freshly built page-size-1 allocator, with a HOT region."""
        if type(stock) is not TokenToKVPoolAllocator:
            raise ValueError(
                f"GraniKV replaces only SGLang's page-size-1 TokenToKVPoolAllocator, "
                f"got {type(stock).__name__} (page_size={getattr(stock, 'page_size', '?')}); "
                "hybrid / SWA / NPU / paged pools are not supported")
        return cls(stock.size, stock.dtype, stock.device, stock.get_kvcache(), stock.need_sort,
                   hot_fraction=hot_fraction, debug_checks=debug_checks)

    # ---- SGLang interface ------------------------------------------------------------------

    def clear(self):
        # also reached through resize(): the HOT layout follows the (new) size
        super().clear()  # free_pages = arange(1, size + 1), free groups, release pages
        self.hot_base, self.hot_capacity = hot_layout(self.size, self.hot_fraction)
        self.hot_pool.reset(self.hot_base, self.hot_capacity)
        self.free_pages = self.free_pages[: self.hot_base - 1]  # COLD = [1, hot_base)

    def free(self, free_index: torch.Tensor):
        if self.debug_checks and free_index.numel():
            hot = free_index >= self.hot_base
            assert not bool(hot.any()), (
                f"GraniKVAllocator.free got {int(hot.sum())} HOT slots (>= {self.hot_base}); "
                "HOT extents are freed through hot_pool.free")
        super().free(free_index)

    # ---- GraniKV ---------------------------------------------------------------------------

    def ensure_hot_prefix_table(self, num_rows: int) -> HotPrefixTable:
        """The shared HotPrefixTable (``num_rows`` = ``req_to_token`` rows), created once."""
        if self.hot_prefix_table is None:
            self.hot_prefix_table = HotPrefixTable(num_rows)
        elif self.hot_prefix_table.num_rows != num_rows:
            raise ValueError(f"HotPrefixTable has {self.hot_prefix_table.num_rows} rows, "
                             f"asked for {num_rows}")
        return self.hot_prefix_table

    @property
    def cold_capacity(self) -> int:
        return self.hot_base - 1

    def cold_free_slots(self) -> torch.Tensor:
        """Every free COLD slot, including pending release / free-group entries (debug use)."""
        parts = [self.free_pages, self.release_pages] + compat.free_group_parts(self)
        return torch.cat([p.to(torch.int64) for p in parts])

    def check_integrity(self) -> None:
        free = self.cold_free_slots().cpu()
        if free.numel():
            lo, hi = int(free.min()), int(free.max())
            if lo < 1 or hi >= self.hot_base:
                raise IntegrityError(
                    f"GraniKVAllocator: free COLD slot outside [1, {self.hot_base}): "
                    f"min {lo}, max {hi}")
            dupes = free.numel() - torch.unique(free).numel()
            if dupes:
                raise IntegrityError(f"GraniKVAllocator: {dupes} COLD slots are free twice")
        self.hot_pool.check_integrity()
