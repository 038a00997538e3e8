"""CPU tests of the GPU soak (benchmark/reliability/soak*.py): the request plan (count, abort
fraction, determinism, workload mix, sliding family windows, sample), the log scanner, the
metrics parser, the output comparison, the checks and the JSON / markdown writer. Nothing is
launched and SGLang is not imported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.harness import server_proc
from benchmark.reliability import soak, soak_checks, soak_load, soak_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    return soak_load.build_plan(2000, seed=0, abort_frac=0.1, sample_size=48)


# ---- plan ----------------------------------------------------------------------------------


def test_plan_has_the_requested_count_and_consistent_jobs(plan):
    assert len(plan.requests) == 2000
    assert [r.idx for r in plan.requests] == list(range(2000))
    flat = [i for job in plan.jobs for i in job]
    assert sorted(flat) == list(range(2000))  # every request in exactly one job
    for j, job in enumerate(plan.jobs):
        reqs = [plan.requests[i] for i in job]
        assert all(r.job == j for r in reqs)
        assert [r.turn for r in reqs] == list(range(len(reqs)))  # agent turns in order
        assert len({(r.family, r.agent) for r in reqs}) == 1  # one agent per session
        assert len(reqs) == 1 or reqs[0].kind == "agent_loop"


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.25])
def test_abort_fraction_is_exact_and_kinds_are_balanced(frac):
    p = soak_load.build_plan(600, seed=3, abort_frac=frac, sample_size=24)
    aborted = [r for r in p.requests if r.abort]
    assert abs(len(aborted) / 600 - frac) <= 1 / 600
    counts = [sum(r.abort == k for r in aborted) for k in soak_load.ABORT_KINDS]
    assert max(counts) - min(counts) <= 1
    for r in aborted:
        assert not r.sample
        if r.abort == "before_first_token":
            assert r.abort_after == 0
        elif r.abort == "mid_stream":
            assert 1 <= r.abort_after <= max(1, r.max_new_tokens // 2)
        else:
            assert 0 <= r.abort_after <= max(1, r.max_new_tokens // 2)


def test_plan_is_deterministic_in_the_seed(plan):
    again = soak_load.build_plan(2000, seed=0, abort_frac=0.1, sample_size=48)
    assert again.requests == plan.requests and again.jobs == plan.jobs and again.sample == plan.sample
    assert all(again.first_prompt(r) == plan.first_prompt(r) for r in plan.requests[:300])
    other = soak_load.build_plan(2000, seed=1, abort_frac=0.1, sample_size=48)
    assert [r.abort for r in other.requests] != [r.abort for r in plan.requests]
    assert other.first_prompt(other.requests[0]) != plan.first_prompt(plan.requests[0])


def test_plan_mixes_the_multi_agent_workloads(plan):
    by_kind = plan.counts()["by_kind"]
    assert set(by_kind) == {"shared", "agent_loop", "no_sharing"}
    for kind, share in soak_load.MIX.items():
        assert abs(by_kind[kind] / 2000 - share) < 0.01
    prefixes = {f.prefix_len for f in plan.families.values() if f.kind == "shared"}
    assert prefixes == set(soak_load.SHARED_PREFIXES)
    assert all(plan.jobs)  # no empty job
    sessions = [len(j) for j in plan.jobs if plan.requests[j[0]].kind == "agent_loop"]
    assert max(sessions) == max(soak_load.AGENT_TURNS) and min(sessions) >= 1
    assert {r.max_new_tokens for r in plan.requests} == set(soak_load.OUT_CHOICES)


def test_prompts_share_their_family_prefix_and_agent_turns_grow(plan):
    for r in plan.requests[:400]:
        fam = plan.families[r.family]
        prompt = plan.first_prompt(r)
        if fam.kind == "no_sharing":
            assert plan.prefix_of(r) == [] and len(prompt) in soak_load.NO_SHARING_LENS
        else:
            assert prompt[: fam.prefix_len] == plan.prefix_of(r)
            assert len(prompt) > fam.prefix_len
    job = next(j for j in plan.jobs if len(j) >= 3)
    r0, r1 = plan.requests[job[0]], plan.requests[job[1]]
    ctx = plan.prompt(r0)
    out = [7] * r0.max_new_tokens
    nxt = plan.prompt(r1, ctx, out)
    assert nxt[: len(ctx)] == ctx and nxt[len(ctx): len(ctx) + len(out)] == out
    assert len(nxt) == len(ctx) + len(out) + soak_load.AGENT_TOOL


def test_families_slide_so_prefixes_go_cold(plan):
    """Early shared requests use the first families, late ones the last: old prefixes are left
    to eviction, and the distinct KV the plan writes exceeds the default COLD pool."""
    shared = [r for r in plan.requests if r.kind == "shared"]
    fam = lambda r: int(r.family[len("shared"):])  # noqa: E731
    first, last = shared[:100], shared[-100:]
    assert max(map(fam, first)) < soak_load.SHARED_WINDOW + 1
    assert min(map(fam, last)) >= soak_load.SHARED_FAMILIES - soak_load.SHARED_WINDOW - 1
    budget = soak_load.kv_budget(98304, 0.25)
    assert budget == {"slots": 98304, "hot": 24576, "cold": 73728}
    kv = plan.kv_tokens_distinct()
    assert kv["shared_prefix_tokens"] > budget["cold"] and kv["total"] > 5 * budget["cold"]


def test_sample_is_first_turns_with_sharers_and_never_aborted(plan):
    assert len(plan.sample) == 48 and plan.sample == sorted(plan.sample)
    reqs = [plan.requests[i] for i in plan.sample]
    assert all(r.sample and r.turn == 0 and r.abort is None for r in reqs)
    assert sum(r.sample for r in plan.requests) == 48
    kinds = {r.kind for r in reqs}
    assert kinds == {"shared", "agent_loop", "no_sharing"}
    for fam in {r.family for r in reqs if r.kind != "no_sharing"}:
        assert sum(r.family == fam for r in reqs) >= 2  # sharers: the prefix gets promoted


def test_describe_plan_lists_budget_and_shapes(plan):
    text = "\n".join(soak_load.describe_plan(plan, soak_load.kv_budget(98304, 0.25), shapes=5))
    assert "2,000 requests" in text and "COLD 73,728" in text and "eviction is forced" in text
    assert text.count("\n  #") == 5


def test_bad_plan_arguments_are_rejected():
    with pytest.raises(ValueError):
        soak_load.build_plan(0)
    with pytest.raises(ValueError):
        soak_load.build_plan(100, abort_frac=1.0)


# ---- log, metrics, outputs -------------------------------------------------------------------

LOG = """\
[2026-11-29 10:00:00] server_args=ServerArgs(model_path='/tmp/m', enable_granikv=True)
[2026-11-29 10:00:05] Prefill batch, #new-seq: 4, #new-token: 8192, token usage: 0.10, cuda graph: False
[2026-11-29 10:00:06] Decode batch, #running-req: 64, #token: 51234, token usage: 0.69, cuda graph: True
[2026-11-29 10:00:07] GraniKV: hot 18432/24576 (75.0%) in 4 extents, cold 70000/73728 (94.9%), promotions 9
[2026-11-29 10:00:08] GraniKV: hot 8192/24576 (33.3%) in 2 extents, cold 71000/73728 (96.3%), promotions 12
[2026-11-29 10:00:09] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 900
INFO:     127.0.0.1:5000 - "POST /generate HTTP/1.1" 200 OK
[2026-11-29 10:00:10] [http_server] Client disconnected: Request is disconnected from the client side (type 1).
[2026-11-29 10:00:11] Decode batch, #running-req: 12, #token: 9000, token usage: 0.91, cuda graph: True
Traceback (most recent call last):
  File "scheduler.py", line 1, in run
