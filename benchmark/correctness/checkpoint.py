"""A context-sensitive Llama checkpoint: random-normal weights written as a real HF folder.

SGLang's dummy weights (uniform +-1e-3) leave the residual stream dominated by the embedding,
so logits barely depend on attention and a request that attends to the wrong KV would still
produce the stock tokens. With every matrix drawn from N(0, std^2) (std 0.02) and unit RMSNorm
weights, each attention layer's output is ~100x the embedding: the next token depends on the
context, and a wrong prefix changes it.

The folder (``config.json`` + ``model.safetensors``) is loaded through SGLang's normal loader
(``load_format="safetensors"``) and by ``transformers.LlamaForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict

DEFAULT_STD = 0.02


@dataclass(frozen=True)
class LlamaShape:
    """Architecture of the check model. Defaults: Llama-3.1-8B's layer shape (32 q / 8 kv
    heads of 128, hidden 4096, MLP 14336) with 4 layers and a 4,096-token vocabulary
    (~0.9 B parameters, 1.8 GB in bf16)."""

    num_layers: int = 4
    hidden: int = 4096
    intermediate: int = 14336
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 4096
    max_positions: int = 16384

    def __post_init__(self):
        for name, v in asdict(self).items():
            if v < 1:
                raise ValueError(f"LlamaShape.{name}={v} must be >= 1")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    def hf_config(self) -> Dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "max_position_embeddings": self.max_positions,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        }

    def tensor_shapes(self) -> Dict[str, tuple]:
        """HF parameter name -> shape, in the order they are written."""
        h, i, q, kv = self.hidden, self.intermediate, self.num_q_heads, self.num_kv_heads
        d = self.head_dim
        out: Dict[str, tuple] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, q * d),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out


def write_checkpoint(dest: str, shape: LlamaShape = LlamaShape(), *, std: float = DEFAULT_STD,
                     seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Writes ``config.json`` and ``model.safetensors`` into ``dest`` (created) and returns it.

    Every matrix is N(0, std^2) from a seeded CPU generator (the same bytes on every host for
    one seed and shape); every norm weight is 1.
    """
    import torch
    from safetensors.torch import save_file

    if not std > 0:
        raise ValueError(f"std={std} must be > 0")
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shp in shape.tensor_shapes().items():
        if len(shp) == 1:
            tensors[name] = torch.ones(shp, dtype=torch_dtype)
        else:
            tensors[name] = (torch.randn(shp, generator=gen) * std).to(torch_dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(shape.hf_config(), torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
