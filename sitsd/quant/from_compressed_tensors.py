"""compressed-tensors checkpoints (llm-compressor's `pack-quantized` W4A16) -> `Int4Weight`.

A pack-quantized linear module holds, for W `[N, K]` and G = K / group_size groups:

    weight_packed      [N, K / 8] int32   packed along K: element 8j + i of a row in bits 4i..4i+3
                                          of word j, stored as the signed code plus 8 (0..15)
    weight_scale       [N, G]             bfloat16 or float16
    weight_zero_point  [N / 8, G] int32   asymmetric only: signed zero points plus 8, packed
                                          along N (nibble i = row 8w + i)
    weight_g_idx       [K] int32          optional (actorder "group" of older versions)
    weight_shape       [2] int            (N, K)

and its dequantization is `W = (q - z) * s` on the signed values (compressed-tensors'
`unpack_from_int32` then `dequantize`, computed in the scale's dtype). The packing along K is the
layout's own, so `weight_packed` is taken as it is (or its columns permuted for act-order);
`(q_stored - 8) - (z_stored - 8) = q_stored - z_stored`, so symmetric weights have no offsets and
asymmetric ones float32 offsets `-z_stored * s`, exact for the same reason as AWQ's
(`sitsd.quant.from_awq`). Runs on the tensors' device.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_layout import num_groups, pack_int4, unpack_int4
from sitsd.quant.checks import (
    HALF_DTYPES,
    act_order_perm,
    check_scales,
    check_tensor,
    unpack_nibbles,
)
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight

__all__ = ["int4_from_compressed_tensors"]


def int4_from_compressed_tensors(
    weight_packed: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    weight_shape: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    group_size: int,
    symmetric: bool,
    name: str,
) -> Int4Weight:
    """The `Int4Weight` of one pack-quantized linear module named `name`, W of `shape` (N, K).

    Raises:
        QuantFormatError: Tensors missing, or shapes, dtypes or scales that do not fit.
    """
    n, k = shape
    if k % 8 or k % group_size:
        raise QuantFormatError(
            f"{name}: K = {k} is not a multiple of 8 and of the group size {group_size}"
        )
    if weight_shape is not None and [int(v) for v in weight_shape.tolist()] != [n, k]:
        raise QuantFormatError(
            f"{name}.weight_shape is {weight_shape.tolist()}, expected [{n}, {k}]"
        )
    groups = num_groups(k, group_size)
    packed_name, scale_name = f"{name}.weight_packed", f"{name}.weight_scale"
    weight_packed = check_tensor(
        packed_name, weight_packed, (n, k // 8), (torch.int32,), "[N, K / 8]"
    )
    weight_scale = check_tensor(scale_name, weight_scale, (n, groups), HALF_DTYPES, "[N, G]")
    check_scales(f"{name}.weight_scale", weight_scale)
    scales = weight_scale.T.contiguous()  # [G, N]
    offsets = None
    if not symmetric:
        zp_name = f"{name}.weight_zero_point"
        zp = check_tensor(
            zp_name, weight_zero_point, (-(-n // 8), groups), (torch.int32,), "[N / 8, G]"
        )
        zeros = unpack_nibbles(zp.T.contiguous())[:, :n]  # [G, N], stored (+8)
        offsets = -(zeros.float() * scales.float())
    perm = act_order_perm(weight_g_idx, k, group_size, f"{name}.weight_g_idx")
    qweight = weight_packed.contiguous()
    if perm is not None:
        qweight = pack_int4(unpack_int4(qweight)[:, perm.long()])
    return Int4Weight(qweight, scales, offsets, group_size, perm)
