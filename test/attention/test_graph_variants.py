"""Stock and cascade decode CUDA graphs per batch size: capture and replay selection on CPU.

SGLang's real ``DecodeCudaGraphRunner`` class (its ``_make_graph_key`` and ``ShapeKey``) with
the plugin's hooks around ``capture_one_shape`` / ``load_batch``; only the CUDA graph object is
a stand-in (a dict of captured keys, as ``FullCudaGraphBackend._graphs``). The backend is the
real GraniKVAttnBackend over test_backend's paged stand-in.
"""

import dataclasses
import inspect

import pytest
import torch
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner.shape_key import ShapeKey

from granikv import plugin
from granikv.config import GraniKVConfig, parse_graph_bs
from granikv.attention.decode.graph_variants import (
    CASCADE_LABEL,
    MOVED_ENDS,
    NO_DEVICE_ENDS,
    UNBOUND_CAPTURE,
    GraphVariants,
    cascade_can_win,
    cascade_label,
)
from test_backend import ATOL, LAYER, RTOL, _backend, _batch, _expected, _qkv, _replay_view, _runner  # noqa: E402


class FakeRunner(DecodeCudaGraphRunner):
    """The real class without its CUDA-only ``__init__``: the attributes the hooks and SGLang's
    key helpers read."""

    def __init__(self, backend, capture_bs):
        self.attn_backend = backend
        self.enable_pdmux = False
        self.ragged_verify_mode = False
        self.capture_bs = capture_bs
        self.graphs = {}  # ShapeKey -> recorded path of the capture (the CUDA graph stand-in)
        self._replay_graph_key = None


def _capture_orig(fb_of):
    """SGLang's capture_one_shape as far as the backend sees it: metadata, one forward, a graph
    stored under the runner's key."""

    def capture_one_shape(runner, size, forward, stream_idx=None, variant_label=None):
        fb = fb_of(size)
        runner.attn_backend.init_forward_metadata_out_graph(fb, in_capture=True)
        runner.graphs[runner._make_graph_key(size, stream_idx, variant_label)] = runner.attn_backend.decode.path.value

    return capture_one_shape


def _load_orig(runner, fb):
    """SGLang's load_batch as far as the backend sees it: the plan, then the stock key."""
    runner.attn_backend.init_forward_metadata_out_graph(fb)
    runner._replay_graph_key = runner._make_graph_key(fb.batch_size, None, None)


def test_hooks_match_sglangs_signatures():
    params = list(inspect.signature(DecodeCudaGraphRunner.capture_one_shape).parameters)
    assert params[:5] == ["self", "size", "forward", "stream_idx", "variant_label"]
    assert list(inspect.signature(DecodeCudaGraphRunner.load_batch).parameters)[:2] == ["self", "forward_batch"]
    assert "_replay_graph_key" in inspect.getsource(DecodeCudaGraphRunner.load_batch)
    for key in ("capture_one_shape", "load_batch", "graph_capture"):
        assert plugin._TARGETS[key].startswith(plugin._DGR)


