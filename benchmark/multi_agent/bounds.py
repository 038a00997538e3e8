"""Upper bound on any shared-prefix speedup, per benchmark row (no GPU needed).

A row's throughput counts its prefill and its decode. Against the row's ceiling (the same
workload with every shared prefix cut to 256 tokens, measured on the stock engine in the same
run), a long shared prefix adds only attention work; everything else (GEMMs, sampling,
scheduling, the private histories' attention) is the ceiling's. So the row's wall time is at
least::

    floor = ceiling wall
          + prefill:  4 * sum_i L_i * (S_i + n_i * (turns - 1) * tool) * Hq * D * layers / peak FLOP/s
          + decode:   turns * (out - 1) * layers * per-layer step extra, where per layer and step
                        max(4 * sum_i n_i * L_i * Hq * D / peak FLOP/s,       every query sees
                            sum_i L_i * Hkv * D * 2 (K, V) * bytes / peak B/s)  its prefix; each
                                                                                prefix read once
                      - sum_i n_i * min(L_i, 256) * Hkv * D * 2 * bytes / peak B/s
                                                  (the ceiling's own short prefix, read per request)

for prefix groups i (L_i tokens, n_i agents, S_i private suffix tokens in all); one sum over
the distinct prefixes of a forest; an agent loop (turns > 1) prefills each later turn's tool
result against the prefix (the outputs before it are cached) and decodes turns * (out - 1)
steps at least, its private history growing inside the ceiling's wall. Hq, Hkv, D and layers
are the row's model shape (its config under configs/, heads divided by TP), so GQA 3, 4, 7 ...
each get their own bytes-to-FLOPs balance; ``layers`` counts full-attention layers only (a hybrid
model's sliding-window layers read their window whatever the prefix: nothing to remove there). Peak rates: the best attention rate measured on the
host (FlashInfer FA3 prefill over a HOT extent, 646-647 TFLOP/s, docs/results/kernels.md) and
the H200's HBM bandwidth (4.8 TB/s).

``floor_speedup`` = floor tok/s / stock tok/s, at least 1 (the stock engine is always
reachable: a layer that does nothing matches it); ``floor_fraction`` = GraniKV tok/s / floor
tok/s. Rows with nothing shared (no prefix, or one agent per prefix) have the stock engine as
their floor (``floor_speedup`` 1) whatever the formula says. Rows without a ceiling of the same
shape get null and a ``floor_reason``.

What it bounds: removing the long prefix's redundant work and nothing else. A prefix-sharing
layer on top of the wrapped engine, with prefix kernels at exactly those rates and no overhead,
would reach the floor. GraniKV also replaces the wrapped backend's attention for the private
tokens (its cascade suffix kernel, its FA3 extend under triton), so where that is faster than
the stock kernel (the triton backend) a row can pass the floor.

    python3 -m benchmark.multi_agent.bounds docs/results/multi_agent.json [--tflops 650 --tbps 4.8]
    python3 -m benchmark.multi_agent.bounds docs/results/multi_agent.json --annotate
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from benchmark.harness import model_config

CEILING_PREFIX = 256
KV_BYTES = 2  # bf16
DEFAULT_TFLOPS = 650.0  # best attention rate measured on the H200 host (FA3 prefill over a HOT extent)
DEFAULT_TBPS = 4.8  # H200 HBM3e bandwidth
CONFIG_DIR = str(model_config.CONFIG_DIR)


class Group(NamedTuple):
    """One shared prefix of a row: its length, its agents, their private suffix tokens in all."""

    prefix: int
    agents: int
    suffix_tokens: int


class Shape(NamedTuple):
    """What the floor needs of a row's workload (see the module docstring)."""

    groups: Tuple[Group, ...]
    out: int  # output tokens per agent and turn
    turns: int = 1
    tool: int = 0  # tokens appended per agent between turns, beyond its own output

    @property
    def agents(self) -> int:
        return sum(g.agents for g in self.groups)

    @property
    def shares(self) -> bool:
        return any(g.agents >= 2 and g.prefix > 0 for g in self.groups)


