"""One decode attention layer over shared prefixes: GraniKV kernels vs SGLang / FlashInfer, one run.

Paths timed side by side on the same KV pool (bf16, page size 1, prefixes contiguous = HOT
extents, suffix slots shuffled = COLD):
  sgl_triton      SGLang's paged Triton decode (decode_attention_fwd), best num_kv_splits
  fi_decode_tc    FlashInfer tensor-core paged decode (SGLang's flashinfer backend for GQA 4)
  fi_cascade_fa2  FlashInfer MultiLevelCascadeAttentionWrapper, fa2 prefill kernels
  fi_cascade_fa3  the same with FlashInfer's default backend (fa3 on sm90)
  gkv_cascade     GraniKV prefix + suffix + merge (3 launches)
  gkv_fused       GraniKV single launch
  gkv_bgemm       torch flash attention per group for the prefix + GraniKV suffix + merge (eager)
  gkv_*@NAME      the same with a SWEEP variant of the kernel config (--variants NAME,...), e.g.
                  "descriptor" / "descriptor_ws": the prefix kernel over tensor descriptors (TMA),
                  without / with warp specialisation; its prefix launch alone is gkv_part_prefix@NAME
GraniKV's capturable paths are timed as CUDA-graph replays (as SGLang runs decode; eager times
too), baselines eagerly as in fi_attn_bench.py (GPU-bound at these sizes); triton.testing
.do_bench median, L2 flushed between runs. Floor = max(unique bytes / copy bandwidth,
FLOPs / bf16 matmul rate), both measured at the start of the run; "TB/s" and "TFLOP/s" count
the unique bytes (each K/V token read once, q read, out written) and the useful FLOPs.

    python -m benchmark.kernels.bench_attention --quick --out DIR     # key points
    python -m benchmark.kernels.bench_attention --sweep --out DIR     # tile/launch variants (SWEEP)
    python -m benchmark.kernels.bench_attention --out DIR             # full grid
    python -m benchmark.kernels.bench_attention --quick --variants descriptor,descriptor_ws --out DIR
                                             # the TMA prefix kernel beside the default and FlashInfer
    python -m benchmark.kernels.bench_attention --shape qwen2.5-7b --sweep --out DIR
                                             # another model's heads (SHAPES): per-shape tile sweep
    python -m benchmark.kernels.bench_attention --matrix --max-bs 256 --out DIR
                                             # the prefix part at GQA 1/3/4/7/8 x head_dim 128/64 x
                                             # 4K-32K prefixes x 16-256 sharers, beside FlashInfer's
                                             # cascade and its fa3 prefill with packed queries
    python -m benchmark.kernels.bench_attention --kv-dtype fp8_e4m3 --sweep --variants descriptor --out DIR
                                             # over an FP8 cache ("auto" keeps pointer loads there;
                                             # "descriptor" forces tensor-descriptor loads of FP8 tiles)

Writes DIR/kernels.json and DIR/kernels.png (if matplotlib is importable).
"""

import argparse
import dataclasses
import json
import os
import time
import traceback

import numpy as np
import torch
import triton

from benchmark.harness.timing import gpu_ms as bench  # (ms, "graph" | "eager")
from benchmark.harness.timing import host_ms
from benchmark.kernels.read_bound import best_read_us
from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
from granikv.kernels.merge_state import merge_state
from granikv.kernels.prefix_attention import prefix_attention
from granikv.kernels.suffix_attention import suffix_attention
from granikv.kernels.kernel_config import device_has_tma, tile_config
from granikv.kernels.plan import Grouping
from granikv.attention.decode.workspace import CascadeWorkspace

