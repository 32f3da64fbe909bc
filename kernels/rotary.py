"""Triton kernel: rotary position embedding (rotate-half, GPT-NeoX / Hugging Face Llama style).

One program per token rotates all query and key heads of that token in place, reading the
token's row of the precomputed cos/sin table once. The table (Llama-3 frequency scaling
included) comes from `reference.compute_cos_sin_cache`; this kernel only applies it, with
`reference.rotary_embedding_ref`'s arithmetic (fp32, cast back to the input dtype). The rotary
dimension is the whole head (what the reference supports).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_same_dtype,
    next_power_of_2,
)

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    cos,  # [1, BLOCK_HALF] fp32
    sin,  # [1, BLOCK_HALF] fp32
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate `NUM_HEADS` heads starting at `x_ptr` (one token's row) in place."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    r1, r2 = _rotate(x1, x2, cos, sin)
    tl.store(ptrs, r1, mask=mask)
    tl.store(ptrs + HALF, r2, mask=mask)


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The rotated halves of a head, in fp32 and cast back to the input dtype (the reference's
    arithmetic)."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK_HALF
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64 (int32 accepted)
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotate-half RoPE to `query` and `key` **in place** and return them.

    Same values as `rotary_embedding_ref`, which returns new tensors instead: callers that need
    the unrotated inputs must copy them first. `query`/`key` may be strided views (e.g. of a
    fused QKV output) as long as the last dimension is contiguous. Positions are not
    range-checked (no host sync).

    Args:
        positions: Absolute position of each token.
        query: Queries, fp32/fp16/bf16.
        key: Keys, `query`'s dtype, same number of tokens and head_dim.
        cos_sin_cache: Table from `compute_cos_sin_cache`, any float dtype, contiguous rows.

    Returns:
        `(query, key)`, rotated.
    """
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key shape {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(
            f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the even head_dim {head_dim}"
        )
    check_dtype("positions", positions, INDEX_DTYPES)
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    check_same_dtype(query=query, key=key)
    check_same_device(query=query, key=key, positions=positions, cos_sin_cache=cos_sin_cache)
    for name, t in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, t)
    check_contiguous("positions", positions)
    if num_tokens == 0:
        return query, key

    half = head_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_KV_H=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half), num_warps=4,
    )  # fmt: skip
    return query, key
