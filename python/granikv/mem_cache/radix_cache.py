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
head); ``self._hot_start`` holds ``start`` and ``self._head`` the head length (absent = 0) on
the host, so nothing here reads the device to find an extent. Root children are the ``d = 0``
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
- ``apply_pending_promotions()`` EXECUTES the queue at a safe point (before a batch's
  forward): extent alloc (right after the parent's HOT run when that covers the whole path
  and the slots are free: no head, only the node's KV copied; else a fresh extent with a
  shadow head, HOT eviction / compaction if needed), KV copy (ancestors + node),
  rewrite of the holders' ``req_to_token`` rows (and 0.5.17's ``prefix_indices``), free of
  the COLD slots;
- ``update_request_hot_prefix(req)`` after ``alloc_for_extend`` registers a live request and
  points its row at its HOT run; so does every insert of the request's KV (``_after_insert``);
  the release of its row (finish, abort, retract: ``_after_release``) drops it.
Anything that cannot be done safely is skipped and counted in ``metrics``; nothing raises
mid-serving. ``evict`` (COLD pressure) evicts HOT nodes only where they pin COLD ancestors;
``evict_hot`` (HOT pressure) evicts HOT subtrees.
"""

import heapq
import time
from collections import deque
from typing import Dict, List, NamedTuple, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from granikv import sglang_compat as compat
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_prefix_table import HotPrefixTable
from granikv.mem_cache.kv_copy import check_kv_layout, copy_kv_slots, move_kv_range
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import PromotionPolicy, SharedLongPrefixPolicy


_RETRY = "retry"


class HotExtent(NamedTuple):
    """The HotPool extent a HOT node owns: ``[start, start + head + length)``.

        slot:  start                start + head                  start + head + length
               | shadow head (copy)  | the node's own tokens       |
                 path tokens [0, head) path tokens [head, head + length)

    ``head`` is the node's depth when it was promoted (0 for root children and for the lower
    half of a split); ``node_start`` is ``node.value[0]``.
    """

    start: int
    head: int
    length: int

    @property
    def node_start(self) -> int:
        return self.start + self.head

    @property
    def size(self) -> int:
        return self.head + self.length


class _Run(NamedTuple):
    """A request's HOT run: path tokens ``[0, length)`` live in ``[start, start + length)``;
    the first ``head`` of them are a shadow head (the tree's own values differ there)."""

    start: int
    length: int
    head: int


class GraniKVRadixCache(compat.lifecycle_mixin(), RadixCache):
    def __init__(self, params: CacheInitParams, config, kv_pool,
                 hot_prefix_table: HotPrefixTable, *, policy: Optional[PromotionPolicy] = None,
                 metrics: Optional[GraniKVMetrics] = None):
        allocator = params.token_to_kv_pool_allocator
        if not isinstance(allocator, GraniKVAllocator):
            raise ValueError(f"GraniKVRadixCache needs a GraniKVAllocator, got {type(allocator).__name__}")
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
        self.policy = policy or SharedLongPrefixPolicy.from_config(config)
        self.metrics = metrics or GraniKVMetrics()
        self._hot_start: Dict[TreeNode, int] = {}  # HOT node -> node.value[0]
        self._head: Dict[TreeNode, int] = {}  # HOT node -> shadow head length (only if > 0)
        self._pending: Dict[TreeNode, None] = {}  # insertion-ordered set: deterministic
        self._retry_counted: Dict[TreeNode, None] = {}  # queued nodes whose unknown_holders skip is counted
        self._live: Dict[int, object] = {}  # req_pool_idx -> Req
        self.promotions_frozen: Optional[str] = None  # why no new promotion is queued, if so
        super().__init__(params)
        self.refresh_gauges()

    @classmethod
    def create(cls, params: CacheInitParams, config, kv_pool, **kwargs) -> "GraniKVRadixCache":
        """Build with the allocator's HotPrefixTable (created for ``params.req_to_token_pool``)."""
        alloc = params.token_to_kv_pool_allocator
        table = None  # the constructor rejects anything but a GraniKVAllocator
        if isinstance(alloc, GraniKVAllocator):
            table = alloc.ensure_hot_prefix_table(params.req_to_token_pool.req_to_token.shape[0])
        return cls(params, config, kv_pool, table, **kwargs)

    # ---- SGLang API overrides --------------------------------------------------------------

    def reset(self):
        # every HOT extent belongs to a node (check_integrity), so all of them go, whether or
        # not the allocator was cleared first
        self.hot_pool.reset(self.hot_pool.base, self.hot_pool.capacity)
        self._hot_start.clear()
        self._head.clear()
        self._pending.clear()
        self._live.clear()
        self.hot_prefix_table.reset()
        super().reset()

    def inc_lock_ref(self, node: TreeNode):
        result = super().inc_lock_ref(node)
        self._maybe_queue(node)
        return result

    # lifecycle callbacks (``sglang_compat.lifecycle_mixin`` maps SGLang's calls onto them)

    def _after_insert(self, req) -> None:
        """The request's KV went into the tree (a chunk, a prefill, a finish): re-publish."""
        self.update_request_hot_prefix(req)

    def _after_release(self, idx: Optional[int], req) -> None:
        """The request gave row ``idx`` back (finish, abort, retract): forget it."""
        if idx is not None and self._live.get(idx) is req:
            del self._live[idx]
        if idx is not None:
            self.hot_prefix_table.clear(idx)

    def evict(self, params: EvictParams) -> EvictResult:
        """LRU over COLD leaves, and over HOT nodes below a COLD node: a node promoted with a
        shadow head pins its COLD ancestors, and evicting it is the only way to free them
        (this keeps ``evictable_size()`` exact). Counts COLD slots only."""
        start_time = time.perf_counter()
        hot = self._hot_start
        eligible = lambda n: n not in hot or self._below(n, cold=True)  # noqa: E731
        num = self._evict_lru(params.num_tokens, eligible=eligible,
                              counts=lambda n: 0 if n in hot else len(n.value))
        self.update_eviction_metrics(num, start_time)
        return EvictResult(num_tokens_evicted=num)

    def evictable_size(self):
        return self.evictable_size_ - self._hot_key_tokens(locked=False)

    def protected_size(self):
        return self.protected_size_ - self._hot_key_tokens(locked=True)

    def _split_node(self, key, child: TreeNode, split_len: int):
        """A HOT ``child`` splits its extent: the upper half keeps the shadow head.

            before:  | head | child's tokens ..................... |
            after:   | head | new_node [:split_len] | child [split_len:] |
        """
        new_node = super()._split_node(key, child, split_len)
        start = self._hot_start.get(child)
        if start is not None:  # both halves stay HOT and contiguous
            head = self._head.pop(child, 0)
            self._hot_start[new_node] = start
            if head:
                self._head[new_node] = head
            self._hot_start[child] = self.hot_pool.split(start - head, head + split_len)
            self.metrics.hot_splits += 1
        return new_node

    # ---- GraniKV API -----------------------------------------------------------------------

    def update_request_hot_prefix(self, req) -> None:
        """Register ``req`` as live and publish its HOT run (call after ``alloc_for_extend``)."""
        self.update_requests_hot_prefix([req])

    def update_requests_hot_prefix(self, reqs) -> None:
        """Register ``reqs`` as live, point their rows at their HOT runs, publish the runs.

        SGLang writes ``prefix_indices`` (the tree's values) into a new request's row, so
        where a run starts with a shadow head, the row's first columns still point at the
        ancestors' slots (same KV): those rows are repointed (device-side, no host sync).
        """
        reqs = [r for r in reqs if compat.req_pool_idx(r) is not None]
        for req in reqs:
            self._live[compat.req_pool_idx(req)] = req
        runs = [self._run(r) for r in reqs]
        self._repoint([(r, run) for r, run in zip(reqs, runs) if run.head])
        self._publish(reqs, runs)

    def hot_run(self, req) -> tuple:
        """``(start, length)`` of the HOT run ``req``'s KV starts with; ``(0, 0)`` if none."""
        run = self._run(req)
        return run.start, run.length

    def apply_pending_promotions(self, register=()) -> int:
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
        work, self._pending = deque(self._pending), {}
        seen, promoted = set(), 0
        while work:
            node = work.popleft()
            if node in seen:
                continue
            seen.add(node)
            holders = self._promotable_holders(node)
            if holders is _RETRY:
                self._pending[node] = None  # e.g. a holder registers later this step
                continue
            if holders is None:
                continue
            deeper = self._superseded_by(node, holders)
            if deeper is not None:  # every holder shares a longer prefix: promote that one
                self.metrics.skip("superseded")
                work.extend(deeper)
                continue
            ext = self._extend_in_place(node)
            if ext is None:
                depth = self._depth(node)
                start = self._reserve_extent(depth + len(node.value))
                if start is None:
                    self.metrics.skip("no_space")
                    continue
                ext = HotExtent(start, depth, len(node.value))
            self._materialize(node, ext, holders)
            promoted += 1
        self._retry_counted = {n: None for n in self._retry_counted if n in self._pending}
        if promoted:
            self.refresh_gauges()
        return promoted

    def has_pending_promotions(self) -> bool:
        return bool(self._pending)

    def pending_promotions(self) -> int:
        """Number of queued promotions (deterministic: the same on every TP rank)."""
        return len(self._pending)

    def freeze_promotions(self, reason: str) -> None:
        """Queue no new promotion from now on (``reason`` is kept for logs and tests); queued
        ones are dropped. Existing HOT extents stay and are evicted as usual, so the KV, the
        tree and the table stay consistent. Used when the TP ranks diverged (tp_consistency)."""
        self.promotions_frozen = reason
        self._pending.clear()

    def evict_hot(self, num_tokens: int) -> int:
        """LRU-evict unlocked HOT subtrees until ``num_tokens`` HOT slots are freed.

        COLD leaves below HOT nodes go too (a HOT node is a leaf only once they are gone);
        COLD ancestors of HOT nodes stay (``evict`` frees them). Returns the number of HOT
        slots freed (shadow heads included).
        """
        hot = self._hot_start
        freed = self._evict_lru(
            num_tokens, eligible=lambda n: n in hot or self._below(n, cold=False),
            counts=lambda n: self._extent(n).size if n in hot else 0)
        self.refresh_gauges()
        return freed

    def hot_evictable_size(self) -> int:
        """HOT slots (shadow heads included) of unlocked HOT nodes."""
        return self._hot_slots(locked=False)

    def hot_protected_size(self) -> int:
        """HOT slots (shadow heads included) of locked HOT nodes."""
        return self._hot_slots(locked=True)

    def hot_extent_of(self, node: TreeNode) -> Optional[HotExtent]:
        return self._extent(node) if node in self._hot_start else None

    def live_requests(self) -> Dict[int, object]:
        return dict(self._live)

    def refresh_gauges(self) -> None:
        alloc, m = self.token_to_kv_pool_allocator, self.metrics
        m.hot_extents = len(self._hot_start)
        m.hot_used_tokens = self.hot_pool.used_size
        m.hot_capacity = self.hot_pool.capacity
        m.cold_capacity = alloc.cold_capacity
        m.cold_used_tokens = alloc.cold_capacity - alloc.available_size()

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

    # ---- promotion internals ---------------------------------------------------------------

    def _target(self, node: Optional[TreeNode]) -> Optional[TreeNode]:
        """The deepest node on ``node``'s path the policy accepts (``None``: none does)."""
        path = self._path(node)
        end = sum(len(n.key) for n in path)
        for n in reversed(path):
            if self.policy.should_promote(end, n.lock_ref, hit_count=n.hit_count):
                return n
            end -= len(n.key)
        return None

    def _maybe_queue(self, node: TreeNode) -> None:
        if self.promotions_frozen is not None:
            return
        target = self._target(node)
        if target is not None and target not in self._hot_start:
            self._pending[target] = None

    def _promotable_holders(self, node: TreeNode):
        """The live requests holding ``node`` if it may be promoted now; ``None`` to drop the
        queue entry; ``_RETRY`` to keep it queued for the next call."""
        if not self._attached(node) or node in self._hot_start:
            return None  # stale queue entry: evicted, already HOT
        total = self._depth(node) + len(node.key)
        if not self.policy.should_promote(total, node.lock_ref, hit_count=node.hit_count):
            return None
        if total > self.hot_pool.capacity:
            self.metrics.skip("too_large")
            return None
        holders = [r for r in self._live_reqs() if node in self._path(r.last_node)]
        if len(holders) != node.lock_ref:
            # a lock we cannot map to a req_to_token row (a temporary admission lock, or a
            # holder the plugin did not register): its row could keep the old COLD slots
            if node not in self._retry_counted:  # one skip per waiting node, not one per retry
                self._retry_counted[node] = None
                self.metrics.skip("unknown_holders")
            return _RETRY
        return holders

    def _superseded_by(self, node: TreeNode, holders: list) -> Optional[list]:
        """``None`` if some holder's deepest accepted node is ``node``; otherwise the holders'
        deeper COLD targets (promoting ``node`` too would copy KV nobody's run would use)."""
        targets = dict.fromkeys(self._target(r.last_node) for r in holders)
        if node in targets:
            return None
        return [t for t in targets if t is not None and t not in self._hot_start]

    def _reserve_extent(self, n: int) -> Optional[int]:
        """A HOT extent of ``n`` slots: best fit, else compaction (keeps every cached extent),
        else LRU eviction of unlocked HOT subtrees one node at a time (then compaction again).
        ``None`` when even that cannot make room: the promotion is skipped."""
        pool = self.hot_pool
        start = pool.alloc(n)
        if start is None and pool.free_size >= n and self._compact(n):
            start = pool.alloc(n)
        while start is None and pool.free_size + self.hot_evictable_size() >= n > 0:
            if self.evict_hot(1) == 0:
                break
            start = pool.alloc(n)
            if start is None and pool.free_size >= n and self._compact(n):
                start = pool.alloc(n)
        return start

    def _extend_in_place(self, node: TreeNode) -> Optional[HotExtent]:
        """A head-less extent right after the HOT run of ``node``'s parent path, when that run
        covers the whole path and the slots after it are free; ``None`` otherwise.

            before:  | run of the parent path (depth d) | free ... |
            after:   | run of the parent path (depth d) | node     |   one run of d + len(node)

        No ancestor KV is copied (a shadow head would copy the whole path again), and the node
        continues its HOT parent's extent, like the lower half of a split.
        """
        depth = self._depth(node)
        run = self._run_of(node.parent)
        if depth == 0 or run.length != depth:
            return None
        start = run.start + run.length
        if not self.hot_pool.alloc_at(start, len(node.value)):
            return None
        self.metrics.extended_in_place += 1
        return HotExtent(start, 0, len(node.value))

    def _compact(self, need: int) -> bool:
        """Slide unlocked extents down (KV moved) if that opens a hole of ``need`` slots.

        Only unlocked extents move, so no live row points into them; a split's lower half
        sits right after its upper half, so it moves with it or not at all (contiguity kept).
        """
        node_at = {self._extent(node).start: node for node in self._hot_start}
        locked = [s for s, node in node_at.items() if node.lock_ref > 0]
        plan = self.hot_pool.compaction_plan(locked)
        if plan.largest_hole < need:
            return False
        for move in plan.moves:
            self.metrics.bytes_copied += move_kv_range(self.kv_pool, *move)
            self.hot_pool.apply_move(move)
            node = node_at[move.src]
            start = move.dst + self._head.get(node, 0)
            node.value = self._arange(start, len(node.key))
            self._hot_start[node] = start
        self.metrics.compactions += 1
        self.metrics.compaction_moves += len(plan.moves)
        return True

    def _materialize(self, node: TreeNode, ext: HotExtent, holders: list) -> None:
        """Copy the path's last ``ext.size`` tokens of KV (ancestors, then ``node``) into ``ext``
        and repoint at it.

            path:     | A (any slots) | h (any slots) | node (COLD)       |
            extent:   | ext.start ..... shadow head   | ext.node_start ... |   head = depth
            req_to_token[holder][:head + length] -> arange(ext.start, ext.start + ext.size)

        (``head = 0``: the extent continues the parent's HOT run, only ``node``'s KV is copied,
        ``_extend_in_place``.)

        The ancestors keep their own slots (other requests use them); ``node``'s old COLD
        slots are freed.
        """
        path = self._path(node)
        src = torch.cat([n.value for n in path])[-ext.size:]  # head = depth: the whole path
        self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, src, ext.start)
        old = node.value
        node.value = self._arange(ext.node_start, ext.length)
        self._hot_start[node] = ext.node_start
        if ext.head:
            self._head[node] = ext.head
        runs = [self._run(r) for r in holders]
        self._repoint(list(zip(holders, runs)))
        self.token_to_kv_pool_allocator.free(old)
        self._publish(holders, runs)
        self.metrics.promotions += 1
        self.metrics.promoted_tokens += ext.length
        self.metrics.shadow_head_tokens += ext.head

    def _repoint(self, reqs_runs: list) -> None:
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
            compat.splice_prefix_indices(req, self._arange(run.start, run.length))
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

