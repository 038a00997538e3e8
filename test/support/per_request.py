"""One check the kernel and backend tests share: each request's output rows against the float64
reference, elementwise, so one wrong request fails with its batch position named."""

from typing import Optional

import torch


def assert_per_request(out: torch.Tensor, ref: torch.Tensor, *, atol: float = 4e-3, rtol: float = 4e-3,
                       atol_floor: Optional[float] = None) -> None:
    """``out[i]`` against ``ref[i]`` for every request i; a failure's message starts with
    ``request i: ``. ``atol_floor``: None for an absolute ``atol``; else ``atol`` is relative to
    ``max(atol_floor, max |ref[i]|)`` (outputs whose scale varies: FP8-scaled values, bf16)."""
    for i in range(ref.shape[0]):
        tol = atol if atol_floor is None else atol * max(atol_floor, ref[i].abs().max().item())
        torch.testing.assert_close(out[i].double(), ref[i], atol=tol, rtol=rtol,
                                   msg=lambda m, i=i: f"request {i}: {m}")
