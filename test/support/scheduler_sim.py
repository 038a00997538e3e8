"""A CPU scenario driver: real SGLang pools + GraniKV allocator and cache, SGLang's call order.

The KV content is an oracle: the K (V) written for token ``t`` at position ``p`` of layer
``l`` is ``kv_table[l, 0 (1), t, p]`` (random, fixed per seed). Requests that share a prefix
share tokens and positions, so every live request's view through its ``req_to_token`` row,
and every tree node's slots, must equal the table bit for bit, whatever was promoted,
split, compacted or evicted.

The request lifecycle follows the running SGLang release (``sglang_compat.LIFECYCLE``):

    0.5.17 (``_FinishedReqCalls``, the sim's own ``SimReq``):
    admit:  match_prefix -> inc_lock_ref -> ReqToTokenPool.alloc -> evict + alloc COLD slots
            -> write req_to_token (prefix + new) -> [plugin] update_request_hot_prefix
            -> forward (KV of the new tokens) -> cache_unfinished_req
    chunked prefill: admit with the extend cut at the first chunk -> forward
            -> cache_unfinished_req(chunked=True) (inserts the prefix so far) -> next chunk:
            alloc -> write req_to_token (prefix_indices + new) -> [plugin] register -> forward
            -> ... -> the last chunk ends with cache_unfinished_req(chunked=False)
    finish: cache_finished_req(kv_len_to_handle=committed) -> ReqToTokenPool.free
    abort:  cache_finished_req(is_insert=False, ...) -> ReqToTokenPool.free

    0.5.23 (``_CheckpointCalls``, SGLang's real ``Req`` and ``mem_cache.common`` functions):
    admit:  Req.init_next_round_input(tree_cache) (match_kv_cache) -> req.lock = lock(node)
            -> ReqToTokenPool.alloc -> evict + alloc COLD slots -> write req_to_token
            (prefix_device_indices + new; kv committed = allocated) -> [plugin] register
            -> forward -> checkpoint_kv_cache (checkpoint(req, up_to=extend_end))
    chunked prefill: the same per chunk; the row is kept, the next chunk starts at prefix_len
    finish: release_kv_cache(req, tree_cache, checkpoint=True)  (checkpoint, free_kv_row,
            unlock, on_release, ReqToTokenPool.free)
    abort:  release_kv_cache(..., checkpoint=False)

    both:   decode: evict + alloc 1 slot -> write req_to_token -> forward
            promote: [plugin, before run_batch] apply_pending_promotions

``overlap_schedule`` drives a workload in the overlap scheduler's order (0.5.23's default):
batch N is formed, registered, promoted and launched BEFORE batch N-1's results are processed
(its finished requests released, its prefilled requests checkpointed), and a chunked request
is checkpointed at the start of the next step, before its previous chunk's results are in.
"""

import itertools
import random
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from granikv import sglang_compat as compat
from granikv.config import GraniKVConfig
from granikv.mem_cache.allocator import GraniKVAllocator
from granikv.mem_cache.radix_cache import GraniKVRadixCache


@dataclass(frozen=True)
class SimConfig:
    kv_size: int = 384
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    max_reqs: int = 12
    max_context: int = 160
    vocab: int = 61
    hot_fraction: float = 0.5
    min_tokens: int = 16
    min_sharers: int = 2
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    shuffle_free: bool = False  # start from a scattered free list (prefills not contiguous)


_ids = itertools.count()


class _SimReqFields:
    """What the sim itself tracks per request, on every release."""

    def _init_sim_fields(self) -> None:
        self.rid = next(_ids)
        self.written_len = 0  # KV the sim's forwards have written: [0, written_len)
        self.fill_len: Optional[int] = None  # chunked prefill: the prompt extended so far
        self.pending = None  # (first position, slots) allocated but not yet forwarded

    @property
    def tokens(self) -> array:
        return self.origin_input_ids + self.output_ids


class SimReq0517(_SimReqFields):
    """The attributes of SGLang 0.5.17's ``Req`` that the pools and RadixCache read and write."""

    def __init__(self, prompt: List[int]):
        self._init_sim_fields()
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.extra_key = None
        self.priority = 0
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices = None
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.inflight_middle_chunks = 0
        self.kv = None

    def get_fill_ids(self) -> array:
        ids = self.origin_input_ids + self.output_ids
        return ids if self.fill_len is None else ids[: self.fill_len]


