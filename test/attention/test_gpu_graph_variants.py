"""GPU host: decode CUDA graphs of one batch size, stock and cascade, captured for real.

The stock graph of a size must hold no GraniKV kernel (a paged step replays exactly the stock
work); the cascade graph replayed after a grouped plan must match the float64 paged reference.
The wrapped backend is a capturable paged stand-in (masked dense attention over
``req_to_token`` rows, fixed shapes) reading its seq_lens from a fixed buffer, as SGLang's
backends read theirs.
"""

import pytest
import torch

from granikv.kernels.graph_capture import capture_graph
from test_backend import ATOL, D, HKV, HQ, LAYER, RTOL, _backend, _batch, _expected, _qkv, _replay_view, _runner  # noqa: E402

pytestmark = pytest.mark.gpu
BS = 8


class CapturablePaged:
    """Writes K/V at out_cache_loc, then attends to ``req_to_token[rpi, :seq_len]`` with a mask."""

    def __init__(self, runner):
        self.runner = runner
        self.seq_lens = torch.ones(BS, dtype=torch.int64, device="cuda")
        self.rpi = torch.zeros(BS, dtype=torch.int64, device="cuda")
        self.forward_metadata = None

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def init_forward_metadata_in_graph(self, fb):  # SGLang's base: nothing of its own in the graph
        pass

    def get_cuda_graph_seq_len_fill_value(self):  # the padding rows' seq_len (SGLang's backends: 1)
        return 1

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.seq_lens.copy_(fb.seq_lens[:BS])
        self.rpi.copy_(fb.req_pool_indices[:BS])
        if in_capture:
            self.forward_metadata = object()

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        pool = self.runner.token_to_kv_pool
        kb, vb = pool.k_buffer[0], pool.v_buffer[0]
        kb[fb.out_cache_loc] = k.view(-1, HKV, D)
        vb[fb.out_cache_loc] = v.view(-1, HKV, D)
        rows = self.runner.req_to_token_pool.req_to_token[self.rpi].long()  # [bs, L]
        keys, vals = kb[rows].float(), vb[rows].float()  # [bs, L, Hkv, D]
        qg = q.view(BS, HKV, HQ // HKV, D).float()
        s = torch.einsum("bgrd,blgd->bgrl", qg, keys) * layer.scaling
        mask = torch.arange(rows.shape[1], device="cuda")[None, :] < self.seq_lens[:, None]
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        o = torch.einsum("bgrl,blgd->bgrd", torch.softmax(s, dim=-1), vals)
        return o.reshape(BS, HQ * D).to(q.dtype)


def test_stock_graph_has_no_granikv_kernel_and_cascade_graph_matches_reference(monkeypatch):
    runner = _runner("cuda")
    be = _backend(runner, "cascade")
    be.inner = CapturablePaged(runner)
    be.init_cuda_graph_state(max_bs=BS, max_num_tokens=BS)
    fb, rows = _batch(runner, hot={0, 2, 3})
    static = _replay_view(fb, BS)  # SGLang's fixed graph inputs, refilled before every replay
    q, k, v = _qkv(BS, 1)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    launches = []
    real_run = be.decode.run
    monkeypatch.setattr(be.decode, "run", lambda *a, **kw: launches.append(1) or real_run(*a, **kw))
    out = {}

    be.init_forward_metadata_out_graph(static, in_capture=True)
    stock = capture_graph(lambda: out.__setitem__("stock", be.forward_decode(q, k, v, LAYER, static)))
    assert launches == []  # nothing of GraniKV's was recorded into the stock graph
    be.graphs.begin_capture(BS)
    be.init_forward_metadata_out_graph(static, in_capture=True)
    cascade = capture_graph(lambda: out.__setitem__("cascade", be.forward_decode(q, k, v, LAYER, static)))
    be.graphs.end_capture(ok=True)
    assert launches  # warm-up + capture ran the kernels

    for hot, graph_name in (({0, 2, 3}, "cascade"), ({4}, "stock"), ({0, 1, 2, 3, 4}, "cascade")):
        fb, rows = _batch(runner, hot=hot)
        view = _replay_view(fb, BS)
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(static, name).copy_(getattr(view, name))
        static.seq_lens_cpu = view.seq_lens_cpu
        be.stage_batch(rows)
        be.init_forward_metadata_out_graph(static)
        assert ("cascade" if be.graphs.planned_cascade else "stock") == graph_name
        {"stock": stock, "cascade": cascade}[graph_name].replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[graph_name][:5], _expected(runner, fb, q[:5]), atol=ATOL, rtol=RTOL)


