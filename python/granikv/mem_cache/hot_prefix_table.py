"""HotPrefixTable: per ``req_pool_idx``, the HOT run a request's KV starts with.

    row r (= req_pool_idx):  start[r], length[r]
    req_to_token[r, 0:length[r]] == arange(start[r], start[r] + length[r])   (length 0: none)

Device tensors ``start_dev`` / ``length_dev`` (int32 ``[num_rows]``, fixed addresses, so a
captured CUDA graph reads the current values on replay) and numpy mirrors ``start_np`` /
``length_np`` (int64) for host-side planning. Row 0 is SGLang's padding row and stays (0, 0).
Writes are stream-ordered on the current stream and never sync; writes that would not
change a row are dropped.
"""

import numpy as np
import torch

from granikv.mem_cache.hot_pool import IntegrityError


class HotPrefixTable:
    def __init__(self, num_rows: int, device):
        if num_rows < 1:
            raise ValueError(f"HotPrefixTable needs num_rows >= 1 (row 0 is padding), got {num_rows}")
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.start_dev = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
        self.length_dev = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
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
        """Set several rows with one scatter per tensor (only rows that change)."""
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
        # One H2D copy from pinned memory, non-blocking (PyTorch keeps the pinned block alive
        # until the copy is done), then two scatters: no host sync on the serving path.
        packed = torch.from_numpy(np.stack([rows, starts, lengths]).astype(np.int32))
        if self.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        idx = packed[0].long()
        self.start_dev[idx] = packed[1]
        self.length_dev[idx] = packed[2]

    def reset(self) -> None:
        self.version += 1
        self.start_np[:] = 0
        self.length_np[:] = 0
        self.start_dev.zero_()
        self.length_dev.zero_()

    def check_integrity(self) -> None:
        """Device == mirror, row 0 is (0, 0), lengths >= 0 (syncs the device)."""
        if self.start_np[0] or self.length_np[0]:
            raise IntegrityError("HotPrefixTable: padding row 0 is not (0, 0)")
        if (self.length_np < 0).any():
            raise IntegrityError("HotPrefixTable: negative length")
        for name, dev, host in (("start", self.start_dev, self.start_np),
                                ("length", self.length_dev, self.length_np)):
            diff = np.nonzero(dev.cpu().numpy().astype(np.int64) != host)[0]
            if diff.size:
                raise IntegrityError(f"HotPrefixTable: {name}_dev != {name}_np at rows {diff[:8]}")
