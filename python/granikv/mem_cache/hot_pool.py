"""HotPool: host-side extent allocator over the HOT slot range ``[base, base + capacity)``.

Pure bookkeeping (python ints, no tensors, no device work): it decides WHERE extents live;
moving KV is ``kv_copy``'s job, and deciding WHAT is hot is the radix cache's.

    slot:  base                                                         base+capacity
           |  ext A  |  free  |   ext B   | ext C |      free       |
           ^ allocated extents: start -> len     ^ free intervals: sorted, disjoint, coalesced

Invariants (``check_integrity``): free + allocated == capacity, everything disjoint and inside
the range, free intervals never touch (they are coalesced on ``free``).
"""

import bisect
from typing import Dict, List, NamedTuple, Optional


class IntegrityError(AssertionError):
    """An executable invariant of a GraniKV storage structure does not hold."""


class Move(NamedTuple):
    """Move the extent ``[src, src + length)`` to ``[dst, dst + length)``; ``dst < src``."""

    src: int
    dst: int
    length: int


class CompactionPlan(NamedTuple):
    moves: List[Move]
    largest_hole: int  # the largest free interval once every move is applied


class HotPoolStats(NamedTuple):
    capacity: int
    used: int
    free: int
    num_extents: int
    num_holes: int
    largest_hole: int


