"""benchmark/harness/gpu_idle.py: idle, busy and span of a profiler trace's GPU activity."""

import gzip
import json

import pytest

from benchmark.harness import gpu_idle


def ev(ts, dur, cat="kernel"):
    return dict(ph="X", cat=cat, ts=ts, dur=dur, name="k")


def test_overlapping_streams_count_once_and_gaps_are_idle():
    events = [ev(0, 10), ev(5, 10, "gpu_memcpy"),  # overlap: busy 0..15
              ev(20, 5), ev(40, 10),  # gaps 5 and 15
              dict(ph="X", cat="cpu_op", ts=100, dur=1000),  # host work: not GPU activity
              dict(ph="i", cat="kernel", ts=60)]  # an instant event, no duration
    r = gpu_idle.idle_of_events(events, steps=2)
    assert r["gpu_span_us_per_step"] == 25.0 and r["gpu_busy_us_per_step"] == 15.0
    assert r["gpu_idle_us_per_step"] == 10.0 and r["gpu_gap_us_max"] == 15.0 and r["gpu_activities"] == 4
    assert gpu_idle.idle_of_events([dict(ph="X", cat="cpu_op", ts=0, dur=5)], steps=1) is None
    with pytest.raises(ValueError, match="steps=0"):
        gpu_idle.idle_of_events(events, steps=0)


def test_a_gzipped_trace_on_disk(tmp_path):
    path = tmp_path / "idle-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=[ev(0, 4), ev(10, 4)]), f)
    assert gpu_idle.newest_trace(tmp_path) == path
    assert gpu_idle.idle_of_trace(path, steps=1)["gpu_idle_us_per_step"] == 6.0
    assert gpu_idle.newest_trace(tmp_path / "none") is None


def test_host_calls_per_step_rank_the_hosts_time_by_call():
    def call(name, dur, cat="cuda_runtime"):
        return dict(ph="X", cat=cat, ts=0, dur=dur, name=name)

    events = [call("cudaGraphLaunch", 30), call("cudaGraphLaunch", 50), call("cudaStreamSynchronize", 400),
              call("aten::copy_", 6, "cpu_op"), call("cuLaunchKernel", 4, "cuda_driver"),
              ev(0, 1000),  # GPU activity: not host time
              dict(ph="i", cat="cuda_runtime", ts=0, name="cudaEventRecord")]  # no duration
    r = gpu_idle.host_calls_of_events(events, steps=2)
    assert list(r["host_calls"]) == ["cudaStreamSynchronize", "cudaGraphLaunch", "aten::copy_", "cuLaunchKernel"]
    assert r["host_calls"]["cudaGraphLaunch"] == [1.0, 40.0] and r["host_calls"]["cudaStreamSynchronize"] == [0.5, 200.0]
    assert list(gpu_idle.host_calls_of_events(events, steps=2, top=1)["host_calls"]) == ["cudaStreamSynchronize"]
    with pytest.raises(ValueError, match="steps=0"):
        gpu_idle.host_calls_of_events(events, steps=0)


def test_host_probe_reports_the_interval_between_graph_launches():
    launches = [dict(ph="X", cat="cuda_runtime", ts=ts, dur=20, name="cudaGraphLaunch") for ts in (0, 5000, 9000, 15000)]
    r = gpu_idle.host_calls_of_events(launches + [dict(ph="X", cat="cpu_op", ts=1, dur=3, name="aten::add")], steps=3)
    assert r["graph_launch_interval_us"] == dict(p50=5000.0, mean=5000.0, n=3)
    assert gpu_idle.host_calls_of_events(launches[:1], steps=1)["graph_launch_interval_us"] is None


def test_python_self_times_subtract_nested_frames_per_thread():
    def py(name, ts, dur, tid=1):
        return dict(ph="X", cat="python_function", ts=ts, dur=dur, name=name, pid=7, tid=tid)

    events = [py("step", 0, 100), py("plan", 10, 40), py("fill", 20, 25), py("plan", 60, 20),
              py("other_thread", 0, 500, tid=2),  # not nested in "step": another thread
              dict(ph="X", cat="cuda_runtime", ts=15, dur=5, name="cudaMemcpyAsync")]  # not a frame
    r = gpu_idle.python_self_times(events, steps=2)["python_self"]
    assert r == {"other_thread": [0.5, 250.0], "step": [0.5, 20.0], "plan": [1.0, 17.5], "fill": [0.5, 12.5]}
    assert list(gpu_idle.python_self_times(events, steps=1, top=1)["python_self"]) == ["other_thread"]


def test_host_calls_of_a_kept_trace_add_python_self_times_only_where_recorded(tmp_path):
    frames = [dict(ph="X", cat="python_function", ts=0, dur=8, name="plan", pid=1, tid=1)]
    calls = [dict(ph="X", cat="cuda_runtime", ts=0, dur=4, name="cudaGraphLaunch")]
    raw = tmp_path / "a.trace.json"
    raw.write_text(json.dumps({"traceEvents": frames + calls}))
    kept = gpu_idle.keep_trace(raw, tmp_path / "kept" / "a.trace.json.gz")
    r = gpu_idle.host_calls_of_trace(kept, steps=1)
    assert r["python_self"] == {"plan": [1.0, 8.0]} and r["host_calls"] == {"cudaGraphLaunch": [1.0, 4.0]}
    raw.write_text(json.dumps({"traceEvents": calls}))
    assert "python_self" not in gpu_idle.host_calls_of_trace(raw, steps=1)
