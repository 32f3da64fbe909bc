"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) over a paged KV cache.

The model is a function of its weights: `LlamaModel` holds the architecture, the kernels and the
rotary tables; `LlamaWeights` holds the tensors. Keeping them apart is what lets the daemon keep
two weight slots and flip between them between two steps (hot-swap) with the same model object,
and capture CUDA graphs per slot. The weights' table, and how a checkpoint (16-bit or quantized)
becomes them, are `sitsd.model.weights`' (re-exported here); a linear weight may be dense or a
quantized layout, and the kernel set's linears take either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sitsd.kernels.reference import compute_cos_sin_cache
from sitsd.model.arch import LlamaArch
from sitsd.model.attention import AttentionMetadata, paged_attention
from sitsd.model.ops import KernelSet
from sitsd.model.weights import (
    LayerWeights,
    LlamaWeights,
    ServingFormat,
    WeightsError,
    build_weights,
    check_tensors,
    empty_weights_like,
    expected_shapes,
    expected_tensors,
    weight_copy_plan,
)

__all__ = [
    "LayerWeights",
    "LlamaModel",
    "LlamaWeights",
    "ServingFormat",
    "WeightsError",
    "build_weights",
    "check_tensors",
    "empty_weights_like",
    "expected_shapes",
    "expected_tensors",
    "weight_copy_plan",
]


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
        if hidden.dtype != weights.norm.dtype:  # a 16-bit embedding under float32 activations
            hidden = hidden.to(weights.norm.dtype)
        residual: torch.Tensor | None = None
        eps = arch.rms_norm_eps
        for layer, kv_cache in zip(weights.layers, kv_caches):
            # Pre-norm: (residual add +) RMSNorm, then the projection; the first layer has no
            # residual to add yet. qkv may come as a split-K layer's float32 partials [parts,
            # T, q + 2 * kv], which the rotary kernel sums into the normed input's dtype.
            qkv, residual = k.norm_linear(
                hidden, residual, layer.input_norm, eps, layer.qkv_proj, layer.qkv_bias,
                unsummed=True,
            )  # fmt: skip
            qkv_dtype = torch.promote_types(residual.dtype, layer.input_norm.dtype)
            hidden = self._attention(layer, qkv, positions, meta, kv_cache, qkv_dtype)
            gate_up, residual = k.norm_linear(
                hidden, residual, layer.post_attn_norm, eps, layer.gate_up_proj
            )  # [T, 2 * intermediate]
            # o's and down's outputs go into an add + RMSNorm, which sums a split-K layer's
            # partials itself (`qlinear.split_partials`): one launch fewer each
            hidden = k.swiglu_linear(gate_up, layer.down_proj, unsummed=True)  # [T, hidden]
        assert residual is not None, "a model has at least one layer"
        hidden, _ = k.fused_add_rms_norm(hidden, residual, weights.norm, arch.rms_norm_eps)
        return hidden

    def _attention(
        self,
        layer: LayerWeights,
        qkv: torch.Tensor,  # [(parts,) T, q_size + 2 * kv_size], the normed input's projection
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        dtype: torch.dtype,  # the activations' (qkv's, once summed)
    ) -> torch.Tensor:  # [T, hidden]
        arch = self.arch
        num_tokens = positions.shape[0]
        q, k, v = qkv.split([arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
        q = q.unflatten(-1, (arch.num_heads, arch.head_dim))  # [(parts,) T, heads, head_dim]
        k = k.unflatten(-1, (arch.num_kv_heads, arch.head_dim))
        v = v.unflatten(-1, (arch.num_kv_heads, arch.head_dim))
        key_cache, value_cache = kv_cache
        args = (positions, q, k, v, self.cos_sin_cache, key_cache, value_cache, meta.slot_mapping)
        if qkv.dim() == 3:  # a split layer's partials, summed and rounded to `dtype` there
            q, k = self.kernels.rotary_and_cache(*args, dtype=dtype)
        else:
            q, k = self.kernels.rotary_and_cache(*args)
        out = paged_attention(self.kernels, q, kv_cache, meta, self.scale)
        return self.kernels.linear(out.reshape(num_tokens, arch.q_size), layer.o_proj,
                                   unsummed=True)  # fmt: skip

    def compute_logits(
        self,
        weights: LlamaWeights,
        hidden: torch.Tensor,  # [num_seqs, hidden]
    ) -> torch.Tensor:  # [num_seqs, vocab] float32
        return self.kernels.linear(hidden, weights.lm_head).float()
