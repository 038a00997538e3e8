"""The prefix launch's wave target per step shape, from a table measured on the GPU.

``KernelConfig.prefix_waves`` is one number for every step: 1.5 waves of prefix programs, so
that the suffix launch (on its own stream) finds SM slots beside them. Measured sweeps found no
single value best everywhere (docs/results/kernels.md, "The SM split with the new default"):
the best split of the SMs between the two launches depends on how many query rows a group
stacks per kv head and how long its prefix is. The number of programs is a host-side choice of
the work list (``work_list.build_prefix_items``), not a compiled one, so it can change per step
under the same captured CUDA graph as long as the workspace's capacity covers the largest
target (``LaunchTable.max_prefix_waves``).

A step's key is its dominant group (the most prefix work: members x prefix length): its query
rows per kv head (``members * ratio``) and its prefix length; and the batch's mean suffix
length per request, which sets how much work the suffix launch brings beside the prefix launch
(the same 16K x 64 step measured fastest at 1.75 waves with 64-token suffixes and at 1.5 with
256-token ones). A rule ``(head_dim, max_rows, max_prefix, max_suffix, prefix_waves)`` matches
a step of that head_dim with at most ``max_rows`` rows, a prefix of at most ``max_prefix``
tokens and a mean suffix of at most ``max_suffix``; the first matching rule in (max_rows,
max_prefix, max_suffix) order gives the waves, no match keeps ``config.prefix_waves``.

The tables are checked in per GPU like the cost models (``data/launch_table_<gpu slug>.json``),
made by ``benchmark/kernels/launch_table_fit.py`` from a ``bench_attention --matrix`` run with
wave variants; no file for a GPU: every step keeps the config's waves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from granikv.attention.cost.cost_model import DATA_DIR, gpu_slug
from granikv.kernels.plan import Grouping

__all__ = ["LaunchRule", "LaunchTable", "rules_of", "table_path"]

WAVES_RANGE = (0.5, 4.0)  # what a rule may ask for (a table outside it is refused at load)


@dataclass(frozen=True)
class LaunchRule:
    head_dim: int
    max_rows: int  # query rows per kv head of the step's dominant group, at most
    max_prefix: int  # its prefix tokens, at most
    max_suffix: int  # the batch's mean suffix tokens per request, at most
    prefix_waves: float


@dataclass(frozen=True)
class LaunchTable:
    """Rules sorted by (head_dim, max_rows, max_prefix, max_suffix); ``gpu`` and ``source`` say
    where they come from."""

    rules: Tuple[LaunchRule, ...]
    gpu: str = ""
    source: str = "<rules>"

    def __post_init__(self) -> None:
        lo, hi = WAVES_RANGE
        for r in self.rules:
            if not lo <= r.prefix_waves <= hi or min(r.max_rows, r.max_prefix, r.max_suffix, r.head_dim) < 1:
                raise ValueError(f"launch table {self.source}: rule {r} outside the allowed ranges "
                                 f"(prefix_waves in [{lo}, {hi}], positive bounds)")
        object.__setattr__(self, "rules", tuple(sorted(self.rules, key=lambda r: (
            r.head_dim, r.max_rows, r.max_prefix, r.max_suffix))))

    @property
    def max_prefix_waves(self) -> float:
        """The largest wave target any rule asks for (0 for an empty table): what a workspace's
        prefix capacity must cover."""
        return max((r.prefix_waves for r in self.rules), default=0.0)

    def waves_for(self, head_dim: int, rows: int, prefix: int, suffix: float) -> Optional[float]:
        """The wave target of a step whose dominant group stacks ``rows`` query rows per kv head
        over a ``prefix``-token extent, in a batch of ``suffix`` suffix tokens per request on
        average, or None (no rule: the config's)."""
        for r in self.rules:
            if r.head_dim == head_dim and rows <= r.max_rows and prefix <= r.max_prefix and suffix <= r.max_suffix:
                return r.prefix_waves
        return None

    def waves_for_step(self, grouping: Grouping, seq_lens: np.ndarray, ratio: int, head_dim: int) -> Optional[float]:
        """``waves_for`` of the grouping's dominant group (the most members x prefix tokens) and
        the batch's mean suffix (``seq_lens`` minus each request's prefix)."""
        if not grouping.num_groups or not len(seq_lens):
            return None
        size = grouping.group_size
        g = int(np.argmax(size * grouping.group_len))
        suffix = float(np.add.reduce(seq_lens) - np.add.reduce(grouping.prefix_len)) / len(seq_lens)
        return self.waves_for(head_dim, int(size[g]) * ratio, int(grouping.group_len[g]), suffix)

    def to_mapping(self) -> Dict[str, Any]:
        return dict(gpu=self.gpu, rules=[dict(head_dim=r.head_dim, max_rows=r.max_rows, max_prefix=r.max_prefix,
                                              max_suffix=r.max_suffix, prefix_waves=r.prefix_waves)
                                         for r in self.rules])

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "<mapping>") -> LaunchTable:
        try:
            rules: List[LaunchRule] = [LaunchRule(int(r["head_dim"]), int(r["max_rows"]), int(r["max_prefix"]),
                                                  int(r["max_suffix"]), float(r["prefix_waves"]))
                                       for r in values["rules"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"launch table {source}: malformed ({type(e).__name__}: {e}); expected "
                             "{'gpu': ..., 'rules': [{head_dim, max_rows, max_prefix, max_suffix, "
                             "prefix_waves}, ...]}") from e
        return cls(tuple(rules), str(values.get("gpu", "")), source)

    @classmethod
    def load(cls, path: str) -> LaunchTable:
        with open(path) as f:
            try:
                values = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"launch table {path}: not JSON ({e})") from e
        return cls.from_mapping(values, source=path)

    @classmethod
    def for_gpu(cls, gpu_name: Optional[str]) -> Optional[LaunchTable]:
        """The checked-in table of this GPU, or None where there is none."""
        if not gpu_name:
            return None
        path = table_path(gpu_name)
        return cls.load(path) if os.path.exists(path) else None


def table_path(gpu_name: str) -> str:
    return os.path.normpath(os.path.join(DATA_DIR, f"launch_table_{gpu_slug(gpu_name)}.json"))


def rules_of(entries: Sequence[Tuple[int, int, int, int, float]]) -> Tuple[LaunchRule, ...]:
    """``(head_dim, max_rows, max_prefix, max_suffix, prefix_waves)`` tuples as rules (tests, the fit)."""
    return tuple(LaunchRule(int(h), int(r), int(p), int(sfx), float(w)) for h, r, p, sfx, w in entries)
