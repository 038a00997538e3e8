"""The README's flag table and example error equal what scripts/flag_table.py renders from
granikv.config, and the check fails when the README's text or a marker is changed."""

import dataclasses
import subprocess
import sys

import pytest

from granikv.config import GraniKVConfig, cli_flag
from scripts import flag_table as ft


def test_the_checked_in_readme_matches_the_config():
    text = ft.README.read_text()
    assert ft.regenerate(text) == text, (
        "run `python scripts/flag_table.py --write`:\n" + "\n".join(ft.diff(text, ft.regenerate(text))))


def test_every_field_has_a_row_with_its_default_and_range():
    table = ft.render_table()
    for f in dataclasses.fields(GraniKVConfig):
        row = [line for line in table.split("\n") if line.startswith(f"| `{cli_flag(f.name)}` |")]
        assert len(row) == 1, f.name
        if f.metadata.get("lo") is not None:
            assert f"| [{f.metadata['lo']}, {f.metadata['hi']}] |" in row[0]
        if f.metadata.get("choices"):
            assert ", ".join(f"`{c}`" for c in f.metadata["choices"]) in row[0]
    assert "| `--granikv-hot-fraction` | float | `0.5` | [0.0, 1.0] |" in table
    assert "| `--granikv-extend-path` | `auto`, `hot`, `paged` | `auto` | – |" in table
    assert "| `--enable-granikv` | switch | off | – |" in table


def test_the_example_error_is_the_configs_own_message():
    with pytest.raises(ValueError) as e:
        GraniKVConfig(hot_fraction=2.0)
    assert ft.example_error() == f"    error: {e.value}"
    assert "[0.0, 1.0]" in ft.example_error()


def _readme_with(old: str, new: str) -> str:
    text = ft.README.read_text()
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_a_changed_default_or_error_in_the_readme_is_reported():
    text = ft.README.read_text()
    for old, new in [("| `--granikv-hot-fraction` | float | `0.5` | [0.0, 1.0] |",
                      "| `--granikv-hot-fraction` | float | `0.25` | [0.0, 0.9] |"),
                     ("is outside [0.0, 1.0]", "is outside [0.0, 0.9]")]:
        tampered = _readme_with(old, new)
        assert ft.regenerate(tampered) == text  # --write restores it
        assert any(line.startswith("-") and new in line for line in
                   ft.diff(tampered, ft.regenerate(tampered)))


def test_check_exits_1_with_a_diff_and_write_repairs(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(_readme_with("| `--granikv-log-interval` | int | `40` |",
                                   "| `--granikv-log-interval` | int | `41` |"))
    script = str(ft.ROOT / "scripts" / "flag_table.py")
    check = [sys.executable, script, "--check", "--readme", str(readme)]
    proc = subprocess.run(check, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "-| `--granikv-log-interval` | int | `41` |" in proc.stdout
    assert "+| `--granikv-log-interval` | int | `40` |" in proc.stdout
    subprocess.run([sys.executable, script, "--write", "--readme", str(readme)], check=True,
                   capture_output=True)
    assert readme.read_text() == ft.README.read_text()
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_the_text_outside_the_markers_is_kept():
    outside = _readme_with("## Flags\n", "## Flags (edited by hand)\n")
    assert ft.regenerate(outside) == outside


@pytest.mark.parametrize("marker", ["<!-- flags: begin -->", "<!-- flags: end -->",
                                    "<!-- flag-error: begin -->", "<!-- flag-error: end -->"])
def test_a_missing_marker_is_a_clear_error(marker, tmp_path):
    text = _readme_with(marker + "\n", "")
    with pytest.raises(ValueError, match=f"expected one line '{marker}', found 0"):
        ft.regenerate(text)
    readme = tmp_path / "README.md"
    readme.write_text(text)
    proc = subprocess.run([sys.executable, str(ft.ROOT / "scripts" / "flag_table.py"), "--check",
                           "--readme", str(readme)], capture_output=True, text=True)
    assert proc.returncode == 2 and f"expected one line '{marker}', found 0" in proc.stderr
