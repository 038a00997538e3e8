"""The steady replay (attention/decode/steady_step.py): a decode step of an unchanged batch
planned from the previous step in a handful of calls plans exactly what the full plan plans,
step after step, and gives way to the full plan whenever the batch, the HOT table, the lengths,
the path choice or the build's reuse bound change. Real SGLang pools on CPU, the Triton kernels
under the interpreter, CUDA-graph replays driven as SGLang's graph runner drives them: one
static device ``seq_lens`` buffer refilled before each replay, which the cascade graph copies its
suffix ends from (its first node, emulated here before the kernels run)."""

import dataclasses

import numpy as np
import pytest
import torch

from granikv.attention.dispatcher import Decision, Path
from granikv.kernels.suffix_slots import append_suffix_slots
from test_backend import ATOL, LAYER, RTOL, _backend, _batch, _capture, _expected, _qkv, _replay_view, _runner

PADDED = 8


class GraphDriver:
    """A backend in graph mode with the cascade graph of ``PADDED`` captured over SGLang's
    static seq_lens buffer, and the per-step refills of a replay."""

    def __init__(self, runner, path="cascade", hot=(0, 1, 3)):
        self.runner = runner
        self.appends = True  # the replay runs the graph's slot append (planted faults turn it off)
        self.be = be = _backend(runner, path)
        be.init_cuda_graph_state(max_bs=PADDED, max_num_tokens=PADDED)
        self.fb, self.rows = _batch(runner, hot=set(hot))
        self.static = torch.ones(PADDED, dtype=torch.int64)  # the graph runner's device seq_lens
        self.host = torch.ones(2 * PADDED, dtype=torch.int64)  # ... and its host seq_lens
        self.static_loc = torch.zeros(PADDED, dtype=torch.int64)  # ... and its out_cache_loc
        self._slots = torch.Generator().manual_seed(1)
        view = self._view()
        be.init_forward_metadata_out_graph(view, in_capture=True)  # the stock graph
        be.graphs.begin_capture(PADDED)
        be.init_forward_metadata_out_graph(view, in_capture=True)  # the cascade graph
        be.init_forward_metadata_in_graph(view)  # its in-graph suffix-end copy, from `static`
        be.graphs.end_capture(ok=True)
        assert be.graphs.ends_source.get(PADDED) == self.static.data_ptr()

    def _view(self):
        view = _replay_view(self.fb, PADDED)
        self.static.copy_(view.seq_lens)
        self.host[:PADDED] = view.seq_lens_cpu
        self.static_loc.copy_(view.out_cache_loc)
        view.seq_lens = self.static  # the same buffers every replay
        view.seq_lens_cpu = self.host[:PADDED]
        view.out_cache_loc = self.static_loc
        return view

    def _decode_slots(self):
        """SGLang's decode step: each request's newest token (position ``seq_len - 1``) gets a
        KV slot, written to ``req_to_token`` and handed over as ``out_cache_loc``."""
        rt = self.runner.req_to_token_pool.req_to_token
        loc = torch.randint(140, 300, (self.fb.batch_size,), generator=self._slots)  # free slots (test_backend)
        rows = self.fb.req_pool_indices.long()
        rt[rows, self.fb.seq_lens.long() - 1] = loc.to(rt.dtype)
        self.fb.out_cache_loc = loc

    def step(self, grow=1, rows=None):
        """One decode step: every request ``grow`` tokens longer (an int or one per request),
        staged with ``rows`` (default: the same array), planned as a replay; returns the view."""
        self.fb.seq_lens_cpu = self.fb.seq_lens_cpu + torch.as_tensor(grow)
        self.fb.seq_lens = self.fb.seq_lens_cpu.clone()
        self.fb.seq_lens_sum = int(self.fb.seq_lens_cpu.sum())
        self._decode_slots()
        view = self._view()
        self.be.stage_batch(self.rows if rows is None else rows)
        self.be.init_forward_metadata_out_graph(view)
        d = self.be.decode
        if d.graphs.planned_cascade and d.ws.ends.bound is not None:  # the replay's first nodes
            d.ws.ends.copy_from(self.static, PADDED)
            if PADDED in d.graphs.slots_appended and self.appends:
                append_suffix_slots(d.ws.buffers, self.static_loc, d.ws.ends.buffer)
        return view

    def check(self, step=0):
        """Outputs of the real requests against the paged reference."""
        q, k, v = _qkv(PADDED, step)
        o = self.be.forward_decode(q, k, v, LAYER, self._view_for_forward())
        n = self.fb.batch_size
        torch.testing.assert_close(o[:n], _expected(self.runner, self.fb, q[:n]), atol=ATOL, rtol=RTOL)

    def _view_for_forward(self):
        view = _replay_view(self.fb, PADDED)
        view.seq_lens = self.static
        view.out_cache_loc = self.static_loc
        return view


