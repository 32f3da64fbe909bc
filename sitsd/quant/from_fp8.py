"""FP8 checkpoints (`quant_method: fp8` / `fbgemm_fp8`, compressed-tensors `float-quantized`) ->
`Fp8Weight`.

An FP8 linear module holds `weight [N, K]` float8_e4m3fn and `weight_scale`: one value (per
tensor: shape `[]`, `[1]` or `[1, 1]`) or one per output row (per channel: `[N]` or `[N, 1]`), in
float32 (or a 16-bit float, read exactly); its dequantization is `W = weight * weight_scale` in
float32 (vLLM's `fp8` loader, compressed-tensors' `dequantize`). The codes are kept as they are and
the scale becomes `[N]` float32 (a per-tensor one repeated), so the layout's W is the format's
bit for bit. A static `input_scale` is not needed: activations are quantized per token at run
time. Runs on the tensors' device.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_layout import FP8_DTYPE
from sitsd.quant.checks import check_scales, check_tensor
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Fp8Weight

__all__ = ["fp8_from_checkpoint"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fp8_from_checkpoint(
    weight: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    *,
    shape: tuple[int, int],
    name: str,
) -> Fp8Weight:
    """The `Fp8Weight` of one FP8 linear module named `name` with W of `shape` (N, K).

    Raises:
        QuantFormatError: Tensors missing, shapes or dtypes that do not fit, NaN codes, or
            scales that are not finite and positive.
    """
    n, _ = shape
    weight = check_tensor(f"{name}.weight", weight, shape, (FP8_DTYPE,), "[N, K]")
    if weight_scale is None:
        raise QuantFormatError(f"{name}.weight_scale is missing")
    if weight_scale.numel() not in (1, n) or weight_scale.dim() > 2:
        raise QuantFormatError(
            f"{name}.weight_scale has shape {tuple(weight_scale.shape)}: expected one scale per "
            f"tensor or one per output row ([{n}] or [{n}, 1])"
        )
    if weight_scale.dtype not in _SCALE_DTYPES:
        raise QuantFormatError(f"{name}.weight_scale has dtype {weight_scale.dtype}, not a float")
    check_scales(f"{name}.weight_scale", weight_scale)
    if bool((weight_scale < 0).any()):
        raise QuantFormatError(f"{name}.weight_scale holds negative scales")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes
        raise QuantFormatError(f"{name}.weight holds NaN codes")
    scale = weight_scale.float().reshape(-1).expand(n).contiguous()
    return Fp8Weight(weight.contiguous(), scale)
