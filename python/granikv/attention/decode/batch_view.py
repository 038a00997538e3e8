"""What the decode planner reads off SGLang's batch and hands back to the wrapped backend:
the host ``seq_lens`` as a numpy view (one object while the memory is the same), the
``seq_len = 1`` view of the batch the wrapped backend plans with, the step's device ends, and
the per-request arrays padded to a graph's batch size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from granikv.attention.decode.workspace import CascadeWorkspace


class SeqLensView:
    """``seq_lens_cpu[:bs]`` as int64 numpy, the same array object while SGLang hands over the
    same memory (graph replays slice one persistent host buffer): a zero-copy view holds the
    tensor, so its address cannot be reused while cached."""

    def __init__(self) -> None:
        # ((data_ptr, bs), dtype, numpy view) of the last step's seq_lens_cpu
        self._cached: Optional[Tuple[Tuple[int, int], torch.dtype, np.ndarray]] = None

    def __call__(self, seq_lens_cpu: torch.Tensor, bs: int) -> Optional[np.ndarray]:
        """The view; None if ``seq_lens_cpu`` holds fewer than ``bs`` lengths."""
        key = (seq_lens_cpu.data_ptr(), bs)
        cached = self._cached
        if cached is not None and cached[0] == key and cached[1] is seq_lens_cpu.dtype:
            return cached[2]
        view = seq_lens_cpu.numpy()[:bs]
        if view.shape[0] != bs:
            return None
        if view.dtype != np.int64:
            view = view.astype(np.int64)  # a copy: not cached
            self._cached = None
            return view
        self._cached = (key, seq_lens_cpu.dtype, view)
        return view


class OneTokenView:
    """The batch with every ``seq_len = 1``: the wrapped backend still writes the step's K/V
    and reads one token. The ones are made once per batch size and dtype (read-only for the
    wrapped backend)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._ones: Optional[torch.Tensor] = None
        # (bs, dtypes) -> the (device, host) seq_lens of ones of a seq_len = 1 view
        self._views: Dict[Tuple[Any, ...], Tuple[torch.Tensor, torch.Tensor]] = {}

    def ensure(self, n: int) -> None:
        """The device ones the views slice, at least ``n`` of them."""
        if self._ones is None or self._ones.numel() < n:
            self._ones = torch.ones(n, dtype=torch.int64, device=self.device)
            self._views = {}

    def of(self, fb: Any) -> Any:
        """``fb`` with every ``seq_len = 1`` (``ensure`` was called for its batch size)."""
        bs = fb.batch_size
        # SGLang's replay view is a SimpleNamespace (a plain attribute copy is the cheap copy);
        # an eager step's ForwardBatch is a dataclass
        if type(fb) is SimpleNamespace:
            view = SimpleNamespace(**vars(fb))
        else:  # what copy.copy does for a dataclass, without its generic protocol
            view = object.__new__(type(fb))
            view.__dict__.update(fb.__dict__)
        key = (bs, fb.seq_lens.dtype, fb.seq_lens_cpu.dtype)
        ones = self._views.get(key)
        if ones is None:
            assert self._ones is not None and self._ones.numel() >= bs, "OneTokenView.ensure not called"
            ones = self._views[key] = (self._ones[:bs].to(fb.seq_lens.dtype),
                                       torch.ones(bs, dtype=fb.seq_lens_cpu.dtype))
        view.seq_lens, view.seq_lens_cpu = ones
        view.seq_lens_sum = bs
        return view


def same_rows(staged: np.ndarray, held: np.ndarray) -> bool:
    """The staged rows equal the held ones (a new array with the same rows: e.g. a batch rebuilt
    on the host without a change); compared only when the array is not the held one."""
    return staged.shape == held.shape and bool((staged == held).all())


def device_ends(fb: Any, ws: CascadeWorkspace) -> Optional[torch.Tensor]:
    """The step's device ``seq_lens``, which the kernels end each request's last suffix item at
    (``SuffixEnds.bind``): steady steps then upload nothing. None (the ends travel in
    the workspace's upload) where the tensor does not cover the padded batch on its device."""
    t = getattr(fb, "seq_lens", None)
    return t if t is not None and ws.ends.fits(t, fb.batch_size) else None


def real_batch_size(fb: Any) -> int:
    """The requests of a decode batch, without a replay view's padding rows."""
    return fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)


def seq_total(fb: Any, pad_fill: Optional[int]) -> Optional[int]:
    """``sum(seq_lens)`` of the real requests from SGLang's ``seq_lens_sum`` (no array work):
    a replay view's total includes its padding rows at the wrapped backend's fill value
    ``pad_fill``. None when unknown (the chooser then sums the array; it also checks this one)."""
    total = getattr(fb, "seq_lens_sum", None)
    pad = getattr(fb, "num_padding", 0)
    if total is None:
        return None
    if not pad:
        return total
    return None if pad_fill is None else total - pad * pad_fill


def pad_rows(seq_lens: np.ndarray, req_pool_indices: np.ndarray, padded: int) -> Tuple[np.ndarray, np.ndarray]:
    """Extends the per-request arrays to the padded graph batch (padding rows: row 0, len 1;
    their prefix: ``Grouping.padded``)."""
    bs = len(seq_lens)
    if padded == bs:
        return seq_lens, req_pool_indices
    extra = padded - bs
    return (np.concatenate([seq_lens, np.ones(extra, np.int64)]),
            np.concatenate([req_pool_indices, np.zeros(extra, np.int64)]))
