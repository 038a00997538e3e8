"""What every benchmark script shares: engine subprocesses, tagged records, result files.

- ``engine_proc``: run one engine (or server) in its own process group, parse its tagged
  stdout lines into records, kill the whole group on exit, timeout or error.
- ``results``: write JSON atomically (a run killed mid-write keeps the previous file), markdown,
  and a matplotlib figure when matplotlib is importable.

Scripts under benchmark/ are not a package: they put ``benchmark/`` on ``sys.path`` and import
``harness`` (see benchmark/multi_agent/run.py).
"""
