"""CPU tests of the multi-agent benchmark: workloads (sizes, sharing, determinism), the report
(ratio columns), the child's measuring loop against a fake engine, and the parent end to end
with a fake ``sglang`` package (no GPU, no SGLang import)."""

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmark.harness import engine_args, engine_child, latency, model_config
from benchmark.multi_agent import report, run
from benchmark.multi_agent import workloads as wl

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "benchmark.multi_agent.run"]  # from ROOT


# ---- workloads -----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_len,agents,suffix,out", [(16384, 64, 256, 256), (37, 17, 5, 3)])
def test_homogeneous_shares_one_prefix(prefix_len, agents, suffix, out):
    w = wl.homogeneous(prefix_len, agents, suffix, out)
    assert w.agents == agents and w.prefix_len == prefix_len and w.turns == 1
    assert len(w.prefixes) == 1 and len(w.prefixes[0]) == prefix_len
    assert all(len(p) == prefix_len + suffix for p in w.prompts)
    assert all(p[:prefix_len] == w.prefixes[0] for p in w.prompts)
    assert len({p[prefix_len:] for p in w.prompts}) == agents  # private suffixes differ
    assert w.sampling.to_dict() == {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}
    assert w.out_tokens == agents * out
    assert w.kv_tokens_logical() == prefix_len + agents * (suffix + out)
    assert all(wl.TOKEN_LO <= t < wl.TOKEN_HI for p in w.prompts for t in p)


def test_workloads_are_deterministic_and_seeded():
    for build in (lambda s: wl.homogeneous(64, 5, 7, 3, seed=s),
                  lambda s: wl.heterogeneous(40, seed=s),
                  lambda s: wl.agent_loop(64, 5, turns=3, seed=s),
                  lambda s: wl.no_sharing(5, 33, seed=s)):
        a, b, c = build(0), build(0), build(1)
        assert a == b
        assert a.prompts != c.prompts


def test_ceiling_is_a_256_token_prefix():
    w = wl.short_prefix_ceiling(64)
    assert w.name == "ceiling" and w.prefix_len == 256 and w.agents == 64
    assert all(len(p) == 512 for p in w.prompts)
    # a different stream than the homogeneous workload of the same size
    assert w.prompts != wl.homogeneous(256, 64).prompts


@pytest.mark.parametrize("agents", [24, 37, 64, 128])
def test_heterogeneous_forest(agents):
    w = wl.heterogeneous(agents)
    counts = w.params["agents_per_prefix"]
    assert sum(counts) == agents and min(counts) >= 2
    assert len(set(counts)) > 1  # unequal
    assert counts == sorted(counts, reverse=True)  # short prompts get more agents
    assert [len(p) for p in w.prefixes] == list(wl.HETEROGENEOUS_PREFIXES)
    assert len({p for p in w.prefixes}) == 8
    for prompt, g in zip(w.prompts, w.group):
        assert prompt[: len(w.prefixes[g])] == w.prefixes[g]
        assert len(prompt) == len(w.prefixes[g]) + 256
    assert w.group != tuple(sorted(w.group))  # interleaved in one batch
    assert w.prefix_len == 16384


def test_split_agents():
    assert wl.split_agents(16, [1] * 8) == [2] * 8
    assert sum(wl.split_agents(101, wl.HETEROGENEOUS_WEIGHTS)) == 101
    with pytest.raises(ValueError, match="below 8 groups"):
        wl.split_agents(15, [1] * 8)


def test_agent_loop_contexts_grow_by_output_and_tool():
    w = wl.agent_loop(100, 3, turns=4, suffix=10, out=6, tool=5)
    assert w.turns == 4 and w.out_tokens == 3 * 4 * 6
    assert all(len(t) == 3 and all(len(x) == 5 for x in t) for t in w.tool_results)
    ctx = list(w.prompts[1])
    out = [7] * 6
    nxt = w.next_prompt(1, ctx, out, 0)
    assert nxt == ctx + out + list(w.tool_results[1][0])
    assert nxt[:100] == list(w.prefixes[0])
    assert w.kv_tokens_logical() == 100 + 3 * (10 + 4 * 6 + 3 * 5)


