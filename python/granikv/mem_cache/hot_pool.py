"""HotPool: host-side registry of the HOT extents inside the slot range ``[base, base + span)``.

Pure bookkeeping (python ints, no tensors, no device work): it records WHERE extents live.
HOT extents have no region of their own: they are carved out of the same free slots as
every request's KV (the allocator takes them off its free list and gives them back), so a
gap between extents is simply "not HOT" (free, COLD tree KV or a request's private KV:
the allocator and the radix cache know which). Moving KV is ``kv_copy``'s job, deciding
WHAT is hot the radix cache's.

    slot:  base                                                              base+span
           |  ext A  |  gap  |   ext B   | ext C |            gap             |
           ^ extents: start -> len   ^ gaps: sorted, disjoint, coalesced

Invariants (``check_integrity``): extents + gaps tile the range, everything disjoint, gaps
never touch (coalesced on ``free``), the used counter == the sum of extent lengths.
"""

import bisect
from typing import Dict, List, Tuple


class IntegrityError(AssertionError):
    """An executable invariant of a GraniKV storage structure does not hold."""


class HotPool:
    """Extent registry with exact-range allocation, coalescing frees and splits.

    Every result depends only on the call sequence (TP ranks run identical schedulers and
    must agree).
    """

    def __init__(self, base: int, span: int) -> None:
        self.reset(base, span)

    def reset(self, base: int, span: int) -> None:
        if base < 0 or span < 0:
            raise ValueError(f"HotPool needs base >= 0 and span >= 0, got {base}, {span}")
        self.base = base
        self.span = span
        self._extents: Dict[int, int] = {}
        # gaps (slots of no extent) as two parallel sorted lists (starts, lengths)
        self._gap_starts: List[int] = [base] if span else []
        self._gap_lens: List[int] = [span] if span else []
        self._used = 0

    # ---- queries ---------------------------------------------------------------------------

    @property
    def end(self) -> int:
        return self.base + self.span

    @property
    def used_size(self) -> int:
        """Slots held by extents."""
        return self._used

    def extents(self) -> Dict[int, int]:
        """A copy of the extents, ``start -> length``."""
        return dict(self._extents)

    def gaps(self) -> List[Tuple[int, int]]:
        """``(start, length)`` of every maximal span that no extent holds."""
        return list(zip(self._gap_starts, self._gap_lens, strict=True))

    def overlaps(self, start: int, n: int) -> bool:
        """Whether ``[start, start + n)`` intersects an extent (or leaves the range)."""
        if n <= 0:
            return False
        i = bisect.bisect_right(self._gap_starts, start) - 1
        return i < 0 or start + n > self._gap_starts[i] + self._gap_lens[i]

    # ---- allocation ------------------------------------------------------------------------

    def alloc_at(self, start: int, n: int) -> bool:
        """Record the extent ``[start, start + n)`` if no extent holds any of its slots;
        ``False`` otherwise. The caller owns the slots (taken off the free list, or a tree
        node's own slots that become the extent)."""
        if n <= 0:
            raise ValueError(f"HotPool.alloc_at needs n >= 1, got {n}")
        if self.overlaps(start, n):
            return False
        i = bisect.bisect_right(self._gap_starts, start) - 1
        g_start, g_len = self._gap_starts[i], self._gap_lens[i]
        # carve [start, start + n) out of the gap [g_start, g_start + g_len)
        before, after = start - g_start, g_start + g_len - (start + n)
        del self._gap_starts[i], self._gap_lens[i]
        if after:
            self._gap_starts.insert(i, start + n)
            self._gap_lens.insert(i, after)
        if before:
            self._gap_starts.insert(i, g_start)
            self._gap_lens.insert(i, before)
        self._extents[start] = n
        self._used += n
        return True

    def free(self, start: int, n: int) -> None:
        """Drop the extent ``[start, start + n)`` exactly as recorded (or split)."""
        got = self._extents.get(start)
        assert got == n, f"HotPool.free({start}, {n}): the extent there has length {got}"
        del self._extents[start]
        self._used -= n
        self._insert_gap(start, n)

    def split(self, start: int, first_len: int) -> int:
        """Split extent ``[start, start+L)`` into ``[start, start+first_len)`` and the rest.

        Returns the start of the second part. Used when the radix tree splits a HOT node.
        """
        total = self._extents.get(start)
        assert total is not None, f"HotPool.split({start}): no extent starts there"
        assert 0 < first_len < total, f"HotPool.split: first_len {first_len} not in (0, {total})"
        self._extents[start] = first_len
        self._extents[start + first_len] = total - first_len
        return start + first_len

    def _insert_gap(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._gap_starts, start)
        merge_prev = i > 0 and self._gap_starts[i - 1] + self._gap_lens[i - 1] == start
        merge_next = i < len(self._gap_starts) and start + n == self._gap_starts[i]
        if merge_prev and merge_next:
            self._gap_lens[i - 1] += n + self._gap_lens[i]
            del self._gap_starts[i], self._gap_lens[i]
        elif merge_prev:
            self._gap_lens[i - 1] += n
        elif merge_next:
            self._gap_starts[i] = start
            self._gap_lens[i] += n
        else:
            self._gap_starts.insert(i, start)
            self._gap_lens.insert(i, n)

    # ---- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        spans = [(s, n, "extent") for s, n in self._extents.items()]
        spans += [(s, n, "gap") for s, n in zip(self._gap_starts, self._gap_lens, strict=True)]
        spans.sort()
        cursor = self.base
        for start, length, kind in spans:
            if length <= 0:
                raise IntegrityError(f"HotPool: {kind} at {start} has length {length}")
            if start != cursor:
                raise IntegrityError(
                    f"HotPool: {kind} at {start} but the previous span ends at {cursor} "
                    f"({'overlap' if start < cursor else 'unaccounted slots'})")
            cursor = start + length
        if cursor != self.end:
            raise IntegrityError(f"HotPool: spans end at {cursor}, range ends at {self.end}")
        for i in range(1, len(self._gap_starts)):
            if self._gap_starts[i - 1] + self._gap_lens[i - 1] >= self._gap_starts[i]:
                raise IntegrityError(f"HotPool: gaps {i - 1} and {i} are not coalesced")
        used = sum(self._extents.values())
        if used != self._used or used + sum(self._gap_lens) != self.span:
            raise IntegrityError(
                f"HotPool: gaps {sum(self._gap_lens)} + extents {used} != span {self.span} "
                f"(used counter {self._used})")
