"""Host cost of planning one decode step: grouping + dispatcher (+ the kernels' work list).

Prints microseconds per plan (median of --repeats runs of --iters plans each, one CPU thread)
for batch sizes 1..256 and 1..16 groups of unequal sizes, 16K-token prefixes, suffix 256,
Llama-3.1-8B heads (32q/8kv/128, bf16 KV). Target: group + choose < 50 us at bs 256.

    python benchmark/kernels/bench_planning.py [--iters 2000] [--repeats 5] [--no-work-list]

Columns: ``group`` = plan.group_requests, ``choose`` = Dispatcher.choose, ``plan`` = both;
``work_list`` = granikv.kernels.work_list.build_work_list (the cascade kernels' host-side
metadata, when that module imports), ``total`` = plan + work_list.

``step full`` / ``step steady``: what the attention backend does on the host per decode step,
for successive steps of one batch (every ``seq_len`` + 1 per step): ``BatchDescription``, grouping,
``Dispatcher.choose`` and ``CascadeWorkspace.fill`` into a CPU workspace (the metadata copy is
a host memcpy here; on a GPU it is one pinned non-blocking copy). ``full`` rebuilds everything
each step (the behaviour before the reuse); ``steady`` uses ``GroupingMemo`` and the workspace's
work-list reuse (``KernelConfig.reuse_chunk_factor``), periodic rebuilds included.
"""

import argparse
import dataclasses
import os
import platform
import statistics
import time

import numpy as np

from granikv.layers.attention.cascade.cost_model import CostModel
from granikv.layers.attention.cascade.dispatcher import Dispatcher
from granikv.layers.attention.cascade.plan import BatchDescription, GroupingMemo, group_requests

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


def step_fn(desc: BatchDescription, dispatcher, *, steady: bool):
    """One decode step's host work in the backend, for successive steps of the same batch."""
    from granikv.kernels.work_list import CascadeWorkspace, default_config

    cfg = default_config(128)
    if not steady:
        cfg = dataclasses.replace(cfg, reuse_chunk_factor=0.0)
    ws = CascadeWorkspace(len(desc.seq_lens), 32, 8, 128, "cpu", sm_count=132, config=cfg)
    memo = GroupingMemo()
    step = [0]

    def fn():
        step[0] += 1
        d = BatchDescription(desc.req_pool_indices, desc.seq_lens + step[0], desc.hot_start, desc.hot_len)
        g = memo.group(d, min_group_size=2) if steady else group_requests(d, min_group_size=2)
        dispatcher.choose(g, d)
        ws.fill(g.group_start, g.group_len, g.group_req_indptr, g.group_req_idx, g.prefix_len, d.seq_lens,
                d.req_pool_indices)  # fmt: skip

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
    header += "" if args.no_work_list else f" {'work_list':>10} {'total':>8} {'step full':>10} {'step steady':>12}"
    print(header)
    worst = worst_step = 0.0
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
                t_full = per_call_us(step_fn(desc, dispatcher, steady=False), args.iters // 4 or 1, args.repeats)
                t_steady = per_call_us(step_fn(desc, dispatcher, steady=True), args.iters // 4 or 1, args.repeats)
                worst_step = max(worst_step, t_steady)
                line += f" {t_full:>10.1f} {t_steady:>12.1f}"
            print(line, flush=True)
    print(f"# worst plan (group + choose): {worst:.1f} us (target < 50 us)")
    if worst_step:
        print(f"# worst steady decode step (plan + workspace fill, reuse on): {worst_step:.1f} us")


if __name__ == "__main__":
    main()
