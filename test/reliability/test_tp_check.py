"""The runtime cross-rank check (granikv/tp_consistency.py) over a real gloo group of two
processes, each a simulated TP rank (real GraniKVRadixCache, other KV head share) driven by the
same churn events: ranks that decide alike agree at every check; a rank with another promotion
threshold is caught on both ranks, which then freeze promotions together and stay consistent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from granikv.tp_consistency import DECISION_COUNTERS, TPConsistencyCheck, differences

WORKER = Path(__file__).with_name("tp_check_worker.py")
TEST_DIR = Path(__file__).resolve().parents[1]
EVENTS = 600


def run_ranks(tmp_path, diverge, world: int = 2) -> list:
    init = tmp_path / "gloo_init"
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TEST_DIR), env.get("PYTHONPATH")]))  # support.*
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(init), str(EVENTS),
                               {True: "1", False: "0"}.get(diverge, diverge)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(out, key=lambda r: r["rank"])


def test_ranks_that_decide_alike_agree_at_every_check(tmp_path):
    ranks = run_ranks(tmp_path, diverge=False)
    for r in ranks:
        assert r["tp_checks"] == EVENTS // 10 and r["agree"] == EVENTS // 10
        assert r["tp_divergences"] == 0 and r["differ"] == 0 and r["frozen"] is None
    assert ranks[0]["promotions"] == ranks[1]["promotions"] > 0  # decisions were compared


def test_a_diverging_rank_is_caught_on_every_rank_and_promotions_freeze(tmp_path):
    ranks = run_ranks(tmp_path, diverge=True)
    for r in ranks:
        assert r["tp_divergences"] >= 1 and r["frozen"] == "tp divergence"
        assert r["promotions"] == r["promotions_at_freeze"]  # nothing promoted after the freeze
        assert r["differences"]  # the log names what differs, per rank
    assert ranks[0]["tp_divergences"] == ranks[1]["tp_divergences"]  # same action on both
    assert ranks[0]["differences"] == ranks[1]["differences"]


def test_a_rank_whose_fingerprint_fails_turns_the_check_off_on_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, diverge="fail")
    off = {r["off_at"] for r in ranks}
    assert len(off) == 1 and None not in off  # the same check, on both ranks
    for r in ranks:
        assert r["tp_checks"] == 2 and r["frozen"] is None  # two good checks, then off
        assert r["slowest_check_s"] < 10  # nobody waited for the 20 s collective timeout


def test_differences_names_counters_and_fields():
    a = dict(counters=tuple(range(len(DECISION_COUNTERS))), cold_free=10, hot_layout="x")
    b = dict(a, counters=(99,) + a["counters"][1:], hot_layout="y")
    assert differences([a, dict(a)]) == {}
    assert differences([a, b]) == {DECISION_COUNTERS[0]: [0, 99], "hot_layout": ["x", "y"]}


@pytest.mark.parametrize("world, interval", [(1, 10), (2, 0)])
def test_check_is_off_with_one_rank_or_interval_zero(world, interval):
    check = TPConsistencyCheck(object(), world, interval)
    assert not check.enabled and check.on_decode_step(None, 10) is None


def test_a_failing_collective_turns_the_check_off_without_raising(caplog):
    """Without an initialised process group all_gather_object raises: the step goes on."""
    from support.scheduler_sim import Sim, SimConfig

    sim = Sim(SimConfig())
    check = TPConsistencyCheck(object(), 2, 1)
    with caplog.at_level("WARNING", logger="granikv"):
        assert check.on_decode_step(sim.cache, 1) is None
    assert not check.enabled and "check failed" in caplog.text
    assert sim.cache.metrics.tp_checks == 0 and sim.cache.promotions_frozen is None
