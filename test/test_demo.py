from granikv import demo


def test_cpu_walkthrough_runs_and_reports(capsys):
    rc = demo.main(["--cpu", "--agents", "3", "--prefix", "64", "--suffix", "5", "--turns", "2",
                    "--decode", "4", "--tool", "3", "--print-every", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "CPU walk-through (no GPU used)" in out
    assert "Promotions 1" in out  # the shared prefix became HOT once
    assert "Integrity:" in out
    # 3 agents share the prefix: a decode step reads it once instead of three times
    saving = float(out.split("x less")[0].rsplit("(", 1)[1])
    assert saving > 1.5


def test_invalid_argument_names_the_flag():
    import pytest

    with pytest.raises(SystemExit, match="--agents must be >= 1"):
        demo.main(["--cpu", "--agents", "0"])


def test_help_documents_every_option(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out  # no reST markup in the terminal
    assert "CUDA GPU" in out and "CPU walk-through" in out
    parser_opts = ["--cpu", "--out", "--agents", "--prefix", "--suffix", "--turns", "--decode",
                   "--tool", "--print-every", "--seed"]
    lines = out.splitlines()
    for opt in parser_opts:
        i = next(i for i, l in enumerate(lines) if l.strip().startswith(opt))
        # the help text follows on the same line or the next one
        text = (lines[i].strip()[len(opt):] + " " + lines[i + 1]).strip()
        assert len(text.split()) >= 3, f"{opt} has no help: {lines[i]!r}"


def _fake_gpu(monkeypatch, calls):
    import importlib.util

    monkeypatch.setattr(demo, "_gpu_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "sgl_kernel" else real(name, *a))
    monkeypatch.setattr(demo.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)


def test_gpu_path_writes_to_a_temporary_folder_not_docs_results(monkeypatch, capsys):
    from pathlib import Path

    calls = []
    _fake_gpu(monkeypatch, calls)
    assert demo.main([]) == 0
    (cmd,) = calls
    assert cmd[1:3] == ["-m", "benchmark.multi_agent.run"] and "--quick" in cmd
    out = Path(cmd[cmd.index("--out") + 1])
    assert out.is_dir() and out.name.startswith("granikv-demo-")
    assert "docs" not in out.parts
    assert f"results in {out}" in capsys.readouterr().out
    out.rmdir()


def test_gpu_path_takes_out_and_refuses_the_checked_in_results(monkeypatch, tmp_path):
    import pytest

    calls = []
    _fake_gpu(monkeypatch, calls)
    assert demo.main(["--out", str(tmp_path / "r")]) == 0
    assert calls[0][calls[0].index("--out") + 1] == str(tmp_path / "r")
    checkout = demo._find_benchmark().parents[2]
    with pytest.raises(SystemExit, match="is the checked-in"):
        demo.main(["--out", str(checkout / "docs" / "results")])
    with pytest.raises(SystemExit, match="is the checked-in"):
        demo.main(["--out", str(checkout / "docs" / "results" / "sub")])
    assert len(calls) == 1
