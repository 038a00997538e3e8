"""Engine arguments: the ones every benchmark engine starts from, ``--engine-arg KEY=VALUE``
pass-through (GraniKV's keys to the GraniKV engines only) and the same arguments as
``launch_server`` flags. No sglang import."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Sequence

from granikv.config import is_granikv_key

# Engine arguments of every published run: dummy weights and token ids (nothing downloaded),
# pytorch sampling (greedy never reaches FlashInfer's sampling kernels, so an install without
# them works), no grammar backend, decode CUDA graphs up to 256, no prefill CUDA graph (faster
# start), and an idle scheduler that sleeps: without ``sleep_on_idle`` an idle SGLang scheduler
# polls in a loop at 100% of a CPU thread, so an engine waiting its turn beside the measured
# one (the regime grid's side-by-side engines) takes a host core from it, and a host-bound
# model's throughput then depends on where the OS places the two processes.
BASE_ENGINE_KWARGS: Dict[str, Any] = dict(
    load_format="dummy", skip_tokenizer_init=True, sampling_backend="pytorch",
    grammar_backend="none", mem_fraction_static=0.85, log_level="warning",
    max_running_requests=256, disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=256,
    sleep_on_idle=True,
)


def parse_value(text: str) -> Any:
    """``--engine-arg`` value: JSON literal when it parses (8, 0.8, true, null, [..]), else str."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_engine_args(items: Sequence[str]) -> Dict[str, Any]:
    """``["key=value", ...]`` (``--engine-arg``, repeatable) -> ``{key: value}``; dashes in a key
    become underscores."""
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg {item!r} is not key=value")
        out[key.strip().replace("-", "_")] = parse_value(value)
    return out


def apply_extra(kwargs: Dict[str, Any], extra: Mapping[str, Any], *, granikv: bool) -> Dict[str, Any]:
    """``kwargs`` updated in place with the pass-through keys ``extra``: every key that is not
    GraniKV's (``granikv.config.is_granikv_key``); with ``granikv``, also
    ``enable_granikv=True`` and GraniKV's keys. Returns ``kwargs``."""
    kwargs.update({k: v for k, v in extra.items() if not is_granikv_key(k)})
    if granikv:
        kwargs.update(enable_granikv=True, **{k: v for k, v in extra.items() if is_granikv_key(k)})
    return kwargs


def server_flags(kwargs: Mapping[str, Any]) -> List[str]:
    """Engine kwargs as ``launch_server`` flags: ``True`` -> ``--key``, other values ``--key value``."""
    flags: List[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags
