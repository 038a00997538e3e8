"""Extend batches over HOT prefixes under a wrapped backend without ragged + paged calls (triton).

``GraniKVAttnBackend`` around a stand-in of SGLang's triton extend (one causal kernel over each
request's whole row, no LSE), with real SGLang pools (the KV write goes through the real
``MHATokenToKVPool.set_kv_buffer``) and the real HotPrefixTable: GraniKV computes the whole
extend (causal part + prefix part over the HOT extents + COLD remainder, merged) and the result
must equal full causal attention over each request's ``req_to_token`` row; layers or batches it
does not serve go to the stand-in. Same batches and tolerances as test_hot_extend.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.attention.extend.full_extend import backend_reason
from granikv.attention.eligibility import call_reason, layer_reason
from granikv.attention.extend.hot_extend import HotExtendAttention, TorchDense

from extend_standin import TritonExtendStandIn  # noqa: E402  (beside this file)
from test_hot_extend import ATOL, D, HKV, HQ, RTOL, SCALE, _expected, _setup  # noqa: E402

LAYER = SimpleNamespace(layer_id=0, scaling=SCALE, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D,
                        k_scale=None, v_scale=None, sliding_window_size=-1, logit_cap=0.0,
                        is_cross_attention=False)


def _backend(runner, **cfg):
    be = GraniKVAttnBackend(None, model_runner=runner, cfg=GraniKVConfig(enable=True, **{"extend_path": "hot", **cfg}), backend_name="triton")
    be.inner = TritonExtendStandIn(runner)
    return be


def _run(be, fb, rows, q, k, v, layer=LAYER, stage=True):
    if stage:
        be.stage_batch(rows)
    be.init_forward_metadata(fb)
    return be.forward_extend(q, k, v, layer, fb)


def _pool_kv(runner):
    pool = runner.token_to_kv_pool
    return pool.k_buffer[0].clone(), pool.v_buffer[0].clone()


@pytest.mark.parametrize("kinds, new", [
    (["A", "A", "A"], [5, 7, 3]),  # agents joining one shared prefix
    (["A", "none", "B", "A", "A"], [5, 4, 3, 6, 2]),  # two extents, a fresh request in between
    (["A", "cold", "A+", "none", "B", "A+"], [3, 4, 5, 2, 3, 1]),  # + COLD remainders (paged call)
])
def test_full_extend_equals_causal_attention_over_the_rows_and_writes_the_kv(kinds, new):
    runner, fb, rows, q, k, v = _setup(kinds, new)
    ref_runner, ref_fb, _, _, _, _ = _setup(kinds, new)
    expected = _expected(runner, fb, q, k, v)
    be = _backend(runner)
    out = _run(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 0  # GraniKV served the whole layer
    TritonExtendStandIn(ref_runner).forward_extend(q, k, v, LAYER, ref_fb)  # the stock KV write
    for ours, stock in zip(_pool_kv(runner), _pool_kv(ref_runner)):
        assert torch.equal(ours, stock)  # exactly the same K/V in the same slots
    snap = be.stats_snapshot()
    assert snap["extend_hot_batches"] == snap["extend_batches"] == 1
    assert snap["extend_hot_tokens"] == sum(n for kd, n in zip(kinds, new) if kd in ("A", "A+", "B"))
    be.extend.hot_extend.check_integrity()
    be.extend.full_extend.check_integrity()
    be.init_forward_metadata(fb)  # nothing staged: the next batch ends this one's plan
    assert not be.extend.full_extend.active
    be.extend.full_extend.check_integrity()


def test_batches_without_hot_runs_or_cached_prefix_stay_on_the_wrapped_backend():
    runner, fb, rows, q, k, v = _setup(["cold", "none", "cold"], [4, 4, 4])
    be = _backend(runner)
    torch.testing.assert_close(_run(be, fb, rows, q, k, v), _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 1 and be.stats_snapshot()["extend_fallbacks"] == {"no HOT prefix in the batch": 1}
    runner, fb, rows, q, k, v = _setup(["none", "none"], [3, 5])
    be = _backend(runner)
    _run(be, fb, rows, q, k, v)
    assert be.inner.calls == 1 and be.stats.extend_batches == 0  # nothing to share: not even counted
    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 3])
    be = _backend(runner)
    _run(be, fb, rows, q, k, v, stage=False)
    assert be.inner.calls == 1 and be.stats.extend_fallbacks == {"batch not staged": 1}
    be = _backend(runner, extend_path="paged")
    _run(be, fb, rows, q, k, v)
    assert be.inner.calls == 1 and be.stats.extend_batches == 0


def test_a_layer_it_does_not_serve_goes_to_the_wrapped_backend(caplog):
    runner, fb, rows, q, k, v = _setup(["A", "B", "A"], [3, 2, 4])
    be = _backend(runner)
    windowed = SimpleNamespace(**{**vars(LAYER), "sliding_window_size": 64})
    with caplog.at_level("INFO", logger="granikv"):
        out = _run(be, fb, rows, q, k, v, layer=windowed)
        be.forward_extend(q, k, v, windowed, fb)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 2 and caplog.text.count("(sliding window 64)") == 1  # logged once
    assert be.forward_extend(q, k, v, LAYER, fb) is not None and be.inner.calls == 2  # the next layer: served


def test_layer_and_backend_reasons():
    q = torch.zeros(1, HQ * D)
    assert layer_reason(LAYER) is None and call_reason(q, q, {}) is None
    assert call_reason(q, None, {}) == "no new K/V given"
    assert "sinks" in call_reason(q, q, {"sinks": torch.zeros(1)})
    assert call_reason(q, q, {"sinks": None}) is None
    for attr, val in (("k_scale", 1.0), ("logit_cap", 30.0), ("is_cross_attention", True)):
        assert layer_reason(SimpleNamespace(**{**vars(LAYER), attr: val})) is not None
    runner, *_ = _setup(["A"], [1])
    pool = runner.token_to_kv_pool
    assert backend_reason(SimpleNamespace(), pool) is None
    assert "deterministic" in backend_reason(SimpleNamespace(enable_deterministic=True), pool)
    assert "context parallel" in backend_reason(SimpleNamespace(dcp_size=2), pool)
    translating = {"_translate_kv_loc": lambda loc: loc,
                   "kv_index_translator": SimpleNamespace(is_translating=True)}
    assert "translated slots" in backend_reason(SimpleNamespace(**translating), pool)
    plain = {"_translate_kv_loc": None, "kv_index_translator": SimpleNamespace(is_translating=False)}
    assert backend_reason(SimpleNamespace(**plain), pool) is None


def test_a_deterministic_wrapped_backend_keeps_its_own_extend():
    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 3])
    be = _backend(runner)
    be.inner.enable_deterministic = True
    _run(be, fb, rows, q, k, v)
    assert be.inner.calls == 1
    assert be.stats.extend_fallbacks == {"deterministic inference (the wrapped backend's own kernel)": 1}


def test_a_failing_full_extend_falls_back_and_stays_off(caplog):
    runner, fb, rows, q, k, v = _setup(["A", "A", "B"], [3, 4, 2])
    be = _backend(runner)

    class Broken(TorchDense):
        def run_causal(self, *a, **kw):
            raise RuntimeError("no prebuilt module for this shape")

    be.extend.attention()
    be.extend.hot_extend.runner = Broken()
    with caplog.at_level("ERROR", logger="granikv"):
        out = _run(be, fb, rows, q, k, v)
        out2 = be.forward_extend(q, k, v, LAYER, fb)  # the batch's next layer: stock, no retry
    for o in (out, out2):
        torch.testing.assert_close(o, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 2 and caplog.text.count("stock prefill from now on") == 1
    runner2, fb2, rows2, q2, k2, v2 = _setup(["A", "A"], [2, 2], seed=3)
    be.model_runner, be.inner = runner2, TritonExtendStandIn(runner2)
    _run(be, fb2, rows2, q2, k2, v2)
    assert be.inner.calls == 1  # the next batch: planned stock
    assert all("after an error (RuntimeError)" in r for r in be.stats_snapshot()["extend_fallbacks"])


def test_debug_compare_runs_the_wrapped_backend_on_layer_0(caplog):
    runner, fb, rows, q, k, v = _setup(["A", "cold", "A+"], [3, 2, 4])
    be = _backend(runner, debug_compare_every=1)
    with caplog.at_level("INFO", logger="granikv"):
        out = _run(be, fb, rows, q, k, v)
        be.forward_extend(q, k, v, LAYER, fb)  # layer 0 again in the same batch: compared once
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 1 and caplog.text.count("backend's extend") == 1
    assert 0 < be.stats.max_extend_compare_diff < 5e-3


def test_the_next_batch_is_planned_afresh():
    runner, fb, rows, q, k, v = _setup(["A", "B", "A"], [4, 4, 4])
    be = _backend(runner)
    _run(be, fb, rows, q, k, v)
    runner2, fb2, rows2, q2, k2, v2 = _setup(["cold", "cold"], [2, 2], seed=1)
    be.model_runner, be.inner = runner2, TritonExtendStandIn(runner2)
    out = _run(be, fb2, rows2, q2, k2, v2)
    torch.testing.assert_close(out, _expected(runner2, fb2, q2, k2, v2), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 1 and not be.extend.full_extend.active
    assert isinstance(be.extend.hot_extend, HotExtendAttention)
    np.testing.assert_array_equal(rows2, [1, 2])


def test_padded_inputs_of_a_prefill_cuda_graph_replay():
    """SGLang's breakable prefill CUDA graph (its default on CUDA) plans the metadata from the
    real batch and runs the model on inputs padded to its bucket (padding rows write their K/V
    to the padding slot 0). The real tokens' output is unchanged, padding rows get 0, the path
    stays on."""
    import copy

    runner, fb, rows, q, k, v = _setup(["A", "cold", "A+", "B"], [3, 4, 5, 2])
    expected = _expected(runner, fb, q, k, v)
    be = _backend(runner)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)  # the real batch
    pad = 6
    static = copy.copy(fb)
    static.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros(pad, dtype=fb.out_cache_loc.dtype)])
    qp, kp, vp = (torch.cat([t, torch.randn(pad, t.shape[1]).to(t.dtype)]) for t in (q, k, v))
    out = be.forward_extend(qp, kp, vp, LAYER, static)
    assert out.shape == (q.shape[0] + pad, HQ * D)
    torch.testing.assert_close(out[: q.shape[0]], expected, atol=ATOL, rtol=RTOL)
    assert (out[q.shape[0]:] == 0).all()
    assert be.inner.calls == 0 and be.extend.full_extend.active and not be.stats.extend_fallbacks
    with pytest.raises(RuntimeError, match="query tokens"):  # fewer rows than the batch: a real mismatch
        be.extend.full_extend.forward(q[:-1], k[:-1], v[:-1], LAYER, fb, runner.token_to_kv_pool, False)


def test_a_piecewise_prefill_graph_leaves_the_call_to_the_wrapped_backend(monkeypatch):
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import context_manager

    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 4])
    be = _backend(runner)
    monkeypatch.setattr(context_manager, "_in_tc_piecewise_cuda_graph", True)
    out = _run(be, fb, rows, q, k, v)
    torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
    assert be.inner.calls == 1 and be.extend.full_extend.active  # this call only: the batch stays planned
    monkeypatch.setattr(context_manager, "_in_tc_piecewise_cuda_graph", False)
    be.forward_extend(q, k, v, LAYER, fb)
    assert be.inner.calls == 1


def test_check_integrity_catches_a_batch_begun_without_a_plan():
    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 3])
    be = _backend(runner, debug_integrity=True)  # the backend runs it on every planned batch
    _run(be, fb, rows, q, k, v)
    be.extend.hot_extend.end()
    be.extend.full_extend.begin()
    with pytest.raises(AssertionError, match="without a plan"):
        be.extend.full_extend.check_integrity()


def _expected_with_sinks(runner, fb, q, k, v, sinks):
    """Float64 causal attention of each new token over its row, the sink's logit in each q-head's
    softmax denominator (kernels/reference.with_sinks_ref, as SGLang's triton extend kernel adds
    ``exp(sink - max)`` to its denominator)."""
    from granikv.kernels.reference import attend_ref, with_sinks_ref

    kb, vb = runner.token_to_kv_pool.k_buffer[0].clone(), runner.token_to_kv_pool.v_buffer[0].clone()
    kb[fb.out_cache_loc] = k.view(-1, HKV, D)
    vb[fb.out_cache_loc] = v.view(-1, HKV, D)
    rt = runner.req_to_token_pool.req_to_token
    q3, outs, t = q.view(-1, HQ, D), [], 0
    for row, p, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = rt[row, : p + n].long()
        for j in range(n):
            st = attend_ref(q3[t + j], kb[slots[: p + j + 1]], vb[slots[: p + j + 1]], SCALE)
            outs.append(with_sinks_ref(type(st)(st.o[None], st.lse[None]), sinks).o[0])
        t += n
    return torch.stack(outs).view(-1, HQ * D)


def test_attention_sinks_join_the_softmax_of_the_whole_extend():
    """gpt-oss's layers carry learned sinks: the whole extend (causal + HOT prefix + COLD
    remainder, merged) scales each q-head's output by sigmoid(lse - sink), which equals the
    float64 reference with the sink in the denominator; the wrapped backend is not called.
    Planted: the same batch without the sinks is off by far more than the tolerance. Sinks of
    another shape go to the wrapped backend."""
    runner, fb, rows, q, k, v = _setup(["A", "cold", "A+", "none", "B"], [3, 4, 5, 2, 3])
    sinks = torch.linspace(-1.0, 2.5, HQ)  # around the scores' log-sum-exp: a visible share
    expected = _expected_with_sinks(runner, fb, q, k, v, sinks)
    be = _backend(runner)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    out = be.forward_extend(q, k, v, LAYER, fb, sinks=sinks.to(torch.bfloat16).float())
    assert be.inner.calls == 0
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=RTOL)
    wrong = be.extend.full_extend.forward(q, k, v, LAYER, fb, runner.token_to_kv_pool, False, sinks=None)
    assert (wrong.double() - expected).abs().max() > 20 * ATOL
    be.forward_extend(q, k, v, LAYER, fb, sinks=torch.zeros(HQ + 1))
    assert be.inner.calls == 1  # not one logit per q-head: stock


def test_the_prefix_part_proxy_leaves_a_layer_with_sinks_to_the_wrapped_backend():
    """Under a ragged + paged backend (flashinfer) GraniKV swaps only the prefix call, so it cannot
    add the sink: such a layer runs the wrapped backend whole."""
    from test_hot_extend import _backend as proxy_backend

    runner, fb, rows, q, k, v = _setup(["A", "A"], [3, 4])
    be = proxy_backend(runner)
    be.stage_batch(rows)
    be.init_forward_metadata(fb)
    assert be.extend.full_extend is None or not be.extend.full_extend.active
    assert be.eligibility.reason(LAYER, k, v, {"sinks": torch.zeros(HQ)}) is not None
    assert be.eligibility.sinks_reason(LAYER, k, v, {"sinks": torch.zeros(HQ)}) is None


def test_the_sink_convention_is_sglangs_triton_extend_kernel():
    """SGLang's own triton extend kernel (what gpt-oss's prefill runs on) with the same sinks over
    the same batch equals the float64 reference the whole extend is held to above."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    runner, fb, rows, q, k, v = _setup(["A", "cold", "A+", "none", "B"], [3, 4, 5, 2, 3])
    sinks = torch.linspace(-1.0, 2.5, HQ)
    expected = _expected_with_sinks(runner, fb, q, k, v, sinks)
    rt = runner.req_to_token_pool.req_to_token
    pool = runner.token_to_kv_pool
    pool.set_kv_buffer(LAYER, fb.out_cache_loc, k.view(-1, HKV, D), v.view(-1, HKV, D))
    pre = list(fb.extend_prefix_lens_cpu)
    new = list(fb.extend_seq_lens_cpu)
    kv_indptr = torch.tensor([0] + list(np.cumsum(pre)), dtype=torch.int32)
    qo_indptr = torch.tensor([0] + list(np.cumsum(new)), dtype=torch.int32)
    kv_indices = torch.cat([rt[r, :p] for r, p in zip(fb.req_pool_indices.tolist(), pre)]).long()
    out = torch.empty(q.shape[0], HQ, D, dtype=q.dtype)
    extend_attention_fwd(q.view(-1, HQ, D), k.view(-1, HKV, D), v.view(-1, HKV, D), out, pool.k_buffer[0],
                         pool.v_buffer[0], qo_indptr, kv_indptr, kv_indices, None, True, None, max(new),
                         1.0, 1.0, sm_scale=SCALE, sinks=sinks)
    torch.testing.assert_close(out.view(-1, HQ * D).double(), expected, atol=ATOL, rtol=RTOL)


