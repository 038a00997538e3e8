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


def test_forest_agent_loop_and_gqa_by_hand():
    b = _mod()
    flops, bw = 1e12, 1e11
    kv = 2 * 8 * 2 * 2  # hkv * d * (K, V) * bf16 bytes
    # a forest: two prefixes, their own agents and suffix tokens; an agent loop of 3 turns
    shape = b.Shape((b.Group(1000, 3, 40), b.Group(500, 2, 10)), out=5, turns=3, tool=7)
    prefill = 4 * (1000 * (40 + 3 * 2 * 7) + 500 * (10 + 2 * 2 * 7)) * 4 * 8 * 2 / flops
    step = max(4 * (3 * 1000 + 2 * 500) * 4 * 8 / flops, (1000 + 500) * kv / bw)
    ceiling_read = (3 * 256 + 2 * 256) * kv / bw
    want = 2.0 + prefill + 3 * 4 * 2 * (step - ceiling_read)
    assert b.floor_wall_of(shape, 2.0, MODEL, flops, bw) == pytest.approx(want, rel=1e-12)
    # a prefix shorter than the ceiling's is read at its own length by the ceiling
    short = b.Shape((b.Group(100, 4, 4),), out=2)
    read = 4 * 100 * kv / bw
    assert b.floor_wall_of(short, 1.0, MODEL, flops, bw) == pytest.approx(
        1.0 + 4 * 100 * 4 * 4 * 8 * 2 / flops + 2 * (max(4 * 400 * 32 / flops, 100 * kv / bw) - read), rel=1e-12)
    # GQA shapes from the configs: Qwen2.5-7B is 28q / 4kv, Llama-3.2-3B 24q / 8kv
    assert b.model_shape("qwen2.5-7b") == dict(layers=28, hq=28, hkv=4, d=128, kv_bytes=2)
    assert b.model_shape("llama-3.2-3b") == dict(layers=28, hq=24, hkv=8, d=128, kv_bytes=2)
    assert b.model_shape("qwen2.5-14b", tp=2)["hq"] == 20


def test_floor_of_rules():
    b = _mod()
    one = b.Shape((b.Group(16384, 64, 64 * 256),), out=128)
    kw = dict(model=b.model_shape("llama-3.1-8b"), flops=650e12, bw=4.8e12)
    f = b.floor_of(one, baseline=2600.0, granikv=5900.0, ceiling=7700.0, **kw)
    assert 1.5 < f.floor_speedup < 7700 / 2600 and f.floor_reason is None
    assert f.floor_fraction == pytest.approx(5900 / f.floor_tok_s, abs=1e-4)
    # nothing shared (no prefix, or one agent per prefix): the stock engine is the floor
    for shape in (b.Shape((), out=64), b.Shape((b.Group(2048, 1, 256),) * 4, out=64)):
        f = b.floor_of(shape, baseline=1000.0, granikv=990.0, ceiling=None, **kw)
        assert (f.floor_speedup, f.floor_fraction, f.floor_tok_s) == (1.0, 0.99, 1000.0)
    # a stock engine faster than the formula: the floor is never below stock
    f = b.floor_of(one, baseline=7650.0, granikv=7650.0, ceiling=7700.0, **kw)
    assert f.floor_speedup == 1.0
    # a ceiling slower than the stock row (its one run slowed: the 4-layer hom4k_x64 at 2a34169,
    # 22,555 against 25,102 tok/s) gives no floor, not a floor of 1.0x that would count the row
    # among those where sharing cannot pay
    f = b.floor_of(one, baseline=25102.0, granikv=27747.0, ceiling=22555.0, **kw)
    assert f.floor_speedup is None and f.floor_fraction is None and "ceiling below" in f.floor_reason
    assert "ceiling" in b.floor_of(one, baseline=1.0, granikv=1.0, ceiling=None, **kw).floor_reason
    assert b.floor_of(None, baseline=1.0, granikv=1.0, ceiling=1.0, **kw).floor_reason.startswith("workload shape")
    assert b.floor_of(one, baseline=None, granikv=1.0, ceiling=1.0, **kw).floor_speedup is None


def test_checked_in_multi_agent_rows_carry_their_floor():
    """Every row of docs/results/multi_agent.json has floor_speedup / floor_fraction, equal to
    what bounds.annotate computes from the row's own data (null only with a reason)."""
    b = _mod()
    doc = json.loads((ROOT / "docs" / "results" / "multi_agent.json").read_text())
    fresh = b.annotate(doc)
    for stored, new in zip(doc["rows"], fresh):
        assert "floor_speedup" in stored and "floor_fraction" in stored
        assert (stored["floor_speedup"], stored["floor_fraction"]) == (new["floor_speedup"], new["floor_fraction"])
        assert (stored["floor_speedup"] is None) == bool(stored.get("floor_reason"))
    by = {(r["workload"], r["agents"]): r for r in fresh}
    assert by[("homogeneous", 64)]["floor_speedup"] > 2 and by[("no_sharing", 64)]["floor_speedup"] == 1.0
    assert by[("agent_loop", 64)]["floor_speedup"] is None  # its ceiling (an agent loop) was not run
    # a ceiling of another shape does not bound a row: plant one
    planted = json.loads(json.dumps(doc))
    for r in planted["rows"]:
        if r["workload"] == "ceiling" and r["agents"] == 64:
            r["params"]["out"] = 64
    row = {(r["workload"], r["agents"]): r for r in b.annotate(planted)}[("homogeneous", 64)]
    assert row["floor_speedup"] is None and "ceiling" in row["floor_reason"]


def test_an_fp8_grid_model_halves_the_kv_bytes_of_its_floor():
    """``<config>+fp8_e4m3``: the same config, one byte per KV element; the byte term of the floor
    halves by hand, and the shape says so (``kv_bytes``)."""
    b = _mod()
    bf16, fp8 = b.model_shape("llama-3.1-8b"), b.model_shape("llama-3.1-8b+fp8_e4m3")
    assert bf16 == dict(fp8, kv_bytes=2) and fp8["kv_bytes"] == 1
    flops, bw = 1e30, 1e11  # no compute term: the floor is the ceiling wall plus KV bytes
    m2, m1 = dict(MODEL, kv_bytes=2), dict(MODEL, kv_bytes=1)
    d2 = b.floor_wall([(1000, 3)], 10, 5, 1.0, m2, flops, bw) - 1.0
    d1 = b.floor_wall([(1000, 3)], 10, 5, 1.0, m1, flops, bw) - 1.0
    assert d2 == pytest.approx(4 * 2 * (1000 - 3 * 256) * 2 * 8 * 2 * 2 / bw, rel=1e-9)  # by hand, bf16
    assert d1 == pytest.approx(d2 / 2, rel=1e-9)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        b.model_shape("llama-3.1-8b+int4")


def test_a_hybrid_models_floor_counts_its_full_attention_layers_only():
    """gpt-oss-20b's windowed layers read 128 tokens whatever the prefix: the floor's layers are
    its 12 full-attention layers, and a config without ``layer_types`` counts every layer."""
    b = _mod()
    assert b.model_shape("gpt-oss-20b") == dict(layers=12, hq=64, hkv=8, d=64, kv_bytes=2)
    assert b.model_shape("llama-3.1-8b")["layers"] == 32
    from benchmark.harness.model_config import full_attention_layers
    assert full_attention_layers({"num_hidden_layers": 3, "layer_types": ["sliding_attention"] * 3}) == 0
    assert full_attention_layers({"num_hidden_layers": 3}) == 3
