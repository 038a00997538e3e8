"""Several query tokens per request through the decode cascade: the shape of a verify step.

A speculative verify step scores T draft tokens of every request at once: token t of request i
sits at position ``seq_lens[i] - T + t`` and sees the request's keys up to and including
itself (a chain of drafts; the K/V of all T tokens are written before attention runs, as in
SGLang's ``target_verify``, whose queries are request-major: row ``i * T + t``). The cascade
kernels serve it as they are, as a decode batch of ``bs * T`` query rows: row ``i * T + t`` is a
request of its own, with request i's ``req_to_token`` row, its group, its prefix length and the
end ``seq_lens[i] - T + 1 + t``. So:

- the prefix launch stacks ``T * ratio`` rows per request per kv head (its tiles' M grows
  T-fold: a bandwidth-bound batch moves toward the tensor cores, the same prefix bytes read
  once for T times the queries);
- each row's suffix items read its request's suffix up to that row's end (the suffix, short by
  construction, is read once per row);
- the merge writes ``out[i * T + t]``.

``expand_query_tokens`` is that mapping, on the host, before the workspace fill (the
workspace's ``max_bs`` counts query rows). It is the planner's side of a verify step only:
SGLang's speculative decoding stays switched off under GraniKV (``eligibility``), and tree
drafts (a custom mask between draft tokens) are not this shape.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from granikv.kernels.plan import Grouping

__all__ = ["QueryRows", "expand_query_tokens"]


class QueryRows(NamedTuple):
    """A batch of ``bs`` requests with ``tokens`` query tokens each, as ``bs * tokens`` decode rows."""

    grouping: Grouping
    seq_lens: np.ndarray  # int64 [bs * tokens]: row i * T + t ends at seq_lens[i] - T + 1 + t
    req_pool_indices: np.ndarray  # int64 [bs * tokens]: request i's row, T times


def expand_query_tokens(grouping: Grouping, seq_lens: npt.ArrayLike, req_pool_indices: npt.ArrayLike,
                        tokens: int) -> QueryRows:
    """The decode rows of a batch whose requests each end in ``tokens`` query tokens.

    ``grouping``, ``seq_lens``, ``req_pool_indices``: the batch per request, as a decode step
    has them (``seq_lens`` counts the query tokens). Every request's first query token must come
    after its HOT prefix (``seq_lens - tokens >= prefix_len``): the draft tokens are new tokens,
    never part of a shared prefix. ValueError otherwise, or for ``tokens < 1``.
    """
    seq = np.asarray(seq_lens, dtype=np.int64)
    rpi = np.asarray(req_pool_indices, dtype=np.int64)
    bs = grouping.batch_size
    if tokens < 1:
        raise ValueError(f"query tokens per request must be >= 1, got {tokens}")
    if seq.shape != (bs,) or rpi.shape != (bs,):
        raise ValueError(f"seq_lens {seq.shape} and req_pool_indices {rpi.shape} must be [{bs}] (the grouping's batch)")
    first = seq - tokens  # position of each request's first query token
    bad = np.flatnonzero(first < grouping.prefix_len)
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"request {i}: {tokens} query tokens in a sequence of {int(seq[i])} with a HOT prefix "
                         f"of {int(grouping.prefix_len[i])}: query tokens must follow the prefix")
    t = np.arange(tokens, dtype=np.int64)
    rows = Grouping(
        group_start=grouping.group_start,
        group_len=grouping.group_len,
        group_req_indptr=grouping.group_req_indptr * tokens,
        group_req_idx=(grouping.group_req_idx[:, None] * tokens + t).reshape(-1),  # ascending within a group
        prefix_len=np.repeat(grouping.prefix_len, tokens),
    )
    return QueryRows(rows, (first[:, None] + 1 + t).reshape(-1), np.repeat(rpi, tokens))
