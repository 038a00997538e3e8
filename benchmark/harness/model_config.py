"""The shipped model configs (``benchmark/multi_agent/configs/<name>/config.json``) and a model
folder for ``load_format="dummy"`` built from one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

CONFIG_DIR = Path(__file__).resolve().parents[1] / "multi_agent" / "configs"

#: A grid model named ``<config>+<kv dtype>`` is that shipped config served with that
#: ``--kv-cache-dtype`` (e.g. ``llama-3.1-8b+fp8_e4m3``).
KV_DTYPE_SEP = "+"
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def split_model_name(name: str) -> Tuple[str, Optional[str]]:
    """``(config folder, kv cache dtype or None)`` of a grid model name."""
    config, sep, kv = name.partition(KV_DTYPE_SEP)
    if sep and kv not in KV_DTYPE_BYTES:
        raise ValueError(f"model {name!r}: unknown KV cache dtype {kv!r} (known: {', '.join(KV_DTYPE_BYTES)})")
    return config, (kv or None)


def kv_dtype_bytes(name: str) -> int:
    """Bytes per KV element of a grid model name (2 without a KV dtype: bf16)."""
    return KV_DTYPE_BYTES[split_model_name(name)[1] or "auto"]


def full_attention_layers(cfg: Mapping[str, Any]) -> int:
    """Layers of a config that attend to the whole context: all, except a hybrid model's
    sliding-window layers (``layer_types`` "sliding_attention", as gpt-oss)."""
    types = cfg.get("layer_types")
    return sum(1 for t in types if t != "sliding_attention") if types else int(cfg["num_hidden_layers"])


def model_config_path(model: str) -> Path:
    """``config.json`` of a shipped model name (a folder of :data:`CONFIG_DIR`) or of a model
    folder path."""
    shipped = CONFIG_DIR / split_model_name(model)[0] / "config.json"
    if shipped.is_file():
        return shipped
    given = Path(model) / "config.json"
    if given.is_file():
        return given
    raise ValueError(f"--model {model!r}: no {shipped} and no {given}")


def write_model_dir(model: str, dest: str, *, tokenizer: bool = False) -> Path:
    """A model folder for ``--load-format dummy``: the shipped config.json and, optionally, a
    word-level tokenizer (token i <-> the word ``t<i>``, whitespace-separated) covering the
    whole vocabulary, for clients that send text (sglang.bench_serving). decode then encode
    round-trips exactly, so a prompt of N generated tokens is N tokens on the server too.
    """
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = model_config_path(model)
    shutil.copy(cfg_path, out / "config.json")
    if tokenizer:
        cfg = json.loads(cfg_path.read_text())
        vocab = {f"t{i}": i for i in range(int(cfg["vocab_size"]))}
        tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
               "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
               "post_processor": None, "decoder": None,
               "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
        (out / "tokenizer.json").write_text(json.dumps(tok))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
            "bos_token": f"t{cfg.get('bos_token_id', 1)}", "eos_token": f"t{cfg.get('eos_token_id', 2)}",
            "unk_token": "t0", "clean_up_tokenization_spaces": False}))
    return out
