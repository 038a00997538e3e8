"""Composed attention backends (hybrid prefill/decode, two-batch overlap, pdmux): every instance
the plugin wraps is registered and staged by the scheduler step; none reachable turns
promotions off with a warning; the attention counters of several backends add up."""

from types import SimpleNamespace

import numpy as np
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from granikv import plugin
from granikv.config import GraniKVConfig
from granikv.attention import backend_registry
from granikv.attention.backend import GraniKVAttnBackend
from granikv.mem_cache.policy import NeverPromote
from granikv.scheduler_step import metrics_snapshot, on_run_batch

from attention import test_backend as tb
from support.scheduler_sim import Sim, SimConfig

CFG = GraniKVConfig(enable=True, hot_min_tokens=16, attention_path="cascade", log_interval=0)


def _wrapped_runner():
    """A model runner whose two full-attention backends went through the plugin's hook, composed
    by a hybrid stand-in (what SGLang's HybridAttnBackend does with them)."""
    runner = tb._runner()
    runner.server_args = SimpleNamespace(speculative_algorithm=None, _granikv=CFG)
    built = [plugin._around_build_attn_backend(lambda **kw: tb.PagedStandIn(runner), model_runner=runner,
                                               backend_str=name, init_new_workspace=False)
             for name in ("flashinfer", "triton")]
    runner.attn_backend = SimpleNamespace(decode_backend=built[0], prefill_backend=built[1])
    return runner, built


def _scheduler(sim, runner):
    return SimpleNamespace(tree_cache=sim.cache, tp_worker=SimpleNamespace(model_runner=runner),
                           enable_overlap=False, server_args=runner.server_args)


def test_every_wrapped_backend_is_registered_and_staged():
    runner, built = _wrapped_runner()
    assert all(isinstance(b, GraniKVAttnBackend) for b in built)
    assert backend_registry.backends_of(runner) == built
    backend_registry.register(runner, built[0])  # once per instance
    assert len(backend_registry.backends_of(runner)) == 2 and backend_registry.backends_of(None) == []
    sim = Sim(SimConfig(min_tokens=16))
    reqs = [sim.prefill_begin(list(range(1, 20)) + [40 + i]) for i in range(3)]
    on_run_batch(_scheduler(sim, runner), SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs), CFG)
    for b in built:  # the hybrid's prefill and decode halves both hold the batch's rows
        assert list(b._staged) == [r.req_pool_idx for r in reqs]


def test_the_decode_half_of_a_hybrid_plans_normally():
    runner, (decode, prefill) = _wrapped_runner()
    sim = Sim(SimConfig(min_tokens=16))
    sched = _scheduler(sim, runner)
    fb, rows = tb._batch(runner, hot={0, 2, 3})
    reqs = [SimpleNamespace(req_pool_idx=int(r), kv=SimpleNamespace(req_pool_idx=int(r))) for r in rows]
    on_run_batch(sched, SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs), CFG)
    q, k, v = tb._qkv(fb.batch_size, 1)
    decode.init_forward_metadata(fb)
    o = decode.forward_decode(q, k, v, tb.LAYER, fb)
    torch_close = __import__("torch").testing.assert_close
    torch_close(o, tb._expected(runner, fb, q), atol=tb.ATOL, rtol=tb.RTOL)
    assert decode.stats.paths == {"cascade": 1} and decode.stats.unplanned == 0
    att = metrics_snapshot(sched)["attention"]
    assert att["backends"] == 2 and att["decode_steps"] == 1 and att["steps_per_path"] == {"cascade": 1}
    prefill.stats.unplanned, decode.stats.unplanned = 2, 3
    assert metrics_snapshot(sched)["attention"]["unplanned_steps"] == 5  # counts add up


def test_no_reachable_backend_says_so_and_stops_promotions(caplog):
    runner = SimpleNamespace(attn_backend=object(), server_args=SimpleNamespace(_granikv=CFG))
    sim = Sim(SimConfig(min_tokens=16))
    prefix = list(range(1, 33))
    sim.finish(sim.admit(prefix + [40]))
    reqs = [sim.prefill_begin(prefix + [41 + i, 50]) for i in range(3)]
    with caplog.at_level("WARNING", logger="granikv"):
        on_run_batch(_scheduler(sim, runner), SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs), CFG)
    assert "no GraniKV attention backend is reachable" in caplog.text
    assert isinstance(sim.cache.policy, NeverPromote)
    assert sim.cache.metrics.promotions == 0  # three sharers of a cached 32-token prefix: not promoted
    assert np.all(sim.cache.hot_prefix_table.length_np == 0)
    assert "attention" not in metrics_snapshot(_scheduler(sim, runner))