def _full_plan_only(driver):
    """The twin that never arms the replay: every step takes the full plan."""
    driver.be.decode._arm = lambda *a, **k: None
    return driver


def _same_work_list(a, b):
    for f in a._fields:
        x, y = getattr(a, f), getattr(b, f)
        if not (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y):
            return False
    return True


def test_steady_replays_plan_what_the_full_plan_plans():
    """60 decode steps of one batch: the replay plans every step but the builds, and every step leaves the
    path, the work list the kernels read (with the ends the graph copied), the device metadata
    and the step counts of a twin that takes the full plan every step; the outputs match the
    paged reference at the first step, at a rebuild and at the last."""
    fast, slow = GraphDriver(_runner()), _full_plan_only(GraphDriver(_runner()))
    steps, rebuilds = 60, []
    for step in range(steps):
        builds = fast.be.decode.workspace.fills_built
        fast.step()
        slow.step()
        df, ds = fast.be.decode, slow.be.decode
        assert df.path is ds.path is Path.CASCADE and df.graphs.planned_cascade, step
        fw, sw = df.workspace, ds.workspace
        assert _same_work_list(fw.work_list, sw.work_list), step
        assert torch.equal(fw.ends.buffer, sw.ends.buffer) and torch.equal(fw.meta, sw.meta), step
        assert fw.slot_copy_ready is sw.slot_copy_ready
        if df._steady is not None:
            df._steady.check_integrity(fast.fb.seq_lens_cpu.numpy())
        if fw.fills_built != builds:
            rebuilds.append(step)
        if step in (0, steps - 1) or (rebuilds and rebuilds[-1] == step and step):
            fast.check(step)
    # every step but the builds is a replay: the step after a build too (build_in_place)
    assert df.steady_replays == steps - len(rebuilds) and ds.steady_replays == 0
    assert len(rebuilds) >= 2, "the run never reached the build's reuse bound"
    assert fw.fills_built == sw.fills_built and fw.advances_in_place == sw.advances_in_place
    sf, ss = fast.be.stats_snapshot(), slow.be.stats_snapshot()
    for key in ("decode_steps", "steps_per_path", "groups_per_step", "hot_hit_rate", "ends_in_graph_steps",
                "work_list_builds", "work_list_reuses", "work_list_in_place"):
        assert sf[key] == ss[key], key
    assert sf["steady_replays"] == df.steady_replays


def test_a_changed_batch_takes_the_full_plan():
    """Each change a replay must not carry over makes the next step take the full plan; the
    step after that replays again, and the outputs stay exact."""
    d = GraphDriver(_runner())
    dec = d.be.decode
    for _ in range(3):
        d.step()
    replays = dec.steady_replays
    assert replays >= 1 and dec._steady is not None

    def full_plan(**kw):
        before = dec.steady_replays
        d.step(**kw)
        assert dec.steady_replays == before, kw
        d.step()
        assert dec.steady_replays == before + 1, kw
        d.check(before)

    d.rows = d.rows.copy()  # a new rows array (SGLang filtered or merged the batch), kept from now on
    full_plan()
    grow = np.ones(d.fb.batch_size, dtype=np.int64)
    grow[2] = 2  # one request two tokens longer: not a decode step of this batch
    full_plan(grow=torch.from_numpy(grow))
    table = d.runner.token_to_kv_pool_allocator.hot_prefix_table
    before = dec.steady_replays
    table.set(int(d.rows[4]), 300, 37)  # two table writes (a new version), same runs after them
    table.set(int(d.rows[4]), 0, 0)
    d.step()
    assert dec.steady_replays == before
    d.be.decode.stock_step(extend=True)  # an extend batch between two decode steps
    before = dec.steady_replays
    d.step()
    assert dec.steady_replays == before and dec._steady is not None
    d.step()
    assert dec.steady_replays == before + 1
    d.check(1)


