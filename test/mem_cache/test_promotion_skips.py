"""promotions_skipped counts distinct skips: a promotion that waits for an unknown holder over
many scheduler steps is one skip, not one per retry."""

from support.scheduler_sim import Sim

P = [(7 * i + 3) % 61 for i in range(41)]  # a 41-token shared prefix (token ids < the Sim's vocab 61)


def test_waiting_promotion_counts_one_skip_however_many_retries():
    sim = Sim()
    holders = [sim.admit(P + [50 + i, i]) for i in range(2)]
    late = sim.prefill_begin(P + [57, 7], register=False)  # a holder the plugin has not registered
    for _ in range(5):  # five scheduler steps retry it
        assert sim.promote() == 0 and sim.cache.has_pending_promotions()
    m = sim.cache.metrics
    assert m.skip_reasons["unknown_holders"] == 1 and m.promotions_skipped == 1
    assert sim.cache.apply_pending_promotions(register=[late]) == 1
    assert not sim.cache._retry_counted  # nothing left waiting: nothing remembered
    sim.prefill_end(late)
    sim.check()
    del holders