def test_the_capture_hook_hands_both_captures_what_sglang_passes_after_the_label():
    """0.5.23 calls ``capture_one_shape(bs, forward, stream_idx, variant_label, attention_variant)``
    (one positional more than 0.5.17): the hook takes it and passes it to the stock and the
    cascade capture alike (on the GPU the missing parameter failed every engine start)."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    seen = []

    def cap(runner, size, forward, stream_idx=None, variant_label=None, *more, **kw):
        seen.append((variant_label, more, kw))
        return _capture_orig(lambda s: _replay_view(fb, 8))(runner, size, forward, stream_idx, variant_label)

    plugin._around_capture_one_shape(cap, gr, 8, None, None, None, "decode_variant", extra=1)
    assert seen == [(None, ("decode_variant",), {"extra": 1}), (CASCADE_LABEL, ("decode_variant",), {"extra": 1})]
    real = list(inspect.signature(DecodeCudaGraphRunner.capture_one_shape).parameters)[1:]
    bound = inspect.signature(plugin._around_capture_one_shape).bind(cap, gr, *range(len(real)))
    assert len(bound.arguments) >= 2  # every parameter the running release declares is accepted


def _bs8_cascade(capture_bs=(8,)):
    """A cascade-path backend with a cascade graph for batch size 8 only, its graph state, the
    5-request batch (requests 0, 2, 3 share the HOT run) and a fake graph runner."""
    runner_ = _runner()
    be = _backend(runner_, "cascade")
    be.graphs = GraphVariants(frozenset({8}), can_win=None)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fb, rows = _batch(runner_, hot={0, 2, 3})
    return runner_, be, fb, rows, FakeRunner(be, capture_bs=list(capture_bs))


def test_capture_and_replay_pick_the_graph_the_plan_chose():
    runner_, be, fb, rows, gr = _bs8_cascade(capture_bs=(8, 5))
    cap = _capture_orig(lambda size: _replay_view(fb, 8) if size == 8 else fb)
    for size in reversed(gr.capture_bs):  # SGLang captures the largest first
        plugin._around_capture_one_shape(cap, gr, size, forward=None)
    assert gr.graphs == {ShapeKey(8): "paged", ShapeKey(8, variant_label=CASCADE_LABEL): "cascade",
                         ShapeKey(5): "paged"}
    be.graphs.check_integrity()
    assert "cascade graphs for 1 batch sizes [8]" in be.graphs.summary()

    for hot, want in (({0, 2, 3}, CASCADE_LABEL), ({4}, None), ({0, 2, 3}, CASCADE_LABEL)):
        fb, rows = _batch(runner_, hot=hot)
        view = _replay_view(fb, 8)
        be.stage_batch(rows)
        plugin._around_load_batch(_load_orig, gr, view)
        assert gr._replay_graph_key == ShapeKey(8, variant_label=want) and gr._replay_graph_key in gr.graphs
        q, k, v = _qkv(8, 21)
        o = be.forward_decode(q, k, v, LAYER, view)
        torch.testing.assert_close(o[:5], _expected(runner_, fb, q[:5]), atol=ATOL, rtol=RTOL)
    # bs 5 has a stock graph only: a grouped batch of 5 replays it, paged
    fb, rows = _batch(runner_, hot={0, 2, 3})
    be.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, fb)
    assert gr._replay_graph_key == ShapeKey(5) and be.decode.path.value == "paged"
    # an idle / non-decode load leaves SGLang's key alone
    be.graphs.planned_cascade = True
    idle = _replay_view(fb, 8)
    idle.forward_mode = type(fb.forward_mode).IDLE
    plugin._around_load_batch(_load_orig, gr, idle)
    assert gr._replay_graph_key == ShapeKey(8)


def _bound_capture_orig(fb_of):
    """``_capture_orig`` whose graph stand-in also keeps what a captured suffix kernel reads its
    ends from: the workspace's bound device buffer, or None (the metadata)."""

    def capture_one_shape(runner, size, forward, stream_idx=None, variant_label=None):
        fb = fb_of(size)
        be = runner.attn_backend
        be.init_forward_metadata_out_graph(fb, in_capture=True)
        ends = be.decode.ws.ends.bound if be.decode.path.value == "cascade" else None
        runner.graphs[runner._make_graph_key(size, stream_idx, variant_label)] = (be.decode.path.value, ends)

    return capture_one_shape


def _replay(gr, be, view, seed):
    """The replay of the key ``load_batch`` left: a cascade graph's kernels read the ends where
    its capture bound them (a captured launch keeps its arguments), whatever this step bound."""
    path, ends = gr.graphs[gr._replay_graph_key]
    if path == "cascade":
        be.decode.ws.ends.bound = ends
    q, k, v = _qkv(8, seed)
    return q, be.forward_decode(q, k, v, LAYER, view)


