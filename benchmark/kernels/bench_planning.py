"""Host cost of planning one decode step, on the code path serving runs.

Default table (``serving``): the scheduler hook (``scheduler_step.on_run_batch``: staging the
batch's rows) followed by ``GraniKVAttnBackend.init_forward_metadata_out_graph`` (plan, path
choice, workspace fill, the wrapped backend's view) for a CUDA-graph step, with the real backend,
HotPrefixTable and CascadeWorkspace on the CPU (the workspace upload is a host memcpy here; on a
GPU it is one pinned non-blocking copy) and a no-op wrapped backend (its metadata work is stock
SGLang's). Successive decode steps of one batch (every ``seq_len`` + 1 per step), Llama-3.1-8B
heads (32q/8kv/128, bf16 KV, 32 layers), 16K prefixes, suffix 256. Batches: ``paged`` (no HOT
prefix), ``homog`` (one shared prefix), ``forestN`` (N prefixes of unequal fan-out). Columns:
``p50``/``p99`` of the per-step planning time the backend records (what /metrics and server info
report), ``hook p50/p99`` the wall time of hook + metadata call together, ``cpu p50/p99`` its thread
CPU time (what the step costs when the host is shared: preemption excluded). Target: plan p50
<= 30 us, p99 <= 80 us.

    python -m benchmark.kernels.bench_planning [--steps 3000] [--device cuda] [--fresh | --both] [--micro]
    python -m benchmark.kernels.bench_planning --steady-ab 5 --steps 1000   # the steady replay off / on
    python -m benchmark.kernels.bench_planning --steps 600 --rows homog:24,forest16:130 --idle-ms 10

``--device cuda``: the workspace on the GPU (pinned staging buffers, non-blocking copies, events:
what each CUDA call costs the host). ``--fresh``: new host ``seq_lens`` and rows tensors every
step (SGLang reuses them; a path that copies them defeats the planner's identity-based reuse);
``--both``: both tables. Section columns: the backend's mean per-step sections (``lookup``: HOT
runs, grouping or its reuse, description; ``choose``; ``fill``: advance or full fill; ``upload``;
``slot_copy``: the pre-replay slot-copy replay (CUDA; a steady replay makes none, its graph
appends the newest slots); ``view``); ``reuse``: share of steps whose work list was advanced
rather than rebuilt.

``--thrash``: between two steps (outside the timing) a pass over ``THRASH_BYTES`` of numpy data and
``THRASH_OBJECTS`` Python objects, as SGLang's scheduler runs its own work between two plans: the
step then finds the host's caches cold, as in serving (where the same steady step measured 4-6x
its back-to-back time; docs/results/gpu_suite.md). ``--idle-ms 10``: the host asleep 10 ms before
every step, as the scheduler waits on a 32-layer decode step; on this repository's CPU machine
a step after such a wait costs about 1.5x one after ``--thrash`` alone, and its p50 is the
closest estimate of serving (docs/results/kernels.md, "Planning cost"). ``--rows homog:24,forest16:130``:
the agent loop's and the forest's decode batches.

``--micro`` adds the old per-function table: ``group`` = plan.group_requests, ``choose`` =
Dispatcher.choose, ``plan`` = both; ``work_list`` = build_work_list; ``step full`` /
``step steady``: BatchDescription, grouping, choose and ``CascadeWorkspace.fill`` without /
with the reuse of the previous step's plan.
"""

import argparse
import dataclasses
import math
import os
import platform
import time
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from benchmark.harness.timing import HostClock, per_call_us, run_for
from granikv.attention.cost.cost_model import CostModel
from granikv.attention.dispatcher import Decision, Dispatcher, Path, PathTimes
from granikv.attention.grouping import BatchDescription, GroupingMemo, group_requests

BATCH_SIZES = (1, 2, 8, 17, 64, 128, 256)
THRASH_BYTES = 8 << 20  # --thrash: numpy bytes written between two steps (more than a core's L2)
THRASH_OBJECTS = 200_000  # --thrash: Python objects (dicts) of which a third are read between two steps
GROUPS = (1, 2, 4, 16)
HOT = 1 << 24


