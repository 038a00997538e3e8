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

CUDA graphs (``decode.planner``, ``decode.graph_variants``): every captured batch size has the stock
graph (the wrapped backend alone) and, where the cost model says cascade can win at that size, a cascade graph
(``wrapped decode with seq_len = 1 -> cascade kernels``). The plan, made in
``init_forward_metadata_out_graph`` before the replay, picks the graph: paged steps replay the
stock graph (exactly the stock work), cascade steps the cascade graph. All plan-dependent data
lives in the fixed-capacity ``CascadeWorkspace`` and the wrapped backend's per-size metadata
buffers, shared by both graphs of a size and refilled before every replay. Fused and bgemm run
on eager steps only.

Extend batches with a cached prefix (``extend.paths``, ``extend.plan``, ``extend.hot_extend``): when
some cached prefix in the batch starts with a HOT run and the wrapped backend is flashinfer (ragged + paged
prefill), the paged prefill wrapper in the batch's metadata is replaced by a
``PrefixPartProxy``: the prefix part runs as one dense call per HOT extent, plus one paged call
for the COLD remainder; SGLang's code does the rest of the extend. Under other backends
(triton: one kernel per row, no LSE), ``full_extend`` computes the batch's whole extend.

The per-step host input is staged by the scheduler hook (``stage_batch``: the batch's
``req_pool_idx`` values, known on the host without a device sync); HOT runs come from the
``HotPrefixTable`` numpy mirror.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import numpy as np
import torch

from granikv.attention.context import AttentionContext
from granikv.attention.debug import kv_round
from granikv.attention.debug.compare import DebugCompare
from granikv.attention.decode.graph_variants import GraphVariants
from granikv.attention.decode.layer_paths import LayerPaths, per_layer_stock
from granikv.attention.decode.planner import DecodePlanner
from granikv.attention.dispatcher import Dispatcher, Path, build_dispatcher
from granikv.attention.eligibility import LayerEligibility, unsupported_reason
from granikv.attention.extend.paths import ExtendPaths
from granikv.attention.forwarding import ForwardingBackend
from granikv.attention.step_stats import StepStats

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from granikv.config import GraniKVConfig

logger = logging.getLogger("granikv")


