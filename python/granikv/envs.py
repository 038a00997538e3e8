"""GraniKV's environment variables: every one starts with ``GRANIKV_`` and is read here only.

``GRANIKV_DEBUG_FAULT``: debug only, never for serving. Plants a known error in the decode
attention so that an end-to-end correctness check (benchmark/correctness/check.py) can show it
detects one; see ``attention/debug/planted_fault.py`` for the values. Unset or empty:
no fault.

``GRANIKV_DEBUG_KV_ROUND``: debug only, never for serving. ``fp8_e4m3`` or ``fp8_e5m2``: every
layer's new K/V is rounded through that format (with the layer's scales, as SGLang writes an
FP8 cache) before the wrapped backend writes and reads it, so stock kernels over a bf16 cache
compute the attention of the values an FP8 cache holds: the correctness check's reference for
an FP8 KV cache (``attention/debug/kv_round.py``). Unset or empty: no rounding.
"""

import os
from typing import Iterable

DEBUG_FAULT = "GRANIKV_DEBUG_FAULT"


def debug_fault() -> str:
    """The planted-fault name, ``""`` when none (validated by ``planted_fault.from_name``)."""
    return os.environ.get(DEBUG_FAULT, "").strip()


DEBUG_KV_ROUND = "GRANIKV_DEBUG_KV_ROUND"


def debug_kv_round() -> str:
    """The KV rounding format, ``""`` when none (validated by ``kv_round.from_name``)."""
    return os.environ.get(DEBUG_KV_ROUND, "").strip()


def check_debug_value(var: str, value: str, allowed: Iterable[str]) -> None:
    """Raises ValueError naming ``var`` unless ``value`` is one of ``allowed`` (empty: unset)."""
    names = sorted(allowed)
    if value and value not in names:
        raise ValueError(f"{var}={value!r} is not one of {', '.join(names)} (or empty)")
