"""The fixed-capacity device workspace of the cascade kernels, filled once per decode step.

``CascadeWorkspace`` owns FIXED-capacity device buffers (one int32 metadata block, the partial
states, the fused kernel's arrival counters: ``kernels.plan.CascadeBuffers``). ``fill`` builds
the work list in numpy and copies it in place with one non-blocking copy from pinned memory
(``staging_ring``), so a captured CUDA graph stays valid and replays a different batch
correctly: grids are fixed at capacity and programs read the live item counts from ``meta``
(device memory). ``plan`` is what the launchers read for the step just filled.

Work items and their layout: ``work_list``; what a steady step reuses: ``reuse_base``.
"""

from dataclasses import replace
from typing import Optional, Tuple, Union

import numpy as np
import torch

from granikv.attention.decode.launch_table import LaunchTable
from granikv.attention.decode.reuse_base import ReuseBase, last_item_bound
from granikv.attention.decode.staging_ring import StagingRing
from granikv.attention.decode.suffix_ends import SuffixEnds
from granikv.attention.decode.work_list import (
    PrefixItems,
    WorkList,
    build_prefix_items,
    build_work_list,
    capacity,
    suffix_heads,
    suffix_tile_rows,
)
from granikv.kernels.kernel_config import KernelConfig, device_config
from granikv.kernels.plan import BgemmMembers, CascadeBuffers, CascadePlan, Grouping

