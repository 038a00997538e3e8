"""The end-to-end correctness check on a context-sensitive model (``python3 -m benchmark.correctness.check``)."""
