"""The correctness check's rows (one per workload and backend) and its report files.

Input: ``engines[(backend, config)]`` = a child's RESULT (``workloads[name]`` holds the
engine's ``outputs``, the increase of GraniKV's counters over the workload, ``granikv_delta``,
and its absolute counters at the workload's end, ``granikv_state``), configs ``baseline`` /
``granikv`` / ``fault``. A missing engine leaves its columns None.

A row (one workload, one backend) passes when GraniKV passes both rules (metrics.py):

- layer outputs (``metrics.layer_passes``): the debug compare (``--granikv-debug-compare-every``,
  attention/debug/compare.py) compared at least one decode layer-step of the workload and none deviated
  from the stock output by more than its tolerance (TOLERANCE_FACTOR x the stock output's own
  deviation from float64, at least FLOOR_EPS x the dtype's eps). Columns: the layer-steps
  compared / over tolerance in this workload, and the engine's ``layer_output_max_rel_dev``,
  ``layer_output_stock_max_rel_dev`` and ``layer_output_tolerance``: maxima over every layer-step
  it compared up to this workload's end (workloads run in table order, so a later row's maxima
  include the earlier workloads');
- tokens (``metrics.token_passes``): agreement >= stock-vs-stock agreement - max(margin, 2 x
  the paired bootstrap stderr of the difference), first-token and logprob clauses;

and GraniKV's own attention ran (its counters). The planted fault is caught only when EACH
applied rule rejects the fault engine (``fault_caught_by`` names those that did). With the
compare off (no ``layer_output`` counters) the layer rule is not applied (None) and the tokens
decide alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmark.correctness import metrics

ATTENTION_KEYS = ("decode_steps", "steps_per_path", "unplanned_steps", "extend_batches",
                  "extend_hot_batches", "extend_exact_batches", "extend_fallbacks", "decode_paged_reasons")


#: The engine config of the FP8 check's references (check.py ``--dequantized-reference``): stock
#: kernels over a bf16 cache holding the K/V rounded through the FP8 format, on both backends.
DEQUANTIZED = "dequantized"
DEQUANTIZED_BACKENDS = ("flashinfer", "triton")
#: The engine config of a one-backend model's second correct kernel (check.py ``--model gpt-oss``):
#: the same stock backend with another decode KV split count.
SPLITS = "splits"


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


LAYER_DELTA_KEYS = ("compares", "over_tolerance", "f64_references")  # counts: this workload's
LAYER_STATE_KEYS = ("max_rel_dev", "stock_max_rel_dev", "tolerance")  # maxima: the engine's so far


def _layer(engines, backend: str, config: str, workload: str) -> Optional[Dict[str, Any]]:
    """The debug compare's layer-output figures of the engine over this workload (keys without
    the ``layer_output_`` prefix), None when it compared nothing ever (compare off, baseline or
    absent engine)."""
    w = ((engines.get((backend, config)) or {}).get("workloads") or {}).get(workload) or {}
    delta = (w.get("granikv_delta") or {}).get("attention") or {}
    state = (w.get("granikv_state") or {}).get("attention") or {}
    if "layer_output_compares" not in state:
        return None
    out = {k: int(delta.get(f"layer_output_{k}", 0)) for k in LAYER_DELTA_KEYS}
    out.update({k: state.get(f"layer_output_{k}") for k in LAYER_STATE_KEYS})
    return out


def decode_path_ran(att: Optional[Mapping[str, Any]]) -> bool:
    """Whether GraniKV's own decode attention served any step (a non-paged decode step)."""
    if not att:
        return False
    return sum(n for p, n in (att.get("steps_per_path") or {}).items() if p != "paged") > 0


def fast_path_ran(att: Optional[Mapping[str, Any]]) -> bool:
    """Whether GraniKV's own attention served any step: a non-paged decode step or an extend
    batch over HOT extents. A check where it never ran proves nothing."""
    return decode_path_ran(att) or bool(att and att.get("extend_hot_batches", 0) > 0)


def forces_decode_path(meta: Mapping[str, Any]) -> bool:
    """The check forced GraniKV's engines onto a non-paged decode path (``--attention-path``):
    then a row whose decode steps all ran paged has not checked GraniKV's decode."""
    return meta.get("attention_path") not in (None, "auto", "paged")


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


