"""HotNodes: which tree nodes are HOT, where their extents are, and the HOT run of a path.

A HOT node's ``value`` is always ``arange(start, start + len)`` (its own tokens, after its
shadow head); ``start`` holds ``start`` and ``head`` the head length (absent = 0) on the
host, so nothing here reads the device to find an extent. Also the tree-path helpers the
cache's collaborators share (they stop at the cache's current root).
"""

from typing import Callable, Dict, List, NamedTuple, Optional

from sglang.srt.mem_cache.radix_cache import TreeNode

from granikv.mem_cache.hot_pool import HotPool


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


class Run(NamedTuple):
    """A request's HOT run: path tokens ``[0, length)`` live in ``[start, start + length)``;
    the first ``head`` of them are a shadow head (the tree's own values differ there)."""

    start: int
    length: int
    head: int


def path_to(node: Optional[TreeNode], root: TreeNode) -> List[TreeNode]:
    """Nodes from the root's child down to ``node`` (empty for None / the root)."""
    path = []
    while node is not None and node is not root:
        path.append(node)
        node = node.parent
    return path[::-1]


def is_attached(node: TreeNode) -> bool:
    parent = node.parent
    return parent is not None and parent.children.get(node.key.child_key(1)) is node


class HotNodes:
    """The HOT node registry: node -> ``node.value[0]`` and node -> shadow head length."""

    def __init__(self, hot_pool: HotPool, root: Callable[[], TreeNode]) -> None:
        self.hot_pool = hot_pool
        self.root = root  # the cache's current root (``reset`` makes a new one)
        self.start: Dict[TreeNode, int] = {}  # HOT node -> node.value[0]
        self.head: Dict[TreeNode, int] = {}  # HOT node -> shadow head length (only if > 0)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.start

    def clear(self) -> None:
        self.start.clear()
        self.head.clear()

    def path(self, node: Optional[TreeNode]) -> List[TreeNode]:
        return path_to(node, self.root())

    def depth(self, node: TreeNode) -> int:
        return sum(len(n.key) for n in self.path(node.parent))

    def add(self, node: TreeNode, ext: HotExtent) -> None:
        self.start[node] = ext.node_start
        if ext.head:
            self.head[node] = ext.head

    def drop(self, node: TreeNode) -> HotExtent:
        """Forget HOT ``node``; returns the extent it owned."""
        ext = self.extent(node)
        del self.start[node]
        self.head.pop(node, None)
        return ext

    def split(self, child: TreeNode, new_node: TreeNode, split_len: int) -> bool:
        """``new_node`` is the upper ``split_len`` tokens of ``child``: if ``child`` is HOT,
        both halves stay HOT and contiguous, the upper half keeps the shadow head.

            before:  | head | child's tokens ..................... |
            after:   | head | new_node [:split_len] | child [split_len:] |
        """
        start = self.start.get(child)
        if start is None:
            return False
        head = self.head.pop(child, 0)
        self.start[new_node] = start
        if head:
            self.head[new_node] = head
        self.start[child] = self.hot_pool.split(start - head, head + split_len)
        return True

    def extent(self, node: TreeNode) -> HotExtent:
        head = self.head.get(node, 0)
        return HotExtent(self.start[node] - head, head, len(node.key))

    def head_slots(self, *, locked: bool) -> int:
        """Shadow-head slots of HOT nodes: held, but in no node key (SGLang's counters)."""
        return sum(h for n, h in self.head.items() if (n.lock_ref > 0) == locked)

    def hot_slots(self, *, locked: bool) -> int:
        """HOT slots (shadow heads included) of HOT nodes."""
        return sum(self.extent(n).size for n in self.start if (n.lock_ref > 0) == locked)

    def run_of(self, node: Optional[TreeNode]) -> Run:
        """The HOT run of the path root -> ``node``.

            path:   | h (COLD, 4) | B (HOT, head 4) | B' (HOT, follows B) | c (COLD) |
            run:    [s, s + 4 + |B| + |B'|)       s = B's extent start

        A HOT node whose shadow head covers its whole depth (re)starts the run (root
        children: depth 0, head 0); a HOT node whose slots follow the run's end, with the run
        reaching its depth, extends it. Other nodes leave the run as it is.
        """
        start = length = head = depth = 0
        for n in self.path(node):
            s = self.start.get(n)
            if s is not None:
                if length == depth > 0 and s == start + length:
                    length += len(n.key)
                elif self.head.get(n, 0) == depth:
                    start, length, head = s - depth, depth + len(n.key), depth
            depth += len(n.key)
        return Run(start, length, head)
