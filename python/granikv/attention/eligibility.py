"""What GraniKV's attention can serve: the model runner, each layer, each call.

Two levels of eligibility:

- ``unsupported_reason``: the model runner as a whole (MLA, window, KV dtype, head_dim, ...):
  GraniKV's attention stays off and SGLang's backend is returned unwrapped;
- ``layer_reason`` / ``call_reason``: one attention layer (``RadixAttention``) and one call of
  it. The one function decode and extend share: ``scan_layers`` runs it on every attention
  layer of the loaded model at wrap time, and the extend path again on each call (a feature
  that only shows in the call's arguments, such as ``sinks``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from granikv.attention.kv_scales import scale_reason
from granikv.kernels.kernel_config import FP8_KV_DTYPES

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner

    from granikv.config import GraniKVConfig

logger = logging.getLogger("granikv")

#: fp16 / bf16, and the FP8 caches SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2 make (read as
#: stored and widened in registers, with the layer's scales: kv_scales.py). Other quantized
#: caches (fp4_e2m1, mxfp8: block scales the kernels do not apply) stay off.
SUPPORTED_KV_DTYPES = (torch.float16, torch.bfloat16) + FP8_KV_DTYPES
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def unsupported_reason(model_runner: ModelRunner, cfg: GraniKVConfig) -> Optional[str]:
    """Why the shared-prefix attention cannot serve this model runner (None = it can)."""
    if cfg.attention_path == "paged":
        return "--granikv-attention-path=paged"
    mc = model_runner.model_config
    if getattr(model_runner, "use_mla_backend", False):
        return "MLA attention"
    window = getattr(model_runner, "sliding_window_size", None)
    if window and (getattr(model_runner, "is_hybrid_swa", False) or getattr(mc, "is_hybrid_swa", False)):
        # windowed layers in a pool of their own: not a pool GraniKV's allocator replaces
        return (f"sliding-window attention (window {window}) in SGLang's hybrid SWA KV pool; start "
                "with --disable-hybrid-swa-memory for per-layer decode paths")
    if model_runner.kv_cache_dtype not in SUPPORTED_KV_DTYPES:
        return f"KV cache dtype {model_runner.kv_cache_dtype} (supported: fp16, bf16, fp8_e4m3, fp8_e5m2)"
    if mc.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={mc.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    spec = getattr(model_runner.server_args, "speculative_algorithm", None)
    if spec:
        return f"speculative decoding ({spec})"
    if getattr(mc.hf_config, "final_logit_softcapping", None) or getattr(
        mc.hf_config, "attn_logit_softcapping", None
    ):
        return "attention logit soft-capping"
    return None


def attention_tp_size(model_runner: ModelRunner) -> int:
    """Attention tensor-parallel size (heads per rank = total / this)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except Exception:  # no runtime context (tests, other SGLang versions)
        ps = getattr(model_runner, "ps", None)
        return int(getattr(ps, "attn_tp_size", None) or getattr(ps, "tp_size", None) or 1)


# ---- per-layer eligibility -----------------------------------------------------------------

_SINK_HINT = "sink"  # model-side attention-sink tensors (gpt-oss ``sinks``, MiMo ``attention_sink_bias``)
SINKS = "attention sinks"  # the scan's reason for such layers: served where the path adds the sink (``sinks_served``)
#: Scan reasons of a layer the wrapped backend serves per layer in decode, with the real
#: batch's metadata, beside GraniKV's path on the other layers (decode/layer_paths.py).
PER_LAYER_REASONS = ("sliding window",)


