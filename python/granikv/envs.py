"""GraniKV's environment variables: every one starts with ``GRANIKV_`` and is read here only.

``GRANIKV_DEBUG_FAULT``: debug only, never for serving. Plants a known error in the decode
attention so that an end-to-end correctness check (benchmark/correctness/check.py) can show it
detects one; see ``attention/debug/planted_fault.py`` for the values. Unset or empty:
no fault.
"""

import os

DEBUG_FAULT = "GRANIKV_DEBUG_FAULT"


def debug_fault() -> str:
    """The planted-fault name, ``""`` when none (validated by ``planted_fault.from_name``)."""
    return os.environ.get(DEBUG_FAULT, "").strip()