class CascadeGraph:
    """A backend in graph mode with the stock and the cascade graph of ``BS`` captured over one
    static replay view, in SGLang's order, the cascade graph's in-graph metadata hook (suffix-end
    copy, slot append) inside its capture, or (``hook_outside``, planted) run at capture time
    outside it; ``replay`` drives one decode step as SGLang's graph runner does."""

    def __init__(self, seed, *, hook_outside=False):
        self.runner = runner = _runner("cuda")
        self.be = be = _backend(runner, "cascade")
        be.inner = CapturablePaged(runner)
        be.init_cuda_graph_state(max_bs=BS, max_num_tokens=BS)
        self.fb, self.rows = _batch(runner, hot={0, 2, 3})
        self.static = static = _replay_view(self.fb, BS)
        self.q, k, v = (t.cuda() for t in _qkv(BS, seed))
        out = self.out = {}
        be.init_forward_metadata_out_graph(static, in_capture=True)
        capture_graph(lambda: out.__setitem__("stock", be.forward_decode(self.q, k, v, LAYER, static)))
        be.graphs.begin_capture(BS)
        be.init_forward_metadata_out_graph(static, in_capture=True)
        if hook_outside:
            be.init_forward_metadata_in_graph(static)

        def body():
            if not hook_outside:
                be.init_forward_metadata_in_graph(static)
            out["cascade"] = be.forward_decode(self.q, k, v, LAYER, static)

        self.graph = capture_graph(body)
        be.graphs.end_capture(ok=True)
        self.steps, self.results = [], []

    def replay(self, fb_i):
        """One step over ``fb_i``: the static buffers refilled (stream-ordered, as SGLang's replay
        preparation), planned, the cascade graph replayed; no sync."""
        view, static = _replay_view(fb_i, BS), self.static
        static.seq_lens.copy_(view.seq_lens)
        static.out_cache_loc.copy_(view.out_cache_loc)
        static.seq_lens_cpu = view.seq_lens_cpu
        static.seq_lens_sum = view.seq_lens_sum
        self.be.stage_batch(self.rows)
        self.be.init_forward_metadata_out_graph(static)
        assert self.be.graphs.planned_cascade
        self.graph.replay()
        self.results.append(self.out["cascade"][:5].clone())
        self.steps.append(fb_i)

    def check(self, *, planted):
        """Every step's output against the paged reference (after a sync); planted: some differ."""
        torch.cuda.synchronize()

        def check():
            for fb_i, o in zip(self.steps, self.results):
                torch.testing.assert_close(o, _expected(self.runner, fb_i, self.q[:5]), atol=ATOL, rtol=RTOL)

        if planted:
            with pytest.raises(AssertionError):
                check()
        else:
            check()


def _step(fb, grow):
    """``fb`` with every request ``grow`` tokens longer (negative: shorter)."""
    import copy

    fb_i = copy.copy(fb)
    fb_i.seq_lens = fb.seq_lens + grow
    fb_i.seq_lens_cpu = fb.seq_lens_cpu + grow
    fb_i.seq_lens_sum = int(fb_i.seq_lens_cpu.sum())
    return fb_i


@pytest.mark.parametrize("planted", [False, True])
def test_back_to_back_replays_end_suffixes_where_the_graph_copied_them(planted):
    """The cascade graph records the suffix-end copy in the in-graph metadata hook (as SGLang's
    ``run_once`` calls it inside the capture), so its replays launch no copy before them. Four
    replays back to back, no sync between them, each over other lengths written into the static
    ``seq_lens`` (fills and advances): every output equals the paged reference. Planted: the hook
    ran at capture time but outside the graph, so the planner trusts a copy the graph does not
    make and the replays end suffixes at the captured lengths (the outputs differ)."""
    g = CascadeGraph(3, hook_outside=planted)
    assert g.be.graphs.ends_source == {BS: g.static.seq_lens.data_ptr()}
    rt = g.runner.req_to_token_pool.req_to_token
    for cut in (3, 2, 2, 1):  # shorter than captured: every step ends somewhere else
        fb_i = _step(g.fb, -cut)
        fb_i.out_cache_loc = rt[g.fb.req_pool_indices, fb_i.seq_lens - 1].long()  # SGLang: the newest token's slot
        g.replay(fb_i)
    assert g.be.decode.ends_in_graph_steps == 4
    g.check(planted=planted)


@pytest.mark.parametrize("planted", [False, True])
def test_steady_replays_back_to_back_match_the_reference(planted):
    """Decode steps of one batch as SGLang drives a cascade graph: 64 replays back to back, no
    sync between them, every request one token longer each step with a new KV slot in
    ``req_to_token`` and ``out_cache_loc`` (the static buffers refilled before each); most steps
    are planned from the previous one (``steady_step``), their graph appending the newest slots
    to the slot copy with no copy before them, and every output equals the paged reference.
    Planted: the replay armed with 1,000 steps more headroom than the build's reuse bound, so
    steps past the bound replay a build whose last suffix items no longer cover their requests
    (the outputs differ)."""
    g = CascadeGraph(5)
    if planted:
        ws = g.be.decode.workspace
        real = ws.in_place_headroom
        ws.in_place_headroom = lambda seq_lens: None if real(seq_lens) is None else real(seq_lens) + 1000
    rt = g.runner.req_to_token_pool.req_to_token
    for grow in range(64):
        fb_i = _step(g.fb, grow)
        if grow:  # SGLang's decode step: a slot for each request's newest token (each request its own
            # 32 free slots, 140-299, reused in turn: a slot only ever holds its request's k and v)
            loc = 140 + 32 * torch.arange(5, device="cuda") + grow % 32
            rt[g.fb.req_pool_indices, fb_i.seq_lens - 1] = loc.to(rt.dtype)
            fb_i.out_cache_loc = loc
        g.replay(fb_i)
    assert g.be.decode.steady_replays >= 50 and g.be.graphs.slots_appended == {BS}
    g.check(planted=planted)
