"""The shipped model configs (``benchmark/multi_agent/configs/<name>/config.json``) and a model
folder for ``load_format="dummy"`` built from one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "multi_agent" / "configs"


def model_config_path(model: str) -> Path:
    """``config.json`` of a shipped model name (a folder of :data:`CONFIG_DIR`) or of a model
    folder path."""
    shipped = CONFIG_DIR / model / "config.json"
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
