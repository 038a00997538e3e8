"""HotPlacement: where a promoted node's HOT extent goes, and the KV moves that makes room.

A node promoted at depth ``d`` gets ONE extent of ``d + len`` slots: a shadow head (a copy
of its ancestors' KV), then its own tokens. ``place`` picks the cheapest placement and
reserves it (allocator); unlocked COLD KV inside the chosen window is moved out
(``relocate``, run by the caller right after ``place``); ``copy_in`` copies the path's KV
into the extent.
"""

from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Tuple

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_nodes import HotExtent, HotNodes
from granikv.mem_cache.kv_copy import copy_kv_slots, move_kv_slots
from granikv.mem_cache.metrics import GraniKVMetrics

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


class Placement(NamedTuple):
    """Where a promotion puts a node: ``ext``; ``adopted``: the node's own (contiguous) slots
    are the extent's node part, so only the shadow head (if any) is copied and nothing is
    freed; ``moves``: ``(start, n, dst)`` for ``relocate`` when the window held unlocked COLD
    KV (``None``: nothing to move)."""

    ext: HotExtent
    adopted: bool
    moves: Optional[Tuple[int, int, torch.Tensor]] = None


class HotPlacement:
    def __init__(self, allocator: GraniKVAllocator, kv_pool: "MHATokenToKVPool", hot: HotNodes,
                 metrics: GraniKVMetrics, *, evict: Callable[[int], object],
                 evict_hot: Callable[[int], int]) -> None:
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.hot = hot
        self.metrics = metrics
        self.evict = evict  # LRU over every unlocked leaf (SGLang's memory pressure), n tokens
        self.evict_hot = evict_hot  # LRU over unlocked HOT subtrees; returns HOT slots freed

    def place(self, node: TreeNode) -> Optional[Placement]:
        """Where ``node`` goes, cheapest first; ``None`` (skip counted) when nowhere.

        1. adopt: the node's own slots are contiguous ``[a, a + len)`` (a fresh prefill
           usually is) and either it is a root child, or its parent's HOT run covers its
           depth and ends at ``a``: nothing copied, nothing freed;
        2. extend in place: the parent's HOT run covers the depth and the ``len`` slots after
           it hold no blocked slot: unlocked COLD KV there is moved out, the node's KV copied;
        3. adopt with a shadow head in the ``depth`` free slots before the node's own;
        4. a fresh extent of ``depth + len`` slots (``reserve_extent``).

        Every extent counts against the HOT cap (``hot_capacity``).
        """
        depth, length = self.hot.depth(node), len(node.value)
        alloc = self.allocator
        run = self.hot.run_of(node.parent)
        covered = depth > 0 and run.length == depth
        a = self.contiguous_start(node.value)
        if (a is not None and (depth == 0 or (covered and run.start + run.length == a))
                and self.room(length)):
            alloc.adopt_extent(a, length)
            self.metrics.adopted += 1
            return Placement(HotExtent(a, 0, length), True)
        if covered and self.room(length):
            end = run.start + run.length
            window = alloc.window_at(end, length, self.movable_mask(), self.slot_mask([node.value]))
            if window is not None:
                dst = alloc.take_window(window, length)
                self.metrics.extended_in_place += 1
                return Placement(HotExtent(end, 0, length), False,
                                 (end, length, dst) if window.moves else None)
        if (a is not None and depth and a > depth and self.room(depth + length)
                and alloc.take_range(a - depth, depth, owned_after=length)):
            self.metrics.adopted += 1
            return Placement(HotExtent(a - depth, depth, length), True)
        reserved = self.reserve_extent(node, depth + length)
        if reserved is None:
            return None
        start, moves = reserved
        return Placement(HotExtent(start, depth, length), False, moves)

    def room(self, n: int) -> bool:
        """Whether an extent of ``n`` slots fits under the HOT cap, after LRU-evicting
        unlocked HOT subtrees if needed."""
        alloc = self.allocator
        while alloc.hot_room() < n:
            if self.evict_hot(1) == 0:
                return False
        return True

    def reserve_extent(self, node: TreeNode, n: int
                       ) -> Optional[Tuple[int, Optional[Tuple[int, int, torch.Tensor]]]]:
        """A fresh extent of ``n`` slots off the common free list: the window with the
        fewest movable slots (unlocked COLD KV, to move out first: ``relocate``); if none,
        LRU eviction (any unlocked leaf while free slots are short, then unlocked HOT
        subtrees, which block windows) and again. Returns ``(start, moves)``; ``None``
        (skip counted) when even that cannot make room."""
        alloc = self.allocator
        if not self.room(n):
            self.metrics.skip("hot_cap")
            return None
        if alloc.available_size() < n:
            self.evict(n - alloc.available_size())
        while True:
            window = alloc.find_window(n, self.movable_mask(), self.slot_mask([node.value]))
            if window is not None:
                break
            if alloc.available_size() < n or self.evict_hot(1) == 0:
                self.metrics.skip("no_space")
                return None
        dst = alloc.take_window(window, n)
        return window.start, ((window.start, n, dst) if window.moves else None)

    def movable_mask(self) -> torch.Tensor:
        """bool ``[size + 1]``: slots of unlocked COLD nodes (no live row reads them)."""
        return self.slot_mask([n.value for n in self.movable_nodes()])

    def slot_mask(self, values: List[torch.Tensor]) -> torch.Tensor:
        alloc = self.allocator
        mask = torch.zeros(alloc.size + 1, dtype=torch.bool, device=alloc.device)
        if values:
            mask[torch.cat(values)] = True
        return mask

    def movable_nodes(self) -> List[TreeNode]:
        nodes, stack = [], list(self.hot.root().children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0 and node not in self.hot.start and len(node.value):
                nodes.append(node)
        return nodes

    def relocate(self, start: int, n: int, dst: torch.Tensor) -> None:
        """Move the unlocked COLD KV inside ``[start, start + n)`` to ``dst`` (free slots
        outside it) and rewrite the owning nodes' values.

            window:   | F  M1 F  M2 M3 F |      dst: [d1, d2, d3]
            after:    KV(M1) -> d1, KV(M2) -> d2, KV(M3) -> d3; node values follow

        Only unlocked nodes move, so no live row or ``prefix_indices`` points at them (the
        same argument as evicting them; a waiting request's match is redone at admission).
        """
        nodes = self.movable_nodes()
        values = torch.cat([nd.value for nd in nodes])
        inside = (values >= start) & (values < start + n)
        src = values[inside]
        assert src.numel() == dst.numel(), (
            f"relocate: {src.numel()} movable slots in [{start}, {start + n}), {dst.numel()} targets")
        self.metrics.bytes_copied += move_kv_slots(self.kv_pool, src, dst)
        values = values.clone()
        values[inside] = dst.to(values.dtype)
        for nd, v in zip(nodes, torch.split(values, [len(nd.value) for nd in nodes]), strict=True):
            nd.value = v.clone()
        self.metrics.compactions += 1
        self.metrics.compaction_moves += int(src.numel())

    @staticmethod
    def contiguous_start(value: torch.Tensor) -> Optional[int]:
        """``a`` if ``value == arange(a, a + len)`` (one host sync), else ``None``."""
        if not len(value):
            return None
        steps_ok = (value[1:] - value[:-1] == 1).all() if len(value) > 1 else value.new_ones((), dtype=torch.bool)
        a, ok = torch.stack([value[0], steps_ok.to(value.dtype)]).tolist()
        return int(a) if ok else None

    def copy_in(self, node: TreeNode, placement: Placement) -> Optional[torch.Tensor]:
        """Copy the path's KV into ``placement.ext`` (adopted: only the shadow head, else the
        path's last ``ext.size`` tokens, ancestors then ``node``). Returns ``node``'s old
        COLD slots to free (``None`` if adopted: they are the extent)."""
        ext = placement.ext
        path = self.hot.path(node)
        if placement.adopted:
            if ext.head:
                src = torch.cat([n.value for n in path[:-1]])[-ext.head:]
                self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, src, ext.start)
            return None
        src = torch.cat([n.value for n in path])[-ext.size:]  # head = depth: the whole path
        self.metrics.bytes_copied += copy_kv_slots(self.kv_pool, src, ext.start)
        return node.value
