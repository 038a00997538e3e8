"""benchmark/harness/pytest_workers.py (``gpu_suite --tests-workers N``): the GPU tests split over
N pytest processes. Real pytest subprocesses on a generated test folder (no GPU): every test runs
exactly once, each process writes its own junit XML, a failing test fails the part, and the
processes are killed when the suite stops."""

import subprocess
import xml.etree.ElementTree as ET

import pytest

from benchmark.harness import pytest_workers as pw

TESTS = '''
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(5))
def test_a(i):
    assert i >= 0

@pytest.mark.gpu
def test_b():
    assert {fail}

def test_not_gpu():
    raise AssertionError("selected out by -m gpu")
'''


def _folder(tmp_path, fail=False):
    root = tmp_path / "repo"
    (root / "test").mkdir(parents=True)
    (root / "test" / "test_one.py").write_text(TESTS.format(fail="False" if fail else "True"))
    (root / "test" / "test_two.py").write_text(TESTS.format(fail="True").replace("test_a", "test_c"))
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")
    return root


def test_split_is_round_robin_over_files_and_covers_every_id_once():
    ids = [f"test/{f}.py::t[{i}]" for f in ("b", "a") for i in range(5)]
    groups = pw.split(ids, 3)
    assert sorted(i for g in groups for i in g) == sorted(ids)
    assert [len(g) for g in groups] == [4, 3, 3]
    assert groups[0][:2] == ["test/a.py::t[0]", "test/a.py::t[3]"]  # each group a share of each file
    assert all(any(i.startswith("test/a.py") for i in g) and any(i.startswith("test/b.py") for i in g)
               for g in groups)
    assert pw.split(ids[:2], 8) == [[ids[0]], [ids[1]]]  # fewer tests than workers: no empty group
    assert pw.split([], 4) == [[]]
    with pytest.raises(ValueError, match="at least 1"):
        pw.split(ids, 0)


def test_workers_run_every_gpu_test_once_with_a_junit_each(tmp_path, capsys):
    root = _folder(tmp_path)
    ids = pw.collect(["-m", "gpu", "-q", "test/"], root)
    assert len(ids) == 12 and not any("not_gpu" in i for i in ids)
    res = pw.run(pw.split(ids, 3), ["-m", "gpu", "-q"], tmp_path / "out", root)
    assert res == dict(passed=True, exit_codes=[0, 0, 0], workers=3)
    ran = []
    for i in range(3):
        tree = ET.parse(tmp_path / "out" / f"gpu_tests_{i}.xml")
        ran += [f"{c.get('classname')}::{c.get('name')}" for c in tree.iter("testcase")]
    assert len(ran) == len(set(ran)) == 12
    assert "worker 2: exit 0" in capsys.readouterr().out


def test_a_failing_test_fails_the_part_and_shows_its_worker_log(tmp_path, capsys):
    root = _folder(tmp_path, fail=True)
    ids = pw.collect(["-m", "gpu", "-q", "test/"], root)
    res = pw.run(pw.split(ids, 2), ["-m", "gpu", "-q"], tmp_path / "out", root)
    assert not res["passed"] and sorted(res["exit_codes"]) == [0, 1]
    out = capsys.readouterr().out
    assert "test_one.py::test_b" in out and "exit 1" in out


def test_a_collection_error_is_an_error(tmp_path):
    root = _folder(tmp_path)
    (root / "test" / "test_broken.py").write_text("import nonexistent_module_xyz\n")
    with pytest.raises(RuntimeError, match="collect-only exited"):
        pw.collect(["-m", "gpu", "-q", "test/"], root)


def test_every_process_is_killed_when_the_run_stops(tmp_path, monkeypatch):
    started = []

    class Proc:
        def __init__(self, cmd, **kw):
            assert kw["start_new_session"] and "--junitxml=" in " ".join(cmd)
            self.pid, self.done = 1000 + len(started), False
            started.append(self)

        def wait(self):
            raise KeyboardInterrupt  # the suite's Stopped, or any interruption while waiting

        def poll(self):
            return None

    killed = []
    monkeypatch.setattr(pw.os, "killpg", lambda pid, sig: killed.append(pid))
    with pytest.raises(KeyboardInterrupt):
        pw.run([["t::a"], ["t::b"]], ["-m", "gpu"], tmp_path / "out", tmp_path, popen=Proc)
    assert killed == [1000, 1001]


def test_the_suite_runs_its_tests_part_in_workers(tmp_path, monkeypatch):
    from benchmark import gpu_suite

    seen = {}
    monkeypatch.setattr(gpu_suite.pytest_workers, "collect", lambda args, cwd: seen.update(collect=args) or
                        [f"test/x.py::t{i}" for i in range(7)])
    monkeypatch.setattr(gpu_suite.pytest_workers, "run", lambda groups, args, out, cwd: seen.update(
        groups=groups, args=args, out=out) or dict(passed=True, exit_codes=[0] * len(groups), workers=len(groups)))
    args = gpu_suite.parse_args(["--out", str(tmp_path), "--parts", "tests", "--tests-workers", "3",
                                 "--tests-args", "--timeout 150"])
    res = gpu_suite.run_tests_in_workers(args, tmp_path / "tests")
    assert res == dict(passed=True, exit_codes=[0, 0, 0], workers=3, tests=7)
    assert seen["collect"] == ["-m", "gpu", "-q", "test/", "--timeout", "150"]
    assert seen["args"] == ["-m", "gpu", "-q", "--timeout", "150"] and len(seen["groups"]) == 3
    monkeypatch.setattr(gpu_suite.pytest_workers, "collect", lambda args, cwd: [])
    assert gpu_suite.run_tests_in_workers(args, tmp_path / "tests")["passed"] is False
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--tests-workers", "0"])


def test_the_suite_splits_its_tests_by_default_only_on_a_large_gpu(monkeypatch):
    """Without --tests-workers: four pytest processes on an 80 GB GPU, one on a 24 GB GPU or
    where no GPU answers; an explicit value always wins."""
    from benchmark import gpu_suite

    for gib, want in ((79.6, 4), (139.8, 4), (23.6, 1), (None, 1)):
        monkeypatch.setattr(gpu_suite, "gpu_memory_gib", lambda gib=gib: gib)
        assert gpu_suite.parse_args(["--parts", "tests"]).tests_workers == want
        assert gpu_suite.parse_args(["--parts", "tests", "--tests-workers", "2"]).tests_workers == 2
    monkeypatch.setattr(gpu_suite, "gpu_memory_gib", lambda: pytest.fail("the GPU asked without the tests part"))
    assert gpu_suite.parse_args(["--parts", "smoke,grid"]).tests_workers == 1


def test_collect_uses_pytest_itself(tmp_path):
    root = _folder(tmp_path)
    direct = subprocess.run(pw.pytest_cmd(["-m", "gpu", "-q", "--collect-only", "test/"]), cwd=root,
                            capture_output=True, text=True).stdout
    assert pw.collect(["-m", "gpu", "-q", "test/"], root) == [ln for ln in direct.splitlines() if "::" in ln]
