"""GraniKVAttnBackend's planning and metadata logic on CPU, against a paged reference.

Real SGLang pools (ReqToTokenPool, MHATokenToKVPool on CPU), the real HotPrefixTable and the
Triton kernels under the interpreter; the wrapped stock backend is a small paged-attention
stand-in (SGLang's own backends need CUDA) that honours the seq_lens it was planned with, so a
test fails if the wrapper leaves any row to it while planning ``seq_len = 1``.
"""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from granikv.config import GraniKVConfig
from granikv.kernels.reference import decode_attention_ref
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.dispatcher import Path
from granikv.mem_cache.hot_prefix_table import HotPrefixTable

HQ, HKV, D = 8, 2, 64
SLOTS = 400
HOT_BASE = 300
DTYPE = torch.float16
ATOL = RTOL = 2e-3  # fp16 output rounding of a softmax-weighted mean of N(0,1) values


class PagedStandIn:
    """A stock-backend stand-in: writes K/V at out_cache_loc, paged attention over seq_lens."""

    needs_cpu_seq_lens = True

    def __init__(self, runner):
        self.runner = runner
        self.seq_lens = None

    def init_forward_metadata(self, fb):
        self.seq_lens = fb.seq_lens.clone()
        self.req_pool_indices = fb.req_pool_indices

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.init_forward_metadata(fb)

    def init_forward_metadata_in_graph(self, fb):  # SGLang's base: nothing recorded in the graph
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        pool = self.runner.token_to_kv_pool
        if save_kv_cache:
            pool.k_buffer[layer.layer_id][fb.out_cache_loc] = k.view(-1, HKV, D)
            pool.v_buffer[layer.layer_id][fb.out_cache_loc] = v.view(-1, HKV, D)
        st = decode_attention_ref(q.view(-1, HQ, D), pool.k_buffer[0], pool.v_buffer[0],
                                  self.runner.req_to_token_pool.req_to_token,
                                  self.req_pool_indices, self.seq_lens, layer.scaling)
        return st.o.to(q.dtype).reshape(q.shape[0], HQ * D)


def _runner(device="cpu"):
    mc = SimpleNamespace(num_attention_heads=HQ, head_dim=D, num_hidden_layers=1,
                         get_num_kv_heads=lambda tp: HKV, hf_config=SimpleNamespace())
    r = SimpleNamespace(model_config=mc, ps=SimpleNamespace(attn_tp_size=1), device=device, kv_cache_dtype=DTYPE,
                        server_args=SimpleNamespace(speculative_algorithm=None))
    r.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=128, device=device,
                                         enable_memory_saver=False)
    r.token_to_kv_pool = MHATokenToKVPool(SLOTS, page_size=1, dtype=DTYPE, head_num=HKV,
                                          head_dim=D, layer_num=1, device=device,
                                          enable_memory_saver=False)
    r.token_to_kv_pool_allocator = SimpleNamespace(hot_prefix_table=HotPrefixTable(9))
    g = torch.Generator().manual_seed(0)
    for buf in (r.token_to_kv_pool.k_buffer[0], r.token_to_kv_pool.v_buffer[0]):
        buf.copy_(torch.randn(buf.shape, generator=g).to(DTYPE))  # (copied to the pool's device)
    return r


def _batch(runner, hot):
    """Rows 1..n; requests in ``hot`` start with the 37-token HOT run at HOT_BASE."""
    suffix = [5, 9, 7, 17, 6]
    rows, seq_lens = [], []
    rt = runner.req_to_token_pool.req_to_token
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    next_cold = 1
    for i, n in enumerate(suffix):
        row = i + 1
        prefix = list(range(HOT_BASE, HOT_BASE + 37)) if i in hot else []
        if i not in hot:  # a private cold prompt of the same shape
            prefix = list(range(next_cold, next_cold + 37))
            next_cold += 37
        cold = list(range(next_cold, next_cold + n))
        next_cold += n
        rt[row, : 37 + n] = torch.tensor(prefix + cold, dtype=torch.int32)
        table.set(row, HOT_BASE if i in hot else 0, 37 if i in hot else 0)
        rows.append(row)
        seq_lens.append(37 + n)
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    dev = rt.device
    out_loc = rt[torch.tensor(rows, device=dev), seq.to(dev) - 1].long()  # the decoded token's slot
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                         req_pool_indices=torch.tensor(rows, device=dev), seq_lens=seq.to(dev),
                         seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), out_cache_loc=out_loc)
    return fb, np.array(rows, dtype=np.int64)