DEV = "cuda"
DT = torch.bfloat16
SHAPES = {  # --shape: (q heads, kv heads, head_dim) per layer at TP 1
    "llama-3.1-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "qwen2.5-14b": (40, 8, 128), "gqa3": (24, 8, 128),
    "mha": (32, 32, 128), "llama-3.1-8b-d64": (32, 8, 64), "qwen2.5-7b-d64": (28, 4, 64), "gqa3-d64": (24, 8, 64),
    "qwen2.5-14b-d64": (40, 8, 64), "mha-d64": (32, 32, 64),
    # the grid's hybrid and MoE models (docs/results/hybrid_models.md): gpt-oss's full-attention
    # layers (GQA 8 at head_dim 64, where its decode step sits furthest from the floor) and Qwen3-MoE's
    "gpt-oss-20b": (64, 8, 64), "qwen3-30b-a3b": (32, 4, 128),
    "gqa8": (64, 8, 128),  # GQA 8 at head_dim 128 (the prefix matrix, --matrix)
}
HQ, HKV, D = SHAPES["llama-3.1-8b"]
SCALE = D**-0.5
KV_DTYPES = {"bf16": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # --kv-dtype
KV_DT = None  # the KV cache's dtype when it is not DT (an FP8 cache: --kv-dtype, sweeps only)


def set_kv_dtype(name: str) -> None:
    """Store every case's K/V as SGLang stores an FP8 cache (``--kv-cache-dtype``: divided by
    the layer's scale, then cast), the kernels given the scales."""
    global KV_DT
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {name}: one of {', '.join(KV_DTYPES)}")
    KV_DT = KV_DTYPES[name]


def set_shape(name: str) -> None:
    """Run every case at another model's head shape (module-level, as the cases read it)."""
    global HQ, HKV, D, SCALE
    HQ, HKV, D = SHAPES[name]
    SCALE = D**-0.5


def base_config():
    """The config GraniKV picks for the shape being run (kernel_config.tile_config)."""
    return tile_config(HQ // HKV, D, tma=device_has_tma(DEV))


def ws_max_bs(n_req: int, max_bs: int) -> int:
    """Workspace capacity for a case (``max_bs``: --max-bs, 0 = the case's request count).
    Serving sizes its graph workspace for the largest CUDA-graph batch (--cuda-graph-max-bs,
    256 in the benchmarks), and the kernels' grids follow it."""
    return max(n_req, 8, max_bs)


def ceilings():
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms, _ = bench(lambda: y.copy_(x), graph=False, warmup=10, rep=50)
    bw = 2 * x.numel() / ms / 1e9  # TB/s, read + write
    a = torch.randn(8192, 8192, dtype=DT, device=DEV)
    b = torch.randn(8192, 8192, dtype=DT, device=DEV)
    ms, _ = bench(lambda: a @ b, graph=False, warmup=10, rep=50)
    tf = 2 * 8192**3 / ms / 1e9
    del x, y, a, b
    torch.cuda.empty_cache()
    return bw, tf


class Case:
    """KV pool + per-path inputs for one point: groups = [(prefix_len, n_requests)], plus ungrouped."""

    def __init__(self, groups, suffix, n_ungrouped=0, ungrouped_len=0, seed=0):
        torch.manual_seed(seed)
        self.groups, self.suffix = groups, suffix
        n_req = sum(n for _, n in groups) + n_ungrouped
        n_pre = sum(lp for lp, _ in groups)
        n_cold = sum(n for _, n in groups) * suffix + n_ungrouped * ungrouped_len
        n_tok = 1 + n_pre + n_cold
        self.k = torch.randn(n_tok, HKV, D, device=DEV, dtype=DT)
        self.v = torch.randn(n_tok, HKV, D, device=DEV, dtype=DT)
        self.k_scale = self.v_scale = 1.0
        if KV_DT is not None:  # as SGLang's set_kv_buffer writes an FP8 cache: x / scale, cast
            half_max = 0.5 * torch.finfo(KV_DT).max
            self.k_scale = float(self.k.float().abs().max()) / half_max
            self.v_scale = float(self.v.float().abs().max()) / half_max
            self.k = (self.k.float() / self.k_scale).to(KV_DT)
            self.v = (self.v.float() / self.v_scale).to(KV_DT)
        self.q = torch.randn(n_req, HQ, D, device=DEV, dtype=DT)
        cold = 1 + n_pre + torch.randperm(n_cold, device=DEV).to(torch.int32)
        starts = 1 + np.cumsum([0] + [lp for lp, _ in groups[:-1]])
        rows, prefix_len, members, c = [], [], [], 0
        for g, (lp, n) in enumerate(groups):
            pre = torch.arange(starts[g], starts[g] + lp, device=DEV, dtype=torch.int32)
            members.append(list(range(len(rows), len(rows) + n)))
            for _ in range(n):
                rows.append(torch.cat([pre, cold[c : c + suffix]]))
                prefix_len.append(lp)
                c += suffix
        for _ in range(n_ungrouped):
            rows.append(cold[c : c + ungrouped_len])
            prefix_len.append(0)
            c += ungrouped_len
        self.seq_lens = np.array([len(r) for r in rows], np.int64)
        max_ctx = int(self.seq_lens.max())
        self.r2t = torch.zeros(n_req + 1, max_ctx, dtype=torch.int32, device=DEV)
        for i, r in enumerate(rows):
            self.r2t[i + 1, : len(r)] = r
        self.rpi = torch.arange(1, n_req + 1, device=DEV)
        self.g = Grouping(
            group_start=np.asarray(starts, np.int64),
            group_len=np.array([lp for lp, _ in groups], np.int64),
            group_req_indptr=np.cumsum([0] + [n for _, n in groups]).astype(np.int64),
            group_req_idx=np.array([i for m in members for i in m], np.int64),
            prefix_len=np.array(prefix_len, np.int64),
        )
        self.full_idx = torch.cat(rows)
        self.full_indptr = torch.zeros(n_req + 1, dtype=torch.int32, device=DEV)
        self.full_indptr[1:] = torch.as_tensor(self.seq_lens, device=DEV).cumsum(0)
        self.n_req = n_req
        kv_tok = n_pre + n_cold
        self.bytes = kv_tok * HKV * D * 2 * 2 + 2 * n_req * HQ * D * 2
        self.flops = 4 * int(self.seq_lens.sum()) * HQ * D
        self.paged_bytes = int(self.seq_lens.sum()) * HKV * D * 2 * 2

    def fill(self, ws, **kw):
        return ws.fill(self.g, self.seq_lens, self.rpi, **kw)


def run_graniKV(case, row, outs, configs, max_bs):
    for name, cfg in configs.items():
        ws = CascadeWorkspace(ws_max_bs(case.n_req, max_bs), HQ, HKV, D, DEV, config=cfg)
        sfx = "" if name == "default" else f"@{name}"
        case.fill(ws)
        if name != "default":  # the variant's prefix launch alone (the kernel a variant changes)
            try:
                f = lambda: prefix_attention(case.q, case.k, case.v, ws.plan, sm_scale=SCALE)  # noqa: E731
                row[f"gkv_part_prefix{sfx}_us"] = round(bench(f)[0] * 1e3, 1)
            except Exception as e:  # noqa: BLE001
                row[f"gkv_part_prefix{sfx}_error"] = repr(e)[:300]
                traceback.print_exc()
        for path, fn in (("gkv_cascade", cascade_attention), ("gkv_fused", fused_cascade_attention)):
            out = torch.empty_like(case.q)
            f = lambda: fn(case.q, case.k, case.v, case.r2t, ws.plan, sm_scale=SCALE, out=out)  # noqa: E731
            try:
                row[path + sfx + "_ms"], _ = bench(f)
                outs[path + sfx] = out.clone()
                if name == "default":
                    row[path + "_eager_ms"], _ = bench(f, graph=False)
            except Exception as e:  # noqa: BLE001
                row[path + sfx + "_error"] = repr(e)[:300]
                traceback.print_exc()
        if name == "default":
            out = torch.empty_like(case.q)
            for part, f in (
                ("prefix", lambda: prefix_attention(case.q, case.k, case.v, ws.plan, sm_scale=SCALE)),
                ("suffix", lambda: suffix_attention(case.q, case.k, case.v, case.r2t, ws.plan, sm_scale=SCALE)),
                ("merge", lambda: merge_state(ws.plan, out)),
            ):
                row[f"gkv_part_{part}_us"] = round(bench(f)[0] * 1e3, 1)
            row["gkv_plan_us"] = host_ms(lambda: case.fill(ws)) * 1e3
            row["gkv_prefix_chunk"] = ws.work_list.prefix_chunk
            row["gkv_prefix_items"] = ws.work_list.num_prefix_items
            row["gkv_suffix_items"] = ws.work_list.num_suffix_items
            case.fill(ws, single_prefix_chunk=True)
            out = torch.empty_like(case.q)
            f = lambda: bgemm_cascade_attention(case.q, case.k, case.v, case.r2t, ws.plan, sm_scale=SCALE, out=out)  # noqa
            try:
                row["gkv_bgemm_ms"], _ = bench(f, graph=False)
                outs["gkv_bgemm"] = out.clone()
            except Exception as e:  # noqa: BLE001
                row["gkv_bgemm_error"] = repr(e)[:300]
                traceback.print_exc()


def run_baselines(case, row, outs, ws_bytes):
    B = case.n_req
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

        o = torch.empty_like(case.q)
        idx64 = case.full_idx.long()
        best = None
        for s in (8, 16, 32, 64):
            logits = torch.empty(B, HQ, s, D, device=DEV, dtype=torch.float32)
            lse = torch.empty(B, HQ, s, device=DEV, dtype=torch.float32)
            nsp = torch.full((B,), s, device=DEV, dtype=torch.int32)
            f = lambda: decode_attention_fwd(case.q, case.k, case.v, o, case.full_indptr, idx64, logits, lse, nsp,  # noqa
                                             s, SCALE, 1.0, 1.0)
            ms, _ = bench(f, graph=False)
            if best is None or ms < best[0]:
                best = (ms, s)
                outs["sgl_triton"] = (f(), o.clone())[1]
        row["sgl_triton_ms"], row["sgl_triton_splits"] = best
    except Exception as e:  # noqa: BLE001
        row["sgl_triton_error"] = repr(e)[:300]
        traceback.print_exc()
    try:
        import flashinfer
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        kv = (case.k.view(-1, 1, HKV, D), case.v.view(-1, 1, HKV, D))
        ones_b = torch.ones(B, dtype=torch.int32, device=DEV)
        w = BatchDecodeWithPagedKVCacheWrapper(ws_bytes, "NHD", use_tensor_cores=True)
        w.plan(case.full_indptr, case.full_idx, ones_b, HQ, HKV, D, 1, data_type=DT, q_data_type=DT)
        outs["fi_decode_tc"] = w.run(case.q, kv)
        row["fi_decode_tc_ms"], _ = bench(lambda: w.run(case.q, kv), graph=False)
        run_fi_cascade(case, row, outs, ws_bytes, kv)
        del flashinfer
    except Exception as e:  # noqa: BLE001
        row["flashinfer_error"] = repr(e)[:300]
        traceback.print_exc()


def run_fi_cascade(case, row, outs, ws_bytes, kv):
    """FlashInfer's two-level cascade over the case's groups (level 0: each group's prefix,
    level 1: each request's suffix) with its fa2 and its default (fa3 on sm90) prefill kernels."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper, MultiLevelCascadeAttentionWrapper

    B = case.n_req
    if not (case.g.group_req_idx.size == B and all(lp > 0 for lp, _ in case.groups)):
        return
    ones_b = torch.ones(B, dtype=torch.int32, device=DEV)
    i32 = lambda x: torch.as_tensor(np.asarray(x), dtype=torch.int32, device=DEV)  # noqa: E731
    G = len(case.groups)
    qo0 = i32(case.g.group_req_indptr)
    kv0_ptr = i32(np.cumsum([0] + [lp for lp, _ in case.groups]))
    kv0_idx = torch.cat([torch.arange(s, s + lp, dtype=torch.int32, device=DEV)
                         for s, (lp, _) in zip(case.g.group_start, case.groups)])
    qo1 = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    sfx = torch.as_tensor(case.seq_lens - case.g.prefix_len)
    kv1_ptr = i32(np.concatenate([[0], np.cumsum(sfx.numpy())]))
    kv1_idx = torch.cat([case.r2t[i + 1, case.g.prefix_len[i] : case.seq_lens[i]] for i in range(B)])
    for be, name in (("fa2", "fi_cascade_fa2"), ("auto", "fi_cascade_fa3")):
        try:
            c = MultiLevelCascadeAttentionWrapper(2, ws_bytes, "NHD")
            if be != "auto":
                c._batch_prefill_wrappers = [BatchPrefillWithPagedKVCacheWrapper(ws_bytes, "NHD", backend=be)
                                             for _ in range(2)]
            pl = lambda: c.plan([qo0, qo1], [kv0_ptr, kv1_ptr], [kv0_idx, kv1_idx],  # noqa: E731
                                [torch.ones(G, dtype=torch.int32, device=DEV), ones_b], HQ, HKV, D, 1,
                                causal=False, q_data_type=DT, kv_data_type=DT)
            row[name + "_plan_ms"] = host_ms(pl, n=5)
            pl()
            outs[name] = c.run(case.q, kv)
            row[name + "_ms"], _ = bench(lambda: c.run(case.q, kv), graph=False)
        except Exception as e:  # noqa: BLE001
            row[name + "_error"] = repr(e)[:300]
            traceback.print_exc()


def run_case(groups, suffix, configs, bw, tf, ws_bytes, max_bs, n_ungrouped=0, ungrouped_len=0):
    case = Case(groups, suffix, n_ungrouped, ungrouped_len)
    row = dict(groups=groups, suffix=suffix, n_ungrouped=n_ungrouped, requests=case.n_req,
               unique_MB=round(case.bytes / 1e6, 1), paged_MB=round(case.paged_bytes / 1e6, 1),
               GFLOP=round(case.flops / 1e9, 2))
    row["floor_ms"] = max(case.bytes / bw / 1e9, case.flops / tf / 1e9)
    outs = {}
    run_baselines(case, row, outs, ws_bytes)
    run_graniKV(case, row, outs, configs, max_bs)
    ref = outs.get("fi_decode_tc", outs.get("sgl_triton"))
    if ref is not None:
        for k, v in outs.items():
            row["maxdiff_" + k] = round((v.float() - ref.float()).abs().max().item(), 4)
    for k in list(row):
        if k.endswith("_ms") and not k.endswith("plan_ms") and k != "floor_ms":
            ms = row[k]
            row[k[:-3] + "_TBps"] = round(case.bytes / ms / 1e9, 2)
            row[k[:-3] + "_TFLOPs"] = round(case.flops / ms / 1e9, 1)
    del case
    torch.cuda.empty_cache()
    return row


MAIN = ["sgl_triton", "fi_decode_tc", "fi_cascade_fa2", "fi_cascade_fa3", "gkv_cascade", "gkv_fused", "gkv_bgemm"]


def print_table(rows, bw, tf):
    print(f"\n{torch.cuda.get_device_name()}  bf16 {HQ}q/{HKV}kv/{D}  copy {bw:.2f} TB/s  matmul {tf:.0f} TFLOP/s")
    hdr = f"{'groups':<34}{'sfx':>5}{'req':>5}{'floor':>8}" + "".join(f"{m:>15}" for m in MAIN) + f"{'best gkv':>16}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        cells = []
        for m in MAIN:
            v = r.get(m + "_ms")
            cells.append(f"{v:8.4f} {r.get(m + '_TBps', 0):4.1f}T" if v else f"{'-':>15}")
        gk = {k: v for k, v in r.items() if k.startswith("gkv_") and k.endswith("_ms")}
        best = min(gk, key=gk.get) if gk else None
        tail = f"{gk[best]:8.4f} {best[4:-3][:7]}" if best else "-"
        print(f"{str(r['groups']):<34}{r['suffix']:>5}{r['requests']:>5}{r['floor_ms']:8.4f}" + "".join(
            f"{c:>15}" for c in cells) + f"{tail:>16}")
    print("(cells: ms and effective TB/s of unique bytes; floor = max(bytes/copy BW, FLOPs/matmul rate))")


SWEEP = {  # measured on the H200 (docs/results/kernels.md; sweeps 1-4 tried tile sizes,
    # stages 2/4, block_m 128/256, suffix blocks/waves, prefix waves 1/3; sweep 5 TMA prefix loads
    # (10-18x slower, removed) and the overlapped suffix launch; sweep 7 grid-stride launches at
    # serving capacity (slower at 16K, removed): see docs/results/kernels.md)
    "default": {},  # overlap_suffix, prefix_waves 1.5 (sweep 5)
    "serial": dict(overlap_suffix=False, prefix_waves=2.0),  # the defaults before sweep 5
    "pw1.0": dict(prefix_waves=1.0),
    "pw1.25": dict(prefix_waves=1.25),
    "pw1.75": dict(prefix_waves=1.75),
    "pw1.5_swv3": dict(suffix_waves=3.0),
    "pw1.5_swv6": dict(suffix_waves=6.0),
    "pw1.5_sb64": dict(suffix_block_n=64),
    # sweep 8: a one-pass merge (online max, two partial rows per iteration) and
    # 2 merge warps changed nothing (removed); prefix 8 warps 1.6-2x slower; even_split won
    # (prefix alone 5-6% faster at 16K, cascade equal or 2% faster): now the default
    "pw2.0": dict(prefix_waves=2.0),
    "masked": dict(even_split=False),  # the default before sweep 8
    # not measured yet: the prefix kernel over tensor descriptors (TMA loads, tl.range pipelining),
    # without / with warp specialisation, and with 2 / 4 stages; the many-group item target
    "descriptor": dict(prefix_kernel="descriptor"),
    "descriptor_ws": dict(prefix_kernel="descriptor", prefix_warp_specialize=True),
    "descriptor_s2": dict(prefix_kernel="descriptor", prefix_stages=2),
    "descriptor_s4": dict(prefix_kernel="descriptor", prefix_stages=4),
    "forest2": dict(forest_items_per_tile=2.0),
    # per-shape tiles (--shape): row tiles of 128 / 32, kv tiles of 32 / 128
    "bm128_w8": dict(block_m=128, prefix_warps=8),
    "bm32": dict(block_m=32),
    "bn32": dict(block_n=32),
    "bn128": dict(block_n=128),
    # Hopper-shaped prefix tiles (two warpgroups of 64 rows per program), stages and kv tile
    "bm128_w8_s2": dict(block_m=128, prefix_warps=8, prefix_stages=2),
    "bm128_w8_s4": dict(block_m=128, prefix_warps=8, prefix_stages=4),
    "bm128_w8_bn128_s2": dict(block_m=128, prefix_warps=8, block_n=128, prefix_stages=2),
    "bm128_w8_pw1.0": dict(block_m=128, prefix_warps=8, prefix_waves=1.0),
    "bm128_w8_pw2.0": dict(block_m=128, prefix_warps=8, prefix_waves=2.0),
    "s2": dict(prefix_stages=2),
    "s4": dict(prefix_stages=4),
    "pw3.0": dict(prefix_waves=3.0),
    "pw4.0": dict(prefix_waves=4.0),
    # the descriptor (TMA) prefix kernel with wave targets and kv tiles; kv tiles of 128 with waves
    "desc_pw1.75": dict(prefix_kernel="descriptor", prefix_waves=1.75),
    "desc_pw2.0": dict(prefix_kernel="descriptor", prefix_waves=2.0),
    "desc_pw3.0": dict(prefix_kernel="descriptor", prefix_waves=3.0),
    "desc_bn128": dict(prefix_kernel="descriptor", block_n=128),
    "desc_bn128_pw2.0": dict(prefix_kernel="descriptor", block_n=128, prefix_waves=2.0),
    "desc_bn128_pw3.0": dict(prefix_kernel="descriptor", block_n=128, prefix_waves=3.0),
    "bn128_pw2.0": dict(block_n=128, prefix_waves=2.0),
    "bn128_pw3.0": dict(block_n=128, prefix_waves=3.0),
    # FP8 caches (--kv-dtype): FP8 tiles widened to bf16 (the query's dtype), the default before
    # fp16 math; and fp16 math with two warpgroups per program
    "fp8q": dict(fp8_math="query"),
    "fp8q_bm128_w8_pw1.0": dict(fp8_math="query", block_m=128, prefix_warps=8, prefix_waves=1.0),
    # the merge per (request, q-head) over tiles of 8 / 16 / 32 partial rows (running max). H200,
    # cascade graph at max_bs 256, merge32 against the default (kernels.md, "Merge tiles"): 4K x 8
    # 29.3 -> 25.6 us, the agent-loop batch 60.2 -> 54.1; 16K x 64 71.4 -> 76.1, the 4-group mix
    # 76.3 -> 77.2, the forest 114.2 -> 125.0, the 8-prefix mix 129.7 -> 140.1. One program per
    # (request, kv head) over its q-heads in turn was slower than that on every case (removed)
    "merge8": dict(merge_block_p=8),
    "merge16": dict(merge_block_p=16),
    "merge32": dict(merge_block_p=32),
    # the merge grid sized by the batch (out's rows) instead of the workspace's 256 slots. H100 at
    # df30722: no change alone; merge32_rows_batch 8% faster on the agent-loop batch, 6-9% slower
    # at 64-130 requests
    "merge_rows_batch": dict(merge_rows="batch"),
    # 80b0461 (H100): the merge inside the prefix and suffix launches (the last program to write
    # a row's partial rows merges it; no merge launch) slower on 4 of 6 cases (forest +12.4 us,
    # 16K x 64 +6.2), equal on 2: not kept
    "merge_in_kernels": dict(merge_in_kernels=True),
    "merge32_rows_batch": dict(merge_block_p=32, merge_rows="batch"),
    "sfx_s3": dict(suffix_stages=3),
    # the SM split between the prefix and suffix launches: the suffix's stream at the highest
    # priority and / or its launch issued first, with more prefix waves (KernelConfig.suffix_priority,
    # suffix_first; every one slower than the default on an H100, docs/results/kernels.md)
    "sfx_first": dict(suffix_first=True),
    "sfx_prio": dict(suffix_priority=True),
    "sfx_prio_first": dict(suffix_priority=True, suffix_first=True),
    "sfx_prio_pw1.75": dict(suffix_priority=True, prefix_waves=1.75),
    "sfx_prio_pw2.0": dict(suffix_priority=True, prefix_waves=2.0),
    "sfx_prio_first_pw1.75": dict(suffix_priority=True, suffix_first=True, prefix_waves=1.75),
    # bandwidth-bound shapes: shorter prefix / suffix chunks (more programs per launch)
    "chunk128": dict(min_prefix_chunk=128),
    "sfx32": dict(min_suffix_chunk=32),
    # the suffix launch's occupancy and tile (it reads at about half of the HBM bandwidth
    # alone): 8 warps, kv tiles of 64 slots, 2 waves of larger items, 16-slot tiles with 3
    # stages; measured at dcc1346 (H200, kernels.md "Lean suffix tiles..."): the last makes the
    # suffix alone 7-9% faster and the layer -0.5..+2.1 us; the others slower; none kept
    "sfx_w8": dict(suffix_warps=8),
    "sfx_bn64": dict(suffix_block_n=64, suffix_max_keys=512),
    "sfx_bn16_s3": dict(suffix_block_n=16, suffix_stages=3),
    "swv2": dict(suffix_waves=2.0),
    # the prefix kernels' online softmax (KernelConfig.prefix_softmax): one fused multiply-add per
    # score; and a lazy running max that skips the accumulator's rescale on most tiles. H100
    # (kernels.md, "The prefix kernels' online softmax"): sm_fma equal, sm_lazy 3-24% slower
    # the prefix kernel closest to FA3's shape Triton can express: descriptor loads, warp
    # specialisation (producer warps loading, consumer warpgroups computing) and two consumer
    # warpgroups of 64 rows per program. H100 at df30722 (kernels.md, "The wgmma prefix kernel in
    # Gluon"): descriptor_ws equal to the default, desc_ws_bm128_w8 17-39% slower
    "desc_ws_bm128_w8": dict(prefix_kernel="descriptor", prefix_warp_specialize=True, block_m=128, prefix_warps=8),
    "desc_ws_bm128_w8_pw1.0": dict(prefix_kernel="descriptor", prefix_warp_specialize=True, block_m=128,
                                   prefix_warps=8, prefix_waves=1.0),
    # three prefix programs per SM instead of two: registers capped at 168 (spills allowed) and
    # shared memory cut by kv tiles of 32 or 2 stages; wave targets for the extra program. H100 at
    # df30722: 23-60% slower at 16K, 1-5% faster on the agent-loop batch
    "nreg168_bn32": dict(prefix_maxnreg=168, block_n=32),
    "nreg168_s2": dict(prefix_maxnreg=168, prefix_stages=2),
    "nreg168_bn32_pw2.25": dict(prefix_maxnreg=168, block_n=32, prefix_waves=2.25),
    "nreg128_bn32": dict(prefix_maxnreg=128, block_n=32),
    "sm_fma": dict(prefix_softmax="fma"),
    "sm_lazy": dict(prefix_softmax="lazy"),
    "sm_lazy_pw2.0": dict(prefix_softmax="lazy", prefix_waves=2.0),
    "sm_lazy_bm128_w8": dict(prefix_softmax="lazy", block_m=128, prefix_warps=8),
    # the Gluon sm90 prefix kernel (prefix_wgmma.py): TMA stages, asynchronous wgmma, the next
    # tile's scores overlapped with the last tile's P @ V ("_noovl": every MMA waited for at
    # once); stages, kv tiles, two warpgroups of 64 rows, wave targets
    "wgmma": dict(prefix_kernel="wgmma"),
    "wgmma_noovl": dict(prefix_kernel="wgmma", prefix_mma_overlap=False),
    "wgmma_s2": dict(prefix_kernel="wgmma", prefix_stages=2),
    "wgmma_s4": dict(prefix_kernel="wgmma", prefix_stages=4),
    "wgmma_bn128_s2": dict(prefix_kernel="wgmma", block_n=128, prefix_stages=2),
    "wgmma_bm128": dict(prefix_kernel="wgmma", block_m=128, prefix_stages=2),
    "wgmma_pw2.0": dict(prefix_kernel="wgmma", prefix_waves=2.0),
    "wgmma_pw1.0": dict(prefix_kernel="wgmma", prefix_waves=1.0),
    # measured at df30722 (H100, kernels.md "The wgmma prefix kernel in Gluon"): wgmma the fastest
    # prefix launch (4-10%), cascade 0-3%; the others slower. The warp-specialized wgmma kernel (a
    # producer warp, two consumer warpgroups sharing one K/V ring, one program per SM), 73c52b5:
    # prefix 60% slower at 16K x 64 (wgmma_ws, _s4, _pw2.0; _pw1.5 and _s2 not run)
    # not measured yet: kv tiles of 32 (64 KB of shared memory and 148 registers per program,
    # no spills: three programs per SM instead of two) at wave targets for the third program
    "wgmma_bn32": dict(prefix_kernel="wgmma", block_n=32),
    "wgmma_bn32_pw2.0": dict(prefix_kernel="wgmma", block_n=32, prefix_waves=2.0),
    "wgmma_bn32_pw3.0": dict(prefix_kernel="wgmma", block_n=32, prefix_waves=3.0),
    # not measured yet: the query tile in registers (no Q reads from shared memory; 16 KB less
    # shared memory per program; 246 registers per thread at 64-key tiles (two programs per SM),
    # 168 at 32-key tiles (three per SM, with 4 stages in 64 KB))
    "wgmma_qreg": dict(prefix_kernel="wgmma", prefix_q_registers=True),
    "wgmma_qreg_s2": dict(prefix_kernel="wgmma", prefix_q_registers=True, prefix_stages=2),
    "wgmma_qreg_bn32": dict(prefix_kernel="wgmma", prefix_q_registers=True, block_n=32),
    "wgmma_qreg_bn32_s4": dict(prefix_kernel="wgmma", prefix_q_registers=True, block_n=32, prefix_stages=4),
    "wgmma_qreg_bn32_s4_pw3.0": dict(prefix_kernel="wgmma", prefix_q_registers=True, block_n=32, prefix_stages=4,
                                     prefix_waves=3.0),
    # a suffix program small enough to run beside two wgmma prefix programs on one SM (kv
    # tiles of 16 x 2 heads, one stage: 89 registers and 13 KB of shared memory per program on
    # sm90, against 255 and 40 KB for the default suffix tile); measured at dcc1346 (H100,
    # kernels.md "Lean suffix tiles..."): the layer 3-16 us slower on every case, not kept
    "lean_sfx": dict(suffix_block_n=16, suffix_max_keys=32, suffix_stages=1),
    "pw1.75_lean_sfx": dict(prefix_waves=1.75, suffix_block_n=16, suffix_max_keys=32, suffix_stages=1),
    "pw2.0_lean_sfx": dict(prefix_waves=2.0, suffix_block_n=16, suffix_max_keys=32, suffix_stages=1),
    "pw2.0_lean_sfx_swv8": dict(prefix_waves=2.0, suffix_block_n=16, suffix_max_keys=32, suffix_stages=1,
                                suffix_waves=8.0),
    "wgmma_ws": dict(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, prefix_waves=1.0),
    "wgmma_ws_pw1.5": dict(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, prefix_waves=1.5),
    "wgmma_ws_pw2.0": dict(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, prefix_waves=2.0),
    "wgmma_ws_s4": dict(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, prefix_waves=1.0,
                        prefix_stages=4),
    "wgmma_ws_s2": dict(prefix_kernel="wgmma", prefix_warp_specialize=True, block_m=128, prefix_waves=1.0,
                        prefix_stages=2),

}
FOREST_16 = [(1536 + 283 * g, 4 + (g * 5) % 9) for g in range(16)]  # 16 prefixes 1.5-5.8K, 4-12 agents
FOREST_64 = [(512 + 57 * g, 2 + g % 3) for g in range(64)]  # 64 prefixes 0.5-4K, 2-4 agents
SWEEP_CASES = [([(16384, 64)], 256), ([(16384, 128)], 256), ([(16384, 8), (8192, 16), (4096, 24), (2048, 16)], 256),
               ([(4096, 8)], 256),
               # the heterogeneous e2e row at 128 agents (workloads.py: 8 prefixes 2K-16K)
               ([(2048, 30), (4096, 23), (6144, 20), (8192, 16), (10240, 13), (12288, 12), (14336, 9), (16384, 5)],
                256),
               (FOREST_16, 256), (FOREST_64, 256),
               # an agent loop's decode batch (24 agents on a 10K prefix, histories of ~600 tokens)
               ([(10240, 24)], 640)]


def prefix_flops(groups) -> float:
    """Useful FLOPs of the prefix part: QK^T and PV over every group's prefix, per layer."""
    return float(sum(4 * HQ * n * lp * D for lp, n in groups))


def tera_per_s(amount: float, us: float, digits: int) -> float:
    """``amount`` (FLOPs or bytes) done in ``us`` microseconds, in units of 1e12 per second."""
    return round(amount / (us * 1e-6) / 1e12, digits)


def prefix_kv_bytes(groups) -> float:
    """Unique K/V bytes of the prefix part: every group's extent read once, per layer (what a
    bandwidth-bound prefix launch, 128 query rows per kv head or fewer, is measured against)."""
    item = (KV_DT or DT).itemsize
    return float(sum(2 * lp * HKV * D * item for lp, _ in groups))


def sweep_selection(variants: str, cases: str):
    """(names, cases) of a sweep: every SWEEP variant, or "default" plus ``variants``; every
    SWEEP_CASES entry, or those at the comma-separated indices ``cases``."""
    names = list(SWEEP) if not variants else ["default"] + [n for n in variants.split(",") if n and n != "default"]
    picked = SWEEP_CASES if not cases else [SWEEP_CASES[int(i)] for i in cases.split(",") if i.strip()]
    return names, picked


def sweep(args):
    """SWEEP variants of the default config at SWEEP_CASES: cascade graph time + parts (us)."""
    base = base_config()
    rows = []
    names, cases = sweep_selection(args.variants, args.sweep_cases)
    kv_name = str(KV_DT or DT).replace("torch.", "")  # what every case stores its K/V as
    for groups, sfx in cases:
        case = Case(groups, sfx)
        ref = None
        for name in names:
            kw = SWEEP[name]
            row = dict(groups=groups, suffix=sfx, config=name, kv_dtype=kv_name)
            try:
                cfg = dataclasses.replace(base, **kw)
                ws = CascadeWorkspace(ws_max_bs(case.n_req, args.max_bs), HQ, HKV, D, DEV, config=cfg)
                case.fill(ws)
                out = torch.empty_like(case.q)
                ks, vs = case.k_scale, case.v_scale
                row["cascade_us"] = round(bench(lambda: cascade_attention(case.q, case.k, case.v, case.r2t, ws.plan,
                                                                          sm_scale=SCALE, out=out, k_scale=ks,
                                                                          v_scale=vs))[0] * 1e3, 1)
                ref = out.clone() if ref is None else ref
                row["maxdiff"] = round((out.float() - ref.float()).abs().max().item(), 4)
                for part, f in (
                    ("prefix", lambda: prefix_attention(case.q, case.k, case.v, ws.plan, sm_scale=SCALE, k_scale=ks)),
                    ("suffix", lambda: suffix_attention(case.q, case.k, case.v, case.r2t, ws.plan, sm_scale=SCALE,
                                                        k_scale=ks)),
                    ("merge", lambda: merge_state(ws.plan, out, v_scale=vs)),
                ):
                    row[part + "_us"] = round(bench(f)[0] * 1e3, 1)
                row["prefix_tflops"] = tera_per_s(prefix_flops(groups), row["prefix_us"], 1)
                row["prefix_tbs"] = tera_per_s(prefix_kv_bytes(groups), row["prefix_us"], 2)
                row["prefix_rows_per_kv_head"] = max(n for _, n in groups) * (HQ // HKV)
                wl = ws.work_list
                row.update(prefix_chunk=wl.prefix_chunk, prefix_items=wl.num_prefix_items,
                           suffix_chunk=wl.suffix_chunk, suffix_items=wl.num_suffix_items)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
                traceback.print_exc()
            rows.append(row)
            print("SWEEP", json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "kernels_sweep.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, max_bs=args.max_bs,
                       shape=dict(hq=HQ, hkv=HKV, d=D), kv_dtype=kv_name,
                       base=dataclasses.asdict(base),
                       variants=SWEEP, rows=rows), f, indent=1)
    for r in rows:
        print(f"{str(r['groups'])[:40]:<42}{r['suffix']:>5} {r['config']:<12}"
              + " ".join(f"{k[:-3]}={r.get(k, '-')}" for k in ("cascade_us", "prefix_us", "suffix_us", "merge_us"))
              + f" prefix_TFLOP/s={r.get('prefix_tflops', '-')} prefix_TB/s={r.get('prefix_tbs', '-')}"
              + f" diff={r.get('maxdiff', r.get('error', '-'))}")


# --matrix: the prefix part at every (head shape, prefix length, sharers) point, beside
# FlashInfer's cascade (fa2 / fa3 prefill kernels) and FlashInfer's fa3 prefill over the same
# prefix with the sharers' queries packed as one sequence's query tokens
MATRIX_SHAPES = ("mha", "gqa3", "llama-3.1-8b", "qwen2.5-7b", "gqa8",
                 "mha-d64", "gqa3-d64", "llama-3.1-8b-d64", "qwen2.5-7b-d64", "gpt-oss-20b")  # GQA 1/3/4/7/8 x D 128/64
MATRIX_PREFIXES = (4096, 8192, 16384, 32768)
MATRIX_SHARERS = (16, 32, 64, 128, 256)
MATRIX_SUFFIX = 64  # tokens of each sharer's private suffix
BANDWIDTH_BOUND_ROWS = 128  # query rows per kv head at or below which a prefix launch is reported in TB/s


def matrix_points(shapes=MATRIX_SHAPES, prefixes=MATRIX_PREFIXES, sharers=MATRIX_SHARERS):
    """(shape name, prefix length, sharers) of every --matrix point, shape by shape (one shape's
    kernels compile once)."""
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"--matrix shape {name}: not in SHAPES ({', '.join(SHAPES)})")
        for lp in prefixes:
            for n in sharers:
                yield name, lp, n


def prefix_rate(rows_per_kv_head: int, flops: float, kv_bytes: float, us: float):
    """How a prefix launch of ``us`` is reported: ("TB/s", its unique K/V bytes per second) where
    it is bandwidth-bound (``BANDWIDTH_BOUND_ROWS`` query rows per kv head or fewer), else
    ("TFLOP/s", its useful FLOPs per second)."""
    if rows_per_kv_head <= BANDWIDTH_BOUND_ROWS:
        return "TB/s", tera_per_s(kv_bytes, us, 2)
    return "TFLOP/s", tera_per_s(flops, us, 1)


def run_fa3_packed_prefill(case, row, outs):
    """FlashInfer's fa3 prefill over the (one) group's prefix extent, the sharers' queries packed
    as the query tokens of one non-causal sequence: a library call for the prefix part alone."""
    import flashinfer

    (lp, n), start = case.groups[0], int(case.g.group_start[0])
    k, v = case.k[start : start + lp], case.v[start : start + lp]
    q = case.q[:n].contiguous()
    for be in ("fa3", "auto"):  # fa3 where FlashInfer has it (sm90), else its default kernel
        try:
            f = lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=False, sm_scale=SCALE,  # noqa: E731
                                                                backend=be, return_lse=True)
            outs["fi_prefill_packed"] = f()[0]
            row["fi_prefill_packed_us"] = round(bench(f, graph=False)[0] * 1e3, 1)
            row["fi_prefill_packed_backend"] = be
            return
        except Exception as e:  # noqa: BLE001
            row["fi_prefill_packed_error"] = repr(e)[:300]


