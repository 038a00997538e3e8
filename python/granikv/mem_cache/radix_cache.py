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
  forward): placement (``_place``: the node's own slots when they are contiguous, nothing
  or only a shadow head copied; else right after the parent's HOT run; else a fresh extent
  taken off the common free list, with unlocked COLD KV moved out of its window and LRU
  eviction if needed), KV copy, rewrite of the holders' ``req_to_token`` rows (and
  0.5.17's ``prefix_indices``), free of the old COLD slots;
- ``update_request_hot_prefix(req)`` after ``alloc_for_extend`` registers a live request and
  points its row at its HOT run; so does every insert of the request's KV (``_after_insert``);
  the release of its row (finish, abort, retract: ``_after_release``) drops it.
Anything that cannot be done safely is skipped and counted in ``metrics``; nothing raises
mid-serving. HOT extents come out of the same free slots as COLD KV and go back to them:
``evict`` (SGLang's memory pressure) is LRU over every unlocked leaf, HOT or COLD, and
counts the slots it frees; ``evict_hot`` (the HOT cap) evicts HOT subtrees.
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
from granikv.mem_cache.kv_copy import check_kv_layout, copy_kv_slots, move_kv_slots
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import PromotionPolicy, SharedLongPrefixPolicy
from granikv.mem_cache.step_context import StepContext


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


class _Placement(NamedTuple):
    """Where a promotion puts a node: ``ext``; ``adopted``: the node's own (contiguous) slots
    are the extent's node part, so only the shadow head (if any) is copied and nothing is
    freed."""

    ext: HotExtent
    adopted: bool


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
        self._candidates: tuple = ()  # the queue as apply_pending_promotions found it
        self._step: Optional[StepContext] = None  # built from the tree once per apply call
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
        self.hot_pool.reset(self.hot_pool.base, self.hot_pool.span)
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
        """LRU over every unlocked leaf, HOT or COLD: both give their slots back to the one
        free list. Counts the slots freed (a HOT node's whole extent, shadow head included),
        so ``evictable_size()`` is exact."""
        start_time = time.perf_counter()
        hot = self._hot_start
        num = self._evict_lru(params.num_tokens, eligible=lambda n: True,
                              counts=lambda n: self._extent(n).size if n in hot else len(n.value))
        self.update_eviction_metrics(num, start_time)
        if num and hot:
            self.refresh_gauges()
        return EvictResult(num_tokens_evicted=num)

    def evictable_size(self):
        """Tokens of unlocked nodes (SGLang's counter, HOT included) + their shadow heads."""
        return self.evictable_size_ + self._head_slots(locked=False)

    def protected_size(self):
        return self.protected_size_ + self._head_slots(locked=True)

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
        self._candidates, self._step = tuple(work), None
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
            placement = self._place(node)
            if placement is None:
                continue  # counted by _place
            self._materialize(node, placement, holders)
            promoted += 1
        self._candidates, self._step = (), None  # no tree nodes held past the call
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

    # ---- promotion internals ---------------------------------------------------------------

    def _target(self, node: Optional[TreeNode]) -> Optional[TreeNode]:
        """The deepest node on ``node``'s path the policy accepts (``None``: none does)."""
        path = self._path(node)
        end = sum(len(n.key) for n in path)
        for n in reversed(path):
            if self.policy.may_promote(end, n.lock_ref, hit_count=n.hit_count):
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
        if not self.policy.may_promote(total, node.lock_ref, hit_count=node.hit_count):
            return None
        if total > self.token_to_kv_pool_allocator.hot_capacity:
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
        if not self.policy.should_promote(total, node.lock_ref, hit_count=node.hit_count,
                                          remaining_steps=_remaining_steps(holders),
                                          **self._step_context(node)):
            self.metrics.skip("does_not_pay")
            return None
        return holders

    def _step_context(self, node: TreeNode) -> dict:
        """``context`` / ``within`` of the step ``node`` would be served in (``StepContext``):
        HOT nodes with live holders + the queued candidates that pass ``may_promote``."""
        if not self.policy.uses_context:
            return {}
        if self._step is None or node not in self._step:
            hot = [n for n in self._hot_start if n.lock_ref > 0]
            queued = [n for n in self._candidates if n not in self._hot_start and self._attached(n)
                      and self.policy.may_promote(self._depth(n) + len(n.key), n.lock_ref)]
            self._step = StepContext([*hot, *queued, node], root=self.root_node)
        return dict(context=self._step.context_for(node), within=self._step.within(node))

    def _superseded_by(self, node: TreeNode, holders: list) -> Optional[list]:
        """``None`` if some holder's deepest accepted node is ``node``; otherwise the holders'
        deeper COLD targets (promoting ``node`` too would copy KV nobody's run would use)."""
        targets = dict.fromkeys(self._target(r.last_node) for r in holders)
        if node in targets:
            return None
        return [t for t in targets if t is not None and t not in self._hot_start]

    def _place(self, node: TreeNode) -> Optional[_Placement]:
        """Where ``node`` goes, cheapest first; ``None`` (skip counted) when nowhere.

        1. adopt: the node's own slots are contiguous ``[a, a + len)`` (a fresh prefill
           usually is) and either it is a root child, or its parent's HOT run covers its
           depth and ends at ``a``: nothing copied, nothing freed;
        2. extend in place: the parent's HOT run covers the depth and the ``len`` slots after
           it hold no blocked slot: unlocked COLD KV there is moved out, the node's KV copied;
        3. adopt with a shadow head in the ``depth`` free slots before the node's own;
        4. a fresh extent of ``depth + len`` slots (``_reserve_extent``).

        Every extent counts against the HOT cap (``hot_capacity``).
        """
        depth, length = self._depth(node), len(node.value)
        alloc = self.token_to_kv_pool_allocator
        run = self._run_of(node.parent)
        covered = depth > 0 and run.length == depth
        a = self._contiguous_start(node.value)
        if (a is not None and (depth == 0 or (covered and run.start + run.length == a))
                and self._room(length)):
            alloc.adopt_extent(a, length)
            self.metrics.adopted += 1
            return _Placement(HotExtent(a, 0, length), True)
        if covered and self._room(length):
            end = run.start + run.length
            window = alloc.window_at(end, length, self._movable_mask(), self._slot_mask([node.value]))
            if window is not None:
                dst = alloc.take_window(window, length)
                if window.moves:
                    self._relocate(end, length, dst)
                self.metrics.extended_in_place += 1
                return _Placement(HotExtent(end, 0, length), False)
        if (a is not None and depth and a > depth and self._room(depth + length)
                and alloc.take_range(a - depth, depth, owned_after=length)):
            self.metrics.adopted += 1
            return _Placement(HotExtent(a - depth, depth, length), True)
        start = self._reserve_extent(node, depth + length)
        return None if start is None else _Placement(HotExtent(start, depth, length), False)

    def _room(self, n: int) -> bool:
        """Whether an extent of ``n`` slots fits under the HOT cap, after LRU-evicting
        unlocked HOT subtrees if needed."""
        alloc = self.token_to_kv_pool_allocator
        while alloc.hot_room() < n:
            if self.evict_hot(1) == 0:
                return False
        return True

    def _reserve_extent(self, node: TreeNode, n: int) -> Optional[int]:
        """A fresh extent of ``n`` slots off the common free list: the window with the
        fewest movable slots (unlocked COLD KV, moved out first: ``_relocate``); if none,
        LRU eviction (any unlocked leaf while free slots are short, then unlocked HOT
        subtrees, which block windows) and again. ``None`` (skip counted) when even that
        cannot make room."""
        alloc = self.token_to_kv_pool_allocator
        if not self._room(n):
            self.metrics.skip("hot_cap")
            return None
        if alloc.available_size() < n:
            self.evict(EvictParams(num_tokens=n - alloc.available_size()))
        while True:
            window = alloc.find_window(n, self._movable_mask(), self._slot_mask([node.value]))
            if window is not None:
                break
            if alloc.available_size() < n or self.evict_hot(1) == 0:
                self.metrics.skip("no_space")
                return None
        dst = alloc.take_window(window, n)
        if window.moves:
            self._relocate(window.start, n, dst)
        return window.start

    def _movable_mask(self) -> torch.Tensor:
        """bool ``[size + 1]``: slots of unlocked COLD nodes (no live row reads them)."""
        return self._slot_mask([n.value for n in self._movable_nodes()])

    def _slot_mask(self, values: list) -> torch.Tensor:
        alloc = self.token_to_kv_pool_allocator
        mask = torch.zeros(alloc.size + 1, dtype=torch.bool, device=alloc.device)
        if values:
            mask[torch.cat(values)] = True
        return mask

    def _movable_nodes(self) -> List[TreeNode]:
        nodes, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0 and node not in self._hot_start and len(node.value):
                nodes.append(node)
        return nodes

    def _relocate(self, start: int, n: int, dst: torch.Tensor) -> None:
        """Move the unlocked COLD KV inside ``[start, start + n)`` to ``dst`` (free slots
        outside it) and rewrite the owning nodes' values.

            window:   | F  M1 F  M2 M3 F |      dst: [d1, d2, d3]
            after:    KV(M1) -> d1, KV(M2) -> d2, KV(M3) -> d3; node values follow

        Only unlocked nodes move, so no live row or ``prefix_indices`` points at them (the
        same argument as evicting them; a waiting request's match is redone at admission).
        """
        nodes = self._movable_nodes()
        values = torch.cat([nd.value for nd in nodes])
        inside = (values >= start) & (values < start + n)
        src = values[inside]
        assert src.numel() == dst.numel(), (
            f"relocate: {src.numel()} movable slots in [{start}, {start + n}), {dst.numel()} targets")
        self.metrics.bytes_copied += move_kv_slots(self.kv_pool, src, dst)
        values = values.clone()
        values[inside] = dst.to(values.dtype)
        for nd, v in zip(nodes, torch.split(values, [len(nd.value) for nd in nodes])):
            nd.value = v.clone()
        self.metrics.compactions += 1
        self.metrics.compaction_moves += int(src.numel())

    def _contiguous_start(self, value: torch.Tensor) -> Optional[int]:
        """``a`` if ``value == arange(a, a + len)`` (one host sync), else ``None``."""
        if not len(value):
            return None
        steps_ok = (value[1:] - value[:-1] == 1).all() if len(value) > 1 else value.new_ones((), dtype=torch.bool)
        a, ok = torch.stack([value[0], steps_ok.to(value.dtype)]).tolist()
        return int(a) if ok else None

    def _materialize(self, node: TreeNode, placement: _Placement, holders: list) -> None:
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
        path = self._path(node)
        if placement.adopted:
            if ext.head:
                src = torch.cat([n.value for n in path[:-1]])[-ext.head:]
                self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, src, ext.start)
            old = None
        else:
            src = torch.cat([n.value for n in path])[-ext.size:]  # head = depth: the whole path
            self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, src, ext.start)
            old = node.value
        node.value = self._arange(ext.node_start, ext.length)
        self._hot_start[node] = ext.node_start
        if ext.head:
            self._head[node] = ext.head
        runs = [self._run(r) for r in holders]
        self._repoint(list(zip(holders, runs)))
        if old is not None:  # the node's old slots, except those the extent now holds
            outside = (old < ext.start) | (old >= ext.start + ext.size)
            self.token_to_kv_pool_allocator.free(old[outside])
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
        self.token_to_kv_pool_allocator.free_extent(ext.start, ext.size)  # no host sync
        self.metrics.hot_evictions += 1
        self.metrics.hot_evicted_tokens += ext.size

    def _extent(self, node: TreeNode) -> HotExtent:
        head = self._head.get(node, 0)
        return HotExtent(self._hot_start[node] - head, head, len(node.key))

    def _head_slots(self, *, locked: bool) -> int:
        """Shadow-head slots of HOT nodes: held, but in no node key (SGLang's counters)."""
        return sum(h for n, h in self._head.items() if (n.lock_ref > 0) == locked)

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


def _remaining_steps(reqs) -> Optional[float]:
    """Mean decode steps ``reqs`` may still run (``max_new_tokens`` minus tokens output so
    far); ``None`` if some request does not say."""
    left = []
    for r in reqs:
        budget = getattr(getattr(r, "sampling_params", None), "max_new_tokens", None)
        if budget is None:
            return None
        left.append(max(budget - len(r.output_ids), 0))
    return sum(left) / len(left) if left else None

