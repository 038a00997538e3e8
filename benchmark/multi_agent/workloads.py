"""Multi-agent workloads as token ids: deterministic (seeded), tokenizer-free, model-agnostic.

Every builder returns a :class:`Workload`: the prompts of the timed batch (lists of token ids),
the shared prefixes to cache before timing (warm-up), the sampling parameters and, for the
agent loop, the tool results appended between turns. The runner (run.py) sends the prompts
to ``sglang.Engine`` with ``input_ids=`` (the engine runs with ``skip_tokenizer_init``).

Shape of one agent's first prompt (every workload but ``no_sharing``)::

    | shared prefix (prefix_len tokens, same ids for the whole group) | private suffix (suffix) |
    ^ cached by the warm-up request before timing                      ^ new per agent

Agent loop, turn t >= 1 (the agent's own context grows; nothing of it is shared but the prefix)::

    | shared prefix | suffix | out_0 | tool_0 | out_1 | tool_1 | ... | out_{t-1} | tool_{t-1} |

Token ids are drawn from ``[TOKEN_LO, TOKEN_HI)``, which avoids the special ids of Llama-3
(>= 128000) and Qwen2.5 (>= 151643) and fits both vocabularies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

TOKEN_LO, TOKEN_HI = 1000, 120000

WORKLOAD_NAMES = ("homogeneous", "heterogeneous", "agent_loop", "no_sharing", "ceiling")

# Heterogeneous mix: 8 distinct shared prompts (2K..16K) and their relative agent weights
# (short prompts get more agents, like a fleet of small tools next to a few big planners).
HETEROGENEOUS_PREFIXES = (2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384)
HETEROGENEOUS_WEIGHTS = (8, 6, 5, 4, 3, 3, 2, 1)
CEILING_PREFIX = 256


@dataclass(frozen=True)
class Sampling:
    """Greedy, fixed-length generation (ignore_eos), as SGLang's ``sampling_params`` dict."""

    max_new_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True

    def to_dict(self) -> Dict[str, object]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "ignore_eos": self.ignore_eos}


@dataclass(frozen=True)
class Workload:
    """One measured batch.

    prompts[i]: the first prompt of agent i (token ids). group[i]: index into ``prefixes`` of
    the shared prefix agent i starts with, or -1 for none. prefixes: the distinct shared
    prefixes (each a prompt prefix of its agents; the runner caches each with one warm-up
    request before timing). turns: generation turns per agent (1 = one-shot batch).
    tool_results[i][t]: tokens appended to agent i's context after its turn-t output (only for
    turns > 1; ``len(tool_results[i]) == turns - 1``). ``params`` records the builder's
    arguments and is what the report prints next to the figures.
    """

    name: str
    params: Mapping[str, object]
    prompts: Tuple[Tuple[int, ...], ...]
    group: Tuple[int, ...]
    prefixes: Tuple[Tuple[int, ...], ...]
    sampling: Sampling
    turns: int = 1
    tool_results: Tuple[Tuple[Tuple[int, ...], ...], ...] = ()

    @property
    def agents(self) -> int:
        return len(self.prompts)

    @property
    def prefix_len(self) -> int:
        """Longest shared prefix (0 for no sharing); the report's 'prefix' column."""
        return max((len(p) for p in self.prefixes), default=0)

    @property
    def out_tokens(self) -> int:
        """Output tokens the whole workload generates (ignore_eos makes it exact)."""
        return self.agents * self.turns * self.sampling.max_new_tokens

    @property
    def prompt_tokens_first_turn(self) -> int:
        return sum(len(p) for p in self.prompts)

    def kv_tokens_logical(self) -> int:
        """KV tokens live at the end of the run if every shared prefix is stored once.

        prefixes once + every agent's private tokens (prompt beyond its prefix, all outputs,
        all tool results). Paged or cascade storage holds this many; what the engine reports
        on top of it is cache of finished requests.
        """
        private = 0
        for i, prompt in enumerate(self.prompts):
            g = self.group[i]
            shared = len(self.prefixes[g]) if g >= 0 else 0
            tools = sum(len(t) for t in self.tool_results[i]) if self.tool_results else 0
            private += len(prompt) - shared + self.turns * self.sampling.max_new_tokens + tools
        return sum(len(p) for p in self.prefixes) + private

    def next_prompt(self, agent: int, context: Sequence[int], output_ids: Sequence[int],
                    turn: int) -> List[int]:
        """Agent loop: the prompt of turn ``turn + 1`` = context + its output + tool result."""
        return list(context) + list(output_ids) + list(self.tool_results[agent][turn])


