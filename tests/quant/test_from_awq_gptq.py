"""AWQ (GEMM packing) and GPTQ (sym true/false, act-order, both zero-point conventions) ->
`Int4Weight`, bit for bit against the producing libraries' own dequantization code
(`tests.quant.format_code`) and the exact float32 definition; bad input refused by name."""

from __future__ import annotations

import pytest
import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_awq import int4_from_awq
from sitsd.quant.from_gptq import int4_from_gptq
from tests.quant.format_code import awq_pack, dequantize_gemm, gptq_dequantize, gptq_pack


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _scales(groups, n, dtype=torch.float16):
    return ((torch.rand(groups, n) + 0.1) * 0.02).to(dtype)


def _exact(codes_kn, zeros_gn, scales_gn, g_idx):  # W [N, K] = (q - z) * s, in float64
    z, s = zeros_gn.double()[g_idx], scales_gn.double()[g_idx]
    return ((codes_kn.double() - z) * s).T


# --- AWQ ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_awq_equals_autoawq_dequantize_gemm_bit_for_bit(group_size, scale_dtype):
    n, k = 64, 2 * group_size  # AutoAWQ packs N in multiples of 32
    codes, zeros = torch.randint(0, 16, (k, n)), torch.randint(0, 16, (k // group_size, n))
    scales = _scales(k // group_size, n, scale_dtype)
    qweight, qzeros = awq_pack(codes, zeros)
    weight = int4_from_awq(qweight, qzeros, scales, shape=(n, k), group_size=group_size, name="m")
    theirs = dequantize_gemm(qweight, qzeros, scales, 4, group_size)  # [K, N], scale dtype
    assert torch.equal(_bits(weight.dequantize(scale_dtype).T.contiguous()), _bits(theirs))
    g_idx = torch.arange(k) // group_size
    assert torch.equal(weight.dequantize().double(), _exact(codes, zeros, scales, g_idx))


def test_awq_refuses_bad_tensors_naming_them():
    n, k, g = 32, 128, 64
    qweight, qzeros = awq_pack(torch.randint(0, 16, (k, n)), torch.randint(0, 16, (2, n)))
    scales = _scales(2, n)
    name = "model.layers.3.mlp.up_proj"

    def convert(qw=qweight, qz=qzeros, s=scales, shape=(n, k), group=g):
        return int4_from_awq(qw, qz, s, shape=shape, group_size=group, name=name)

    with pytest.raises(QuantFormatError, match=r"up_proj\.qweight has shape \(128, 4\), expected"):
        convert(shape=(n, 2 * k))
    with pytest.raises(QuantFormatError, match=r"up_proj\.qzeros has shape \(2, 4\), expected"):
        convert(group=32)
    with pytest.raises(QuantFormatError, match=r"up_proj\.qzeros is missing"):
        convert(qz=None)
    with pytest.raises(QuantFormatError, match=r"up_proj\.scales has dtype torch\.float32"):
        convert(s=scales.float())
    nan = scales.clone()
    nan[1, 3] = float("nan")
    with pytest.raises(QuantFormatError, match=r"up_proj\.scales holds NaN or Inf"):
        convert(s=nan)
    zero = scales.clone()
    zero[0, 0] = 0
    with pytest.raises(QuantFormatError, match=r"up_proj\.scales holds 1 zero scales"):
        convert(s=zero)
    with pytest.raises(QuantFormatError, match="N = 12 in words of 8"):
        convert(shape=(12, k))


# --- GPTQ --------------------------------------------------------------------------------------


def _gptq_case(n, k, group_size, *, symmetric, minus_one, act_order):
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (k, n))
    if symmetric:
        zeros = torch.full((groups, n), 8)
    else:  # the original format cannot store a zero point of 0 (it would be -1)
        zeros = torch.randint(1 if minus_one else 0, 16, (groups, n))
    g_idx = torch.arange(k) // group_size
    if act_order:  # desc_act: groups assigned in a processing order of GPTQ's own
        g_idx = g_idx[torch.argsort(torch.randperm(k))]
    qweight, qzeros = gptq_pack(codes, zeros, minus_one=minus_one)
    return codes, zeros, g_idx.to(torch.int32), qweight, qzeros, _scales(groups, n)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("minus_one", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("k", "group_size"), [(256, 32), (576, 128)])
def test_gptq_equals_gptqmodel_dequantize_bit_for_bit(
    symmetric, minus_one, act_order, k, group_size
):
    # K = 576 with groups of 128: the last group has 64 channels (SmolLM2's hidden size).
    n = 32  # AutoGPTQ's loops pack N and K in multiples of 32
    codes, zeros, g_idx, qweight, qzeros, scales = _gptq_case(
        n, k, group_size, symmetric=symmetric, minus_one=minus_one, act_order=act_order
    )
    weight = int4_from_gptq(qweight, qzeros, scales, g_idx, shape=(n, k), group_size=group_size,
                            symmetric=symmetric, zeros_minus_one=minus_one, name="m")  # fmt: skip
    assert (weight.offsets is None) == symmetric
    assert (weight.perm is not None) == act_order
    theirs = gptq_dequantize(qweight, qzeros, scales, g_idx, minus_one=minus_one)  # [K, N]
    assert torch.equal(_bits(weight.dequantize(torch.float16).T.contiguous()), _bits(theirs))
    assert torch.equal(weight.dequantize().double(), _exact(codes, zeros, scales, g_idx.long()))


def test_gptq_without_g_idx_is_the_plain_group_order():
    codes, zeros, g_idx, qweight, qzeros, scales = _gptq_case(
        32, 128, 64, symmetric=False, minus_one=True, act_order=False
    )
    weight = int4_from_gptq(qweight, qzeros, scales, None, shape=(32, 128), group_size=64,
                            symmetric=False, zeros_minus_one=True, name="m")  # fmt: skip
    assert weight.perm is None
    assert torch.equal(weight.dequantize().double(), _exact(codes, zeros, scales, g_idx.long()))


def test_gptq_refuses_bad_tensors_naming_them():
    n, k, g = 32, 128, 32
    _, _, g_idx, qweight, qzeros, scales = _gptq_case(n, k, g, symmetric=False, minus_one=True,
                                                      act_order=True)  # fmt: skip
    name = "model.layers.0.self_attn.o_proj"

    def convert(qz=qzeros, gi=g_idx, symmetric=False, group=g, shape=(n, k)):
        return int4_from_gptq(qweight, qz, scales, gi, shape=shape, group_size=group,
                              symmetric=symmetric, zeros_minus_one=True, name=name)  # fmt: skip

    with pytest.raises(QuantFormatError, match=r"o_proj\.qzeros: with sym: true every zero point"):
        convert(symmetric=True)
    bad_groups = g_idx.clone()
    bad_groups[:3] = 0  # group 0 now has more than 32 channels
    with pytest.raises(QuantFormatError, match=r"o_proj\.g_idx does not put 32 input channels"):
        convert(gi=bad_groups)
    with pytest.raises(QuantFormatError, match=r"o_proj\.g_idx has shape \(64,\), expected \[K\]"):
        convert(gi=g_idx[:64])
    with pytest.raises(QuantFormatError, match=r"o_proj\.qweight has shape \(16, 32\), expected"):
        convert(shape=(n, 256))
    with pytest.raises(QuantFormatError, match=r"o_proj\.qzeros has shape \(4, 4\), expected"):
        convert(group=64)
