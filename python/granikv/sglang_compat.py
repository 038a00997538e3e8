"""Every difference between the SGLang releases GraniKV supports, behind names that say what
they do. No other module checks SGLang's version.

Supported releases (``SUPPORTED``): 0.5.17 and 0.5.23. Each is one ``_Release`` subclass; the
running SGLang picks the newest one not newer than itself (``release``). The next release is
one more subclass here (and one more entry in ``SUPPORTED`` once the suite passes on it).

What differs (0.5.17 -> 0.5.23):

    request state           req.req_pool_idx, req.cache_protected_len -> req.kv.*
    matched prefix          req.prefix_indices (a tensor) -> gone (req.prefix_len; the row)
    match result            MatchResult.device_indices -> device_prefix_len + path_device_indices
    prefix-cache lifecycle  cache_unfinished_req / cache_finished_req
                            -> checkpoint(req, up_to) / on_release(req, checkpointed)
    remove events           RadixCache._record_remove_event(node) -> kv_events.record_remove(node)
    allocator free group    free_group == [] outside a group -> None
    ServerArgs              a dataclass (its __init__ is hookable) -> a msgspec Struct (it is not)
    WAR barrier's runner    worker.war_fastpath_runner.war_fastpath_read_done_event
                            -> worker.last_shared_read_runner.shared_read_done_event
"""

import re
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult
    from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

SUPPORTED: Tuple[str, ...] = ("0.5.17", "0.5.23")


def parse_version(text: str) -> Tuple[int, ...]:
    """``"0.5.23.post1"`` -> ``(0, 5, 23)``: the numeric release part only."""
    out = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        out.append(int(digits.group()))
        if digits.end() < len(part):  # "24rc1": the release number ends here
            break
    return tuple(out)


def sglang_version() -> str:
    """The installed SGLang's version (its package metadata: importing sglang is not needed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def is_tested(version: Optional[str] = None) -> bool:
    """Whether GraniKV's suite ran on this SGLang release (``SUPPORTED``)."""
    v = parse_version(version or sglang_version())
    return any(v == parse_version(s) for s in SUPPORTED)


# ---- one class per supported release ------------------------------------------------------


class _Release:
    """SGLang 0.5.17 (the oldest supported release): the base every later one overrides."""

    name = "0.5.17"
    #: which prefix-cache calls SGLang makes on a request: "finished_req" (cache_unfinished_req
    #: / cache_finished_req) or "checkpoint" (checkpoint / on_release)
    lifecycle = "finished_req"
    #: whether ServerArgs is a msgspec Struct (no hookable __init__; Engine kwargs go elsewhere)
    server_args_is_struct = False

    # request state
    def req_pool_idx(self, req: "Req") -> Optional[int]:
        return req.req_pool_idx

    def cache_protected_len(self, req: "Req", default: int = 0) -> int:
        return getattr(req, "cache_protected_len", default)

    def kv_allocated_len(self, req: "Req") -> int:
        kv = getattr(req, "kv", None)
        return kv.kv_allocated_len if kv is not None else 0

    def splice_prefix_indices(self, req: "Req", new: torch.Tensor) -> None:
        """Replace the first ``len(new)`` entries of the request's matched-prefix indices."""
        req.prefix_indices = _splice(req.prefix_indices, new)

    # match results
    def match_length(self, result: "MatchResult") -> int:
        return len(result.device_indices)

    def match_indices(self, cache: "RadixCache", result: "MatchResult") -> torch.Tensor:
        return result.device_indices

    # tree events
    def record_remove(self, cache: "RadixCache", node: "TreeNode") -> None:
        cache._record_remove_event(node)

    # allocator
    def free_group_parts(self, allocator: "TokenToKVPoolAllocator") -> List[torch.Tensor]:
        return list(allocator.free_group)

    def outside_free_group(self, allocator: "TokenToKVPoolAllocator") -> bool:
        """No ``free_group_begin`` / ``free_group_end`` bracket is open on ``allocator``."""
        return allocator.is_not_in_free_group

    # attention backends
    #: the attribute a wrapped backend sets when its kernels may read translated slot ids
    kv_translation_attr = "_translate_kv_loc"

    def backend_translates_kv_slots(self, backend: "AttentionBackend") -> bool:
        """Whether ``backend`` reads KV through a virtual-to-physical slot translation (its
        pool's ``req_to_token`` ids are not the K/V buffer rows). 0.5.17: the backend holds
        the allocator's translate function, ``None`` on a plain pool."""
        return getattr(backend, "_translate_kv_loc", None) is not None

    # scheduler's write-after-read barrier
    #: the worker property naming the model runner whose read-done event the barrier waits on
    war_runner_attr = "war_fastpath_runner"
    #: that runner's attribute holding the event (None: the barrier waits for the whole forward)
    war_event_attr = "war_fastpath_read_done_event"

    def war_read_done_runner(self, worker: Any) -> Optional["ModelRunner"]:
        """The model runner owning the read-done event ``Scheduler._apply_war_barrier`` waits
        on (None if ``worker`` has none)."""
        return getattr(worker, self.war_runner_attr, None)

    # offline API
    def install_engine_server_args(self, build: Callable[..., "ServerArgs"]) -> None:
        """Route ``sglang.Engine(**kwargs)``'s ServerArgs through ``build(cls, **kwargs)``.
        0.5.17: nothing to do, the plugin hooks ``ServerArgs.__init__`` instead."""


