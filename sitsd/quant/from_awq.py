"""AWQ checkpoints (AutoAWQ's GEMM packing) -> `Int4Weight`.

An AWQ linear module holds, for W `[N, K]` and G = K / group_size groups:

    qweight  [K, N / 8] int32   packed along N: word j of row k holds columns 8j..8j+7,
                                column 8j + AWQ_ORDER[i] in nibble i (bits 4i..4i+3), with
                                AWQ_ORDER = 0 2 4 6 1 3 5 7
    qzeros   [G, N / 8] int32   the zero points, packed the same way
    scales   [G, N] float16

and its dequantization is `W[n, k] = (q[k, n] - z[g, n]) * s[g, n]` (AutoAWQ's
`dequantize_gemm`, vLLM's `awq` loader). Here the codes go to the layout's rows along K, the
scales stay `[G, N]`, and the zero points become float32 offsets `-z * s`: with a 16-bit scale the
products `q * s` and `z * s` and their sum are exact in float32 (at most 16 significant bits), so
the layout's float32 W is exactly `(q - z) * s`, and rounding it to float16 gives AutoAWQ's own
float16 dequantization bit for bit. Runs on the tensors' device.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_layout import num_groups, pack_int4
from sitsd.quant.checks import HALF_DTYPES, check_scales, check_tensor, unpack_nibbles
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight

__all__ = ["AWQ_ORDER", "int4_from_awq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(8))  # 0 4 1 5 2 6 3 7


def int4_from_awq(
    qweight: torch.Tensor | None,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    group_size: int,
    name: str,
) -> Int4Weight:
    """The `Int4Weight` of one AWQ linear module named `name` with W of `shape` (N, K).

    Raises:
        QuantFormatError: Tensors missing, or shapes, dtypes or scales that do not fit.
    """
    n, k = shape
    if n % 8 or k % group_size:
        raise QuantFormatError(
            f"{name}: AWQ packs N = {n} in words of 8 and K = {k} in groups of {group_size}: "
            "one of them does not divide"
        )
    groups = num_groups(k, group_size)
    qweight = check_tensor(f"{name}.qweight", qweight, (k, n // 8), (torch.int32,), "[K, N / 8]")
    qzeros = check_tensor(f"{name}.qzeros", qzeros, (groups, n // 8), (torch.int32,), "[G, N / 8]")
    scales = check_tensor(f"{name}.scales", scales, (groups, n), HALF_DTYPES, "[G, N]")
    check_scales(f"{name}.scales", scales)
    codes = unpack_nibbles(qweight, _NIBBLE_OF_COLUMN)  # [K, N]
    zeros = unpack_nibbles(qzeros, _NIBBLE_OF_COLUMN)  # [G, N]
    offsets = -(zeros.float() * scales.float())
    return Int4Weight(pack_int4(codes.T), scales.contiguous(), offsets, group_size)
