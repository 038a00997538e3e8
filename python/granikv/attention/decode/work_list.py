"""Host-side work lists for the cascade kernels: the work items of one decode step.

A decode batch of ``bs`` requests is cut into two kinds of work items and a partial-state table:

    prefix item (row_lo, row_hi, slot_lo, n_kv, split)  one per (group, row tile, kv chunk)
        rows   = flat rows [row_lo, row_hi) (<= block_m of them) of the group's stacked queries:
                 flat row f is q-head h * ratio + f % ratio of member group_req_idx[f // ratio]
        keys   = slots [slot_lo, slot_lo + n_kv) of the group's HOT extent (contiguous)
        writes = those q-heads of partial row part_indptr[b] + split for every member b

Flat rows pack every tile full whatever the GQA ratio: a member's q-heads may straddle two
tiles (each writes its own heads of the member's partial row), so a group of n members takes
ceil(n * ratio / block_m) tiles, not ceil(n / (block_m // ratio)) (ratio 3 at 64 members: 3
tiles, not 4; ratio 5: 5, not 6; ratio 7: 7, not 8)::

    group members  b0        b1        b2        b3      (ratio 3, block_m 4)
    flat rows      0  1  2 | 3  4  5 | 6  7  8 | 9 10 11
    tiles          [0 1 2 3] [4 5 6 7] [8 9 10 11]        (b1's heads in tiles 0 and 1)
    suffix item (req, t_lo, t_hi, row)                  one per (request, token chunk)
        rows   = the ratio q-heads of kv head h of batch position req
        keys   = req_to_token[req_pool_indices[req], t_lo:t_hi]   (page size 1, gathered)
        writes = partial row ``row``

Every kernel grid has a second axis over the kv heads. Partial rows of request i:

    part_indptr[i]                                       part_indptr[i+1]
    | prefix chunk 0 | ... | prefix chunk C_g-1 | suffix 0 | ... | suffix S_i-1 |
      (C_g = chunks of i's group, 0 if ungrouped)  (S_i = ceil(suffix_len / suffix_chunk))

Chunk sizes are chosen here so that each launch has about ``waves * sm_count`` programs
(work items x kv heads) of equal size, whatever the mix of prefix lengths and fan-outs: one
chunk bound C for the step (total tile-work / target items), each group cut into
ceil(len / C) EQUAL chunks (a multiple of block_n, only the group's last one shorter), so a
forest's long prefixes get more items and short ones fewer, all about the same size.

The device workspace these lists are copied into: ``decode.workspace.CascadeWorkspace``.
"""

from typing import NamedTuple, Optional, Tuple, Union, overload

import numpy as np

from granikv.kernels.kernel_config import KernelConfig, default_config, tile_config
from granikv.kernels.plan import Grouping

__all__ = ["KernelConfig", "WorkList", "build_work_list", "default_config", "tile_config", "suffix_heads"]


def suffix_tile_rows(ratio: int) -> int:
    """Rows of a suffix tile: ``max(16, next_pow2(ratio))`` (tl.dot needs >= 16); its q-heads
    (``suffix_heads`` kv heads x ratio) always fit."""
    return max(16, 1 << (ratio - 1).bit_length())


def suffix_heads(ratio: int, num_kv_heads: int, config: KernelConfig) -> int:
    """KV heads per suffix program: the largest power of two h dividing num_kv_heads with
    h * ratio <= suffix_tile_rows(ratio) (the rows a tl.dot tile has anyway) and
    h * suffix_block_n <= suffix_max_keys (shared memory); 1 if disabled."""
    if not config.suffix_head_group:
        return 1
    rows = suffix_tile_rows(ratio)
    h = 1
    while (num_kv_heads % (2 * h) == 0 and 2 * h * ratio <= rows
           and 2 * h * config.suffix_block_n <= config.suffix_max_keys):
        h *= 2
    return h