class GraniKVAttnBackend(ForwardingBackend):
    """Decode through the shared-prefix kernels when the plan says so; everything else as-is.

    The class SGLang sees: it keeps SGLang's ``AttentionBackend`` contract and composes the
    concerns, each in its own module: ``LayerEligibility`` (which layers GraniKV computes, for
    decode and extend alike), ``DecodePlanner`` (decode plan / run, workspaces, graph state),
    ``ExtendPaths`` (extend over HOT prefixes), ``DebugCompare`` (debug compare mode);
    ``ForwardingBackend`` hands the wrapped backend the rest.
    """

    layer_paths: Optional[LayerPaths] = None  # a hybrid model's per-layer decode paths (set in __init__)

    @classmethod
    def wrap(cls, inner: AttentionBackend, *, model_runner: ModelRunner, cfg: GraniKVConfig,
             backend_name: str, build_inner: Optional[Callable[[], AttentionBackend]] = None) -> AttentionBackend:
        """Wraps ``inner``, or returns it unchanged (with a log line) when GraniKV cannot serve.
        ``build_inner``: builds another instance of the wrapped backend (SGLang's own builder),
        for per-layer decode paths of a hybrid model (decode/layer_paths.py); None: not offered."""
        reason = unsupported_reason(model_runner, cfg)
        if reason is not None:
            logger.warning("GraniKV attention off (%s): decode uses the stock %s backend",
                           reason, backend_name)
            return kv_round.wrap_stock(inner)  # debug only: itself unless GRANIKV_DEBUG_KV_ROUND
        return cls(inner, model_runner=model_runner, cfg=cfg, backend_name=backend_name, build_inner=build_inner)

    def __init__(self, inner: AttentionBackend, *, model_runner: ModelRunner, cfg: GraniKVConfig, backend_name: str,
                 build_inner: Optional[Callable[[], AttentionBackend]] = None):
        dispatcher = build_dispatcher(model_runner, cfg, backend_name)
        geo = dispatcher.geometry
        check_prefix_kernel(cfg, model_runner, geo.head_dim)
        # the one owner of what the parts below read (they get the context, never this object)
        self.ctx = AttentionContext(cfg=cfg, model_runner=model_runner, inner=inner, backend_name=backend_name,
                                    dispatcher=dispatcher, device=torch.device(model_runner.device),
                                    num_q_heads=geo.num_q_heads, head_dim=geo.head_dim, stats=StepStats())
        super().__init__(inner)
        self.eligibility = LayerEligibility(num_q_heads=geo.num_q_heads, head_dim=geo.head_dim,
                                            backend_name=backend_name)
        # An ineligible layer keeps decode stock for the whole model (the wrapped backend is
        # planned once per step for every layer, so one layer cannot opt out of the ``seq_len =
        # 1`` plan), unless its only refusal is a sliding window and a second wrapped instance
        # can be built: per-layer paths (decode/layer_paths.py). Extend falls back per layer.
        self.eligibility.scan(getattr(model_runner, "model", None))
        blocked = self.eligibility.decode_blocked()
        stock_layers = per_layer_stock(blocked, self.eligibility.num_layers) if build_inner is not None else None
        if blocked and stock_layers is None:
            self.ctx.dispatcher = self._paged_dispatcher()
        self.decode = DecodePlanner(self.ctx)
        if stock_layers is not None and build_inner is not None:
            self.layer_paths = LayerPaths(stock_layers, build_inner, num_layers=self.eligibility.num_layers,
                                          backend_name=backend_name)
        self.compare = DebugCompare(self.ctx)
        self.extend = ExtendPaths(self.ctx, self.eligibility, self.compare)
        self._staged: Optional[np.ndarray] = None
        self._stage_seconds = 0.0
        self._kv_round = kv_round.from_env()  # debug only: NO_ROUND unless GRANIKV_DEBUG_KV_ROUND

    def _paged_dispatcher(self) -> Dispatcher:
        return build_dispatcher(self.model_runner, self.cfg, self.backend_name, forced_path="paged")

    # ---- shared state: read from (and, for tests and hooks, written to) the context ------

    inner = property(lambda self: self.ctx.inner, lambda self, v: setattr(self.ctx, "inner", v))
    cfg = property(lambda self: self.ctx.cfg, lambda self, v: setattr(self.ctx, "cfg", v))
    model_runner = property(lambda self: self.ctx.model_runner, lambda self, v: setattr(self.ctx, "model_runner", v))
    stats = property(lambda self: self.ctx.stats, lambda self, v: setattr(self.ctx, "stats", v))
    backend_name = property(lambda self: self.ctx.backend_name)
    device = property(lambda self: self.ctx.device)
    num_q_heads = property(lambda self: self.ctx.num_q_heads)
    head_dim = property(lambda self: self.ctx.head_dim)
    hot_prefix_table = property(lambda self: self.ctx.hot_prefix_table)

    @property
    def dispatcher(self) -> Dispatcher:
        return self.ctx.dispatcher

    @dispatcher.setter
    def dispatcher(self, value: Dispatcher) -> None:
        """Later decode steps choose with ``value`` (through the planner, the owner of the choice)."""
        self.decode.use_dispatcher(value)

    @property
    def graphs(self) -> GraphVariants:
        """The decode CUDA-graph variants (``graph_variants.GraphVariants``), used by the hooks."""
        return self.decode.graphs

    @graphs.setter
    def graphs(self, value: GraphVariants) -> None:
        self.decode.graphs = value

    def stats_snapshot(self) -> dict:
        """``StepStats.snapshot()`` plus how often steady steps reused the previous plan."""
        out = self.stats.snapshot()
        out.update(self.decode.reuse_counts())
        if self.layer_paths is not None:
            out.update(self.layer_paths.snapshot())
        return out

    def stage_batch(self, req_pool_indices: Optional[np.ndarray], *, seconds: float = 0.0) -> None:
        """The next decode or extend batch's ``req_pool_idx`` per request, in batch order
        (host ints), or None (a batch that is neither: nothing staged); ``seconds``: the host
        time the caller spent building it (counted in the step's planning time)."""
        self._staged = req_pool_indices
        self._stage_seconds = seconds

    def plans_decode(self) -> bool:
        """Whether a decode step staged now would be planned: some request holds a HOT run in
        the table this backend plans from (else ``DecodePlanner.plan_step`` plans nothing and
        reads no rows)."""
        return self.ctx.hot_prefix_table.rows_held > 0

    def _take_staged(self) -> Tuple[Optional[np.ndarray], float]:
        staged, self._staged = self._staged, None
        seconds, self._stage_seconds = self._stage_seconds, 0.0
        return staged, seconds

    def _plan_decode(self, fb: ForwardBatch, *, graph: bool) -> Any:
        staged, seconds = self._take_staged()
        return self.decode.plan_step(fb, staged, stage_seconds=seconds, graph=graph)

    # ---- AttentionBackend metadata contract ---------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.decode.view_memo.forget()
        if not forward_batch.forward_mode.is_decode():  # extend / prefill: the wrapped backend
            staged, self._staged = self._staged, None
            self.decode.stock_step(extend=True)
            self._unplan_layer_paths()
            self.compare.no_decode_compare()
            self.inner.init_forward_metadata(forward_batch)
            self.extend.plan(forward_batch, staged)
            return
        view = self._plan_decode(forward_batch, graph=False)
        self.inner.init_forward_metadata(self.compare.plan_decode(forward_batch, view))
        if self.layer_paths is not None:
            if self.decode.path is Path.PAGED:
                self.layer_paths.unplan()
            else:  # the windowed layers' instance over the real batch
                self.layer_paths.plan(forward_batch)

    def _unplan_layer_paths(self) -> None:
        if self.layer_paths is not None:
            self.layer_paths.unplan()

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self.decode.begin_graph_metadata()
        self.compare.no_decode_compare()  # a replay runs no Python
        self._unplan_layer_paths()
        memo = self.decode.view_memo
        if not (self.decode.graph_mode and forward_batch.forward_mode.is_decode()):
            memo.forget()
            self.decode.stock_step(extend=not forward_batch.forward_mode.is_decode())
            return self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        paths = self.layer_paths
        if in_capture:
            memo.forget()
            self.decode.capture_metadata_for(forward_batch)
            if paths is not None and self.decode.path is not Path.PAGED:  # the cascade graph of a size
                paths.capture(forward_batch)
            return
        view = self._plan_decode(forward_batch, graph=True)  # None: the view's plan is in place (view_memo)
        if view is not None:
            self.inner.init_forward_metadata_out_graph(view)
        if paths is not None and self.graphs.planned_cascade:  # the windowed layers' buffers, real batch
            paths.replay(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.decode.view_memo.forget()
        self.inner.init_forward_metadata_in_graph(forward_batch)
        self.decode.in_graph_metadata(forward_batch)  # a cascade capture: its suffix-end copy
        paths = self.layer_paths
        if paths is not None and paths.planned:  # a cascade capture: the windowed layers' instance too
            paths.real.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode.view_memo.forget()
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        self.decode.init_graph_state(max_bs)
        if self.layer_paths is not None:
            self.layer_paths.init_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        return self.inner.on_after_cuda_graph_warmup()

    def reads_req_to_token_during_replay(self) -> bool:
        """Whether this step's decode-graph replay reads ``req_to_token`` (so SGLang's
        pre-replay read-done event is too early: war_barrier.py): the step planned its size's
        cascade graph and made no pre-replay copy of its suffix slots (``SlotCopier``). Stock
        graphs read it only in the pre-replay metadata copy."""
        return self.decode.replay_reads_req_to_token()

    # ---- compute --------------------------------------------------------------------------

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        k, v = self._kv_round(k, v, layer)
        return self.extend.forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        k, v = self._kv_round(k, v, layer)
        paths = self.layer_paths
        if paths is not None and paths.planned and paths.runs_stock(layer.layer_id):
            return paths.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, kwargs)
        o = self.inner.forward_decode(q, k, v, layer, forward_batch,
                                      save_kv_cache=save_kv_cache, **kwargs)
        if self.decode.path is not Path.PAGED:  # paged: the stock work only
            if paths is not None and paths.planned:
                paths.served()
            self._unscanned_decode_feature(layer, self.eligibility.decode_reason(layer, k, v, kwargs))
            sinks = kwargs.get("sinks")  # checked by decode_reason: one logit per q-head
            due = self.compare.decode_due(layer)
            stock = self.compare.stock_output(o) if due else None  # before the kernels overwrite o
            self.decode.run(q, layer, o, sinks=sinks)
            if due:
                self.compare.compare_decode(q, layer, forward_batch, o, self.decode.path, stock, sinks=sinks)
        return o

    def _unscanned_decode_feature(self, layer: RadixAttention, reason: Optional[str]) -> None:
        """A decode call carries a feature the wrap-time scan did not see (an argument only
        the call shows, or a layer outside the scanned model). This step's wrapped backend was
        planned with ``seq_len = 1``: the output cannot be repaired here, so decode stays stock
        from the next step on (error logged once)."""
        if reason is None:
            return
        logger.error("GraniKV: decode of layer %d carries %s, which the layer scan did not "
                     "find; decode attention is stock from the next step on", layer.layer_id, reason)
        self.eligibility.record(layer.layer_id, reason)
        self.decode.use_dispatcher(self._paged_dispatcher())


