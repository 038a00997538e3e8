"""GraniKV's SGLang entry point: every hook into SGLang lives in this module, nothing else does.

SGLang calls :func:`register` in every process (launcher, Engine, each scheduler) through the
``sglang.srt.plugins`` entry point. Hooks are pass-through unless ``--enable-granikv`` is set
(``server_args._granikv.enable``), so an installed-but-disabled GraniKV changes nothing: same
allocator class, same radix cache, same attention backend.

Hook map (SGLang 0.5.17 and 0.5.23; what differs between them lives in ``sglang_compat``):

    ServerArgs.add_cli_args                        AFTER   add --enable-granikv, --granikv-*
    ServerArgs.from_cli_args                       AROUND  flags -> GraniKVConfig on server_args._granikv
    ServerArgs.__init__ (0.5.17)                   AROUND  same for Engine(enable_granikv=True, granikv_*=...)
    Engine.server_args_class (0.5.23)              factory same (a msgspec ServerArgs has no __init__ to hook)
    KVCacheConfigurator._build_token_to_kv_pool_allocator
                                                   AFTER   stock allocator -> GraniKVAllocator (HOT + COLD)
    KVCacheConfigurator._profile_available_bytes   AFTER   reserve GraniKV's prefill workspace first
    register_radix_cache_backend("granikv")        registry GraniKVRadixCache
    _build_full_attention_backend_from_str         AROUND  wrap the stock backend in GraniKVAttnBackend
    DecodeCudaGraphRunner.capture_one_shape        AROUND  stock graph, then the cascade graph of that size
    DecodeCudaGraphRunner.load_batch               AROUND  replay the cascade graph when the plan chose it
    DecodeCudaGraphRunner.capture                  AFTER   log which sizes have a cascade graph
    Scheduler.run_batch                            BEFORE  promotions, per-request HOT table, plan staging
    Scheduler._apply_war_barrier                   AROUND  coarse barrier when a replay reads req_to_token
    Scheduler.get_internal_state                   AFTER   GraniKV counters in server info
"""

import argparse
import functools
import importlib
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Type

from granikv import sglang_compat as compat
from granikv.config import GraniKVConfig, is_granikv_key
from granikv.server_settings import CACHE_BACKEND_NAME, apply_to_server_kwargs, config_from_flags, version_gate

if TYPE_CHECKING:  # the hooks import these lazily: register() loads nothing of SGLang's
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.server_args import ServerArgs

    from granikv.attention.backend import GraniKVAttnBackend
    from granikv.mem_cache.allocator import GraniKVAllocator
    from granikv.mem_cache.policy import PromotionPolicy
    from granikv.mem_cache.radix_cache import GraniKVRadixCache

logger = logging.getLogger("granikv")

