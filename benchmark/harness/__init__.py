"""What every benchmark shares: engine subprocesses, engine arguments, counters, timers, result files.

- ``engine_proc``: run one engine (or server) in its own process group, parse its tagged
  stdout lines into records, kill the whole group on exit, timeout or error; the command and
  environment of a child that runs a benchmark module (``python -m benchmark.…``).
- ``engine_args``: the engine arguments every benchmark starts from, ``--engine-arg`` parsing,
  GraniKV's pass-through keys, the same arguments as ``launch_server`` flags.
- ``engine_child``: the child side of an ``sglang.Engine`` benchmark: one engine, one workload
  row measured per call (tok/s, TTFT/TPOT, KV peak, GraniKV's counters), the GPU-idle probe.
- ``model_config``: the shipped model configs and a model folder for dummy weights.
- ``counters``: GraniKV's counters in server info and their increase over a row.
- ``latency``: percentiles of per-request latencies.
- ``records``: merging the tagged records of several runs.
- ``resident_engine``: an engine child that stays up and measures rows on request.
- ``server_proc``: a launched SGLang server, its endpoints and logs.
- ``gpu_idle``: GPU idle time per decode step from a profiler trace.
- ``timing``: the kernel benchmarks' timers (GPU time, host wall time).
- ``results``: write JSON atomically (a run killed mid-write keeps the previous file), markdown,
  and a matplotlib figure when matplotlib is importable.

Modules import each other absolutely (``from benchmark.harness import engine_proc``): run the
benchmarks as modules from the repository root.
"""