def _ci(c: Optional[metrics.Comparison]) -> Optional[List[float]]:
    return None if c is None or c.agreement_ci95 is None else [_r(x) for x in c.agreement_ci95]


def _verdict(token: Optional[bool], layer: Optional[bool]) -> Optional[bool]:
    """Both applied rules pass (a None layer rule: not applied); None without a token verdict."""
    if token is None:
        return None
    return token and layer is not False


def _rejected_by(token: Optional[bool], layer: Optional[bool]) -> Optional[List[str]]:
    """The applied rules that reject (``tokens``, ``layer_output``); None without a verdict."""
    if token is None:
        return None
    return [name for name, ok in (("tokens", token), ("layer_output", layer)) if ok is False]


def _token_pair(engines, workload: str, backend: str, backends: Sequence[str],
                stock: Optional[metrics.Outputs]):
    """``(base, reference, label)`` of the token rule: GraniKV is compared with ``base``, and
    ``base`` with ``reference`` (two correct kernels on the same prompts): ``stock`` (this
    backend's baseline) and the other backend's, or, with dequantized engines (an FP8 check),
    the same backend's dequantized engine and the other dequantized one, or, with a SPLITS engine
    (a model one backend serves), ``stock`` and that engine."""
    if (backend, SPLITS) in engines:
        return stock, _outputs(engines, backend, SPLITS, workload), f"{backend} vs {backend} with another KV split count"
    if any(c == DEQUANTIZED for _, c in engines):
        other = next(b for b in DEQUANTIZED_BACKENDS if b != backend)
        label = f"{backend} vs {other}, both stock over the dequantized KV"
        return (_outputs(engines, backend, DEQUANTIZED, workload),
                _outputs(engines, other, DEQUANTIZED, workload), label)
    others = [b for b in backends if b != backend]
    if not others:  # one backend and no dequantized engines: no reference
        return stock, None, None
    return stock, _outputs(engines, others[0], "baseline", workload), f"{backend} vs {others[0]}"


