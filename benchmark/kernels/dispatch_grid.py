"""The dispatcher's choice at every point of a measured kernel grid, against the best paged kernel.

Reads the ``kernels.json`` that ``bench_attention.py`` (full grid) wrote on the GPU, rebuilds each
point's batch description (groups of requests over HOT prefixes, suffix tokens each), asks the
dispatcher with the checked-in cost model of that GPU which path it takes, and looks up the
MEASURED time of that path at that point (paged = FlashInfer's tensor-core paged decode, the
stock path under SGLang's flashinfer backend). Prints, per point, the choice, its time, the best
paged time (min of SGLang triton and FlashInfer paged) and the ratio best_paged / chosen; the
issue-3 target is a ratio >= 0.97 everywhere. Runs on CPU (no kernels run here).

    python -m benchmark.kernels.dispatch_grid docs/results/kernels.json [--eager] [--md OUT.md]

The dispatcher is built as serving builds it (``dispatcher.build_dispatcher``): per-layer times
plus the host planning cost amortised over ``--num-layers`` layers (32: Llama-3.1-8B, the
grid's head shapes).

``--eager``: the choice for steps without CUDA graphs (all four paths); default: graph steps
(paged or cascade), which is what serving with CUDA graphs uses.
"""

import argparse
import json

import numpy as np

from granikv.attention.cost.cost_model import CostModel
from granikv.attention.dispatcher import Dispatcher
from granikv.attention.grouping import BatchDescription, group_requests

MEASURED = {"paged": "fi_decode_tc_ms", "cascade": "gkv_cascade_ms", "fused": "gkv_fused_ms",
            "bgemm": "gkv_bgemm_ms"}


def describe(groups, suffix: int) -> BatchDescription:
    hot_len = np.array([p for p, n in groups for _ in range(n)], np.int64)
    starts = 1 + np.cumsum([0] + [p for p, _ in groups])[:-1]
    hot_start = np.array([s for s, (_, n) in zip(starts, groups) for _ in range(n)], np.int64)
    bs = hot_len.shape[0]
    return BatchDescription(np.arange(1, bs + 1, dtype=np.int64), hot_len + suffix, hot_start, hot_len)


def evaluate(rows, dispatcher: Dispatcher, *, graph: bool, min_group_size: int = 2):
    out = []
    for r in rows:
        if "error" in r or r.get("n_ungrouped"):
            continue
        desc = describe([tuple(g) for g in r["groups"]], r["suffix"])
        decision = dispatcher.choose(group_requests(desc, min_group_size=min_group_size), desc,
                                     graph_safe_only=graph)
        path = decision.path.value
        chosen = r.get(MEASURED[path])
        paged = [r[k] for k in ("fi_decode_tc_ms", "sgl_triton_ms") if r.get(k)]
        if chosen is None or not paged:
            continue
        out.append(dict(groups=r["groups"], suffix=r["suffix"], requests=r["requests"], path=path,
                        chosen_ms=chosen, best_paged_ms=min(paged), ratio=min(paged) / chosen))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernels_json")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--md", help="also write the table as markdown here")
    ap.add_argument("--num-layers", type=int, default=32, help="layers per decode step (plan cost amortised)")
    args = ap.parse_args()
    data = json.load(open(args.kernels_json))
    meta = data["meta"]
    heads = meta["shapes"]
    model = CostModel.load(None, meta["gpu"])
    dispatcher = Dispatcher(model, num_q_heads=heads["hq"], num_kv_heads=heads["hkv"], head_dim=heads["d"],
                            kv_dtype_bytes=2, num_layers=args.num_layers)
    res = evaluate(data["rows"], dispatcher, graph=not args.eager)
    lines = ["| groups (prefix x requests) | suffix | choice | chosen ms | best paged ms | best paged / chosen |",
             "|---|---:|---|---:|---:|---:|"]
    for x in res:
        g = " + ".join(f"{p}x{n}" for p, n in x["groups"])
        lines.append(f"| {g} | {x['suffix']} | {x['path']} | {x['chosen_ms']:.4f} | {x['best_paged_ms']:.4f} | "
                     f"{x['ratio']:.2f}x |")
    worst = min(res, key=lambda x: x["ratio"])
    paths = {p: sum(x["path"] == p for x in res) for p in MEASURED}
    summary = (f"{meta['gpu']}, {'eager' if args.eager else 'CUDA-graph'} steps, {args.num_layers} layers, {len(res)} points, choices "
               f"{paths}; worst best_paged/chosen {worst['ratio']:.2f}x at {worst['groups']} sfx {worst['suffix']} "
               f"({worst['path']}); points below 0.97x: {sum(x['ratio'] < 0.97 for x in res)}")
    print("\n".join(lines))
    print(summary)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"{summary}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
