"""Non-negative least squares, for fitting the cost model's coefficients (numpy only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, *, tol: float = 1e-10, max_iter: int = 200) -> np.ndarray:
    """Non-negative least squares ``argmin |a x - b|, x >= 0`` (Lawson-Hanson active set).

    Small dense problems only (a dozen columns); numpy only, no scipy dependency.
    """
    import numpy as np

    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)  # the "passive" set P: coefficients allowed to move
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        if free.all() or grad[~free].max(initial=-np.inf) <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > tol).all():
                x = z
                break
            neg = free & (z <= tol)
            denom = x[neg] - z[neg]
            step = np.min(np.where(denom > 0, x[neg] / np.where(denom > 0, denom, 1.0), 0.0))
            x = x + step * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x
