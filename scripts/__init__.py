"""Repository scripts (run as files: ``python scripts/results_tables.py --check``); a package so
that the tests import them as ``scripts.<name>``."""
