"""What a full work-list build leaves for the steady decode steps after it.

A steady step (same grouping, same batch size) does not rebuild the work list: it moves each
request's last suffix chunk end to the new ``seq_len`` (``CascadeWorkspace.advance``). A
``ReuseBase`` is the full build plus the indices that make that one scatter.
"""

from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from granikv.attention.decode.work_list import PrefixItems, WorkList


def last_suffix_item(wl: WorkList) -> np.ndarray:
    """Index of each request's last suffix item (-1 if it has none); items are in request order."""
    n = np.bincount(wl.sfx_req, minlength=wl.bs)
    last = np.cumsum(n) - 1
    last[n == 0] = -1
    return last


def last_item_bound(suffix_chunk: int, factor: float) -> int:
    """The most tokens a request's last suffix item holds in a build (``suffix_chunk``) and in
    every steady step advanced from it (``ReuseBase.limit``, ``floor(factor * suffix_chunk)``):
    a kernel ending that item at a device end never reads past ``t_lo + last_item_bound``."""
    return max(suffix_chunk, int(factor * suffix_chunk))


class ReuseBase(NamedTuple):
    """What a full build leaves for the steady steps after it (``CascadeWorkspace.advance``).

    ``hi_pos[i]``: where request i's last ``sfx_hi`` lives in a staging buffer (an index into
    ``meta``), so a steady step writes the new suffix ends with one scatter; ``last_lo1`` and
    ``limit``: the reuse bound as one unsigned comparison, ``0 <= seq_len - last_lo - 1 <
    limit`` (``limit = floor(reuse_chunk_factor * suffix_chunk)``; a negative difference wraps
    to a huge unsigned value)."""

    items: PrefixItems
    wl: WorkList  # the work list of the full build
    single: bool  # built for the bgemm path (one prefix chunk per group)
    last: np.ndarray  # each request's last suffix item
    last_lo1: np.ndarray  # first token of that item, + 1
    hi_pos: np.ndarray  # meta index of that item's sfx_hi
    limit: int
    rows: Optional[np.ndarray]  # the build's host rows (None: they came from the device)

    @classmethod
    def of(cls, items: PrefixItems, wl: WorkList, rows: Union[np.ndarray, torch.Tensor], *, single: bool, factor: float,
           sfx_hi_offset: int) -> Optional["ReuseBase"]:
        """None when the build cannot be advanced (no request, or one without suffix chunks)."""
        if factor <= 0 or not wl.bs:
            return None
        last = last_suffix_item(wl)
        if (last < 0).any():
            return None
        return cls(items, wl, single, last, wl.sfx_lo[last] + 1, sfx_hi_offset + last,
                   int(factor * wl.suffix_chunk),
                   None if isinstance(rows, torch.Tensor) else np.array(rows[: wl.bs], dtype=np.int64))