def _make_req_0523():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    class SimReq0523(_SimReqFields, Req):
        """SGLang 0.5.23's real ``Req``, plus the sim's fields and read-only views under the
        0.5.17 names the tests use (``req_pool_idx``, ``kv_committed_len``, ``prefix_indices``:
        the row's tree-owned part, 0.5.23 keeps no separate tensor)."""

        def __init__(self, prompt: List[int]):
            Req.__init__(self, "sim", "", array("q", prompt), SamplingParams(max_new_tokens=1 << 30))
            self._init_sim_fields()
            self._row_pool = None

        req_pool_idx = property(lambda self: self.kv.req_pool_idx)
        kv_committed_len = property(lambda self: self.kv.kv_committed_len)
        cache_protected_len = property(lambda self: self.kv.cache_protected_len)

        @property
        def prefix_indices(self) -> Optional[torch.Tensor]:
            if self.kv.req_pool_idx is None:
                return None
            row = self._row_pool.req_to_token[self.kv.req_pool_idx]
            return row[: self.kv.cache_protected_len].to(torch.int64)

    return SimReq0523


class _FinishedReqCalls:
    """SGLang 0.5.17's calls: ``cache_unfinished_req`` / ``cache_finished_req``."""

    def __init__(self, sim: "Sim"):
        self.sim = sim

    cache = property(lambda self: self.sim.cache)  # a test may swap in SGLang's own cache

    def new_req(self, prompt):
        return SimReq0517(prompt)

    def match_and_lock(self, req) -> None:
        m = self.sim.match(req.origin_input_ids)
        req.prefix_indices, req.last_node = m.indices, m.node
        req.cache_protected_len = len(m.indices)
        self.cache.inc_lock_ref(req.last_node)

    def unlock_unadmitted(self, req) -> None:
        self.cache.dec_lock_ref(req.last_node)

    def extend_start(self, req) -> int:
        return req.cache_protected_len

    def prefix_slots(self, req, n: int) -> torch.Tensor:
        return req.prefix_indices[:n]

    def allocated(self, req, end: int) -> None:
        req.kv = SimpleNamespace(kv_allocated_len=end)

    def after_forward(self, req, end: int, *, chunked: bool) -> None:
        req.kv_committed_len = end
        self.cache.cache_unfinished_req(req, chunked=chunked)

    def decoded(self, req) -> None:
        req.kv.kv_allocated_len += 1
        req.kv_committed_len += 1

    def commit_pending(self, req, end: int) -> None:
        req.kv_committed_len = end

    def release(self, req, *, is_insert: bool) -> None:
        self.cache.cache_finished_req(req, is_insert, kv_len_to_handle=req.kv_committed_len)
        self.sim.req_pool.free(req)
        req.kv = None

    def temp_lock(self, node):
        self.cache.inc_lock_ref(node)
        return node

    def temp_unlock(self, handle) -> None:
        self.cache.dec_lock_ref(handle)


class _CheckpointCalls:
    """SGLang 0.5.23's calls, through its real ``Req`` and ``mem_cache.common`` functions."""

    def __init__(self, sim: "Sim"):
        from sglang.srt.mem_cache import common

        self.sim, self.common = sim, common
        _publish_default_server_args()

    cache = property(lambda self: self.sim.cache)

    def new_req(self, prompt):
        req = SimReq(prompt)
        req._row_pool = self.sim.req_pool
        return req

    def match_and_lock(self, req) -> None:
        req.init_next_round_input(self.cache)  # match_kv_cache; cache_protected_len = prefix_len
        req.lock = self.cache.lock(req.last_node)

    def unlock_unadmitted(self, req) -> None:
        self.cache.unlock(req.lock)
        req.lock = None

    def extend_start(self, req) -> int:
        return req.prefix_len

    def prefix_slots(self, req, n: int) -> torch.Tensor:
        if req.kv.kv_allocated_len:  # a later chunk: the row already holds its prefix
            return self.sim.req_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        return self.cache.prefix_device_indices(req)[:n]

    def allocated(self, req, end: int) -> None:
        req.extend_end = end
        req.kv.kv_allocated_len = end  # alloc_for_extend: committed at allocation
        req.kv.kv_committed_len = end

    def after_forward(self, req, end: int, *, chunked: bool) -> None:
        self.common.checkpoint_kv_cache(req, self.cache)

    def decoded(self, req) -> None:
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1

    def commit_pending(self, req, end: int) -> None:
        pass  # already counted at allocation

    def release(self, req, *, is_insert: bool) -> None:
        self.common.release_kv_cache(req, self.cache, checkpoint=is_insert)

    def temp_lock(self, node):
        return self.cache.lock(node)

    def temp_unlock(self, handle) -> None:
        self.cache.unlock(handle)


