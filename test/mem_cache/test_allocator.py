import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from granikv.mem_cache.allocator import GraniKVAllocator, hot_cap
from granikv.mem_cache.hot_pool import IntegrityError


def _kv(size):
    return MHATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=4,
                            layer_num=1, device="cpu", enable_memory_saver=False)


def _alloc(size=101, frac=0.3, **kw):
    return GraniKVAllocator(size, torch.bfloat16, "cpu", _kv(size), False, hot_fraction=frac, **kw)


def test_fresh_allocator_is_stock_with_a_cap():
    a = _alloc(101, 0.3)
    stock = TokenToKVPoolAllocator(101, torch.bfloat16, "cpu", _kv(101), need_sort=False)
    assert torch.equal(a.free_pages, stock.free_pages)
    assert a.available_size() == stock.available_size() == 101  # nothing reserved
    assert (a.hot_capacity, a.hot_used, a.hot_room()) == (30, 0, 30)
    assert hot_cap(100, 0.0) == 0 and hot_cap(100, 1.0) == 100
    with pytest.raises(ValueError):
        hot_cap(100, 1.5)
    got = a.alloc(101)  # every slot can serve requests
    assert got is not None and a.alloc(1) is None
    a.check_integrity()


def test_take_range_only_when_free_and_free_extent_gives_it_back():
    a = _alloc()
    held = a.alloc(10)  # slots 1..10
    assert not a.take_range(8, 5)  # 8..10 are held
    assert a.take_range(20, 7)
    assert a.available_size() == 101 - 10 - 7 and a.hot_used == 7
    assert not a.take_range(25, 3)  # overlaps the extent
    free = a.free_slots()
    assert not bool(((free >= 20) & (free < 27)).any())
    a.check_integrity()
    a.free_extent(20, 7)
    a.free(held)
    assert a.available_size() == 101 and a.hot_used == 0
    a.check_integrity()


def test_take_range_with_owned_slots_after_and_adopt():
    a = _alloc()
    held = a.alloc(30)  # slots 1..30; 21..30: a node's own, contiguous
    a.free(held[14:20])  # 15..20 free again
    assert not a.take_range(14, 7, owned_after=10)  # 14 is held
    assert a.take_range(15, 6, owned_after=10)  # head 15..20 free, node 21..30 owned
    assert a.hot_pool.extents() == {15: 16} and a.available_size() == 101 - 30
    a.check_integrity()
    a.adopt_extent(40, 5)  # the caller's own slots (here: free ones, to see the check fire)
    with pytest.raises(IntegrityError, match="inside HOT extents"):
        a.check_integrity()


def test_take_window_returns_lowest_free_slots_outside():
    a = _alloc(40, 1.0)
    a.alloc(40)
    a.free(torch.tensor([3, 4, 9, 11, 12, 13, 30], dtype=torch.int64))
    movable = torch.zeros(41, dtype=torch.bool)
    movable[[10, 14]] = True  # e.g. unlocked COLD KV
    own = torch.zeros(41, dtype=torch.bool)
    w = a.find_window(5, movable, own)
    assert tuple(w) == (9, 1)  # [9, 14): 9, 11, 12, 13 free, 10 movable
    own[[5, 6, 7, 8]] = True  # a promoted node's own slots: usable with no move
    assert tuple(a.find_window(5, movable, own)) == (3, 0)  # [3, 8): 3, 4 free, 5..7 own
    dst = a.take_window(w, 5)
    assert dst.tolist() == [3]
    assert sorted(a.free_slots().tolist()) == [4, 30]
    assert a.hot_pool.extents() == {9: 5}


def test_hot_cap_is_checked():
    a = _alloc(101, 0.05)  # cap 5
    a.take_range(50, 5)
    a.check_integrity()
    a.adopt_extent(60, 1)
    with pytest.raises(IntegrityError, match="over the cap"):
        a.check_integrity()


def test_free_group_and_clear():
    a = _alloc()
    x, y = a.alloc(5), a.alloc(7)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == 101 - 12
    a.check_integrity()  # free-group entries are counted as free, not leaked
    a.free_group_end()
    assert a.available_size() == 101
    a.take_range(40, 9)
    a.clear()
    assert a.available_size() == 101 and a.hot_used == 0


def test_debug_check_rejects_extent_slots():
    a = _alloc(debug_checks=True)
    a.take_range(50, 4)
    with pytest.raises(AssertionError, match="HOT extents"):
        a.free(torch.tensor([3, 52], dtype=torch.int64))


def test_integrity_detects_double_free_and_out_of_range():
    a = _alloc()
    a.free(a.free_pages[:1].clone())
    with pytest.raises(IntegrityError, match="free twice"):
        a.check_integrity()
    a.clear()
    a.free_pages = torch.cat([a.free_pages[1:], torch.tensor([0])])
    with pytest.raises(IntegrityError, match="outside"):
        a.check_integrity()


def test_from_stock_and_resize():
    kv = _kv(64)
    stock = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", kv, need_sort=True)
    a = GraniKVAllocator.from_stock(stock, hot_fraction=0.25)
    assert (a.size, a.need_sort, a.get_kvcache(), a.hot_capacity) == (64, True, kv, 16)
    a.take_range(10, 4)
    a.resize(type("Cfg", (), {"max_total_num_tokens": 40})())
    assert (a.hot_capacity, a.hot_used, a.available_size()) == (10, 0, 40)
    assert a.hot_pool.gaps() == [(1, 40)]
    with pytest.raises(ValueError, match="TokenToKVPoolAllocator"):
        GraniKVAllocator.from_stock(a, hot_fraction=0.25)
