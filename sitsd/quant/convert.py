"""One entry point for the loaders: a quantized linear module of a Hugging Face checkpoint ->
its internal layout, by the checkpoint's `QuantScheme`.

`module_tensor_names` says which tensors a quantized module holds in each format (so a loader
knows what to read and what `expected_shapes` of a quantized checkpoint are), `convert_linear`
picks the format's converter and hands it those tensors. GGUF is not here: its tensors carry
their own type (`sitsd.quant.from_gguf.from_gguf`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sitsd.quant.config import QuantScheme
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_awq import int4_from_awq
from sitsd.quant.from_compressed_tensors import int4_from_compressed_tensors
from sitsd.quant.from_fp8 import fp8_from_checkpoint
from sitsd.quant.from_gptq import int4_from_gptq
from sitsd.quant.layout import QuantizedWeight

__all__ = ["convert_linear", "module_tensor_names"]


def module_tensor_names(scheme: QuantScheme) -> tuple[str, ...]:
    """Suffixes of the tensors a quantized linear module holds (`<module>.<suffix>`); optional
    ones (g_idx, zero points of symmetric schemes, weight_shape) included."""
    if scheme.method == "awq":
        return ("qweight", "qzeros", "scales")
    if scheme.method == "gptq":
        return ("qweight", "qzeros", "scales", "g_idx")
    if scheme.layout == "fp8":
        return ("weight", "weight_scale", "input_scale")
    return ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


def convert_linear(
    scheme: QuantScheme,
    tensors: Mapping[str, torch.Tensor],
    module: str,
    shape: tuple[int, int],
) -> QuantizedWeight:
    """The layout of linear module `module` (e.g. "model.layers.0.mlp.down_proj"), whose W is
    `shape` (N, K), from the checkpoint tensors named `<module>.<suffix>`.

    Raises:
        QuantFormatError: A tensor missing or not fitting the scheme (the message names it).
    """

    def get(suffix: str) -> torch.Tensor | None:
        return tensors.get(f"{module}.{suffix}")

    group = scheme.group_size
    if scheme.layout == "fp8":
        return fp8_from_checkpoint(get("weight"), get("weight_scale"), shape=shape, name=module)
    if group is None:
        raise QuantFormatError(f"{module}: an INT4 scheme needs a group size")
    if scheme.method == "awq":
        return int4_from_awq(get("qweight"), get("qzeros"), get("scales"), shape=shape,
                             group_size=group, name=module)  # fmt: skip
    if scheme.method == "gptq":
        return int4_from_gptq(
            get("qweight"), get("qzeros"), get("scales"), get("g_idx"), shape=shape,
            group_size=group, symmetric=scheme.symmetric, zeros_minus_one=scheme.zeros_minus_one,
            name=module,
        )  # fmt: skip
    return int4_from_compressed_tensors(
        get("weight_packed"), get("weight_scale"), get("weight_zero_point"), get("weight_g_idx"),
        get("weight_shape"), shape=shape, group_size=group, symmetric=scheme.symmetric,
        name=module,
    )  # fmt: skip
