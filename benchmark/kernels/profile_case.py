"""One sweep case's cascade launches, eagerly, for a profiler (ncu / nsys) to attach to.

    ncu --kernel-name regex:"_prefix|_suffix|_merge" --launch-skip 9 --launch-count 3 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python -m benchmark.kernels.profile_case --case 7 [--variant merge16]

Runs prefix, suffix and merge ``--iters`` times each (after a warm-up that compiles them) on the
case ``bench_attention.SWEEP_CASES[--case]`` with the kernel config GraniKV picks for the shape
(or a SWEEP variant of it), so a profiler sees the same launches the sweep times.
"""

import argparse
import dataclasses

import torch

from benchmark.kernels import bench_attention as bench
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.merge_state import merge_state
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.suffix_attention import suffix_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=int, default=7, help="index into bench_attention.SWEEP_CASES")
    ap.add_argument("--variant", default="default", choices=list(bench.SWEEP))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-bs", type=int, default=256)
    a = ap.parse_args()
    groups, sfx = bench.SWEEP_CASES[a.case]
    case = bench.Case(groups, sfx)
    cfg = dataclasses.replace(bench.base_config(), **bench.SWEEP[a.variant])
    ws = CascadeWorkspace(bench.ws_max_bs(case.n_req, a.max_bs), bench.HQ, bench.HKV, bench.D, bench.DEV, config=cfg)
    case.fill(ws)
    out = torch.empty_like(case.q)
    for _ in range(1 + a.iters):
        prefix_attention(case.q, case.k, case.v, ws.plan, sm_scale=bench.SCALE)
        suffix_attention(case.q, case.k, case.v, case.r2t, ws.plan, sm_scale=bench.SCALE)
        merge_state(ws.plan, out)
    torch.cuda.synchronize()
    wl = ws.work_list
    print(f"case {a.case} {groups if len(groups) < 4 else f'{len(groups)} groups'} suffix {sfx}: "
          f"prefix items {wl.num_prefix_items} (chunk {wl.prefix_chunk}), suffix items {wl.num_suffix_items} "
          f"(chunk {wl.suffix_chunk}), partial rows {wl.num_partials}, grid max_bs {ws.max_bs}")


if __name__ == "__main__":
    main()