def make_desc(bs: int, groups: int, rng) -> BatchDescription:
    """bs requests over `groups` HOT extents with unequal sizes (weights 1..groups), 16K prefixes."""
    weights = np.arange(1, groups + 1, dtype=np.float64)
    which = rng.choice(groups, size=bs, p=weights / weights.sum())
    hot_len = 16384 - rng.integers(0, 64, bs)
    return BatchDescription(
        req_pool_indices=rng.permutation(bs).astype(np.int64) + 1,
        seq_lens=(hot_len + 256 + rng.integers(0, 64, bs)).astype(np.int64),
        hot_start=(HOT + which * 100_000).astype(np.int64),
        hot_len=hot_len.astype(np.int64),
    )


def work_list_fn(desc: BatchDescription):
    """A closure building the cascade kernels' work list, or None if that module is missing."""
    try:
        from granikv.attention.decode.work_list import build_work_list, default_config
    except Exception as e:  # noqa: BLE001 - optional column
        print(f"# work_list column skipped: {type(e).__name__}: {e}")
        return None
    config = default_config(128)

    def fn(g):
        return build_work_list(
            g, desc.seq_lens, ratio=4, num_kv_heads=8, config=config, sm_count=132, max_splits=32,
        )  # fmt: skip

    return fn


def step_fn(desc: BatchDescription, dispatcher, *, steady: bool):
    """One decode step's host work in the backend, for successive steps of the same batch."""
    from granikv.attention.decode.work_list import default_config
    from granikv.attention.decode.workspace import CascadeWorkspace

    cfg = default_config(128)
    if not steady:
        cfg = dataclasses.replace(cfg, reuse_chunk_factor=0.0)
    ws = CascadeWorkspace(len(desc.seq_lens), 32, 8, 128, "cpu", sm_count=132, config=cfg)
    memo = GroupingMemo()
    step = [0]

    def fn():
        step[0] += 1
        d = BatchDescription(desc.req_pool_indices, desc.seq_lens + step[0], desc.hot_start, desc.hot_len)
        g = memo.group(d, min_group_size=2) if steady else group_requests(d, min_group_size=2)
        dispatcher.choose(g, d)
        ws.fill(g, d.seq_lens, d.req_pool_indices)

    return fn


# ---- the serving path -----------------------------------------------------------------------

HQ, HKV, HD, LAYERS = 32, 8, 128, 32
PREFIX, SUFFIX = 16384, 256
BATCHES = ("paged", "homog", "forest16", "forest64")


class _NoopBackend:
    """The wrapped stock backend, doing nothing (its metadata work is stock SGLang's cost)."""

    forward_metadata = None

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        pass

    def init_forward_metadata(self, fb):
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def get_cuda_graph_seq_len_fill_value(self):
        return 1


class _Cache:
    """The radix cache as the scheduler hook sees it in a steady decode (nothing to promote)."""

    metrics = None

    def apply_pending_promotions(self):
        pass

    def has_pending_promotions(self):
        return False

    def update_requests_hot_prefix(self, reqs):
        pass

    def refresh_gauges(self):
        pass


