"""``granikv-demo``: the multi-agent workload, short.

With a CUDA GPU and SGLang's GPU stack it runs the short end-to-end benchmark (baseline SGLang
vs SGLang + GraniKV, ``benchmark/multi_agent/run.py --quick``) and writes its results into a new
temporary folder or ``--out``. Without one it runs the CPU walk-through: N agents sharing one
long prefix, each with a private suffix, several turns (output + a tool result appended each
turn), through the REAL SGLang pools (ReqToTokenPool, MHATokenToKVPool on CPU) and GraniKV's
allocator and radix cache, in SGLang's scheduler call order (the test suite's
``scheduler_sim``: it runs from a source checkout). Per decode step it prints HOT/COLD
occupancy, promotions, the groups the attention planner forms, and the KV bytes one decode step
of Llama-3.1-8B would read with and without the shared HOT prefix. It ends with an integrity
check: every slot free again and every request's KV bit-identical to what was written.
"""

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    from granikv.kernels.plan import Grouping

LLAMA_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K+V, 32 layers, 8 kv heads, dim 128, bf16

DESCRIPTION = """\
The multi-agent workload, short: many agents share one long prefix, each adds a private suffix.

On a machine without a CUDA GPU (or with --cpu) it runs the CPU walk-through: the agents go
through SGLang's real KV pools and GraniKV's allocator and radix cache in SGLang's scheduler
order; per decode step it prints HOT/COLD occupancy, promotions, the shared-prefix groups the
planner forms and the KV bytes a Llama-3.1-8B decode step would read with and without them, and
it ends with an integrity check. It measures storage and planning, not speed.

On a CUDA GPU with SGLang's GPU stack (pip install "granikv[serve]") and a GraniKV checkout
(for benchmark/multi_agent/run.py) it runs the short benchmark instead: SGLang vs
SGLang + GraniKV on Llama-3.1-8B-shaped dummy weights, flashinfer backend (~3 min), and writes
multi_agent.{json,md,png} into --out (default: a new temporary folder, printed at the end)."""

