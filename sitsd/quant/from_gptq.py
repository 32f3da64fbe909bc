"""GPTQ checkpoints (AutoGPTQ / GPTQModel packing, `sym` true or false, act-order) -> `Int4Weight`.

A GPTQ linear module holds, for W `[N, K]` and G = ceil(K / group_size) groups:

    qweight  [K / 8, N] int32   packed along K: word r of column n holds rows 8r..8r+7, row
                                8r + i in nibble i
    qzeros   [G, N / 8] int32   zero points packed along N, nibble i = column 8j + i; the
                                original format ("gptq") stores each one minus one, "gptq_v2" not
    scales   [G, N] float16
    g_idx    [K] int32          optional: the group of each input channel (act-order,
                                `desc_act: true`, assigns groups in an order of its own)

and its dequantization is `W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]` (GPTQModel's
`dequantize_weight`, vLLM's `gptq` loader), with `z = stored + 1` in the original format (so a
stored 15 reads 16: the format's known quirk, kept). Here the input channels are sorted by group
when `g_idx` is not already `k // group_size` (the layout's `perm`), the codes go to the layout's
rows along K, and the zero points become float32 offsets `-z * s`, exact like AWQ's
(`sitsd.quant.from_awq`); with `sym: true` every zero point must be 8 and the layout has no
offsets. Runs on the tensors' device.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_layout import num_groups, pack_int4
from sitsd.quant.checks import (
    HALF_DTYPES,
    act_order_perm,
    check_scales,
    check_tensor,
    unpack_nibbles,
)
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight

__all__ = ["int4_from_gptq"]


def int4_from_gptq(
    qweight: torch.Tensor | None,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    group_size: int,
    symmetric: bool,
    zeros_minus_one: bool,
    name: str,
) -> Int4Weight:
    """The `Int4Weight` of one GPTQ linear module named `name` with W of `shape` (N, K).

    Raises:
        QuantFormatError: Tensors missing, shapes, dtypes or scales that do not fit, zero points
            that are not 8 under `sym: true`, or a `g_idx` whose groups cannot be made contiguous.
    """
    n, k = shape
    if n % 8 or k % 8:
        raise QuantFormatError(f"{name}: GPTQ packs N = {n} and K = {k} in words of 8")
    groups = num_groups(k, group_size)
    qweight = check_tensor(f"{name}.qweight", qweight, (k // 8, n), (torch.int32,), "[K / 8, N]")
    qzeros = check_tensor(f"{name}.qzeros", qzeros, (groups, n // 8), (torch.int32,), "[G, N / 8]")
    scales = check_tensor(f"{name}.scales", scales, (groups, n), HALF_DTYPES, "[G, N]")
    check_scales(f"{name}.scales", scales)
    perm = act_order_perm(g_idx, k, group_size, f"{name}.g_idx")
    codes = unpack_nibbles(qweight.T.contiguous()).T  # [K, N]
    zeros = unpack_nibbles(qzeros).to(torch.int32) + int(zeros_minus_one)  # [G, N]
    if symmetric:
        if not bool((zeros == 8).all()):
            stored = "7 (stored minus one)" if zeros_minus_one else "8"
            raise QuantFormatError(
                f"{name}.qzeros: with sym: true every zero point must be {stored}"
            )
        offsets = None
    else:
        offsets = -(zeros.float() * scales.float())
    codes = codes.T  # [N, K]
    if perm is not None:
        codes = codes[:, perm.long()]
    return Int4Weight(pack_int4(codes), scales.contiguous(), offsets, group_size, perm)
