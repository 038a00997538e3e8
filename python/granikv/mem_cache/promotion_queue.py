"""PromotionQueue: promotion candidates, queued at lock time and drained once per step.

``queue`` (the cache's ``inc_lock_ref``) queues the deepest node of the locked path that the
policy accepts, if it is COLD; ``drain`` (the cache's ``apply_pending_promotions``, at a safe
point) decides, in queue order, which candidates are promoted now (live holders known, not
superseded by a deeper shared prefix, paying in the step they are served in), which wait
for a later call and which are dropped, and hands each one to promote to the cache.
"""

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Dict, Final, Iterable, List, Literal, Optional, Set, Tuple, Union

from sglang.srt.mem_cache.radix_cache import TreeNode

from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.hot_nodes import HotNodes, is_attached
from granikv.mem_cache.metrics import GraniKVMetrics
from granikv.mem_cache.policy import PromotionPolicy
from granikv.mem_cache.step_context import StepContext

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

RETRY: Final = "retry"


class PromotionQueue:
    def __init__(self, policy: PromotionPolicy, metrics: GraniKVMetrics, hot: HotNodes,
                 allocator: GraniKVAllocator, live_reqs: Callable[[], List["Req"]]) -> None:
        self.policy = policy
        self.metrics = metrics
        self.hot = hot
        self.allocator = allocator
        self.live_reqs = live_reqs  # the registered live requests (HotPublisher.live_reqs)
        self.pending: Dict[TreeNode, None] = {}  # insertion-ordered set: deterministic
        self.retry_counted: Dict[TreeNode, None] = {}  # queued nodes whose unknown_holders skip is counted
        self.candidates: Tuple[TreeNode, ...] = ()  # the queue as drain found it
        self.step: Optional[StepContext] = None  # built from the tree once per drain
        self.frozen: Optional[str] = None  # why no new promotion is queued, if so

    def freeze(self, reason: str) -> None:
        self.frozen = reason
        self.pending.clear()

    def queue(self, node: TreeNode) -> None:
        if self.frozen is not None:
            return
        target = self.target(node)
        if target is not None and target not in self.hot.start:
            self.pending[target] = None

    def drain(self, promote: Callable[[TreeNode, List["Req"]], bool]) -> int:
        """Decide every queued candidate; ``promote(node, holders)`` places and materializes
        one (``False``: no room, counted there). Returns how many nodes became HOT."""
        work, self.pending = deque(self.pending), {}
        self.candidates, self.step = tuple(work), None
        seen: Set[TreeNode] = set()
        promoted = 0
        while work:
            node = work.popleft()
            if node in seen:
                continue
            seen.add(node)
            holders = self.holders(node)
            if holders == RETRY:
                self.pending[node] = None  # e.g. a holder registers later this step
                continue
            if holders is None:
                continue
            deeper = self.superseded_by(node, holders)
            if deeper is not None:  # every holder shares a longer prefix: promote that one
                self.metrics.skip("superseded")
                work.extend(deeper)
                continue
            if promote(node, holders):
                promoted += 1
        self.candidates, self.step = (), None  # no tree nodes held past the call
        self.retry_counted = {n: None for n in self.retry_counted if n in self.pending}
        return promoted

    def target(self, node: Optional[TreeNode]) -> Optional[TreeNode]:
        """The deepest node on ``node``'s path the policy accepts (``None``: none does)."""
        path = self.hot.path(node)
        end = sum(len(n.key) for n in path)
        for n in reversed(path):
            if self.policy.may_promote(end, n.lock_ref, hit_count=n.hit_count):
                return n
            end -= len(n.key)
        return None

    def holders(self, node: TreeNode) -> Union[List["Req"], Literal["retry"], None]:
        """The live requests holding ``node`` if it may be promoted now; ``None`` to drop the
        queue entry; ``RETRY`` to keep it queued for the next call."""
        if not is_attached(node) or node in self.hot.start:
            return None  # stale queue entry: evicted, already HOT
        total = self.hot.depth(node) + len(node.key)
        if not self.policy.may_promote(total, node.lock_ref, hit_count=node.hit_count):
            return None
        if total > self.allocator.hot_capacity:
            self.metrics.skip("too_large")
            return None
        holders = [r for r in self.live_reqs() if node in self.hot.path(r.last_node)]
        if len(holders) != node.lock_ref:
            # a lock we cannot map to a req_to_token row (a temporary admission lock, or a
            # holder the plugin did not register): its row could keep the old COLD slots
            if node not in self.retry_counted:  # one skip per waiting node, not one per retry
                self.retry_counted[node] = None
                self.metrics.skip("unknown_holders")
            return RETRY
        if not self.policy.should_promote(total, node.lock_ref, hit_count=node.hit_count,
                                          remaining_steps=remaining_steps(holders),
                                          **self.step_context(node)):
            self.metrics.skip("does_not_pay")
            return None
        return holders

    def step_context(self, node: TreeNode) -> Dict[str, Any]:
        """``context`` / ``within`` of the step ``node`` would be served in (``StepContext``):
        HOT nodes with live holders + the queued candidates that pass ``may_promote`` and fit
        the HOT cap beside ``node`` (``within_cap``)."""
        if not self.policy.uses_context:
            return {}
        if self.step is None or node not in self.step:
            hot = [n for n in self.hot.start if n.lock_ref > 0]
            queued = [n for n in self.candidates if n not in self.hot.start and is_attached(n)
                      and self.policy.may_promote(self.hot.depth(n) + len(n.key), n.lock_ref)]
            self.step = StepContext([*hot, *self.within_cap(node, queued)], root=self.hot.root())
        return dict(context=self.step.context_for(node), within=self.step.within(node))

    def within_cap(self, node: TreeNode, queued: List[TreeNode]) -> List[TreeNode]:
        """``node``, then the other queued candidates, in queue order, that the HOT cap can
        hold beside ``node`` and the live HOT extents (unlocked extents can be evicted to make
        room): the ones past the cap would be refused there (skip ``hot_cap``), so the step
        ``node`` is priced in does not count them as groups. Each takes at least its own
        tokens, and its depth too unless its parent's HOT run covers it (``HotPlacement.place``)."""
        room = self.allocator.hot_capacity - self.hot.hot_slots(locked=True) - self.slots_needed(node)
        kept = [node]
        for n in queued:
            need = self.slots_needed(n)
            if n is not node and need <= room:
                kept.append(n)
                room -= need
        return kept

    def slots_needed(self, node: TreeNode) -> int:
        """The fewest HOT slots promoting ``node`` takes."""
        depth = self.hot.depth(node)
        return len(node.key) + (0 if depth > 0 and self.hot.run_of(node.parent).length == depth else depth)

    def superseded_by(self, node: TreeNode, holders: List["Req"]) -> Optional[List[TreeNode]]:
        """``None`` if some holder's deepest accepted node is ``node``; otherwise the holders'
        deeper COLD targets (promoting ``node`` too would copy KV nobody's run would use)."""
        targets = dict.fromkeys(self.target(r.last_node) for r in holders)
        if node in targets:
            return None
        return [t for t in targets if t is not None and t not in self.hot.start]


def remaining_steps(reqs: Iterable["Req"]) -> Optional[float]:
    """Mean decode steps ``reqs`` may still run (``max_new_tokens`` minus tokens output so
    far); ``None`` if some request does not say."""
    left = []
    for r in reqs:
        budget = getattr(getattr(r, "sampling_params", None), "max_new_tokens", None)
        if budget is None:
            return None
        left.append(max(budget - len(r.output_ids), 0))
    return sum(left) / len(left) if left else None