def _tokens(rng: random.Random, n: int) -> Tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n))


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


def homogeneous(prefix_len: int, agents: int, suffix: int = 256, out: int = 256, *,
                seed: int = 0, name: str = "homogeneous") -> Workload:
    """One shared prefix of ``prefix_len`` tokens; every agent adds its own ``suffix`` tokens."""
    _check_positive(prefix_len=prefix_len, agents=agents, suffix=suffix, out=out)
    rng = random.Random(f"{name}:{seed}:{prefix_len}:{agents}")
    prefix = _tokens(rng, prefix_len)
    prompts = tuple(prefix + _tokens(rng, suffix) for _ in range(agents))
    return Workload(name=name, params=dict(prefix_len=prefix_len, agents=agents, suffix=suffix,
                                           out=out, seed=seed),
                    prompts=prompts, group=(0,) * agents, prefixes=(prefix,),
                    sampling=Sampling(out))


def short_prefix_ceiling(agents: int, suffix: int = 256, out: int = 256, *,
                         seed: int = 0) -> Workload:
    """The no-long-prefix ceiling: :func:`homogeneous` with a 256-token prefix.

    The same engine at the same agent count, with prefix attention nearly free, bounds what any
    prefix-sharing scheme can reach end to end.
    """
    return homogeneous(CEILING_PREFIX, agents, suffix, out, seed=seed, name="ceiling")


def split_agents(agents: int, weights: Sequence[int], *, min_per_group: int = 2) -> List[int]:
    """Integer agent counts proportional to ``weights``, each >= min_per_group, summing to agents.

    Largest-remainder rounding; ties go to the earlier group. Raises ValueError when ``agents``
    cannot give every group ``min_per_group``.
    """
    g = len(weights)
    if agents < g * min_per_group:
        raise ValueError(f"agents={agents} is below {g} groups x {min_per_group} agents = "
                         f"{g * min_per_group}")
    spare = agents - g * min_per_group
    total = sum(weights)
    exact = [spare * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(g), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: spare - sum(counts)]:
        counts[i] += 1
    return [c + min_per_group for c in counts]


