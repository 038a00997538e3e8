import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from granikv.mem_cache.hot_pool import HotPool, IntegrityError


def test_alloc_at_records_exact_ranges_and_rejects_overlaps():
    pool = HotPool(100, 60)
    assert pool.alloc_at(110, 7) and pool.alloc_at(117, 17)
    assert not pool.alloc_at(105, 6)  # overlaps [110, 117)
    assert not pool.alloc_at(155, 6)  # leaves the range
    assert pool.extents() == {110: 7, 117: 17} and pool.used_size == 24
    assert pool.gaps() == [(100, 10), (134, 26)]
    assert pool.overlaps(133, 1) and not pool.overlaps(134, 26) and pool.overlaps(99, 1)
    pool.check_integrity()
    with pytest.raises(ValueError, match="n >= 1"):
        pool.alloc_at(140, 0)


def test_free_coalesces_both_sides():
    pool = HotPool(0, 30)
    for s in (0, 10, 20):
        assert pool.alloc_at(s, 10)
    pool.free(0, 10)
    pool.free(20, 10)
    assert len(pool.gaps()) == 2
    pool.free(10, 10)
    assert pool.gaps() == [(0, 30)] and pool.used_size == 0
    pool.check_integrity()


def test_free_of_wrong_extent_asserts():
    pool = HotPool(0, 30)
    pool.alloc_at(3, 10)
    with pytest.raises(AssertionError):
        pool.free(3, 9)
    with pytest.raises(AssertionError):
        pool.free(4, 9)


def test_split_then_free_halves_separately():
    pool = HotPool(10, 50)
    pool.alloc_at(10, 17)
    second = pool.split(10, 5)
    assert second == 15 and pool.extents() == {10: 5, 15: 12}
    pool.check_integrity()
    pool.free(second, 12)
    pool.free(10, 5)
    assert pool.gaps() == [(10, 50)]
    pool.alloc_at(20, 4)
    with pytest.raises(AssertionError):
        pool.split(20, 4)


def test_integrity_detects_planted_faults():
    pool = HotPool(0, 30)
    pool.alloc_at(5, 10)
    pool._extents[12] = 3  # overlaps [5, 15)
    with pytest.raises(IntegrityError, match="overlap"):
        pool.check_integrity()
    pool = HotPool(0, 30)
    pool.alloc_at(5, 10)
    pool._used += 1
    with pytest.raises(IntegrityError, match="used counter"):
        pool.check_integrity()
    pool = HotPool(0, 30)
    pool._gap_starts, pool._gap_lens = [0, 10], [10, 20]  # touching gaps
    with pytest.raises(IntegrityError, match="coalesced"):
        pool.check_integrity()


# ---- property: random alloc_at / free / split against a slot-set model ----------------------

_OPS = st.lists(st.tuples(st.sampled_from(["alloc_at", "free", "split"]),
                          st.integers(1, 40), st.integers(0, 1000)), max_size=60)


@settings(max_examples=1000 if os.environ.get("GRANIKV_SLOW_TESTS") == "1" else 150,
          derandomize=os.environ.get("GRANIKV_SLOW_TESTS") != "1", deadline=None, database=None)
@given(ops=_OPS)
def test_hot_pool_random_ops_match_model(ops):
    pool = HotPool(7, 97)
    model = {}  # start -> length, the extents as the caller sees them
    for op, n, pick in ops:
        starts = sorted(model)
        if op == "alloc_at":
            s = pool.base + pick % pool.span
            taken = any(t < s + n and s < t + model[t] for t in starts)
            fits = s + n <= pool.end and not taken
            assert pool.overlaps(s, n) == (not fits)
            assert pool.alloc_at(s, n) == fits
            if fits:
                model[s] = n
        elif op == "free" and starts:
            s = starts[pick % len(starts)]
            pool.free(s, model.pop(s))
        elif op == "split" and starts:
            s = starts[pick % len(starts)]
            if model[s] > 1:
                k = 1 + pick % (model[s] - 1)
                model[s + k] = model[s] - k
                model[s] = k
                pool.split(s, k)
        pool.check_integrity()
        assert pool.extents() == model
        assert pool.used_size == sum(model.values())
