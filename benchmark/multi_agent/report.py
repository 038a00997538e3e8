"""Multi-agent benchmark report: pairs baseline and GraniKV measurements, writes JSON, markdown, PNG.

    python3 -m benchmark.multi_agent.report docs/results/multi_agent.json [more.json ...] --out DIR

run.py calls :func:`write` after every engine; the CLI re-merges the measurements of one or
more earlier runs (e.g. a flashinfer run and a triton run made separately; for the same
backend / config / workload / prefix / agents a later file wins) and rewrites the outputs.

Input records (run.py's child output, one per engine configuration and workload row)::

    {"kind": "row", "backend": "flashinfer", "config": "baseline" | "granikv",
     "workload": ..., "prefix_len": ..., "agents": ..., "out_tok_per_s": ...,
     "ttft_p50_ms": ..., "ttft_p99_ms": ..., "tpot_p50_ms": ..., "tpot_p99_ms": ...,
     "kv_used_tokens_peak": ..., "kv_tokens_logical": ..., "granikv": {...} | null, ...}
    {"kind": "info", "backend": ..., "config": ..., "gpu": ..., "max_total_num_tokens": ...}
    {"kind": "error", "backend": ..., "config": ..., "error": "..."}

Output rows (one per backend / workload / prefix / agents): both throughputs, ``speedup`` =
granikv / baseline, ``ceiling_ratio`` = granikv / the 256-token-prefix ceiling at the same
agent count and backend (baseline engine's ceiling row; the granikv engine's if the baseline
has none), latencies of both, KV figures, and the project's target where one applies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmark.harness.records import commands_of, merge_records
from benchmark.harness.results import pyplot, write_json
from benchmark.multi_agent import bounds

LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
SIDE_KEYS = LATENCY_KEYS + ("kv_used_tokens_peak", "cached_tokens", "seconds")
CEILING = "ceiling"

# Targets per (model, TP, DP) of the run: (workload, backend, agents or None for any, prefix or
# None) -> min speedup: Llama-3.1-8B on one GPU, Qwen2.5-14B at TP=2 and
# Qwen2.5-32B at TP=4. Other runs (DP=2, dry runs at another TP) show no target.
Target = Tuple[str, str, Optional[int], Optional[int], float]
TARGETS: Tuple[Target, ...] = (
    ("homogeneous", "flashinfer", 64, 16384, 2.5),
    ("homogeneous", "flashinfer", 128, 16384, 3.1),
    ("homogeneous", "triton", 64, 16384, 3.0),
    ("homogeneous", "triton", 128, 16384, 5.0),
    ("heterogeneous", "*", None, None, 2.0),
    ("no_sharing", "*", None, None, 0.97),
)
TARGETS_BY_RUN: Dict[Tuple[str, int, int], Tuple[str, Tuple[Target, ...]]] = {
    ("llama-3.1-8b", 1, 1): ("the single-GPU targets (Llama-3.1-8B)", TARGETS),
    ("qwen2.5-14b", 2, 1): ("the TP=2 target (Qwen2.5-14B)", (("homogeneous", "flashinfer", 64, 16384, 2.2),)),
    ("qwen2.5-32b", 4, 1): ("the TP=4 target (Qwen2.5-32B)", (("homogeneous", "flashinfer", 64, 16384, 1.8),)),
}
DEFAULT_MODEL = "llama-3.1-8b"


def target_for(workload: str, backend: str, agents: int, prefix: int, *, model: str = DEFAULT_MODEL,
               tp: int = 1, dp: int = 1) -> Optional[float]:
    _, targets = TARGETS_BY_RUN.get((model, tp, dp), ("", ()))
    for w, b, n, p, t in targets:
        if w == workload and b in ("*", backend) and n in (None, agents) and p in (None, prefix):
            return t
    return None


def _run_key(meta: Mapping[str, Any]) -> Tuple[str, int, int]:
    return (str(meta.get("model") or DEFAULT_MODEL), int(meta.get("tp") or 1), int(meta.get("dp") or 1))


def _key(r: Mapping[str, Any]) -> Tuple:
    return (r["backend"], r["workload"], r["prefix_len"], r["agents"])


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def combine(records: Sequence[Mapping[str, Any]], *, model: str = DEFAULT_MODEL, tp: int = 1,
            dp: int = 1) -> List[Dict[str, Any]]:
    """Pairs the baseline and granikv rows of each backend/workload/prefix/agents; targets are
    those of the run's model and parallelism (``TARGETS_BY_RUN``)."""
    rows = [r for r in records if r.get("kind") == "row"]
    infos = {(r["backend"], r["config"]): r for r in records if r.get("kind") == "info"}
    sides: Dict[Tuple, Dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        sides.setdefault(_key(r), {})[r["config"]] = r
    ceilings = {}
    for (backend, workload, _, agents), by_cfg in sides.items():
        if workload == CEILING:
            ref = by_cfg.get("baseline") or by_cfg.get("granikv")
            ceilings[(backend, agents)] = ref["out_tok_per_s"]
    out = []
    for key in sorted(sides, key=_sort_key):
        backend, workload, prefix, agents = key
        b, g = sides[key].get("baseline"), sides[key].get("granikv")
        any_side = b or g
        # the ceiling bounds shared-prefix workloads; no_sharing has nothing to share
        ceiling = ceilings.get((backend, agents)) if workload != "no_sharing" else None
        b_tps = b["out_tok_per_s"] if b else None
        g_tps = g["out_tok_per_s"] if g else None
        info = infos.get((backend, "baseline")) or infos.get((backend, "granikv")) or {}
        row = dict(workload=workload, backend=backend, prefix_len=prefix, agents=agents,
                   turns=any_side.get("turns", 1), params=any_side.get("params"),
                   baseline_out_tok_s=b_tps, granikv_out_tok_s=g_tps, speedup=_ratio(g_tps, b_tps),
                   target_speedup=target_for(workload, backend, agents, prefix, model=model, tp=tp, dp=dp),
                   ceiling_out_tok_s=ceiling, ceiling_ratio=_ratio(g_tps, ceiling),
                   baseline_ceiling_ratio=_ratio(b_tps, ceiling),
                   kv_tokens_logical=any_side.get("kv_tokens_logical"),
                   gpu=info.get("gpu"))
        for side, r in (("baseline", b), ("granikv", g)):
            for k in SIDE_KEYS:
                row[f"{side}_{k}"] = r.get(k) if r else None
            cap = infos.get((backend, side), {}).get("max_total_num_tokens")
            row[f"{side}_kv_capacity_tokens"] = cap
        row["granikv_counters"] = g.get("granikv") if g else None
        row["granikv_counters_delta"] = g.get("granikv_delta") if g else None
        out.append(row)
    return out


def _sort_key(key: Tuple) -> Tuple:
    backend, workload, prefix, agents = key
    order = ("homogeneous", "heterogeneous", "agent_loop", "no_sharing", CEILING)
    w = order.index(workload) if workload in order else len(order)
    return (backend != "flashinfer", backend, w, prefix, agents)


# ---- markdown ------------------------------------------------------------------------------


def _num(x: Optional[float], fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pair(a: Optional[float], b: Optional[float]) -> str:
    if a is None and b is None:
        return "–"
    return f"{_num(a, '{:,.1f}')} / {_num(b, '{:,.1f}')}"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = ("| workload | prefix | agents | backend | baseline tok/s | granikv tok/s | speedup "
            "| target | % of ceiling (granikv / baseline) | TTFT p50 / p99 ms, baseline "
            "| TTFT p50 / p99 ms, granikv | TPOT p50 / p99 ms, baseline "
            "| TPOT p50 / p99 ms, granikv | KV tokens peak, baseline / granikv |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        sp = _num(r["speedup"], "{:.2f}x")
        t = r.get("target_speedup")
        if t is not None and r["speedup"] is not None:
            sp += " ✓" if r["speedup"] >= t else " ✗"
        ceil = "–"
        if r["ceiling_ratio"] is not None or r["baseline_ceiling_ratio"] is not None:
            ceil = f"{_num(_pct(r['ceiling_ratio']), '{:.0f}%')} / " \
                   f"{_num(_pct(r['baseline_ceiling_ratio']), '{:.0f}%')}"
        lines.append("| " + " | ".join([
            r["workload"] + (f" ({r['turns']} turns)" if r.get("turns", 1) > 1 else ""),
            f"{r['prefix_len']:,}", str(r["agents"]), r["backend"],
            _num(r["baseline_out_tok_s"]), _num(r["granikv_out_tok_s"]), sp,
            _num(t, "≥{:.2f}x"), ceil,
            _pair(r["baseline_ttft_p50_ms"], r["baseline_ttft_p99_ms"]),
            _pair(r["granikv_ttft_p50_ms"], r["granikv_ttft_p99_ms"]),
            _pair(r["baseline_tpot_p50_ms"], r["baseline_tpot_p99_ms"]),
            _pair(r["granikv_tpot_p50_ms"], r["granikv_tpot_p99_ms"]),
            f"{_num(r['baseline_kv_used_tokens_peak'])} / {_num(r['granikv_kv_used_tokens_peak'])}",
        ]) + " |")
    return "\n".join(lines)


def _target_source(meta: Mapping[str, Any]) -> str:
    key = _run_key(meta)
    source = TARGETS_BY_RUN.get(key, ("",))[0]
    return source or f"none (none is set for {key[0]} at TP {key[1]}, DP {key[2]})"


def _pct(x: Optional[float]) -> Optional[float]:
    return None if x is None else 100.0 * x


def markdown(rows: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
             meta: Mapping[str, Any], png: Optional[str]) -> str:
    infos = [r for r in records if r.get("kind") == "info"]
    errors = [r for r in records if r.get("kind") == "error"]
    gpus = sorted({str(i.get("gpu")) for i in infos})
    caps = ", ".join(f"{i['backend']}/{i['config']} {_num(i.get('max_total_num_tokens'))}"
                     for i in infos)
    cmds = meta.get("commands") or [meta.get("command")]
    out = ["# Multi-agent benchmark: SGLang vs SGLang + GraniKV", "",
           f"GPU: {', '.join(gpus) or 'unknown'}; model: {meta.get('model')} (dummy bf16 weights), "
           f"TP {meta.get('tp')}, DP {meta.get('dp')}; date: {meta.get('date')}; "
           f"SGLang {next((i.get('version') for i in infos if i.get('version')), '?')}.", "",
           "Method: per row the radix cache is flushed, each shared prefix is cached by one "
           "warm-up request, then all agents are submitted at once (agent loop: each agent's "
           "next turn as soon as its previous one completes); greedy, ignore_eos. Output tok/s = "
           "output tokens / wall time of the batch; TTFT = first token − submit; TPOT = (last − "
           "first token) / (tokens − 1), per request. Ceiling = the same engine with a "
           "256-token prefix at the same agent count (bound on any prefix-sharing gain). KV "
           "tokens peak = SGLang's used KV slots, polled every 0.25 s. Targets: "
           f"{_target_source(meta)}.", "",
           "Command:", ""]
    out += [f"    {c}" for c in cmds if c]
    out += ["", markdown_table(rows), "", f"KV pool capacity (tokens): {caps or '–'}."]
    if png:
        out += ["", f"![throughput]({png})"]
    for backend, a in (meta.get("agreement") or {}).items():
        out += ["", f"Output agreement ({backend}; probe {a['probe']}): baseline vs itself "
                f"{a['baseline_self_agreement']:.1%} of tokens, GraniKV vs baseline "
                f"{a['granikv_vs_baseline_agreement']:.1%} (target: >= baseline's own); max "
                f"|logprob| difference on equal tokens {a['max_logprob_diff_same_token']} "
                f"(tolerance {a['logprob_atol']})."]
    out += floor_section(rows, meta)
    if errors:
        out += ["", "Errors:", ""] + [f"- {e['backend']}/{e['config']}: {e['error']}" for e in errors]
    return "\n".join(out) + "\n"


def floor_section(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> List[str]:
    """The bounds.py floor of every row it can bound, at its default peak rates (markdown lines;
    none when no row can be bounded or the model's config is not in configs/)."""
    try:
        found = bounds.bound_rows(dict(meta=dict(meta), rows=list(rows)), bounds.DEFAULT_TFLOPS * 1e12,
                                  bounds.DEFAULT_TBPS * 1e12)
    except (OSError, KeyError):
        return []
    if not found:
        return []
    return ["", f"Floor (`bounds.py`: the ceiling row's wall time plus the long prefix's attention at "
            f"{bounds.DEFAULT_TFLOPS:g} TFLOP/s and {bounds.DEFAULT_TBPS:g} TB/s, no overhead; what any "
            "prefix-sharing layer on this engine could reach at best):", "", bounds.to_markdown(found)]


def with_floors(rows: List[Dict[str, Any]], meta: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Every row with its ``floor_speedup`` / ``floor_fraction`` (bounds.annotate); the rows
    unchanged when the run's model has no config under configs/."""
    try:
        return bounds.annotate(dict(meta=dict(meta), rows=rows))
    except (OSError, KeyError):
        return rows


# ---- plot ----------------------------------------------------------------------------------


def plot(rows: Sequence[Mapping[str, Any]], path: Path, *, quiet: bool = False) -> bool:
    """Grouped bars per backend: baseline vs granikv tok/s per row, ceiling as a marker.
    Returns False (and says so) when matplotlib is not importable."""
    plt = pyplot(quiet, str(path))
    if plt is None:
        return False
    backends = sorted({r["backend"] for r in rows}, key=lambda b: (b != "flashinfer", b))
    if not backends:
        return False
    fig, axes = plt.subplots(len(backends), 1, figsize=(max(8, 0.9 * len(rows)), 4 * len(backends)),
                             squeeze=False)
    for ax, backend in zip(axes[:, 0], backends):
        sel = [r for r in rows if r["backend"] == backend]
        xs = range(len(sel))
        base = [r["baseline_out_tok_s"] or 0 for r in sel]
        gkv = [r["granikv_out_tok_s"] or 0 for r in sel]
        ax.bar([x - 0.2 for x in xs], base, 0.4, label="SGLang")
        ax.bar([x + 0.2 for x in xs], gkv, 0.4, label="SGLang + GraniKV")
        ceil = [(x, r["ceiling_out_tok_s"]) for x, r in zip(xs, sel)
                if r["ceiling_out_tok_s"] and r["workload"] != CEILING]
        if ceil:
            ax.scatter([c[0] for c in ceil], [c[1] for c in ceil], marker="_", s=400, color="k",
                       label="256-token-prefix ceiling", zorder=3)
        for x, r, top in zip(xs, sel, [max(a, b) for a, b in zip(base, gkv)]):
            if r["speedup"]:
                ax.annotate(f"{r['speedup']:.2f}x", (x, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['workload']}\n{r['prefix_len']}x{r['agents']}" for r in sel],
                           fontsize=7)
        ax.set_ylabel("output tok/s")
        ax.set_title(f"attention backend: {backend}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- files ---------------------------------------------------------------------------------


def write(out_dir: str, records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], *,
          tag: str = "", quiet: bool = False) -> List[Path]:
    """Writes multi_agent[_tag].json / .md / .png into out_dir; returns the paths written.
    quiet: no note when matplotlib is missing (run.py rewrites the files after every row)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "multi_agent" + (f"_{tag}" if tag else "")
    model, tp, dp = _run_key(meta)
    rows = combine(records, model=model, tp=tp, dp=dp)
    for r in rows:
        r.update(date=meta.get("date"), command=meta.get("command") or meta.get("commands"))
    rows = with_floors(rows, meta)
    png = out / f"{stem}.png"
    have_png = plot(rows, png, quiet=quiet) if rows else False
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    write_json(paths[0], dict(meta=dict(meta), rows=rows, measurements=list(records)))
    paths[1].write_text(markdown(rows, records, meta, png.name if have_png else None))
    return paths + ([png] if have_png else [])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Rebuild the multi-agent report from run outputs.")
    p.add_argument("inputs", nargs="+", help="multi_agent*.json files written by run.py")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in a.inputs]
    # a later row with the same backend/config/workload/prefix/agents replaces the earlier one
    # (infos likewise per backend/config)
    records = merge_records((d.get("measurements", []) for d in docs), row_key=lambda r: (r["config"],) + _key(r),
                            info_key=lambda r: (r["backend"], r["config"]))
    metas = [d.get("meta", {}) for d in docs]
    meta = dict(metas[-1], commands=commands_of(metas))
    meta.pop("command", None)
    paths = write(a.out, records, meta, tag=a.tag)
    print("wrote", ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
