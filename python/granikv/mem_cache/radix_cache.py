"""GraniKVRadixCache: SGLang's RadixCache with HOT (contiguous-extent) nodes.

Which nodes are HOT: the deepest node of a locked path that the policy accepts (prefix length
from the root, live sharers), and the halves a split of a HOT node leaves. A node promoted at
depth ``d`` (tokens above it) gets ONE extent of ``d + len`` slots: a "shadow head", a copy of
its ancestors' KV, then its own tokens, so a request through it has a HOT run from token 0
even when the ancestors are COLD (a short common head) or HOT elsewhere (an earlier chunk):

    tree:  root ── h (COLD, 4) ── B (HOT, head 4) ── B' (HOT half) ── a (COLD) ...
                              └─ C (COLD) ...                      └─ b (COLD) ...
    HOT:   | copy of h | B's tokens | B''s tokens |      <- one extent [s, s + 4 + |B| + |B'|)
             s           s+4 = B.value[0]

A HOT node's ``value`` is always ``arange(start, start + len)`` (its own tokens, after the
head); ``HotNodes`` (hot_nodes.py) holds ``start`` and the head length (absent = 0) on the
host, so nothing here reads the device to find an extent. Root children are the ``d = 0``
case of the same code. The tree keeps the ancestors' own slots: other requests use them.

The HOT run of a request walks its path from the root: a node whose head covers its whole
depth (re)starts the run, a HOT node whose slots follow the run's end extends it. It is
published in the ``HotPrefixTable`` row of the request's ``req_pool_idx``, and the request's
``req_to_token`` row (and, on 0.5.17, ``prefix_indices``) point at the run.

Lifecycle (the plugin drives the two public extras; everything else is SGLang's own calls, named
per release in ``sglang_compat``: 0.5.17 ``cache_unfinished_req`` / ``cache_finished_req``,
0.5.23 ``checkpoint`` / ``on_release``):
- ``inc_lock_ref`` (admission, and each insert's re-lock) QUEUES the deepest node of the locked
  path that the policy accepts, if it is COLD;
- ``apply_pending_promotions()`` EXECUTES the queue (``PromotionQueue``) at a safe point
  (before a batch's forward): placement (``HotPlacement``: the node's own slots when they
  are contiguous, nothing or only a shadow head copied; else right after the parent's HOT
  run; else a fresh extent taken off the common free list, with unlocked COLD KV moved out
  of its window and LRU eviction if needed), KV copy, rewrite of the holders'
  ``req_to_token`` rows (and 0.5.17's ``prefix_indices``), free of the old COLD slots;
- ``update_request_hot_prefix(req)`` after ``alloc_for_extend`` registers a live request and
  points its row at its HOT run (``HotPublisher``); so does every insert of the request's
  KV (``_after_insert``); the release of its row (finish, abort, retract:
  ``_after_release``) drops it.
Anything that cannot be done safely is skipped and counted in ``metrics``; nothing raises
mid-serving. HOT extents come out of the same free slots as COLD KV and go back to them:
``evict`` (SGLang's memory pressure) is LRU over every unlocked leaf, HOT or COLD, and
counts the slots it frees; ``evict_hot`` (the HOT cap) evicts HOT subtrees.

This class is what SGLang sees (its RadixCache, the tree and eviction); it composes
``HotNodes`` (the HOT registry), ``PromotionQueue``, ``HotPlacement`` and ``HotPublisher``.
"""

import heapq
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from granikv import sglang_compat as compat
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_nodes import HotExtent, HotNodes, Run, is_attached
from granikv.mem_cache.hot_placement import HotPlacement, Placement
from granikv.mem_cache.hot_prefix_table import HotPrefixTable
from granikv.mem_cache.hot_publishing import HotPublisher
from granikv.mem_cache.kv_copy import check_kv_layout
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import PromotionPolicy, SharedLongPrefixPolicy
from granikv.mem_cache.promotion_queue import PromotionQueue

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from granikv.config import GraniKVConfig

__all__ = ["GraniKVRadixCache", "HotExtent"]


# the running release's prefix-cache lifecycle overrides (a class chosen at import time)
_Lifecycle: Any = compat.lifecycle_mixin()