def serving_setup(bs: int, batch: str, rng, device: str = "cpu", eager_ends: bool = False):
    """A GraniKV backend in graph mode with a cascade graph of size ``bs``, a scheduler and a
    decode batch of ``bs`` requests: ``batch`` in BATCHES. ``device``: where the workspace and
    the batch's device tensors live (``cuda``: pinned staging buffers, real non-blocking
    uploads and events). ``eager_ends``: the cascade graph does not copy its suffix ends itself
    (as before the in-graph copy): each step copies them before the replay."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from granikv.attention.backend import GraniKVAttnBackend
    from granikv.config import GraniKVConfig
    from granikv.mem_cache.hot_prefix_table import HotPrefixTable

    mc = SimpleNamespace(num_attention_heads=HQ, head_dim=HD, num_hidden_layers=LAYERS, context_len=32768,
                         get_num_kv_heads=lambda tp: HKV, hf_config=SimpleNamespace())
    table = HotPrefixTable(bs + 1)
    cuda = device.startswith("cuda")
    # SGLang's req_to_token (zeros: the noop backend reads no KV): what the pre-replay slot copy
    # reads on CUDA, where its graph replay is part of the step's host work; on CPU the copy
    # would run in Triton's interpreter, so the CPU rows plan without it (--granikv-replay-slots table)
    r2t = SimpleNamespace(req_to_token=torch.zeros(bs + 2, PREFIX + SUFFIX + 128, dtype=torch.int32, device=device))
    runner = SimpleNamespace(model_config=mc, ps=SimpleNamespace(attn_tp_size=1), device=device,
                             kv_cache_dtype=torch.bfloat16, server_args=SimpleNamespace(speculative_algorithm=None),
                             token_to_kv_pool_allocator=SimpleNamespace(hot_prefix_table=table),
                             req_to_token_pool=r2t if cuda else None)
    cfg = GraniKVConfig(enable=True, log_interval=0, replay_slots="copy" if cuda else "table")
    be = GraniKVAttnBackend(_NoopBackend(), model_runner=runner, cfg=cfg, backend_name="noop")
    be.init_cuda_graph_state(bs, bs)
    be.graphs.captured.add(bs)  # as a capture of bs would leave it (graph_variants.end_capture) ...
    be.graphs.ends_bound[bs] = True  # ... with its suffix ends bound to the step's device seq_lens
    rows = rng.permutation(bs) + 1
    groups = {"paged": 0, "homog": 1}[batch] if batch in ("paged", "homog") else int(batch[len("forest"):])
    hot_len = PREFIX - rng.integers(0, 64, bs)
    if groups:
        weights = np.arange(1, groups + 1, dtype=np.float64)
        which = rng.choice(groups, size=bs, p=weights / weights.sum())
        table.set_many(rows, 1_000_000 + which * 100_000, hot_len)
    seq = torch.from_numpy(hot_len + SUFFIX + rng.integers(0, 64, bs))
    # SGLang's replay buffers: persistent device and host seq_lens, sliced per step
    host_buf = torch.zeros(2 * bs, dtype=torch.int64, pin_memory=device.startswith("cuda"))
    host_buf[:bs] = seq
    view = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs, num_padding=0,
                           req_pool_indices=torch.from_numpy(rows).to(device), seq_lens=seq.to(device),
                           seq_lens_cpu=host_buf[:bs], seq_lens_sum=int(seq.sum()))
    if not eager_ends:  # the capture's in-graph copy reads SGLang's static seq_lens (planner.in_graph_metadata)
        be.graphs.ends_source[bs] = view.seq_lens.data_ptr()
        if cuda:  # ... and its slot-copy table gets each step's newest slots from the graph (append_suffix_slots)
            be.graphs.slots_appended.add(bs)
    reqs = [SimpleNamespace(req_pool_idx=int(r), kv=SimpleNamespace(req_pool_idx=int(r)))  # 0.5.17, 0.5.23
            for r in rows]
    sched = SimpleNamespace(tree_cache=_Cache(), tp_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=be)),
                            tp_rank=0)
    sbatch = SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs, req_pool_indices_cpu=torch.from_numpy(rows))
    return be, sched, sbatch, view, cfg, host_buf


class Thrash:
    """What a serving process runs between two plans, in miniature: writes ``THRASH_BYTES`` of a
    numpy buffer and reads a third of ``THRASH_OBJECTS`` dicts, so the next step starts with the
    host's caches holding other data (``--thrash``)."""

    def __init__(self) -> None:
        self.buf = np.zeros(THRASH_BYTES, np.int8)
        self.objs = [dict(a=i, b=str(i)) for i in range(THRASH_OBJECTS)]

    def __call__(self) -> int:
        self.buf += 1
        return sum(d["a"] for d in self.objs[::3])


def serving_run(bs: int, batch: str, steps: int, rng, *, device: str = "cpu", fresh: bool = False,
                eager_ends: bool = False, thrash: Optional["Thrash"] = None, steady: bool = True,
                windows: bool = False, idle_s: float = 0.0):
    """Per-step plan times (the backend's record) and hook + metadata wall and thread CPU times,
    in us. Each step refills SGLang's buffers first (outside the timing): the persistent host
    seq_lens buffer in place and a new slice of it, as graph replays do; ``fresh``: a NEW host
    seq_lens tensor and a NEW rows tensor for the batch every step (what a serving path that
    copies them would hand over), which defeats the planner's identity-based reuse. ``thrash``:
    run before each step, outside the timing. ``steady=False``: the planner never arms its steady
    replay (attention/decode/steady_step.py), so every step takes the full plan (the A/B of
    ``--steady-ab``). ``windows``: the step clock's measurement cycle imposed on the choice
    (``clock_windows``). ``idle_s``: the host sleeps this long before each step (after
    ``thrash``), outside the timing, as the scheduler waits on a long GPU step (``--idle-ms``)."""
    import torch

    from granikv.scheduler_step import on_run_batch

    be, sched, sbatch, view, cfg, host_buf = serving_setup(bs, batch, rng, device, eager_ends)
    if not steady:
        be.decode._arm = lambda *a, **k: None  # benchmark knob: the full plan every step
    if windows:
        clock_windows(be.decode.clock)
    rows = sbatch.req_pool_indices_cpu
    cuda = device.startswith("cuda")
    wall = np.zeros(steps)
    cpu = np.zeros(steps)
    clock = HostClock()
    for i in range(steps):
        host_buf[:bs] += 1  # SGLang's own per-step work (buffer fill), outside the timing
        if fresh:
            view.seq_lens_cpu = host_buf[:bs].clone()
            sbatch.req_pool_indices_cpu = rows.clone()
        else:
            view.seq_lens_cpu = host_buf[:bs]
        view.seq_lens_sum += bs
        if cuda and i % 64 == 0:
            torch.cuda.synchronize()  # the GPU keeps up with the host, as in serving
        if thrash is not None:
            thrash()
        if idle_s:
            time.sleep(idle_s)
        clock.start()
        on_run_batch(sched, sbatch, cfg)
        be.init_forward_metadata_out_graph(view)
        wall[i], cpu[i] = clock.stop()
    if cuda:
        torch.cuda.synchronize()
    snap = be.stats_snapshot()
    return snap, 1e6 * wall, 1e6 * cpu


SECTIONS = ("lookup", "choose", "fill", "upload", "slot_copy", "view")


def serving_table(steps: int, *, device: str = "cpu", fresh: bool = False, eager_ends: bool = False,
                  thrash: bool = False, idle_ms: float = 0.0,
                  rows: Sequence[Tuple[str, int]] = ()) -> float:
    """Prints the serving table (``rows``: (batch, bs) pairs; default every batch kind at 64, 128
    and 256 requests); returns the worst p50 over all rows."""
    rng = np.random.default_rng(0)
    evict = Thrash() if thrash else None  # built once for every row of the table
    print(f"# device {device}{' (' + _device_name(device) + ')' if device != 'cpu' else ''}, "
          f"{'FRESH host arrays every step' if fresh else 'SGLang buffers reused'}; "
          f"{'caches COLD (--thrash) at every step; ' if thrash else ''}"
          f"{f'host idle {idle_ms:g} ms before every step; ' if idle_ms else ''}suffix ends copied "
          f"{'before each replay' if eager_ends else 'by the cascade graph'}; section columns: mean us "
          f"per step of the backend's sections (upload = staging-buffer wait + copy + event)")
    print(f"{'batch':>9} {'bs':>4} {'path':>8} {'p50':>7} {'p99':>7} {'mean':>7} {'hook p50':>9} {'hook p99':>9} "
          f"{'cpu p50':>8} {'cpu p99':>8} " + " ".join(f"{s:>7}" for s in SECTIONS) + f" {'reuse':>6}")
    worst = [0.0, 0.0]
    for batch, bs in rows or [(b, n) for b in BATCHES for n in (64, 128, 256)]:
        snap, wall, cpu = serving_run(bs, batch, steps, rng, device=device, fresh=fresh, eager_ends=eager_ends,
                                      thrash=evict, idle_s=idle_ms / 1e3)
        path = max(snap["steps_per_path"], key=snap["steps_per_path"].get)
        p50, p99 = snap["plan_us_p50"], snap["plan_us_p99"]
        worst = [max(worst[0], p50), max(worst[1], p99)]
        w50, w99 = np.percentile(wall, [50, 99])
        c50, c99 = np.percentile(cpu, [50, 99])
        n = snap["planned_steps"] or 1
        sec = snap["plan_sections_us_total"]
        reuse = snap["work_list_reuses"] / max(1, snap["work_list_reuses"] + snap["work_list_builds"])
        print(f"{batch:>9} {bs:>4} {path:>8} {p50:>7.1f} {p99:>7.1f} {snap['plan_us_mean']:>7.1f} "
              f"{w50:>9.1f} {w99:>9.1f} {c50:>8.1f} {c99:>8.1f} "
              + " ".join(f"{sec[s] / n:>7.1f}" for s in SECTIONS) + f" {reuse:>6.2f}", flush=True)
    print(f"# worst plan p50 {worst[0]:.1f} us (target <= 30), worst p99 {worst[1]:.1f} us (target <= 80)")
    return worst