def test_debug_integrity_plans_every_step_in_full():
    d = GraphDriver(_runner())
    d.be.ctx.cfg = dataclasses.replace(d.be.ctx.cfg, debug_integrity=True)
    for _ in range(6):
        d.step()
    assert d.be.decode.steady_replays == 0 and d.be.decode._steady is None


def _force_paged(dec, calls=None):
    """The planner's path choice says paged from now on (as when the step clock measures paged
    for a window); returns the function that restores the real choice."""
    real_choose = dec.chooser.choose

    def paged(*a, **k):
        if calls is not None:
            calls.append("choose")
        got = real_choose(*a, **k)
        return Decision(Path.PAGED, got.times, "test: paged")

    dec.chooser.choose = paged
    return lambda: setattr(dec.chooser, "choose", real_choose)


def test_a_paged_choice_is_a_paged_excursion_and_the_build_resumes():
    """The replay's path choice says paged for two steps (a clock window): those steps are
    planned from the replay (the choice and the clock once each), the cascade build stays in
    its workspace, and the cascade choice after them resumes it in place, with the slot copy
    made again, instead of planning in full: the same work list, device ends and outputs as a
    twin that plans every step in full, and no build."""
    fast, slow = GraphDriver(_runner()), _full_plan_only(GraphDriver(_runner()))
    for _ in range(3):
        fast.step()
        slow.step()
    dec = fast.be.decode
    ws = dec.workspace
    assert dec.steady_replays >= 1 and dec._steady.path is Path.CASCADE
    cascade_replay, builds, copies = dec._steady, ws.fills_built, dec.slot_copier.copies
    calls = []
    restore, restore_slow = _force_paged(dec, calls), _force_paged(slow.be.decode)
    before = dec.steady_replays
    for k in range(2):
        fast.step()
        slow.step()
        assert dec.path is slow.be.decode.path is Path.PAGED and not dec.graphs.planned_cascade
        assert dec.steady_replays == before + k + 1 and calls.count("choose") == k + 1
        assert fast.be.stats.last_reason == "test: paged"
        assert dec._steady.path is Path.PAGED and dec._steady.resume is cascade_replay
        dec._steady.check_integrity(fast.fb.seq_lens_cpu.numpy())
    restore()
    restore_slow()
    fast.step()
    slow.step()
    assert dec.path is Path.CASCADE and dec.graphs.planned_cascade and dec.steady_replays == before + 3
    assert dec._steady is cascade_replay and ws.fills_built == builds
    assert dec.slot_copier.copies == copies + 1  # the paged steps' stock graph appended no slot
    dec._steady.check_integrity(fast.fb.seq_lens_cpu.numpy())
    assert _same_work_list(ws.work_list, slow.be.decode.workspace.work_list)
    assert torch.equal(ws.ends.buffer, slow.be.decode.workspace.ends.buffer)
    fast.check(2)
    sf, ss = fast.be.stats_snapshot(), slow.be.stats_snapshot()
    for key in ("decode_steps", "steps_per_path", "groups_per_step", "ends_in_graph_steps"):
        assert sf[key] == ss[key], key


def test_a_resume_without_the_slot_copy_reads_stale_slots():
    """Planted fault: the resumed build's replay makes no slot copy before it (as a replay of
    an unbroken cascade run does): the paged steps' newest slots were never appended to the
    copy, and the outputs leave the reference."""
    d = GraphDriver(_runner())
    for _ in range(3):
        d.step()
    dec = d.be.decode
    restore = _force_paged(dec)
    d.step()
    d.step()
    restore()
    dec.slot_copier.run = lambda: None
    d.step()
    assert dec.path is Path.CASCADE and dec._steady.ws is not None and dec._steady.replays >= 2
    with pytest.raises(AssertionError, match="not close"):
        d.check(3)


def test_a_resume_past_the_headroom_or_after_the_workspace_changed_plans_in_full():
    """A paged excursion longer than the build's headroom, or one during which the workspace
    was filled or advanced, ends in the full plan (a build where the bound is passed), with the
    outputs of the reference."""
    for touch in (None, "fill", "advance"):
        d = GraphDriver(_runner())
        for _ in range(3):
            d.step()
        dec = d.be.decode
        ws = dec.workspace
        room = dec._steady.headroom
        restore = _force_paged(dec)
        for _ in range(1 if touch else room + 1):
            d.step()
        if touch == "fill":
            ws.fill_empty()
        elif touch == "advance":  # the build's in-place state kept, its revision not
            assert ws.repeat_in_place(dec._steady.n)
        restore()
        replays, builds = dec.steady_replays, ws.fills_built
        d.step()
        assert dec.path is Path.CASCADE and dec.steady_replays == replays, touch
        if not touch:
            assert ws.fills_built == builds + 1
        d.check(4)


