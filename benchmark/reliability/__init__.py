"""The GPU soak of a launched server (``python3 -m benchmark.reliability.soak``) and its parts."""
