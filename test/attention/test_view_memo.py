"""``ViewPlanMemo``: a steady cascade graph step skips planning the wrapped backend's one-token
view when the previous step left exactly that view in place, and plans it again after anything
that could have changed it. The backend is the real GraniKVAttnBackend over test_backend's
paged stand-in (which records what it was planned with); the graph steps go through the
backend's capture and replay metadata calls as SGLang's graph runner makes them."""

from types import SimpleNamespace

import pytest
import torch

from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.decode.view_memo import ViewPlanMemo
from granikv.config import GraniKVConfig
from test_backend import ATOL, HOT_BASE, LAYER, RTOL, PagedStandIn, _batch, _capture, _expected, _qkv, _replay_view, _runner  # noqa: E402


def test_memo_reuses_only_the_same_size_rows_object_and_version():
    memo, rows = ViewPlanMemo(), object()
    assert not memo.in_place((8, rows, 3))  # first: planned
    assert memo.in_place((8, rows, 3)) and memo.reused == 1
    assert not memo.in_place((16, rows, 3))  # another size
    assert not memo.in_place((16, object(), 3))  # other rows (an equal key of another object)
    assert not memo.in_place((16, rows, 4)) and not memo.in_place(None)  # new version; a paged step
    assert not memo.in_place((16, rows, 4))  # after a paged step: planned again
    memo.forget()
    assert not memo.in_place((16, rows, 4)) and memo.planned == 6
    off = ViewPlanMemo(enabled=False)
    assert not off.in_place((8, rows, 3)) and not off.in_place((8, rows, 3)) and off.reused == 0
    memo.check_integrity()
    off.reused = 1  # planted: a reuse while off
    with pytest.raises(AssertionError, match="reuse is off"):
        off.check_integrity()


class Recording(PagedStandIn):
    """The stand-in, recording the seq_lens and rows of each metadata call."""

    def __init__(self, runner):
        super().__init__(runner)
        self.calls = []

    def init_forward_metadata(self, fb):
        super().init_forward_metadata(fb)
        self.calls.append((fb.seq_lens.tolist(), fb.req_pool_indices.tolist()))


def _graph_backend(view_plan="reuse"):
    runner = _runner()
    cfg = GraniKVConfig(enable=True, attention_path="cascade", view_plan=view_plan)
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=cfg, backend_name="stand-in")
    be.inner = Recording(runner)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fb, _ = _batch(runner, hot={0, 2, 3})
    _capture(be, _replay_view(fb, 8))
    be.inner.calls.clear()
    return runner, be


def _grow(runner, fb, rows, next_slot):
    """The batch one token later: each request's next token in a fresh COLD slot."""
    rt = runner.req_to_token_pool.req_to_token
    seq = fb.seq_lens + 1
    for i, row in enumerate(rows):
        rt[row, seq[i] - 1] = next_slot + i
    return SimpleNamespace(**{**vars(fb), "seq_lens": seq, "seq_lens_cpu": seq.clone(), "seq_lens_sum": int(seq.sum()),
                              "out_cache_loc": rt[torch.tensor(rows), seq - 1].long()})


