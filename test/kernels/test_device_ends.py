"""Device ends: the kernels end each request's last suffix item at the batch's own device
``seq_lens`` (``SuffixEnds.bind``), so a steady decode step uploads nothing.

The kernel checks compare each request, elementwise, with the float64 decode reference at the
new lengths (fp16 tolerances of test_cascade.py); a workspace whose device metadata still holds
the old ends would miss the new tokens, so every check below fails if the kernels ignore the
bound ends, and one wrong end at any batch position fails it (``support.per_request.assert_per_request``).
"""

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, make_batch

from support.per_request import assert_per_request
from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
from granikv.kernels.reference import decode_attention_ref
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.attention.decode.reuse_base import last_item_bound, last_suffix_item
from granikv.kernels.plan import Grouping

PATHS = [cascade_attention, fused_cascade_attention]


def _workspace(b, extra=4):
    return CascadeWorkspace(b.bs + extra, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)


def _fill(ws, b, seq, ends=None, **kw):
    return ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                   b.req_pool_indices, seq_lens_dev=ends, **kw)  # fmt: skip


def _ref(b, seq):
    return decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, torch.as_tensor(seq),
                                b.sm_scale).o


def _run(path, ws, b):
    out = torch.full_like(b.q, float("nan"))
    path(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    return out


POSITIONS = {"first": lambda bs: 0, "middle": lambda bs: bs // 2, "last": lambda bs: bs - 1}


@pytest.mark.parametrize("path", PATHS)
def test_steady_steps_upload_nothing_and_match_the_reference(path):
    b = make_batch(suffix=40, ungrouped_len=70, seed=11)
    ws = _workspace(b)
    seq0 = b.seq_lens - 3
    ends = torch.as_tensor(seq0.copy())  # stands for SGLang's device seq_lens (rewritten each step)
    _fill(ws, b, seq0, ends)
    meta0, uploads0 = ws.meta.clone(), ws._uploads
    for step in (2, 1, 0):
        seq = b.seq_lens - step
        ends.copy_(torch.as_tensor(seq))
        assert ws.advance(seq, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
        assert ws._uploads == uploads0 and torch.equal(ws.meta, meta0)  # nothing copied
        assert_per_request(_run(path, ws, b), _ref(b, seq))
    assert ws.advances_in_place == 3
    ws.check_integrity()  # the host work list is rebuilt from the ends of the last advance
    assert [int(ws.work_list.sfx_hi[ws.work_list.sfx_req == i].max()) for i in range(b.bs)] == list(b.seq_lens)


@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("path", PATHS)
def test_one_wrong_device_end_at_any_position_fails_the_check(path, where):
    """The planted fault of the per-request check: after an in-place advance, one request's
    device end left at the previous step's length (a missed copy). The check names that
    request; every other request still matches."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=43)
    ws = _workspace(b)
    ends = torch.as_tensor(b.seq_lens - 1)
    _fill(ws, b, b.seq_lens - 1, ends)
    ends += 1
    assert ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
    p = POSITIONS[where](b.bs)
    ws.ends.buffer[p] -= 1  # the fault: request p ends where the previous step did
    out, ref = _run(path, ws, b), _ref(b, b.seq_lens)
    with pytest.raises(AssertionError, match=f"^request {p}: "):
        assert_per_request(out, ref)
    others = [i for i in range(b.bs) if i != p]
    assert_per_request(out[others], ref[others])


@pytest.mark.parametrize("path", PATHS)
def test_a_device_end_past_the_planned_bound_reads_no_further(path):
    """A device end larger than the work list allows (a wrong length: here 100 tokens past the
    host one) ends that request's last item at ``t_lo + sfx_max``, the most the build and its
    steady steps plan for (``last_item_bound``), never further; every other request is exact."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=47, max_ctx=400)  # room in the rows past seq_len
    ws = _workspace(b)
    wl = _fill(ws, b, b.seq_lens, torch.as_tensor(b.seq_lens.copy()))
    bound = int(ws.sfx_max[0])
    assert bound == last_item_bound(wl.suffix_chunk, SMALL_CONFIG.reuse_chunk_factor) >= wl.suffix_chunk
    lo = wl.sfx_lo[last_suffix_item(wl)]
    p = b.bs // 2
    ws.ends.buffer[p] = int(b.seq_lens[p]) + 100  # past lo + bound, inside the request's row (slot 0 there)
    assert lo[p] + bound < ws.ends.buffer[p] <= b.req_to_token.shape[1]
    cut = b.seq_lens.copy()
    cut[p] = lo[p] + bound  # what the kernels may read of request p
    assert_per_request(_run(path, ws, b), _ref(b, cut))


def test_a_staging_advance_after_an_in_place_one_reports_its_own_ends():
    """An in-place advance (ends read from the device), then a staging advance of the same
    build whose ring buffer already holds that build (only the new ends are written): the host
    work list (``work_list``, ``check_integrity``) ends each request at the staging step's
    seq_lens, as the uploaded metadata does, not at the in-place step's device ends."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=37)
    ws = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4,
                          staging_buffers=2)
    ends = torch.as_tensor(b.seq_lens - 3)
    _fill(ws, b, b.seq_lens - 3, ends)  # staging buffer 0: this build
    assert ws.advance(b.seq_lens - 2, b.req_pool_indices, bs=b.bs)  # unbound: buffer 1, written whole
    ends.copy_(torch.as_tensor(b.seq_lens - 1))
    assert ws.advance(b.seq_lens - 1, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
    assert ws.advances_in_place == 1
    assert ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs)  # unbound: buffer 0 again, new ends only
    assert ws._hi_buf == 0 and ws.advances_in_place == 1 and ws.ends.bound is None
    wl = ws.work_list
    assert wl.sfx_hi[last_suffix_item(wl)].tolist() == b.seq_lens.tolist()
    ws.check_integrity()
    assert_per_request(_run(cascade_attention, ws, b), _ref(b, b.seq_lens))  # what the metadata holds


def test_without_bound_ends_the_metadata_ends_are_used():
    """The planted fault of the checks above: advancing in place, then unbinding the ends, runs
    the kernels on the stale ends in ``meta`` and misses the new tokens."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=13)
    ws = _workspace(b)
    seq0 = b.seq_lens - 2
    ends = torch.as_tensor(b.seq_lens.copy())
    _fill(ws, b, seq0, torch.as_tensor(seq0.copy()))
    assert ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
    good = _run(cascade_attention, ws, b)
    torch.testing.assert_close(good.double(), _ref(b, b.seq_lens), atol=4e-3, rtol=4e-3)
    ws.ends.bound = None  # the fault: kernels read meta, which still ends at seq0
    stale = _run(cascade_attention, ws, b).double()
    torch.testing.assert_close(stale, _ref(b, seq0), atol=4e-3, rtol=4e-3)
    assert (stale - _ref(b, b.seq_lens)).abs().max() > 1e-2


def test_other_rows_or_unbound_ends_upload():
    b = make_batch(suffix=40, ungrouped_len=70, seed=17)
    ws = _workspace(b)
    ends = torch.as_tensor(b.seq_lens.copy())
    _fill(ws, b, b.seq_lens - 2, ends)
    u = ws._uploads
    other_rows = b.req_pool_indices.copy()
    other_rows[[0, 1]] = other_rows[[1, 0]]
    assert ws.advance(b.seq_lens - 1, other_rows, bs=b.bs, seq_lens_dev=ends)
    assert ws._uploads == u + 1 and ws.advances_in_place == 0  # new rows: the ring path uploads them
    equal_rows = other_rows.copy()  # an equal array (not the same object): rows already there
    assert ws.advance(b.seq_lens, equal_rows, bs=b.bs, seq_lens_dev=ends)
    assert ws._uploads == u + 1 and ws.advances_in_place == 1
    assert ws.advance(b.seq_lens, equal_rows, bs=b.bs)  # ends unbound: the ends travel in the upload
    assert ws._uploads == u + 2 and ws.ends.bound is None


def test_a_full_build_with_bound_ends_and_padding_rows():
    """Graph padding rows (prefix 0, one token, device seq_len at the wrapped backend's fill
    value, here 0) keep one token, and the real rows match the reference."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=19)
    ws = _workspace(b, extra=4)
    pad = 3
    seq = np.concatenate([b.seq_lens, np.ones(pad, np.int64)])
    pl = np.concatenate([b.prefix_len, np.zeros(pad, np.int64)])
    rows = np.concatenate([b.req_pool_indices, np.zeros(pad, np.int64)])
    ends = torch.as_tensor(np.concatenate([b.seq_lens, np.zeros(pad, np.int64)]))
    ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, pl), seq, rows, seq_lens_dev=ends)
    q = torch.cat([b.q, b.q[:pad]])
    for path in PATHS:
        out = torch.full_like(q, float("nan"))
        path(q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[: b.bs].double(), _ref(b, b.seq_lens), atol=4e-3, rtol=4e-3)


def test_bgemm_path_reads_the_bound_ends():
    b = make_batch(suffix=40, ungrouped_len=70, seed=23)
    ws = _workspace(b)
    ends = torch.as_tensor((b.seq_lens - 1).copy())
    _fill(ws, b, b.seq_lens - 1, ends, single_prefix_chunk=True)
    ends.copy_(torch.as_tensor(b.seq_lens))
    assert ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs, single_prefix_chunk=True, seq_lens_dev=ends)
    out = _run(bgemm_cascade_attention, ws, b)
    torch.testing.assert_close(out.double(), _ref(b, b.seq_lens), atol=4e-3, rtol=4e-3)


def test_ends_that_do_not_fit_are_refused():
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b)
    for bad in (torch.zeros(b.bs - 1, dtype=torch.int64), torch.zeros(b.bs, dtype=torch.float32),
                torch.zeros(b.bs, 1, dtype=torch.int64)):
        assert not ws.ends.fits(bad, b.bs)
        with pytest.raises(ValueError, match="seq_lens_dev"):
            _fill(ws, b, b.seq_lens, bad)


def test_check_integrity_reads_the_device_ends():
    """After an in-place advance the host work list is rebuilt from the device ends, so
    ``check_integrity`` sees a corrupted end (here: one that leaves a last item empty)."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=29)
    ws = _workspace(b)
    ends = torch.as_tensor(b.seq_lens - 2)
    _fill(ws, b, b.seq_lens - 2, ends)
    ends += 1
    assert ws.advance(b.seq_lens - 1, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
    ws.check_integrity()
    ends += 1
    assert ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs, seq_lens_dev=ends)
    base = ws._reuse_base
    ws.ends.buffer[0] = int(base.last_lo1[0]) - 1  # the planted fault: request 0's last item ends where it starts
    with pytest.raises(AssertionError, match="empty work item"):
        ws.check_integrity()


def test_a_refused_advance_leaves_the_bound_ends():
    """``advance`` returns False having done nothing: a step that needs a fill (here: a last
    chunk grown past the reuse bound) copies no ends either (the fill binds them once)."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=31)
    ws = _workspace(b)
    ends = torch.as_tensor(b.seq_lens.copy())
    _fill(ws, b, b.seq_lens, ends)
    before = ws.ends.buffer.clone()
    far = b.seq_lens + int(SMALL_CONFIG.reuse_chunk_factor * ws.work_list.suffix_chunk) + 1
    assert not ws.advance(far, b.req_pool_indices, bs=b.bs, seq_lens_dev=torch.as_tensor(far))
    assert torch.equal(ws.ends.buffer, before) and ws.ends.bound is ws.ends.buffer


@pytest.mark.parametrize("path", PATHS)
def test_a_build_with_bound_ends_counts_as_in_place(path):
    """``build_in_place``: a build uploaded with its ends bound to the device is an in-place
    advance to its lengths (``in_place_headroom`` and ``repeat_in_place`` hold at once), and the
    steps repeated from it end each last item at the new device ends: the reference's outputs.
    Refused without bound ends, for other rows, after an advance, or for more positions than
    the build's."""
    b = make_batch(suffix=40, ungrouped_len=70, seed=23)
    ws = _workspace(b)
    seq = b.seq_lens - 2
    ends = torch.as_tensor(seq.copy())
    _fill(ws, b, seq)  # unbound ends: the kernels read the metadata's
    assert not ws.build_in_place(b.bs, b.req_pool_indices) and ws.in_place_headroom(seq) is None
    _fill(ws, b, seq, ends)  # the same grouping: an advance that uploads, not a build
    assert ws.fills_built == 1 and not ws.build_in_place(b.bs, b.req_pool_indices)
    ws = _workspace(b)
    _fill(ws, b, seq, ends)
    other = b.req_pool_indices[::-1].copy()
    assert not ws.build_in_place(b.bs, other) and not ws.build_in_place(b.bs + 1, b.req_pool_indices)
    assert ws.build_in_place(b.bs, b.req_pool_indices)
    room = ws.in_place_headroom(seq)
    assert room is not None and room >= 2
    for step in (1, 0):  # two steady steps: the device ends move, nothing else
        s = b.seq_lens - step
        ends.copy_(torch.as_tensor(s))
        assert ws.repeat_in_place(b.bs) and ws.in_place_headroom(s) == room - (2 - step)
        ws.ends.copy_from(ends, b.bs)  # what a replay's first node does (the graph's in-graph copy)
        assert_per_request(_run(path, ws, b), _ref(b, s))
    ws.check_integrity()
    assert not ws.build_in_place(b.bs, b.req_pool_indices)  # in place already
