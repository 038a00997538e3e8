"""``SlotCopier``: the pre-replay copy of a cascade graph step's suffix slots.

A cascade graph captured with the graph workspace's slot-copy table (``CascadeWorkspace.graph_plan``)
reads each suffix item's KV slots from that table, not from ``req_to_token``
(kernels/suffix_slots.py). The planner runs the copy once per cascade replay, after the
step's metadata upload and before SGLang records its read-done event, so the replay reads
nothing the scheduler writes next and SGLang's fast write-after-read path stays (war_barrier.py).

On CUDA the copy is one launch captured into a CUDA graph of its own at graph-state set-up
(a replay costs a few microseconds of host time, where a Triton launch costs tens); elsewhere,
or if that capture fails, the kernel is launched directly.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.kernels.suffix_slots import copy_suffix_slots

logger = logging.getLogger("granikv")

#: Width of the slot-copy table: the most tokens one suffix item may hold (``sfx_max``) for the
#: copy to serve a build; a build with longer items (a suffix chunk above 1024 tokens at the
#: default reuse factor 2, i.e. a request's private suffix above ~32K tokens) reads
#: ``req_to_token`` during the replay, and SGLang's barrier then waits for the whole forward.
SLOT_COPY_TOKENS = 2048


class SlotCopier:
    def __init__(self, ws: CascadeWorkspace, req_to_token: Callable[[], torch.Tensor]):
        if ws.slot_copy is None:
            raise ValueError("SlotCopier: the workspace has no slot-copy table")
        self.ws = ws
        self._req_to_token = req_to_token
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._table: Optional[torch.Tensor] = None  # the req_to_token the graph was captured over
        self.copies = 0  # steps whose replay read the copy

    def capture(self) -> None:
        """Captures the copy into a CUDA graph (CUDA only; outside any other capture)."""
        if self.ws.device.type != "cuda":
            return
        table = self._req_to_token()
        if table.device.type != "cuda":
            return
        from granikv.kernels.graph_capture import capture_graph

        try:
            self._graph = capture_graph(lambda: copy_suffix_slots(self.ws.buffers, table))
            self._table = table
        except Exception as e:  # noqa: BLE001 - the direct launch stays correct
            logger.warning("GraniKV: the suffix-slot copy could not be captured into a CUDA graph (%s); "
                           "it is launched directly before each cascade replay", e)
            self._graph = None

    def run(self) -> None:
        """The copy for the step just uploaded (current stream; ``ws.slot_copy_ready`` must hold)."""
        table = self._req_to_token()
        if self._graph is not None and table is self._table:
            self._graph.replay()
        else:
            copy_suffix_slots(self.ws.buffers, table)
        self.copies += 1
