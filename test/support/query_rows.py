"""The float64 reference of a verify step's shape, from its definition, for the CPU and GPU
tests of ``query_tokens.expand_query_tokens``."""

import torch

from granikv.kernels.reference import attend_ref


def query_rows_ref(b, q: torch.Tensor, tokens: int) -> torch.Tensor:
    """float64 [bs * T, Hq, D]: query row i * T + t over request i's keys [0, seq_lens[i] - T + 1 + t)
    (``b``: a conftest ``make_batch``)."""
    out = []
    for i in range(b.bs):
        slots = b.req_to_token[int(b.req_pool_indices[i])].long()
        for t in range(tokens):
            end = int(b.seq_lens[i]) - tokens + 1 + t
            out.append(attend_ref(q[i * tokens + t], b.k[slots[:end]], b.v[slots[:end]], b.sm_scale).o)
    return torch.stack(out)