def test_no_sharing_has_no_common_prefix():
    w = wl.no_sharing(16, 64)
    assert w.prefixes == () and w.prefix_len == 0 and set(w.group) == {-1}
    assert len({p[:4] for p in w.prompts}) == 16
    assert w.kv_tokens_logical() == 16 * (64 + 256)


def test_invalid_sizes_raise():
    with pytest.raises(ValueError, match="agents=0"):
        wl.homogeneous(16, 0)
    with pytest.raises(ValueError, match="unknown workload"):
        wl.plan(["nope"], [4], 16)


def test_plan_orders_ceiling_first_and_roundtrips():
    specs = wl.plan(["homogeneous", "heterogeneous", "ceiling"], [16, 64], 4096)
    assert [s.name for s in specs] == ["ceiling", "ceiling", "homogeneous", "homogeneous",
                                       "heterogeneous"]  # heterogeneous needs >= 24 agents
    for s in specs:
        assert wl.WorkloadSpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert specs[2].build().prefix_len == 4096


# ---- run's argument handling, the engine arguments, the shipped configs -------------------------


def test_quick_and_engine_args():
    a = run.parse_args(["--quick", "--engine-arg", "granikv_hot_min_tokens=2048",
                        "--engine-arg", "disable_cuda_graph=true", "--engine-arg",
                        "mem_fraction_static=0.8", "--engine-arg", "schedule_policy=lpm"])
    assert a.backends == ["flashinfer"] and a.agents == [64]
    assert set(a.workloads) == {"homogeneous", "ceiling", "no_sharing"}
    cfgs = run.engine_configs(a)
    assert [c.name for c in cfgs] == ["flashinfer/baseline", "flashinfer/granikv"]
    base, gkv = cfgs[0].engine_kwargs, cfgs[1].engine_kwargs
    assert base["disable_cuda_graph"] is True and base["mem_fraction_static"] == 0.8
    assert base["schedule_policy"] == "lpm" and base["attention_backend"] == "flashinfer"
    assert "enable_granikv" not in base and "granikv_hot_min_tokens" not in base
    assert gkv["enable_granikv"] is True and gkv["granikv_hot_min_tokens"] == 2048
    with pytest.raises(ValueError, match="key=value"):
        engine_args.parse_engine_args(["oops"])


def test_model_configs_shipped():
    for name, arch, layers in [("llama-3.1-8b", "LlamaForCausalLM", 32),
                               ("qwen2.5-14b", "Qwen2ForCausalLM", 48),
                               ("qwen2.5-32b", "Qwen2ForCausalLM", 64)]:
        cfg = json.loads(model_config.model_config_path(name).read_text())
        assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == layers
        assert cfg["num_key_value_heads"] == 8
        assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 128
        assert cfg["max_position_embeddings"] >= 32768 + 512


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    assert latency.percentile([], 50) is None
    assert latency.percentile([3.0], 99) == 3.0
    for xs in (list(range(1, 101)), [5.0, 1.0, 3.0], [0.1 * i * i for i in range(37)]):
        for q in (0, 50, 99, 100):
            assert latency.percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_dry_run_prints_plan(capsys):
    assert run.main(["--dry-run", "--backends", "triton", "--agents", "32",
                     "--workloads", "homogeneous,agent_loop"]) == 0
    text = capsys.readouterr().out
    assert "triton/baseline" in text and "triton/granikv" in text
    assert "agent_loop(prefix=16384, agents=32)" in text and "turns=4" in text


# ---- report ------------------------------------------------------------------------------------


def _row(config, workload, prefix, agents, tps, backend="flashinfer", **kw):
    return dict(kind="row", backend=backend, config=config, workload=workload, prefix_len=prefix,
                agents=agents, turns=1, out_tok_per_s=tps, ttft_p50_ms=10.0, ttft_p99_ms=20.0,
                tpot_p50_ms=5.0, tpot_p99_ms=6.0, kv_used_tokens_peak=1000, kv_tokens_logical=900,
                **kw)