def row(engines, workload: str, backend: str, backends: Sequence[str], *, layer_rule: bool = True) -> Dict[str, Any]:
    """One (workload, backend) row. ``layer_rule`` False: the GraniKV engines ran without the
    debug compare (check.py ``--compare-every 0``), so the layer-output rule is not applied
    (None) rather than failed for comparing nothing."""
    stock = _outputs(engines, backend, "baseline", workload)
    base, reference, label = _token_pair(engines, workload, backend, backends, stock)
    cross_pair: Tuple[Optional[metrics.Outputs], ...] = (base, reference)
    cross = metrics.compare(*cross_pair) if None not in cross_pair else None
    out: Dict[str, Any] = dict(workload=workload, backend=backend, cross_backend=label)
    outputs: Dict[str, Optional[metrics.Outputs]] = {}
    for config, key in (("granikv", "granikv"), ("fault", "fault")):
        ours = outputs[config] = _outputs(engines, backend, config, workload)
        c = metrics.compare(ours, base) if ours is not None and base is not None else None
        out[f"{key}_agreement"] = _r(c.agreement) if c else None
        out[f"{key}_agreement_stderr"] = _r(c.agreement_stderr) if c else None
        out[f"{key}_agreement_ci95"] = _ci(c)
        out[f"{key}_first_token_agreement"] = _r(c.first_token_agreement) if c else None
        out[f"{key}_logprob_dev_mean"] = _r(c.logprob_dev_mean) if c else None
        both = c is not None and cross is not None
        out[f"{key}_agreement_diff_stderr"] = _r(metrics.difference_stderr(c, cross)) if both else None
        out[f"{key}_agreement_threshold"] = _r(metrics.agreement_threshold(c, cross)) if both else None
        out[f"{key}_first_token_threshold"] = _r(metrics.first_token_threshold(c, cross)) if both else None
        out[f"{key}_per_request"] = [list(p) for p in c.per_request] if c else None  # re-judging needs them
        token = metrics.token_passes(c, cross) if both else None
        layer = _layer(engines, backend, config, workload) if layer_rule else None
        layer_ok = metrics.layer_passes(layer)
        out[f"{key}_token_passes"] = token
        out[f"{key}_layer_passes"] = layer_ok
        out[f"{key}_layer_output_compares"] = layer["compares"] if layer else None
        out[f"{key}_layer_output_over_tolerance"] = layer["over_tolerance"] if layer else None
        out[f"{key}_layer_output_f64_references"] = layer["f64_references"] if layer else None
        for k in LAYER_STATE_KEYS:
            v = layer[k] if layer else None
            out[f"{key}_layer_output_{k}"] = None if v is None else float(f"{v:.4g}")
        out[f"{key}_passes"] = _verdict(token, layer_ok)
        out[f"{key}_rejected_by"] = _rejected_by(token, layer_ok)
        att = _attention(engines, backend, config, workload)
        out[f"{key}_attention"] = att
        out[f"{key}_fast_path_ran"] = fast_path_ran(att) if ours is not None else None
        out[f"{key}_decode_path_ran"] = decode_path_ran(att) if ours is not None else None
    # the column names the results format fixes
    out["granikv_vs_baseline_agreement"] = out.pop("granikv_agreement")
    out["first_token_agreement"] = out.pop("granikv_first_token_agreement")
    out["logprob_dev_mean"] = out.pop("granikv_logprob_dev_mean")
    out["cross_backend_agreement"] = _r(cross.agreement) if cross else None
    out["cross_agreement_stderr"] = _r(cross.agreement_stderr) if cross else None
    out["cross_agreement_ci95"] = _ci(cross)
    out["cross_first_token_agreement"] = _r(cross.first_token_agreement) if cross else None
    out["cross_logprob_dev_mean"] = _r(cross.logprob_dev_mean) if cross else None
    out["cross_per_request"] = [list(p) for p in cross.per_request] if cross else None
    # GraniKV against the same backend's stock engine over the same cache (the token rule's base
    # unless dequantized engines stand in for it)
    ours = outputs["granikv"]
    vs_stock = metrics.compare(ours, stock) if ours is not None and stock is not None else None
    out["granikv_vs_stock_agreement"] = _r(vs_stock.agreement) if vs_stock else None
    out["passed"] = out.pop("granikv_passes")
    out.pop("granikv_rejected_by")
    out.pop("fault_passes")
    # caught only when every applied rule rejects the fault engine on its own
    caught_by = out.pop("fault_rejected_by")
    applied = 1 + (out["fault_layer_passes"] is not None)
    out["fault_caught_by"] = caught_by
    out["planted_fault_caught"] = None if caught_by is None else len(caught_by) == applied
    out["requests"] = len(stock.ids) if stock is not None else None
    return out


def rows(engines, workloads: Sequence[str], backends: Sequence[str], *,
         layer_rule: bool = True) -> List[Dict[str, Any]]:
    return [row(engines, w, b, backends, layer_rule=layer_rule) for w in workloads for b in backends]


def all_ok(meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]], *, fault: bool) -> bool:
    """Every row passed with GraniKV's attention exercised (its decode path too where the check
    forced one), every planted fault was caught, and no engine failed."""
    if meta.get("errors") or not rows_:
        return False
    decode = forces_decode_path(meta)
    for r in rows_:
        if r["passed"] is not True or not r["granikv_fast_path_ran"]:
            return False
        if decode and not r.get("granikv_decode_path_ran"):
            return False
        if fault and r["planted_fault_caught"] is not True:
            return False
    return True


def fault_summary(rows_: Sequence[Mapping[str, Any]]) -> str:
    """One line per row: whether the planted fault was caught, and by which rules (caught only
    when every applied rule rejected it)."""
    lines = ["planted fault:"]
    for r in rows_:
        by = r.get("fault_caught_by")
        verdict = {True: "caught", False: "NOT caught", None: "no verdict"}[r.get("planted_fault_caught")]
        lines.append(f"  {r['workload']}/{r['backend']}: {verdict}"
                     + ("" if by is None else f" (rejected by: {', '.join(by) or 'no rule'})"))
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def _pm(x: Optional[float], se: Optional[float]) -> str:
    return _fmt(x) if x is None or se is None else f"{x:.3f} ± {se:.3f}"


