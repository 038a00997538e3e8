"""The regime grid: which (model, workload) rows the regime benchmark measures, what each costs.

Pure (no GPU, no sglang): regimes.py runs what :func:`select` keeps; the tests check it here.

How the grid was chosen. The axes that decide whether sharing pays are the shared prefix
length (0 .. 32K), the sharers per prefix (1 .. 128), the distinct prefixes per batch (1 .. 64),
the private suffix (64 .. 2K), the output length (64 .. 256) and whether the KV pool binds. A
full cross product is thousands of rows; one backend gets about eight minutes of GPU time,
engine starts included (~40 s per 8B-class engine, two engines per model). So the grid is one
row per *regime*, each placed where a previous measurement or the cost model says the answer
changes:

- rows that win and must keep winning: one 16K prefix x 64 and x 128 agents (Llama-3.1-8B),
  32K x 48, a forest of 16 prefixes (1.5-6K, 4-12 agents each), an agent loop (24 agents, 10K
  prefix, 4 turns), three unequal prefixes with 1-700-token suffixes;
- rows where sharing cannot pay (floor_speedup about 1): short prefixes (~1.1K) with 3 sharers
  and long suffixes, 64 distinct 512-token prefixes with 2 sharers, one sharer per cached
  prefix, no shared prefix at all, and the KV-bound row (more distinct prompts than the KV
  pool holds);
- the same regimes on the other shapes: Qwen2.5-7B (GQA 7), Llama-3.2-3B (GQA 3) and a
  4-layer Llama-3.1-8B whose decode step is short enough to be host-bound;
- the models agent workloads serve: the gpt-oss-20b shape (12 full-attention layers between 12
  of a 128-token sliding window, learned sinks, MoE, head_dim 64; triton only, as SGLang allows
  for it) and the Qwen3-30B-A3B shape (MoE, GQA 8, 48 layers). Their configs drop the released
  checkpoints' quantization (gpt-oss's MXFP4 experts): dummy weights are bf16.

Output lengths are 64-128 tokens (256 on two rows) so that a row takes seconds; every agent
count stays within the decode CUDA graphs (<= 256). The Llama-3.1-8B engines cap the KV pool at
``LLAMA_POOL_TOKENS`` so the KV-bound row needs 393K prompt tokens rather than the full pool's
845K (a minute of prefill per engine); every other Llama row fits that pool with room to
spare (largest: the forest, 61K prefix + 37K private tokens). Each row has a priority: when
the estimated cost of the grid (:func:`estimate_s`) exceeds the time budget, rows are dropped
from the lowest priority up, and a model none of whose rows is left is not started.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmark.harness.model_config import CONFIG_DIR, kv_dtype_bytes, model_config_path, split_model_name

CEILING_PREFIX = 256
HOST_BOUND_OUT = 2048  # output tokens of the host-bound model's rows (see default_grid)
LLAMA_POOL_TOKENS = 294912  # 288K: the KV-bound row's 64 x 6K prompts need 1.33x this
HOST_BOUND_POOL_TOKENS = 786432  # the 4-layer model's KV pool (16 KB a token): its long rows fit once


@dataclass(frozen=True)
class Model:
    """A model shape of the grid: a config under configs/, its engine start, engine extras."""

    name: str  # folder under configs/, or <folder>+<kv cache dtype> (model_config.split_model_name)
    start_s: float  # estimated engine start (weights, CUDA graphs, the first requests)
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    backends: Optional[Tuple[str, ...]] = None  # the attention backends SGLang serves it on (None: any)

    @property
    def config_path(self) -> Path:
        return model_config_path(self.name)

    def config(self) -> Dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def engine_args(self) -> Dict[str, Any]:
        """``engine_kwargs`` with the name's KV cache dtype, if it has one."""
        kv = split_model_name(self.name)[1]
        return dict(self.engine_kwargs, **({"kv_cache_dtype": kv} if kv else {}))


