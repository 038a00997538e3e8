"""benchmark/gpu_suite.py and benchmark/smoke.py on CPU: the parts' commands, the summary and its
merge, a failing part, and the smoke checks on a real /metrics text of GraniKV's exporter."""

import json
import sys

import pytest

from benchmark.harness.engine_proc import REPO_ROOT as ROOT


@pytest.fixture(scope="module")
def suite():
    from benchmark import gpu_suite

    return gpu_suite


@pytest.fixture(scope="module")
def smoke():
    from benchmark import smoke

    return smoke


def test_parts_and_their_commands(suite, tmp_path):
    args = suite.parse_args(["--out", str(tmp_path), "--grid-backends", "flashinfer,triton", "--grid-models",
                             "llama-3.1-8b", "--grid-budget-s", "300"])
    assert args.parts == list(suite.PARTS)  # all
    cmds = suite.part_commands(args, tmp_path)
    assert cmds["tests"][0][1:5] == ["-m", "pytest", "-m", "gpu"]
    # every benchmark part runs as a module (from the repository root: run_commands' cwd)
    assert cmds["correctness"][0][:3] == [sys.executable, "-m", "benchmark.correctness.check"]
    assert all(c[:3] == [sys.executable, "-m", "benchmark.multi_agent.regimes"] for c in cmds["grid"])
    assert [c[c.index("--backend") + 1] for c in cmds["grid"]] == ["flashinfer", "triton"]
    g = cmds["grid"][0]
    assert g[g.index("--time-budget-s") + 1] == "200" and g[g.index("--models") + 1] == "llama-3.1-8b"
    t = cmds["grid"][1]
    assert t[t.index("--time-budget-s") + 1] == "100"  # the grid's budget, split: it fits what it is given
    assert str(tmp_path / "grid") in g and str(tmp_path / "correctness") in cmds["correctness"][0]
    with pytest.raises(SystemExit):
        suite.parse_args(["--parts", "tests,bogus"])


def test_default_budgets_split_the_suites_grid_and_correctness_runs_at_scale_2_three_at_a_time(suite, tmp_path):
    args = suite.parse_args(["--out", str(tmp_path)])
    cmds = suite.part_commands(args, tmp_path)
    budgets = [float(c[c.index("--time-budget-s") + 1]) for c in cmds["grid"]]
    assert budgets == [320.0, 160.0] and sum(budgets) == suite.GRID_BUDGET_S  # flashinfer first
    assert cmds["correctness"][0][-4:] == ["--scale", "2", "--parallel", "3"]
    assert all(c[c.index("--models") + 1] == suite.GRID_MODELS for c in cmds["grid"])
    every = suite.parse_args(["--out", str(tmp_path), "--grid-models", "all"])
    assert all("--models" not in c for c in suite.part_commands(every, tmp_path)["grid"])
    one = suite.parse_args(["--out", str(tmp_path), "--grid-backends", "triton"])
    assert suite.grid_budgets(one) == [suite.GRID_BUDGET_S]
    three = suite.parse_args(["--out", str(tmp_path), "--grid-backends", "flashinfer,triton,fa3"])
    assert suite.grid_budgets(three) == [320.0, 80.0, 80.0]
    mine = suite.parse_args(["--out", str(tmp_path), "--grid-budget-s", "100", "--correctness-args", ""])
    assert suite.grid_budgets(mine) == [67.0, 33.0]
    assert suite.part_commands(mine, tmp_path)["correctness"][0][-1] == str(tmp_path / "correctness")
    assert all("--host-probe-steps" not in c for c in cmds["grid"])
    host = suite.parse_args(["--out", str(tmp_path), "--grid-host-probe-steps", "16"])
    assert all(c[c.index("--host-probe-steps") + 1] == "16" and "--keep-host-traces" in c
               for c in suite.part_commands(host, tmp_path)["grid"])
    reuse = suite.parse_args(["--out", str(tmp_path), "--grid-engine-arg", "granikv_view_plan=reuse"])
    assert all(c[c.index("--engine-arg") + 1] == "granikv_view_plan=reuse"
               for c in suite.part_commands(reuse, tmp_path)["grid"])
    assert suite.grid_scope(reuse) == dict(suite.grid_scope(host), engine_args=["granikv_view_plan=reuse"])


def test_grid_also_stock_goes_to_every_other_backends_grid(suite, tmp_path):
    args = suite.parse_args(["--out", str(tmp_path), "--grid-backends", "flashinfer,fa3", "--grid-also-stock", "fa3"])
    fi, fa3 = suite.part_commands(args, tmp_path)["grid"]
    assert fi[fi.index("--also-stock") + 1] == "fa3" and "--also-stock" not in fa3


