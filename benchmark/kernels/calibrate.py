"""Measure the cost-model coefficients of this GPU and write data/cost_model_<gpu>.json.

Times, on one GPU, one decode layer of synthetic shared-prefix batches (HOT prefixes
contiguous, suffix slots scattered as in a page-size-1 pool after churn) on every path:

- paged:   the stock kernel SGLang runs: FlashInfer's tensor-core paged decode
           (``BatchDecodeWithPagedKVCacheWrapper``, as SGLang's flashinfer backend) when it
           imports, else SGLang's Triton ``decode_attention_fwd`` (best of 8/16/32 kv splits);
- cascade / fused / bgemm: ``granikv.kernels.cascade`` over a filled ``CascadeWorkspace``,

then fits ``CostModel``'s coefficients by non-negative least squares on relative error
(``CostModel.fit``) and measures ``plan_us`` (group + choose + workspace fill, host wall time).

Method: per case, K/V buffers of ``L`` layers are allocated so that one pass over the layers
touches >= 3x the L2 cache (no layer finds the previous call's KV in L2, as in a real model);
graph-safe paths are captured in a CUDA graph of one call per layer and replayed (no Python
launch overhead, as under SGLang's decode CUDA graphs); bgemm runs eagerly, as in production.
Time per call = median replay time / L.

    python -m benchmark.kernels.calibrate [--out PATH] [--paged auto]

Prints every case (measured vs fitted, relative error) and the coefficients; takes < 60 s on
one H200. Default shapes: Llama-3.1-8B per-GPU heads (32q/8kv/128), bf16.
"""

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time

from typing import Dict, Optional

import numpy as np
import torch

from benchmark.harness.timing import eager_us, graph_us, host_ms
from granikv.attention.cost.cost_model import (
    DISABLEABLE_PATHS,
    LAUNCHES,
    PAGED_NAMES,
    CostModel,
    ExtendTerms,
    ServedTerms,
    calibrated_path,
    never_fastest,
)
from granikv.attention.dispatcher import Dispatcher
from granikv.attention.grouping import BatchDescription, group_requests

SMALL_GROUPS = [(2048 + round(i * 2048 / 31), 2 + i % 2) for i in range(32)]  # the grid's small_groups32 row
FOREST16_LIKE = [(1536 + 283 * i, 4 + i % 6) for i in range(16)]  # 16 prefixes of 1.5-5.8K, 4-9 sharers

# (groups as [(prefix_len, requests)], suffix tokens per request, ungrouped requests)
CASES = [([(p, n)], 256, 0) for p in (1024, 4096, 16384) for n in (2, 8, 32, 128)] + [
    ([(4096, 32)], 1024, 0),
    ([(1024, 64)], 64, 0),
    ([(16384, 64)], 64, 0),
    ([(16384, 8), (8192, 16), (4096, 24), (2048, 16)], 256, 0),
    ([(2048, 4)] * 16, 256, 0),
    ([(8192, 3)] * 4, 512, 8),
    ([(4096, 16)], 256, 32),
    # forests of many small groups: one-group cases alone fit the cascade's fixed costs into its
    # bandwidths and overprice it here by 1.3-1.5x (docs/results/kernels.md, "Calibration")
    (SMALL_GROUPS, 160, 0),
    (FOREST16_LIKE, 256, 0),
]
UNGROUPED_LEN = 2048
PATHS = ("paged", "cascade", "fused", "bgemm")


