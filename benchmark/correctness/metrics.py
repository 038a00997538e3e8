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
- ``agreement_stderr`` / ``agreement_ci95``: the bootstrap standard error and 95% percentile
  interval of ``agreement`` (``BOOTSTRAP_RESAMPLES`` resamples of the requests with
  replacement, seed ``BOOTSTRAP_SEED``): each request's agreeing share is near 0 or 1 (one early
  near-tie flip costs a whole request), so this is the noise ``agreement`` carries at this
  request count.

Token rule (``token_passes``): a comparison ``c`` passes against the two stock backends'
comparison ``ref`` on the same prompts when

    c.agreement >= ref.agreement - max(AGREEMENT_MARGIN, AGREEMENT_Z * diff_stderr)

with ``diff_stderr`` the paired bootstrap standard error of ``c.agreement - ref.agreement``
(both recomputed on the same resampled requests: ``difference_stderr``), i.e. agreement not
significantly (``AGREEMENT_Z`` = 3 sigma, one-sided) below stock-vs-stock and never more than
the margin below it when the noise is smaller. Why 3 and not 2: the check judges 6 rows (3
workloads x 2 backends) at once; at 2 sigma a correct engine fails at least one of them about
13% of the time (1 - 0.977^6), at 3 sigma about 0.8%; the planted fault's agreement (~0.02
against ~0.5) sits far below either bar, and the layer-output rule is the sharp one. The
rule also needs ``c``'s first-token agreement at least ``ref``'s less ``max(AGREEMENT_MARGIN,
AGREEMENT_Z *`` the paired bootstrap stderr of that difference``)`` (``first_token_threshold``) and its
logprob deviation within ``LOGPROB_FACTOR`` x theirs + ``LOGPROB_SLACK``. A wrong
prefix drives agreement toward 0. The check's other rule (the layer outputs) is
``layer_passes``; results.py combines them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

AGREEMENT_MARGIN = 0.05
AGREEMENT_Z = 3.0  # one-sided sigmas of the token rule (module docstring: why 3)
LOGPROB_FACTOR = 3.0
LOGPROB_SLACK = 0.02
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


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
    agreement_stderr: Optional[float] = None  # bootstrap; None: fewer than two requests
    agreement_ci95: Optional[Tuple[float, float]] = None  # bootstrap percentiles; None: as above
    per_request: Tuple[Tuple[int, int], ...] = ()  # (agreeing tokens, output tokens) per request


def _agreeing_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def compare(a: Outputs, b: Outputs) -> Comparison:
    """A against B (symmetric). Raises ValueError when they cover different request counts."""
    if len(a.ids) != len(b.ids):
        raise ValueError(f"{len(a.ids)} requests vs {len(b.ids)}: not the same prompts")
    first = 0
    devs, per = [], []
    for xa, xb, la, lb in zip(a.ids, b.ids, a.logprobs, b.logprobs):
        n = _agreeing_prefix(xa, xb)
        per.append((n, max(len(xa), len(xb))))
        first += n > 0
        devs += [abs(p - q) for p, q in zip(la[:n], lb[:n]) if p is not None and q is not None]
    requests = len(a.ids)
    boot = bootstrap(per)
    return Comparison(
        agreement=_agreement(per),
        first_token_agreement=first / requests if requests else 1.0,
        logprob_dev_mean=sum(devs) / len(devs) if devs else None,
        compared_tokens=len(devs),
        agreement_stderr=None if boot is None else boot[0],
        agreement_ci95=None if boot is None else boot[1],
        per_request=tuple(per),
    )


def _agreement(per: Sequence[Tuple[int, int]]) -> float:
    """Agreeing tokens / output tokens (1.0 when there are none)."""
    total = sum(t for _, t in per)
    return sum(n for n, _ in per) / total if total else 1.0


def _resampled_agreements(per: Sequence[Tuple[int, int]], idx: np.ndarray) -> np.ndarray:
    """``_agreement`` of every resample: ``idx[r]`` = the request indices of resample ``r``."""
    arr = np.asarray(per, dtype=np.float64).reshape(-1, 2)
    same, total = arr[idx, 0].sum(axis=1), arr[idx, 1].sum(axis=1)
    return np.divide(same, total, out=np.ones_like(same), where=total > 0)


