r"""Host-side planning of one extend (prefill) batch: which new tokens can attend their cached
prefix as one dense call over a HOT extent.

When agents join a cached shared prefix, each new token attends to the whole prefix. SGLang's
flashinfer backend computes that part with its paged prefill wrapper, request by request
(page size 1, FA2). If a request's cached prefix is exactly one HOT run, the prefix is a
contiguous slice of the KV buffer, and all requests that start at the same slot with the same
prefix length can be served by ONE ragged (dense) call: their new tokens stacked as queries,
the extent as K/V, no mask (docs/design.md, "Prefill over a HOT prefix")::

    batch position:        0      1      2      3      4
    prefix_len (cached):  512    512      0    512    300
    hot run (start, len): (100,512) (100,512) - (100,512) (900,300)
    new tokens:            7      5      9      4      6      -> token ranges [0,7) [7,12) ...
    group 0: extent [100, 612), requests [0, 1, 3] -> tokens [0,12) + [21,25)
    group 1: extent [900, 1200), requests [4]       -> tokens [25,31)
    request 2 has no cached prefix: its tokens get no prefix part (LSE -inf)

A batch is eligible only if EVERY request with a cached prefix has it entirely HOT
(``hot_len == prefix_len``): the stock paged part is then not needed at all. Otherwise
(a COLD part in some prefix: chunked prefill of an unshared prompt, an agent's earlier turns)
the whole batch goes to the stock path, and ``reason`` says why.
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
class ExtendPlan:
    groups: Tuple[ExtendGroup, ...]
    num_tokens: int  # all new tokens of the batch

    @property
    def hot_tokens(self) -> int:
        """New tokens whose prefix part the dense calls serve."""
        return sum(g.num_tokens for g in self.groups)

    @property
    def covers_all_tokens(self) -> bool:
        return self.hot_tokens == self.num_tokens

    @property
    def prefix_pairs(self) -> int:
        """(new token, prefix token) pairs computed: sum of tokens x extent length."""
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
    """``(plan, "")`` when the batch is eligible, else ``(None, reason)``.

    All inputs are int64 numpy arrays ``[bs]`` in batch order, except ``table_start`` /
    ``table_length`` (``HotPrefixTable.start_np`` / ``length_np``, indexed by
    ``req_pool_indices``). ``extend_lens[i]`` new tokens of request i follow those of i-1 in
    the batch's stacked queries.
    """
    bs = req_pool_indices.shape[0]
    if prefix_lens.shape != (bs,) or extend_lens.shape != (bs,):
        raise ValueError(f"plan_extend: prefix_lens {prefix_lens.shape} and extend_lens "
                         f"{extend_lens.shape} must both be ({bs},)")
    has_prefix = prefix_lens > 0
    if not has_prefix.any():
        return None, "no cached prefix"
    hot_len = table_length[req_pool_indices]
    partial = has_prefix & (hot_len != prefix_lens)
    if partial.any():
        i = int(np.flatnonzero(partial)[0])
        return None, ("cached prefix not entirely HOT" if hot_len[i] else "cached prefix is COLD")
    members = np.flatnonzero(has_prefix & (extend_lens > 0))
    if members.shape[0] == 0:
        return None, "no new tokens"
    starts = table_start[req_pool_indices[members]]
    lens = prefix_lens[members]
    keys = np.stack([starts, lens], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    if uniq.shape[0] > max_groups:
        return None, f"{uniq.shape[0]} HOT extents in one batch (limit {max_groups})"
    tok_begin = np.zeros(bs + 1, dtype=np.int64)
    np.cumsum(extend_lens, out=tok_begin[1:])
    groups = []
    for g in range(uniq.shape[0]):
        reqs = members[inverse == g]  # ascending batch positions
        counts = extend_lens[reqs]
        # tokens of reqs, stacked: request r's range [tok_begin[r], tok_begin[r] + counts[r])
        offset = np.repeat(tok_begin[reqs] - (np.cumsum(counts) - counts), counts)
        token_idx = offset + np.arange(int(counts.sum()), dtype=np.int64)
        groups.append(ExtendGroup(int(uniq[g, 0]), int(uniq[g, 1]), token_idx, int(reqs.shape[0])))
    groups.sort(key=lambda gr: int(gr.token_idx[0]))
    return ExtendPlan(tuple(groups), int(tok_begin[-1])), ""