MODELS: Tuple[Model, ...] = (
    # starts: the slower of the two engines measured on one H200 (docs/results/regimes.json's
    # engine info records, 2026-12-01), rounded up
    # every pool capped alike, so that a model's stock and GraniKV engines fit one GPU side by side
    Model("llama-3.1-8b", 39.0, {"max_total_tokens": LLAMA_POOL_TOKENS}),
    Model("qwen2.5-7b", 60.0, {"max_total_tokens": LLAMA_POOL_TOKENS}),
    Model("llama-3.2-3b", 56.0, {"max_total_tokens": LLAMA_POOL_TOKENS}),
    Model("llama-3.1-8b-4layers", 42.0, {"max_total_tokens": HOST_BOUND_POOL_TOKENS}),
    # FP8 KV cache (--kv-cache-dtype fp8_e4m3): stock and GraniKV both on it (no GPU run yet;
    # on the offline GPU host run it with --backend triton: FlashInfer's FP8 modules are not prebuilt there)
    Model("llama-3.1-8b+fp8_e4m3", 39.0, {"max_total_tokens": LLAMA_POOL_TOKENS}),
    # hybrid sliding-window model with sinks: SGLang 0.5.17 serves GptOssForCausalLM on triton (not
    # flashinfer) on this GPU; its SWA pool is off on both engines (GraniKV refuses that pool)
    Model("gpt-oss-20b", 90.0, {"max_total_tokens": LLAMA_POOL_TOKENS, "disable_hybrid_swa_memory": True},
          backends=("triton",)),
    # 61 GB of bf16 weights per engine: two engines side by side need the smaller pool and reserve
    Model("qwen3-30b-a3b", 120.0, {"max_total_tokens": 65536, "mem_fraction_static": 0.93}),
)
MODEL_NAMES = tuple(m.name for m in MODELS)


@dataclass(frozen=True)
class Regime:
    """One row of the grid before it is measured.

    kind: ``grouped`` (workloads.grouped: a forest, one prefix, an agent loop) or
    ``no_sharing`` (workloads.no_sharing); kwargs: that builder's arguments. priority: 0 must
    run, 1 should, 2 if time allows.
    """

    name: str
    model: str
    kind: str
    kwargs: Mapping[str, Any]
    priority: int = 1

    @property
    def agents(self) -> int:
        if self.kind == "no_sharing":
            return int(self.kwargs["agents"])
        return int(sum(self.kwargs["agents_per_prefix"]))

    @property
    def turns(self) -> int:
        return int(self.kwargs.get("turns", 1))

    @property
    def prefix_len(self) -> int:
        return max(self.kwargs.get("prefixes") or [0])

    @property
    def has_ceiling(self) -> bool:
        """Whether cutting the prefixes to 256 tokens changes the workload (else it is its own
        ceiling and none is run)."""
        return self.kind == "grouped" and self.prefix_len > CEILING_PREFIX

    def spec_json(self, *, ceiling: bool = False) -> Dict[str, Any]:
        """workloads.WorkloadSpec.to_json() of the row (or of its ceiling)."""
        kw = dict(self.kwargs)
        if ceiling:
            kw["prefixes"] = [min(int(x), CEILING_PREFIX) for x in kw["prefixes"]]
        if self.kind == "no_sharing":
            agents = kw.pop("agents")
            return dict(name="no_sharing", agents=agents, prefix_len=0, kwargs=kw)
        return dict(name="grouped", agents=self.agents, prefix_len=max(kw["prefixes"]), kwargs=kw)

    @property
    def key(self) -> str:
        return f"{self.model}/{self.name}"


def _forest16() -> Dict[str, Any]:
    """16 distinct prefixes of 1.5-6K tokens (evenly spread), 4-12 agents each (128 in all)."""
    prefixes = [1536 + round(i * (6144 - 1536) / 15) for i in range(16)]
    agents = [4 + (7 * i) % 9 for i in range(16)]  # 4..12, mixed over the lengths
    return dict(prefixes=prefixes, agents_per_prefix=agents, suffix=[64, 512], out=128)


def _short3(groups: int = 16) -> Dict[str, Any]:
    """Short shared prefixes (~1.1K), 3 sharers each, long private suffixes (1-2K)."""
    return dict(prefixes=[1024 + 8 * i for i in range(groups)], agents_per_prefix=[3] * groups,
                suffix=[1024, 2048], out=128)


