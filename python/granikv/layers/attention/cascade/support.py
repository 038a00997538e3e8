"""What GraniKV's attention can serve, and the dispatcher for a model runner's head shapes."""

import logging
from typing import Optional

import torch

from granikv.layers.attention.cascade.cost_model import CostModel
from granikv.layers.attention.cascade.dispatcher import Dispatcher

logger = logging.getLogger("granikv")

SUPPORTED_KV_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def unsupported_reason(model_runner, cfg) -> Optional[str]:
    """Why the shared-prefix attention cannot serve this model runner (None = it can)."""
    if cfg.attention_path == "paged":
        return "--granikv-attention-path=paged"
    mc = model_runner.model_config
    if getattr(model_runner, "use_mla_backend", False):
        return "MLA attention"
    if getattr(model_runner, "sliding_window_size", None):
        return f"sliding-window attention (window {model_runner.sliding_window_size})"
    if model_runner.kv_cache_dtype not in SUPPORTED_KV_DTYPES:
        return f"KV cache dtype {model_runner.kv_cache_dtype} (supported: fp16, bf16)"
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


def attention_tp_size(model_runner) -> int:
    """Attention tensor-parallel size (heads per rank = total / this)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_size)
    except Exception:  # no runtime context (tests, other SGLang versions)
        ps = getattr(model_runner, "ps", None)
        return int(getattr(ps, "attn_tp_size", None) or getattr(ps, "tp_size", None) or 1)


def build_dispatcher(model_runner, cfg, backend_name: Optional[str] = None) -> Dispatcher:
    """The dispatcher for this model runner's head shapes, with the paged coefficients of the
    wrapped backend ``backend_name`` where the cost-model file has them (else its top-level
    ones, calibrated on FlashInfer's decode; logged)."""
    mc = model_runner.model_config
    tp = attention_tp_size(model_runner)
    gpu = torch.cuda.get_device_name(model_runner.device) if torch.cuda.is_available() else None
    loaded = CostModel.load(cfg.cost_model, gpu)
    cost_model = loaded.for_backend(backend_name)
    if backend_name and cost_model is loaded and backend_name != "flashinfer":
        logger.info("GraniKV cost model: no paged coefficients of the %s backend; using the "
                    "calibrated (flashinfer) ones", backend_name)
    return Dispatcher(
        cost_model,
        num_q_heads=mc.num_attention_heads // tp,
        num_kv_heads=mc.get_num_kv_heads(tp),
        head_dim=mc.head_dim,
        kv_dtype_bytes=model_runner.kv_cache_dtype.itemsize,
        forced_path=cfg.attention_path,
        num_layers=mc.num_hidden_layers,
    )