def heterogeneous(agents: int, prefixes: Sequence[int] = HETEROGENEOUS_PREFIXES,
                  weights: Sequence[int] = HETEROGENEOUS_WEIGHTS, suffix: int = 256,
                  out: int = 256, *, seed: int = 0) -> Workload:
    """Distinct shared prompts of different lengths, unequal agent counts, one batch.

    Agents of all groups are interleaved in a seeded random order, so one decode batch holds
    a forest of prefixes. Counts come from :func:`split_agents` (the short prompts get more).
    """
    _check_positive(agents=agents, suffix=suffix, out=out)
    if len(prefixes) != len(weights):
        raise ValueError(f"{len(prefixes)} prefixes but {len(weights)} weights")
    rng = random.Random(f"heterogeneous:{seed}:{agents}:{tuple(prefixes)}")
    counts = split_agents(agents, weights)
    shared = tuple(_tokens(rng, n) for n in prefixes)
    order = [g for g, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(order)
    prompts = tuple(shared[g] + _tokens(rng, suffix) for g in order)
    return Workload(name="heterogeneous",
                    params=dict(agents=agents, prefixes=list(prefixes), agents_per_prefix=counts,
                                suffix=suffix, out=out, seed=seed),
                    prompts=prompts, group=tuple(order), prefixes=shared, sampling=Sampling(out))


def agent_loop(prefix_len: int, agents: int, turns: int = 4, suffix: int = 256, out: int = 128,
               tool: int = 128, *, seed: int = 0) -> Workload:
    """Agents that run ``turns`` turns each over one shared prefix.

    Turn 0 is :func:`homogeneous`'s prompt. After each turn the agent appends its own output
    and a tool result of ``tool`` random tokens to its context and submits the next turn as
    soon as its previous turn completes (asynchronous per agent, not turn-synchronous), so
    agents drift apart and the batch mixes prefill and decode, as real agent fleets do.
    """
    _check_positive(prefix_len=prefix_len, agents=agents, turns=turns, suffix=suffix, out=out,
                    tool=tool)
    base = homogeneous(prefix_len, agents, suffix, out, seed=seed, name="agent_loop")
    rng = random.Random(f"agent_loop_tools:{seed}:{prefix_len}:{agents}:{turns}")
    tools = tuple(tuple(_tokens(rng, tool) for _ in range(turns - 1)) for _ in range(agents))
    return Workload(name="agent_loop",
                    params=dict(prefix_len=prefix_len, agents=agents, turns=turns, suffix=suffix,
                                out=out, tool=tool, seed=seed),
                    prompts=base.prompts, group=base.group, prefixes=base.prefixes,
                    sampling=base.sampling, turns=turns, tool_results=tools)


def no_sharing(agents: int, prompt_len: int = 2048, out: int = 256, *, seed: int = 0) -> Workload:
    """Independent random prompts (no common prefix beyond chance): the no-regression check."""
    _check_positive(agents=agents, prompt_len=prompt_len, out=out)
    rng = random.Random(f"no_sharing:{seed}:{prompt_len}:{agents}")
    prompts = tuple(_tokens(rng, prompt_len) for _ in range(agents))
    return Workload(name="no_sharing", params=dict(agents=agents, prompt_len=prompt_len, out=out,
                                                   seed=seed),
                    prompts=prompts, group=(-1,) * agents, prefixes=(), sampling=Sampling(out))


def grouped(prefixes: Sequence[int], agents_per_prefix: Sequence[int], suffix: Sequence[int] = (256, 256),
            out: int = 128, *, turns: int = 1, tool: int = 0, seed: int = 0,
            name: str = "grouped") -> Workload:
    """A forest: distinct shared prefixes of the given lengths, each with its own agent count,
    every agent with a private suffix of a seeded length in ``[suffix[0], suffix[1]]``, agents
    of all groups interleaved in one batch; ``turns`` > 1 makes it an agent loop (a ``tool``
    -token result appended after each turn's output, as :func:`agent_loop`).

    The suffix lengths, the interleaving and the tool results depend on the agent counts and the
    seed only, not on the prefix lengths, so the same call with every prefix cut to 256 tokens
    (:func:`cut_prefixes`) is the same workload with short prefixes: its ceiling. A prefix of
    0 tokens gives agents without a shared prefix.
    """
    if len(prefixes) != len(agents_per_prefix):
        raise ValueError(f"{len(prefixes)} prefixes but {len(agents_per_prefix)} agent counts")
    lo, hi = int(suffix[0]), int(suffix[1])
    _check_positive(out=out, turns=turns, suffix=lo, agents=sum(agents_per_prefix) or 0)
    if hi < lo or any(n < 1 for n in agents_per_prefix) or any(L < 0 for L in prefixes):
        raise ValueError(f"grouped: suffix {lo}..{hi}, agents {list(agents_per_prefix)}, prefixes "
                         f"{list(prefixes)}: need lo <= hi, agents >= 1, prefixes >= 0")
    if turns > 1 and tool < 1:
        raise ValueError(f"tool={tool} must be >= 1 with turns={turns}")
    shape_rng = random.Random(f"{name}:{seed}:{tuple(agents_per_prefix)}:{lo}:{hi}:{turns}:{tool}")
    order = [g for g, c in enumerate(agents_per_prefix) for _ in range(c)]
    shape_rng.shuffle(order)
    lens = [shape_rng.randint(lo, hi) for _ in order]
    tok_rng = random.Random(f"{name}:tokens:{seed}:{tuple(prefixes)}:{tuple(agents_per_prefix)}")
    shared = tuple(_tokens(tok_rng, L) for L in prefixes)
    suffixes = [_tokens(shape_rng, n) for n in lens]
    prompts = tuple(shared[g] + s for g, s in zip(order, suffixes))
    per_prefix = [0] * len(prefixes)
    for g, n in zip(order, lens):
        per_prefix[g] += n
    tools = ()
    if turns > 1:
        tools = tuple(tuple(_tokens(shape_rng, tool) for _ in range(turns - 1)) for _ in order)
    kept = tuple(g for g, L in enumerate(prefixes) if L > 0)  # a 0-token prefix shares nothing
    index = {g: i for i, g in enumerate(kept)}
    return Workload(name=name,
                    params=dict(prefixes=list(prefixes), agents_per_prefix=list(agents_per_prefix),
                                suffix=[lo, hi], suffix_tokens_per_prefix=per_prefix, out=out,
                                turns=turns, tool=tool, seed=seed, agents=len(order)),
                    prompts=prompts, group=tuple(index.get(g, -1) for g in order),
                    prefixes=tuple(shared[g] for g in kept), sampling=Sampling(out), turns=turns,
                    tool_results=tools)


def cut_prefixes(kwargs: Mapping[str, object], length: int = CEILING_PREFIX) -> Dict[str, object]:
    """:func:`grouped` arguments with every shared prefix cut to ``length`` tokens (0 stays 0)."""
    out = dict(kwargs)
    out["prefixes"] = [min(int(L), length) for L in kwargs["prefixes"]]
    return out


def dp_routes(w: Workload, dp: int) -> Tuple[int, ...]:
    """Prefix-affine DP rank of each agent, for SGLang's per-request ``routed_dp_rank``.

    Agents are walked group by group (largest group first, then the agents without a shared
    prefix) and packed onto ranks 0..dp-1 in contiguous runs of ceil(agents / dp): each rank
    gets the same number of agents (+-1), and a shared prefix is split over ranks only where a
    run boundary falls inside its group. So at most dp - 1 prefixes are cached (and promoted to
    HOT) on two ranks, and a single-prefix workload is split evenly, each rank holding one copy.
    """
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    n = w.agents
    sizes: Dict[int, int] = {}
    for g in w.group:
        sizes[g] = sizes.get(g, 0) + 1
    order = sorted(range(n), key=lambda i: (w.group[i] < 0, -sizes[w.group[i]], w.group[i], i))
    ranks = [0] * n
    for pos, i in enumerate(order):
        ranks[i] = pos * dp // n  # contiguous runs of floor / ceil(n / dp) agents
    return tuple(ranks)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to build, without building it (cheap to print in ``--dry-run``, to send to a child).

    ``build()`` makes the token ids; children rebuild them from the spec (seeded, so every
    engine configuration gets identical prompts).
    """

    name: str
    agents: int
    prefix_len: int = 0
    kwargs: Mapping[str, object] = field(default_factory=dict)

    def build(self) -> Workload:
        kw = dict(self.kwargs)
        if self.name == "homogeneous":
            return homogeneous(self.prefix_len, self.agents, **kw)
        if self.name == "heterogeneous":
            return heterogeneous(self.agents, **kw)
        if self.name == "agent_loop":
            return agent_loop(self.prefix_len, self.agents, **kw)
        if self.name == "no_sharing":
            return no_sharing(self.agents, **kw)
        if self.name == "ceiling":
            return short_prefix_ceiling(self.agents, **kw)
        if self.name == "grouped":
            return grouped(**kw)
        raise ValueError(f"unknown workload {self.name!r}; known: {', '.join(WORKLOAD_NAMES)}, grouped")

    def to_json(self) -> Dict[str, object]:
        return dict(name=self.name, agents=self.agents, prefix_len=self.prefix_len,
                    kwargs=dict(self.kwargs))

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> "WorkloadSpec":
        return cls(name=d["name"], agents=int(d["agents"]), prefix_len=int(d.get("prefix_len", 0)),
                   kwargs=dict(d.get("kwargs") or {}))

    @property
    def label(self) -> str:
        return f"{self.name}(prefix={self.prefix_len}, agents={self.agents})"


def plan(workloads: Sequence[str], agents: Sequence[int], prefix_len: int, *,
         no_sharing_len: int = 2048, turns: int = 4,
         heterogeneous_prefixes: Optional[Sequence[int]] = None) -> List[WorkloadSpec]:
    """The full cross product of requested workloads and agent counts, in run order.

    Ceiling rows come first so the ratio to the ceiling is available as soon as the first long-
    prefix row lands. ``heterogeneous`` reports its longest prompt as ``prefix_len`` and is
    skipped for agent counts below 3 per prompt (24 for 8 prompts).
    """
    unknown = [w for w in workloads if w not in WORKLOAD_NAMES]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; known: {', '.join(WORKLOAD_NAMES)}")
    het = tuple(heterogeneous_prefixes or HETEROGENEOUS_PREFIXES)
    order = sorted(workloads, key=lambda w: WORKLOAD_NAMES.index(w) if w != "ceiling" else -1)
    specs: List[WorkloadSpec] = []
    for w in order:
        for n in agents:
            if w == "homogeneous":
                specs.append(WorkloadSpec(w, n, prefix_len))
            elif w == "ceiling":
                specs.append(WorkloadSpec(w, n, CEILING_PREFIX))
            elif w == "heterogeneous":
                if n < 3 * len(het):
                    continue  # below 3 per prompt the split cannot be both shared and unequal
                specs.append(WorkloadSpec(w, n, max(het), {"prefixes": list(het)}))
            elif w == "agent_loop":
                specs.append(WorkloadSpec(w, n, prefix_len, {"turns": turns}))
            elif w == "no_sharing":
                specs.append(WorkloadSpec(w, n, 0, {"prompt_len": no_sharing_len}))
    return specs
