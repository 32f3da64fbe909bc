"""INT4 codes -> a Hugging Face checkpoint's tensors and `quantization_config`, in two formats.

Each `*_module(codes)` packs one linear module's `Int4Codes` (`sitsd.quant.rtn`) as its format
stores it, and each `*_config` is the `quantization_config` its producing tool writes, so what
`sitsd quantize` writes loads in sitsd (the `sitsd.quant.from_*` modules document each packing
and read it back) and in the engines that read the format:

    awq                 AutoAWQ's GEMM layout: `qweight [K, N / 8]`, `qzeros [G, N / 8]` int32
                        (nibble order `AWQ_ORDER`), `scales [G, N]` float16; no act-order
    gptq                AutoGPTQ / GPTQModel: `qweight [K / 8, N]`, `qzeros [G, N / 8]` int32,
                        `scales [G, N]` float16, `g_idx [K]` int32; zero points stored minus
                        one ("gptq", what other engines read) unless a zero point is 0, which
                        that cannot hold ("gptq_v2" then)

Symmetric codes get the zero point 8 where a format stores one per group. Codes with an
act-order permutation go to the formats with a `g_idx` (gptq).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_awq import AWQ_ORDER
from sitsd.quant.rtn import Int4Codes

__all__ = [
    "FORMATS",
    "awq_config",
    "awq_module",
    "export_modules",
    "gptq_config",
    "gptq_module",
]

FORMATS = ("awq", "gptq")


def _words(values: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
    """`[R, C]` codes 0..15 -> `[R, C / 8]` int32: eight columns per word, column 8j + order[i]
    (8j + i without `order`) in nibble i."""
    r, c = values.shape
    grouped = values.to(torch.int64).reshape(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.int64)
    for nibble, column in enumerate(order or range(8)):
        word |= grouped[..., column] << (4 * nibble)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # two's complement


def _zeros(codes: Int4Codes) -> torch.Tensor:  # [G, N] uint8
    if codes.zeros is None:
        return torch.full_like(codes.scales, 8, dtype=torch.uint8)
    return codes.zeros


def awq_module(codes: Int4Codes) -> dict[str, torch.Tensor]:
    """The AWQ tensors of one module (suffix -> tensor) holding exactly `codes`' W."""
    if codes.perm is not None:
        raise QuantFormatError("the AWQ layout has no g_idx: act-order codes need the gptq "
                               "format")  # fmt: skip
    return {
        "qweight": _words(codes.codes.T.contiguous(), AWQ_ORDER),  # [K, N / 8]
        "qzeros": _words(_zeros(codes), AWQ_ORDER),  # [G, N / 8]
        "scales": codes.scales.half().contiguous(),  # [G, N]
    }


def gptq_module(codes: Int4Codes, *, minus_one: bool = True) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one module holding exactly `codes`' W; `minus_one`: the "gptq"
    format's zero points (each stored minus one; a zero point of 0 cannot be)."""
    zeros = _zeros(codes).to(torch.int64)
    if minus_one:
        if bool((zeros == 0).any()):
            raise QuantFormatError("a zero point of 0 does not fit the 'gptq' format: gptq_v2")
        zeros = zeros - 1
    return {
        "qweight": _words(codes.natural_codes().contiguous()).T.contiguous(),  # [K / 8, N]
        "qzeros": _words(zeros),  # [G, N / 8]
        "scales": codes.scales.half().contiguous(),  # [G, N]
        "g_idx": codes.group_index(),  # [K]
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


def gptq_config(
    group_size: int,
    modules_to_not_convert: list[str],
    *,
    act_order: bool,
    symmetric: bool,
    damp: float,
    minus_one: bool,
) -> dict[str, object]:
    """The `quantization_config` GPTQModel writes for 4 bits (`damp`: its `damp_percent`)."""
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": symmetric,
        "damp_percent": damp,
        "true_sequential": True,
        "static_groups": False,
        "lm_head": False,
        "checkpoint_format": "gptq" if minus_one else "gptq_v2",
        "modules_to_not_convert": modules_to_not_convert,
    }


def export_modules(
    fmt: str,
    modules: Mapping[str, Int4Codes],
    kept: list[str],
    *,
    damp: float = 0.01,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Every quantized module's tensors (`<module>.<suffix>`) in format `fmt`, and the
    `quantization_config` that describes them (the modules in `kept` stay 16-bit).

    Raises:
        QuantFormatError: An unknown format, or act-order codes for AWQ.
    """
    if fmt not in FORMATS:
        raise QuantFormatError(f"format {fmt!r}: sitsd quantize writes {', '.join(FORMATS)}")
    every = list(modules.values())
    group_size = every[0].group_size if every else 128
    act_order = any(c.perm is not None for c in every)
    symmetric = bool(every) and all(c.zeros is None for c in every)
    minus_one = not any(bool((_zeros(c) == 0).any()) for c in every)
    tensors: dict[str, torch.Tensor] = {}
    for module, codes in modules.items():
        if fmt == "awq":
            packed = awq_module(codes)
        else:
            packed = gptq_module(codes, minus_one=minus_one)
        tensors |= {f"{module}.{suffix}": t for suffix, t in packed.items()}
    if fmt == "awq":
        return tensors, awq_config(group_size, kept)
    return tensors, gptq_config(group_size, kept, act_order=act_order, symmetric=symmetric,
                                damp=damp, minus_one=minus_one)  # fmt: skip
