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
least one request has a HOT run (else the stock path is as good: ``reason`` says why).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

MAX_EXTEND_GROUPS = 8  # distinct (extent, length) pairs per extend batch; beyond: stock path


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

    def slot_coords(self):
        """``(rows, cols)`` int64 of every remainder slot in ``req_to_token``, request by request."""
        n = self.hi - self.lo
        rows = np.repeat(self.rows, n)
        cols = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(self.kv_indptr[:-1] - self.lo, n)
        return rows, cols


@dataclass(frozen=True, eq=False)
class ExtendPlan:
    groups: Tuple[ExtendGroup, ...]
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
    max_groups: int = MAX_EXTEND_GROUPS,
) -> Tuple[Optional[ExtendPlan], str]:
    """``(plan, "")`` when the batch is planned, else ``(None, reason)``.

    All inputs are int64 numpy arrays ``[bs]`` in batch order, except ``table_start`` /
    ``table_length`` (``HotPrefixTable.start_np`` / ``length_np``, indexed by
    ``req_pool_indices``). ``extend_lens[i]`` new tokens of request i follow those of i-1 in
    the batch's stacked queries.
    """
    bs = req_pool_indices.shape[0]
    if prefix_lens.shape != (bs,) or extend_lens.shape != (bs,):
        raise ValueError(f"plan_extend: prefix_lens {prefix_lens.shape} and extend_lens "
                         f"{extend_lens.shape} must both be ({bs},)")
    active = (prefix_lens > 0) & (extend_lens > 0)
    if not active.any():
        return None, "no cached prefix" if not (prefix_lens > 0).any() else "no new tokens"
    hot_len = np.where(active, np.minimum(table_length[req_pool_indices], prefix_lens), 0)
    members = np.flatnonzero(hot_len > 0)
    if members.shape[0] == 0:
        return None, "no HOT prefix in the batch"
    keys = np.stack([table_start[req_pool_indices[members]], hot_len[members]], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if uniq.shape[0] > max_groups:
        return None, f"{uniq.shape[0]} HOT extents in one batch (limit {max_groups})"
    tok_begin = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(extend_lens, out=tok_begin[1:])
    groups = [ExtendGroup(int(uniq[g, 0]), int(uniq[g, 1]), _tokens_of(members[inverse == g], tok_begin),
                          int((inverse == g).sum())) for g in range(uniq.shape[0])]
    groups.sort(key=lambda gr: int(gr.token_idx[0]))
    rem = np.flatnonzero(active & (prefix_lens > hot_len))
    paged = None
    if rem.shape[0]:
        paged = PagedRemainder(rows=req_pool_indices[rem].astype(np.int64), lo=hot_len[rem].astype(np.int64),
                               hi=prefix_lens[rem].astype(np.int64), qo_lens=extend_lens[rem].astype(np.int64),
                               token_idx=_tokens_of(rem, tok_begin))
    return ExtendPlan(tuple(groups), paged, tok_begin), ""


def _tokens_of(reqs: np.ndarray, tok_begin: np.ndarray) -> np.ndarray:
    """Stacked token positions of the (ascending) batch positions ``reqs``."""
    counts = tok_begin[reqs + 1] - tok_begin[reqs]
    offset = np.repeat(tok_begin[reqs] - (np.cumsum(counts) - counts), counts)
    return offset + np.arange(int(counts.sum()), dtype=np.int64)