@pytest.mark.parametrize("capture_bound", [True, False])
def test_a_step_replays_the_cascade_graph_only_with_its_captures_suffix_end_binding(capture_bound):
    """Each cascade capture records whether its suffix ends were bound (``GraphVariants.ends_bound``).
    Steady steps whose binding differs (ends bound over a graph captured without, or not bound
    over one captured with) replay the stock graph with a paged reason, so no replay ends
    suffixes at stale lengths (an in-place step uploads no metadata ends; an unbound one writes
    no device ends); steps with the capture's binding replay the cascade graph. Outputs match
    paged attention every step."""
    runner_, be, fb, rows, gr = _bs8_cascade()

    def view_of(fb, bound):
        view = _replay_view(fb, 8)
        if not bound:  # seq_lens the workspace cannot bind (SuffixEnds.fits): the ends travel in the upload
            view.seq_lens = view.seq_lens.float()
        return view

    plugin._around_capture_one_shape(_bound_capture_orig(lambda s: view_of(fb, capture_bound)), gr, 8, forward=None)
    assert be.graphs.ends_bound == {8: capture_bound}
    be.graphs.check_integrity()
    for step in range(4):
        step_bound = step < 2  # two bound steps, then two unbound ones (each pair: a fill, an advance)
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1
        fb.seq_lens = fb.seq_lens_cpu.clone()
        view = view_of(fb, step_bound)
        be.stage_batch(rows)
        plugin._around_load_batch(_load_orig, gr, view)
        same = step_bound == capture_bound
        assert be.graphs.planned_cascade == same and gr._replay_graph_key.variant_label == (
            CASCADE_LABEL if same else None), step
        if not same:
            assert be.stats.last_reason == (UNBOUND_CAPTURE if step_bound else NO_DEVICE_ENDS)
        q, o = _replay(gr, be, view, 30 + step)
        torch.testing.assert_close(o[:5], _expected(runner_, fb, q[:5]), atol=ATOL, rtol=RTOL)
    assert be.stats.paths["cascade"] == 2 and be.stats.paths["paged"] == 2


def _in_graph_capture_orig(static, *, record_copy=True):
    """SGLang's capture of a size over its runner's static buffers ``static`` (the replay view
    whose ``seq_lens`` SGLang refills in place before every replay): metadata, then the in-graph
    metadata hook that ``run_once`` records. The graph stand-in keeps the suffix-end copies that
    hook made (``SuffixEnds.copy_from``), which a replay runs again before its kernels, reading
    the captured tensor. ``record_copy=False`` (a planted fault): the graph loses those copies."""

    def capture_one_shape(runner, size, forward, stream_idx=None, variant_label=None):
        be = runner.attn_backend
        be.init_forward_metadata_out_graph(static, in_capture=True)
        path, ws, copies = be.decode.path.value, be.decode.ws, []
        if path == "cascade":
            real = ws.ends.copy_from
            ws.ends.copy_from = lambda t, n: (copies.append((t, n)), real(t, n))
            try:
                be.init_forward_metadata_in_graph(static)
            finally:
                del ws.ends.copy_from
        ends = ws.ends.bound if path == "cascade" else None
        runner.graphs[runner._make_graph_key(size, stream_idx, variant_label)] = (
            path, ends, copies if record_copy else [])

    return capture_one_shape


def _replay_in_graph(gr, be, view, seed):
    """``_replay`` whose cascade graph first runs the suffix-end copies its capture recorded."""
    path, ends, copies = gr.graphs[gr._replay_graph_key]
    if path == "cascade":
        for t, n in copies:
            be.decode.ws.ends.copy_from(t, n)
        be.decode.ws.ends.bound = ends
    q, k, v = _qkv(8, seed)
    return q, be.forward_decode(q, k, v, LAYER, view)


def _refill(static, fb):
    """SGLang's replay preparation: the batch's lengths into the static buffers, in place."""
    static.seq_lens[: fb.batch_size].copy_(fb.seq_lens)
    static.seq_lens_cpu[: fb.batch_size].copy_(fb.seq_lens_cpu)
    static.seq_lens_sum = int(static.seq_lens_cpu.sum())


