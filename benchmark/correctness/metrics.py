"""Agreement between two engines' greedy outputs on the same prompts, and the pass rule.

Greedy decoding of a context-sensitive model (checkpoint.py) diverges at some token even
between two correct kernels (bf16 rounding differs); after that token the contexts differ and
nothing more can be compared. So every measure stops at each request's first differing token:

    request:   t0 t1 t2 t3 t4 t5 ...     (output ids of engine A)
               t0 t1 t2 u3 ...           (engine B)
                        ^ first difference: 3 agreeing tokens of 6, logprobs compared at 0..2

- ``agreement``: agreeing tokens before each request's first difference / all output tokens;
- ``first_token_agreement``: share of requests whose first output token agrees (that token
  comes from the prefill, so it checks the extend path);
- ``logprob_dev_mean``: mean |logprob_A - logprob_B| of the chosen token over the agreeing
  positions;
- ``agreement_stderr``: the standard error of the mean of the per-request agreeing shares
  (each near 0 or 1: one early near-tie flip costs a whole request), the noise ``agreement``
  carries at this request count.

A comparison passes when it agrees at least as well as two correct stock backends do with
each other on the same prompts, less ``AGREEMENT_MARGIN``, and its logprob deviation is within
``LOGPROB_FACTOR`` x theirs + ``LOGPROB_SLACK``. A wrong prefix drives agreement toward 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

AGREEMENT_MARGIN = 0.05
LOGPROB_FACTOR = 3.0
LOGPROB_SLACK = 0.02


@dataclass(frozen=True)
class Outputs:
    """One engine's outputs on one workload: per request, output ids and their logprobs
    (``logprobs[i][t]`` of ``ids[i][t]``; None where the engine gave none)."""

    ids: Sequence[Sequence[int]]
    logprobs: Sequence[Sequence[Optional[float]]]

    def __post_init__(self):
        if len(self.ids) != len(self.logprobs):
            raise ValueError(f"{len(self.ids)} id lists but {len(self.logprobs)} logprob lists")

    @classmethod
    def from_json(cls, d) -> "Outputs":
        return cls(ids=d["ids"], logprobs=d["logprobs"])

    def to_json(self):
        return {"ids": [list(x) for x in self.ids], "logprobs": [list(x) for x in self.logprobs]}


@dataclass(frozen=True)
class Comparison:
    agreement: float
    first_token_agreement: float
    logprob_dev_mean: Optional[float]  # None: no agreeing position had logprobs on both sides
    compared_tokens: int  # positions the logprob deviation averages over
    agreement_stderr: Optional[float] = None  # None: fewer than two requests


def _agreeing_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def compare(a: Outputs, b: Outputs) -> Comparison:
    """A against B (symmetric). Raises ValueError when they cover different request counts."""
    if len(a.ids) != len(b.ids):
        raise ValueError(f"{len(a.ids)} requests vs {len(b.ids)}: not the same prompts")
    same = total = first = 0
    devs, shares = [], []
    for xa, xb, la, lb in zip(a.ids, b.ids, a.logprobs, b.logprobs):
        n = _agreeing_prefix(xa, xb)
        same += n
        total += max(len(xa), len(xb))
        shares.append(n / max(len(xa), len(xb), 1))
        first += n > 0
        devs += [abs(p - q) for p, q in zip(la[:n], lb[:n]) if p is not None and q is not None]
    requests = len(a.ids)
    return Comparison(
        agreement=same / total if total else 1.0,
        first_token_agreement=first / requests if requests else 1.0,
        logprob_dev_mean=sum(devs) / len(devs) if devs else None,
        compared_tokens=len(devs),
        agreement_stderr=_stderr(shares),
    )


def _stderr(xs: Sequence[float]) -> Optional[float]:
    n = len(xs)
    if n < 2:
        return None
    mean = sum(xs) / n
    return (sum((x - mean) ** 2 for x in xs) / (n - 1) / n) ** 0.5


def passes(c: Comparison, reference: Comparison) -> bool:
    """Whether ``c`` is as close to the baseline as the cross-backend ``reference`` is."""
    if c.agreement < reference.agreement - AGREEMENT_MARGIN:
        return False
    if c.first_token_agreement < reference.first_token_agreement - AGREEMENT_MARGIN:
        return False
    if c.logprob_dev_mean is None or reference.logprob_dev_mean is None:
        return True  # agreement alone decides (no logprobs to compare)
    return c.logprob_dev_mean <= LOGPROB_FACTOR * reference.logprob_dev_mean + LOGPROB_SLACK
