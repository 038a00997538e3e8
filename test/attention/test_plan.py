"""Grouping of a decode batch by HOT extent, and the same-physical-slots check (CPU)."""

import numpy as np
import pytest
import torch

from granikv.attention.grouping import (
    BatchDescription,
    Grouping,
    group_requests,
    verify_same_slots,
)


def desc_of(hot_start, hot_len, seq_lens=None, req_pool_indices=None) -> BatchDescription:
    hot_start = np.asarray(hot_start, dtype=np.int64)
    hot_len = np.asarray(hot_len, dtype=np.int64)
    bs = hot_start.shape[0]
    if seq_lens is None:
        seq_lens = hot_len + 7
    if req_pool_indices is None:
        req_pool_indices = np.arange(1, bs + 1)
    return BatchDescription(
        req_pool_indices=np.asarray(req_pool_indices, dtype=np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        hot_start=hot_start,
        hot_len=hot_len,
    )


def reference_grouping(desc, min_group_size, min_prefix_len=1):
    """Dict-based reference: {start: (len, [batch positions])}."""
    members = {}
    for i in range(desc.batch_size):
        eff = min(int(desc.hot_len[i]), int(desc.seq_lens[i]))
        if eff >= min_prefix_len:
            members.setdefault(int(desc.hot_start[i]), []).append(i)
    out = {}
    for start, idx in sorted(members.items()):
        if len(idx) >= min_group_size:
            eff = [min(int(desc.hot_len[i]), int(desc.seq_lens[i])) for i in idx]
            out[start] = (min(eff), idx)
    return out


def as_dict(g: Grouping):
    out = {}
    for k in range(g.num_groups):
        idx = g.group_req_idx[g.group_req_indptr[k] : g.group_req_indptr[k + 1]]
        out[int(g.group_start[k])] = (int(g.group_len[k]), idx.tolist())
    return out


def check_consistent(g: Grouping, desc: BatchDescription):
    """Structural invariants every Grouping must satisfy."""
    G, bs = g.num_groups, desc.batch_size
    assert g.batch_size == bs
    for name in ("group_start", "group_len", "group_req_indptr", "group_req_idx", "prefix_len"):
        assert getattr(g, name).dtype == np.int64, name
    assert g.group_len.shape == (G,) and g.group_req_indptr.shape == (G + 1,)
    assert g.group_req_indptr[0] == 0 and g.group_req_indptr[-1] == g.num_grouped
    assert (np.diff(g.group_start) > 0).all(), "groups ordered by start, starts distinct"
    assert (g.group_len >= 1).all()
    assert len(set(g.group_req_idx.tolist())) == g.num_grouped, "a request in two groups"
    expected = np.zeros(bs, dtype=np.int64)
    for k in range(G):
        idx = g.group_req_idx[g.group_req_indptr[k] : g.group_req_indptr[k + 1]]
        assert (np.diff(idx) > 0).all(), "members in batch order"
        assert (desc.hot_start[idx] == g.group_start[k]).all()
        assert (np.minimum(desc.hot_len[idx], desc.seq_lens[idx]) >= g.group_len[k]).all()
        expected[idx] = g.group_len[k]
    np.testing.assert_array_equal(g.prefix_len, expected)
    assert (g.prefix_len <= desc.seq_lens).all()
    assert g.prefix_tokens == int(g.group_len.sum())
    assert g.stacked_prefix_tokens == int(g.prefix_len.sum())


def test_forest_of_unequal_groups_dissolves_small_ones():
    # starts: 900 x2, 100 x5 (lens vary), 500 x1 (dissolved), 2 requests without HOT prefix
    desc = desc_of(
        hot_start=[900, 100, 0, 100, 500, 900, 100, 100, 7, 100],
        hot_len=[300, 512, 0, 512, 640, 200, 700, 513, 0, 600],
    )
    g = group_requests(desc, min_group_size=2)
    check_consistent(g, desc)
    assert as_dict(g) == {100: (512, [1, 3, 6, 7, 9]), 900: (200, [0, 5])}
    np.testing.assert_array_equal(g.prefix_len, [200, 512, 0, 512, 0, 200, 512, 512, 0, 512])
    np.testing.assert_array_equal(g.group_size, [5, 2])


def test_identical_starts_take_min_hot_len():
    desc = desc_of(hot_start=[40, 40, 40], hot_len=[37, 17, 29])
    g = group_requests(desc, min_group_size=2)
    assert as_dict(g) == {40: (17, [0, 1, 2])}
    np.testing.assert_array_equal(g.prefix_len, [17, 17, 17])


def test_min_group_size_dissolves_groups_below_it():
    desc = desc_of(hot_start=[10] * 1 + [50] * 2 + [90] * 5, hot_len=[37] * 8)
    assert set(as_dict(group_requests(desc, min_group_size=1))) == {10, 50, 90}
    assert set(as_dict(group_requests(desc, min_group_size=2))) == {50, 90}
    assert set(as_dict(group_requests(desc, min_group_size=3))) == {90}
    g = group_requests(desc, min_group_size=6)
    assert g.num_groups == 0 and (g.prefix_len == 0).all()


def test_min_prefix_len_excludes_short_runs_before_counting():
    desc = desc_of(hot_start=[10, 10, 10], hot_len=[64, 3, 64])
    g = group_requests(desc, min_group_size=2, min_prefix_len=16)
    assert as_dict(g) == {10: (64, [0, 2])}
    assert group_requests(desc, min_group_size=3, min_prefix_len=16).num_groups == 0


def test_hot_len_is_clipped_to_seq_len():
    desc = desc_of(hot_start=[10, 10], hot_len=[64, 64], seq_lens=[40, 70])
    g = group_requests(desc, min_group_size=2)
    assert as_dict(g) == {10: (40, [0, 1])}


def test_no_hot_prefix_and_empty_batch():
    desc = desc_of(hot_start=[5, 5, 5], hot_len=[0, 0, 0])
    g = group_requests(desc, min_group_size=1)
    check_consistent(g, desc)
    assert g.num_groups == 0 and g.num_grouped == 0 and g.stacked_prefix_tokens == 0
    empty = desc_of(hot_start=[], hot_len=[])
    g = group_requests(empty, min_group_size=2)
    assert g.batch_size == 0 and g.num_groups == 0


@pytest.mark.parametrize("bs", [1, 17, 37, 256])
@pytest.mark.parametrize("num_starts", [1, 3, 16])
@pytest.mark.parametrize("min_group_size", [1, 2, 5])
def test_matches_reference_on_random_batches(bs, num_starts, min_group_size):
    rng = np.random.default_rng(bs * 1000 + num_starts * 10 + min_group_size)
    starts = rng.choice(10_000, size=num_starts, replace=False) * 64 + 1
    hot_start = starts[rng.integers(0, num_starts, bs)]
    hot_len = rng.integers(1, 300, bs) * (rng.random(bs) < 0.8)  # ~20% without HOT prefix
    seq_lens = hot_len + rng.integers(-5, 40, bs).clip(1)
    desc = desc_of(hot_start, hot_len, seq_lens, rng.permutation(bs) + 1)
    g = group_requests(desc, min_group_size=min_group_size)
    check_consistent(g, desc)
    assert as_dict(g) == reference_grouping(desc, min_group_size)


def test_rejects_bad_arguments():
    desc = desc_of(hot_start=[1], hot_len=[3])
    with pytest.raises(ValueError, match="min_group_size=0"):
        group_requests(desc, min_group_size=0)
    with pytest.raises(ValueError, match="hot_len has shape"):
        BatchDescription(np.arange(3), np.ones(3, np.int64), np.ones(3, np.int64), np.ones(2, np.int64))


def test_from_table_gathers_rows():
    start = np.array([0, 500, 0, 500, 900], dtype=np.int64)
    length = np.array([0, 37, 0, 17, 64], dtype=np.int64)
    desc = BatchDescription.from_table(
        np.array([3, 1, 2], dtype=np.int64), np.array([40, 50, 9], dtype=np.int64), start, length
    )
    np.testing.assert_array_equal(desc.hot_start, [500, 500, 0])
    np.testing.assert_array_equal(desc.hot_len, [17, 37, 0])
    assert as_dict(group_requests(desc, min_group_size=2)) == {500: (17, [0, 1])}


# ---- same physical slots ---------------------------------------------------------------------


def build_req_to_token(desc: BatchDescription, width: int, seed: int = 0) -> torch.Tensor:
    """A req_to_token table where each request's first hot_len positions hold its HOT run and
    the rest hold distinct random COLD slots (below the HOT region at 100_000)."""
    rng = np.random.default_rng(seed)
    rows = int(desc.req_pool_indices.max()) + 1
    table = rng.permutation(rows * width).reshape(rows, width) % 90_000 + 1
    for i in range(desc.batch_size):
        r, s, n = desc.req_pool_indices[i], desc.hot_start[i], desc.hot_len[i]
        table[r, :n] = np.arange(s, s + n)
    return torch.from_numpy(table.astype(np.int32))


def test_verify_same_slots_accepts_a_true_grouping():
    desc = desc_of(
        hot_start=[100_000, 100_000, 200_000, 100_000, 200_000, 0],
        hot_len=[37, 53, 17, 41, 29, 0],
        req_pool_indices=[5, 2, 9, 7, 1, 3],
    )
    g = group_requests(desc, min_group_size=2)
    assert g.num_groups == 2
    table = build_req_to_token(desc, width=80)
    assert verify_same_slots(g, desc, table)
    assert verify_same_slots(Grouping.empty(desc.batch_size), desc, table)


def test_equal_tokens_in_other_slots_are_not_grouped_and_fail_the_check():
    # Requests 0 and 1 hold the same token ids, but request 1's copy lives in another extent:
    # grouping is by slot, so they are not grouped together.
    desc = desc_of(hot_start=[100_000, 300_000, 100_000], hot_len=[37, 37, 37])
    g = group_requests(desc, min_group_size=2)
    assert as_dict(g) == {100_000: (37, [0, 2])}
    table = build_req_to_token(desc, width=50)
    assert verify_same_slots(g, desc, table)

    # A stale description that claims request 2 starts at 100_000 while its row points to the
    # other copy must fail the check, even if a single slot differs.
    stale = table.clone()
    stale[desc.req_pool_indices[2], :37] = torch.arange(300_000, 300_037, dtype=torch.int32)
    assert not verify_same_slots(g, desc, stale)
    one_off = table.clone()
    one_off[desc.req_pool_indices[0], 36] = 7
    assert not verify_same_slots(g, desc, one_off)
    # Slots after the group prefix are the suffix: changing them does not matter.
    after = table.clone()
    after[desc.req_pool_indices[0], 37:] = 7
    assert verify_same_slots(g, desc, after)


def test_verify_same_slots_rejects_a_group_longer_than_the_table():
    desc = desc_of(hot_start=[100_000, 100_000], hot_len=[60, 60])
    g = group_requests(desc, min_group_size=2)
    table = build_req_to_token(desc, width=80)[:, :40]
    assert not verify_same_slots(g, desc, table)