def _small_groups(groups: int = 32) -> Dict[str, Any]:
    """Many short shared prefixes (2-4K tokens, evenly spread), each shared by 2 or 3 agents."""
    return dict(prefixes=[2048 + round(i * 2048 / (groups - 1)) for i in range(groups)],
                agents_per_prefix=[2 + i % 2 for i in range(groups)], suffix=[64, 256], out=128)


def _one(prefix: int, agents: int, out: int = 128, suffix: int = 256) -> Dict[str, Any]:
    return dict(prefixes=[prefix], agents_per_prefix=[agents], suffix=[suffix, suffix], out=out)


def default_grid() -> List[Regime]:
    """Every row, in run order within a model (see the module docstring)."""
    L, Q, G3, H, F8, OSS, Q3 = MODEL_NAMES
    g, ns = "grouped", "no_sharing"
    rows = [
        Regime("hom16k_x64", L, g, _one(16384, 64), 0),
        Regime("hom16k_x128", L, g, _one(16384, 128), 0),
        Regime("short1k_3sharers", L, g, _short3(), 0),
        Regime("kv_bound_no_sharing", L, ns, dict(agents=64, prompt_len=6144, out=64), 0),
        Regime("forest16", L, g, _forest16(), 0),
        Regime("agent_loop_10k_x24", L, g, dict(_one(10240, 24, out=64), turns=4, tool=128), 0),
        Regime("small_groups32_2to3sharers", L, g, _small_groups(), 0),
        # 256 output tokens: at 64 a repeat lasted 1.2 s, mostly prefill, and the stock engine's
        # own repeats spread 3.4% (H100, 2026-12-07) on a row judged against 0.99x
        Regime("prefix512_2sharers_x64", L, g, dict(prefixes=[512] * 64, agents_per_prefix=[2] * 64,
                                                    suffix=[64, 256], out=256), 1),
        Regime("hom32k_x48", L, g, _one(32768, 48, out=64), 1),
        Regime("three_unequal", L, g, dict(prefixes=[12288, 6144, 2048], agents_per_prefix=[8, 24, 48],
                                           suffix=[1, 700], out=128), 1),
        Regime("prefix4k_8sharers_x4_out256", L, g, dict(prefixes=[4096] * 4, agents_per_prefix=[8] * 4,
                                                         suffix=[64, 2048], out=256), 2),
        Regime("prefix2k_1sharer_x32", L, g, dict(prefixes=[2048] * 32, agents_per_prefix=[1] * 32,
                                                  suffix=[256, 1024], out=128), 2),
        Regime("no_sharing_1k_x64", L, ns, dict(agents=64, prompt_len=1024, out=128), 2),
        Regime("short1k_3sharers", Q, g, _short3(), 0),
        Regime("forest16", Q, g, _forest16(), 0),
        Regime("hom16k_x64", Q, g, _one(16384, 64), 1),
        Regime("no_sharing_1k_x64", Q, ns, dict(agents=64, prompt_len=1024, out=128), 2),
        Regime("short1k_3sharers", G3, g, _short3(), 0),
        Regime("hom16k_x64", G3, g, _one(16384, 64), 1),
        Regime("forest16", G3, g, _forest16(), 1),
        # the host-bound model decodes 16x longer: at 128 tokens its rows lasted under a second,
        # where the stock engine's own spread over three repeats reached 27-36% on the H200; at
        # 512 (about 1 s) single repeats still ran 15-30% slow (one 0.15-0.3 s stall), a stock
        # spread of 12-17% on the rows that share least (H200, 2026-12-05); at 2048 such a stall
        # is a few percent of a row
        Regime("forest16", H, g, dict(_forest16(), out=HOST_BOUND_OUT), 0),
        Regime("short1k_3sharers", H, g, dict(_short3(), out=HOST_BOUND_OUT), 1),
        Regime("hom4k_x64", H, g, _one(4096, 64, out=HOST_BOUND_OUT), 1),
        Regime("three_unequal", H, g, dict(prefixes=[12288, 6144, 2048], agents_per_prefix=[8, 24, 48],
                                           suffix=[1, 700], out=HOST_BOUND_OUT), 1),
        Regime("no_sharing_1k_x64", H, ns, dict(agents=64, prompt_len=1024, out=HOST_BOUND_OUT), 2),
        # FP8 KV: the stock paged decode reads half of bf16's bytes, so the floor is lower
        Regime("hom16k_x64", F8, g, _one(16384, 64), 0),
        Regime("forest16", F8, g, _forest16(), 0),
        Regime("agent_loop_10k_x24", F8, g, dict(_one(10240, 24, out=64), turns=4, tool=128), 1),
        Regime("no_sharing_1k_x64", F8, ns, dict(agents=64, prompt_len=1024, out=128), 1),
        # hybrid (half the layers windowed) and MoE models
        Regime("hom16k_x64", OSS, g, _one(16384, 64), 0),
        Regime("forest16", OSS, g, _forest16(), 0),
        Regime("agent_loop_10k_x24", OSS, g, dict(_one(10240, 24, out=64), turns=4, tool=128), 1),
        Regime("no_sharing_1k_x64", OSS, ns, dict(agents=64, prompt_len=1024, out=128), 0),
        Regime("hom16k_x64", Q3, g, _one(16384, 64), 0),
        Regime("no_sharing_1k_x64", Q3, ns, dict(agents=64, prompt_len=1024, out=128), 0),
    ]
    return rows


