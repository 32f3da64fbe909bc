"""A Hugging Face `quantization_config`, read into one `QuantScheme` whatever wrote it.

Read here (field names as the producing tools write them, and as vLLM's loaders read them):

* `awq` (AutoAWQ, llm-awq): `bits` (or `w_bit`) 4, `group_size` (or `q_group_size`),
  `zero_point` true, `version` "gemm", `modules_to_not_convert`;
* `gptq` (AutoGPTQ, GPTQModel, optimum): `bits` 4, `group_size`, `sym`, `desc_act`,
  `checkpoint_format` (or `format`) "gptq" (zero points stored minus one) or "gptq_v2" (as they
  are), `lm_head`, `modules_to_not_convert`;
* `compressed-tensors` (llm-compressor): one config group whose weights are either int 4-bit
  `group` strategy (format `pack-quantized`, W4A16) or float 8-bit `tensor` / `channel` strategy
  (format `float-quantized`, FP8), `actorder`, `ignore`;
* `fp8` (vLLM / AutoFP8) and `fbgemm_fp8`: e4m3 weights with per-tensor or per-channel
  `weight_scale`; `activation_scheme` static or dynamic (sitsd always quantizes activations per
  token at run time); `modules_to_not_convert` / `ignored_layers`. Block-wise FP8
  (`weight_block_size`, `weight_scale_inv`) is refused for now.

Anything else (another `quant_method`, another bit width, a group size the INT4 kernels do not
take, a per-channel INT4 scheme) raises `QuantFormatError` naming the field. Which tensors a
format's module holds and how they become a layout is the format modules' business.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sitsd.kernels.quant_layout import GROUP_SIZES
from sitsd.quant.errors import QuantFormatError

__all__ = ["METHODS", "QuantScheme", "parse_quantization_config"]

METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "fbgemm_fp8")


@dataclass(frozen=True)
class QuantScheme:
    """What a checkpoint's quantization config says, in one shape for every format."""

    method: str = "gptq"  # quant_method, one of METHODS
    layout: str = "int4"  # the internal layout its linear weights become: "int4" or "fp8"
    group_size: int | None = 128  # inputs per INT4 scale; None for FP8 (per tensor or channel)
    symmetric: bool = True  # INT4 without zero points (zero point 8)
    act_order: bool = False  # g_idx may reorder the input channels (GPTQ desc_act)
    zeros_minus_one: bool = False  # GPTQ's original format stores every zero point minus one
    quantize_lm_head: bool = False  # the lm_head is quantized too (GPTQ's `lm_head: true`)
    # Modules left in 16 bits: a rule "re:PATTERN" matches names by re.match, any other rule
    # matches names that contain it (transformers' and vLLM's reading of these lists).
    skip_rules: tuple[str, ...] = ()

    def skips(self, module_name: str) -> bool:
        """Whether `module_name` (e.g. "model.layers.0.mlp.down_proj", "lm_head") stays 16-bit."""
        if module_name == "lm_head" and not self.quantize_lm_head and self.method == "gptq":
            return True
        for rule in self.skip_rules:
            if rule.startswith("re:"):
                if re.match(rule[3:], module_name):
                    return True
            elif rule in module_name:
                return True
        return False


