"""What GraniKV does once per scheduler step, just before SGLang runs a batch.

Called by the ``Scheduler.run_batch`` hook (plugin.py). At that point the batch is formed and
its KV slots are allocated (``alloc_for_extend`` / ``alloc_for_decode`` ran), and its forward has
not been launched, which makes it the safe point to:

1. register the requests of an extend batch (their HOT run goes to the HotPrefixTable, and
   their locks count as sharers), then run queued promotions (copy a shared prefix into a HOT
   extent, rewrite the rows of the requests that hold it). Under the overlap scheduler the
   previous batch's forward may still be running on the forward stream and reading
   ``req_to_token``; the schedule stream waits for it first (a device-side wait, no host sync),
   and the next forward waits for the schedule stream as SGLang already arranges;
2. stage the batch's ``req_pool_idx`` list for the attention backend's per-step plan (decode:
   grouping and path; extend: the prefix part over HOT extents);
3. optionally check integrity, compare the TP ranks' storage decisions (tp_consistency.py,
   decode steps only: every rank of the group runs them in the same order), and log metrics at
   the configured cadence.
"""

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np
import torch

from granikv import sglang_compat as compat
from granikv.attention.step_stats import MAXIMA

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    from granikv.attention.backend import GraniKVAttnBackend
    from granikv.config import GraniKVConfig
    from granikv.mem_cache.radix_cache import GraniKVRadixCache
    from granikv.prometheus import PrometheusExporter
    from granikv.tp_consistency import TPConsistencyCheck

logger = logging.getLogger("granikv")


def on_run_batch(scheduler: "Scheduler", batch: "ScheduleBatch", cfg: "GraniKVConfig") -> None:
    cache = scheduler.tree_cache
    if not hasattr(cache, "apply_pending_promotions"):
        return
    backends = granikv_backends(scheduler, cache)  # first call: no backend -> no promotions
    mode = batch.forward_mode
    decode = mode.is_decode()
    extend = not decode and mode.is_extend()
    if extend:  # register first: their locks may be what makes a prefix shared
        cache.update_requests_hot_prefix(batch.reqs)
    if cache.has_pending_promotions():
        _wait_for_forward_stream(scheduler)
        cache.apply_pending_promotions()
    if backends:  # every wrapped instance: the one that runs this batch plans it
        rows, seconds = None, 0.0
        if extend or (decode and _any_plans_decode(backends)):  # else no rows are read this step
            t0 = time.perf_counter()
            rows = batch_rows(batch)
            seconds = time.perf_counter() - t0
        for b in backends:
            b.stage_batch(rows, seconds=seconds)
    if cfg.debug_integrity:
        cache.check_integrity()  # pools, table and tree
    if decode:
        n = scheduler._granikv_decode_steps = getattr(scheduler, "_granikv_decode_steps", 0) + 1
        _tp_check(scheduler, cfg).on_decode_step(cache, n)
        if not n % (cfg.log_interval or METRICS_INTERVAL):
            _report(scheduler, cache, backends, cfg.log_interval)


def _any_plans_decode(backends: List["GraniKVAttnBackend"]) -> bool:
    """Whether any backend would plan a decode step now (``plans_decode``: a HOT run is held in
    its table); a loop, no generator (every decode step)."""
    for b in backends:
        if b.plans_decode():
            return True
    return False


_ROWS_VIEW: List[Any] = [None, None]  # (SGLang's rows tensor, its numpy view) of the last step


def batch_rows(batch: "ScheduleBatch") -> np.ndarray:
    """The batch's ``req_pool_idx`` per request, in batch order (int64, host).

    SGLang keeps them on the host as ``ScheduleBatch.req_pool_indices_cpu`` (int64, replaced by
    a new tensor whenever the batch is filtered or merged, never written in place): a zero-copy
    view of it is returned (callers must not write to it), the SAME array object while SGLang's
    tensor is the same, so that the planner can tell an unchanged batch by identity. Otherwise
    the rows are read from the requests (a new array)."""
    cpu = getattr(batch, "req_pool_indices_cpu", None)
    n = len(batch.reqs)
    if cpu is not None:
        if _ROWS_VIEW[0] is not cpu and cpu.dtype == torch.int64 and cpu.dim() == 1:
            _ROWS_VIEW[:] = cpu, cpu.numpy()  # checked once: SGLang never writes or resizes it in place
        if _ROWS_VIEW[0] is cpu and len(_ROWS_VIEW[1]) == n:
            return _ROWS_VIEW[1]
    return np.fromiter((compat.req_pool_idx(r) for r in batch.reqs), dtype=np.int64,
                       count=n)


def _tp_check(scheduler: "Scheduler", cfg: "GraniKVConfig") -> "TPConsistencyCheck":
    """The scheduler's cross-rank decision check, created on first use."""
    check = getattr(scheduler, "_granikv_tp_check", None)
    if check is None:
        from granikv.tp_consistency import for_scheduler

        check = scheduler._granikv_tp_check = for_scheduler(scheduler, cfg.tp_check_interval)
    return check


