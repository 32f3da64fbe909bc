"""reshape_and_cache (Triton) against reshape_and_cache_ref: every slot written, -1 skipped."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.reference import reshape_and_cache_ref
from sitsd.kernels.reshape_and_cache import reshape_and_cache


def _inputs(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, cache_dtype, device):
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere: comparing with the reference also shows nothing else was touched.
    key_cache = torch.full(cache_shape, float("nan"), device=device).to(cache_dtype)
    value_cache = torch.full(cache_shape, float("nan"), device=device).to(cache_dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slot_mapping[torch.rand(num_tokens, device=device) < 0.3] = -1
    return key, value, key_cache, value_cache, slot_mapping


def _check_against_reference(key, value, key_cache, value_cache, slot_mapping):
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slot_mapping)
    assert reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) is None
    # A copy (and cast) must be exact; equal_nan: untouched slots stay NaN on both sides.
    assert torch.allclose(key_cache.float(), ref_k.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(value_cache.float(), ref_v.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (8, 128), (3, 80)])
def test_writes_each_token_to_its_slot_and_skips_minus_one(
    dtype, num_tokens, num_kv_heads, head_dim, device
):
    args = _inputs(num_tokens, num_kv_heads, head_dim, 9, 16, dtype, dtype, device)
    _check_against_reference(*args)


def test_all_minus_one_writes_nothing(device):
    key, value, key_cache, value_cache, slot_mapping = _inputs(
        5, 2, 64, 4, 16, torch.float16, torch.float16, device
    )
    reshape_and_cache(key, value, key_cache, value_cache, torch.full_like(slot_mapping, -1))
    assert key_cache.isnan().all()
    assert value_cache.isnan().all()


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(torch.float32, torch.float16), (torch.float16, torch.float32)]
)
def test_casts_to_the_cache_dtype(dtype, cache_dtype, device):
    # fp32 -> bf16 is checked on the GPU only: the interpreter truncates that cast instead of
    # rounding to nearest even (see kernels/NOTES.md).
    args = _inputs(7, 2, 64, 4, 16, dtype, cache_dtype, device)
    _check_against_reference(*args)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, device):
    args = _inputs(13, 2, 64, 20, block_size, torch.float16, torch.float16, device)
    _check_against_reference(*args)


def test_int32_slot_mapping_and_strided_views_of_a_fused_qkv(device):
    _, _, key_cache, value_cache, slot_mapping = _inputs(
        11, 2, 64, 4, 16, torch.float16, torch.float16, device
    )
    qkv = torch.randn(11, 8 + 2 + 2, 64, device=device).half()  # [T, H + 2 Hkv, D]
    key, value = qkv[:, 8:10], qkv[:, 10:]
    _check_against_reference(key, value, key_cache, value_cache, slot_mapping.to(torch.int32))


def test_cache_view_of_a_fused_kv_pool(device):
    pool = torch.full((2, 6, 16, 2, 64), float("nan"), device=device).half()  # [2, NB, BS, H, D]
    key, value, _, _, slot_mapping = _inputs(9, 2, 64, 6, 16, torch.float16, torch.float16, device)
    _check_against_reference(key, value, pool[0], pool[1], slot_mapping)


@pytest.mark.parametrize(
    ("index", "bad", "error", "match"),
    [
        (0, lambda k: k.to(torch.int32), TypeError, "key must have dtype"),
        (1, lambda v: v.float(), TypeError, "dtypes must match"),
        (1, lambda v: v[:-1], ValueError, "value must have shape"),
        (2, lambda c: c[..., :32], ValueError, "key_cache must have shape"),
        (3, lambda c: c.float(), TypeError, "dtypes must match"),
        (4, lambda s: s.float(), TypeError, "slot_mapping must have dtype"),
        (4, lambda s: s[:-1], ValueError, "slot_mapping must have shape"),
        (
            0,
            lambda k: k.transpose(1, 2).contiguous().transpose(1, 2),
            ValueError,
            "key must be contiguous in its last dimension",
        ),
        (0, lambda k: k[0], ValueError, r"key must be \[num_tokens"),
    ],
)
def test_wrapper_rejects_bad_arguments_with_clear_errors(index, bad, error, match, device):
    args = list(_inputs(4, 2, 64, 3, 16, torch.float16, torch.float16, device))
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        reshape_and_cache(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (8, 128), (2, 128), (8, 64)])
def test_gpu_grid_matches_reference(dtype, num_kv_heads, head_dim, device):
    for num_tokens in (1, 7, 33, 4099):
        args = _inputs(num_tokens, num_kv_heads, head_dim, 400, 16, dtype, dtype, device)
        _check_against_reference(*args)
    args = _inputs(257, num_kv_heads, head_dim, 40, 16, torch.float32, dtype, device)
    _check_against_reference(*args)  # cast on the way in, rounded to nearest even
