"""`sitsd quantize --format compressed-tensors`: the tensors are llm-compressor's pack-quantized
W4A16 as the `compressed-tensors` library decompresses them, the config is one that library
validates, and the directory (RTN, or GPTQ with act-order's g_idx) loads back through sitsd's
compressed-tensors loader with the logits of its dequantized weights."""

from __future__ import annotations

import json
import random

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from sitsd.quant.cpu import CpuInt4Weight
from sitsd.quant.export import compressed_tensors_module
from sitsd.quant.from_compressed_tensors import int4_from_compressed_tensors
from sitsd.quant.precision import PrecisionMap
from sitsd.quant.rtn import quantize_int4
from sitsd.weights import load_checkpoint
from sitsd.weights.gptq import gptq_quantize, hessian
from sitsd.weights.quantize import QuantizeConfig, quantize_checkpoint
from tests.weights.test_gptq import _rtn, _served_logits_match_the_dequantized
from tests.weights.test_quantize import TEXT
from tests.weights.tiny_models import write_tiny_llama


@pytest.fixture
def tiny(tmp_path):
    write_tiny_llama(tmp_path / "src", seed=random.randrange(1000))
    return load_checkpoint(tmp_path / "src")


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_compressed_tensors_output_is_what_the_library_decompresses(symmetric, group_size):
    n, k = 36, 2 * group_size  # N = 36: the zero points' last packed word is partial
    w = torch.randn(n, k) * torch.rand(n, 1)
    codes = quantize_int4(w, group_size, symmetric=symmetric)
    tensors = compressed_tensors_module(codes)
    assert ("weight_zero_point" in tensors) != symmetric
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    theirs = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert torch.equal(theirs, codes.dequantize().to(theirs.dtype))  # one rounding of exact W
    back = int4_from_compressed_tensors(
        tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"),
        None, tensors["weight_shape"], shape=(n, k), group_size=group_size,
        symmetric=symmetric, name="m",
    )  # fmt: skip
    assert torch.equal(back.dequantize(), codes.dequantize())


def test_compressed_tensors_permuted_codes_write_the_g_idx_the_loader_reads_exactly():
    # Older llm-compressor versions wrote weight_g_idx (actorder "group"); sitsd reads those.
    k, n = 128, 24
    x = torch.randn(400, k) * torch.rand(k) * 3
    codes = gptq_quantize(torch.randn(n, k), hessian(x), 32, _rtn(32), act_order=True)
    tensors = compressed_tensors_module(codes)
    assert torch.equal(tensors["weight_g_idx"], codes.group_index())
    back = int4_from_compressed_tensors(
        tensors["weight_packed"], tensors["weight_scale"], tensors["weight_zero_point"],
        tensors["weight_g_idx"], tensors["weight_shape"], shape=(n, k), group_size=32,
        symmetric=False, name="m",
    )  # fmt: skip
    assert back.perm is not None
    assert torch.equal(back.dequantize(), codes.dequantize())


@pytest.mark.parametrize(("method", "act_order"), [("rtn", False), ("gptq", True)])
def test_the_compressed_tensors_directory_loads_back_with_the_logits_of_its_dequantized_weights(
    tiny, tmp_path, method, act_order
):
    keep = PrecisionMap.from_mapping({"*.o_proj.weight": "bf16", "*": "int4-g32"})
    config = QuantizeConfig(method=method, group_size=32, window=64, precision=keep,
                            format="compressed-tensors", act_order=act_order)  # fmt: skip
    quantize_checkpoint(tiny, config, TEXT, tmp_path / "q")
    hf = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(hf)  # what llm-compressor's readers take
    assert parsed.format == "pack-quantized"
    args = parsed.config_groups["group_0"].weights
    assert (args.num_bits, args.group_size, args.symmetric) == (4, 32, False)
    # Act-order with the inputs' own groups (the current library has no g_idx).
    assert args.actorder == ("weight" if act_order else None)
    assert hf["ignore"] == ["lm_head"] + [f"model.layers.{n}.self_attn.o_proj" for n in (0, 1)]
    ckpt, weights, _ = _served_logits_match_the_dequantized(tmp_path / "q")
    assert ckpt.quant.scheme.method == "compressed-tensors"
    assert not any(name.endswith("weight_g_idx") for name in ckpt.tensors)
    assert isinstance(weights.layers[0].down_proj, CpuInt4Weight)
    assert weights.layers[0].down_proj.perm is None
    assert isinstance(weights.layers[0].o_proj, torch.Tensor)  # kept 16-bit