RuntimeError: boom
[2026-11-29 10:00:12] [http_server] Error: bad input
[2026-11-29 10:00:13] full memory leak detected! available_size=1
ERROR:    Exception in ASGI application
[2026-11-29 10:00:14] Health check failed. Server couldn't get a response
"""


def test_scan_log_lists_errors_and_peaks():
    s = soak_checks.scan_log(LOG.splitlines())
    assert s["errors"] == 6
    joined = "\n".join(s["error_lines"])
    for needle in ("Traceback", "RuntimeError: boom", "Error: bad input", "memory leak",
                   "Exception in ASGI", "Health check failed"):
        assert needle in joined
    assert "Client disconnected" not in joined and "server_args" not in joined
    assert s["error_lines"][0].startswith("10: Traceback")
    assert s["retractions"] == 1 and s["warnings"] == 0
    assert (s["granikv_hot_peak"], s["granikv_hot_capacity"]) == (18432, 24576)
    assert (s["granikv_cold_peak"], s["granikv_cold_capacity"]) == (71000, 73728)
    assert s["decode_token_usage_peak"] == pytest.approx(0.91)


def test_scan_log_ignore_and_line_offset():
    s = soak_checks.scan_log(LOG.splitlines(), ignore=[r"Exception in ASGI", r"Health check"], first_line=101)
    assert s["errors"] == 4 and s["ignored"] == 2
    assert s["error_lines"][0].startswith("110: ")
    assert soak_checks.scan_log(["all fine", "Decode batch, token usage: 0.20"])["errors"] == 0


def test_scan_server_log_splits_startup_from_serving(tmp_path):
    log = tmp_path / "server.log"
    boot = "ImportError: optional module xyz missing\nready\n"
    log.write_text(boot + "serving\nValueError: broken\n")
    s = soak_checks.scan_server_log(log, len(boot.encode()), log.stat().st_size, [])
    assert s["errors"] == 1 and s["error_lines"] == ["4: ValueError: broken"]
    assert s["startup_errors"] == 1 and s["scanned"]


def test_trim_log_keeps_head_tail_and_errors(tmp_path):
    log = tmp_path / "big.log"
    lines = [f"line {i} ok" for i in range(20000)]
    lines[10000] = "RuntimeError: in the middle"
    log.write_text("\n".join(lines) + "\n")
    soak_checks.trim_log(log, limit=40000)
    text = log.read_text()
    assert log.stat().st_size < 40000 * 1.2
    assert text.startswith("line 0 ok") and text.rstrip().endswith("line 19999 ok")
    assert "RuntimeError: in the middle" in text and "bytes cut" in text


def test_parse_metrics_sums_label_sets():
    text = """# HELP sglang:evicted_tokens_total x
