"""The matrix's read bound (benchmark/kernels/read_bound.py) reads exactly the extent's bytes.

In the interpreter (fp16 / fp32): every program's sum against the float64 reference, at extents
that are not multiples of the load step, program counts that leave programs without work, and a
start inside the buffer; a read that starts one slot early (a planted off-by-one) fails it.
"""

import pytest
import torch
import triton

from benchmark.kernels import read_bound


def reference_sums(k_buffer, v_buffer, start, length, programs):
    """What ``read_extent`` writes, in float64: each program's share of the K and V elements."""
    k = k_buffer[start: start + length].reshape(-1).double()
    v = v_buffer[start: start + length].reshape(-1).double()
    per = triton.cdiv(triton.cdiv(k.numel(), programs), read_bound.BLOCK) * read_bound.BLOCK
    return torch.stack([k[p * per: (p + 1) * per].sum() + v[p * per: (p + 1) * per].sum() for p in range(programs)])


def _bufs(slots, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, hkv, d, generator=g).to(dtype), torch.randn(slots, hkv, d, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("start,length,programs", [(1, 37, 3), (5, 70, 4), (0, 3, 7), (11, 129, 2)])
def test_read_extent_matches_reference(dtype, start, length, programs, monkeypatch):
    monkeypatch.setattr(read_bound, "BLOCK", 256)  # small load steps: several per program, masked tails
    k, v = _bufs(160, 2, 16, dtype)
    out = torch.zeros(programs, dtype=torch.float32)
    read_bound.read_extent(k, v, start, length, out)
    ref = reference_sums(k, v, start, length, programs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)
    assert abs(float(out.double().sum()) - float(k[start: start + length].double().sum()
                                                 + v[start: start + length].double().sum())) < 1e-2


def test_planted_off_by_one_fails(monkeypatch):
    monkeypatch.setattr(read_bound, "BLOCK", 256)
    k, v = _bufs(160, 2, 16, torch.float32)
    out = torch.zeros(3, dtype=torch.float32)
    read_bound.read_extent(k, v, 4, 37, out)  # one slot early
    ref = reference_sums(k, v, 5, 37, 3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-3)


def test_read_extent_rejects_bad_extents():
    k, v = _bufs(16, 2, 16, torch.float32)
    out = torch.zeros(2, dtype=torch.float32)
    with pytest.raises(ValueError, match="outside"):
        read_bound.read_extent(k, v, 10, 7, out)
    with pytest.raises(ValueError, match="contiguous"):
        read_bound.read_extent(k.transpose(0, 1), v.transpose(0, 1), 0, 1, out)
