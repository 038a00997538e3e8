"""benchmark/multi_agent/regimes.py and its pure parts (regime_grid, regime_report) on fake
engine results: the grid and its budget, the rows built from records, merge, report, and the
parent / child loops with the engines replaced."""

import json
import sys
from pathlib import Path

import pytest

from benchmark.harness import engine_child, engine_proc, resident_engine
from benchmark.multi_agent import regime_grid, regime_report, workloads
from benchmark.multi_agent import regimes as regimes_mod

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def grid():
    return regime_grid


@pytest.fixture(scope="module")
def rep():
    return regime_report


@pytest.fixture(scope="module")
def wl():
    return workloads


# ---- the grid ------------------------------------------------------------------------------


def test_grid_covers_the_required_regimes(grid):
    rows = grid.default_grid()
    keys = {r.key for r in rows}
    L = "llama-3.1-8b"
    for need in ("hom16k_x64", "hom16k_x128", "kv_bound_no_sharing", "short1k_3sharers", "forest16",
                 "agent_loop_10k_x24"):
        assert f"{L}/{need}" in keys
    assert {r.model for r in rows} == set(grid.MODEL_NAMES) and len(grid.MODEL_NAMES) >= 4
    assert "llama-3.1-8b-4layers/forest16" in keys
    assert 20 <= len(rows) <= 60 and len(keys) == len(rows)  # tens of rows, each once
    assert all(r.agents <= 256 for r in rows)  # within the decode CUDA graphs
    forest = next(r for r in rows if r.key == f"{L}/forest16")
    assert len(forest.kwargs["prefixes"]) == 16 and min(forest.kwargs["prefixes"]) == 1536
    assert max(forest.kwargs["prefixes"]) == 6144 and set(forest.kwargs["agents_per_prefix"]) <= set(range(4, 13))
    # the KV-bound row holds more prompt tokens than the capped Llama pool
    kv = next(r for r in rows if r.key == f"{L}/kv_bound_no_sharing")
    assert kv.kwargs["agents"] * kv.kwargs["prompt_len"] > grid.LLAMA_POOL_TOKENS
    # every other Llama row fits it with the prefixes once
    for r in rows:
        if r.model == L and r.kind == "grouped":
            lo, hi = r.kwargs["suffix"]
            need = sum(r.kwargs["prefixes"]) + r.agents * (hi + r.kwargs["out"] * r.kwargs.get("turns", 1)
                                                           + r.kwargs.get("tool", 0) * 3)
            assert need < grid.LLAMA_POOL_TOKENS * 0.75, r.key
    # the host-bound model's long rows fit its own pool the same way (none of them is KV-bound)
    pool = {m.name: m.engine_kwargs["max_total_tokens"] for m in grid.MODELS}["llama-3.1-8b-4layers"]
    for r in rows:
        if r.model == "llama-3.1-8b-4layers" and r.kind == "grouped":
            lo, hi = r.kwargs["suffix"]
            assert sum(r.kwargs["prefixes"]) + r.agents * (hi + r.kwargs["out"]) < pool * 0.75, r.key
            assert r.kwargs["out"] == grid.HOST_BOUND_OUT


def test_ceiling_spec_cuts_prefixes_only(grid):
    r = next(r for r in grid.default_grid() if r.name == "forest16")
    main, ceil = r.spec_json(), r.spec_json(ceiling=True)
    assert r.has_ceiling and max(ceil["kwargs"]["prefixes"]) == 256 and ceil["agents"] == main["agents"]
    assert {k: v for k, v in ceil["kwargs"].items() if k != "prefixes"} == \
        {k: v for k, v in main["kwargs"].items() if k != "prefixes"}
    ns = next(r for r in grid.default_grid() if r.kind == "no_sharing")
    assert not ns.has_ceiling and ns.spec_json()["name"] == "no_sharing"


def test_select_subsets_and_budget(grid):
    rows = grid.default_grid()
    full = grid.select(rows)
    assert len(full.rows) == len(rows) and not full.skipped
    only = grid.select(rows, models=["qwen2.5-7b"], rows=["forest16", "short1k_3sharers"])
    assert {r.key for r in only.rows} == {"qwen2.5-7b/forest16", "qwen2.5-7b/short1k_3sharers"}
    with pytest.raises(ValueError, match="--models"):
        grid.select(rows, models=["gpt-9"])
    with pytest.raises(ValueError, match="--rows"):
        grid.select(rows, rows=["nope"])
    tight = grid.select(rows, budget_s=full.estimate_s * 0.6)
    assert tight.estimate_s <= full.estimate_s * 0.6 and tight.skipped
    dropped = {k for k, _ in tight.skipped}
    by = {m.name: m for m in grid.MODELS}
    kept_models = {r.model for r in tight.rows}
    # every dropped row is one that no longer fits the time left (its model's start included)
    for r in rows:
        if r.key in dropped:
            extra = grid.estimate_s(r, by[r.model]) + (0 if r.model in kept_models else grid.start_s(by[r.model]))
            assert tight.estimate_s + extra > full.estimate_s * 0.6, r.key
    # lower priorities go first: a kept row of a worse priority than a dropped one is cheaper than it
    for r in rows:
        if r.key in dropped:
            worse = [k for k in tight.rows if k.priority > r.priority]
            assert all(grid.estimate_s(k, by[k.model]) < grid.estimate_s(r, by[r.model]) for k in worse), r.key
    # run order stays grouped by model, in the grid's order
    order = [r.key for r in tight.rows]
    assert order == [r.key for r in rows if r.key in set(order)]
    # the default budget fits its own estimate, starts included (one pair start per model)
    d = grid.select(rows, budget_s=450)
    starts = sum(grid.start_s(m) for m in grid.MODELS if m.name in {r.model for r in d.rows})
    assert d.estimate_s <= 450 and d.estimate_s == pytest.approx(
        starts + sum(grid.estimate_s(r, {m.name: m for m in grid.MODELS}[r.model]) for r in d.rows))


def test_estimate_tracks_checked_in_stock_rows(grid):
    """The budget estimate against the stock rows of docs/results/multi_agent.json (same GPU)."""
    doc = json.loads((ROOT / "docs" / "results" / "multi_agent.json").read_text())
    cfg = grid.MODELS[0].config()
    for r in doc["rows"]:
        if r["workload"] not in ("homogeneous", "no_sharing") or r["agents"] < 64:
            continue
        p = r["params"]
        if r["workload"] == "homogeneous":
            spec = dict(name="grouped", agents=r["agents"], kwargs=dict(
                prefixes=[p["prefix_len"]], agents_per_prefix=[p["agents"]], suffix=[p["suffix"]] * 2, out=p["out"]))
        else:
            spec = dict(name="no_sharing", agents=r["agents"], kwargs=dict(prompt_len=p["prompt_len"], out=p["out"]))
        est = grid.run_estimate_s(spec, cfg) - grid.ROW_OVERHEAD_S
        assert est == pytest.approx(r["baseline_seconds"], rel=0.5), (r["workload"], r["agents"])


# ---- workloads.grouped ---------------------------------------------------------------------


def test_grouped_workload_and_its_ceiling(wl):
    kw = dict(prefixes=[700, 300, 0], agents_per_prefix=[3, 2, 2], suffix=[5, 40], out=7, turns=3, tool=4, seed=1)
    w = wl.grouped(**kw)
    c = wl.grouped(**wl.cut_prefixes(kw))
    assert w.agents == 7 and w.turns == 3 and len(w.prefixes) == 2  # the 0-token prefix shares nothing
    assert sorted(w.group) == [-1, -1, 0, 0, 0, 1, 1]
    for i, p in enumerate(w.prompts):
        g = w.group[i]
        if g >= 0:
            assert p[:len(w.prefixes[g])] == w.prefixes[g]
    # same suffix lengths, interleaving and tool results; only the prefixes are shorter
    assert c.group == w.group and [len(t) for t in c.tool_results[0]] == [4, 4]
    for pw, pc, g in zip(w.prompts, c.prompts, w.group):
        cut = (len(w.prefixes[g]) - 256) if g >= 0 and len(w.prefixes[g]) > 256 else 0
        assert len(pw) - len(pc) == cut
    assert w.params["suffix_tokens_per_prefix"] == c.params["suffix_tokens_per_prefix"]
    sums = [0, 0, 0]
    for i, p in enumerate(w.prompts):
        gi = [700, 300, 0].index(len(w.prefixes[w.group[i]])) if w.group[i] >= 0 else 2
        sums[gi] += len(p) - (len(w.prefixes[w.group[i]]) if w.group[i] >= 0 else 0)
    assert sums == w.params["suffix_tokens_per_prefix"]
    assert w.out_tokens == 7 * 3 * 7
    assert wl.grouped(**kw).prompts == w.prompts  # seeded
    spec = wl.WorkloadSpec("grouped", 7, 700, kw)
    assert wl.WorkloadSpec.from_json(spec.to_json()).build().prompts == w.prompts
    with pytest.raises(ValueError, match="agent counts"):
        wl.grouped(prefixes=[10], agents_per_prefix=[1, 2])
    with pytest.raises(ValueError, match="tool"):
        wl.grouped(prefixes=[10], agents_per_prefix=[2], turns=2)


