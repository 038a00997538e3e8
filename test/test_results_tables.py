"""The checked-in results tables equal what scripts/results_tables.py generates from their JSON,
and the check fails when a figure or its JSON is changed."""

import json

import pytest

from scripts import results_tables as rt


def test_every_checked_in_table_matches_its_json():
    found = rt.pages()
    names = {md.name for md, _ in found}
    assert {"README.md", "multi_agent.md", "multi_agent_triton.md", "multi_agent_dp2.md"} <= names
    stale = [str(md) for md, run in found if rt.regenerate(md, run) != md.read_text()]
    assert not stale, f"run `python scripts/results_tables.py --write`: {stale}"


def test_a_changed_figure_in_a_marked_table_is_caught():
    text = (rt.ROOT / "README.md").read_text()
    lines = text.split("\n")
    first_row = lines.index("<!-- table: status one_gpu -->") + 3  # marker, header, rule, row
    tampered = lines[:first_row] + [lines[first_row].rsplit("|", 2)[0] + "| 9.99x |"] + \
        lines[first_row + 1:]
    assert "\n".join(tampered) != text
    assert rt.regenerate_marked("\n".join(tampered), "README.md") == text


def test_a_changed_json_row_is_caught():
    md = rt.RESULTS / "multi_agent_triton.md"
    rows = json.loads(md.with_suffix(".json").read_text())["rows"]
    rows[0] = dict(rows[0], granikv_out_tok_s=rows[0]["granikv_out_tok_s"] * 2)
    assert rt.regenerate_run_page(md.read_text(), rows, md.name) != md.read_text()


def test_the_grid_table_reads_both_stock_engines_and_names_a_missing_row(monkeypatch):
    doc = json.loads((rt.RESULTS / "regimes_fa3.json").read_text())
    row = next(r for r in doc["rows"] if (r["model"], r["workload"]) == ("llama-3.1-8b", "hom16k_x64"))
    table = rt.grid_table("fa3").split("\n")
    assert table[0].startswith("| regime grid rows") and "SGLang flashinfer | SGLang fa3 |" in table[0]
    first = table[2].split(" | ")
    assert first[1:4] == [f"{row['also_stock']['flashinfer']['out_tok_s']:,.0f}", f"{row['baseline_out_tok_s']:,.0f}",
                          f"{row['granikv_out_tok_s']:,.0f}"]
    title, name, other, picks = rt.GRID_STATUS["fa3"]
    monkeypatch.setitem(rt.GRID_STATUS, "fa3", (title, name, other, [("llama-3.1-8b", "nope", "x")]))
    with pytest.raises(KeyError, match="no row llama-3.1-8b/nope"):
        rt.grid_table("fa3")


def test_a_marker_without_a_table_or_of_an_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="no table after the status one_gpu marker"):
        rt.regenerate_marked("<!-- table: status one_gpu -->\n\ntext", "x.md")
    with pytest.raises(ValueError, match="unknown table kind 'nope'"):
        rt.regenerate_marked("<!-- table: nope x -->\n| a |", "x.md")
    with pytest.raises(KeyError, match="no row flashinfer/homogeneous/3 agents"):
        rt._row(("multi_agent.json", "flashinfer", "homogeneous", 3))



def test_every_cited_log_exists(tmp_path):
    """Every ``runs/<file>`` a results page, the README or a benchmark README names is there;
    a page citing a missing log is reported."""
    assert rt.missing_logs() == []
    page = tmp_path / "p.md"
    page.write_text("log `runs/soak.md`, `runs/kernels_285ab5a.*`, `runs/multi_agent_<commit>.md`"
                    ", and `runs/nope_log.txt`.")
    assert rt.missing_logs([page]) == [f"{page}: runs/nope_log.txt"]
