"""Steady decode steps reuse the previous work list (``CascadeWorkspace._advance``) and the
previous grouping (``plan.GroupingMemo``): the reused plan must be as correct as a full build.

The coverage checks are exact (integer token ranges); the kernel check compares with the
float64 decode reference at the fp16 tolerances of test_cascade.py.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.kernels.cascade import cascade_attention, fused_cascade_attention
from granikv.kernels.reference import decode_attention_ref
from granikv.attention.decode.work_list import build_work_list
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.attention.grouping import BatchDescription, GroupingMemo, group_requests
from granikv.kernels.plan import Grouping


def _workspace(b, config=SMALL_CONFIG, extra=4):
    return CascadeWorkspace(b.bs + extra, 8, 2, 64, "cpu", config=config, sm_count=32, max_splits=4)


def _check_cover(wl, prefix_len, seq_lens, chunk_limit):
    """Every request's suffix items tile [prefix_len, seq_len) exactly, none empty, none longer
    than chunk_limit; partial rows are written exactly once (check_integrity does that)."""
    for i in range(wl.bs):
        sel = np.flatnonzero(wl.sfx_req == i)
        lo, hi = wl.sfx_lo[sel], wl.sfx_hi[sel]
        assert (hi > lo).all() and (hi - lo <= chunk_limit).all()
        assert lo[0] == prefix_len[i] and hi[-1] == seq_lens[i]
        assert (lo[1:] == hi[:-1]).all(), f"request {i}: items do not tile its suffix"


def _advance_steps(ws, b, steps, grow=1):
    """Fill at seq_lens - steps * grow (at least one suffix token, as in decode), then advance
    ``grow`` tokens per step up to b.seq_lens."""
    kinds = []
    for s in range(steps, -1, -1):
        before = ws.fills_reused
        seq = np.maximum(b.seq_lens - s * grow, b.prefix_len + 1)
        wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                     b.req_pool_indices)  # fmt: skip
        ws.check_integrity()
        _check_cover(wl, b.prefix_len, seq, max(ws.config.reuse_chunk_factor, 1.0) * wl.suffix_chunk)
        kinds.append("reused" if ws.fills_reused > before else "built")
    return kinds


def test_steady_steps_reuse_and_stay_exact():
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b)
    kinds = _advance_steps(ws, b, steps=30)
    assert kinds[0] == "built" and kinds.count("reused") >= 20, kinds
    # a rebuild happens once some last chunk would exceed the factor, and then reuse resumes
    assert ws.fills_built + ws.fills_reused == 31


@pytest.mark.parametrize("path", [cascade_attention, fused_cascade_attention])
def test_kernels_on_a_reused_work_list_match_the_reference(path):
    b = make_batch(suffix=40, ungrouped_len=70, seed=3)
    ws = _workspace(b)
    kinds = _advance_steps(ws, b, steps=5)
    assert kinds[-1] == "reused"  # the plan the kernels run below
    out = torch.full_like(b.q, float("nan"))
    path(b.q, b.k, b.v, b.req_to_token, ws.plan, sm_scale=b.sm_scale, out=out)
    ref = decode_attention_ref(b.q, b.k, b.v, b.req_to_token, b.req_pool_indices, b.seq_lens, b.sm_scale).o
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)


def test_reused_list_equals_a_fresh_build_in_coverage_and_rows():
    b = make_batch(suffix=40, ungrouped_len=70, seed=5)
    ws = _workspace(b)
    _advance_steps(ws, b, steps=3)
    fresh = build_work_list(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                            b.seq_lens, ratio=4, num_kv_heads=2, config=SMALL_CONFIG, sm_count=32,
                            max_splits=4)  # fmt: skip
    wl = ws.work_list
    # same prefix items; the suffix may be cut differently, but both cover the same tokens
    for f in ("pfx_row_lo", "pfx_row_hi", "pfx_slot_lo", "pfx_n_kv", "pfx_split", "group_req_idx"):
        assert np.array_equal(getattr(wl, f), getattr(fresh, f)), f
    _check_cover(fresh, b.prefix_len, b.seq_lens, fresh.suffix_chunk)


def test_rebuild_when_the_plan_cannot_be_extended():
    b = make_batch(suffix=40, ungrouped_len=70, seed=7)
    ws = _workspace(b)
    fill(ws, b)
    assert (ws.fills_built, ws.fills_reused) == (1, 0)
    # growth beyond reuse_chunk_factor * suffix_chunk in one go
    far = b.seq_lens + int(SMALL_CONFIG.reuse_chunk_factor * ws.work_list.suffix_chunk) + 1
    ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), far,
            b.req_pool_indices)  # fmt: skip
    assert ws.fills_built == 2
    # a position whose sequence is now shorter than its last chunk's start (a new request)
    short = far.copy()
    short[np.flatnonzero(b.prefix_len == 0)[0]] = 1
    ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), short,
            b.req_pool_indices)  # fmt: skip
    assert ws.fills_built == 3
    # another grouping (a group's prefix shorter) -> other prefix items
    g_len = b.group_len.copy()
    g_len[0] -= 1
    p_len = b.prefix_len.copy()
    p_len[b.group_req_idx[b.group_req_indptr[0]:b.group_req_indptr[1]]] = g_len[0]
    ws.fill(Grouping.of(b.group_start, g_len, b.group_req_indptr, b.group_req_idx, p_len), short + 1, b.req_pool_indices)
    assert ws.fills_built == 4
    ws.check_integrity()
    _check_cover(ws.work_list, p_len, short + 1, ws.work_list.suffix_chunk)


def test_reuse_can_be_disabled():
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b, config=dataclasses.replace(SMALL_CONFIG, reuse_chunk_factor=0.0))
    assert _advance_steps(ws, b, steps=4) == ["built"] * 5


def test_grouping_memo_hits_only_while_hot_runs_are_unchanged():
    rng = np.random.default_rng(0)
    bs = 24
    rpi = np.arange(bs, dtype=np.int64)
    hot_start = np.where(rng.random(bs) < 0.7, rng.choice([100, 900, 5000], bs), 0).astype(np.int64)
    hot_len = np.where(hot_start > 0, rng.integers(200, 400, bs), 0).astype(np.int64)
    seq = hot_len + rng.integers(1, 50, bs)
    memo = GroupingMemo()
    for step in range(5):
        desc = BatchDescription(rpi, seq + step, hot_start, hot_len)
        g = memo.group(desc, min_group_size=2)
        ref = group_requests(desc, min_group_size=2)
        for f in ("group_start", "group_len", "group_req_indptr", "group_req_idx", "prefix_len"):
            assert np.array_equal(getattr(g, f), getattr(ref, f)), f
    assert (memo.hits, memo.misses) == (4, 1)
    hot_len2 = hot_len.copy()
    hot_len2[np.flatnonzero(hot_len)[0]] += 7  # a promotion / extension changed one run
    desc = BatchDescription(rpi, seq + 10, hot_start, hot_len2)
    g = memo.group(desc, min_group_size=2)
    assert memo.misses == 2 and np.array_equal(g.prefix_len, group_requests(desc, min_group_size=2).prefix_len)
    # hot_len > seq_len somewhere (never in decode): no memo, plain grouping
    desc = BatchDescription(rpi, np.ones(bs, np.int64), hot_start, hot_len2)
    g = memo.group(desc, min_group_size=2)
    assert memo.misses == 3 and g.num_groups == group_requests(desc, min_group_size=2).num_groups


def test_random_step_sequences_always_cover_every_suffix_exactly():
    """Property: whatever happens between fills (tokens added, a position taken by a new request
    of another length, the grouping changed, a paged step with an empty fill), the uploaded work
    list tiles every request's [prefix_len, seq_len) exactly, and reuse does happen."""
    rng = np.random.default_rng(42)
    b = make_batch(suffix=40, ungrouped_len=70, seed=9)
    ws = _workspace(b)
    seq = b.seq_lens.copy()
    g_len, p_len = b.group_len.copy(), b.prefix_len.copy()
    for step in range(300):
        event = rng.random()
        if event < 0.70:  # a decode step: every request one token longer
            seq = seq + 1
        elif event < 0.85:  # a position is taken by a new request with another suffix length
            i = int(rng.integers(b.bs))
            seq[i] = p_len[i] + int(rng.integers(1, 120))
        elif event < 0.93:  # the grouping changes (a group's shared prefix gets shorter or longer)
            g = int(rng.integers(len(g_len)))
            g_len[g] = max(16, g_len[g] + int(rng.integers(-5, 6)))
            members = b.group_req_idx[b.group_req_indptr[g] : b.group_req_indptr[g + 1]]
            p_len[members] = g_len[g]
            seq = np.maximum(seq, p_len + 1)
        else:  # a paged step in between (the backend fills an empty work list)
            ws.fill(Grouping.empty(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
            continue
        wl = ws.fill(Grouping.of(b.group_start, g_len, b.group_req_indptr, b.group_req_idx, p_len), seq, b.req_pool_indices)
        ws.check_integrity()
        _check_cover(wl, p_len, seq, max(SMALL_CONFIG.reuse_chunk_factor, 1.0) * wl.suffix_chunk)
    assert ws.fills_reused > 50 and ws.fills_built > 10, (ws.fills_reused, ws.fills_built)


def test_empty_fills_in_a_row_copy_nothing_and_a_real_fill_in_between_clears_the_skip():
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b)
    uploads = []
    orig = ws._upload
    ws._upload = lambda wl, rpi, *a: (uploads.append(wl.bs), orig(wl, rpi, *a))[1]
    first = ws.fill_empty()
    assert first.bs == 0 and uploads == [0] and ws.counts.tolist() == [0, 0, 0]
    assert ws.fill_empty() is first and ws.fill_empty() is first and uploads == [0]  # skipped
    assert ws.fills_skipped == 2
    wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                 b.seq_lens, b.req_pool_indices)  # fmt: skip
    assert uploads == [0, b.bs] and ws.counts.tolist()[0] == b.bs == wl.bs
    assert ws.fill_empty().bs == 0 and uploads == [0, b.bs, 0]  # the device held a real list
    assert ws.counts.tolist() == [0, 0, 0]
    ws.check_integrity()


