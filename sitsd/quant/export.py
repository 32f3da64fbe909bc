"""INT4 codes -> a Hugging Face checkpoint's tensors and `quantization_config`, in three formats.

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
    compressed-tensors  llm-compressor's `pack-quantized` W4A16: `weight_packed [N, K / 8]`
                        int32, `weight_scale [N, G]` float16, `weight_zero_point [N / 8, G]`
                        int32 (asymmetric), `weight_shape [2]`, `weight_g_idx [K]` (codes with
                        a permutation: older versions' `actorder: group`); act-order without
                        one (GPTQ's static groups) is `actorder: weight`, what the current
                        library writes and validates

Symmetric codes get the zero point 8 where a format stores one per group. Codes with an
act-order permutation go to the formats with a `g_idx` (gptq, compressed-tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from sitsd.kernels.quant_layout import pack_int4
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_awq import AWQ_ORDER
from sitsd.quant.rtn import Int4Codes

__all__ = [
    "FORMATS",
    "awq_config",
    "awq_module",
    "compressed_tensors_config",
    "compressed_tensors_module",
    "export_modules",
    "gptq_config",
    "gptq_module",
]

FORMATS = ("awq", "gptq", "compressed-tensors")


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
        raise QuantFormatError("the AWQ layout has no g_idx: act-order codes need the gptq or "
                               "compressed-tensors format")  # fmt: skip
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


def compressed_tensors_module(codes: Int4Codes) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one module holding exactly `codes`' W (stored codes are
    the signed codes plus 8: the unsigned codes themselves)."""
    natural = codes.natural_codes()
    n, k = natural.shape
    out = {
        "weight_packed": pack_int4(natural),  # [N, K / 8]
        "weight_scale": codes.scales.T.half().contiguous(),  # [N, G]
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if codes.zeros is not None:
        rows = -(-n // 8) * 8  # zero points packed along N, padded to whole words
        padded = torch.zeros(rows, codes.zeros.shape[0], dtype=torch.uint8)
        padded[:n] = codes.zeros.T
        out["weight_zero_point"] = _words(padded.T.contiguous()).T.contiguous()  # [N / 8, G]
    if codes.perm is not None:
        out["weight_g_idx"] = codes.group_index()
    return out


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


def compressed_tensors_config(
    group_size: int, ignore: list[str], *, actorder: str | None, symmetric: bool
) -> dict[str, object]:
    """The `quantization_config` llm-compressor writes for W4A16 `pack-quantized` (`actorder`:
    None, "weight" or "group", the last with `weight_g_idx`)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group_size,
        "actorder": actorder,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", *ignore],
        "kv_cache_scheme": None,
    }


def export_modules(
    fmt: str,
    modules: Mapping[str, Int4Codes],
    kept: list[str],
    *,
    act_order: bool = False,
    damp: float = 0.01,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Every quantized module's tensors (`<module>.<suffix>`) in format `fmt`, and the
    `quantization_config` that describes them (the modules in `kept` stay 16-bit; `act_order`:
    the codes were made in act-order, with or without a permutation, and `damp` their GPTQ
    damping, for the config).

    Raises:
        QuantFormatError: An unknown format, or act-order codes for AWQ.
    """
    if fmt not in FORMATS:
        raise QuantFormatError(f"format {fmt!r}: sitsd quantize writes {', '.join(FORMATS)}")
    every = list(modules.values())
    group_size = every[0].group_size if every else 128
    permuted = any(c.perm is not None for c in every)
    symmetric = bool(every) and all(c.zeros is None for c in every)
    minus_one = not any(bool((_zeros(c) == 0).any()) for c in every)
    tensors: dict[str, torch.Tensor] = {}
    for module, codes in modules.items():
        if fmt == "awq":
            packed = awq_module(codes)
        elif fmt == "gptq":
            packed = gptq_module(codes, minus_one=minus_one)
        else:
            packed = compressed_tensors_module(codes)
        tensors |= {f"{module}.{suffix}": t for suffix, t in packed.items()}
    if fmt == "awq":
        return tensors, awq_config(group_size, kept)
    if fmt == "gptq":
        return tensors, gptq_config(group_size, kept, act_order=act_order, symmetric=symmetric,
                                    damp=damp, minus_one=minus_one)  # fmt: skip
    actorder = ("group" if permuted else "weight") if act_order else None
    return tensors, compressed_tensors_config(group_size, kept, actorder=actorder,
                                              symmetric=symmetric)  # fmt: skip
