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
