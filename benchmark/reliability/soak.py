"""GPU soak of a launched SGLang server with GraniKV on, then a baseline server.

    python3 -m benchmark.reliability.soak --out $OUT
    python3 -m benchmark.reliability.soak --dry-run          # the plan, nothing launched

Method. One process, stdlib only on the client side (no aiohttp, no sglang import):

1. Plan (seeded, pure): ``--requests`` requests built from the multi-agent workloads
   (benchmark/multi_agent/workloads.py): *shared* requests (``workloads.homogeneous``
   families with 2K/4K/8K shared prefixes and private suffixes of 64-512 tokens), *agent_loop*
   sessions (``workloads.agent_loop``, 3-4 turns each, a turn's prompt = the previous context +
   its output + a tool result) and *no_sharing* prompts (``workloads.no_sharing``, 1K/2K).
   Families are used in a sliding window over the run (5 of 18 shared families, 2 of 6 agent
   families at a time), so prefixes come, are promoted to HOT while shared, and go cold again;
   their total size exceeds the COLD pool, which forces COLD (radix LRU) and HOT evictions.
   Outputs are 16-64 tokens (greedy, ignore_eos). ``--abort-frac`` of the requests (exactly,
   none of the sample) are aborted, a third each: ``before_first_token`` (the connection is
   closed right after the request is sent), ``mid_stream`` (closed after k streamed chunks) and
   ``endpoint`` (``POST /abort_request {"rid": ...}`` after k chunks, the stream then read to
   its end).
2. GraniKV server: ``python -m sglang.launch_server --enable-granikv --max-total-tokens N``
   (dummy weights, token ids, flashinfer, ``--enable-metrics``, log to a file). Warm-up, a
   quiet run of the identity sample (``pre``), the idle KV level (``/v1/loads``
   ``num_used_tokens``: slots held by requests, i.e. neither free nor evictable cache), then the
   soak: ``--concurrency`` client threads take jobs in plan order (an agent session's turns run
   back to back) until all are sent or ``--budget-s`` is spent. A monitor polls ``/v1/loads``
   and ``/server_info`` for the peaks (KV used, HOT / COLD occupancy).
3. Checks once the server is idle again: ``/health`` and ``/health_generate`` answer 200, KV
   usage is back to the idle level (slots leaked = used now - used at idle before; SGLang's own
   idle invariant check also raises on any COLD mismatch, which would kill the scheduler), no
   error line in the server log since it became ready (Traceback, Exception, ``*Error``, leak,
   CUDA error, ...; start-up lines are listed apart, not counted), no
   failed non-aborted request (HTTP error, missing or short output, an abort finish reason).
   GraniKV counters (promotions, HOT evictions, ...) come from ``/server_info``
   ``internal_states[0]["granikv"]``, COLD evictions from ``/metrics``
   (``sglang:evicted_tokens_total``). Then ``/flush_cache`` and the ``post`` sample run.
4. Baseline server (the same flags without ``--enable-granikv``, and GraniKV's COLD capacity as
   its ``--max-total-tokens``: the same scheduler token budget): the same sample twice.
   A sample run flushes the cache, caches each shared prefix of the sample with one request,
   then sends the whole sample as ONE batched ``/generate`` (fixed order, greedy, 32 tokens),
   the same way on both servers. Identity: GraniKV ``post`` vs baseline ``A`` must be at least
   as identical as baseline ``A`` vs ``B`` (bf16 batch effects). Also reported: GraniKV ``pre``
   vs ``post`` and the soak's own outputs of the sample prompts (under load) vs baseline.

Writes soak.json, soak.md and both server logs into ``--out`` (default docs/results/runs);
exit status 0 only if every check passes.

Modules: ``soak_load`` (the plan, the client threads, the monitor, the sample run),
``soak_client`` (streamed and batched ``/generate``, the aborts, the edge inputs),
``soak_checks`` (log scan, output comparison, counter deltas, the verdicts), ``soak_report``
(figures, markdown, the files); the launched-server lifecycle is benchmark/harness/server_proc.py.
This file: the server commands, the two phases and the command line. Every server runs in its own process group, killed
on exit, on exceptions, on SIGTERM and at the hard ``--timeout-s`` (which writes what was
measured so far first). The load phase stops early enough to leave ``RESERVE_S`` for the checks
and the baseline server.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmark.harness.counters import counter_delta
from benchmark.harness.engine_args import BASE_ENGINE_KWARGS, server_flags
from benchmark.harness.engine_proc import engine_env
from benchmark.harness.model_config import write_model_dir
from benchmark.harness.server_proc import (
    Server,
    free_port,
    http_call,
    kill_all,
    kill_group,
    log_size,
    start_server,
    tail,
    wait_ready,
)
from benchmark.reliability.soak_checks import evaluate, identity, metric_delta, scan_server_log, trim_log
from benchmark.reliability.soak_client import context_tokens, edge_inputs
from benchmark.reliability.soak_load import (
    AGENT_FAMILIES,
    AGENT_PREFIXES,
    AGENT_TURNS,
    AGENT_WINDOW,
    MIX,
    NO_SHARING_LENS,
    OUT_CHOICES,
    SHARED_FAMILIES,
    SHARED_PREFIXES,
    SHARED_SUFFIXES,
    SHARED_WINDOW,
    Monitor,
    Plan,
    Soak,
    build_plan,
    describe_plan,
    kv_budget,
    run_sample,
    snapshot_idle,
    wait_idle,
    warm_up,
)
from benchmark.reliability.soak_report import summary_lines, write_report
from granikv.config import GraniKVConfig

# Engine settings of the offline GPU host recipe (harness.engine_args.BASE_ENGINE_KWARGS), as launch_server
# flags; the log level is the soak's own (--log-level).
BASE_SERVER_FLAGS = server_flags({k: v for k, v in BASE_ENGINE_KWARGS.items() if k != "log_level"})
GRANIKV_DEFAULT_HOT_FRACTION = GraniKVConfig().hot_fraction
RESERVE_S = 160.0  # kept after the load phase: drain, checks, baseline start + sample, stops
READY_TIMEOUT_S = 240.0
DISCONNECT_ABORT_S = 3.0  # SGLang aborts a disconnected stream 2 s after the disconnect


def server_command(args: argparse.Namespace, model_dir: str, port: int, *, granikv: bool) -> List[str]:
    """launch_server flags. The baseline's KV budget is GraniKV's COLD capacity: both schedulers
    then budget the same tokens, so they admit and batch the identity sample the same way."""
    cmd = [sys.executable, "-m", "sglang.launch_server"] if not args.launcher else shlex.split(args.launcher)
    budget = kv_budget(args.max_total_tokens, hot_fraction_of(args))
    cmd += ["--model-path", model_dir, *BASE_SERVER_FLAGS, "--attention-backend", args.backend,
            "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens",
            str(budget["slots"] if granikv else budget["cold"]), "--log-level", args.log_level]
    if not args.no_metrics:
        cmd.append("--enable-metrics")
    for extra in args.server_arg:
        cmd += shlex.split(extra)
    if granikv:
        cmd.append("--enable-granikv")
        if args.hot_fraction is not None:
            cmd += ["--granikv-hot-fraction", str(args.hot_fraction)]
        for extra in args.granikv_arg:
            cmd += shlex.split(extra)
    return cmd


def granikv_phase(args, plan: Plan, server: Server, result: Dict[str, Any], t_end: float) -> None:
    """Start, warm, sample (pre), soak, checks, sample (post), stop. Fills result in place."""
    rec: Dict[str, Any] = result["servers"].setdefault("granikv", {})
    start_server(server, engine_env(args.backend))
    print(f"== granikv: {shlex.join(server.cmd)}", flush=True)
    rec["ready_s"] = wait_ready(server, READY_TIMEOUT_S)
    print(f"== granikv: ready in {rec['ready_s']} s", flush=True)
    warm_up(server)
    info = server.info() or {}
    incremental = bool(info.get("incremental_streaming_output", False))
    result["meta"].update(sglang=info.get("version"), max_total_num_tokens=info.get("max_total_num_tokens"),
                          incremental_streaming_output=incremental)
    g0 = server.granikv() or {}
    rec.update(hot_capacity=g0.get("hot_capacity"), cold_capacity=g0.get("cold_capacity"))
    print(f"== granikv: HOT {g0.get('hot_capacity')} COLD {g0.get('cold_capacity')} slots, "
          f"scheduler budget {info.get('max_total_num_tokens')}", flush=True)
    pre = run_sample(server, plan)
    result["samples"]["granikv_pre"] = pre["outputs"]
    if not wait_idle(server):
        raise RuntimeError("granikv: not idle after warm-up")
    rec["idle_before"] = snapshot_idle(server)
    before_g, before_m = server.granikv() or {}, server.metrics()

    deadline = min(time.time() + args.budget_s, t_end - RESERVE_S)
    print(f"== granikv: soak of {len(plan.requests):,d} requests, concurrency {args.concurrency}, "
          f"load phase at most {deadline - time.time():.0f} s", flush=True)
    soak = Soak(plan, server, concurrency=args.concurrency, deadline=deadline, incremental=incremental)
    result["_soak"] = soak  # the hard timeout writes what is there
    monitor = Monitor(server, soak.progress)
    monitor.start()
    seconds = soak.run()
    monitor.stop_event.set()
    result["soak"] = soak.summary(seconds)
    print(f"== granikv: soak done in {seconds:.0f} s: {soak.progress()}", flush=True)

    time.sleep(max(0.0, soak.last_disconnect + DISCONNECT_ABORT_S - time.time()))
    idle = wait_idle(server)
    if not server.alive():
        rec["health"] = dict(alive=False)
        raise RuntimeError(f"granikv server died (status {server.proc.returncode}); log tail:\n"
                           f"{tail(server.log_path, 20)}")
    rec["health"] = dict(alive=server.alive(), idle=idle is not None,
                         health=server.status("/health"), health_generate=server.status("/health_generate"))
    wait_idle(server, timeout=15)  # the health probe's own request
    rec["idle_after"] = snapshot_idle(server)
    after_g, after_m = server.granikv() or {}, server.metrics()
    rec.update(granikv_before=before_g, granikv_after=after_g,
               granikv_delta=counter_delta(after_g, before_g or {}) if after_g else {},
               metrics_delta=metric_delta(after_m, before_m) if after_m else {})
    ub, ua = rec["idle_before"].get("num_used_tokens"), rec["idle_after"].get("num_used_tokens")
    rec["slots_leaked"] = (ua - ub) if isinstance(ua, int) and isinstance(ub, int) else None
    gd = rec["granikv_delta"]
    rec["evictions"] = dict(cold_evicted_tokens=rec["metrics_delta"].get("cold_evicted_tokens"),
                            hot_evictions=gd.get("hot_evictions"),
                            hot_evicted_tokens=gd.get("hot_evicted_tokens"))

    post = run_sample(server, plan)  # flushes first: the flush check reads the state after it
    result["samples"]["granikv_post"] = post["outputs"]
    result["samples"]["soak"] = [soak.outcomes[i].output_ids if i in soak.outcomes
                                 and soak.outcomes[i].status == "served" else None for i in plan.sample]
    flushed = http_call(server.host, server.port, "POST", "/flush_cache", timeout=60)[0]
    wait_idle(server, timeout=15)
    rec["post_flush"] = dict(flushed=flushed == 200 and pre["flush_status"] == 200
                             and post["flush_status"] == 200, **snapshot_idle(server))
    # scanned before the stop: shutdown noise is not the soak's
    rec["log"] = scan_server_log(server.log_path, server.ready_at, log_size(server.log_path),
                                 args.log_ignore)
    rec["peaks"] = _merge_peaks(monitor.peaks, rec["log"])
    if not args.no_edge_inputs:  # after the log scan: refusing bad input may log an error
        rec["edge_inputs"] = edge_inputs(server, context_tokens(args.model))


def _merge_peaks(polled: Dict[str, float], scan: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(polled)
    out["hot_used_tokens"] = max(polled.get("hot_used_tokens", 0), scan.get("granikv_hot_peak", 0))
    out["cold_used_tokens"] = max(polled.get("cold_used_tokens", 0), scan.get("granikv_cold_peak", 0))
    out["token_usage"] = max(polled.get("token_usage", 0.0), scan.get("decode_token_usage_peak", 0.0))
    return out


def baseline_phase(args, plan: Plan, server: Server, result: Dict[str, Any]) -> None:
    rec: Dict[str, Any] = result["servers"].setdefault("baseline", {})
    start_server(server, engine_env(args.backend))
    print(f"== baseline: {shlex.join(server.cmd)}", flush=True)
    rec["ready_s"] = wait_ready(server, READY_TIMEOUT_S)
    warm_up(server)
    result["samples"]["baseline_a"] = run_sample(server, plan)["outputs"]
    result["samples"]["baseline_b"] = run_sample(server, plan)["outputs"]
    rec["log"] = scan_server_log(server.log_path, server.ready_at, log_size(server.log_path),
                                 args.log_ignore)
    if not args.no_edge_inputs:
        rec["edge_inputs"] = edge_inputs(server, context_tokens(args.model))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="Requests in the plan (default 2000).")
    p.add_argument("--concurrency", type=int, default=64, help="Client threads (default 64).")
    p.add_argument("--abort-frac", type=float, default=0.10,
                   help="Share of the requests aborted by the client (default 0.10).")
    p.add_argument("--max-total-tokens", type=int, default=98304,
                   help="KV slots of the GraniKV server (default 98304 = HOT {hot:,} + COLD {cold:,} "
                        "with GraniKV's default hot fraction); the baseline gets the COLD part."
                        .format(**kv_budget(98304, GRANIKV_DEFAULT_HOT_FRACTION)))
    p.add_argument("--hot-fraction", type=float, default=None,
                   help=f"--granikv-hot-fraction (default: GraniKV's, {GRANIKV_DEFAULT_HOT_FRACTION}).")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="Load phase: no job starts after this many seconds (the checks still run).")
    p.add_argument("--timeout-s", type=float, default=525.0,
                   help="Hard limit of the whole run: servers killed, what was measured written.")
    p.add_argument("--port", type=int, default=30000, help="GraniKV server port (baseline: +2).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, default=48, help="Identity sample size (default 48).")
    p.add_argument("--backend", default="flashinfer", help="Attention backend (default flashinfer).")
    p.add_argument("--model", default="llama-3.1-8b",
                   help="A folder of benchmark/multi_agent/configs or a model folder (dummy weights).")
    p.add_argument("--log-level", default="info", help="Server --log-level (default info).")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAGS",
                   help="Extra launch_server flags for both servers (repeatable, shell-split).")
    p.add_argument("--granikv-arg", action="append", default=[], metavar="FLAGS",
                   help="Extra flags for the GraniKV server only, e.g. '--granikv-debug-integrity' "
                        "(exact HOT/COLD ownership after every step; slow).")
    p.add_argument("--log-ignore", action="append", default=[], metavar="REGEX",
                   help="Server log lines matching this are not counted as errors (repeatable).")
    p.add_argument("--no-metrics", action="store_true", help="Do not pass --enable-metrics.")
    p.add_argument("--no-edge-inputs", action="store_true",
                   help="Skip the edge inputs (empty prompt, prompt over the context, 10^9 new tokens).")
    p.add_argument("--skip-baseline", action="store_true",
                   help="No baseline server (the identity check then fails).")
    p.add_argument("--out", default="docs/results/runs")
    p.add_argument("--dry-run", action="store_true", help="Print the plan and the commands; launch nothing.")
    # a stand-in for `python -m sglang.launch_server` (checks of the harness without a GPU)
    p.add_argument("--launcher", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.timeout_s < RESERVE_S + 60:
        p.error(f"--timeout-s must be at least {RESERVE_S + 60:.0f}")
    return args


def hot_fraction_of(args: argparse.Namespace) -> float:
    return GRANIKV_DEFAULT_HOT_FRACTION if args.hot_fraction is None else args.hot_fraction


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python3", "-m", "benchmark.reliability.soak", *argv])


def base_result(args, argv: Sequence[str], plan: Plan, commands: Dict[str, str]) -> Dict[str, Any]:
    hf = hot_fraction_of(args)
    return dict(
        meta=dict(command=command_line(argv), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  model=args.model, backend=args.backend, seed=args.seed,
                  concurrency=args.concurrency, abort_frac=args.abort_frac,
                  max_total_tokens=args.max_total_tokens, hot_fraction=hf,
                  kv_budget=kv_budget(args.max_total_tokens, hf), budget_s=args.budget_s,
                  timeout_s=args.timeout_s, server_commands=commands, gpu=gpu_name()),
        plan=dict(plan.counts(), kv_tokens=plan.kv_tokens_distinct(),
                  sample_requests=plan.sample, settings=dict(
                      shared_prefixes=SHARED_PREFIXES, shared_suffixes=SHARED_SUFFIXES,
                      shared_families=SHARED_FAMILIES, shared_window=SHARED_WINDOW,
                      agent_prefixes=AGENT_PREFIXES, agent_families=AGENT_FAMILIES,
                      agent_window=AGENT_WINDOW, agent_turns=AGENT_TURNS, no_sharing=NO_SHARING_LENS,
                      out_choices=OUT_CHOICES, mix=MIX)),
        servers={}, samples={}, soak={}, identity={}, durations={})


def gpu_name() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def finish(args, result: Dict[str, Any], t0: float) -> int:
    """Checks, report files, summary; returns the exit status."""
    soak = result.pop("_soak", None)
    if soak is not None and not result.get("soak"):
        result["soak"] = soak.summary(time.time() - t0)
    result["identity"] = identity(result.get("samples") or {})
    result["durations"]["total_s"] = round(time.time() - t0, 1)
    result["checks"] = evaluate(result)
    result["ok"] = all(c["ok"] for c in result["checks"]) and not result.get("failure")
    paths = write_report(args.out, result)
    print("\n".join(summary_lines(result)), flush=True)
    print(f"wrote {', '.join(str(p) for p in paths)}", flush=True)
    return 0 if result["ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.time()
    t_end = t0 + args.timeout_s
    plan = build_plan(args.requests, seed=args.seed, abort_frac=args.abort_frac, sample_size=args.sample)
    hf = hot_fraction_of(args)
    port_g = args.port if args.dry_run else free_port(args.port)
    port_b = args.port + 2 if args.dry_run else free_port(args.port + 2)
    model_dir = tempfile.mkdtemp(prefix="granikv_soak_model_") if not args.dry_run else "<model dir>"
    servers = dict(granikv=server_command(args, model_dir, port_g, granikv=True),
                   baseline=server_command(args, model_dir, port_b, granikv=False))
    commands = {k: shlex.join(v) for k, v in servers.items()}
    print("\n".join(describe_plan(plan, kv_budget(args.max_total_tokens, hf))))
    for name, cmd in commands.items():
        print(f"{name} server: {cmd}")
    print(f"load phase <= {args.budget_s:.0f} s, whole run <= {args.timeout_s:.0f} s "
          f"(reserve after the load phase {RESERVE_S:.0f} s), out {args.out}", flush=True)
    if args.dry_run:
        return 0

    write_model_dir(args.model, model_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = base_result(args, argv, plan, commands)
    g = Server("granikv", servers["granikv"], out / "soak_server_granikv.log", "127.0.0.1", port_g)
    b = Server("baseline", servers["baseline"], out / "soak_server_baseline.log", "127.0.0.1", port_b)

    def scan_if_missing(server: Server) -> None:
        """A phase cut short (exception, hard timeout) still gets its log scanned."""
        rec = result["servers"].get(server.name)
        if rec is not None and "log" not in rec and server.proc is not None:
            rec["log"] = scan_server_log(server.log_path, server.ready_at,
                                         log_size(server.log_path), args.log_ignore)

    def hard_timeout() -> None:
        print(f"HARD TIMEOUT after {args.timeout_s:.0f} s: killing the servers", flush=True)
        kill_all()
        result["failure"] = f"hard timeout after {args.timeout_s:.0f} s"
        try:
            for s in (g, b):
                scan_if_missing(s)
                trim_log(s.log_path)
            finish(args, result, t0)
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
            os._exit(2)

    watchdog = threading.Timer(max(1.0, t_end - time.time()), hard_timeout)
    watchdog.daemon = True
    watchdog.start()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind to the finally below
        signal.signal(sig, lambda *_: sys.exit(143))
    try:
        t = time.time()
        try:
            granikv_phase(args, plan, g, result, t_end)
        except Exception as e:
            traceback.print_exc()
            result["failure"] = f"granikv phase: {type(e).__name__}: {e}"
        finally:
            if g.proc is not None:
                kill_group(g.proc)
            scan_if_missing(g)
            result["durations"]["granikv_phase_s"] = round(time.time() - t, 1)
        if not args.skip_baseline and result["samples"].get("granikv_post") is not None:
            t = time.time()
            try:
                baseline_phase(args, plan, b, result)
            except Exception as e:
                traceback.print_exc()
                result["failure"] = ((result.get("failure") or "")
                                     + f" baseline phase: {type(e).__name__}: {e}")
            finally:
                if b.proc is not None:
                    kill_group(b.proc)
                scan_if_missing(b)
                result["durations"]["baseline_phase_s"] = round(time.time() - t, 1)
        watchdog.cancel()
        for s in (g, b):
            trim_log(s.log_path)
        return finish(args, result, t0)
    except (KeyboardInterrupt, SystemExit) as e:  # SIGINT / SIGTERM: report what was measured
        watchdog.cancel()
        kill_all()
        result["failure"] = f"interrupted ({type(e).__name__})"
        for s in (g, b):
            scan_if_missing(s)
        finish(args, result, t0)
        raise
    finally:
        watchdog.cancel()
        kill_all()
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as e:
        kill_all()
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        kill_all()
        code = 1
    sys.stdout.flush()
    os._exit(code)  # client threads are daemons; do not wait for them