EPILOG = """\
The shape options (--agents ... --print-every, --seed) size the CPU walk-through; the GPU
benchmark has fixed rows (run.py --quick: 16K shared prefix x 64 agents, its no-long-prefix
ceiling and a no-sharing row). For other GPU rows run `python -m benchmark.multi_agent.run` from the checkout's root."""


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="granikv-demo", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="Run the CPU walk-through even when a GPU is present.")
    p.add_argument("--out", metavar="DIR",
                   help="GPU: folder for the benchmark's results (default: a new temporary "
                        "folder). Never the checked-in docs/results. CPU: not used.")
    p.add_argument("--agents", type=int, default=8,
                   help="CPU: number of agents sharing the prefix (default 8).")
    p.add_argument("--prefix", type=int, default=2048,
                   help="CPU: shared prefix length in tokens (default 2048).")
    p.add_argument("--suffix", type=int, default=64,
                   help="CPU: private suffix tokens per agent (default 64).")
    p.add_argument("--turns", type=int, default=3,
                   help="CPU: turns per agent; each turn is one prefill and --decode decode "
                        "steps (default 3).")
    p.add_argument("--decode", type=int, default=24,
                   help="CPU: output tokens per agent per turn (default 24).")
    p.add_argument("--tool", type=int, default=16,
                   help="CPU: tool-result tokens appended to each agent's context after a "
                        "turn (default 16).")
    p.add_argument("--print-every", type=int, default=8,
                   help="CPU: print a table row every N decode steps (default 8).")
    p.add_argument("--seed", type=int, default=0,
                   help="CPU: seed of the random token ids (default 0).")
    args = p.parse_args(argv)
    for name in ("agents", "prefix", "suffix", "turns", "decode", "tool", "print_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"granikv-demo: --{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not args.cpu and _gpu_available():
        return _run_gpu_benchmark(args)
    return run_cpu_walkthrough(args)


# ---- GPU: the short benchmark -----------------------------------------------------------------


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _run_gpu_benchmark(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("sgl_kernel") is None:
        print("granikv-demo: a GPU is present but SGLang's GPU stack is not installed "
              "(`pip install 'granikv[serve]'` provides it); running the CPU walk-through.")
        return run_cpu_walkthrough(args)
    script = _find_benchmark()
    if script is None:
        print("granikv-demo: a GPU is present, but benchmark/multi_agent/run.py was not found "
              "(run from a GraniKV checkout); falling back to the CPU walk-through.")
        return run_cpu_walkthrough(args)
    checkout = script.parents[2]
    out = _results_dir(args.out, checkout=checkout)
    cmd = [sys.executable, "-m", "benchmark.multi_agent.run", "--quick", "--out", str(out)]
    print("granikv-demo: GPU found; running the short benchmark:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=checkout)  # the benchmarks run as modules from the checkout's root
    print(f"granikv-demo: results in {out}", flush=True)
    return rc


def _results_dir(out: Optional[str], *, checkout: Path) -> Path:
    """``--out`` or a new temporary folder; never the checkout's checked-in docs/results."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="granikv-demo-"))
    path = Path(out).resolve()
    checked_in = (checkout / "docs" / "results").resolve()
    if path == checked_in or checked_in in path.parents:
        raise SystemExit(f"granikv-demo: --out={out} is the checked-in {checked_in}; pick "
                         "another folder (benchmark/multi_agent/run.py regenerates those pages)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _find_benchmark() -> Optional[Path]:
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        script = root / "benchmark" / "multi_agent" / "run.py"
        if script.is_file():
            return script
    return None


# ---- CPU: the walk-through ----------------------------------------------------------------


def _scheduler_sim() -> Tuple[Any, Any]:
    """``(Sim, SimConfig)`` of the test suite's scheduler simulator (``test/support``): the CPU
    walk-through runs from a source checkout (``pip install -e .``)."""
    support = Path(__file__).resolve().parents[2] / "test" / "support"
    if not (support / "scheduler_sim.py").is_file():
        raise SystemExit(f"granikv-demo --cpu drives the test suite's scheduler simulator, not "
                         f"found at {support / 'scheduler_sim.py'}: run it from a source checkout "
                         f"(git clone, then pip install -e .)")
    if str(support) not in sys.path:
        sys.path.insert(0, str(support))
    from scheduler_sim import Sim, SimConfig

    return Sim, SimConfig


def run_cpu_walkthrough(args: argparse.Namespace) -> int:
    from granikv.attention.grouping import BatchDescription, group_requests
    Sim, SimConfig = _scheduler_sim()

    rng = random.Random(args.seed)
    private = args.suffix + args.turns * (args.decode + args.tool)
    max_context = args.prefix + private + 8
    kv_size = 4 * (args.prefix + args.agents * private) + 64
    cfg = SimConfig(kv_size=kv_size, layers=2, kv_heads=2, head_dim=4, max_reqs=args.agents + 4,
                    max_context=max_context, vocab=61, hot_fraction=0.4,
                    min_tokens=min(1024, max(16, args.prefix // 2)), min_sharers=2,
                    seed=args.seed)
    sim = Sim(cfg, debug_checks=True)
    print(f"granikv-demo: CPU walk-through (no GPU used): {args.agents} agents, shared prefix "
          f"{args.prefix}, suffix {args.suffix}, {args.turns} turns x {args.decode} tokens "
          f"(+{args.tool} tool tokens); real SGLang pools ({kv_size} KV slots: "
          f"shared by COLD and HOT, HOT capped at {sim.allocator.hot_capacity}), "
          f"GraniKV allocator + radix cache.")
    tok = lambda n: [rng.randrange(cfg.vocab) for _ in range(n)]  # noqa: E731
    prefix = tok(args.prefix)
    contexts = [prefix + tok(args.suffix) for _ in range(args.agents)]
    sim.admit(prefix + tok(1))  # one request caches the shared prefix, as in serving
    sim.finish(next(iter(sim.live.values())))
    header = (f"{'turn':>4} {'step':>4} | {'HOT used/cap':>15} {'COLD used/cap':>15} | "
              f"{'prom':>4} {'groups':>6} {'grouped':>7} | {'KV read/step paged':>18} "
              f"{'GraniKV':>9} {'saving':>6}")
    print(header + "\n" + "-" * len(header))
    totals = [0, 0]
    for turn in range(args.turns):
        reqs = [sim.prefill_begin(list(c)) for c in contexts]  # one extend batch
        if any(r is None for r in reqs):
            print("granikv-demo: out of KV slots (raise the pool size)")
            return 1
        sim.promote()  # the plugin's step before run_batch
        for r in reqs:
            sim.prefill_end(r)
        for step in range(args.decode):
            for r in reqs:
                sim.decode(r, rng.randrange(cfg.vocab))
            table = sim.cache.hot_prefix_table
            desc = BatchDescription.from_table(
                np.array([r.req_pool_idx for r in reqs], dtype=np.int64),
                np.array([r.kv_committed_len for r in reqs], dtype=np.int64),
                table.start_np, table.length_np)
            g = group_requests(desc, min_group_size=2)
            paged = int(desc.seq_lens.sum())
            shared = paged - int(g.prefix_len.sum()) + int(g.group_len.sum())
            totals[0] += paged
            totals[1] += shared
            if step % args.print_every == 0 or step == args.decode - 1:
                _print_step(sim, turn, step, g, paged, shared)
        for i, r in enumerate(reqs):  # the turn's output and a tool result join the context
            contexts[i] = list(r.tokens) + tok(args.tool)
            sim.finish(r)
        sim.check()
    sim.drain()
    sim.check()
    sim.assert_all_free()
    m = sim.cache.metrics
    print(f"\nKV bytes read by decode attention over the run (Llama-3.1-8B shapes): paged "
          f"{_gib(totals[0])}, GraniKV {_gib(totals[1])} ({totals[0] / max(totals[1], 1):.1f}x "
          f"less). Promotions {m.promotions} ({m.promoted_tokens} tokens, shadow heads "
          f"{m.shadow_head_tokens}), HOT evictions {m.hot_evictions}, splits {m.hot_splits}, "
          f"copied {m.bytes_copied} B.")
    print("Integrity: every request's KV matched what was written; after draining, every "
          "slot is free and every lock count is zero. (CPU path: this measures storage and "
          "planning, not speed; on a GPU `granikv-demo` runs the benchmark.)")
    return 0


def _print_step(sim: Any, turn: int, step: int, g: "Grouping", paged: int, shared: int) -> None:
    sim.cache.refresh_gauges()
    m = sim.cache.metrics
    print(f"{turn:>4} {step:>4} | {m.hot_used_tokens:>7}/{m.hot_capacity:<7} "
          f"{m.cold_used_tokens:>7}/{m.cold_capacity:<7} | {m.promotions:>4} {g.num_groups:>6} "
          f"{g.num_grouped:>7} | {_gib(paged):>18} {_gib(shared):>9} "
          f"{paged / max(shared, 1):>5.1f}x")


def _gib(tokens: int) -> str:
    return f"{tokens * LLAMA_8B_KV_BYTES_PER_TOKEN / 2**30:.2f} GiB"


if __name__ == "__main__":
    sys.exit(main())