def test_partial_uploads_leave_the_device_metadata_of_a_full_write():
    """Steady fills rewrite only sfx_hi and the rows in the staging buffer; the device metadata
    must equal what a fresh workspace uploads for the same work list, every step."""
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    fresh = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    reused = 0
    for step in range(12):
        seq = b.seq_lens + step
        before = ws.fills_reused
        wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                     b.req_pool_indices, same_grouping=step > 0)
        reused += ws.fills_reused - before
        fresh._upload(wl, b.req_pool_indices)
        assert torch.equal(ws.meta, fresh.meta), f"step {step}"
    assert reused >= 8


def test_partial_upload_check_can_fail():
    """The comparison above sees a staging buffer that claims the current base but holds
    another work list (a planted stale suffix start, which a partial write does not rewrite)."""
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    fresh = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4)
    for step in range(3):
        wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                     b.seq_lens + step, b.req_pool_indices)
    ws._host_base[ws._flip] = None  # next buffer: treated as holding another base
    o, S = ws._offs, ws.suffix_cap
    ws._host_np[ws._flip][o["sfx"] + 1 * S] += 1  # a stale suffix start
    ws._host_base[ws._flip] = ws._reuse_base  # ... claimed current
    wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                 b.seq_lens + 3, b.req_pool_indices)
    fresh._upload(wl, b.req_pool_indices)
    assert not torch.equal(ws.meta, fresh.meta)


