"""The correctness check's rows (one per workload and backend) and its report files.

Input: ``engines[(backend, config)]`` = a child's RESULT (``workloads[name]`` holds the
engine's ``outputs`` and the increase of GraniKV's counters, ``granikv_delta``), configs
``baseline`` / ``granikv`` / ``fault``. A missing engine leaves its columns None.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import metrics

ATTENTION_KEYS = ("decode_steps", "steps_per_path", "unplanned_steps", "extend_batches",
                  "extend_hot_batches", "extend_fallbacks")


def _outputs(engines, backend: str, config: str, workload: str) -> Optional[metrics.Outputs]:
    e = engines.get((backend, config))
    if e is None or workload not in e.get("workloads", {}):
        return None
    return metrics.Outputs.from_json(e["workloads"][workload]["outputs"])


def _attention(engines, backend: str, config: str, workload: str) -> Optional[Dict[str, Any]]:
    """The engine's attention counters over this workload (None: baseline or absent)."""
    e = engines.get((backend, config))
    delta = (e or {}).get("workloads", {}).get(workload, {}).get("granikv_delta")
    if not delta:
        return None
    att = delta.get("attention") or {}
    return {k: att[k] for k in ATTENTION_KEYS if k in att}


def fast_path_ran(att: Optional[Mapping[str, Any]]) -> bool:
    """Whether GraniKV's own attention served any step: a non-paged decode step or an extend
    batch over HOT extents. A check where it never ran proves nothing."""
    if not att:
        return False
    decode = sum(n for p, n in (att.get("steps_per_path") or {}).items() if p != "paged")
    return decode > 0 or att.get("extend_hot_batches", 0) > 0


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def row(engines, workload: str, backend: str, backends: Sequence[str]) -> Dict[str, Any]:
    base = _outputs(engines, backend, "baseline", workload)
    others = [b for b in backends if b != backend]
    cross_pair: Tuple[Optional[metrics.Outputs], ...] = (
        base, _outputs(engines, others[0], "baseline", workload) if others else None)
    cross = metrics.compare(*cross_pair) if None not in cross_pair else None
    out: Dict[str, Any] = dict(workload=workload, backend=backend,
                               cross_backend=f"{backend} vs {others[0]}" if others else None)
    for config, key in (("granikv", "granikv"), ("fault", "fault")):
        ours = _outputs(engines, backend, config, workload)
        c = metrics.compare(ours, base) if ours is not None and base is not None else None
        out[f"{key}_agreement"] = _r(c.agreement) if c else None
        out[f"{key}_agreement_stderr"] = _r(c.agreement_stderr) if c else None
        out[f"{key}_first_token_agreement"] = _r(c.first_token_agreement) if c else None
        out[f"{key}_logprob_dev_mean"] = _r(c.logprob_dev_mean) if c else None
        out[f"{key}_passes"] = metrics.passes(c, cross) if c and cross else None
        att = _attention(engines, backend, config, workload)
        out[f"{key}_attention"] = att
        out[f"{key}_fast_path_ran"] = fast_path_ran(att) if ours is not None else None
    # the column names the results format fixes
    out["granikv_vs_baseline_agreement"] = out.pop("granikv_agreement")
    out["first_token_agreement"] = out.pop("granikv_first_token_agreement")
    out["logprob_dev_mean"] = out.pop("granikv_logprob_dev_mean")
    out["cross_backend_agreement"] = _r(cross.agreement) if cross else None
    out["cross_agreement_stderr"] = _r(cross.agreement_stderr) if cross else None
    out["cross_first_token_agreement"] = _r(cross.first_token_agreement) if cross else None
    out["cross_logprob_dev_mean"] = _r(cross.logprob_dev_mean) if cross else None
    out["passed"] = out.pop("granikv_passes")
    fault_passes = out.pop("fault_passes")
    out["planted_fault_caught"] = None if fault_passes is None else not fault_passes
    out["requests"] = len(base.ids) if base is not None else None
    return out


def rows(engines, workloads: Sequence[str], backends: Sequence[str]) -> List[Dict[str, Any]]:
    return [row(engines, w, b, backends) for w in workloads for b in backends]


def all_ok(meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]], *, fault: bool) -> bool:
    """Every row passed with GraniKV's attention exercised, every planted fault was caught,
    and no engine failed."""
    if meta.get("errors") or not rows_:
        return False
    for r in rows_:
        if r["passed"] is not True or not r["granikv_fast_path_ran"]:
            return False
        if fault and r["planted_fault_caught"] is not True:
            return False
    return True


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def markdown(meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]]) -> str:
    m = meta.get("model", {})
    lines = [
        "# Correctness on a context-sensitive model: GraniKV vs stock SGLang",
        "",
        f"Model: random-normal Llama (std {m.get('std')}), {m.get('num_layers')} layers, "
        f"{m.get('num_q_heads')} q / {m.get('num_kv_heads')} kv heads of {m.get('head_dim')}, "
        f"hidden {m.get('hidden')}, vocab {m.get('vocab')}, {m.get('dtype')}; loaded from a "
        f"safetensors checkpoint. GPU: {meta.get('gpu')}. Greedy, logprobs. GraniKV decode "
        f"path: {meta.get('attention_path')}. Planted fault: GRANIKV_DEBUG_FAULT="
        f"{meta.get('fault')}. Date {meta.get('date')}, {meta.get('seconds')} s.",
        "",
        "Agreement = tokens before each request's first differing token / all tokens; logprob "
        "dev = mean |logprob difference| before it. A row passes when GraniKV vs stock is within "
        f"{meta.get('margin')} of stock flashinfer vs stock triton (and its logprob dev within "
        f"{meta.get('logprob_factor')}x theirs + {meta.get('logprob_slack')}); the fault is "
        "caught when the fault engine does not pass.",
        "",
        "| workload | backend | requests | GraniKV agree | cross-backend agree | first token "
        "(GraniKV / cross) | logprob dev (GraniKV / cross) | GraniKV path ran | passed | fault "
        "agree | fault caught |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rows_:
        lines.append(
            f"| {r['workload']} | {r['backend']} | {_fmt(r['requests'])} | "
            f"{_fmt(r['granikv_vs_baseline_agreement'])} | {_fmt(r['cross_backend_agreement'])} | "
            f"{_fmt(r['first_token_agreement'])} / {_fmt(r['cross_first_token_agreement'])} | "
            f"{_fmt(r['logprob_dev_mean'])} / {_fmt(r['cross_logprob_dev_mean'])} | "
            f"{_fmt(r['granikv_fast_path_ran'])} | {_fmt(r['passed'])} | "
            f"{_fmt(r['fault_agreement'])} | {_fmt(r['planted_fault_caught'])} |")
    for e in meta.get("errors") or []:
        lines.append(f"\nEngine failure: {e}")
    lines.append("")
    lines.append(f"Command: `{meta.get('command')}`")
    return "\n".join(lines) + "\n"


def write(out_dir: str, meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]]) -> List[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / "correctness.json", out / "correctness.md"
    j.write_text(json.dumps({"meta": dict(meta), "rows": list(rows_)}, indent=1, default=str))
    md.write_text(markdown(meta, rows_))
    return [j, md]