def _records():
    return [
        dict(kind="info", backend="flashinfer", config="baseline", gpu="H200",
             max_total_num_tokens=700000, version="0.5.17"),
        _row("baseline", "ceiling", 256, 64, 8000.0),
        _row("baseline", "homogeneous", 16384, 64, 2500.0),
        _row("granikv", "ceiling", 256, 64, 7900.0),
        _row("granikv", "homogeneous", 16384, 64, 6500.0, granikv={"steps_cascade": 10}),
        _row("baseline", "no_sharing", 0, 64, 3000.0),
        _row("granikv", "no_sharing", 0, 64, 2940.0),
        _row("baseline", "homogeneous", 16384, 128, 2870.0),  # granikv side missing
        dict(kind="error", backend="flashinfer", config="granikv", error="boom"),
    ]


def test_combine_ratios():
    rows = {(r["workload"], r["agents"]): r for r in report.combine(_records())}
    h = rows[("homogeneous", 64)]
    assert h["speedup"] == pytest.approx(2.6) and h["target_speedup"] == 2.5
    assert h["ceiling_out_tok_s"] == 8000.0
    assert h["ceiling_ratio"] == pytest.approx(6500 / 8000, abs=1e-3)
    assert h["baseline_ceiling_ratio"] == pytest.approx(2500 / 8000, abs=1e-3)
    assert h["granikv_counters"] == {"steps_cascade": 10}
    assert h["baseline_kv_capacity_tokens"] == 700000 and h["gpu"] == "H200"
    assert h["granikv_ttft_p50_ms"] == 10.0 and h["baseline_tpot_p99_ms"] == 6.0
    n = rows[("no_sharing", 64)]
    assert n["speedup"] == pytest.approx(0.98) and n["target_speedup"] == 0.97
    assert n["ceiling_ratio"] is None
    miss = rows[("homogeneous", 128)]
    assert miss["granikv_out_tok_s"] is None and miss["speedup"] is None
    assert miss["ceiling_out_tok_s"] is None and miss["target_speedup"] == 3.1
    assert [r["workload"] for r in report.combine(_records())] == [
        "homogeneous", "homogeneous", "no_sharing", "ceiling"]


def test_write_json_and_markdown(tmp_path):
    meta = dict(command="python3 -m benchmark.multi_agent.run --quick", date="2026-11-29",
                model="llama-3.1-8b", tp=1, dp=1)
    paths = report.write(str(tmp_path), _records(), meta)
    doc = json.loads((tmp_path / "multi_agent.json").read_text())
    assert doc["meta"]["command"] == meta["command"] and len(doc["measurements"]) == 9
    h = next(r for r in doc["rows"] if r["workload"] == "homogeneous" and r["agents"] == 64)
    assert h["speedup"] == pytest.approx(2.6) and h["command"] == meta["command"]
    md = (tmp_path / "multi_agent.md").read_text()
    assert "| homogeneous | 16,384 | 64 | flashinfer | 2,500 | 6,500 | 2.60x ✓ | ≥2.50x | 81% / 31% |" in md
    assert "| no_sharing | 0 | 64 | flashinfer | 3,000 | 2,940 | 0.98x ✓ | ≥0.97x |" in md
    assert "python3 -m benchmark.multi_agent.run --quick" in md and "H200" in md
    assert "flashinfer/granikv: boom" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(paths) == 2
    else:
        assert (tmp_path / "multi_agent.png").stat().st_size > 0


def test_markdown_has_the_floor_of_rows_it_can_bound(tmp_path):
    meta = dict(command="cmd", date="d", model="llama-3.1-8b", tp=1, dp=1)
    assert "Floor (`bounds.py`" not in report.markdown(report.combine(_records()), _records(), meta, None)
    params = lambda prefix: dict(prefix_len=prefix, agents=64, suffix=256, out=256, seed=0)  # noqa: E731
    recs = [_row(c, w, p, 64, t, params=params(p)) for c, w, p, t in (
        ("baseline", "ceiling", 256, 8000.0), ("granikv", "ceiling", 256, 7900.0),
        ("baseline", "homogeneous", 16384, 2500.0), ("granikv", "homogeneous", 16384, 6500.0))]
    md = report.markdown(report.combine(recs), recs, meta, None)
    assert "Floor (`bounds.py`" in md and "| homogeneous × 64 | flashinfer | 2,500 | 6,500 (2.60x) |" in md


