"""What GraniKV does once per scheduler step, just before SGLang runs a batch.

Called by the ``Scheduler.run_batch`` hook (plugin.py). At that point the batch is formed and
its KV slots are allocated (``alloc_for_extend`` / ``alloc_for_decode`` ran), and its forward has
not been launched, which makes it the safe point to:

1. register the requests of an extend batch (their HOT run goes to the HotPrefixTable, and
   their locks count as sharers), then run queued promotions (copy a shared prefix into a HOT extent, rewrite the rows of the
   requests that hold it). Under the overlap scheduler the previous batch's forward may still
   be running on the forward stream and reading ``req_to_token``; the schedule stream waits for
   it first (a device-side wait, no host sync), and the next forward waits for the schedule
   stream as SGLang already arranges;
2. stage the batch's ``req_pool_idx`` list for the attention backend's per-step plan (decode:
   grouping and path; extend: the prefix part over HOT extents);
3. optionally check integrity, compare the TP ranks' storage decisions (tp_consistency.py,
   decode steps only: every rank of the group runs them in the same order), and log metrics at
   the configured cadence.
"""

import logging
import time

import numpy as np
import torch

logger = logging.getLogger("granikv")


def on_run_batch(scheduler, batch, cfg) -> None:
    cache = scheduler.tree_cache
    if not hasattr(cache, "apply_pending_promotions"):
        return
    mode = batch.forward_mode
    decode = mode.is_decode()
    extend = not decode and mode.is_extend()
    if extend:  # register first: their locks may be what makes a prefix shared
        cache.update_requests_hot_prefix(batch.reqs)
    if cache.has_pending_promotions():
        _wait_for_forward_stream(scheduler)
        cache.apply_pending_promotions()
    backend = _granikv_backend(scheduler)
    if backend is not None:
        t0 = time.perf_counter()
        rows = batch_rows(batch) if decode or extend else None
        backend.stage_batch(rows, seconds=time.perf_counter() - t0)
    if cfg.debug_integrity:
        cache.check_integrity()  # pools, table and tree
    if decode:
        n = scheduler._granikv_decode_steps = getattr(scheduler, "_granikv_decode_steps", 0) + 1
        _tp_check(scheduler, cfg).on_decode_step(cache, n)
        _maybe_report(scheduler, cache, backend, cfg.log_interval, n)


_ROWS_VIEW = [None, None]  # (SGLang's rows tensor, its numpy view) of the last step


def batch_rows(batch) -> np.ndarray:
    """The batch's ``req_pool_idx`` per request, in batch order (int64, host).

    SGLang keeps them on the host as ``ScheduleBatch.req_pool_indices_cpu`` (int64, replaced by
    a new tensor whenever the batch is filtered or merged, never written in place): a zero-copy
    view of it is returned (callers must not write to it), the SAME array object while SGLang's
    tensor is the same, so that the planner can tell an unchanged batch by identity. Otherwise
    the rows are read from the requests (a new array)."""
    cpu = getattr(batch, "req_pool_indices_cpu", None)
    if cpu is not None and cpu.dtype == torch.int64 and cpu.dim() == 1 and cpu.shape[0] == len(batch.reqs):
        if _ROWS_VIEW[0] is not cpu:
            _ROWS_VIEW[:] = cpu, cpu.numpy()
        return _ROWS_VIEW[1]
    return np.fromiter((r.req_pool_idx for r in batch.reqs), dtype=np.int64, count=len(batch.reqs))


def _tp_check(scheduler, cfg):
    """The scheduler's cross-rank decision check, created on first use."""
    check = getattr(scheduler, "_granikv_tp_check", None)
    if check is None:
        from granikv.tp_consistency import for_scheduler

        check = scheduler._granikv_tp_check = for_scheduler(scheduler, cfg.tp_check_interval)
    return check


def _wait_for_forward_stream(scheduler) -> None:
    fwd = getattr(scheduler, "forward_stream", None)
    if getattr(scheduler, "enable_overlap", False) and fwd is not None and torch.cuda.is_available():
        torch.cuda.current_stream().wait_stream(fwd)


def _granikv_backend(scheduler):
    """The model runner's GraniKV backend (None if attention is stock), looked up once."""
    if not hasattr(scheduler, "_granikv_backend"):
        from granikv.layers.attention.cascade.backend import GraniKVAttnBackend

        backend = getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None),
                          "attn_backend", None)
        scheduler._granikv_backend = backend if isinstance(backend, GraniKVAttnBackend) else None
    return scheduler._granikv_backend


METRICS_INTERVAL = 40  # decode steps between /metrics refreshes when logging is off


def _maybe_report(scheduler, cache, backend, log_interval: int, n: int) -> None:
    """Every ``log_interval`` decode steps (``n``: this one's number): a log line, and the
    /metrics gauges if enabled."""
    if n % (log_interval or METRICS_INTERVAL):
        return
    cache.refresh_gauges()
    if log_interval:
        attn = backend.stats_snapshot() if backend is not None else {}
        logger.info("%s | attention %s", cache.metrics.format(), attn)
    exporter = _exporter(scheduler)
    if exporter is not None:
        exporter.update(metrics_snapshot(scheduler, refresh=False))


def _exporter(scheduler):
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


def metrics_snapshot(scheduler, *, refresh: bool = True) -> dict:
    """Storage and attention counters, for server info / the metrics endpoint."""
    cache = scheduler.tree_cache
    if not hasattr(cache, "refresh_gauges"):
        return {}
    if refresh:
        cache.refresh_gauges()
    out = dict(cache.metrics.snapshot())
    backend = _granikv_backend(scheduler)
    if backend is not None:
        out["attention"] = backend.stats_snapshot()
    return out
