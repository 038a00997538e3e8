"""Agent loops over the real pools + cache (SGLang's call order, ``scheduler_sim.Sim``): a
growing per-agent context must keep its HOT prefix without re-promotion or extra copies.

Two loops, several turns each (every turn: admit all agents, promote, decode their outputs,
finish; the next turn's prompt is the agent's whole transcript + a tool result + a query):

- private histories: agents share only the first prompt's prefix P; after P's one promotion
  every later turn promotes nothing and copies nothing, and every agent's HOT run stays P's
  extent (same start and length) while its COLD history grows;
- a shared transcript: all agents see the same appended messages M_1, M_2, ... (a group chat);
  each turn promotes only the new shared message, placed in place right after the transcript's
  HOT run (no shadow head re-copying the earlier transcript), so the copy volume per turn is the
  new message alone and every agent's HOT run is the whole transcript, from the same start.
KV views are checked bit-exact after every step (``Sim.check``).
"""

import random

from support.scheduler_sim import Sim, SimConfig

AGENTS, TURNS, OUT, TOOL = 4, 4, 5, 6


def _tokens(seed, n, vocab=61):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _turn(sim, prompts, seed):
    """One turn of every agent: admit, promote (the plugin, before the batch runs), decode
    ``OUT`` tokens, finish. Returns (each agent's transcript, HOT runs (start, len) while live)."""
    reqs = [sim.admit(p) for p in prompts]
    assert all(r is not None for r in reqs), "the scenario must fit the pools"
    sim.promote()
    sim.check()
    table = sim.cache.hot_prefix_table
    runs = [(int(table.start_np[r.req_pool_idx]), int(table.length_np[r.req_pool_idx])) for r in reqs]
    out = _tokens(seed, OUT * len(reqs))
    for step in range(OUT):
        for i, r in enumerate(reqs):
            assert sim.decode(r, out[i * OUT + step])
        assert sim.promote() == 0  # decode steps promote nothing
    sim.check()
    transcripts = [list(r.origin_input_ids) + list(r.output_ids) for r in reqs]
    for r in reqs:
        sim.finish(r)
    sim.check()
    return transcripts, runs


def _counters(sim):
    m = sim.cache.metrics
    return m.promotions, m.bytes_copied, m.shadow_head_tokens


def test_private_histories_keep_the_shared_prefix_hot_without_churn():
    sim = Sim(SimConfig(kv_size=1024, max_context=160, max_reqs=2 * AGENTS))
    prefix = _tokens(1, 41)
    prompts = [prefix + [(7 * i + 3) % 61, i] for i in range(AGENTS)]
    transcripts, runs = _turn(sim, prompts, seed=100)
    promotions, copied, heads = _counters(sim)
    assert promotions == 1 and heads == 0
    p_run = runs[0]
    assert p_run[1] == len(prefix) and runs == [p_run] * AGENTS
    for turn in range(1, TURNS):
        prompts = [t + _tokens(1000 * turn + i, TOOL) + [i, turn] for i, t in enumerate(transcripts)]
        transcripts, runs = _turn(sim, prompts, seed=100 + turn)
        assert _counters(sim) == (promotions, copied, heads), f"turn {turn}: a re-promotion or a copy"
        assert runs == [p_run] * AGENTS, f"turn {turn}: an agent lost its HOT prefix"
        assert all(len(t) > len(prefix) + turn * (OUT + TOOL) for t in transcripts)


def test_a_shared_transcript_extends_in_place_each_turn():
    sim = Sim(SimConfig(kv_size=1024, max_context=160, max_reqs=2 * AGENTS))
    transcript = _tokens(1, 41)
    slot_bytes = 2 * sim.cfg.layers * sim.cfg.kv_heads * sim.cfg.head_dim * sim.cfg.dtype.itemsize
    start = None
    for turn in range(TURNS):
        if turn:
            transcript = transcript + _tokens(500 + turn, 17)  # the turn's shared message
        before, moved_before = _counters(sim), sim.cache.metrics.compaction_moves
        prompts = [transcript + [(7 * i + turn) % 61, i] for i in range(AGENTS)]
        _, runs = _turn(sim, prompts, seed=200 + turn)
        promotions, copied, heads = _counters(sim)
        assert promotions == before[0] + 1 and heads == 0, f"turn {turn}: not one in-place promotion"
        new = len(transcript) - (0 if turn == 0 else len(transcript) - 17)
        # an adopted message (its prefill slots already follow the run) copies nothing; cached
        # COLD KV moved out of the slots after the run is not the transcript's copy
        moved = (sim.cache.metrics.compaction_moves - moved_before) * slot_bytes
        assert copied - before[1] - moved <= new * slot_bytes, f"turn {turn}: copied more than the new message"
        start = runs[0][0] if start is None else start
        assert runs == [(start, len(transcript))] * AGENTS, f"turn {turn}: HOT run not the whole transcript"
