"""GraniKVRadixCache: SGLang's RadixCache with HOT (contiguous-extent) nodes.

Which nodes are HOT: a child of the root promoted by the policy, and the chain of halves a
split of a HOT node leaves below it (each half keeps a contiguous extent). A HOT node's
``value`` is always ``arange(start, start + len)`` on the KV device; ``self._hot_start``
holds ``start`` on the host, so nothing here reads the device to find an extent.

    root ── S (HOT, [h, h+L1)) ── S' (HOT, [h+L1, h+L1+L2)) ── a (COLD) ...
         └─ T (COLD)                                      └─ b (COLD) ...

The HOT run of a request walks its path from the root while nodes are HOT and each extent
starts where the previous one ended; it is published in the ``HotPrefixTable`` row of the
request's ``req_pool_idx``.

Lifecycle (the plugin drives the two public extras; everything else is SGLang's own calls):
- ``inc_lock_ref`` (admission, ``cache_unfinished_req``) QUEUES the root child on the path
  when the policy holds (length, live sharers = lock count);
- ``apply_pending_promotions()`` EXECUTES the queue at a safe point (before a batch's
  forward): extent alloc (HOT eviction / compaction if needed), KV copy, rewrite of the
  holders' ``req_to_token`` rows and ``prefix_indices``, free of the COLD slots;
- ``update_request_hot_prefix(req)`` after ``alloc_for_extend`` registers a live request;
  ``cache_finished_req`` (finish, abort, retract) drops it.
Anything that cannot be done safely is skipped and counted in ``metrics``; nothing raises
mid-serving. ``evict`` (COLD pressure) never evicts HOT nodes; ``evict_hot`` does.
"""

import heapq
import time
from typing import Dict, List, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_pool import IntegrityError
from granikv.mem_cache.hot_prefix_table import HotPrefixTable
from granikv.mem_cache.kv_copy import check_kv_layout, copy_kv_slots, move_kv_range
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import PromotionPolicy, SharedLongPrefixPolicy


_RETRY = "retry"