def prefix_target(config: KernelConfig, sm_count: int, num_kv_heads: int, waves: Optional[float] = None) -> int:
    """Prefix items a launch aims at: ``waves * sm_count`` programs over Hkv grid rows
    (``waves``: the step's choice, ``launch_table``; None: ``config.prefix_waves``)."""
    return max(1, int((config.prefix_waves if waves is None else waves) * sm_count) // num_kv_heads)


def suffix_target(config: KernelConfig, sm_count: int, num_kv_heads: int, ratio: int) -> int:
    """Suffix items a launch aims at: ``suffix_waves * sm_count`` programs over the
    ``Hkv / suffix_heads`` kv-head groups of the grid."""
    return max(1, int(config.suffix_waves * sm_count) // (num_kv_heads // suffix_heads(ratio, num_kv_heads, config)))


class Capacity(NamedTuple):
    """A workspace's fixed item and partial-row capacities (``capacity``)."""

    prefix_items: int
    suffix_items: int
    partial_rows: int


def capacity(config: KernelConfig, max_bs: int, max_groups: int, ratio: int, num_kv_heads: int,
             sm_count: int) -> Capacity:
    """The most work items and partial rows any batch of ``max_bs`` requests in ``max_groups``
    groups can plan (``build_work_list``'s chunking rules):

    - prefix items  <= target_p + T,  T = ceil(max_bs * ratio / block_m) + max_groups (the most
                       (group, row tile) pairs), target_p = max(prefix_waves * SMs / Hkv,
                       forest_items_per_tile * T)
    - suffix items  <= target_s + max_bs
    - partial rows  <= ceil(block_m * target_p / ratio) + max_bs  (prefix)  +  suffix items
      (the prefix chunk is at least total tile-work / target_p)
    """
    tiles_max = cdiv(max_bs * ratio, config.block_m) + max_groups  # (group, row tile) pairs
    target_p = max(prefix_target(config, sm_count, num_kv_heads), int(config.forest_items_per_tile * tiles_max))
    suffix_cap = suffix_target(config, sm_count, num_kv_heads, ratio) + max_bs
    return Capacity(target_p + tiles_max, suffix_cap, cdiv(config.block_m * target_p, ratio) + max_bs + suffix_cap)


class WorkList(NamedTuple):
    """One step's work items (numpy int64, see the module docstring for the layout)."""

    bs: int
    prefix_chunk: int  # kv tokens per prefix item (last chunk of a group may be shorter)
    suffix_chunk: int  # tokens per suffix item
    pfx_row_lo: np.ndarray  # [Np] first flat row (member index into group_req_idx * ratio + r)
    pfx_row_hi: np.ndarray  # [Np] one past the last flat row
    pfx_slot_lo: np.ndarray  # [Np] first kv slot
    pfx_n_kv: np.ndarray  # [Np] kv tokens (>= 1)
    pfx_split: np.ndarray  # [Np] chunk index within the group
    group_req_idx: np.ndarray  # [nnz] batch positions, group by group
    sfx_req: np.ndarray  # [Ns] batch position
    sfx_lo: np.ndarray  # [Ns] first token position (index into the req_to_token row)
    sfx_hi: np.ndarray  # [Ns] one past the last token position (> sfx_lo)
    sfx_row: np.ndarray  # [Ns] partial row written
    part_indptr: np.ndarray  # [bs+1] CSR of partial rows per request

    @property
    def num_prefix_items(self) -> int:
        return len(self.pfx_row_lo)

    @property
    def num_suffix_items(self) -> int:
        return len(self.sfx_req)

    @property
    def num_partials(self) -> int:
        return int(self.part_indptr[-1])

    def check(self, ratio: int) -> None:
        """Assert no item is empty and every (partial row, q-head of a kv head) is written by
        exactly one item (``ratio`` q-heads per kv head)."""
        assert (self.pfx_n_kv > 0).all() and (self.sfx_hi > self.sfx_lo).all(), "empty work item"
        cover = np.zeros((self.num_partials, ratio), np.int64)  # writes per (partial row, q-head)
        cover[self.sfx_row] += 1
        for lo, hi, sp in zip(self.pfx_row_lo, self.pfx_row_hi, self.pfx_split, strict=False):
            f = np.arange(lo, hi)
            np.add.at(cover, (self.part_indptr[self.group_req_idx[f // ratio]] + sp, f % ratio), 1)
        assert (cover == 1).all(), "partial rows not written exactly once (per q-head)"


@overload
def cdiv(a: int, b: int) -> int: ...
@overload
def cdiv(a: np.ndarray, b: Union[int, np.ndarray]) -> np.ndarray: ...
def cdiv(a: Union[int, np.ndarray], b: Union[int, np.ndarray]) -> Union[int, np.ndarray]:
    """``ceil(a / b)`` of ints or int arrays (elementwise)."""
    return -(-a // b)


def _round_up(x: int, m: int) -> int:
    return cdiv(x, m) * m


def _segment_arange(counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """For counts [3, 1, 2] return owners [0,0,0,1,2,2] and local [0,1,2,0,0,1]."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(total) - starts[owner]
    return owner, local


class PrefixItems(NamedTuple):
    """The prefix half of a work list: depends on the grouping only, not on ``seq_lens``."""

    chunk: int
    row_lo: np.ndarray
    row_hi: np.ndarray
    slot_lo: np.ndarray
    n_kv: np.ndarray
    split: np.ndarray
    n_pre: np.ndarray  # [bs] prefix chunks of each request's group (0 = ungrouped)
    group_req_idx: np.ndarray


def build_prefix_items(grouping: Grouping, bs: int, *, ratio: int, num_kv_heads: int, config: KernelConfig,
                       sm_count: int, max_splits: int, single_prefix_chunk: bool = False,
                       prefix_waves: Optional[float] = None) -> PrefixItems:
    """Prefix items (group, chunk, tile), tile fastest so a chunk's tiles run together (L2);
    tiles of ``block_m`` flat rows, chunks equal within a group (module docstring).
    ``prefix_waves``: the launch's wave target for this step (``launch_table``), within the
    workspace's capacity; None: ``config.prefix_waves``."""
    g_start, g_len = grouping.group_start, grouping.group_len
    g_ptr, g_idx = grouping.group_req_indptr, grouping.group_req_idx
    n_mem = np.diff(g_ptr)
    tiles = cdiv(n_mem * ratio, config.block_m)
    if len(g_len):
        if single_prefix_chunk:
            chunk = int(g_len.max())
        else:
            target = max(prefix_target(config, sm_count, num_kv_heads, prefix_waves),
                         int(config.forest_items_per_tile * int(tiles.sum())))
            work = int((tiles * g_len).sum())
            chunk = max(cdiv(work, target), config.min_prefix_chunk, cdiv(int(g_len.max()), max_splits))
            chunk = _round_up(chunk, config.block_n)
        chunks = cdiv(g_len, chunk)
        # equal chunks per group, a multiple of block_n: (chunks - 1) * g_chunk < len as g_chunk <= chunk
        g_chunk = cdiv(cdiv(g_len, chunks), config.block_n) * config.block_n
    else:
        chunk, chunks, g_chunk = 0, np.zeros(0, np.int64), np.zeros(0, np.int64)
    item_g, local = _segment_arange(tiles * chunks)
    tiles_of = tiles[item_g]
    c = local // np.maximum(tiles_of, 1)
    t = local - c * tiles_of
    row_lo = g_ptr[item_g] * ratio + t * config.block_m
    row_hi = np.minimum(row_lo + config.block_m, g_ptr[item_g + 1] * ratio)
    ck = g_chunk[item_g]
    kv_lo = c * ck
    n_pre = np.zeros(bs, np.int64)
    n_pre[g_idx] = np.repeat(chunks, n_mem)
    return PrefixItems(chunk=int(chunk), row_lo=row_lo, row_hi=row_hi, slot_lo=g_start[item_g] + kv_lo,
                       n_kv=np.minimum(ck, g_len[item_g] - kv_lo), split=c, n_pre=n_pre,
                       group_req_idx=g_idx)


def build_work_list(
    grouping: Grouping,
    seq_lens: np.ndarray,
    *,
    ratio: int,
    num_kv_heads: int,
    config: KernelConfig,
    sm_count: int,
    max_splits: int,
    single_prefix_chunk: bool = False,
    prefix_items: Optional[PrefixItems] = None,
) -> WorkList:
    """Cut a grouped decode batch into prefix items, suffix items and partial rows.

    ``grouping``: the step's groups (docs/contracts.md; its ``prefix_len[bs]`` is the
    ``group_len`` of each request's group, 0 if none); ``seq_lens[bs]`` numpy ints.
    ``single_prefix_chunk`` plans one chunk per group (the bgemm path fills those rows itself).
    ``prefix_items``: ``build_prefix_items`` of the same grouping, reused (decode steps keep their
    grouping while ``seq_lens`` grow). Vectorised: no Python loop over requests or groups.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    prefix_len = grouping.prefix_len
    bs = len(seq_lens)
    if len(prefix_len) != bs:
        raise ValueError(f"grouping of {len(prefix_len)} requests, seq_lens of {bs}")
    p = prefix_items or build_prefix_items(
        grouping, bs, ratio=ratio,
        num_kv_heads=num_kv_heads, config=config, sm_count=sm_count, max_splits=max_splits,
        single_prefix_chunk=single_prefix_chunk,
    )  # fmt: skip

    # ---- partial rows per request: its group's prefix chunks, then its suffix chunks
    sfx_len = np.maximum(seq_lens - prefix_len, 0)
    if bs:
        target = suffix_target(config, sm_count, num_kv_heads, ratio)
        s_chunk = max(cdiv(int(sfx_len.sum()), target), config.min_suffix_chunk, cdiv(int(sfx_len.max()), max_splits))
        s_chunk = _round_up(s_chunk, config.suffix_block_n)
    else:
        s_chunk = config.suffix_block_n
    n_sfx = cdiv(sfx_len, s_chunk)
    part_indptr = np.zeros(bs + 1, np.int64)
    np.cumsum(p.n_pre + n_sfx, out=part_indptr[1:])

    # ---- suffix items
    s_req, s_local = _segment_arange(n_sfx)
    s_lo = prefix_len[s_req] + s_local * s_chunk
    s_hi = np.minimum(s_lo + s_chunk, seq_lens[s_req])
    s_row = part_indptr[s_req] + p.n_pre[s_req] + s_local

    return WorkList(
        bs=bs,
        prefix_chunk=p.chunk,
        suffix_chunk=int(s_chunk),
        pfx_row_lo=p.row_lo,
        pfx_row_hi=p.row_hi,
        pfx_slot_lo=p.slot_lo,
        pfx_n_kv=p.n_kv,
        pfx_split=p.split,
        group_req_idx=p.group_req_idx,
        sfx_req=s_req,
        sfx_lo=s_lo,
        sfx_hi=s_hi,
        sfx_row=s_row,
        part_indptr=part_indptr,
    )