def _backend(runner, path):
    cfg = GraniKVConfig(enable=True, attention_path=path)
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=cfg, backend_name="stand-in")
    be.inner = PagedStandIn(runner)
    return be


def _qkv(bs, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, HQ * D, generator=g).to(DTYPE)
    k = torch.randn(bs, HKV * D, generator=g).to(DTYPE)
    v = torch.randn(bs, HKV * D, generator=g).to(DTYPE)
    return q, k, v


LAYER = SimpleNamespace(layer_id=0, scaling=D ** -0.5, tp_q_head_num=HQ, head_dim=D)


def _expected(runner, fb, q):
    st = decode_attention_ref(q.view(-1, HQ, D), runner.token_to_kv_pool.k_buffer[0],
                              runner.token_to_kv_pool.v_buffer[0],
                              runner.req_to_token_pool.req_to_token, fb.req_pool_indices,
                              fb.seq_lens, LAYER.scaling)
    return st.o.to(DTYPE).reshape(q.shape[0], HQ * D)


@pytest.mark.parametrize("path", ["cascade", "fused"])
def test_eager_shared_prefix_matches_paged(path):
    runner = _runner()
    be = _backend(runner, path)
    fb, rows = _batch(runner, hot={0, 2, 3})
    q, k, v = _qkv(fb.batch_size, 1)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert be.inner.seq_lens.tolist() == [1] * fb.batch_size  # stock backend reads 1 token
    o = be.forward_decode(q, k, v, LAYER, fb)
    torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    assert be.stats.paths[path] == 1 and be.stats.grouped_requests == 3
    snap = be.stats.snapshot()
    assert be.stats.planned == 1 and 0 < snap["plan_us_mean"] <= snap["plan_us_max"] < 1e6
    # the parts of the planning time are counted separately, and add up to at most the whole
    assert snap["planned_steps"] == 1 and snap["plan_us_total"] == pytest.approx(snap["plan_us_mean"])
    assert 0 < snap["plan_choose_us_total"] and 0 < snap["plan_fill_us_total"]
    assert snap["plan_choose_us_total"] + snap["plan_fill_us_total"] <= snap["plan_us_total"]
    assert be.stats_snapshot()["upload_wait_us_total"] == 0.0  # CPU workspace: no events


def test_steady_decode_steps_reuse_the_plan_and_stay_exact():
    """Successive decode steps of one batch (each request one token longer per step): the
    backend reuses its grouping and work list (stats_snapshot counters) and every step still
    matches paged attention over the whole sequence."""
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={0, 2, 3})
    rt = runner.req_to_token_pool.req_to_token
    used = rt[torch.tensor(rows)]
    next_slot = int(used[used < HOT_BASE].max()) + 1  # past every COLD slot in use
    assert next_slot + 6 * len(rows) < HOT_BASE
    for step in range(6):
        if step:  # the next token of every request: a fresh COLD slot at position seq_len
            seq = fb.seq_lens + 1
            for i, row in enumerate(rows):
                rt[row, seq[i] - 1] = next_slot
                next_slot += 1
            fb = SimpleNamespace(**{**vars(fb), "seq_lens": seq, "seq_lens_cpu": seq.clone(),
                                    "seq_lens_sum": int(seq.sum()),
                                    "out_cache_loc": rt[torch.tensor(rows), seq - 1].long()})
        q, k, v = _qkv(fb.batch_size, 10 + step)
        be.stage_batch(rows)
        be.init_forward_metadata(fb)
        o = be.forward_decode(q, k, v, LAYER, fb)
        torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    snap = be.stats_snapshot()
    assert snap["steps_per_path"] == {"cascade": 6}
    assert snap["grouping_reuses"] == 5
    assert snap["work_list_builds"] >= 1 and snap["work_list_reuses"] >= 1
    assert snap["work_list_builds"] + snap["work_list_reuses"] == 6