def describe(groups, suffix: int, ungrouped: int, order_seed: Optional[int] = None):
    """The batch of a case: ``(BatchDescription, req_to_token rows as numpy, label)``.

    Slot layout: 0 = padding | COLD slots (randomly permuted) | HOT prefixes, one after another.
    Ungrouped requests have ``UNGROUPED_LEN`` COLD tokens. Batch order: each group's members
    adjacent, groups in turn, then the ungrouped requests; with ``order_seed`` a seeded
    permutation of that (every group's members spread over the batch, as a running batch holds
    requests in arrival order).
    """
    rng = np.random.default_rng(0)
    bs = sum(n for _, n in groups) + ungrouped
    hot_len = np.array([p for p, n in groups for _ in range(n)] + [0] * ungrouped, np.int64)
    seq_lens = np.where(hot_len > 0, hot_len + suffix, UNGROUPED_LEN).astype(np.int64)
    n_cold = int((seq_lens - hot_len).sum())
    starts = 1 + n_cold + np.cumsum([0] + [p for p, _ in groups])[:-1]
    hot_start = np.array([s for s, (_, n) in zip(starts, groups) for _ in range(n)] + [0] * ungrouped,
                         np.int64)  # fmt: skip
    if order_seed is not None:
        perm = np.random.default_rng(order_seed).permutation(bs)
        hot_len, seq_lens, hot_start = hot_len[perm], seq_lens[perm], hot_start[perm]
    cold = rng.permutation(n_cold) + 1
    rows = np.zeros((bs + 1, int(seq_lens.max())), np.int32)
    c = 0
    for i in range(bs):
        h, s = int(hot_len[i]), int(seq_lens[i])
        rows[i + 1, :h] = np.arange(hot_start[i], hot_start[i] + h)
        rows[i + 1, h:s] = cold[c : c + s - h]
        c += s - h
    desc = BatchDescription(np.arange(1, bs + 1, dtype=np.int64), seq_lens, hot_start, hot_len)
    label = ("+".join(f"{p}x{n}" for p, n in groups) if len(set(groups)) > 1 or len(groups) == 1
             else f"{len(groups)}*({groups[0][0]}x{groups[0][1]})")  # fmt: skip
    label += f" sfx{suffix}" + (f" +{ungrouped}cold" if ungrouped else "")
    label += " interleaved" if order_seed is not None else ""
    return desc, rows, label


def workload_of(heads=(32, 8, 128), kv_dtype_bytes: int = 2, model: Optional[CostModel] = None):
    """``of(groups, suffix, ungrouped=0, order_seed=None) -> (Workload, label)``: one decode layer
    of ``describe``'s batch with every group counted (CPU only). The workload is pure accounting:
    ``model`` (default: the default file) only builds the dispatcher that computes it."""
    dispatcher = Dispatcher(model or CostModel.load(None, None), num_q_heads=heads[0], num_kv_heads=heads[1],
                            head_dim=heads[2], kv_dtype_bytes=kv_dtype_bytes)  # fmt: skip

    def of(groups, suffix: int, ungrouped: int = 0, order_seed: Optional[int] = None):
        desc, _, label = describe(groups, suffix, ungrouped, order_seed)
        return dispatcher.workload(group_requests(desc, min_group_size=1), desc), label

    return of


class Case:
    """One synthetic decode batch on the GPU and ``layers`` copies of its KV (one per layer)."""

    def __init__(self, groups, suffix, ungrouped, heads, dtype, l2_bytes, order_seed: Optional[int] = None):
        hq, hkv, d = heads
        self.desc, rows, self.label = describe(groups, suffix, ungrouped, order_seed)
        self.grouping = group_requests(self.desc, min_group_size=1)
        self.bs, self.heads, self.dtype = self.desc.batch_size, heads, dtype
        slots = 1 + int(self.desc.seq_lens.sum() - self.desc.hot_len.sum()) + sum(p for p, _ in groups)
        per_layer = slots * hkv * d * 2 * torch.finfo(dtype).bits // 8
        self.layers = int(min(32, max(2, math.ceil(3 * l2_bytes / per_layer))))
        dev = "cuda"
        self.req_to_token = torch.from_numpy(rows).to(dev)
        self.rpi = torch.arange(1, self.bs + 1, dtype=torch.int32, device=dev)
        self.kv = [(torch.randn(slots, hkv, d, dtype=dtype, device=dev),
                    torch.randn(slots, hkv, d, dtype=dtype, device=dev)) for _ in range(self.layers)]  # fmt: skip
        self.q = torch.randn(self.bs, hq, d, dtype=dtype, device=dev)
        self.out = torch.empty_like(self.q)
        self.scale = d**-0.5
        flat = [rows[i + 1, :s] for i, s in enumerate(self.desc.seq_lens)]
        self.kv_indices = torch.from_numpy(np.concatenate(flat)).to(dev)
        indptr = np.concatenate(([0], np.cumsum(self.desc.seq_lens)))
        self.kv_indptr = torch.from_numpy(indptr).to(torch.int32).to(dev)


# ---- paths --------------------------------------------------------------------------------------


