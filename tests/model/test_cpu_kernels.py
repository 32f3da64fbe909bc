"""The CPU kernels compute what the references compute (the CPU runner uses them)."""

from __future__ import annotations

import random

import pytest
import torch

from sitsd.kernels import reference
from sitsd.model import cpu_kernels

BLOCK = 4


def paged(num_blocks=40, heads=2, dim=16):
    k = torch.randn(num_blocks, BLOCK, heads, dim)
    return k, torch.randn_like(k)


def test_reshape_and_cache_matches_the_reference_with_and_without_skipped_slots():
    for slots in ([5, 17, 2, 39], [5, -1, 2, -1]):
        key, value = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
        a_k, a_v = paged()
        b_k, b_v = a_k.clone(), a_v.clone()
        slot_mapping = torch.tensor(slots)
        cpu_kernels.reshape_and_cache(key, value, a_k, a_v, slot_mapping)
        reference.reshape_and_cache_ref(key, value, b_k, b_v, slot_mapping)
        assert torch.equal(a_k, b_k)
        assert torch.equal(a_v, b_v)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_decode_attention_matches_the_reference(heads, kv_heads):
    k, v = paged(heads=kv_heads)
    seq_lens = torch.tensor([1, 7, 33, 12], dtype=torch.int32)
    tables = torch.tensor([random.sample(range(40), 10) for _ in range(4)], dtype=torch.int32)
    q = torch.randn(4, heads, 16)
    got = cpu_kernels.decode_attention(q, k, v, tables, seq_lens, 0.25)
    want = reference.decode_attention_ref(q, k, v, tables, seq_lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_norms_match_the_reference():
    x, res, w = torch.randn(7, 64), torch.randn(7, 64), torch.randn(64)
    torch.testing.assert_close(
        cpu_kernels.rms_norm(x, w, 1e-5), reference.rms_norm_ref(x, w, 1e-5), atol=1e-6, rtol=0
    )
    got = cpu_kernels.fused_add_rms_norm(x, res, w, 1e-6)
    want = reference.fused_add_rms_norm_ref(x, res, w, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_rotary_is_bit_identical_to_the_reference():
    cache = reference.compute_cos_sin_cache(32, 512, 10000.0)
    positions = torch.randint(0, 512, (9,))
    q, k = torch.randn(9, 4, 32), torch.randn(9, 2, 32)
    for a, b in zip(cpu_kernels.rotary_embedding(positions, q, k, cache),
                    reference.rotary_embedding_ref(positions, q, k, cache)):  # fmt: skip
        assert torch.equal(a, b)
