"""Triton kernel: write each new token's K/V into its slot of the paged KV cache.

One program per token copies that token's `[num_kv_heads, head_dim]` rows of K and V to slot
`slot_mapping[t]` (block `slot // block_size`, offset `slot % block_size`); a slot of -1 (padding,
or a token whose K/V is already cached) writes nothing. The cache layout and the semantics are
`reference.reshape_and_cache_ref`'s. Which slots a token gets is the KV cache manager's business;
this kernel trusts the mapping (slots past the cache are not checked: that would need a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_device,
    check_same_dtype,
    check_shape,
    next_power_of_2,
)

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # -1 marks a token whose K/V must not be written: mask everything rather than return early,
    # so the kernel stays one straight-line body; a skipped token then moves no bytes at all.
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A skipped token gets an all-false mask. (Folding the scalar condition in through `where`
    # rather than `&` also sidesteps the interpreter turning scalar-and-block `&` into int32.)
    num_heads_written = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    # [BLOCK_H, BLOCK_D]
    mask = (offs_h[:, None] < num_heads_written) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = key_cache_ptr + block_id * stride_kcb + block_offset * stride_kcs
    v_dst = value_cache_ptr + block_id * stride_vcb + block_offset * stride_vcs
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 accepted), -1 = skip
) -> None:
    """Write K/V of new tokens into the paged cache in place (see `reshape_and_cache_ref`).

    `key`/`value` may be strided views (e.g. slices of a fused QKV projection) as long as their
    last dimension is contiguous; they are cast to the cache dtype on the way in.

    Args:
        key: New keys, fp32/fp16/bf16.
        value: New values, same dtype and shape as `key`.
        key_cache: Paged key cache, fp32/fp16/bf16, last dimension contiguous.
        value_cache: Paged value cache, same dtype and shape as `key_cache`.
        slot_mapping: Destination slot of each token, `block_id * block_size + offset`; -1 skips
            the token. Slots are not range-checked (no host sync).

    Raises:
        TypeError, ValueError: on a wrong dtype, shape, device or stride.
    """
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    check_shape("value", value, tuple(key.shape), "[num_tokens, num_kv_heads, head_dim]")
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    check_shape("key_cache", key_cache, cache_shape, "[num_blocks, block_size, kv_heads, head_dim]")
    check_shape("value_cache", value_cache, cache_shape, "key_cache's shape")
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")
    check_dtype("key", key, FLOAT_DTYPES)
    check_dtype("key_cache", key_cache, FLOAT_DTYPES)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_same_dtype(key=key, value=value)
    check_same_dtype(key_cache=key_cache, value_cache=value_cache)
    check_same_device(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        check_last_dim_contiguous(name, t)
    if slot_mapping.dim() == 1 and slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if num_tokens == 0:
        return

    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
