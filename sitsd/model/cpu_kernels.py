"""CPU kernels: the references' semantics with fewer, larger torch ops.

`sitsd.kernels.reference` defines what every kernel computes and favours clarity; on the CPU,
where each small torch op costs microseconds of dispatch, a decode step of a 30-layer model
spent ~40% of its time outside the matmuls in them. These functions take the same arguments
and return the same results (tested against the references in `tests/model/`) for the cases
the CPU runner produces: float32, contiguous caches, no padding slots in decode batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sitsd.kernels import reference


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """`reference.reshape_and_cache_ref`, with `index_copy_` when no slot is skipped."""
    if int(slot_mapping.min()) < 0:  # a host read is free on the CPU
        reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    flat = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(flat, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(flat, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """`reference.decode_attention_ref`; one fused SDPA call per sequence."""
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        num_blocks = -(-seq_len // block_size)
        table = block_tables[i, :num_blocks].long()
        k = key_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
        v = value_cache[table].flatten(0, 1)[:seq_len].transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(
            query[i, :, None, :], k, v, scale=scale, enable_gqa=True
        )[:, 0]  # [H, D]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm_ref` for float32 inputs, as one torch op."""
    if x.dtype != torch.float32:
        return reference.rms_norm_ref(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fused_add_rms_norm_ref`: residual += x, then its RMSNorm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim], float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_embedding_ref` for float32, rotating both tensors in one pass each."""
    if query.dtype != torch.float32:
        return reference.rotary_embedding_ref(positions, query, key, cos_sin_cache)
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].unsqueeze(1).split(half, dim=-1)  # [T, 1, half] each
    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # [T, 1, head_dim]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.split(half, dim=-1)
        # rotate_half(x) = [-x2, x1]; (x * cos) + (rotate_half(x) * sin), as transformers.
        return x * cos2 + torch.cat([x2, x1], -1) * sin2

    return rotate(query), rotate(key)


def rotary_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_and_cache_ref` with this module's two halves."""
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return query, key


silu_and_mul = reference.silu_and_mul_ref
prefill_attention = reference.prefill_attention_ref
