"""A device metadata block uploaded from a ring of pinned host staging buffers.

Each upload writes one staging buffer on the host and copies it whole to the device block
with one non-blocking copy and one event record. A buffer is written again only once the copy
that last read it is known done (``StagingRing._claim``), so host writes never race a pending
copy, and in steady state the host waits on an event only once per ``staging_buffers // 2``
uploads. The last ``max_rows`` ints of the block hold the batch's request-pool rows, written
from the host or copied device-to-device (``_copy_up``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from granikv.attention.decode.reuse_base import ReuseBase

StagedRows = Tuple[np.ndarray, int]  # a host rows array and how many of its rows a buffer holds


class StagingRing:
    """Base of ``CascadeWorkspace``: the device block ``meta`` and its host staging ring.

    Host state per buffer k: ``_host[k]`` (pinned on CUDA) and its numpy view ``_host_np[k]``,
    ``_events[k]`` (recorded after the last copy out of k), ``_buf_upload[k]`` (the number of
    the upload that last read k), ``_host_rows[k]`` (the rows array and count k holds) and
    ``_host_base[k]`` (the build whose work list k holds; set by the workspace).
    """

    def _init_ring(self, meta_len: int, rows_offset: int, max_rows: int, device: torch.device,
                   staging_buffers: int) -> None:
        if staging_buffers < 2:
            raise ValueError(f"staging_buffers={staging_buffers} must be >= 2")
        pin = device.type == "cuda"
        self._cuda = pin
        nbuf = self.staging_buffers = staging_buffers
        self._rows_offset = rows_offset
        self._host = [torch.zeros(meta_len, dtype=torch.int32, pin_memory=pin) for _ in range(nbuf)]
        self._host_np = [h.numpy() for h in self._host]
        # event recorded after the last copy out of each buffer
        self._events: List[Optional[torch.cuda.Event]] = [None] * nbuf
        self._buf_upload = [-1] * nbuf  # number of the upload that last read each buffer
        self._uploads = 0  # uploads issued so far (the next one's number)
        self._done_upto = -1  # every upload numbered <= this one has completed (see _claim)
        self._flip = 0  # the next staging buffer (the ring's position)
        # the build whose work list each pinned buffer holds
        self._host_base: List[Optional[ReuseBase]] = [None] * nbuf
        self._host_rows: List[Optional[StagedRows]] = [None] * nbuf  # (rows array, n) each buffer holds (_copy_up)
        self._rows_up: Optional[StagedRows] = None  # (host rows array, n) of the last upload (None: device rows)
        self.meta = torch.zeros(meta_len, dtype=torch.int32, device=device)
        self.req_pool_indices = self.meta[rows_offset : rows_offset + max_rows]
        self.upload_wait_seconds = 0.0  # host time spent waiting for a staging buffer's last copy
        self.upload_seconds = 0.0  # host time of uploads: those waits + the copies (and events)
        self.upload_waits = 0  # event synchronizations (one per staging_buffers // 2 uploads, steady)

    def _next_buffer(self) -> int:
        """The pinned staging buffer to write this step (a ring of ``staging_buffers``), once
        the copy that last read it is done."""
        k = self._flip
        self._flip = k + 1 if k + 1 < self.staging_buffers else 0
        if self._buf_upload[k] > self._done_upto:
            self._claim(k)
        return k

    def _claim(self, k: int) -> None:
        """Waits until the copy that last read buffer ``k`` is done (host writes to a pinned
        buffer under a pending copy would reach the device).

        Uploads run in order on the stream, so one synchronized event proves every earlier
        upload done. The wait is on the upload ``staging_buffers // 2`` before the next one
        (at least the one that read ``k``): that one is done already whenever the device keeps
        up with the host (SGLang's overlap scheduler runs one step ahead), so the call returns
        at once, and the next ``staging_buffers // 2`` claims need no call at all::

            ring of 8, next upload U = 20: buffer 20 % 8 last read by upload 12
            sync on upload 16's event -> done_upto = 16: uploads 21..24 reuse buffers of 13..16
        """
        target = max(self._buf_upload[k], self._uploads - self.staging_buffers // 2)
        if target <= self._done_upto:
            return
        ev = self._events[target % self.staging_buffers]
        if ev is None:  # no device copy (CPU workspace): nothing pending
            self._done_upto = target
            return
        t0 = time.perf_counter()
        ev.synchronize()
        dt = time.perf_counter() - t0
        self.upload_waits += 1
        self.upload_wait_seconds += dt
        self.upload_seconds += dt
        self._done_upto = target

    def _copy_up(self, k: int, n: int, req_pool_indices: Union[np.ndarray, torch.Tensor]) -> None:
        """Buffer ``k`` (written but for the rows) to ``meta``, with the first ``n`` rows. Host
        rows are written unless the buffer holds that very array already (same object, same n,
        since the last full write of the buffer)."""
        t0 = time.perf_counter()
        rpi = self._rows_offset
        host = None if isinstance(req_pool_indices, torch.Tensor) else req_pool_indices  # None: device rows
        held = self._host_rows[k]
        if host is not None and (held is None or held[0] is not host or held[1] != n):
            self._host_np[k][rpi : rpi + n] = host[:n]
            self._host_rows[k] = (host, n)
        self._rows_up = None if host is None else (host, n)
        if self._cuda:
            self.meta.copy_(self._host[k], non_blocking=True)
            ev = self._events[k]
            if ev is None:
                ev = self._events[k] = torch.cuda.Event()
            ev.record()
        else:
            self.meta.copy_(self._host[k])
        self._buf_upload[k] = self._uploads
        self._uploads += 1
        if isinstance(req_pool_indices, torch.Tensor):
            self.req_pool_indices[:n].copy_(req_pool_indices[:n], non_blocking=True)
        self.upload_seconds += time.perf_counter() - t0