# ---- helpers ---------------------------------------------------------------------------

    def _run(self, req) -> _Run:
        """``req``'s HOT run, capped at ``cache_protected_len`` (never its private slots)."""
        run = self._run_of(getattr(req, "last_node", None))
        limit = compat.cache_protected_len(req, run.length)
        return run if run.length <= limit else _Run(run.start, max(limit, 0), min(run.head, limit))

    def _run_of(self, node: Optional[TreeNode]) -> _Run:
        """The HOT run of the path root -> ``node``.

            path:   | h (COLD, 4) | B (HOT, head 4) | B' (HOT, follows B) | c (COLD) |
            run:    [s, s + 4 + |B| + |B'|)       s = B's extent start

        A HOT node whose shadow head covers its whole depth (re)starts the run (root
        children: depth 0, head 0); a HOT node whose slots follow the run's end, with the run
        reaching its depth, extends it. Other nodes leave the run as it is.
        """
        start = length = head = depth = 0
        for n in self._path(node):
            s = self._hot_start.get(n)
            if s is not None:
                if length == depth > 0 and s == start + length:
                    length += len(n.key)
                elif self._head.get(n, 0) == depth:
                    start, length, head = s - depth, depth + len(n.key), depth
            depth += len(n.key)
        return _Run(start, length, head)

    def _publish(self, reqs, runs) -> None:
        self.hot_prefix_table.set_many([compat.req_pool_idx(r) for r in reqs],
                                       [run.start for run in runs], [run.length for run in runs])

    def _live_reqs(self) -> list:
        stale = [i for i, r in self._live.items() if compat.req_pool_idx(r) != i]
        for i in stale:  # released through a path that bypassed the release callback
            del self._live[i]
            self.hot_prefix_table.clear(i)
        return list(self._live.values())

    def _evict_lru(self, num_tokens: int, *, eligible, counts) -> int:
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
        self._pending.pop(node, None)
        if node not in self._hot_start:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            return
        ext = self._extent(node)
        del self._hot_start[node]
        self._head.pop(node, None)
        self.hot_pool.free(ext.start, ext.size)  # host metadata only, no .item()
        self.metrics.hot_evictions += 1
        self.metrics.hot_evicted_tokens += ext.size

    def _extent(self, node: TreeNode) -> HotExtent:
        head = self._head.get(node, 0)
        return HotExtent(self._hot_start[node] - head, head, len(node.key))

    def _hot_key_tokens(self, *, locked: bool) -> int:
        """Tree tokens (node keys) of HOT nodes: what SGLang's size counters include."""
        return sum(len(n.key) for n in self._hot_start if (n.lock_ref > 0) == locked)

    def _hot_slots(self, *, locked: bool) -> int:
        """HOT slots (shadow heads included) of HOT nodes."""
        return sum(self._extent(n).size for n in self._hot_start if (n.lock_ref > 0) == locked)

    def _below(self, node: TreeNode, *, cold: bool) -> bool:
        """Whether some ancestor of ``node`` (the root excluded) is COLD (``cold``) / HOT."""
        node = node.parent
        while node is not None and node is not self.root_node:
            if (node not in self._hot_start) == cold:
                return True
            node = node.parent
        return False

    def _path(self, node: Optional[TreeNode]) -> List[TreeNode]:
        """Nodes from the root's child down to ``node`` (empty for None / the root)."""
        path = []
        while node is not None and node is not self.root_node:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _depth(self, node: TreeNode) -> int:
        return sum(len(n.key) for n in self._path(node.parent))

    def _attached(self, node: TreeNode) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(node.key.child_key(1)) is node

    def _arange(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int64, device=self.device)

