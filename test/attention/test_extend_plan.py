"""plan_extend: which extend batches can take their prefix part from HOT extents, and how the
new tokens are grouped (synthetic batches; host numpy only)."""

import dataclasses

import numpy as np
import pytest

from granikv.attention.extend.plan import plan_extend
from granikv.attention.extend.hot_extend import check_call

I64 = np.int64


def _table(runs, rows=32):
    start, length = np.zeros(rows, I64), np.zeros(rows, I64)
    for row, (s, n) in runs.items():
        start[row], length[row] = s, n
    return start, length


def _plan(rows, prefix, new, runs, **kw):
    start, length = _table(runs)
    return plan_extend(np.array(rows, I64), np.array(prefix, I64), np.array(new, I64), start, length, **kw)


def test_docstring_example_groups_by_extent_and_length():
    # batch order: rows 3, 5, 7, 2, 9 (the module docstring's example)
    plan, reason = _plan([3, 5, 7, 2, 9], [512, 512, 0, 512, 300], [7, 5, 9, 4, 6],
                         {3: (100, 512), 5: (100, 512), 2: (100, 512), 9: (900, 300)})
    assert reason == "" and plan.num_tokens == 31
    assert plan.token_indptr.tolist() == [0, 7, 12, 21, 25, 31]  # request boundaries (the causal part)
    g0, g1 = plan.groups
    assert (g0.start, g0.length, g0.num_requests) == (100, 512, 3)
    assert g0.token_idx.tolist() == list(range(0, 12)) + list(range(21, 25)) and not g0.contiguous
    assert (g1.start, g1.length, g1.num_requests) == (900, 300, 1)
    assert g1.token_idx.tolist() == list(range(25, 31)) and g1.contiguous and g1.token_range == (25, 31)
    assert plan.hot_tokens == 22 and not plan.covers_all_tokens
    assert plan.prefix_pairs == 16 * 512 + 6 * 300


def test_one_shared_prefix_is_one_contiguous_call():
    plan, _ = _plan([1, 2, 3], [4096] * 3, [256, 256, 100], {r: (7, 4096) for r in (1, 2, 3)})
    (g,) = plan.groups
    assert g.contiguous and g.token_range == (0, 612) and plan.covers_all_tokens


def test_same_extent_different_lengths_are_different_groups():
    # a HOT node extended in place: one request matched A (len 100), another A+B (len 300)
    plan, _ = _plan([1, 2], [100, 300], [3, 4], {1: (50, 100), 2: (50, 300)})
    assert [(g.start, g.length) for g in plan.groups] == [(50, 100), (50, 300)]


def test_cold_prefix_parts_become_the_paged_remainder():
    # row 1: all HOT; row 2: HOT head (256) + 256 COLD tokens (an earlier turn); row 3: all COLD
    plan, reason = _plan([1, 2, 3], [512, 512, 300], [8, 4, 2], {1: (100, 512), 2: (100, 256)})
    assert reason == ""
    assert [(g.start, g.length, g.token_idx.tolist()) for g in plan.groups] == [
        (100, 512, list(range(8))), (100, 256, list(range(8, 12)))]
    rem = plan.paged
    assert rem.rows.tolist() == [2, 3] and rem.lo.tolist() == [256, 0] and rem.hi.tolist() == [512, 300]
    assert rem.token_idx.tolist() == list(range(8, 14)) and rem.qo_indptr.tolist() == [0, 4, 6]
    assert rem.kv_indptr.tolist() == [0, 256, 556]
    rows, cols = rem.slot_coords()
    assert rows.tolist() == [2] * 256 + [3] * 300
    assert cols.tolist() == list(range(256, 512)) + list(range(300))
    assert plan.hot_tokens == 12 and not plan.covers_all_tokens


def test_a_batch_with_no_hot_run_stays_stock():
    assert _plan([1, 2], [512, 40], [8, 8], {}) == (None, "no HOT prefix in the batch")


def test_no_cached_prefix_and_no_new_tokens():
    assert _plan([1, 2], [0, 0], [5, 5], {}) == (None, "no cached prefix")
    assert _plan([1], [64], [0], {1: (10, 64)}) == (None, "no new tokens")