class HotPool:
    """Best-fit extent allocator with coalescing frees, splits and compaction plans.

    ``alloc`` returns ``None`` when no hole fits (never raises for "full").
    Ties in best fit go to the lowest start, so the result depends only on the call sequence
    (TP ranks run identical schedulers and must agree).
    """

    def __init__(self, base: int, capacity: int):
        self.reset(base, capacity)

    def reset(self, base: int, capacity: int) -> None:
        if base < 0 or capacity < 0:
            raise ValueError(f"HotPool needs base >= 0 and capacity >= 0, got {base}, {capacity}")
        self.base = base
        self.capacity = capacity
        self._extents: Dict[int, int] = {}
        # free intervals as two parallel sorted lists (starts, lengths)
        self._free_starts: List[int] = [base] if capacity else []
        self._free_lens: List[int] = [capacity] if capacity else []
        self._used = 0

    # ---- queries ---------------------------------------------------------------------------

    @property
    def end(self) -> int:
        return self.base + self.capacity

    @property
    def used_size(self) -> int:
        return self._used

    @property
    def free_size(self) -> int:
        return self.capacity - self._used

    def extents(self) -> Dict[int, int]:
        """A copy of the allocated extents, ``start -> length``."""
        return dict(self._extents)

    def holes(self) -> List[tuple]:
        return list(zip(self._free_starts, self._free_lens))

    def largest_hole(self) -> int:
        return max(self._free_lens, default=0)

    def stats(self) -> HotPoolStats:
        return HotPoolStats(self.capacity, self._used, self.free_size, len(self._extents),
                            len(self._free_starts), self.largest_hole())

    # ---- allocation ------------------------------------------------------------------------

    def alloc(self, n: int) -> Optional[int]:
        """Start of a fresh extent of ``n`` slots (best fit), or ``None`` if no hole fits."""
        if n <= 0:
            raise ValueError(f"HotPool.alloc needs n >= 1, got {n}")
        best = None
        for i, length in enumerate(self._free_lens):
            if length >= n and (best is None or length < self._free_lens[best]):
                best = i
                if length == n:
                    break
        if best is None:
            return None
        start = self._free_starts[best]
        self.alloc_at(start, n)  # the front of the best hole
        return start

    def alloc_at(self, start: int, n: int) -> bool:
        """Allocate exactly ``[start, start + n)`` if those slots are all free (one hole holds
        them); ``False`` otherwise. Used to extend a HOT run in place."""
        if n <= 0:
            raise ValueError(f"HotPool.alloc_at needs n >= 1, got {n}")
        i = bisect.bisect_right(self._free_starts, start) - 1
        if i < 0:
            return False
        h_start, h_len = self._free_starts[i], self._free_lens[i]
        if start + n > h_start + h_len:
            return False
        # carve [start, start + n) out of the hole [h_start, h_start + h_len)
        before, after = start - h_start, h_start + h_len - (start + n)
        del self._free_starts[i], self._free_lens[i]
        if after:
            self._free_starts.insert(i, start + n)
            self._free_lens.insert(i, after)
        if before:
            self._free_starts.insert(i, h_start)
            self._free_lens.insert(i, before)
        self._extents[start] = n
        self._used += n
        return True

    def free(self, start: int, n: int) -> None:
        """Return the allocated extent ``[start, start + n)`` exactly as allocated (or split)."""
        got = self._extents.get(start)
        assert got == n, f"HotPool.free({start}, {n}): allocated extent there has length {got}"
        del self._extents[start]
        self._used -= n
        self._insert_free(start, n)

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

    def _insert_free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        merge_prev = i > 0 and self._free_starts[i - 1] + self._free_lens[i - 1] == start
        merge_next = i < len(self._free_starts) and start + n == self._free_starts[i]
        if merge_prev and merge_next:
            self._free_lens[i - 1] += n + self._free_lens[i]
            del self._free_starts[i], self._free_lens[i]
        elif merge_prev:
            self._free_lens[i - 1] += n
        elif merge_next:
            self._free_starts[i] = start
            self._free_lens[i] += n
        else:
            self._free_starts.insert(i, start)
            self._free_lens.insert(i, n)

    # ---- compaction ------------------------------------------------------------------------

    def compaction_plan(self, locked_starts) -> CompactionPlan:
        """Slide every unlocked extent down as far as it goes; locked extents stay put.

            before:  | A |....| B(locked) |..| C |.....| D |......|
            after:   | A |....| B(locked) | C | D |...............|
                          ^ a hole below a locked extent stays

        Each unlocked extent moves to the lowest free slot above the previous extent, so with
        no locked extent the result is one hole at the top. Moves are in ascending order and
        must be applied in that order (a move may overlap its own source: ``dst < src``).
        """
        locked = set(locked_starts)
        cursor, moves, holes = self.base, [], []
        for start in sorted(self._extents):
            length = self._extents[start]
            if start in locked:
                holes.append(start - cursor)
                cursor = start + length
                continue
            if start != cursor:
                moves.append(Move(start, cursor, length))
            cursor += length
        holes.append(self.end - cursor)
        return CompactionPlan(moves, max(holes, default=0))

    def apply_move(self, move: Move) -> None:
        """Record that the extent at ``move.src`` now lives at ``move.dst`` (KV already moved)."""
        src, dst, length = move
        assert self._extents.get(src) == length, f"apply_move: no extent of {length} at {src}"
        del self._extents[src]
        self._extents[dst] = length
        self._rebuild_free()

    def _rebuild_free(self) -> None:
        self._free_starts, self._free_lens = [], []
        cursor = self.base
        for start in sorted(self._extents):
            if start > cursor:
                self._free_starts.append(cursor)
                self._free_lens.append(start - cursor)
            cursor = start + self._extents[start]
        if cursor < self.end:
            self._free_starts.append(cursor)
            self._free_lens.append(self.end - cursor)

    # ---- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        spans = [(s, n, "extent") for s, n in self._extents.items()]
        spans += [(s, n, "hole") for s, n in zip(self._free_starts, self._free_lens)]
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
        for i in range(1, len(self._free_starts)):
            if self._free_starts[i - 1] + self._free_lens[i - 1] >= self._free_starts[i]:
                raise IntegrityError(f"HotPool: holes {i - 1} and {i} are not coalesced")
        used = sum(self._extents.values())
        if used != self._used or used + sum(self._free_lens) != self.capacity:
            raise IntegrityError(
                f"HotPool: free {sum(self._free_lens)} + allocated {used} != capacity "
                f"{self.capacity} (used counter {self._used})")
