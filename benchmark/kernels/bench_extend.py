"""Prefill (extend) attention against a shared HOT prefix: is there a faster kernel than SGLang's?

The end-to-end rows are bound by the prefill (docs/results/multi_agent.md, "How far the targets
are ..."): when N agents join a cached 16K prefix, each of their new tokens attends to the whole
prefix, ~4.4 TFLOP per layer at 64 x 256 tokens. SGLang's flashinfer backend computes that
part per request with its paged prefill wrapper (page size 1, FA2 on the host) and merges it
with the new tokens' own causal attention. Because the prefix is a contiguous HOT extent, the
same result can come from ONE dense call over the stacked new tokens of the whole group. This
script times, for one layer (bf16, 32q/8kv/128), the prefix part only (non-causal, with LSE,
as a merge needs):

    fi_paged_fa2      SGLang's way: BatchPrefillWithPagedKVCacheWrapper, per request, kv = prefix slots
    fi_paged_fa3      the same wrapper with backend="fa3"
    sgl_fa3_paged     SGLang's fa3 backend's call (sgl_kernel ``flash_attn_with_kvcache``, page size 1,
                      the prefix slots as the page table): the stock prefix part under ``fa3``
    fi_ragged_fa3     BatchPrefillWithRaggedKVCacheWrapper over the stacked tokens, K/V = the extent view
    fi_ragged_fa2     the same with backend="fa2"
    sdpa_flash        torch flash attention, q heads of a kv head stacked as rows (as the bgemm path)
    fi_ragged_fa3_splitS   (cases with few query tokens, e.g. decode: 1 new token per agent) the
                      ragged FA3 call with the extent cut into S chunks, each chunk its own
                      entry with a copy of the stacked queries, merged by LSE (merge_states):
                      FA3 has no split-KV, so few query rows leave most SMs idle; q copy, run and
                      merge are all timed
    fi_ragged_{fa3,fa2}_mhaS   (the same few-token cases) the GQA heads packed as query rows:
                      q [n, 32, d] is viewed as [n * 4, 8, d], so the call is MHA with 8 heads and
                      4x the rows, each tile full and each K/V chunk read once per kv head (the
                      unpacked calls above read it once per q head, from half-empty 128-row
                      tiles); S chunks as above (S = 1: one entry). Pack, q copies, run, merge
                      and unpack are all timed. A candidate for the decode prefix part, where
                      GraniKV's Triton kernel runs at ~300 TFLOP/s and FA3 at ~650 on prefill
    fi_paged_{fa3,fa2}_mhaS    the same through the paged wrapper (page size 1, kv_indices = the
                      extent's slots): the CUDA-graph-capturable form that can also take several
                      groups' extents in one call

With ``--forest``, a forest extend batch instead (16 prefixes of 1.5-6K tokens, 4-12 agents
each with 64-256 new tokens, in shuffled batch order; gaps between the extents; 8 agents that
matched only the first 1K of theirs), the prefix part as GraniKV serves it beside the stock way:

    fi_paged_fa2 / fi_paged_fa3   SGLang's way, per request (page size 1), FA2 / FA3
    granikv_calls                 HotExtendAttention + FlashInferDense: the groups of disjoint
                                  extents in one ragged FA3 call (gap entries), overlapping ones
                                  in a second (extend_plan.ExtendCall); gathers and scatters timed
    fi_ragged_per_group           one ragged FA3 call per (extent, length) group (the path before
                                  batching), same gathers

Each variant that fails (a FlashInfer module not prebuilt on the offline host, say) is reported
with its error and skipped. Outputs are compared with fi_paged_fa2 (max abs of o and lse).

    python -m benchmark.kernels.bench_extend --out $OUT     # GPU
    python -m benchmark.kernels.bench_extend --forest --out $OUT
    python -m benchmark.kernels.bench_extend --cases 0,7 --out $OUT   # two cases (CASES indices)

Writes OUT/extend.json (OUT/extend_forest.json with --forest). This is a measurement to decide whether to build a shared-prefix extend
path in the backend; nothing in the serving path uses it.
"""

import argparse
import json
import os
import traceback

import torch

from benchmark.harness.timing import gpu_ms