def _padded(b, extra):
    """The batch as a graph replay pads it: ``extra`` rows of row 0, seq_len 1, no prefix."""
    z, one = np.zeros(extra, np.int64), np.ones(extra, np.int64)
    return (np.concatenate([b.prefix_len, z]), lambda seq: np.concatenate([seq, one]),
            np.concatenate([b.req_pool_indices, z]))


def _same_work_list(a, b):
    assert a.bs == b.bs and (a.prefix_chunk, a.suffix_chunk) == (b.prefix_chunk, b.suffix_chunk)
    for f in a._fields[3:]:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("extra", [0, 3])
def test_advance_equals_a_fill_of_the_padded_batch_every_step(extra):
    """``advance`` (real rows only, the padding kept from the build) leaves the device metadata
    and the work list that ``fill`` of the padded batch leaves, step after step, through
    rebuilds; the rows array is the same object every step (SGLang's staged rows)."""
    b = make_batch(suffix=40, ungrouped_len=70)
    bs = b.bs + extra
    p_len, pad_seq, rpi = _padded(b, extra)
    ref, ws = _workspace(b, extra=extra + 2), _workspace(b, extra=extra + 2)
    rows = b.req_pool_indices
    advanced = built = 0
    for step in range(40):
        seq = b.seq_lens + step
        want = ref.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len), pad_seq(seq), rpi,
                        same_grouping=step > 0)
        if ws.advance(seq, rows, bs=bs):
            advanced += 1
        else:
            built += 1
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len), pad_seq(seq), rpi,
                    same_grouping=step > 0)
        assert torch.equal(ws.meta, ref.meta), f"step {step}"
        _same_work_list(ws.work_list, want)
        ws.check_integrity()
        _check_cover(ws.work_list, p_len, pad_seq(seq), SMALL_CONFIG.reuse_chunk_factor * want.suffix_chunk)
    assert advanced >= 25 and built >= 2, (advanced, built)
    assert (ws.fills_reused, ws.fills_built) == (ref.fills_reused, ref.fills_built)  # same builds, same reuses


