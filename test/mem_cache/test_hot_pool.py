import pytest

from granikv.mem_cache.hot_pool import HotPool, IntegrityError, Move


def test_alloc_is_best_fit_and_lowest_start_on_ties():
    pool = HotPool(100, 60)
    a, b, c, d = pool.alloc(10), pool.alloc(7), pool.alloc(17), pool.alloc(5)
    assert (a, b, c, d) == (100, 110, 117, 134)
    pool.free(b, 7)  # hole of 7 at 110
    pool.free(d, 5)  # hole of 5 at 134 coalesces with the tail hole [134, 160)
    assert pool.holes() == [(110, 7), (134, 26)]
    assert pool.alloc(6) == 110  # the 7-hole fits best
    assert pool.alloc(1) == 116  # the 1-slot remainder is an exact fit
    pool.check_integrity()


def test_alloc_returns_none_when_no_hole_fits():
    pool = HotPool(1, 37)
    assert pool.alloc(37) == 1
    assert pool.alloc(1) is None
    assert HotPool(5, 0).alloc(1) is None
    with pytest.raises(ValueError):
        pool.alloc(0)


def test_free_coalesces_both_sides():
    pool = HotPool(0, 30)
    starts = [pool.alloc(10) for _ in range(3)]
    pool.free(starts[0], 10)
    pool.free(starts[2], 10)
    assert len(pool.holes()) == 2
    pool.free(starts[1], 10)
    assert pool.holes() == [(0, 30)] and pool.free_size == 30
    pool.check_integrity()


def test_free_of_wrong_extent_asserts():
    pool = HotPool(0, 30)
    s = pool.alloc(10)
    with pytest.raises(AssertionError):
        pool.free(s, 9)
    with pytest.raises(AssertionError):
        pool.free(s + 1, 9)


def test_split_then_free_halves_separately():
    pool = HotPool(10, 50)
    s = pool.alloc(17)
    second = pool.split(s, 5)
    assert second == s + 5 and pool.extents() == {s: 5, s + 5: 12}
    pool.check_integrity()
    pool.free(second, 12)
    pool.free(s, 5)
    assert pool.holes() == [(10, 50)]
    with pytest.raises(AssertionError):
        pool.split(pool.alloc(4), 4)


def test_compaction_plan_slides_unlocked_extents_down():
    pool = HotPool(0, 100)
    a, b, c, d = (pool.alloc(n) for n in (10, 20, 15, 5))  # 0, 10, 30, 45
    pool.free(a, 10)
    pool.free(c, 15)  # extents: b@10, d@45
    plan = pool.compaction_plan(locked_starts=[])
    assert plan.moves == [Move(10, 0, 20), Move(45, 20, 5)] and plan.largest_hole == 75
    for mv in plan.moves:
        pool.apply_move(mv)
    assert pool.extents() == {0: 20, 20: 5} and pool.holes() == [(25, 75)]
    pool.check_integrity()


def test_compaction_keeps_locked_extents_in_place():
    pool = HotPool(0, 60)
    a, b, c = pool.alloc(10), pool.alloc(10), pool.alloc(10)  # 0, 10, 20
    pool.free(a, 10)
    plan = pool.compaction_plan(locked_starts=[b])
    assert plan.moves == [] and plan.largest_hole == 30  # c@20 is already against b
    plan = pool.compaction_plan(locked_starts=[])
    assert plan.moves == [Move(10, 0, 10), Move(20, 10, 10)] and plan.largest_hole == 40


def test_integrity_catches_corruption():
    pool = HotPool(0, 20)
    pool.alloc(5)
    pool._extents[3] = 4  # overlaps the first extent
    with pytest.raises(IntegrityError, match="overlap"):
        pool.check_integrity()


def test_stats():
    pool = HotPool(0, 20)
    pool.alloc(5)
    st = pool.stats()
    assert (st.used, st.free, st.num_extents, st.largest_hole) == (5, 15, 1, 15)


def test_alloc_at_carves_exact_slots_out_of_a_hole():
    pool = HotPool(10, 50)  # [10, 60)
    assert pool.alloc_at(20, 5)  # middle of the hole: two holes remain
    assert pool.holes() == [(10, 10), (25, 35)]
    assert pool.alloc_at(10, 10)  # a whole hole
    assert pool.alloc_at(55, 5)  # the end of a hole
    assert pool.holes() == [(25, 30)]
    assert not pool.alloc_at(50, 6)  # runs into the extent at 55
    assert not pool.alloc_at(22, 3)  # inside an extent
    assert not pool.alloc_at(5, 2)  # below the range
    assert pool.extents() == {20: 5, 10: 10, 55: 5}
    pool.check_integrity()
    with pytest.raises(ValueError, match="n >= 1"):
        pool.alloc_at(30, 0)


# ---- property: random alloc / free / split / compaction against a slot-set model ------------

import os  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc_at", "free", "split", "compact"]),
                          st.integers(1, 40), st.integers(0, 1000)), max_size=60)


@settings(max_examples=1000 if os.environ.get("GRANIKV_SLOW_TESTS") == "1" else 150,
          derandomize=os.environ.get("GRANIKV_SLOW_TESTS") != "1", deadline=None, database=None)
@given(ops=_OPS)
def test_hot_pool_random_ops_match_model(ops):
    pool = HotPool(7, 97)
    model = {}  # start -> length, the allocated extents as the caller sees them
    for op, n, pick in ops:
        starts = sorted(model)
        if op == "alloc":
            s = pool.alloc(n)
            if s is None:
                assert pool.largest_hole() < n
            else:
                assert all(s + n <= t or t + model[t] <= s for t in starts)
                model[s] = n
        elif op == "alloc_at":
            s = pool.base + pick % pool.capacity
            taken = any(t < s + n and s < t + model[t] for t in starts)
            fits = s + n <= pool.end and not taken
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
        elif op == "compact":
            locked = {t for i, t in enumerate(starts) if (pick >> (i % 10)) & 1}
            plan = pool.compaction_plan(locked)
            for mv in plan.moves:
                assert mv.src not in locked and mv.dst < mv.src
                pool.apply_move(mv)
                model[mv.dst] = model.pop(mv.src)
            assert pool.largest_hole() == plan.largest_hole
        pool.check_integrity()
        assert pool.extents() == model