def test_a_run_writes_its_summary_and_a_failing_part_fails_it(suite, tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(suite, "run_commands", lambda cmds: ran.append(cmds) or dict(passed=len(ran) == 1))
    assert suite.main(["--parts", "tests,correctness", "--out", str(tmp_path), "--commit", "abc"]) == 1
    doc = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert doc["commit"] == "abc" and [p["name"] for p in doc["parts"]] == ["tests", "correctness"]
    assert [p["passed"] for p in doc["parts"]] == [True, False]
    assert all(p["wall_s"] >= 0 for p in doc["parts"]) and "-m benchmark.gpu_suite" in doc["command"]
    assert "correctness: FAILED" in capsys.readouterr().out

    def broken():
        raise RuntimeError("no GPU")

    res = suite.run_part("smoke", broken)  # a part that raises is a failed part, not a crash
    assert res["passed"] is False and "no GPU" in res["error"]


def test_the_grid_part_records_the_rows_it_did_not_run(suite, tmp_path, monkeypatch, capsys):
    """The grid part passes on its commands' exit status and says which rows its backends left
    out and why (the regimes JSON's ``meta.skipped``); a backend without a JSON adds none."""
    def fake_grid(cmds):
        grid = tmp_path / "grid"
        meta = dict(skipped=[["llama-3.1-8b/three_unequal", "its estimate no longer fits the time budget"]])
        (grid / "regimes_flashinfer.json").write_text(json.dumps(dict(meta=meta, rows=[])))
        return dict(passed=True, exit_codes=[0] * len(cmds))

    monkeypatch.setattr(suite, "run_commands", fake_grid)
    assert suite.main(["--parts", "grid", "--out", str(tmp_path), "--commit", "abc"]) == 0
    assert "1 grid rows not run: flashinfer:llama-3.1-8b/three_unequal" in capsys.readouterr().out
    part = json.loads((tmp_path / "gpu_suite.json").read_text())["parts"][0]
    assert part["passed"] is True
    assert part["rows_not_run"] == [["flashinfer", "llama-3.1-8b/three_unequal",
                                     "its estimate no longer fits the time budget"]]


def test_merge_keeps_each_parts_run(suite, tmp_path):
    a = dict(commit="c1", date="d1", parts=[dict(name="tests", wall_s=1, passed=True),
                                            dict(name="grid", wall_s=2, passed=False)])
    b = dict(commit="c2", date="d2", sglang_version="0.5.17", parts=[dict(name="grid", wall_s=3, passed=True)])
    m = suite.merge([a, b])
    assert [(p["name"], p["commit"], p["passed"]) for p in m["parts"]] == [("tests", "c1", True), ("grid", "c2", True)]
    assert m["passed"] and m["commit"] == "c2" and len(m["runs"]) == 2
    assert not suite.merge([b, a])["passed"]  # the later run's grid failed


def test_merge_keeps_grid_parts_of_other_scopes_and_each_parts_gpu(suite):
    cmd = "python3 -m benchmark.gpu_suite --parts {} --grid-backends flashinfer --grid-models {}"
    a = dict(commit="c1", gpu="H100", command=cmd.format("tests,grid", "m1"),
             parts=[dict(name="tests", wall_s=1, passed=True), dict(name="grid", wall_s=2, passed=True)])
    b = dict(commit="c2", gpu="H200", command=cmd.format("grid", "m2"),  # scope read back from the command
             parts=[dict(name="grid", wall_s=3, passed=True)])
    c = dict(commit="c3", gpu="H200", parts=[dict(name="grid", wall_s=4, passed=False, scope=dict(
        backends=["flashinfer"], models="m1", rows=None))])  # the recorded scope of a's grid: replaces it
    m = suite.merge([a, b])
    assert [(p["name"], p["commit"], p["gpu"]) for p in m["parts"]] == [
        ("tests", "c1", "H100"), ("grid", "c1", "H100"), ("grid", "c2", "H200")]
    assert m["gpu"] == "H100 + H200" and m["passed"]
    m2 = suite.merge([m, c])  # a merge merges again: its parts keep their own commit and GPU
    assert [(p["name"], p["commit"]) for p in m2["parts"]] == [("tests", "c1"), ("grid", "c2"), ("grid", "c3")]
    assert not m2["passed"] and [r["commit"] for r in m2["runs"]] == ["c1", "c2", "c3"]
    # an earlier merge whose grid parts record no scope (and no command tells one): each kept
    old = dict(commit="c2", runs=[dict(commit="c1"), dict(commit="c2")], parts=[
        dict(name="grid", commit="c1", date="d1", wall_s=5, passed=True),
        dict(name="grid", commit="c2", date="d2", wall_s=6, passed=True)])
    m3 = suite.merge([old, c])
    assert [(p["name"], p["commit"]) for p in m3["parts"]] == [("grid", "c1"), ("grid", "c2"), ("grid", "c3")]
    assert suite.merge([m3, m3])["parts"] == m3["parts"]  # merging the same parts again adds none


def test_a_stopped_suite_kills_its_running_part_and_records_it(suite, tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import threading

    pid_file = tmp_path / "child.pid"
    child = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(120)"]
    monkeypatch.setattr(suite, "part_commands", lambda args, out: dict(tests=[child], correctness=[child]))

    def stop_when_running():
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.05)

    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    threading.Thread(target=stop_when_running, daemon=True).start()
    try:
        assert suite.main(["--parts", "tests,correctness", "--out", str(tmp_path), "--commit", "x"]) == 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    doc = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(p["name"], p["passed"], p.get("error")) for p in doc["parts"]] == [("tests", False, "stopped by SIGTERM")]
    pid = int(pid_file.read_text())
    gone = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert gone == "" or gone.startswith("Z"), f"the part's process {pid} outlived the suite ({gone})"  # a zombie (Z, Zs) is dead


