"""One check the GPU kernel tests share: a launch replayed from a CUDA graph gives its eager
output bit for bit."""

from typing import Callable

import torch

from granikv.kernels.graph_capture import capture_graph


def eager_equals_replay(fn: Callable[[], object], out: torch.Tensor) -> torch.Tensor:
    """Runs ``fn`` (which writes ``out``) eagerly, captures it into a CUDA graph, replays the
    graph over a NaN-filled ``out`` and asserts the replay wrote the eager output exactly;
    returns a copy of it. No synchronize before the eager copy: the current stream must already
    be ordered after any side stream ``fn`` forks."""
    fn()
    eager = out.clone()
    g = capture_graph(fn)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, out)
    return out.clone()
