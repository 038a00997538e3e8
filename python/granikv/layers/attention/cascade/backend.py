"""``GraniKVAttnBackend``: wraps the attention backend SGLang built (flashinfer, triton, ...).

Idle batches, and extend batches without a HOT prefix, go to the wrapped backend untouched
(extend batches over HOT prefixes: below). For a decode batch, the plan
(``plan.group_requests`` + ``dispatcher.Dispatcher``) picks a path once per step, on the host:

- ``paged``: the wrapped backend with the batch's real metadata; GraniKV adds no device work
  (eager steps run no GraniKV kernel; graph steps replay the stock graph, see below).
- ``cascade`` / ``fused`` / ``bgemm``: the wrapped backend still runs (it writes the step's K/V
  into the pool exactly as stock SGLang does) but plans every request with ``seq_len = 1``, so
  its attention costs next to nothing; GraniKV's kernels then compute every request's
  attention (HOT prefix once per group + COLD suffix + LSE merge) and overwrite the wrapped
  backend's output rows in place.

CUDA graphs (``graph_variants``): every captured batch size has the stock graph (the wrapped
backend alone) and, where the cost model says cascade can win at that size, a cascade graph
(``wrapped decode with seq_len = 1 -> cascade kernels``). The plan, made in
``init_forward_metadata_out_graph`` before the replay, picks the graph: paged steps replay the
stock graph (exactly the stock work), cascade steps the cascade graph. All plan-dependent data
lives in the fixed-capacity ``CascadeWorkspace`` and the wrapped backend's per-size metadata
buffers, shared by both graphs of a size and refilled before every replay. Fused and bgemm run
on eager steps only.

Extend batches with a cached prefix (``extend_plan`` / ``hot_extend``): when some cached prefix
in the batch starts with a HOT run and the wrapped backend is flashinfer (ragged + paged
prefill), the paged prefill wrapper in the batch's metadata is replaced by a
``PrefixPartProxy``: the prefix part runs as one dense call per HOT extent, plus one paged call
for the COLD remainder; SGLang's code does the rest of the extend. Under other backends
(triton: one kernel per row, no LSE), ``full_extend`` computes the batch's whole extend.

The per-step host input is staged by the scheduler hook (``stage_batch``: the batch's
``req_pool_idx`` values, known on the host without a device sync); HOT runs come from the
``HotPrefixTable`` numpy mirror.
"""

import copy
import logging
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from granikv.config import parse_graph_bs
from granikv.layers.attention.cascade.dispatcher import Path, SteadyChooser
from granikv.layers.attention.cascade.extend_plan import plan_extend
from granikv.layers.attention.cascade.graph_variants import AUTO_PREFIX_TOKENS, GraphVariants, cascade_can_win
from granikv.layers.attention.cascade.full_extend import FullExtend, backend_reason, graph_reason
from granikv.layers.attention.cascade.hot_extend import (
    FlashInferDense,
    HotExtendAttention,
    PrefixPartProxy,
    TorchDense,
)
from granikv.layers.attention.cascade import extend_workspace, planted_fault
from granikv.layers.attention.cascade.plan import (
    BatchDescription,
    GroupingMemo,
    verify_same_slots,
)
from granikv.layers.attention.cascade.step_stats import StepStats
from granikv.layers.attention.cascade.support import (
    build_dispatcher,
    call_reason,
    layer_ranges,
    layer_reason,
    scan_layers,
    unsupported_reason,
)

logger = logging.getLogger("granikv")
_UNSEEN = object()

try:  # SGLang is the host; GraniKV's kernels and planner do not need it.
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover
    AttentionBackend = object


