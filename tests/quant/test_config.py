"""quantization_config -> QuantScheme for every format sitsd reads (as the producing tools write
the configs), skip rules, and the settings refused with the field named."""

from __future__ import annotations

import pytest

from sitsd.quant.config import QuantScheme, parse_quantization_config
from sitsd.quant.convert import module_tensor_names
from sitsd.quant.errors import QuantFormatError

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": ["visual"]}  # fmt: skip
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq", "lm_head": False, "damp_percent": 0.01}  # fmt: skip
CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
        "actorder": None}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}  # fmt: skip
CT_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}},
    "ignore": ["lm_head"],
}  # fmt: skip
FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}


def test_each_format_reads_into_its_scheme():
    assert parse_quantization_config(AWQ) == QuantScheme(
        method="awq", group_size=128, symmetric=False, skip_rules=("visual",)
    )
    assert parse_quantization_config(GPTQ) == QuantScheme(
        method="gptq", group_size=64, symmetric=False, act_order=True, zeros_minus_one=True
    )
    ct = parse_quantization_config(CT_W4A16)
    assert (ct.method, ct.layout, ct.group_size, ct.symmetric) == ("compressed-tensors", "int4",
                                                                   32, True)  # fmt: skip
    assert parse_quantization_config(CT_FP8).layout == "fp8"
    assert parse_quantization_config(FP8) == QuantScheme(
        method="fp8", layout="fp8", group_size=None, skip_rules=("lm_head",)
    )
    assert (
        parse_quantization_config({**GPTQ, "checkpoint_format": "gptq_v2"}).zeros_minus_one is False
    )
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True}
    assert parse_quantization_config(autoawq).group_size == 64


def test_skip_rules_match_by_substring_or_regex_and_gptq_keeps_lm_head_16_bit():
    ct = parse_quantization_config(CT_W4A16)
    assert ct.skips("lm_head")
    assert ct.skips("model.layers.3.mlp.gate")
    assert not ct.skips("model.layers.3.mlp.gate_proj")
    gptq = parse_quantization_config(GPTQ)
    assert gptq.skips("lm_head")
    assert not gptq.skips("model.layers.0.mlp.down_proj")
    assert not parse_quantization_config({**GPTQ, "lm_head": True}).skips("lm_head")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
        ({}, r"quant_method None is not supported: sitsd reads awq, gptq"),
        ({**AWQ, "group_size": 256}, r"group_size 256 is not supported: the INT4 kernels take"),
        ({**GPTQ, "group_size": -1}, r"group_size -1 is not supported"),
        ({**GPTQ, "bits": 3}, r"quantization_config.bits 3: sitsd reads GPTQ at 4 bits only"),
        ({**AWQ, "version": "gemv"}, r"version 'gemv': sitsd reads AWQ's GEMM packing only"),
        ({**AWQ, "zero_point": False}, r"zero_point false"),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin'"),
        ({**FP8, "weight_block_size": [128, 128]}, r"weight_block_size \[128, 128\]: block-wise"),
        ({**CT_W4A16, "format": "marlin-24"}, r"config_groups.group_0.weights is int 4-bit group"),
        ({**CT_W4A16, "config_groups": {}}, r"config_groups has 0 groups"),
        ({**AWQ, "modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list"),
    ],
)
def test_unsupported_settings_are_refused_naming_the_field(config, message):
    with pytest.raises(QuantFormatError, match=message):
        parse_quantization_config(config)


def test_each_scheme_names_the_tensors_its_modules_hold():
    assert module_tensor_names(parse_quantization_config(AWQ)) == ("qweight", "qzeros", "scales")
    assert "g_idx" in module_tensor_names(parse_quantization_config(GPTQ))
    assert "weight_packed" in module_tensor_names(parse_quantization_config(CT_W4A16))
    assert module_tensor_names(parse_quantization_config(FP8))[:2] == ("weight", "weight_scale")