def model_shape(name: str, tp: int = 1) -> Dict[str, int]:
    """Layers and attention heads (per TP rank) of a model config under configs/, and the bytes
    per KV element (``kv_bytes``: 1 for a ``<config>+fp8_e4m3`` grid model, else 2)."""
    with open(os.path.join(CONFIG_DIR, model_config.split_model_name(name)[0], "config.json")) as f:
        cfg = json.load(f)
    hq = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    # a hybrid model's sliding-window layers read at most their window, however long the prefix:
    # only its full-attention layers have prefix work to remove
    return dict(layers=model_config.full_attention_layers(cfg), hq=hq // tp, hkv=max(1, cfg["num_key_value_heads"] // tp), d=d,
                kv_bytes=model_config.kv_dtype_bytes(name))


def load_model(rows: List[dict], meta: dict) -> Dict[str, int]:
    """Layers and attention heads of the run's model (its config under configs/)."""
    return model_shape(meta.get("model", "llama-3.1-8b"), int(meta.get("tp", 1) or 1))


def shape_of(row: Mapping) -> Optional[Shape]:
    """The prefix groups of a row from its recorded ``params``; None when they do not say.

    Knows every workload builder of workloads.py: homogeneous / ceiling / agent_loop (one
    prefix), heterogeneous (several), grouped (a forest, suffix tokens per prefix recorded) and
    no_sharing (no group).
    """
    p = row.get("params") or {}
    w = row.get("workload_kind") or row.get("workload")
    if "out" not in p:
        return None
    turns = int(p.get("turns", row.get("turns", 1)) or 1)
    if w == "no_sharing" or (w == "grouped" and not p.get("prefixes")):
        return Shape((), p["out"], turns, int(p.get("tool", 0)))
    if w in ("homogeneous", "ceiling", "agent_loop") and "prefix_len" in p and "suffix" in p:
        n = p["agents"]
        return Shape((Group(p["prefix_len"], n, n * p["suffix"]),), p["out"], turns, int(p.get("tool", 0)))
    if w == "heterogeneous" and "prefixes" in p and "suffix" in p:
        return Shape(tuple(Group(L, n, n * p["suffix"]) for L, n in zip(p["prefixes"], p["agents_per_prefix"])),
                     p["out"], turns)
    if w == "grouped" and "suffix_tokens_per_prefix" in p:
        return Shape(tuple(Group(*g) for g in zip(p["prefixes"], p["agents_per_prefix"],
                                                  p["suffix_tokens_per_prefix"])),
                     p["out"], turns, int(p.get("tool", 0)))
    return None


def floor_wall(groups: Sequence[tuple], suffix: int, out: int, ceiling_wall: float, model: Dict[str, int],
               flops: float, bw: float) -> float:
    """Lower bound on a one-shot row's wall time in seconds, every agent with ``suffix`` tokens
    (groups: (prefix tokens, agents))."""
    shape = Shape(tuple(Group(L, n, n * suffix) for L, n in groups), out)
    return floor_wall_of(shape, ceiling_wall, model, flops, bw)


def floor_wall_of(shape: Shape, ceiling_wall: float, model: Dict[str, int], flops: float, bw: float) -> float:
    """Lower bound on the row's wall time in seconds (module docstring)."""
    hq, hkv, d, layers = model["hq"], model["hkv"], model["d"], model["layers"]
    gs, kv = shape.groups, hkv * d * 2 * model.get("kv_bytes", KV_BYTES)
    later_turns = max(0, shape.turns - 1) * shape.tool
    prefill = 4 * sum(g.prefix * (g.suffix_tokens + g.agents * later_turns) for g in gs) * hq * d * layers / flops
    dec_flops = 4 * sum(g.agents * g.prefix for g in gs) * hq * d / flops
    dec_bytes = sum(g.prefix for g in gs) * kv / bw
    ceiling_read = sum(g.agents * min(g.prefix, CEILING_PREFIX) for g in gs) * kv / bw
    decode = shape.turns * (shape.out - 1) * layers * (max(dec_flops, dec_bytes) - ceiling_read)
    return ceiling_wall + prefill + decode


