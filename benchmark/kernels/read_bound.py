"""How fast one launch can read a prefix extent at all: the bound of a bandwidth-bound prefix launch.

A prefix launch at few query rows per kv head (``bench_attention.BANDWIDTH_BOUND_ROWS`` or
fewer) is a read of the extent's K and V bytes with little math on them. ``read_extent`` reads
exactly those bytes (two contiguous ranges of ``[slots, Hkv, D]`` buffers: slots
``[start, start + length)`` of K and of V) in one launch of ``programs`` programs, each summing
its share with wide vector loads and writing one float, and nothing else: no query, no partial
rows, no merge. Its time, as a CUDA-graph replay with the L2 flushed (what the matrix times the
prefix launch as), is what any single-launch prefix kernel needs for those bytes on that GPU;
``best_read_us`` takes the fastest of a few launch widths.

Nothing here is part of GraniKV: it is the benchmark's yardstick (docs/results/kernels.md).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per load step of one program (8 KB of bf16)
WIDTHS = (1.0, 2.0, 4.0, 8.0)  # programs per SM tried by best_read_us (4 was the fastest at 8-537 MB on an H100)


@triton.jit
def _read_kernel(K, V, Out, start, n_elems, per_prog, BLOCK: tl.constexpr):
    """Program p sums elements [p * per_prog, (p + 1) * per_prog) of the flat range
    [start, start + n_elems) of K and of V, and writes the sum to Out[p]."""
    p = tl.program_id(0)
    lo = p * per_prog
    hi = tl.minimum(lo + per_prog, n_elems)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for i in range(lo, hi, BLOCK):
        idx = i + offs
        ok = idx < hi
        acc += tl.load(K + start + idx, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(V + start + idx, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + p, tl.sum(acc, 0))


def read_extent(k_buffer: torch.Tensor, v_buffer: torch.Tensor, start: int, length: int,
                out: torch.Tensor) -> torch.Tensor:
    """Sum slots ``[start, start + length)`` of the contiguous ``[slots, Hkv, D]`` buffers in one
    launch of ``out.numel()`` programs (``out`` fp32, one partial sum per program); returns out."""
    if not (k_buffer.is_contiguous() and v_buffer.is_contiguous()) or k_buffer.shape != v_buffer.shape:
        raise ValueError("read_extent needs two contiguous K / V buffers of one shape")
    if start < 0 or length < 1 or start + length > k_buffer.shape[0]:
        raise ValueError(f"extent [{start}, {start + length}) outside the buffer's {k_buffer.shape[0]} slots")
    row = k_buffer[0].numel()
    n_elems = length * row
    programs = out.numel()
    per_prog = triton.cdiv(triton.cdiv(n_elems, programs), BLOCK) * BLOCK  # whole load steps
    _read_kernel[(programs,)](k_buffer, v_buffer, out, start * row, n_elems, per_prog, BLOCK=BLOCK, num_warps=8)
    return out


def best_read_us(k_buffer: torch.Tensor, v_buffer: torch.Tensor, start: int, length: int, sm_count: int,
                 timer: Callable[[Callable[[], Any]], Tuple[float, str]],
                 widths: Sequence[float] = WIDTHS) -> Tuple[float, Dict[str, float]]:
    """The fastest time of ``read_extent`` over the launch widths ``widths`` (programs per SM),
    µs, and each width's; ``timer(fn) -> (ms, mode)`` (the benchmark's: CUDA-graph replays
    with the L2 flushed, ``harness.timing.gpu_ms``)."""
    times = {}
    for w in widths:
        out = torch.empty(max(1, int(w * sm_count)), dtype=torch.float32, device=k_buffer.device)
        times[f"{w:g}"] = round(timer(lambda o=out: read_extent(k_buffer, v_buffer, start, length, o))[0] * 1e3, 2)
    return min(times.values()), times