def run_flashinfer_columns(case, row, outs, ws_bytes, rows: int, flops: float, kv_bytes: float) -> None:
    """A matrix point's FlashInfer columns: its cascade (fa2, fa3) and its packed fa3 prefill."""
    kv = (case.k.view(-1, 1, HKV, D), case.v.view(-1, 1, HKV, D))
    run_fi_cascade(case, row, outs, ws_bytes, kv)
    for k in ("fi_cascade_fa2", "fi_cascade_fa3"):
        if k + "_ms" in row:
            row[k + "_us"] = round(row.pop(k + "_ms") * 1e3, 1)
    run_fa3_packed_prefill(case, row, outs)
    if "fi_prefill_packed_us" in row:
        row["fi_prefill_packed_rate"] = prefix_rate(rows, flops, kv_bytes, row["fi_prefill_packed_us"])[1]


def matrix_point(name: str, lp: int, n: int, suffix: int, ws_bytes, max_bs: int, variants=(),
                 baselines: bool = True) -> dict:
    """One --matrix point: GraniKV's prefix launch alone and its cascade layer (CUDA-graph
    replays, the config GraniKV picks for the shape), FlashInfer's cascade and packed prefill;
    ``variants`` (SWEEP names): the cascade layer again with each (``variant_cascade_us``, what
    launch_table_fit.py fits the prefix wave table from); without ``baselines`` no FlashInfer
    column runs."""
    set_shape(name)
    case = Case([(lp, n)], suffix)
    cfg = base_config()
    rows = n * (HQ // HKV)
    flops, kv_bytes = prefix_flops([(lp, n)]), prefix_kv_bytes([(lp, n)])
    row = dict(shape=name, hq=HQ, hkv=HKV, d=D, prefix=lp, sharers=n, suffix=suffix,
               rows_per_kv_head=rows, prefix_kernel=cfg.prefix_kernel)
    outs = {}
    try:
        ws = CascadeWorkspace(ws_max_bs(n, max_bs), HQ, HKV, D, DEV, config=cfg)
        case.fill(ws)
        out = torch.empty_like(case.q)
        row["gkv_prefix_us"] = round(bench(lambda: prefix_attention(case.q, case.k, case.v, ws.plan,
                                                                    sm_scale=SCALE))[0] * 1e3, 1)
        row["gkv_cascade_us"] = round(bench(lambda: cascade_attention(case.q, case.k, case.v, case.r2t, ws.plan,
                                                                      sm_scale=SCALE, out=out))[0] * 1e3, 1)
        outs["gkv_cascade"] = out.clone()
        row["gkv_prefix_items"] = ws.work_list.num_prefix_items
        unit, rate = prefix_rate(rows, flops, kv_bytes, row["gkv_prefix_us"])
        row["prefix_unit"], row["gkv_prefix_rate"] = unit, rate
        # the yardstick: one launch that only reads the extent's K / V bytes (read_bound.py)
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count if DEV == "cuda" else 4
        row["read_bound_us"], row["read_bound_widths"] = best_read_us(case.k, case.v, int(case.g.group_start[0]),
                                                                      lp, sms, bench)
        row["read_bound_TBps"] = tera_per_s(kv_bytes, row["read_bound_us"], 2)
        row["prefix_waves"] = cfg.prefix_waves
        if variants:
            row["variant_cascade_us"], row["variant_prefix_waves"] = {}, {}
        for v in variants:
            vcfg = dataclasses.replace(cfg, **SWEEP[v])
            vws = CascadeWorkspace(ws_max_bs(n, max_bs), HQ, HKV, D, DEV, config=vcfg)
            case.fill(vws)
            vout = torch.empty_like(case.q)
            row["variant_cascade_us"][v] = round(bench(lambda: cascade_attention(  # noqa: B023 - called here
                case.q, case.k, case.v, case.r2t, vws.plan, sm_scale=SCALE, out=vout))[0] * 1e3, 1)
            row["variant_prefix_waves"][v] = vcfg.prefix_waves
            del vws
    except Exception as e:  # noqa: BLE001
        row["gkv_error"] = repr(e)[:300]
        traceback.print_exc()
    try:
        if baselines:
            run_flashinfer_columns(case, row, outs, ws_bytes, rows, flops, kv_bytes)
        else:
            row["flashinfer_skipped"] = True
    except Exception as e:  # noqa: BLE001
        row["flashinfer_error"] = repr(e)[:300]
        traceback.print_exc()
    ref = outs.get("fi_cascade_fa2")
    if ref is not None and "gkv_cascade" in outs:
        row["maxdiff_gkv_cascade"] = round((outs["gkv_cascade"].float() - ref.float()).abs().max().item(), 4)
    del case
    torch.cuda.empty_cache()
    return row


def matrix(args) -> None:
    """--matrix: every ``matrix_points`` point (``--matrix-shapes`` narrows the shapes), one
    JSON row each, written after every point (kernels_matrix.json), and a table at the end."""
    shapes = tuple(filter(None, args.matrix_shapes.split(","))) or MATRIX_SHAPES
    variants = tuple(filter(None, args.matrix_variants.split(",")))
    unknown = [v for v in variants if v not in SWEEP]
    if unknown:
        raise SystemExit(f"--matrix-variants: {', '.join(unknown)} not in SWEEP")
    ws_bytes = torch.empty(512 << 20, dtype=torch.uint8, device=DEV)
    rows = []
    path = os.path.join(args.out, "kernels_matrix.json")
    suffixes = [int(x) for x in str(args.matrix_suffixes or MATRIX_SUFFIX).split(",") if x]
    for name, lp, n in matrix_points(shapes):
        for sfx in suffixes:
            t = time.time()
            row = matrix_point(name, lp, n, sfx, ws_bytes, args.max_bs, variants, not args.matrix_skip_baselines)
            row["point_s"] = round(time.time() - t, 1)
            rows.append(row)
            print("MATRIX", json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, max_bs=args.max_bs,
                           suffix=suffixes[0] if len(suffixes) == 1 else suffixes, rows=rows), f, indent=1)
    for r in rows:
        print(f"{r['shape']:<18}{r['prefix']:>6} x{r['sharers']:<4} sfx={r['suffix']:<5} M={r['rows_per_kv_head']:<5} "
              f"prefix={r.get('gkv_prefix_us', '-')}us ({r.get('gkv_prefix_rate', '-')} {r.get('prefix_unit', '')}) "
              f"read={r.get('read_bound_us', '-')}us ({r.get('read_bound_TBps', '-')} TB/s) "
              f"cascade={r.get('gkv_cascade_us', '-')} fa2={r.get('fi_cascade_fa2_us', '-')} "
              f"fa3={r.get('fi_cascade_fa3_us', '-')} packed={r.get('fi_prefill_packed_us', '-')}")
    try:
        print("plot:", plot_matrix(path, args.out))
    except Exception as e:  # noqa: BLE001 - no matplotlib (or a broken one): no plot
        print("no plot:", repr(e)[:200])


