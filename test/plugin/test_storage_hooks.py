"""The storage hooks with SGLang's real objects on CPU: allocator swap, token budget, cache."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from granikv import plugin
from granikv.config import GraniKVConfig
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.radix_cache import GraniKVRadixCache

SIZE = 400


def _pools():
    kv = MHATokenToKVPool(SIZE, page_size=1, dtype=torch.float16, head_num=2, head_dim=8,
                          layer_num=2, device="cpu", enable_memory_saver=False)
    req = ReqToTokenPool(size=6, max_context_len=64, device="cpu", enable_memory_saver=False)
    stock = TokenToKVPoolAllocator(SIZE, torch.float16, "cpu", kv, need_sort=False)
    return kv, req, stock


def _configurator(enable: bool, *, draft: bool = False):
    sa = SimpleNamespace(_granikv=GraniKVConfig(enable=enable, hot_fraction=0.25))
    return SimpleNamespace(server_args=sa, is_draft_worker=draft)


def _build(enable, **kw):
    kv, req, stock = _pools()
    conf = _configurator(enable, **kw)
    got = plugin._after_build_allocator(stock, conf, sizes=None, token_to_kv_pool=kv,
                                        is_dsv4_model=False, req_to_token_pool=req,
                                        token_to_kv_pool_allocator=None)
    return kv, req, stock, conf, got


def test_allocator_swap_keeps_the_pool_and_reserves_nothing():
    kv, req, stock, conf, alloc = _build(True)
    assert isinstance(alloc, GraniKVAllocator) and alloc.get_kvcache() is kv
    assert alloc.hot_capacity == SIZE // 4  # a cap on extents, not a carve-out
    assert alloc.available_size() == stock.available_size() == SIZE  # stock's token budget
    assert torch.equal(alloc.free_pages, stock.free_pages)
    assert alloc.hot_prefix_table.num_rows == req.req_to_token.shape[0]
    alloc.check_integrity()
    # SGLang's budget (max_total_num_tokens) is not touched: no configure hook
    assert "configure" not in plugin._TARGETS


def test_disabled_or_draft_workers_keep_sglangs_allocator():
    for enable, draft in ((False, False), (True, True)):
        *_, got = _build(enable, draft=draft)
        assert got is None  # AFTER hook: None keeps SGLang's own result


def test_unsupported_allocator_is_a_clear_startup_error():
    kv, req, stock = _pools()

    class PagedLike(TokenToKVPoolAllocator):
        pass

    odd = object.__new__(PagedLike)
    with pytest.raises(ValueError, match="replaces only SGLang's page-size-1 TokenToKVPoolAllocator, got PagedLike"):
        plugin._after_build_allocator(odd, _configurator(True), sizes=None, token_to_kv_pool=kv,
                                      is_dsv4_model=False, req_to_token_pool=req,
                                      token_to_kv_pool_allocator=None)

    class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):  # the name of SGLang's hybrid sliding-window allocator
        pass

    swa = object.__new__(SWATokenToKVPoolAllocator)
    with pytest.raises(ValueError, match="pass --disable-hybrid-swa-memory"):
        plugin._after_build_allocator(swa, _configurator(True), sizes=None, token_to_kv_pool=kv,
                                      is_dsv4_model=False, req_to_token_pool=req,
                                      token_to_kv_pool_allocator=None)


def _build_context(conf, req, alloc, tp_worker=None):
    """SGLang's cache-factory context from the fields the running release has (0.5.23 dropped
    ``effective_chunked_prefill_size``)."""
    params = CacheInitParams(disable=False, req_to_token_pool=req,
                             token_to_kv_pool_allocator=alloc, page_size=1)
    values = dict(server_args=conf.server_args, params=params, is_hybrid_swa=False,
                  is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
                  effective_chunked_prefill_size=None, tp_worker=tp_worker, model_config=None,
                  tp_size=1, tp_rank=0, tp_group=None)
    known = {f.name for f in dataclasses.fields(TreeCacheBuildContext)}
    return TreeCacheBuildContext(**{k: v for k, v in values.items() if k in known})


def test_registered_cache_factory_builds_the_granikv_cache():
    kv, req, stock, conf, alloc = _build(True)
    ctx = _build_context(conf, req, alloc)
    cache = plugin._make_radix_cache(ctx)
    assert isinstance(cache, GraniKVRadixCache)
    assert cache.hot_prefix_table is alloc.hot_prefix_table
    cache.check_integrity()
    off = TreeCacheBuildContext(**{**ctx.__dict__, "server_args": _configurator(False).server_args})
    with pytest.raises(ValueError, match="without --enable-granikv"):
        plugin._make_radix_cache(off)


def test_cache_factory_wires_the_pays_off_policy_to_the_backends_cost_model():
    from granikv.attention.cost.cost_model import CostModel
    from granikv.attention.dispatcher import Dispatcher
    from granikv.mem_cache.policy import PaysOffPolicy, SharedLongPrefixPolicy

    dispatcher = Dispatcher(CostModel.load(None, "NVIDIA H200"), num_q_heads=32, num_kv_heads=8,
                            head_dim=128, kv_dtype_bytes=2, num_layers=32)
    from granikv.attention import backend_registry

    runner = SimpleNamespace()
    backend_registry.register(runner, SimpleNamespace(dispatcher=dispatcher))  # as the attention hook does
    worker = SimpleNamespace(model_runner=runner)

    def build(tp_worker, **cfg):
        kv, req, stock, conf, alloc = _build(True)
        conf.server_args._granikv = GraniKVConfig(enable=True, **cfg)
        return plugin._make_radix_cache(_build_context(conf, req, alloc, tp_worker)).policy

    policy = build(worker)
    assert isinstance(policy, PaysOffPolicy) and policy.estimate.dispatcher is dispatcher
    assert policy.should_promote(16384, 64) and not policy.should_promote(1100, 3)
    assert isinstance(build(worker, hot_policy="threshold"), SharedLongPrefixPolicy)
    assert isinstance(build(None), SharedLongPrefixPolicy)  # no GraniKV backend: thresholds


def test_register_is_idempotent_per_process():
    from sglang.srt.mem_cache.registry import _RADIX_CACHE_REGISTRY

    plugin.register()
    plugin.register()  # SGLang may call load_plugins paths twice; no "already registered"
    assert plugin.CACHE_BACKEND_NAME in _RADIX_CACHE_REGISTRY