def test_a_cascade_graph_copies_its_suffix_ends_itself_and_its_replays_launch_no_copy():
    """The cascade capture runs SGLang's in-graph metadata hook over the runner's static
    ``seq_lens``, which records the suffix-end copy into the graph (``graphs.ends_source``).
    Its replays then bind the ends without copying them on the host: after the step's plan the
    device ends still hold the previous step's lengths, and the replay's own copy brings the
    step's. Outputs match paged attention on every step, fills and in-place advances alike."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    static = _replay_view(fb, 8)
    plugin._around_capture_one_shape(_in_graph_capture_orig(static), gr, 8, forward=None)
    assert be.graphs.ends_source == {8: static.seq_lens.data_ptr()} and be.graphs.ends_bound == {8: True}
    be.graphs.check_integrity()
    be.graphs.ends_bound[8] = False  # planted: an in-graph copy recorded for a capture without bound ends
    with pytest.raises(AssertionError, match="in-graph suffix-end copies"):
        be.graphs.check_integrity()
    be.graphs.ends_bound[8] = True
    ends = be.decode.ws.ends.buffer
    for step in range(4):
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1
        fb.seq_lens = fb.seq_lens_cpu.clone()
        _refill(static, fb)
        before = ends.clone()
        be.stage_batch(rows)
        plugin._around_load_batch(_load_orig, gr, static)
        assert be.graphs.planned_cascade and gr._replay_graph_key.variant_label == CASCADE_LABEL, step
        assert torch.equal(ends, before), f"step {step}: the plan copied the ends its graph copies"
        q, o = _replay_in_graph(gr, be, static, 40 + step)
        assert torch.equal(ends[:5], fb.seq_lens.to(ends.dtype)), step
        torch.testing.assert_close(o[:5], _expected(runner_, fb, q[:5]), atol=ATOL, rtol=RTOL)
    assert be.stats.paths["cascade"] == 4 and be.decode.ws.advances_in_place >= 2
    assert be.stats_snapshot()["ends_in_graph_steps"] == 4


def test_a_replay_whose_graph_lost_its_suffix_end_copy_ends_suffixes_short():
    """The planted fault behind the test above: a cascade graph that does not copy the ends
    while the planner relies on it ends every suffix at the previous step's length, and the
    outputs differ from paged attention (the check above can fail)."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    static = _replay_view(fb, 8)
    plugin._around_capture_one_shape(_in_graph_capture_orig(static, record_copy=False), gr, 8, forward=None)
    fb.seq_lens_cpu = fb.seq_lens_cpu + 1
    fb.seq_lens = fb.seq_lens_cpu.clone()
    _refill(static, fb)
    be.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, static)
    q, o = _replay_in_graph(gr, be, static, 50)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(o[:5], _expected(runner_, fb, q[:5]), atol=ATOL, rtol=RTOL)


def test_a_replay_over_other_seq_lens_than_its_graph_copies_from_runs_paged():
    """A step whose device ``seq_lens`` is not the buffer the cascade graph copies its ends from
    (not SGLang's replay path) replays the stock graph (``MOVED_ENDS``): the graph's copy would
    overwrite the step's ends with that buffer's. Under ``--granikv-debug-integrity`` the step
    copies its ends before the replay as well, so the host/device check reads the step's."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    static = _replay_view(fb, 8)
    plugin._around_capture_one_shape(_in_graph_capture_orig(static), gr, 8, forward=None)
    _refill(static, fb)
    moved = _replay_view(fb, 8)  # the same lengths in another tensor
    be.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, moved)
    assert not be.graphs.planned_cascade and be.stats.last_reason == MOVED_ENDS
    assert be.decode.ends_in_graph_steps == 0
    q, o = _replay_in_graph(gr, be, moved, 60)
    torch.testing.assert_close(o[:5], _expected(runner_, fb, q[:5]), atol=ATOL, rtol=RTOL)

    be.ctx.cfg = dataclasses.replace(be.ctx.cfg, debug_integrity=True)
    fb.seq_lens_cpu = fb.seq_lens_cpu + 1
    fb.seq_lens = fb.seq_lens_cpu.clone()
    _refill(static, fb)
    be.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, static)
    assert be.graphs.planned_cascade
    assert torch.equal(be.decode.ws.ends.buffer[:5], fb.seq_lens.to(torch.int32))  # copied at the plan


def test_a_pre_planned_load_never_replays_the_cascade_graph_of_a_previous_step():
    """SGLang's ``load_batch`` returns before planning a pre-planned batch (it only sets the
    stock key): the step before chose the cascade graph, but this one never planned, so the
    hook must give SGLang's stock key."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    plugin._around_capture_one_shape(_capture_orig(lambda s: _replay_view(fb, 8)), gr, 8, forward=None)
    be.stage_batch(rows)
    plugin._around_load_batch(_load_orig, gr, _replay_view(fb, 8))
    assert gr._replay_graph_key == ShapeKey(8, variant_label=CASCADE_LABEL) and be.graphs.planned_cascade

    def preplanned(runner, fb):  # load_batch's early return: no plan, the stock key
        runner._replay_graph_key = runner._make_graph_key(fb.batch_size, None, None)

    plugin._around_load_batch(preplanned, gr, _replay_view(fb, 8))
    assert gr._replay_graph_key == ShapeKey(8) and not be.graphs.planned_cascade
    assert not be.reads_req_to_token_during_replay()  # the write-after-read barrier sees a stock replay