def test_the_auto_gate_charges_the_whole_extends_causal_call_and_merge():
    """--granikv-extend-path auto under a one-call stock extend (triton): the gate prices the
    whole extend GraniKV would run (ExtendTerms.hot_full_us: + one causal call + one merge), not
    the prefix part alone. Terms where the prefix part pays (two dense calls of ~0 us against a
    3 us stock call) but the extra merge (5 us) does not: stock; with the merge ~0 us: HOT."""
    import dataclasses

    def run(merge_us):
        runner, fb, rows, q, k, v = _setup(["A", "A", "B"], [3, 5, 4])
        be = _backend(runner, extend_path="auto")
        cm = be.dispatcher.cost_model
        ext = dataclasses.replace(cm.served.extend, dense_call_us=1e-6, paged_call_us=3.0, merge_us=merge_us)
        assert ext.hot_us(2, 0.0, None) < ext.stock_us(0.0)  # the prefix part alone would pay
        be.dispatcher.cost_model = dataclasses.replace(cm, served=dataclasses.replace(cm.served, extend=ext))
        out = _run(be, fb, rows, q, k, v)
        torch.testing.assert_close(out, _expected(runner, fb, q, k, v), atol=ATOL, rtol=RTOL)
        return be

    be = run(5.0)
    assert be.inner.calls == 1 and be.stats.extend_hot_batches == 0
    assert list(be.stats.extend_fallbacks) == ["the cost model puts the stock prefill first for this shape"]
    be = run(1e-6)
    assert be.inner.calls == 0 and be.stats.extend_hot_batches == 1