# ---- cost estimate (for the time budget only; a guess from peak rates, not a measurement) ---

# Fitted to the stock rows of docs/results/multi_agent.json (Llama-3.1-8B, H200): 16K x 64 and
# 2K no-sharing x 64 / x 128 within 15%.
PREFILL_FLOPS = 6.0e14  # effective dense rate of a bf16 prefill
WEIGHT_BW = 4.0e12  # effective HBM rate of a decode step's weight reads
KV_BW = 6.0e12  # effective rate of its KV reads (shared prefix pages partly hit L2)
HOST_STEP_S = 4e-3  # floor of one decode step's wall (launch, sampling, scheduling)
ROW_OVERHEAD_S = 1.5  # per measured run: cache flush, warm-up request, submit, counters


def model_facts(cfg: Mapping[str, Any], kv_bytes: int = 2) -> Dict[str, float]:
    """Parameter count and KV bytes per token (``kv_bytes`` per element: 2 for bf16) of a config
    (an MoE config: every expert counted, as a decode step of many requests touches them all)."""
    h, layers, hq = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    hkv, vocab = cfg["num_key_value_heads"], cfg["vocab_size"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 1
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts > 1 else cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // hq
    per_layer = 2 * h * hq * d + 2 * h * hkv * d + 3 * h * inter * experts
    params = layers * per_layer + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return dict(params=float(params), kv_bytes=float(layers * hkv * d * 2 * kv_bytes))


def run_estimate_s(spec: Mapping[str, Any], cfg: Mapping[str, Any], pool_tokens: Optional[int] = None,
                   kv_bytes: int = 2) -> float:
    """Seconds one engine needs for one workload spec (spec_json form): its warm-up and new
    prompt tokens at PREFILL_FLOPS, its decode steps' weight and (stock engine) KV reads at
    WEIGHT_BW / KV_BW, in waves when the prompts exceed ``pool_tokens``."""
    f = model_facts(cfg, kv_bytes)
    kw = spec["kwargs"]
    turns, out = int(kw.get("turns", 1)), int(kw["out"])
    if spec["name"] == "no_sharing":
        agents, warm, new, ctx = spec["agents"], 0, spec["agents"] * kw["prompt_len"], kw["prompt_len"]
    else:
        lo, hi = kw["suffix"]
        agents = sum(kw["agents_per_prefix"])
        warm = sum(kw["prefixes"])
        new = agents * (lo + hi) / 2 + agents * (turns - 1) * kw.get("tool", 0)
        ctx = sum(L * n for L, n in zip(kw["prefixes"], kw["agents_per_prefix"])) / agents + (lo + hi) / 2
    prefill = 2 * f["params"] * (warm + new) / PREFILL_FLOPS
    live = agents * (ctx + out * turns / 2)
    waves = max(1, math.ceil(live / pool_tokens)) if pool_tokens else 1
    step = max(HOST_STEP_S, 2 * f["params"] / WEIGHT_BW + live / waves * f["kv_bytes"] / KV_BW)
    return ROW_OVERHEAD_S + prefill + waves * turns * out * step


def estimate_s(row: Regime, model: Model, repeats: int = 1, engines: int = 2) -> float:
    """Seconds of one row on ``engines`` engines (the GraniKV engine counted as a stock one), each
    measured ``repeats`` times, plus its ceiling on the stock engine, measured once."""
    cfg, pool, kvb = model.config(), model.engine_kwargs.get("max_total_tokens"), kv_dtype_bytes(model.name)
    t = engines * run_estimate_s(row.spec_json(), cfg, pool, kvb) * repeats
    if row.has_ceiling:
        t += run_estimate_s(row.spec_json(ceiling=True), cfg, pool, kvb)
    return t


PAIR_START_FACTOR = 1.3  # both engines of a model start at once on one GPU: ~1.3x one start


def start_s(model: Model) -> float:
    """Estimated seconds until both engines of ``model`` are up (started side by side)."""
    return PAIR_START_FACTOR * model.start_s


@dataclass(frozen=True)
class Selection:
    rows: Tuple[Regime, ...]  # kept, in run order
    skipped: Tuple[Tuple[str, str], ...]  # (row key, why)
    estimate_s: float  # kept rows + the engine pair start of each of their models


def select(grid: Sequence[Regime], *, models: Optional[Sequence[str]] = None,
           rows: Optional[Sequence[str]] = None, budget_s: float = 0.0,
           model_table: Sequence[Model] = MODELS, repeats: int = 1, backend: Optional[str] = None,
           engines: int = 2) -> Selection:
    """The rows to run: those of ``models`` (names) and ``rows`` (row names, or model/row
    keys) whose model serves on ``backend`` (None: every row), then, under a ``budget_s`` (0:
    none), the most important that fit the estimate.

    Dropping goes from the lowest priority up and, within one, from the most expensive row; a
    model left without rows costs no start. Run order stays the grid's order (grouped by model:
    each model's two engines start once).
    """
    by_name = {m.name: m for m in model_table}
    unknown = [m for m in (models or ()) if m not in by_name]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; known: {', '.join(by_name)}")
    names = {r.name for r in grid} | {r.key for r in grid}
    bad = [r for r in (rows or ()) if r not in names]
    if bad:
        raise ValueError(f"--rows: unknown {bad}; known: {', '.join(sorted({r.name for r in grid}))}")
    kept = [r for r in grid if (not models or r.model in models)
            and (not rows or r.name in rows or r.key in rows)]
    if repeats < 1:
        raise ValueError(f"--repeats={repeats} must be >= 1")
    skipped: List[Tuple[str, str]] = []
    for r in list(kept):
        allowed = by_name[r.model].backends
        if backend is not None and allowed is not None and backend not in allowed:
            kept.remove(r)
            skipped.append((r.key, f"{r.model} is served on {', '.join(allowed)} only, not {backend}"))
    cost = {r.key: estimate_s(r, by_name[r.model], repeats, engines) for r in kept}

    def total(sel: Sequence[Regime]) -> float:
        return sum(cost[r.key] for r in sel) + sum(start_s(by_name[m]) for m in {r.model for r in sel})

    if budget_s > 0:
        dropped: List[Regime] = []
        for r in sorted(kept, key=lambda r: (-r.priority, -cost[r.key])):
            if total(kept) <= budget_s:
                break
            kept.remove(r)
            dropped.append(r)
        # then, most important and cheapest first, any dropped row that fits the time left (an
        # expensive row dropped first can leave room for cheaper ones of its priority or below)
        order = {r.key: i for i, r in enumerate(grid)}
        for r in sorted(dropped, key=lambda r: (r.priority, cost[r.key])):
            if total(kept + [r]) <= budget_s:
                kept.append(r)
            else:
                skipped.append((r.key, f"estimated {cost[r.key]:.0f} s does not fit --time-budget-s {budget_s:g}"))
        kept.sort(key=lambda r: order[r.key])  # run order stays the grid's
    return Selection(tuple(kept), tuple(skipped), total(kept))


def models_of(rows: Sequence[Regime]) -> List[str]:
    """Models in first-appearance order."""
    return list(dict.fromkeys(r.model for r in rows))
