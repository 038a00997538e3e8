import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from granikv.mem_cache.kv_copy import check_kv_layout, copy_kv_slots, move_kv_slots, slot_bytes


def _pool(size=67, layers=3, dtype=torch.bfloat16):
    pool = MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=2, head_dim=5,
                            layer_num=layers, device="cpu", enable_memory_saver=False)
    g = torch.Generator().manual_seed(0)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randn(b.shape, generator=g).to(dtype))
    return pool


def _snapshot(pool):
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


@pytest.mark.parametrize("n", [1, 17])
def test_copy_kv_slots_gathers_every_layer(n):
    pool = _pool()
    before = _snapshot(pool)
    src = torch.randperm(30)[:n] + 1  # scattered COLD slots in [1, 31)
    nbytes = copy_kv_slots(pool, src, 40)
    assert nbytes == n * slot_bytes(pool) == n * 3 * 2 * 2 * 5 * 2
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        assert torch.equal(new[40 : 40 + n], old[src])
        assert torch.equal(new[:40], old[:40]) and torch.equal(new[40 + n :], old[40 + n :])


@pytest.mark.parametrize("n", [0, 1, 17])
def test_move_kv_slots_scatters_every_layer(n):
    pool = _pool()
    before = _snapshot(pool)
    perm = torch.randperm(66, generator=torch.Generator().manual_seed(n)) + 1
    src, dst = perm[:n], perm[n : 2 * n]  # disjoint, scattered
    assert move_kv_slots(pool, src, dst) == n * slot_bytes(pool)
    untouched = torch.ones(68, dtype=torch.bool)
    untouched[dst] = False
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        assert torch.equal(new[dst], old[src])
        assert torch.equal(new[untouched], old[untouched])


def test_layout_check_rejects_non_mha_pools():
    with pytest.raises(ValueError, match="k_buffer"):
        check_kv_layout(object())
    check_kv_layout(_pool())
