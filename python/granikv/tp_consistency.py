"""Runtime check that the attention-TP ranks took the same storage decisions.

Under SGLang's tensor parallelism every TP rank runs its own scheduler, radix cache and GraniKV
allocator over its share of the KV heads, and nothing is shared: the ranks must promote,
evict, split and compact identically on their own (the decisions depend only on scheduler
events, `docs/multi_gpu.md`). A rank that diverged would hold different COLD free counts,
hence admit different batches, and SGLang's collectives would then hang or mix up requests.
The CPU test `test/reliability/test_tp_consistency.py` drives simulated ranks through random
events; this module checks the real ranks while serving:

- mechanism: ``fingerprint(cache)``, a small dict of the decision counters, the COLD free count
  and a digest of the HOT pool's layout (the slot numbers are the same on every rank: SGLang
  sizes the KV pools to the minimum over the TP ranks);
- policy: ``TPConsistencyCheck.on_decode_step``, every ``interval`` decode steps, all-gathers
  the fingerprints over SGLang's attention-TP CPU (gloo) group and compares them. On a
  mismatch every rank sees the same gathered list, so all of them take the same action
  together: log the differing fields per rank (error, once), count it, and freeze promotions
  (``GraniKVRadixCache.freeze_promotions``), which keeps each rank's own state consistent and
  stops the divergence from growing; serving goes on.

The hook (``scheduler_step.on_run_batch``) calls it on decode steps only, which every rank of
the group runs in the same order, so the collective never waits for a rank that skipped it.
"""

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, cast

import numpy as np

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler
    from torch.distributed import ProcessGroup

    from granikv.mem_cache.radix_cache import GraniKVRadixCache

logger = logging.getLogger("granikv")

DECISION_COUNTERS = ("promotions", "promotions_skipped", "promoted_tokens", "shadow_head_tokens",
                     "extended_in_place", "hot_evictions", "hot_evicted_tokens", "hot_splits",
                     "compactions", "compaction_moves", "rows_rewritten")
"""Counters equal on every rank when the decisions are (bytes_copied is per rank: head share)."""
_FAILED = "fingerprint_failed"  # the key a rank sends instead of its fingerprint when that raised


def fingerprint(cache: "GraniKVRadixCache") -> Dict[str, Any]:
    """What every TP rank must agree on, from ``cache`` (a GraniKVRadixCache)."""
    m = cache.metrics
    extents = cache.hot_pool.extents()
    layout = np.asarray(sorted(extents.items()), dtype=np.int64).tobytes()
    return dict(
        counters=tuple(int(getattr(m, k)) for k in DECISION_COUNTERS),
        cold_free=int(cache.token_to_kv_pool_allocator.available_size()),
        hot_extents=len(extents),
        hot_used=int(cache.hot_pool.used_size),
        hot_layout=hashlib.blake2b(layout, digest_size=8).hexdigest(),
        pending=cache.pending_promotions(),
    )


def differences(prints: List[Dict[str, Any]]) -> Dict[str, list]:
    """Fields whose values differ across ranks -> the per-rank values ({} if all agree)."""
    out: Dict[str, list] = {}
    for key in prints[0]:
        values: List[Any] = [p.get(key) for p in prints]
        if any(v != values[0] for v in values[1:]):
            if key == "counters":  # name the counters that differ
                for i, name in enumerate(DECISION_COUNTERS):
                    per_rank = [v[i] for v in values]
                    if any(x != per_rank[0] for x in per_rank[1:]):
                        out[name] = per_rank
            else:
                out[key] = values
    return out


class TPConsistencyCheck:
    """Compares the ranks' fingerprints every ``interval`` decode steps over ``group``.

    ``group``: a torch.distributed process group on CPU (SGLang's ``attn_tp_cpu_group``, gloo)
    of ``world_size`` ranks; with one rank (or interval 0) the check is off.
    """

    def __init__(self, group: Optional["ProcessGroup"], world_size: int, interval: int) -> None:
        self.group = group
        self.world_size = int(world_size)
        self.interval = int(interval)
        self.last_differences: Dict[str, list] = {}

    @property
    def enabled(self) -> bool:
        return self.interval > 0 and self.world_size > 1 and self.group is not None

    def on_decode_step(self, cache: "GraniKVRadixCache", step: int) -> Optional[bool]:
        """Decode step number ``step`` (counted by the caller, the same on every rank): every
        ``interval`` steps gather and compare. Returns True (all ranks agree), False (a
        divergence, handled) or None (no check this step, or the collective failed: the check
        then turns itself off, logged once)."""
        if not self.enabled or step % self.interval:
            return None
        return self.check(cache, step)

    def check(self, cache: "GraniKVRadixCache", step: int) -> Optional[bool]:
        """One comparison. A rank that cannot compute its fingerprint still takes part in the
        collective (with a failure marker instead), so every rank learns of it in the same call
        and all turn the check off together: none is left blocked at a later all-gather."""
        import torch.distributed as dist

        try:
            mine: Dict[str, Any] = fingerprint(cache)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            mine = {_FAILED: f"{type(exc).__name__}: {exc}"}
        prints: List[Optional[Dict[str, Any]]] = [None] * self.world_size
        try:
            dist.all_gather_object(prints, mine, group=self.group)
        except Exception as exc:  # a failed gloo call must not fail the scheduler step
            self._turn_off(f"{type(exc).__name__}: {exc}")
            return None
        failed = {r: p.get(_FAILED) if p else "no fingerprint" for r, p in enumerate(prints)
                  if not p or _FAILED in p}
        if failed:
            self._turn_off(f"rank(s) could not compute a fingerprint: {failed}")
            return None
        m = cache.metrics
        m.tp_checks += 1
        diff = differences(cast(List[Dict[str, Any]], prints))  # no None left: ``failed`` is empty
        if not diff:
            return True
        m.tp_divergences += 1
        self.last_differences = diff
        if m.tp_divergences == 1:
            logger.error(
                "GraniKV: the %d attention-TP ranks' storage decisions differ after %d decode "
                "steps (per-rank values: %s). Promotions are frozen on every rank from now on; "
                "each rank's KV stays consistent on its own. Please report this with the "
                "server flags.", self.world_size, step, diff)
        cache.freeze_promotions("tp divergence")
        return False


    def _turn_off(self, why: str) -> None:
        self.interval = 0
        logger.warning("GraniKV: the TP decision check failed (%s) and is off from now on; serving "
                       "goes on", why)
        return None


def for_scheduler(scheduler: "Scheduler", interval: int) -> TPConsistencyCheck:
    """The check of one SGLang scheduler: its attention-TP CPU group (the ranks that hold the
    same requests; with DP attention, only those)."""
    group = getattr(scheduler, "attn_tp_cpu_group", None) or getattr(scheduler, "tp_cpu_group", None)
    size = 1
    if group is not None:
        import torch.distributed as dist

        size = dist.get_world_size(group) if dist.is_initialized() else 1
    return TPConsistencyCheck(group, size, interval)
