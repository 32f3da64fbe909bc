"""The one error of `sitsd.quant`: quantized tensors or a config that sitsd cannot use."""

from __future__ import annotations


class QuantFormatError(ValueError):
    """Quantized weights that do not fit their config or the layout (shapes, dtypes, values), or
    a quantization config sitsd does not read; the message names the tensor or the field."""
