"""GraniKV's counters on SGLang's ``/metrics`` endpoint (Prometheus), when metrics are enabled.

SGLang (``--enable-metrics``) runs prometheus_client in multiprocess mode: gauges created in
the scheduler process are served by the HTTP server. GraniKV mirrors its storage counters and
the attention path counts into ``granikv:*`` gauges (``mostrecent``, labelled by TP rank),
refreshed at the scheduler-step cadence. Cumulative counts are exported as gauges named
``*_total`` (they only grow while the server lives).
"""

from typing import TYPE_CHECKING, Any, Dict, Iterable, Mapping, Optional, Set

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Gauge

STORAGE_GAUGES = {
    "hot_used_tokens": "KV slots used by HOT extents.",
    "hot_capacity": "Cap on the KV slots HOT extents may hold (nothing reserved).",
    "cold_used_tokens": "KV slots used in the COLD region.",
    "cold_capacity": "KV slots not held by HOT extents (what COLD KV may use now).",
    "hot_extents": "HOT extents (promoted shared prefixes and their split halves).",
    "promotions": "Prefixes promoted to HOT extents (total).",
    "promotions_skipped": "Promotions skipped (no space, superseded, unknown holders) (total).",
    "extended_in_place": "Promotions placed right after their parent's HOT run, nothing re-copied (total).",
    "hot_evictions": "HOT nodes evicted (total).",
    "bytes_copied": "Bytes of KV copied by promotions and compaction (total).",
    "tp_divergences": "Cross-rank checks that found the TP ranks' storage decisions differing (total; "
                      "promotions are frozen after the first).",
}
TOTALS = {"promotions", "promotions_skipped", "extended_in_place", "hot_evictions", "bytes_copied",
          "tp_divergences"}


def metrics_enabled() -> bool:
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:
        return False


