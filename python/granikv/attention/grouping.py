r"""Host-side planning of one decode step: which requests share a HOT prefix (grouping).

A request whose first ``hot_len`` tokens live in the contiguous HOT run ``[hot_start,
hot_start + hot_len)`` can have its prefix attention served from that dense slice. Requests
that start at the SAME slot share those slots physically, so their queries can be stacked and
the prefix read once per step (docs/contracts.md, "Batch description -> plan")::

    batch position:      0     1     2     3     4     5
    hot_start:         900   100   900   100   100     -
    hot_len:           300   512   200   512   640     0
                        \___________/     \_________/
    group 0: start 100, len min(512, 512, 640) = 512, requests [1, 3, 4]
    group 1: start 900, len min(300, 200)      = 200, requests [0, 2]
    prefix_len:        200   512   200   512   512     0

    request i reads  slots [group_start, group_start + prefix_len[i])      -> prefix pass
                     req_to_token[req_pool_indices[i], prefix_len[i]:seq_lens[i]] -> suffix pass

Grouping is by physical slot, never by token ids: two requests with equal prompts in
different slots are not grouped. ``verify_same_slots`` checks the claim against
``req_to_token`` (debug mode and tests; it reads the device table).

Planning runs once per decode step on the host and must cost microseconds: everything here is
a handful of vectorised numpy calls (benchmark/kernels/bench_planning.py measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

import numpy as np

from granikv.kernels.plan import Grouping

if TYPE_CHECKING:
    import torch

__all__ = ["BatchDescription", "Grouping", "GroupingMemo", "group_requests", "verify_same_slots"]


@dataclass(frozen=True, eq=False)
class BatchDescription:
    """The decode batch as the planner sees it: numpy int64 arrays ``[bs]`` in batch order.

    - ``req_pool_indices[i]``: row of request i in SGLang's ``req_to_token``.
    - ``seq_lens[i]``: tokens of request i, including the one decoded this step.
    - ``hot_start[i]``, ``hot_len[i]``: the HOT run request i starts with (slots
      ``[hot_start, hot_start + hot_len)`` hold its first ``hot_len`` tokens); ``hot_len == 0``
      means none, and ``hot_start`` is then ignored.

    The arrays are not copied: the caller must not mutate them while the description is in use.
    """

    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    hot_start: np.ndarray
    hot_len: np.ndarray

    def __post_init__(self) -> None:
        bs = self.req_pool_indices.shape
        for name in ("seq_lens", "hot_start", "hot_len"):
            shape = getattr(self, name).shape
            if shape != bs or len(shape) != 1:
                raise ValueError(
                    f"BatchDescription.{name} has shape {shape}, expected {bs} "
                    "(1-D, like req_pool_indices)"
                )

    @classmethod
    def unchecked(cls, req_pool_indices: np.ndarray, seq_lens: np.ndarray, hot_start: np.ndarray,
                  hot_len: np.ndarray) -> BatchDescription:
        """The constructor without the shape checks, for arrays the caller already knows to
        match (the planner's steady steps: the rows and HOT runs of a checked description, and
        ``seq_lens`` sliced to the same length)."""
        d = object.__new__(cls)
        d.__dict__.update(req_pool_indices=req_pool_indices, seq_lens=seq_lens, hot_start=hot_start,
                          hot_len=hot_len)
        return d

    @classmethod
    def from_table(
        cls,
        req_pool_indices: np.ndarray,
        seq_lens: np.ndarray,
        table_start: np.ndarray,
        table_length: np.ndarray,
    ) -> "BatchDescription":
        """Gathers the HOT runs of the batch's rows from a per-``req_pool_idx`` table.

        ``table_start``/``table_length`` are ``HotPrefixTable.start_np``/``length_np``
        (int64 ``[R+1]``); ``req_pool_indices`` and ``seq_lens`` are int64 ``[bs]``.
        """
        return cls(
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            hot_start=table_start[req_pool_indices],
            hot_len=table_length[req_pool_indices],
        )

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]


def group_requests(
    desc: BatchDescription, *, min_group_size: int, min_prefix_len: int = 1
) -> Grouping:
    """Groups the batch's requests by the HOT slot they start at.

    Requests with the same ``hot_start`` and an effective HOT length (``min(hot_len,
    seq_lens)``) of at least ``min_prefix_len`` form a group when there are at least
    ``min_group_size`` of them; the group's prefix length is the minimum effective HOT length
    of its members, so every member really holds slots ``[start, start + len)``. Smaller
    groups are dissolved: their requests get ``prefix_len`` 0.

    Cost: O(bs log bs) in a fixed number of numpy calls (no Python loop over requests).
    """
    if min_group_size < 1 or min_prefix_len < 1:
        raise ValueError(
            f"min_group_size={min_group_size} and min_prefix_len={min_prefix_len} must be >= 1"
        )
    bs = desc.batch_size
    hot_len = np.minimum(desc.hot_len, desc.seq_lens)
    cand = np.flatnonzero(hot_len >= min_prefix_len)
    if cand.shape[0] < min_group_size:
        return Grouping.empty(bs)

    cand_start = desc.hot_start[cand]
    if (cand_start == cand_start[0]).all():  # one shared prefix: the common multi-agent case
        return _single_group(cand, cand_start[:1], hot_len[cand].min(), bs)

    # Sort candidates by start (stable: batch order inside a group), then cut into runs of equal
    # start:   starts (sorted) 100 100 100 900 900  ->  seg_begin [0, 3], seg_size [3, 2]
    sort = np.argsort(cand_start, kind="stable")
    order = cand[sort]
    starts = cand_start[sort]
    cuts = np.flatnonzero(starts[1:] != starts[:-1])
    bounds = np.empty(cuts.shape[0] + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, order.shape[0]
    bounds[1:-1] = cuts + 1
    seg_begin = bounds[:-1]
    seg_size = bounds[1:] - seg_begin

    keep = seg_size >= min_group_size
    if not keep.any():
        return Grouping.empty(bs)
    group_len = np.minimum.reduceat(hot_len[order], seg_begin)[keep]
    group_size = seg_size[keep]
    group_req_idx = order[np.repeat(keep, seg_size)]
    indptr = np.zeros(group_size.shape[0] + 1, dtype=np.int64)
    np.cumsum(group_size, out=indptr[1:])

    prefix_len = np.zeros(bs, dtype=np.int64)
    prefix_len[group_req_idx] = np.repeat(group_len, group_size)
    return Grouping(
        group_start=starts[seg_begin[keep]],
        group_len=group_len,
        group_req_indptr=indptr,
        group_req_idx=group_req_idx,
        prefix_len=prefix_len,
    )


class GroupingMemo:
    """``group_requests`` of the previous step, reused while the batch's HOT runs are unchanged.

    Successive decode steps of one batch keep their HOT runs while ``seq_lens`` grow. Whenever
    every ``hot_len <= seq_lens`` (always true in decode: the new token is never HOT), the
    grouping depends only on ``(hot_start, hot_len, min_group_size)``, which is the memo key.
    """

    def __init__(self) -> None:
        self._key: Optional[Tuple[int, bytes, bytes]] = None
        self._grouping: Optional[Grouping] = None
        self.hits = self.misses = 0

    def group(self, desc: BatchDescription, *, min_group_size: int) -> "Grouping":
        if not (desc.hot_len <= desc.seq_lens).all():
            self.misses += 1
            return group_requests(desc, min_group_size=min_group_size)
        key = (min_group_size, desc.hot_start.tobytes(), desc.hot_len.tobytes())
        if key == self._key and self._grouping is not None:
            self.hits += 1
            return self._grouping
        self.misses += 1
        self._grouping = group_requests(desc, min_group_size=min_group_size)
        self._key = key
        return self._grouping


def _single_group(members: np.ndarray, start: np.ndarray, length: Union[int, np.integer], bs: int) -> Grouping:
    """Every candidate (ascending batch positions ``members``) shares one start."""
    prefix_len = np.zeros(bs, dtype=np.int64)
    prefix_len[members] = length
    return Grouping(
        group_start=start,
        group_len=np.array([length], dtype=np.int64),
        group_req_indptr=np.array([0, members.shape[0]], dtype=np.int64),
        group_req_idx=members,
        prefix_len=prefix_len,
    )


def verify_same_slots(grouping: Grouping, desc: BatchDescription, req_to_token: torch.Tensor) -> bool:
    """True iff every grouped request's ``req_to_token`` row starts with its group's slots.

    For each group g and each member i, checks
    ``req_to_token[req_pool_indices[i], :group_len[g]] == arange(group_start[g], group_start[g]
    + group_len[g])`` in one vectorised torch comparison on ``req_to_token``'s device (a
    ``[nnz, max group_len]`` temporary; synchronises with the device: debug mode and tests only).

    ``req_to_token``: int32/int64 tensor ``[rows, max_context_len]`` (SGLang's
    ``ReqToTokenPool.req_to_token``). A group longer than a row is reported as False.
    """
    import torch

    if grouping.num_grouped == 0:
        return True
    max_len = int(grouping.group_len.max())
    if max_len > req_to_token.shape[1]:
        return False
    dev = req_to_token.device
    sizes = grouping.group_size
    rows = torch.from_numpy(desc.req_pool_indices[grouping.group_req_idx]).to(dev)
    start = torch.from_numpy(np.repeat(grouping.group_start, sizes)).to(dev)
    length = torch.from_numpy(np.repeat(grouping.group_len, sizes)).to(dev)
    pos = torch.arange(max_len, device=dev)
    got = req_to_token[rows, :max_len].to(torch.int64)
    want = start[:, None] + pos[None, :]
    return bool(((got == want) | (pos[None, :] >= length[:, None])).all())