class GraniKVAttnBackend(AttentionBackend):
    """Decode through the shared-prefix kernels when the plan says so; everything else as-is."""

    @classmethod
    def wrap(cls, inner, *, model_runner, cfg, backend_name: str):
        """Wraps ``inner``, or returns it unchanged (with a log line) when GraniKV cannot serve."""
        reason = unsupported_reason(model_runner, cfg)
        if reason is not None:
            logger.warning("GraniKV attention off (%s): decode uses the stock %s backend",
                           reason, backend_name)
            return inner
        return cls(inner, model_runner=model_runner, cfg=cfg, backend_name=backend_name)

    def __init__(self, inner, *, model_runner, cfg, backend_name: str):
        self.inner = inner
        self.cfg = cfg
        self.backend_name = backend_name
        self.model_runner = model_runner
        self.dispatcher = build_dispatcher(model_runner, cfg, backend_name)
        self._chooser = SteadyChooser(self.dispatcher)  # steady steps: O(1) path choice
        geo = self.dispatcher.geometry
        self._layer_reasons = self._scan_layers(model_runner, geo)  # layer_id -> why it runs stock
        self._layer_memo = {}  # id(layer) -> its layer_reason (None: served)
        self.num_q_heads, self.head_dim = geo.num_q_heads, geo.head_dim
        self.device = torch.device(model_runner.device)
        self.workspace = None  # CascadeWorkspace (the graph one once graphs exist)
        self._eager_workspace = None  # eager steps larger than the graph workspace
        self._ws = None  # the workspace of the current step
        self.stats = StepStats()
        self._grouping_memo = GroupingMemo()  # steady decode steps reuse the grouping
        self._staged: Optional[np.ndarray] = None
        self._stage_seconds = 0.0
        self._last_rows = None  # (rows array, table version, hot_start, hot_len, grouping) of the last plan
        self._path = Path.PAGED  # path of the current step
        self._graph_mode = False  # True once CUDA-graph state exists
        self.graphs = GraphVariants(parse_graph_bs(cfg.cascade_graph_bs), can_win=self._cascade_can_win)
        self._capture_metadata = {}  # bs -> the wrapped backend's forward_metadata of its stock capture
        self._ones = None
        self._ones_views = {}  # (bs, dtypes) -> (device, host) seq_lens of ones
        self._filled_grouping = self._filled_ws = None  # grouping and workspace of the last fill
        self._hot_extend = None  # HotExtendAttention, created on the first eligible extend batch
        self._full_extend = None  # FullExtend around it (wrapped backends without ragged + paged)
        self._full_compare = False  # debug compare due on this batch's layer 0 (full extend)
        self._logged_layer_reasons = set()
        # set when the dense prefill path has no workspace or failed: stock from then on
        self._extend_off_reason = self._extend_workspace_reason()
        if self._extend_off_reason is not None and cfg.extend_path != "paged":
            logger.warning("GraniKV: prefill over HOT prefixes is off under %s (%s)", backend_name,
                           self._extend_off_reason)
        self._stock_prefill_wrappers = None  # the batch's wrappers the proxies stand in for
        self._fault = planted_fault.from_env()  # debug only: NO_FAULT unless GRANIKV_DEBUG_FAULT

    def _scan_layers(self, model_runner, geo) -> dict:
        """Per-layer eligibility (support.layer_reason) of the loaded model's attention layers,
        logged once per reason. Any ineligible layer keeps decode stock (the wrapped backend is
        planned once per step for every layer, so one layer cannot opt out of the ``seq_len =
        1`` plan); extend batches fall back layer by layer."""
        reasons = scan_layers(getattr(model_runner, "model", None), num_q_heads=geo.num_q_heads,
                              head_dim=geo.head_dim)
        by_reason = {}
        for layer_id, reason in sorted(reasons.items()):
            by_reason.setdefault(reason, []).append(layer_id)
        for reason, ids in by_reason.items():
            logger.warning("GraniKV: attention layers %s run the stock %s backend (%s); decode "
                           "stays stock for the whole model", layer_ranges(ids), self.backend_name, reason)
        if reasons:
            self._force_paged_decode()
        return reasons

    def _force_paged_decode(self) -> None:
        """Every later decode step runs the wrapped backend alone."""
        self.dispatcher = build_dispatcher(self.model_runner, self.cfg, self.backend_name, forced_path="paged")
        self._chooser = SteadyChooser(self.dispatcher)

    def _layer_reason(self, layer, k, v, kwargs):
        """Why this call runs the wrapped backend's attention (None: GraniKV serves it): the
        scan's verdict, else ``layer_reason`` of this layer object (checked once per object),
        else the call's own arguments."""
        reason = self._layer_memo.get(id(layer), _UNSEEN)
        if reason is _UNSEEN:
            geo = self.dispatcher.geometry
            reason = self._layer_reasons.get(layer.layer_id) or layer_reason(
                layer, num_q_heads=geo.num_q_heads, head_dim=geo.head_dim)
            self._layer_memo[id(layer)] = reason
        return reason or call_reason(k, v, kwargs)

    def __getattr__(self, name):
        # Only called for attributes not found normally: delegate to the wrapped backend.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def forward_metadata(self):
        return self.inner.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value):  # SGLang resets it on idle batches
        self.inner.forward_metadata = value

    # ---- shared state ------------------------------------------------------------------

    @property
    def hot_prefix_table(self):
        return self.model_runner.token_to_kv_pool_allocator.hot_prefix_table

    def stats_snapshot(self) -> dict:
        """``StepStats.snapshot()`` plus how often steady steps reused the previous plan."""
        out = self.stats.snapshot()
        wss = [w for w in (self.workspace, self._eager_workspace) if w is not None]
        out["work_list_builds"] = sum(w.fills_built for w in wss)
        out["work_list_reuses"] = sum(w.fills_reused for w in wss)
        out["grouping_reuses"] = self._grouping_memo.hits
        out["choice_reuses"] = self._chooser.hits
        out["upload_wait_us_total"] = 1e6 * sum(w.upload_wait_seconds for w in wss)
        return out

    def stage_batch(self, req_pool_indices: np.ndarray, *, seconds: float = 0.0) -> None:
        """The next decode or extend batch's ``req_pool_idx`` per request, in batch order
        (host ints); ``seconds``: the host time the caller spent building it (counted in the
        step's planning time)."""
        self._staged = req_pool_indices
        self._stage_seconds = seconds

    def _cascade_can_win(self, bs: int) -> bool:
        context = getattr(self.model_runner.model_config, "context_len", None) or AUTO_PREFIX_TOKENS
        return cascade_can_win(self.dispatcher, bs, prefix_tokens=min(context, AUTO_PREFIX_TOKENS),
                               min_group_size=self.cfg.min_group_size)

    def _new_workspace(self, max_bs: int):
        from granikv.kernels.work_list import CascadeWorkspace

        geo = self.dispatcher.geometry
        return CascadeWorkspace(max_bs, geo.num_q_heads, geo.num_kv_heads, geo.head_dim,
                                self.device)

    def _workspace_for(self, bs: int):
        """The workspace a step of ``bs`` requests uses.

        The graph workspace (sized at ``init_cuda_graph_state``) is never reallocated: captured
        graphs read its buffers. Eager steps larger than it (more running requests than the
        largest captured graph) get a separate eager workspace, grown on demand.
        """
        if self._graph_mode and bs <= self.workspace.max_bs:
            return self.workspace
        attr = "_eager_workspace" if self._graph_mode else "workspace"
        ws = getattr(self, attr)
        if ws is None or ws.max_bs < bs:
            ws = self._new_workspace(max(bs, 2 * ws.max_bs if ws is not None else bs))
            setattr(self, attr, ws)
        if self._ones is None or self._ones.numel() < bs:
            self._ones = torch.ones(ws.max_bs, dtype=torch.int64, device=self.device)
            self._ones_views = {}
        return ws

    # ---- planning (host side, once per step) -----------------------------------------

    def _plan_decode(self, fb, *, graph: bool):
        """A decode step's host work: plan, fill the workspace; returns the batch the wrapped
        backend plans with (``fb`` itself for paged steps, else the ``seq_len = 1`` view).
        ``graph``: the step replays a graph of ``fb.batch_size`` (paged, or cascade where that
        size has a cascade graph). The time of both parts is recorded, with the staging time
        the scheduler hook measured for this step."""
        t0 = time.perf_counter()
        plan = self._plan(fb, graph=graph)
        t1 = time.perf_counter()
        self._path = Path.PAGED if plan is None else plan[2].path  # graph steps: paged or cascade
        if plan is not None:
            self._fill_workspace(plan, fb)
        self.graphs.planned_cascade = graph and plan is not None
        view = fb if plan is None else self._inner_view(fb)
        t2 = time.perf_counter()
        stage, self._stage_seconds = self._stage_seconds, 0.0
        self.stats.record_plan_time(t2 - t0 + stage, choose=t1 - t0, fill=t2 - t1, stage=stage)
        return view

    def _plan(self, fb, graph: bool):
        """Returns (grouping, desc, decision) or None for the paged path (decode batches only)."""
        staged, self._staged = self._staged, None
        bs = fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)
        if staged is None or len(staged) != bs or fb.seq_lens_cpu is None:
            self.stats.unplanned += 1
            return None
        if graph and not self.graphs.has_cascade_graph(fb.batch_size):
            self.stats.record_paged(bs, "no cascade graph of this batch size")
            return None
        table = self.hot_prefix_table
        version = getattr(table, "version", None)
        last = self._last_rows
        if last is not None and last[0] is staged and last[1] == version and version is not None:
            hot_start, hot_len, grouping = last[2:]  # same rows, same table: same HOT runs
        else:
            hot_len = table.length_np[staged]
            hot_start = table.start_np[staged] if hot_len.any() else None
            grouping = None
            self._last_rows = (staged, version, hot_start, hot_len, None)
        if hot_start is None:  # no request starts with a HOT run: nothing to group
            self.stats.record_paged(bs, "no HOT prefix in the batch")
            return None
        seq_lens = np.asarray(fb.seq_lens_cpu.numpy()[:bs], dtype=np.int64)
        desc = BatchDescription(staged, seq_lens, hot_start, hot_len)
        if grouping is None:
            grouping = self._grouping_memo.group(desc, min_group_size=self.cfg.min_group_size)
            if (hot_len <= seq_lens).all():  # then the grouping does not depend on seq_lens
                self._last_rows = self._last_rows[:4] + (grouping,)
        else:
            self._grouping_memo.hits += 1
        if grouping.num_groups == 0:
            self.stats.record_paged(bs, "no group")
            return None
        if self.cfg.debug_integrity and grouping.num_groups and not verify_same_slots(
            grouping, desc, self.model_runner.req_to_token_pool.req_to_token
        ):
            logger.error("GraniKV: grouped requests do not all hold their group's HOT slots "
                         "(stale HotPrefixTable); this step runs paged")
            self.stats.unplanned += 1
            return None
        decision = self._chooser.choose(grouping, desc, graph_safe_only=graph)
        self.stats.record(decision, grouping)
        if decision.path is Path.PAGED:
            return None
        return grouping, desc, decision

    def _fill_workspace(self, plan, fb) -> None:
        ws = self._ws = self._workspace_for(fb.batch_size)
        grouping, desc, decision = plan
        padded = fb.batch_size
        prefix_len, seq_lens, rpi = _pad(grouping.prefix_len, desc.seq_lens,
                                         desc.req_pool_indices, padded)
        same = grouping is self._filled_grouping and ws is self._filled_ws
        ws.fill(grouping.group_start, self._fault.group_len(grouping.group_len), grouping.group_req_indptr,
                grouping.group_req_idx, prefix_len, seq_lens, rpi,
                single_prefix_chunk=decision.path is Path.BGEMM, same_grouping=same)
        self._filled_grouping, self._filled_ws = grouping, ws  # held: `is` stays meaningful

    def _inner_view(self, fb):
        """``fb`` with every ``seq_len = 1``: the wrapped backend still writes K/V, reads 1 token."""
        bs = fb.batch_size
        # SGLang's replay view is a SimpleNamespace (a plain attribute copy is the cheap copy);
        # an eager step's ForwardBatch is a dataclass
        view = SimpleNamespace(**vars(fb)) if type(fb) is SimpleNamespace else copy.copy(fb)
        key = (bs, fb.seq_lens.dtype, fb.seq_lens_cpu.dtype)
        ones = self._ones_views.get(key)
        if ones is None:  # per batch size, made once (read-only for the wrapped backend)
            ones = self._ones_views[key] = (self._ones[:bs].to(fb.seq_lens.dtype),
                                            torch.ones(bs, dtype=fb.seq_lens_cpu.dtype))
        view.seq_lens, view.seq_lens_cpu = ones
        view.seq_lens_sum = bs
        return view

    # ---- AttentionBackend metadata contract ---------------------------------------------

    def init_forward_metadata(self, forward_batch):
        if not forward_batch.forward_mode.is_decode():  # extend / prefill: the wrapped backend
            staged, self._staged, self._path = self._staged, None, Path.PAGED
            self.inner.init_forward_metadata(forward_batch)
            self._plan_extend(forward_batch, staged)
            return
        self.inner.init_forward_metadata(self._plan_decode(forward_batch, graph=False))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self.graphs.planned_cascade = False
        if not (self._graph_mode and forward_batch.forward_mode.is_decode()):
            self._path = Path.PAGED
            return self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if in_capture:
            return self._capture_metadata_for(forward_batch)
        view = self._plan_decode(forward_batch, graph=True)
        self.inner.init_forward_metadata_out_graph(view)

    def _capture_metadata_for(self, fb) -> None:
        """Metadata of a decode graph capture. The stock graph of a size (``graphs.capturing``
        is not this size): the wrapped backend alone, as stock SGLang captures it. The cascade
        graph of a size (captured right after its stock graph): GraniKV's kernels over an empty
        work list (they read the live counts at replay), and the wrapped backend with ``seq_len =
        1`` through the buffers of the stock capture, refilled as a replay refills them (a
        second ``in_capture`` would make the wrapped backend allocate new per-size buffers, and
        the stock graph would then read stale ones)."""
        bs = fb.batch_size
        if self.graphs.capturing != bs:
            self._path = Path.PAGED
            self.inner.init_forward_metadata_out_graph(fb, in_capture=True)
            self._capture_metadata[bs] = getattr(self.inner, "forward_metadata", None)
            return
        self._path = Path.CASCADE
        self._ws = self._workspace_for(bs)
        self._ws.fill_empty()
        view = self._inner_view(fb)
        if bs in self._capture_metadata:
            self.inner.init_forward_metadata_out_graph(view)
            self.inner.forward_metadata = self._capture_metadata[bs]
        else:  # no stock capture of this size before (not SGLang's order): a fresh one
            self.inner.init_forward_metadata_out_graph(view, in_capture=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.inner.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        self.graphs.captured.clear()
        self._capture_metadata.clear()
        self._graph_mode = False
        self.workspace = None
        self._workspace_for(max_bs)
        self._graph_mode = True

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        return self.inner.on_after_cuda_graph_warmup()

    # ---- extend (prefill) over HOT prefixes ------------------------------------------------

    def _plan_extend(self, fb, staged) -> None:
        """After the wrapped backend planned an extend batch: if its prefix part can run over
        HOT extents, swap the batch's paged prefill wrappers for proxies (flashinfer, see
        ``hot_extend``) or plan the whole extend here (other backends, see ``full_extend``)."""
        if self._hot_extend is not None:
            self._hot_extend.end()
        if self._full_extend is not None:
            self._full_extend.end()
        self._full_compare = False
        if self.cfg.extend_path == "paged" or getattr(fb.forward_mode, "name", "") != "EXTEND":
            return
        md = getattr(self.inner, "forward_metadata", None)
        full = not hasattr(md, "prefill_wrappers")  # not flashinfer: GraniKV computes the whole extend
        unservable = backend_reason(self.inner, self.model_runner.token_to_kv_pool) if full else None
        if self._extend_off_reason is not None:
            reason = self._extend_off_reason
        elif full and getattr(fb, "extend_prefix_lens_cpu", None) is None:
            reason = "no host-side prefix lengths in the batch"
        elif full and not any(fb.extend_prefix_lens_cpu):
            return  # no cached prefix anywhere: the stock extend has nothing to share
        elif unservable is not None:
            reason = unservable
        elif not full and not getattr(md, "use_ragged", False):
            reason = "flashinfer prefill without its ragged call"
        elif not full and getattr(md, "extend_no_prefix", True):
            return  # no cached prefix anywhere: the stock ragged call is the whole attention
        elif not full and (getattr(self.inner, "prefill_uses_dequant_workspace", False) or (
                getattr(md, "multi_item_params", None) is not None and md.multi_item_params.is_enabled())):
            reason = "dequantising or multi-item prefill"
        elif staged is None or len(staged) != fb.batch_size:
            reason = "batch not staged"
        else:
            table = self.hot_prefix_table
            prefix_lens = np.asarray(fb.extend_prefix_lens_cpu, dtype=np.int64)
            extend_lens = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
            plan, reason = plan_extend(staged, prefix_lens, extend_lens, table.start_np, table.length_np)
            if plan is not None and self.cfg.extend_path == "auto" and not self._hot_extend_pays(
                    plan, prefix_lens, extend_lens):
                plan, reason = None, "the cost model puts the stock prefill first for this shape"
            if plan is not None:
                self.stats.record_extend(plan, "")
                attn = self._extend_attention()
                attn.begin(plan, self.model_runner.req_to_token_pool.req_to_token)
                if self.cfg.debug_integrity:
                    attn.check_integrity()
                if full:
                    self._full_extend.begin()
                    if self.cfg.debug_integrity:
                        self._full_extend.check_integrity()
                    self._full_compare = self._extend_compare_due()
                    return
                compare = self._extend_compare_callback(plan) if self._extend_compare_due() else None
                self._stock_prefill_wrappers = md.prefill_wrappers  # for layers GraniKV does not serve
                md.prefill_wrappers = [PrefixPartProxy(attn, w, on_compare=compare, on_failure=self._extend_failed)
                                       for w in md.prefill_wrappers]  # a new list: SGLang's stays
                return
        self.stats.record_extend(None, reason)

    def _hot_extend_pays(self, plan, prefix_lens: np.ndarray, extend_lens: np.ndarray) -> bool:
        """The extend gate: True iff ``ExtendTerms`` puts the prefix part over HOT extents (one
        dense call per group, plus the COLD remainder's paged call and a merge) below the stock
        paged call for this batch's shape. Runs under ``--granikv-extend-path auto``;
        other than auto) is not gated here: ``--granikv-extend-path auto`` only."""
        terms = self.dispatcher.cost_model.served.extend
        per_pair = self.dispatcher.geometry.flops_per_query_token
        flops_all = per_pair * float(np.dot(prefix_lens, extend_lens))
        flops_hot = per_pair * float(sum(g.length * g.num_tokens for g in plan.groups))
        rem = plan.paged
        flops_cold = None if rem is None else per_pair * float(np.dot(rem.hi - rem.lo, rem.qo_lens))
        return terms.hot_us(len(plan.groups), flops_hot, flops_cold) < terms.stock_us(flops_all)

    def _extend_failed(self, exc: Exception) -> None:
        """The dense prefill path raised: this call and the rest of the batch are served by the
        stock wrapper; every later extend batch stays stock (logged once; the failed batch counts
        as HOT and as a fallback)."""
        self._hot_extend.end()  # the batch's remaining layers: stock (the proxy sees no plan)
        if self._extend_off_reason is None:
            self._extend_off_reason = f"dense prefill path off after an error ({type(exc).__name__})"
            logger.error("GraniKV: the prefill path over HOT prefixes failed (%r); extend batches use "
                         "the stock prefill from now on (--granikv-extend-path paged silences this)",
                         exc)
        self.stats.extend_fallbacks[self._extend_off_reason] += 1

    def _extend_attention(self):
        if self._hot_extend is None:
            if self.device.type == "cuda":
                # the flashinfer backend's float workspace (calls are stream-ordered); other
                # backends have none: the one reserved at startup (extend_workspace)
                runner = FlashInferDense(self._extend_workspace_buffer())
            else:
                runner = TorchDense()  # CPU (tests): the float32 reference
            self._hot_extend = HotExtendAttention(runner, self.device)
        if self._full_extend is None or self._full_extend.attn is not self._hot_extend:
            self._full_extend = FullExtend(self._hot_extend)
        return self._hot_extend

    def _extend_workspace_buffer(self):
        buf = getattr(self.inner, "workspace_buffer", None)
        if buf is not None:
            return buf
        reservation = extend_workspace.reservation_of(self.model_runner)
        return reservation.buffer

    def _extend_workspace_reason(self):
        """Why the HOT prefill path has no FlashInfer workspace (None: it has one, or runs on
        CPU). Checked at construction: no workspace is ever allocated mid-serving."""
        if self.device.type != "cuda" or getattr(self.inner, "workspace_buffer", None) is not None:
            return None
        reservation = extend_workspace.reservation_of(self.model_runner)
        if reservation is None:
            return "no FlashInfer workspace reserved at startup"
        return reservation.off_reason

    def _extend_compare_due(self) -> bool:
        """Debug compare mode: every N-th HOT extend batch (the one just recorded)."""
        n = self.cfg.debug_compare_every
        return bool(n) and (self.stats.extend_hot_batches - 1) % n == 0

    def _extend_compare_callback(self, plan):
        """Debug compare mode: layer 0's dense prefix part against the stock paged one (same
        batch, same KV), logged and kept in the stats."""

        def compare(ours, stock):
            parts = [g.token_idx for g in plan.groups] + ([plan.paged.token_idx] if plan.paged else [])
            rows = torch.from_numpy(np.unique(np.concatenate(parts))).to(ours[0].device)
            d_o = (ours[0].index_select(0, rows).float() - stock[0].index_select(0, rows).float()).abs().max()
            d_l = (ours[1].index_select(0, rows) - stock[1].index_select(0, rows)).abs().max()
            diff = max(float(d_o), float(d_l))
            self.stats.max_extend_compare_diff = max(self.stats.max_extend_compare_diff, diff)
            logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens, %d groups): max |diff| "
                        "vs paged prefill: o %.3e, lse %.3e", self.stats.extend_hot_batches,
                        plan.hot_tokens, len(plan.groups), float(d_o), float(d_l))
        return compare

    # ---- compute --------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        full = self._full_extend
        if full is not None and full.active:  # planned for a backend without ragged + paged calls
            reason = self._layer_reason(layer, k, v, kwargs) or graph_reason()
            if reason is None:
                try:
                    o = full.forward(q, k, v, layer, forward_batch, self.model_runner.token_to_kv_pool,
                                     save_kv_cache)
                except Exception as e:  # noqa: BLE001 - serve the stock way, never fail the forward
                    self._extend_failed(e)
                else:
                    if self._full_compare and layer.layer_id == 0:
                        self._full_compare = False
                        self._compare_full_extend(o, q, k, v, layer, forward_batch, kwargs)
                    return o
            elif reason not in self._logged_layer_reasons:
                self._logged_layer_reasons.add(reason)
                logger.info("GraniKV: extend of layer %d goes to the %s backend (%s)", layer.layer_id,
                            self.backend_name, reason)
        elif self._hot_extend is not None and self._hot_extend.plan is not None:  # flashinfer proxies
            reason = self._layer_reason(layer, k, v, kwargs)
            if reason is not None:
                return self._stock_extend_layer(q, k, v, layer, forward_batch, save_kv_cache, kwargs, reason)
        return self.inner.forward_extend(q, k, v, layer, forward_batch,
                                         save_kv_cache=save_kv_cache, **kwargs)

    def _stock_extend_layer(self, q, k, v, layer, fb, save_kv_cache, kwargs, reason):
        """One layer of a proxied (flashinfer) extend batch, computed wholly by the wrapped backend:
        its stock paged prefill wrappers are put back for the call."""
        if reason not in self._logged_layer_reasons:
            self._logged_layer_reasons.add(reason)
            logger.info("GraniKV: extend of layer %d goes to the %s backend (%s)", layer.layer_id,
                        self.backend_name, reason)
        md = self.inner.forward_metadata
        proxies, md.prefill_wrappers = md.prefill_wrappers, self._stock_prefill_wrappers
        try:
            return self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=save_kv_cache, **kwargs)
        finally:
            md.prefill_wrappers = proxies

    def _compare_full_extend(self, ours, q, k, v, layer, fb, kwargs) -> None:
        """Debug compare mode: layer 0's extend output against the wrapped backend's (it reads the
        K/V just written, and writes nothing)."""
        stock = self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=False, **kwargs)
        diff = float((ours.float() - stock.float()).abs().max())
        scale = float(stock.float().abs().max())  # dummy weights give tiny outputs: say how tiny
        self.stats.max_extend_compare_diff = max(self.stats.max_extend_compare_diff, diff)
        logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens): max |diff| vs the %s "
                    "backend's extend: o %.3e (max |o| %.3e)", self.stats.extend_hot_batches,
                    self._hot_extend.plan.hot_tokens, self.backend_name, diff, scale)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        o = self.inner.forward_decode(q, k, v, layer, forward_batch,
                                      save_kv_cache=save_kv_cache, **kwargs)
        if self._path is not Path.PAGED:  # paged: the stock work only
            self._unscanned_decode_feature(layer, self._layer_reason(layer, k, v, kwargs))
            self._run_shared_prefix(q, layer, o)
            if self._compare_due(layer):
                self._compare_with_reference(q, layer, forward_batch, o)
        return o

    def _unscanned_decode_feature(self, layer, reason) -> None:
        """A decode call carries a feature the wrap-time scan did not see (an argument only
        the call shows, or a layer outside the scanned model). This step's wrapped backend was planned with ``seq_len = 1``: the
        output cannot be repaired here, so decode stays stock from the next step on (error
        logged once)."""
        if reason is None:
            return
        logger.error("GraniKV: decode of layer %d carries %s, which the layer scan did not "
                     "find; decode attention is stock from the next step on", layer.layer_id, reason)
        self._layer_reasons.setdefault(layer.layer_id, reason)
        self._force_paged_decode()

    def reads_req_to_token_during_replay(self) -> bool:
        """Whether this step's decode-graph replay runs GraniKV's kernels, which read
        ``req_to_token`` during the replay (so SGLang's pre-replay read-done event is too early:
        war_barrier.py): the step planned its size's cascade graph. Stock graphs read it only
        in the pre-replay metadata copy."""
        return self._graph_mode and self.graphs.planned_cascade

    def _compare_due(self, layer) -> bool:
        n = self.cfg.debug_compare_every
        capturing = torch.cuda.is_current_stream_capturing() if torch.cuda.is_available() else False
        return bool(n) and layer.layer_id == 0 and not capturing and self.stats.steps % n == 0

    def _compare_with_reference(self, q, layer, fb, o) -> None:
        """Debug: the chosen path against the float64 torch reference of paged attention on
        layer 0. Python runs ``forward_decode`` only on eager steps: with CUDA graphs on, only
        steps that do not replay a graph are compared."""
        from granikv.kernels.reference import decode_attention_ref

        pool = self.model_runner.token_to_kv_pool
        bs = fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)
        ref = decode_attention_ref(q.view(-1, self.num_q_heads, self.head_dim)[:bs],
                                   pool.get_key_buffer(layer.layer_id),
                                   pool.get_value_buffer(layer.layer_id),
                                   self.model_runner.req_to_token_pool.req_to_token,
                                   fb.req_pool_indices[:bs], fb.seq_lens[:bs], layer.scaling)
        diff = (o.view(-1, self.num_q_heads, self.head_dim)[:bs].double() - ref.o).abs().max()
        self.stats.max_compare_diff = max(self.stats.max_compare_diff, float(diff))
        logger.info("GraniKV debug compare (step %d, %s, bs %d): max |diff| vs paged = %.3e",
                    self.stats.steps, self._path.value, bs, float(diff))

    def _run_shared_prefix(self, q, layer, o):
        from granikv.kernels import cascade as kernels

        pool = self.model_runner.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q3 = q.view(-1, self.num_q_heads, self.head_dim)
        out = o.view(-1, self.num_q_heads, self.head_dim)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        run = {Path.FUSED: kernels.fused_cascade_attention,
               Path.BGEMM: kernels.bgemm_cascade_attention}.get(self._path,
                                                                kernels.cascade_attention)
        run(q3, k_buf, v_buf, req_to_token, self._ws, sm_scale=layer.scaling, out=out)


# ``forward`` dispatches to this class's forward_decode / forward_extend: never forwarded.
_NOT_FORWARDED = ("forward", "_abc_impl")


def forwarded_base_names(cls) -> list:
    """What ``_forward_base_methods`` forwards: every name SGLang's ``AttentionBackend``
    defines itself that ``cls`` does not (the base's own namespace, not a hand list)."""
    return [n for n in vars(AttentionBackend)
            if not n.startswith("__") and n not in cls.__dict__ and n not in _NOT_FORWARDED]


def _forward_base_methods(cls) -> None:
    """Everything defined on SGLang's ``AttentionBackend`` (methods, properties, class-level
    flags such as triton's ``supports_prefill_cuda_graph_max_context_size``, breakable prefill
    CUDA graphs, chunked-prefix MHA, verify buffers, ...) would shadow ``__getattr__`` with
    the base's default: each one this class does not define reads from the wrapped backend
    (methods are called on it; flags and properties are read from and written to it). The
    names come from the base class itself, so a release's additions are forwarded as they come.
    """
    if AttentionBackend is object:  # pragma: no cover
        return
    cls.forwarded_base_names = tuple(forwarded_base_names(cls))
    for name in cls.forwarded_base_names:
        attr = vars(AttentionBackend)[name]
        if isinstance(attr, property):
            setattr(cls, name, property(lambda self, n=name: getattr(self.inner, n),
                                        lambda self, v, n=name: setattr(self.inner, n, v)))
        elif not callable(attr):  # a class-level flag: the base's default if the inner lacks it
            setattr(cls, name, property(lambda self, n=name, d=attr: getattr(self.inner, n, d),
                                        lambda self, v, n=name: setattr(self.inner, n, v)))
        else:
            setattr(cls, name, lambda self, *a, n=name, **kw: getattr(self.inner, n)(*a, **kw))


_forward_base_methods(GraniKVAttnBackend)

def _pad(prefix_len, seq_lens, req_pool_indices, padded: int):
    """Extends the per-request arrays to the padded graph batch (padding rows: row 0, len 1)."""
    bs = len(seq_lens)
    if padded == bs:
        return prefix_len, seq_lens, req_pool_indices
    extra = padded - bs
    return (np.concatenate([prefix_len, np.zeros(extra, np.int64)]),
            np.concatenate([seq_lens, np.ones(extra, np.int64)]),
            np.concatenate([req_pool_indices, np.zeros(extra, np.int64)]))
