"""Triton kernel: rotary position embedding and the paged-cache write, in one launch.

One program per new token of a step rotates its query heads in place (rotate-half, GPT-NeoX /
Hugging Face Llama style), rotates its key heads (in place, and into the token's cache slot) and
copies its value heads into the slot. A decode step of a 32-layer model runs both once per layer,
so fusing them saves a launch and a gap between kernels per layer, and the rotated keys are
written from registers instead of being read back. Slot -1 (padding, or a token whose K/V is
already cached) writes nothing to the cache; its query and key are still rotated. Values are
`reference.rotary_and_cache_ref`'s: `rotary_embedding_ref`'s arithmetic (fp32, cast back to the
input dtype), then `reshape_and_cache_ref`'s write. The cos/sin table (Llama-3 frequency scaling
included) is `reference.compute_cos_sin_cache`'s; which slot a token gets, the KV cache manager's.

Q, K and V may also come as the float32 partials of a QKV projection split along K
(`int4_matmul(unsummed=True)`): each program then sums its token's parts in split order and
rounds them to the activation dtype, as `int4_matmul`'s own sum does, before the rotation; the
rotated query and key go to new tensors. That saves the projection's summing launch and its
16-bit round trip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_pdl,
    check_same_device,
    check_same_dtype,
    check_shape,
    next_power_of_2,
)

__all__ = ["rotary_and_cache"]


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The rotated halves of a head, in fp32 and cast back to the input dtype (the reference's
    arithmetic)."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def _load(ptrs, mask, parts_stride, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """The values at `ptrs`; with `PARTS` > 0 the sum of that many float32 partials,
    `parts_stride` elements apart, in split order from 0.0 and rounded to `DTYPE` (the bits of
    `int4_matmul`'s `_split_sum_kernel`)."""
    if PARTS > 0:
        acc = tl.full(ptrs.shape, 0.0, tl.float32)
        for part in tl.static_range(PARTS):
            acc += tl.load(ptrs + part * parts_stride, mask=mask, other=0.0)
        return acc.to(DTYPE)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    out_ptr,
    stride_oh,
    cos,  # [1, BLOCK_HALF] fp32
    sin,  # [1, BLOCK_HALF] fp32
    parts_stride,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Rotate `NUM_HEADS` heads starting at `x_ptr` (one token's row, or its partials) into
    `out_ptr` (`x_ptr` itself: in place)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)  # [BLOCK_H, BLOCK_HALF]
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = _load(ptrs, mask, parts_stride, PARTS, dtype)
    x2 = _load(ptrs + HALF, mask, parts_stride, PARTS, dtype)
    r1, r2 = _rotate(x1, x2, cos, sin)
    out_ptrs = out_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, r1, mask=mask)
    tl.store(out_ptrs + HALF, r2, mask=mask)


@triton.jit
def _rotary_and_cache_kernel(
    positions_ptr,
    slot_mapping_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,  # the rotated query: q_ptr itself (in place) without partials
    k_out_ptr,  # the rotated key: k_ptr itself (in place) without partials
    cos_sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    parts_stride,  # PARTS: elements between two partials of q, k and v
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PARTS: tl.constexpr,  # q, k and v are this many float32 partials summed here (0: themselves)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_KV_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * stride_qot,
                  stride_qoh, cos, sin, parts_stride, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF,
                  PARTS)  # fmt: skip

    # Keys: rotate in registers, store to the key rows and to the cache slot.
    mask = (offs_h[:, None] < NUM_KV_HEADS) & d_mask[None, :]  # [BLOCK_KV_H, BLOCK_HALF]
    k_ptrs = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    dtype = k_out_ptr.dtype.element_ty
    k1 = _load(k_ptrs, mask, parts_stride, PARTS, dtype)
    k2 = _load(k_ptrs + HALF, mask, parts_stride, PARTS, dtype)
    r1, r2 = _rotate(k1, k2, cos, sin)
    k_out = k_out_ptr + token * stride_kot + offs_h[:, None] * stride_koh + offs_d[None, :]
    tl.store(k_out, r1, mask=mask)
    tl.store(k_out + HALF, r2, mask=mask)

    # The cache write: slot -1 gets an all-false mask rather than an early return, so the body
    # stays straight-line. The scalar condition goes in through `where`, not `&`: the
    # interpreter turns scalar-and-block `&` into an int32 block, which a mask rejects.
    heads_written = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    cmask = (offs_h[:, None] < heads_written) & d_mask[None, :]
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE
    kc = (
        key_cache_ptr
        + block_id * stride_kcb
        + block_offset * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :]
    )
    cache_ty = key_cache_ptr.dtype.element_ty
    tl.store(kc, r1.to(cache_ty), mask=cmask)
    tl.store(kc + HALF, r2.to(cache_ty), mask=cmask)
    v_ptrs = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    vc = (
        value_cache_ptr
        + block_id * stride_vcb
        + block_offset * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :]
    )
    v1 = _load(v_ptrs, cmask, parts_stride, PARTS, dtype)
    v2 = _load(v_ptrs + HALF, cmask, parts_stride, PARTS, dtype)
    tl.store(vc, v1.to(cache_ty), mask=cmask)
    tl.store(vc + HALF, v2.to(cache_ty), mask=cmask)


