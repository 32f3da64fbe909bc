"""The shape of a Llama-family model (Llama 2/3, SmolLM2, Mistral), as plain data.

Loaders (`sitsd.weights`) fill it from a Hugging Face `config.json` or GGUF metadata; the model
(`sitsd.model.llama`) and the runtime size themselves from it. It holds no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral")


@dataclass(frozen=True)
class LlamaArch:
    """Hyper-parameters of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias
    sliding_window: int | None = None  # Mistral v0.1: attention window (served length is capped)
    architecture: str = "llama"  # "llama" or "mistral"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unused source keys

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes


def arch_from_hf_config(cfg: dict[str, Any]) -> LlamaArch:
    """Build a `LlamaArch` from a Hugging Face `config.json` dict (Llama, Mistral, SmolLM2)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    known = {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "sliding_window",
        "model_type",
    }
    rope_params = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    return LlamaArch(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=cfg.get("sliding_window"),
        architecture=model_type,
        extra={k: v for k, v in cfg.items() if k not in known},
    )
