"""rotary_and_cache (Triton) against rotary_and_cache_ref: rotated Q/K in place, rotated K and V
in their slots (cast to the cache dtype), -1 skipped, nothing else touched."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.int4_matmul import Int4MatmulConfig, int4_matmul
from sitsd.kernels.reference import compute_cos_sin_cache, rotary_and_cache_ref
from sitsd.kernels.rotary_cache import rotary_and_cache
from tests.kernels.helpers import assert_close
from tests.kernels.int4_inputs import random_int4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, *, num_blocks=9,
            block_size=16, max_position=2048, skip=0.3, cache_dtype=None,
            rope_scaling=LLAMA3_SCALING, table_dtype=torch.float32):  # fmt: skip
    cos_sin = compute_cos_sin_cache(
        head_dim, max_position, 500000.0, rope_scaling, dtype=table_dtype
    ).to(device)
    positions = torch.randint(0, max_position, (num_tokens,), device=device)
    # One fused QKV row per token, as the model hands them over: strided views.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=device).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere: comparing with the reference also shows nothing else was written.
    key_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype or dtype)
    value_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype or dtype)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[torch.rand(num_tokens, device=device) < skip] = -1
    return positions, q, k, v, cos_sin, key_cache, value_cache, slots


def _check(positions, q, k, v, cos_sin, key_cache, value_cache, slots):
    dtype, cache_dtype = q.dtype, key_cache.dtype
    coarser = max(dtype, cache_dtype, key=lambda d: torch.finfo(d).eps)
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    ref_q, ref_k = rotary_and_cache_ref(positions, q, k, v, cos_sin, ref_kc, ref_vc, slots)
    v_before = v.clone()
    out_q, out_k = rotary_and_cache(positions, q, k, v, cos_sin, key_cache, value_cache, slots)
    assert out_q is q  # in place, as documented
    assert out_k is k
    assert_close(q, ref_q, dtype)
    assert_close(k, ref_k, dtype)
    assert torch.equal(v, v_before)
    keep = slots >= 0
    written = slots[keep]
    flat = key_cache.shape[0] * key_cache.shape[1]
    for cache, ref in ((key_cache, ref_kc), (value_cache, ref_vc)):
        got, want = cache.view(flat, -1), ref.view(flat, -1)
        if written.numel():
            assert_close(got[written], want[written], coarser)
        untouched = torch.ones(flat, dtype=torch.bool, device=cache.device)
        untouched[written] = False
        assert got[untouched].isnan().all()
    # The cache holds the very keys left in `key` and the values, cast: exact, except where the
    # interpreter truncates an fp32 -> bf16 cast that torch rounds (kernels/NOTES.md).
    if not (q.device.type == "cpu" and dtype == torch.float32 and cache_dtype == torch.bfloat16):
        assert torch.equal(key_cache.view(flat, *k.shape[1:])[written], k[keep].to(cache_dtype))
        assert torch.equal(value_cache.view(flat, *v.shape[1:])[written], v[keep].to(cache_dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (9, 3, 80)]
)
def test_matches_reference(dtype, num_tokens, num_heads, num_kv_heads, head_dim, device):
    _check(*_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device))


def test_all_minus_one_rotates_but_writes_nothing(device):
    args = _inputs(5, 4, 2, 64, torch.float16, device, skip=1.1)
    _check(*args)
    assert args[5].isnan().all()
    assert args[6].isnan().all()


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(torch.float32, torch.float16), (torch.float16, torch.float32)]
)
def test_casts_to_the_cache_dtype(dtype, cache_dtype, device):
    # fp32 -> bf16 is checked on the GPU only: the interpreter truncates that cast instead of
    # rounding to nearest even (see kernels/NOTES.md).
    _check(*_inputs(7, 4, 2, 64, dtype, device, cache_dtype=cache_dtype))


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, device):
    _check(*_inputs(13, 4, 2, 64, torch.float16, device, num_blocks=20, block_size=block_size))


@pytest.mark.parametrize(
    ("rope_scaling", "table_dtype"), [(None, torch.float32), (LLAMA3_SCALING, torch.float16)]
)
def test_plain_and_low_precision_tables(rope_scaling, table_dtype, device):
    args = _inputs(9, 4, 2, 64, torch.float16, device, rope_scaling=rope_scaling,
                   table_dtype=table_dtype, max_position=20000)  # fmt: skip
    _check(*args)


def test_int32_positions_and_slots(device):
    positions, *rest, slots = _inputs(11, 8, 2, 64, torch.float16, device)
    _check(positions.to(torch.int32), *rest, slots.to(torch.int32))


def test_caches_that_are_views_of_one_kv_pool(device):
    # allocate_kv_caches hands out pool[layer, 0] and pool[layer, 1] of one allocation.
    pool = torch.full((2, 2, 6, 16, 2, 64), float("nan"), device=device).half()
    positions, q, k, v, cos_sin, _, _, slots = _inputs(9, 4, 2, 64, torch.float16, device,
                                                       num_blocks=6)  # fmt: skip
    _check(positions, q, k, v, cos_sin, pool[1, 0], pool[1, 1], slots)
    assert pool[0].isnan().all()


def test_wrapper_rejects_bad_arguments_with_clear_errors(device):
    positions, q, k, v, cos_sin, kc, vc, slots = _inputs(3, 4, 2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="value must have shape key's shape"):
        rotary_and_cache(positions, q, k, v[:, :1], cos_sin, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc, vc, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc, vc, slots.float())
    with pytest.raises(TypeError, match="positions must have dtype"):
        rotary_and_cache(positions.float(), q, k, v, cos_sin, kc, vc, slots)
    with pytest.raises(ValueError, match="positions has 2 entries for 3 tokens"):
        rotary_and_cache(positions[:2], q, k, v, cos_sin, kc, vc, slots)
    with pytest.raises(ValueError, match="key shape"):
        rotary_and_cache(positions, q, k[:2], v, cos_sin, kc, vc, slots)
    with pytest.raises(TypeError, match="dtypes must match"):
        rotary_and_cache(positions, q, k, v.half(), cos_sin, kc, vc, slots)
    with pytest.raises(TypeError, match="dtypes must match"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc, vc.half(), slots)
    with pytest.raises(ValueError, match="value_cache must have shape key_cache's shape"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc, vc[:2], slots)
    with pytest.raises(ValueError, match="key_cache must have shape"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc[..., :32], vc, slots)
    with pytest.raises(ValueError, match=r"key_cache must be \[num_blocks"):
        rotary_and_cache(positions, q, k, v, cos_sin, kc[0], vc, slots)
    with pytest.raises(ValueError, match="cos_sin_cache width 32 must equal"):
        rotary_and_cache(positions, q, k, v, cos_sin[:, :32], kc, vc, slots)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="query must be contiguous in its last dimension"):
        rotary_and_cache(positions, transposed, k, v, cos_sin, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(32, 8, 128), (32, 32, 128), (16, 2, 64), (9, 3, 64)],
)
def test_gpu_grid_matches_reference(dtype, num_heads, num_kv_heads, head_dim, device):
    for num_tokens in (1, 7, 33, 4093):
        _check(*_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device,
                        num_blocks=300, max_position=131072))  # fmt: skip
    # fp32 activations into a 16-bit cache: rounded to nearest even, exactly as torch casts
    _check(*_inputs(257, num_heads, num_kv_heads, head_dim, torch.float32, device,
                    num_blocks=40, cache_dtype=dtype))  # fmt: skip


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_partials_give_the_bits_of_the_summed_projection(split_k, device):
    # A QKV projection in INT4 split along K, its float32 partials left unsummed: the kernel
    # sums each token's parts in split order and rounds them to bf16 (the layer's own sum),
    # then rotates and writes the cache: the same bits as the summed layer rotated in place.
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 7
    w = random_int4((heads + 2 * kv_heads) * head_dim, 256, 128, offsets=True, device=device)
    x = torch.randn(tokens, 256, device=device).to(torch.bfloat16)
    config = Int4MatmulConfig("dot", block_m=16, block_n=64, block_k=128, split_k=split_k)
    positions, *_, cos_sin, key_cache, value_cache, slots = _inputs(
        tokens, heads, kv_heads, head_dim, torch.bfloat16, device
    )

    def views(qkv: torch.Tensor) -> list[torch.Tensor]:  # as `LlamaModel._attention` splits
        heads_last = qkv.unflatten(-1, (heads + 2 * kv_heads, head_dim))
        return list(heads_last.split([heads, kv_heads, kv_heads], dim=-2))

    summed = int4_matmul(x, *w.args, config=config)
    kc, vc = key_cache.clone(), value_cache.clone()
    want_q, want_k = rotary_and_cache(positions, *views(summed), cos_sin, kc, vc, slots)
    parts = int4_matmul(x, *w.args, config=config, unsummed=True)
    q, k, v = views(parts)
    got_q, got_k = rotary_and_cache(positions, q, k, v, cos_sin, key_cache, value_cache, slots,
                                    dtype=torch.bfloat16)  # fmt: skip
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    # (NaN where no slot was written, in both)
    assert torch.equal(key_cache.nan_to_num(7.0), kc.nan_to_num(7.0))
    assert torch.equal(value_cache.nan_to_num(7.0), vc.nan_to_num(7.0))
    with pytest.raises(TypeError, match="partials need the dtype"):
        rotary_and_cache(positions, q, k, v, cos_sin, key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="value partials"):
        rotary_and_cache(positions, q, k, v[:1], cos_sin, key_cache, value_cache, slots,
                         dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="dtype applies to partials only"):
        rotary_and_cache(positions, *views(summed), cos_sin, kc, vc, slots, dtype=torch.float16)