_NO_REQUEST = Grouping.empty(0)  # the grouping of a step with no request
_NO_SEQ = np.zeros(0, np.int64)
# KernelConfig.suffix_priority: torch maps a priority below CUDA's range to its highest
SIDE_STREAM_HIGHEST = -(1 << 16)
Rows = Union[np.ndarray, torch.Tensor]  # req_pool_indices: host (numpy) or device
PrefixKey = Tuple[Union[int, bool, bytes], ...]  # (bs, single chunk, the group arrays' bytes)
# (n, last_lo1[:n], hi_pos[:n], scratch [n], the scratch as uint64: a negative growth reads as huge)
Advance = Tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class CascadeWorkspace(StagingRing):
    """Fixed-capacity device metadata + partial states for the cascade kernels.

    Allocate once per (max batch size, head shape); call ``fill`` once per decode step (before
    the layers run, outside any CUDA graph), then run the kernels of every layer against it.

    Capacities: ``work_list.capacity`` (from the constructor arguments, never from a batch;
    the prefix wave target at its widest: ``config.prefix_waves`` or the ``launch_table``'s
    largest, which then picks each step's target from its dominant group).
    Host staging: ``StagingRing``; suffix ends once bound: ``SuffixEnds``.

    Device buffers (int32 unless noted):
      ``meta``: [3 + 1 + 1 + 5*P + 4*S + max_bs + (max_bs+1) + max_bs] = counts (bs, n_prefix_items,
      n_suffix_items) | sfx_max (the most tokens a request's last suffix item may hold: the
      kernels clamp a device end to ``t_lo + sfx_max``, ``reuse_base.last_item_bound``) |
      slot_copy_on (1: ``sfx_max`` fits the slot-copy table) |
      prefix items SoA | suffix items SoA | group_req_idx | part_indptr |
      req_pool_indices (the view ``req_pool_indices``; host rows travel in the one copy);
      ``part_o`` fp32 [rows, Hq, D]; ``part_lse`` fp32
      [rows, Hq]; ``counters`` [max_bs, Hq] (fused kernel arrivals, zero between launches);
      ``slot_copy`` [S, slot_copy_tokens] (``slot_copy_tokens`` > 0 only): each suffix item's
      slots, copied before a graph replay (kernels/suffix_slots.py).
    """

    def __init__(
        self,
        max_bs: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: Union[str, torch.device],
        *,
        max_groups: Optional[int] = None,
        max_splits: int = 32,
        sm_count: Optional[int] = None,
        config: Optional[KernelConfig] = None,
        staging_buffers: int = 8,
        slot_copy_tokens: int = 0,
        launch_table: Optional[LaunchTable] = None,
    ):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # one spelling, for SuffixEnds.fits
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ratio = num_q_heads // num_kv_heads
        self.config = config or device_config(self.ratio, head_dim, self.device)
        if sm_count is None:
            sm_count = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 132
            )
        self.max_bs, self.num_q_heads, self.num_kv_heads, self.head_dim = max_bs, num_q_heads, num_kv_heads, head_dim
        self.max_groups = max_bs if max_groups is None else max_groups
        self.max_splits, self.sm_count = max_splits, sm_count
        cfg = self.config
        self.suffix_heads = suffix_heads(self.ratio, num_kv_heads, cfg)
        self.suffix_groups = num_kv_heads // self.suffix_heads  # suffix grid axis 1
        self.suffix_block_h = suffix_tile_rows(self.ratio)
        # the step's prefix wave target comes from the table where it has a rule (_prefix_items):
        # the capacity covers the largest it may ask for
        self.launch_table = launch_table
        widest = max(cfg.prefix_waves, launch_table.max_prefix_waves if launch_table else 0.0)
        self.prefix_cap, self.suffix_cap, self.partial_cap = capacity(
            replace(cfg, prefix_waves=widest), max_bs, self.max_groups, self.ratio, num_kv_heads, sm_count)

        # meta layout
        P, S = self.prefix_cap, self.suffix_cap
        offs, o = {}, 0
        for name, n in (("counts", 3), ("sfx_max", 1), ("sco", 1), ("pfx", 5 * P), ("sfx", 4 * S), ("gidx", max_bs),
                        ("pptr", max_bs + 1), ("rpi", max_bs)):
            offs[name], o = o, o + n
        self._offs, self._meta_len = offs, o
        self._init_ring(o, offs["rpi"], max_bs, self.device, staging_buffers)
        self.counts = self.meta[0:3]
        self.sfx_max = self.meta[offs["sfx_max"] : offs["sfx_max"] + 1]
        self.slot_copy_on = self.meta[offs["sco"] : offs["sco"] + 1]
        # each suffix item's slots, copied before a graph replay (kernels/suffix_slots.py)
        self.slot_copy = (torch.zeros(S, slot_copy_tokens, dtype=torch.int32, device=self.device)
                          if slot_copy_tokens > 0 else None)
        self.slot_copy_ready = False  # the device's slot_copy_on of the current build
        self.pfx_items = self.meta[offs["pfx"] : offs["pfx"] + 5 * P]
        self.sfx_items = self.meta[offs["sfx"] : offs["sfx"] + 4 * S]
        self.group_req_idx = self.meta[offs["gidx"] : offs["gidx"] + max_bs]
        self.part_indptr = self.meta[offs["pptr"] : offs["pptr"] + max_bs + 1]
        self.part_o = torch.empty(self.partial_cap, num_q_heads, head_dim, dtype=torch.float32, device=self.device)
        self.part_lse = torch.empty(self.partial_cap, num_q_heads, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(max_bs, num_q_heads, dtype=torch.int32, device=self.device)
        self._work_list: Optional[WorkList] = None
        self._hi_buf: Optional[int] = None  # staging buffer holding the suffix ends of the last advance (work_list)
        self.ends = SuffixEnds(max_bs, self.device)  # the suffix ends the kernels read once bound
        self._dev_ends: Optional[int] = None  # n of the last in-place advance: its ends are ends.host(n) (work_list)
        self.advances_in_place = 0  # steady steps with device ends: no upload at all
        self._bgemm: Optional[BgemmMembers] = None  # the last fill's, for the eager bgemm path
        # (key, PrefixItems) of the last grouping
        self._prefix_memo: Tuple[Optional[PrefixKey], Optional[PrefixItems]] = (None, None)
        self._prefix_shape: Optional[Tuple[int, bool]] = None  # (bs, single chunk) of the last lookup
        self._reuse_base: Optional[ReuseBase] = None  # ReuseBase of the last full build (None: nothing to advance)
        self._adv: Optional[Advance] = None  # of the current build
        self.fills_built = self.fills_reused = 0  # full work-list builds / reuses (see _advance)
        self.fills_skipped = 0  # empty fills with the empty work list already on the device
        # side stream of the overlapped suffix launch (KernelConfig.overlap_suffix), one per workspace
        self.side_stream = (torch.cuda.Stream(self.device, priority=SIDE_STREAM_HIGHEST if cfg.suffix_priority else 0)
                            if cfg.overlap_suffix and self.device.type == "cuda" else None)
        self.buffers = CascadeBuffers(
            config=cfg, max_bs=max_bs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            ratio=self.ratio, prefix_cap=self.prefix_cap, suffix_cap=self.suffix_cap, partial_cap=self.partial_cap,
            suffix_heads=self.suffix_heads, suffix_groups=self.suffix_groups, suffix_block_h=self.suffix_block_h,
            counts=self.counts, sfx_max=self.sfx_max, pfx_items=self.pfx_items, sfx_items=self.sfx_items,
            group_req_idx=self.group_req_idx, part_indptr=self.part_indptr, req_pool_indices=self.req_pool_indices,
            part_o=self.part_o, part_lse=self.part_lse, counters=self.counters, side_stream=self.side_stream,
            slot_copy_on=self.slot_copy_on, slot_copy=self.slot_copy)
        # the plans of a step without the bgemm path: the ends in the upload, or on the device;
        # reading req_to_token, or the slot copy (graph replays only: the copy runs before them)
        self._plans = {(False, False): CascadePlan(self.buffers),
                       (True, False): CascadePlan(self.buffers, ends=self.ends.buffer)}
        if self.slot_copy is not None:
            self._plans[(False, True)] = CascadePlan(self.buffers, slot_copy=True)
            self._plans[(True, True)] = CascadePlan(self.buffers, ends=self.ends.buffer, slot_copy=True)

    @property
    def plan(self) -> CascadePlan:
        """What the launchers read for the step of the last fill / advance (no allocation on
        the paths CUDA graphs replay)."""
        ends = self.ends.bound
        if self._bgemm is not None:
            return CascadePlan(self.buffers, ends=ends, bgemm=self._bgemm)
        return self._plans[(ends is not None, False)]

    @property
    def graph_plan(self) -> CascadePlan:
        """``plan`` as a CUDA graph captures it: with a slot-copy table, its kernels read the
        copy wherever the device's ``slot_copy_on`` is set, so every replay of such a graph
        must follow ``copy_suffix_slots`` (the planner runs it before each replay)."""
        ends = self.ends.bound
        return self._plans[(ends is not None, self.slot_copy is not None)]

    # ------------------------------------------------------------------ fill
    @property
    def work_list(self) -> Optional[WorkList]:
        """The work list of the last fill. After a steady ``advance`` it is built here on first
        read, from the build it advanced and the suffix ends in the staging buffer just copied,
        or, after an in-place advance, on every read from ``ends`` (the step itself only writes
        those ends, and later in-place steps keep writing them: never cached)."""
        k, ends = self._hi_buf, self._dev_ends
        if k is not None or ends is not None:
            base = self._reuse_base
            assert base is not None, "an advance without a build"
            hi = base.wl.sfx_hi.copy()
            if ends is not None:  # a device read (debug and tests only: serving never reads the host list)
                hi[base.last[:ends]] = self.ends.host(ends)
                return base.wl._replace(sfx_hi=hi)
            assert k is not None
            hi[base.last] = self._host_np[k][base.hi_pos]
            self.work_list = base.wl._replace(sfx_hi=hi)
        return self._work_list

    @work_list.setter
    def work_list(self, wl: Optional[WorkList]) -> None:
        self._work_list, self._hi_buf, self._dev_ends = wl, None, None

    def fill(
        self,
        grouping: Grouping,
        seq_lens: np.ndarray,
        req_pool_indices: Rows,
        *,
        single_prefix_chunk: bool = False,
        same_grouping: bool = False,
        seq_lens_dev: Optional[torch.Tensor] = None,
        ends_copy: bool = True,
    ) -> WorkList:
        """Plan one decode step and copy its metadata into the fixed device buffers (async).

        ``grouping`` of the (padded) batch (docs/contracts.md; its ``prefix_len`` covers every
        position of ``seq_lens``); ``seq_lens`` numpy [bs]; ``req_pool_indices`` [bs] device
        tensor (copied device-to-device) or numpy. ``single_prefix_chunk=True`` plans for
        ``bgemm_cascade_attention``. ``same_grouping=True``: the caller guarantees the grouping's
        group arrays hold what they held in the previous ``fill`` (the planner's unchanged
        ``Grouping``), which skips comparing them.
        ``seq_lens_dev``: see ``SuffixEnds.bind`` (must hold ``seq_lens`` on the device);
        ``ends_copy=False``: the step's graph replay copies them (``SuffixEnds.bind``'s ``copy``).
        Raises ValueError when the batch exceeds the workspace's capacity.
        """
        bs = len(seq_lens)
        if bs > self.max_bs:
            raise ValueError(f"batch size {bs} exceeds the workspace's max_bs={self.max_bs}")
        if grouping.num_groups > self.max_groups:
            raise ValueError(f"{grouping.num_groups} groups exceed the workspace's max_groups={self.max_groups}")
        self.ends.bind(seq_lens_dev, bs, copy=ends_copy)
        if not single_prefix_chunk:  # a reused bgemm build (same items) keeps its members
            self._bgemm = None
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        items = self._prefix_items(grouping, bs, single_prefix_chunk, same_grouping, seq_lens)
        base = self._reuse_base
        if base is not None and base.items is items and base.wl.bs == bs and self._advance(seq_lens, req_pool_indices):
            advanced = self.work_list
            assert advanced is not None  # an advance leaves its work list (or builds it on this read)
            return advanced
        wl = build_work_list(
            grouping, seq_lens,
            ratio=self.ratio, num_kv_heads=self.num_kv_heads, config=self.config,
            sm_count=self.sm_count, max_splits=self.max_splits, single_prefix_chunk=single_prefix_chunk,
            prefix_items=items,
        )  # fmt: skip
        np_, ns = wl.num_prefix_items, wl.num_suffix_items
        if np_ > self.prefix_cap or ns > self.suffix_cap or wl.num_partials > self.partial_cap:
            raise ValueError(
                f"work list ({np_} prefix items, {ns} suffix items, {wl.num_partials} partial rows) exceeds "
                f"the workspace ({self.prefix_cap}, {self.suffix_cap}, {self.partial_cap})"
            )
        base = ReuseBase.of(items, wl, req_pool_indices, single=single_prefix_chunk,
                             factor=self.config.reuse_chunk_factor,
                             sfx_hi_offset=self._offs["sfx"] + 2 * self.suffix_cap)
        self._upload(wl, req_pool_indices, base)
        self.slot_copy_ready = self._slot_copy_fits(last_item_bound(wl.suffix_chunk, self.config.reuse_chunk_factor))
        self.work_list, self._reuse_base = wl, base  # only a work list that was uploaded is reused
        self._adv = None
        self.fills_built += 1
        if single_prefix_chunk:  # device indices for every layer of the eager bgemm path, queued after the upload
            gidx = self.group_req_idx[: len(wl.group_req_idx)].long()
            self._bgemm = BgemmMembers(grouping, idx=gidx, rows=self.part_indptr[gidx].long())
        return wl

    def fill_empty(self, seq_lens_dev: Optional[torch.Tensor] = None) -> WorkList:
        """``fill`` with no request: the kernels then exit at once (a captured graph still runs
        them on a paged step). While the device metadata already holds an empty work list
        (paged steps in a row: no shared prefix in the batch) nothing is built or copied.
        ``seq_lens_dev``: what a graph captured over this fill reads its ends from (``SuffixEnds.bind``)."""
        wl = self._work_list
        if self._hi_buf is None and self._dev_ends is None and wl is not None and wl.bs == 0:
            self.ends.bind(seq_lens_dev, 0)
            self.fills_skipped += 1
            return wl
        return self.fill(_NO_REQUEST, _NO_SEQ, _NO_SEQ, seq_lens_dev=seq_lens_dev)

    def advance(self, seq_lens: np.ndarray, req_pool_indices: np.ndarray, *, bs: int,
                single_prefix_chunk: bool = False, seq_lens_dev: Optional[torch.Tensor] = None,
                ends_checked: bool = False, ends_copy: bool = True) -> bool:
        """A steady decode step, without a ``fill``: the last fill's work list with each request's
        last suffix chunk ending at its new ``seq_len``, uploaded. Returns False, having done
        nothing, when a ``fill`` is needed (no build to advance, a different batch size, or a
        last chunk that would outgrow ``KernelConfig.reuse_chunk_factor``).

        The caller guarantees that the grouping is the one of the last ``fill`` (the planner's
        unchanged ``Grouping``, as ``same_grouping``). ``seq_lens`` (int64) and
        ``req_pool_indices`` (numpy, never written in place once passed: an array seen again
        is not copied again) cover the first ``n = len(seq_lens)`` of the ``bs`` batch positions
        of that fill; positions ``n..bs`` (graph padding) keep what that fill gave them.
        Cost: a handful of numpy calls and one copy, whatever the batch (no per-request loop);
        with ``seq_lens_dev`` (``SuffixEnds.bind``) and the rows already on the device, only the
        device-to-device copy of the ends: the kernels read the new ends there, nothing is uploaded.
        """
        base = self._reuse_base
        if (base is None or base.wl.bs != bs or base.single is not single_prefix_chunk
                or self._prefix_memo[1] is not base.items or len(seq_lens) > bs
                or (base.rows is None and len(seq_lens) < bs)):
            return False
        return self._advance(seq_lens, req_pool_indices, ends=(seq_lens_dev, bs, ends_checked, ends_copy))

    def _advance(self, seq_lens: np.ndarray, req_pool_indices: Rows,
                 ends: Optional[Tuple[Optional[torch.Tensor], int, bool, bool]] = None) -> bool:
        """Advances the current build (``_reuse_base``) to ``seq_lens`` (the first n positions)
        and uploads it; False when a last chunk would hold no token or more than ``limit``.

        Correct for any batch with the same prefix items (same grouping and batch size, hence
        the same ``prefix_len`` per position): every chunk but a request's last is full and
        starts at ``prefix_len + k * suffix_chunk``, so ``[lo_last, seq_len)`` completes an exact
        cover of ``[prefix_len, seq_len)`` whenever ``seq_len > lo_last``. ``ends``: the
        ``SuffixEnds.bind`` arguments (``advance``), bound once the step is known to advance;
        with ends bound and the rows on the device the very rows given, nothing is uploaded.
        None (``fill``, which binds first): the binding stays and the step uploads.
        """
        base, n = self._reuse_base, len(seq_lens)
        assert base is not None  # the callers check it
        st = self._adv
        if st is None or st[0] != n:  # per build and n: views and a scratch row, made once
            scratch = np.empty(n, np.int64)
            st = self._adv = (n, base.last_lo1[:n], base.hi_pos[:n], scratch, scratch.view(np.uint64))
        np.subtract(seq_lens, st[1], out=st[3])
        if np.maximum.reduce(st[4]) >= base.limit:
            return False
        if ends is not None:
            self.ends.bind(ends[0], ends[1], checked=ends[2], copy=ends[3])
        if ends is not None and self.ends.bound is not None and self._rows_on_device(req_pool_indices, n):
            # the kernels end each last item at seq_lens_dev: nothing to upload
            self._work_list, self._hi_buf, self._dev_ends = None, None, n
            self.fills_reused += 1
            self.advances_in_place += 1
            return True
        k = self._flip  # _next_buffer, inlined
        self._flip = k + 1 if k + 1 < self.staging_buffers else 0
        if self._buf_upload[k] > self._done_upto:
            self._claim(k)
        h = self._host_np[k]
        if self._host_base[k] is base:  # the buffer holds a work list of this build: new ends only
            h[st[2]] = seq_lens
            self._hi_buf, self._dev_ends = k, None  # work_list: these ends, not an in-place step's
        else:
            bs = base.wl.bs
            hi = base.wl.sfx_hi.copy()
            hi[base.last[:n]] = seq_lens
            wl = base.wl._replace(sfx_hi=hi)
            self._write_all(h, wl)
            if base.rows is not None:  # positions n.. keep the build's rows
                h[self._offs["rpi"] : self._offs["rpi"] + bs] = base.rows
                self._host_rows[k] = None
            self._host_base[k] = base
            self.work_list = wl
        self._copy_up(k, n, req_pool_indices)
        self.fills_reused += 1
        return True

    def in_place_headroom(self, seq_lens: np.ndarray) -> Optional[int]:
        """After an in-place ``advance`` to ``seq_lens`` (the first n positions): how many tokens
        every request may still grow before an advance would have to rebuild: ``limit - 1 -
        max(seq_len - last_lo - 1)``, negative past that bound. None when the last advance was
        not in place to these n positions (``steady_step``)."""
        base = self._reuse_base
        n = len(seq_lens)
        if base is None or self._dev_ends != n or not n:
            return None
        d = seq_lens - base.last_lo1[:n]
        if d.min() < 0:
            return None
        return base.limit - 1 - int(d.max())  # negative: past the bound (an advance would rebuild)

    def build_in_place(self, n: int, req_pool_indices: Rows) -> bool:
        """Counts the build just uploaded as an in-place advance to its first ``n`` positions
        (``in_place_headroom``, ``repeat_in_place``), so that the step after a build may be a
        steady replay: True when the kernels end each last item at the device ends (bound) and
        the build's rows are these. The build's host ends are the step's ``seq_lens``, which its
        device ends equal, so the build and its in-place advance to those lengths plan the same
        kernels' work; ``work_list`` then reads the ends from the device, as after an advance."""
        base = self._reuse_base
        if (base is None or self.ends.bound is None or self._work_list is not base.wl or self._hi_buf is not None
                or self._dev_ends is not None or not 0 < n <= base.wl.bs
                or not self._rows_on_device(req_pool_indices, n)):
            return False
        self._dev_ends = n
        return True

    @property
    def revision(self) -> Tuple[int, int, int, int]:
        """Changes with every fill, advance, repeat and upload of this workspace: a steady
        replay that resumes a build after paged steps (``steady_step``) checks that nothing
        touched the workspace since it was armed."""
        return (self.fills_built, self.fills_reused, self.fills_skipped, self._uploads)

    def can_repeat_in_place(self, n: int) -> bool:
        """Whether ``repeat_in_place(n)`` would hold (nothing counted)."""
        return self._dev_ends == n and self._reuse_base is not None

    def repeat_in_place(self, n: int) -> bool:
        """A steady replay (``steady_step``): the in-place advance of the last step holds for
        this one too (the kernels read the new ends on the device), counted as one; False when
        the last advance was not in place to n positions (nothing counted)."""
        if self._dev_ends != n or self._reuse_base is None:
            return False
        self.fills_reused += 1
        self.advances_in_place += 1
        return True

    def _rows_on_device(self, req_pool_indices: Rows, n: int) -> bool:
        """The last upload's first ``n`` rows are ``req_pool_indices[:n]`` (host rows only: the
        same array, or an equal one; the build's padding rows after them stay)."""
        held = self._rows_up
        if held is None or held[1] < n or isinstance(req_pool_indices, torch.Tensor):
            return False
        return (held[0] is req_pool_indices and held[1] == n) or bool(
            np.array_equal(held[0][:n], req_pool_indices[:n]))

    def _prefix_items(self, grouping: Grouping, bs: int, single_prefix_chunk: bool,
                      same_grouping: bool, seq_lens: np.ndarray) -> PrefixItems:
        """``build_prefix_items``, reused while the grouping is unchanged (successive decode
        steps of the same requests), which halves the host work of a step; a build asks the
        launch table (if any) for its wave target from the grouping and ``seq_lens``, and the
        steps reusing it keep that target."""
        memo_key, items = self._prefix_memo
        if same_grouping and items is not None and self._prefix_shape == (bs, single_prefix_chunk):
            return items
        self._prefix_shape = (bs, single_prefix_chunk)
        g = grouping
        key: PrefixKey = (bs, single_prefix_chunk) + tuple(
            a.tobytes() for a in (g.group_start, g.group_len, g.group_req_indptr, g.group_req_idx))
        if memo_key != key or items is None:
            table = self.launch_table
            waves = table.waves_for_step(grouping, seq_lens, self.ratio, self.head_dim) if table else None
            items = build_prefix_items(grouping, bs, ratio=self.ratio, num_kv_heads=self.num_kv_heads,
                                       config=self.config, sm_count=self.sm_count, max_splits=self.max_splits,
                                       single_prefix_chunk=single_prefix_chunk, prefix_waves=waves)  # fmt: skip
            self._prefix_memo = (key, items)
        return items

    def _upload(self, wl: WorkList, req_pool_indices: Rows, base: Optional[ReuseBase] = None) -> None:
        """Writes ``wl`` whole into the next staging buffer and copies it to ``meta``; ``base``:
        the build ``wl`` is (what later advances may rewrite in part)."""
        k = self._next_buffer()
        self._write_all(self._host_np[k], wl)
        self._host_base[k] = base
        self._copy_up(k, wl.bs, req_pool_indices)

    def _write_all(self, h: np.ndarray, wl: WorkList) -> None:
        P, S, o = self.prefix_cap, self.suffix_cap, self._offs
        h[0:3] = (wl.bs, wl.num_prefix_items, wl.num_suffix_items)
        bound = last_item_bound(wl.suffix_chunk, self.config.reuse_chunk_factor)
        h[o["sfx_max"]] = bound
        h[o["sco"]] = int(self._slot_copy_fits(bound))
        n = wl.num_prefix_items
        for j, a in enumerate((wl.pfx_row_lo, wl.pfx_row_hi, wl.pfx_slot_lo, wl.pfx_n_kv, wl.pfx_split)):
            h[o["pfx"] + j * P : o["pfx"] + j * P + n] = a
        n = wl.num_suffix_items
        for j, a in enumerate((wl.sfx_req, wl.sfx_lo, wl.sfx_hi, wl.sfx_row)):
            h[o["sfx"] + j * S : o["sfx"] + j * S + n] = a
        h[o["gidx"] : o["gidx"] + len(wl.group_req_idx)] = wl.group_req_idx
        h[o["pptr"] : o["pptr"] + wl.bs + 1] = wl.part_indptr

    # -------------------------------------------------------------- helpers
    def _slot_copy_fits(self, sfx_max: int) -> bool:
        """A build whose items hold at most ``sfx_max`` tokens is served by the slot copy."""
        return self.slot_copy is not None and sfx_max <= self.slot_copy.shape[1]

    def check_integrity(self) -> None:
        """Assert the last work list is self-consistent, that the device's ``slot_copy_on``
        is what the host believes of the build (``slot_copy_ready``: the planner copies the
        slots before a replay exactly then), and that no arrival counter was left non-zero.
        Debug aid: reads the device (a sync)."""
        wl = self.work_list
        assert wl is not None, "workspace was never filled"
        assert wl.num_partials <= self.partial_cap, f"{wl.num_partials} partial rows > cap {self.partial_cap}"
        wl.check(self.ratio)
        on = bool(int(self.slot_copy_on[0]))
        assert on == self.slot_copy_ready, f"device slot_copy_on={on}, host slot_copy_ready={self.slot_copy_ready}"
        # the fused kernel and KernelConfig.merge_in_kernels reset every counter they count on
        stale = int(torch.count_nonzero(self.counters))
        assert stale == 0, f"{stale} arrival counters non-zero between launches (a launch did not finish its count)"