AB_ROWS = (("homog", 64), ("homog", 256), ("forest16", 128), ("forest64", 128), ("paged", 64))
WINDOW_ROWS = (("homog", 64), ("homog", 128), ("homog", 256))


def clock_windows(clock) -> None:
    """Imposes the step clock's measurement cycle on a batch's path choice: the model's path
    for ``WINDOW`` steps, paged for ``WINDOW``, the model's path held for ``HOLD`` (``StepClock``'s
    own constants), as where the clock measures paged against the model's choice."""

    real, step = clock.adjust, [0]
    cycle = 2 * clock.WINDOW + clock.HOLD

    def adjust(decision, key):
        d = real(decision, key)
        k = step[0] % cycle
        step[0] += 1
        return Decision(Path.PAGED, d.times, "clock window") if clock.WINDOW <= k < 2 * clock.WINDOW else d

    clock.adjust = adjust
    clock.keeps = lambda *args: False  # every step's choice through the windows (no kept cascade)


def windows_table(steps: int, *, device: str = "cpu") -> None:
    """Planning with the step clock's windows (``clock_windows``), caches cold before every
    step: the share of steps planned in full (builds, path changes the replay does not take)
    sets the p99 once it passes 1%."""
    from granikv.attention.decode.step_clock import StepClock

    evict = Thrash()
    print(f"# the step clock's windows imposed (paged for {StepClock.WINDOW} of every "
          f"{2 * StepClock.WINDOW + StepClock.HOLD} steps), device {device}, caches COLD at every step, "
          f"{steps} steps per row; us")
    print(f"{'batch':>9} {'bs':>4} {'p50':>7} {'p99':>7} {'hook p99':>9} {'paged':>6} {'replays':>8} "
          f"{'builds':>7} {'full plans':>11}")
    for batch, bs in WINDOW_ROWS:
        snap, wall, _ = serving_run(bs, batch, steps, np.random.default_rng(0), device=device, thrash=evict,
                                    windows=True)
        full = snap["planned_steps"] - snap["steady_replays"]
        print(f"{batch:>9} {bs:>4} {snap['plan_us_p50']:>7.1f} {snap['plan_us_p99']:>7.1f} "
              f"{np.percentile(wall, 99):>9.1f} {snap['steps_per_path'].get('paged', 0):>6} "
              f"{snap['steady_replays']:>8} {snap['work_list_builds']:>7} {full:>5} ({full / steps:.1%})", flush=True)


