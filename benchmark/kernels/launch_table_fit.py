"""Fit the prefix wave table (python/granikv/attention/decode/launch_table.py) from a matrix run.

    python3 -m benchmark.kernels.bench_attention --matrix --max-bs 256 \\
        --matrix-suffixes 64,256,1024 --matrix-variants pw1.0,pw1.25,pw1.75,pw2.0 --out $OUT
    python3 -m benchmark.kernels.launch_table_fit $OUT/kernels_matrix.json \\
        --out python/granikv/data/launch_table_<gpu slug>.json

Every matrix point (head_dim, query rows per kv head, prefix length, suffix length) gets one rule: the wave
target whose cascade layer was fastest there (the config's own, ``prefix_waves`` of the row, or
a variant's, ``variant_prefix_waves``), a variant only where it beats the config's by at least
``--min-gain``; points of several head shapes with the same key (GQA 1 at 64 sharers and GQA 4
at 16 both stack 64 rows) are decided by their summed times. A rule for every point, so that a
step between points takes the rule of the next larger point, never one fitted elsewhere.
Prints what each rule gains over the config's waves.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from granikv.attention.decode.launch_table import LaunchTable, rules_of

Key = Tuple[int, int, int, int]  # (head_dim, rows per kv head, prefix tokens, suffix tokens per request)


def fit_rules(rows: Sequence[Mapping[str, Any]], min_gain: float = 0.03) -> Tuple[LaunchTable, List[Dict[str, Any]]]:
    """The table from matrix rows (each with ``d``, ``rows_per_kv_head``, ``prefix``, ``suffix``,
    ``gkv_cascade_us``, ``prefix_waves`` and ``variant_cascade_us`` / ``variant_prefix_waves``),
    and one report line per rule."""
    totals: Dict[Key, Dict[float, float]] = defaultdict(lambda: defaultdict(float))
    counts: Dict[Key, Dict[float, int]] = defaultdict(lambda: defaultdict(int))
    base_of: Dict[Key, float] = {}
    for r in rows:
        if "gkv_cascade_us" not in r or "variant_cascade_us" not in r:
            continue
        key = (int(r["d"]), int(r["rows_per_kv_head"]), int(r["prefix"]), int(r["suffix"]))
        base = float(r["prefix_waves"])
        if base_of.setdefault(key, base) != base:
            raise ValueError(f"matrix points of key {key} ran with different default waves")
        times = {base: float(r["gkv_cascade_us"])}
        for v, us in r["variant_cascade_us"].items():
            times.setdefault(float(r["variant_prefix_waves"][v]), float(us))
        for w, us in times.items():
            totals[key][w] += us
            counts[key][w] += 1
    entries, report = [], []
    for key in sorted(totals):
        n = max(counts[key].values())
        full = {w: t for w, t in totals[key].items() if counts[key][w] == n}  # waves timed at every point of the key
        base = base_of[key]
        best = min(full, key=full.get)
        if full[best] > full[base] * (1.0 - min_gain):
            best = base
        entries.append((key[0], key[1], key[2], key[3], best))
        report.append(dict(head_dim=key[0], rows=key[1], prefix=key[2], suffix=key[3], points=n, base=base, waves=best,
                           gain=round(full[base] / full[best], 3)))
    return LaunchTable(rules_of(entries)), report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("matrix", help="kernels_matrix.json of a --matrix run with --matrix-variants")
    ap.add_argument("--out", required=True, help="the table JSON to write")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="a variant's waves only where its layer beats the config's by this share (one timing per "
                         "point: smaller gains are within run-to-run noise)")
    args = ap.parse_args(argv)
    with open(args.matrix) as f:
        doc = json.load(f)
    table, report = fit_rules(doc["rows"], args.min_gain)
    if not table.rules:
        raise SystemExit(f"{args.matrix}: no point has variant timings (--matrix-variants)")
    for line in report:
        print(json.dumps(line))
    out = dict(table.to_mapping(), gpu=doc.get("gpu", ""), source=args.matrix, min_gain=args.min_gain)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    moved = sum(x["waves"] != x["base"] for x in report)
    print(f"{len(table.rules)} rules, {moved} away from the config's waves -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
