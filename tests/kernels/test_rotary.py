"""rotary_embedding (Triton) against rotary_embedding_ref, with plain and Llama-3 scaled tables."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.reference import compute_cos_sin_cache, rotary_embedding_ref
from sitsd.kernels.rotary import rotary_embedding
from tests.kernels.helpers import assert_close

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _check(
    num_tokens,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    device,
    *,
    rope_scaling=None,
    max_position=2048,
    cache_dtype=torch.float32,
):
    cos_sin = compute_cos_sin_cache(
        head_dim, max_position, 500000.0, rope_scaling, dtype=cache_dtype
    ).to(device)
    positions = torch.randint(0, max_position, (num_tokens,), device=device)
    query = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    ref_q, ref_k = rotary_embedding_ref(positions, query, key, cos_sin)
    out_q, out_k = rotary_embedding(positions, query, key, cos_sin)
    assert out_q is query  # rotated in place, as documented
    assert out_k is key
    assert_close(out_q, ref_q, dtype)
    assert_close(out_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (9, 3, 64)]
)
def test_matches_reference(dtype, num_tokens, num_heads, num_kv_heads, head_dim, device):
    _check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device)


def test_llama3_scaled_table_matches_reference(device):
    _check(17, 8, 2, 128, torch.float32, device, rope_scaling=LLAMA3_SCALING, max_position=20000)


def test_low_precision_table_matches_reference(device):
    _check(9, 4, 2, 64, torch.float16, device, cache_dtype=torch.float16)


def test_rotates_strided_views_of_a_fused_qkv_in_place(device):
    cos_sin = compute_cos_sin_cache(64, 512, 10000.0).to(device)
    qkv = torch.randn(11, 8 + 2 + 2, 64, device=device).half()  # [T, H + 2 Hkv, D]
    positions = torch.randint(0, 512, (11,), device=device, dtype=torch.int32)
    before = qkv.clone()
    ref_q, ref_k = rotary_embedding_ref(positions, qkv[:, :8], qkv[:, 8:10], cos_sin)
    rotary_embedding(positions, qkv[:, :8], qkv[:, 8:10], cos_sin)
    assert_close(qkv[:, :8], ref_q, torch.float16)
    assert_close(qkv[:, 8:10], ref_k, torch.float16)
    assert torch.equal(qkv[:, 10:], before[:, 10:])  # V untouched


def test_wrapper_rejects_bad_arguments_with_clear_errors(device):
    cos_sin = compute_cos_sin_cache(64, 16, 10000.0).to(device)
    positions = torch.arange(3, device=device)
    q = torch.randn(3, 4, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    with pytest.raises(TypeError, match="positions must have dtype"):
        rotary_embedding(positions.float(), q, k, cos_sin)
    with pytest.raises(TypeError, match="dtypes must match"):
        rotary_embedding(positions, q, k.half(), cos_sin)
    with pytest.raises(ValueError, match="cos_sin_cache width 32 must equal"):
        rotary_embedding(positions, q, k, cos_sin[:, :32])
    with pytest.raises(ValueError, match="key shape"):
        rotary_embedding(positions, q, k[:2], cos_sin)
    with pytest.raises(ValueError, match="positions has 2 entries for 3 tokens"):
        rotary_embedding(positions[:2], q, k, cos_sin)
    with pytest.raises(ValueError, match="query must be contiguous in its last dimension"):
        rotary_embedding(positions, q.transpose(1, 2).contiguous().transpose(1, 2), k, cos_sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (32, 32, 128), (16, 2, 64), (9, 3, 64)],
)
def test_gpu_grid_matches_reference(dtype, num_heads, num_kv_heads, head_dim, device):
    for num_tokens in (1, 7, 33, 8191):
        _check(
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            rope_scaling=LLAMA3_SCALING,
            max_position=131072,
        )