def test_advance_refuses_what_it_cannot_serve():
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b, extra=4)
    assert not ws.advance(b.seq_lens, b.req_pool_indices, bs=b.bs)  # nothing built yet
    wl = ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), b.seq_lens,
                 b.req_pool_indices)
    before = ws.meta.clone()
    assert not ws.advance(b.seq_lens + 1, b.req_pool_indices, bs=b.bs + 1)  # another batch size
    assert not ws.advance(b.seq_lens + 1, b.req_pool_indices, bs=b.bs, single_prefix_chunk=True)  # bgemm plan
    shrunk = b.seq_lens.copy()
    shrunk[0] = wl.sfx_lo[np.flatnonzero(wl.sfx_req == 0)[-1]]  # last chunk would be empty
    assert not ws.advance(shrunk, b.req_pool_indices, bs=b.bs)
    far = b.seq_lens + int(SMALL_CONFIG.reuse_chunk_factor * wl.suffix_chunk) + 1  # would outgrow the limit
    assert not ws.advance(far, b.req_pool_indices, bs=b.bs)
    assert torch.equal(ws.meta, before) and ws.fills_reused == 0  # refusals change nothing
    ws.fill_empty()
    assert not ws.advance(b.seq_lens + 1, b.req_pool_indices, bs=b.bs)  # the empty list is no build


def test_advance_comparison_sees_a_stale_padding_row():
    """The comparison above can fail: a staging buffer holding a wrong suffix end for a padding
    row (which an advance of the real rows does not rewrite) reaches the device metadata."""
    b = make_batch(suffix=40, ungrouped_len=70)
    extra = 2
    p_len, pad_seq, rpi = _padded(b, extra)
    ref, ws = _workspace(b, extra=extra + 2), _workspace(b, extra=extra + 2)
    steps = ws.staging_buffers + 2  # the last step's buffer held this build's work list before
    for step in range(steps):
        if step == steps - 1:
            ws._host_np[ws._flip][ws._reuse_base.hi_pos[-1]] += 1  # padding row's suffix end, next buffer
        want = ref.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len),
                        pad_seq(b.seq_lens + step), rpi, same_grouping=step > 0)
        if not ws.advance(b.seq_lens + step, b.req_pool_indices, bs=b.bs + extra):
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, p_len),
                    pad_seq(b.seq_lens + step), rpi, same_grouping=step > 0)
    assert ws.fills_reused == steps - 1
    assert not torch.equal(ws.meta, ref.meta)
    with pytest.raises(AssertionError):
        _same_work_list(ws.work_list, want)


def test_lazy_work_list_after_advance_is_checked():
    """After an advance the work list is built on first read from the staging buffer: a
    planted empty last chunk there is what check_integrity then reports."""
    b = make_batch(suffix=40, ungrouped_len=70)
    ws = _workspace(b)
    for step in range(ws.staging_buffers + 2):  # the last buffer held this build's list: a partial write
        if not ws.advance(b.seq_lens + step, b.req_pool_indices, bs=b.bs):
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                    b.seq_lens + step, b.req_pool_indices)
    assert ws._hi_buf is not None  # the last step advanced: nothing materialised yet
    base = ws._reuse_base
    ws._host_np[ws._hi_buf][base.hi_pos[0]] = base.last_lo1[0] - 1  # sfx_hi == sfx_lo
    with pytest.raises(AssertionError, match="empty work item"):
        ws.check_integrity()


# ---- the staging ring: one copy + one event per step, a wait only every few steps ------------


class _LazyDevice:
    """A stream that completes uploads only when an event of theirs is synchronized (the
    slowest device allowed): ``completed`` is the last upload known done."""

    def __init__(self, ws):
        self.ws, self.completed, self.syncs, self.records, self.events = ws, -1, 0, 0, 0
        dev = self

        class Event:
            def __init__(self):
                dev.events += 1
                self.upload = None

            def record(self):
                dev.records += 1
                self.upload = dev.ws._uploads  # the upload being issued

            def synchronize(self):
                dev.syncs += 1
                dev.completed = max(dev.completed, self.upload)

        self.Event = Event


