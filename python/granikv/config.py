"""GraniKV options: one frozen dataclass; the CLI flags are generated from it.

Every field becomes ``--granikv-<field-with-dashes>`` (``enable`` becomes ``--enable-granikv``)
and a keyword of the offline API (``sglang.Engine(enable_granikv=True, granikv_<field>=...)``).
Ranges and option sets live in the field metadata and are checked in ``__post_init__``, so an
invalid value fails at startup with the flag, the value and the allowed range in the message
(the launcher prints it as one ``error: ...`` line and exits with status 2). The values are
read only when GraniKV is enabled: without ``--enable-granikv`` the other flags are ignored
(:func:`given_flags` names them for the warning).
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Literal, Mapping, Optional, Sequence, get_args

AttentionPath = Literal["auto", "cascade", "fused", "bgemm", "paged"]
ExtendPath = Literal["auto", "hot", "paged"]
HotPolicy = Literal["pays_off", "threshold"]
ReplaySlots = Literal["copy", "table"]
ViewPlan = Literal["reuse", "every_step"]
ClockProbe = Literal["model_paths", "paged_too"]
PrefixKernel = Literal["auto", "pointer", "descriptor", "wgmma"]  # kernels.kernel_config.PREFIX_KERNELS (no torch here)

FLAG_PREFIX = "granikv_"
ENABLE_FLAG = "enable_granikv"


def _opt(default: Any, help: str, *, lo: Optional[float] = None, hi: Optional[float] = None,
         choices: Optional[Sequence[str]] = None) -> Any:
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi, "choices": choices})


HOT_FRACTION_RANGE = (0.0, 1.0)  # --granikv-hot-fraction; the allocator checks the same range


@dataclass(frozen=True)
class GraniKVConfig:
    enable: bool = _opt(False, "Turn GraniKV on (HOT/COLD KV storage and shared-prefix attention).")
    hot_min_tokens: int = _opt(
        1024,
        "A radix-tree prefix becomes HOT (contiguous extent) only if it is at least this long.",
        lo=16,
        hi=1 << 22,
    )
    hot_min_sharers: int = _opt(
        2,
        "A prefix becomes HOT only when at least this many live requests share it.",
        lo=1,
        hi=4096,
    )
    hot_policy: HotPolicy = _opt(
        "pays_off",
        "Which shared prefixes become HOT: pays_off = those whose estimated decode-time saving "
        "(cost model: sharers, prefix length, expected remaining decode steps) exceeds the copy "
        "cost, never one the dispatcher would not serve with the shared-prefix path; "
        "threshold = every prefix past --granikv-hot-min-tokens and --granikv-hot-min-sharers.",
        choices=get_args(HotPolicy),
    )
    hot_expected_decode_steps: int = _opt(
        128,
        "Decode steps a sharer is expected to run when its request sets no max_new_tokens "
        "(the pays_off policy's horizon).",
        lo=1,
        hi=1 << 20,
    )
    hot_fraction: float = _opt(
        0.5,
        "Cap on the KV slots HOT extents may hold, as a fraction of all KV slots. Extents come "
        "out of the same free slots as every request's KV and return to them when evicted; "
        "nothing is reserved (0 = no promotions).",
        lo=HOT_FRACTION_RANGE[0],
        hi=HOT_FRACTION_RANGE[1],
    )
    attention_path: AttentionPath = _opt(
        "auto",
        "Decode attention path: auto = per-step cost model; cascade/fused/bgemm force a path "
        "(falling back to paged where it cannot serve a batch); paged = stock backend only.",
        choices=get_args(AttentionPath),
    )
    extend_path: ExtendPath = _opt(
        "auto",
        "Prefill (extend) attention over a cached prefix: hot = the part of each cached prefix "
        "in a HOT extent runs as one dense call per extent (flashinfer: in place of its paged "
        "prefix call; triton: GraniKV computes the whole extend of such batches); auto = hot "
        "where the cost model puts it below the stock prefill for the batch's shape; paged = the "
        "stock backend's prefill.",
        choices=get_args(ExtendPath),
    )
    min_group_size: int = _opt(
        2,
        "Requests sharing a HOT prefix form a cascade group only if there are at least this many.",
        lo=1,
        hi=4096,
    )
    cascade_graph_bs: str = _opt(
        "auto",
        "Decode batch sizes that get a second CUDA graph, with the cascade kernels, beside the "
        "stock graph every captured size has: auto = the captured sizes where the cost model says "
        "cascade can beat paged for a batch sharing one long prefix; none = stock graphs only "
        "(steps that replay a graph run paged); or a comma-separated list of batch sizes. Each "
        "cascade graph costs about the memory of one more stock graph of its size.",
    )
    replay_slots: ReplaySlots = _opt(
        "copy",
        "Where the suffix kernels of a cascade CUDA-graph replay read each request's KV slots: "
        "copy = a copy of the step's suffix slots made before the replay, beside SGLang's own "
        "metadata copy, so SGLang's scheduler writes its next batch while the replay runs, as "
        "with stock graphs; table = SGLang's req_to_token during the replay (the scheduler then "
        "waits for the whole forward before its next writes).",
        choices=get_args(ReplaySlots),
    )
    view_plan: ViewPlan = _opt(
        "reuse",
        "How a cascade CUDA-graph step plans the wrapped backend's one-token view of the batch: "
        "every_step = on every step, as a paged step plans its batch; reuse = only when it differs "
        "from the view the previous step left in place (another batch size, other requests, a HOT "
        "promotion in between, or any other metadata call of the wrapped backend since), which "
        "saves the wrapped backend's host-side plan on steady steps.",
        choices=get_args(ViewPlan),
    )
    clock_probe: ClockProbe = _opt(
        "paged_too",
        "Which close path choices the measured step clock probes (StepClock): model_paths = only "
        "the cost model's non-paged choices, turned paged where measured slower; paged_too = also "
        "a paged choice for rows that share a HOT prefix where the cheapest other path is priced "
        "within a tenth of the step, held where measured faster (a host-bound model's steps are where "
        "the model's host and launch terms miss most).",
        choices=get_args(ClockProbe),
    )
    prefix_kernel: PrefixKernel = _opt(
        "auto",
        "The kernel of the cascade's prefix part (decode steps over HOT prefixes): auto = the "
        "wgmma kernel on Hopper (sm90) where it can run, else TMA tile loads on Hopper and later "
        "where the KV buffers allow them, else pointer loads; "
        "pointer; descriptor (TMA); wgmma = the Hopper kernel written in Gluon (asynchronous "
        "warp-group MMAs; sm90, fp16/bf16 KV cache, head_dim 64 or 128, else the server refuses "
        "to start and says why; docs/kernels.md).",
        choices=get_args(PrefixKernel),
    )
    cost_model: Optional[str] = _opt(
        None,
        "Path to a cost-model JSON (benchmark/kernels/calibrate.py writes one); default: the "
        "checked-in file for this GPU, else a conservative default.",
    )
    launch_table: Optional[str] = _opt(
        None,
        "Path to a prefix wave table JSON (benchmark/kernels/launch_table_fit.py writes one: how "
        "many prefix programs a cascade step launches per step shape), or off; default: the "
        "checked-in table for this GPU where there is one, else the kernel config's waves on "
        "every step.",
    )
    debug_integrity: bool = _opt(
        False, "Run check_integrity() on the pools and the cache after every scheduler step, and "
        "check that every planned group's requests hold its HOT slots and that the suffix ends the "
        "kernels read on the device are the host seq_lens the step was planned from (slow)."
    )
    debug_compare_every: int = _opt(
        0,
        "Every N decode steps, compare every layer's output with the wrapped backend's for the "
        "same step (and that with a float64 reference of paged attention: the tolerance), log "
        "and count the deviations (0 = off; eager steps only: use --disable-cuda-graph).",
        lo=0,
        hi=1 << 30,
    )
    tp_check_interval: int = _opt(
        256,
        "With attention TP > 1: every N decode steps the TP ranks compare a fingerprint of their "
        "storage decisions over SGLang's CPU group; on a mismatch promotions freeze on every rank "
        "and an error is logged (0 = off).",
        lo=0,
        hi=1 << 30,
    )
    log_interval: int = _opt(
        40, "Log GraniKV metrics every N decode steps (0 = never).", lo=0, hi=1 << 30
    )
    allow_untested_sglang: bool = _opt(
        False, "Run on an SGLang release GraniKV has not been tested with (by default GraniKV "
        "then turns itself off with a warning and stock SGLang serves)."
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            md = f.metadata
            flag = cli_flag(f.name)
            if md.get("choices") is not None and value not in md["choices"]:
                raise ValueError(
                    f"{flag}={value!r} is not one of {', '.join(map(str, md['choices']))}"
                )
            lo, hi = md.get("lo"), md.get("hi")
            if lo is not None and not (lo <= value <= hi):
                raise ValueError(f"{flag}={value!r} is outside [{lo}, {hi}]")
        # parsed once, here (raises ValueError naming the flag): ``cascade_graph_sizes``
        object.__setattr__(self, "_graph_sizes", parse_graph_bs(self.cascade_graph_bs))
        if self.cost_model is not None and not os.path.isfile(self.cost_model):
            raise ValueError(f"{cli_flag('cost_model')}={self.cost_model!r}: no such file")
        if self.launch_table not in (None, "off") and not os.path.isfile(self.launch_table):
            raise ValueError(f"{cli_flag('launch_table')}={self.launch_table!r}: no such file (or off)")

    @property
    def cascade_graph_sizes(self) -> Optional[FrozenSet[int]]:
        """``--granikv-cascade-graph-bs`` parsed: None for ``auto``, else the batch sizes."""
        sizes: Optional[FrozenSet[int]] = self.__dict__["_graph_sizes"]
        return sizes

    # ---- conversions ----------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "GraniKVConfig":
        """Build from flag-style keys (``enable_granikv``, ``granikv_hot_min_tokens``, ...).

        Missing keys take the defaults; ``None`` values too (argparse leaves them ``None``).
        A ``granikv_*`` key that names no option is an error (a misspelt Engine keyword).
        """
        known = {attr_name(f.name) for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in values if is_granikv_key(k) and k not in known)
        if unknown:
            raise ValueError(f"unknown GraniKV option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            key = attr_name(f.name)
            if values.get(key) is not None:
                kwargs[f.name] = values[key]
        return cls(**kwargs)

    def to_mapping(self) -> Dict[str, Any]:
        return {attr_name(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def parse_graph_bs(spec: str) -> Optional[FrozenSet[int]]:
    """``--granikv-cascade-graph-bs``: None for ``auto``, else the set of batch sizes."""
    spec = spec.strip().lower()
    if spec == "auto":
        return None
    if spec == "none":
        return frozenset()
    try:
        sizes = frozenset(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        sizes = frozenset([0])
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{cli_flag('cascade_graph_bs')}={spec!r} must be auto, none or a "
                         "comma-separated list of batch sizes >= 1")
    return sizes


def attr_name(field_name: str) -> str:
    """Field name -> argparse dest / Engine keyword."""
    return ENABLE_FLAG if field_name == "enable" else FLAG_PREFIX + field_name


def cli_flag(field_name: str) -> str:
    return "--" + attr_name(field_name).replace("_", "-")


def is_granikv_key(key: str) -> bool:
    return key == ENABLE_FLAG or key.startswith(FLAG_PREFIX)


def given_flags(values: Mapping[str, Any]) -> List[str]:
    """``--granikv-<name>=<value>``, sorted, for every GraniKV key set in ``values`` (flag-style
    keys, ``None`` = not given; ``--enable-granikv`` excluded): what a disabled GraniKV ignores."""
    return sorted(f"--{k.replace('_', '-')}={v!r}" for k, v in values.items()
                  if k != ENABLE_FLAG and k.startswith(FLAG_PREFIX) and v is not None)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per config field to an argparse parser (SGLang's server-args parser).

    Option sets are shown as the metavar but not given to argparse as ``choices``: like the
    ranges, they are checked only when GraniKV is enabled (see :class:`GraniKVConfig`).
    """
    group = parser.add_argument_group("GraniKV (shared-prefix KV storage and attention)")
    for f in dataclasses.fields(GraniKVConfig):
        md = f.metadata
        help_text = md["help"]
        if md.get("lo") is not None:
            help_text += f" Range [{md['lo']}, {md['hi']}]."
        help_text += f" Default: {f.default}."
        if f.type is bool:
            group.add_argument(cli_flag(f.name), dest=attr_name(f.name), action="store_true",
                               default=None, help=help_text)
            continue
        kinds: Dict[Any, type] = {int: int, float: float}
        kind = kinds.get(f.type, str)
        group.add_argument(cli_flag(f.name), dest=attr_name(f.name), type=kind, default=None,
                           metavar="{" + ",".join(md["choices"]) + "}" if md.get("choices")
                           else None, help=help_text)