class Floor(NamedTuple):
    floor_tok_s: Optional[float]
    floor_speedup: Optional[float]
    floor_fraction: Optional[float]
    floor_reason: Optional[str]  # why there is no floor (None when there is one)


def floor_of(shape: Optional[Shape], *, baseline: Optional[float], granikv: Optional[float],
             ceiling: Optional[float], model: Optional[Dict[str, int]], flops: float, bw: float) -> Floor:
    """The floor of one row: tok/s, ÷ stock tok/s (>= 1), GraniKV's tok/s ÷ it.

    ceiling: tok/s of the same workload with its prefixes cut to 256 tokens (stock engine);
    not needed for a row that shares nothing.
    """
    if not baseline:
        return Floor(None, None, None, "no stock measurement")
    if shape is None:
        return Floor(None, None, None, "workload shape not recorded (params)")
    frac = lambda best: None if not granikv else round(granikv / best, 4)  # noqa: E731
    if not shape.shares:  # nothing to remove: the stock engine is the floor
        return Floor(baseline, 1.0, frac(baseline), None)
    if not ceiling:
        return Floor(None, None, None, "no ceiling row of the same shape (prefixes cut to 256 tokens)")
    if model is None:
        return Floor(None, None, None, "model shape unknown (no config under configs/)")
    if ceiling < baseline:  # the same engine with the long prefixes cut cannot be slower
        return Floor(None, None, None, "ceiling below the stock row (its one run was slowed)")
    tokens = shape.agents * shape.turns * shape.out
    wall = floor_wall_of(shape, tokens / ceiling, model, flops, bw)
    best = max(tokens / wall, baseline)
    return Floor(round(best, 1), round(best / baseline, 4), frac(best), None)


def _same_shape_ceiling(row: Mapping, ceiling: Mapping) -> bool:
    """multi_agent.json's ceiling row stands for ``row`` when only the prefixes differ."""
    p, c = row.get("params") or {}, ceiling.get("params") or {}
    return (ceiling.get("agents") == row.get("agents") and c.get("out") == p.get("out")
            and c.get("suffix") == p.get("suffix") and int(row.get("turns", 1) or 1) == int(ceiling.get("turns", 1) or 1))


def annotate(doc: Mapping, flops: float = DEFAULT_TFLOPS * 1e12, bw: float = DEFAULT_TBPS * 1e12) -> List[dict]:
    """``floor_speedup`` and ``floor_fraction`` (and ``floor_reason`` where they are null) for
    every row of a multi_agent.json (its ``ceiling`` rows at the same backend and agents) or
    regimes.json (each row's own ``ceiling_out_tok_s``); returns the rows with the keys set."""
    rows, meta = doc["rows"], doc.get("meta", {})
    tp = int(meta.get("tp", 1) or 1)
    ceilings = {(r["backend"], r["agents"]): r for r in rows if r.get("workload") == "ceiling"}
    out = []
    for r in rows:
        name = r.get("model") or meta.get("model", "llama-3.1-8b")
        try:
            model = model_shape(name, tp)
        except OSError:
            model = None
        if "regime" in r or r.get("workload_kind"):  # a regime row carries its own ceiling
            ceiling = r.get("ceiling_out_tok_s")
        else:
            c = ceilings.get((r["backend"], r.get("agents")))
            ceiling = None
            if c is not None and _same_shape_ceiling(r, c):
                ceiling = max(c.get("baseline_out_tok_s") or 0, c.get("granikv_out_tok_s") or 0) or None
        f = floor_of(shape_of(r), baseline=r.get("baseline_out_tok_s"), granikv=r.get("granikv_out_tok_s"),
                     ceiling=ceiling, model=model, flops=flops, bw=bw)
        r = dict(r, floor_speedup=f.floor_speedup, floor_fraction=f.floor_fraction)
        r.pop("floor_reason", None)
        if f.floor_speedup is None:
            r["floor_reason"] = f.floor_reason
        out.append(r)
    return out