def test_no_group_goes_to_the_stock_backend_untouched():
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, rows = _batch(runner, hot={1})  # one HOT request: below min_group_size=2
    q, k, v = _qkv(fb.batch_size, 2)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert torch.equal(be.inner.seq_lens, fb.seq_lens)
    o = be.forward_decode(q, k, v, LAYER, fb)
    torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    assert be.stats.paths["paged"] == 1


def test_unstaged_step_falls_back_to_paged():
    runner = _runner()
    be = _backend(runner, "cascade")
    fb, _ = _batch(runner, hot={0, 1, 2})
    be.init_forward_metadata(fb)  # nothing staged: the plan cannot know the rows
    assert torch.equal(be.inner.seq_lens, fb.seq_lens) and be.stats.unplanned == 1


def test_steps_while_no_request_holds_a_hot_run_plan_nothing():
    """While no request holds a HOT run (``HotPrefixTable.rows_held`` is 0) a decode step goes to
    the wrapped backend over the real batch with nothing planned (its staged rows are dropped):
    counted in ``no_hot_steps``, timed in the plan record, the step clock interrupted. Before
    and after, steps with HOT runs plan and group as ever, and every step matches paged attention (planted: a table that does not count its held rows
    would send the grouped steps to the stock path; a planner that kept the first stretch's
    resets would let the clock sample across the second)."""
    runner = _runner()
    be = _backend(runner, "cascade")
    table = runner.token_to_kv_pool_allocator.hot_prefix_table
    for step, hot in enumerate(({0, 2, 3}, set(), set(), {0, 1, 4}, set())):
        if not hot:
            table.reset()  # every HOT holder finished
        fb, rows = _batch(runner, hot=hot)
        assert table.rows_held == len(hot)
        q, k, v = _qkv(fb.batch_size, 20 + step)
        be.stage_batch(rows)
        be.init_forward_metadata(fb)
        assert be._staged is None
        if not hot:  # the real batch, as stock plans it; no interval spanning these steps is a sample
            assert torch.equal(be.inner.seq_lens, fb.seq_lens)
            assert be.decode.path is Path.PAGED and be.decode.clock._last_t is None
        o = be.forward_decode(q, k, v, LAYER, fb)
        torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    snap = be.stats_snapshot()
    assert snap["steps_per_path"] == {"cascade": 2, "paged": 3} and snap["no_hot_steps"] == 3
    assert snap["decode_paged_reasons"] == {"no HOT prefix in the batch": 3} and snap["unplanned_steps"] == 0
    assert snap["decode_steps"] == snap["planned_steps"] == 5 and len(be.stats.recent_plan) == 5
    assert snap["last_reason"] == "no HOT prefix in the batch" and 0 < snap["hot_hit_rate"] < 1


def _replay_view(fb, padded):
    """What SGLang's graph runner hands the backend at replay: padded, a namespace."""
    extra = padded - fb.batch_size
    view = copy.copy(fb)
    view.batch_size = padded
    view.num_padding = extra
    dev = fb.seq_lens.device
    view.req_pool_indices = torch.cat([fb.req_pool_indices, torch.zeros(extra, dtype=torch.int64, device=dev)])
    view.seq_lens = torch.cat([fb.seq_lens, torch.ones(extra, dtype=torch.int64, device=dev)])
    view.seq_lens_cpu = view.seq_lens.cpu()
    view.seq_lens_sum = int(view.seq_lens.sum())
    view.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(extra, dtype=torch.int64, device=dev)])
    return view