_SA = "sglang.srt.server_args.ServerArgs"
_DGR = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_TARGETS = {
    "add_cli_args": f"{_SA}.add_cli_args",
    "from_cli_args": f"{_SA}.from_cli_args",
    "server_args_init": f"{_SA}.__init__",
    "allocator": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    "._build_token_to_kv_pool_allocator",
    "profile_kv": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    "._profile_available_bytes",
    "attn_backend": "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
    "._build_full_attention_backend_from_str",
    "capture_one_shape": f"{_DGR}.capture_one_shape",
    "load_batch": f"{_DGR}.load_batch",
    "graph_capture": f"{_DGR}.capture",
    "run_batch": "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "war_barrier": "sglang.srt.managers.scheduler.Scheduler._apply_war_barrier",
    "internal_state": "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
}


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): registers hooks, does nothing else."""
    from sglang.srt.mem_cache.registry import _RADIX_CACHE_REGISTRY, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = [
        ("add_cli_args", _after_add_cli_args, HookType.AFTER),
        ("from_cli_args", _around_from_cli_args, HookType.AROUND),
        ("allocator", _after_build_allocator, HookType.AFTER),
        ("profile_kv", _after_profile_available_bytes, HookType.AFTER),
        ("attn_backend", _around_build_attn_backend, HookType.AROUND),
        ("capture_one_shape", _around_capture_one_shape, HookType.AROUND),
        ("load_batch", _around_load_batch, HookType.AROUND),
        ("graph_capture", _after_graph_capture, HookType.AFTER),
        ("run_batch", _before_run_batch, HookType.BEFORE),
        ("war_barrier", _around_apply_war_barrier, HookType.AROUND),
        ("internal_state", _after_get_internal_state, HookType.AFTER),
    ]
    if not compat.SERVER_ARGS_IS_STRUCT:
        hooks.append(("server_args_init", _around_server_args_init, HookType.AROUND))
    for key, fn, kind in hooks:
        HookRegistry.register(_TARGETS[key], fn, kind)
    compat.install_engine_server_args(_build_engine_server_args)
    if CACHE_BACKEND_NAME not in _RADIX_CACHE_REGISTRY:
        register_radix_cache_backend(CACHE_BACKEND_NAME, _make_radix_cache)


# ---- configuration -------------------------------------------------------------------------


def config_of(server_args: Any) -> Optional[GraniKVConfig]:
    """The GraniKV config carried by ``server_args`` if GraniKV is enabled, else None."""
    cfg = getattr(server_args, "_granikv", None)
    return cfg if cfg is not None and cfg.enable else None


@functools.lru_cache(maxsize=None)
def _per_step(module: str) -> ModuleType:
    """A GraniKV module that a per-step hook calls into: imported by the first call (so
    ``register`` loads nothing of SGLang's) and held. An import statement in the hook's body
    would cost about 0.6 µs on every decode step."""
    return importlib.import_module(module)


def _log_enabled(cfg: GraniKVConfig) -> None:
    if cfg.enable:
        logger.info("GraniKV enabled on SGLang %s: %s", compat.sglang_version(), cfg)


def _after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    from granikv.config import add_cli_args

    add_cli_args(parser)


def _around_from_cli_args(orig: Callable[..., "ServerArgs"], cls: Type["ServerArgs"],
                          args: argparse.Namespace) -> "ServerArgs":
    """Command line -> ``server_args._granikv``. An invalid GraniKV value ends the launcher
    with one line, ``error: --granikv-hot-fraction=2.0 is outside [0.0, 1.0]``, and exit
    status 2 (argparse's convention for usage errors), not a traceback."""
    try:
        cfg = version_gate(config_from_flags(vars(args)))
        apply_to_server_kwargs(cfg, lambda k: getattr(args, k, None),
                                lambda k, v: setattr(args, k, v))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    server_args = orig(cls, args)
    server_args._granikv = cfg
    _log_enabled(cfg)
    return server_args


def _around_server_args_init(orig: Callable[..., None], self: "ServerArgs", *args: Any,
                             **kwargs: Any) -> None:
    """``ServerArgs(**kwargs)`` as ``sglang.Engine(**kwargs)`` builds it: GraniKV keywords
    (``enable_granikv``, ``granikv_*``) are taken out, validated and attached as ``_granikv``.
    (``Engine.__init__`` itself cannot be hooked: it loads the plugins.)"""
    given = any(is_granikv_key(k) for k in kwargs)
    cfg = _take_granikv_kwargs(kwargs)
    orig(self, *args, **kwargs)
    if getattr(self, "_granikv", None) is None or given:
        self._granikv = cfg
        _log_enabled(cfg)


def _build_engine_server_args(server_args_class: Callable[..., "ServerArgs"], **kwargs: Any) -> "ServerArgs":
    """``Engine(**kwargs)``'s ServerArgs where it is a msgspec Struct (no ``__init__`` hook):
    the GraniKV keywords are taken out, validated and attached as ``_granikv``."""
    cfg = _take_granikv_kwargs(kwargs)
    server_args = server_args_class(**kwargs)
    server_args._granikv = cfg
    _log_enabled(cfg)
    return server_args


def _take_granikv_kwargs(kwargs: Dict[str, Any]) -> GraniKVConfig:
    """Pops the GraniKV keywords off ServerArgs keywords, validates them (version gate
    included) and sets what GraniKV needs from SGLang in the rest."""
    values = {k: kwargs.pop(k) for k in list(kwargs) if is_granikv_key(k)}
    cfg = version_gate(config_from_flags(values))
    apply_to_server_kwargs(cfg, kwargs.get, kwargs.__setitem__)
    return cfg


# ---- storage -------------------------------------------------------------------------------


def _after_build_allocator(result: "BaseTokenToKVPoolAllocator", configurator: "KVCacheConfigurator",
                           **kw: Any) -> Optional["GraniKVAllocator"]:
    cfg = config_of(configurator.server_args)
    if cfg is None or configurator.is_draft_worker or kw.get("token_to_kv_pool_allocator"):
        return None
    from granikv.mem_cache.allocator import GraniKVAllocator

    # from_stock raises a ValueError naming the class for anything but SGLang's page-size-1
    # TokenToKVPoolAllocator (hybrid / SWA / NPU / paged pools): a clear startup error.
    allocator = GraniKVAllocator.from_stock(result, hot_fraction=cfg.hot_fraction,
                                            debug_checks=cfg.debug_integrity)
    # The per-request HOT table lives beside the allocator: the cache (scheduler) writes it,
    # the attention backend (model runner) reads it; both reach the allocator.
    req_to_token_pool = kw["req_to_token_pool"]
    allocator.ensure_hot_prefix_table(req_to_token_pool.req_to_token.shape[0])
    # HOT extents come out of the same free slots as requests' KV: SGLang's token budget
    # (max_total_num_tokens) stays the whole pool, as stock.
    logger.info("GraniKV allocator: %d KV slots shared by COLD and HOT (HOT capped at %d)",
                allocator.size, allocator.hot_capacity)
    return allocator


def _after_profile_available_bytes(result: int, configurator: "KVCacheConfigurator", *args: Any,
                                   **kw: Any) -> Optional[int]:
    """The bytes SGLang will size the KV pool from, less GraniKV's prefill workspace, which is
    allocated here (before the pool) when the prefill backend has none of its own."""
    cfg = config_of(configurator.server_args)
    model = getattr(configurator, "model", None)  # holds the reservation (the configurator is slotted)
    if cfg is None or configurator.is_draft_worker or configurator.device != "cuda" or model is None:
        return None
    from granikv.attention.extend import workspace as extend_workspace

    if not extend_workspace.needs_own_workspace(configurator.server_args, cfg):
        return None
    import torch

    device = torch.device("cuda", getattr(configurator, "gpu_id", None) or 0)
    reserved = extend_workspace.reserve(model, device)
    return result - reserved if reserved else None


def _make_radix_cache(ctx: "TreeCacheBuildContext") -> "GraniKVRadixCache":
    from granikv.mem_cache.radix_cache import GraniKVRadixCache

    cfg = config_of(ctx.server_args)
    if cfg is None:
        raise ValueError(
            f"--radix-cache-backend={CACHE_BACKEND_NAME} is set without --enable-granikv"
        )
    allocator = ctx.params.token_to_kv_pool_allocator
    return GraniKVRadixCache(ctx.params, cfg, allocator.get_kvcache(), allocator.hot_prefix_table,
                             policy=_promotion_policy(ctx, cfg))


def _promotion_policy(ctx: "TreeCacheBuildContext", cfg: GraniKVConfig) -> "PromotionPolicy":
    """``--granikv-hot-policy``: pays_off asks the attention layer's cost model (through the
    model runner's GraniKV backend, built before the cache) what a promotion is worth."""
    from granikv.attention import backend_registry
    from granikv.mem_cache.policy import PaysOffPolicy, SharedLongPrefixPolicy

    dispatcher = backend_registry.dispatcher_of(compat.model_runner_of_cache_context(ctx))
    if cfg.hot_policy == "threshold" or dispatcher is None:
        if cfg.hot_policy != "threshold":
            logger.warning("GraniKV: no GraniKV attention backend found; promotion policy "
                           "falls back to the length / sharers thresholds")
        return SharedLongPrefixPolicy.from_config(cfg)
    from granikv.attention.promotion_estimate import PromotionEstimate

    policy = PaysOffPolicy.from_config(cfg, PromotionEstimate.from_config(dispatcher, cfg))
    logger.info("GraniKV promotion policy: %r", policy)
    return policy


# ---- attention -----------------------------------------------------------------------------


def _around_build_attn_backend(orig: Callable[..., "AttentionBackend"], *, model_runner: "ModelRunner",
                               backend_str: str, init_new_workspace: bool) -> "AttentionBackend":
    inner = orig(model_runner=model_runner, backend_str=backend_str,
                 init_new_workspace=init_new_workspace)
    cfg = config_of(model_runner.server_args)
    if cfg is None or getattr(model_runner, "is_draft_worker", False):
        return inner
    from granikv.attention import backend_registry
    from granikv.attention.backend import GraniKVAttnBackend

    def build_inner() -> "AttentionBackend":  # a hybrid model's second instance (decode/layer_paths.py)
        return orig(model_runner=model_runner, backend_str=backend_str, init_new_workspace=True)

    backend = GraniKVAttnBackend.wrap(inner, model_runner=model_runner, cfg=cfg,
                                      backend_name=backend_str, build_inner=build_inner)
    if isinstance(backend, GraniKVAttnBackend):  # the scheduler stages every wrapped instance
        backend_registry.register(model_runner, backend)
    return backend


# ---- decode CUDA graphs (graph_variants.py) ---------------------------------------------------


def _graph_backend(runner: "DecodeCudaGraphRunner") -> Optional["GraniKVAttnBackend"]:
    """The GraniKV backend a decode graph runner captures / replays, or None (stock)."""
    backend = getattr(runner, "attn_backend", None)
    if backend is None or getattr(runner, "enable_pdmux", False):
        return None
    return backend if isinstance(backend, _per_step("granikv.attention.backend").GraniKVAttnBackend) else None


def _around_capture_one_shape(orig: Callable[..., Any], runner: "DecodeCudaGraphRunner", size: int,
                              forward: Callable[..., Any], stream_idx: Optional[int] = None,
                              variant_label: Optional[str] = None, *more: Any, **kwargs: Any) -> Any:
    """SGLang's capture of one size (the stock graph), then GraniKV's cascade graph of that
    size under the label ``graph_variants.cascade_label(variant_label)`` where it can pay.
    ``more`` / ``kwargs``: what a release passes after the label (0.5.23: ``attention_variant``),
    handed to both captures unchanged."""
    out = orig(runner, size, forward, stream_idx, variant_label, *more, **kwargs)
    backend = _graph_backend(runner)
    if backend is None or getattr(runner, "ragged_verify_mode", False) or not backend.graphs.wants_cascade(size):
        return out
    from granikv.attention.decode.graph_variants import cascade_label

    backend.graphs.begin_capture(size)
    ok = False
    try:
        orig(runner, size, forward, stream_idx, cascade_label(variant_label), *more, **kwargs)
        ok = True
    finally:
        backend.graphs.end_capture(ok)
    return out


def _around_load_batch(orig: Callable[..., Any], runner: "DecodeCudaGraphRunner", forward_batch: "ForwardBatch",
                       *args: Any, **kwargs: Any) -> Any:
    """After SGLang's ``load_batch`` (which runs the backend's plan): the cascade graph's key
    when the plan chose cascade, else SGLang's (stock) key. The choice is reset first: a
    pre-planned batch (``load_batch`` returns before planning; SGLang pre-plans speculative
    batches only, which GraniKV does not serve) replays the stock graph, never the cascade
    graph on a previous step's plan."""
    backend = _graph_backend(runner)
    if backend is not None:
        backend.graphs.planned_cascade = False
    out = orig(runner, forward_batch, *args, **kwargs)
    key = getattr(runner, "_replay_graph_key", None)
    if backend is not None and key is not None:
        runner._replay_graph_key = backend.graphs.replay_key(key)
    return out


def _after_graph_capture(result: None, runner: "DecodeCudaGraphRunner", *args: Any, **kwargs: Any) -> None:
    backend = _graph_backend(runner)
    if backend is not None:
        logger.info("GraniKV decode CUDA graphs: %s", backend.graphs.summary())
    return None


# ---- scheduler step ------------------------------------------------------------------------


def _before_run_batch(scheduler: "Scheduler", batch: "ScheduleBatch", *args: Any, **kwargs: Any) -> None:
    cfg = config_of(scheduler.server_args)
    if cfg is None:
        return None
    _per_step("granikv.scheduler_step").on_run_batch(scheduler, batch, cfg)
    return None


def _around_apply_war_barrier(orig: Callable[..., Any], scheduler: "Scheduler", *args: Any, **kwargs: Any) -> Any:
    """Where this step's cascade replay reads ``req_to_token`` (no pre-replay slot copy), after
    SGLang's early read-done event: make SGLang wait for the whole forward (war_barrier.py)."""
    if config_of(scheduler.server_args) is not None:
        _per_step("granikv.war_barrier").drop_early_read_done(scheduler)
    return orig(scheduler, *args, **kwargs)


def _after_get_internal_state(result: Any, scheduler: "Scheduler", *args: Any, **kwargs: Any) -> None:
    """Adds GraniKV's counters to ``GetInternalStateReqOutput.internal_state`` (server info)."""
    state = getattr(result, "internal_state", result)
    if isinstance(state, dict) and config_of(scheduler.server_args) is not None:
        from granikv.scheduler_step import metrics_snapshot

        state["granikv"] = metrics_snapshot(scheduler)
    return None