def _dev(r: Mapping[str, Any], key: str) -> str:
    """``dev / tolerance (n)`` of ``key``'s layer compare; ``n``: layer-steps compared in the
    workload, ``k over`` of them above their tolerance."""
    n = r.get(f"{key}_layer_output_compares")
    if n is None:
        return "–"
    over = r.get(f"{key}_layer_output_over_tolerance") or 0
    dev, tol = r.get(f"{key}_layer_output_max_rel_dev"), r.get(f"{key}_layer_output_tolerance")
    return (f"{_g(dev)} / {_g(tol)} ({n}" + (f", {over} over" if over else "") + ")")


def _g(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2g}"


def _by(rules: Optional[Sequence[str]]) -> str:
    return f" ({', '.join(rules) or 'none'})" if rules is not None else ""


def _arch(m: Mapping[str, Any]) -> str:
    """The check model in words (a run recorded before the field existed was a Llama)."""
    if m.get("architecture") == "GptOssForCausalLM":
        return (f"gpt-oss-shaped model (sliding window {m.get('window')} on every other layer, attention "
                f"sinks, {m.get('num_experts')} experts top {m.get('experts_per_token')})")
    if m.get("architecture") == "Qwen3MoeForCausalLM":
        return (f"Qwen3-MoE-shaped model (q/k norms, {m.get('num_experts')} experts top "
                f"{m.get('experts_per_token')})")
    return "Llama"


def markdown(meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]]) -> str:
    m = meta.get("model", {})
    lines = [
        "# Correctness on a context-sensitive model: GraniKV vs stock SGLang",
        "",
        f"Model: random-normal {_arch(m)} (std {m.get('std')}), {m.get('num_layers')} layers, "
        f"{m.get('num_q_heads')} q / {m.get('num_kv_heads')} kv heads of {m.get('head_dim')}, "
        f"hidden {m.get('hidden')}, vocab {m.get('vocab')}, {m.get('dtype')}; loaded from a "
        f"safetensors checkpoint. GPU: {meta.get('gpu')}. Greedy, logprobs. GraniKV decode "
        f"path: {meta.get('attention_path')}. Planted fault: GRANIKV_DEBUG_FAULT="
        f"{meta.get('fault')}. Date {meta.get('date')}, {meta.get('seconds')} s.",
        "",
        "Agreement = tokens before each request's first differing token / all tokens (± its "
        "bootstrap stderr over requests); logprob dev = mean |logprob difference| before it. "
        "Layer dev = max over compared decode layer-steps of max|GraniKV - stock| / max|stock| "
        "(every layer of every "
        f"{meta.get('compare_every')}-th eager decode step); tolerance = "
        f"{meta.get('tolerance_factor')}x the stock output's own deviation from float64, at least "
        f"{meta.get('floor_eps')}x the dtype's eps. A row passes when no compared layer-step "
        "exceeds its tolerance AND GraniKV's agreement >= cross-backend agreement - max("
        f"{meta.get('margin')}, {meta.get('agreement_z', 2.0):g} x the paired bootstrap stderr of the difference) (first token "
        f"likewise: at least the cross-backend share less max({meta.get('margin')}, "
        f"{meta.get('agreement_z', 2.0):g} x the paired bootstrap stderr of that difference); logprob dev "
        f"within {meta.get('logprob_factor')}x theirs + {meta.get('logprob_slack')}); the fault is caught when EACH rule rejects the fault "
        "engine (caught by: the rules that did).",
        "",
    ]
    if not meta.get("compare_every"):
        lines += ["No debug compare ran (`--compare-every 0`: CUDA graphs on): the layer rule is not "
                  "applied; the tokens decide, and catch the fault alone.", ""]
    if meta.get("dequantized_reference"):
        lines += [
            f"KV cache: {meta.get('kv_cache_dtype')}. Token rule's references: stock "
            f"{' and '.join(meta['dequantized_reference'])} over a bf16 cache holding the K/V rounded "
            f"through {meta.get('kv_cache_dtype')} (GRANIKV_DEBUG_KV_ROUND); GraniKV and the fault are "
            "compared with the same backend's such engine, the cross column is the two with each "
            "other, and `GraniKV vs stock` is GraniKV against the stock engine over the same FP8 "
            "cache (SGLang's FP8 triton decode also rounds the query and probabilities to FP8). The "
            "layer rule compares with that stock engine.",
            "",
        ]
    lines += [
        "| workload | backend | requests | GraniKV agree | cross-backend agree | agree bar | "
        "first token (GraniKV / cross) | logprob dev (GraniKV / cross) | layer dev / tolerance "
        "(layer-steps) | GraniKV path ran | passed | fault agree | fault layer dev | fault "
        "caught (by) | GraniKV vs stock |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|---:|",
    ]
    for r in rows_:
        lines.append(
            f"| {r['workload']} | {r['backend']} | {_fmt(r['requests'])} | "
            f"{_pm(r['granikv_vs_baseline_agreement'], r.get('granikv_agreement_stderr'))} | "
            f"{_pm(r['cross_backend_agreement'], r.get('cross_agreement_stderr'))} | "
            f"{_fmt(r.get('granikv_agreement_threshold'))} | "
            f"{_fmt(r['first_token_agreement'])} / {_fmt(r['cross_first_token_agreement'])} | "
            f"{_fmt(r['logprob_dev_mean'])} / {_fmt(r['cross_logprob_dev_mean'])} | "
            f"{_dev(r, 'granikv')} | "
            f"{_path_ran(r)} | {_fmt(r['passed'])} | "
            f"{_pm(r['fault_agreement'], r.get('fault_agreement_stderr'))} | {_dev(r, 'fault')} | "
            f"{_fmt(r['planted_fault_caught'])}{_by(r.get('fault_caught_by'))} | "
            f"{_fmt(r.get('granikv_vs_stock_agreement'))} |")
    prefill = prefill_lines(rows_)
    if prefill:
        lines += ["", "GraniKV's prefill per row (extend batches with a cached prefix; a request "
                  "prefilled by the stock kernel can start differently from the reference):", ""]
        lines += prefill
    decode = decode_lines(rows_)
    if decode:
        lines += ["", "GraniKV's decode steps sent to the stock path before any path choice, per row "
                  "(`decode_paged_reasons`):", ""]
        lines += decode
    for e in meta.get("errors") or []:
        lines.append(f"\nEngine failure: {e}")
    lines.append("")
    lines.append(f"Command: `{meta.get('command')}`")
    return "\n".join(lines) + "\n"