def rotary_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64 (int32 accepted)
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos half, then sin half
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 accepted), -1 = skip
    *,
    dtype: torch.dtype | None = None,  # with partials: the dtype their sums round to
    pdl: bool = False,  # programmatic dependent launch (`kernels/_pdl.py`; sm_90+)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` and `key` **in place** (as `rotary_embedding_ref`, which returns new
    tensors instead), write the rotated keys and the values into the paged cache, cast to its
    dtype (as `reshape_and_cache_ref`); returns `(query, key)`.

    `query`/`key`/`value` may be strided views of a fused QKV output with a contiguous last
    dimension. Positions and slots are not range-checked (no host sync).

    They may also be views of a split-K projection's float32 partials, `[parts, num_tokens,
    heads, head_dim]` each, one parts stride for all three (`int4_matmul(unsummed=True)`):
    q, k and v are then their sums in split order rounded to `dtype` (which the call must
    give), and the rotated query and key are returned in new tensors of that dtype.

    Raises:
        TypeError, ValueError: on a wrong dtype, shape, device or stride.
    """
    parts = None
    if query.dim() == 4:  # a split projection's partials, summed here
        parts = query.shape[0]
        for name, t in (("query", query), ("key", key), ("value", value)):
            check_dtype(name, t, (torch.float32,))
            check_ndim(name, t, 4, "[parts, num_tokens, heads, head_dim]")
            if t.shape[0] != parts or t.stride(0) != query.stride(0):
                raise ValueError(f"{name} partials {tuple(t.shape)} (stride {t.stride(0)}) do "
                                 f"not match query's {tuple(query.shape)} (stride "
                                 f"{query.stride(0)})")  # fmt: skip
        if dtype is None or dtype not in FLOAT_DTYPES:
            raise TypeError(f"partials need the dtype their sums round to, got {dtype}")
        parts_stride = query.stride(0)
        query, key, value = query[0], key[0], value[0]
    elif dtype is not None:
        raise ValueError("dtype applies to partials only: q, k and v keep their own")
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, head_dim]")
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key shape {tuple(key.shape)} does not match query {tuple(query.shape)}")
    check_shape("value", value, tuple(key.shape), "key's shape")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(
            f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal the even head_dim {head_dim}"
        )
    num_blocks, block_size = key_cache.shape[:2]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    check_shape("key_cache", key_cache, cache_shape, "[num_blocks, block_size, kv_heads, head_dim]")
    check_shape("value_cache", value_cache, cache_shape, "key_cache's shape")
    check_dtype("positions", positions, INDEX_DTYPES)
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    check_dtype("key_cache", key_cache, FLOAT_DTYPES)
    check_same_dtype(query=query, key=key, value=value)
    check_same_dtype(key_cache=key_cache, value_cache=value_cache)
    check_same_device(
        query=query, key=key, value=value, positions=positions, cos_sin_cache=cos_sin_cache,
        key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    for name, t in (("query", query), ("key", key), ("value", value),
                    ("cos_sin_cache", cos_sin_cache), ("key_cache", key_cache),
                    ("value_cache", value_cache)):  # fmt: skip
        check_last_dim_contiguous(name, t)
    check_contiguous("positions", positions)
    check_contiguous("slot_mapping", slot_mapping)
    check_pdl(pdl, query)
    if parts is None:
        parts_stride, q_out, k_out = 0, query, key
    else:
        q_out = torch.empty(query.shape, dtype=dtype, device=query.device)
        k_out = torch.empty(key.shape, dtype=dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out

    half = head_dim // 2
    _rotary_and_cache_kernel[(num_tokens,)](
        positions, slot_mapping, query, key, value, q_out, k_out, cos_sin_cache, key_cache,
        value_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
        k_out.stride(1), parts_stride, cos_sin_cache.stride(0),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_KV_H=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(half), PARTS=parts or 0, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return q_out, k_out
