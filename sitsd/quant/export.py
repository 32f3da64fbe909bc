"""INT4 codes -> a Hugging Face AWQ checkpoint's tensors and `quantization_config`.

`awq_module(codes)` packs `Int4Codes` (`sitsd.quant.rtn`) the way AutoAWQ's GEMM layout stores a
linear module (`qweight [K, N / 8]`, `qzeros [G, N / 8]` int32, `scales [G, N]` float16; the
nibble order `AWQ_ORDER`; `sitsd.quant.from_awq` documents it and reads it back), so what
`sitsd quantize` writes loads in sitsd and in the engines that read AWQ. Symmetric codes get
the zero point 8 (AWQ stores one per group).
"""

from __future__ import annotations

import torch

from sitsd.quant.from_awq import AWQ_ORDER
from sitsd.quant.rtn import Int4Codes

__all__ = ["awq_config", "awq_module"]


def _pack_columns(values: torch.Tensor) -> torch.Tensor:  # [R, N] 0..15 -> [R, N / 8] int32
    """Eight columns per int32 word, column 8j + AWQ_ORDER[i] in nibble i."""
    r, n = values.shape
    grouped = values.to(torch.int64).reshape(r, n // 8, 8)
    word = torch.zeros(r, n // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        word |= grouped[..., column] << (4 * nibble)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # two's complement


def awq_module(codes: Int4Codes) -> dict[str, torch.Tensor]:
    """The AWQ tensors of one module (suffix -> tensor) holding exactly `codes`' W."""
    zeros = codes.zeros
    if zeros is None:
        zeros = torch.full_like(codes.scales, 8, dtype=torch.uint8)
    return {
        "qweight": _pack_columns(codes.codes.T.contiguous()),  # [K, N / 8]
        "qzeros": _pack_columns(zeros),  # [G, N / 8]
        "scales": codes.scales.half().contiguous(),  # [G, N]
    }


def awq_config(group_size: int, modules_to_not_convert: list[str]) -> dict[str, object]:
    """The `quantization_config` AutoAWQ writes for 4-bit GEMM with zero points."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }
