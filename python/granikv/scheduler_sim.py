"""A CPU scenario driver: real SGLang pools + GraniKV allocator and cache, SGLang's call order.

The KV content is an oracle: the K (V) written for token ``t`` at position ``p`` of layer
``l`` is ``kv_table[l, 0 (1), t, p]`` (random, fixed per seed). Requests that share a prefix
share tokens and positions, so every live request's view through its ``req_to_token`` row,
and every tree node's slots, must equal the table bit for bit, whatever was promoted,
split, compacted or evicted.

Scheduler call sequence mimicked (sglang 0.5.17):
    admit:  match_prefix -> inc_lock_ref -> ReqToTokenPool.alloc -> evict + alloc COLD slots
            -> write req_to_token (prefix + new) -> [plugin] update_request_hot_prefix
            -> forward (KV of the new tokens) -> cache_unfinished_req
    chunked prefill: admit with the extend cut at the first chunk -> forward
            -> cache_unfinished_req(chunked=True) (inserts the prefix so far) -> next chunk:
            alloc -> write req_to_token (prefix_indices + new) -> [plugin] register -> forward
            -> ... -> the last chunk ends with cache_unfinished_req(chunked=False)
    decode: evict + alloc 1 slot -> write req_to_token -> forward
    finish: cache_finished_req(kv_len_to_handle=committed) -> ReqToTokenPool.free
    abort:  cache_finished_req(is_insert=False, ...) -> ReqToTokenPool.free
    promote: [plugin, before run_batch] apply_pending_promotions
"""

import itertools
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

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


