"""``DecodePlanner``: a decode step's plan (host side, once per step) and run (per layer), its
workspaces and its CUDA-graph state.

Plan: ``plan.group_requests`` (through ``GroupingMemo``) and the dispatcher's ``SteadyChooser``
pick a path; for a non-paged path the step's ``CascadeWorkspace`` is filled and the wrapped
backend is planned with a ``seq_len = 1`` view of the batch (it still writes the step's K/V,
and reads one token). Run: GraniKV's kernels compute every request's attention and overwrite
the wrapped backend's output rows in place.

Graphs (``graph_variants``): every captured batch size has the stock graph and, where the cost
model says cascade can win, a cascade graph. Both graphs of a size read the fixed graph
workspace (sized at ``init_graph_state``, never reallocated) and the wrapped backend's per-size
metadata buffers, refilled before every replay. Eager steps larger than the graph workspace use
a separate eager workspace, grown on demand.

``ctx`` (``AttentionContext``): the model runner, the wrapped backend, the configuration, the
dispatcher and the step counters, read at each call (the backend may replace a field while
serving). The planner owns the step's path, its graph state and the launch plan the kernels
read (``kernels.plan.CascadePlan``); the backend asks, it never writes them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from granikv.attention.context import AttentionContext
from granikv.attention.debug import planted_fault
from granikv.attention.decode.batch_view import (
    OneTokenView,
    SeqLensView,
    device_ends,
    pad_rows,
    real_batch_size,
    same_rows,
    seq_total,
)
from granikv.attention.decode.graph_variants import AUTO_PREFIX_TOKENS, GraphVariants, cascade_can_win
from granikv.attention.decode.launch_table import LaunchTable
from granikv.attention.decode.slot_copy import SLOT_COPY_TOKENS, SlotCopier
from granikv.attention.decode.steady_step import PAGED_HEADROOM, SteadyReplay
from granikv.attention.decode.step_clock import StepClock
from granikv.attention.decode.step_plan import HeldRows, StepPlan
from granikv.attention.decode.view_memo import ViewKey, ViewPlanMemo
from granikv.attention.decode.workspace import CascadeWorkspace
from granikv.attention.dispatcher import Decision, Dispatcher, Path, SteadyChooser
from granikv.attention.grouping import BatchDescription, Grouping, GroupingMemo, verify_same_slots
from granikv.attention.kv_scales import kv_scales
from granikv.attention.step_stats import NO_HOT_PREFIX
from granikv.config import cli_flag
from granikv.kernels.kernel_config import KernelConfig, device_config
from granikv.kernels.plan import CascadePlan

logger = logging.getLogger("granikv")


class DecodePlanner:
    def __init__(self, ctx: AttentionContext):
        self.ctx = ctx
        self.chooser = SteadyChooser(ctx.dispatcher)  # steady steps: O(1) path choice
        # measured end-to-end step time per path (overrules the model where measured otherwise)
        self.clock = StepClock(probe_paged=ctx.cfg.clock_probe == "paged_too")
        self._clock_key: Optional[Tuple[int, int]] = None  # (batch size, groups) of the step being planned
        self.grouping_memo = GroupingMemo()  # steady decode steps reuse the grouping
        self.path = Path.PAGED  # path of the current step
        self.workspace: Optional[CascadeWorkspace] = None  # the graph one once graphs exist
        self.slot_copier: Optional[SlotCopier] = None  # the graph workspace's pre-replay slot copy
        self.slots_copied = False  # this step's replay reads the slot copy, not req_to_token
        self.eager_workspace: Optional[CascadeWorkspace] = None  # eager steps larger than the graph workspace
        self.ws: Optional[CascadeWorkspace] = None  # the workspace of the current step
        self.launch: Optional[CascadePlan] = None  # what the kernels of the current step read
        self.graph_mode = False  # True once CUDA-graph state exists
        self.graphs = GraphVariants(ctx.cfg.cascade_graph_sizes, can_win=self.cascade_can_win)
        self._held: Optional[HeldRows] = None  # the rows of the last plan and what they gave
        self.last_desc: Optional[BatchDescription] = None  # of the last plan (reused while its arrays are)
        self._seq_lens_view = SeqLensView()  # the step's host seq_lens as numpy
        self._capture_metadata: Dict[int, Any] = {}  # bs -> the wrapped backend's metadata of its stock capture
        self._one_token = OneTokenView(ctx.device)  # the batch the wrapped backend plans with
        self.filled_grouping: Optional[Grouping] = None  # grouping of the last fill
        self._filled_ws: Optional[CascadeWorkspace] = None  # workspace of the last fill
        self._t_choose: Optional[float] = None  # perf_counter when this step's path choice began (plan_step's sections)
        self._pad_fill: Optional[int] = None  # seq_len of a graph's padding rows (the wrapped backend's fill value)
        self._ends: Optional[torch.Tensor] = None  # the step's device seq_lens, if the workspace can bind them (_plan)
        self._ends_copy = True  # the step copies its ends before the replay (False: its graph copies them)
        self.launch_table = self._load_launch_table()  # the prefix wave table the workspaces plan with, or None
        self.ends_in_graph_steps = 0  # planned graph steps whose graph copied the suffix ends itself
        self._warned_ends = False  # the warning of a graph step whose seq_lens could not be bound
        self._fault = planted_fault.from_env()  # debug only: NO_FAULT unless GRANIKV_DEBUG_FAULT
        self.view_memo = ViewPlanMemo(ctx.cfg.view_plan == "reuse")  # reuse of the wrapped backend's view plan
        self._steady: Optional[SteadyReplay] = None  # armed by a steady cascade graph step (steady_step)
        self.steady_replays = 0  # steps planned from the armed step
        self._paged_plan: Optional[StepPlan] = None  # this step's grouping where the dispatcher chose paged
        self._no_hot = False  # the last decode step found no HOT run (_no_hot_step)

    def use_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Later steps choose with ``dispatcher`` (e.g. one forced to paged); it becomes the
        context's dispatcher too."""
        self.ctx.dispatcher = dispatcher
        self.chooser = SteadyChooser(dispatcher)
        self._steady = None

    # ---- the backend's step notices (the planner owns the path and the graph state) --------

    def stock_step(self, *, extend: bool) -> None:
        """The next forward runs the wrapped backend alone (an extend batch, a non-graph
        replay or capture of a stock size): paged; an extend also interrupts the step clock."""
        self.path = Path.PAGED
        self._steady = None
        if extend:
            self.clock.interrupt()

    def begin_graph_metadata(self) -> None:
        """Before a graph step's metadata: no cascade graph planned until ``plan_step`` says so."""
        self.graphs.planned_cascade = False

    def reuse_counts(self) -> dict:
        """How often steady steps reused the previous plan (for ``stats_snapshot``)."""
        wss = [w for w in (self.workspace, self.eager_workspace) if w is not None]
        return {"work_list_builds": sum(w.fills_built for w in wss),
                "work_list_reuses": sum(w.fills_reused for w in wss),
                "work_list_in_place": sum(w.advances_in_place for w in wss),
                "ends_in_graph_steps": self.ends_in_graph_steps,
                "view_plans_reused": self.view_memo.reused,
                "view_plans_made": self.view_memo.planned,
                "steady_replays": self.steady_replays,
                "grouping_reuses": self.grouping_memo.hits,
                "choice_reuses": self.chooser.hits,
                **self._host_plan_counts(),
                **self.clock.snapshot(),
                "upload_wait_us_total": 1e6 * sum(w.upload_wait_seconds for w in wss),
                "upload_us_total": 1e6 * sum(w.upload_seconds for w in wss)}

    def _host_plan_counts(self) -> dict:
        """The dispatcher's host planning term (HostPlanTime); empty without a dispatcher."""
        d = self.chooser.dispatcher
        if d is None:
            return {}
        return {"dispatch_host_us_mean": d.host_plan.us, "dispatch_host_samples": d.host_plan.samples}

    def cascade_can_win(self, bs: int) -> bool:
        ctx = self.ctx
        context = getattr(ctx.model_runner.model_config, "context_len", None) or AUTO_PREFIX_TOKENS
        return cascade_can_win(ctx.dispatcher, bs, prefix_tokens=min(context, AUTO_PREFIX_TOKENS),
                               min_group_size=ctx.cfg.min_group_size)

    # ---- workspaces ----------------------------------------------------------------------

    def _new_workspace(self, max_bs: int, slot_copy_tokens: int = 0) -> CascadeWorkspace:
        geo = self.ctx.dispatcher.geometry
        return CascadeWorkspace(max_bs, geo.num_q_heads, geo.num_kv_heads, geo.head_dim, self.ctx.device,
                                slot_copy_tokens=slot_copy_tokens, config=self.kernel_config(),
                                launch_table=self.launch_table)

    def _load_launch_table(self) -> Optional[LaunchTable]:
        """``--granikv-launch-table``'s file, none for ``off``, else this GPU's checked-in table
        where there is one. At startup: a malformed file stops the server naming the flag."""
        path = self.ctx.cfg.launch_table
        if path == "off":
            return None
        try:
            if path is not None:
                table: Optional[LaunchTable] = LaunchTable.load(path)
            else:
                device = torch.device(self.ctx.device)
                on_cuda = device.type == "cuda" and torch.cuda.is_available()
                table = LaunchTable.for_gpu(torch.cuda.get_device_name(device) if on_cuda else None)
        except ValueError as e:
            raise ValueError(f"{cli_flag('launch_table')}: {e}") from e
        if table is not None:
            logger.info("GraniKV: prefix wave targets from %s (%d rules)", table.source, len(table.rules))
        return table

    def kernel_config(self) -> KernelConfig:
        """The kernels' tiles for this model (``tile_config``), with ``--granikv-prefix-kernel``
        where it names one."""
        geo = self.ctx.dispatcher.geometry
        return device_config(geo.num_q_heads // geo.num_kv_heads, geo.head_dim, self.ctx.device,
                             self.ctx.cfg.prefix_kernel)

    def workspace_for(self, bs: int) -> CascadeWorkspace:
        """The workspace a step of ``bs`` requests uses.

        The graph workspace (sized at ``init_graph_state``) is never reallocated: captured
        graphs read its buffers. Eager steps larger than it (more running requests than the
        largest captured graph) get a separate eager workspace, grown on demand.
        """
        if self.graph_mode and self.workspace is not None and bs <= self.workspace.max_bs:
            return self.workspace
        attr = "eager_workspace" if self.graph_mode else "workspace"
        ws = getattr(self, attr)
        if ws is None or ws.max_bs < bs:
            ws = self._new_workspace(max(bs, 2 * ws.max_bs if ws is not None else bs))
            setattr(self, attr, ws)
        self._one_token.ensure(ws.max_bs)
        return ws

    # ---- planning (host side, once per step) -----------------------------------------

    def plan_step(self, fb: Any, staged: Optional[np.ndarray], *, stage_seconds: float, graph: bool) -> Any:
        """A decode step's host work: plan, fill the workspace; returns the batch the wrapped
        backend plans with (``fb`` itself for paged steps, else the ``seq_len = 1`` view), or
        None for a graph step whose wrapped backend's plan of that view is in place
        (``view_memo``: the caller does not call it).
        ``staged``: the batch's ``req_pool_idx`` values (None: not staged). ``graph``: the step
        replays a graph of ``fb.batch_size`` (paged, or cascade where that size has a cascade
        graph). The time of both parts is recorded, with ``stage_seconds`` (the host time the
        scheduler hook spent staging this step)."""
        if not self.ctx.hot_prefix_table.rows_held:  # no request holds a HOT run: nothing to plan
            return self._no_hot_step(fb, stage_seconds)
        self._no_hot = False
        c0, t0 = time.thread_time(), time.perf_counter()
        self.clock.tick()
        self._t_choose = self._clock_key = None
        self._ends_copy = True
        steady, self._steady = self._steady, None
        self._paged_plan = None
        decided = None
        if steady is not None:
            taken, view, decided = self._replay(fb, staged, steady, graph, c0, t0, stage_seconds)
            if taken:
                return view
        plan = self._plan(fb, staged, graph=graph, decided=decided)
        t1 = time.perf_counter()
        tc = self._t_choose or t1
        self.path = Path.PAGED if plan is None else plan.decision.path  # graph steps: paged or cascade
        upload = slot_copy = 0.0
        self.slots_copied = False
        if plan is not None:
            ws = self.workspace_for(fb.batch_size)
            upload = self._fill_workspace(ws, plan, fb)
            self.ws, self.launch = ws, (ws.graph_plan if graph else ws.plan)
            copier = self.slot_copier
            if graph and copier is not None and copier.ws is ws and ws.slot_copy_ready:
                c1 = time.perf_counter()
                copier.run()  # before the replay, and before SGLang's read-done event
                slot_copy = time.perf_counter() - c1
                self.slots_copied = True
            if not self._ends_copy:
                self.ends_in_graph_steps += 1
            if self.ctx.cfg.debug_integrity:  # host lengths (the work list) vs the kernels' device ends
                ws.ends.check_integrity(plan.desc.seq_lens)
        self.graphs.planned_cascade = graph and plan is not None
        self.clock.record(self.path, self._clock_key or (fb.batch_size, 0))
        view = self._finish(fb, plan is not None, graph, c0, (t0, tc, t1, time.perf_counter()), stage_seconds,
                            upload, slot_copy)
        chosen = plan if plan is not None else self._paged_plan  # a step the dispatcher decided
        if chosen is not None:
            self._arm(fb, staged, chosen, graph)
        return view

    def _no_hot_step(self, fb: Any, stage_seconds: float) -> Any:
        """A decode step while no request holds a HOT run (``HotPrefixTable.rows_held`` is 0: a
        server whose prefixes never paid for a promotion, or whose HOT holders all finished):
        no grouping can form, so the wrapped backend plans the real batch as in stock SGLang,
        and the step costs a count and its time in the planning record. The first such step
        after a planned one interrupts the step clock (the next interval spans unmeasured
        steps), drops any armed replay (the table changed since it was armed) and forgets the
        wrapped backend's view plan (it now plans the real batch); none of them is set again
        before the next planned step, so the steps after it touch less."""
        t0 = time.perf_counter()
        self.path = Path.PAGED
        self.slots_copied = False
        self.graphs.planned_cascade = False
        if not self._no_hot:
            self._no_hot = True
            self._steady = self._paged_plan = None
            self.clock.interrupt()
            self.view_memo.forget()
        bs = real_batch_size(fb)
        self.ctx.stats.record_no_hot(bs, time.perf_counter() - t0 + stage_seconds)
        return fb

    def _replay(self, fb: Any, staged: Optional[np.ndarray], s: SteadyReplay, graph: bool, c0: float, t0: float,
                stage_seconds: float) -> Tuple[bool, Any, Any]:
        """The step planned from the armed one (``steady_step``): ``(True, view, None)`` when
        taken (the wrapped backend's batch, as ``plan_step`` returns it); ``(False, None,
        decision)`` when the batch matches but the path choice changed in a way the replay does
        not take (the full plan goes on with that decision: the clock has sampled this step);
        ``(False, None, None)`` when it does not match (nothing done). A cascade replay's step
        chosen paged is taken as a paged excursion, and a paged excursion's step chosen back to
        its cascade path resumes that build where its headroom allows (``steady_step``)."""
        ctx, chooser = self.ctx, self.chooser
        total = seq_total(fb, self._pad_fill) if chooser.hint_ok else None
        if total is None or not s.matches(fb.batch_size, staged, getattr(ctx.hot_prefix_table, "version", None),
                                          graph, fb.seq_lens.data_ptr(), total):
            return False, None, None
        tc = time.perf_counter()
        plan, path = s.plan, s.path
        decision = self._kept(s, total) if path is Path.CASCADE else None
        if decision is None:
            decision = chooser.choose(plan.grouping, plan.desc, graph_safe_only=s.graph, seq_total=total)
            if chooser.dispatcher.forced is None:
                decision = self.clock.adjust(decision, s.clock_key)
        steps, resumed = 1, False
        if decision.path is not path:
            if path is not Path.PAGED and decision.path is Path.PAGED:  # the build stays for a resume
                s = s.paged_excursion(StepPlan(plan.grouping, plan.desc, decision), total)
                path, steps = Path.PAGED, 0
            else:
                steps = s.resume_steps(decision.path, fb.seq_lens.data_ptr(), total)
                if not steps:
                    return False, None, decision
                r = s.resume
                assert r is not None and r.ws is not None  # resume_steps found the kept replay
                if not r.ws.repeat_in_place(r.n):
                    return False, None, decision
                s, path, resumed = r, r.path, True
        elif s.ws is not None and not s.ws.repeat_in_place(s.n):
            return False, None, decision
        t1 = time.perf_counter()
        s.advance(total, steps)
        self.path = path
        self.steady_replays += 1
        slot_copy = 0.0
        self.slots_copied = False
        if s.copy_slots:  # the replay reads the slot copy: made current before it, or by its graph
            if not s.appends or resumed:  # (the stock graph of the paged steps appended nothing)
                copier = self.slot_copier
                assert copier is not None
                c1 = time.perf_counter()
                copier.run()
                slot_copy = time.perf_counter() - c1
            self.slots_copied = True
        cascade = path is not Path.PAGED
        self.ends_in_graph_steps += cascade
        self.graphs.planned_cascade = cascade
        ctx.stats.record_counts(decision, s.counts)
        self.clock.record(path, s.clock_key)
        view = self._finish(fb, cascade, graph, c0, (t0, tc, t1, time.perf_counter()), stage_seconds, 0.0, slot_copy)
        self._steady = s
        return True, view, None

    def _kept(self, s: SteadyReplay, total: int) -> Optional[Decision]:
        """A cascade replay's decision where it stays cascade, taken without this step's times:
        the chooser prices cascade cheapest again (``SteadyChooser.kept_saving``, the same
        floats as ``choose``), the clock keeps it (``StepClock.keeps``) and the workspace's
        in-place advance holds. The path, reason and counters come out as ``choose`` and
        ``adjust`` give them; None: the caller runs those two (nothing was changed)."""
        if s.ws is None or not s.ws.can_repeat_in_place(s.n):
            return None
        chooser = self.chooser
        saving = chooser.kept_saving(s.plan.grouping, graph_safe_only=s.graph, seq_total=total)
        if saving is None or not self.clock.keeps(s.clock_key, Path.CASCADE, saving):
            return None
        return chooser.kept()

    def _finish(self, fb: Any, cascade: bool, graph: bool, c0: float, marks: Tuple[float, float, float, float],
                stage_seconds: float, upload: float, slot_copy: float) -> Any:
        """The batch the wrapped backend plans with (the one-token view on a GraniKV path; None
        for a graph step whose view plan is in place, ``view_memo``: the wrapped backend is not
        called and no view is made) and the step's recorded times; ``marks``: perf_counter at the
        step's start, its path choice, its fill and the end of its bookkeeping. A GraniKV path's
        time also feeds the dispatcher's host term."""
        t0, tc, t1, t2 = marks
        if graph and self.view_memo.in_place(self.view_key(fb)):
            view = None  # the wrapped backend's plan of this view is in place (view_memo): no view
        else:
            view = self._one_token.of(fb) if cascade else fb
        t3 = time.perf_counter()
        self.ctx.stats.record_plan_time(
            t3 - t0 + stage_seconds, choose=t1 - t0, fill=t3 - t1, stage=stage_seconds, cpu=time.thread_time() - c0,
            sections=(stage_seconds, tc - t0, t1 - tc, t2 - t1 - upload - slot_copy, upload, slot_copy, t3 - t2))
        if cascade:
            self.chooser.dispatcher.host_plan.observe(t3 - t0 + stage_seconds)
        return view

    def _arm(self, fb: Any, staged: Optional[np.ndarray], plan: StepPlan, graph: bool) -> None:
        """Arms the steady replay after a step the dispatcher decided (``plan.decision``): a
        paged one, or a cascade graph step whose graph copied its own suffix ends and whose
        workspace advanced in place (``steady_step``)."""
        if self.ctx.cfg.debug_integrity:  # its checks need the full plan every step
            return
        seq_lens = plan.desc.seq_lens
        version = getattr(self.ctx.hot_prefix_table, "version", None)
        if staged is None or version is None or not self.chooser.hint_ok:
            return
        total = int(np.add.reduce(seq_lens))
        if seq_total(fb, self._pad_fill) != total:  # the replay measures growth by SGLang's totals
            return
        path, ws, room = plan.decision.path, None, PAGED_HEADROOM
        if path is not Path.PAGED:
            ws = self.ws
            if not graph or self._ends_copy or ws is None or ws is not self.workspace:
                return
            left = ws.in_place_headroom(seq_lens)
            if left is None and ws.build_in_place(len(seq_lens), staged):  # a build: its ends are the device's
                left = ws.in_place_headroom(seq_lens)
            if left is None or left < 1:
                return
            room = left
        copy = self.slots_copied  # (never on a paged step)
        self._steady = SteadyReplay(fb.batch_size, staged, version, fb.seq_lens.data_ptr(), total, room, plan,
                                    path, graph, ws, len(seq_lens), self._clock_key or (fb.batch_size, 0), copy,
                                    appends=copy and fb.batch_size in self.graphs.slots_appended)

    def _plan(self, fb: Any, staged: Optional[np.ndarray], graph: bool, decided: Any = None) -> Optional[StepPlan]:
        """The step's plan, or None for the paged path (decode batches only). ``decided``: the
        step's path decision, already made (``_replay``)."""
        ctx, stats = self.ctx, self.ctx.stats
        bs = real_batch_size(fb)
        if staged is None or len(staged) != bs or fb.seq_lens_cpu is None:
            stats.unplanned += 1
            return None
        if graph and not self.graphs.has_cascade_graph(fb.batch_size):
            stats.record_paged(bs, "no cascade graph of this batch size")
            return None
        table = ctx.hot_prefix_table
        version = getattr(table, "version", None)
        held = self._held
        if (held is not None and held.version == version and version is not None
                and (held.rows is staged or same_rows(staged, held.rows))):
            hot_start, hot_len, grouping = held.hot_start, held.hot_len, held.grouping  # same rows and table
            held.rows = staged  # equal rows in a new array: held from now on (identity)
        else:
            hot_len = table.length_np[staged]
            hot_start = table.start_np[staged] if hot_len.any() else None
            grouping = None
            held = self._held = HeldRows(staged, version, hot_start, hot_len)
        if hot_start is None:  # no request starts with a HOT run: nothing to group
            stats.record_paged(bs, NO_HOT_PREFIX)
            return None
        seq_lens = self._seq_lens_view(fb.seq_lens_cpu, bs)
        if seq_lens is None:  # fewer host lengths than requests: not a batch to plan
            stats.unplanned += 1
            return None
        if grouping is None:
            desc = BatchDescription(staged, seq_lens, hot_start, hot_len)
            grouping = self.grouping_memo.group(desc, min_group_size=ctx.cfg.min_group_size)
            if (hot_len <= seq_lens).all():  # then the grouping does not depend on seq_lens
                held.grouping = grouping
        else:  # the arrays of the step that made this grouping: known to match
            last = self.last_desc
            if (last is not None and last.seq_lens is seq_lens and last.hot_len is hot_len
                    and last.req_pool_indices is staged):
                desc = last
            else:
                desc = BatchDescription.unchecked(staged, seq_lens, hot_start, hot_len)
            self.grouping_memo.hits += 1
        self.last_desc = desc
        if grouping.num_groups == 0:
            stats.record_paged(bs, "no group")
            return None
        if ctx.cfg.debug_integrity and grouping.num_groups and not verify_same_slots(grouping, desc, ctx.req_to_token):
            logger.error("GraniKV: grouped requests do not all hold their group's HOT slots "
                         "(stale HotPrefixTable); this step runs paged")
            stats.unplanned += 1
            return None
        self._t_choose = time.perf_counter()
        self._clock_key = (fb.batch_size, grouping.num_groups)  # one measurement per batch shape
        if decided is not None:
            decision = decided
        else:
            decision = self.chooser.choose(grouping, desc, graph_safe_only=graph,
                                           seq_total=seq_total(fb, self._pad_fill))
            if self.chooser.dispatcher.forced is None:  # a forced path is never overruled
                decision = self.clock.adjust(decision, self._clock_key)
        if decision.path is not Path.PAGED:
            self._ends = device_ends(fb, self.workspace_for(fb.batch_size))
            reason = None
            if graph:  # the cascade graph ends each suffix where its capture bound the ends (or did not)
                reason, copied = self.graphs.ends_binding(fb.batch_size, self._ends)
                # debug: the integrity check reads the ends before the replay
                self._ends_copy = not copied or ctx.cfg.debug_integrity
            if reason is not None:
                if self._ends is None:
                    self._warn_ends(fb)
                stats.record_paged(bs, reason)
                return None
        stats.record(decision, grouping)
        if decision.path is Path.PAGED:
            self._paged_plan = StepPlan(grouping, desc, decision)  # a steady replay may repeat this choice
            return None
        return StepPlan(grouping, desc, decision)

    def _warn_ends(self, fb: Any) -> None:
        if self._warned_ends:
            return
        t = getattr(fb, "seq_lens", None)
        logger.warning("GraniKV: a decode graph step's seq_lens (%s) cannot be copied to the cascade workspace on "
                       "%s; such steps replay the stock graph",
                       None if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}", self.ctx.device)
        self._warned_ends = True

    def _fill_workspace(self, ws: CascadeWorkspace, plan: StepPlan, fb: Any) -> float:
        """Advances or fills the step's workspace ``ws``; returns the seconds its upload took."""
        up0 = ws.upload_seconds
        grouping, desc, decision = plan.grouping, plan.desc, plan.decision
        same = grouping is self.filled_grouping and ws is self._filled_ws
        ends = self._ends  # checked against this workspace in _plan
        if same and ws.advance(desc.seq_lens, desc.req_pool_indices, bs=fb.batch_size,
                               single_prefix_chunk=decision.path is Path.BGEMM, seq_lens_dev=ends,
                               ends_checked=True, ends_copy=self._ends_copy):
            return ws.upload_seconds - up0  # a steady step: only the suffix ends changed
        seq_lens, rpi = pad_rows(desc.seq_lens, desc.req_pool_indices, fb.batch_size)
        filled = grouping.with_group_len(self._fault.group_len(grouping.group_len)).padded(fb.batch_size)
        ws.fill(filled, seq_lens, rpi, single_prefix_chunk=decision.path is Path.BGEMM, same_grouping=same,
                seq_lens_dev=ends, ends_copy=self._ends_copy)
        self.filled_grouping, self._filled_ws = grouping, ws  # held: `is` stays meaningful
        return ws.upload_seconds - up0

    # ---- CUDA graphs -------------------------------------------------------------------------

    def init_graph_state(self, max_bs: int) -> None:
        """After the wrapped backend's ``init_cuda_graph_state``: the fixed graph workspace."""
        self._steady = None
        self.graphs.captured.clear()
        self.graphs.ends_bound.clear()
        self.graphs.ends_source.clear()
        self.graphs.slots_appended.clear()
        self._capture_metadata.clear()
        fill = getattr(self.ctx.inner, "get_cuda_graph_seq_len_fill_value", None)
        try:
            self._pad_fill = int(fill()) if fill is not None else None
        except Exception:  # noqa: BLE001 - an unknown fill value only costs the array sum
            self._pad_fill = None
        ws = self.workspace = self._new_workspace(
            max_bs, SLOT_COPY_TOKENS if self.ctx.cfg.replay_slots == "copy" else 0)
        self._one_token.ensure(max_bs)
        self.slot_copier = None
        if ws.slot_copy is not None:
            self.slot_copier = SlotCopier(ws, lambda: self.ctx.req_to_token)
            self.slot_copier.capture()
        self.graph_mode = True

    def capture_metadata_for(self, fb: Any) -> None:
        """Metadata of a decode graph capture. The stock graph of a size (``graphs.capturing``
        is not this size): the wrapped backend alone, as stock SGLang captures it. The cascade
        graph of a size (captured right after its stock graph): GraniKV's kernels over an empty
        work list (they read the live counts at replay), and the wrapped backend with ``seq_len =
        1`` through the buffers of the stock capture, refilled as a replay refills them (a
        second ``in_capture`` would make the wrapped backend allocate new per-size buffers, and
        the stock graph would then read stale ones)."""
        inner = self.ctx.inner
        bs = fb.batch_size
        self._steady = None
        if self.graphs.capturing != bs:
            self.path = Path.PAGED
            inner.init_forward_metadata_out_graph(fb, in_capture=True)
            self._capture_metadata[bs] = getattr(inner, "forward_metadata", None)
            return
        self.path = Path.CASCADE
        ws = self.ws = self.workspace_for(bs)
        ws.fill_empty(device_ends(fb, ws))  # the graph reads the runner's static seq_lens
        self.launch = ws.graph_plan  # with a slot-copy table, the kernels read it where the step made one
        self.graphs.record_capture_ends(ws.ends.bound is not None)  # what its kernels read, per replay
        view = self._one_token.of(fb)
        if bs in self._capture_metadata:
            inner.init_forward_metadata_out_graph(view)
            inner.forward_metadata = self._capture_metadata[bs]
        else:  # no stock capture of this size before (not SGLang's order): a fresh one
            inner.init_forward_metadata_out_graph(view, in_capture=True)

    def in_graph_metadata(self, fb: Any) -> None:
        """SGLang's in-graph metadata hook (recorded into the graph being captured; its warm-up
        runs call it eagerly): the cascade graph of a size whose capture bound the suffix ends
        copies them from the batch's device ``seq_lens`` itself (SGLang's static buffer, which
        every replay refills first), so a replay of it launches no copy before it
        (``graphs.ends_source``)."""
        ws = self.ws
        bs = fb.batch_size
        if self.graphs.capturing != bs or self.path is Path.PAGED or ws is None or ws.ends.bound is None:
            return
        seq_lens = fb.seq_lens
        ws.ends.copy_from(seq_lens, bs)  # fits: checked when the capture bound them (device_ends)
        self.graphs.record_capture_ends_source(seq_lens.data_ptr())
        loc = getattr(fb, "out_cache_loc", None)
        if (ws.slot_copy is not None and isinstance(loc, torch.Tensor) and loc.dim() == 1 and loc.shape[0] >= bs
                and loc.device == ws.device and loc.dtype in (torch.int32, torch.int64)):
            from granikv.kernels.suffix_slots import append_suffix_slots

            append_suffix_slots(ws.buffers, loc, ws.ends.buffer)  # the step's newest slots into the copy
            self.graphs.record_capture_appends()

    def view_key(self, fb: Any) -> Optional[ViewKey]:
        """What the wrapped backend's plan of this replay step is a function of, where the step
        planned its size's cascade graph (the one-token view, ``view_memo``); None otherwise."""
        held = self._held
        if not self.graphs.planned_cascade or held is None:
            return None
        return (fb.batch_size, held, held.version)

    def replay_runs_kernels(self) -> bool:
        """This step's decode-graph replay runs GraniKV's kernels (its size's cascade graph)."""
        return self.graph_mode and self.graphs.planned_cascade

    def replay_reads_req_to_token(self) -> bool:
        """This step's replay runs GraniKV's kernels and they read ``req_to_token`` (no slot
        copy was made before it: ``--granikv-replay-slots table``, or a build whose suffix
        items are wider than the copy)."""
        return self.replay_runs_kernels() and not self.slots_copied

    # ---- compute (per layer) -----------------------------------------------------------------

    def run(self, q: torch.Tensor, layer: Any, o: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> None:
        """The planned path's kernels over layer ``layer``: every request's attention into ``o``;
        ``sinks`` [Hq]: the layer's attention-sink logits (the merge adds them), or None."""
        from granikv.kernels import cascade as kernels

        ctx, plan = self.ctx, self.launch
        if plan is None:
            raise RuntimeError("GraniKV decode kernels called before a step was planned")
        pool = ctx.kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        q3 = q.view(-1, ctx.num_q_heads, ctx.head_dim)
        out = o.view(-1, ctx.num_q_heads, ctx.head_dim)
        run = {Path.FUSED: kernels.fused_cascade_attention,
               Path.BGEMM: kernels.bgemm_cascade_attention}.get(self.path, kernels.cascade_attention)
        k_scale, v_scale = kv_scales(layer)
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
            sinks = sinks.float().contiguous()  # the merge reads fp32 (gpt-oss keeps bf16 sinks)
        run(q3, k_buf, v_buf, ctx.req_to_token, plan, sm_scale=layer.scaling, out=out, k_scale=k_scale,
            v_scale=v_scale, sinks=sinks)