# ---- rows from records -----------------------------------------------------------------------


def _rec(config, regime, tps, variant="main", *, model="llama-3.1-8b", backend="flashinfer", agents=64,
         prefixes=(16384,), out=128, gkv=None, has_ceiling=True, kind="grouped"):
    params = dict(prefixes=list(prefixes), agents_per_prefix=[agents // len(prefixes)] * len(prefixes),
                  suffix=[256, 256], suffix_tokens_per_prefix=[256 * (agents // len(prefixes))] * len(prefixes),
                  out=out, turns=1, tool=0, seed=0, agents=agents)
    if kind == "no_sharing":
        params = dict(agents=agents, prompt_len=6144, out=out, seed=0)
    return dict(kind="row", model=model, backend=backend, config=config, regime=regime, variant=variant,
                priority=0, has_ceiling=has_ceiling, workload=kind, agents=agents,
                prefix_len=max(prefixes), turns=1, params=params, out_tok_per_s=tps,
                seconds=agents * out / tps, granikv=(gkv or {}).get("after"), granikv_delta=(gkv or {}).get("delta"))


GKV = dict(after=dict(attention=dict(plan_us_p50=21.0, plan_us_p99=70.5, plan_window_steps=4096)),
           delta=dict(promotions=1, skip_reasons={"short": 2, "never": 0},
                      attention=dict(planned_steps=127, plan_us_total=2540.0, decode_steps=127,
                                     steps_per_path={"cascade": 120, "paged": 7, "split": 0},
                                     extend_fallbacks={"no HOT prefix in the batch": 3})))


def test_assemble_pairs_sides_ceiling_floor_and_counters(rep):
    recs = [_rec("baseline", "hom16k_x64", 2600.0), _rec("baseline", "hom16k_x64", 7700.0, "ceiling", prefixes=(256,)),
            _rec("granikv", "hom16k_x64", 5900.0, gkv=GKV),
            _rec("baseline", "kv", 1160.0, kind="no_sharing", has_ceiling=False, prefixes=(0,)),
            _rec("granikv", "kv", 1116.0, kind="no_sharing", has_ceiling=False, prefixes=(0,)),
            _rec("baseline", "orphan", 1000.0, "ceiling"),  # a ceiling alone is no row
            dict(kind="info", model="llama-3.1-8b", backend="flashinfer", config="granikv", max_total_num_tokens=1234)]
    rows = rep.assemble(recs)
    assert [r["workload"] for r in rows] == ["hom16k_x64", "kv"]
    h, k = rows
    assert h["speedup"] == pytest.approx(5900 / 2600, abs=1e-4) and h["ceiling_out_tok_s"] == 7700.0
    assert 1.5 < h["floor_speedup"] < 7700 / 2600 and h["floor_fraction"] == pytest.approx(
        5900 / (h["floor_speedup"] * 2600), rel=1e-3)
    assert (h["plan_us_p50"], h["plan_us_p99"], h["plan_us_mean_row"]) == (21.0, 70.5, 20.0)
    assert h["plan_window_only_this_row"] is False  # 127 steps of a 4096-step window
    assert h["dispatch_paths"] == {"cascade": 120, "paged": 7}
    assert h["extend_fallbacks"] == {"no HOT prefix in the batch": 3} and h["promotion_skips"] == {"short": 2}
    assert h["granikv_kv_capacity_tokens"] == 1234 and h["baseline_kv_capacity_tokens"] is None
    # no shared prefix: its own ceiling, floor = stock
    assert k["ceiling_is_row"] and k["ceiling_out_tok_s"] == 1160.0 and k["floor_speedup"] == 1.0
    assert k["floor_fraction"] == pytest.approx(1116 / 1160, abs=1e-4)
    assert k["plan_us_p50"] is None and k["dispatch_paths"] == {}  # nothing reported: None / empty
    assert rep.verdicts(k) == ["speedup < 0.97", "no-pay row < 0.99"]
    assert rep.verdicts(h) == []


def test_plan_percentiles_of_a_row_come_from_its_histogram_delta(rep):
    """With the engine's cumulative histogram, a row's p50/p99 are its own steps' (the bucket
    deltas), whatever the engine's recent-steps window says; section means are per row too."""
    hist = {"16": 60, "19.03": 30, "22.63": 8, "90.51": 2}
    gkv = dict(after=GKV["after"], delta=dict(GKV["delta"], attention=dict(
        GKV["delta"]["attention"], planned_steps=100, plan_us_total=2000.0, plan_cpu_us_total=1500.0,
        plan_us_hist=hist, plan_sections_us_total={"lookup": 500.0, "upload": 800.0})))
    rows = rep.assemble([_rec("baseline", "r", 2600.0), _rec("baseline", "r", 7700.0, "ceiling", prefixes=(256,)),
                         _rec("granikv", "r", 5900.0, gkv=gkv)])
    r = rows[0]
    assert 13.45 < r["plan_us_p50"] <= 16.0 and 22.63 < r["plan_us_p99"] <= 90.51
    assert r["plan_us_p50"] != 21.0 and r["plan_percentiles_of"] == "row" and r["plan_window_only_this_row"]
    assert r["plan_us_mean_row"] == 20.0 and r["plan_cpu_us_mean_row"] == 15.0
    assert r["plan_sections_us_mean_row"] == {"lookup": 5.0, "upload": 8.0}


def test_a_row_without_its_ceiling_has_no_floor(rep):
    rows = rep.assemble([_rec("baseline", "r", 2600.0), _rec("granikv", "r", 5900.0)])
    assert rows[0]["floor_speedup"] is None and "ceiling" in rows[0]["floor_reason"]


def test_verdicts_and_summary(rep):
    rows = [dict(model="m", backend="b", workload=f"w{i}", speedup=s, floor_speedup=f, floor_fraction=ff,
                 plan_us_p50=p50, plan_us_p99=p99)
            for i, (s, f, ff, p50, p99) in enumerate([(0.96, 1.0, 0.96, 10, 20), (0.995, 1.02, 0.97, 31, 20),
                                                      (1.01, 1.0, 1.01, 10, 81), (2.0, 2.5, 0.8, 10, 20),
                                                      (2.4, 2.5, 0.96, 10, 20)])]
    assert rep.verdicts(rows[0]) == ["speedup < 0.97", "no-pay row < 0.99"]
    assert rep.verdicts(rows[1]) == ["plan p50 > 30 us"]
    assert rep.verdicts(rows[2]) == ["plan p99 > 80 us"]
    assert rep.verdicts(rows[3]) == ["floor_fraction < 0.9"] and rep.verdicts(rows[4]) == []
    s = rep.summary(rows)
    assert s["worst_speedup"] == dict(row="m/b/w0", value=0.96) and s["no_pay_rows"] == 3
    assert s["no_pay_median_speedup"] == 0.995 and s["worst_floor_fraction"]["row"] == "m/b/w3"
    assert s["rows_missing_a_target"] == 4
    # engines with unequal KV pools served different workloads: the row is flagged whatever its ratio
    unequal = dict(rows[4], baseline_kv_capacity_tokens=294912, granikv_kv_capacity_tokens=55081)
    assert rep.verdicts(unequal) == ["KV pools differ (294912 / 55081 tokens)"]
    assert rep.verdicts(dict(unequal, granikv_kv_capacity_tokens=294000)) == []


def test_merge_later_wins_and_prunes_skips(rep, tmp_path):
    a = dict(meta=dict(command="c1", date="d1", backend="flashinfer", skipped=[["llama-3.1-8b/x", "budget"]]),
             measurements=[_rec("baseline", "x", 100.0), _rec("granikv", "x", 90.0),
                           dict(kind="error", model="m", backend="flashinfer", config="granikv", error="boom")])
    b = dict(meta=dict(command="c2", date="d2", backend="triton", skipped=[["qwen2.5-7b/y", "budget"]]),
             measurements=[_rec("granikv", "x", 110.0)])
    records, meta = rep.merge_docs([a, b])
    rows = rep.assemble(records, meta)
    assert len(rows) == 1 and rows[0]["granikv_out_tok_s"] == 110.0  # the later file wins
    assert meta["commands"] == ["c1", "c2"] and meta["backends"] == ["flashinfer", "triton"]
    assert meta["skipped"] == [["qwen2.5-7b/y", "budget"]]  # x was measured after all
    paths = rep.write(str(tmp_path), "regimes", records, meta, quiet=True)
    doc = json.loads((tmp_path / "regimes.json").read_text())
    assert set(doc) == {"meta", "summary", "rows", "measurements"} and len(doc["rows"]) == 1
    for key in ("model", "backend", "workload", "baseline_out_tok_s", "granikv_out_tok_s", "speedup",
                "ceiling_out_tok_s", "floor_speedup", "floor_fraction", "plan_us_p50", "plan_us_p99"):
        assert key in doc["rows"][0]
    md = (tmp_path / "regimes.md").read_text()
    assert "| llama-3.1-8b | flashinfer | x | 64 | 100 | 110 | 1.100x |" in md and "boom" in md
    assert "c1" in md and "c2" in md and "qwen2.5-7b/y" in md
    assert [p.name for p in paths][:2] == ["regimes.json", "regimes.md"]


# ---- the parent and child loops, engines replaced -------------------------------------------


@pytest.fixture()
def regimes():
    return regimes_mod


class FakeResident:
    """regimes.ResidentEngine without a child: ``answer(config, row, variant, k)`` gives each
    request's record (a dict) or raises EngineGone; every request is logged in ``log``."""

    log: list = []
    answer = None

    def __init__(self, cmd, *, name, env, extra, on_record, echo=True, cwd=None):
        # a child of this benchmark module, from the repository root
        assert cmd[1:4] == ["-m", "benchmark.multi_agent.regimes", "--child"] and cwd == engine_proc.REPO_ROOT
        self.job = json.loads(open(cmd[-1]).read())
        FakeResident.envs.append(env)
        self.extra, self.on_record = extra, on_record
        self.k = {}

    pools = None  # config -> KV pool tokens of each start in turn (default 1000 every time)
    starts: list = []
    envs: list = []  # each start's environment

    def wait_ready(self, timeout):
        assert timeout > 0
        FakeResident.starts.append((self.job["config"], self.job["engine_kwargs"].get("max_total_tokens")))
        n = sum(1 for c, _ in FakeResident.starts if c == self.job["config"]) - 1
        pools = (FakeResident.pools or {}).get(self.job["config"])
        rec = dict(kind="info", max_total_num_tokens=pools[min(n, len(pools) - 1)] if pools else 1000, **self.extra)
        self.on_record(rec)
        return rec

    def request(self, payload, timeout):
        assert timeout > 0
        t = payload["tags"]
        key = (t["regime"], t["variant"])
        k = self.k[key] = self.k.get(key, -1) + 1
        FakeResident.log.append((self.job["config"], t["regime"], t["variant"]))
        FakeResident.probes.append(payload.get("probe"))
        rec = FakeResident.answer(self.job, t, k)
        return dict(rec, id=0, **self.extra)

    def shutdown(self):
        FakeResident.log.append((self.job["config"], "shutdown", None))

    def close(self):
        pass


@pytest.fixture()
def fake_resident(regimes, monkeypatch):
    FakeResident.log, FakeResident.probes, FakeResident.starts, FakeResident.pools = [], [], [], None
    FakeResident.envs = []
    monkeypatch.setattr(regimes, "ResidentEngine", FakeResident)
    monkeypatch.setattr(regimes.engine_proc, "gpu_free_bytes", lambda: None)  # a GPU's memory: unknown
    return FakeResident


def test_parent_interleaves_engines_per_repeat_and_writes_after_every_record(regimes, fake_resident, tmp_path):
    seen = []
    tps = {("baseline", 0): 1000.0, ("baseline", 1): 1010.0, ("baseline", 2): 990.0,
           ("granikv", 0): 3000.0, ("granikv", 1): 2900.0, ("granikv", 2): 3100.0}

    def answer(job, tags, k):
        seen.append((tmp_path / "regimes_flashinfer.json").exists())
        if job["config"] == "granikv" and tags["regime"] == "forest16":
            return dict(kind="error", error="forest16: bad row")
        v = 5000.0 if tags["variant"] == "ceiling" else tps[(job["config"], k)]
        return _rec(job["config"], tags["regime"], v, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "qwen2.5-7b", "--rows", "forest16,short1k_3sharers", "--out", str(tmp_path),
            "--time-budget-s", "0"]
    assert regimes.main(argv) == 1  # an error record was sent
    # the first row once on each engine, untimed, before anything is measured
    assert fake_resident.log[:2] == [("baseline", "short1k_3sharers", "warm_up"),
                                     ("granikv", "short1k_3sharers", "warm_up")]
    log = [x for x in fake_resident.log if x[1] == "short1k_3sharers" and x[2] != "warm_up"]
    # taking turns: stock first on even repeats, GraniKV first on odd ones, the ceiling once at the end
    assert [c for c, _, v in log] == ["baseline", "granikv", "granikv", "baseline", "baseline", "granikv",
                                      "baseline"]
    assert log[-1][2] == "ceiling"
    assert fake_resident.log[-2:] == [("baseline", "shutdown", None), ("granikv", "shutdown", None)]
    assert [c for c, r, v in fake_resident.log if r == "forest16" and v == "main"].count("granikv") == 1
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    assert all(seen[1:])  # the JSON exists from the first record on
    rows = {r["workload"]: r for r in doc["rows"]}
    s = rows["short1k_3sharers"]
    assert s["baseline_out_tok_s"] == 1000.0 and s["granikv_out_tok_s"] == 3000.0  # median repeats
    assert s["baseline_spread"] == pytest.approx(0.02) and s["granikv_spread"] == pytest.approx(0.2 / 3, abs=1e-4)
    assert s["baseline_repeats_out_tok_s"] == [1000.0, 1010.0, 990.0]
    assert s["ceiling_out_tok_s"] == 5000.0
    assert rows["forest16"]["granikv_out_tok_s"] is None
    kw = doc["meta"]["engine_kwargs"]
    assert kw["qwen2.5-7b/flashinfer/granikv"]["enable_granikv"] is True
    assert "enable_granikv" not in kw["qwen2.5-7b/flashinfer/baseline"]
    # graphs for the rows' batch sizes only, and a capped pool so both engines fit one GPU
    assert kw["qwen2.5-7b/flashinfer/baseline"]["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16, 32, 48, 64, 128, 130]
    assert kw["qwen2.5-7b/flashinfer/baseline"]["max_total_tokens"] > 0


def test_parent_skips_the_rest_of_a_model_whose_engine_is_gone(regimes, fake_resident, tmp_path):
    def answer(job, tags, k):
        if job["config"] == "granikv":
            raise regimes.EngineGone("granikv: exited with status -9")
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "qwen2.5-7b", "--rows", "forest16,short1k_3sharers", "--out", str(tmp_path),
            "--time-budget-s", "0", "--repeats", "1"]
    assert regimes.main(argv) == 1
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    assert ["qwen2.5-7b/forest16", "an engine is gone"] in doc["meta"]["skipped"]
    assert any("exited with status -9" in r.get("error", "") for r in doc["measurements"] if r["kind"] == "error")


def test_a_row_the_budget_leaves_out_while_running_is_listed_not_an_error(regimes, fake_resident, tmp_path,
                                                                         monkeypatch):
    """The plan fits the budget, the run is slower than estimated (a slower host): the row the
    clock no longer leaves time for is not started, it is listed with its reason, and the run
    exits 0 with the rows it measured; a failed row still makes it exit 1."""
    clock = [1000.0]
    monkeypatch.setattr(regimes.time, "time", lambda: clock[0])

    def answer(job, tags, k):
        clock[0] += 25.0  # every request takes longer than the estimate allows for
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    rows = "forest16,short1k_3sharers"
    sel = regimes.grid.select(regimes.grid.default_grid(), models=["qwen2.5-7b"], rows=rows.split(","), budget_s=0,
                              repeats=1, backend="flashinfer", engines=2)
    budget = int(sel.estimate_s) + 5  # both rows planned
    argv = ["--models", "qwen2.5-7b", "--rows", rows, "--out", str(tmp_path), "--time-budget-s", str(budget),
            "--repeats", "1", "--idle-probe-steps", "0"]
    assert regimes.main(argv) == 0
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    measured = [r["workload"] for r in doc["rows"] if r["granikv_out_tok_s"]]
    left_out = [k for k, why in doc["meta"]["skipped"] if "no longer fits the time budget" in why]
    assert measured and left_out and len(measured) + len(left_out) == 2
    assert not [r for r in doc["measurements"] if r["kind"] == "error"]
    assert "Not run (time budget)" in (tmp_path / "regimes_flashinfer.md").read_text()

    def failing(job, tags, k):
        clock[0] += 25.0
        return dict(kind="error", error="a bad row")

    fake_resident.answer = failing
    assert regimes.main(argv) == 1  # an error is still one


def _one_row(job, tags, k):
    return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])


def _llama_row_argv(tmp_path):
    """One Llama-3.1-8B row, one repeat, no budget: what the KV-pool tests run."""
    return ["--models", "llama-3.1-8b", "--rows", "short1k_3sharers", "--out", str(tmp_path),
            "--time-budget-s", "0", "--repeats", "1"]


def test_unequal_kv_pools_restart_every_engine_at_one_size(regimes, fake_resident, tmp_path):
    """SGLang lowered the GraniKV engine's pool (a GPU too small for both at the cap): both are
    restarted with the pools they held shared out evenly, and the model's rows run on those."""
    fake_resident.answer = _one_row
    fake_resident.pools = {"baseline": [294912, 165888], "granikv": [55081, 165888]}
    argv = _llama_row_argv(tmp_path)
    assert regimes.main(argv) == 0
    cap = regimes.grid.LLAMA_POOL_TOKENS
    assert fake_resident.starts == [("baseline", cap), ("granikv", cap), ("baseline", 165888), ("granikv", 165888)]
    assert [x for x in fake_resident.log if x[1] == "shutdown"][:2] == [("baseline", "shutdown", None),
                                                                          ("granikv", "shutdown", None)]
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    assert doc["meta"]["pool_equalized"]["llama-3.1-8b"] == dict(tokens=165888,
                                                                 profiled=dict(baseline=294912, granikv=55081))
    assert [r["workload"] for r in doc["rows"] if r["granikv_out_tok_s"]] == ["short1k_3sharers"]


def test_kv_pools_that_still_differ_skip_the_model_with_the_reason(regimes, fake_resident, tmp_path):
    fake_resident.answer = _one_row
    fake_resident.pools = {"baseline": [294912], "granikv": [55081]}
    argv = _llama_row_argv(tmp_path)
    assert regimes.main(argv) == 1
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    assert ["llama-3.1-8b/short1k_3sharers", "an engine did not start"] in doc["meta"]["skipped"]
    assert any("KV pools still differ" in r.get("error", "") for r in doc["measurements"] if r["kind"] == "error")
    assert len(fake_resident.starts) == 4  # one restart, then given up


def test_fitted_pool_where_the_engines_do_not_fit_at_the_cap(regimes):
    """Two Llama-3.1-8B engines at the 288K cap need ~2 x 53 GiB: on an 80 GB GPU each gets the
    pool that fits whatever order they profile in (SGLang's rule: free after its weights less
    15% of the free before); on an H200 the cap stays; a model whose weights alone do not fit twice
    is refused with the numbers."""
    models = {m.name: m for m in regimes.grid.MODELS}
    llama = models["llama-3.1-8b"]
    kw = regimes.engine_kwargs(llama, "flashinfer", "baseline", {}, engines=2)
    free = int(79.2 * 2**30)
    tokens = regimes.fitted_pool(llama, kw, 2, free)
    facts = regimes.grid.model_facts(llama.config())
    w, b = 2 * facts["params"], facts["kv_bytes"]
    assert tokens % 1024 == 0 and 100_000 < tokens < regimes.grid.LLAMA_POOL_TOKENS
    # the worst order: the other engine's weights, pool and reserve in place before this one's
    # weights, its slack taken on all the memory that was free at the start
    assert free - 2 * w - tokens * b - 2 * regimes.ENGINE_RESERVE_BYTES - 0.15 * free >= tokens * b
    assert regimes.fitted_pool(llama, kw, 2, 139 * 2**30) is None
    assert regimes.fitted_pool(llama, kw, 2, None) is None
    big = models["qwen3-30b-a3b"]
    with pytest.raises(regimes.EngineGone, match="2 engines do not fit one GPU with 79.2 GiB free"):
        regimes.fitted_pool(big, regimes.engine_kwargs(big, "flashinfer", "baseline", {}, engines=2), 2, free)


def test_engines_start_at_the_fitted_pool_on_a_smaller_gpu(regimes, fake_resident, tmp_path, monkeypatch):
    """Both engines start at the fitted pool (not at the cap, where the second to profile fails to
    start on an 80 GB GPU) and the run records it; a pool given with --engine-arg is kept."""
    fake_resident.answer = _one_row
    monkeypatch.setattr(regimes.engine_proc, "gpu_free_bytes", lambda: int(79.2 * 2**30))
    llama = {m.name: m for m in regimes.grid.MODELS}["llama-3.1-8b"]
    fitted = regimes.fitted_pool(llama, regimes.engine_kwargs(llama, "flashinfer", "baseline", {}), 2,
                                 int(79.2 * 2**30))
    fake_resident.pools = {"baseline": [fitted], "granikv": [fitted]}
    argv = _llama_row_argv(tmp_path)
    assert regimes.main(argv) == 0
    assert fake_resident.starts == [("baseline", fitted), ("granikv", fitted)]
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    assert doc["meta"]["pool_fitted"]["llama-3.1-8b"] == dict(tokens=fitted, cap=regimes.grid.LLAMA_POOL_TOKENS,
                                                             free_gib=79.2)
    assert f"- llama-3.1-8b: {fitted} KV tokens per engine" in (tmp_path / "regimes_flashinfer.md").read_text()
    fake_resident.starts.clear()
    fake_resident.pools = {"baseline": [100352], "granikv": [100352]}
    assert regimes.main(argv + ["--engine-arg", "max_total_tokens=100352", "--out", str(tmp_path / "given")]) == 0
    assert fake_resident.starts == [("baseline", 100352), ("granikv", 100352)]


def test_pools_differ_and_equal_pool(regimes):
    assert not regimes.pools_differ(dict(a=1000, b=995)) and regimes.pools_differ(dict(a=1000, b=980))
    assert not regimes.pools_differ(dict(a=1000, b=None))
    assert regimes.equal_pool(dict(a=294912, b=55081)) == 165888  # 0.95 x the mean, whole 1024s
    assert regimes.equal_pool(dict(a=1000, b=900)) == 900  # never below the smallest


def test_graph_sizes_cover_every_row_and_the_powers_below(regimes, grid):
    rows = [r for r in grid.default_grid() if r.model == "llama-3.1-8b"]
    sizes = regimes.graph_sizes(rows)
    assert {r.agents for r in rows} <= set(sizes) and max(sizes) <= 256 and sizes == sorted(set(sizes))
    assert regimes.graph_sizes(rows[:1]) == [1, 2, 4, 8, 16, 32, 64]


def test_resident_child_answers_every_request_then_stops(regimes, monkeypatch, capsys, tmp_path):
    import io

    def run_row(spec):
        if spec.agents == 13:
            raise RuntimeError("bad row")
        return dict(workload=spec.name, agents=spec.agents, out_tok_per_s=1.0, params={})

    _fake_child(monkeypatch, run_row)
    spec = lambda agents: dict(name="no_sharing", agents=agents, kwargs=dict(out=1))  # noqa: E731
    reqs = [dict(op="row", id=0, spec=spec(2), tags=dict(regime="a", variant="main")),
            dict(op="row", id=1, spec=spec(13), tags=dict(regime="b", variant="main")),
            dict(op="row", id=2, spec=spec(3), tags=dict(regime="c", variant="ceiling")),
            dict(op="shutdown"), dict(op="row", id=3, spec=spec(4), tags={})]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in reqs)))
    path = tmp_path / "job.json"
    path.write_text(json.dumps(dict(engine_kwargs={})))
    assert regimes.main_child(str(path)) == 1  # one request failed
    recs = [x for x in map(regimes.engine_proc.parse_line, capsys.readouterr().out.splitlines()) if x]
    assert [(r["kind"], r.get("id"), r.get("regime")) for r in recs] == [
        ("info", None, None), ("row", 0, "a"), ("error", 1, None), ("row", 2, "c")]  # nothing after shutdown
    assert "bad row" in recs[2]["error"]
    assert resident_engine.serve(lambda req: {}, io.StringIO("")) == 0


