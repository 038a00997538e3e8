"""Work-list builder and workspace upload: pure data movement, checked for exact equality."""

import numpy as np
import pytest
import torch
from conftest import SMALL_CONFIG, fill, make_batch

from granikv.attention.decode.work_list import KernelConfig, build_work_list, suffix_heads
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.plan import Grouping


def _cdiv(a, b):
    return -(-a // b)


def _work_list_loops(b, *, ratio, num_kv_heads, cfg, sm_count, max_splits):
    """Straightforward per-group / per-request loops with the same chunk-size rule."""
    n_mem = np.diff(b.group_req_indptr)
    tiles = [_cdiv(int(n) * ratio, cfg.block_m) for n in n_mem]
    target = max(1, int(cfg.prefix_waves * sm_count) // num_kv_heads)
    work = sum(t * int(L) for t, L in zip(tiles, b.group_len))
    chunk = max(_cdiv(work, target), cfg.min_prefix_chunk, _cdiv(int(b.group_len.max()), max_splits))
    chunk = _cdiv(chunk, cfg.block_n) * cfg.block_n
    pfx = []
    n_pre = [0] * b.bs
    for g in range(len(b.group_len)):
        L, p0, p1 = int(b.group_len[g]), int(b.group_req_indptr[g]), int(b.group_req_indptr[g + 1])
        nc = _cdiv(L, chunk)
        gc = _cdiv(_cdiv(L, nc), cfg.block_n) * cfg.block_n  # equal chunks within the group
        for i in b.group_req_idx[p0:p1]:
            n_pre[i] = nc
        for c in range(nc):
            for t in range(tiles[g]):
                lo = p0 * ratio + t * cfg.block_m
                n_kv = min(gc, L - c * gc)
                assert n_kv > 0
                pfx.append((lo, min(lo + cfg.block_m, p1 * ratio), int(b.group_start[g]) + c * gc, n_kv, c))
    sfx_len = [int(s - p) for s, p in zip(b.seq_lens, b.prefix_len)]
    target = max(1, int(cfg.suffix_waves * sm_count) // (num_kv_heads // suffix_heads(ratio, num_kv_heads, cfg)))
    sc = max(_cdiv(sum(sfx_len), target), cfg.min_suffix_chunk, _cdiv(max(sfx_len), max_splits))
    sc = _cdiv(sc, cfg.suffix_block_n) * cfg.suffix_block_n
    indptr = [0]
    for i in range(b.bs):
        indptr.append(indptr[-1] + n_pre[i] + _cdiv(sfx_len[i], sc))
    sfx = []
    for i in range(b.bs):
        for s in range(_cdiv(sfx_len[i], sc)):
            lo = int(b.prefix_len[i]) + s * sc
            sfx.append((i, lo, min(lo + sc, int(b.seq_lens[i])), indptr[i] + n_pre[i] + s))
    return chunk, sc, np.array(pfx).reshape(-1, 5), np.array(sfx).reshape(-1, 4), np.array(indptr)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio", [1, 4, 5])
def test_build_work_list_matches_loops(seed, ratio):
    rng = np.random.default_rng(seed)
    G = int(rng.integers(0, 5))
    groups = [(int(rng.integers(1, 300)), int(rng.integers(1, 9))) for _ in range(G)]
    b = make_batch(groups=groups, n_ungrouped=int(rng.integers(0 if G else 1, 5)), suffix=int(rng.integers(1, 60)),
                   ungrouped_len=int(rng.integers(1, 200)), num_q_heads=2 * ratio, num_kv_heads=2, head_dim=16,
                   seed=seed)  # fmt: skip
    sm = int(rng.integers(4, 140))
    kw = dict(ratio=ratio, num_kv_heads=2, sm_count=sm, max_splits=int(rng.integers(1, 40)))
    wl = build_work_list(Grouping.of(b.group_start, b.group_len, b.group_req_indptr, b.group_req_idx, b.prefix_len), b.seq_lens,
                         config=SMALL_CONFIG, **kw)  # fmt: skip
    if not G:
        b.group_len = np.zeros(1, np.int64)  # loops reference needs a max; no groups -> no prefix items
    chunk, sc, pfx, sfx, indptr = _work_list_loops(b, cfg=SMALL_CONFIG, **kw)
    got_pfx = np.stack([wl.pfx_row_lo, wl.pfx_row_hi, wl.pfx_slot_lo, wl.pfx_n_kv, wl.pfx_split], 1).reshape(-1, 5)
    got_sfx = np.stack([wl.sfx_req, wl.sfx_lo, wl.sfx_hi, wl.sfx_row], 1).reshape(-1, 4)
    if G:
        assert wl.prefix_chunk == chunk
        np.testing.assert_array_equal(got_pfx, pfx)
    else:
        assert wl.num_prefix_items == 0
    assert wl.suffix_chunk == sc
    np.testing.assert_array_equal(got_sfx, sfx)
    np.testing.assert_array_equal(wl.part_indptr, indptr)


@pytest.mark.parametrize("seed", range(4))
def test_workspace_upload_and_capacity(seed):
    """fill() writes exactly the work list into the fixed meta block; capacities hold at worst."""
    rng = np.random.default_rng(seed)
    groups = [(int(rng.integers(1, 5000)), int(rng.integers(1, 20))) for _ in range(int(rng.integers(1, 6)))]
    b = make_batch(groups=groups, n_ungrouped=int(rng.integers(0, 8)), suffix=int(rng.integers(1, 2000)),
                   ungrouped_len=int(rng.integers(1, 9000)), num_q_heads=32, num_kv_heads=8, head_dim=16, seed=seed)
    ws = CascadeWorkspace(b.bs + int(rng.integers(0, 5)), 32, 8, 16, "cpu", sm_count=132)
    wl = fill(ws, b)
    ws.check_integrity()
    m = ws.meta.numpy()
    P, S = ws.prefix_cap, ws.suffix_cap
    assert list(m[:3]) == [b.bs, wl.num_prefix_items, wl.num_suffix_items]
    pfx = ws.pfx_items.numpy().reshape(5, P)[:, : wl.num_prefix_items]
    np.testing.assert_array_equal(pfx, np.stack([wl.pfx_row_lo, wl.pfx_row_hi, wl.pfx_slot_lo, wl.pfx_n_kv, wl.pfx_split]))
    sfx = ws.sfx_items.numpy().reshape(4, S)[:, : wl.num_suffix_items]
    np.testing.assert_array_equal(sfx, np.stack([wl.sfx_req, wl.sfx_lo, wl.sfx_hi, wl.sfx_row]))
    np.testing.assert_array_equal(ws.part_indptr.numpy()[: b.bs + 1], wl.part_indptr)
    np.testing.assert_array_equal(ws.group_req_idx.numpy()[: len(b.group_req_idx)], b.group_req_idx)
    np.testing.assert_array_equal(ws.req_pool_indices.numpy()[: b.bs], b.req_pool_indices)


def test_workspace_worst_case_fits():
    """max_bs requests, each its own group (max_groups), long prefixes: still within capacity."""
    bs = 64
    b = make_batch(groups=[(9000 + 7 * i, 1) for i in range(bs)], n_ungrouped=0, suffix=3000, num_q_heads=40,
                   num_kv_heads=8, head_dim=16)
    ws = CascadeWorkspace(bs, 40, 8, 16, "cpu", sm_count=132)
    fill(ws, b)
    ws.check_integrity()
    b2 = make_batch(groups=[(16384, bs)], n_ungrouped=0, suffix=256, num_q_heads=40, num_kv_heads=8, head_dim=16)
    fill(ws, b2)
    ws.check_integrity()


def test_fill_rejects_oversized_batch():
    b = make_batch()
    ws = CascadeWorkspace(b.bs - 1, 8, 2, 64, "cpu")
    with pytest.raises(ValueError, match="max_bs"):
        fill(ws, b)


def test_planning_cost_bs256():
    """Planning (numpy) stays in the tens of microseconds at bs 256 (loose bound for CI noise)."""
    import time

    b = make_batch(groups=[(16384, 64), (8192, 64), (4096, 64), (2048, 32)], n_ungrouped=32, suffix=256,
                   num_q_heads=32, num_kv_heads=8, head_dim=16, ungrouped_len=300)
    ws = CascadeWorkspace(256, 32, 8, 16, "cpu")
    for _ in range(20):
        fill(ws, b)
    t = time.perf_counter()
    n = 200
    for _ in range(n):
        fill(ws, b)
    per = (time.perf_counter() - t) / n
    print(f"fill: {per * 1e6:.1f} us")
    assert per < 1e-3


def test_fill_reuses_the_prefix_half_only_while_the_grouping_is_unchanged():
    """Decode steps keep their grouping while seq_lens grow: the memoised prefix items must
    give exactly the work list a fresh build gives, and a new grouping must not reuse them."""
    import numpy as np

    from granikv.attention.decode.work_list import build_work_list
    from granikv.attention.decode.workspace import CascadeWorkspace

    ws = CascadeWorkspace(16, 8, 2, 64, "cpu", sm_count=4)
    g = (np.array([100, 300]), np.array([37, 90]), np.array([0, 2, 5]), np.array([0, 3, 1, 4, 6]))
    prefix_len = np.array([37, 90, 0, 37, 90, 0, 90])
    g2 = (np.array([500]), np.array([40]), np.array([0, 2]), np.array([2, 5]))
    prefix2 = np.array([0, 0, 40, 0, 0, 40, 0])
    for step, (grouping, pl) in enumerate([(g, prefix_len)] * 3 + [(g2, prefix2)]):
        seq = np.array([50, 120, 17, 60, 95, 30, 99]) + step
        got = ws.fill(Grouping.of(*grouping, pl), seq, np.arange(1, 8))
        want = build_work_list(Grouping.of(*grouping, pl), seq, ratio=ws.ratio, num_kv_heads=2,
                               config=ws.config, sm_count=4, max_splits=ws.max_splits)
        for name, value in want._asdict().items():
            assert np.array_equal(np.asarray(getattr(got, name)), np.asarray(value)), (step, name)


@pytest.mark.parametrize(
    "ratio,hkv,want",
    [(4, 8, 4), (4, 2, 2), (8, 8, 2), (5, 8, 2), (1, 8, 8), (1, 32, 8), (7, 4, 2), (9, 8, 1), (16, 8, 1), (4, 1, 1), (3, 6, 2)],
)
def test_suffix_heads(ratio, hkv, want):
    """Heads per suffix program fill the tile's 16 (or next_pow2(ratio)) rows and divide Hkv."""
    cfg = KernelConfig()
    h = suffix_heads(ratio, hkv, cfg)
    assert h == want
    assert hkv % h == 0 and h * ratio <= max(16, 1 << (ratio - 1).bit_length())
    assert suffix_heads(ratio, hkv, KernelConfig(suffix_head_group=False)) == 1


@pytest.mark.parametrize("ratio,hkv,head_dim,want", [(1, 32, 128, 8), (1, 32, 64, 16), (4, 8, 128, 4), (2, 16, 256, 8)])
def test_suffix_heads_fit_shared_memory(ratio, hkv, head_dim, want):
    """A suffix tile gathers at most 256 keys x head_dim 128 (MHA at head_dim 128 with 16 heads
    per program asked 282 KB of shared memory on the H200): tile_config scales the cap by head_dim."""
    from granikv.kernels.kernel_config import tile_config

    cfg = tile_config(ratio, head_dim)
    h = suffix_heads(ratio, hkv, cfg)
    assert h == want
    assert h * cfg.suffix_block_n * head_dim <= 256 * 128
