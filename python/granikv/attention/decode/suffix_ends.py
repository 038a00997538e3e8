"""Where the suffix kernels end each request's last suffix item: the step's device seq_lens.

A steady decode step (same grouping, every request a token longer) changes nothing in the
work list but those ends. ``SuffixEnds`` copies the step's ``forward_batch.seq_lens`` device
to device into one fixed int32 buffer, which the kernels read (``DEVICE_ENDS``) and a captured
CUDA graph reads at its fixed address whatever tensor SGLang hands over, so such a step
uploads no metadata at all (``CascadeWorkspace.advance``). Unbound (``bound is None``), the
kernels use the ends in the workspace's metadata, as a direct kernel call does.

Inside a cascade decode graph the copy itself is captured (``copy_from`` in the graph's
metadata hook, reading SGLang's static ``seq_lens`` buffer): a replay of such a graph binds
the ends without a host launch (``bind(..., copy=False)``); the buffer holds the step's ends
once the replay's first node has run.
"""

from typing import Dict, Optional

import numpy as np
import torch

_DTYPES = (torch.int32, torch.int64)


class SuffixEnds:
    def __init__(self, max_bs: int, device: torch.device):
        self.device = device
        self.buffer = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.bound: Optional[torch.Tensor] = None  # what the kernels read: ``buffer`` once bound
        self._views: Dict[int, torch.Tensor] = {}  # bs -> buffer[:bs]

    def fits(self, t: torch.Tensor, bs: int) -> bool:
        """``t`` can be bound as the ends of a batch of ``bs``: an int32/int64 vector of at
        least ``bs`` on this device."""
        shape = t.shape
        return len(shape) == 1 and shape[0] >= bs and t.dtype in _DTYPES and t.device == self.device

    def bind(self, seq_lens_dev: Optional[torch.Tensor], bs: int, *, checked: bool = False,
             copy: bool = True) -> None:
        """Ends from ``seq_lens_dev[:bs]`` (one non-blocking device copy, ordered on the current
        stream before the layers' kernels), or, with None, from the metadata. ``checked``: the
        caller has just seen ``fits`` hold. ``copy=False``: the step's graph replay makes the
        copy (captured by ``copy_from``), so none is launched here. Raises ValueError for a
        tensor that does not fit."""
        if seq_lens_dev is None:
            self.bound = None
            return
        if not checked and not self.fits(seq_lens_dev, bs):
            raise ValueError(f"seq_lens_dev {tuple(seq_lens_dev.shape)} {seq_lens_dev.dtype} on "
                             f"{seq_lens_dev.device} is not an int32/int64 vector of >= {bs} on {self.device}")
        if copy:
            self.copy_from(seq_lens_dev, bs)
        self.bound = self.buffer

    def copy_from(self, seq_lens_dev: torch.Tensor, bs: int) -> None:
        """The copy of ``seq_lens_dev[:bs]`` into the buffer (``fits`` must hold); inside a
        graph capture, the capture records it."""
        dst = self._views.get(bs)
        if dst is None:
            dst = self._views[bs] = self.buffer[:bs]
        dst.copy_(seq_lens_dev if seq_lens_dev.shape[0] == bs else seq_lens_dev[:bs], non_blocking=True)

    def host(self, n: int) -> np.ndarray:
        """The first ``n`` bound ends on the host (a device read: debug and tests only)."""
        return self.buffer[:n].cpu().numpy()

    def check_integrity(self, seq_lens: np.ndarray) -> None:
        """Assert the bound ends hold the host ``seq_lens`` the step was planned from (its first
        ``len(seq_lens)`` positions; graph padding rows after them are not compared): the work
        list's items and reuse bound come from the host lengths, the kernels end each request's
        last item at the device ones. A device read (debug mode only); nothing when unbound."""
        if self.bound is None:
            return
        n = len(seq_lens)
        dev = self.host(n).astype(np.int64)
        bad = np.flatnonzero(dev != seq_lens)
        if len(bad):
            i = int(bad[0])
            raise AssertionError(
                f"suffix ends: request at batch position {i} has host seq_len {int(seq_lens[i])} but device "
                f"end {int(dev[i])} ({len(bad)} of {n} positions differ)")
