"""``AttentionContext``: what GraniKV's attention parts read of the served model and its
configuration, in one typed object with one owner per field.

The backend (``GraniKVAttnBackend``) makes it and is the only writer of its fields (a field may
be replaced while serving: the dispatcher by the paged one when a layer shows a feature the
kernels do not implement; tests swap the wrapped backend). The decode planner, the extend paths
and the debug compare read it; none of them holds the backend itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from granikv.attention.step_stats import StepStats
from granikv.config import GraniKVConfig

if TYPE_CHECKING:
    from granikv.attention.dispatcher import Dispatcher
    from granikv.mem_cache.hot_prefix_table import HotPrefixTable


@dataclass
class AttentionContext:
    """The served model runner, the wrapped backend and GraniKV's per-model settings.

    ``model_runner``: SGLang's ``ModelRunner`` (or a stand-in with its fields); ``inner``: the
    wrapped SGLang attention backend; ``num_q_heads`` / ``head_dim``: the per-rank geometry the
    kernels serve; ``stats``: the per-step counters every part records into.
    """

    cfg: GraniKVConfig
    model_runner: Any
    inner: Any
    backend_name: str
    dispatcher: Dispatcher
    device: torch.device
    num_q_heads: int
    head_dim: int
    stats: StepStats = field(default_factory=StepStats)

    @property
    def hot_prefix_table(self) -> HotPrefixTable:
        """Each request-pool row's HOT run (the allocator's table)."""
        return self.model_runner.token_to_kv_pool_allocator.hot_prefix_table

    @property
    def req_to_token(self) -> torch.Tensor:
        """SGLang's ``req_to_token`` table (int32 [rows, max_ctx])."""
        return self.model_runner.req_to_token_pool.req_to_token

    @property
    def kv_pool(self) -> Any:
        """SGLang's token-to-KV pool (per-layer K/V buffers)."""
        return self.model_runner.token_to_kv_pool
