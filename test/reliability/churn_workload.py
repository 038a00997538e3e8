"""A seeded churn workload: random scheduler events over one or more ``Sim`` in lockstep.

Each ``Sim`` is one simulated TP rank (the soak uses one); every event is applied to every
rank, and every rank must take the same decision (admitted or refused, promotions executed).
Events (``random.Random(seed)``, no hypothesis: the sequence depends only on the seed):

    join          a new agent on an active prefix (whole, or cut: a partial share splits HOT
                  nodes), prefilled whole or in chunks; allocated now, forwarded at ``forward``
    forward       the plugin's promotions (before run_batch), then every pending forward
    next_chunk    allocate the next chunk of a chunked prefill
    decode        promotions, then 1-4 decode steps of one agent (COLD out -> retracted)
    finish        one decoding agent finishes (its prefix stays cached)
    abort         one agent, whatever its phase: waiting (matched + locked, no row),
                  pending prefill, between / during chunks, decoding; and right after a promotion
    lock, unlock  a temporary admission lock (PrefillAdder._lock_node) with no row
    rotate        the set of shared prefixes changes: old ones stop being shared, new ones start
    match         a lookup of part of a prefix (splits HOT nodes, no lock)
    evict         memory pressure from elsewhere (``evict_from_tree_cache``): LRU leaves, HOT
                  or COLD, go back to the free list

The prefix family: two prefixes below a short common head (4 tokens, < min_tokens), one
prefix that is a prefix of another, and fresh random prefixes of random lengths on every
rotation (so HOT extents of many sizes come and go: fragmentation, relocation, eviction).
"""

import random
from collections import Counter
from typing import Dict, List, Optional

from support.scheduler_sim import Sim, SimReq

EVENTS = {"join": 24, "forward": 14, "next_chunk": 8, "decode": 20, "finish": 14, "abort": 7,
          "lock": 2, "unlock": 4, "rotate": 3, "match": 3, "evict": 2}


class Agent:
    """One logical request: its ``SimReq`` on every rank and where it is in its life."""

    def __init__(self, reqs: List[SimReq], chunk: Optional[int]):
        self.reqs = reqs
        self.chunk = chunk
        self.phase = "pending"  # pending (allocated, forward not run) | chunking | decoding
        self.chunks_done = 0


