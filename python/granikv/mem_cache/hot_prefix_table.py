"""HotPrefixTable: per ``req_pool_idx``, the HOT run a request's KV starts with.

    row r (= req_pool_idx):  start[r], length[r]
    req_to_token[r, 0:length[r]] == arange(start[r], start[r] + length[r])   (length 0: none)

Host-only numpy arrays ``start_np`` / ``length_np`` (int64), read by the per-step planning
(decode grouping, extend plan); no kernel reads the table, so it has no device copy (the plan
uploads what the kernels need into their workspace). Row 0 is SGLang's padding row and stays
(0, 0); a row without a HOT run is stored as (0, 0).

``rows_held`` counts the rows with a HOT run, kept by every write: while it is 0 no request
can be grouped, and a decode step's planning is skipped whole (``DecodePlanner.plan_step``).
"""

from typing import Any, Sequence, Tuple, cast

import numpy as np
from numpy.typing import ArrayLike

from granikv.mem_cache.hot_pool import IntegrityError


class HotPrefixTable:
    def __init__(self, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError(f"HotPrefixTable needs num_rows >= 1 (row 0 is padding), got {num_rows}")
        self.num_rows = num_rows
        self.start_np = np.zeros(num_rows, dtype=np.int64)
        self.length_np = np.zeros(num_rows, dtype=np.int64)
        self.version = 0  # +1 on every change (readers cache what they derived from the table)
        self.rows_held = 0  # rows with a HOT run (length > 0)

    def get(self, row: int) -> Tuple[int, int]:
        return int(self.start_np[row]), int(self.length_np[row])

    def set(self, row: int, start: int, length: int) -> None:
        self.set_many([row], [start], [length])

    def clear(self, row: int) -> None:
        self.set_many([row], [0], [0])

    def set_many(self, rows: ArrayLike, starts: ArrayLike, lengths: ArrayLike) -> None:
        """Set several rows at once."""
        if isinstance(rows, (list, tuple, np.ndarray)) and len(rows) == 1:  # one request's publish or release
            one = cast(Sequence[Any], rows), cast(Sequence[Any], starts), cast(Sequence[Any], lengths)
            self._set_one(int(one[0][0]), int(one[1][0]), int(one[2][0]))
            return
        row_arr = np.asarray(rows, dtype=np.int64)
        start_arr = np.asarray(starts, dtype=np.int64)
        len_arr = np.asarray(lengths, dtype=np.int64)
        if row_arr.size and (row_arr.min() < 1 or row_arr.max() >= self.num_rows):
            raise ValueError(f"HotPrefixTable rows must be in [1, {self.num_rows}), got "
                             f"[{row_arr.min()}, {row_arr.max()}]")
        start_arr = np.where(len_arr > 0, start_arr, 0)  # (start, 0) is stored as (0, 0)
        changed = (self.start_np[row_arr] != start_arr) | (self.length_np[row_arr] != len_arr)
        if not changed.any():
            return
        row_arr, start_arr, len_arr = row_arr[changed], start_arr[changed], len_arr[changed]
        self.version += 1
        touched = np.unique(row_arr)  # a row given twice counts once (numpy keeps its last value)
        before = np.count_nonzero(self.length_np[touched])
        self.start_np[row_arr] = start_arr
        self.length_np[row_arr] = len_arr
        self.rows_held += int(np.count_nonzero(self.length_np[touched]) - before)

    def _set_one(self, row: int, start: int, length: int) -> None:
        """``set_many`` of one row, on Python ints (a request's publish or release, several per
        request: the array path's temporaries cost about 10 µs there)."""
        if not 1 <= row < self.num_rows:
            raise ValueError(f"HotPrefixTable rows must be in [1, {self.num_rows}), got [{row}, {row}]")
        if length <= 0:
            start = 0  # (start, 0) is stored as (0, 0)
        old_length = int(self.length_np[row])
        if old_length == length and int(self.start_np[row]) == start:
            return
        self.version += 1
        self.start_np[row] = start
        self.length_np[row] = length
        self.rows_held += (length != 0) - (old_length != 0)

    def reset(self) -> None:
        self.version += 1
        self.rows_held = 0
        self.start_np[:] = 0
        self.length_np[:] = 0

    def check_integrity(self) -> None:
        """Row 0 is (0, 0), lengths >= 0, rows without a HOT run are (0, 0), ``rows_held`` counts
        the rows with one."""
        if self.start_np[0] or self.length_np[0]:
            raise IntegrityError("HotPrefixTable: padding row 0 is not (0, 0)")
        if (self.length_np < 0).any():
            raise IntegrityError("HotPrefixTable: negative length")
        stray = np.nonzero((self.length_np == 0) & (self.start_np != 0))[0]
        if stray.size:
            raise IntegrityError(f"HotPrefixTable: rows {stray[:8]} have a start but no length")
        held = int(np.count_nonzero(self.length_np))
        if held != self.rows_held:
            raise IntegrityError(f"HotPrefixTable: rows_held {self.rows_held}, but {held} rows have a HOT run")
