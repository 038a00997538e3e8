"""Capturing a callable into a CUDA graph the way torch requires (benchmarks and GPU tests)."""

from typing import Callable

import torch


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``fn`` run once on a side stream (warm-up: compiles, autotunes, allocates outside the
    graph, as torch requires before capture), then captured into a CUDA graph, which is returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