def test_a_forest_of_extents_is_one_call_with_gap_entries():
    # 16 extents (no limit), batch order not slot order, gaps of different sizes, two adjacent
    n = 16
    starts = [10000 - 300 * r for r in range(1, n + 1)]
    starts[2] = starts[1] + 100  # row 3's extent right after row 2's
    runs = {r: (s, 100) for r, s in zip(range(1, n + 1), starts)}
    plan, reason = _plan(list(runs), [100] * n, [r % 3 + 1 for r in runs], runs)
    assert reason == "" and len(plan.groups) == n
    (call,) = plan.calls
    check_call(call, plan.groups)
    assert call.kv_lo == min(starts) and call.kv_hi == max(starts) + 100
    gaps = [kv for qo, kv in call.shapes if qo == 0]
    assert len(gaps) == n - 2  # rows 2 and 3 touch: no gap entry between them
    assert sum(gaps) == call.kv_hi - call.kv_lo - 100 * n
    assert sorted(call.token_idx.tolist()) == list(range(plan.num_tokens)) and not call.contiguous


def test_overlapping_extents_go_to_as_few_calls_as_the_overlap_depth():
    # extent [50, 350) at HOT lengths 100, 300 and 300 (two rows); a disjoint extent after it
    runs = {1: (50, 100), 2: (50, 300), 3: (50, 300), 4: (400, 64), 5: (900, 10)}
    plan, _ = _plan([1, 2, 3, 4, 5], [100, 300, 300, 64, 10], [3, 4, 2, 5, 1], runs)
    assert [(g.start, g.length) for g in plan.groups] == [(50, 100), (50, 300), (400, 64), (900, 10)]
    assert len(plan.calls) == 2
    for c in plan.calls:
        check_call(c, plan.groups)
    assert [[plan.groups[i].length for i in c.groups] for c in plan.calls] == [[100, 64, 10], [300]]
    a = plan.calls[0]
    assert a.shapes == ((3, 100), (0, 250), (5, 64), (0, 436), (1, 10))
    assert plan.calls[1].contiguous and plan.calls[1].token_range == (3, 9)


def test_max_groups_still_limits_when_given():
    runs = {r: (1000 * r, 64) for r in range(1, 4)}
    plan, reason = _plan(list(runs), [64] * 3, [2] * 3, runs, max_groups=2)
    assert plan is None and "3 HOT extents in one batch (limit 2)" == reason


def test_check_call_sees_a_planted_fault():
    runs = {1: (100, 64), 2: (300, 32)}
    plan, _ = _plan([1, 2], [64, 32], [2, 3], runs)
    (call,) = plan.calls
    check_call(call, plan.groups)
    bad = call.kv_indptr.copy()
    bad[1] -= 1  # group 0 one key short, the gap one longer
    with pytest.raises(AssertionError, match="not its extent"):
        check_call(dataclasses.replace(call, kv_indptr=bad), plan.groups)
    with pytest.raises(AssertionError, match="not its tokens"):
        check_call(dataclasses.replace(call, token_idx=call.token_idx[::-1].copy()), plan.groups)


def test_random_batches_cover_each_prefixed_token_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        bs = int(rng.integers(1, 12))
        rows = rng.permutation(np.arange(1, 16))[:bs]
        ext = rng.integers(0, 3, bs) * 1000 + 5
        prefix = rng.choice([0, 40, 80], bs)
        new = rng.integers(0, 6, bs)
        runs = {int(r): (int(e), int(p)) for r, e, p in zip(rows, ext, prefix) if p}
        runs = {r: run for r, run in runs.items() if rng.random() < 0.8}  # some prefixes COLD
        plan, reason = _plan(rows, prefix, new, runs)
        if plan is None:
            assert reason in ("no cached prefix", "no new tokens", "no HOT prefix in the batch")
            continue
        begin = np.concatenate([[0], np.cumsum(new)])
        want, want_rem = {}, {}
        for i in range(bs):
            if prefix[i] and int(rows[i]) in runs:
                for t in range(begin[i], begin[i + 1]):
                    want[t] = (ext[i], prefix[i])
            elif prefix[i]:
                for t in range(begin[i], begin[i + 1]):
                    want_rem[t] = (int(rows[i]), 0, int(prefix[i]))
        got = {int(t): (g.start, g.length) for g in plan.groups for t in g.token_idx}
        assert got == want
        assert sum(g.num_tokens for g in plan.groups) == len(want)  # no token twice
        got_rem = {}
        if plan.paged is not None:
            rem = plan.paged
            for j in range(rem.num_requests):
                for t in rem.token_idx[rem.qo_indptr[j]: rem.qo_indptr[j + 1]]:
                    got_rem[int(t)] = (int(rem.rows[j]), int(rem.lo[j]), int(rem.hi[j]))
        assert got_rem == want_rem
        assert sorted(i for c in plan.calls for i in c.groups) == list(range(len(plan.groups)))
        for c in plan.calls:
            check_call(c, plan.groups)
        depth = max(sum(1 for h in plan.groups if h.start <= g.start < h.start + h.length) for g in plan.groups)
        assert len(plan.calls) == depth  # as few calls as the deepest overlap