_METADATA_PREFIXES = ("init_forward_metadata", "prepare_forward_metadata", "prepare_full_cuda_graph")


def check_prefix_kernel(cfg: GraniKVConfig, model_runner: Any, head_dim: int) -> None:
    """At startup: ``--granikv-prefix-kernel wgmma`` on a model and GPU it cannot serve is a
    ValueError naming the flag and the reason (never a failed launch mid-serving)."""
    if cfg.prefix_kernel != "wgmma":
        return
    from granikv.kernels.prefix_wgmma import wgmma_unfit_for

    kv_dtype = model_runner.kv_cache_dtype
    why = wgmma_unfit_for(model_runner.device, getattr(model_runner, "dtype", kv_dtype), kv_dtype, head_dim)
    if why:
        raise ValueError(f"--granikv-prefix-kernel=wgmma cannot run here: {why}; use auto, pointer or descriptor")


def _forgetting_view_plan(name: str) -> Callable[..., Any]:
    """The forwarder of base method ``name``, which first forgets the wrapped backend's
    one-token plan (``view_memo``): a metadata call GraniKV does not make itself (a breakable
    prefill graph, a chunked-prefix graph) may rewrite buffers the decode graphs share."""
    forward = getattr(GraniKVAttnBackend, name)

    def call(self: GraniKVAttnBackend, *args: Any, **kwargs: Any) -> Any:
        self.decode.view_memo.forget()
        return forward(self, *args, **kwargs)

    call._granikv_forwarded = True  # type: ignore[attr-defined]  # still a forwarder (forwarding.py)
    return call


for _name in GraniKVAttnBackend.forwarded_base_names:
    if _name.startswith(_METADATA_PREFIXES) and callable(getattr(GraniKVAttnBackend, _name, None)):
        setattr(GraniKVAttnBackend, _name, _forgetting_view_plan(_name))