def test_resident_engine_round_trip_with_a_real_child(tmp_path):
    """ResidentEngine against a real subprocess speaking the protocol: ready, requests answered
    by id, a child that dies is reported as EngineGone, not a hang."""
    child = tmp_path / "child.py"
    child.write_text(
        "import sys\n"
        "from benchmark.harness import engine_proc, resident_engine\n"
        "print('starting up')\n"
        "engine_proc.emit(engine_proc.INFO_TAG, dict(up=1))\n"
        "def handle(req):\n"
        "    if req.get('die'):\n"
        "        import os; os._exit(3)\n"
        "    return dict(double=2 * req['x'])\n"
        "sys.exit(resident_engine.serve(handle))\n")
    seen = []
    env = engine_proc.repo_env()  # the child, a script in tmp_path, imports the benchmark package
    e = resident_engine.ResidentEngine([sys.executable, str(child)], name="t", extra=dict(model="m"),
                                       on_record=seen.append, echo=False, env=env, cwd=tmp_path)
    assert e.wait_ready(30)["up"] == 1 and seen[0]["model"] == "m"
    assert e.request(dict(x=4), 30)["double"] == 8
    assert e.request(dict(x=5), 30)["double"] == 10
    with pytest.raises(resident_engine.EngineGone, match="exited"):
        e.request(dict(die=True), 30)
    e.shutdown(grace_s=1)
    e2 = resident_engine.ResidentEngine([sys.executable, str(child)], name="t2", echo=False, env=env)
    e2.wait_ready(30)
    e2.shutdown(grace_s=10)
    assert e2.proc.returncode == 0


