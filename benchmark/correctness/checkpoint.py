"""Context-sensitive checkpoints: random-normal weights written as a real HF folder (a Llama, a
gpt-oss-shaped hybrid model with sliding-window layers and attention sinks, and a Qwen3-MoE-shaped
model with q/k norms and GQA 8).

SGLang's dummy weights (uniform +-1e-3) leave the residual stream dominated by the embedding,
so logits barely depend on attention and a request that attends to the wrong KV would still
produce the stock tokens. With every matrix drawn from N(0, std^2) (std 0.02) and unit RMSNorm
weights, each attention layer's output is ~100x the embedding: the next token depends on the
context, and a wrong prefix changes it.

The folder (``config.json`` + ``model.safetensors``) is loaded through SGLang's normal loader
(``load_format="safetensors"``) and by transformers' ``LlamaForCausalLM`` / ``GptOssForCausalLM``
/ ``Qwen3MoeForCausalLM`` ``from_pretrained``. Which tensors are drawn how (``init_of``): matrices
N(0, std^2), norm weights 1, biases 0, gpt-oss's sinks N(0, 1) (logits that take a visible
share of each softmax).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Tuple, Union

DEFAULT_STD = 0.02
SINK_STD = 1.0


def _check_heads(shape: object) -> None:
    """Every field of a shape dataclass >= 1, and whole q-head groups per kv head."""
    for name, v in asdict(shape).items():  # type: ignore[call-overload]
        if v < 1:
            raise ValueError(f"{type(shape).__name__}.{name}={v} must be >= 1")
    q, kv = getattr(shape, "num_q_heads"), getattr(shape, "num_kv_heads")
    if q % kv:
        raise ValueError(f"num_q_heads={q} is not a multiple of num_kv_heads={kv}")


def _check_experts(shape: object) -> None:
    """A MoE shape routes each token to at most all of its experts."""
    top, n = getattr(shape, "experts_per_token"), getattr(shape, "num_experts")
    if top > n:
        raise ValueError(f"experts_per_token={top} > num_experts={n}")


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
        _check_heads(self)

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


@dataclass(frozen=True)
class GptOssShape:
    """A hybrid check model of gpt-oss's attention shape: layers alternating a 128-token sliding
    window and full attention (layer 0 windowed, as gpt-oss), 64 q / 8 kv heads of 64, learned
    sinks on every layer, biased projections, a small MoE (8 experts, top 4) and a 4,096-token
    vocabulary (4 layers: ~0.9 B parameters, 1.8 GB in bf16)."""

    num_layers: int = 4
    hidden: int = 2880
    intermediate: int = 2880
    num_q_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    num_experts: int = 8
    experts_per_token: int = 4
    window: int = 128
    vocab: int = 4096
    max_positions: int = 16384

    def __post_init__(self):
        _check_heads(self)
        _check_experts(self)

    @property
    def layer_types(self) -> Tuple[str, ...]:
        return tuple("sliding_attention" if n % 2 == 0 else "full_attention" for n in range(self.num_layers))

    def hf_config(self) -> Dict[str, object]:
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "num_local_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token, "layer_types": list(self.layer_types),
            "sliding_window": self.window, "swiglu_limit": 7.0, "attention_bias": True,
            "vocab_size": self.vocab, "max_position_embeddings": self.max_positions,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
            # gpt-oss's YaRN, its factor fitted to this context length (4,096 x 4 = 16,384)
            "rope_scaling": {"rope_type": "yarn", "factor": self.max_positions / 4096,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False},
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "bfloat16",
        }

    def tensor_shapes(self) -> Dict[str, tuple]:
        """HF (transformers GptOss) parameter name -> shape, in the order they are written."""
        h, i, q, kv, d, e = (self.hidden, self.intermediate, self.num_q_heads, self.num_kv_heads,
                             self.head_dim, self.num_experts)
        out: Dict[str, tuple] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.sinks": (q,),
                p + "self_attn.q_proj.weight": (q * d, h), p + "self_attn.q_proj.bias": (q * d,),
                p + "self_attn.k_proj.weight": (kv * d, h), p + "self_attn.k_proj.bias": (kv * d,),
                p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.v_proj.bias": (kv * d,),
                p + "self_attn.o_proj.weight": (h, q * d), p + "self_attn.o_proj.bias": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
                p + "mlp.experts.gate_up_proj": (e, h, 2 * i), p + "mlp.experts.gate_up_proj_bias": (e, 2 * i),
                p + "mlp.experts.down_proj": (e, i, h), p + "mlp.experts.down_proj_bias": (e, h),
            })
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out


@dataclass(frozen=True)
class Qwen3MoeShape:
    """A check model of Qwen3-30B-A3B's attention shape: 32 q / 4 kv heads of 128 (GQA 8) with
    RMSNorm over each q and k head before RoPE, hidden 2048, every layer a small MoE (8 experts of
    768, top 2; the released model has 128, top 8) and a 4,096-token vocabulary. Experts are
    written one by one (``mlp.experts.{j}.gate_proj``, the released checkpoints' layout, which
    SGLang's loader and transformers both read); 4 layers: ~0.4 B parameters."""

    num_layers: int = 4
    hidden: int = 2048
    moe_intermediate: int = 768
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    num_experts: int = 8
    experts_per_token: int = 2
    vocab: int = 4096
    max_positions: int = 16384

    def __post_init__(self):
        _check_heads(self)
        _check_experts(self)

    def hf_config(self) -> Dict[str, object]:
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": self.hidden, "intermediate_size": 4 * self.moe_intermediate,
            "moe_intermediate_size": self.moe_intermediate, "num_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab, "max_position_embeddings": self.max_positions,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        }

    def tensor_shapes(self) -> Dict[str, tuple]:
        """Parameter name (the released checkpoints' per-expert layout) -> shape, in order."""
        h, mi, q, kv, d = self.hidden, self.moe_intermediate, self.num_q_heads, self.num_kv_heads, self.head_dim
        out: Dict[str, tuple] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            out.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, q * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate.weight": (self.num_experts, h),
            })
            for j in range(self.num_experts):
                e = f"{p}mlp.experts.{j}."
                out.update({e + "gate_proj.weight": (mi, h), e + "up_proj.weight": (mi, h),
                            e + "down_proj.weight": (h, mi)})
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out