def _step(be, runner, fb, rows, seed):
    """One replay step: metadata, then the forward its graph would run; checks the output."""
    view = _replay_view(fb, 8)
    be.stage_batch(rows)
    n = len(be.inner.calls)
    be.init_forward_metadata_out_graph(view)
    planned = len(be.inner.calls) > n
    # what is in place is this step's batch (paged) or its one-token view (cascade), planned or not
    want = [1] * 8 if be.graphs.planned_cascade else view.seq_lens.tolist()
    assert be.inner.seq_lens.tolist() == want
    assert be.inner.req_pool_indices.tolist() == view.req_pool_indices.tolist()
    q, k, v = _qkv(8, seed)
    o = be.forward_decode(q, k, v, LAYER, view)
    torch.testing.assert_close(o[:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)
    return planned


def test_steady_cascade_replays_plan_the_view_once_and_stay_exact():
    runner, be = _graph_backend()
    made = []  # the one-token views the planner makes: none where the view's plan is in place
    of = be.decode._one_token.of
    be.decode._one_token.of = lambda fb: made.append(fb.batch_size) or of(fb)
    fb, rows = _batch(runner, hot={0, 2, 3})
    slot = 250  # past every COLD slot _batch uses, below the HOT run
    planned = []
    for step in range(5):
        if step:
            fb = _grow(runner, fb, rows, slot)
            slot += len(rows)
        planned.append(_step(be, runner, fb, rows, 20 + step))
    assert planned == [True, False, False, False, False] and made == [8]
    snap = be.stats_snapshot()
    assert snap["view_plans_made"] == 1 and snap["view_plans_reused"] == 4
    assert snap["steps_per_path"] == {"cascade": 5}

    # a paged step of other rows plans the wrapped backend with the real batch; the next
    # cascade step plans its view again
    other, other_rows = _batch(runner, hot={4})
    assert _step(be, runner, other, other_rows, 30) and not be.graphs.planned_cascade
    assert be.inner.seq_lens.tolist()[:5] == other.seq_lens.tolist()
    fb, rows = _batch(runner, hot={0, 2, 3})
    assert _step(be, runner, fb, rows, 31)
    assert not _step(be, runner, _grow(runner, fb, rows, slot), rows, 32)

    # a paged step of the same rows (a forced path here; the step clock's overrule alike)
    cascade = be.ctx.dispatcher
    be.dispatcher = be._paged_dispatcher()
    assert _step(be, runner, fb, rows, 40) and not be.graphs.planned_cascade
    be.dispatcher = cascade
    assert _step(be, runner, fb, rows, 41) and be.graphs.planned_cascade

    # any other call of the wrapped backend (here an eager step) in between: planned again
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert _step(be, runner, fb, rows, 33)
    assert not _step(be, runner, fb, rows, 34)

    # a new HotPrefixTable version (a promotion may have rewritten the rows' first slots)
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    table.set(7, HOT_BASE, 5)  # a row outside the batch: a new version all the same
    assert _step(be, runner, fb, rows, 35)
    assert not _step(be, runner, fb, rows, 36)
    be.decode.view_memo.check_integrity()


def test_every_step_plans_the_view_on_every_cascade_replay():
    runner, be = _graph_backend(view_plan="every_step")
    fb, rows = _batch(runner, hot={0, 2, 3})
    assert all(_step(be, runner, fb, rows, 40 + i) for i in range(3))
    assert be.stats_snapshot()["view_plans_reused"] == 0


def test_the_flag_names_its_choices():
    with pytest.raises(ValueError, match="--granikv-view-plan=.sometimes. is not one of reuse, every_step"):
        GraniKVConfig(enable=True, view_plan="sometimes")


def test_metadata_calls_the_backend_forwards_unchanged_forget_the_view_plan():
    """A base-class metadata method GraniKV does not define (e.g. a breakable prefill graph's
    replay metadata) goes straight to the wrapped backend and may rewrite buffers the decode
    graphs share: the next cascade step plans its view again."""
    runner, be = _graph_backend()
    fb, rows = _batch(runner, hot={0, 2, 3})
    assert _step(be, runner, fb, rows, 50) and not _step(be, runner, fb, rows, 51)
    seen = []
    be.inner.prepare_forward_metadata_for_breakable_cuda_graph_replay = lambda *a, **kw: seen.append(a)
    be.prepare_forward_metadata_for_breakable_cuda_graph_replay(fb)
    assert seen == [(fb,)]  # forwarded as before
    assert _step(be, runner, fb, rows, 52) and not _step(be, runner, fb, rows, 53)


def test_the_reuse_is_the_default():
    assert GraniKVConfig(enable=True).view_plan == "reuse"
