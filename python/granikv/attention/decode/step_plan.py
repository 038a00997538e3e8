"""What the decode planner derives from a step and keeps for the next: ``StepPlan`` (a step
planned for a GraniKV path) and ``HeldRows`` (the last step's rows and what they gave)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from granikv.attention.dispatcher import Decision
from granikv.attention.grouping import BatchDescription, Grouping


@dataclass(frozen=True, eq=False)
class StepPlan:
    """A decode step planned for a GraniKV path: its grouping, batch and the path decision."""

    grouping: Grouping
    desc: BatchDescription
    decision: Decision


@dataclass(eq=False)
class HeldRows:
    """The rows of the last planned step and what was derived from them while the HOT-prefix
    table keeps its ``version``: their HOT runs and, once known not to depend on ``seq_lens``,
    their grouping (steady steps reuse all three)."""

    rows: np.ndarray
    version: Any
    hot_start: Optional[np.ndarray]
    hot_len: np.ndarray
    grouping: Optional[Grouping] = None
