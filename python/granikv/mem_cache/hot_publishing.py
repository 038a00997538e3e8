"""HotPublisher: the live requests, their HOT runs, their rows and the HotPrefixTable.

The HOT run of a request walks its path from the root (``HotNodes.run_of``), capped at its
``cache_protected_len``. It is published in the ``HotPrefixTable`` row of the request's
``req_pool_idx``, and the request's ``req_to_token`` row (and, on 0.5.17,
``prefix_indices``) point at the run.
"""

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch

from granikv import sglang_compat as compat
from granikv.mem_cache.hot_nodes import HotNodes, Run
from granikv.mem_cache.hot_prefix_table import HotPrefixTable
from granikv.mem_cache.metrics import GraniKVMetrics

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


class HotPublisher:
    def __init__(self, table: HotPrefixTable, hot: HotNodes, req_to_token_pool: "ReqToTokenPool",
                 metrics: GraniKVMetrics, device: Optional[torch.device]) -> None:
        self.table = table
        self.hot = hot
        self.req_to_token_pool = req_to_token_pool
        self.metrics = metrics
        self.device = device
        self.live: Dict[int, "Req"] = {}  # req_pool_idx -> Req

    def reset(self) -> None:
        self.live.clear()
        self.table.reset()

    def update(self, reqs: Iterable["Req"]) -> None:
        """Register ``reqs`` as live, point their rows at their HOT runs, publish the runs.

        SGLang writes ``prefix_indices`` (the tree's values) into a new request's row, so
        where a run starts with a shadow head, the row's first columns still point at the
        ancestors' slots (same KV): those rows are repointed (device-side, no host sync).
        """
        reqs = [r for r in reqs if compat.req_pool_idx(r) is not None]
        for req in reqs:
            self.live[_row(req)] = req
        runs = [self.run(r) for r in reqs]
        self.repoint([(r, run) for r, run in zip(reqs, runs, strict=True) if run.head])
        self.publish(reqs, runs)

    def release(self, idx: Optional[int], req: "Req") -> None:
        """The request gave row ``idx`` back (finish, abort, retract): forget it."""
        if idx is not None and self.live.get(idx) is req:
            del self.live[idx]
        if idx is not None:
            self.table.clear(idx)

    def run(self, req: "Req") -> Run:
        """``req``'s HOT run, capped at ``cache_protected_len`` (never its private slots)."""
        run = self.hot.run_of(getattr(req, "last_node", None))
        limit = compat.cache_protected_len(req, run.length)
        return run if run.length <= limit else Run(run.start, max(limit, 0), min(run.head, limit))

    def repoint(self, reqs_runs: List[Tuple["Req", Run]]) -> None:
        """Point each request's row and ``prefix_indices`` at its HOT run: one device-side
        masked write for all rows (no host sync).

            req_to_token[r]:  | ancestors' / COLD slots ...... | rest (untouched) |
                           -> | run.start ... run.start+len-1  | rest             |
                                columns [0, run.length)

        Valid for any live request: its path's tokens ``[0, run.length)`` have the same KV
        in the run as in the slots the row held (``run.length <= cache_protected_len``, so
        the request's private slots are never overwritten).
        """
        reqs_runs = [(r, run) for r, run in reqs_runs if run.length]
        if not reqs_runs:
            return
        for req, run in reqs_runs:
            compat.splice_prefix_indices(req, self.arange(run.start, run.length))
        r2t = self.req_to_token_pool.req_to_token
        width = max(run.length for _, run in reqs_runs)
        host = torch.tensor([[compat.req_pool_idx(r), run.start, run.length] for r, run in reqs_runs],
                            dtype=torch.int64)
        rows, starts, lens = host.to(r2t.device, non_blocking=True).unbind(1)
        cols = torch.arange(width, dtype=torch.int64, device=r2t.device)
        block = r2t[rows, :width]
        new = (starts[:, None] + cols).to(r2t.dtype)
        r2t[rows, :width] = torch.where(cols < lens[:, None], new, block)
        self.metrics.rows_rewritten += len(reqs_runs)

    def publish(self, reqs: Sequence["Req"], runs: Sequence[Run]) -> None:
        self.table.set_many([_row(r) for r in reqs],
                            [run.start for run in runs], [run.length for run in runs])

    def live_reqs(self) -> List["Req"]:
        stale = [i for i, r in self.live.items() if compat.req_pool_idx(r) != i]
        for i in stale:  # released through a path that bypassed the release callback
            del self.live[i]
            self.table.clear(i)
        return list(self.live.values())

    def arange(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int64, device=self.device)


def _row(req: "Req") -> int:
    """``req``'s ``req_pool_idx``: set for every request registered or published here."""
    return cast(int, compat.req_pool_idx(req))