def test_report_cli_merges_runs(tmp_path):
    meta = dict(command="cmd-a", date="d", model="llama-3.1-8b", tp=1, dp=1)
    report.write(str(tmp_path / "a"), _records(), meta)
    later = [_row("granikv", "homogeneous", 16384, 128, 9000.0),
             _row("baseline", "homogeneous", 16384, 64, 2000.0, backend="triton"),
             _row("granikv", "homogeneous", 16384, 64, 6400.0, backend="triton")]
    report.write(str(tmp_path / "b"), later, dict(meta, command="cmd-b"))
    assert report.main([str(tmp_path / "a" / "multi_agent.json"),
                        str(tmp_path / "b" / "multi_agent.json"), "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "multi_agent.json").read_text())
    rows = {(r["backend"], r["workload"], r["agents"]): r for r in doc["rows"]}
    assert rows[("flashinfer", "homogeneous", 128)]["speedup"] == pytest.approx(9000 / 2870, abs=1e-3)
    assert rows[("triton", "homogeneous", 64)]["speedup"] == pytest.approx(3.2)
    assert rows[("triton", "homogeneous", 64)]["target_speedup"] == 3.0
    assert doc["meta"]["commands"] == ["cmd-a", "cmd-b"]


# ---- the child's measuring loop, against a fake engine ------------------------------------------


class FakeTokenizerManager:
    def __init__(self):
        self.flushes = 0

    async def flush_cache(self):
        self.flushes += 1

    async def get_loads(self):
        return [type("Load", (), {"num_used_tokens": 1234})()]


class FakeEngine:
    """Echoes ``max_new_tokens`` ids per request, in chunks, like a streamed SGLang request."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager()
        self.server_args = type("SA", (), {"incremental_streaming_output": False})()
        self.prompts = []

    def generate(self, input_ids, sampling_params, routed_dp_rank=None):
        self.warm_calls = getattr(self, "warm_calls", []) + [(routed_dp_rank, [tuple(p[:-1]) for p in input_ids])]
        n = sampling_params["max_new_tokens"]
        return [{"output_ids": [1] * n, "meta_info": {"cached_tokens": 0}} for _ in input_ids]

    async def async_generate(self, input_ids, sampling_params, stream, routed_dp_rank=None):
        assert stream and sampling_params["stream_interval"] == engine_child.STREAM_INTERVAL
        self.prompts.append(list(input_ids))
        self.routes = getattr(self, "routes", []) + [routed_dp_rank]
        n = sampling_params["max_new_tokens"]

        async def chunks():
            for k in range(1, n + 1, 2):
                await asyncio.sleep(0)
                yield {"output_ids": [2] * min(n, k + 1), "meta_info": {"cached_tokens": 7}}
        return chunks()

    def get_server_info(self):
        self.info_calls = getattr(self, "info_calls", 0) + 1
        return {"internal_states": [{"granikv": {"hot_hits": 3 * self.info_calls, "mode": "x",
                                                 "attention": {"cascade": 2 * self.info_calls}}}],
                "max_total_num_tokens": 99}


def _fake_child(latency="stream", dp=1, **job):
    child = engine_child.EngineChild.__new__(engine_child.EngineChild)
    child.job = {"latency": latency, "engine_kwargs": {"dp_size": dp}, **job}
    child.engine = FakeEngine()
    child.loop = child.engine.loop
    child.incremental = False
    child.engine_up_s = 0.0
    return child


def test_child_measures_agent_loop():
    child = _fake_child()
    spec = wl.WorkloadSpec("agent_loop", 3, 32, {"turns": 3, "out": 4, "suffix": 8, "tool": 5})
    row = child.run(spec)
    assert row["out_tokens"] == 3 * 3 * 4 and row["agents"] == 3 and row["turns"] == 3
    assert row["ttft_p50_ms"] is not None and row["tpot_p99_ms"] is not None
    assert row["kv_used_tokens_peak"] == 1234
    assert row["granikv"] == {"hot_hits": 6, "mode": "x", "attention": {"cascade": 4}}
    assert row["granikv_delta"] == {"hot_hits": 3, "attention": {"cascade": 2}}
    assert row["cached_tokens"] == 7 * 9 and row["out_tok_per_s"] > 0
    w = spec.build()
    last = [p for p in child.engine.prompts if p[32:40] == list(w.prompts[0][32:40])][-1]
    assert len(last) == 40 + 2 * (4 + 5)  # two appended (output, tool) pairs before turn 3
    assert child.engine.tokenizer_manager.flushes == 1


def test_child_batch_mode_matches_baseline_bench():
    child = _fake_child(latency="none")
    row = child.run(wl.WorkloadSpec("homogeneous", 4, 16, {"out": 3, "suffix": 2}))
    assert row["out_tokens"] == 12 and row["ttft_p50_ms"] is None


class PacedEngine(FakeEngine):
    """A FakeEngine whose streams take real time per chunk and whose profiler records how far
    every request had got when it started, then writes a trace of one kernel per step."""

    def __init__(self):
        super().__init__()
        self.emitted = {}
        self.tokenizer_manager.start_profile = self._start_profile

    async def async_generate(self, input_ids, sampling_params, stream, routed_dp_rank=None):
        agent = tuple(input_ids[16:24])  # the agent's private suffix (the workloads below: prefix 16)
        turn = sum(1 for a, _ in self.emitted if a == agent)
        key, n = (agent, turn), sampling_params["max_new_tokens"]
        self.emitted[key] = 0

        async def chunks():
            for k in range(1, n + 1, engine_child.STREAM_INTERVAL):
                await asyncio.sleep(0.002)
                self.emitted[key] = k
                yield {"output_ids": [2] * k, "meta_info": {"cached_tokens": 0}}
            await asyncio.sleep(0.02)  # the decode between the last streamed count and the end
            self.emitted[key] = n
            yield {"output_ids": [2] * n, "meta_info": {"cached_tokens": 0}}
        return chunks()

    async def _start_profile(self, req):
        latest = {}
        for (agent, turn), n in self.emitted.items():
            latest[agent] = max(latest.get(agent, (0, 0)), (turn, n))
        self.at_start = sorted(latest.values())  # (turn, tokens into it) of every agent
        events = [{"ph": "X", "cat": "kernel", "ts": 100.0 * i, "dur": 60.0} for i in range(req.num_steps)]
        Path(req.output_dir, "p.trace.json").write_text(json.dumps({"traceEvents": events}))


def test_idle_probe_window_sits_at_the_middle_of_the_decode(tmp_path, monkeypatch):
    """The probe starts once every agent is half-way through its output less half the window,
    so its busy time is the run's mean step (a window at the first token fails this)."""
    monkeypatch.setattr(engine_child.time, "sleep", lambda s: None)
    child = _fake_child()
    child.engine = PacedEngine()
    child.loop = child.engine.loop
    spec = wl.WorkloadSpec("homogeneous", 4, 16, {"out": 1024, "suffix": 2})
    res = child.idle_probe(spec, 32, str(tmp_path / "t"))
    start = engine_child.probe_start_tokens(1024, 32)
    assert start == 513 and res["probe_start_tokens"] == start  # the streamed count at or after 496
    assert len(child.engine.at_start) == 4 and (0, start) <= min(child.engine.at_start)
    assert max(child.engine.at_start) < (0, 1024) and res["probe_turn"] == 0
    assert res["gpu_busy_us_per_step"] == pytest.approx(60.0 * 32 / 32)
    # 64 output tokens streamed every 64: the probe starts at the first token, not after the end
    child.engine = PacedEngine()
    child.loop = child.engine.loop
    res = child.idle_probe(wl.WorkloadSpec("homogeneous", 4, 16, {"out": 64, "suffix": 2}), 32, str(tmp_path / "u"))
    assert res["probe_start_tokens"] == 1 and max(child.engine.at_start) < (0, 64)
    assert engine_child.probe_start_tokens(16, 32) == 1  # a short decode: from the first token
    assert engine_child.probe_start_tokens(64, 32) == 1  # 65 would leave no room: the first token
    assert engine_child.probe_start_tokens(128, 32) == 65 and engine_child.probe_start_tokens(2048, 32) == 1025
    for n in range(1, 600):  # the window always fits the decode, from a count the client sees
        s = engine_child.probe_start_tokens(n, min(32, max(1, n // 2)))
        assert (s - 1) % engine_child.STREAM_INTERVAL == 0 and (s == 1 or s + min(32, n // 2) <= n)


def test_idle_probe_of_an_agent_loop_sits_in_its_middle_turn(tmp_path, monkeypatch):
    """An agent loop is probed too: once every agent is into turn ``turns // 2`` (or past it) by
    the probe's start, so the window holds that turn's decode steps, not the first turn's."""
    monkeypatch.setattr(engine_child.time, "sleep", lambda s: None)
    child = _fake_child()
    child.engine = PacedEngine()
    child.loop = child.engine.loop
    spec = wl.WorkloadSpec("agent_loop", 3, 16, {"turns": 4, "out": 512, "suffix": 8, "tool": 5})
    res = child.idle_probe(spec, 32, str(tmp_path / "t"))
    start = engine_child.probe_start_tokens(512, 32)
    assert res["probe_turn"] == 2 and res["probe_start_tokens"] == start == 257
    assert len(child.engine.at_start) == 3 and (2, start) <= min(child.engine.at_start)
    assert max(child.engine.at_start) < (3, 512)
    assert len(child.engine.emitted) == 3 * 4  # every turn ran to the end


# ---- parent end to end, children importing a fake sglang -----------------------------------------


FAKE_SGLANG = textwrap.dedent('''
    import asyncio
    class Engine:
        def __init__(self, **kw):
            if kw.get("enable_granikv") and kw.get("granikv_fail"):
                raise TypeError("unexpected keyword enable_granikv")
            self.kw = kw
            self.loop = asyncio.new_event_loop()
            self.server_args = type("SA", (), {"incremental_streaming_output": False})()
            tm = type("TM", (), {})()
            async def flush_cache(): return None
            async def get_loads(): return []
            tm.flush_cache, tm.get_loads = flush_cache, get_loads
            self.tokenizer_manager = tm
            self.fast = 3.0 if kw.get("enable_granikv") else 1.0
        def generate(self, input_ids, sampling_params, return_logprob=False):
            n = sampling_params["max_new_tokens"]
            lp = {"output_token_logprobs": [(-1.0, 1, None)] * n} if return_logprob else {}
            return [{"output_ids": [1] * n, "meta_info": lp} for _ in input_ids]
        async def async_generate(self, input_ids, sampling_params, stream):
            n = sampling_params["max_new_tokens"]
            delay = 0.00002 * len(input_ids) / self.fast
            async def chunks():
                await asyncio.sleep(delay)
                yield {"output_ids": [1], "meta_info": {}}
                await asyncio.sleep(delay)
                yield {"output_ids": [1] * n, "meta_info": {"cached_tokens": 0}}
            return chunks()
        def get_server_info(self):
            return {"version": "fake", "max_total_num_tokens": 1000,
                    "internal_states": [{"memory_usage": {"kv_cache_gb": 1.0}}]}
        def shutdown(self): pass
''')


def test_parent_end_to_end_with_fake_engine(tmp_path):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_SGLANG)
    out = tmp_path / "out"
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path / "fake"))
    cmd = RUN + ["--backends", "triton", "--agents", "4",
                 "--prefix", "512", "--workloads", "homogeneous,ceiling,no_sharing,agent_loop",
                 "--no-sharing-len", "64", "--turns", "2", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "multi_agent.json").read_text())
    rows = {r["workload"]: r for r in doc["rows"]}
    assert set(rows) == {"homogeneous", "ceiling", "no_sharing", "agent_loop"}
    h = rows["homogeneous"]
    assert h["baseline_out_tok_s"] > 0 and h["granikv_out_tok_s"] > 0
    assert h["speedup"] > 1.5  # the fake granikv engine is 3x faster per token of context
    assert h["ceiling_ratio"] is not None and h["baseline_kv_capacity_tokens"] == 1000
    assert rows["agent_loop"]["turns"] == 2
    assert "-m benchmark.multi_agent.run --backends triton" in doc["meta"]["command"]
    assert (out / "multi_agent.md").exists()

    # a granikv engine that cannot start: the baseline rows survive, the error is reported
    res = subprocess.run(cmd[:-2] + ["--out", str(tmp_path / "out2"), "--workloads", "ceiling",
                                     "--engine-arg", "granikv_fail=1"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 1
    doc = json.loads((tmp_path / "out2" / "multi_agent.json").read_text())
    assert doc["rows"][0]["baseline_out_tok_s"] > 0 and doc["rows"][0]["granikv_out_tok_s"] is None
    assert "engine start: TypeError" in (tmp_path / "out2" / "multi_agent.md").read_text()


def test_parent_budget_and_timeout_with_fake_engine(tmp_path):
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    hang = "        self.kw = kw\n        if kw.get('granikv_hang'):\n            __import__('time').sleep(600)\n"
    assert "        self.kw = kw\n" in FAKE_SGLANG
    (fake / "__init__.py").write_text(FAKE_SGLANG.replace("        self.kw = kw\n", hang))
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path / "fake"))
    base = RUN + ["--backends", "triton", "--agents", "4",
                  "--workloads", "ceiling,no_sharing", "--no-sharing-len", "64"]
    # a hung engine is killed after --child-timeout; the baseline's rows are kept
    res = subprocess.run(base + ["--out", str(tmp_path / "a"), "--child-timeout", "6",
                                 "--engine-arg", "granikv_hang=1"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 1
    doc = json.loads((tmp_path / "a" / "multi_agent.json").read_text())
    assert all(r["baseline_out_tok_s"] for r in doc["rows"])
    assert "killed after --child-timeout 6 s" in (tmp_path / "a" / "multi_agent.md").read_text()
    # a spent budget skips rows, and says so
    res = subprocess.run(base + ["--out", str(tmp_path / "b"), "--budget-s", "0.001"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 1
    assert "--budget-s spent" in (tmp_path / "b" / "multi_agent.md").read_text()


def test_agreement_summary_counts_tokens_until_divergence():
    from benchmark.multi_agent import agreement

    base = {"agreement_runs": [
        {"ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "logprobs": [[-1.0] * 4, [-2.0] * 4]},
        {"ids": [[1, 2, 3, 4], [5, 6, 9, 9]], "logprobs": [[-1.0] * 4, [-2.0] * 4]},
    ]}
    gran = {"agreement_runs": [
        {"ids": [[1, 2, 3, 4], [5, 6, 7, 0]], "logprobs": [[-1.1] * 4, [-2.0] * 4]},
    ] * 2}
    s = agreement.summarize(base, gran)
    assert s["baseline_self_agreement"] == 0.75  # (4 + 2) of 8
    assert s["granikv_vs_baseline_agreement"] == 0.875  # (4 + 3) of 8
    assert s["tokens_ok"] and abs(s["max_logprob_diff_same_token"] - 0.1) < 1e-9


# ---- data parallelism: prefix-affine routing ------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("build", [
    lambda: wl.homogeneous(64, 64, 4, 2),
    lambda: wl.heterogeneous(64, prefixes=(64, 48, 32, 16, 40, 24, 56, 8), suffix=4, out=2),
    lambda: wl.no_sharing(10, 16, 2),
])
def test_dp_routes_balance_ranks_and_keep_prefixes_together(build, dp):
    w = build()
    routes = wl.dp_routes(w, dp)
    counts = [routes.count(r) for r in range(dp)]
    assert len(routes) == w.agents and max(routes) < dp
    assert max(counts) - min(counts) <= 1 and max(counts) == -(-w.agents // dp)  # balanced
    split = [g for g in range(len(w.prefixes)) if len({r for r, gi in zip(routes, w.group) if gi == g}) > 1]
    assert len(split) <= dp - 1, f"prefixes {split} spread over ranks"
    assert wl.dp_routes(w, dp) == routes  # deterministic


def test_dp_routes_rejects_bad_dp():
    with pytest.raises(ValueError, match="dp=0"):
        wl.dp_routes(wl.homogeneous(16, 4, 2, 2), 0)


def test_child_routes_agents_and_warms_each_rank_with_its_prefixes():
    child = _fake_child(dp=2, dp_routing="prefix")
    spec = wl.WorkloadSpec("heterogeneous", 16, 64, {"out": 3, "suffix": 2})
    row = child.run(spec)
    w = spec.build()
    routes = wl.dp_routes(w, 2)
    assert row["dp_routes"] == [8, 8]
    assert sorted(child.engine.routes) == sorted(routes)
    warmed = {rank: set(prefixes) for rank, prefixes in child.engine.warm_calls}
    for rank in (0, 1):
        want = {tuple(w.prefixes[g]) for g, r in zip(w.group, routes) if r == rank and g >= 0}
        assert warmed[rank] == want


def test_child_batch_mode_leaves_routing_to_sglang():
    child = _fake_child(latency="none", dp=2, dp_routing="prefix")
    row = child.run(wl.WorkloadSpec("homogeneous", 4, 16, {"out": 3, "suffix": 2}))
    assert row["dp_routes"] is None
    assert [r for r, _ in child.engine.warm_calls] == [None, None]  # warm-up + the batch, unrouted


def test_child_leaves_routing_to_sglang_when_asked():
    child = _fake_child(dp=2, dp_routing="balance")
    row = child.run(wl.WorkloadSpec("homogeneous", 4, 16, {"out": 3, "suffix": 2}))
    assert row["dp_routes"] is None and set(child.engine.routes) == {None}
    assert [r for r, _ in child.engine.warm_calls] == [None]


def test_targets_follow_the_runs_model_and_parallelism():
    # targets: Llama on one GPU; Qwen2.5-14B at TP=2; Qwen2.5-32B at TP=4
    assert report.target_for("homogeneous", "flashinfer", 64, 16384) == 2.5
    q14, q32 = "qwen2.5-14b", "qwen2.5-32b"
    assert report.target_for("homogeneous", "flashinfer", 64, 16384, model=q14, tp=2) == 2.2
    assert report.target_for("homogeneous", "flashinfer", 128, 16384, model=q14, tp=2) is None
    assert report.target_for("heterogeneous", "flashinfer", 64, 16384, model=q14, tp=2) is None
    assert report.target_for("homogeneous", "flashinfer", 64, 16384, model=q32, tp=4) == 1.8
    assert report.target_for("homogeneous", "flashinfer", 64, 16384, model=q32, tp=2) is None  # dry run
    assert report.target_for("homogeneous", "flashinfer", 64, 16384, model=q14, tp=1) is None  # dry run
    assert report.target_for("homogeneous", "flashinfer", 64, 16384, dp=2) is None
    rec = [dict(kind="row", config=c, backend="flashinfer", workload="homogeneous", prefix_len=16384,
                agents=64, out_tok_per_s=v) for c, v in (("baseline", 100.0), ("granikv", 200.0))]
    assert report.combine(rec, model=q14, tp=2)[0]["target_speedup"] == 2.2
    assert report.combine(rec, dp=2)[0]["target_speedup"] is None
    md = report.markdown(report.combine(rec, model=q14, tp=2), rec, dict(model=q14, tp=2, dp=1), None)
    assert "Targets: the TP=2 target (Qwen2.5-14B)." in md
    assert "none (none is set for qwen2.5-32b at TP 2, DP 1)" in report.markdown([], rec, dict(model=q32, tp=2, dp=1), None)