class PrometheusExporter:
    """``update(snapshot)`` with ``scheduler_step.metrics_snapshot``'s dict."""

    def __init__(self, labels: Mapping[str, str], *, registry: Optional["CollectorRegistry"] = None) -> None:
        from prometheus_client import REGISTRY, Gauge

        reg = registry if registry is not None else REGISTRY
        self.labels = dict(labels)
        names = list(self.labels)

        def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> "Gauge":
            """One of GraniKV's gauges: the server's labels (+ ``extra``), the most recent value
            across processes."""
            return Gauge(name, doc, labelnames=names + list(extra), multiprocess_mode="mostrecent",
                         registry=reg)

        self._storage: Dict[str, "Gauge"] = {}
        for key, doc in STORAGE_GAUGES.items():
            name = f"granikv:{key}{'_total' if key in TOTALS else ''}"
            self._storage[key] = gauge(name, doc)
        self._steps = gauge("granikv:decode_steps_total", "Decode steps per attention path.", ("path",))
        self._hit = gauge("granikv:hot_hit_rate",
                          "Share of decode requests served from a shared HOT prefix.")
        self._plan = gauge("granikv:plan_us_mean",
                           "Mean host time of a decode step's planning (grouping, path choice, workspace fill).")
        self._plan_pct = gauge("granikv:plan_us",
                               "Host time of a decode step's planning (staging, grouping, path choice, "
                               "workspace fill), percentile over the last decode steps.", ("quantile",))
        self._plan_steps = gauge("granikv:planned_steps_total", "Decode steps planned (and timed) by GraniKV.")
        self._plan_section = gauge("granikv:plan_section_us_total",
                                   "Host time of decode planning per section (stage, lookup, choose, fill, "
                                   "upload, view), and 'cpu': the thread CPU time of the backend's part "
                                   "(work, not waiting); a rate over planned_steps_total gives means.", ("section",))
        self._plan_bucket = gauge("granikv:plan_us_bucket",
                                  "Decode steps whose planning took at most 'le' microseconds (cumulative "
                                  "histogram since start; bucket deltas give any window's percentiles).", ("le",))
        self._bucket_edges: Set[str] = set()  # histogram edges published so far
        self._reuse = gauge("granikv:work_list_fills_total",
                            "Decode-step workspace fills: 'built' from scratch or 'reused' from the previous step "
                            "('in_place': reused with nothing uploaded; 'ends_in_graph': steps whose CUDA graph "
                            "copied the suffix ends itself; 'steady_replay': decode steps planned from the "
                            "previous one, paged or not).",
                            ("kind",))
        self._extend = gauge("granikv:extend_batches_total",
                             "Extend (prefill) batches with a cached prefix: prefix part 'hot' (dense "
                             "call over HOT extents) or 'stock' (the wrapped backend's paged prefill); "
                             "'exact': an FP8 cache's batch without a HOT run, computed by GraniKV over "
                             "the cache's values as its decode reads them.", ("path",))

        self._host_overhead = gauge("granikv:host_overhead_steps_total",
                                    "Decode steps run paged because the host planning term and the launch "
                                    "floors exceed what GraniKV's kernels would save (reason host_overhead).")
        self._host_term = gauge("granikv:dispatch_host_us",
                                "Host planning term the dispatcher charges a GraniKV step (moving average "
                                "of the measured planning time of such steps; the cost model's prior before).")
        self._unplanned = gauge("granikv:unplanned_steps_total",
                                "Decode steps that reached a GraniKV backend without a staged batch (ran paged).")
        self._fallbacks = gauge("granikv:extend_fallbacks_total",
                                "Extend batches with a cached prefix left to the stock prefill, per reason.",
                                ("reason",))
        self._paged_reasons = gauge("granikv:decode_paged_reasons_total",
                                    "Decode steps sent to the stock path before any path choice, per reason "
                                    "(e.g. no cascade graph of this batch size, no HOT prefix in the batch).",
                                    ("reason",))
        self._layer_calls = gauge("granikv:decode_layer_calls_total",
                                  "Decode layer calls of steps with per-layer paths (hybrid models): "
                                  "'granikv' (GraniKV's path) or 'stock' (sliding-window layers on the "
                                  "wrapped backend planned with the real batch).", ("path",))
        self._backends = gauge("granikv:attention_backends",
                               "GraniKV attention backends the scheduler stages (0: attention is stock).")

    def update(self, snapshot: Mapping[str, Any]) -> None:
        for key, gauge in self._storage.items():
            if key in snapshot:
                gauge.labels(**self.labels).set(float(snapshot[key]))
        attention: Optional[Mapping[str, Any]] = snapshot.get("attention")
        self._backends.labels(**self.labels).set(float(attention.get("backends", 1)) if attention else 0.0)
        if attention:
            self._unplanned.labels(**self.labels).set(float(attention.get("unplanned_steps", 0)))
            self._host_overhead.labels(**self.labels).set(float(attention.get("host_overhead_steps", 0)))
            if "dispatch_host_us_mean" in attention:
                self._host_term.labels(**self.labels).set(float(attention["dispatch_host_us_mean"]))
            for reason, n in (attention.get("extend_fallbacks") or {}).items():
                self._fallbacks.labels(**self.labels, reason=reason).set(float(n))
            for reason, n in (attention.get("decode_paged_reasons") or {}).items():
                self._paged_reasons.labels(**self.labels, reason=reason).set(float(n))
            for path, n in attention.get("steps_per_path", {}).items():
                self._steps.labels(**self.labels, path=path).set(float(n))
            self._hit.labels(**self.labels).set(float(attention.get("hot_hit_rate", 0.0)))
            self._plan.labels(**self.labels).set(float(attention.get("plan_us_mean", 0.0)))
            for q, key in (("0.5", "plan_us_p50"), ("0.99", "plan_us_p99")):
                self._plan_pct.labels(**self.labels, quantile=q).set(float(attention.get(key, 0.0)))
            self._plan_steps.labels(**self.labels).set(float(attention.get("planned_steps", 0)))
            sections = dict(attention.get("plan_sections_us_total") or {})
            sections["cpu"] = attention.get("plan_cpu_us_total", 0.0)
            for section, us in sections.items():
                self._plan_section.labels(**self.labels, section=section).set(float(us))
            self._update_buckets(attention.get("plan_us_hist") or {})
            for kind, key in (("built", "work_list_builds"), ("reused", "work_list_reuses"),
                              ("in_place", "work_list_in_place"), ("ends_in_graph", "ends_in_graph_steps"),
                              ("steady_replay", "steady_replays")):
                self._reuse.labels(**self.labels, kind=kind).set(float(attention.get(key, 0)))
            for path, n in (attention.get("per_layer_calls") or {}).items():
                self._layer_calls.labels(**self.labels, path=path).set(float(n))
            hot = float(attention.get("extend_hot_batches", 0))
            exact = float(attention.get("extend_exact_batches", 0))
            self._extend.labels(**self.labels, path="hot").set(hot)
            self._extend.labels(**self.labels, path="exact").set(exact)
            self._extend.labels(**self.labels, path="stock").set(
                float(attention.get("extend_batches", 0)) - hot - exact)

    def _update_buckets(self, hist: Mapping[str, float]) -> None:
        """Prometheus histogram convention: cumulative counts per upper edge, ``+Inf`` last
        (only the edges some step reached, and every edge after them: counts never go down)."""
        seen = self._bucket_edges
        seen.update(hist)
        total = 0.0
        for edge in sorted(seen, key=float):
            total += float(hist.get(edge, 0))
            self._plan_bucket.labels(**self.labels, le="+Inf" if edge == "inf" else edge).set(total)
        if "inf" not in seen:
            self._plan_bucket.labels(**self.labels, le="+Inf").set(total)