# TYPE sglang:evicted_tokens_total counter
sglang:evicted_tokens_total{cache_type="GraniKVRadixCache",tp_rank="0"} 1500.0
sglang:evicted_tokens_total{cache_type="GraniKVRadixCache",tp_rank="1"} 500.0
sglang:num_aborted_requests_total{model_name="m"} 12
granikv:hot_used_tokens{tp_rank="0"} 4096
sglang:token_usage 0.5
"""
    m = server_proc.parse_metrics(text)
    assert m["sglang:evicted_tokens_total"] == 2000.0
    assert m["sglang:num_aborted_requests_total"] == 12 and m["granikv:hot_used_tokens"] == 4096
    assert m["sglang:token_usage"] == 0.5
    before = {"sglang:evicted_tokens_total": 500.0}
    d = soak_checks.metric_delta(m, before)
    assert d["cold_evicted_tokens"] == 1500.0 and d["retracted_requests"] is None


def test_numeric_delta_recurses():
    after = {"promotions": 10, "attention": {"decode_steps": 50, "last_reason": "x"}, "flag": True}
    before = {"promotions": 4, "attention": {"decode_steps": 20}}
    assert soak.counter_delta(after, before) == {"promotions": 6, "attention": {"decode_steps": 30}}


def test_compare_outputs():
    a = [[1, 2, 3], [4, 5, 6], [7, 8], None]
    b = [[1, 2, 3], [4, 9, 6], [7, 8], [1]]
    c = soak_checks.compare_outputs(a, b)
    assert c["n"] == 4 and c["identical"] == 2 and c["identical_pct"] == 50.0
    assert c["token_agreement_pct"] == pytest.approx(100 * (3 + 1 + 2) / (3 + 3 + 2 + 1), abs=0.01)
    p = soak_checks.compare_outputs([[1, 2, 3, 4]], [[1, 2]], prefix=True)
    assert p["identical"] == 1
    assert soak_checks.compare_outputs([], [])["identical_pct"] is None


# ---- checks and report ------------------------------------------------------------------------


def _result(**over):
    r = {
        "meta": {"command": "python3 -m benchmark.reliability.soak", "date": "2026-11-29",
                 "model": "llama-3.1-8b", "backend": "flashinfer", "concurrency": 64,
                 "abort_frac": 0.1, "seed": 0, "kv_budget": soak_load.kv_budget(98304, 0.25),
                 "server_commands": {"granikv": "python -m sglang.launch_server --enable-granikv"}},
        "plan": {"requests": 2000},
        "soak": {"sent": 2000, "served": 1800, "aborted": 200, "errors": 0, "abort_errors": 0,
                 "aborted_by_kind": {"before_first_token": 67, "mid_stream": 67, "endpoint": 66},
                 "seconds": 150.0, "error_examples": []},
        "servers": {"granikv": {
            "health": {"alive": True, "health": 200, "health_generate": 200},
            "idle_before": {"num_used_tokens": 0}, "idle_after": {"num_used_tokens": 0},
            "slots_leaked": 0,
            "post_flush": {"flushed": True, "num_used_tokens": 0, "hot_used_tokens": 0,
                           "cold_used_tokens": 0},
            "log": {"errors": 0, "scanned": True, "error_lines": []},
            "evictions": {"cold_evicted_tokens": 123456, "hot_evictions": 40},
            "granikv_delta": {"promotions": 77}, "hot_capacity": 24576, "cold_capacity": 73728,
            "peaks": {"hot_used_tokens": 24000, "cold_used_tokens": 73000}}},
        "identity": {"granikv_post_vs_baseline": {"identical_pct": 100.0},
                     "baseline_self": {"identical_pct": 100.0}},
        "durations": {"total_s": 420.0},
    }
    for k, v in over.items():
        r[k] = v
    return r


def test_evaluate_passes_a_clean_result():
    checks = soak_checks.evaluate(_result())
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]
    assert len(checks) == 10


@pytest.mark.parametrize("mutate,failing", [
    (lambda r: r["soak"].update(errors=1), "no failed request"),
    (lambda r: r["soak"].update(abort_errors=3), "aborts handled cleanly"),
    (lambda r: r["soak"].update(sent=1500), "all planned requests sent"),
    (lambda r: r["servers"]["granikv"]["health"].update(health_generate=503),
     "server healthy after the soak"),
    (lambda r: r["servers"]["granikv"].update(slots_leaked=12),
     "KV back to the idle level (slots leaked = 0)"),
    (lambda r: r["servers"]["granikv"]["post_flush"].update(hot_used_tokens=8),
     "flush_cache frees every slot"),
    (lambda r: r["servers"]["granikv"]["log"].update(errors=2), "no error in the server log"),
    (lambda r: r["servers"]["granikv"].update(evictions={"cold_evicted_tokens": 0, "hot_evictions": 0}),
     "eviction forced"),
    (lambda r: r["servers"]["granikv"].update(granikv_delta={}), "GraniKV promoted shared prefixes"),
    (lambda r: r["identity"]["granikv_post_vs_baseline"].update(identical_pct=97.9),
     "sample outputs identical to the baseline"),
    (lambda r: r.update(identity={}), "sample outputs identical to the baseline"),
])
def test_evaluate_flags_each_failure(mutate, failing):
    r = _result()
    mutate(r)
    bad = [c["name"] for c in soak_checks.evaluate(r) if not c["ok"]]
    assert bad == [failing]


def _edge(**over):
    e = {"empty_prompt": {"http_status": 400, "error": "empty"},
         "prompt_longer_than_context": {"http_status": 400, "error": "too long"},
         "huge_max_new_tokens": {"http_status": 200, "first_chunk": True, "finish": "abort"},
         "_health_after": {"alive": True, "health": 200}}
    e.update(over)
    return e


def test_edge_inputs_must_match_the_baseline():
    ok, detail = soak_checks.compare_edge(_edge(), _edge())
    assert ok and "empty_prompt -> 400 refused" in detail
    assert not soak_checks.compare_edge(_edge(empty_prompt={"http_status": 500, "error": "x"}), _edge())[0]
    assert not soak_checks.compare_edge(_edge(huge_max_new_tokens={"http_status": 400, "error": "x"}), _edge())[0]
    assert not soak_checks.compare_edge(_edge(empty_prompt={"http_status": 200, "output_ids": [1], "finish": "length"}),
                                 _edge(empty_prompt={"http_status": 200, "output_ids": [2], "finish": "length"}))[0]
    assert not soak_checks.compare_edge(_edge(_health_after={"alive": False}), _edge())[0]
    assert not soak_checks.compare_edge(_edge(), None)[0]
    r = _result()
    r["servers"]["granikv"]["edge_inputs"] = _edge()
    r["servers"]["baseline"] = {"edge_inputs": _edge(prompt_longer_than_context={"http_status": 200, "output_ids": []})}
    assert [c["name"] for c in soak_checks.evaluate(r) if not c["ok"]] == ["edge inputs handled as plain SGLang"]


def test_identity_pass_is_relative_to_the_baselines_own_agreement():
    r = _result(identity={"granikv_post_vs_baseline": {"identical_pct": 95.0},
                          "baseline_self": {"identical_pct": 95.0}})
    assert all(c["ok"] for c in soak_checks.evaluate(r))


def test_write_report_json_and_markdown(tmp_path):
    r = _result()
    r["checks"] = soak_checks.evaluate(r)
    r["ok"] = all(c["ok"] for c in r["checks"])
    r["servers"]["granikv"]["log"]["error_lines"] = ["12: RuntimeError: boom"]
    paths = soak_report.write_report(str(tmp_path / "out"), r)
    assert [p.name for p in paths] == ["soak.json", "soak.md"]
    back = json.loads(paths[0].read_text())
    assert back["soak"]["served"] == 1800 and back["ok"] is True
    md = paths[1].read_text()
    assert md.startswith("# GraniKV soak: PASS")
    for needle in ("| requests sent | 2,000 |", "| requests served (complete output) | 1,800 |",
                   "| errors (non-aborted requests) | 0 |", "| promotions | 77 |",
                   "| COLD evicted tokens (sglang:evicted_tokens_total) | 123,456 |",
                   "| HOT evictions (nodes) | 40 |", "| slots leaked (KV used at idle, after - before) | 0 |",
                   "|   aborted: endpoint | 66 |", "24,000 / 24,576",
                   "| identical outputs, GraniKV vs baseline (%) | 100.00 |",
                   "| sample outputs identical to the baseline | pass |", "RuntimeError: boom",
                   "--enable-granikv"):
        assert needle in md, needle
    lines = soak_report.summary_lines(r)
    assert lines[-1] == "RESULT: PASS" and any(ln.startswith("PASS  no failed request") for ln in lines)


def test_markdown_of_a_failed_run_names_the_failure():
    r = _result(failure="granikv phase: RuntimeError: server died\nlog tail line")
    r["checks"] = soak_checks.evaluate(r)
    r["ok"] = False
    md = soak_report.markdown(r)
    assert md.startswith("# GraniKV soak: FAIL")
    assert "    granikv phase: RuntimeError: server died" in md and "    log tail line" in md


# ---- command line ------------------------------------------------------------------------------


def test_server_commands_differ_by_granikv_flags_and_budget():
    args = soak.parse_args(["--hot-fraction", "0.3", "--granikv-arg", "--granikv-log-interval 20",
                            "--server-arg", "--chunked-prefill-size 8192"])
    g = soak.server_command(args, "/m", 30000, granikv=True)
    b = soak.server_command(args, "/m", 30002, granikv=False)
    assert g[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for flags in (g, b):
        for f in ("--load-format", "--skip-tokenizer-init", "--enable-metrics", "--max-total-tokens",
                  "--chunked-prefill-size"):
            assert f in flags
        assert flags[flags.index("--attention-backend") + 1] == "flashinfer"
    # GraniKV: all slots (HOT + COLD); baseline: the COLD part, the same scheduler budget
    assert g[g.index("--max-total-tokens") + 1] == "98304"
    assert b[b.index("--max-total-tokens") + 1] == str(98304 - int(98304 * 0.3))
    extra = [x for x in g if x not in b]
    assert extra == ["30000", "98304", "--enable-granikv", "--granikv-hot-fraction", "0.3",
                     "--granikv-log-interval", "20"]


def test_dry_run_prints_the_plan_and_launches_nothing():
    out = subprocess.run([sys.executable, "-m", "benchmark.reliability.soak", "--dry-run", "--requests", "300"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "plan: 300 requests" in out.stdout and "sglang.launch_server" in out.stdout
    assert "--enable-granikv" in out.stdout and "first 8 requests" in out.stdout


def test_numeric_delta_drops_means_maxima_and_rates():
    after = {"attention": {"plan_us_total": 900.0, "planned_steps": 30, "plan_us_mean": 30.0, "plan_us_max": 80.0,
                           "hot_hit_rate": 0.5, "groups_per_step": 1.0, "max_compare_diff": 0.1}}
    before = {"attention": {"plan_us_total": 300.0, "planned_steps": 10, "plan_us_mean": 30.0, "hot_hit_rate": 0.9}}
    assert soak.counter_delta(after, before) == {"attention": {"plan_us_total": 600.0, "planned_steps": 20}}
