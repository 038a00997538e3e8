"""Output agreement: GraniKV vs baseline, against the baseline's agreement with itself.

Each engine runs the same probe twice (``probe``): greedy decoding of a fixed multi-agent batch
(one shared prefix, private suffixes), returning output ids and the first tokens' logprobs.
``summarize`` compares baseline run A with baseline run B (self-agreement: batch composition and
split-KV scheduling already change bf16 rounding) and GraniKV's runs with baseline run A.

A smoke test only: with dummy weights the logits barely depend on attention, so it cannot
detect a request attending to the wrong prefix (benchmark/correctness/check.py can).
"""

import random
from typing import Any, Dict, List, Optional

PREFIX, SUFFIX, AGENTS, OUT = 4096, 64, 16, 32
LOGPROB_ATOL = 0.25  # bf16 logits of a random 8B model: |logprob| differences seen between runs


def _prompts() -> List[List[int]]:
    rng = random.Random(1234)
    prefix = [rng.randrange(1000, 120000) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(1000, 120000) for _ in range(SUFFIX)] for _ in range(AGENTS)]


def probe(engine) -> Dict[str, Any]:
    """Two greedy runs of the probe batch (the prefix cached first, as in serving)."""
    prompts = _prompts()
    params = {"max_new_tokens": OUT, "ignore_eos": True, "temperature": 0}
    engine.generate(input_ids=[prompts[0][:PREFIX] + [5]],
                    sampling_params={"max_new_tokens": 1, "ignore_eos": True, "temperature": 0})
    runs = []
    for _ in range(2):
        res = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        runs.append(dict(ids=[r["output_ids"] for r in res],
                         logprobs=[[t[0] for t in r["meta_info"].get("output_token_logprobs", [])]
                                   for r in res]))
    return dict(agreement_runs=runs)


def _token_agreement(a: List[List[int]], b: List[List[int]]) -> float:
    """Share of tokens before each request's first divergence (after it, contexts differ)."""
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
        total += max(len(x), len(y))
    return same / total if total else 1.0


def _max_logprob_diff(a, b) -> Optional[float]:
    diffs = [abs(p - q) for x, y, ix, iy in zip(a["logprobs"], b["logprobs"], a["ids"], b["ids"])
             for p, q, tx, ty in zip(x, y, ix, iy) if tx == ty and p is not None and q is not None]
    return max(diffs) if diffs else None


def summarize(baseline: Dict[str, Any], granikv: Dict[str, Any]) -> Dict[str, Any]:
    b0, b1 = baseline["agreement_runs"]
    g0 = granikv["agreement_runs"][0]
    self_agree = _token_agreement(b0["ids"], b1["ids"])
    cross = _token_agreement(b0["ids"], g0["ids"])
    lp = _max_logprob_diff(b0, g0)
    return dict(
        baseline_self_agreement=round(self_agree, 4),
        granikv_vs_baseline_agreement=round(cross, 4),
        max_logprob_diff_same_token=lp,
        logprob_atol=LOGPROB_ATOL,
        tokens_ok=cross >= self_agree,
        logprobs_ok=lp is None or lp <= LOGPROB_ATOL,
        probe=dict(prefix=PREFIX, suffix=SUFFIX, agents=AGENTS, out=OUT),
    )