def plot_matrix(json_path: str, out_dir: str) -> str:
    """kernels_matrix.png from a --matrix JSON: the prefix launch's rate per point, TFLOP/s
    against query rows per kv head (left) and effective K/V TB/s of the bandwidth-bound points
    against the prefix length (right), one colour per head shape; returns the PNG's path."""
    import sys

    sys.modules.pop("IPython", None)  # the offline host's IPython stub confuses matplotlib
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if "gkv_prefix_rate" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    colors = plt.get_cmap("tab10")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for i, name in enumerate(shapes):
        mine = [r for r in rows if r["shape"] == name]
        style = dict(color=colors(i % 10), label=name, marker="o" if mine[0]["d"] == 128 else "^", ls="")
        flop = [r for r in mine if r["prefix_unit"] == "TFLOP/s"]
        left.plot([r["rows_per_kv_head"] for r in flop], [r["gkv_prefix_rate"] for r in flop], **style)
        band = [r for r in mine if r["prefix_unit"] == "TB/s"]
        right.plot([r["prefix"] for r in band], [r["gkv_prefix_rate"] for r in band], **style)
    left.axhline(450, color="k", ls="--", lw=0.8)
    left.set(xscale="log", xlabel="query rows per kv head (sharers x GQA ratio)", ylabel="prefix launch TFLOP/s",
             title=f"compute-bound points (> {BANDWIDTH_BOUND_ROWS} rows)")
    right.axhline(4.0, color="k", ls="--", lw=0.8)
    right.set(xscale="log", xlabel="prefix tokens", ylabel="prefix launch K/V TB/s (each byte once)",
              title=f"bandwidth-bound points (<= {BANDWIDTH_BOUND_ROWS} rows)")
    right.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{data.get('gpu', '?')}: GraniKV's prefix launch alone, bf16 (dashed: the targets)")
    fig.tight_layout()
    path = os.path.join(out_dir, "kernels_matrix.png")
    fig.savefig(path, dpi=100)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="key points only (tuning variants: --sweep)")
    ap.add_argument("--sweep", action="store_true",
                    help="tile/launch tuning only: GraniKV cascade (graph) + its parts per config, no baselines")
    ap.add_argument("--variants", default="",
                    help="comma-separated SWEEP names also timed (with the baselines) as gkv_cascade@NAME; "
                         "with --sweep: the variants swept beside the default (default: every SWEEP entry)")
    ap.add_argument("--sweep-cases", default="",
                    help="with --sweep: comma-separated indices into SWEEP_CASES (default: all)")
    ap.add_argument("--max-bs", type=int, default=0,
                    help="GraniKV workspace capacity (grids scale with it); serving uses the largest CUDA-graph "
                         "batch, e.g. 256. 0 (default, as in the recorded runs): the case's request count")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES),
                    help="head shape of every case (q heads / kv heads / head_dim per layer)")
    ap.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES),
                    help="the KV cache's dtype (fp8_*: K/V stored as SGLang stores an FP8 cache, the "
                         "kernels given its scales; with --sweep only: the baselines read bf16)")
    ap.add_argument("--matrix", action="store_true",
                    help="the prefix part over MATRIX_SHAPES x MATRIX_PREFIXES x MATRIX_SHARERS beside FlashInfer's "
                         "cascade (fa2, fa3) and its fa3 prefill with packed queries (kernels_matrix.json)")
    ap.add_argument("--plot-matrix", default="", metavar="JSON",
                    help="draw DIR/kernels_matrix.png from a --matrix JSON (no GPU needed) and exit")
    ap.add_argument("--matrix-shapes", default="", help="with --matrix: comma-separated SHAPES (default: all of them)")
    ap.add_argument("--matrix-suffixes", default=str(MATRIX_SUFFIX),
                    help="with --matrix: comma-separated suffix lengths per sharer, each point run at each "
                         f"(default {MATRIX_SUFFIX})")
    ap.add_argument("--matrix-skip-baselines", action="store_true",
                    help="with --matrix: GraniKV's launches and the read bound only (no FlashInfer columns)")
    ap.add_argument("--matrix-variants", default="",
                    help="with --matrix: SWEEP variants whose cascade layer is timed at every point too "
                         "(e.g. pw1.25,pw2.0: the runs benchmark/kernels/launch_table_fit.py fits a table from)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    set_shape(args.shape)
    set_kv_dtype(args.kv_dtype)
    if KV_DT is not None and not args.sweep:
        ap.error(f"--kv-dtype {args.kv_dtype} runs with --sweep only (the baselines here read a bf16 cache)")
    unknown = [n for n in filter(None, args.variants.split(",")) if n not in SWEEP]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: not in SWEEP ({', '.join(SWEEP)})")
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        return sweep(args)
    if args.plot_matrix:
        print(plot_matrix(args.plot_matrix, args.out))
        return None
    if args.matrix:
        return matrix(args)
    bw, tf = ceilings()
    print(f"ceilings: copy {bw:.2f} TB/s, bf16 matmul {tf:.0f} TFLOP/s", flush=True)
    ws_bytes = torch.empty(512 << 20, dtype=torch.uint8, device=DEV)
    base = base_config()
    if args.quick:
        configs = {"default": base}  # tile/launch variants: --sweep (or name some with --variants)
        cases = [([(16384, 64)], 256), ([(16384, 128)], 256), ([(16384, 8), (8192, 16), (4096, 24), (2048, 16)], 256),
                 ([(4096, 8)], 256), (FOREST_16, 256)]
    else:
        configs = {"default": base}
        cases = []
        for lp in (1024, 4096, 16384, 32768):
            for sfx in (64, 256, 1024):
                for n in (1, 8, 32, 64, 128, 256):
                    cases.append(([(lp, n)], sfx))
        for G in (4, 16):
            cases.append(([(32768 >> (i % 4), 4 + 4 * (i % 3)) for i in range(G)], 256))
    for name in filter(None, args.variants.split(",")):
        configs[name] = dataclasses.replace(base, **SWEEP[name])  # timed beside the default as gkv_*@name
    rows = []
    for groups, sfx in cases:
        t = time.time()
        try:
            r = run_case(groups, sfx, configs, bw, tf, ws_bytes, args.max_bs)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = dict(groups=groups, suffix=sfx, requests=sum(n for _, n in groups), floor_ms=0, error=repr(e)[:300])
        r["case_s"] = round(time.time() - t, 1)
        rows.append(r)
        print("ROW", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, max_bs=args.max_bs,
                shape_name=args.shape,
                copy_TBps=bw, matmul_TFLOPs=tf, shapes=dict(hq=HQ, hkv=HKV, d=D, dtype="bf16"),
                configs={k: dataclasses.asdict(v) for k, v in configs.items()})
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print_table(rows, bw, tf)
    try:
        import sys

        sys.modules.pop("IPython", None)  # the offline host's IPython stub confuses matplotlib
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 5))
        labels = [f"{r['groups']}/{r['suffix']}" for r in rows]
        x = np.arange(len(rows))
        for j, m in enumerate(MAIN + ["floor"]):
            ax.bar(x + j * 0.1, [r.get(m + "_ms", 0) or 0 for r in rows], 0.1, label=m)
        ax.set_xticks(x + 0.35, labels, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("ms (one layer)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title(f"{meta['gpu']} decode attention, bf16 {HQ}q/{HKV}kv/{D}")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "kernels.png"), dpi=110)
    except Exception as e:  # noqa: BLE001 - no matplotlib (or a broken one): no plot
        print("no plot:", repr(e)[:200])


if __name__ == "__main__":
    main()
