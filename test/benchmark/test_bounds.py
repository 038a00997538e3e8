"""benchmark/multi_agent/bounds.py: the floor is the ceiling wall plus the long prefix's attention
at peak rates, computed by hand here for a small made-up model; rows it cannot bound are left out."""

import json

import pytest
from bench_scripts import ROOT, load  # noqa: E402  (test/benchmark, on the path)


def _mod():
    return load("multi_agent", "bounds.py")


MODEL = dict(layers=2, hq=4, hkv=2, d=8)


def test_floor_wall_by_hand():
    b = _mod()
    flops, bw = 1e12, 1e11
    # one group: 1,000-token prefix, 3 agents, suffix 10, 5 output tokens
    prefill = 4 * 3 * 10 * 1000 * 4 * 8 * 2 / flops
    step_flops = 4 * 3 * 1000 * 4 * 8 / flops  # 3.84e-7 s
    step_bytes = 1000 * 2 * 8 * 2 * 2 / bw  # 6.4e-7 s: memory-bound here
    ceiling_read = 3 * 256 * 2 * 8 * 2 * 2 / bw
    want = 1.0 + prefill + 4 * 2 * (max(step_flops, step_bytes) - ceiling_read)
    got = b.floor_wall([(1000, 3)], 10, 5, 1.0, MODEL, flops, bw)
    assert got == pytest.approx(want, rel=1e-12)
    # two prefixes are each read once per step: the byte term adds up, the FLOP term too
    two = b.floor_wall([(1000, 3), (1000, 3)], 10, 5, 1.0, MODEL, flops, bw)
    assert two > got


def test_bound_rows_on_a_checked_in_run():
    b = _mod()
    doc = json.loads((ROOT / "docs" / "results" / "multi_agent.json").read_text())
    rows = b.bound_rows(doc, 650e12, 4.8e12)
    kinds = {(r["workload"], r["agents"]) for r in rows}
    assert ("homogeneous", 64) in kinds and ("heterogeneous", 128) in kinds
    assert all(r["agents"] >= 2 for r in rows)  # one agent shares nothing: not bounded
    assert not any(r["workload"] in ("agent_loop", "no_sharing", "ceiling") for r in rows)
    for r in rows:  # a floor faster than the baseline, slower than the no-long-prefix ceiling
        assert r["baseline"] < r["floor_tok_s"] and r["floor_ceiling_pct"] < 100
    md = b.to_markdown(rows)
    assert md.count("\n") == len(rows) + 1 and "| homogeneous × 64 | flashinfer |" in md