def _path_ran(r: Mapping[str, Any]) -> str:
    """The "GraniKV path ran" cell: yes (its decode path served steps), prefill only, or no."""
    if r.get("granikv_fast_path_ran") is None:
        return _fmt(None)
    if r.get("granikv_decode_path_ran"):
        return "yes"
    return "prefill only" if r["granikv_fast_path_ran"] else "**no**"


def prefill_lines(rows_: Sequence[Mapping[str, Any]]) -> List[str]:
    """One line per row whose GraniKV engine counted extend batches: how many ran over HOT
    extents and why the others stayed stock (``extend_fallbacks``)."""
    out = []
    for r in rows_:
        att = r.get("granikv_attention") or {}
        n = att.get("extend_batches")
        if not n:
            continue
        left = att.get("extend_fallbacks") or {}
        why = ", ".join(f"{reason}: {k}" for reason, k in sorted(left.items()) if k) or "none"
        exact = att.get("extend_exact_batches", 0)
        also = f", computed over the FP8 cache's values without a HOT run in {exact}" if exact else ""
        out.append(f"- {r['workload']} / {r['backend']}: over HOT extents in {att.get('extend_hot_batches', 0)} "
                   f"of {n} extend batches{also}; left stock: {why}")
    return out


def decode_lines(rows_: Sequence[Mapping[str, Any]]) -> List[str]:
    """One line per row whose GraniKV engine sent decode steps paged before choosing a path
    (``decode_paged_reasons``: no cascade graph of the batch size, no HOT prefix, ...)."""
    out = []
    for r in rows_:
        att = r.get("granikv_attention") or {}
        why = {k: n for k, n in (att.get("decode_paged_reasons") or {}).items() if n}
        if why:
            steps = att.get("decode_steps", 0)
            out.append(f"- {r['workload']} / {r['backend']}: " + ", ".join(
                f"{reason}: {n}" for reason, n in sorted(why.items())) + f" (of {steps} decode steps)")
    return out


def write(out_dir: str, meta: Mapping[str, Any], rows_: Sequence[Mapping[str, Any]]) -> List[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / "correctness.json", out / "correctness.md"
    j.write_text(json.dumps({"meta": dict(meta), "rows": list(rows_)}, indent=1, default=str))
    md.write_text(markdown(meta, rows_))
    return [j, md]
