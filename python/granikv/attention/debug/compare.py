"""``DebugCompare``: ``--granikv-debug-compare-every N`` checks of GraniKV's attention against a
reference on live batches, logged and kept in ``StepStats``.

- decode: every N-th step (eager steps only: a graph replay runs no Python), EVERY layer's
  output of the chosen path against a reference for the same step (``compare_decode``);
- extend through proxies (flashinfer): every N-th HOT extend batch, layer 0's dense prefix part
  against the stock paged one (same batch, same KV);
- full extend (other backends): every N-th HOT extend batch, layer 0's whole extend output
  against the wrapped backend's (it reads the K/V just written, and writes nothing).

Decode compare. On a compared step (``plan_decode``) the wrapped backend is planned with the
real batch instead of the ``seq_len = 1`` view, so its ``forward_decode`` output is the stock
output of that layer for that step (stock SGLang's own work on the same q and KV); GraniKV's
kernels then overwrite it as on any step, and the step's tokens are GraniKV's. Per layer::

    ref64     = float64 paged attention (granikv.kernels.reference)
    stock_dev = rel_dev(stock, ref64)          what a correct stock kernel deviates by
    dev       = rel_dev(ours, stock)           GraniKV vs the stock output (ref64 without one)
    tolerance = layer_tolerance(stock_dev, dtype) = max(TOLERANCE_FACTOR * stock_dev,
                                                        FLOOR_EPS * eps(dtype))

with ``rel_dev(o, ref) = max|o - ref| / max|ref|``, both maxima over every element of the
layer's output for the batch (requests x heads x head_dim). The tolerance is measured, not
guessed: two correct kernels on the same inputs differ by at most the sum of their errors from
the exact result, so a GraniKV kernel as accurate as stock gives ``dev <= ~2 * stock_dev``;
``TOLERANCE_FACTOR = 4`` is that 2 with 2x headroom for a different accumulation order (split
KV, LSE merge). The floor: both outputs are rounded to the output dtype (error <= eps/2 of an
element each), so two correct kernels may differ by one ulp, ``eps * max|ref|``, even where the
stock output happens to round exactly like float64 (``stock_dev`` ~ 0); ``FLOOR_EPS = 2``
covers that ulp and fp32 accumulation differences. A fault such as ``GRANIKV_DEBUG_FAULT=
half_prefix`` moves an attention output by a sizeable share of its magnitude (dev ~ 0.1 .. 1,
against a bf16 tolerance ~ 0.016). Without a stock output for the step (a caller passing none)
the reference is ``ref64`` and the tolerance its floor.

``ctx`` (``AttentionContext``): ``cfg``, ``stats``, ``inner`` and ``model_runner`` are read
from it at each call (the backend may replace them while serving).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import numpy as np
import torch

from granikv.attention.context import AttentionContext
from granikv.attention.decode.batch_view import real_batch_size

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

    from granikv.attention.dispatcher import Path
    from granikv.attention.extend.hot_extend import Attended
    from granikv.attention.extend.plan import ExtendPlan

logger = logging.getLogger("granikv")

TOLERANCE_FACTOR = 4.0  # x the stock kernel's own deviation from float64 (module docstring)
FLOOR_EPS = 2.0  # x the output dtype's eps: the least tolerance (module docstring)


def rel_dev(o: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|o - ref| / max|ref|`` over every element, in float64: 0.0 when both are all zero,
    ``inf`` when only ``ref`` is. Raises ValueError on different shapes."""
    if o.shape != ref.shape:
        raise ValueError(f"output {tuple(o.shape)} vs reference {tuple(ref.shape)}")
    diff = float((o.double() - ref.double()).abs().max()) if o.numel() else 0.0
    scale = float(ref.double().abs().max()) if ref.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def layer_tolerance(stock_dev: Optional[float], dtype: torch.dtype) -> float:
    """A layer-step's tolerance: ``max(TOLERANCE_FACTOR * stock_dev, FLOOR_EPS * eps(dtype))``;
    the floor alone when ``stock_dev`` is None (no stock output to measure)."""
    floor = FLOOR_EPS * torch.finfo(dtype).eps
    return floor if stock_dev is None else max(TOLERANCE_FACTOR * stock_dev, floor)