def _wait_for_forward_stream(scheduler: "Scheduler") -> None:
    fwd = getattr(scheduler, "forward_stream", None)
    if getattr(scheduler, "enable_overlap", False) and fwd is not None and torch.cuda.is_available():
        torch.cuda.current_stream().wait_stream(fwd)


def granikv_backends(scheduler: "Scheduler", cache: Optional["BasePrefixCache"] = None
                     ) -> List["GraniKVAttnBackend"]:
    """The model runner's GraniKV backends, looked up once: every instance wrapped for it
    (backend_registry: hybrid prefill/decode, two-batch overlap, pdmux), else its
    ``attn_backend`` if that is one. None found: GraniKV's attention cannot run, so the first
    lookup says so and turns promotions off (a HOT prefix would only cost copies)."""
    if not hasattr(scheduler, "_granikv_backends"):
        from granikv.attention import backend_registry
        from granikv.attention.backend import GraniKVAttnBackend

        runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        found = backend_registry.backends_of(runner)
        top = getattr(runner, "attn_backend", None)
        if not found and isinstance(top, GraniKVAttnBackend):
            found = [top]
        scheduler._granikv_backends = found
        if not found:
            logger.warning("GraniKV: no GraniKV attention backend is reachable from the model "
                           "runner (attention %s): decode and extend stay stock, and prefixes are "
                           "not promoted to HOT", type(top).__name__)
    backends = scheduler._granikv_backends
    if not backends and cache is not None and hasattr(cache, "policy"):
        from granikv.mem_cache.policy import NeverPromote

        if not isinstance(cache.policy, NeverPromote):
            cache.policy = NeverPromote()
    return backends


class _AttentionStats:
    """The attention counters of one or several wrapped backends, as one snapshot: counts
    summed, ``max_*`` and ``step_stats.MAXIMA`` maxima, means and rates of the busiest backend
    (most decode steps)."""

    def __init__(self, backends: List["GraniKVAttnBackend"]) -> None:
        self.backends = backends

    def stats_snapshot(self) -> Dict[str, Any]:
        snaps: List[Dict[str, Any]] = [b.stats_snapshot() for b in self.backends]
        if len(snaps) == 1:
            return snaps[0]
        busiest = max(snaps, key=lambda s: s.get("decode_steps", 0))
        out = dict(busiest)
        for key, value in out.items():
            if key.startswith("max_") or key.endswith("_max") or key in MAXIMA:
                out[key] = max(s.get(key, 0) for s in snaps)
            elif isinstance(value, dict):
                merged: Dict[Any, Any] = {}
                for s in snaps:
                    for k, v in (s.get(key) or {}).items():
                        merged[k] = merged.get(k, 0) + v
                out[key] = merged
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                    key.endswith(("_mean", "_rate", "_per_step"))):
                out[key] = sum(s.get(key, 0) for s in snaps)
        out["backends"] = len(snaps)
        return out


METRICS_INTERVAL = 40  # decode steps between /metrics refreshes when logging is off


def _report(scheduler: "Scheduler", cache: "GraniKVRadixCache", backends: List["GraniKVAttnBackend"],
            log_interval: int) -> None:
    """What ``on_run_batch`` does every ``log_interval`` decode steps (every ``METRICS_INTERVAL``
    when logging is off): a log line if logging is on and the logger passes INFO (the line's
    snapshot costs about 30 µs of the scheduler's step: not built for a dropped line), and the
    /metrics gauges if enabled."""
    cache.refresh_gauges()
    if log_interval and logger.isEnabledFor(logging.INFO):
        attn = _AttentionStats(backends).stats_snapshot() if backends else {}
        logger.info("%s | attention %s", cache.metrics.format(), attn)
    exporter = _exporter(scheduler)
    if exporter is not None:
        exporter.update(metrics_snapshot(scheduler, refresh=False))


def _exporter(scheduler: "Scheduler") -> Optional["PrometheusExporter"]:
    """The scheduler's Prometheus exporter, created on first use; None if metrics are off."""
    if not hasattr(scheduler, "_granikv_exporter"):
        from granikv.prometheus import PrometheusExporter, metrics_enabled

        exporter = None
        if metrics_enabled():
            try:
                exporter = PrometheusExporter({"tp_rank": str(getattr(scheduler, "tp_rank", 0))})
            except ImportError:
                logger.warning("GraniKV: prometheus_client is missing; no granikv:* metrics")
        scheduler._granikv_exporter = exporter
    return scheduler._granikv_exporter


def metrics_snapshot(scheduler: "Scheduler", *, refresh: bool = True) -> Dict[str, Any]:
    """Storage and attention counters, for server info / the metrics endpoint."""
    cache = scheduler.tree_cache
    if not hasattr(cache, "refresh_gauges"):
        return {}
    if refresh:
        cache.refresh_gauges()
    out = dict(cache.metrics.snapshot())
    backends = granikv_backends(scheduler, cache)
    if backends:
        out["attention"] = _AttentionStats(backends).stats_snapshot()
    return out