def _get(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in config and config[name] is not None:
            return config[name]
    return default


def _int4_group_size(value: Any, field: str) -> int:
    if value not in GROUP_SIZES:
        raise QuantFormatError(
            f"quantization_config.{field} {value!r} is not supported: the INT4 kernels take "
            f"groups of {', '.join(map(str, GROUP_SIZES))} (-1 or None, one group per row, "
            "is not one of them)"
        )
    return int(value)


def _bits(config: Mapping[str, Any], expected: int, method: str, *names: str) -> None:
    bits = _get(config, *names)
    if bits != expected:
        raise QuantFormatError(
            f"quantization_config.{names[0]} {bits!r}: sitsd reads {method} at {expected} bits only"
        )


def _skip_rules(config: Mapping[str, Any], *names: str) -> tuple[str, ...]:
    rules: list[str] = []
    for name in names:
        value = config.get(name) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise QuantFormatError(f"quantization_config.{name} must be a list of module names")
        rules += value
    return tuple(rules)


def _awq(config: Mapping[str, Any]) -> QuantScheme:
    _bits(config, 4, "AWQ", "bits", "w_bit")
    version = str(_get(config, "version", default="gemm")).lower()
    if version != "gemm":
        raise QuantFormatError(
            f"quantization_config.version {version!r}: sitsd reads AWQ's GEMM packing only"
        )
    if not _get(config, "zero_point", default=True):
        raise QuantFormatError("quantization_config.zero_point false: AWQ without zero points")
    return QuantScheme(
        method="awq",
        group_size=_int4_group_size(_get(config, "group_size", "q_group_size"), "group_size"),
        symmetric=False,
        skip_rules=_skip_rules(config, "modules_to_not_convert"),
    )


def _gptq(config: Mapping[str, Any]) -> QuantScheme:
    _bits(config, 4, "GPTQ", "bits")
    checkpoint_format = str(_get(config, "checkpoint_format", "format", default="gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantFormatError(
            f"quantization_config.checkpoint_format {checkpoint_format!r}: sitsd reads GPTQ's "
            "'gptq' and 'gptq_v2' packings"
        )
    return QuantScheme(
        method="gptq",
        group_size=_int4_group_size(config.get("group_size"), "group_size"),
        symmetric=bool(_get(config, "sym", default=True)),
        act_order=bool(_get(config, "desc_act", default=False)),
        zeros_minus_one=checkpoint_format == "gptq",
        quantize_lm_head=bool(_get(config, "lm_head", default=False)),
        skip_rules=_skip_rules(config, "modules_to_not_convert"),
    )


def _compressed_tensors(config: Mapping[str, Any]) -> QuantScheme:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantFormatError(
            f"quantization_config.config_groups has {len(groups)} groups: sitsd reads one scheme "
            "for every quantized layer"
        )
    ((group_name, group),) = groups.items()
    weights = group.get("weights") or {}
    fmt = str(group.get("format") or config.get("format") or "")
    field = f"config_groups.{group_name}.weights"
    kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
    ignore = _skip_rules(config, "ignore")
    if kind == ("int", 4, "group") and fmt == "pack-quantized":
        actorder = weights.get("actorder")
        return QuantScheme(
            method="compressed-tensors",
            group_size=_int4_group_size(weights.get("group_size"), f"{field}.group_size"),
            symmetric=bool(weights.get("symmetric", True)),
            act_order=actorder in ("group", "dynamic", True),
            skip_rules=ignore,
        )
    if kind[:2] == ("float", 8) and kind[2] in ("tensor", "channel") and fmt == "float-quantized":
        return QuantScheme(method="compressed-tensors", layout="fp8", group_size=None,
                           skip_rules=ignore)  # fmt: skip
    raise QuantFormatError(
        f"quantization_config.{field} is {kind[0]} {kind[1]}-bit {kind[2]} in format {fmt!r}: "
        "sitsd reads int 4-bit group (pack-quantized) and float 8-bit tensor or channel "
        "(float-quantized)"
    )


def _fp8(config: Mapping[str, Any], method: str) -> QuantScheme:
    if config.get("weight_block_size"):
        raise QuantFormatError(
            f"quantization_config.weight_block_size {config['weight_block_size']!r}: block-wise "
            "FP8 is not supported yet (per-tensor and per-channel scales are)"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantFormatError(f"quantization_config.activation_scheme {scheme!r} is unknown")
    return QuantScheme(
        method=method,
        layout="fp8",
        group_size=None,
        skip_rules=_skip_rules(config, "modules_to_not_convert", "ignored_layers"),
    )


def parse_quantization_config(config: Mapping[str, Any]) -> QuantScheme:
    """The scheme of a `config.json`'s `quantization_config` (or AutoAWQ's `quant_config.json`).

    Raises:
        QuantFormatError: An unknown `quant_method`, or settings sitsd cannot serve.
    """
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    method = "fbgemm_fp8" if method == "fbgemm-fp8" else method
    if method == "awq":
        return _awq(config)
    if method == "gptq":
        return _gptq(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method in ("fp8", "fbgemm_fp8"):
        return _fp8(config, method)
    raise QuantFormatError(
        f"quantization_config.quant_method {config.get('quant_method')!r} is not supported: "
        f"sitsd reads {', '.join(METHODS)}"
    )