def _resample_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap(per: Sequence[Tuple[int, int]], *, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> Optional[Tuple[float, Tuple[float, float]]]:
    """The bootstrap standard error of ``agreement`` over requests ``per`` = (agreeing, output
    tokens) each, and its 95% percentile interval: ``resamples`` draws of ``len(per)`` requests
    with replacement (fixed ``seed``: the same figures every run). None for fewer than two."""
    if len(per) < 2:
        return None
    stats = _resampled_agreements(per, _resample_indices(len(per), resamples, seed))
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(stats.std(ddof=1)), (float(lo), float(hi))


def difference_stderr(c: Comparison, ref: Comparison, *, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> Optional[float]:
    """The standard error of ``c.agreement - ref.agreement``: a paired bootstrap (the same
    resampled request indices for both, as both compare the same prompts); without per-request
    data of equal length, ``sqrt(se_c^2 + se_ref^2)`` of their own stderrs; None when neither
    is known."""
    if len(c.per_request) == len(ref.per_request) >= 2:
        idx = _resample_indices(len(c.per_request), resamples, seed)
        d = _resampled_agreements(c.per_request, idx) - _resampled_agreements(ref.per_request, idx)
        return float(d.std(ddof=1))
    if c.agreement_stderr is None or ref.agreement_stderr is None:
        return None
    return (c.agreement_stderr ** 2 + ref.agreement_stderr ** 2) ** 0.5


def agreement_threshold(c: Comparison, reference: Comparison) -> float:
    """The least agreement the token rule accepts: ``reference.agreement - max(AGREEMENT_MARGIN,
    AGREEMENT_Z * difference_stderr)`` (the margin alone when the stderr is unknown)."""
    se = difference_stderr(c, reference)
    return reference.agreement - max(AGREEMENT_MARGIN, AGREEMENT_Z * (se or 0.0))


def _first_token_flags(c: Comparison) -> Optional[np.ndarray]:
    """Per request, 1.0 where its first output token agrees (its agreeing prefix is not empty),
    from ``per_request``; None without per-request data, or where it does not give
    ``c.first_token_agreement`` (a comparison built by hand)."""
    if not c.per_request:
        return None
    flags = np.asarray([n > 0 for n, _ in c.per_request], dtype=np.float64)
    return flags if abs(float(flags.mean()) - c.first_token_agreement) < 1e-9 else None


def first_token_difference_stderr(c: Comparison, ref: Comparison, *, resamples: int = BOOTSTRAP_RESAMPLES,
                                  seed: int = BOOTSTRAP_SEED) -> Optional[float]:
    """The paired bootstrap standard error of ``c.first_token_agreement -
    ref.first_token_agreement`` (the same resampled requests as ``difference_stderr``); None
    without per-request data of equal length (two requests at least)."""
    a, b = _first_token_flags(c), _first_token_flags(ref)
    if a is None or b is None or len(a) != len(b) or len(a) < 2:
        return None
    idx = _resample_indices(len(a), resamples, seed)
    return float((a[idx].mean(axis=1) - b[idx].mean(axis=1)).std(ddof=1))


def first_token_threshold(c: Comparison, reference: Comparison) -> float:
    """The least first-token agreement the token rule accepts: ``reference``'s less
    ``max(AGREEMENT_MARGIN, AGREEMENT_Z * first_token_difference_stderr)``. One request of 16
    is 0.0625 of the share, more than the margin: without the stderr term a single near-tie
    prefill token flipped by rounding fails a correct engine at small request counts."""
    se = first_token_difference_stderr(c, reference)
    return reference.first_token_agreement - max(AGREEMENT_MARGIN, AGREEMENT_Z * (se or 0.0))


def token_passes(c: Comparison, reference: Comparison) -> bool:
    """The token rule (module docstring): ``c`` is as close to the baseline as the
    cross-backend ``reference`` is, up to its noise."""
    if c.agreement < agreement_threshold(c, reference):
        return False
    if c.first_token_agreement < first_token_threshold(c, reference):
        return False
    if c.logprob_dev_mean is None or reference.logprob_dev_mean is None:
        return True  # agreement alone decides (no logprobs to compare)
    return c.logprob_dev_mean <= LOGPROB_FACTOR * reference.logprob_dev_mean + LOGPROB_SLACK


passes = token_passes  # the rule's earlier name


def layer_passes(layer: Optional[Mapping[str, float]]) -> Optional[bool]:
    """The layer-output rule over one workload's compared decode layer-steps (the engine's
    ``attention.layer_output_*`` counters, attention/debug/compare.py): at least one layer-step compared
    (``compares``) and none over its own tolerance (``over_tolerance``; every layer-step within
    its tolerance implies ``layer_output_max_rel_dev <= layer_output_tolerance`` over them).
    None when the compare was off (``layer`` None)."""
    if layer is None:
        return None
    return layer.get("compares", 0) > 0 and layer.get("over_tolerance", 0) == 0