def steady_ab(steps: int, repeats: int, *, device: str = "cpu") -> None:
    """The steady replay's A/B in one run: each row planned with the replay off and on, in
    turns (``repeats`` times each, caches cold before every step), medians of the per-run p50s;
    ``replays``: the share of steps the replay planned."""
    evict = Thrash()
    print(f"# steady replay A/B, device {device}, caches COLD (--thrash) at every step, {steps} steps per run, "
          f"{repeats} runs per side in turns; medians over runs of the per-run p50 (us)")
    print(f"{'batch':>9} {'bs':>4} {'path':>8} {'plan off':>9} {'plan on':>8} {'ratio':>6} "
          f"{'hook off':>9} {'hook on':>8} {'replays':>8}")
    for batch, bs in AB_ROWS:
        res: dict = {False: ([], []), True: ([], [])}
        share, path = 0.0, "-"
        for _ in range(repeats):
            for steady in (False, True):
                snap, wall, _ = serving_run(bs, batch, steps, np.random.default_rng(0), device=device, thrash=evict,
                                            steady=steady)
                res[steady][0].append(snap["plan_us_p50"])
                res[steady][1].append(float(np.percentile(wall, 50)))
                if steady:
                    share = snap["steady_replays"] / max(1, snap["planned_steps"])
                    path = max(snap["steps_per_path"], key=snap["steps_per_path"].get)
        off, on = (float(np.median(res[k][0])) for k in (False, True))
        hoff, hon = (float(np.median(res[k][1])) for k in (False, True))
        print(f"{batch:>9} {bs:>4} {path:>8} {off:>9.1f} {on:>8.1f} {on / off:>6.2f} {hoff:>9.1f} {hon:>8.1f} "
              f"{share:>8.2f}", flush=True)


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-work-list", action="store_true")
    ap.add_argument("--steps", type=int, default=3000, help="decode steps per serving row")
    ap.add_argument("--micro", action="store_true", help="also the per-function table")
    ap.add_argument("--device", default="cpu",
                    help="where the workspace lives: cpu (default) or cuda[:N] (pinned uploads, events)")
    ap.add_argument("--fresh", action="store_true",
                    help="new host seq_lens and rows tensors every step (identity-based reuse fails)")
    ap.add_argument("--both", action="store_true", help="the table with reused buffers, then with fresh ones")
    ap.add_argument("--eager-ends", action="store_true",
                    help="also the table with the suffix ends copied before each replay (no in-graph copy)")
    ap.add_argument("--thrash", action="store_true",
                    help="also the table with the host's caches made cold before every step (as in serving)")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="also the table with the host asleep this long before every step (the scheduler "
                         "waiting on a long GPU step; 10 ms: a 32-layer decode step), after --thrash if given")
    ap.add_argument("--rows", default="", metavar="BATCH:BS[,BATCH:BS]",
                    help="the serving table's rows (default: every batch kind at 64, 128, 256), e.g. "
                         "homog:24,forest16:130 (the agent loop's and the forest's decode batches)")
    ap.add_argument("--steady-ab", type=int, default=0, metavar="REPEATS",
                    help="only the steady replay's A/B (off / on in turns, caches cold), REPEATS runs per side")
    ap.add_argument("--clock-windows", action="store_true",
                    help="only the table with the step clock's windows imposed (paged for a window per cycle), "
                         "caches cold")
    args = ap.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {cpu_name()} ({os.cpu_count()} cores, load average {load}), python {platform.python_version()}, "
          f"numpy {np.__version__}; serving path, {args.steps} decode steps per row; us per step")
    if args.steady_ab:
        steady_ab(args.steps, args.steady_ab, device=args.device)
        return
    if args.clock_windows:
        windows_table(args.steps, device=args.device)
        return
    rows = [(b, int(n)) for b, n in (r.split(":") for r in args.rows.split(",") if r.strip())]
    for fresh in ((False, True) if args.both else (args.fresh,)):
        serving_table(args.steps, device=args.device, fresh=fresh, rows=rows)
        if args.eager_ends:
            serving_table(args.steps, device=args.device, fresh=fresh, eager_ends=True, rows=rows)
        if args.thrash:
            serving_table(args.steps, device=args.device, fresh=fresh, thrash=True, rows=rows)
        if args.idle_ms:
            serving_table(args.steps, device=args.device, fresh=fresh, thrash=args.thrash, idle_ms=args.idle_ms,
                          rows=rows)
    if not args.micro:
        return

    rng = np.random.default_rng(0)
    dispatcher = Dispatcher(
        CostModel.load(None, None), num_q_heads=32, num_kv_heads=8, head_dim=128,
        kv_dtype_bytes=2, num_layers=32,
    )  # fmt: skip
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"numpy {np.__version__}, pid {os.getpid()}; us per plan, median of {args.repeats} x "
          f"{args.iters}")  # fmt: skip
    warm = make_desc(256, 16, rng)  # let the CPU clock and numpy's caches settle first
    run_for(1.0, lambda: dispatcher.choose(group_requests(warm, min_group_size=2), warm))
    header = f"{'bs':>4} {'G':>3} {'grp':>4} {'group':>8} {'choose':>8} {'plan':>8}"
    header += "" if args.no_work_list else f" {'work_list':>10} {'total':>8} {'step full':>10} {'step steady':>12}"
    print(header)
    worst = worst_step = 0.0
    for bs in BATCH_SIZES:
        for groups in GROUPS:
            if groups > bs:
                continue
            desc = make_desc(bs, groups, rng)
            g = group_requests(desc, min_group_size=2)
            t_group = per_call_us(lambda: group_requests(desc, min_group_size=2), args.iters, args.repeats)
            t_choose = per_call_us(lambda: dispatcher.choose(g, desc), args.iters, args.repeats)
            t_plan = per_call_us(
                lambda: dispatcher.choose(group_requests(desc, min_group_size=2), desc),
                args.iters, args.repeats,
            )  # fmt: skip
            worst = max(worst, t_plan)
            line = f"{bs:>4} {groups:>3} {g.num_groups:>4} {t_group:>8.1f} {t_choose:>8.1f} {t_plan:>8.1f}"
            wl = None if args.no_work_list else work_list_fn(desc)
            if wl is not None:
                t_wl = per_call_us(lambda: wl(g), args.iters // 4 or 1, args.repeats)
                line += f" {t_wl:>10.1f} {t_plan + t_wl:>8.1f}"
                t_full = per_call_us(step_fn(desc, dispatcher, steady=False), args.iters // 4 or 1, args.repeats)
                t_steady = per_call_us(step_fn(desc, dispatcher, steady=True), args.iters // 4 or 1, args.repeats)
                worst_step = max(worst_step, t_steady)
                line += f" {t_full:>10.1f} {t_steady:>12.1f}"
            print(line, flush=True)
    print(f"# worst plan (group + choose): {worst:.1f} us (target < 50 us)")
    if worst_step:
        print(f"# worst steady decode step (plan + workspace fill, reuse on): {worst_step:.1f} us")
    clock_micro(args.iters, args.repeats)


def clock_micro(iters: int, repeats: int) -> None:
    """The step clock's per-step calls (``adjust`` and ``record``) on a steady step, warm: a
    held verdict of the probe (the model chose paged, cascade measured faster: every step of the
    host-bound forest on an H100), a held "paged is slower" verdict, and a choice the clock
    measures nothing for (the cost model trusted)."""
    from granikv.attention.decode.step_clock import StepClock, _SizeState

    t = [0.0]
    clock = StepClock(lambda: t[0], probe_paged=True)
    paged = Decision(Path.PAGED, PathTimes(3000.0, 3050.0, math.inf, math.inf), "paged by the model", True)
    cascade = Decision(Path.CASCADE, PathTimes(3100.0, 3000.0, math.inf, math.inf), "cascade by the model")
    trusted = Decision(Path.CASCADE, PathTimes(9000.0, 3000.0, math.inf, math.inf), "cascade by the model")
    for key, model_paged, paged_wins in (("probe", True, False), ("slower", False, True)):
        st = clock._sizes[key] = _SizeState(measured=Path.CASCADE, model_paged=model_paged)
        st.phase, st.hold_left, st.paged_wins, st.last_a, st.last_b = "hold", 1 << 60, paged_wins, 3.5e-3, 4.1e-3
    clock._interval = 3.5e-3

    def step(d: Decision, key: str) -> Callable[[], None]:
        return lambda: clock.record(clock.adjust(d, key).path, key)

    print("# step clock per steady step (adjust + record), warm: us")
    for name, fn in (("held probe verdict (model paged, cascade measured faster)", step(paged, "probe")),
                     ("held verdict paged (model cascade, measured slower)", step(cascade, "slower")),
                     ("model trusted (nothing measured)", step(trusted, "trusted"))):
        print(f"{per_call_us(fn, iters * 10, repeats):8.2f}  {name}")


if __name__ == "__main__":
    main()
