r"""Decode CUDA graphs per batch size: the stock graph, and a cascade graph where it can pay.

SGLang's ``DecodeCudaGraphRunner`` captures one graph per batch size (``ShapeKey(size, ...,
variant_label)``). GraniKV captures, for each size, the STOCK graph exactly as SGLang would
(the wrapped backend alone: GraniKV's kernels are not in it), and for the sizes chosen here a
second CASCADE graph (wrapped backend with ``seq_len = 1``, then the cascade kernels), keyed
by the same size and ``CASCADE_LABEL`` in its variant label. The plan of a step picks which
one replays, so a paged step replays exactly the stock work::

    capture (per size, largest first)            replay (per step)
    ---------------------------------            ----------------------------------------------
    capture_one_shape(bs)          stock graph   load_batch -> init_forward_metadata_out_graph
    capture_one_shape(bs, label)   cascade graph               (the plan: paged or cascade,
        only if bs in cascade_sizes                             cascade only if bs has a graph)
                                                 replay key := cascade variant if planned so

Both graphs of a size read the same metadata buffers of the wrapped backend (the cascade
capture refills them the way a replay does instead of creating new ones; see
``GraniKVAttnBackend.init_forward_metadata_out_graph``) and GraniKV's fixed workspace, so
whichever graph replays finds its inputs refilled by the step's plan.

Which sizes get a cascade graph (``--granikv-cascade-graph-bs``): ``auto`` asks the cost
model, per captured size, whether cascade beats paged on the most favourable batch of that
size (all requests sharing one prefix of the model's context length, capped at
``AUTO_PREFIX_TOKENS``); sizes where it cannot win never replay a cascade graph, so capturing
one would cost memory for nothing. ``none`` or an explicit list bound graph memory further.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Optional, Set, Tuple

import numpy as np

from granikv.attention.dispatcher import Path
from granikv.attention.grouping import BatchDescription, group_requests

if TYPE_CHECKING:
    import torch

    from granikv.attention.dispatcher import Dispatcher

logger = logging.getLogger("granikv")

CASCADE_LABEL = "granikv-cascade"
AUTO_PREFIX_TOKENS = 32768  # longest shared prefix ``auto`` assumes (design range 4K-32K)
AUTO_SUFFIX_TOKENS = 256
# paged reasons of a graph step whose suffix-end binding is not its cascade graph's (``ends_binding``)
NO_DEVICE_ENDS = "no device seq_lens for the cascade graph"
UNBOUND_CAPTURE = "cascade graph captured without device seq_lens"
MOVED_ENDS = "device seq_lens not the buffer the cascade graph copies its ends from"


def cascade_label(variant_label: Optional[str]) -> str:
    """The variant label of the cascade graph beside a stock graph labelled ``variant_label``
    (SGLang's own labels, e.g. "lora" / "nolora", are kept as a prefix)."""
    return CASCADE_LABEL if variant_label is None else f"{variant_label}+{CASCADE_LABEL}"


def cascade_can_win(dispatcher: Dispatcher, bs: int, *, prefix_tokens: int, min_group_size: int) -> bool:
    """True iff the cost model puts cascade below paged for ``bs`` requests sharing one
    ``prefix_tokens``-long HOT prefix with ``AUTO_SUFFIX_TOKENS`` private tokens each. Under a
    forced path (``--granikv-attention-path``) the cost model does not choose: every size where
    the forced path is eligible on a graph step gets a cascade graph, none under forced paged
    (otherwise a forced cascade would still replay stock graphs wherever the cost model's
    calibration, e.g. the conservative default on a GPU without one, puts paged ahead)."""
    if bs < min_group_size or prefix_tokens < 1:
        return False
    seq = np.full(bs, prefix_tokens + AUTO_SUFFIX_TOKENS, dtype=np.int64)
    desc = BatchDescription(np.arange(1, bs + 1, dtype=np.int64), seq,
                            np.ones(bs, dtype=np.int64), np.full(bs, prefix_tokens, dtype=np.int64))
    grouping = group_requests(desc, min_group_size=min_group_size)
    times = dispatcher.estimate(grouping, desc, graph_safe_only=True)
    forced = dispatcher.forced
    if forced is not None:
        return forced is not Path.PAGED and bool(np.isfinite(times.of(forced)))
    return times.cascade < times.paged


class GraphVariants:
    """Which captured decode sizes have a cascade graph, and the variant of the current step.

    Owned by the backend (one per model runner); the graph-runner hooks in plugin.py drive it:
    ``capturing_cascade`` around the second capture of a size, ``replay_key`` after the
    step's plan. State: ``captured`` (sizes with a cascade graph), ``capturing`` (the size whose
    cascade graph is being captured, else None), ``planned_cascade`` (the step just planned
    replays the cascade graph), ``ends_bound`` (per captured size: whether its capture bound the
    suffix ends, ``SuffixEnds.bind``; the graph's kernels read the ends where the capture had them,
    the bound device buffer or the workspace's metadata, whatever a later step binds),
    ``ends_source`` (per captured size whose graph copies the suffix ends itself: the address of
    the ``seq_lens`` it copies from, SGLang's static buffer; ``SuffixEnds.copy_from``),
    ``slots_appended`` (the captured sizes whose graph appends each request's newest slot to the
    slot copy itself, ``suffix_slots.append_suffix_slots``: a steady replay of them makes no copy
    before it).
    """

    def __init__(self, sizes: Optional[FrozenSet[int]], *, can_win: Callable[[int], bool]) -> None:
        """``sizes``: explicit batch sizes (``config.parse_graph_bs``), or None for auto, where
        ``can_win(bs)`` decides (``cascade_can_win`` bound to the dispatcher)."""
        self._sizes = sizes
        self._can_win = can_win
        self.captured: Set[int] = set()
        self.stock_only: Set[int] = set()
        self.capturing: Optional[int] = None
        self.planned_cascade = False
        # bs -> the cascade capture of bs bound its suffix ends (None: not recorded)
        self.ends_bound: Dict[int, Optional[bool]] = {}
        self._capture_ends: Optional[bool] = None  # the binding recorded during the capture in progress
        # bs -> data_ptr of the seq_lens its cascade graph copies the suffix ends from (in-graph copy)
        self.ends_source: Dict[int, int] = {}
        self._capture_source: Optional[int] = None  # that address, recorded during the capture in progress
        self.slots_appended: Set[int] = set()  # sizes whose cascade graph appends the newest slots itself
        self._capture_appends = False  # recorded during the capture in progress
        self.memory_bytes = 0  # device memory the cascade captures took (CUDA; 0 elsewhere)
        self._cascade_keys: Dict[Any, Any] = {}  # SGLang's (frozen, hashable) replay key -> its cascade key

    def wants_cascade(self, bs: int) -> bool:
        want = (bs in self._sizes) if self._sizes is not None else self._can_win(bs)
        if not want:
            self.stock_only.add(bs)
        return want

    def begin_capture(self, bs: int) -> None:
        if self.capturing is not None:
            raise RuntimeError(f"cascade graph capture of bs {bs} inside that of bs {self.capturing}")
        self.capturing = bs
        self._capture_ends = self._capture_source = None
        self._capture_appends = False
        self._free_before = _free_device_bytes()

    def record_capture_ends(self, bound: bool) -> None:
        """The cascade graph being captured has its suffix ends bound (True) or reads them from
        the workspace's metadata (False); kept for its size once the capture succeeds."""
        self._capture_ends = bound

    def record_capture_ends_source(self, data_ptr: int) -> None:
        """The cascade graph being captured copies its suffix ends from the ``seq_lens`` at
        ``data_ptr`` (kept for its size once the capture succeeds)."""
        self._capture_source = data_ptr

    def record_capture_appends(self) -> None:
        """The cascade graph being captured appends each request's newest slot to the slot copy
        (kept for its size once the capture succeeds, with its in-graph ends copy)."""
        self._capture_appends = True

    def end_capture(self, ok: bool) -> None:
        bs, self.capturing = self.capturing, None
        assert bs is not None, "end_capture without a begin_capture"
        if ok:
            self.captured.add(bs)
            self.ends_bound[bs] = self._capture_ends
            if self._capture_ends and self._capture_source is not None:
                self.ends_source[bs] = self._capture_source
            else:
                self.ends_source.pop(bs, None)
            if self._capture_appends and bs in self.ends_source:
                self.slots_appended.add(bs)
            else:
                self.slots_appended.discard(bs)
            self.memory_bytes += max(0, self._free_before - _free_device_bytes())
        else:
            self.ends_bound.pop(bs, None)
            self.ends_source.pop(bs, None)
            self.slots_appended.discard(bs)
        self._capture_source = None
        self._capture_appends = False

    def ends_binding(self, bs: int, seq_lens_dev: Optional[torch.Tensor]) -> Tuple[Optional[str], bool]:
        """How a step of padded size ``bs`` whose bindable device ``seq_lens`` is ``seq_lens_dev``
        (None: none the workspace can bind) gets its suffix ends into the cascade graph of ``bs``:
        ``(None, copied)`` when it can replay it (``copied``: the graph copies them itself from
        ``seq_lens_dev``, ``ends_source``), else ``(paged reason, False)``. A graph captured with
        bound ends reads the device buffer, which an unbound step never writes; one captured
        without reads the metadata, which an in-place step never uploads; one that copies its
        ends from another buffer would overwrite the step's with that buffer's: each replay
        would end suffixes at stale lengths."""
        bound = seq_lens_dev is not None
        if self.ends_bound.get(bs) is not bound:
            return (UNBOUND_CAPTURE if bound else NO_DEVICE_ENDS), False
        src = self.ends_source.get(bs)
        if src is None or seq_lens_dev is None:
            return None, False
        return (None, True) if src == seq_lens_dev.data_ptr() else (MOVED_ENDS, False)

    def has_cascade_graph(self, bs: int) -> bool:
        return bs in self.captured

    def replay_key(self, key: Any) -> Any:
        """The ``ShapeKey`` the step just planned must replay: SGLang's own (the stock graph) or,
        when the plan chose cascade, the same key with the cascade graph's label (made once per
        key)."""
        if not self.planned_cascade:
            return key
        cascade = self._cascade_keys.get(key)
        if cascade is None:
            cascade = self._cascade_keys[key] = dataclasses.replace(
                key, variant_label=cascade_label(key.variant_label))
        return cascade

    def summary(self) -> str:
        cascade = sorted(self.captured)
        stock = sorted(self.stock_only - self.captured)
        return (f"cascade graphs for {len(cascade)} batch sizes {cascade} "
                f"(~{self.memory_bytes / 2**20:.0f} MiB), stock graph only for {len(stock)} sizes {stock}")

    def check_integrity(self) -> None:
        assert self.capturing is None, f"a cascade capture of bs {self.capturing} never ended"
        stray = sorted(set(self.ends_bound) - self.captured)
        assert not stray, f"suffix-end bindings recorded for sizes without a cascade graph: {stray}"
        unbound = sorted(bs for bs in self.ends_source if not self.ends_bound.get(bs))
        assert not unbound, f"in-graph suffix-end copies recorded for sizes captured without bound ends: {unbound}"
        stray_appends = sorted(self.slots_appended - set(self.ends_source))
        assert not stray_appends, (
            f"in-graph slot appends recorded for sizes without an in-graph ends copy: {stray_appends}")
        assert self.captured.isdisjoint(self.stock_only), (
            f"sizes both stock-only and with a cascade graph: {sorted(self.captured & self.stock_only)}")


def _free_device_bytes() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info()
    return free