def layer_reason(layer: RadixAttention, *, num_q_heads: Optional[int] = None,
                 head_dim: Optional[int] = None) -> Optional[str]:
    """Why GraniKV's kernels cannot compute this attention layer exactly (None: they can).

    ``layer``: SGLang's ``RadixAttention`` (attributes read with SGLang's defaults, so a stand-in
    with only the core fields is plain causal self-attention). ``num_q_heads`` / ``head_dim``:
    the geometry GraniKV's kernels were built for (per TP rank), checked when given. The
    kernels implement exactly: causal decoder self-attention, one softmax scale, no soft cap, no
    window, the layer's KV scales as host floats (kv_scales.py), equal q/k and v head dims, the
    model's head counts.
    """
    if getattr(layer, "is_cross_attention", False):
        return "cross attention"
    attn_type = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
    if attn_type != "DECODER":
        return f"attention type {attn_type}"
    window = getattr(layer, "sliding_window_size", -1)
    if window not in (-1, None, 0):
        return f"sliding window {window}"
    if getattr(layer, "logit_cap", 0.0) or 0.0:
        return f"logit cap {layer.logit_cap}"
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return f"xai temperature scaling (len {layer.xai_temperature_len})"
    if getattr(layer, "use_irope", False):
        return "chunked local attention (irope)"
    if getattr(layer, "pos_encoding_mode", "NONE") not in ("NONE", None):
        return f"in-kernel position encoding {layer.pos_encoding_mode}"
    scales = scale_reason(layer)
    if scales is not None:
        return scales
    hd = getattr(layer, "head_dim", None)
    if getattr(layer, "qk_head_dim", hd) != getattr(layer, "v_head_dim", hd):
        return f"qk head dim {layer.qk_head_dim} != v head dim {layer.v_head_dim}"
    if head_dim is not None and hd is not None and hd != head_dim:
        return f"head_dim {hd} (kernels built for {head_dim})"
    q_heads = getattr(layer, "tp_q_head_num", None)
    if num_q_heads is not None and q_heads is not None and q_heads != num_q_heads:
        return f"{q_heads} query heads (kernels built for {num_q_heads})"
    return None


def call_reason(k: Optional[torch.Tensor], v: Optional[torch.Tensor], kwargs: Mapping[str, object],
                served: Tuple[str, ...] = ()) -> Optional[str]:
    """Why this call of an attention layer cannot be served (None: it can): no new K/V, or
    extra keyword arguments the kernels do not implement (``sinks`` outside ``served``,
    descales, ...)."""
    if k is None or v is None:
        return "no new K/V given"
    extra = sorted(key for key, val in kwargs.items() if val is not None and key not in served)
    if extra:
        return f"extra arguments {extra}"
    return None


