import numpy as np
import pytest

from granikv.mem_cache.hot_pool import IntegrityError
from granikv.mem_cache.hot_prefix_table import HotPrefixTable


def test_set_clear_set_many():
    t = HotPrefixTable(9)
    t.set(3, 100, 17)
    t.set_many([1, 5, 8], [7, 9, 11], [2, 0, 37])
    assert t.get(3) == (100, 17) and t.get(5) == (0, 0) and t.get(8) == (11, 37)
    assert t.start_np.dtype == np.int64 and not hasattr(t, "start_dev")  # host-only
    t.check_integrity()
    t.clear(3)
    assert t.get(3) == (0, 0)
    assert t.length_np.tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 37]
    t.reset()
    assert not t.length_np.any() and not t.start_np.any()


def test_padding_row_is_protected():
    t = HotPrefixTable(4)
    with pytest.raises(ValueError, match="rows"):
        t.set(0, 1, 1)
    with pytest.raises(ValueError, match="rows"):
        t.set(4, 1, 1)


@pytest.mark.parametrize("plant, match", [
    (lambda t: t.start_np.__setitem__(0, 3), "padding row 0"),
    (lambda t: t.length_np.__setitem__(2, -1), "negative length"),
    (lambda t: t.length_np.__setitem__(2, 0), "start but no length"),
    (lambda t: setattr(t, "rows_held", 0), "rows_held 0, but 1 rows"),
])
def test_integrity_detects_planted_faults(plant, match):
    t = HotPrefixTable(4)
    t.set(2, 5, 6)
    t.check_integrity()
    plant(t)
    with pytest.raises(IntegrityError, match=match):
        t.check_integrity()


def test_rows_held_counts_the_rows_with_a_hot_run():
    t = HotPrefixTable(9)
    assert t.rows_held == 0
    t.set(3, 100, 17)
    t.set(3, 200, 5)  # a new run of a held row: still one
    assert t.rows_held == 1
    t.set_many([1, 5, 8], [7, 9, 11], [2, 0, 37])
    assert t.rows_held == 3
    t.set_many([4, 4, 1], [6, 8, 0], [3, 5, 0])  # row 4 given twice counts once; row 1 cleared
    assert t.get(1) == (0, 0) and t.get(4)[1] in (3, 5) and t.rows_held == 3
    t.check_integrity()
    t.clear(8)
    t.clear(8)
    assert t.rows_held == 2
    t.reset()
    assert t.rows_held == 0
    t.check_integrity()


def test_one_row_writes_match_the_array_path():
    """``set`` / ``clear`` / one-row ``set_many`` take the scalar path, several rows the array
    path: the same table, ``version`` and ``rows_held`` as a plain model of both, on random ops
    (no-op writes leave ``version`` alone)."""
    rng = np.random.default_rng(0)
    t, model, version = HotPrefixTable(12), {}, 0
    for _ in range(2000):
        k = int(rng.integers(1, 4))
        rows = [int(x) for x in rng.choice(np.arange(1, 12), size=k, replace=False)]
        starts = [int(x) for x in rng.integers(0, 4, size=k)]
        lengths = [int(x) for x in rng.integers(0, 3, size=k)]
        op = int(rng.integers(0, 3))
        if op == 0 and k == 1:
            t.set(rows[0], starts[0], lengths[0])
        elif op == 1:
            t.clear(rows[0])
            starts, lengths, rows = [0], [0], rows[:1]
        else:
            t.set_many(rows, starts, lengths)
        new = {r: ((s if n > 0 else 0), n) for r, s, n in zip(rows, starts, lengths)}
        version += any(model.get(r, (0, 0)) != v for r, v in new.items())
        model.update(new)
        assert t.version == version
        assert [t.get(r) for r in range(12)] == [model.get(r, (0, 0)) for r in range(12)]
        assert t.rows_held == sum(1 for _, n in model.values() if n)
    t.check_integrity()
    with pytest.raises(ValueError, match="rows must be in"):
        t.set(12, 1, 1)
