"""A deliberate, debug-only decode error, so a correctness check can prove it catches one.

``GRANIKV_DEBUG_FAULT=half_prefix`` (envs.py): every group's prefix attention covers only the
first half of its HOT extent, while each request's suffix still starts after the whole prefix::

    HOT extent  | p0 ... p(n/2-1) | p(n/2) ... p(n-1) |   COLD suffix  | s0 ... |
    read        | <--- read ----> | <--- skipped ---> |                | <-- read

so the second half of every shared prefix silently drops out of the context (the kind of
error a wrong extent or a stale HOT table would make). Data outside the extent is never read:
the fault cannot fault the device. Without the variable the backend holds ``NO_FAULT``, whose
methods return their input.
"""

import logging

import numpy as np

from granikv import envs

logger = logging.getLogger("granikv")


class NoFault:
    """The null object: decode plans pass through unchanged."""

    name = ""

    def group_len(self, group_len: np.ndarray) -> np.ndarray:
        return group_len


class HalfPrefix(NoFault):
    """Each group's prefix part reads the first ``max(1, len // 2)`` slots of its extent."""

    name = "half_prefix"

    def group_len(self, group_len: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(group_len) // 2, 1).astype(np.asarray(group_len).dtype)


NO_FAULT = NoFault()
FAULTS = {f.name: f for f in (HalfPrefix(),)}


def from_name(name: str) -> NoFault:
    """The fault called ``name`` (``""``: none). Raises ValueError naming the variable."""
    envs.check_debug_value(envs.DEBUG_FAULT, name, FAULTS)
    if not name:
        return NO_FAULT
    logger.error("GraniKV: %s=%s is set: decode attention is deliberately WRONG (debug only)",
                 envs.DEBUG_FAULT, name)
    return FAULTS[name]


def from_env() -> NoFault:
    return from_name(envs.debug_fault())
