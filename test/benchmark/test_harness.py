"""benchmark/harness: tagged records from a real child process, the hard timeout that kills the
child's whole process group (a grandchild included), atomic JSON."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from benchmark.harness import engine_proc, results


def _child(tmp_path, body: str) -> list:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_run_tagged_parses_records_and_reports_status(tmp_path):
    cmd = _child(tmp_path, """
        import sys
        from benchmark.harness.engine_proc import ERROR_TAG, INFO_TAG, ROW_TAG, emit
        print("plain line")
        emit(INFO_TAG, {"gpu": "none"})
        emit(ROW_TAG, {"x": 1})
        print("ROW {not json")
        emit(ERROR_TAG, {"error": "boom"})
        sys.exit(3)
    """)
    got = []
    res = engine_proc.run_tagged(cmd, name="t", on_record=got.append, timeout=60, extra=dict(config="c"),
                                 echo=False, env=engine_proc.repo_env(), cwd=tmp_path)
    assert [(r["kind"], r["config"]) for r in got] == [("info", "c"), ("row", "c"), ("error", "c")]
    assert got[1]["x"] == 1 and res.returncode == 3 and res.errors == 1 and not res.timed_out


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    cmd = _child(tmp_path, f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(p.pid))
        print("ROW {{}}", flush=True)
        time.sleep(120)
    """)
    t = time.time()
    res = engine_proc.run_tagged(cmd, name="t", on_record=lambda r: None, timeout=2.0, echo=False)
    assert res.timed_out and time.time() - t < 30
    pid = int(pid_file.read_text())
    for _ in range(50):  # the grandchild (an engine's scheduler, say) died with the group
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init eventually; a zombie counts as dead
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} still alive after the group kill")


def test_module_children_find_the_package_from_any_directory(tmp_path):
    env = engine_proc.repo_env({"PYTHONPATH": os.pathsep.join(["/elsewhere", str(engine_proc.REPO_ROOT)])})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(engine_proc.REPO_ROOT), "/elsewhere"]
    cmd = engine_proc.module_command("benchmark.multi_agent.bounds", "--help")
    assert cmd[:3] == [sys.executable, "-m", "benchmark.multi_agent.bounds"]
    res = subprocess.run(cmd, cwd=tmp_path, env=engine_proc.repo_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "usage" in res.stdout, res.stderr[-2000:]


def test_parse_line_and_env():
    assert engine_proc.parse_line('ROW {"a": 1}') == {"a": 1, "kind": "row"}
    assert engine_proc.parse_line("ROW [1]") is None and engine_proc.parse_line("hello") is None
    assert engine_proc.engine_env("flashinfer", {})["SGLANG_IS_FLASHINFER_AVAILABLE"] == "true"
    assert "SGLANG_IS_FLASHINFER_AVAILABLE" not in engine_proc.engine_env("triton", {})


def test_write_json_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "out" / "r.json"
    results.write_json(path, {"rows": [1]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    # a failure mid-write leaves the previous complete file and no temporary behind

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken)
    with pytest.raises(OSError):
        results.write_json(path, {"rows": [2]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_gpu_free_bytes_reads_nvidia_smi_of_the_engines_gpu(monkeypatch):
    """The first visible GPU's free memory in bytes; None without nvidia-smi or with output it
    cannot read (the grid then keeps its caps)."""
    from types import SimpleNamespace

    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(returncode=0, stdout="81090\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert engine_proc.gpu_free_bytes() == 81090 << 20
    assert seen[-1][-2:] == ["-i", "3"]

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=0, stdout="[N/A]\n"))
    assert engine_proc.gpu_free_bytes() is None

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert engine_proc.gpu_free_bytes() is None
