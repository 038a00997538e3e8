"""The pre-replay copy of a step's suffix slots (kernels/suffix_slots.py) and the suffix
kernels reading it (``CascadePlan.slot_copy``): what lets a cascade graph replay read nothing
SGLang's scheduler may write while the replay runs.

The copy must match the torch reference exactly (a data-movement kernel). The kernels reading
it must match the float64 decode reference per request, and must keep matching when
``req_to_token`` is rewritten after the copy (what the scheduler may do during a replay):
the planted faults show the same checks fail when the kernels read the table, or a wrong copy.
"""

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, make_batch

from support.per_request import assert_per_request
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.cascade import cascade_attention, fused_cascade_attention
from granikv.kernels.plan import Grouping
from granikv.kernels.reference import decode_attention_ref
from granikv.kernels.suffix_slots import (append_suffix_slots, append_suffix_slots_reference, copy_suffix_slots,
                                         copy_suffix_slots_reference)

PATHS = [cascade_attention, fused_cascade_attention]


def _workspace(b, tokens=256, extra=4):
    return CascadeWorkspace(b.bs + extra, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4,
                            slot_copy_tokens=tokens)


def _fill(ws, b, seq, ends=None):
    return ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                   b.req_pool_indices, seq_lens_dev=ends)  # fmt: skip


def _ref(b, seq, req_to_token=None):
    r2t = b.req_to_token if req_to_token is None else req_to_token
    return decode_attention_ref(b.q, b.k, b.v, r2t, b.req_pool_indices, torch.as_tensor(seq), b.sm_scale).o


def _run(path, plan, b, req_to_token=None):
    out = torch.full_like(b.q, float("nan"))
    path(b.q, b.k, b.v, b.req_to_token if req_to_token is None else req_to_token, plan, sm_scale=b.sm_scale,
         out=out)
    return out


def _scrambled(b):
    """``req_to_token`` with every row pointing at other slots (what a rewrite of the table
    after the copy looks like to a kernel that reads it)."""
    r2t = b.req_to_token.clone()
    r2t[r2t > 0] = torch.roll(r2t[r2t > 0], 7)
    return r2t


@pytest.mark.parametrize("seed", [3, 5])
def test_the_copy_matches_its_reference_exactly(seed):
    b = make_batch(suffix=40, ungrouped_len=70, seed=seed, max_ctx=150)
    ws = _workspace(b)
    wl = _fill(ws, b, b.seq_lens)
    assert ws.slot_copy_ready and int(ws.slot_copy_on[0]) == 1 and wl.num_suffix_items > 1
    ws.slot_copy.fill_(-5)  # rows of dead items and entries past sfx_max keep what they hold
    want = copy_suffix_slots_reference(ws.buffers, b.req_to_token)
    copy_suffix_slots(ws.buffers, b.req_to_token)
    assert torch.equal(ws.slot_copy, want)
    n = int(ws.sfx_max[0])
    for w in range(wl.num_suffix_items):  # each live item: its slots, from its first token on
        row = b.req_to_token[b.req_pool_indices[wl.sfx_req[w]]]
        lo, hi = int(wl.sfx_lo[w]), int(wl.sfx_hi[w])
        assert torch.equal(ws.slot_copy[w, : hi - lo], row[lo:hi])
    assert (ws.slot_copy[wl.num_suffix_items:] == -5).all() and (ws.slot_copy[:, n:] == -5).all()


@pytest.mark.parametrize("path", PATHS)
def test_kernels_reading_the_copy_ignore_later_table_writes(path):
    """After the copy, ``req_to_token`` is rewritten: the kernels of a slot-copy plan still
    match the reference over the table as it was at the copy, request by request."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=7)
    ws = _workspace(b)
    _fill(ws, b, b.seq_lens)
    copy_suffix_slots(ws.buffers, b.req_to_token)
    later = _scrambled(b)
    assert_per_request(_run(path, ws.graph_plan, b, later), _ref(b, b.seq_lens))


@pytest.mark.parametrize("path", PATHS)
def test_planted_fault_a_kernel_reading_the_table_sees_the_later_writes(path):
    """The fault the copy removes: the plan without the copy reads the rewritten table and
    misses the reference (the check above can fail)."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=7)
    ws = _workspace(b)
    _fill(ws, b, b.seq_lens)
    copy_suffix_slots(ws.buffers, b.req_to_token)
    with pytest.raises(AssertionError, match="^request "):
        assert_per_request(_run(path, ws.plan, b, _scrambled(b)), _ref(b, b.seq_lens))


@pytest.mark.parametrize("path", PATHS)
def test_planted_fault_one_wrong_copied_slot_fails_its_request_only(path):
    b = make_batch(suffix=40, ungrouped_len=70, seed=9)
    ws = _workspace(b)
    wl = _fill(ws, b, b.seq_lens)
    copy_suffix_slots(ws.buffers, b.req_to_token)
    w = wl.num_suffix_items // 2
    p = int(wl.sfx_req[w])
    ws.slot_copy[w, 0] = int(b.req_to_token[b.req_pool_indices[p], 0]) + 1  # another slot
    out, ref = _run(path, ws.graph_plan, b), _ref(b, b.seq_lens)
    with pytest.raises(AssertionError, match=f"^request {p}: "):
        assert_per_request(out, ref)
    others = [i for i in range(b.bs) if i != p]
    assert_per_request(out[others], ref[others])


