"""Invariants of GraniKVRadixCache, checked from the outside (debug mode and tests).

Every check syncs the device (it reads node values and ``req_to_token`` rows) and raises
``IntegrityError`` with the first violated invariant: tree structure and size counters, HOT
nodes (a shadow head covering the node's depth, or the continuation of its HOT parent's
extent), HOT node extents == the hot pool's extents, every slot of the one slot space owned
at most once (exactly once in strict mode: free + COLD tree + live requests' private slots +
HOT extents == size), the per-request table == the tree's HOT runs, and lock counts == live
holders (strict).
"""

from typing import TYPE_CHECKING, Dict, List

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from granikv import sglang_compat as compat
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_pool import IntegrityError

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from granikv.mem_cache.radix_cache import GraniKVRadixCache


def check_cache(cache: "GraniKVRadixCache", *, strict: bool) -> None:
    alloc = cache.token_to_kv_pool_allocator
    alloc.check_integrity()
    cache.hot_prefix_table.check_integrity()
    nodes = _check_tree(cache)
    _check_hot_extents(cache, nodes)
    _check_live(cache, nodes, strict=strict)  # first: every live request still has its row
    owned = {"COLD tree": [n.value for n in nodes if n not in cache._hot_start],
             "HOT extents": [torch.arange(s, s + n) for s, n in alloc.hot_pool.extents().items()]}
    if strict:
        owned["private"] = [_private_slots(cache, r) for r in cache._live.values()]
    _check_ownership(alloc, owned, exact=strict)


def _check_tree(cache: "GraniKVRadixCache") -> List[TreeNode]:
    """Structure, values, lock counts and size counters of every node; returns the nodes."""
    nodes, stack = [], [(c, 0) for c in cache.root_node.children.values()]
    evictable = protected = 0
    size = cache.token_to_kv_pool_allocator.size
    while stack:
        node, depth = stack.pop()
        nodes.append(node)
        stack.extend((c, depth + len(node.key)) for c in node.children.values())
        where = f"node {node.id} (len {len(node.key)}, depth {depth})"
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
            if node in cache._head:
                raise IntegrityError(f"{where}: COLD node has a shadow head")
            if len(v) and (int(v.min()) < 1 or int(v.max()) > size):
                raise IntegrityError(f"{where}: COLD node holds slots outside [1, {size}]")
            continue
        _check_hot_node(cache, node, depth, where)
    if (evictable, protected) != (cache.evictable_size_, cache.protected_size_):
        raise IntegrityError(
            f"tree sizes: evictable {evictable} / protected {protected} by walk, counters say "
            f"{cache.evictable_size_} / {cache.protected_size_}")
    return nodes


def _check_hot_node(cache: "GraniKVRadixCache", node: TreeNode, depth: int, where: str) -> None:
    """A HOT node starts a run (its shadow head covers its whole depth; root children: 0) or
    continues its HOT parent's extent (the lower half of a split); value == its slots."""
    start, head = cache._hot_start[node], cache._head.get(node, 0)
    if head and head != depth:
        raise IntegrityError(f"{where}: shadow head of {head} tokens != depth {depth}")
    parent = node.parent
    follows = (parent in cache._hot_start
               and cache._hot_start[parent] + len(parent.key) == start)
    if not head and depth and not follows:
        raise IntegrityError(f"{where}: HOT node with neither a shadow head nor a HOT parent "
                             f"whose extent it continues")
    v = node.value
    if not torch.equal(v.cpu(), torch.arange(start, start + len(v))):
        raise IntegrityError(f"{where}: HOT value is not arange({start}, {start + len(v)})")


def _check_hot_extents(cache: "GraniKVRadixCache", nodes: List[TreeNode]) -> None:
    """HOT node extents (shadow heads included) == the hot pool's extents, none twice."""
    in_tree = set(nodes)
    for node in cache._hot_start:
        if node not in in_tree:
            raise IntegrityError(f"HOT node {node.id} is not in the tree")
    for node in cache._head:
        if node not in cache._hot_start or cache._head[node] <= 0:
            raise IntegrityError(f"node {node.id}: shadow head {cache._head[node]} on a non-HOT node")
    exts = [cache._extent(n) for n in cache._hot_start]
    by_nodes = {e.start: e.size for e in exts}
    if len(by_nodes) != len(exts):
        raise IntegrityError(f"{len(exts) - len(by_nodes)} HOT extents claimed by two nodes")
    by_pool = cache.hot_pool.extents()
    if by_nodes != by_pool:
        raise IntegrityError(f"HOT extents of nodes {sorted(by_nodes.items())[:8]} != hot pool "
                             f"{sorted(by_pool.items())[:8]}")


def _check_ownership(alloc: GraniKVAllocator, owned: Dict[str, List[torch.Tensor]], *, exact: bool) -> None:
    """No slot owned twice among the free list and ``owned`` (COLD tree, HOT extents and,
    exact, live requests' private slots); exact: together they are every slot of
    ``[1, size]``."""
    parts = {"free": alloc.free_slots().cpu()}
    for name, tensors in owned.items():
        parts[name] = (torch.cat([t.cpu().to(torch.int64) for t in tensors]) if tensors
                       else parts["free"][:0])
    counts = ", ".join(f"{name} {t.numel()}" for name, t in parts.items())
    every = torch.cat(list(parts.values()))
    dupes = every.numel() - torch.unique(every).numel()
    if dupes:
        raise IntegrityError(f"slots: {dupes} owned twice ({counts})")
    if exact and every.numel() != alloc.size:
        raise IntegrityError(f"slots: {counts} != total {alloc.size} "
                             f"({alloc.size - every.numel()} leaked)")


def _private_slots(cache: "GraniKVRadixCache", req: "Req") -> torch.Tensor:
    """The slots a live request owns itself: row[cache_protected_len : kv_allocated_len]."""
    row = cache.req_to_token_pool.req_to_token[compat.req_pool_idx(req)]
    return row[compat.cache_protected_len(req) : compat.kv_allocated_len(req)]


def _check_live(cache: "GraniKVRadixCache", nodes: List[TreeNode], *, strict: bool) -> None:
    table, r2t = cache.hot_prefix_table, cache.req_to_token_pool.req_to_token
    for idx, req in cache._live.items():
        if compat.req_pool_idx(req) != idx:
            raise IntegrityError(f"live request at row {idx} now has req_pool_idx "
                                 f"{compat.req_pool_idx(req)}")
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
        _check_lock_counts(cache, nodes)


def _check_lock_counts(cache: "GraniKVRadixCache", nodes: List[TreeNode]) -> None:
    holders: Dict[TreeNode, int] = {}
    for req in cache._live.values():
        for node in cache._path(req.last_node):
            holders[node] = holders.get(node, 0) + 1
    for node in nodes:  # every tree node (``_check_tree``)
        if node.lock_ref != holders.get(node, 0):
            raise IntegrityError(f"node {node.id}: lock_ref {node.lock_ref} but "
                                 f"{holders.get(node, 0)} live requests hold it")
