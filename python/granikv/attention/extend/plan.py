r"""Host-side planning of one extend (prefill) batch: which new tokens can attend their cached
prefix (or its HOT head) as one dense call over a HOT extent.

When agents join a cached shared prefix, each new token attends to the whole prefix. SGLang's
flashinfer backend computes that part with its paged prefill wrapper, request by request
(page size 1, FA2). If a request's cached prefix starts with a HOT run, that run is a
contiguous slice of the KV buffer, and all requests that start at the same slot with the same
HOT length can be served by ONE ragged (dense) call: their new tokens stacked as queries,
the extent as K/V, no mask (docs/design.md, "Prefill over a HOT prefix")::

    batch position:        0      1      2      3      4
    prefix_len (cached):  512    512      0    512    300
    hot run (start, len): (100,512) (100,512) - (100,512) (900,300)
    new tokens:            7      5      9      4      6      -> token ranges [0,7) [7,12) ...
    group 0: extent [100, 612), requests [0, 1, 3] -> tokens [0,12) + [21,25)
    group 1: extent [900, 1200), requests [4]       -> tokens [25,31)
    request 2 has no cached prefix: its tokens get no prefix part (LSE -inf)

Cached prefix tokens that are not in a HOT run (a request whose prefix is COLD: an unshared
prompt, a prefix with one sharer; or a HOT run followed by COLD tokens: an agent's earlier
turns) form the paged remainder: ``req_to_token[row, hot_len:prefix_len]`` per request, served
by one paged call and merged by LSE with the request's dense part. A batch is planned when at
least one request has a HOT run (else the stock path is as good: ``reason`` says why), or with
``cover_all`` always (an FP8 cache: GraniKV's prefill then attends to exactly the values its
decode reads, ``paths.ExtendPaths``).

Any number of groups is served. Groups whose extents do not overlap share ONE dense call
(``ExtendCall``): a ragged call over the KV slot range that spans them, with an entry per group
and a query-less entry over each gap between two extents, so every group's keys start at its
own slot (see ``ExtendCall``). Overlapping groups (the same extent at two HOT lengths) go to
different calls; the calls are as few as the deepest overlap (greedy interval partitioning).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True, eq=False)
class ExtendGroup:
    """One dense call: the group's new tokens against KV slots ``[start, start + length)``.

    ``token_idx`` (int64, ascending) are positions in the batch's stacked new tokens;
    ``contiguous`` is True when they are one range ``[token_idx[0], token_idx[-1] + 1)``
    (then the call reads and writes slices, no gather).
    """

    start: int
    length: int
    token_idx: np.ndarray
    num_requests: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_idx.shape[0])

    @property
    def contiguous(self) -> bool:
        n = self.num_tokens
        return n > 0 and int(self.token_idx[-1]) - int(self.token_idx[0]) == n - 1

    @property
    def token_range(self) -> Tuple[int, int]:
        return int(self.token_idx[0]), int(self.token_idx[-1]) + 1


@dataclass(frozen=True, eq=False)
class PagedRemainder:
    """Prefix tokens outside the HOT runs: request j (of ``n``) attends slots
    ``req_to_token[rows[j], lo[j]:hi[j]]`` with its ``qo_lens[j]`` new tokens, which are
    ``token_idx[qo_indptr[j]:qo_indptr[j+1]]`` of the batch's stacked tokens (int64 arrays)."""

    rows: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    qo_lens: np.ndarray
    token_idx: np.ndarray

    @property
    def num_requests(self) -> int:
        return int(self.rows.shape[0])

    @property
    def qo_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.qo_lens)]).astype(np.int64)

    @property
    def kv_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.hi - self.lo)]).astype(np.int64)

    def slot_coords(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(rows, cols)`` int64 of every remainder slot in ``req_to_token``, request by request."""
        n = self.hi - self.lo
        rows = np.repeat(self.rows, n)
        cols = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(self.kv_indptr[:-1] - self.lo, n)
        return rows, cols


@dataclass(frozen=True, eq=False)
class ExtendCall:
    """One ragged dense call serving several groups whose extents do not overlap.

    Keys and values are the slot range ``[kv_lo, kv_hi)`` of the KV buffer (a view, no copy);
    entry e has queries ``qo_indptr[e]:qo_indptr[e+1]`` of the call's stacked tokens and keys
    ``kv_indptr[e]:kv_indptr[e+1]`` of the view. Groups come in ascending slot order; a gap
    between two extents is an entry with no query (no work, it only moves the next offset)::

        slots:     kv_lo         gap            kv_hi
                   | group a |..........| group b |
        entry:        0          1           2
        qo_len:      n_a         0          n_b
        kv_len:      L_a     s_b - e_a      L_b

    ``groups`` indexes ``ExtendPlan.groups``; ``token_idx`` (int64) are the batch's stacked
    token positions of the call's queries in call order (the groups' tokens, group by group).
    """

    kv_lo: int
    kv_hi: int
    groups: Tuple[int, ...]
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    token_idx: np.ndarray

    @property
    def num_entries(self) -> int:
        return int(self.qo_indptr.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.token_idx.shape[0])

    @property
    def contiguous(self) -> bool:
        """The queries are one range of the stacked tokens, in order (served by slices)."""
        n = self.num_tokens
        return n > 0 and bool((np.diff(self.token_idx) == 1).all())

    @property
    def token_range(self) -> Tuple[int, int]:
        return int(self.token_idx[0]), int(self.token_idx[-1]) + 1

    @property
    def shapes(self) -> Tuple[Tuple[int, int], ...]:
        """``(qo_len, kv_len)`` of every entry (gap entries have qo_len 0)."""
        return tuple(zip(np.diff(self.qo_indptr).tolist(), np.diff(self.kv_indptr).tolist(), strict=True))


def batch_calls(groups: Tuple[ExtendGroup, ...]) -> Tuple[ExtendCall, ...]:
    """Pack groups into as few ``ExtendCall`` s as their overlaps allow: groups in ascending
    start order, each into the first call whose last extent ends at or before its start (the
    number of calls is the largest number of extents over any one slot)."""
    order = sorted(range(len(groups)), key=lambda i: (groups[i].start, groups[i].length))
    members: List[List[int]] = []  # group indices of each call
    ends: List[int] = []  # end slot of each call's last extent
    for i in order:
        g = groups[i]
        for c, end in enumerate(ends):
            if end <= g.start:
                members[c].append(i)
                ends[c] = g.start + g.length
                break
        else:
            members.append([i])
            ends.append(g.start + g.length)
    return tuple(_call(groups, m) for m in members)


def _call(groups: Sequence[ExtendGroup], members: Sequence[int]) -> ExtendCall:
    lo = groups[members[0]].start
    qo, kv, prev_end = [0], [0], lo
    for i in members:
        g = groups[i]
        if g.start > prev_end:  # a query-less entry over the gap
            qo.append(qo[-1])
            kv.append(g.start - lo)
        qo.append(qo[-1] + g.num_tokens)
        kv.append(g.start + g.length - lo)
        prev_end = g.start + g.length
    return ExtendCall(kv_lo=lo, kv_hi=prev_end, groups=tuple(members), qo_indptr=np.array(qo, np.int64),
                      kv_indptr=np.array(kv, np.int64),
                      token_idx=np.concatenate([groups[i].token_idx for i in members]))


@dataclass(frozen=True, eq=False)
class ExtendPlan:
    groups: Tuple[ExtendGroup, ...]
    calls: Tuple[ExtendCall, ...]  # every group in exactly one call
    paged: Optional[PagedRemainder]  # None: every cached prefix token is in a HOT run
    token_indptr: np.ndarray  # [bs+1] int64: request i's new tokens are [token_indptr[i], token_indptr[i+1])

    @property
    def num_tokens(self) -> int:
        """All new tokens of the batch."""
        return int(self.token_indptr[-1])

    @property
    def hot_tokens(self) -> int:
        """New tokens with a dense part (their prefix starts with a HOT run)."""
        return sum(g.num_tokens for g in self.groups)

    @property
    def covers_all_tokens(self) -> bool:
        """Every new token has a dense part (so the dense calls write every output row)."""
        return self.hot_tokens == self.num_tokens

    @property
    def has_prefix_part(self) -> bool:
        """Some new token attends a cached prefix (a dense group or the COLD remainder); False
        only for a ``cover_all`` plan of a batch without cached prefixes."""
        return bool(self.groups) or self.paged is not None

    @property
    def prefix_pairs(self) -> int:
        """(new token, prefix token) pairs of the dense calls: sum of tokens x extent length."""
        return sum(g.num_tokens * g.length for g in self.groups)


def plan_extend(
    req_pool_indices: np.ndarray,
    prefix_lens: np.ndarray,
    extend_lens: np.ndarray,
    table_start: np.ndarray,
    table_length: np.ndarray,
    *,
    max_groups: Optional[int] = None,
    cover_all: bool = False,
) -> Tuple[Optional[ExtendPlan], str]:
    """``(plan, "")`` when the batch is planned, else ``(None, reason)``.

    All inputs are int64 numpy arrays ``[bs]`` in batch order, except ``table_start`` /
    ``table_length`` (``HotPrefixTable.start_np`` / ``length_np``, indexed by
    ``req_pool_indices``). ``extend_lens[i]`` new tokens of request i follow those of i-1 in
    the batch's stacked queries. ``max_groups``: plan at most that many (extent, length)
    groups (None: any number; they are batched into ``plan.calls``).
    """
    bs = req_pool_indices.shape[0]
    if prefix_lens.shape != (bs,) or extend_lens.shape != (bs,):
        raise ValueError(f"plan_extend: prefix_lens {prefix_lens.shape} and extend_lens "
                         f"{extend_lens.shape} must both be ({bs},)")
    active = (prefix_lens > 0) & (extend_lens > 0)
    if not active.any() and not cover_all:
        return None, "no cached prefix" if not (prefix_lens > 0).any() else "no new tokens"
    hot_len = np.where(active, np.minimum(table_length[req_pool_indices], prefix_lens), 0)
    members = np.flatnonzero(hot_len > 0)
    if members.shape[0] == 0 and not cover_all:
        return None, "no HOT prefix in the batch"
    keys = np.stack([table_start[req_pool_indices[members]], hot_len[members]], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if max_groups is not None and uniq.shape[0] > max_groups:
        return None, f"{uniq.shape[0]} HOT extents in one batch (limit {max_groups})"
    tok_begin = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(extend_lens, out=tok_begin[1:])
    found = [ExtendGroup(int(uniq[g, 0]), int(uniq[g, 1]), _tokens_of(members[inverse == g], tok_begin),
                         int((inverse == g).sum())) for g in range(uniq.shape[0])]
    found.sort(key=lambda gr: int(gr.token_idx[0]))
    rem = np.flatnonzero(active & (prefix_lens > hot_len))
    paged: Optional[PagedRemainder] = None
    if rem.shape[0]:
        paged = PagedRemainder(rows=req_pool_indices[rem].astype(np.int64), lo=hot_len[rem].astype(np.int64),
                               hi=prefix_lens[rem].astype(np.int64), qo_lens=extend_lens[rem].astype(np.int64),
                               token_idx=_tokens_of(rem, tok_begin))
    groups = tuple(found)
    return ExtendPlan(groups, batch_calls(groups), paged, tok_begin), ""


def _tokens_of(reqs: np.ndarray, tok_begin: np.ndarray) -> np.ndarray:
    """Stacked token positions of the (ascending) batch positions ``reqs``."""
    counts = tok_begin[reqs + 1] - tok_begin[reqs]
    offset = np.repeat(tok_begin[reqs] - (np.cumsum(counts) - counts), counts)
    return offset + np.arange(int(counts.sum()), dtype=np.int64)