def test_a_failed_cascade_capture_leaves_the_size_stock_only():
    runner_, be, fb, _, gr = _bs8_cascade()

    def cap(runner, size, forward, stream_idx=None, variant_label=None):
        if variant_label is not None:
            raise RuntimeError("out of graph memory")
        _capture_orig(lambda s: _replay_view(fb, 8))(runner, size, forward, stream_idx, variant_label)

    with pytest.raises(RuntimeError):
        plugin._around_capture_one_shape(cap, gr, 8, forward=None)
    assert not be.graphs.has_cascade_graph(8) and be.graphs.capturing is None


def test_labels_keep_sglangs_variant():
    assert cascade_label(None) == CASCADE_LABEL
    assert cascade_label("nolora") == "nolora+" + CASCADE_LABEL
    g = GraphVariants(frozenset({4}), can_win=None)
    g.planned_cascade = True
    assert g.replay_key(ShapeKey(4, variant_label="lora")) == ShapeKey(4, variant_label="lora+" + CASCADE_LABEL)
    g.planned_cascade = False
    assert g.replay_key(ShapeKey(4, variant_label="lora")) == ShapeKey(4, variant_label="lora")
    g.planned_cascade = True  # the cascade key is made once per SGLang key, and per key
    first = g.replay_key(ShapeKey(4, variant_label="lora"))
    assert g.replay_key(ShapeKey(4, variant_label="lora")) is first
    assert g.replay_key(ShapeKey(8)) == ShapeKey(8, variant_label=CASCADE_LABEL)


def test_auto_sizes_follow_the_cost_model():
    """auto: a size gets a cascade graph iff the cost model lets cascade beat paged there on a
    long shared prefix; never below min_group_size."""
    be = _backend(_runner(), "auto")
    d = be.dispatcher
    assert not cascade_can_win(d, 1, prefix_tokens=32768, min_group_size=2)
    wins = [bs for bs in (2, 4, 8, 16, 64, 128, 256) if cascade_can_win(d, bs, prefix_tokens=32768, min_group_size=2)]
    assert wins and wins == sorted(wins) and 256 in wins
    assert not cascade_can_win(d, 256, prefix_tokens=1, min_group_size=2) or d.forced is not None
    g = GraphVariants(None, can_win=lambda bs: bs >= 16)
    assert [bs for bs in (1, 8, 16, 32) if g.wants_cascade(bs)] == [16, 32]
    assert g.stock_only == {1, 8}


