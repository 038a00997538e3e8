"""The replay-gap recorder (benchmark.harness.replay_gaps): its reduction, its hooks on a fake clock,
its arming through the control file, and its plugin metadata and hook targets against the
SGLang installed here."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmark.harness import replay_gaps as rg

ROOT = Path(__file__).resolve().parents[2]


class ClockEvent:
    """A recorded event at the fake clock's time (ms)."""

    def __init__(self, t_ms: float):
        self.t = t_ms
        self.synced = False

    def elapsed_time(self, other: "ClockEvent") -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        self.synced = True


class Engine:
    """A fake scheduler's stream: decode executes of ``replay_ms`` with ``gap_ms`` between them,
    the model runner numbering its forwards as SGLang's does."""

    def __init__(self, control=None):
        self.t = 0.0
        self.profiling = False
        self.model_runner = SimpleNamespace(forward_pass_id=0)
        self.rec = rg.ReplayGapRecorder(lambda: ClockEvent(self.t), lambda: self.profiling, control)

    def forward(self, mode: str, ms: float, gap_ms: float) -> None:
        self.model_runner.forward_pass_id += 1
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: mode == "decode"))

        def replay(key, static_forward_batch):
            self.t += ms
            return "out"

        def execute(runner, forward_batch):
            self.t += 0.003  # load_batch: in the gap, not the replay
            return self.rec.around_graph_replay(replay, "key", forward_batch)

        if mode == "decode":
            assert self.rec.around_execute(execute, self, fb) == "out"
        else:
            assert self.rec.around_graph_replay(lambda *a: "prefill graph", "key", fb) == "prefill graph"
            self.t += ms
        self.t += gap_ms


def test_gap_stats_filtering_exactly():
    recs = [(1, False, 10.0, 5.0), (2, False, 10.0, 7.0), (3, False, 10.0, 999.0), (5, False, 10.0, 6.0),
            (6, True, 30.0, 999.0), (7, False, 10.0, None)]
    s = rg.gap_stats(recs)
    # kept: 1->2 (5), 2->3 (7); left out: 3->5 (a forward between), 5->6 and 6->7 (profiled), 7 (last)
    assert s["gaps"] == 2 and s["gap_us_p50"] == 6.0 and s["gap_us_mean"] == 6.0
    assert s["replay_us_p50"] == 10.0  # the profiled replay left out
    empty = rg.gap_stats([])
    assert empty["gaps"] == 0 and empty["gap_us_p50"] is None and empty["replay_us_p50"] is None


def test_recorder_times_decode_replays_only_while_armed(tmp_path):
    control = str(tmp_path / "ctl")
    e = Engine(control)
    e.forward("decode", 2.0, 0.05)  # not armed: nothing recorded
    assert e.rec._pending is None
    assert e.rec.window()["replays"] == 0 and not e.rec.armed  # no control file: stays off
    rg.arm(control, True)
    assert e.rec.window()["replays"] == 0 and e.rec.armed
    for _ in range(10):
        e.forward("decode", 2.0, 0.05)
    e.forward("extend", 30.0, 0.01)  # an agent loop's next turn: its gap is not a decode gap
    for _ in range(10):
        e.forward("decode", 2.0, 0.05)
    e.profiling = True
    for _ in range(3):
        e.forward("decode", 2.5, 0.5)  # the profiled steps: slower host, left out
    e.profiling = False
    for _ in range(5):
        e.forward("decode", 2.0, 0.05)
    rg.arm(control, False)
    assert not Path(control).exists()  # disarmed: no control file left behind
    w = e.rec.window()
    assert w["replays"] == 28 and w["replay_us_p50"] == pytest.approx(2000.0)
    assert w["gaps"] == 9 + 9 + 4 and w["gap_us_p50"] == pytest.approx(53.0) and w["gap_us_p90"] == pytest.approx(53.0)
    assert not e.rec.armed and e.rec.window()["replays"] == 0  # disarmed: a new, empty window


def test_recorder_sees_a_slower_host(tmp_path):
    """A correctness check of the measure: the same steps with 30 µs more between replays read
    30 µs more; the same GPU work with a profiled (slowed) window does not change it."""
    control = str(tmp_path / "ctl")
    out = {}
    for name, gap in (("stock", 0.040), ("slower", 0.070)):
        e = Engine(control)
        rg.arm(control, True)
        e.rec.window()
        for _ in range(40):
            e.forward("decode", 2.0, gap)
        out[name] = e.rec.window()["gap_us_p50"]
    assert out["slower"] - out["stock"] == pytest.approx(30.0)


def test_internal_state_gets_the_window(tmp_path):
    e = Engine(str(tmp_path / "ctl"))
    state = {"memory_usage": {}}
    assert e.rec.after_internal_state(SimpleNamespace(internal_state=state), object()) is None
    assert state[rg.STATE_KEY]["replays"] == 0
    info = {"internal_states": [state]}
    assert rg.of_server_info(info) is state[rg.STATE_KEY] and rg.of_server_info({}) is None


def test_plugin_env_puts_the_metadata_on_the_path_and_the_entry_point_loads():
    env = rg.plugin_env({"PYTHONPATH": str(ROOT)}, "/tmp/x.ctl")
    assert env[rg.CONTROL_ENV] == "/tmp/x.ctl" and env["PYTHONPATH"].split(os.pathsep)[-1] == str(rg.PLUGIN_DIR)
    assert rg.plugin_env(env, "/tmp/y")["PYTHONPATH"] == env["PYTHONPATH"]  # not added twice
    code = ("from importlib.metadata import entry_points; "
            "import json; print(json.dumps({e.name: e.value for e in entry_points(group='sglang.srt.plugins')}))")
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=60, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1])["replay_gaps"] == "benchmark.harness.replay_gaps:register"


def test_register_hooks_real_sglang_targets(monkeypatch, tmp_path):
    """The targets exist in the SGLang installed here (a renamed method would fail this), and
    register() adds its hooks only when a control file is named."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target in rg._TARGETS.values():
        mod, cls, meth = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(mod), cls), meth)), target
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.delenv(rg.CONTROL_ENV, raising=False)
    rg.register()
    assert not any(t in HookRegistry._hooks for t in rg._TARGETS.values())
    monkeypatch.setenv(rg.CONTROL_ENV, str(tmp_path / "ctl"))
    rg.register()
    assert all(len(HookRegistry._hooks[t]) == 1 for t in rg._TARGETS.values())


def test_the_runner_records_forward_pass_ids():
    """The recorder reads ModelRunner.forward_pass_id; the real ModelRunner.forward increments it."""
    import inspect

    from sglang.srt.model_executor.model_runner import ModelRunner

    assert "self.forward_pass_id += 1" in inspect.getsource(ModelRunner.forward)
