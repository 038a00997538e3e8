"""SGLang's WAR barrier with GraniKV's kernels in the decode graph: the real
``Scheduler._apply_war_barrier`` through the plugin's hook takes the coarse path (wait for the
whole forward stream) when a GraniKV backend captured graphs, and keeps its fast path
(the pre-replay read-done event) otherwise."""

from types import SimpleNamespace

import pytest
from sglang.srt.managers.scheduler import Scheduler

from granikv import plugin
from granikv import sglang_compat as compat
from granikv.config import GraniKVConfig
from granikv.attention import backend_registry


class _Stream:
    def __init__(self):
        self.waits = []

    def wait_event(self, ev):
        self.waits.append(("event", ev))

    def wait_stream(self, stream):
        self.waits.append(("stream", stream))


class _Backend:
    def __init__(self, graphs):
        self.graphs = graphs

    def reads_req_to_token_during_replay(self):
        return self.graphs


def _scheduler(backends, enable=True):
    runner = SimpleNamespace(attn_backend=None, **{compat.WAR_EVENT_ATTR: "read-done"})
    for b in backends:
        backend_registry.register(runner, b)
    return SimpleNamespace(
        server_args=SimpleNamespace(_granikv=GraniKVConfig(enable=enable)), _war_barrier_enabled=True,
        model_worker=SimpleNamespace(**{compat.WAR_RUNNER_ATTR: runner}), schedule_stream=_Stream(),
        forward_stream="forward", tp_worker=SimpleNamespace(model_runner=runner)), runner


@pytest.mark.parametrize("backends, enable, expect", [
    ([_Backend(True)], True, ("stream", "forward")),  # captured GraniKV kernels: coarse
    ([_Backend(False), _Backend(True)], True, ("stream", "forward")),  # any of a composed backend
    ([_Backend(False)], True, ("event", "read-done")),  # eager only: SGLang's fast path holds
    ([_Backend(True)], False, ("event", "read-done")),  # GraniKV off: untouched
])
def test_real_war_barrier_waits_for_granikv_reads(backends, enable, expect):
    sched, runner = _scheduler(backends, enable)
    plugin._around_apply_war_barrier(Scheduler._apply_war_barrier, sched)
    assert sched.schedule_stream.waits == [expect]
    assert getattr(runner, compat.WAR_EVENT_ATTR) is None  # SGLang clears it either way


def test_the_real_backend_reports_a_planned_cascade_graph():
    from attention import test_backend as tb  # noqa: PLC0415

    be = tb._backend(tb._runner(), "cascade")
    assert not be.reads_req_to_token_during_replay()  # eager: no graph
    be.init_cuda_graph_state(4, 4)
    be.graphs.planned_cascade = False  # a paged step replays the stock graph
    assert not be.reads_req_to_token_during_replay()
    be.graphs.planned_cascade = True  # this step replays the cascade graph
    assert be.reads_req_to_token_during_replay()