HQ, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = "cuda"
CASES = [(16384, 64, 256), (16384, 128, 256), (16384, 8, 256), (4096, 64, 256), (16384, 64, 1024),
         (16384, 64, 1), (16384, 128, 1),  # these two: decode (GraniKV's prefix kernel: 59 / 107 us, sweep 7)
         (10240, 24, 128)]  # an agent loop's later turn: 24 tool results of 128 tokens on a 10K prefix
SPLITS = (4, 8, 16)
MHA_SPLITS = (1, 4, 8, 16)
FEW_TOKENS = 256  # split variants for cases with at most this many query tokens


def pack_gqa(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, hq, d] -> [n * r, hkv, d] (r = hq // hkv): row ``i * r + j``, head ``g`` is q head
    ``g * r + j`` of token ``i``, which reads kv head ``g``, so MHA over the rows is the GQA."""
    n, hq, d = q.shape
    r = hq // hkv
    return q.view(n, hkv, r, d).transpose(1, 2).reshape(n * r, hkv, d)


def unpack_gqa(o: torch.Tensor, lse: torch.Tensor, hq: int):
    """Inverse of ``pack_gqa`` for the output [n * r, hkv, d] and its LSE [n * r, hkv]."""
    m, hkv, d = o.shape
    r = hq // hkv
    n = m // r
    return (o.view(n, r, hkv, d).transpose(1, 2).reshape(n, hq, d),
            lse.view(n, r, hkv).transpose(1, 2).reshape(n, hq))


def split_ptrs(length: int, n_split: int) -> list:
    """kv_indptr of ``length`` keys cut into ``n_split`` near-equal chunks."""
    chunk = -(-length // n_split)
    return [min(j * chunk, length) for j in range(n_split + 1)]


def mha_split_attention(q, k, v, n_split: int, attend, merge):
    """GQA attention of q [n, hq, d] to k, v [L, hkv, d] as packed MHA over ``n_split`` key
    chunks: ``attend(q_rows, k, v, qo_ptr, kv_ptr) -> (o, lse)`` runs the ragged batch (entry
    s: the packed rows against keys [kv_ptr[s], kv_ptr[s+1])); ``merge(o [m, S, h, d],
    lse [m, S, h])`` combines the chunks. Returns (o [n, hq, d], lse [n, hq])."""
    hkv = k.shape[1]
    rows = pack_gqa(q, hkv)
    m = rows.shape[0]
    qo_ptr = list(range(0, n_split * m + 1, m))
    o, lse = attend(rows.repeat(n_split, 1, 1) if n_split > 1 else rows, k, v, qo_ptr,
                    split_ptrs(k.shape[0], n_split))
    if n_split > 1:
        o, lse = merge(o.view(n_split, m, hkv, -1).transpose(0, 1).contiguous(),
                       lse.view(n_split, m, hkv).transpose(0, 1).contiguous())
    return unpack_gqa(o, lse, q.shape[1])


def granikv_prefix(q, k, v, start: int, prefix: int, scale: float):
    """GraniKV's own decode prefix kernel (``prefix_attention``) for one group: every request of
    q shares the extent [start, start + prefix) and has one COLD token. Returns (run, result):
    ``run`` is the kernel launch alone (what the serving path times per layer), ``result()``
    merges each request's prefix chunks in torch into (o [n, hq, d], lse [n, hq] base 2)."""
    import numpy as np

    from granikv.kernels.prefix_attention import prefix_attention
    from granikv.attention.decode.workspace import CascadeWorkspace
    from granikv.kernels.plan import Grouping

    n = q.shape[0]
    ws = CascadeWorkspace(n, HQ, HKV, D, DEV)
    grouping = Grouping.of([start], [prefix], [0, n], np.arange(n), np.full(n, prefix))
    wl = ws.fill(grouping, np.full(n, prefix + 1, dtype=np.int64), np.arange(n))
    chunks = int(wl.pfx_split.max()) + 1  # one group: every member has this many prefix rows, first

    def run():
        prefix_attention(q, k, v, ws.plan, sm_scale=scale)

    def result():
        run()
        lo = torch.as_tensor(wl.part_indptr[:n], device=q.device)
        rows = lo[:, None] + torch.arange(chunks, device=q.device)[None, :]  # [n, chunks]
        po, pl = ws.part_o[rows], ws.part_lse[rows]  # [n, chunks, hq, d], [n, chunks, hq]
        m = torch.logsumexp(pl, 1)
        o = (po * torch.exp(pl - m[:, None])[..., None]).sum(1)
        return o, m / 0.6931471805599453

    return run, result


def run_case(prefix: int, agents: int, new: int, ws_bytes) -> dict:
    n_tok = agents * new
    start = 1
    slots = start + prefix + 8
    k = torch.randn(slots, HKV, D, device=DEV, dtype=DT)
    v = torch.randn(slots, HKV, D, device=DEV, dtype=DT)
    q = torch.randn(n_tok, HQ, D, device=DEV, dtype=DT)
    scale = D**-0.5
    i32 = lambda *a: torch.tensor(a, dtype=torch.int32, device=DEV)  # noqa: E731
    row = dict(prefix=prefix, agents=agents, new_tokens=new, GFLOP=round(4 * n_tok * prefix * HQ * D / 1e9, 1))
    outs = {}

    def record(name, fn):
        try:
            o, lse = fn()
            outs[name] = (o.float(), lse.float())
            ms, _ = gpu_ms(fn, graph=False)
            row[name + "_ms"] = round(ms, 4)
            row[name + "_TFLOPs"] = round(4 * n_tok * prefix * HQ * D / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name + "_error"] = repr(e)[:300]
            traceback.print_exc()

    import flashinfer

    qo_req = torch.arange(0, n_tok + 1, new, dtype=torch.int32, device=DEV)
    kv_req = torch.arange(0, agents * prefix + 1, prefix, dtype=torch.int32, device=DEV)
    kv_idx = torch.arange(start, start + prefix, dtype=torch.int32, device=DEV).repeat(agents)
    last = torch.ones(agents, dtype=torch.int32, device=DEV)
    paged = (k.view(-1, 1, HKV, D), v.view(-1, 1, HKV, D))
    for be in ("fa2", "fa3"):
        def paged_fn(be=be):
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_bytes, "NHD", backend=be)
            w.plan(qo_req, kv_req, kv_idx, last, HQ, HKV, D, 1, causal=False, q_data_type=DT, kv_data_type=DT)
            return lambda: w.run(q, paged, return_lse=True)
        try:
            record(f"fi_paged_{be}", paged_fn())
        except Exception as e:  # noqa: BLE001
            row[f"fi_paged_{be}_error"] = repr(e)[:300]
    ext_k, ext_v = k[start : start + prefix], v[start : start + prefix]  # the contiguous HOT extent
    for be in ("fa3", "fa2"):
        def ragged_fn(be=be):
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_bytes, "NHD", backend=be)
            w.plan(i32(0, n_tok), i32(0, prefix), HQ, HKV, D, causal=False, q_data_type=DT, kv_data_type=DT)
            return lambda: w.run(q, ext_k, ext_v, return_lse=True)
        try:
            record(f"fi_ragged_{be}", ragged_fn())
        except Exception as e:  # noqa: BLE001
            row[f"fi_ragged_{be}_error"] = repr(e)[:300]

    if n_tok <= FEW_TOKENS:
        for n_split in SPLITS:
            def split_fn(n_split=n_split):
                kv_ptr = split_ptrs(prefix, n_split)
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_bytes, "NHD", backend="fa3")
                w.plan(torch.arange(0, n_split * n_tok + 1, n_tok, dtype=torch.int32), torch.tensor(kv_ptr, dtype=torch.int32),
                       HQ, HKV, D, causal=False, q_data_type=DT, kv_data_type=DT)

                def run():
                    o, lse = w.run(q.repeat(n_split, 1, 1), ext_k, ext_v, return_lse=True)
                    return flashinfer.merge_states(o.view(n_split, n_tok, HQ, D).transpose(0, 1).contiguous(),
                                                   lse.view(n_split, n_tok, HQ).transpose(0, 1).contiguous())
                return run
            try:
                record(f"fi_ragged_fa3_split{n_split}", split_fn())
            except Exception as e:  # noqa: BLE001
                row[f"fi_ragged_fa3_split{n_split}_error"] = repr(e)[:300]

        for be in ("fa3", "fa2"):
            for n_split in MHA_SPLITS:
                def mha_fn(be=be, n_split=n_split):
                    m = n_tok * (HQ // HKV)
                    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_bytes, "NHD", backend=be)
                    w.plan(torch.arange(0, n_split * m + 1, m, dtype=torch.int32),
                           torch.tensor(split_ptrs(prefix, n_split), dtype=torch.int32),
                           HKV, HKV, D, causal=False, q_data_type=DT, kv_data_type=DT)
                    attend = lambda rows, kk, vv, _qo, _kv: w.run(rows, kk, vv, return_lse=True)  # noqa: E731
                    return lambda: mha_split_attention(q, ext_k, ext_v, n_split, attend, flashinfer.merge_states)
                try:
                    record(f"fi_ragged_{be}_mha{n_split}", mha_fn())
                except Exception as e:  # noqa: BLE001
                    row[f"fi_ragged_{be}_mha{n_split}_error"] = repr(e)[:300]

                def paged_mha_wrapper(be, n_split):
                    # the same through the paged wrapper (page size 1, kv_indices = the extent's
                    # slots): the form SGLang already captures in CUDA graphs, and the one that can
                    # take several groups' extents (anywhere in the pool) in one call
                    m = n_tok * (HQ // HKV)
                    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_bytes, "NHD", backend=be)
                    w.plan(torch.arange(0, n_split * m + 1, m, dtype=torch.int32),
                           torch.tensor(split_ptrs(prefix, n_split), dtype=torch.int32),
                           torch.arange(start, start + prefix, dtype=torch.int32, device=DEV),
                           torch.ones(n_split, dtype=torch.int32), HKV, HKV, D, 1, causal=False,
                           q_data_type=DT, kv_data_type=DT)
                    return w

                def paged_mha_fn(be=be, n_split=n_split):
                    w = paged_mha_wrapper(be, n_split)
                    attend = lambda rows, _k, _v, _qo, _kv: w.run(rows, paged, return_lse=True)  # noqa: E731
                    return lambda: mha_split_attention(q, ext_k, ext_v, n_split, attend, flashinfer.merge_states)
                try:
                    record(f"fi_paged_{be}_mha{n_split}", paged_mha_fn())
                except Exception as e:  # noqa: BLE001
                    row[f"fi_paged_{be}_mha{n_split}_error"] = repr(e)[:300]

                def paged_mha_run_only(be=be, n_split=n_split):
                    # the attention call alone, rows packed and repeated beforehand: what is left
                    # if pack and merge are fused into the kernels around it
                    w = paged_mha_wrapper(be, n_split)
                    rows = pack_gqa(q, HKV).repeat(n_split, 1, 1)
                    return lambda: w.run(rows, paged, return_lse=True)
                try:  # timed only (its rows are not in q's order, so it is not compared)
                    fn = paged_mha_run_only()
                    fn()
                    ms, _ = gpu_ms(fn, graph=False)
                    row[f"fi_paged_{be}_mha{n_split}_run_ms"] = round(ms, 4)
                    row[f"fi_paged_{be}_mha{n_split}_run_TFLOPs"] = round(4 * n_tok * prefix * HQ * D / ms / 1e9, 1)
                except Exception as e:  # noqa: BLE001
                    row[f"fi_paged_{be}_mha{n_split}_run_error"] = repr(e)[:300]

        try:
            run, result = granikv_prefix(q, k, v, start, prefix, scale)
            o, lse = result()
            outs["granikv_prefix"] = (o.float(), lse.float())
            ms, _ = gpu_ms(run, graph=False)
            row["granikv_prefix_ms"] = round(ms, 4)
            row["granikv_prefix_TFLOPs"] = round(4 * n_tok * prefix * HQ * D / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001
            row["granikv_prefix_error"] = repr(e)[:300]
            traceback.print_exc()

    ratio = HQ // HKV

    def sdpa():
        qs = q.view(n_tok, HKV, ratio, D).permute(1, 0, 2, 3).reshape(1, HKV, n_tok * ratio, D)
        kk = ext_k.transpose(0, 1).unsqueeze(0)
        vv = ext_v.transpose(0, 1).unsqueeze(0)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(qs, kk, vv, scale=scale)[:2]
        o = o.view(HKV, n_tok, ratio, D).permute(1, 0, 2, 3).reshape(n_tok, HQ, D)
        return o, lse.view(HKV, n_tok, ratio).permute(1, 0, 2).reshape(n_tok, HQ)

    record("sdpa_flash", sdpa)

    def sgl_fa3():
        # SGLang's fa3 backend over the same cache (page size 1): the page table lists each
        # request's prefix slots, the new tokens are its queries (the stock prefix part under fa3)
        from sgl_kernel.flash_attn import flash_attn_with_kvcache

        table = kv_idx.view(agents, prefix)
        lens = torch.full((agents,), prefix, dtype=torch.int32, device=DEV)

        def run():
            o, lse, *_ = flash_attn_with_kvcache(q, paged[0], paged[1], cache_seqlens=lens, page_table=table,
                                                 cu_seqlens_q=qo_req, max_seqlen_q=new, softmax_scale=scale,
                                                 causal=False, return_softmax_lse=True)
            return o, (lse.t() if lse.shape[0] == HQ else lse)  # varlen LSE: [Hq, tokens]
        return run

    try:
        record("sgl_fa3_paged", sgl_fa3())
    except Exception as e:  # noqa: BLE001 - sglang-kernel without its FA3 library
        row["sgl_fa3_paged_error"] = repr(e)[:300]
    ref = outs.get("fi_paged_fa2")
    if ref is not None:
        for name, (o, lse) in outs.items():
            row[name + "_maxdiff_o"] = round((o - ref[0]).abs().max().item(), 4)
            # FlashInfer returns base-2 LSE; torch natural log: compare what each reports
            row[name + "_lse_scale_vs_fi"] = round(float((lse / ref[1]).median().item()), 4)
    return row


def forest_batch(seed: int = 0):
    """The --forest batch: KV buffers, rows, cached prefix lengths, HOT runs per row, new tokens,
    req_to_token, q (all on the GPU but the numpy plan inputs)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    lens = rng.integers(1536, 6145, 16)
    starts = 1 + np.cumsum(lens + rng.integers(0, 2048, 16)) - lens
    ext_of = rng.permutation(np.repeat(np.arange(16), rng.integers(4, 13, 16)))
    bs = len(ext_of)
    rows = np.arange(1, bs + 1, dtype=np.int64)
    start, length = np.zeros(bs + 1, np.int64), np.zeros(bs + 1, np.int64)
    start[rows] = starts[ext_of]
    length[rows] = lens[ext_of]
    length[rows[rng.permutation(bs)[:8]]] = 1024  # matched only the head of their extent
    prefix = length[rows].copy()
    new = rng.integers(64, 257, bs).astype(np.int64)
    slots = int(starts[-1] + lens[-1]) + 1
    k = torch.randn(slots, HKV, D, device=DEV, dtype=DT, generator=g)
    v = torch.randn(slots, HKV, D, device=DEV, dtype=DT, generator=g)
    r2t = torch.zeros(bs + 1, int(lens.max()), dtype=torch.int32, device=DEV)
    for r in rows:
        r2t[r, : prefix[r - 1]] = torch.arange(start[r], start[r] + prefix[r - 1], dtype=torch.int32, device=DEV)
    q = torch.randn(int(new.sum()), HQ, D, device=DEV, dtype=DT, generator=g)
    return k, v, rows, prefix, start, length, new, r2t, q


def run_forest(ws_bytes) -> dict:
    """The --forest comparison (module docstring); prefix part only, one layer."""
    import flashinfer
    import numpy as np

    from granikv.attention.extend.plan import plan_extend
    from granikv.attention.extend.hot_extend import FlashInferDense, HotExtendAttention

    k, v, rows, prefix, start, length, new, r2t, q = forest_batch()
    scale = D**-0.5
    flops = 4 * int((new * prefix).sum()) * HQ * D
    plan, reason = plan_extend(rows, prefix, new, start, length)
    assert reason == "", reason
    row = dict(requests=len(rows), tokens=int(new.sum()), groups=len(plan.groups), calls=len(plan.calls),
               GFLOP=round(flops / 1e9, 1))
    outs = {}

    def record(name, fn):
        try:
            outs[name] = tuple(t.float() for t in fn())
            ms, _ = gpu_ms(fn, graph=False)
            row[name + "_ms"] = round(ms, 4)
            row[name + "_TFLOPs"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - report and go on
            row[name + "_error"] = repr(e)[:300]
            traceback.print_exc()

    i32 = dict(dtype=torch.int32, device=DEV)
    paged = (k.view(-1, 1, HKV, D), v.view(-1, 1, HKV, D))
    kv_idx = torch.cat([r2t[r, :p] for r, p in zip(rows, prefix)])
    for be in ("fa2", "fa3"):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_bytes, "NHD", backend=be)
        try:
            w.plan(torch.tensor(np.concatenate([[0], np.cumsum(new)]), **i32),
                   torch.tensor(np.concatenate([[0], np.cumsum(prefix)]), **i32), kv_idx,
                   torch.ones(len(rows), **i32), HQ, HKV, D, 1, causal=False, sm_scale=scale,
                   q_data_type=DT, kv_data_type=DT)
            record(f"fi_paged_{be}", lambda w=w: w.run(q, paged, return_lse=True))
        except Exception as e:  # noqa: BLE001
            row[f"fi_paged_{be}_error"] = repr(e)[:300]
    attn = HotExtendAttention(FlashInferDense(ws_bytes), DEV)
    attn.begin(plan, r2t)
    record("granikv_calls", lambda: attn.prefix_part(q, k, v, scale))
    try:
        wrappers, idx = [], []
        for gr in plan.groups:
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_bytes, "NHD", backend="auto")
            w.plan(torch.tensor([0, gr.num_tokens], dtype=torch.int32), torch.tensor([0, gr.length], dtype=torch.int32),
                   HQ, HKV, D, causal=False, sm_scale=scale, q_data_type=DT, kv_data_type=DT)
            wrappers.append(w)
            idx.append(torch.from_numpy(gr.token_idx).to(DEV))

        def per_group():
            o = torch.empty_like(q)
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEV)
            for w, gr, ix in zip(wrappers, plan.groups, idx):
                og, lg = w.run(q.index_select(0, ix), k[gr.start: gr.start + gr.length],
                               v[gr.start: gr.start + gr.length], return_lse=True)
                o.index_copy_(0, ix, og)
                lse.index_copy_(0, ix, lg)
            return o, lse
        record("fi_ragged_per_group", per_group)
    except Exception as e:  # noqa: BLE001
        row["fi_ragged_per_group_error"] = repr(e)[:300]
        traceback.print_exc()
    ref = outs.get("fi_paged_fa2")
    if ref is not None:
        for name, (o, lse) in outs.items():
            row[name + "_maxdiff_o"] = round((o - ref[0]).abs().max().item(), 4)
            row[name + "_maxdiff_lse"] = round((lse - ref[1]).abs().max().item(), 4)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode-only", action="store_true", help="only the decode-shaped cases (1 new token)")
    ap.add_argument("--forest", action="store_true", help="the forest extend batch only (module docstring)")
    ap.add_argument("--cases", default="", help="comma-separated indices into CASES (default: all)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ws_bytes = torch.empty(512 << 20, dtype=torch.uint8, device=DEV)
    if args.forest:
        r = run_forest(ws_bytes)
        print("FOREST", json.dumps(r), flush=True)
        with open(os.path.join(args.out, "extend_forest.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, row=r), f, indent=1)
        return
    rows = []
    picked = [CASES[int(i)] for i in args.cases.split(",") if i.strip()] if args.cases else CASES
    for prefix, agents, new in picked:
        if args.decode_only and new != 1:
            continue
        r = run_case(prefix, agents, new, ws_bytes)
        rows.append(r)
        print("ROW", json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    names = ("fi_paged_fa2", "fi_paged_fa3", "sgl_fa3_paged", "fi_ragged_fa3", "fi_ragged_fa2", "sdpa_flash") + tuple(
        f"fi_ragged_fa3_split{n}" for n in SPLITS) + tuple(
        f"fi_{kind}_{be}_mha{n}" for kind in ("ragged", "paged") for be in ("fa3", "fa2") for n in MHA_SPLITS) + tuple(
        f"fi_paged_{be}_mha{n}_run" for be in ("fa3", "fa2") for n in MHA_SPLITS) + ("granikv_prefix",)
    print(f"\n{torch.cuda.get_device_name()}  prefix part of extend attention, one layer, ms (TFLOP/s)")
    print(f"{'prefix x agents x new':<24}{'GFLOP':>8}" + "".join(f"{n:>20}" for n in names))
    for r in rows:
        cells = [f"{r[n + '_ms']:.3f} ({r[n + '_TFLOPs']:.0f})" if n + "_ms" in r else "error" for n in names]
        print(f"{r['prefix']}x{r['agents']}x{r['new_tokens']:<14}{r['GFLOP']:>8}" + "".join(f"{c:>20}" for c in cells))
    with open(os.path.join(args.out, "extend.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