@pytest.mark.parametrize("path", PATHS)
def test_in_place_steps_copy_the_new_token_each_step(path):
    """Steady steps with device ends upload nothing; the copy of each step covers its new token
    (an item's copy spans ``sfx_max`` tokens), so the kernels match the new lengths."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=11)
    ws = _workspace(b)
    seq0 = b.seq_lens - 3
    ends = torch.as_tensor(seq0.copy())
    _fill(ws, b, seq0, ends)
    for step in (2, 1, 0):
        seq = b.seq_lens - step
        ends.copy_(torch.as_tensor(seq))
        assert ws.advance(seq, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
        copy_suffix_slots(ws.buffers, b.req_to_token)
        assert_per_request(_run(path, ws.graph_plan, b, _scrambled(b)), _ref(b, seq))
    assert ws.advances_in_place == 3
    ws.check_integrity()
    ws.slot_copy_on.fill_(0)  # the planted fault: the device no longer says the copy serves the build
    with pytest.raises(AssertionError, match="slot_copy_on=False, host slot_copy_ready=True"):
        ws.check_integrity()


@pytest.mark.parametrize("path", PATHS)
def test_items_wider_than_the_copy_read_the_table(path):
    """A build whose items may hold more tokens than the table is wide turns the copy off on
    the device: the copy writes nothing and the same graph plan reads ``req_to_token``."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=13)
    ws = _workspace(b, tokens=16)  # narrower than sfx_max (>= suffix_chunk >= 16 * 2 here)
    _fill(ws, b, b.seq_lens)
    assert int(ws.sfx_max[0]) > 16 and not ws.slot_copy_ready and int(ws.slot_copy_on[0]) == 0
    ws.check_integrity()
    before = ws.slot_copy.clone()
    copy_suffix_slots(ws.buffers, b.req_to_token)
    assert torch.equal(ws.slot_copy, before)
    assert_per_request(_run(path, ws.graph_plan, b), _ref(b, b.seq_lens))


def test_a_workspace_without_a_table_has_no_slot_copy_plan():
    b = make_batch(seed=1)
    ws = CascadeWorkspace(b.bs, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    _fill(ws, b, b.seq_lens)
    assert ws.slot_copy is None and not ws.slot_copy_ready and not ws.graph_plan.slot_copy
    with pytest.raises(ValueError, match="no slot_copy table"):
        copy_suffix_slots(ws.buffers, b.req_to_token)
    np.testing.assert_array_equal(ws.slot_copy_on.numpy(), [0])


def _new_token_slots(b, seq, r2t, seed):
    """SGLang's decode step in miniature: a slot per request for the token at position ``seq -
    1``, written to ``req_to_token`` and returned as the step's ``out_cache_loc`` (int64)."""
    loc = torch.randint(1, b.k.shape[0], (b.bs,), generator=torch.Generator().manual_seed(seed))
    rows = torch.as_tensor(b.req_pool_indices, dtype=torch.int64)
    r2t[rows, torch.as_tensor(seq, dtype=torch.int64) - 1] = loc.to(torch.int32)
    return loc


def test_the_append_matches_its_reference_exactly():
    b = make_batch(suffix=40, ungrouped_len=70, seed=3, max_ctx=150)
    ws = _workspace(b)
    ends = torch.as_tensor(b.seq_lens.copy())
    wl = _fill(ws, b, b.seq_lens, ends)
    ws.slot_copy.fill_(-5)
    loc = torch.arange(900, 900 + b.bs, dtype=torch.int64)
    want = append_suffix_slots_reference(ws.buffers, loc, ws.ends.buffer)
    append_suffix_slots(ws.buffers, loc, ws.ends.buffer)
    assert torch.equal(ws.slot_copy, want)
    last = {}
    for w in range(wl.num_suffix_items):
        last[int(wl.sfx_req[w])] = w
    written = (ws.slot_copy != -5).nonzero().tolist()
    assert sorted(written) == sorted([w, int(b.seq_lens[r]) - 1 - int(wl.sfx_lo[w])] for r, w in last.items())
    assert all(int(ws.slot_copy[w, p]) == 900 + r for r, w in last.items()
               for p in [int(b.seq_lens[r]) - 1 - int(wl.sfx_lo[w])])
    ws.slot_copy_on.fill_(0)  # off: nothing written
    ws.slot_copy.fill_(-5)
    append_suffix_slots(ws.buffers, loc, ws.ends.buffer)
    assert (ws.slot_copy == -5).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("planted", [False, True])
def test_steps_after_one_copy_read_the_appended_slots(path, planted):
    """One copy at the first step, then only the append per step (what a steady replay's graph
    does): every step's kernels, reading the copy while ``req_to_token`` is scrambled, match the
    float64 reference per request. Planted: the appends stop after the first steady step, so
    the copy misses every later token's slot and the requests whose newest token is read from a
    stale entry fail."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=11, max_ctx=160)
    ws = _workspace(b)
    r2t = b.req_to_token
    seq = b.seq_lens - 4
    ends = torch.as_tensor(seq.copy())
    _fill(ws, b, seq, ends)
    copy_suffix_slots(ws.buffers, r2t)
    failed = False
    for step in range(1, 9):
        seq = seq + 1
        loc = _new_token_slots(b, seq, r2t, seed=step)
        ends.copy_(torch.as_tensor(seq))
        assert ws.advance(seq, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
        if not (planted and step > 1):
            append_suffix_slots(ws.buffers, loc, ws.ends.buffer)
        out = _run(path, ws.graph_plan, b, _scrambled(b))
        try:
            assert_per_request(out, _ref(b, seq))
        except AssertionError:
            failed = True
            assert planted, f"step {step}"
    assert failed is planted
