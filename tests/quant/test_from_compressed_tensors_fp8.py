"""compressed-tensors pack-quantized (W4A16) and FP8 checkpoints (per tensor, per channel) ->
layouts, bit for bit against the `compressed-tensors` library's own decompression and the formats'
float32 definitions; bad input refused by name."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_compressed_tensors import int4_from_compressed_tensors
from sitsd.quant.from_fp8 import fp8_from_checkpoint


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _pack_quantized(n, k, group_size, *, symmetric, scale_dtype=torch.bfloat16):
    """A module's tensors as llm-compressor writes them (packed by compressed-tensors itself)."""
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = ((torch.rand(n, k // group_size) + 0.1) * 0.02).to(scale_dtype)
    tensors = {"weight_packed": pack_to_int32(values, 4), "weight_scale": scale,
               "weight_shape": torch.tensor([n, k])}  # fmt: skip
    if not symmetric:
        zero_point = torch.randint(-8, 8, (n, k // group_size), dtype=torch.int8)
        tensors["weight_zero_point"] = pack_to_int32(zero_point, 4, packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)  # fmt: skip
    return tensors, QuantizationScheme(targets=["Linear"], weights=args)


def _convert_ct(tensors, n, k, group_size, symmetric, name="m", g_idx=None):
    return int4_from_compressed_tensors(
        tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"),
        g_idx, tensors["weight_shape"], shape=(n, k), group_size=group_size,
        symmetric=symmetric, name=name,
    )  # fmt: skip


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_pack_quantized_equals_compressed_tensors_decompress(group_size, symmetric, scale_dtype):
    n, k = 36, 2 * group_size  # N = 36: the zero points' last packed word is partial
    tensors, scheme = _pack_quantized(n, k, group_size, symmetric=symmetric,
                                      scale_dtype=scale_dtype)  # fmt: skip
    weight = _convert_ct(tensors, n, k, group_size, symmetric)
    assert (weight.offsets is None) == symmetric
    theirs = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert theirs.dtype == scale_dtype
    assert torch.equal(_bits(weight.dequantize(scale_dtype)), _bits(theirs))


def test_pack_quantized_act_order_g_idx_permutes_the_columns_exactly():
    # Older llm-compressor versions wrote weight_g_idx (actorder "group"); GPTQ's semantics.
    n, k, g = 16, 128, 32
    tensors, _ = _pack_quantized(n, k, g, symmetric=True)
    g_idx = (torch.arange(k) // g)[torch.argsort(torch.randperm(k))].to(torch.int32)
    weight = _convert_ct(tensors, n, k, g, True, g_idx=g_idx)
    assert weight.perm is not None
    # Column c of the checkpoint's values belongs to group g_idx[c]: W rebuilt that way.
    values = unpack_from_int32(tensors["weight_packed"], 4, torch.Size([n, k]))
    expected = values.float() * tensors["weight_scale"].float()[:, g_idx.long()]
    assert torch.equal(weight.dequantize(), expected)


def test_pack_quantized_refuses_bad_tensors_naming_them():
    n, k, g = 16, 128, 64
    tensors, _ = _pack_quantized(n, k, g, symmetric=False)
    name = "model.layers.2.mlp.gate_proj"
    with pytest.raises(QuantFormatError, match=r"gate_proj\.weight_shape is \[16, 128\]"):
        _convert_ct(tensors, n, 2 * k, g, False, name=name)
    with pytest.raises(QuantFormatError, match=r"gate_proj\.weight_zero_point is missing"):
        _convert_ct({**tensors, "weight_zero_point": None}, n, k, g, False, name=name)
    with pytest.raises(QuantFormatError, match=r"gate_proj\.weight_scale has shape \(16, 2\)"):
        _convert_ct(tensors, n, k, 32, False, name=name)
    inf = tensors["weight_scale"].clone()
    inf[0, 1] = float("inf")
    with pytest.raises(QuantFormatError, match=r"gate_proj\.weight_scale holds NaN or Inf"):
        _convert_ct({**tensors, "weight_scale": inf}, n, k, g, False, name=name)


# --- FP8 ---------------------------------------------------------------------------------------


def _fp8(n, k):
    return (torch.randn(n, k) * 16).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_shape", [(), (1,), (24,), (24, 1)])
def test_fp8_equals_the_formats_float32_dequantization(scale_shape):
    n, k = 24, 40
    weight = _fp8(n, k)
    weight_scale = torch.rand(scale_shape) * 0.01 + 1e-4
    converted = fp8_from_checkpoint(weight, weight_scale, shape=(n, k), name="m")
    expected = weight.float() * weight_scale.reshape(-1, 1)  # vLLM's fp8 loader's definition
    assert torch.equal(converted.dequantize(), expected.expand(n, k))
    assert converted.scale.shape == (n,)


def test_fp8_float_quantized_equals_compressed_tensors_decompress():
    n, k = 32, 64
    weight, scale = _fp8(n, k), torch.rand(n, 1) * 0.01 + 1e-4
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": weight, "weight_scale": scale}
    theirs = FloatQuantizationCompressor.decompress(state, scheme)["weight"]
    converted = fp8_from_checkpoint(weight, scale, shape=(n, k), name="m")
    assert torch.equal(converted.dequantize(theirs.dtype), theirs)


def test_fp8_refuses_bad_tensors_naming_them():
    weight, name = _fp8(8, 16), "model.layers.1.self_attn.qkv"
    with pytest.raises(QuantFormatError, match=r"qkv\.weight_scale has shape \(3,\)"):
        fp8_from_checkpoint(weight, torch.ones(3), shape=(8, 16), name=name)
    with pytest.raises(QuantFormatError, match=r"qkv\.weight_scale holds 1 zero scales"):
        fp8_from_checkpoint(weight, torch.zeros(1), shape=(8, 16), name=name)
    with pytest.raises(QuantFormatError, match=r"qkv\.weight_scale holds negative scales"):
        fp8_from_checkpoint(weight, -torch.ones(8), shape=(8, 16), name=name)
    nan = weight.clone()
    nan.view(torch.uint8)[3, 5] = 0x7F
    with pytest.raises(QuantFormatError, match=r"qkv\.weight holds NaN codes"):
        fp8_from_checkpoint(nan, torch.ones(1), shape=(8, 16), name=name)
    with pytest.raises(QuantFormatError, match=r"qkv\.weight has dtype torch\.bfloat16"):
        fp8_from_checkpoint(weight.bfloat16(), torch.ones(1), shape=(8, 16), name=name)
    with pytest.raises(QuantFormatError, match=r"qkv\.weight_scale is missing"):
        fp8_from_checkpoint(weight, None, shape=(8, 16), name=name)
