"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over a paged KV cache.

The model is a function of its weights: `LlamaModel` holds the architecture, the kernels and the
rotary tables; `LlamaWeights` holds the tensors. Keeping them apart is what lets the daemon keep
two weight slots and flip between them between two steps (hot-swap) with the same model object,
and capture CUDA graphs per slot. `build_weights` turns a checkpoint's Hugging Face-named
tensors into `LlamaWeights` (fusing q/k/v and gate/up), checking names, shapes and finiteness;
`weight_copy_plan` says where each checkpoint tensor goes in an existing `LlamaWeights` (a
weight slot filled in place).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sitsd.kernels.reference import compute_cos_sin_cache
from sitsd.model.arch import LlamaArch
from sitsd.model.attention import AttentionMetadata, paged_attention
from sitsd.model.ops import KernelSet


class WeightsError(ValueError):
    """Checkpoint tensors that do not fit the architecture (names, shapes, values)."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_attn_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]


@dataclass
class LlamaWeights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding tensor itself when tied

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "embed_tokens", self.embed_tokens
        for i, layer in enumerate(self.layers):
            for name, t in vars(layer).items():
                if t is not None:
                    yield f"layers.{i}.{name}", t
        yield "norm", self.norm
        if self.lm_head is not self.embed_tokens:
            yield "lm_head", self.lm_head

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())


# The Hugging Face names of the model's own tensors, and of a layer's (`_layer_tensors`)
_EMBED = "model.embed_tokens.weight"
_FINAL_NORM = "model.norm.weight"
_LM_HEAD = "lm_head.weight"
_LAYER = "model.layers.{}."


@dataclass(frozen=True)
class _LayerTensor:
    """One `LayerWeights` field and the checkpoint tensors whose rows it concatenates."""

    field: str  # the `LayerWeights` attribute
    # (Hugging Face name under `model.layers.{n}.`, its shape), in row order
    parts: tuple[tuple[str, tuple[int, ...]], ...]


def _layer_tensors(arch: LlamaArch) -> tuple[_LayerTensor, ...]:
    """A layer's tensors: the one place their Hugging Face names and shapes are spelled
    (`expected_shapes`, `build_weights` and `weight_copy_plan` read it, in this order). q/k/v
    and gate/up are fused; the q/k/v biases exist only with `arch.attention_bias`."""
    h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    attn, mlp = "self_attn.", "mlp."
    table = [
        _LayerTensor("input_norm", (("input_layernorm.weight", (h,)),)),
        _LayerTensor("qkv_proj", ((attn + "q_proj.weight", (q, h)),
                                  (attn + "k_proj.weight", (kv, h)),
                                  (attn + "v_proj.weight", (kv, h)))),
        _LayerTensor("o_proj", ((attn + "o_proj.weight", (h, q)),)),
        _LayerTensor("post_attn_norm", (("post_attention_layernorm.weight", (h,)),)),
        _LayerTensor("gate_up_proj", ((mlp + "gate_proj.weight", (i, h)),
                                      (mlp + "up_proj.weight", (i, h)))),
        _LayerTensor("down_proj", ((mlp + "down_proj.weight", (h, i)),)),
    ]  # fmt: skip
    if arch.attention_bias:
        table.append(_LayerTensor("qkv_bias", ((attn + "q_proj.bias", (q,)),
                                               (attn + "k_proj.bias", (kv,)),
                                               (attn + "v_proj.bias", (kv,)))))  # fmt: skip
    return tuple(table)


def expected_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names of the architecture and their shapes."""
    layer = _layer_tensors(arch)
    shapes: dict[str, tuple[int, ...]] = {_EMBED: (arch.vocab_size, arch.hidden_size)}
    for n in range(arch.num_layers):
        shapes |= {_LAYER.format(n) + name: shape for t in layer for name, shape in t.parts}
    shapes[_FINAL_NORM] = (arch.hidden_size,)
    if not arch.tie_word_embeddings:
        shapes[_LM_HEAD] = (arch.vocab_size, arch.hidden_size)
    return shapes