class GraniKVRadixCache(_Lifecycle, RadixCache):
    def __init__(self, params: CacheInitParams, config: "GraniKVConfig", kv_pool: "MHATokenToKVPool",
                 hot_prefix_table: HotPrefixTable, *, policy: Optional[PromotionPolicy] = None,
                 metrics: Optional[GraniKVMetrics] = None) -> None:
        allocator = params.token_to_kv_pool_allocator
        if not isinstance(allocator, GraniKVAllocator):
            raise ValueError(
                f"GraniKVRadixCache needs a GraniKVAllocator, got {type(allocator).__name__}")
        if params.page_size != 1 or params.disable or params.is_eagle:
            raise ValueError(
                f"GraniKVRadixCache needs page_size=1, radix cache enabled and no EAGLE bigram "
                f"keys (got page_size={params.page_size}, disable={params.disable}, "
                f"is_eagle={params.is_eagle})")
        check_kv_layout(kv_pool)
        self.config = config
        self.kv_pool = kv_pool
        self.hot_prefix_table = hot_prefix_table
        self.hot_pool = allocator.hot_pool
        self.metrics = metrics or GraniKVMetrics()
        # the collaborators exist before SGLang's __init__ (it calls ``reset``); the tree's
        # root only after it, and ``reset`` replaces it: they read it through ``root``
        self.hot = HotNodes(self.hot_pool, root=lambda: self.root_node)
        self._publisher = HotPublisher(hot_prefix_table, self.hot, params.req_to_token_pool,
                                       self.metrics, device=None)
        self._queue = PromotionQueue(policy or SharedLongPrefixPolicy.from_config(config),
                                     self.metrics, self.hot, allocator,
                                     live_reqs=self._publisher.live_reqs)
        self._placement = HotPlacement(
            allocator, kv_pool, self.hot, self.metrics,
            evict=lambda n: self.evict(EvictParams(num_tokens=n)),
            evict_hot=lambda n: self.evict_hot(n))
        super().__init__(params)
        self._publisher.device = self.device  # SGLang's choice (from the allocator)
        self.refresh_gauges()

    @classmethod
    def create(cls, params: CacheInitParams, config: "GraniKVConfig", kv_pool: "MHATokenToKVPool",
               **kwargs: Any) -> "GraniKVRadixCache":
        """Build with the allocator's HotPrefixTable (created for ``params.req_to_token_pool``)."""
        alloc = params.token_to_kv_pool_allocator
        table = None  # the constructor rejects anything but a GraniKVAllocator
        if isinstance(alloc, GraniKVAllocator):
            table = alloc.ensure_hot_prefix_table(params.req_to_token_pool.req_to_token.shape[0])
        # None only with an allocator the constructor rejects before using the table
        return cls(params, config, kv_pool, cast(HotPrefixTable, table), **kwargs)

    # ---- state of the collaborators, under the names the checks and tests read -------------

    @property
    def policy(self) -> PromotionPolicy:
        """The promotion policy (the queue's; assignable, e.g. ``NeverPromote``)."""
        return self._queue.policy

    @policy.setter
    def policy(self, policy: PromotionPolicy) -> None:
        self._queue.policy = policy

    _hot_start = property(lambda self: self.hot.start)  # HOT node -> node.value[0]
    _head = property(lambda self: self.hot.head)  # HOT node -> shadow head length (if > 0)
    _live = property(lambda self: self._publisher.live)  # req_pool_idx -> Req
    _pending = property(lambda self: self._queue.pending)  # queued candidates (ordered set)
    _retry_counted = property(lambda self: self._queue.retry_counted)
    _candidates = property(lambda self: self._queue.candidates)  # the queue as drain found it

    @property
    def promotions_frozen(self) -> Optional[str]:
        """Why no new promotion is queued, if so (``freeze_promotions``)."""
        return self._queue.frozen

    # ---- SGLang API overrides --------------------------------------------------------------

    def reset(self) -> None:
        # every HOT extent belongs to a node (check_integrity), so all of them go, whether or
        # not the allocator was cleared first
        self.hot_pool.reset(self.hot_pool.base, self.hot_pool.span)
        self.hot.clear()
        self._queue.pending.clear()
        self._publisher.reset()
        super().reset()

    def inc_lock_ref(self, node: TreeNode) -> Any:  # SGLang's result (IncLockRefResult)
        result = super().inc_lock_ref(node)
        self._queue.queue(node)
        return result

    # lifecycle callbacks (``sglang_compat.lifecycle_mixin`` maps SGLang's calls onto them)

    def _after_insert(self, req: "Req") -> None:
        """The request's KV went into the tree (a chunk, a prefill, a finish): re-publish."""
        self.update_request_hot_prefix(req)

    def _after_release(self, idx: Optional[int], req: "Req") -> None:
        """The request gave row ``idx`` back (finish, abort, retract): forget it."""
        self._publisher.release(idx, req)

    def evict(self, params: EvictParams) -> EvictResult:
        """LRU over every unlocked leaf, HOT or COLD: both give their slots back to the one
        free list. Counts the slots freed (a HOT node's whole extent, shadow head included),
        so ``evictable_size()`` is exact."""
        start_time = time.perf_counter()
        hot = self.hot.start
        num = self._evict_lru(params.num_tokens, eligible=lambda n: True,
                              counts=lambda n: self._extent(n).size if n in hot else len(n.value))
        self.update_eviction_metrics(num, start_time)
        if num and hot:
            self.refresh_gauges()
        return EvictResult(num_tokens_evicted=num)

    def evictable_size(self) -> int:
        """Tokens of unlocked nodes (SGLang's counter, HOT included) + their shadow heads."""
        return self.evictable_size_ + self.hot.head_slots(locked=False)

    def protected_size(self) -> int:
        return self.protected_size_ + self.hot.head_slots(locked=True)

    def _split_node(self, key: "RadixKey", child: TreeNode, split_len: int) -> TreeNode:
        """A HOT ``child`` splits its extent: the upper half keeps the shadow head
        (``HotNodes.split``)."""
        new_node = super()._split_node(key, child, split_len)
        if self.hot.split(child, new_node, split_len):  # both halves stay HOT and contiguous
            self.metrics.hot_splits += 1
        return new_node

    # ---- GraniKV API -----------------------------------------------------------------------

    def update_request_hot_prefix(self, req: "Req") -> None:
        """Register ``req`` as live and publish its HOT run (call after ``alloc_for_extend``)."""
        self.update_requests_hot_prefix([req])

    def update_requests_hot_prefix(self, reqs: Sequence["Req"]) -> None:
        """Register ``reqs`` as live, point their rows at their HOT runs, publish the runs
        (``HotPublisher.update``)."""
        self._publisher.update(reqs)

    def hot_run(self, req: "Req") -> Tuple[int, int]:
        """``(start, length)`` of the HOT run ``req``'s KV starts with; ``(0, 0)`` if none."""
        run = self._run(req)
        return run.start, run.length

    def apply_pending_promotions(self, register: Sequence["Req"] = ()) -> int:
        """Execute queued promotions; returns how many nodes became HOT.

        ``register``: requests to register (``update_requests_hot_prefix``) first, e.g. the
        requests of the extend batch about to run.

        Call at a safe point: the batch about to run is formed and allocated, and its requests
        are already registered (``update_request_hot_prefix`` FIRST: a lock held by an
        unregistered request defers the promotion to a later call, counted as
        ``unknown_holders``). All device work is stream-ordered on the current stream (copy
        before row rewrite).
        """
        if register:
            self.update_requests_hot_prefix(register)
        promoted = self._queue.drain(self._promote)
        if promoted:
            self.refresh_gauges()
        return promoted

    def has_pending_promotions(self) -> bool:
        return bool(self._queue.pending)

    def pending_promotions(self) -> int:
        """Number of queued promotions (deterministic: the same on every TP rank)."""
        return len(self._queue.pending)

    def freeze_promotions(self, reason: str) -> None:
        """Queue no new promotion from now on (``reason`` is kept for logs and tests); queued
        ones are dropped. Existing HOT extents stay and are evicted as usual, so the KV, the
        tree and the table stay consistent. Used when the TP ranks diverged (tp_consistency)."""
        self._queue.freeze(reason)

    def evict_hot(self, num_tokens: int) -> int:
        """LRU-evict unlocked HOT subtrees until ``num_tokens`` HOT slots are freed.

        COLD leaves below HOT nodes go too (a HOT node is a leaf only once they are gone);
        COLD ancestors of HOT nodes stay (``evict`` frees them). Returns the number of HOT
        slots freed (shadow heads included).
        """
        hot = self.hot.start
        freed = self._evict_lru(
            num_tokens, eligible=lambda n: n in hot or self._below(n, cold=False),
            counts=lambda n: self._extent(n).size if n in hot else 0)
        self.refresh_gauges()
        return freed

    def hot_evictable_size(self) -> int:
        """HOT slots (shadow heads included) of unlocked HOT nodes."""
        return self.hot.hot_slots(locked=False)

    def hot_protected_size(self) -> int:
        """HOT slots (shadow heads included) of locked HOT nodes."""
        return self.hot.hot_slots(locked=True)

    def hot_extent_of(self, node: TreeNode) -> Optional[HotExtent]:
        return self._extent(node) if node in self.hot.start else None

    def live_requests(self) -> Dict[int, "Req"]:
        return dict(self._publisher.live)

    def refresh_gauges(self) -> None:
        alloc, m = self.token_to_kv_pool_allocator, self.metrics
        m.hot_extents = len(self.hot.start)
        m.hot_used_tokens = alloc.hot_used
        m.hot_capacity = alloc.hot_capacity  # a cap: unused, it stays free for every request
        m.cold_capacity = alloc.size - alloc.hot_used  # the slots COLD KV may use right now
        m.cold_used_tokens = m.cold_capacity - alloc.available_size()

    def check_integrity(self, *, strict: bool = True) -> None:
        """Raise ``IntegrityError`` on the first violated invariant (syncs the device).

        ``strict``: every request holding slots or locks is registered (true once the plugin's
        ``run_batch`` step has registered the batch, i.e. after ``alloc_for_extend`` and before
        the forward, no temporary admission locks pending), so COLD accounting is
        exact (free + tree + requests' private slots == COLD capacity) and every lock count
        equals the number of live requests whose path holds the node.
        """
        from granikv.mem_cache.cache_integrity import check_cache

        check_cache(self, strict=strict)

    # ---- promotion: place, move, copy, repoint (the queue decides which nodes) -------------

    def _promote(self, node: TreeNode, holders: List["Req"]) -> bool:
        placement = self._place(node)
        if placement is None:
            return False  # counted by the placement
        self._materialize(node, placement, holders)
        return True

    def _place(self, node: TreeNode) -> Optional[Placement]:
        """``HotPlacement.place``, then the move of unlocked COLD KV out of its window."""
        placement = self._placement.place(node)
        if placement is not None and placement.moves is not None:
            self._relocate(*placement.moves)
        return placement

    def _relocate(self, start: int, n: int, dst: torch.Tensor) -> None:
        self._placement.relocate(start, n, dst)

    def _materialize(self, node: TreeNode, placement: Placement, holders: List["Req"]) -> None:
        """Copy the path's last ``ext.size`` tokens of KV (ancestors, then ``node``) into ``ext``
        (adopted: only the shadow head) and repoint at it.

            path:     | A (any slots) | h (any slots) | node (COLD)       |
            extent:   | ext.start ..... shadow head   | ext.node_start ... |   head = depth
            req_to_token[holder][:head + length] -> arange(ext.start, ext.start + ext.size)

        (``head = 0``: the extent continues the parent's HOT run, only ``node``'s KV is copied
        unless adopted.) The ancestors keep their own slots (other requests use them);
        ``node``'s old COLD slots are freed unless adopted (then they are the extent).
        """
        ext = placement.ext
        old = self._placement.copy_in(node, placement)
        node.value = self._publisher.arange(ext.node_start, ext.length)
        self.hot.add(node, ext)
        runs = [self._run(r) for r in holders]
        self._publisher.repoint(list(zip(holders, runs, strict=True)))
        if old is not None:  # the node's old slots, except those the extent now holds
            outside = (old < ext.start) | (old >= ext.start + ext.size)
            self.token_to_kv_pool_allocator.free(old[outside])
        self._publisher.publish(holders, runs)
        self.metrics.promotions += 1
        self.metrics.promoted_tokens += ext.length
        self.metrics.shadow_head_tokens += ext.head

    # ---- eviction --------------------------------------------------------------------------

    def _evict_lru(self, num_tokens: int, *, eligible: Callable[[TreeNode], bool],
                   counts: Callable[[TreeNode], int]) -> int:
        """Evict ``eligible`` leaves in LRU order until ``counts`` (slots freed per node, taken
        before the node goes) adds up to ``num_tokens``; parents that become leaves join."""
        prio = self.eviction_strategy.get_priority
        heap = [(prio(n), n) for n in self.evictable_leaves if eligible(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, x = heapq.heappop(heap)
            freed += counts(x)
            self._release_value(x)
            self._delete_leaf(x)
            compat.record_remove(self, x)
            p = x.parent
            if p is not self.root_node and not p.children and p.lock_ref == 0 and eligible(p):
                heapq.heappush(heap, (prio(p), p))
        return freed

    def _release_value(self, node: TreeNode) -> None:
        self._queue.pending.pop(node, None)
        if node not in self.hot.start:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            return
        ext = self.hot.drop(node)
        self.token_to_kv_pool_allocator.free_extent(ext.start, ext.size)  # no host sync
        self.metrics.hot_evictions += 1
        self.metrics.hot_evicted_tokens += ext.size

    def _below(self, node: TreeNode, *, cold: bool) -> bool:
        """Whether some ancestor of ``node`` (the root excluded) is COLD (``cold``) / HOT."""
        node = node.parent
        while node is not None and node is not self.root_node:
            if (node not in self.hot.start) == cold:
                return True
            node = node.parent
        return False

    # ---- thin delegates (cache_integrity.py, tests and test support read these) ------------

    def _run(self, req: "Req") -> Run:
        return self._publisher.run(req)

    def _movable_nodes(self) -> List[TreeNode]:
        return self._placement.movable_nodes()

    def _extent(self, node: TreeNode) -> HotExtent:
        return self.hot.extent(node)

    def _path(self, node: Optional[TreeNode]) -> List[TreeNode]:
        """Nodes from the root's child down to ``node`` (empty for None / the root)."""
        return self.hot.path(node)

    def _depth(self, node: TreeNode) -> int:
        return self.hot.depth(node)

    def _attached(self, node: TreeNode) -> bool:
        return is_attached(node)
