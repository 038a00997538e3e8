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