def _publish_default_server_args() -> None:
    """0.5.23's ``release_kv_cache`` reads the published server args (speculative decoding,
    thinking-cache stripping); publish SGLang's defaults if nothing is published yet."""
    from sglang.srt.runtime_context import get_context, get_spec

    try:
        get_spec()
    except ValueError:
        get_context().override_server_args().install()


def _calls(sim: "Sim"):
    return _CheckpointCalls(sim) if compat.LIFECYCLE == "checkpoint" else _FinishedReqCalls(sim)


#: the request class of the running release
SimReq = _make_req_0523() if compat.LIFECYCLE == "checkpoint" else SimReq0517


class Sim:
    def __init__(self, cfg: SimConfig = SimConfig(), *, debug_checks: bool = True):
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.kv_pool = MHATokenToKVPool(
            size=cfg.kv_size, page_size=1, dtype=cfg.dtype, head_num=cfg.kv_heads,
            head_dim=cfg.head_dim, layer_num=cfg.layers, device="cpu", enable_memory_saver=False)
        self.allocator = GraniKVAllocator(cfg.kv_size, cfg.dtype, "cpu", self.kv_pool, False,
                                          hot_fraction=cfg.hot_fraction, debug_checks=debug_checks)
        if cfg.shuffle_free:  # as after long serving: promotions copy instead of adopting
            perm = torch.randperm(cfg.kv_size, generator=gen)
            self.allocator.free_pages = self.allocator.free_pages[perm]
        self.req_pool = ReqToTokenPool(cfg.max_reqs, cfg.max_context, "cpu", False)
        self.config = GraniKVConfig(enable=True, hot_min_tokens=cfg.min_tokens,
                                    hot_min_sharers=cfg.min_sharers, hot_fraction=cfg.hot_fraction)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=1)
        self.cache = GraniKVRadixCache.create(params, self.config, self.kv_pool)
        self.calls = _calls(self)
        shape = (cfg.layers, 2, cfg.vocab, cfg.max_context, cfg.kv_heads, cfg.head_dim)
        self.kv_table = torch.randn(shape, generator=gen).to(cfg.dtype)
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:  # garbage, never zeros
            buf.copy_(torch.randn(buf.shape, generator=gen).to(cfg.dtype))
        self.live: Dict[int, object] = {}  # rid -> request holding a req_to_token row
        self.temp_locks: list = []

    # ---- scheduler steps -------------------------------------------------------------------

    def match(self, tokens) -> SimpleNamespace:
        """``match_prefix_for_req``: at most len - 1 tokens (one must be computed)."""
        key = RadixKey(array("q", tokens[: max(len(tokens) - 1, 0)]))
        res = self.cache.match_prefix(MatchPrefixParams(key=key))
        return SimpleNamespace(indices=compat.match_indices(self.cache, res),
                               node=res.last_device_node)

    def admit(self, prompt: List[int], *, register: bool = True):
        """Prefill one request; ``None`` when rows or KV slots run out (nothing leaks)."""
        req = self.prefill_begin(prompt, register=register)
        if req is not None:
            self.prefill_end(req)
        return req

    def prefill_begin(self, prompt: List[int], *, register: bool = True,
                      chunk: Optional[int] = None):
        """Schedule + allocate (``get_new_batch_prefill``), up to the forward.

        ``chunk``: extend only that many tokens now (chunked prefill; see ``admit_chunked``).
        """
        req = self.calls.new_req(prompt)
        self.calls.match_and_lock(req)
        if self.req_pool.alloc([req]) is None:
            self.calls.unlock_unadmitted(req)
            return None
        start = self.calls.extend_start(req)
        end = len(prompt) if chunk is None else min(len(prompt), start + chunk)
        if not self._alloc_extend(req, end, register=register):
            self.calls.unlock_unadmitted(req)
            self.req_pool.free(req)
            return None
        self.live[req.rid] = req
        return req

    def prefill_end(self, req, *, chunked: bool = False) -> None:
        """The forward (KV of the new tokens), then the insert of the prefill so far
        (0.5.17 ``cache_unfinished_req``, 0.5.23 ``checkpoint_kv_cache``)."""
        self.forward_pending(req)
        self.insert_prefilled(req, chunked=chunked)

    def forward_pending(self, req) -> None:
        """The forward of the allocated extend: writes the KV of its tokens."""
        start, out = req.pending
        end = start + len(out)
        self._forward(out, req.origin_input_ids[start:end], start)
        req.pending = None
        req.written_len = end

    def insert_prefilled(self, req, *, chunked: bool = False) -> None:
        """The prefill's (or chunk's) result processing: its KV goes into the tree."""
        self.calls.after_forward(req, req.written_len, chunked=chunked)

    def admit_chunked(self, prompt: List[int], chunk: int, *, promote: bool = False,
                      register: bool = True):
        """Chunked prefill, ``chunk`` tokens per extend: the tree grows root -> chunk 1 ->
        chunk 2 -> ... (``promote``: the plugin's promotions run before every chunk's
        forward). ``None`` when rows or COLD slots run out (the request is aborted)."""
        req = self.prefill_begin(prompt, chunk=chunk, register=register)
        while req is not None:
            if promote:
                self.promote()
            last = req.fill_len is None
            self.prefill_end(req, chunked=not last)
            if last:
                return req
            end = min(len(prompt), req.written_len + chunk)
            if not self._alloc_extend(req, end, register=register):
                self.abort(req)
                return None
        return None

    def decode(self, req, token: int) -> bool:
        """One decode step; on COLD exhaustion the request is retracted (aborted)."""
        pos = req.written_len
        if pos >= self.cfg.max_context:
            return False
        out = self._alloc_cold(1)
        if out is None:
            self.abort(req)
            return False
        self.req_pool.req_to_token[compat.req_pool_idx(req), pos] = out.to(torch.int32)
        self._forward(out, [token], pos)
        req.output_ids.append(token)
        self.calls.decoded(req)
        req.written_len += 1
        return True

    def finish(self, req, *, is_insert: bool = True) -> None:
        """``release_kv_cache``: the tree keeps the KV (``is_insert``), the row is freed."""
        self.calls.release(req, is_insert=is_insert)
        del self.live[req.rid]

    def abort(self, req) -> None:
        self.finish(req, is_insert=False)

    def promote(self) -> int:
        return self.cache.apply_pending_promotions()

    def prefill_next_chunk(self, req: SimReq, chunk: int) -> bool:
        """Chunked prefill, step by step: allocate the next ``chunk`` prompt tokens of a
        request whose previous chunk went through ``prefill_end(chunked=True)``; the caller
        then runs ``prefill_end``. On COLD exhaustion the request is aborted (``False``)."""
        end = min(len(req.origin_input_ids), req.written_len + chunk)
        if self._alloc_extend(req, end, register=True):
            return True
        self.abort(req)
        return False

    def abort_pending(self, req: SimReq) -> None:
        """Abort a request allocated by ``prefill_begin`` / ``prefill_next_chunk`` whose forward
        has not run. SGLang counts the extend as committed when it allocates it
        (``prepare_for_extend`` / ``alloc_for_extend``), so the release without insert frees
        the new slots; nothing unwritten enters the tree."""
        start, out = req.pending
        req.pending = None
        self.calls.commit_pending(req, start + len(out))
        self.abort(req)

    def hot_state(self) -> dict:
        """Every storage decision, in rank-independent terms (no tensors, no node ids): HOT
        extents by path tokens, the promotion queue in order, the table, the counters. Two
        simulated TP ranks fed the same calls must return equal dicts."""
        cache = self.cache
        path = lambda n: tuple(t for m in cache._path(n) for t in m.key.token_ids)  # noqa: E731
        m = cache.metrics.snapshot()
        slot_bytes = 2 * self.cfg.layers * self.cfg.kv_heads * self.cfg.head_dim * self.cfg.dtype.itemsize
        m["bytes_copied"] = m["bytes_copied"] / slot_bytes  # slots copied: per-rank bytes differ
        return {
            "extents": sorted((path(n), tuple(cache.hot_extent_of(n))) for n in cache._hot_start),
            "pending": [path(n) for n in cache._pending],
            "gaps": self.allocator.hot_pool.gaps(),
            "table": (cache.hot_prefix_table.start_np.tolist(),
                      cache.hot_prefix_table.length_np.tolist()),
            "cold_free": self.allocator.available_size(),
            "metrics": m,
        }


    def lock(self, tokens) -> None:
        """A temporary admission lock (``PrefillAdder._lock_node``) with no request row."""
        node = self.match(tokens).node
        self.temp_locks.append(self.calls.temp_lock(node))

    def unlock(self) -> None:
        if self.temp_locks:
            self.calls.temp_unlock(self.temp_locks.pop())

    def evict(self, n: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted

    def drain(self) -> None:
        """Finish everything, drop temp locks, evict the whole tree."""
        while self.temp_locks:
            self.unlock()
        for req in list(self.live.values()):
            self.finish(req)
        self.evict(1 << 30)  # HOT and COLD leaves alike

    # ---- oracle ----------------------------------------------------------------------------

    def expected_kv(self, tokens, start_pos: int) -> torch.Tensor:
        """(layers, 2, n, H, D) oracle KV of ``tokens`` at positions ``start_pos...``."""
        t = torch.tensor(list(tokens), dtype=torch.int64)
        p = torch.arange(start_pos, start_pos + len(t))
        return self.kv_table[:, :, t, p]

    def gather_kv(self, slots: torch.Tensor) -> torch.Tensor:
        s = slots.to(torch.int64)
        k = torch.stack([b[s] for b in self.kv_pool.k_buffer])
        v = torch.stack([b[s] for b in self.kv_pool.v_buffer])
        return torch.stack([k, v], dim=1)

    def request_view(self, req: SimReq) -> torch.Tensor:
        row = self.req_pool.req_to_token[compat.req_pool_idx(req), : req.written_len]
        return self.gather_kv(row)

    def check_views(self) -> None:
        """Every live row, every live ``prefix_indices``, every node and every shadow head
        holds the oracle's KV."""
        for req in self.live.values():
            if req.written_len == 0:
                continue  # between prefill_begin and prefill_end: nothing written yet
            want = self.expected_kv(req.tokens[: req.written_len], 0)
            assert torch.equal(self.request_view(req), want), f"request {req.rid}: KV view differs"
            n = min(len(req.prefix_indices), req.written_len)
            assert torch.equal(self.gather_kv(req.prefix_indices[:n]), want[:, :, :n]), (
                f"request {req.rid}: prefix_indices KV differs")
        stack = [(c, []) for c in self.cache.root_node.children.values()]
        while stack:
            node, above = stack.pop()
            want = self.expected_kv(node.key.token_ids, len(above))
            assert torch.equal(self.gather_kv(node.value), want), f"node {node.id}: KV differs"
            ext = self.cache.hot_extent_of(node)
            if ext is not None and ext.head:
                head = self.gather_kv(torch.arange(ext.start, ext.node_start))
                assert torch.equal(head, self.expected_kv(above[: ext.head], 0)), (
                    f"node {node.id}: shadow head KV differs")
            below = above + list(node.key.token_ids)
            stack += [(c, below) for c in node.children.values()]

    def check(self) -> None:
        self.cache.check_integrity(strict=not self.temp_locks)
        self.check_views()

    def assert_all_free(self) -> None:
        a = self.allocator
        assert a.available_size() == a.size, (a.available_size(), a.size)
        assert a.hot_pool.used_size == 0 and not a.hot_pool.extents()
        assert not self.cache.root_node.children
        assert self.cache.evictable_size_ == 0 and self.cache.protected_size_ == 0
        assert self.cache.root_node.lock_ref == 1
        assert not self.cache.hot_prefix_table.length_np.any()

    # ---- internals -------------------------------------------------------------------------

    def _alloc_extend(self, req, end: int, *, register: bool) -> bool:
        """``alloc_for_extend``: COLD slots for prompt tokens ``[start, end)``; the row gets the
        matched prefix then the new slots; then the plugin registers the request."""
        start = self.calls.extend_start(req)
        out = self._alloc_cold(end - start)
        if out is None:
            return False
        row = self.req_pool.req_to_token[compat.req_pool_idx(req)]
        row[:start] = self.calls.prefix_slots(req, start).to(torch.int32)
        row[start:end] = out.to(torch.int32)
        self.calls.allocated(req, end)
        req.fill_len = end if end < len(req.origin_input_ids) else None
        req.pending = (start, out)
        if register:
            self.cache.update_request_hot_prefix(req)
        return True

    def _alloc_cold(self, n: int) -> Optional[torch.Tensor]:
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        short = n - self.allocator.available_size()
        if short > 0:  # evict_from_tree_cache
            self.evict(short)
        return self.allocator.alloc(n)

    def _forward(self, slots: torch.Tensor, tokens, start_pos: int) -> None:
        """What the model's forward does to the KV pool: write K/V of the new tokens."""
        if len(slots) == 0:
            return
        kv = self.expected_kv(tokens, start_pos)
        for layer in range(self.cfg.layers):
            self.kv_pool.k_buffer[layer][slots] = kv[layer, 0]
            self.kv_pool.v_buffer[layer][slots] = kv[layer, 1]


def overlap_schedule(sim: Sim, prompts: List[List[int]], *, chunk: int, decode_tokens: int,
                     seed: int = 0, check: bool = True) -> dict:
    """Serve ``prompts`` in the overlap scheduler's order (SGLang 0.5.23's default loop):

        step N:  stash the chunked request (its chunk's KV into the tree: checkpoint)
                 form + allocate batch N (next chunk | new prefills | decode of the running)
                 [plugin] register + apply_pending_promotions         (run_batch hook)
                 launch batch N (the sim writes its KV now: stream order)
                 process batch N-1's results: prefilled -> checkpoint, joins the running;
                 done decoding -> release_kv_cache (finish)

    so a request finishing in batch N-1 is still registered and holding its locks while batch N
    is promoted and launched, and a chunk is checkpointed before its batch's results are in.
    ``check``: pools, table, tree and the KV oracle after every launch. Returns counters.
    """
    rng = random.Random(seed)
    waiting = [list(p) for p in prompts]
    running: List[object] = []
    budget: Dict[int, int] = {}
    chunked = None
    last: Optional[tuple] = None  # ("prefill" | "decode", reqs) of batch N-1
    stats = {"steps": 0, "finished": 0, "aborted": 0, "promotions": 0}
    while waiting or running or chunked is not None or last is not None:
        if chunked is not None:  # stash_chunked_request
            sim.insert_prefilled(chunked, chunked=True)
        if chunked is not None:
            req, chunked = chunked, None
            batch = ("prefill", [req]) if sim.prefill_next_chunk(req, chunk) else None
            stats["aborted"] += batch is None
        elif waiting and (not running or rng.random() < 0.5):
            reqs = []
            for _ in range(min(len(waiting), rng.randrange(1, 4))):
                req = sim.prefill_begin(waiting[0], chunk=chunk)
                if req is None:
                    break
                waiting.pop(0)
                budget[req.rid] = decode_tokens
                reqs.append(req)
                if req.fill_len is not None:
                    break  # one chunked request at a time, it ends the batch
            batch = ("prefill", reqs) if reqs else None
        elif running:
            batch = ("decode", list(running))
        else:
            batch = None
        stats["promotions"] += sim.promote()
        if batch is not None:
            kind, reqs = batch
            if kind == "prefill":
                for req in reqs:
                    sim.forward_pending(req)
                chunked = reqs[-1] if reqs[-1].fill_len is not None else None
                batch = (kind, [r for r in reqs if r is not chunked])  # a chunk's result: nothing
            else:
                for req in reqs:
                    if not sim.decode(req, rng.randrange(sim.cfg.vocab)):
                        running.remove(req)
                        budget.pop(req.rid)
                        stats["aborted"] += 1 if req.rid not in sim.live else 0
                        if req.rid in sim.live:
                            sim.finish(req)  # context full: finishes
                            stats["finished"] += 1
                batch = (kind, [r for r in reqs if r.rid in sim.live])
        stats["steps"] += 1
        if check:
            sim.check()
        if last is not None:  # process_batch_result of batch N-1
            kind, reqs = last
            for req in reqs:
                if kind == "prefill" and req.rid in sim.live:
                    sim.insert_prefilled(req)
                    running.append(req)
                elif kind == "decode" and req.rid in sim.live:
                    budget[req.rid] -= 1
                    if budget[req.rid] <= 0:
                        running.remove(req)
                        sim.finish(req)
                        stats["finished"] += 1
        last = batch
        if batch is None and not running and chunked is None and waiting:
            raise RuntimeError("overlap_schedule: no request fits (raise kv_size)")
    return stats
