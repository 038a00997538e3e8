"""Debug only: every layer's new K/V rounded through an FP8 format before the wrapped backend
sees it, so that stock kernels over a bf16 cache compute attention over exactly the values an
FP8 cache would hold.

``GRANIKV_DEBUG_KV_ROUND=fp8_e4m3`` (or ``fp8_e5m2``; envs.py) on an engine with a bf16 KV
cache: ``k`` becomes ``(k / k_scale).to(fp8).to(bf16) * k_scale`` (the layer's scales, 1.0
without; SGLang's FP8 ``set_kv_buffer`` divides by the same scale before its cast), likewise
``v``. GraniKV's backend applies it in ``forward_extend`` / ``forward_decode``; where GraniKV's
attention is off (``--granikv-attention-path paged`` among others) ``RoundingBackend`` wraps
the stock backend for this alone. The correctness check runs stock flashinfer and stock triton
this way (path ``paged``) as its two reference kernels for GraniKV over a real FP8 cache: both see the bytes
GraniKV dequantizes, neither adds the FP8 rounding of the query and probabilities that SGLang's
own FP8 triton decode adds (benchmark/correctness/check.py). Without the variable the backend
holds ``NO_ROUND``, which returns its input.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple, TypeVar

import torch

from granikv import envs
from granikv.attention.forwarding import ForwardingBackend
from granikv.attention.kv_scales import kv_scales

logger = logging.getLogger("granikv")

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

T = TypeVar("T", torch.Tensor, Optional[torch.Tensor])  # a call without new K/V passes None


class NoRound:
    """The null object: K/V pass through unchanged."""

    name = ""

    def __call__(self, k: T, v: T, layer: Any) -> Tuple[T, T]:
        return k, v


class Round(NoRound):
    """K/V rounded through ``FORMATS[name]`` with the layer's scales."""

    def __init__(self, name: str):
        self.name = name
        self.dtype = FORMATS[name]

    def __call__(self, k: T, v: T, layer: Any) -> Tuple[T, T]:
        k_scale, v_scale = kv_scales(layer)
        return self.round(k, k_scale), self.round(v, v_scale)

    def round(self, x: T, scale: float) -> T:
        if x is None or x.dtype in FORMATS.values():  # an FP8 cache's own values: already rounded
            return x
        q = (x if scale == 1.0 else x / scale).to(self.dtype).to(x.dtype)
        return q if scale == 1.0 else q * scale


NO_ROUND = NoRound()


#: The start-up line's words (the correctness check reads them in each reference engine's log to
#: know the rounding was built into its backend).
LOG_MARK = "before attention (debug only: a reference for an FP8 KV cache)"


class RoundingBackend(ForwardingBackend):
    """The stock backend with its new K/V rounded (``GRANIKV_DEBUG_KV_ROUND`` where GraniKV's own
    attention is off); everything else forwarded unchanged."""

    def __init__(self, inner: Any, rounding: NoRound):
        super().__init__(inner)
        self.rounding = rounding

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        k, v = self.rounding(k, v, layer)
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        k, v = self.rounding(k, v, layer)
        return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


def wrap_stock(inner: Any) -> Any:
    """``inner`` under ``RoundingBackend`` when ``GRANIKV_DEBUG_KV_ROUND`` is set, else ``inner``."""
    rounding = from_env()
    return inner if rounding is NO_ROUND else RoundingBackend(inner, rounding)


def from_name(name: str) -> NoRound:
    """The rounding called ``name`` (``""``: none). Raises ValueError naming the variable."""
    envs.check_debug_value(envs.DEBUG_KV_ROUND, name, FORMATS)
    if not name:
        return NO_ROUND
    logger.error("GraniKV: %s=%s is set: every layer's K/V is rounded through %s %s",
                 envs.DEBUG_KV_ROUND, name, name, LOG_MARK)
    return Round(name)


def from_env() -> NoRound:
    return from_name(envs.debug_kv_round())