def paged_flashinfer(case: Case):
    import flashinfer

    hq, hkv, d = case.heads
    bs = case.bs
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    last = torch.ones(bs, dtype=torch.int32, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=case.kv_indptr.clone(), paged_kv_indices_buffer=case.kv_indices.clone(),
        paged_kv_last_page_len_buffer=last.clone(),
    )  # fmt: skip
    w.plan(case.kv_indptr, case.kv_indices, last, hq, hkv, d, 1, data_type=case.dtype, q_data_type=case.dtype)
    calls = [
        (lambda k=k, v=v: w.run(case.q, (k.view(-1, 1, hkv, d), v.view(-1, 1, hkv, d)), out=case.out))
        for k, v in case.kv
    ]
    return graph_us(calls)


def paged_triton(case: Case):
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    hq, _, d = case.heads
    idx64 = case.kv_indices.long()
    best = math.inf
    for splits in (8, 16, 32):
        logits = torch.empty(case.bs, hq, splits, d, dtype=torch.float32, device="cuda")
        lse = torch.empty(case.bs, hq, splits, dtype=torch.float32, device="cuda")
        nsp = torch.full((case.bs,), splits, dtype=torch.int32, device="cuda")
        calls = [
            (lambda k=k, v=v, lg=logits, ls=lse, ns=nsp, s=splits: decode_attention_fwd(
                case.q, k, v, case.out, case.kv_indptr, idx64, lg, ls, ns, s, case.scale, 1.0, 1.0))
            for k, v in case.kv
        ]  # fmt: skip
        best = min(best, graph_us(calls))
    return best


def granikv_paths(case: Case):
    """{path: us per call} for cascade, fused (graph) and bgemm (eager)."""
    from granikv.kernels.cascade import bgemm_cascade_attention, cascade_attention, fused_cascade_attention
    from granikv.attention.decode.workspace import CascadeWorkspace

    hq, hkv, d = case.heads
    g = case.grouping
    out = {}
    ws = CascadeWorkspace(case.bs, hq, hkv, d, "cuda", max_groups=max(g.num_groups, 1))
    ws.fill(g, case.desc.seq_lens, case.rpi)
    for name, fn in (("cascade", cascade_attention), ("fused", fused_cascade_attention)):
        calls = [
            (lambda k=k, v=v, fn=fn: fn(case.q, k, v, case.req_to_token, ws.plan, sm_scale=case.scale, out=case.out))
            for k, v in case.kv
        ]  # fmt: skip
        out[name] = graph_us(calls)
    wsb = CascadeWorkspace(case.bs, hq, hkv, d, "cuda", max_groups=max(g.num_groups, 1))
    wsb.fill(g, case.desc.seq_lens, case.rpi, single_prefix_chunk=True)
    calls = [
        (lambda k=k, v=v: bgemm_cascade_attention(case.q, k, v, case.req_to_token, wsb.plan, sm_scale=case.scale,
                                                  out=case.out))
        for k, v in case.kv
    ]  # fmt: skip
    out["bgemm"] = eager_us(calls)
    return out


def plan_us(case: Case, dispatcher: Dispatcher, iters: int = 200) -> float:
    """Host wall time of one step's planning: group + choose + workspace fill."""
    from granikv.attention.decode.workspace import CascadeWorkspace

    hq, hkv, d = case.heads
    ws = CascadeWorkspace(case.bs, hq, hkv, d, "cuda", max_groups=case.bs)
    desc = case.desc

    def step():
        g = group_requests(desc, min_group_size=2)
        dispatcher.choose(g, desc)
        ws.fill(g, desc.seq_lens, desc.req_pool_indices)  # host rows, as the backend passes them

    return host_ms(step, n=iters, warmup=10) * 1e3