class _Release0523(_Release):
    name = "0.5.23"
    lifecycle = "checkpoint"
    server_args_is_struct = True

    def req_pool_idx(self, req: "Req") -> Optional[int]:
        return req.kv.req_pool_idx

    def cache_protected_len(self, req: "Req", default: int = 0) -> int:
        kv = getattr(req, "kv", None)
        return kv.cache_protected_len if kv is not None else default

    def splice_prefix_indices(self, req: "Req", new: torch.Tensor) -> None:
        """No such tensor: a request's matched prefix is its row (``prefix_device_indices``)."""

    def match_length(self, result: "MatchResult") -> int:
        return result.device_prefix_len

    def match_indices(self, cache: "RadixCache", result: "MatchResult") -> torch.Tensor:
        return cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]

    def record_remove(self, cache: "RadixCache", node: "TreeNode") -> None:
        cache.kv_events.record_remove(node)

    def free_group_parts(self, allocator: "TokenToKVPoolAllocator") -> List[torch.Tensor]:
        return list(allocator.free_group or [])

    def outside_free_group(self, allocator: "TokenToKVPoolAllocator") -> bool:
        return allocator.free_group is None

    kv_translation_attr = "kv_index_translator"

    def backend_translates_kv_slots(self, backend: "AttentionBackend") -> bool:
        """0.5.23: the backend holds the model runner's ``KVIndexTranslator``, which says
        ``is_translating`` (a unified pool); a plain pool's translator is the identity."""
        translator = getattr(backend, "kv_index_translator", None)
        return bool(getattr(translator, "is_translating", False))

    war_runner_attr = "last_shared_read_runner"
    war_event_attr = "shared_read_done_event"

    def install_engine_server_args(self, build: Callable[..., "ServerArgs"]) -> None:
        """A msgspec ServerArgs rejects unknown keywords before any hook runs, and
        ``Engine.__init__`` loads the plugins itself (too late to wrap it). Engine builds its
        ServerArgs through the class attribute ``server_args_class``, read AFTER the plugins
        load: it becomes a factory that hands the keywords to ``build``. (Not through
        SGLang's HookRegistry: it would also rebind every module's ``ServerArgs`` name.)"""
        from sglang.srt.entrypoints.engine import Engine

        current = Engine.__dict__.get("server_args_class")
        if current is None or getattr(current, "__func__", None) is not None:
            return  # not SGLang's attribute, or already a factory (plugins load per process)
        Engine.server_args_class = staticmethod(lambda **kw: build(current, **kw))


_RELEASES = (_Release(), _Release0523())


def _pick(version: str) -> _Release:
    v = parse_version(version)
    fitting = [r for r in _RELEASES if parse_version(r.name) <= v]
    return fitting[-1] if fitting else _RELEASES[0]


release: _Release = _pick(sglang_version())


# ---- module-level names (what the rest of GraniKV calls) -----------------------------------

LIFECYCLE = release.lifecycle
SERVER_ARGS_IS_STRUCT = release.server_args_is_struct
req_pool_idx = release.req_pool_idx
cache_protected_len = release.cache_protected_len
kv_allocated_len = release.kv_allocated_len
splice_prefix_indices = release.splice_prefix_indices
match_length = release.match_length
match_indices = release.match_indices
record_remove = release.record_remove
free_group_parts = release.free_group_parts
outside_free_group = release.outside_free_group
KV_TRANSLATION_ATTR = release.kv_translation_attr
backend_translates_kv_slots = release.backend_translates_kv_slots
install_engine_server_args = release.install_engine_server_args
WAR_RUNNER_ATTR = release.war_runner_attr
WAR_EVENT_ATTR = release.war_event_attr
war_read_done_runner = release.war_read_done_runner


def model_runner_of_cache_context(ctx: Any) -> Optional["ModelRunner"]:
    """The model runner of a tree-cache build context (its ``tp_worker``'s; the same in both
    releases), None when the context has none (tests, other cache builders)."""
    return getattr(getattr(ctx, "tp_worker", None), "model_runner", None)


def _splice(indices: Optional[torch.Tensor], new: torch.Tensor) -> Optional[torch.Tensor]:
    """``indices`` with its first ``min(len(indices), len(new))`` entries replaced by ``new``'s
    (a new tensor; ``None`` stays ``None``)."""
    if indices is None:
        return None
    k = min(len(indices), len(new))
    return torch.cat([new[:k].to(device=indices.device, dtype=indices.dtype), indices[k:]])


def lifecycle_mixin() -> type:
    """The prefix-cache lifecycle overrides for the running release, as a mixin to put before
    SGLang's ``RadixCache``. The class it is mixed into provides two callbacks:

    - ``_after_insert(req)``: the request's KV so far went into the tree and its row / lock
      moved to the node the insert ended on (0.5.17 ``cache_unfinished_req``, 0.5.23
      ``checkpoint``, also at finish);
    - ``_after_release(req_pool_idx, req)``: the request gave its row back (0.5.17
      ``cache_finished_req``, 0.5.23 ``on_release``; finish, abort and retract alike).
    """
    return _CheckpointLifecycle if LIFECYCLE == "checkpoint" else _FinishedReqLifecycle


# To the type checker the mixins derive from SGLang's RadixCache (their ``super()`` calls and the
# two callbacks resolve there and in the class they are mixed into); at run time from object.
if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import RadixCache as _CacheBase
else:
    _CacheBase = object


class _FinishedReqLifecycle(_CacheBase):
    def cache_unfinished_req(self, req: "Req", chunked: bool = False) -> None:
        super().cache_unfinished_req(req, chunked=chunked)
        self._after_insert(req)

    def cache_finished_req(self, req: "Req", is_insert: bool = True, *, kv_len_to_handle: int) -> None:
        idx = req.req_pool_idx
        super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        self._after_release(idx, req)


class _CheckpointLifecycle(_CacheBase):
    def checkpoint(self, req: "Req", *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to, **kwargs)
        self._after_insert(req)

    def on_release(self, req: "Req", *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._after_release(req.kv.req_pool_idx, req)
