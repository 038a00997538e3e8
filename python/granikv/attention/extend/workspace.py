"""The FlashInfer float workspace of the prefill path over HOT prefixes, reserved at startup.

SGLang's flashinfer backend owns a workspace that GraniKV's dense prefill calls share (stream
ordered). Other backends (triton) have none, so GraniKV needs its own: 384 MiB, SGLang's
default FlashInfer size. It is allocated while SGLang profiles the memory left for the KV
pool (``KVCacheConfigurator._profile_available_bytes``, plugin.py) and subtracted from that
figure, so the KV pool is sized with it counted and nothing is allocated mid-serving. If the
allocation fails there, the HOT prefill path is off (logged) and everything else runs.

The reservation lives on the loaded model (``model._granikv_extend_workspace``; the configurator
is a slotted dataclass and holds the model as ``model``): the attention backend finds it
through ``model_runner.model``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    from granikv.config import GraniKVConfig

logger = logging.getLogger("granikv")

EXTEND_WORKSPACE_BYTES = 384 << 20  # SGLang's default FlashInfer workspace (SGLANG_FLASHINFER_WORKSPACE_SIZE)
_ATTR = "_granikv_extend_workspace"


@dataclass(frozen=True)
class Reservation:
    """``buffer``: the uint8 workspace, or None with ``off_reason`` saying why there is none."""

    buffer: Optional[torch.Tensor]
    off_reason: Optional[str] = None


def prefill_backend_of(server_args: ServerArgs) -> Optional[str]:
    get = getattr(server_args, "get_attention_backends", None)
    if get is not None:
        return get()[0]
    return getattr(server_args, "prefill_attention_backend", None) or getattr(
        server_args, "attention_backend", None)


def needs_own_workspace(server_args: ServerArgs, cfg: GraniKVConfig) -> bool:
    """Whether the HOT prefill path will need a workspace of its own (prefill not flashinfer)."""
    return cfg.extend_path != "paged" and prefill_backend_of(server_args) != "flashinfer"


def reserve(holder: object, device: Union[str, torch.device], nbytes: int = EXTEND_WORKSPACE_BYTES) -> int:
    """Allocates the workspace on ``device`` and records it on ``holder``; returns the bytes to
    take off the KV budget (0 when the allocation failed or ``holder`` already has one)."""
    if getattr(holder, _ATTR, None) is not None:
        return 0  # profiled again: the buffer is already outside the free memory
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        reason = f"no memory for its {nbytes >> 20} MiB FlashInfer workspace at startup"
        logger.error("GraniKV: prefill over HOT prefixes is off: %s (%s)", reason, type(e).__name__)
        setattr(holder, _ATTR, Reservation(None, reason))
        return 0
    setattr(holder, _ATTR, Reservation(buf))
    logger.info("GraniKV: %d MiB FlashInfer workspace reserved before the KV pool is sized (prefill "
                "over HOT prefixes)", nbytes >> 20)
    return nbytes


def reservation_of(model_runner: ModelRunner) -> Optional[Reservation]:
    """The reservation made for ``model_runner``'s model, None if none was attempted."""
    return getattr(getattr(model_runner, "model", None), _ATTR, None)