def test_integrity_check_names_a_paged_excursions_wrong_headroom():
    d = GraphDriver(_runner())
    for _ in range(3):
        d.step()
    restore = _force_paged(d.be.decode)
    d.step()
    restore()
    s = d.be.decode._steady
    s.check_integrity(d.fb.seq_lens_cpu.numpy())
    s.resume.headroom += 1000
    with pytest.raises(AssertionError, match="paged excursion: headroom"):
        s.check_integrity(d.fb.seq_lens_cpu.numpy())


def test_paged_decisions_replay_too():
    """Where the dispatcher chooses paged for a grouped batch, later steps of it replay that
    choice: the same paths and counts as the full plan, the wrapped backend planned with the
    real batch."""
    fast, slow = GraphDriver(_runner(), path="paged"), _full_plan_only(GraphDriver(_runner(), path="paged"))
    for step in range(12):
        vf, _ = fast.step(), slow.step()
        assert fast.be.decode.path is slow.be.decode.path is Path.PAGED
        assert not fast.be.decode.graphs.planned_cascade
        assert fast.be.inner.seq_lens.tolist() == vf.seq_lens.tolist(), step  # the real lengths
    assert fast.be.decode.steady_replays >= 10 and slow.be.decode.steady_replays == 0
    sf, ss = fast.be.stats_snapshot(), slow.be.stats_snapshot()
    assert sf["steps_per_path"] == ss["steps_per_path"] and sf["decode_steps"] == ss["decode_steps"]
    q, k, v = _qkv(PADDED, 3)
    o = fast.be.forward_decode(q, k, v, LAYER, vf)
    n = fast.fb.batch_size
    torch.testing.assert_close(o[:n], _expected(fast.runner, fast.fb, q[:n]), atol=ATOL, rtol=RTOL)


def test_a_headroom_past_the_reuse_bound_is_caught():
    """Planted fault: the replay armed with more headroom than the build's reuse bound gives.
    Steps then replay past the bound: the work list drifts from the full plan's, the
    replay's integrity check names the headroom, and the outputs leave the reference."""
    fast, slow = GraphDriver(_runner()), _full_plan_only(GraphDriver(_runner()))
    ws = fast.be.decode.workspace
    real = ws.in_place_headroom
    ws.in_place_headroom = lambda seq_lens: None if real(seq_lens) is None else real(seq_lens) + 1000
    caught = drift = False
    for _ in range(60):
        fast.step()
        slow.step()
        drift |= not _same_work_list(fast.be.decode.workspace.work_list, slow.be.decode.workspace.work_list)
        s = fast.be.decode._steady
        if s is not None:
            ws.in_place_headroom = real
            try:
                s.check_integrity(fast.fb.seq_lens_cpu.numpy())
            except AssertionError as e:
                assert "headroom" in str(e)
                caught = True
            ws.in_place_headroom = lambda seq_lens: None if real(seq_lens) is None else real(seq_lens) + 1000
    assert drift and caught
    with pytest.raises(AssertionError, match="not close"):  # and the kernels' outputs are wrong
        fast.check(9)


@pytest.mark.parametrize("field", ["seq_total", "n"])
def test_integrity_check_names_a_wrong_armed_state(field):
    d = GraphDriver(_runner())
    for _ in range(3):
        d.step()
    s = d.be.decode._steady
    s.check_integrity(d.fb.seq_lens_cpu.numpy())
    setattr(s, field, getattr(s, field) + 1)
    with pytest.raises(AssertionError, match="sequence total|requests"):
        s.check_integrity(d.fb.seq_lens_cpu.numpy())


def test_a_replay_without_the_graphs_slot_append_reads_stale_slots():
    """Planted fault: the cascade graph does not append the newest slots, yet steady replays
    make no copy before them (as if the capture had recorded an append it did not make): the
    newest tokens are read from stale copy entries and the outputs leave the reference, while
    the same steps with the append match it."""
    d = GraphDriver(_runner())
    for step in range(4):
        d.step()
    assert d.be.decode.steady_replays >= 2
    d.check(0)
    d.appends = False
    d.step()
    d.step()
    assert d.be.decode.steady_replays >= 4
    with pytest.raises(AssertionError, match="not close"):
        d.check(1)
