"""GraniKV's benchmarks, one package run from the repository root.

Every entry point is a module: ``python3 -m benchmark.gpu_suite ...``,
``python3 -m benchmark.multi_agent.run ...``, ``python3 -m benchmark.kernels.calibrate ...``. What
the benchmarks share (engine subprocesses, engine arguments, counters, timers, result files) is
in :mod:`benchmark.harness`.
"""
