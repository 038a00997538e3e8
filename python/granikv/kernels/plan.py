"""What the cascade launchers read: the step's groups, the fixed device buffers, the step's plan.

The decode planner fills these; the launchers (``cascade.py`` and the kernels' wrappers) only
read them. Three frozen types, no duck typing between the two layers:

- ``Grouping``: the requests of one decode step grouped by the HOT extent they start with
  (host numpy arrays, docs/contracts.md);
- ``CascadeBuffers``: the fixed-capacity device buffers and launch shape of one workspace (made
  once per workspace; a captured CUDA graph reads these very tensors on every replay);
- ``CascadePlan``: one step's view of them: the buffers, the device suffix ends the kernels end
  each request's last suffix item at (or None: the ends in the uploaded work list), and the
  eager bgemm path's members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import numpy.typing as npt
import torch

from granikv.kernels.kernel_config import KernelConfig

_EMPTY = np.zeros(0, dtype=np.int64)
_ZERO_INDPTR = np.zeros(1, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Grouping:
    """Requests grouped by the HOT extent they start with (numpy int64 arrays).

    - ``group_start[G]``, ``group_len[G]``: the group's prefix is slots
      ``[group_start[g], group_start[g] + group_len[g])``, ``group_len[g] >= 1``; groups are
      ordered by ``group_start``.
    - ``group_req_indptr[G+1]``, ``group_req_idx[nnz]``: CSR; the batch positions of group g are
      ``group_req_idx[group_req_indptr[g]:group_req_indptr[g+1]]``, ascending.
    - ``prefix_len[bs]``: tokens of request i served by its group's prefix (0 = not grouped);
      ``prefix_len[i] <= seq_lens[i]``.
    """

    group_start: np.ndarray
    group_len: np.ndarray
    group_req_indptr: np.ndarray
    group_req_idx: np.ndarray
    prefix_len: np.ndarray

    @classmethod
    def empty(cls, batch_size: int) -> Grouping:
        """No group: every request goes through the paged (or suffix-only) path."""
        return cls(_EMPTY, _EMPTY, _ZERO_INDPTR, _EMPTY, np.zeros(batch_size, dtype=np.int64))

    @classmethod
    def of(cls, group_start: npt.ArrayLike, group_len: npt.ArrayLike, group_req_indptr: npt.ArrayLike,
           group_req_idx: npt.ArrayLike, prefix_len: npt.ArrayLike) -> Grouping:
        """From any int sequences (lists in tests and benchmarks), as int64 numpy arrays."""
        a = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return cls(a(group_start), a(group_len), a(group_req_indptr), a(group_req_idx), a(prefix_len))

    def padded(self, batch_size: int) -> Grouping:
        """The grouping of a graph batch padded to ``batch_size`` (padding rows: no prefix)."""
        extra = batch_size - self.batch_size
        if extra <= 0:
            return self
        pl = np.concatenate([self.prefix_len, np.zeros(extra, np.int64)])
        return Grouping(self.group_start, self.group_len, self.group_req_indptr, self.group_req_idx, pl)

    def with_group_len(self, group_len: np.ndarray) -> Grouping:
        """The same groups with other prefix lengths (the planted fault's shorter prefixes)."""
        if group_len is self.group_len:
            return self
        return Grouping(self.group_start, group_len, self.group_req_indptr, self.group_req_idx, self.prefix_len)

    @property
    def batch_size(self) -> int:
        return self.prefix_len.shape[0]

    @property
    def num_groups(self) -> int:
        return self.group_start.shape[0]

    @property
    def num_grouped(self) -> int:
        """Requests that belong to a group (nnz of the CSR)."""
        return self.group_req_idx.shape[0]

    @property
    def group_size(self) -> np.ndarray:
        """Requests per group, int64 ``[G]``."""
        return np.diff(self.group_req_indptr)

    @property
    def prefix_tokens(self) -> int:
        """Prefix tokens read once per step by a prefix pass: sum of ``group_len``."""
        return sum(self.group_len.tolist())

    @property
    def stacked_prefix_tokens(self) -> int:
        """(request, prefix token) pairs: sum of ``prefix_len`` = sum of size * len per group."""
        return int(np.add.reduce(self.prefix_len))


@dataclass(frozen=True, eq=False)
class CascadeBuffers:
    """The fixed device buffers and launch shape of one cascade workspace (docs/kernels.md).

    int32 views of the workspace's one metadata block: ``counts`` [3] (bs, prefix items, suffix
    items), ``sfx_max`` [1], ``pfx_items`` [5 * prefix_cap], ``sfx_items`` [4 * suffix_cap],
    ``group_req_idx`` [max_bs], ``part_indptr`` [max_bs + 1], ``req_pool_indices`` [max_bs];
    ``part_o`` fp32 [partial_cap, Hq, D], ``part_lse`` fp32 [partial_cap, Hq], ``counters`` int32
    [max_bs, Hq] (the fused kernel's arrivals, zero between launches). ``side_stream``: the
    stream of the overlapped suffix launch (``KernelConfig.overlap_suffix``), or None.
    ``slot_copy``: int32 [suffix_cap, width], each suffix item's KV slots copied before a graph
    replay (``suffix_slots``), or None (no table); ``slot_copy_on`` [1] (in the metadata block):
    1 where the build's ``sfx_max`` fits ``width``, so the copy serves it.
    """

    config: KernelConfig
    max_bs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    ratio: int
    prefix_cap: int
    suffix_cap: int
    partial_cap: int
    suffix_heads: int  # kv heads per suffix program
    suffix_groups: int  # suffix grid axis 1
    suffix_block_h: int  # query rows of a suffix tile
    counts: torch.Tensor
    sfx_max: torch.Tensor
    pfx_items: torch.Tensor
    sfx_items: torch.Tensor
    group_req_idx: torch.Tensor
    part_indptr: torch.Tensor
    req_pool_indices: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    counters: torch.Tensor
    side_stream: Optional[torch.cuda.Stream]
    slot_copy_on: torch.Tensor
    slot_copy: Optional[torch.Tensor] = None

    def check_shapes(self, q: torch.Tensor, k_buffer: torch.Tensor) -> None:
        """Raise ValueError if q / k_buffer do not match these buffers."""
        if q.dim() != 3 or q.shape[1:] != (self.num_q_heads, self.head_dim):
            raise ValueError(f"q {tuple(q.shape)} does not match [bs, {self.num_q_heads}, {self.head_dim}]")
        if k_buffer.dim() != 3 or k_buffer.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k_buffer {tuple(k_buffer.shape)} does not match [slots, {self.num_kv_heads}, {self.head_dim}]"
            )
        if q.shape[0] > self.max_bs:
            raise ValueError(f"q batch {q.shape[0]} exceeds max_bs={self.max_bs}")

    def grid_items(self, kind: str) -> int:
        """Programs along axis 0 for a launch ('prefix', 'suffix', 'fused'): the capacity, fixed
        per workspace (programs past the live count exit at once; docs/results/kernels.md
        measures them at ~2 us per layer at serving capacity)."""
        return {"prefix": self.prefix_cap, "suffix": self.suffix_cap, "fused": self.prefix_cap + self.suffix_cap}[kind]


@dataclass(frozen=True, eq=False)
class BgemmMembers:
    """The eager bgemm path's groups: the host grouping (one torch call per group) and, on the
    device, each member's batch position (``idx``, int64) and its prefix partial row (``rows``)."""

    grouping: Grouping
    idx: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """One decode step as the launchers see it. ``ends``: the device ``seq_lens`` the suffix
    kernels end each request's last suffix item at (None: the ends are in the uploaded work
    list); ``bgemm``: set by a fill for ``bgemm_cascade_attention`` only; ``slot_copy``: the
    suffix kernels read each item's slots from ``buffers.slot_copy`` wherever the device's
    ``slot_copy_on`` says the step's copy was made (the plans CUDA graphs capture; the copy
    itself runs before every replay, ``suffix_slots.copy_suffix_slots``)."""

    buffers: CascadeBuffers
    ends: Optional[torch.Tensor] = None
    bgemm: Optional[BgemmMembers] = None
    slot_copy: bool = False