def _fake_child(monkeypatch, run_row):
    """harness.engine_child.EngineChild replaced by an engine-less child whose ``run(spec)`` is
    ``run_row(spec)``."""

    class FakeEngine:
        def generate(self, **_):
            return []

        def shutdown(self):
            pass

    class FakeChild:
        def __init__(self, job):
            self.engine = FakeEngine()

        def info(self):
            return dict(engine_up_s=1.0)

        def run(self, spec):
            return run_row(spec)

    monkeypatch.setattr(engine_child, "EngineChild", FakeChild)


def test_end_to_end_with_a_fake_engine(tmp_path):
    """The real parent and children (subprocesses) on a fake ``sglang`` package."""
    import os
    import subprocess

    from test_multi_agent_workloads import FAKE_SGLANG

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_SGLANG)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(ROOT / "python")]))
    out = tmp_path / "out"
    module = [sys.executable, "-m", "benchmark.multi_agent.regimes"]  # run from ROOT
    cmd = module + ["--backend", "triton", "--models", "llama-3.1-8b-4layers",
                    "--rows", "hom4k_x64,no_sharing_1k_x64", "--time-budget-s", "0", "--out", str(out), "--tag", "t"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "regimes_triton_t.json").read_text())
    rows = {r["workload"]: r for r in doc["rows"]}
    assert set(rows) == {"hom4k_x64", "no_sharing_1k_x64"}
    h, n = rows["hom4k_x64"], rows["no_sharing_1k_x64"]
    assert h["speedup"] > 1.5 and h["ceiling_out_tok_s"] > h["baseline_out_tok_s"]  # fake: 3x per context token
    assert h["floor_speedup"] >= 1.0 and h["floor_fraction"] is not None
    assert n["ceiling_is_row"] and n["floor_speedup"] == 1.0
    assert h["plan_us_p50"] is None  # the fake engine reports no GraniKV counters
    assert {(m["config"], m["variant"]) for m in doc["measurements"] if m["kind"] == "row"
            and m["regime"] == "hom4k_x64"} == {("baseline", "main"), ("baseline", "ceiling"), ("granikv", "main")}
    merged = tmp_path / "merged"
    res = subprocess.run(module + ["--merge", str(out / "regimes_triton_t.json"), "--out", str(merged)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((merged / "regimes.json").read_text())["rows"] == doc["rows"]
    assert "| llama-3.1-8b-4layers | triton | hom4k_x64 | 64 |" in (merged / "regimes.md").read_text()
    res = subprocess.run(module + ["--merge", str(out / "regimes_triton_t.json"), "--tag", "x", "--out", str(merged)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and (merged / "regimes_x.json").is_file() and (merged / "regimes_x.md").is_file()


def test_repeats_keep_the_median_run_and_scale_the_estimate(regimes, grid):
    assert regimes.median_repeat([{"out_tok_per_s": 30.0, "tag": 1}, {"out_tok_per_s": 10.0},
                                  {"out_tok_per_s": 20.0, "tag": 3}]) == {
        "out_tok_per_s": 20.0, "tag": 3, "repeats_out_tok_s": [30.0, 10.0, 20.0]}  # the median run, whole
    assert regimes.median_repeat([{"out_tok_per_s": 4.0}, {"out_tok_per_s": 2.0}])["out_tok_per_s"] == 2.0
    assert "repeats_out_tok_s" not in regimes.median_repeat([{"out_tok_per_s": 4.0}])
    with pytest.raises(ValueError):
        regimes.median_repeat([])
    rows = grid.default_grid()
    m = {x.name: x for x in grid.MODELS}[rows[0].model]
    ceiling = grid.estimate_s(rows[0], m) - 2 * grid.run_estimate_s(rows[0].spec_json(), m.config(),
                                                                     m.engine_kwargs.get("max_total_tokens"))
    assert rows[0].has_ceiling and ceiling > 0
    assert grid.estimate_s(rows[0], m, 3) - ceiling == pytest.approx(3 * (grid.estimate_s(rows[0], m) - ceiling))
    with pytest.raises(ValueError, match="--repeats=0"):
        grid.select(rows, repeats=0)
    assert regimes.parse_args(["--repeats", "1"]).repeats == 1 and regimes.parse_args([]).repeats == 3


def test_spread_of_repeats(rep):
    assert rep.spread(dict(repeats_out_tok_s=[100.0, 102.0, 99.0])) == pytest.approx(0.03)
    assert rep.spread(dict(repeats_out_tok_s=[100.0])) is None and rep.spread(None) is None
    row = dict(speedup=1.0, floor_speedup=1.0, baseline_spread=0.02)
    assert "baseline_spread > 0.01" in rep.verdicts(row)
    assert not rep.verdicts(dict(row, baseline_spread=0.005))


def test_idle_probe_runs_untimed_after_the_repeats_and_fills_the_row(regimes, fake_resident, tmp_path):
    def answer(job, tags, k):
        if tags["variant"] == "idle":
            return dict(kind="row", config=job["config"], workload="grouped",
                        gpu_idle_us_per_step=12.0 if job["config"] == "baseline" else 15.0, gpu_busy_us_per_step=900.0)
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "qwen2.5-7b", "--rows", "short1k_3sharers", "--out", str(tmp_path), "--time-budget-s", "0",
            "--repeats", "1", "--idle-probe-steps", "32"]
    assert regimes.main(argv) == 0
    assert [v for _, _, v in fake_resident.log if v][-2:] == ["idle", "idle"]  # after the timed runs
    row = json.loads((tmp_path / "regimes_flashinfer.json").read_text())["rows"][0]
    assert (row["gpu_idle_us_baseline"], row["gpu_idle_us_granikv"]) == (12.0, 15.0)
    assert row["baseline_out_tok_s"] == 1000.0  # the probe's run is not a timed repeat
    assert "host_calls_baseline" not in row  # no host probe asked for
    assert row["baseline_tpot_p50_ms"] is None and row["gpu_idle_us_baseline_timed"] is None  # no latency here


def test_idle_probe_engines_carry_the_replay_gap_recorder_and_rows_are_judged_by_it(regimes, fake_resident, tmp_path):
    """With the idle probe on, every engine starts with the recorder's plugin on its path; the
    probe's replay gaps fill the row and decide the idle verdict (the probe's own figures, which
    would fail GraniKV here, are set aside)."""
    from benchmark.harness import replay_gaps

    def answer(job, tags, k):
        if tags["variant"] == "idle":
            gap = 41.0 if job["config"] == "baseline" else 44.0
            return dict(kind="row", config=job["config"], workload="grouped", gpu_idle_us_per_step=12.0
                        if job["config"] == "baseline" else 90.0, gpu_busy_us_per_step=900.0,
                        replay_gaps=dict(replays=300, gaps=290, gap_us_p50=gap, replay_us_p50=880.0))
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "qwen2.5-7b", "--rows", "short1k_3sharers", "--out", str(tmp_path), "--time-budget-s", "0",
            "--repeats", "1", "--idle-probe-steps", "32"]
    assert regimes.main(argv) == 0
    envs = [e for e in fake_resident.envs if e is not None]
    assert envs and all(replay_gaps.CONTROL_ENV in e and str(replay_gaps.PLUGIN_DIR) in e["PYTHONPATH"] for e in envs)
    row = json.loads((tmp_path / "regimes_flashinfer.json").read_text())["rows"][0]
    assert (row["replay_gap_us_baseline"], row["replay_gap_us_granikv"], row["replay_gaps_granikv"]) == (41.0, 44.0, 290)
    assert row["gpu_idle_basis"] == "replay"
    judged = dict(row, plan_us_p50=45.0, plan_us_p99=90.0)
    assert regimes_mod.report.gpu_waits_not(judged)  # 44 within 41 + 5, though the probe reads 90 against 12
    assert not regimes_mod.report.gpu_waits_not(dict(judged, replay_gap_us_granikv=47.0))
    assert regimes_mod.report.idle_basis(dict(judged, replay_gaps_baseline=3)) != "replay"  # too few gaps
    assert "[replay gap 41 / 44, judged by it]" in regimes_mod.report.markdown_table([row])
    fake_resident.envs.clear()
    assert regimes.main(argv[:-2]) == 0  # no probe: no recorder
    assert not any(replay_gaps.CONTROL_ENV in (e or {}) for e in fake_resident.envs)


def test_idle_probe_covers_agent_loop_rows(regimes, fake_resident, tmp_path):
    """Multi-turn rows are probed too (the child's window sits in their middle turn)."""
    def answer(job, tags, k):
        if tags["variant"] == "idle":
            return dict(kind="row", config=job["config"], workload="grouped", probe_turn=2,
                        gpu_idle_us_per_step=20.0, gpu_busy_us_per_step=800.0)
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "llama-3.1-8b", "--rows", "agent_loop_10k_x24", "--out", str(tmp_path), "--time-budget-s", "0",
            "--repeats", "1", "--idle-probe-steps", "32"]
    assert regimes.main(argv) == 0
    assert [v for _, _, v in fake_resident.log if v][-2:] == ["idle", "idle"]
    row = json.loads((tmp_path / "regimes_flashinfer.json").read_text())["rows"][0]
    assert row["workload"] == "agent_loop_10k_x24" and row["gpu_idle_us_granikv"] == 20.0


def test_timed_idle_is_tpot_less_gpu_busy_and_shown_beside_the_probe(rep):
    row = dict(baseline_tpot_p50_ms=3.54, gpu_busy_us_baseline=2816.2, granikv_tpot_p50_ms=2.92,
               gpu_busy_us_granikv=2083.9)
    assert rep.timed_idle_us(row, "baseline") == pytest.approx(723.8)
    assert rep.timed_idle_us(row, "granikv") == pytest.approx(836.1)
    assert rep.timed_idle_us(dict(row, gpu_busy_us_granikv=None), "granikv") is None  # no probe
    assert rep.timed_idle_us(dict(row, granikv_tpot_p50_ms=None), "granikv") is None  # no latency
    cell = dict(model="m", backend="flashinfer", workload="w", gpu_idle_us_baseline=393.0, gpu_idle_us_granikv=2052.4,
                gpu_idle_us_baseline_timed=723.8, gpu_idle_us_granikv_timed=836.1)
    assert "| 393 / 2052 (timed 724 / 836) |" in rep.markdown_table([cell])
    assert "| 393 / 2052 |" in rep.markdown_table([dict(cell, gpu_idle_us_baseline_timed=None,
                                                        gpu_idle_us_granikv_timed=None)])


def test_host_probe_asks_for_cpu_activity_and_fills_the_row(regimes, fake_resident, tmp_path):
    asked = []

    def answer(job, tags, k):
        if tags["variant"] == "host":
            asked.append(job["config"])
            return dict(kind="row", config=job["config"], workload="grouped",
                        host_calls={"cudaGraphLaunch": [1.0, 30.0 if job["config"] == "baseline" else 45.0]})
        return _rec(job["config"], tags["regime"], 1000.0, tags["variant"], model=job["model"])

    fake_resident.answer = answer
    argv = ["--models", "qwen2.5-7b", "--rows", "short1k_3sharers", "--out", str(tmp_path), "--time-budget-s", "0",
            "--repeats", "1", "--host-probe-steps", "16"]
    assert regimes.main(argv) == 0
    assert sorted(asked) == ["baseline", "granikv"] and [v for _, _, v in fake_resident.log if v][-2:] == ["host"] * 2
    row = json.loads((tmp_path / "regimes_flashinfer.json").read_text())["rows"][0]
    assert row["host_calls_granikv"] == {"cudaGraphLaunch": [1.0, 45.0]} and row["gpu_idle_us_granikv"] is None
    assert [p["keep"] for p in fake_resident.probes if p] == [None, None]  # traces not kept unless asked
    fake_resident.probes.clear()
    assert regimes.main(argv + ["--keep-host-traces"]) == 0
    kept = [p["keep"] for p in fake_resident.probes if p]
    assert kept == [str(tmp_path / "traces" / f"qwen2.5-7b_short1k_3sharers_{c}_host.trace.json.gz")
                    for c in ("baseline", "granikv")]


def test_planning_verdict_rests_on_idle_evidence(rep):
    row = dict(speedup=2.0, floor_speedup=3.0, floor_fraction=0.95, plan_us_p50=100.0, plan_us_p99=150.0)
    assert "plan p50 > 30 us" in rep.verdicts(row) and "plan p99 > 80 us" in rep.verdicts(row)
    assert not rep.verdicts(dict(row, gpu_idle_us_baseline=10.0, gpu_idle_us_granikv=14.0))  # GPU never waits
    assert "plan p50 > 30 us" in rep.verdicts(dict(row, gpu_idle_us_baseline=10.0, gpu_idle_us_granikv=16.0))
    # the timed estimates decide where both engines have one (the probe stretched one engine's step)
    probed = dict(row, gpu_idle_us_baseline=393.0, gpu_idle_us_granikv=2052.0)
    assert "plan p50 > 30 us" in rep.verdicts(dict(probed, gpu_idle_us_baseline_timed=724.0,
                                                    gpu_idle_us_granikv_timed=836.0))
    assert not rep.verdicts(dict(probed, gpu_idle_us_baseline_timed=724.0, gpu_idle_us_granikv_timed=727.0))
    assert "plan p50 > 30 us" in rep.verdicts(dict(probed, gpu_idle_us_baseline_timed=724.0))  # one side: probe


def test_idle_basis_sets_the_timed_estimate_aside_where_prefill_shares_the_steps(rep):
    """32-layer short1k_3sharers at 0d9754e: stock's TPOT p50 17.4 ms against its probed step of
    11.5 ms (prefill chunks in the decode's steps); the timed estimate read 6.4 / 7.1 ms of idle."""
    row = dict(speedup=1.0, floor_speedup=1.2, floor_fraction=0.95, plan_us_p50=40.0, plan_us_p99=60.0,
               baseline_tpot_p50_ms=17.40, gpu_busy_us_baseline=11032.0, gpu_idle_us_baseline=483.0,
               granikv_tpot_p50_ms=18.11, gpu_busy_us_granikv=11045.0, gpu_idle_us_granikv=485.0)
    for side in ("baseline", "granikv"):
        row[f"gpu_idle_us_{side}_timed"] = rep.timed_idle_us(row, side)
    assert rep.idle_basis(row) == "probe" and not rep.verdicts(row)  # the probe: 485 against 483 µs
    assert "judged by the probe" in rep.markdown_table([dict(row, model="m", backend="b", workload="w")])
    # the 4-layer forest probed at the middle: stock's TPOT within its probed step, the timed figures hold
    forest = dict(row, baseline_tpot_p50_ms=3.55, gpu_busy_us_baseline=3372.0, gpu_idle_us_baseline=487.0,
                  granikv_tpot_p50_ms=2.93, gpu_busy_us_granikv=2770.0, gpu_idle_us_granikv=1168.0)
    for side in ("baseline", "granikv"):
        forest[f"gpu_idle_us_{side}_timed"] = rep.timed_idle_us(forest, side)
    assert rep.idle_basis(forest) == "timed" and not rep.verdicts(forest)  # 160 against 178 µs
    assert "plan p50 > 30 us" in rep.verdicts(dict(forest, gpu_idle_us_granikv_timed=190.0))
    assert rep.idle_basis(dict(row, gpu_idle_us_baseline=None, gpu_idle_us_baseline_timed=None)) is None


def test_idle_basis_sets_the_timed_estimate_aside_where_granikvs_tpot_holds_prefill(rep):
    """Qwen2.5-7B hom16k_x64 at 7205f09: stock's TPOT p50 1.06x its probed step, GraniKV's 1.20x
    (its shorter decode step, the same prefill chunks); the timed estimate read 1,941 µs of idle
    per step for GraniKV against its probe's 289."""
    row = dict(speedup=1.5, floor_speedup=1.6, floor_fraction=0.94, plan_us_p50=25.1, plan_us_p99=411.3,
               baseline_tpot_p50_ms=14.96, gpu_busy_us_baseline=13547.5, gpu_idle_us_baseline=589.7,
               granikv_tpot_p50_ms=10.07, gpu_busy_us_granikv=8128.8, gpu_idle_us_granikv=288.9)
    for side in ("baseline", "granikv"):
        row[f"gpu_idle_us_{side}_timed"] = rep.timed_idle_us(row, side)
    assert row["gpu_idle_us_granikv_timed"] > row["gpu_idle_us_baseline_timed"] + 500  # the estimate's verdict
    assert rep.idle_basis(row) == "probe" and not rep.verdicts(row)  # the probe: 289 against 590 µs
    # GraniKV's TPOT within its probed step: the timed figures decide, and here they miss
    within = dict(row, granikv_tpot_p50_ms=9.60)  # 1.14x its probed step: 1,471 against 1,412 µs
    within["gpu_idle_us_granikv_timed"] = rep.timed_idle_us(within, "granikv")
    assert rep.idle_basis(within) == "timed" and "plan p99 > 80 us" in rep.verdicts(within)


def test_the_fp8_model_serves_the_same_config_on_an_fp8_cache():
    m = {x.name: x for x in regime_grid.MODELS}["llama-3.1-8b+fp8_e4m3"]
    assert m.config() == {x.name: x for x in regime_grid.MODELS}["llama-3.1-8b"].config()
    assert m.engine_args()["kv_cache_dtype"] == "fp8_e4m3"
    kw = regimes_mod.engine_kwargs(m, "triton", "granikv", {})
    assert kw["kv_cache_dtype"] == "fp8_e4m3" and kw["enable_granikv"] is True
    assert regimes_mod.engine_kwargs(m, "triton", "baseline", {})["kv_cache_dtype"] == "fp8_e4m3"
    rows = {r.name for r in regime_grid.default_grid() if r.model == m.name}
    assert rows == {"hom16k_x64", "forest16", "agent_loop_10k_x24", "no_sharing_1k_x64"}
    bf16 = next(r for r in regime_grid.default_grid() if r.key == "llama-3.1-8b/hom16k_x64")
    fp8 = next(r for r in regime_grid.default_grid() if r.key == "llama-3.1-8b+fp8_e4m3/hom16k_x64")
    assert regime_grid.estimate_s(fp8, m) < regime_grid.estimate_s(bf16, regime_grid.MODELS[0])  # half the KV bytes


def test_hybrid_and_moe_models_and_the_backends_they_serve_on():
    """gpt-oss-20b: 12 of its 24 layers windowed (128 tokens), served on triton only (SGLang
    refuses flashinfer for it): a flashinfer grid skips its rows with that reason, a triton grid
    keeps them, and both engines run without SGLang's hybrid SWA pool. Qwen3-30B-A3B: every
    expert counted in the weights a decode step reads (the row estimate), not one MLP."""
    by = {x.name: x for x in regime_grid.MODELS}
    oss, q3 = by["gpt-oss-20b"], by["qwen3-30b-a3b"]
    cfg = oss.config()
    assert cfg["layer_types"].count("sliding_attention") == 12 and cfg["sliding_window"] == 128
    assert "quantization_config" not in cfg  # dummy weights are bf16
    assert regime_grid.model_facts(cfg)["params"] == pytest.approx(20.9e9, rel=0.02)
    assert regime_grid.model_facts(q3.config())["params"] == pytest.approx(30.5e9, rel=0.02)
    for side in ("baseline", "granikv"):
        assert regimes_mod.engine_kwargs(oss, "triton", side, {})["disable_hybrid_swa_memory"] is True
    grid = regime_grid.default_grid()
    fi = regime_grid.select(grid, models=[oss.name, q3.name], backend="flashinfer")
    assert {r.model for r in fi.rows} == {q3.name}
    assert {k for k, _ in fi.skipped} == {r.key for r in grid if r.model == oss.name}
    assert all("triton only, not flashinfer" in why for _, why in fi.skipped)
    tr = regime_grid.select(grid, models=[oss.name], backend="triton")
    assert {r.name for r in tr.rows} == {"hom16k_x64", "forest16", "agent_loop_10k_x24", "no_sharing_1k_x64"}
    assert not tr.skipped
    assert {r.name for r in regime_grid.select(grid, models=[q3.name]).rows} == {"hom16k_x64", "no_sharing_1k_x64"}


def test_also_stock_adds_a_third_engine_taking_turns_with_its_own_backend(regimes, fake_resident, tmp_path):
    """--backend fa3 --also-stock flashinfer: GraniKV behind fa3 against stock fa3 (ceiling and
    floor from it), stock flashinfer beside both in every repeat; each engine runs once in every
    position over three repeats; the three pools are capped so they fit one GPU."""
    tps = {"baseline": [1000.0, 1010.0, 990.0], "granikv": [3000.0, 2900.0, 3100.0],
           "stock_flashinfer": [1100.0, 1090.0, 1120.0]}

    def answer(job, tags, k):
        v = 5000.0 if tags["variant"] == "ceiling" else tps[job["config"]][k]
        return _rec(job["config"], tags["regime"], v, tags["variant"], model=job["model"], backend=job["backend"])

    fake_resident.answer = answer
    argv = ["--backend", "fa3", "--also-stock", "flashinfer", "--models", "qwen2.5-7b", "--rows", "short1k_3sharers",
            "--out", str(tmp_path), "--time-budget-s", "0"]
    assert regimes.main(argv) == 0
    log = [c for c, r, v in fake_resident.log if r == "short1k_3sharers" and v == "main"]
    assert log == ["baseline", "granikv", "stock_flashinfer", "granikv", "stock_flashinfer", "baseline",
                   "stock_flashinfer", "baseline", "granikv"]
    assert [c for c, r, v in fake_resident.log if v == "ceiling"] == ["baseline"]
    doc = json.loads((tmp_path / "regimes_fa3.json").read_text())
    kw = doc["meta"]["engine_kwargs"]
    assert kw["qwen2.5-7b/fa3/baseline"]["attention_backend"] == "fa3"
    assert kw["qwen2.5-7b/fa3/granikv"]["attention_backend"] == "fa3" and kw["qwen2.5-7b/fa3/granikv"]["enable_granikv"]
    other = kw["qwen2.5-7b/fa3/stock_flashinfer"]
    assert other["attention_backend"] == "flashinfer" and "enable_granikv" not in other
    assert {k["max_total_tokens"] for k in kw.values()} == {_three_engine_pool("qwen2.5-7b")}
    (row,) = doc["rows"]
    assert row["backend"] == "fa3" and row["speedup"] == pytest.approx(3.0)
    fi = row["also_stock"]["flashinfer"]
    assert fi["out_tok_s"] == 1100.0 and fi["vs_stock"] == pytest.approx(1.1)
    assert fi["granikv_speedup"] == pytest.approx(3000 / 1100, abs=1e-4)
    assert fi["spread"] == pytest.approx(30 / 1100, abs=1e-4)
    md = (tmp_path / "regimes_fa3.md").read_text()
    assert "stock flashinfer tok/s (÷ stock)" in md and "1,100 (1.100x)" in md and "2.727x" in md


def test_also_stock_refuses_unknown_and_own_backends(regimes, tmp_path, capsys):
    for extra in (["--also-stock", "bogus"], ["--backend", "fa3", "--also-stock", "fa3"]):
        assert regimes.main(["--out", str(tmp_path), "--dry-run", *extra]) == 2
        assert "--also-stock" in capsys.readouterr().err


def test_also_granikv_adds_a_graniKV_engine_with_other_flags_taking_turns(regimes, fake_resident, tmp_path):
    """--also-granikv probe:granikv_clock_probe=paged_too: a second GraniKV engine whose GraniKV
    flags are the main one's (--engine-arg) with the variant's on top, taking its turn in every
    repeat; the row gets its tok/s, spread, ratios to stock and to the main GraniKV engine, and
    what it said of its decode steps; the md gets its columns."""
    tps = {"baseline": [1000.0, 1010.0, 990.0], "granikv": [3000.0, 2900.0, 3100.0],
           "granikv_probe": [3300.0, 3200.0, 3250.0]}
    gkv = dict(after=dict(attention=dict(plan_us_p50=21.0)),
               delta=dict(attention=dict(planned_steps=10, plan_us_total=200.0, decode_steps=10, steady_replays=7,
                                         steps_per_path={"cascade": 6, "paged": 4, "fused": 0})))

    def answer(job, tags, k):
        v = 5000.0 if tags["variant"] == "ceiling" else tps[job["config"]][k]
        return _rec(job["config"], tags["regime"], v, tags["variant"], model=job["model"], backend=job["backend"],
                    gkv=gkv if job["config"] == "granikv_probe" else None)

    fake_resident.answer = answer
    argv = ["--also-granikv", "probe:granikv_clock_probe=paged_too,granikv_launch_table=off", "--models",
            "qwen2.5-7b", "--rows", "short1k_3sharers", "--engine-arg", "granikv_view_plan=reuse",
            "--engine-arg", "granikv_clock_probe=model_paths", "--out", str(tmp_path), "--time-budget-s", "0"]
    assert regimes.main(argv) == 0
    log = [c for c, r, v in fake_resident.log if r == "short1k_3sharers" and v == "main"]
    assert log == ["baseline", "granikv", "granikv_probe", "granikv", "granikv_probe", "baseline",
                   "granikv_probe", "baseline", "granikv"]
    doc = json.loads((tmp_path / "regimes_flashinfer.json").read_text())
    kw = doc["meta"]["engine_kwargs"]
    main, probe, stock = (kw[f"qwen2.5-7b/flashinfer/{c}"] for c in ("granikv", "granikv_probe", "baseline"))
    assert main["granikv_clock_probe"] == "model_paths" and "granikv_launch_table" not in main
    assert probe["enable_granikv"] and probe["granikv_clock_probe"] == "paged_too"
    assert probe["granikv_launch_table"] == "off" and probe["granikv_view_plan"] == "reuse"
    assert "enable_granikv" not in stock and not any(k.startswith("granikv_") for k in stock)
    assert {k["max_total_tokens"] for k in kw.values()} == {_three_engine_pool("qwen2.5-7b")}
    assert doc["meta"]["also_granikv"] == {"probe": {"granikv_clock_probe": "paged_too", "granikv_launch_table": "off"}}
    (row,) = doc["rows"]
    assert row["speedup"] == pytest.approx(3.0) and row["dispatch_paths"] == {}  # the main engine's own
    v = row["also_granikv"]["probe"]
    assert v["out_tok_s"] == 3250.0 and v["speedup"] == pytest.approx(3.25) and v["vs_granikv"] == pytest.approx(3250 / 3000, abs=1e-4)
    assert v["spread"] == pytest.approx(100 / 3250, abs=1e-4)
    assert v["dispatch_paths"] == {"cascade": 6, "paged": 4} and v["steady_replays"] == 7 and v["plan_us_mean_row"] == 20.0
    md = (tmp_path / "regimes_flashinfer.md").read_text()
    assert "GraniKV probe tok/s (÷ stock)" in md and "3,250 (3.250x)" in md and "1.083x" in md
    assert "cascade 6, paged 4" in md
    # a merge keeps the variants' flags
    records, meta = regimes.report.merge_docs([doc])
    assert meta["also_granikv"] == doc["meta"]["also_granikv"]
    assert regimes.report.assemble(records, meta)[0]["also_granikv"]["probe"]["out_tok_s"] == 3250.0


@pytest.mark.parametrize("value, why", [
    ("probe", "expected NAME:KEY=VALUE"),
    ("probe:", "expected NAME:KEY=VALUE"),
    ("p-x:granikv_clock_probe=paged_too", "expected NAME:KEY=VALUE"),
    ("probe:max_total_tokens=1000", "max_total_tokens not a GraniKV flag"),
    ("probe:enable_granikv=False", "enable_granikv not a GraniKV flag"),
    ("probe:granikv_clock_probe", "is not key=value"),
])
def test_also_granikv_refuses_what_would_not_be_an_ab_of_granikv_flags(regimes, tmp_path, capsys, value, why):
    assert regimes.main(["--out", str(tmp_path), "--dry-run", "--also-granikv", value]) == 2
    err = capsys.readouterr().err
    assert "--also-granikv" in err and why in err


def test_also_granikv_twice_the_same_name_is_refused(regimes, tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--dry-run", "--also-granikv", "a:granikv_clock_probe=paged_too",
            "--also-granikv", "a:granikv_launch_table=off"]
    assert regimes.main(argv) == 2 and "given twice" in capsys.readouterr().err


def _three_engine_pool(name):
    model = {m.name: m for m in regime_grid.MODELS}[name]
    return min(int(model.engine_args()["max_total_tokens"]), regimes_mod.three_engine_pool_tokens(model))


def test_three_engines_share_a_pool_cap_in_kv_bytes():
    """Three engines or more on one GPU: each pool is capped at 20 GiB of KV, in the model's own
    tokens; Llama-3.1-8B at 160K tokens, the 4-layer model (8x fewer bytes a token) keeps its
    own cap, which its long rows need (at 160K tokens its forest row retracted requests)."""
    by = {m.name: m for m in regime_grid.MODELS}
    assert regimes_mod.three_engine_pool_tokens(by["llama-3.1-8b"]) == 163840
    four = by["llama-3.1-8b-4layers"]
    assert regimes_mod.three_engine_pool_tokens(four) == 8 * 163840
    kw = regimes_mod.engine_kwargs(four, "flashinfer", "baseline", {}, engines=3)
    assert kw["max_total_tokens"] == four.engine_args()["max_total_tokens"] == regime_grid.HOST_BOUND_POOL_TOKENS
    assert regimes_mod.engine_kwargs(by["llama-3.1-8b"], "flashinfer", "granikv", {}, engines=3)["max_total_tokens"] == 163840
    assert regimes_mod.engine_kwargs(by["llama-3.1-8b"], "flashinfer", "granikv", {}, engines=2)["max_total_tokens"] == (
        regime_grid.LLAMA_POOL_TOKENS)