def bound_rows(doc: dict, flops: float, bw: float) -> List[dict]:
    """The rows of a multi_agent.json with a shared prefix, more than one agent and a ceiling
    row at the same agent count, with their floor (the report's floor table)."""
    rows, meta = doc["rows"], doc.get("meta", {})
    model = load_model(rows, meta)
    ceilings = {(r["backend"], r["agents"]): r for r in rows if r["workload"] == "ceiling"}
    out = []
    for r in rows:
        shape = shape_of(r) if r.get("workload") in ("homogeneous", "heterogeneous") else None
        c = ceilings.get((r["backend"], r["agents"]))
        if (shape is None or shape.turns != 1 or c is None or not c.get("baseline_out_tok_s") or not c.get("params")
                or not r.get("baseline_out_tok_s") or not r.get("granikv_out_tok_s") or r["agents"] < 2):
            continue  # one agent shares nothing (and is launch-bound, not at any peak)
        p = r["params"]
        tokens = r["agents"] * p["out"]
        c_best = max(c["baseline_out_tok_s"], c.get("granikv_out_tok_s") or 0)  # both engines run it stock
        c_wall = c["agents"] * c["params"]["out"] / c_best
        wall = floor_wall_of(shape, c_wall, model, flops, bw)
        best = tokens / wall
        base, ours = r["baseline_out_tok_s"], r["granikv_out_tok_s"]
        target = r.get("target_speedup")
        out.append(dict(workload=r["workload"], agents=r["agents"], backend=r["backend"], baseline=base,
                        granikv=ours, speedup=r.get("speedup") or ours / base, floor_tok_s=best, floor_speedup=best / base,
                        floor_ceiling_pct=100 * best / c_best,
                        measured_of_floor_pct=100 * ours / best, target=target,
                        target_of_floor_pct=None if not target else 100 * target / (best / base)))
    return out
def to_markdown(bounds: List[dict]) -> str:
    lines = ["| row | backend | baseline tok/s | GraniKV tok/s (speedup) | floor: best tok/s (speedup, % of ceiling) "
             "| GraniKV, % of floor | target | target, % of floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for b in bounds:
        tgt = f"{b['target']:.2f}x" if b["target"] else "–"
        tof = f"{b['target_of_floor_pct']:.0f}%" if b["target_of_floor_pct"] else "–"
        lines.append(f"| {b['workload']} × {b['agents']} | {b['backend']} | {b['baseline']:,.0f} | "
                     f"{b['granikv']:,.0f} ({b['speedup']:.2f}x) | {b['floor_tok_s']:,.0f} "
                     f"({b['floor_speedup']:.2f}x, {b['floor_ceiling_pct']:.0f}%) | "
                     f"{b['measured_of_floor_pct']:.0f}% | {tgt} | {tof} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="multi_agent[_TAG].json (run.py / report.py) or regimes.json")
    ap.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="peak attention rate, TFLOP/s")
    ap.add_argument("--tbps", type=float, default=DEFAULT_TBPS, help="peak HBM bandwidth, TB/s")
    ap.add_argument("--annotate", action="store_true",
                    help="write floor_speedup / floor_fraction (floor_reason where null) into every "
                         "row of the file, in place")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        doc = json.load(f)
    flops, bw = args.tflops * 1e12, args.tbps * 1e12
    if args.annotate:
        doc["rows"] = annotate(doc, flops, bw)
        with open(args.results, "w") as f:
            f.write(json.dumps(doc, indent=1, default=str) + "\n")
        for r in doc["rows"]:
            print(f"{r.get('regime') or r['workload']:>20} x {r.get('agents')!s:>4} {r['backend']:>10}: "
                  f"floor_speedup {r['floor_speedup']}, floor_fraction {r['floor_fraction']}"
                  + (f" ({r['floor_reason']})" if r.get("floor_reason") else ""))
        return 0
    bounds = bound_rows(doc, flops, bw)
    if not bounds:
        print("no one-shot shared-prefix row with a ceiling row at the same agent count", file=sys.stderr)
        return 1
    print(f"floor at {args.tflops:g} TFLOP/s and {args.tbps:g} TB/s ({args.results}):\n")
    print(to_markdown(bounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