def test_a_forced_path_decides_the_sizes_not_the_cost_model():
    """--granikv-attention-path cascade: every size from min_group_size up gets a cascade graph,
    also where the cost model puts paged ahead (a short prefix, a small batch); forced paged:
    none. Otherwise a forced cascade replays stock graphs at those sizes (seen in serving on a
    GPU without a calibrated cost model)."""
    auto = _backend(_runner(), "auto").dispatcher
    loses = [bs for bs in (2, 4, 8, 16) if not cascade_can_win(auto, bs, prefix_tokens=256, min_group_size=2)]
    assert loses, "the cost model should put paged ahead somewhere on a 256-token prefix"
    forced = _backend(_runner(), "cascade").dispatcher
    assert all(cascade_can_win(forced, bs, prefix_tokens=256, min_group_size=2) for bs in (2, 4, 8, 16, 256))
    assert not cascade_can_win(forced, 1, prefix_tokens=256, min_group_size=2)
    paged = _backend(_runner(), "paged").dispatcher
    assert not any(cascade_can_win(paged, bs, prefix_tokens=32768, min_group_size=2) for bs in (2, 16, 256))


def test_graph_bs_flag():
    assert parse_graph_bs("auto") is None and parse_graph_bs("none") == frozenset()
    assert parse_graph_bs("8, 16,256") == frozenset({8, 16, 256})
    for bad in ("0", "x", "", "8,-1"):
        with pytest.raises(ValueError, match="--granikv-cascade-graph-bs"):
            GraniKVConfig(enable=True, cascade_graph_bs=bad)


def test_integrity_check_fails_on_a_capture_left_open():
    g = GraphVariants(None, can_win=lambda bs: True)
    g.begin_capture(8)
    with pytest.raises(AssertionError, match="never ended"):
        g.check_integrity()
    g.end_capture(ok=True)
    g.check_integrity()
    g.stock_only.add(8)
    with pytest.raises(AssertionError, match="both stock-only"):
        g.check_integrity()


@pytest.mark.parametrize("replay_slots", ["copy", "table"])
def test_a_cascade_replay_reads_the_pre_replay_slot_copy_not_req_to_token(replay_slots):
    """With the slot copy (the default) the planner copies each suffix item's slots after the
    step's upload, inside ``load_batch`` (before SGLang records its read-done event), so the
    replay reads nothing the scheduler may write meanwhile: rewriting the batch's
    ``req_to_token`` rows after ``load_batch`` leaves every output exact, and the write-after-read
    barrier keeps SGLang's fast path. The planted fault (``table``: the kernels read the table
    during the replay) gets the rewritten rows, and the barrier falls back to its coarse path."""
    runner_, be, fb, rows, gr = _bs8_cascade()
    be.cfg = GraniKVConfig(enable=True, attention_path="cascade", replay_slots=replay_slots)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    assert (be.decode.slot_copier is not None) == (replay_slots == "copy")
    plugin._around_capture_one_shape(_capture_orig(lambda s: _replay_view(fb, 8)), gr, 8, forward=None)
    table = runner_.req_to_token_pool.req_to_token
    for step in range(3):  # a full build, then in-place steady steps
        fb.seq_lens_cpu = fb.seq_lens_cpu + 1
        fb.seq_lens = fb.seq_lens_cpu.clone()
        view = _replay_view(fb, 8)
        be.stage_batch(rows)
        plugin._around_load_batch(_load_orig, gr, view)
        assert gr._replay_graph_key == ShapeKey(8, variant_label=CASCADE_LABEL)
        assert be.reads_req_to_token_during_replay() == (replay_slots == "table")
        q, k, v = _qkv(8, 40 + step)
        saved = table.clone()
        for r in rows:  # the scheduler rewrites the rows while the replay runs (suffix tokens)
            n = int(fb.seq_lens_cpu[list(rows).index(r)])
            table[r, 37 : n - 1] = torch.flip(table[r, 37 : n - 1], [0]) + 1
        o = be.forward_decode(q, k, v, LAYER, view)
        table.copy_(saved)
        want = _expected(runner_, fb, q[:5])  # over the rows as they were (and the step's new K/V)
        if replay_slots == "copy":
            torch.testing.assert_close(o[:5], want, atol=ATOL, rtol=RTOL)
        else:
            assert (o[:5].float() - want.float()).abs().max() > 10 * ATOL
    if replay_slots == "copy":
        assert be.decode.slot_copier.copies == 3
