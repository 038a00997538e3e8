"""One simulated TP rank for test_tp_check.py: a real gloo process group, a real
GraniKVRadixCache (scheduler_sim.Sim), the churn workload, and TPConsistencyCheck every 10
events. Prints one JSON line with what the rank saw.

    PYTHONPATH=test python test/reliability/tp_check_worker.py RANK WORLD INIT_FILE EVENTS MODE(0|1|fail)

MODE 1: the last rank uses another promotion threshold; fail: the last rank's fingerprint
raises at its third check.
"""

import json
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist
from churn_workload import ChurnWorkload  # beside this file (run as a script)

from granikv import tp_consistency
from granikv.tp_consistency import TPConsistencyCheck
from support.scheduler_sim import Sim, SimConfig  # test/ is on PYTHONPATH (test_tp_check.py)


def main() -> None:
    rank, world, init_file, events, mode = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                            int(sys.argv[4]), sys.argv[5])
    diverge = mode == "1"
    # a short collective timeout: a rank left waiting shows up as a slow check, not a hang
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    if mode == "fail" and rank == world - 1:
        real, calls = tp_consistency.fingerprint, [0]

        def failing(cache):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("planted fingerprint failure")
            return real(cache)

        tp_consistency.fingerprint = failing
    cfg = SimConfig(kv_size=400, hot_fraction=0.5, max_reqs=16, kv_heads=2 if rank == 0 else 1, seed=rank)
    if diverge and rank == world - 1:
        cfg = replace(cfg, min_tokens=40)  # another promotion threshold: decisions diverge
    sim = Sim(cfg)
    check = TPConsistencyCheck(dist.group.WORLD, world, 10)
    seen = dict(agree=0, differ=0, promotions_at_freeze=None, off_at=None, slowest_check_s=0.0)

    def on_step(_event: str) -> None:
        t = time.perf_counter()
        was_on = check.enabled
        ok = check.on_decode_step(sim.cache, work.counts["events"])
        seen["slowest_check_s"] = max(seen["slowest_check_s"], time.perf_counter() - t)
        if was_on and not check.enabled:
            seen["off_at"] = work.counts["events"]
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