def _ring_workspace(b, monkeypatch, **kw):
    """A CPU workspace that uploads as a CUDA one does (events), on a lazy fake device; every
    copy asserts that the host wrote its staging buffer only after that buffer's last copy."""
    ws = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4, **kw)
    dev = _LazyDevice(ws)
    monkeypatch.setattr(torch.cuda, "Event", dev.Event)
    ws._cuda = True
    real = ws._copy_up

    def checked(k, n, rows):
        last = ws._buf_upload[k]
        assert last <= dev.completed, f"buffer {k} written while its copy {last} may be pending"
        return real(k, n, rows)

    ws._copy_up = checked
    return ws, dev


@pytest.mark.parametrize("nbuf", [2, 3, 8])
def test_staging_ring_waits_only_every_few_uploads_and_never_too_little(monkeypatch, nbuf):
    b = make_batch(suffix=40, ungrouped_len=70)
    ws, dev = _ring_workspace(b, monkeypatch, staging_buffers=nbuf)
    # same ring size: past the live counts, meta keeps what its staging buffer last held
    ref = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", config=SMALL_CONFIG, sm_count=32, max_splits=4,
                           staging_buffers=nbuf)
    steps = 60
    for step in range(steps):
        seq = b.seq_lens + step
        ref.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                 b.req_pool_indices, same_grouping=step > 0)
        if not ws.advance(seq, b.req_pool_indices, bs=b.bs):
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                    b.req_pool_indices, same_grouping=step > 0)
        assert torch.equal(ws.meta, ref.meta), f"step {step}"
    assert ws._uploads == dev.records == steps and dev.events == nbuf  # one event per upload, reused
    assert ws.fills_reused >= 40
    per_wait = max(1, nbuf // 2)
    assert dev.syncs == ws.upload_waits <= steps // per_wait + 1
    if nbuf >= 8:
        assert dev.syncs <= steps // 4 + 1  # a quarter of the steps or fewer call into the device


def test_staging_ring_check_can_fail(monkeypatch):
    """Without the wait, the host writes a staging buffer whose copy is still pending: the
    check in ``_ring_workspace`` sees it."""
    b = make_batch(suffix=40, ungrouped_len=70)
    ws, dev = _ring_workspace(b, monkeypatch, staging_buffers=4)
    ws._claim = lambda k: None
    with pytest.raises(AssertionError, match="may be pending"):
        for step in range(10):
            if not ws.advance(b.seq_lens + step, b.req_pool_indices, bs=b.bs):
                ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len),
                        b.seq_lens + step, b.req_pool_indices, same_grouping=step > 0)
    with pytest.raises(ValueError, match="staging_buffers"):
        CascadeWorkspace(8, 8, 2, 64, "cpu", staging_buffers=1)


@pytest.mark.gpu
def test_staging_ring_on_a_lagging_gpu_matches_a_host_fill():
    """GPU host: the device runs behind the host (a sleep kernel before every upload), so the
    ring's waits are real; a device-side snapshot of ``meta`` after every upload, read once at
    the end, equals a CPU workspace's metadata of the same step (a host write into a buffer
    whose copy was still pending would show up here)."""
    b = make_batch(suffix=40, ungrouped_len=70)
    kw = dict(config=SMALL_CONFIG, sm_count=32, max_splits=4, staging_buffers=4)
    ref = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cpu", **kw)
    ws = CascadeWorkspace(b.bs + 4, 8, 2, 64, "cuda", **kw)
    steps = 40
    snaps = torch.empty(steps, ws.meta.numel(), dtype=ws.meta.dtype, device="cuda")
    want = []
    for step in range(steps):
        seq = b.seq_lens + step
        ref.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                 b.req_pool_indices, same_grouping=step > 0)
        want.append(ref.meta.clone())
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU work queued before this step's copy
        if not ws.advance(seq, b.req_pool_indices, bs=b.bs):
            ws.fill(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), seq,
                    b.req_pool_indices, same_grouping=step > 0)
        snaps[step].copy_(ws.meta)
    torch.cuda.synchronize()
    for step in range(steps):
        assert torch.equal(snaps[step].cpu(), want[step]), f"step {step}"
    assert ws.upload_waits <= steps // 2 + 1 and ws.fills_reused >= 20
