"""Several query tokens per request (a verify step's shape) through the decode cascade.

``expand_query_tokens`` turns ``bs`` requests with ``T`` query tokens each into ``bs * T``
decode rows; the cascade paths then run unchanged. Checked per query row against float64
attention computed here from the definition (token t of request i sees its request's keys up to
position ``seq_lens[i] - T + t``), at GQA 1 / 3 / 4 / 5, T = 1 / 2 / 3 / 8, fp16 / fp32, with
the tolerances of test_cascade.py. Planted fault: rows that end one token late (every draft
token seeing the next one, as an off-by-one in the expansion would plan them) fail the same check.
"""

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, make_batch

from support.per_request import assert_per_request
from support.query_rows import query_rows_ref
from granikv.attention.decode.query_tokens import expand_query_tokens
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import cascade_attention, fused_cascade_attention
from granikv.kernels.plan import Grouping

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
PATHS = {"cascade": cascade_attention, "fused": fused_cascade_attention}


def _grouping(b):
    return Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len)


def _queries(b, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b.bs * tokens, *b.q.shape[1:], generator=g).to(b.q.dtype)


def _run(path, b, q, tokens, late=0):
    rows = expand_query_tokens(_grouping(b), b.seq_lens, b.req_pool_indices, tokens)
    if late:  # the planted fault: every row planned to end ``late`` tokens past its own position
        rows = rows._replace(seq_lens=rows.seq_lens + late)
    hq, hkv = b.q.shape[1], b.k.shape[1]
    ws = CascadeWorkspace(b.bs * tokens + 2, hq, hkv, b.q.shape[2], "cpu", config=SMALL_CONFIG, sm_count=32,
                          max_splits=4)
    ws.fill(rows.grouping, rows.seq_lens, rows.req_pool_indices)
    ws.check_integrity()
    out = torch.full((b.bs * tokens, hq, b.q.shape[2]), float("nan"), dtype=q.dtype)
    PATHS[path](q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize("ratio,hkv", [(4, 2), (1, 2), (3, 2), (5, 1)])
def test_query_rows_match_causal_attention(path, dtype, tokens, ratio, hkv):
    b = make_batch(groups=((37, 2), (29, 3)), n_ungrouped=2, suffix=17, num_q_heads=ratio * hkv, num_kv_heads=hkv,
                   head_dim=32, dtype=dtype, seed=40 + ratio + tokens)
    q = _queries(b, tokens)
    out = _run(path, b, q, tokens)
    assert_per_request(out, query_rows_ref(b, q, tokens), atol=TOL[dtype], rtol=TOL[dtype])


def test_planted_late_end_fails():
    """Rows whose keys end one token late (draft token t sees token t + 1): the check fails."""
    tokens = 3
    b = make_batch(groups=((37, 2), (29, 3)), n_ungrouped=2, suffix=17, head_dim=32, dtype=torch.float32, seed=9)
    q = _queries(b, tokens)
    ref = query_rows_ref(b, q, tokens)
    assert_per_request(_run("cascade", b, q, tokens), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    with pytest.raises(AssertionError, match="request"):
        assert_per_request(_run("cascade", b, q, tokens, late=1), ref, atol=TOL[torch.float32],
                           rtol=TOL[torch.float32])


def test_expansion_layout():
    g = Grouping.of([10, 50], [4, 6], [0, 2, 3], [0, 2, 1], [4, 4, 6, 0])
    rows = expand_query_tokens(g, [9, 8, 10, 3], [5, 6, 7, 8], 2)
    assert rows.grouping.group_req_indptr.tolist() == [0, 4, 6]
    assert rows.grouping.group_req_idx.tolist() == [0, 1, 4, 5, 2, 3]
    assert rows.grouping.prefix_len.tolist() == [4, 4, 4, 4, 6, 6, 0, 0]
    assert rows.seq_lens.tolist() == [8, 9, 7, 8, 9, 10, 2, 3]
    assert rows.req_pool_indices.tolist() == [5, 5, 6, 6, 7, 7, 8, 8]
    assert np.array_equal(rows.grouping.group_start, g.group_start)


def test_query_tokens_inside_the_prefix_are_refused():
    g = Grouping.of([10], [4], [0, 1], [0], [4, 0])
    with pytest.raises(ValueError, match="request 0: 3 query tokens"):
        expand_query_tokens(g, [6, 9], [1, 2], 3)
    with pytest.raises(ValueError, match=">= 1"):
        expand_query_tokens(g, [6, 9], [1, 2], 0)
    with pytest.raises(ValueError, match="must be"):
        expand_query_tokens(g, [6, 9, 1], [1, 2, 3], 1)