class GraniKVRadixCache(RadixCache):
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
        self._hot_start: Dict[TreeNode, int] = {}
        self._pending: Dict[TreeNode, None] = {}  # insertion-ordered set: deterministic
        self._live: Dict[int, object] = {}  # req_pool_idx -> Req
        super().__init__(params)
        self.refresh_gauges()

    @classmethod
    def create(cls, params: CacheInitParams, config, kv_pool, **kwargs) -> "GraniKVRadixCache":
        """Build with a fresh HotPrefixTable sized for ``params.req_to_token_pool``."""
        table = HotPrefixTable(params.req_to_token_pool.size + 1, kv_pool.device)
        return cls(params, config, kv_pool, table, **kwargs)

    # ---- SGLang API overrides --------------------------------------------------------------

    def reset(self):
        extents = self.hot_pool.extents()  # the allocator may have been cleared first
        for node, start in self._hot_start.items():
            if extents.get(start) == len(node.value):
                self.hot_pool.free(start, len(node.value))
        self._hot_start.clear()
        self._pending.clear()
        self._live.clear()
        self.hot_prefix_table.reset()
        super().reset()

    def inc_lock_ref(self, node: TreeNode):
        result = super().inc_lock_ref(node)
        self._maybe_queue(node)
        return result

    def cache_unfinished_req(self, req, chunked=False):
        super().cache_unfinished_req(req, chunked=chunked)
        self.update_request_hot_prefix(req)

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        idx = req.req_pool_idx
        super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        if idx is not None and self._live.get(idx) is req:
            del self._live[idx]
        if idx is not None:
            self.hot_prefix_table.clear(idx)

    def evict(self, params: EvictParams) -> EvictResult:
        """LRU over COLD leaves only: HOT slots cannot serve a COLD allocation."""
        start_time = time.perf_counter()
        is_cold = lambda node: node not in self._hot_start  # noqa: E731
        num = self._evict_lru(params.num_tokens, eligible=is_cold, counts=is_cold)
        self.update_eviction_metrics(num, start_time)
        return EvictResult(num_tokens_evicted=num)

    def evictable_size(self):
        return self.evictable_size_ - self._hot_tokens(locked=False)

    def protected_size(self):
        return self.protected_size_ - self._hot_tokens(locked=True)

    def _split_node(self, key, child: TreeNode, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        start = self._hot_start.get(child)
        if start is not None:  # both halves stay HOT and contiguous
            self._hot_start[new_node] = start
            self._hot_start[child] = self.hot_pool.split(start, split_len)
            self.metrics.hot_splits += 1
        return new_node

    # ---- GraniKV API -----------------------------------------------------------------------

    def update_request_hot_prefix(self, req) -> None:
        """Register ``req`` as live and publish its HOT run (call after ``alloc_for_extend``)."""
        self.update_requests_hot_prefix([req])

    def update_requests_hot_prefix(self, reqs) -> None:
        reqs = [r for r in reqs if r.req_pool_idx is not None]
        for req in reqs:
            self._live[req.req_pool_idx] = req
        self._publish(reqs)

    def hot_run(self, req) -> tuple:
        """``(start, length)`` of the HOT run ``req``'s KV starts with; ``(0, 0)`` if none."""
        start, total = 0, 0
        for node in self._path(getattr(req, "last_node", None)):
            s = self._hot_start.get(node)
            if s is None or (total and s != start + total):
                break
            start = s if not total else start
            total += len(node.key)
        return start, total

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
        pending, self._pending = list(self._pending), {}
        promoted = 0
        for node in pending:
            holders = self._promotable_holders(node)
            if holders is _RETRY:
                self._pending[node] = None  # e.g. a holder registers later this step
                continue
            if holders is None:
                continue
            start = self._reserve_extent(len(node.value))
            if start is None:
                self.metrics.skip("no_space")
                continue
            self._materialize(node, start, holders)
            promoted += 1
        if promoted:
            self.refresh_gauges()
        return promoted

    def has_pending_promotions(self) -> bool:
        return bool(self._pending)

    def evict_hot(self, num_tokens: int) -> int:
        """LRU-evict unlocked HOT subtrees until ``num_tokens`` HOT slots are freed.

        COLD leaves below HOT nodes go too (a HOT node is a leaf only once they are gone).
        Returns the number of HOT slots freed.
        """
        in_hot_subtree = lambda node: self._root_child(node) in self._hot_start  # noqa: E731
        freed = self._evict_lru(num_tokens, eligible=in_hot_subtree,
                                counts=lambda node: node in self._hot_start)
        self.refresh_gauges()
        return freed

    def hot_evictable_size(self) -> int:
        return self._hot_tokens(locked=False)

    def hot_protected_size(self) -> int:
        return self._hot_tokens(locked=True)

    def hot_extent_of(self, node: TreeNode) -> Optional[tuple]:
        start = self._hot_start.get(node)
        return None if start is None else (start, len(node.key))

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

        ``strict``: every request holding slots or locks is registered (true between
        scheduler steps when the plugin hooks ``alloc_for_extend``), so COLD accounting is
        exact (free + tree + requests' private slots == COLD capacity) and every lock count
        equals the number of live requests whose path holds the node.
        """
        _check_cache(self, strict=strict)

    # ---- promotion internals ---------------------------------------------------------------

    def _maybe_queue(self, node: TreeNode) -> None:
        rc = self._root_child(node)
        if rc is None or rc in self._hot_start or rc in self._pending:
            return
        if self.policy.should_promote(len(rc.key), rc.lock_ref, hit_count=rc.hit_count):
            self._pending[rc] = None

    def _promotable_holders(self, node: TreeNode):
        """The live requests holding ``node`` if it may be promoted now; ``None`` to drop the
        queue entry; ``_RETRY`` to keep it queued for the next call."""
        if not self._attached(node) or node.parent is not self.root_node or node in self._hot_start:
            return None  # stale queue entry: evicted, split below the root, already HOT
        if not self.policy.should_promote(len(node.key), node.lock_ref, hit_count=node.hit_count):
            return None
        if len(node.value) > self.hot_pool.capacity:
            self.metrics.skip("too_large")
            return None
        holders = [r for r in self._live_reqs() if node in self._path(r.last_node)]
        if len(holders) != node.lock_ref:
            # a lock we cannot map to a req_to_token row (a temporary admission lock, or a
            # holder the plugin did not register): its row could keep the old COLD slots
            self.metrics.skip("unknown_holders")
            return _RETRY
        return holders

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

    def _compact(self, need: int) -> bool:
        """Slide unlocked extents down (KV moved) if that opens a hole of ``need`` slots."""
        locked = [s for node, s in self._hot_start.items() if node.lock_ref > 0]
        plan = self.hot_pool.compaction_plan(locked)
        if plan.largest_hole < need:
            return False
        node_at = {s: node for node, s in self._hot_start.items()}
        for move in plan.moves:
            self.metrics.bytes_copied += move_kv_range(self.kv_pool, *move)
            self.hot_pool.apply_move(move)
            node = node_at[move.src]
            node.value = self._arange(move.dst, move.length)
            self._hot_start[node] = move.dst
        self.metrics.compactions += 1
        self.metrics.compaction_moves += len(plan.moves)
        return True

    def _materialize(self, node: TreeNode, start: int, holders: list) -> None:
        """Copy ``node``'s KV into ``[start, start+n)`` and repoint everything at it.

            req_to_token[holder]: | ..depth.. | old COLD slots of node | rest |
                               -> | ..depth.. | start ... start+n-1    | rest |
        """
        old = node.value
        n, depth = len(old), self._depth(node)
        self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, old, start)
        new = self._arange(start, n)
        self._rewrite_rows(holders, depth, old, new)
        node.value = new
        self._hot_start[node] = start
        self.token_to_kv_pool_allocator.free(old)
        self._publish(holders)
        self.metrics.promotions += 1
        self.metrics.promoted_tokens += n

    def _rewrite_rows(self, holders: list, depth: int, old: torch.Tensor, new: torch.Tensor):
        """Device-side masked rewrite (no host sync): a row is rewritten only if its slot at
        ``depth`` is still the node's first old slot."""
        for req in holders:
            req.prefix_indices = _splice(req.prefix_indices, depth, new)
        if not holders:
            return
        r2t = self.req_to_token_pool.req_to_token
        rows = torch.tensor([r.req_pool_idx for r in holders], dtype=torch.int64)
        rows = rows.to(r2t.device, non_blocking=True)
        cols = slice(depth, depth + len(new))
        block = r2t[rows, cols]
        mask = block[:, :1] == old[:1].to(device=r2t.device, dtype=r2t.dtype)
        r2t[rows, cols] = torch.where(mask, new.to(device=r2t.device, dtype=r2t.dtype), block)
        self.metrics.rows_rewritten += len(holders)

    # ---- helpers ---------------------------------------------------------------------------

    def _publish(self, reqs) -> None:
        runs = [self.hot_run(r) for r in reqs]
        self.hot_prefix_table.set_many([r.req_pool_idx for r in reqs],
                                       [s for s, _ in runs], [n for _, n in runs])

    def _live_reqs(self) -> list:
        stale = [i for i, r in self._live.items() if r.req_pool_idx != i]
        for i in stale:  # released through a path that bypassed cache_finished_req
            del self._live[i]
            self.hot_prefix_table.clear(i)
        return list(self._live.values())

    def _evict_lru(self, num_tokens: int, *, eligible, counts) -> int:
        prio = self.eviction_strategy.get_priority
        heap = [(prio(n), n) for n in self.evictable_leaves if eligible(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, x = heapq.heappop(heap)
            freed += len(x.value) if counts(x) else 0
            self._release_value(x)
            self._delete_leaf(x)
            self._record_remove_event(x)
            p = x.parent
            if p is not self.root_node and not p.children and p.lock_ref == 0 and eligible(p):
                heapq.heappush(heap, (prio(p), p))
        return freed

    def _release_value(self, node: TreeNode) -> None:
        self._pending.pop(node, None)
        start = self._hot_start.pop(node, None)
        if start is None:
            self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            return
        self.hot_pool.free(start, len(node.value))  # host metadata only, no .item()
        self.metrics.hot_evictions += 1
        self.metrics.hot_evicted_tokens += len(node.value)

    def _hot_tokens(self, *, locked: bool) -> int:
        return sum(len(n.key) for n in self._hot_start if (n.lock_ref > 0) == locked)

    def _root_child(self, node: Optional[TreeNode]) -> Optional[TreeNode]:
        if node is None or node is self.root_node:
            return None
        while node.parent is not self.root_node:
            node = node.parent
        return node

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


def _splice(indices: Optional[torch.Tensor], depth: int, new: torch.Tensor):
    """``indices`` with ``[depth, depth + len(new))`` replaced by ``new`` (a new tensor)."""
    if indices is None or len(indices) < depth + len(new):
        return indices
    return torch.cat([indices[:depth], new.to(indices.dtype), indices[depth + len(new):]])


# ---- integrity (debug / tests; syncs the device) ---------------------------------------------


def _check_cache(cache: GraniKVRadixCache, *, strict: bool) -> None:
    alloc = cache.token_to_kv_pool_allocator
    alloc.check_integrity()
    cache.hot_prefix_table.check_integrity()
    nodes = _check_tree(cache)
    _check_hot_extents(cache, nodes)
    owned = [n.value for n in nodes if n not in cache._hot_start]
    if strict:
        owned += [_private_slots(cache, r) for r in cache._live.values()]
    _check_cold_ownership(alloc, owned, exact=strict)
    _check_live(cache, strict=strict)


def _check_tree(cache: GraniKVRadixCache) -> list:
    """Structure, values, lock counts and size counters of every node; returns the nodes."""
    nodes, stack = [], list(cache.root_node.children.values())
    evictable = protected = 0
    hot_base = cache.token_to_kv_pool_allocator.hot_base
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
        where = f"node {node.id} (len {len(node.key)})"
        if not cache._attached(node):
            raise IntegrityError(f"{where}: not its parent's child")
        v = node.value
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or len(v) != len(node.key):
            raise IntegrityError(f"{where}: value is not a 1-D tensor of the key's length")
        if node.lock_ref < 0 or (node.parent is not cache.root_node
                                 and node.lock_ref > node.parent.lock_ref):
            raise IntegrityError(f"{where}: lock_ref {node.lock_ref} (parent {node.parent.lock_ref})")
        evictable += len(v) if node.lock_ref == 0 else 0
        protected += len(v) if node.lock_ref > 0 else 0
        start = cache._hot_start.get(node)
        if start is None:
            if len(v) and (int(v.min()) < 1 or int(v.max()) >= hot_base):
                raise IntegrityError(f"{where}: COLD node holds slots outside [1, {hot_base})")
            continue
        if node.parent is not cache.root_node and node.parent not in cache._hot_start:
            raise IntegrityError(f"{where}: HOT node below a COLD node")
        if not torch.equal(v.cpu(), torch.arange(start, start + len(v))):
            raise IntegrityError(f"{where}: HOT value is not arange({start}, {start + len(v)})")
    if (evictable, protected) != (cache.evictable_size_, cache.protected_size_):
        raise IntegrityError(
            f"tree sizes: evictable {evictable} / protected {protected} by walk, counters say "
            f"{cache.evictable_size_} / {cache.protected_size_}")
    return nodes


def _check_hot_extents(cache: GraniKVRadixCache, nodes: list) -> None:
    in_tree = set(nodes)
    for node in cache._hot_start:
        if node not in in_tree:
            raise IntegrityError(f"HOT node {node.id} is not in the tree")
    by_nodes = {s: len(n.key) for n, s in cache._hot_start.items()}
    by_pool = cache.hot_pool.extents()
    if by_nodes != by_pool:
        raise IntegrityError(f"HOT extents of nodes {sorted(by_nodes.items())[:8]} != hot pool "
                             f"{sorted(by_pool.items())[:8]}")


def _check_cold_ownership(alloc: GraniKVAllocator, owned: list, *, exact: bool) -> None:
    """No COLD slot owned twice among free list, tree and (exact) live requests."""
    free = alloc.cold_free_slots().cpu()
    held = torch.cat([t.cpu().to(torch.int64) for t in owned]) if owned else free[:0]
    every = torch.cat([free, held])
    dupes = every.numel() - torch.unique(every).numel()
    if dupes:
        raise IntegrityError(f"COLD: {dupes} slots owned twice (free {free.numel()}, "
                             f"held {held.numel()})")
    if exact and every.numel() != alloc.cold_capacity:
        raise IntegrityError(f"COLD: free {free.numel()} + held {held.numel()} != total "
                             f"{alloc.cold_capacity} ({alloc.cold_capacity - every.numel()} leaked)")


def _private_slots(cache: GraniKVRadixCache, req) -> torch.Tensor:
    """The slots a live request owns itself: row[cache_protected_len : kv_allocated_len]."""
    end = req.kv.kv_allocated_len if getattr(req, "kv", None) is not None else 0
    row = cache.req_to_token_pool.req_to_token[req.req_pool_idx]
    return row[req.cache_protected_len : end]


def _check_live(cache: GraniKVRadixCache, *, strict: bool) -> None:
    table, r2t = cache.hot_prefix_table, cache.req_to_token_pool.req_to_token
    for idx, req in cache._live.items():
        if req.req_pool_idx != idx:
            raise IntegrityError(f"live request at row {idx} now has req_pool_idx {req.req_pool_idx}")
        start, n = cache.hot_run(req)
        if table.get(idx) != (start, n):
            raise IntegrityError(f"row {idx}: table says {table.get(idx)}, tree says {(start, n)}")
        if n and not torch.equal(r2t[idx, :n].cpu().to(torch.int64), torch.arange(start, start + n)):
            raise IntegrityError(f"row {idx}: req_to_token[:{n}] is not its HOT run at {start}")
    rows = set(cache._live)
    stray = [r for r in range(1, table.num_rows) if r not in rows and table.length_np[r]]
    if stray:
        raise IntegrityError(f"table rows {stray[:8]} have a HOT run but no live request")
    if strict:
        _check_lock_counts(cache)


def _check_lock_counts(cache: GraniKVRadixCache) -> None:
    holders: Dict[TreeNode, int] = {}
    for req in cache._live.values():
        for node in cache._path(req.last_node):
            holders[node] = holders.get(node, 0) + 1
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.lock_ref != holders.get(node, 0):
            raise IntegrityError(f"node {node.id}: lock_ref {node.lock_ref} but "
                                 f"{holders.get(node, 0)} live requests hold it")
