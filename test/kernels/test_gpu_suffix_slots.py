"""GPU host: the pre-replay suffix-slot copy at a real shape (Llama-3.1-8B heads, 16K shared
prefix x 64 requests + ungrouped requests, bf16), as serving runs it: the copy replayed from its
own CUDA graph (``SlotCopier``), then a captured cascade graph (``graph_plan``) replayed after
``req_to_token`` has been rewritten, back to back without a sync. The copy must equal its torch
reference exactly and every request must match the float64 reference over the table as it was
at the copy (elementwise, bf16 tolerances); the planted fault (a graph of the plan that reads
the table) must see the rewrite."""

import pytest
import torch
from conftest import fill, make_batch

from support.per_request import assert_per_request
from granikv.attention.decode.slot_copy import SLOT_COPY_TOKENS, SlotCopier
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import cascade_attention, fused_cascade_attention
from granikv.kernels.graph_capture import capture_graph
from granikv.kernels.reference import decode_attention_ref
from granikv.kernels.suffix_slots import copy_suffix_slots_reference

pytestmark = pytest.mark.gpu


def _batch(seed):
    b = make_batch(groups=((16384, 64),), n_ungrouped=4, suffix=256, ungrouped_len=3000, num_q_heads=32,
                   num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=seed)
    b.q *= 4  # peaky softmax, so that wrong keys would show
    return b


def _assert_per_request(out, ref):
    # bf16 P, V and output (8-bit mantissa): measured errors < 1e-2 x max |ref| / 4
    assert_per_request(out, ref, atol=1e-2, rtol=1e-2, atol_floor=0.0)


def _scramble(table):
    live = table > 0
    table[live] = torch.roll(table[live], 7)


@pytest.mark.parametrize("path", [cascade_attention, fused_cascade_attention])
def test_a_replay_after_the_copy_ignores_table_rewrites(path):
    b = _batch(3)
    ws = CascadeWorkspace(128, 32, 8, 128, "cuda", slot_copy_tokens=SLOT_COPY_TOKENS)
    table = b.req_to_token
    copier = SlotCopier(ws, lambda: table)
    copier.capture()
    assert copier._graph is not None
    fill(ws, b)
    assert ws.slot_copy_ready
    out = torch.full_like(b.q, float("nan"))
    graph = capture_graph(lambda: path(b.q, b.k, b.v, table, ws.graph_plan, sm_scale=b.sm_scale, out=out))
    ref = decode_attention_ref(b.q, b.k, b.v, table, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    want_copy = None
    for _ in range(3):  # back to back, no sync: copy, rewrite, replay
        saved = table.clone()
        copier.run()
        if want_copy is None:
            torch.cuda.synchronize()
            want_copy = copy_suffix_slots_reference(ws.buffers, saved)
            assert torch.equal(ws.slot_copy, want_copy)
        _scramble(table)
        graph.replay()
        table.copy_(saved)
    torch.cuda.synchronize()
    _assert_per_request(out, ref)
    # the planted fault: the same graph of the plan that reads req_to_token sees the rewrite
    bad = capture_graph(lambda: path(b.q, b.k, b.v, table, ws.plan, sm_scale=b.sm_scale, out=out))
    saved = table.clone()
    _scramble(table)
    bad.replay()
    table.copy_(saved)
    torch.cuda.synchronize()
    with pytest.raises(AssertionError, match="^request "):
        _assert_per_request(out, ref)
