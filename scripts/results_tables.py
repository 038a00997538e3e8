"""Regenerates the results tables from the JSON they come from, or checks them (CI runs --check).

    python scripts/results_tables.py --check    # exit 1, with a diff, if a checked-in table differs
    python scripts/results_tables.py --write    # rewrite every table from its JSON

Two kinds of table:

- **Run pages.** Every ``docs/results/<name>.json`` written by ``benchmark.multi_agent.run``
  (``{"meta", "rows", ...}``) has ``<name>.md`` beside it; that page's row table is
  ``report.markdown_table(rows)``.
- **Marked tables.** In README.md and docs/**.md a line ``<!-- table: KIND ARG -->`` is followed
  by a table (the next block of lines starting with ``|``) that KIND generates:

  ``floor <name>.json``   bounds.py's floor table of that run (``docs/results/<name>.json``)
  ``status <name>``       one of the README's status tables, from :data:`STATUS` below
  ``history <name>``      the speedups of a topic's earlier runs, from :data:`HISTORY` below
  ``kernels <a>.json[+<b>.json]``  the key points of a bench_attention.py --quick run (and the
                          cascade time of run b beside them)
  ``grid <name>``         regime grid rows against two stock engines, from :data:`GRID_STATUS`

``--check`` also fails when a page cites a log under ``docs/results/runs/`` that is not there.
Nothing here needs a GPU: the tables are pure functions of the checked-in JSON.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
if str(ROOT) not in sys.path:  # run as a script: the benchmark package is at the repository root
    sys.path.insert(0, str(ROOT))

from benchmark.multi_agent import bounds, report  # noqa: E402

MARK = re.compile(r"^<!-- table: (\w+) (\S+) -->$")

# A status cell: (run JSON under docs/results, backend, workload, agents).
Cell = Tuple[str, str, str, int]
# A status row: (label, cells); a row with several cells prints "a / b" in every column.
StatusRow = Tuple[str, Sequence[Cell]]

_FI, _TR = "multi_agent.json", "multi_agent_triton.json"
STATUS: Dict[str, Tuple[str, Sequence[StatusRow]]] = {
    "one_gpu": (
        "Llama-3.1-8B, 256-token suffixes, 256 output tokens, output tok/s", (
            ("16K shared prefix, 64 agents, flashinfer backend",
             [(_FI, "flashinfer", "homogeneous", 64)]),
            ("16K shared prefix, 128 agents, flashinfer",
             [(_FI, "flashinfer", "homogeneous", 128)]),
            ("8 shared prefixes 2K–16K, 64 / 128 agents, flashinfer",
             [(_FI, "flashinfer", "heterogeneous", 64), (_FI, "flashinfer", "heterogeneous", 128)]),
            ("agent loop (4 turns) on a 16K prefix, 64 / 128 agents, flashinfer",
             [(_FI, "flashinfer", "agent_loop", 64), (_FI, "flashinfer", "agent_loop", 128)]),
            ("no shared prefix, 64 / 128 agents, flashinfer",
             [(_FI, "flashinfer", "no_sharing", 64), (_FI, "flashinfer", "no_sharing", 128)]),
            ("16K shared prefix, 64 / 128 agents, triton backend",
             [(_TR, "triton", "homogeneous", 64), (_TR, "triton", "homogeneous", 128)]),
            ("8 shared prefixes 2K–16K, 64 / 128 agents, triton",
             [(_TR, "triton", "heterogeneous", 64), (_TR, "triton", "heterogeneous", 128)]),
            ("agent loop (4 turns) on a 16K prefix, 64 / 128 agents, triton",
             [("multi_agent_triton_loop.json", "triton", "agent_loop", 64),
              ("multi_agent_triton_loop.json", "triton", "agent_loop", 128)]),
            ("no shared prefix, 64 / 128 agents, triton",
             [("multi_agent_triton_loop.json", "triton", "no_sharing", 64),
              ("multi_agent_triton_loop.json", "triton", "no_sharing", 128)]),
            ("`sglang.bench_serving` generated-shared-prefix, 16K, 64 prompts, flashinfer",
             [("bench_serving/bench_serving_flashinfer.json", "flashinfer", "bench_serving", 64)]),
        )),
    "two_gpus": (
        "two H200s ([docs/results/multi_gpu.md](docs/results/multi_gpu.md)), 16K shared prefix, "
        "flashinfer", (
            ("TP=2, Qwen2.5-14B architecture, 64 / 128 agents",
             [("multi_agent_tp2_full.json", "flashinfer", "homogeneous", 64),
              ("multi_agent_tp2_full.json", "flashinfer", "homogeneous", 128)]),
            ("DP=2, Llama-3.1-8B, 64 / 128 agents, prefix-affine routing (`routed_dp_rank`)",
             [("multi_agent_dp2.json", "flashinfer", "homogeneous", 64),
              ("multi_agent_dp2.json", "flashinfer", "homogeneous", 128)]),
            ("TP=2, Qwen2.5-32B architecture, 64 agents",
             [("multi_agent_tp2_qwen32b.json", "flashinfer", "homogeneous", 64)]),
        )),
}


# ---- generators ----------------------------------------------------------------------------


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _row(cell: Cell) -> Tuple[float, float, float]:
    """(baseline tok/s, GraniKV tok/s, speedup) of one cell; KeyError names a missing row."""
    name, backend, workload, agents = cell
    doc = _load(name)
    if workload == "bench_serving":  # benchmark/multi_agent/bench_serving.sh's summary
        return (doc["baseline"]["output_throughput"], doc["granikv"]["output_throughput"],
                doc["speedup"])
    for r in doc["rows"]:
        if (r["backend"], r["workload"], r["agents"]) == (backend, workload, agents):
            return r["baseline_out_tok_s"], r["granikv_out_tok_s"], r["speedup"]
    raise KeyError(f"{name}: no row {backend}/{workload}/{agents} agents")


def status_table(key: str) -> str:
    title, rows = STATUS[key]
    lines = [f"| {title} | SGLang | + GraniKV | speedup |", "|---|---:|---:|---:|"]
    for label, cells in rows:
        vals = [_row(c) for c in cells]
        col = lambda i, fmt: " / ".join(fmt.format(v[i]) for v in vals)  # noqa: E731
        lines.append(f"| {label} | {col(0, '{:,.0f}')} | {col(1, '{:,.0f}')} | "
                     f"{col(2, '{:.2f}x')} |")
    return "\n".join(lines)


def floor_table(name: str) -> str:
    doc = _load(name)
    found = bounds.bound_rows(doc, bounds.DEFAULT_TFLOPS * 1e12, bounds.DEFAULT_TBPS * 1e12)
    return bounds.to_markdown(found)


# Earlier runs of one topic, oldest first: (column label, run JSON(s) under docs/results, "+" between
# the files of one column).
HISTORY: Dict[str, Sequence[Tuple[str, str]]] = {
    "flashinfer": (
        ("`285ab5a`", "runs/multi_agent_285ab5a.json"),
        ("`54beeaa`", "runs/multi_agent_54beeaa.json"),
        ("`0473eeb`", "runs/multi_agent_0473eeb.json"),
        ("`bd83186`", "runs/multi_agent_bd83186.json"),
        ("`f092400` (current)", "multi_agent.json"),
    ),
    "triton": (
        ("`54beeaa`", "runs/multi_agent_triton_54beeaa.json"),
        ("`0473eeb`", "runs/multi_agent_triton_0473eeb.json"),
        ("`4d120ec` / `0a27a23` (current)", "multi_agent_triton.json+multi_agent_triton_loop.json"),
    ),
}
HISTORY_ROWS = ("homogeneous", "heterogeneous", "agent_loop", "no_sharing")


def history_table(key: str) -> str:
    """Speedup over stock SGLang per workload x agents (64, 128) across the runs of ``key``."""
    runs = [(label, {(r["workload"], r["agents"]): r["speedup"]
                     for name in names.split("+") for r in _load(name)["rows"]})
            for label, names in HISTORY[key]]
    backend = key
    lines = [f"| {backend}, speedup | " + " | ".join(label for label, _ in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    for workload in HISTORY_ROWS:
        for agents in (64, 128):
            cells = [by.get((workload, agents)) for _, by in runs]
            if all(c is None for c in cells):
                continue
            lines.append(f"| {workload} × {agents} | " + " | ".join(
                "–" if c is None else f"{c:.2f}x" for c in cells) + " |")
    return "\n".join(lines)


def _point(groups: Sequence[Sequence[int]]) -> str:
    k = lambda n: f"{n // 1024}K" if n % 1024 == 0 else str(n)  # noqa: E731
    if len(groups) == 1:
        return f"{k(groups[0][0])} × {groups[0][1]} req"
    return (f"{len(groups)} groups {'/'.join(k(p) for p, _ in groups)} × "
            f"{'/'.join(str(n) for _, n in groups)}")


def kernels_table(name: str) -> str:
    """Key points of one ``bench_attention.py --quick`` run (ms, CUDA-graph replays for
    GraniKV's paths), with the cascade time of the run given after ``+`` for comparison."""
    current, _, earlier = name.partition("+")
    then = {json.dumps(r["groups"]): r["gkv_cascade_ms"] for r in _load(earlier)["rows"]} \
        if earlier else {}
    label = earlier.rsplit("_", 1)[-1].split(".")[0] if earlier else ""
    cols = ("floor_ms", "sgl_triton_ms", "fi_decode_tc_ms", "fi_cascade_fa2_ms",
            "fi_cascade_fa3_ms", "gkv_cascade_ms", "gkv_fused_ms", "gkv_bgemm_ms")
    head = ("| point | floor | SGLang triton | FI paged TC | FI cascade fa2 | FI cascade fa3 "
            "| **GraniKV cascade** | GraniKV fused | bgemm (eager) |")
    lines = [head + (f" cascade at `{label}` |" if earlier else ""),
             "|---|" + "---:|" * (len(cols) + bool(earlier))]
    ms = lambda x: "–" if x is None else f"{x:#.3g}"  # noqa: E731
    for r in _load(current)["rows"]:
        cells = [ms(r.get(c)) for c in cols]
        cells[5] = f"**{cells[5]}**"
        if earlier:
            cells.append(ms(then.get(json.dumps(r["groups"]))))
        lines.append(f"| {_point(r['groups'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Grid rows against more than one stock engine: (title, regimes JSON under docs/results, the
# ``--also-stock`` backend beside the grid's, rows as (model, workload, label)).
GRID_STATUS: Dict[str, Tuple[str, str, str, Sequence[Tuple[str, str, str]]]] = {
    "fa3": (
        "regime grid rows, output tok/s", "regimes_fa3.json", "flashinfer", (
            ("llama-3.1-8b", "hom16k_x64", "Llama-3.1-8B, 16K shared prefix, 64 agents"),
            ("llama-3.1-8b", "hom16k_x128", "Llama-3.1-8B, 16K shared prefix, 128 agents"),
            ("llama-3.1-8b", "hom32k_x48", "Llama-3.1-8B, 32K shared prefix, 48 agents"),
            ("llama-3.1-8b", "three_unequal", "Llama-3.1-8B, 12K / 6K / 2K prefixes, 8 / 24 / 48 agents"),
            ("llama-3.1-8b", "forest16", "Llama-3.1-8B, forest of 16 prefixes (1.5-6K), 130 agents"),
            ("llama-3.1-8b", "agent_loop_10k_x24", "Llama-3.1-8B, agent loop (4 turns), 10K prefix, 24 agents"),
            ("llama-3.1-8b", "small_groups32_2to3sharers", "Llama-3.1-8B, 32 prefixes (2-4K), 2-3 agents each"),
            ("llama-3.1-8b", "no_sharing_1k_x64", "Llama-3.1-8B, no shared prefix, 64 agents"),
            ("qwen2.5-7b", "hom16k_x64", "Qwen2.5-7B, 16K shared prefix, 64 agents"),
            ("qwen2.5-7b", "forest16", "Qwen2.5-7B, forest of 16 prefixes, 130 agents"),
            ("qwen2.5-7b", "no_sharing_1k_x64", "Qwen2.5-7B, no shared prefix, 64 agents"),
        )),
}


def grid_table(key: str) -> str:
    """GraniKV behind the grid's backend against its stock engine and the ``--also-stock`` one."""
    title, name, other, picks = GRID_STATUS[key]
    rows = {(r["model"], r["workload"]): r for r in _load(name)["rows"]}
    backend = next(iter(rows.values()))["backend"]
    lines = [f"| {title} | SGLang {other} | SGLang {backend} | + GraniKV behind {backend} | "
             f"÷ SGLang {backend} | ÷ SGLang {other} | of the floor |", "|---|" + "---:|" * 6]
    for model, workload, label in picks:
        r = rows.get((model, workload))
        if r is None:
            raise KeyError(f"{name}: no row {model}/{workload}")
        also = r["also_stock"][other]
        floor = "–" if r.get("floor_fraction") is None else f"{r['floor_fraction']:.0%}"
        lines.append(f"| {label} | {also['out_tok_s']:,.0f} | {r['baseline_out_tok_s']:,.0f} | "
                     f"{r['granikv_out_tok_s']:,.0f} | {r['speedup']:.2f}x | {also['granikv_speedup']:.2f}x | "
                     f"{floor} |")
    return "\n".join(lines)


GENERATORS = {"status": status_table, "floor": floor_table, "history": history_table,
              "kernels": kernels_table, "grid": grid_table}


# ---- pages ---------------------------------------------------------------------------------


def _table_end(lines: List[str], start: int) -> int:
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return end


def regenerate_marked(text: str, where: str) -> str:
    """``text`` with every marked table replaced by its generated form."""
    lines = text.split("\n")
    out: List[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = MARK.match(lines[i])
        i += 1
        if not m:
            continue
        kind, arg = m.groups()
        if kind not in GENERATORS:
            raise ValueError(f"{where}: unknown table kind {kind!r} (known: {sorted(GENERATORS)})")
        if i >= len(lines) or not lines[i].startswith("|"):
            raise ValueError(f"{where}:{i}: no table after the {kind} {arg} marker")
        out.extend(GENERATORS[kind](arg).split("\n"))
        i = _table_end(lines, i)
    return "\n".join(out)


def regenerate_run_page(text: str, rows: Sequence[Mapping], where: str) -> str:
    """``text`` (a run page) with its row table replaced by ``report.markdown_table(rows)``."""
    table = report.markdown_table(rows)
    head = table.split("\n", 1)[0]
    lines = text.split("\n")
    try:
        start = lines.index(head)
    except ValueError:
        raise ValueError(f"{where}: no row table (a line equal to report.py's header)") from None
    return "\n".join(lines[:start] + table.split("\n") + lines[_table_end(lines, start):])


def _is_run(doc) -> bool:
    """A run.py result: ``{"meta", "rows": [{"baseline_out_tok_s", ...}, ...]}``."""
    rows = doc.get("rows") if isinstance(doc, dict) else None
    return bool(rows) and isinstance(rows[0], dict) and {"baseline_out_tok_s", "ceiling_ratio"} <= rows[0].keys()


def pages(root: Path = ROOT) -> List[Tuple[Path, Optional[Path]]]:
    """(markdown page, its run JSON or None) for every page that holds a generated table."""
    found: List[Tuple[Path, Optional[Path]]] = []
    for md in [root / "README.md"] + sorted((root / "docs").rglob("*.md")):
        if "runs" in md.relative_to(root).parts:
            continue
        js = md.with_suffix(".json")
        run = js if js.is_file() and _is_run(json.loads(js.read_text())) else None
        if run is not None or "<!-- table: " in md.read_text():
            found.append((md, run))
    return found


def regenerate(md: Path, run: Optional[Path]) -> str:
    where = str(md.relative_to(ROOT))
    text = md.read_text()
    if run is not None:
        text = regenerate_run_page(text, json.loads(run.read_text())["rows"], where)
    return regenerate_marked(text, where)


_CITED = re.compile(r"runs/([A-Za-z0-9_.-]*[A-Za-z0-9_])(\.\*|<)?")


def missing_logs(pages: Optional[Sequence[Path]] = None) -> List[str]:
    """``page: runs/<file>`` for every log under docs/results/runs/ that a page names but that
    is not there (default pages: README.md, docs/**.md outside runs/, benchmark/**.md)."""
    if pages is None:
        pages = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").rglob("*.md"))
                                        if "runs" not in p.relative_to(ROOT).parts]
        pages += sorted((ROOT / "benchmark").rglob("*.md"))
    runs = RESULTS / "runs"
    missing = []
    for page in pages:
        for name, tail in _CITED.findall(Path(page).read_text()):
            if tail == "<":  # a pattern such as runs/multi_agent_<commit>.md
                continue
            found = list(runs.glob(name + ".*")) if tail else (runs / name).exists()
            if not found:
                missing.append(f"{page}: runs/{name}{tail}")
    return missing


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="Fail with a diff if a table differs.")
    mode.add_argument("--write", action="store_true", help="Rewrite the tables in place.")
    args = p.parse_args(argv)
    stale = []
    for md, run in pages():
        old, new = md.read_text(), regenerate(md, run)
        if old == new:
            continue
        stale.append(md)
        if args.write:
            md.write_text(new)
        else:
            rel = str(md.relative_to(ROOT))
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), rel + " (checked in)",
                rel + " (from its JSON)"))
    verb = "rewrote" if args.write else "differ from their JSON"
    if stale:
        print(f"results tables: {len(stale)} page(s) {verb}: "
              + ", ".join(str(m.relative_to(ROOT)) for m in stale))
    else:
        print(f"results tables: {len(pages())} page(s) match their JSON")
    missing = missing_logs()
    for m in missing:
        print(f"results tables: cited log missing: {m}")
    return 1 if (stale or missing) and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