class ChurnWorkload:
    def __init__(self, sims: List[Sim], seed: int, *, check: bool = True):
        self.sims = sims
        self.rng = random.Random(seed)
        self.check_every_step = check
        self.agents: Dict[int, Agent] = {}
        self.next_agent = 0
        self.counts: Counter = Counter()
        self.locks = 0
        self.promotions_seen = 0
        vocab = sims[0].cfg.vocab
        self._tok = lambda n: [self.rng.randrange(vocab) for _ in range(n)]  # noqa: E731
        head = self._tok(4)
        c = self._tok(20)
        self.family = [head + self._tok(36), head + self._tok(22), c, c + self._tok(22)]
        self.active = [0, 2]

    # ---- driving ---------------------------------------------------------------------------

    def run(self, events: int, on_step=None) -> None:
        names, weights = list(EVENTS), list(EVENTS.values())
        for _ in range(events):
            name = self.rng.choices(names, weights)[0]
            getattr(self, "_" + name)()
            self.counts["events"] += 1
            if self.check_every_step:
                for sim in self.sims:
                    sim.check()
            if on_step is not None:
                on_step(name)

    def drain(self) -> None:
        """Run every pending forward, abort unfinished chunked prefills, then ``Sim.drain``."""
        for agent in self._in("pending"):
            self._each(agent, lambda sim, r: sim.prefill_end(r, chunked=r.fill_len is not None))
        for agent in self._in("pending", "chunking"):
            self._each(agent, lambda sim, r: sim.abort(r))
        self.agents.clear()
        self.locks = 0
        for sim in self.sims:
            sim.drain()

    def figures(self) -> Dict[str, int]:
        """Fault classes exercised (events, aborts per phase) + the cache's counters (rank 0)."""
        m = self.sims[0].cache.metrics
        out = dict(self.counts)
        out.update(promotions=m.promotions, hot_evictions=m.hot_evictions,
                   hot_splits=m.hot_splits, compactions=m.compactions,
                   compaction_moves=m.compaction_moves, shadow_head_tokens=m.shadow_head_tokens,
                   extended_in_place=m.extended_in_place, adopted=m.adopted,
                   skipped_no_space=m.skip_reasons.get("no_space", 0),
                   skipped_unknown_holders=m.skip_reasons.get("unknown_holders", 0))
        out["aborts"] = sum(v for k, v in self.counts.items() if k.startswith("abort_"))
        return out

    # ---- events ----------------------------------------------------------------------------

    def _join(self) -> None:
        prefix = self.family[self.rng.choice(self.active)]
        if self.rng.random() < 0.25:  # shares only part of the prefix: splits HOT nodes
            prefix = prefix[: self.rng.randrange(5, len(prefix))]
        prompt = prefix + self._tok(self.rng.randrange(1, 7))
        chunk = self.rng.choice([None, None, None, 7, 16])
        no_row = self.sims[0].req_pool.available_size() == 0
        reqs = [sim.prefill_begin(prompt, chunk=chunk) for sim in self.sims]
        if not self._agree("refused_no_row" if no_row else "refused_no_cold_slots",
                           [r is None for r in reqs]):
            self.agents[self.next_agent] = Agent(reqs, chunk)
            self.next_agent += 1
            self.counts["joins"] += 1

    def _forward(self) -> None:
        self._promote()
        for agent in self._in("pending"):
            chunked = agent.reqs[0].fill_len is not None
            self._each(agent, lambda sim, r: sim.prefill_end(r, chunked=chunked))
            agent.phase = "chunking" if chunked else "decoding"
            agent.chunks_done += 1

    def _next_chunk(self) -> None:
        agent = self._pick("chunking")
        if agent is not None:
            ok = [sim.prefill_next_chunk(r, agent.chunk) for sim, r in zip(self.sims, agent.reqs)]
            if self._agree("retracted_chunk", [not x for x in ok]):
                self._drop(agent)
            else:
                agent.phase = "pending"
                self.counts["chunks"] += 1

    def _decode(self) -> None:
        agent = self._pick("decoding")
        for _ in range(self.rng.randrange(1, 5) if agent else 0):
            self._promote()
            if agent.reqs[0].req_pool_idx is None:  # aborted right after a promotion
                return
            tok = self.rng.randrange(self.sims[0].cfg.vocab)
            if agent.reqs[0].written_len >= self.sims[0].cfg.max_context:
                return
            ok = [sim.decode(r, tok) for sim, r in zip(self.sims, agent.reqs)]
            if self._agree("retracted_decode", [not x for x in ok]):
                self._drop(agent)
                return
            self.counts["decode_steps"] += 1

    def _finish(self) -> None:
        agent = self._pick("decoding")
        if agent is not None:
            self._each(agent, lambda sim, r: sim.finish(r))
            self._drop(agent)
            self.counts["finished"] += 1

    def _abort(self) -> None:
        phase = self.rng.choice(["waiting", "pending", "chunking", "decoding"])
        if phase == "waiting":  # matched and locked by the PrefillAdder, no row yet
            prompt = self.family[self.rng.choice(self.active)] + self._tok(2)
            for sim in self.sims:
                sim.lock(prompt)
            self._promote()  # the lock has no row: its promotion must wait
            for sim in self.sims:
                sim.unlock()
            self.counts["abort_waiting"] += 1
            return
        agent = self._pick(phase)
        if agent is not None:
            self._abort_agent(agent, phase)

    def _abort_agent(self, agent: Agent, why: str) -> None:
        if agent.phase == "pending":
            self._each(agent, lambda sim, r: sim.abort_pending(r))
            if agent.chunks_done and why != "after_promotion":
                why = "mid_chunked_prefill"
        else:
            self._each(agent, lambda sim, r: sim.abort(r))
            why = "mid_chunked_prefill" if why == "chunking" else why
        self._drop(agent)
        self.counts["abort_" + why] += 1

    def _lock(self) -> None:
        if self.locks < 2:
            tokens = self.family[self.rng.choice(self.active)][: self.rng.randrange(2, 40)]
            for sim in self.sims:
                sim.lock(tokens)
            self.locks += 1
            self.counts["temp_locks"] += 1

    def _unlock(self) -> None:
        if self.locks:
            for sim in self.sims:
                sim.unlock()
            self.locks -= 1

    def _rotate(self) -> None:
        """Prefixes stop being shared: a fresh random prefix (or a family member) replaces one."""
        if self.rng.random() < 0.5:
            self.family.append(self._tok(self.rng.randrange(16, 60)))
            new = len(self.family) - 1
        else:
            new = self.rng.randrange(len(self.family))
        self.active[self.rng.randrange(len(self.active))] = new
        if len(self.active) < 3 and self.rng.random() < 0.3:
            self.active.append(self.rng.randrange(len(self.family)))
        self.counts["rotations"] += 1

    def _match(self) -> None:
        prefix = self.family[self.rng.choice(self.active)]
        n = self.rng.randrange(2, len(prefix))
        for sim in self.sims:
            sim.match(prefix[:n])
        self.counts["lookups"] += 1

    def _evict(self) -> None:
        n = self.rng.randrange(1, 120)
        freed = [sim.evict(n) for sim in self.sims]
        assert len(set(freed)) == 1, f"ranks disagree on eviction: {freed}"
        self.counts["cold_evictions"] += 1

    # ---- helpers ---------------------------------------------------------------------------

    def _promote(self) -> None:
        """The plugin's hook before run_batch. Locked HOT extents must not move (a new extent
        moves only unlocked COLD KV); right after a promotion, sometimes abort a holder."""
        for sim in self.sims:
            cache = sim.cache
            locked = {n: cache.hot_extent_of(n) for n in cache._hot_start if n.lock_ref > 0}
            sim.promote()
            for node, ext in locked.items():
                assert cache.hot_extent_of(node) == ext, f"locked HOT node {node.id} moved"
        done = [sim.cache.metrics.promotions for sim in self.sims]
        assert len(set(done)) == 1, f"ranks disagree on promotions: {done}"
        if done[0] > self.promotions_seen:
            self.promotions_seen = done[0]
            hot = [a for a in self.agents.values()
                   if self.sims[0].cache.hot_run(a.reqs[0])[1] > 0]
            if hot and self.rng.random() < 0.3:
                self._abort_agent(self.rng.choice(hot), "after_promotion")

    def _agree(self, what: str, flags: List[bool]) -> bool:
        assert len(set(flags)) == 1, f"ranks disagree ({what}): {flags}"
        if flags[0]:
            self.counts[what] += 1
        return flags[0]

    def _in(self, *phases) -> List[Agent]:
        return [a for a in self.agents.values() if a.phase in phases]

    def _pick(self, phase: str) -> Optional[Agent]:
        agents = self._in(phase)
        return self.rng.choice(agents) if agents else None

    def _each(self, agent: Agent, fn) -> None:
        for sim, req in zip(self.sims, agent.reqs):
            fn(sim, req)

    def _drop(self, agent: Agent) -> None:
        self.agents = {k: a for k, a in self.agents.items() if a is not agent}
