"""The prefill path over HOT prefixes under churn, on the real storage layer (scheduler_sim:
SGLang's pools, GraniKV's allocator, radix cache and HotPrefixTable) and the real scheduler hook.

Seeded random extend batches mix: agents joining shared prefixes (which get promoted to HOT by
the hook in the same step), agents whose prompt extends their own earlier turn (HOT head + COLD
tail), chunked prefills of unshared prompts, fresh prompts, aborts and COLD eviction between
batches. For every batch, layer 0's extend output through ``GraniKVAttnBackend`` (around the
stand-in of SGLang's flashinfer extend, test/attention/extend_standin.py) must equal full causal
attention over the ORACLE KV of each request's tokens (``Sim.expected_kv``), so a HOT extent
holding the wrong KV, a wrong token grouping or a wrong COLD remainder all fail. Tolerance:
float32 KV and math, atol = rtol = 1e-4.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from granikv.config import GraniKVConfig
from granikv.attention.backend import GraniKVAttnBackend
from granikv.scheduler_step import on_run_batch

from attention.extend_standin import FlashInferExtendStandIn, attend
from support.scheduler_sim import Sim, SimConfig

HKV, D, RATIO = 2, 16, 2
HQ = HKV * RATIO
SCALE = D ** -0.5


def _setup(seed):
    sim = Sim(SimConfig(kv_size=1400, layers=1, kv_heads=HKV, head_dim=D, max_reqs=24, max_context=260,
                        hot_fraction=0.4, min_tokens=16, dtype=torch.float32, seed=seed))
    mc = SimpleNamespace(num_attention_heads=HQ, head_dim=D, num_hidden_layers=1,
                         get_num_kv_heads=lambda tp: HKV, hf_config=SimpleNamespace())
    runner = SimpleNamespace(model_config=mc, ps=SimpleNamespace(attn_tp_size=1), device="cpu",
                             kv_cache_dtype=torch.float32, server_args=SimpleNamespace(speculative_algorithm=None),
                             req_to_token_pool=sim.req_pool, token_to_kv_pool=sim.kv_pool,
                             token_to_kv_pool_allocator=sim.allocator)
    be = GraniKVAttnBackend(None, model_runner=runner,
                            cfg=GraniKVConfig(enable=True, hot_min_tokens=16, debug_integrity=True, extend_path="hot"),  # checks each plan
                            backend_name="stand-in")
    be.inner = FlashInferExtendStandIn(runner)
    sched = SimpleNamespace(tree_cache=sim.cache, token_to_kv_pool_allocator=sim.allocator,
                            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=be)),
                            enable_overlap=False)
    return sim, be, sched


def _run_batch(sim, be, sched, reqs, rng, cfg):
    """The hook, then layer 0's extend through the backend; checked against the oracle."""
    on_run_batch(sched, SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs), cfg)
    prefix = [r.pending[0] for r in reqs]
    new = [len(r.pending[1]) for r in reqs]
    toks = [r.origin_input_ids[p: p + n] for r, p, n in zip(reqs, prefix, new)]
    kv = [sim.expected_kv(t, p)[0] for t, p in zip(toks, prefix)]  # layer 0: (2, n, H, D)
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(reqs),
                         req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]),
                         extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=new,
                         out_cache_loc=torch.cat([r.pending[1] for r in reqs]))
    q = torch.randn(sum(new), HQ * D, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    k = torch.cat([x[0] for x in kv]).reshape(-1, HKV * D)
    v = torch.cat([x[1] for x in kv]).reshape(-1, HKV * D)
    be.init_forward_metadata(fb)
    out = be.forward_extend(q, k, v, SimpleNamespace(layer_id=0, scaling=SCALE), fb).view(-1, HQ, D)
    t = 0
    for r, p, n in zip(reqs, prefix, new):
        full = sim.expected_kv(r.origin_input_ids[: p + n], 0)[0]
        want, _ = attend(q.view(-1, HQ, D)[t: t + n], full[0], full[1], SCALE, first_pos=p)
        torch.testing.assert_close(out[t: t + n].double(), want, atol=1e-4, rtol=1e-4)
        t += n
    for r in reqs:
        sim.prefill_end(r, chunked=r.fill_len is not None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_through_hot_prefixes_matches_the_oracle_under_churn(seed):
    rng = random.Random(seed)
    sim, be, sched = _setup(seed)
    cfg = GraniKVConfig(enable=True, hot_min_tokens=16, debug_integrity=True, extend_path="hot")
    shared = [[rng.randrange(1, 61) for _ in range(rng.randrange(20, 70))] for _ in range(3)]
    done = []  # finished prompts + outputs: an agent's next turn extends one of them
    for step in range(25):
        reqs = []
        for _ in range(rng.randrange(1, 5)):
            kind = rng.random()
            if kind < 0.55:  # an agent joins a shared prefix
                prompt = rng.choice(shared) + [rng.randrange(1, 61) for _ in range(rng.randrange(1, 12))]
                req = sim.prefill_begin(prompt)
            elif kind < 0.75 and done:  # an agent's next turn: its earlier turn + new tokens
                prompt = rng.choice(done) + [rng.randrange(1, 61) for _ in range(rng.randrange(1, 9))]
                req = sim.prefill_begin(prompt)
            elif kind < 0.9:  # an unshared prompt, chunked
                prompt = [rng.randrange(1, 61) for _ in range(rng.randrange(20, 60))]
                req = sim.prefill_begin(prompt, chunk=rng.randrange(8, 24))
            else:  # a fresh short prompt
                req = sim.prefill_begin([rng.randrange(1, 61) for _ in range(rng.randrange(2, 10))])
            if req is not None and len(req.origin_input_ids) <= 200:
                reqs.append(req)
            elif req is not None:
                sim.abort_pending(req)
        if not reqs:
            continue
        _run_batch(sim, be, sched, reqs, rng, cfg)
        for r in reqs:  # finish, abort or keep some live (their locks keep prefixes shared)
            if r.fill_len is not None or rng.random() < 0.3:
                continue
            if rng.random() < 0.8:
                done.append(list(r.origin_input_ids))
                sim.finish(r)
            else:
                sim.abort(r)
        for r in [r for r in list(sim.live.values()) if r.fill_len is not None]:  # next chunk as its own batch
            if sim.prefill_next_chunk(r, rng.randrange(8, 24)):
                _run_batch(sim, be, sched, [r], rng, cfg)
        if rng.random() < 0.2:
            sim.evict(rng.randrange(1, 200))
        sim.check()
        if rng.random() < 0.15 and len(sim.live) > 6:
            for r in list(sim.live.values())[:3]:
                if r.pending is None:
                    sim.finish(r)
    snap = be.stats_snapshot()
    assert snap["extend_hot_batches"] >= 5, snap  # the HOT path really ran
    assert be.extend.hot_extend is not None
    for r in list(sim.live.values()):
        if r.pending is not None:
            sim.abort_pending(r)
        else:
            sim.finish(r)
    sim.drain()
    sim.assert_all_free()