def check_tensors(arch: LlamaArch, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise `WeightsError` unless every expected tensor is present with its shape."""
    expected = expected_shapes(arch)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise WeightsError(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise WeightsError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.dtype.is_floating_point:
            raise WeightsError(f"{name} has dtype {t.dtype}, expected a floating-point type")


def build_weights(
    arch: LlamaArch,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
) -> LlamaWeights:
    """Convert Hugging Face-named tensors to `LlamaWeights` on `device` in `dtype`.

    Raises:
        WeightsError: a tensor is missing, misshapen, or holds NaN/Inf after the cast.
    """
    check_tensors(arch, tensors)

    def get(name: str) -> torch.Tensor:
        t = tensors[name].to(device=device, dtype=dtype)
        if not torch.isfinite(t).all():
            raise WeightsError(f"{name} holds NaN or Inf values (in {dtype})")
        return t

    def concat(names: list[str]) -> torch.Tensor:
        if len(names) == 1:
            return get(names[0])
        return torch.cat([get(name) for name in names], dim=0).contiguous()

    table = _layer_tensors(arch)
    layers = []
    for n in range(arch.num_layers):
        prefix = _LAYER.format(n)
        fields = {t.field: concat([prefix + name for name, _ in t.parts]) for t in table}
        # The table names every field but `qkv_bias` where there is no bias.
        layers.append(LayerWeights(**{"qkv_bias": None, **fields}))  # type: ignore[arg-type]
    embed = get(_EMBED)
    lm_head = embed if arch.tie_word_embeddings else get(_LM_HEAD)
    return LlamaWeights(embed, layers, get(_FINAL_NORM), lm_head)


def weight_copy_plan(arch: LlamaArch, weights: LlamaWeights) -> list[tuple[torch.Tensor, str]]:
    """(destination, Hugging Face name) pairs that fill `weights` from a checkpoint, in place.

    The destinations are views into `weights`' tensors: the q/k/v rows of `qkv_proj`, the
    gate/up rows of `gate_up_proj`, whole tensors elsewhere; copying each checkpoint tensor into
    its view gives what `build_weights` builds, without a new allocation (a weight slot's
    addresses never change, so CUDA graphs captured on it stay valid).
    """
    table = _layer_tensors(arch)
    plan = [(weights.embed_tokens, _EMBED)]
    for n, layer in enumerate(weights.layers):
        prefix = _LAYER.format(n)
        for t in table:
            fused: torch.Tensor = getattr(layer, t.field)
            if len(t.parts) == 1:
                plan.append((fused, prefix + t.parts[0][0]))
                continue
            start = 0
            for name, shape in t.parts:
                plan.append((fused[start : start + shape[0]], prefix + name))
                start += shape[0]
    plan.append((weights.norm, _FINAL_NORM))
    if weights.lm_head is not weights.embed_tokens:
        plan.append((weights.lm_head, _LM_HEAD))
    return plan


def empty_weights_like(weights: LlamaWeights, *, zero: bool = False) -> LlamaWeights:
    """A second set of tensors shaped like `weights` (tied embeddings stay tied)."""
    make = torch.zeros_like if zero else torch.empty_like
    layers = [
        LayerWeights(**{name: None if t is None else make(t) for name, t in vars(layer).items()})  # type: ignore[arg-type]
        for layer in weights.layers
    ]
    embed = make(weights.embed_tokens)
    lm_head = embed if weights.lm_head is weights.embed_tokens else make(weights.lm_head)
    return LlamaWeights(embed, layers, make(weights.norm), lm_head)


class LlamaModel:
    """The forward pass; weights are an argument, not state."""

    def __init__(
        self, arch: LlamaArch, kernels: KernelSet, max_position: int, device: torch.device | str
    ) -> None:
        self.arch = arch
        self.kernels = kernels
        self.scale = arch.head_dim**-0.5
        self.cos_sin_cache = compute_cos_sin_cache(
            arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling
        ).to(device)  # [max_position, head_dim], float32

    def forward(
        self,
        weights: LlamaWeights,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
    ) -> torch.Tensor:  # [num_tokens, hidden]
        arch, k = self.arch, self.kernels
        hidden = F.embedding(input_ids, weights.embed_tokens)  # [T, hidden]
        residual: torch.Tensor | None = None
        eps = arch.rms_norm_eps
        for layer, kv_cache in zip(weights.layers, kv_caches):
            # Pre-norm: (residual add +) RMSNorm, then the projection; the first layer has no
            # residual to add yet.
            qkv, residual = k.norm_linear(
                hidden, residual, layer.input_norm, eps, layer.qkv_proj, layer.qkv_bias
            )  # [T, q + 2 * kv]
            hidden = self._attention(layer, qkv, positions, meta, kv_cache)
            gate_up, residual = k.norm_linear(
                hidden, residual, layer.post_attn_norm, eps, layer.gate_up_proj
            )  # [T, 2 * intermediate]
            hidden = k.swiglu_linear(gate_up, layer.down_proj)  # [T, hidden]
        assert residual is not None, "a model has at least one layer"
        hidden, _ = k.fused_add_rms_norm(hidden, residual, weights.norm, arch.rms_norm_eps)
        return hidden

    def _attention(
        self,
        layer: LayerWeights,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size], the normed input's projection
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # [T, hidden]
        arch = self.arch
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
        q = q.view(num_tokens, arch.num_heads, arch.head_dim)
        k = k.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        v = v.view(num_tokens, arch.num_kv_heads, arch.head_dim)
        key_cache, value_cache = kv_cache
        q, k = self.kernels.rotary_and_cache(
            positions, q, k, v, self.cos_sin_cache, key_cache, value_cache, meta.slot_mapping
        )
        out = paged_attention(self.kernels, q, kv_cache, meta, self.scale)
        return self.kernels.linear(out.reshape(num_tokens, arch.q_size), layer.o_proj)

    def compute_logits(
        self,
        weights: LlamaWeights,
        hidden: torch.Tensor,  # [num_seqs, hidden]
    ) -> torch.Tensor:  # [num_seqs, vocab] float32
        return self.kernels.linear(hidden, weights.lm_head).float()