METRICS = """# HELP granikv:hot_extents HOT extents
# TYPE granikv:hot_extents gauge
granikv:hot_extents{model_name="m"} 1.0
granikv:decode_steps_total{model_name="m",path="cascade"} 57.0
granikv:decode_steps_total{model_name="m",path="paged"} 3.0
granikv:work_list_fills_total{kind="in_place",model_name="m"} 50.0
granikv:work_list_fills_total{kind="ends_in_graph",model_name="m"} 55.0
"""


def test_smoke_checks(smoke):
    good = [dict(meta_info=dict(completion_tokens=smoke.MAX_NEW_TOKENS))] * 3
    c = smoke.checks_of(METRICS, good)
    assert all(x["passed"] for x in c.values()) and c["cascade_decode_steps"]["value"] == 57.0
    assert not smoke.checks_of(METRICS.replace("57.0", "0.0"), good)["cascade_decode_steps"]["passed"]
    assert not smoke.checks_of(METRICS.replace("extents{model_name=\"m\"} 1.0", "extents 0"), good)[
        "hot_extents"]["passed"]
    assert c["ends_in_graph_steps"]["value"] == 55.0 and set(c) == set(smoke.METRIC_CHECKS)
    assert smoke.check_names("flashinfer") == set(c) | {"clean_shutdown"}
    assert smoke.check_names(smoke.DEFAULT) == smoke.check_names("triton") | {"default_backend_line"}
    # replays that copied their ends before the graph (the in-graph copy never recorded) fail it
    assert not smoke.checks_of(METRICS.replace("55.0", "0.0"), good)["ends_in_graph_steps"]["passed"]
    short = good + [dict(meta_info=dict(completion_tokens=3))]
    assert not smoke.checks_of(METRICS, short)["completion_tokens"]["passed"]


def test_smoke_reads_the_real_exporters_metric_names(smoke):
    """The names the smoke scrapes are the ones GraniKV's Prometheus exporter defines."""
    text = (ROOT / "python" / "granikv" / "prometheus.py").read_text()
    assert '"granikv:decode_steps_total"' in text and '"hot_extents"' in text
    assert '"granikv:work_list_fills_total"' in text and '"ends_in_graph"' in text


def test_smoke_command_is_the_quickstarts(smoke, tmp_path):
    cmd = smoke.server_command(tmp_path, 30000, "flashinfer")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-granikv", "--enable-metrics", "--attention-backend"):
        assert flag in cmd
    quick = (ROOT / "docs" / "gpu_quickstart.md").read_text()
    assert "--attention-backend flashinfer --enable-granikv --enable-metrics" in quick


def test_smoke_default_backend_passes_none_and_reads_the_choice(smoke, tmp_path):
    cmd = smoke.server_command(tmp_path, 30000, smoke.DEFAULT)
    assert "--attention-backend" not in cmd and "--enable-granikv" in cmd
    from granikv import server_settings

    # the line the server logs is the one the check reads (a planted other name fails it)
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    log = logging.getLogger("granikv")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        kw = {"device": "cuda"}
        server_settings.choose_attention_backend(kw.get, kw.__setitem__)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    text = "[2026] INFO x\n[2026] INFO " + records[0] + "\n"
    assert smoke.default_backend_check(text) == dict(value=kw["attention_backend"], passed=True)
    assert not smoke.default_backend_check(text.replace(f"with {kw['attention_backend']}", "with fa3"))["passed"]
    assert smoke.default_backend_check("nothing") == dict(value=None, passed=False)


def test_the_recorded_commit_says_when_the_tree_differs_from_it(tmp_path):
    """A tree copied with stale git metadata (tracked files changed since HEAD) records
    ``<sha>+modified``, never a bare commit it did not run; a clean tree its bare HEAD; no git:
    "unknown"."""
    import subprocess

    from benchmark.gpu_suite import git_commit

    def git(*cmd):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True, capture_output=True)

    assert git_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+modified"


def test_grid_also_granikv_goes_to_every_backends_grid_and_its_scope(suite, tmp_path):
    item = "probe:granikv_clock_probe=paged_too"
    args = suite.parse_args(["--out", str(tmp_path), "--grid-backends", "flashinfer,triton",
                             "--grid-also-granikv", item])
    for cmd in suite.part_commands(args, tmp_path)["grid"]:
        assert cmd[cmd.index("--also-granikv") + 1] == item
    assert suite.grid_scope(args)["also_granikv"] == [item]
    assert "also_granikv" not in suite.grid_scope(suite.parse_args(["--out", str(tmp_path)]))
