"""How a checkpoint stores its linear modules, and each module converted into its layout.

A loader describes a checkpoint's quantized tensors with one `QuantSource`: the Hugging Face
`quantization_config` it read (`scheme`), or, for GGUF, the GGML type of each tensor it kept as
raw bytes (`gguf_types`, by Hugging Face tensor name) and the head count of the Q/K projections
whose rows llama.cpp permuted (`gguf_qk_heads`). The model asks it, module by module
(`model.layers.0.self_attn.q_proj`, `lm_head`):

    is_quantized(names, module)     whether the checkpoint holds the module quantized
    tensor_names(module)            the checkpoint tensors the module reads (for shape checks)
    convert(tensors, module, shape, device)
                                    the module's layout, converted on `device` (the bytes are
                                    moved there first), with the format's checks

Which modules exist and how they are fused is the model's; the formats are `sitsd.quant`'s
format modules.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field

import torch

from sitsd.quant.config import QuantScheme
from sitsd.quant.convert import convert_linear, module_tensor_names
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_gguf import from_gguf, llama_cpp_row_order
from sitsd.quant.layout import QuantizedWeight, select_rows

__all__ = ["QuantSource"]

# The tensor whose presence says a module is stored quantized, per format.
_MARKER = {"awq": "qweight", "gptq": "qweight", "int4": "weight_packed", "fp8": "weight_scale"}


@dataclass(frozen=True)
class QuantSource:
    """A checkpoint's quantized linear modules (see the module docstring)."""

    scheme: QuantScheme | None = None  # a Hugging Face quantization_config, read
    # GGUF: Hugging Face tensor name ("...q_proj.weight") -> GGML type, for tensors kept as raw
    # bytes `[N, bytes per row]`; tensors not named here were dequantized by the loader
    gguf_types: Mapping[str, int] = field(default_factory=dict)
    # GGUF: Hugging Face tensor name of a Q or K projection -> its head count (llama.cpp
    # permuted those rows for its interleaved rotary embedding)
    gguf_qk_heads: Mapping[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        """Nothing is stored quantized."""
        return self.scheme is None and not self.gguf_types

    def _marker(self) -> str:
        assert self.scheme is not None
        method = self.scheme.method
        return _MARKER.get(method, _MARKER[self.scheme.layout])

    def is_quantized(self, names: Container[str], module: str) -> bool:
        """Whether a checkpoint holding the tensors `names` holds `module` quantized (else
        `<module>.weight` is dense)."""
        if f"{module}.weight" in self.gguf_types:
            return True
        if self.scheme is None:
            return False
        return f"{module}.{self._marker()}" in names

    def tensor_names(self, module: str) -> tuple[str, ...]:
        """Names of every tensor a quantized `module` may hold (optional ones included)."""
        if f"{module}.weight" in self.gguf_types or self.scheme is None:
            return (f"{module}.weight",)
        return tuple(f"{module}.{suffix}" for suffix in module_tensor_names(self.scheme))

    def convert(
        self,
        tensors: Mapping[str, torch.Tensor],
        module: str,
        shape: tuple[int, int],
        device: torch.device | str,
    ) -> QuantizedWeight:
        """The layout of quantized `module` (W of `shape` (N, K)), converted on `device`.

        Raises:
            QuantFormatError: A tensor missing or not fitting its format (the message names it).
        """
        name = f"{module}.weight"
        ggml_type = self.gguf_types.get(name)
        if ggml_type is not None:
            raw = tensors[name].to(device)
            weight = from_gguf(raw, ggml_type, shape=shape, name=name)
            heads = self.gguf_qk_heads.get(name)
            if heads:
                weight = select_rows(weight, llama_cpp_row_order(shape[0], heads))
            return weight
        if self.scheme is None:
            raise QuantFormatError(f"{module} is not stored quantized")
        own = {
            n: t.to(device) for n in self.tensor_names(module) if (t := tensors.get(n)) is not None
        }
        return convert_linear(self.scheme, own, module, shape)
