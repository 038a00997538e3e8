"""One simulated TP rank for test_tp_check.py: a real gloo process group, a real
GraniKVRadixCache (scheduler_sim.Sim), the churn workload, and TPConsistencyCheck every 10
events. Prints one JSON line with what the rank saw.

    python tp_check_worker.py RANK WORLD INIT_FILE EVENTS DIVERGE(0|1)
"""

import json
import sys
from dataclasses import replace

import torch.distributed as dist
from churn_workload import ChurnWorkload

from granikv.scheduler_sim import Sim, SimConfig
from granikv.tp_consistency import TPConsistencyCheck


def main() -> None:
    rank, world, init_file, events, diverge = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                               int(sys.argv[4]), sys.argv[5] == "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = SimConfig(kv_size=400, hot_fraction=0.5, max_reqs=16, kv_heads=2 if rank == 0 else 1, seed=rank)
    if diverge and rank == world - 1:
        cfg = replace(cfg, min_tokens=40)  # another promotion threshold: decisions diverge
    sim = Sim(cfg)
    check = TPConsistencyCheck(dist.group.WORLD, world, 10)
    seen = dict(agree=0, differ=0, promotions_at_freeze=None)

    def on_step(_event: str) -> None:
        ok = check.on_decode_step(sim.cache, work.counts["events"])
        if ok is True:
            seen["agree"] += 1
        elif ok is False:
            seen["differ"] += 1
            if seen["promotions_at_freeze"] is None:
                seen["promotions_at_freeze"] = sim.cache.metrics.promotions

    work = ChurnWorkload([sim], 0, check=False)
    work.run(events, on_step=on_step)
    sim.cache.check_integrity(strict=False)  # a frozen rank's KV, tree and table stay consistent
    work.drain()
    sim.assert_all_free()
    m = sim.cache.metrics
    print(json.dumps(dict(rank=rank, **seen, tp_checks=m.tp_checks, tp_divergences=m.tp_divergences,
                          promotions=m.promotions, frozen=sim.cache.promotions_frozen,
                          differences=check.last_differences)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