class SimReq:
    """The attributes of SGLang's ``Req`` that the pools and RadixCache read and write."""

    _ids = itertools.count()

    def __init__(self, prompt: List[int]):
        self.rid = next(self._ids)
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
        self.fill_len: Optional[int] = None  # chunked prefill: the prompt extended so far
        self.pending = None  # (first position, slots) allocated but not yet forwarded

    def get_fill_ids(self) -> array:
        ids = self.origin_input_ids + self.output_ids
        return ids if self.fill_len is None else ids[: self.fill_len]

    @property
    def tokens(self) -> array:
        return self.get_fill_ids()


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
        shape = (cfg.layers, 2, cfg.vocab, cfg.max_context, cfg.kv_heads, cfg.head_dim)
        self.kv_table = torch.randn(shape, generator=gen).to(cfg.dtype)
        for buf in self.kv_pool.k_buffer + self.kv_pool.v_buffer:  # garbage, never zeros
            buf.copy_(torch.randn(buf.shape, generator=gen).to(cfg.dtype))
        self.live: Dict[int, SimReq] = {}  # rid -> request holding a req_to_token row
        self.temp_locks: list = []

    # ---- scheduler steps -------------------------------------------------------------------

    def match(self, tokens) -> SimpleNamespace:
        """``match_prefix_for_req``: at most len - 1 tokens (one must be computed)."""
        key = RadixKey(array("q", tokens[: max(len(tokens) - 1, 0)]))
        res = self.cache.match_prefix(MatchPrefixParams(key=key))
        return SimpleNamespace(indices=res.device_indices, node=res.last_device_node)

    def admit(self, prompt: List[int], *, register: bool = True) -> Optional[SimReq]:
        """Prefill one request; ``None`` when rows or KV slots run out (nothing leaks)."""
        req = self.prefill_begin(prompt, register=register)
        if req is not None:
            self.prefill_end(req)
        return req

    def prefill_begin(self, prompt: List[int], *, register: bool = True,
                      chunk: Optional[int] = None) -> Optional[SimReq]:
        """Schedule + allocate (``get_new_batch_prefill``), up to the forward.

        ``chunk``: extend only that many tokens now (chunked prefill; see ``admit_chunked``).
        """
        req = SimReq(prompt)
        m = self.match(prompt)
        req.prefix_indices, req.last_node = m.indices, m.node
        req.cache_protected_len = len(m.indices)
        self.cache.inc_lock_ref(req.last_node)
        if self.req_pool.alloc([req]) is None:
            self.cache.dec_lock_ref(req.last_node)
            return None
        end = len(prompt) if chunk is None else min(len(prompt), len(m.indices) + chunk)
        if not self._alloc_extend(req, end, register=register):
            self.cache.dec_lock_ref(req.last_node)
            self.req_pool.free(req)
            return None
        self.live[req.rid] = req
        return req

    def prefill_end(self, req: SimReq, *, chunked: bool = False) -> None:
        """The forward (KV of the new tokens), then ``cache_unfinished_req``."""
        start, out = req.pending
        end = start + len(out)
        self._forward(out, req.origin_input_ids[start:end], start)
        req.pending = None
        req.kv_committed_len = end
        self.cache.cache_unfinished_req(req, chunked=chunked)

    def admit_chunked(self, prompt: List[int], chunk: int, *, promote: bool = False,
                      register: bool = True) -> Optional[SimReq]:
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
            end = min(len(prompt), req.kv_committed_len + chunk)
            if not self._alloc_extend(req, end, register=register):
                self.abort(req)
                return None
        return None

    def decode(self, req: SimReq, token: int) -> bool:
        """One decode step; on COLD exhaustion the request is retracted (aborted)."""
        pos = req.kv_committed_len
        if pos >= self.cfg.max_context:
            return False
        out = self._alloc_cold(1)
        if out is None:
            self.abort(req)
            return False
        self.req_pool.req_to_token[req.req_pool_idx, pos] = out.to(torch.int32)
        req.kv.kv_allocated_len += 1
        self._forward(out, [token], pos)
        req.output_ids.append(token)
        req.kv_committed_len += 1
        return True

    def finish(self, req: SimReq, *, is_insert: bool = True) -> None:
        """``release_kv_cache``: cache_finished_req, then the req_to_token row."""
        self.cache.cache_finished_req(req, is_insert, kv_len_to_handle=req.kv_committed_len)
        self.req_pool.free(req)
        req.kv = None
        del self.live[req.rid]

    def abort(self, req: SimReq) -> None:
        self.finish(req, is_insert=False)

    def promote(self) -> int:
        return self.cache.apply_pending_promotions()

    def prefill_next_chunk(self, req: SimReq, chunk: int) -> bool:
        """Chunked prefill, step by step: allocate the next ``chunk`` prompt tokens of a
        request whose previous chunk went through ``prefill_end(chunked=True)``; the caller
        then runs ``prefill_end``. On COLD exhaustion the request is aborted (``False``)."""
        end = min(len(req.origin_input_ids), req.kv_committed_len + chunk)
        if self._alloc_extend(req, end, register=True):
            return True
        self.abort(req)
        return False

    def abort_pending(self, req: SimReq) -> None:
        """Abort a request allocated by ``prefill_begin`` / ``prefill_next_chunk`` whose forward
        has not run. SGLang counts the extend as committed when it allocates it
        (``prepare_for_extend``), so ``cache_finished_req(is_insert=False)`` frees the new
        slots; nothing unwritten enters the tree."""
        start, out = req.pending
        req.pending = None
        req.kv_committed_len = start + len(out)
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
        self.cache.inc_lock_ref(node)
        self.temp_locks.append(node)

    def unlock(self) -> None:
        if self.temp_locks:
            self.cache.dec_lock_ref(self.temp_locks.pop())

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
        row = self.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len]
        return self.gather_kv(row)

    def check_views(self) -> None:
        """Every live row, every live ``prefix_indices``, every node and every shadow head
        holds the oracle's KV."""
        for req in self.live.values():
            if req.kv_committed_len == 0:
                continue  # between prefill_begin and prefill_end: nothing written yet
            want = self.expected_kv(req.tokens[: req.kv_committed_len], 0)
            assert torch.equal(self.request_view(req), want), f"request {req.rid}: KV view differs"
            n = min(len(req.prefix_indices), req.kv_committed_len)
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

    def _alloc_extend(self, req: SimReq, end: int, *, register: bool) -> bool:
        """``alloc_for_extend``: COLD slots for prompt tokens ``[protected, end)``; the row gets
        ``prefix_indices`` then the new slots; then the plugin registers the request."""
        start = req.cache_protected_len
        out = self._alloc_cold(end - start)
        if out is None:
            return False
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:start] = req.prefix_indices[:start].to(torch.int32)
        row[start:end] = out.to(torch.int32)
        req.kv = SimpleNamespace(kv_allocated_len=end)
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
