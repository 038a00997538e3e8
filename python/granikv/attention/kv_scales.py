"""A layer's KV dequantization scales, read the way SGLang's backends read them.

SGLang writes a quantized KV cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``) as
``k / k_scale`` cast to the cache dtype (``MHATokenToKVPool.set_kv_buffer``), and its backends
undo it in the kernel: FlashInfer takes ``k_scale=layer.k_scale_float`` (scores times it) and
``v_scale=layer.v_scale_float`` (output times it), ``None`` meaning 1; the triton backend passes
the same floats as ``k_descale`` / ``v_descale`` (1.0 without scales). GraniKV's kernels take
the same two floats (kernels/cascade.py): 1.0 where the layer has none.
"""

from typing import Any, Optional, Tuple


def kv_scales(layer: Any) -> Tuple[float, float]:
    """``(k_scale, v_scale)`` of a ``RadixAttention`` layer (1.0 where unset)."""
    return _float(getattr(layer, "k_scale_float", None)), _float(getattr(layer, "v_scale_float", None))


def scale_reason(layer: Any) -> Optional[str]:
    """Why the layer's scales cannot be read without a device sync (None: they can): a scale
    tensor without its host float (SGLang sets both together; a model that sets only the
    tensor would need a copy from the GPU on every call)."""
    for name in ("k_scale", "v_scale"):
        if getattr(layer, name, None) is not None and getattr(layer, f"{name}_float", None) is None:
            return f"KV scale {name} without {name}_float"
    return None


def _float(x: Optional[float]) -> float:
    return 1.0 if x is None else float(x)