class DebugCompare:
    def __init__(self, ctx: AttentionContext):
        self.ctx = ctx
        self._decode_due = False  # this decode step compares every layer
        self._stock_valid = False  # ... and the wrapped backend was planned with the real batch

    # ---- decode ----------------------------------------------------------------------------

    def plan_decode(self, fb: Any, view: Any) -> Any:
        """The batch the wrapped backend plans an eager decode step with (``view``: the
        planner's choice, ``fb`` itself on paged steps). Every N-th step (``stats.steps``, just
        counted by the plan) that runs GraniKV's kernels is compared: the wrapped backend then
        plans the real ``fb``, so its output is the step's stock output (the reference)."""
        n = self.ctx.cfg.debug_compare_every
        self._decode_due = bool(n) and view is not fb and self.ctx.stats.steps % n == 0
        self._stock_valid = self._decode_due
        return fb if self._decode_due else view

    def no_decode_compare(self) -> None:
        """This step is not compared (a graph replay, capture or an extend batch)."""
        self._decode_due = self._stock_valid = False

    def decode_due(self, layer: RadixAttention) -> bool:
        """Whether this layer's decode output is compared: every layer of a compared eager step."""
        capturing = torch.cuda.is_current_stream_capturing() if torch.cuda.is_available() else False
        return self._decode_due and not capturing

    def stock_output(self, o: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of the wrapped backend's output ``o`` when it is the step's stock output (the
        wrapped backend planned the real batch), before GraniKV's kernels overwrite it; else None."""
        return o.clone() if self._stock_valid else None

    def compare_decode(self, q: torch.Tensor, layer: RadixAttention, fb: Any, o: torch.Tensor, path: Path,
                       stock: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> float:
        """The chosen ``path``'s output ``o`` of ``layer`` against ``stock`` (the wrapped backend's
        output for the same step), or the float64 paged reference where ``stock`` is None;
        records it (``StepStats.record_layer_compare``) and returns the deviation."""
        from granikv.attention.kv_scales import kv_scales
        from granikv.kernels.reference import decode_attention_ref

        ctx = self.ctx
        runner = ctx.model_runner
        pool = runner.token_to_kv_pool
        hq, d = ctx.num_q_heads, ctx.head_dim
        bs = real_batch_size(fb)
        k_scale, v_scale = kv_scales(layer)
        ref = decode_attention_ref(q.view(-1, hq, d)[:bs],
                                   pool.get_key_buffer(layer.layer_id),
                                   pool.get_value_buffer(layer.layer_id),
                                   runner.req_to_token_pool.req_to_token,
                                   fb.req_pool_indices[:bs], fb.seq_lens[:bs], layer.scaling,
                                   sinks=sinks, k_scale=k_scale, v_scale=v_scale).o
        ours = o.view(-1, hq, d)[:bs]
        diff = float((ours.double() - ref).abs().max()) if bs else 0.0
        ctx.stats.max_compare_diff = max(ctx.stats.max_compare_diff, diff)
        if stock is not None:
            stock = stock.view(-1, hq, d)[:bs]
            stock_dev, dev = rel_dev(stock, ref), rel_dev(ours, stock)
        else:
            stock_dev, dev = None, rel_dev(ours, ref)
        tol = layer_tolerance(stock_dev, o.dtype)
        ctx.stats.record_layer_compare(dev, stock_dev, tol)
        against = "float64" if stock is None else f"the {ctx.backend_name} backend"
        level = logging.WARNING if dev > tol else logging.INFO
        logger.log(level, "GraniKV debug compare (step %d, layer %d, %s, bs %d): max |diff| vs paged = "
                   "%.3e; rel dev vs %s %.3e (stock vs float64 %s, tolerance %.3e)%s",
                   ctx.stats.steps, layer.layer_id, path.value, bs, diff, against, dev,
                   "–" if stock_dev is None else f"{stock_dev:.3e}", tol,
                   " OVER TOLERANCE" if dev > tol else "")
        return dev

    # ---- extend ----------------------------------------------------------------------------

    def extend_due(self) -> bool:
        """Every N-th HOT extend batch (the one just recorded)."""
        n = self.ctx.cfg.debug_compare_every
        return bool(n) and (self.ctx.stats.extend_hot_batches - 1) % n == 0

    def prefix_part_callback(self, plan: ExtendPlan) -> Callable[[Attended, Attended], None]:
        """The proxies' ``on_compare``: layer 0's dense prefix part against the stock paged one."""
        stats = self.ctx.stats

        def compare(ours: Attended, stock: Attended) -> None:
            parts = [g.token_idx for g in plan.groups] + ([plan.paged.token_idx] if plan.paged else [])
            rows = torch.from_numpy(np.unique(np.concatenate(parts))).to(ours[0].device)
            d_o = (ours[0].index_select(0, rows).float() - stock[0].index_select(0, rows).float()).abs().max()
            d_l = (ours[1].index_select(0, rows) - stock[1].index_select(0, rows)).abs().max()
            diff = max(float(d_o), float(d_l))
            stats.max_extend_compare_diff = max(stats.max_extend_compare_diff, diff)
            logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens, %d groups): max |diff| "
                        "vs paged prefill: o %.3e, lse %.3e", stats.extend_hot_batches,
                        plan.hot_tokens, len(plan.groups), float(d_o), float(d_l))
        return compare

    def compare_full_extend(self, ours: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            layer: RadixAttention, fb: Any, kwargs: Mapping[str, Any], *, hot_tokens: int) -> None:
        """Layer 0's extend output ``ours`` against the wrapped backend's."""
        ctx = self.ctx
        stock = ctx.inner.forward_extend(q, k, v, layer, fb, save_kv_cache=False, **kwargs)
        diff = float((ours.float() - stock.float()).abs().max())
        scale = float(stock.float().abs().max())  # dummy weights give tiny outputs: say how tiny
        ctx.stats.max_extend_compare_diff = max(ctx.stats.max_extend_compare_diff, diff)
        logger.info("GraniKV debug compare (extend batch %d, %d HOT tokens): max |diff| vs the %s "
                    "backend's extend: o %.3e (max |o| %.3e)", ctx.stats.extend_hot_batches,
                    hot_tokens, ctx.backend_name, diff, scale)
