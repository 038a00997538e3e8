"""The paged kernel's re-reads of a shared prefix, and the order of the batch.

A paged decode kernel reads a shared prefix once per sharer. The cost model prices every read
after the first at ``paged_reuse_gbps`` (mostly L2 hits), fitted on calibration batches whose
groups sit in adjacent batch rows. A running batch holds requests in arrival order, so the
sharers of a small group are spread over it. This script times one decode layer of a forest
both ways, on the same KV pool, with calibrate.py's method (``layers`` copies of the KV so no
layer finds its KV in L2, CUDA-graph replays):

- ``paged``: the stock kernel (FlashInfer's tensor-core paged decode, as SGLang's flashinfer
  backend; SGLang's Triton decode where FlashInfer does not import);
- ``cascade``: GraniKV's three launches over the same groups HOT;

beside the checked-in cost model's estimates of both (kernel time per layer: ``cascade_time`` less
its once-a-step ``plan_us``), and the implied
re-read rate: ``reread_bytes / (paged - unique part)``, the unique part priced as the model does.

    python -m benchmark.kernels.batch_order --out DIR     # DIR/batch_order.json; < 60 s on one GPU
"""

import argparse
import datetime
import json
import os
import sys

import torch

from benchmark.kernels.calibrate import FOREST16_LIKE, SMALL_GROUPS, Case, granikv_paths, pick_paged
from granikv.attention.cost.cost_model import CostModel, default_path
from granikv.attention.dispatcher import Dispatcher

#: (name, groups [(prefix_len, sharers)], suffix tokens per request)
SHAPES = [
    ("small_groups32_2to3sharers", SMALL_GROUPS, 160),
    ("16 x 2K x 4", [(2048, 4)] * 16, 256),
    ("4 x 4K x 8", [(4096, 8)] * 4, 256),
    ("forest16_like", FOREST16_LIKE, 256),
]
ORDERS = (("adjacent", None), ("interleaved", 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (batch_order.json)")
    ap.add_argument("--heads", default="32,8,128", help="q heads, kv heads, head_dim (per GPU)")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    paged_name, paged_fn = pick_paged("auto")
    source = os.path.basename(default_path(props.name))
    model = CostModel.load(None, props.name)
    disp = Dispatcher(model, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2], kv_dtype_bytes=2)
    rows = []
    print(f"# {props.name}, L2 {l2 >> 20} MiB, paged = {paged_name}, cost model {source}", flush=True)
    for name, groups, suffix in SHAPES:
        for order, seed in ORDERS:
            case = Case(groups, suffix, 0, heads, torch.bfloat16, l2, order_seed=seed)
            w = disp.workload(case.grouping, case.desc)
            paged = paged_fn(case)
            cascade = granikv_paths(case)["cascade"]
            paged_model = model.paged_time(w)
            # the measured time less the model's unique part (launch + bytes read once)
            reread_us = paged - (paged_model - w.reread_bytes / (model.paged_reuse_gbps * 1e3))
            row = dict(shape=name, order=order, layers=case.layers, requests=case.bs, groups=len(groups),
                       paged_us=round(paged, 2), cascade_us=round(cascade, 2), paged_model_us=round(paged_model, 2),
                       cascade_model_us=round(model.cascade_time(w) - model.plan_us, 2),
                       reread_MB=round(w.reread_bytes / 1e6, 1),
                       unique_MB=round((w.seq_bytes - w.reread_bytes) / 1e6, 1),
                       implied_reread_gbps=round(w.reread_bytes / (reread_us * 1e3), 0) if reread_us > 0 else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(sys.argv),
                gpu=props.name, paged_kernel=paged_name, cost_model=source, heads=list(heads),
                paged_gbps=model.paged_gbps, paged_reuse_gbps=model.paged_reuse_gbps)
    with open(os.path.join(args.out, "batch_order.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
