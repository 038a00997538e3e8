"""The multi-agent benchmark (``run``), its workloads and report, the floor (``bounds``) and the
regime grid (``regimes``)."""