Shape = Union[LlamaShape, GptOssShape, Qwen3MoeShape]
SHAPES = {"llama": LlamaShape, "gpt-oss": GptOssShape, "qwen3-moe": Qwen3MoeShape}  # check.py --model


def init_of(name: str) -> Tuple[str, float]:
    """How the tensor ``name`` is drawn: ("ones", 0) for norm weights, ("zeros", 0) for biases,
    ("normal", std) otherwise (std None: the writer's ``std``; sinks: ``SINK_STD``)."""
    if name.endswith("norm.weight"):
        return "ones", 0.0
    if name.endswith("bias"):
        return "zeros", 0.0
    if name.endswith("sinks"):
        return "normal", SINK_STD
    return "normal", -1.0


def write_checkpoint(dest: str, shape: Shape = LlamaShape(), *, std: float = DEFAULT_STD,
                     seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Writes ``config.json`` and ``model.safetensors`` into ``dest`` (created) and returns it.

    Every matrix is N(0, std^2) from a seeded CPU generator (the same bytes on every host for
    one seed and shape); norm weights 1, biases 0, sinks N(0, SINK_STD^2) (``init_of``).
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
        kind, sd = init_of(name)
        if kind == "ones":
            tensors[name] = torch.ones(shp, dtype=torch_dtype)
        elif kind == "zeros":
            tensors[name] = torch.zeros(shp, dtype=torch_dtype)
        else:
            tensors[name] = (torch.randn(shp, generator=gen) * (std if sd < 0 else sd)).to(torch_dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(shape.hf_config(), torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
