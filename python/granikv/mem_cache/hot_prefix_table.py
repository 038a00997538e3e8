"""HotPrefixTable: per ``req_pool_idx``, the HOT run a request's KV starts with.

    row r (= req_pool_idx):  start[r], length[r]
    req_to_token[r, 0:length[r]] == arange(start[r], start[r] + length[r])   (length 0: none)

Host-only numpy arrays ``start_np`` / ``length_np`` (int64), read by the per-step planning
(decode grouping, extend plan); no kernel reads the table, so it has no device copy (the plan
uploads what the kernels need into their workspace). Row 0 is SGLang's padding row and stays
(0, 0); a row without a HOT run is stored as (0, 0).
"""

import numpy as np

from granikv.mem_cache.hot_pool import IntegrityError


class HotPrefixTable:
    def __init__(self, num_rows: int):
        if num_rows < 1:
            raise ValueError(f"HotPrefixTable needs num_rows >= 1 (row 0 is padding), got {num_rows}")
        self.num_rows = num_rows
        self.start_np = np.zeros(num_rows, dtype=np.int64)
        self.length_np = np.zeros(num_rows, dtype=np.int64)
        self.version = 0  # +1 on every change (readers cache what they derived from the table)

    def get(self, row: int) -> tuple:
        return int(self.start_np[row]), int(self.length_np[row])

    def set(self, row: int, start: int, length: int) -> None:
        self.set_many([row], [start], [length])

    def clear(self, row: int) -> None:
        self.set_many([row], [0], [0])

    def set_many(self, rows, starts, lengths) -> None:
        """Set several rows at once."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if rows.size and (rows.min() < 1 or rows.max() >= self.num_rows):
            raise ValueError(f"HotPrefixTable rows must be in [1, {self.num_rows}), got "
                             f"[{rows.min()}, {rows.max()}]")
        starts = np.where(lengths > 0, starts, 0)  # (start, 0) is stored as (0, 0)
        changed = (self.start_np[rows] != starts) | (self.length_np[rows] != lengths)
        if not changed.any():
            return
        rows, starts, lengths = rows[changed], starts[changed], lengths[changed]
        self.version += 1
        self.start_np[rows] = starts
        self.length_np[rows] = lengths

    def reset(self) -> None:
        self.version += 1
        self.start_np[:] = 0
        self.length_np[:] = 0

    def check_integrity(self) -> None:
        """Row 0 is (0, 0), lengths >= 0, rows without a HOT run are (0, 0)."""
        if self.start_np[0] or self.length_np[0]:
            raise IntegrityError("HotPrefixTable: padding row 0 is not (0, 0)")
        if (self.length_np < 0).any():
            raise IntegrityError("HotPrefixTable: negative length")
        stray = np.nonzero((self.length_np == 0) & (self.start_np != 0))[0]
        if stray.size:
            raise IntegrityError(f"HotPrefixTable: rows {stray[:8]} have a start but no length")
