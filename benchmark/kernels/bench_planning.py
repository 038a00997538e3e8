"""Host cost of planning one decode step: grouping + dispatcher (+ the kernels' work list).

Prints microseconds per plan (median of --repeats runs of --iters plans each, one CPU thread)
for batch sizes 1..256 and 1..16 groups of unequal sizes, 16K-token prefixes, suffix 256,
Llama-3.1-8B heads (32q/8kv/128, bf16 KV). Target (issue 3): group + choose < 50 us at bs 256.

    python benchmark/kernels/bench_planning.py [--iters 2000] [--repeats 5] [--no-work-list]

Columns: ``group`` = plan.group_requests, ``choose`` = Dispatcher.choose, ``plan`` = both;
``work_list`` = granikv.kernels.work_list.build_work_list (the cascade kernels' host-side
metadata, when that module imports), ``total`` = plan + work_list.
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np

from granikv.layers.attention.cascade.cost_model import CostModel
from granikv.layers.attention.cascade.dispatcher import Dispatcher
from granikv.layers.attention.cascade.plan import BatchDescription, group_requests

BATCH_SIZES = (1, 2, 8, 17, 64, 128, 256)
GROUPS = (1, 2, 4, 16)
HOT = 1 << 24


def make_desc(bs: int, groups: int, rng) -> BatchDescription:
    """bs requests over `groups` HOT extents with unequal sizes (weights 1..groups), 16K prefixes."""
    weights = np.arange(1, groups + 1, dtype=np.float64)
    which = rng.choice(groups, size=bs, p=weights / weights.sum())
    hot_len = 16384 - rng.integers(0, 64, bs)
    return BatchDescription(
        req_pool_indices=rng.permutation(bs).astype(np.int64) + 1,
        seq_lens=(hot_len + 256 + rng.integers(0, 64, bs)).astype(np.int64),
        hot_start=(HOT + which * 100_000).astype(np.int64),
        hot_len=hot_len.astype(np.int64),
    )


def per_call_us(fn, iters: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter_ns() - t0) / iters / 1e3)
    return statistics.median(runs)


def work_list_fn(desc: BatchDescription):
    """A closure building the cascade kernels' work list, or None if that module is missing."""
    try:
        from granikv.kernels.work_list import build_work_list, default_config
    except Exception as e:  # noqa: BLE001 - optional column
        print(f"# work_list column skipped: {type(e).__name__}: {e}")
        return None
    config = default_config(128)

    def fn(g):
        return build_work_list(
            g.group_start, g.group_len, g.group_req_indptr, g.group_req_idx, g.prefix_len,
            desc.seq_lens, ratio=4, num_kv_heads=8, config=config, sm_count=132, max_splits=32,
        )  # fmt: skip

    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-work-list", action="store_true")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    dispatcher = Dispatcher(
        CostModel.load(None, None), num_q_heads=32, num_kv_heads=8, head_dim=128,
        kv_dtype_bytes=2, num_layers=32,
    )  # fmt: skip
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"numpy {np.__version__}, pid {os.getpid()}; us per plan, median of {args.repeats} x "
          f"{args.iters}")  # fmt: skip
    warm = make_desc(256, 16, rng)  # let the CPU clock and numpy's caches settle first
    t_end = time.perf_counter() + 1.0
    while time.perf_counter() < t_end:
        dispatcher.choose(group_requests(warm, min_group_size=2), warm)
    header = f"{'bs':>4} {'G':>3} {'grp':>4} {'group':>8} {'choose':>8} {'plan':>8}"
    header += "" if args.no_work_list else f" {'work_list':>10} {'total':>8}"
    print(header)
    worst = 0.0
    for bs in BATCH_SIZES:
        for groups in GROUPS:
            if groups > bs:
                continue
            desc = make_desc(bs, groups, rng)
            g = group_requests(desc, min_group_size=2)
            t_group = per_call_us(lambda: group_requests(desc, min_group_size=2), args.iters, args.repeats)
            t_choose = per_call_us(lambda: dispatcher.choose(g, desc), args.iters, args.repeats)
            t_plan = per_call_us(
                lambda: dispatcher.choose(group_requests(desc, min_group_size=2), desc),
                args.iters, args.repeats,
            )  # fmt: skip
            worst = max(worst, t_plan)
            line = f"{bs:>4} {groups:>3} {g.num_groups:>4} {t_group:>8.1f} {t_choose:>8.1f} {t_plan:>8.1f}"
            wl = None if args.no_work_list else work_list_fn(desc)
            if wl is not None:
                t_wl = per_call_us(lambda: wl(g), args.iters // 4 or 1, args.repeats)
                line += f" {t_wl:>10.1f} {t_plan + t_wl:>8.1f}"
            print(line, flush=True)
    print(f"# worst plan (group + choose): {worst:.1f} us (target < 50 us)")


if __name__ == "__main__":
    main()