def _capture(be, view, *, cascade=True):
    """SGLang's capture of one size, as the graph-runner hooks drive it: the stock graph, then
    (if ``cascade``) the cascade graph of the same size; each runs its forward once."""
    be.init_forward_metadata_out_graph(view, in_capture=True)
    stock_path = be.decode.path
    if cascade:
        be.graphs.begin_capture(view.batch_size)
        be.init_forward_metadata_out_graph(view, in_capture=True)
        cascade_path = be.decode.path
        be.graphs.end_capture(ok=True)
        return stock_path, cascade_path
    return stock_path, None


def test_graph_mode_replays_any_grouping_with_fixed_buffers():
    runner = _runner()
    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    ws = be.decode.workspace
    buffers = (ws.meta.data_ptr(), ws.part_o.data_ptr())
    fb, rows = _batch(runner, hot={0, 2, 3})
    view = _replay_view(fb, 8)
    assert _capture(be, view) == (Path.PAGED, Path.CASCADE)
    # the cascade capture's forward: the kernels run over an empty work list (values unused)
    q, k, v = _qkv(8, 3)
    be.forward_decode(q, k, v, LAYER, view)
    assert be.decode.ws.work_list.bs == 0
    # "replays": a grouped batch (cascade graph), an ungrouped one (stock graph), same buffers
    for hot, path in (({0, 2, 3}, "cascade"), ({4}, "paged")):
        fb, rows = _batch(runner, hot=hot)
        view = _replay_view(fb, 8)
        be.stage_batch(rows)
        be.init_forward_metadata_out_graph(view)
        assert be.graphs.planned_cascade == (path == "cascade")
        q, k, v = _qkv(8, 4)
        o = be.forward_decode(q, k, v, LAYER, view)
        torch.testing.assert_close(o[:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)
        assert be.stats.paths[path] >= 1
    assert (ws.meta.data_ptr(), ws.part_o.data_ptr()) == buffers and be.decode.workspace is ws


def test_paged_graph_steps_launch_nothing_and_fill_nothing(monkeypatch):
    """Replays: paged, paged, cascade, paged. A paged step replays the stock graph: no GraniKV
    kernel (Python would not even run for a replay; here forward_decode is called as the
    stock graph's capture recorded it), no workspace fill, the wrapped backend planned with the
    real seq_lens; every output matches paged attention."""
    runner = _runner()
    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    ws = be.decode.workspace
    fb, _ = _batch(runner, hot={0, 2, 3})
    _capture(be, _replay_view(fb, 8))
    fills, calls = [], []
    real_fill = ws.fill
    monkeypatch.setattr(ws, "fill", lambda *a, **kw: fills.append(1) or real_fill(*a, **kw))
    real_run = be.decode.run
    monkeypatch.setattr(be.decode, "run", lambda *a, **kw: calls.append(1) or real_run(*a, **kw))
    for i, hot in enumerate(({4}, {4}, {0, 2, 3}, {4})):
        fb, rows = _batch(runner, hot=hot)
        view = _replay_view(fb, 8)
        be.stage_batch(rows)
        be.init_forward_metadata_out_graph(view)
        paged = not be.graphs.planned_cascade
        if paged:
            assert torch.equal(be.inner.seq_lens, view.seq_lens)
        q, k, v = _qkv(8, 10 + i)
        o = be.forward_decode(q, k, v, LAYER, view)
        torch.testing.assert_close(o[:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)
    assert len(fills) == 1 and len(calls) == 1  # the cascade step only
    assert be.stats.paths["cascade"] == 1 and be.stats.paths["paged"] == 3


def test_sizes_without_a_cascade_graph_always_replay_stock(monkeypatch):
    """A size captured with its stock graph only is never planned cascade (the plan skips the
    grouping), and its capture has no GraniKV kernel."""
    runner = _runner()
    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    calls = []
    monkeypatch.setattr(be.decode, "run", lambda *a, **kw: calls.append(a))
    fb, rows = _batch(runner, hot={0, 2, 3})
    view = _replay_view(fb, 8)
    assert _capture(be, view, cascade=False) == (Path.PAGED, None)
    q, k, v = _qkv(8, 6)
    be.forward_decode(q, k, v, LAYER, view)  # the stock capture's forward
    be.stage_batch(rows)
    be.init_forward_metadata_out_graph(view)
    o = be.forward_decode(q, k, v, LAYER, view)
    assert calls == [] and not be.graphs.planned_cascade
    assert be.stats.paths["paged"] == 1 and "no cascade graph" in be.stats.last_reason
    torch.testing.assert_close(o[:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)


def test_cascade_capture_reuses_the_stock_capture_metadata():
    """The cascade graph of a size must read the wrapped backend's buffers of the stock graph
    of that size: its capture refills them as a replay does (in_capture=False) and restores the
    stock capture's forward_metadata."""
    runner = _runner()
    be = _backend(runner, "cascade")
    calls = []

    class Recording(PagedStandIn):
        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            calls.append(in_capture)
            if in_capture:
                self.forward_metadata = object()  # new per-size buffers, as flashinfer creates
            self.init_forward_metadata(fb)

    be.inner = Recording(runner)
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fb, _ = _batch(runner, hot={0, 2, 3})
    be.init_forward_metadata_out_graph(_replay_view(fb, 8), in_capture=True)
    stock_md = be.inner.forward_metadata
    be.graphs.begin_capture(8)
    be.init_forward_metadata_out_graph(_replay_view(fb, 8), in_capture=True)
    be.graphs.end_capture(ok=True)
    assert calls == [True, False] and be.inner.forward_metadata is stock_md
    assert torch.equal(be.inner.seq_lens, torch.ones(8, dtype=torch.int64))  # seq_len = 1 view
    assert be.graphs.has_cascade_graph(8) and not be.graphs.has_cascade_graph(4)
    be.graphs.check_integrity()


def test_extend_is_delegated():
    runner = _runner()
    be = _backend(runner, "cascade")
    calls = []
    be.inner.forward_extend = lambda *a, **kw: calls.append(kw) or "stock"
    assert be.forward_extend(None, None, None, LAYER, None) == "stock" and calls


def test_base_class_methods_reach_the_wrapped_backend():
    """Breakable prefill graphs etc. are defined on AttentionBackend; they must be forwarded."""
    runner = _runner()
    be = _backend(runner, "cascade")
    seen = []
    be.inner.prepare_forward_metadata_for_breakable_cuda_graph_replay = (
        lambda *a, **kw: seen.append(a) or "inner")
    assert be.prepare_forward_metadata_for_breakable_cuda_graph_replay(1, 2) == "inner"
    assert seen == [(1, 2)]
    # ... but forward() stays ours, so decode goes through forward_decode above
    assert "forward" not in GraniKVAttnBackend.__dict__
    be.inner.forward_metadata = "fm"
    be.forward_metadata = None  # what SGLang does on an empty idle batch
    assert be.inner.forward_metadata is None


def test_debug_compare_reports_the_difference(caplog):
    runner = _runner()
    be = _backend(runner, "cascade")
    be.cfg = GraniKVConfig(enable=True, attention_path="cascade", debug_compare_every=1)
    fb, rows = _batch(runner, hot={0, 1, 2, 3})
    q, k, v = _qkv(fb.batch_size, 5)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    with caplog.at_level("INFO", logger="granikv"):
        be.forward_decode(q, k, v, LAYER, fb)
    assert "max |diff| vs paged" in caplog.text
    assert 0 < be.stats.max_compare_diff < ATOL  # fp16 output vs float64 reference


def test_eager_step_larger_than_the_graphs_uses_its_own_workspace():
    """More running requests than the largest captured graph: an eager step, still planned."""
    runner = _runner()
    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    graph_ws = be.decode.workspace
    fb, rows = _batch(runner, hot={0, 2, 3})  # 5 requests > 4
    q, k, v = _qkv(fb.batch_size, 7)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, LAYER, fb)
    torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)
    assert be.stats.paths["cascade"] == 1
    assert be.decode.workspace is graph_ws and be.decode.ws is not graph_ws and be.decode.ws.max_bs >= 5
    # unplanned large eager step: the stock backend alone, no kernel launch, no error
    be.init_forward_metadata(fb)
    o = be.forward_decode(q, k, v, LAYER, fb)
    torch.testing.assert_close(o, _expected(runner, fb, q), atol=ATOL, rtol=RTOL)


def test_extend_batch_plans_nothing_and_fills_no_workspace():
    """An extend batch goes to the stock backend as is: no plan, no workspace fill (even for
    a graph-sized batch), the staged rows dropped, no decode step counted."""
    runner = _runner()
    be = _backend(runner, "cascade")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    fills = []
    be.decode.workspace.fill = lambda *a, **kw: fills.append(a)
    fb, rows = _batch(runner, hot={0, 2, 3})
    fb.forward_mode = ForwardMode.EXTEND
    be.stage_batch(rows)
    seen = []
    be.inner.init_forward_metadata = lambda f: seen.append(f)
    be.init_forward_metadata(fb)
    assert seen == [fb] and not fills and be._staged is None
    assert be.stats.planned == 0 and be.stats.steps == 0


def test_every_base_class_name_reads_from_the_wrapped_backend():
    """Each name SGLang's AttentionBackend defines (0.5.23 adds flags such as
    supports_prefill_cuda_graph_max_context_size) answers from the wrapped backend, not the
    base's default: the list is the base class's own namespace."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    names = GraniKVAttnBackend.forwarded_base_names
    base = {n for n in vars(AttentionBackend) if not n.startswith("__") and n != "_abc_impl"}
    own = base - set(names)
    assert own <= {"forward", "forward_metadata", "forward_decode", "forward_extend",
                   "init_forward_metadata", "init_forward_metadata_out_graph",
                   "init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value",
                   "init_forward_metadata_in_graph"} | set(GraniKVAttnBackend.__dict__), own
    be = _backend(_runner(), "auto")
    flags = [n for n in names if not callable(vars(AttentionBackend)[n])
             or isinstance(vars(AttentionBackend)[n], property)]
    for n in flags:
        sentinel = object()
        setattr(be.inner, n, sentinel)
        assert getattr(be, n) is sentinel, n
    methods = [n for n in names if n not in flags]
    for n in methods:
        setattr(be.inner, n, lambda *a, n=n, **kw: (n, a, kw))
        assert getattr(be, n)(1, x=2) == (n, (1,), {"x": 2}), n
    be.prefill_attention_backend_str = "fa3"  # SGLang stamps it on the wrapper
    assert be.inner.prefill_attention_backend_str == "fa3"
    if "supports_prefill_cuda_graph_max_context_size" in vars(AttentionBackend):  # 0.5.23
        be.inner.supports_prefill_cuda_graph_max_context_size = True
        assert be.supports_prefill_cuda_graph_max_context_size is True


def test_forwarding_never_shadows_what_granikv_defines():
    """Only base-class methods GraniKV does not define are forwarded, on the class and on a
    subclass of it (the forwarding runs again for every subclass)."""
    from granikv.attention.forwarding import AttentionBackend, ForwardingBackend

    class Sub(GraniKVAttnBackend):
        pass

    own = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_cuda_graph_state",
           "forward_decode", "forward_extend")
    for name in own:
        assert name in vars(AttentionBackend)
        assert getattr(Sub, name) is vars(GraniKVAttnBackend)[name]
        assert vars(GraniKVAttnBackend)[name].__qualname__ == f"GraniKVAttnBackend.{name}"
    assert Sub.forward_metadata is vars(ForwardingBackend)["forward_metadata"]
    assert Sub.forward is AttentionBackend.forward
