import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from granikv.mem_cache.allocator import GraniKVAllocator, hot_layout
from granikv.mem_cache.hot_pool import IntegrityError


def _kv(size):
    return MHATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=4,
                            layer_num=1, device="cpu", enable_memory_saver=False)


def _alloc(size=101, frac=0.3, **kw):
    return GraniKVAllocator(size, torch.bfloat16, "cpu", _kv(size), False, hot_fraction=frac, **kw)


def test_layout_puts_hot_at_the_top():
    a = _alloc(101, 0.3)
    assert (a.hot_base, a.hot_capacity) == (72, 30) and a.hot_base + a.hot_capacity == 102
    assert a.available_size() == a.cold_capacity == 71  # COLD only
    assert torch.equal(a.free_pages, torch.arange(1, 72))
    assert (a.hot_pool.base, a.hot_pool.capacity) == (72, 30)
    assert hot_layout(100, 0.0) == (101, 0)
    with pytest.raises(ValueError):
        hot_layout(100, 1.0)


def test_alloc_free_stay_cold():
    a = _alloc()
    got = a.alloc(71)
    assert got is not None and int(got.max()) < a.hot_base
    assert a.alloc(1) is None  # HOT capacity never serves a request
    a.free(got[:10])
    assert a.available_size() == 10
    a.check_integrity()


def test_free_group_and_clear():
    a = _alloc()
    x, y = a.alloc(5), a.alloc(7)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == 71 - 12
    a.check_integrity()  # free-group entries are counted as free, not leaked
    a.free_group_end()
    assert a.available_size() == 71
    a.hot_pool.alloc(9)
    a.clear()
    assert a.available_size() == 71 and a.hot_pool.free_size == 30


def test_debug_check_rejects_hot_slots():
    a = _alloc(debug_checks=True)
    with pytest.raises(AssertionError, match="HOT slots"):
        a.free(torch.tensor([3, a.hot_base], dtype=torch.int64))


def test_integrity_detects_double_free_and_hot_in_cold_list():
    a = _alloc()
    a.free(a.free_pages[:1].clone())
    with pytest.raises(IntegrityError, match="free twice"):
        a.check_integrity()
    a.clear()
    a.free_pages = torch.cat([a.free_pages, torch.tensor([a.hot_base])])
    with pytest.raises(IntegrityError, match="outside"):
        a.check_integrity()


def test_from_stock_and_resize():
    kv = _kv(64)
    stock = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", kv, need_sort=True)
    a = GraniKVAllocator.from_stock(stock, hot_fraction=0.25)
    assert (a.size, a.need_sort, a.get_kvcache()) == (64, True, kv)
    assert (a.hot_base, a.hot_capacity) == (49, 16)
    a.resize(type("Cfg", (), {"max_total_num_tokens": 40})())
    assert (a.hot_base, a.hot_capacity, a.available_size()) == (31, 10, 30)
    with pytest.raises(ValueError, match="TokenToKVPoolAllocator"):
        GraniKVAllocator.from_stock(a, hot_fraction=0.25)