# ---- main ---------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="output JSON (default: python/granikv/data/cost_model_<gpu>.json)")
    ap.add_argument("--paged", choices=("auto", "flashinfer", "triton"), default="auto")
    ap.add_argument("--heads", default="32,8,128", help="q heads, kv heads, head_dim (per GPU)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--refit-from", metavar="JSON",
                    help="no GPU: refit from the measured cases of an earlier calibration's JSON "
                         "(cases of CASES), then choose the disabled paths again")
    ap.add_argument("--served-into", metavar="COST_MODEL_JSON",
                    help="no GPU: derive the served-step terms (per-backend paged coefficients, eager "
                         "launch overhead, extend terms) from --with-grid's kernels.json and "
                         "--extend-json, and write them into this file, its kernel coefficients unchanged")
    ap.add_argument("--extend-json", metavar="EXTEND_JSON", help="bench_extend.py's extend.json (with --served-into)")
    ap.add_argument("--with-grid", metavar="KERNELS_JSON",
                    help="with --refit-from: also fit to every point of a full bench_attention.py grid "
                         "(its kernels.json: single layers, paged = FlashInfer tensor-core decode)")
    ap.add_argument("--with-order", metavar="BATCH_ORDER_JSON",
                    help="with --refit-from: also fit to the forests of a batch_order.py run (its paged and "
                         "cascade times per layer, sharers adjacent and interleaved)")
    ap.add_argument("--launch-floor-us", type=float, metavar="US",
                    help="served.launch_floor_us to write: GPU-side floor of one GraniKV launch per layer "
                         "of a served step (default: the file's, else 3 us)")
    ap.add_argument("--host-plan-us", type=float, metavar="US",
                    help="served.host_plan_us to write: prior of the host planning term of a GraniKV "
                         "step, e.g. the p50 plan time of cascade steps in serving (default: the file's, else 250 us)")
    args = ap.parse_args()
    overrides = served_overrides(args.launch_floor_us, args.host_plan_us)
    if args.served_into:
        if not args.with_grid:
            ap.error("--served-into needs --with-grid")
        return served_into(args.served_into, args.with_grid, args.extend_json, overrides)
    if (args.with_grid or args.with_order) and not args.refit_from:
        ap.error("--with-grid and --with-order need --refit-from")
    if args.refit_from:
        return refit_from(args.refit_from, args.out, grid=args.with_grid, overrides=overrides, order=args.with_order)
    t_start = time.time()
    torch.manual_seed(0)
    heads = tuple(int(x) for x in args.heads.split(","))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    paged_name, paged_fn = pick_paged(args.paged)
    print(f"# {gpu}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, torch {torch.__version__}, "
          f"paged = {paged_name}, heads {heads}, {args.dtype}", flush=True)  # fmt: skip

    fallback = CostModel.load(None, None)
    dispatcher = Dispatcher(fallback, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                            kv_dtype_bytes=torch.finfo(dtype).bits // 8)  # fmt: skip
    rows = []
    for groups, suffix, ungrouped in CASES:
        case = Case(groups, suffix, ungrouped, heads, dtype, l2)
        w = dispatcher.workload(case.grouping, case.desc)
        measured = {"paged": paged_fn(case)}
        try:
            measured.update(granikv_paths(case))
        except Exception as e:  # noqa: BLE001 - report and fit what was measured
            print(f"# {case.label}: GraniKV kernels failed: {type(e).__name__}: {e}", file=sys.stderr)
        rows.append((case.label, case.layers, measured, w))
        print(f"{case.label:<42} L={case.layers:<2} " + " ".join(f"{p} {t:8.1f}us" for p, t in measured.items()),
              flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()
    big = Case([(16384, 128)], 256, 0, heads, dtype, l2)
    t_plan = plan_us(big, dispatcher)
    del big
    model, fitted = fit_and_choose(rows, t_plan)
    model = dataclasses.replace(model, served=dataclasses.replace(model.served, **overrides))
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "gpu": gpu, "torch": torch.__version__, "paged_kernel": paged_name,
        "heads": list(heads), "dtype": args.dtype,
        "cases": [{"case": label, "layers": L, "us": {p: round(t, 2) for p, t in m.items()}}
                  for label, L, m, _ in rows],
        **fitted,
        "elapsed_s": round(time.time() - t_start, 1),
    }  # fmt: skip
    out = write_model(model, gpu, meta, args.out)
    print(f"# wrote {out} in {meta['elapsed_s']} s")


def pick_paged(choice: str):
    if choice in ("auto", "flashinfer"):
        try:
            import flashinfer  # noqa: F401

            return "flashinfer BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)", paged_flashinfer
        except Exception as e:  # noqa: BLE001
            if choice == "flashinfer":
                raise
            print(f"# flashinfer unavailable ({type(e).__name__}: {e}); using SGLang's Triton decode")
    return "sglang decode_attention_fwd (best of 8/16/32 splits)", paged_triton


def fit_and_choose(rows, plan: float):
    """Fit the coefficients to every measured sample of ``rows``, choose the disabled paths,
    print the fit and the decisions. Returns ``(model, calibration fields)``."""
    samples = [(p, w, t) for _, _, m, w in rows for p, t in m.items()]
    model, rel_err = CostModel.fit(samples, plan_us=plan, fallback=CostModel.load(None, None))
    model = dataclasses.replace(model, disabled_paths=choose_disabled(rows, model))
    max_err = report(samples, rel_err, model)
    return model, {"decisions_num_layers_32": check_decisions(rows, model), "max_abs_rel_err": max_err}


def write_model(model: CostModel, gpu: str, meta: dict, out: Optional[str], served_note: Optional[dict] = None) -> str:
    """The cost-model JSON (``data/cost_model_<gpu>.json`` unless ``out``; ``served_note``: how
    the served terms were derived, kept from the file they came from); returns its path."""
    out = out or calibrated_path(gpu)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    values = model.to_mapping(gpu, calibration=meta)
    if served_note:
        values["served"]["note"] = served_note
    with open(out, "w") as f:
        json.dump(values, f, indent=2)
        f.write("\n")
    return out


def report(samples, rel_err, model: CostModel) -> dict:
    """Prints the fit (per-path relative errors, coefficients); returns max |error| per path."""
    print(f"\n{'path':<8} {'n':>3} {'max |err|':>9} {'mean |err|':>10}")
    max_err = {}
    for p in PATHS:
        e = [abs(x) for (q, _, _), x in zip(samples, rel_err) if q == p]
        max_err[p] = round(float(max(e, default=0.0)), 3)
        if e:
            print(f"{p:<8} {len(e):>3} {max(e):>9.2f} {sum(e) / len(e):>10.2f}")
    print()
    for name in CostModel.coefficient_names():
        print(f"  {name:<18} {getattr(model, name):10.2f}")
    print(f"  disabled_paths     {', '.join(model.disabled_paths) or '-'} (choose_disabled)")
    return max_err


def decisions(rows, model: CostModel, num_layers: int = 32):
    """The path the model picks for each case on a CUDA-graph step (as the Dispatcher,
    ``num_layers`` layers per plan), against the measured times: vs paged, and vs the fastest
    measured graph path (paged, cascade, fused; disabled or not). One dict per case."""
    out = []
    for label, _, measured, w in rows:
        est = {p: getattr(model, f"{p}_time")(w, num_layers=num_layers)
               for p in ("paged", "cascade", "fused")
               if p in measured and p not in model.disabled_paths}  # fmt: skip
        pick = min(est, key=est.get)  # dict order: paged first, so it wins ties
        best = min((p for p in ("paged", "cascade", "fused") if p in measured), key=measured.get)  # any path
        out.append({"case": label, "pick": pick, "best": best,
                    "speedup_vs_paged": round(measured["paged"] / measured[pick], 3),
                    "vs_best": round(measured[best] / measured[pick], 3)})  # fmt: skip
    return out


PICK_FLOOR = 0.97  # a calibrated model's picks must stay at >= this x the stock paged kernel


def choose_disabled(rows, model: CostModel, floor: float = PICK_FLOOR) -> tuple:
    """The set of GraniKV paths to disable, chosen on the measured cases: every subset of the
    graph paths (cascade, fused) that won some case is tried; paths that never won, and bgemm
    (eager only, so never judged by these CUDA-graph decisions), are always disabled. The
    winner keeps every pick >= ``floor`` x paged if any subset can, then has the best geometric
    mean of measured(best) / measured(pick); ties go to the larger set (fewer paths, simpler).

    A path whose time the model predicts badly (its picks lose to another path) is dropped
    this way, not by a fixed threshold on its error.
    """
    always = set(never_fastest(m for _, _, m, _ in rows)) | {"bgemm"}
    optional = [p for p in DISABLEABLE_PATHS if p not in always]
    best_key, best_set = None, None
    for k in range(len(optional) + 1):
        for extra in itertools.combinations(optional, k):
            disabled = tuple(p for p in DISABLEABLE_PATHS if p in always or p in extra)
            d = decisions(rows, dataclasses.replace(model, disabled_paths=disabled))
            worst = min(x["speedup_vs_paged"] for x in d)
            geo = math.exp(statistics.fmean(math.log(x["vs_best"]) for x in d))
            key = (worst >= floor, round(geo, 4), len(disabled))
            if best_key is None or key > best_key:
                best_key, best_set = key, disabled
    return best_set


def check_decisions(rows, model: CostModel, num_layers: int = 32):
    """``decisions``, printed as a table; returns them."""
    out = decisions(rows, model, num_layers)
    print(f"\n{'case':<44} {'pick':>8} {'best':>8} {'vs paged':>9} {'vs best':>8}")
    for x in out:
        print(f"{x['case'][:44]:<44} {x['pick']:>8} {x['best']:>8} {x['speedup_vs_paged']:>8.2f}x "
              f"{x['vs_best']:>7.2f}x")
    print(f"# worst pick vs paged: {min(x['speedup_vs_paged'] for x in out):.2f}x (target >= {PICK_FLOOR}x)")
    return out


def rows_from(calibration: dict, heads=(32, 8, 128), kv_dtype_bytes: int = 2):
    """``(label, layers, measured, Workload)`` per case of an earlier calibration's
    ``calibration`` section (CPU only: the workloads are rebuilt from ``CASES``, matched by
    label; a calibration from before a case was added simply lacks it)."""
    of = workload_of(heads, kv_dtype_bytes)
    known = {}
    for groups, suffix, ungrouped in CASES:
        w, label = of(groups, suffix, ungrouped)
        known[label] = w
    rows = []
    for c in calibration["cases"]:
        if c["case"] not in known:
            raise ValueError(f"measured case {c['case']!r} is not one of CASES: not the same calibration set")
        rows.append((c["case"], c["layers"], dict(c["us"]), known[c["case"]]))
    return rows


GRID_PATHS = {"paged": "fi_decode_tc_ms", "cascade": "gkv_cascade_ms", "fused": "gkv_fused_ms",
              "bgemm": "gkv_bgemm_ms"}


def rows_from_grid(path: str, heads=(32, 8, 128), kv_dtype_bytes: int = 2):
    """``(label, 1, measured us per layer, Workload)`` per point of a full ``bench_attention.py``
    grid (``kernels.json``); points that failed or lack a path are skipped."""
    with open(path) as f:
        grid = json.load(f)
    shapes = grid["meta"]["shapes"]
    if (shapes["hq"], shapes["hkv"], shapes["d"]) != tuple(heads):
        raise ValueError(f"{path}: grid heads {shapes} differ from the calibration's {heads}")
    of = workload_of(heads, kv_dtype_bytes)
    rows = []
    for r in grid["rows"]:
        if "error" in r or r.get("n_ungrouped") or any(r.get(k) is None for k in GRID_PATHS.values()):
            continue
        w, label = of([tuple(g) for g in r["groups"]], r["suffix"])
        rows.append(("grid " + label, 1, {p: 1e3 * r[k] for p, k in GRID_PATHS.items()}, w))
    return rows


def rows_from_order(path: str, heads=(32, 8, 128), kv_dtype_bytes: int = 2):
    """``(label, layers, {paged, cascade} us per layer, Workload)`` per batch of a
    ``batch_order.py`` run (forests with sharers adjacent and interleaved), rebuilt from its
    ``SHAPES``; a run of other heads is refused."""
    from benchmark.kernels.batch_order import ORDERS, SHAPES

    with open(path) as f:
        run = json.load(f)
    if tuple(run["meta"]["heads"]) != tuple(heads):
        raise ValueError(f"{path}: heads {run['meta']['heads']} differ from the calibration's {list(heads)}")
    of = workload_of(heads, kv_dtype_bytes)
    shapes = {(name, order): (groups, suffix, seed) for name, groups, suffix in SHAPES for order, seed in ORDERS}
    rows = []
    for r in run["rows"]:
        key = (r["shape"], r["order"])
        if key not in shapes:
            raise ValueError(f"{path}: batch {key} is not one of batch_order.SHAPES")
        groups, suffix, seed = shapes[key]
        w, label = of(groups, suffix, order_seed=seed)
        rows.append(("order " + label, r["layers"], {"paged": r["paged_us"], "cascade": r["cascade_us"]}, w))
    return rows


def served_overrides(launch_floor_us: Optional[float], host_plan_us: Optional[float]) -> dict:
    """The ``ServedTerms`` fields given on the command line (checked: positive, finite)."""
    out = {}
    for name, v in (("launch_floor_us", launch_floor_us), ("host_plan_us", host_plan_us)):
        if v is None:
            continue
        if not (math.isfinite(v) and v > 0):
            raise SystemExit(f"--{name.replace('_', '-')}={v} must be a positive finite number of microseconds")
        out[name] = float(v)
    return out


def kept_served(old: dict, source: str, overrides: dict) -> ServedTerms:
    """The served terms a rewrite of the kernel coefficients keeps from the file ``old`` (all
    of them: per-backend paged coefficients, extend terms, launch floor, host planning prior),
    with ``overrides`` on top."""
    return dataclasses.replace(CostModel.from_mapping(old, source=source).served, **overrides)


def refit_from(path: str, out: Optional[str], grid: Optional[str] = None, overrides: Optional[dict] = None,
               order: Optional[str] = None) -> int:
    """Refit the coefficients and choose the disabled paths from ``path``'s measurements (and,
    with ``grid``, a full kernel grid's; with ``order``, a ``batch_order.py`` run's forests); the
    file's served terms are kept (``kept_served``; ``overrides`` replace the launch floor and the
    host planning prior), the ``flashinfer`` paged entry taking the refitted coefficients."""
    with open(path) as f:
        old = json.load(f)
    cal = old["calibration"]
    heads = tuple(cal.get("heads", (32, 8, 128)))
    rows = rows_from(cal, heads, 2)  # calibrations are bf16 or fp16 (--dtype)
    if grid:
        rows += rows_from_grid(grid, heads, 2)
    if order:
        rows += rows_from_order(order, heads, 2)
    model, fitted = fit_and_choose(rows, float(old["coefficients"]["plan_us"]))
    served = kept_served(old, path, overrides or {})
    if "flashinfer" in served.paged_by_backend and str(cal.get("paged_kernel", "")).startswith("flashinfer"):
        # that entry is the calibrated paged kernel's: it takes the refitted coefficients
        by_backend = dict(served.paged_by_backend, flashinfer=paged_coefs(model))
        served = dataclasses.replace(served, paged_by_backend=by_backend)
    model = dataclasses.replace(model, served=served)
    meta = dict(cal, **fitted,
                refit={"from": os.path.basename(path), "grid": grid and os.path.basename(grid),
                       "order": order and os.path.basename(order),
                       "date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "command": " ".join(sys.argv)})  # fmt: skip
    out = write_model(model, old["gpu_name"], meta, out, served_note=(old.get("served") or {}).get("note"))
    print(f"# wrote {out} (refit from {path}, no GPU)")
    return 0


# ---- served-step terms from measured data files (no GPU) ----------------------------------------


def paged_coefs(model: CostModel) -> Dict[str, float]:
    """``model``'s paged coefficients (``PAGED_NAMES``), as ``served.paged_by_backend`` holds them."""
    return {n: getattr(model, n) for n in PAGED_NAMES}


def paged_fit(samples, fallback: CostModel) -> dict:
    """The paged coefficients (``PAGED_NAMES``) fitted to ``(Workload, us)`` samples of one
    paged kernel."""
    model, _ = CostModel.fit([("paged", w, t) for w, t in samples], plan_us=fallback.plan_us, fallback=fallback)
    return paged_coefs(model)


def served_from_grid(grid_path: str, extend_path: Optional[str], fallback: CostModel):
    """``(ServedTerms, how)`` derived from a bench_attention.py grid (SGLang's Triton decode per
    point: the triton paged coefficients; GraniKV's cascade eager vs captured: the eager launch
    overhead) and bench_extend.py's extend.json (prefill TFLOP/s of the paged and dense calls)."""
    with open(grid_path) as f:
        grid = json.load(f)
    shapes = grid["meta"]["shapes"]
    heads = (shapes["hq"], shapes["hkv"], shapes["d"])
    of = workload_of(heads, 2, fallback)
    triton, eager = [], []
    for r in grid["rows"]:
        if "error" in r or r.get("n_ungrouped"):
            continue
        w, _ = of([tuple(g) for g in r["groups"]], r["suffix"])
        if r.get("sgl_triton_ms") is not None:
            triton.append((w, 1e3 * r["sgl_triton_ms"]))
        if r.get("gkv_cascade_eager_ms") is not None and r.get("gkv_cascade_ms") is not None:
            eager.append(1e3 * (r["gkv_cascade_eager_ms"] - r["gkv_cascade_ms"]) / LAUNCHES["cascade"])
    how = {"triton_paged": f"fit to sgl_triton_ms of {len(triton)} points of {os.path.basename(grid_path)}",
           "eager_launch_us": f"median over {len(eager)} points of (gkv_cascade_eager_ms - gkv_cascade_ms) / 3 "
                              f"launches, {os.path.basename(grid_path)}"}  # fmt: skip
    by_backend = {"flashinfer": paged_coefs(fallback), "triton": paged_fit(triton, fallback)}
    extend = ExtendTerms()
    stock_by_backend: Dict[str, Dict[str, float]] = {}
    if extend_path:
        with open(extend_path) as f:
            ext = json.load(f)
        rows = ext["rows"] if isinstance(ext, dict) else ext
        tf = {k: statistics.median(r[f"{k}_TFLOPs"] for r in rows if r.get(f"{k}_TFLOPs")) for k in
              ("fi_paged_fa2", "fi_ragged_fa3") if any(r.get(f"{k}_TFLOPs") for r in rows)}
        if len(tf) == 2:
            extend = dataclasses.replace(extend, paged_tflops=tf["fi_paged_fa2"], dense_tflops=tf["fi_ragged_fa3"])
            how["extend_tflops"] = (f"median TFLOP/s of fi_paged_fa2 (stock) and fi_ragged_fa3 (dense) over "
                                    f"{len(rows)} cases of {os.path.basename(extend_path)}")
        # SGLang's fa3 backend's own prefix part (bench_extend's sgl_fa3_paged), where measured
        fa3 = [r["sgl_fa3_paged_TFLOPs"] for r in rows if r.get("sgl_fa3_paged_TFLOPs")]
        if fa3:
            stock_by_backend["fa3"] = {"paged_tflops": statistics.median(fa3), "paged_call_us": fallback.paged_launch_us}
            how["extend_stock_fa3"] = (f"median TFLOP/s of sgl_fa3_paged over {len(fa3)} cases of "
                                       f"{os.path.basename(extend_path)}; call as flashinfer's paged call")
    extend = dataclasses.replace(extend, paged_call_us=fallback.paged_launch_us,
                                 dense_call_us=2 * fallback.paged_launch_us)
    how["extend_call_us"] = ("not measured (every extend case is compute-bound): paged call = the decode "
                             "paged_launch_us, dense call = 2x it (plan + run of a ragged call), merge "
                             f"{extend.merge_us} us; to refit on the GPU")
    served = ServedTerms(eager_launch_us=statistics.median(eager) if eager else ServedTerms.eager_launch_us,
                         paged_by_backend=by_backend, extend=extend,
                         launch_floor_us=fallback.served.launch_floor_us, host_plan_us=fallback.served.host_plan_us,
                         extend_stock_by_backend=stock_by_backend)
    return served, how


def served_into(path: str, grid_path: str, extend_path: Optional[str], overrides: Optional[dict] = None) -> int:
    """Writes the served-step terms into the cost-model file ``path`` (coefficients unchanged;
    the launch floor and host planning prior kept, or replaced by ``overrides``)."""
    with open(path) as f:
        values = json.load(f)
    model = CostModel.from_mapping(values, source=path)
    served, how = served_from_grid(grid_path, extend_path, model)
    served = dataclasses.replace(served, **(overrides or {}))
    old_note = (values.get("served") or {}).get("note") or {}
    how.update({k: old_note[k] for k in ("launch_floor_us", "host_plan_us") if k in old_note and k not in (overrides or {})})
    how.update({k: f"set on the command line ({v} us)" for k, v in (overrides or {}).items()})
    values["served"] = dict(served.to_mapping(), note={
        **how, "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)})
    CostModel.from_mapping(values, source=path)  # validates what is written
    with open(path, "w") as f:
        json.dump(values, f, indent=2)
        f.write("\n")
    print(f"# wrote the served terms into {path}: {json.dumps(served.to_mapping())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