def layer_ranges(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (for log lines)."""
    order, parts = sorted(ids), []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and order[j + 1] == order[j] + 1:
            j += 1
        parts.append(str(order[i]) if i == j else f"{order[i]}-{order[j]}")
        i = j + 1
    return ", ".join(parts)


def _is_attention_layer(module: object) -> bool:
    return all(hasattr(module, a) for a in ("layer_id", "tp_q_head_num", "scaling", "head_dim"))


def count_attention_layers(model: object) -> int:
    """How many attention layers (distinct ``layer_id``) ``model`` holds (0 without modules)."""
    named = getattr(model, "named_modules", None)
    if named is None:
        return 0
    return len({int(m.layer_id) for _, m in named() if _is_attention_layer(m)})


def scan_layers(model: object, *, num_q_heads: Optional[int] = None,
                head_dim: Optional[int] = None) -> Dict[int, str]:
    """``layer_id -> reason`` for every attention layer of ``model`` GraniKV cannot serve.

    Walks ``model.named_modules()`` (nothing if it has none, e.g. before a model is loaded);
    also marks the attention layers of a module that holds attention-sink tensors (they reach
    the backend as a ``sinks=`` argument at call time).
    """
    out: Dict[int, str] = {}
    named = getattr(model, "named_modules", None)
    if named is None:
        return out
    for _, module in named():
        children = [c for c in vars(module).get("_modules", {}).values() if c is not None]
        names = list(vars(module).get("_parameters", {})) + list(vars(module).get("_buffers", {}))
        names += list(vars(module))
        sinks = any(_SINK_HINT in name.lower() and isinstance(getattr(module, name, None), torch.Tensor)
                    for name in names)
        for child in children:
            if _is_attention_layer(child):
                reason = layer_reason(child, num_q_heads=num_q_heads, head_dim=head_dim)
                if reason is None and sinks:
                    reason = SINKS
                if reason is not None:
                    out.setdefault(int(child.layer_id), reason)
        if _is_attention_layer(module) and int(module.layer_id) not in out:
            reason = layer_reason(module, num_q_heads=num_q_heads, head_dim=head_dim)
            if reason is not None:
                out[int(module.layer_id)] = reason
    return out


# ---- LayerEligibility ---------------------------------------------------------------------
# ``LayerEligibility``: the one verdict decode and extend share on whether GraniKV computes a
# layer's attention call.
#
# ``reason(layer, k, v, kwargs)`` is what both paths ask: the wrap-time scan of the loaded model
# (``scan_layers``), else ``layer_reason`` of this layer object (checked once per
# object), else ``call_reason`` of the call's own arguments. What each path does with a
# reason differs only because of when it can still act:
#
# - decode: the wrapped backend is planned once per step for every layer, so one layer cannot
#   opt out of the ``seq_len = 1`` plan. Any ineligible layer found by the scan keeps decode
#   stock for the whole model (attention sinks excepted: decode adds them in the merge; a
#   sliding window alone: per-layer paths); one found only at call time (``record``) makes
#   decode stock from the next step on;
# - extend: the layer's call goes to the wrapped backend (logged once per reason); attention
#   sinks are served by the whole extend (``full_extend``: the sink scales the merged output),
#   not by the prefix-part proxy.


class LayerEligibility:
    """Per-layer verdicts for one model: ``layer_id -> reason`` from the scan, plus a memo per
    layer object. ``num_q_heads`` / ``head_dim``: the geometry the kernels were built for."""

    def __init__(self, *, num_q_heads: int, head_dim: int, backend_name: str):
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.backend_name = backend_name
        self.scanned: Dict[int, str] = {}  # layer_id -> why it runs stock (scan and ``record``)
        self._memo: Dict[int, Optional[str]] = {}  # id(layer) -> its layer_reason (None: served)
        self._logged: Set[str] = set()
        self.num_layers = 0  # attention layers the scan saw

    def scan(self, model: object) -> Dict[int, str]:
        """Scans ``model``'s attention layers (logged once per reason); returns the verdicts."""
        self.scanned = scan_layers(model, num_q_heads=self.num_q_heads, head_dim=self.head_dim)
        by_reason: Dict[str, List[int]] = {}
        for layer_id, reason in sorted(self.scanned.items()):
            by_reason.setdefault(reason, []).append(layer_id)
        for reason, ids in by_reason.items():
            if reason == SINKS:
                logger.info("GraniKV: attention layers %s have attention sinks: served in decode (the "
                            "sink joins the merge) and in GraniKV's whole-extend prefill; the prefix-part "
                            "prefill of the %s backend keeps them stock", layer_ranges(ids), self.backend_name)
                continue
            then = ("in decode they may take per-layer paths" if reason.startswith(PER_LAYER_REASONS)
                    else "decode stays stock for the whole model")
            logger.warning("GraniKV: attention layers %s run the stock %s backend (%s); %s",
                           layer_ranges(ids), self.backend_name, reason, then)
        self.num_layers = count_attention_layers(model)
        return self.scanned

    def decode_blocked(self) -> Dict[int, str]:
        """The scan's verdicts that keep decode stock (attention sinks do not: decode serves them)."""
        return {i: r for i, r in self.scanned.items() if r != SINKS}

    def decode_reason(self, layer: RadixAttention, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      kwargs: Mapping[str, object]) -> Optional[str]:
        """``reason`` for a decode call: a ``sinks=`` argument of one fp32-convertible logit per
        q-head of this rank is served (the merge adds it), whatever else ``reason`` refuses."""
        return self.sinks_reason(layer, k, v, kwargs)

    def sinks_reason(self, layer: RadixAttention, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                     kwargs: Mapping[str, object]) -> Optional[str]:
        """``reason`` for a call on a path that adds attention sinks (decode's merge, the whole
        extend's final scaling): a ``sinks=`` argument of one logit per q-head is served."""
        reason = self.reason(layer, k, v, kwargs, sinks_served=True)
        sinks = kwargs.get("sinks")
        if reason is None and sinks is not None and (
                not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (self.num_q_heads,)):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            return f"sinks of shape {shape} (served: one per q-head, {self.num_q_heads})"
        return reason

    def reason(self, layer: RadixAttention, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
               kwargs: Mapping[str, object], *, sinks_served: bool = False) -> Optional[str]:
        """Why this call runs the wrapped backend's attention (None: GraniKV serves it)."""
        memo, key = self._memo, id(layer)
        if key in memo:
            reason = memo[key]
        else:
            reason = self.scanned.get(layer.layer_id) or layer_reason(
                layer, num_q_heads=self.num_q_heads, head_dim=self.head_dim)
            memo[key] = reason
        if sinks_served and reason == SINKS:  # the path adds the sinks itself
            reason = None
        return reason or call_reason(k, v, kwargs, served=("sinks",) if sinks_served else ())

    def record(self, layer_id: int, reason: str) -> None:
        """A decode call showed a feature the scan did not see (kept beside the scan's verdicts)."""
        self.scanned.setdefault(layer_id, reason)

    def log_stock_extend(self, layer: RadixAttention, reason: str) -> None:
        """One info line per reason: this extend call goes to the wrapped backend."""
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("GraniKV: extend of layer %d goes to the %s backend (%s)", layer.layer_id,
                        self.backend_name, reason)
