"""StepContext: the decode step a promotion candidate will be served in, from tree state only.

A HOT prefix pays or not in the step it is served in: a cascade step's fixed costs are paid
once per step, whatever the number of groups. The promotion policy is therefore told the
step's other groups, as plain ``(prefix_len, sharers)`` pairs (mem_cache/policy.py). The
radix cache hands this class the group nodes: the HOT nodes with live holders and the queued
candidates that pass the policy's floors. Everything read here is tree state (lock counts,
key lengths, parent links), identical on every TP rank, and the pairs come in the order the
nodes were given (the cache gives them in its deterministic dict order).

A request is served by the deepest group node on its path, so a node's sharers are its lock
count minus the lock counts of the nearest group nodes below it::

    root ── A (HOT, lock 10) ── B (candidate, lock 4) ── ...
                             └─ c (COLD, lock 6, no group node)
    A: (|A|, 10 - 4 = 6)      B: (|A| + |B|, 4)

``context_for(node)`` is every group but ``node``, the group nodes below it (their holders are
``node``'s holders, counted in its own lock count) and the nearest group node above it, which
``within(node)`` gives apart, with the sharers left to it once ``node`` serves its own: without
``node``, its holders are served in that group (``B``'s 4 holders read ``A``'s prefix)::

    context_for(B) = (groups elsewhere in the tree)      within(B) = (|A|, 6)
"""

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

from granikv.mem_cache.policy import Group

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import TreeNode



class StepContext:
    def __init__(self, nodes: Iterable["TreeNode"], *, root: "TreeNode") -> None:
        self._members: Dict["TreeNode", None] = dict.fromkeys(nodes)
        self._members.pop(root, None)
        self.prefix_len: Dict["TreeNode", int] = {}
        self.sharers: Dict["TreeNode", int] = {n: n.lock_ref for n in self._members}
        self._below: Dict["TreeNode", List["TreeNode"]] = {}  # member -> members right below it
        self._up: Dict["TreeNode", Optional["TreeNode"]] = {}  # member -> the nearest member above
        for n in self._members:
            up = self._up[n] = self._nearest_member_above(n, root)
            if up is not None:
                self.sharers[up] -= n.lock_ref
                self._below.setdefault(up, []).append(n)

    def __contains__(self, node: "TreeNode") -> bool:
        return node in self._members

    def groups(self) -> List[Group]:
        """Every group with sharers left, in the nodes' order."""
        return [(self.prefix_len[n], s) for n, s in self.sharers.items() if s > 0]

    def context_for(self, node: "TreeNode") -> Tuple[Group, ...]:
        """The groups of the step other than ``node`` (a member), the members below it and
        the nearest member above it (``within``)."""
        if node not in self._members:
            raise KeyError("context_for: the node is not one of the step's group nodes")
        skip, todo = {node, self._up[node]}, [node]
        while todo:
            for m in self._below.get(todo.pop(), ()):
                skip.add(m)
                todo.append(m)
        return tuple((self.prefix_len[n], s) for n, s in self.sharers.items()
                     if s > 0 and n not in skip)

    def within(self, node: "TreeNode") -> Optional[Group]:
        """``(prefix_len, sharers)`` of the nearest member above ``node``, its sharers
        without ``node``'s holders (``None``: no member above)."""
        up = self._up[node]
        return None if up is None else (self.prefix_len[up], max(self.sharers[up], 0))

    def _nearest_member_above(self, node: "TreeNode", root: "TreeNode") -> Optional["TreeNode"]:
        """Walks ``node``'s path once: records its prefix length, returns the nearest member
        ancestor (``None``: none)."""
        total, up, p = len(node.key), None, node.parent
        while p is not None and p is not root:
            if up is None and p in self._members:
                up = p
            total += len(p.key)
            p = p.parent
        self.prefix_len[node] = total
        return up
