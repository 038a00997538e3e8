"""Property test: random interleavings of SGLang's cache calls and GraniKV's promotions.

After every step: ``check_integrity()`` (exact COLD accounting, HOT extents == hot pool,
lock counts == live holders, table == tree) and the KV oracle through every row and node.
At the end: everything finished and evicted -> every slot free, every lock count zero.
Two of the three shared prefixes start with the same 4-token head (below ``min_tokens``), and
requests may be prefilled in chunks, so deep promotions with shadow heads are exercised.
Derandomized (same examples every run); GRANIKV_SLOW_TESTS=1 runs many more.
"""

import os
import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from support.scheduler_sim import Sim, SimConfig

SLOW = os.environ.get("GRANIKV_SLOW_TESTS") == "1"
CFG = SimConfig(kv_size=320, max_reqs=10, max_context=120, hot_fraction=0.3, min_tokens=16)


def _rand(seed, n):
    return [random.Random(seed).randrange(CFG.vocab) for _ in range(n)]


HEAD = _rand(99, 4)  # a chat template's first tokens
PREFIXES = [HEAD + _rand(100, 44), HEAD + _rand(101, 29), _rand(102, 21)]
GROUP_KEY = 8  # tokens that tell the prefixes apart


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sim = Sim(CFG)
        self.pending = []  # allocated, not yet through their forward (prefill_end)

    @initialize(k=st.integers(2, 3), chunk=st.sampled_from([None, 16]))
    def warm_up(self, k, chunk):
        for p in PREFIXES:  # k requests per shared prefix: promotable from the start
            for j in range(k):
                if chunk is not None and j == 0:
                    self.sim.admit_chunked(p + [j], chunk)
                else:
                    self.sim.admit(p + [j])

    def _live(self, i):
        reqs = [r for r in self.sim.live.values() if r.written_len]
        return reqs[i % len(reqs)] if reqs else None

    @rule(p=st.integers(0, 2), cut=st.sampled_from([None, None, 20, 30, 13, 5]),
          suffix=st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=6),
          copies=st.integers(1, 3), split_phase=st.booleans())
    def new_requests(self, p, cut, suffix, copies, split_phase):
        """A burst of ``copies`` requests on one prefix (``cut``: only part of it -> split)."""
        prefix = PREFIXES[p] if cut is None else PREFIXES[p][:cut]
        batch = [self.sim.prefill_begin(prefix + suffix + [j]) for j in range(copies)]
        batch = [r for r in batch if r is not None]
        self.sim.promote()  # the plugin's hook before run_batch
        if split_phase:
            self.pending += batch  # their forward comes later (another promotion may run first)
        else:
            for req in batch:
                self.sim.prefill_end(req)

    @rule(p=st.integers(0, 2), chunk=st.sampled_from([7, 16, 20]),
          suffix=st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=6),
          promote=st.booleans())
    def chunked_request(self, p, chunk, suffix, promote):
        """Chunked prefill: the prefix enters the tree chunk by chunk (promotions between)."""
        self.sim.admit_chunked(PREFIXES[p] + suffix, chunk, promote=promote)

    @precondition(lambda self: self.pending)
    @rule()
    def forward_pending(self):
        for req in self.pending:
            self.sim.prefill_end(req)
        self.pending.clear()

    @rule(i=st.integers(0, 50), tok=st.integers(0, CFG.vocab - 1), steps=st.integers(1, 4))
    def decode(self, i, tok, steps):
        req = self._live(i)
        for _ in range(steps if req else 0):
            self.sim.promote()
            if not self.sim.decode(req, tok):
                break

    @rule(i=st.integers(0, 50), abort=st.booleans())
    def finish(self, i, abort):
        req = self._live(i)
        if req is not None:
            (self.sim.abort if abort else self.sim.finish)(req)

    @rule(p=st.integers(0, 2))
    def finish_group(self, p):
        """Every request on one prefix finishes: its HOT extent stays cached, unlocked."""
        head = list(PREFIXES[p][:GROUP_KEY])
        for req in list(self.sim.live.values()):
            if req.written_len and list(req.tokens[:GROUP_KEY]) == head:
                self.sim.finish(req)

    @rule(p=st.integers(0, 2), n=st.integers(2, 40))
    def match_only(self, p, n):
        self.sim.match(PREFIXES[p][:n])  # may split (HOT) nodes

    @rule(p=st.integers(0, 2), n=st.integers(2, 40))
    def lock(self, p, n):
        self.sim.lock(PREFIXES[p][:n])

    @rule()
    def unlock(self):
        self.sim.unlock()

    @rule()
    def promote(self):
        self.sim.promote()

    @rule(n=st.integers(1, 200))
    def evict(self, n):
        self.sim.evict(n)

    @rule(n=st.integers(1, 100))
    def evict_hot(self, n):
        self.sim.cache.evict_hot(n)

    @invariant()
    def integrity(self):
        self.sim.check()

    def teardown(self):
        m = self.sim.cache.metrics
        for name in ("promotions", "shadow_head_tokens", "hot_splits", "hot_evictions",
                     "compactions", "promotions_skipped"):
            event(f"{name} > 0: {getattr(m, name) > 0}")
        for req in self.pending:
            self.sim.prefill_end(req)
        self.sim.drain()
        self.sim.check()
        self.sim.assert_all_free()


CacheMachine.TestCase.settings = settings(
    max_examples=400 if SLOW else 25,
    stateful_step_count=60 if SLOW else 30,
    derandomize=not SLOW,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


def test_property_run_promotes_and_splits():
    """The random walk above must actually exercise promotions, shadow heads and HOT splits."""
    sim = Sim(CFG)
    rng = random.Random(7)
    for step in range(120):
        p = PREFIXES[rng.randrange(3)]
        cut = rng.choice([None, None, 17, 19])
        prompt = (p if cut is None else p[:cut]) + [rng.randrange(CFG.vocab)]
        chunk = rng.choice([None, None, 16])
        req = sim.admit(prompt) if chunk is None else sim.admit_chunked(prompt, chunk)
        live = list(sim.live.values())
        if live and rng.random() < 0.4:
            sim.finish(rng.choice(live))
        if step % 3 == 0:
            sim.promote()
        sim.check()
        del req
    m = sim.cache.metrics
    assert m.promotions >= 2 and m.hot_splits >= 1 and m.shadow_head_tokens > 0, m.snapshot()
    sim.drain()
    sim.assert_all_free()
